// fmkv Metal backend: decode attention on the paged compressed cache (FORMAT.md §8): GQA, paged
// via the block table, q_len 1..16 causal, fp16 sink/window regions, k16 pages, softcap.
// Split-K: pass 1 (fmkv_attention_partial) writes one partial softmax state per (query, key
// split, SIMD group) into the workspace; pass 2 (fmkv_attention_merge) merges them, normalises
// and rotates the output back (for fmkv_attention_lse it also writes the softmax log-denominator).
// Thin wrappers over src/metal/kernel_core.h.
#include "../format/portability.h"
#include "params_msl.h"
#include "kernel_core.h"

// Pass 1. Threadgroup size: a multiple of 32, at most 32 * 32; grid:
// num_seqs * kv_heads * tiles * num_splits threadgroups; parts = num_splits * simdgroups.
kernel void fmkv_attention_partial(device const fmkv_metal_attention_params& p [[buffer(0)]],
                                   device const fmkv_u8* pages [[buffer(1)]],
                                   device const fmkv_u16* fp16_k [[buffer(2)]],
                                   device const fmkv_u16* fp16_v [[buffer(3)]],
                                   device const fmkv_u8* q [[buffer(4)]],
                                   device const fmkv_i64* seq_lens [[buffer(5)]],
                                   device const fmkv_i64* row_offsets [[buffer(6)]],
                                   device const fmkv_i32* block_table [[buffer(7)]],
                                   device const fmkv_i32* slots [[buffer(8)]],
                                   device float* ws [[buffer(9)]],
                                   device fmkv_u32* status [[buffer(11)]],
                                   uint tg [[threadgroup_position_in_grid]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint nsg [[simdgroups_per_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]],
                                   uint threads [[threads_per_threadgroup]]) {
  FMKV_THREADGROUP_ARRAY(float, q_rot, FMKV_METAL_QTILE * 256);
  FMKV_THREADGROUP_ARRAY(float, q_raw, FMKV_METAL_QTILE * 256);
  fmkv_attention_partial_impl(p, pages, fp16_k, fp16_v, q, seq_lens, row_offsets, block_table, slots, ws, status,
                              q_rot, q_raw, tg, sg, nsg, lane, threads);
}

// Pass 2. Threadgroup size: a multiple of 32; grid: ceil(items / simdgroups) threadgroups with
// items = num_seqs * kv_heads * tiles * FMKV_METAL_QTILE. lse: written only when p.has_lse != 0
// (fmkv_attention_lse); otherwise any buffer may be bound there.
kernel void fmkv_attention_merge(device const fmkv_metal_attention_params& p [[buffer(0)]],
                                 device const fmkv_i64* row_offsets [[buffer(6)]],
                                 device const float* ws [[buffer(9)]],
                                 device fmkv_u8* out [[buffer(10)]],
                                 device fmkv_u32* status [[buffer(11)]],
                                 device float* lse [[buffer(12)]],
                                 uint tg [[threadgroup_position_in_grid]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint nsg [[simdgroups_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]],
                                 uint threads [[threads_per_threadgroup]]) {
  fmkv_attention_merge_impl(p, row_offsets, ws, out, lse, status, tg, sg, nsg, lane, threads);
}
