#include "quantize.h"

#include "../format/quantize_group.h"
#include "../format/rotation.h"

namespace fmkv::cpu {

void codebook_table16(int32_t bits, float* mag16) {
  const int nm = magnitude_count(bits);
  for (int i = 0; i < 16; ++i) mag16[i] = codebook_mag(bits, i & (nm - 1));
}

void make_quant_params(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer, QuantParams* qp) {
  qp->d = d;
  qp->bits = bits;
  qp->rule = rule;
  uint64_t sw[FMKV_MAX_SIGN_WORDS] = {0, 0, 0, 0};
  rotation_sign_words(seed, layer, d, sw);
  for (int32_t i = 0; i < 256; ++i) qp->sign_xor[i] = i < d && sign_negative(sw, i) ? 0x80000000u : 0u;
  for (int i = 0; i < 8; ++i) qp->thr[i] = i + 1 < magnitude_count(bits) ? codebook_threshold(bits, i) : 0.0f;
  codebook_table16(bits, qp->mag16);
  qp->norm = rotation_norm(d);
}

}  // namespace fmkv::cpu
