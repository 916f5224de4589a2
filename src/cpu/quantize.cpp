#include <cmath>

#include "quantize.h"

#include "../format/quantize_group.h"
#include "../format/rotation.h"

namespace fmkv::cpu {

void codebook_table16(int32_t bits, int table, float* mag16) {
  const int nm = magnitude_count(bits);
  for (int i = 0; i < 16; ++i) mag16[i] = table_mag(table, bits, i & (nm - 1));
}

void signed_table16(int table, float* mag16) {
  for (int i = 0; i < 16; ++i) mag16[i] = decode_level_table((uint32_t)(i & 7), 3, table);
}

void signed_table16_4bit(int table, float* lev16) {
  for (int i = 0; i < 16; ++i) lev16[i] = decode_level_table((uint32_t)i, 4, table);
}

void signed_int_table16(int table, int8_t* lev16, float* step) {
  *step = f16_to_f32(codebook_step_f16(table));
  for (int i = 0; i < 16; ++i) lev16[i] = (int8_t)std::lrint(decode_level_table((uint32_t)(i & 7), 3, table) / *step);
}

void make_quant_params(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer, int32_t format_version,
                       int is_v, int32_t scale_group, QuantParams* qp) {
  const int32_t version = fmkv_resolved_format_version(format_version);
  const int table = codebook_table(version, bits, is_v);
  qp->d = d;
  qp->bits = bits;
  qp->rule = rule;
  qp->tiled = fmkv_tiled_codes(version, bits);
  qp->is_v = is_v;
  qp->ssh = fmkv_scale_shift(scale_group);
  uint64_t sw[FMKV_MAX_SIGN_WORDS] = {0, 0, 0, 0};
  rotation_sign_words(seed, layer, d, sw);
  for (int32_t i = 0; i < 256; ++i) qp->sign_xor[i] = i < d && sign_negative(sw, i) ? 0x80000000u : 0u;
  for (int i = 0; i < 15; ++i) qp->thr[i] = i + 1 < magnitude_count(bits) ? table_threshold(table, bits, i) : 0.0f;
  codebook_table16(bits, table, qp->mag16);
  qp->norm = rotation_norm(d);
}

}  // namespace fmkv::cpu
