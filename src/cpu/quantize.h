// CPU quantizer front end: per-layer constants for the SIMD quantize kernel (kernels_impl.h,
// quantize_t: sign flip + in-register FWHT + norm, group RMS/LSQ scale, codes, code words or tile
// blocks) and the codebook tables shared with attention.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace fmkv::cpu {

// Constants for quantizing head vectors of width d with `bits`-bit codes (2..4) into a K (is_v = 0) or
// V section of a cache in format version `format_version` (its codebook: codebook_table; tile blocks:
// fmkv_tiled_codes) with scale group `scale_group` (fmkv_config.scale_group).
void make_quant_params(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer, int32_t format_version,
                       int is_v, int32_t scale_group, QuantParams* qp);

// mag16[i] = table_mag(table, bits, i & (magnitude_count - 1)) (lookup table for 4-bit indices).
void codebook_table16(int32_t bits, int table, float* mag16);

// mag16[i] = decode_level_table(i & 7, 3, table): the signed levels of 3-bit codes, 8-periodic (the
// attention tables of tiled sections, whose code nibbles carry another code's bit in bit 3).
void signed_table16(int table, float* mag16);

// lev16[i] = decode_level_table(i, 4, table): the signed levels of 4-bit codes (sign in bit 3).
void signed_table16_4bit(int table, float* lev16);

// The same levels as integers and their common step: lev16[i] * step == decode_level_table(i & 7, 3, table)
// exactly (format 3's integer levels, codebook_int_level x codebook_step_f16).
void signed_int_table16(int table, int8_t* lev16, float* step);

}  // namespace fmkv::cpu
