#include "quantize.h"

#include <cmath>

#include "../format/pack.h"
#include "../format/quantize_group.h"
#include "../format/rotation.h"

namespace fmkv::ref {

std::vector<uint64_t> sign_words(uint64_t seed, int32_t layer, int32_t d) {
  std::vector<uint64_t> w(d / 64);
  rotation_sign_words(seed, layer, d, w.data());
  return w;
}

void rotate_f64(const double* x, int32_t d, const uint64_t* sw, double* y) {
  for (int32_t i = 0; i < d; ++i) y[i] = sign_negative(sw, i) ? -x[i] : x[i];
  fwht(y, d);
  for (int32_t i = 0; i < d; ++i) y[i] /= std::sqrt((double)d);
}

void unrotate_f64(const double* y, int32_t d, const uint64_t* sw, double* x) {
  unrotate_exact(y, d, sw, std::sqrt((double)d), x);
}

void quantize_vector(const uint16_t* x_f16, int32_t d, int32_t bits, int32_t scale_rule,
                     const uint64_t* sw, uint8_t* codes, uint16_t* scales, int table, int32_t sg) {
  std::vector<float> x(d), y(d);
  for (int32_t i = 0; i < d; ++i) x[i] = f16_to_f32(x_f16[i]);
  rotate(x.data(), d, sw, y.data());
  const int32_t n = 1 << fmkv_scale_shift(sg);  // code groups per scale
  for (int32_t s = 0; s < fmkv_scales_per_vector(d, sg); ++s)
    scales[s] = quantize_scale_group_table(&y[s * 32 * n], n, bits, table, scale_rule, &codes[s * 32 * n]);
}

void pack_group(const uint8_t* codes, int32_t bits, uint32_t* words, int64_t stride) {
  uint32_t w[FMKV_CODE_BITS_MAX];
  pack_group_words(codes, bits, w);
  for (int32_t k = 0; k < bits; ++k) words[k * stride] = w[k];
}

void unpack_group(const uint32_t* words, int64_t stride, int32_t bits, uint8_t* codes) {
  for (int32_t j = 0; j < 32; ++j) codes[j] = (uint8_t)unpack_code(words, stride, bits, j);
}

void dequantize_vector(const uint8_t* codes, const uint16_t* scales, int32_t d, int32_t bits,
                       double* y, int table, int32_t sg) {
  for (int32_t i = 0; i < d; ++i)
    y[i] = (double)decode_level_table(codes[i], bits, table) * (double)f16_to_f32(scales[i / fmkv_resolved_scale_group(sg)]);
}

void read_token_codes(const uint8_t* section, int32_t format_version, int is_v, int32_t d, int32_t bits, int32_t P,
                      int32_t t, uint8_t* codes, uint16_t* scales, int32_t sg) {
  const int32_t G = fmkv_groups(d);
  const uint16_t* sc = (const uint16_t*)(section + fmkv_scales_offset(d, bits, P));
  for (int32_t s = 0; s < fmkv_scales_per_vector(d, sg); ++s) scales[s] = sc[(int64_t)s * P + t];
  if (fmkv_tiled_codes(format_version, bits)) {
    const uint8_t* block = section + fmkv_tile_block_offset(d, t);
    for (int32_t g = 0; g < G; ++g)
      for (int32_t c = 0; c < 32; ++c) codes[g * 32 + c] = (uint8_t)tile_get_code(block, G, is_v, t & 15, g, c);
    return;
  }
  for (int32_t g = 0; g < G; ++g)
    unpack_group((const uint32_t*)section + fmkv_code_word_index(bits, P, g, 0, t), P, bits, &codes[g * 32]);
}

void write_token_codes(uint8_t* section, int32_t format_version, int is_v, int32_t d, int32_t bits, int32_t P,
                       int32_t t, const uint8_t* codes, const uint16_t* scales, int32_t sg) {
  const int32_t G = fmkv_groups(d);
  uint16_t* sc = (uint16_t*)(section + fmkv_scales_offset(d, bits, P));
  for (int32_t s = 0; s < fmkv_scales_per_vector(d, sg); ++s) sc[(int64_t)s * P + t] = scales[s];
  if (fmkv_tiled_codes(format_version, bits)) {
    uint8_t* block = section + fmkv_tile_block_offset(d, t);
    for (int32_t g = 0; g < G; ++g)
      for (int32_t c = 0; c < 32; ++c) tile_put_code(block, G, is_v, t & 15, g, c, codes[g * 32 + c]);
    return;
  }
  for (int32_t g = 0; g < G; ++g)
    pack_group(&codes[g * 32], bits, (uint32_t*)section + fmkv_code_word_index(bits, P, g, 0, t), P);
}

}  // namespace fmkv::ref
