// fmkv Metal backend: quantize-append kernels (FORMAT.md §2-7). Thin wrappers over
// src/metal/kernel_core.h; the host (backend.mm) dispatches fmkv_append_compress, then
// fmkv_append_fp16, in that order (pass 2 overwrites window-ring slots that pass 1 reads).
// Compile with fast math OFF (MTLCompileOptions.mathMode = safe / xcrun metal -fno-fast-math):
// the bytes depend on IEEE float32 rounding without contraction.
#include "../format/portability.h"
#include "params_msl.h"
#include "kernel_core.h"

// Pass 1. Threadgroup size: a multiple of 32 (one SIMD group per (row, kv head, K|V) item);
// grid: ceil(total_rows * kv_heads * 2 / simdgroups_per_threadgroup) threadgroups.
kernel void fmkv_append_compress(device const fmkv_metal_append_params& p [[buffer(0)]],
                                 device fmkv_u8* pages [[buffer(1)]],
                                 device const fmkv_u16* fp16_k [[buffer(2)]],
                                 device const fmkv_u16* fp16_v [[buffer(3)]],
                                 device const fmkv_u8* k [[buffer(4)]],
                                 device const fmkv_u8* v [[buffer(5)]],
                                 device const fmkv_i64* seq_lens [[buffer(6)]],
                                 device const fmkv_i64* row_offsets [[buffer(7)]],
                                 device const fmkv_i32* block_table [[buffer(8)]],
                                 device const fmkv_i32* slots [[buffer(9)]],
                                 device fmkv_u32* status [[buffer(10)]],
                                 uint tg [[threadgroup_position_in_grid]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint nsg [[simdgroups_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]],
                                 uint threads [[threads_per_threadgroup]]) {
  fmkv_append_compress_impl(p, pages, fp16_k, fp16_v, k, v, seq_lens, row_offsets, block_table, slots, status,
                            tg, sg, nsg, lane, threads);
}

// Pass 2. Any threadgroup size; grid: total_rows * kv_heads * 2 * head_dim threads.
kernel void fmkv_append_fp16(device const fmkv_metal_append_params& p [[buffer(0)]],
                             device fmkv_u16* fp16_k [[buffer(2)]],
                             device fmkv_u16* fp16_v [[buffer(3)]],
                             device const fmkv_u8* k [[buffer(4)]],
                             device const fmkv_u8* v [[buffer(5)]],
                             device const fmkv_i64* seq_lens [[buffer(6)]],
                             device const fmkv_i64* row_offsets [[buffer(7)]],
                             device const fmkv_i32* slots [[buffer(9)]],
                             uint gid [[thread_position_in_grid]]) {
  fmkv_append_fp16_impl(p, fp16_k, fp16_v, k, v, seq_lens, row_offsets, slots, gid);
}
