// Portable scalar kernels (N = 1): the fallback on any architecture, and FMKV_CPU_ISA=scalar.
#include "../core/tensor_io.h"
#include "kernels_impl.h"

namespace fmkv::cpu {
namespace {
void to_f16_scalar(const void* src, int32_t dtype, int32_t n, uint16_t* dst) {
  if (dtype == FMKV_F16) {
    std::memcpy(dst, src, (size_t)n * 2);
  } else if (dtype == FMKV_F32) {
    for (int32_t i = 0; i < n; ++i) dst[i] = f32_to_f16(((const float*)src)[i]);
  } else {
    for (int32_t i = 0; i < n; ++i) dst[i] = f32_to_f16(bf16_to_f32(((const uint16_t*)src)[i]));
  }
}
}  // namespace

const Kernels& kernels_scalar() {
  static const Kernels k{"scalar", 1, kMaxTileOf<ScalarT>, quantize_dispatch<ScalarT>, to_f16_scalar, attend_dispatch<ScalarT>, attend_fp16_t<ScalarT>, unpermute_acc};
  return k;
}
}  // namespace fmkv::cpu
