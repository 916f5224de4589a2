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

// Which codebook a section's codes use (FORMAT.md section 4): table 0, the Lloyd-Max fp16 levels, for every
// width of format 2 and for 2- and 4-bit codes of format 3; table 1 (K) or 2 (V), the integer levels of 3-bit
// codes in format 3 (fmkv_codebook3_int x fmkv_codebook3_step_f16).
FMKV_HD int codebook_table(int32_t format_version, int32_t bits, int is_v) {
  return format_version >= 3 && bits == 3 ? 1 + is_v : 0;
}
// Integer level m of table 1 or 2, and the table's fp16 step.
FMKV_HD int codebook_int_level(int table, int m) {
#if defined(__CUDA_ARCH__) || defined(__CUDACC_RTC__)
  return dev::fmkv_codebook3_int[table - 1][m];
#else
  return fmkv_codebook3_int[table - 1][m];
#endif
}
FMKV_HD uint16_t codebook_step_f16(int table) {
#if defined(__CUDA_ARCH__) || defined(__CUDACC_RTC__)
  return dev::fmkv_codebook3_step_f16[table - 1];
#else
  return fmkv_codebook3_step_f16[table - 1];
#endif
}

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

// Positive level m of table `table` for b-bit codes, as float: table 0's fp16 level, or L[m] x step (an
// integer of <= 8 bits times an fp16 value: exact in float32).
FMKV_HD float table_mag(int table, int bits, int m) {
  if (table == 0) return codebook_mag(bits, m);
  return (float)codebook_int_level(table, m) * f16_to_f32(codebook_step_f16(table));
}

// Decision threshold between magnitudes m and m+1: their midpoint (exact in float32: both levels have at
// most 19 significant bits).
FMKV_HD float table_threshold(int table, int bits, int m) {
  return (table_mag(table, bits, m) + table_mag(table, bits, m + 1)) * 0.5f;
}
FMKV_HD float codebook_threshold(int bits, int m) { return table_threshold(0, bits, m); }

// Code of a normalised value u: sign bit (u < 0; so -0 and +0 are positive) at bit b-1, magnitude
// m = number of thresholds strictly below |u| (a tie goes to the smaller magnitude).
FMKV_HD uint32_t encode_value_table(float u, int bits, int table) {
  uint32_t sign = u < 0.0f ? 1u : 0u;
  float a = u < 0.0f ? -u : u;
  uint32_t m = 0;
  for (int i = 0; i + 1 < magnitude_count(bits); ++i) m += a > table_threshold(table, bits, i) ? 1u : 0u;
  return (sign << (bits - 1)) | m;
}
FMKV_HD uint32_t encode_value(float u, int bits) { return encode_value_table(u, bits, 0); }

// The level a b-bit code stands for (before scaling by its group's scale).
FMKV_HD float decode_level_table(uint32_t code, int bits, int table) {
  float v = table_mag(table, bits, (int)(code & ((1u << (bits - 1)) - 1u)));
  return (code >> (bits - 1)) & 1u ? -v : v;
}
FMKV_HD float decode_level(uint32_t code, int bits) { return decode_level_table(code, bits, 0); }

}  // namespace fmkv

#endif  // FMKV_FORMAT_CODEBOOK_H
