#include "quantize.h"

#include "../core/quant_math.h"
#include "../core/rotation.h"

namespace fmkv::cpu {
namespace {
bool negative(const uint64_t* w, int32_t i) { return (w[i >> 6] >> (i & 63)) & 1u; }

void fwht(float* v, int32_t d) {
  for (int32_t h = 1; h < d; h <<= 1)
    for (int32_t i = 0; i < d; i += 2 * h)
      for (int32_t j = i; j < i + h; ++j) {
        float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
}
}  // namespace

void codebook_table16(int32_t bits, float* mag16) {
  const int nm = magnitude_count(bits);
  for (int i = 0; i < 16; ++i) mag16[i] = codebook_mag(bits, i & (nm - 1));
}

void make_quant_params(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer, QuantParams* qp) {
  qp->d = d;
  qp->bits = bits;
  qp->rule = rule;
  uint64_t sw[4] = {0, 0, 0, 0};
  rotation_sign_words(seed, layer, d, sw);
  for (int32_t i = 0; i < 256; ++i) qp->sign_xor[i] = i < d && negative(sw, i) ? 0x80000000u : 0u;
  for (int i = 0; i < 8; ++i) qp->thr[i] = i + 1 < magnitude_count(bits) ? codebook_threshold(bits, i) : 0.0f;
  codebook_table16(bits, qp->mag16);
  qp->norm = rotation_norm(d);
}

void rotate_f32(const float* x, int32_t d, const uint64_t* sw, float* y) {
  for (int32_t i = 0; i < d; ++i) y[i] = negative(sw, i) ? -x[i] : x[i];
  fwht(y, d);
  const float norm = rotation_norm(d);
  for (int32_t i = 0; i < d; ++i) y[i] = y[i] * norm;
}

void unrotate_f32(const float* y, int32_t d, const uint64_t* sw, float* x) {
  for (int32_t i = 0; i < d; ++i) x[i] = y[i];
  fwht(x, d);
  const float norm = rotation_norm(d);
  for (int32_t i = 0; i < d; ++i) x[i] = (negative(sw, i) ? -x[i] : x[i]) * norm;
}

}  // namespace fmkv::cpu
