// Per-group quantization arithmetic of the format core (FORMAT.md "Scale" and "Codes"), scalar form.
// Every operation is float32 with round-to-nearest and no fused multiply-add; sums over a group use
// the fixed pairwise tree of tree_sum32 (the order a 32-lane xor-shuffle reduction produces).
// The scale rules are stated once here (rms_scale, lsq_scale); backends that reduce in parallel
// (CUDA warps, MSL SIMD groups, CPU vectors) feed them the same tree sums.
// Portable: host C++, CUDA host and device, MSL.
#ifndef FMKV_FORMAT_QUANTIZE_GROUP_H
#define FMKV_FORMAT_QUANTIZE_GROUP_H
#include "codebook.h"
#include "numbers.h"
#include "portability.h"

namespace fmkv {

// Sum of v[0..31]: for step 16, 8, 4, 2, 1: v[j] = v[j] + v[j + step] for j < step.
// Destroys v. (Lane j of a xor-shuffle butterfly computes the same value by commutativity.)
FMKV_HD float tree_sum32(FMKV_THREAD float* v) {
  for (int step = 16; step >= 1; step >>= 1)
    for (int j = 0; j < step; ++j) v[j] = v[j] + v[j + step];
  return v[0];
}

// The RMS scale of a scale group of `coords` coordinates (32 or 64; the whole FMKV_SCALE_RMS rule, and the
// first step of FMKV_SCALE_LSQ) from its sum of squared values: fp16 bits, saturated. A zero scale codes the
// group as zeros. A scale group's sums (here and in lsq_scale) are its code groups' tree_sum32 sums added in
// coordinate order (FORMAT.md "Scale").
FMKV_HD uint16_t rms_scale(float sum_of_squares, int coords = FMKV_GROUP_SIZE) {
  return scale_to_f16(sqrt_rn(sum_of_squares / (float)coords));
}

// The least-squares rescale of FMKV_SCALE_LSQ: sums of y_j * level_j and level_j^2 over the scale group coded
// with the RMS scale.
FMKV_HD uint16_t lsq_scale(float sum_y_level, float sum_level_sq) { return scale_to_f16(sum_y_level / sum_level_sq); }

// Quantize one scale group of n code groups (n = 1 or 2: 32 n rotated values y, float32) with codebook `table`
// (codebook_table): codes[32 n] and the group's fp16 scale.
FMKV_HD uint16_t quantize_scale_group_table(FMKV_THREAD const float* y, int n, int bits, int table, int scale_rule,
                                            FMKV_THREAD uint8_t* codes) {
  float t[32], ss = 0.0f;
  for (int h = 0; h < n; ++h) {
    for (int j = 0; j < 32; ++j) t[j] = y[32 * h + j] * y[32 * h + j];
    ss = h == 0 ? tree_sum32(t) : ss + tree_sum32(t);
  }
  const uint16_t s0 = rms_scale(ss, 32 * n);
  const float s0f = f16_to_f32(s0);
  if (s0f == 0.0f) {
    for (int j = 0; j < 32 * n; ++j) codes[j] = 0;
    return 0;
  }
  for (int j = 0; j < 32 * n; ++j) codes[j] = (uint8_t)encode_value_table(y[j] / s0f, bits, table);
  if (scale_rule == FMKV_SCALE_RMS) return s0;
  float num[32], den[32], sn = 0.0f, sd = 0.0f;
  for (int h = 0; h < n; ++h) {
    for (int j = 0; j < 32; ++j) {
      const float l = decode_level_table(codes[32 * h + j], bits, table);
      num[j] = y[32 * h + j] * l;
      den[j] = l * l;
    }
    const float a = tree_sum32(num), b = tree_sum32(den);
    sn = h == 0 ? a : sn + a;
    sd = h == 0 ? b : sd + b;
  }
  return lsq_scale(sn, sd);
}
// One code group with its own scale (scale group 32).
FMKV_HD uint16_t quantize_group_table(FMKV_THREAD const float* y, int bits, int table, int scale_rule,
                                      FMKV_THREAD uint8_t* codes) {
  return quantize_scale_group_table(y, 1, bits, table, scale_rule, codes);
}
// The same with table 0 (format 2's codebooks).
FMKV_HD uint16_t quantize_group(FMKV_THREAD const float* y, int bits, int scale_rule, FMKV_THREAD uint8_t* codes) {
  return quantize_group_table(y, bits, 0, scale_rule, codes);
}

}  // namespace fmkv

#endif  // FMKV_FORMAT_QUANTIZE_GROUP_H
