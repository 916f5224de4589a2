// fmkv Metal backend: kernel parameter blocks, shared by MSL kernels and host code.
//
// Plain structs of fixed-width fields mirroring fmkv_config / fmkv_layer_cache / fmkv_batch /
// fmkv_tensor (include/fmkv/params.h); the arrays themselves (pages, fp16 regions, tensors, block
// table, lengths, row offsets, slots) are bound as separate buffers (see the buffer index lists
// below). Every field sits at its natural alignment with no implicit padding, so the C++ host, MSL
// and python/fmkv/mlx/kernels.py (struct.pack, with the field lists it reads from this file) agree
// on the layout; tests check the offsets.
// Include src/format/portability.h first.
#ifndef FMKV_METAL_PARAMS_MSL_H
#define FMKV_METAL_PARAMS_MSL_H

// Queries handled per threadgroup tile by the attention kernel (per-lane accumulators: 4 x d/32).
#define FMKV_METAL_QTILE 4
// Largest supported head_dim / 32 (d = 256).
#define FMKV_METAL_GMAX 8
// Status word bits written by the kernels (0 = fine).
#define FMKV_METAL_ERR_BLOCK_TABLE 1u
#define FMKV_METAL_ERR_LAUNCH 2u

// quantize-append. Buffers: 0 params, 1 pages (uchar, in/out), 2 fp16_k (ushort, in/out),
// 3 fp16_v, 4 k rows (bytes, dtype k_dtype), 5 v rows, 6 seq_lens (long), 7 row_offsets (long),
// 8 block_table (int), 9 slots (int), 10 status (uint).
struct fmkv_metal_append_params {
  // fmkv_config
  fmkv_i32 head_dim, num_kv_heads, k_bits, v_bits;
  fmkv_i32 page_size, sink_tokens, window_tokens, scale_rule;
  fmkv_u64 seed;
  // fmkv_layer_cache (pages / fp16 regions are buffers)
  fmkv_i64 num_pages;
  fmkv_i32 num_slots, layer;
  // fmkv_batch
  fmkv_i32 num_seqs, has_slots;  // has_slots = 0: every sequence uses region slot 0
  fmkv_i64 block_table_stride;
  // k, v tensors: [rows][kv_heads][head_dim], element strides
  fmkv_i32 k_dtype, v_dtype;  // fmkv_dtype: 0 f32, 1 f16, 2 bf16
  fmkv_i64 k_row_stride, k_head_stride, v_row_stride, v_head_stride;
  fmkv_i64 total_rows;  // row_offsets[num_seqs]
  fmkv_i64 page_bytes;  // fmkv_page_bytes(...)
  // fmkv_config.format_version as given (0 = FMKV_FORMAT_VERSION; the kernels resolve it): format 3's 3-bit
  // sections use integer levels and tile blocks (FORMAT.md sections 4, 6); fmkv_config.scale_group as given
  // (0 = FMKV_SCALE_GROUP, 32 or 64; the kernels take fmkv_scale_shift of it, FORMAT.md section 4)
  fmkv_i32 format_version, scale_group;
};

// decode attention, pass 1 (partial) and pass 2 (merge). Buffers: 0 params, 1 pages, 2 fp16_k,
// 3 fp16_v, 4 q (bytes, q_dtype), 5 seq_lens, 6 row_offsets, 7 block_table, 8 slots,
// 9 workspace (float), 10 out (bytes, out_dtype; merge only), 11 status (uint),
// 12 lse (float; merge only, written when has_lse != 0: fmkv_attention_lse).
struct fmkv_metal_attention_params {
  fmkv_i32 head_dim, num_kv_heads, k_bits, v_bits;
  fmkv_i32 page_size, sink_tokens, window_tokens, scale_rule;
  fmkv_u64 seed;
  fmkv_i64 num_pages;
  fmkv_i32 num_slots, layer;
  fmkv_i32 num_seqs, has_slots;
  fmkv_i64 block_table_stride;
  fmkv_i32 q_heads, q_dtype;
  fmkv_i64 q_row_stride, q_head_stride;
  fmkv_i32 out_dtype, max_rows;  // max_rows: largest query row count of a sequence (1..16)
  fmkv_i64 out_row_stride, out_head_stride;
  float softmax_scale, softcap;  // softmax_scale resolved (> 0); softcap <= 0: off
  fmkv_i32 tiles;                // query tiles per (sequence, kv head): ceil(max_rows*group/QTILE)
  fmkv_i32 num_splits;           // key splits (threadgroups) per tile
  fmkv_i64 split_len;            // keys per split
  fmkv_i32 parts;                // partial states per query = num_splits * simdgroups per threadgroup
  fmkv_i32 format_version;       // fmkv_config.format_version as given (0 = FMKV_FORMAT_VERSION)
  fmkv_i64 page_bytes;
  fmkv_i32 scale_group;            // fmkv_config.scale_group as given (0 = FMKV_SCALE_GROUP, 32 or 64)
  fmkv_i32 has_lse;                // 1: the merge writes lse[row * lse_row_stride + hq * lse_head_stride] (buffer 12)
  fmkv_i64 lse_row_stride, lse_head_stride;  // element strides of the f32 lse tensor (fmkv_attention_lse)
};

#endif  // FMKV_METAL_PARAMS_MSL_H
