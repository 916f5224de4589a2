// AVX2 + FMA + F16C kernels (N = 8). Compiled with -mavx2 -mfma -mf16c (cmake/cpu_sources.cmake);
// used only when the CPU reports these features. kernels_avx2vnni.cpp compiles this same file with AVX-VNNI
// and the traits Avx2VnniT (format 3's K scored with integer dot products).
#include "kernels_impl.h"

#ifndef FMKV_AVX2_ENTRY  // this file itself: the AVX2 set
#define FMKV_AVX2_ENTRY kernels_avx2
#define FMKV_AVX2_NAME "avx2"
#define FMKV_AVX2_TRAITS Avx2T
#endif

namespace fmkv::cpu {
namespace {
void to_f16_avx2(const void* src, int32_t dtype, int32_t n, uint16_t* dst) {
  int32_t i = 0;
  if (dtype == FMKV_F16) {
    std::memcpy(dst, src, (size_t)n * 2);
    return;
  }
  for (; i + 8 <= n; i += 8) {
    __m256 f = dtype == FMKV_F32
                   ? _mm256_loadu_ps((const float*)src + i)
                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)src + i))), 16));
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i)
    dst[i] = f32_to_f16(dtype == FMKV_F32 ? ((const float*)src)[i] : bf16_to_f32(((const uint16_t*)src)[i]));
}
}  // namespace

const Kernels& FMKV_AVX2_ENTRY() {
  using T = FMKV_AVX2_TRAITS;
  static const Kernels k{FMKV_AVX2_NAME, 8, kMaxTileOf<T>, quantize_dispatch<T>, to_f16_avx2, attend_dispatch<T>, attend_fp16_t<T>, unpermute_acc};
  return k;
}
}  // namespace fmkv::cpu
