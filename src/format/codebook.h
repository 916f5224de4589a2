// The codebooks of the format core (FORMAT.md "Codebooks" and "Codes"): the generated fp16 levels
// (codebooks.inc, written by tools/gen_codebooks.cpp, never copied), decision thresholds, and one
// code <-> one value.
// Portable: host C++, CUDA host and device (each reads its own copy of the generated table: host
// memory, or constant memory on the device), MSL (constant address space, levels only: no double).
#ifndef FMKV_FORMAT_CODEBOOK_H
#define FMKV_FORMAT_CODEBOOK_H
#include "numbers.h"
#include "portability.h"

namespace fmkv {

#if defined(__METAL_VERSION__)
#define FMKV_CODEBOOK_LEVELS_ONLY 1  // the table of levels; the double tables are host documentation
#define FMKV_TABLE constant
#include "codebooks.inc"
#undef FMKV_TABLE
#elif !defined(__CUDACC_RTC__)  // (NVRTC compiles device code only: the constant-memory copy below)
#define FMKV_TABLE static const
#include "codebooks.inc"
#undef FMKV_TABLE
#endif
#if defined(__CUDACC__)
namespace dev {  // the same generated levels in constant memory, for device code
#define FMKV_TABLE static __constant__
#pragma push_macro("FMKV_CODEBOOK_LEVELS_ONLY")
#define FMKV_CODEBOOK_LEVELS_ONLY 1
#include "codebooks.inc"
#pragma pop_macro("FMKV_CODEBOOK_LEVELS_ONLY")
#undef FMKV_TABLE
}  // namespace dev
#endif

// Positive levels of a b-bit codebook: 2^(b-1) (the magnitude index of a code has b-1 bits).
FMKV_HD int magnitude_count(int bits) { return 1 << (bits - 1); }

// fp16 bits of positive level m of a b-bit codebook (these fp16 values ARE the format's levels).
FMKV_HD uint16_t codebook_mag_f16(int bits, int m) {
#if defined(__CUDA_ARCH__) || defined(__CUDACC_RTC__)
  return dev::fmkv_codebook_mag_f16[FMKV_CODEBOOK_OFFSET(bits) + m];
#else
  return fmkv_codebook_mag_f16[FMKV_CODEBOOK_OFFSET(bits) + m];
#endif
}
// Positive level m of a b-bit codebook, as float (exactly an fp16 value).
FMKV_HD float codebook_mag(int bits, int m) { return f16_to_f32(codebook_mag_f16(bits, m)); }

// Decision threshold between magnitudes m and m+1: their midpoint (exact in float32).
FMKV_HD float codebook_threshold(int bits, int m) {
  return (codebook_mag(bits, m) + codebook_mag(bits, m + 1)) * 0.5f;
}

// Code of a normalised value u: sign bit (u < 0; so -0 and +0 are positive) at bit b-1, magnitude
// m = number of thresholds strictly below |u| (a tie goes to the smaller magnitude).
FMKV_HD uint32_t encode_value(float u, int bits) {
  uint32_t sign = u < 0.0f ? 1u : 0u;
  float a = u < 0.0f ? -u : u;
  uint32_t m = 0;
  for (int i = 0; i + 1 < magnitude_count(bits); ++i) m += a > codebook_threshold(bits, i) ? 1u : 0u;
  return (sign << (bits - 1)) | m;
}

// The level a b-bit code stands for (before scaling by its group's scale).
FMKV_HD float decode_level(uint32_t code, int bits) {
  float v = codebook_mag(bits, (int)(code & ((1u << (bits - 1)) - 1u)));
  return (code >> (bits - 1)) & 1u ? -v : v;
}

}  // namespace fmkv

#endif  // FMKV_FORMAT_CODEBOOK_H
