// Compile check (not run): the single-source kernel core of the Metal backend builds as CUDA with
// warp = SIMD group of 32 lanes (src/format/portability.h, __CUDACC__ branch). tests/metal/run.sh:
//   nvcc -arch=sm_90 -std=c++17 -c tests/metal/cuda_check.cu
// This proves the core stays within the common subset of MSL and CUDA C++; the CUDA backend itself
// lives in src/cuda/.
#include "../../src/metal/kernel_core.h"

__global__ void fmkv_core_append_compress(const fmkv_metal_append_params* p, fmkv_u8* pages, const fmkv_u16* fp16_k,
                                          const fmkv_u16* fp16_v, const fmkv_u8* k, const fmkv_u8* v,
                                          const fmkv_i64* seq_lens, const fmkv_i64* row_offsets,
                                          const fmkv_i32* block_table, const fmkv_i32* slots, fmkv_u32* status) {
  fmkv_append_compress_impl(*p, pages, fp16_k, fp16_v, k, v, seq_lens, row_offsets, block_table, slots, status,
                            blockIdx.x, threadIdx.x / 32, blockDim.x / 32, threadIdx.x % 32, blockDim.x);
}

__global__ void fmkv_core_append_fp16(const fmkv_metal_append_params* p, fmkv_u16* fp16_k, fmkv_u16* fp16_v,
                                      const fmkv_u8* k, const fmkv_u8* v, const fmkv_i64* seq_lens,
                                      const fmkv_i64* row_offsets, const fmkv_i32* slots) {
  fmkv_append_fp16_impl(*p, fp16_k, fp16_v, k, v, seq_lens, row_offsets, slots, blockIdx.x * blockDim.x + threadIdx.x);
}

__global__ void fmkv_core_attention_partial(const fmkv_metal_attention_params* p, const fmkv_u8* pages,
                                            const fmkv_u16* fp16_k, const fmkv_u16* fp16_v, const fmkv_u8* q,
                                            const fmkv_i64* seq_lens, const fmkv_i64* row_offsets,
                                            const fmkv_i32* block_table, const fmkv_i32* slots, float* ws,
                                            fmkv_u32* status) {
  FMKV_THREADGROUP_ARRAY(float, q_rot, FMKV_METAL_QTILE * 256);
  FMKV_THREADGROUP_ARRAY(float, q_raw, FMKV_METAL_QTILE * 256);
  fmkv_attention_partial_impl(*p, pages, fp16_k, fp16_v, q, seq_lens, row_offsets, block_table, slots, ws, status,
                              q_rot, q_raw, blockIdx.x, threadIdx.x / 32, blockDim.x / 32, threadIdx.x % 32,
                              blockDim.x);
}

__global__ void fmkv_core_attention_merge(const fmkv_metal_attention_params* p, const fmkv_i64* row_offsets,
                                          const float* ws, fmkv_u8* out, float* lse, fmkv_u32* status) {
  fmkv_attention_merge_impl(*p, row_offsets, ws, out, lse, status, blockIdx.x, threadIdx.x / 32, blockDim.x / 32,
                            threadIdx.x % 32, blockDim.x);
}
