// AArch64 Advanced SIMD kernels (N = 4). NEON is part of the AArch64 baseline: no -m flags and no
// run-time detection; this is the default kernel set on arm64 (cmake/cpu_sources.cmake compiles the
// file only there). Quantize is bit-exact with the reference (exactly rounded vaddq/vsubq/vmulq/vdivq,
// -ffp-contract=off); attention accumulates in float32 with vfmaq.
#if defined(__aarch64__) && defined(__ARM_NEON)
#define FMKV_CPU_NEON_TU 1
#include "kernels_impl.h"

namespace fmkv::cpu {
namespace {
// fp32 / bf16 -> fp16 with FCVTN (round to nearest even, same bits as f32_to_f16 for finite values).
void to_f16_neon(const void* src, int32_t dtype, int32_t n, uint16_t* dst) {
  int32_t i = 0;
  if (dtype == FMKV_F16) {
    std::memcpy(dst, src, (size_t)n * 2);
    return;
  }
  if (dtype == FMKV_F32) {
    const float* s = (const float*)src;
    for (; i + 8 <= n; i += 8) {
      const float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(vld1q_f32(s + i)), vld1q_f32(s + i + 4));
      vst1q_u16(dst + i, vreinterpretq_u16_f16(h));
    }
    for (; i < n; ++i) dst[i] = f32_to_f16(s[i]);
  } else {
    const uint16_t* s = (const uint16_t*)src;
    for (; i + 8 <= n; i += 8) {
      const uint16x8_t b = vld1q_u16(s + i);
      const float32x4_t lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
      const float32x4_t hi = vreinterpretq_f32_u32(vshll_high_n_u16(b, 16));
      vst1q_u16(dst + i, vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(lo), hi)));
    }
    for (; i < n; ++i) dst[i] = f32_to_f16(bf16_to_f32(s[i]));
  }
}
}  // namespace

const Kernels& kernels_neon() {
  static const Kernels k{"neon", 4, kMaxTileOf<NeonT>, quantize_dispatch<NeonT>, to_f16_neon, attend_dispatch<NeonT>, attend_fp16_t<NeonT>, unpermute_acc};
  return k;
}
}  // namespace fmkv::cpu
#endif
