// The golden-vector cases of tests/golden/v2.txt and v3.txt and their inputs, shared by the GoogleTest check
// of every backend (tests/test_golden.cpp) and the Metal emulator tests (tests/metal/test_metal.cpp).
// Inputs come from splitmix64 (not <random>) so the files are platform independent.
#pragma once
#include <cstdint>
#include <vector>

#include "fmkv/fmkv.h"
#include "fmkv/format.h"
#include "format/numbers.h"

namespace fmkv::test {

struct GoldenCase {
  int d, kb, vb, page, sink, window, rule;
  int64_t tokens;
  int scale_group = 0;  // fmkv_config.scale_group (0: the default)
};
inline const std::vector<GoldenCase> kCasesV2 = {
    {64, 2, 3, 16, 0, 0, FMKV_SCALE_LSQ, 21},
    {128, 3, 3, 16, 2, 4, FMKV_SCALE_RMS, 23},
    {128, 4, 2, 32, 0, 0, FMKV_SCALE_LSQ, 19},
    {256, 16, 4, 16, 1, 0, FMKV_SCALE_LSQ, 18},
};
// format 3: 3-bit codes in tile blocks (partly filled tiles: the other slots keep the pool's 0xA5 bytes)
inline const std::vector<GoldenCase> kCasesV3 = {
    {64, 3, 3, 16, 0, 0, FMKV_SCALE_LSQ, 21},
    {128, 3, 2, 32, 2, 4, FMKV_SCALE_RMS, 39},
    {128, 16, 3, 16, 0, 0, FMKV_SCALE_LSQ, 17},
    {256, 4, 3, 16, 1, 0, FMKV_SCALE_LSQ, 18},
};

// scale group 64 (tests/golden/v3_scale_group64.txt, format 3): one scale per 64 coordinates, every head_dim,
// d = 64 with one scale per vector
inline const std::vector<GoldenCase> kCasesScaleGroup64 = {
    {64, 2, 2, 16, 0, 0, FMKV_SCALE_LSQ, 21, 64},
    {64, 3, 2, 32, 2, 4, FMKV_SCALE_RMS, 39, 64},
    {128, 4, 3, 16, 1, 0, FMKV_SCALE_LSQ, 18, 64},
    {256, 16, 2, 16, 0, 0, FMKV_SCALE_LSQ, 17, 64},
};

// 5-bit codes (tests/golden/v3_code_width5.txt, format 3): K, V and both at 5 bits, with fp16 K, a 3-bit tiled side,
// sinks and a window, both scale groups and rules
inline const std::vector<GoldenCase> kCasesCodeWidth5 = {
    {64, 5, 4, 16, 0, 0, FMKV_SCALE_LSQ, 21},
    {128, 5, 5, 32, 2, 4, FMKV_SCALE_RMS, 39},
    {128, 3, 5, 16, 1, 0, FMKV_SCALE_LSQ, 18, 64},
    {256, 16, 5, 16, 0, 0, FMKV_SCALE_LSQ, 17},
};

// The storage of a golden case: one kv head, one sequence in region slot 0, block table {2, 0, 3, 1} over a
// pool of 4 pages of 0xA5 bytes, fp16 regions of 0x7E00; layer = case index.
constexpr int32_t kGoldenPages = 4;
inline const std::vector<int32_t> kGoldenTable = {2, 0, 3, 1};

inline fmkv_config golden_config(const GoldenCase& g, int idx, int32_t version) {
  fmkv_config c;
  fmkv_config_default(&c);
  c.format_version = version;
  c.head_dim = g.d; c.num_kv_heads = 1; c.k_bits = g.kb; c.v_bits = g.vb; c.page_size = g.page;
  c.sink_tokens = g.sink; c.window_tokens = g.window; c.scale_rule = g.rule; c.seed = 0x0123456789ABCDEFull + idx;
  c.scale_group = g.scale_group;
  return c;
}

// Deterministic approximately-Gaussian fp16 inputs (sum of 4 uniforms, scaled): uniforms from the
// splitmix64 stream of `seed` (the rotation's generator with layer 0: output k + 1 is sign word k).
// K, V, Q of case idx use seeds 100 + idx, 200 + idx, 300 + idx.
inline std::vector<uint16_t> golden_values(uint64_t seed, size_t n) {
  std::vector<uint16_t> v(n);
  int32_t k_out = 0;
  for (auto& x : v) {
    double s = 0;
    for (int k = 0; k < 4; ++k) s += (double)(fmkv_rotation_sign_word(seed, 0, k_out++) >> 11) * 0x1.0p-53 - 0.5;
    x = f32_to_f16((float)(s * 1.7320508 * 2.0));
  }
  return v;
}

}  // namespace fmkv::test
