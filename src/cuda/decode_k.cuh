// The decode attention kernels of one K width, FMKV_DECODE_K_BITS: every compiled (head_dim, V width,
// page size, format, 8 or 16 query vectors per pass) of attn_compiled / attn_compiled_f3 / attn_compiled_wide
// (decode_attention.cuh). cmake/cuda.cmake generates
// one translation unit per K width (FMKV_CODE_BITS_MIN .. FMKV_CUDA_CODE_BITS_MAX and FMKV_FP16_BITS, read from
// include/fmkv/format.h and src/cuda/code_widths.cuh) that defines FMKV_DECODE_K_BITS and includes this file, so the widths' kernels
// compile in parallel; decode_attention.cu calls the explicit instantiations through with_k_bits.
#pragma once
#ifndef FMKV_DECODE_K_BITS
#error "decode_k.cuh is included by the generated per-K-width translation units (FMKV_DECODE_K_BITS)"
#endif
#include "decode_attention.cuh"

namespace fmkv {
namespace cuda {

template <int KB, int D, int V, int NH>
AttnFn attn_kernel_dvn(int page, bool f3) {
  return f3 ? attn_kernel_for_page<D, KB, V, true, NH>(page) : attn_kernel_for_page<D, KB, V, false, NH>(page);
}

template <int KB>
AttnFn attn_kernel_k(int d, int vb, int page, bool f3, bool wide) {
  static_assert(is_k_bits(KB), "FMKV_DECODE_K_BITS is not a K width of the format");
  AttnFn fn{};
  const auto for_v = [&](auto VB) {
    constexpr int V = decltype(VB)::value;
    switch (d) {
      case 64: fn = wide ? attn_kernel_dvn<KB, 64, V, 2>(page, f3) : attn_kernel_dvn<KB, 64, V, 1>(page, f3); break;
      case 128: fn = wide ? attn_kernel_dvn<KB, 128, V, 2>(page, f3) : attn_kernel_dvn<KB, 128, V, 1>(page, f3); break;
      case 256: fn = wide ? AttnFn{} : attn_kernel_dvn<KB, 256, V, 1>(page, f3); break;
    }
  };
  with_code_bits(vb, for_v);
  return fn;
}

template AttnFn attn_kernel_k<FMKV_DECODE_K_BITS>(int d, int vb, int page, bool f3, bool wide);

}  // namespace cuda
}  // namespace fmkv
