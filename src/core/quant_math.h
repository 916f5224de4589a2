// Per-group quantization arithmetic of the format (v1 and v2 alike) (FORMAT.md "Scale" and "Codes"), scalar form.
// Every operation is float32 with round-to-nearest and no fused multiply-add; sums over a group use
// the fixed pairwise tree of tree_sum32 (the order a 32-lane xor-shuffle reduction produces).
// Backends that vectorise must reproduce exactly these roundings.
#pragma once
#include <stdint.h>

#include "fmkv/format.h"
#include "half.h"

#define FMKV_TABLE static const
#include "codebooks.inc"
#undef FMKV_TABLE

namespace fmkv {

// Sum of v[0..31]: for step 16, 8, 4, 2, 1: v[j] = v[j] + v[j + step] for j < step.
// Destroys v. (Lane j of a xor-shuffle butterfly computes the same value by commutativity.)
FMKV_HD float tree_sum32(float* v) {
  for (int step = 16; step >= 1; step >>= 1)
    for (int j = 0; j < step; ++j) v[j] = v[j] + v[j + step];
  return v[0];
}

FMKV_HD int magnitude_count(int bits) { return 1 << (bits - 1); }

// Positive level m of a b-bit codebook, as float (exactly an fp16 value).
inline float codebook_mag(int bits, int m) {
  return f16_to_f32(fmkv_codebook_mag_f16[FMKV_CODEBOOK_OFFSET(bits) + m]);
}

// Decision threshold between magnitudes m and m+1: their midpoint (exact in float32).
inline float codebook_threshold(int bits, int m) {
  return (codebook_mag(bits, m) + codebook_mag(bits, m + 1)) * 0.5f;
}

// Code of a normalised value u: sign bit (u < 0; so -0 and +0 are positive) at bit b-1, magnitude
// m = number of thresholds strictly below |u| (a tie goes to the smaller magnitude).
inline uint32_t encode_value(float u, int bits) {
  uint32_t sign = u < 0.0f ? 1u : 0u;
  float a = u < 0.0f ? -u : u;
  uint32_t m = 0;
  for (int i = 0; i + 1 < magnitude_count(bits); ++i) m += a > codebook_threshold(bits, i) ? 1u : 0u;
  return (sign << (bits - 1)) | m;
}

inline float decode_level(uint32_t code, int bits) {
  float v = codebook_mag(bits, (int)(code & ((1u << (bits - 1)) - 1u)));
  return (code >> (bits - 1)) & 1u ? -v : v;
}

// fp16 scale with saturation: a value beyond the fp16 range becomes 65504 (never inf).
FMKV_HD uint16_t scale_to_f16(float s) {
  uint16_t h = f32_to_f16(s);
  return (h & 0x7fffu) >= 0x7c00u ? (uint16_t)0x7bffu : h;
}

// Quantize one group of 32 rotated values y (float32): codes[32] and the fp16 scale.
inline uint16_t quantize_group(const float* y, int bits, int scale_rule, uint8_t* codes) {
  float t[32];
  for (int j = 0; j < 32; ++j) t[j] = y[j] * y[j];
  float rms = __builtin_sqrtf(tree_sum32(t) / 32.0f);
  uint16_t s0 = scale_to_f16(rms);
  float s0f = f16_to_f32(s0);
  if (s0f == 0.0f) {
    for (int j = 0; j < 32; ++j) codes[j] = 0;
    return 0;
  }
  for (int j = 0; j < 32; ++j) codes[j] = (uint8_t)encode_value(y[j] / s0f, bits);
  if (scale_rule == FMKV_SCALE_RMS) return s0;
  float num[32], den[32];
  for (int j = 0; j < 32; ++j) {
    float l = decode_level(codes[j], bits);
    num[j] = y[j] * l;
    den[j] = l * l;
  }
  return scale_to_f16(tree_sum32(num) / tree_sum32(den));
}

}  // namespace fmkv
