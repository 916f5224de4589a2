// AVX-512 kernels (N = 16). Compiled with -mavx512f -mavx512bw -mavx2 -mfma -mf16c (cmake/cpu_sources.cmake);
// used only when the CPU reports AVX-512F and BW (BW: the 512-bit byte shuffle of nibble_v_scratch.h; every
// AVX-512 CPU but the Xeon Phi has it). kernels_avx512vnni.cpp compiles this same file with VNNI
// and the traits Avx512VnniT (format 3's K scored with integer dot products).
// GCC 12 warns about _mm512_undefined_* inside its own headers (false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "kernels_impl.h"

#ifndef FMKV_AVX512_ENTRY  // this file itself: the AVX-512 (F + BW) set
#define FMKV_AVX512_ENTRY kernels_avx512
#define FMKV_AVX512_NAME "avx512"
#define FMKV_AVX512_TRAITS Avx512T
#endif

namespace fmkv::cpu {
namespace {
void to_f16_avx512(const void* src, int32_t dtype, int32_t n, uint16_t* dst) {
  int32_t i = 0;
  if (dtype == FMKV_F16) {
    std::memcpy(dst, src, (size_t)n * 2);
    return;
  }
  for (; i + 16 <= n; i += 16) {
    __m512 f = dtype == FMKV_F32
                   ? _mm512_loadu_ps((const float*)src + i)
                   : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)src + i))), 16));
    _mm256_storeu_si256((__m256i*)(dst + i), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i)
    dst[i] = f32_to_f16(dtype == FMKV_F32 ? ((const float*)src)[i] : bf16_to_f32(((const uint16_t*)src)[i]));
}
}  // namespace

const Kernels& FMKV_AVX512_ENTRY() {
  using T = FMKV_AVX512_TRAITS;
  static const Kernels k{FMKV_AVX512_NAME, 16, kMaxTileOf<T>, quantize_dispatch<T>, to_f16_avx512, attend_dispatch<T>, attend_fp16_t<T>, unpermute_acc};
  return k;
}
}  // namespace fmkv::cpu
