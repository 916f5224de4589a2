#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "format/numbers.h"
#include "lloyd_max.h"

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f) {
  return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0);
}
#endif

namespace {

// Exact RNE reference by way of double arithmetic on the exactly representable candidates.
uint16_t slow_f32_to_f16(float f) { return fmkv::f64_to_f16_bits((double)f); }

TEST(Half, F32ToF16MatchesDoublePathOnEdgeCases) {
  const float cases[] = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.9802322e-8f,
                         2.98023259e-8f, 5.9604645e-8f, 6.1035156e-5f, 6.097555e-5f, 1.0009766f,
                         1.00048828125f, 1.00146484375f, INFINITY, -INFINITY, 3.14159f};
  for (float f : cases) EXPECT_EQ(fmkv::f32_to_f16(f), slow_f32_to_f16(f)) << f;
  EXPECT_EQ(fmkv::f32_to_f16(NAN) & 0x7e00u, 0x7e00u);
}

TEST(Half, F32ToF16MatchesDoublePathRandom) {
  std::mt19937 r(std::random_device{}());
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = r();
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(fmkv::f32_to_f16(f), slow_f32_to_f16(f)) << std::hexfloat << f;
  }
}

#if defined(__x86_64__)
TEST(Half, F32ToF16MatchesF16C) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU has no F16C";
  std::mt19937 r(std::random_device{}());
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = r() & 0x7fffffffu;
    u = (u % 0x10000000u) + 0x30000000u;  // dense around the fp16 range
    float f;
    std::memcpy(&f, &u, 4);
    ASSERT_EQ(fmkv::f32_to_f16(f), hw_f32_to_f16(f)) << std::hexfloat << f;
    ASSERT_EQ(fmkv::f32_to_f16(-f), hw_f32_to_f16(-f));
  }
}
#endif

TEST(Half, F16RoundTripAllValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;  // NaN payloads
    float f = fmkv::f16_to_f32((uint16_t)h);
    ASSERT_EQ(fmkv::f32_to_f16(f), h) << h;
  }
}

TEST(Half, Bf16) {
  EXPECT_EQ(fmkv::f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(fmkv::bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(fmkv::f32_to_bf16(1.00390625f), 0x3f80);  // tie to even
  EXPECT_EQ(fmkv::f32_to_bf16(1.01171875f), 0x3f82);  // tie to even (up)
}

}  // namespace
