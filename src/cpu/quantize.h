// CPU quantizer front end: per-layer constants for the SIMD quantize kernel (kernels_impl.h,
// quantize_t: sign flip + in-register FWHT + norm, group RMS/LSQ scale, codes, code words) and
// the codebook tables shared with attention.
#pragma once
#include <cstdint>

#include "kernels.h"

namespace fmkv::cpu {

// Constants for quantizing head vectors of width d with `bits`-bit codes (2..4).
void make_quant_params(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer, QuantParams* qp);

// mag16[i] = codebook_mag(bits, i & (magnitude_count - 1)) (lookup table for 4-bit indices).
void codebook_table16(int32_t bits, float* mag16);

}  // namespace fmkv::cpu
