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

// Quantize one head vector given as fp16 bits: codes[d] (one code per coordinate) and scales[d / sg], with
// codebook `table` (fmkv::codebook_table: 0 = format 2's) and scale group sg (fmkv_config.scale_group).
void quantize_vector(const uint16_t* x_f16, int32_t d, int32_t bits, int32_t scale_rule,
                     const uint64_t* sign_words, uint8_t* codes, uint16_t* scales, int table = 0, int32_t sg = 0);

// Pack the 32 codes of one group into `bits` words; word w is written at words[w * stride].
void pack_group(const uint8_t* codes, int32_t bits, uint32_t* words, int64_t stride);
void unpack_group(const uint32_t* words, int64_t stride, int32_t bits, uint8_t* codes);

// Dequantized rotated values: level(code) * scale, exact in float64.
void dequantize_vector(const uint8_t* codes, const uint16_t* scales, int32_t d, int32_t bits,
                       double* y, int table = 0, int32_t sg = 0);

// One token's codes[d] and scales[d / sg] in a page section (K: is_v = 0) of a `bits`-bit cache in format
// version `format_version`: format 2's code words, or format 3's tile blocks for 3-bit codes.
void read_token_codes(const uint8_t* section, int32_t format_version, int is_v, int32_t d, int32_t bits, int32_t P,
                      int32_t t, uint8_t* codes, uint16_t* scales, int32_t sg = 0);
void write_token_codes(uint8_t* section, int32_t format_version, int is_v, int32_t d, int32_t bits, int32_t P,
                       int32_t t, const uint8_t* codes, const uint16_t* scales, int32_t sg = 0);

std::vector<uint64_t> sign_words(uint64_t seed, int32_t layer, int32_t d);

}  // namespace fmkv::ref
