#include "quantize.h"

#include <cmath>

#include "../core/quant_math.h"
#include "../core/rotation.h"

namespace fmkv::ref {
namespace {
bool negative(const uint64_t* w, int32_t i) { return (w[i >> 6] >> (i & 63)) & 1u; }

template <typename T>
void fwht(T* v, int32_t d) {
  for (int32_t h = 1; h < d; h <<= 1)
    for (int32_t i = 0; i < d; i += 2 * h)
      for (int32_t j = i; j < i + h; ++j) {
        T a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
}
}  // namespace

std::vector<uint64_t> sign_words(uint64_t seed, int32_t layer, int32_t d) {
  std::vector<uint64_t> w(d / 64);
  rotation_sign_words(seed, layer, d, w.data());
  return w;
}

void rotate(const float* x, int32_t d, const uint64_t* sw, float* y) {
  for (int32_t i = 0; i < d; ++i) y[i] = negative(sw, i) ? -x[i] : x[i];
  fwht(y, d);
  const float norm = rotation_norm(d);
  for (int32_t i = 0; i < d; ++i) y[i] = y[i] * norm;
}

void rotate_f64(const double* x, int32_t d, const uint64_t* sw, double* y) {
  for (int32_t i = 0; i < d; ++i) y[i] = negative(sw, i) ? -x[i] : x[i];
  fwht(y, d);
  for (int32_t i = 0; i < d; ++i) y[i] /= std::sqrt((double)d);
}

void unrotate_f64(const double* y, int32_t d, const uint64_t* sw, double* x) {
  for (int32_t i = 0; i < d; ++i) x[i] = y[i];
  fwht(x, d);
  for (int32_t i = 0; i < d; ++i) x[i] = (negative(sw, i) ? -x[i] : x[i]) / std::sqrt((double)d);
}

void quantize_vector(const uint16_t* x_f16, int32_t d, int32_t bits, int32_t scale_rule,
                     const uint64_t* sw, uint8_t* codes, uint16_t* scales) {
  std::vector<float> x(d), y(d);
  for (int32_t i = 0; i < d; ++i) x[i] = f16_to_f32(x_f16[i]);
  rotate(x.data(), d, sw, y.data());
  for (int32_t g = 0; g < d / 32; ++g)
    scales[g] = quantize_group(&y[g * 32], bits, scale_rule, &codes[g * 32]);
}

void pack_group(const uint8_t* codes, int32_t bits, uint32_t* words, int64_t stride) {
  uint32_t w[4] = {0, 0, 0, 0};
  for (int32_t j = 0; j < 32; ++j) {
    uint32_t c = codes[j], sign = c >> (bits - 1), m = c & ((1u << (bits - 1)) - 1u);
    if (bits == 4) {  // nibble words: the whole code
      w[fmkv_nibble_word(j)] |= c << fmkv_nibble_shift(j);
      continue;
    }
    w[bits - 1] |= sign << j;  // sign plane is the last word
    if (bits == 2) w[0] |= m << j;
    if (bits == 3) w[fmkv_field_word(j)] |= m << fmkv_field_shift(j);
  }
  for (int32_t k = 0; k < bits; ++k) words[k * stride] = w[k];
}

void unpack_group(const uint32_t* words, int64_t stride, int32_t bits, uint8_t* codes) {
  for (int32_t j = 0; j < 32; ++j) {
    if (bits == 4) {
      codes[j] = (uint8_t)((words[fmkv_nibble_word(j) * stride] >> fmkv_nibble_shift(j)) & 15u);
      continue;
    }
    uint32_t sign = (words[(bits - 1) * stride] >> j) & 1u, m = 0;
    if (bits == 2) m = (words[0] >> j) & 1u;
    if (bits == 3) m = (words[fmkv_field_word(j) * stride] >> fmkv_field_shift(j)) & 3u;
    codes[j] = (uint8_t)((sign << (bits - 1)) | m);
  }
}

void dequantize_vector(const uint8_t* codes, const uint16_t* scales, int32_t d, int32_t bits,
                       double* y) {
  for (int32_t i = 0; i < d; ++i)
    y[i] = (double)decode_level(codes[i], bits) * (double)f16_to_f32(scales[i / 32]);
}

}  // namespace fmkv::ref
