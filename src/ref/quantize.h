// Scalar reference (the oracle) of the fmkv format: one head vector quantized and dequantized with
// the format core's rules (src/format/), in simple loops; float32 exactly as FORMAT.md specifies for
// everything that produces bytes, float64 for everything that only measures.
#pragma once
#include <cstdint>
#include <vector>

namespace fmkv::ref {

// x = s * H y / sqrt(d) in float64 (inverse of the rotation, exact arithmetic up to rounding).
void unrotate_f64(const double* y, int32_t d, const uint64_t* sign_words, double* x);
void rotate_f64(const double* x, int32_t d, const uint64_t* sign_words, double* y);

// Quantize one head vector given as fp16 bits: codes[d] (one code per coordinate) and scales[G].
void quantize_vector(const uint16_t* x_f16, int32_t d, int32_t bits, int32_t scale_rule,
                     const uint64_t* sign_words, uint8_t* codes, uint16_t* scales);

// Pack the 32 codes of one group into `bits` words; word w is written at words[w * stride].
void pack_group(const uint8_t* codes, int32_t bits, uint32_t* words, int64_t stride);
void unpack_group(const uint32_t* words, int64_t stride, int32_t bits, uint8_t* codes);

// Dequantized rotated values: level(code) * scale, exact in float64.
void dequantize_vector(const uint8_t* codes, const uint16_t* scales, int32_t d, int32_t bits,
                       double* y);

std::vector<uint64_t> sign_words(uint64_t seed, int32_t layer, int32_t d);

}  // namespace fmkv::ref
