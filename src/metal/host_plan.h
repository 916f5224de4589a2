// fmkv Metal backend, host side without Metal: kernel parameter blocks and launch shapes from the
// validated op arguments. Shared by src/metal/backend.mm and the emulator tests (tests/metal/), so
// the tests cover exactly what the Objective-C++ host will pass to the kernels.
// Batch arrays (row_offsets, seq_lens) are read on the host: Metal buffers on Apple silicon are
// shared (unified) memory.
#pragma once
#include <cstdint>

#include "../core/ops.h"
#include "../format/portability.h"
#include "params_msl.h"

namespace fmkv::metal {

inline fmkv_metal_append_params append_params(const AppendArgs& a) {
  const fmkv_config& c = a.cfg;
  fmkv_metal_append_params p{};
  p.head_dim = c.head_dim;
  p.num_kv_heads = c.num_kv_heads;
  p.k_bits = c.k_bits;
  p.v_bits = c.v_bits;
  p.page_size = c.page_size;
  p.sink_tokens = c.sink_tokens;
  p.window_tokens = c.window_tokens;
  p.scale_rule = c.scale_rule;
  p.seed = c.seed;
  p.num_pages = a.layer.num_pages;
  p.num_slots = a.layer.num_slots;
  p.layer = a.layer.layer;
  p.num_seqs = a.batch.num_seqs;
  p.has_slots = a.batch.slots != nullptr;
  p.block_table_stride = a.batch.block_table_stride;
  p.k_dtype = a.k.dtype;
  p.v_dtype = a.v.dtype;
  p.k_row_stride = a.k.row_stride;
  p.k_head_stride = a.k.head_stride;
  p.v_row_stride = a.v.row_stride;
  p.v_head_stride = a.v.head_stride;
  p.total_rows = a.batch.num_seqs > 0 ? a.batch.row_offsets[a.batch.num_seqs] : 0;
  p.page_bytes = page_bytes(c);
  p.format_version = c.format_version;
  p.scale_group = c.scale_group;
  return p;
}

struct AppendLaunch {
  uint32_t compress_groups;   // threadgroups of fmkv_append_compress
  uint32_t compress_threads;  // threads per threadgroup (multiple of 32)
  uint32_t fp16_threads;      // total threads of fmkv_append_fp16 (0: no fp16 regions)
};

inline AppendLaunch append_launch(const fmkv_metal_append_params& p, uint32_t threads_per_group) {
  const int64_t items = p.total_rows * p.num_kv_heads * 2, nsg = threads_per_group / 32;
  AppendLaunch l;
  l.compress_threads = threads_per_group;
  l.compress_groups = (uint32_t)((items + nsg - 1) / nsg);
  l.fp16_threads = p.sink_tokens + p.window_tokens > 0 ? (uint32_t)(items * p.head_dim) : 0u;
  return l;
}

// splits: key splits per query tile (threadgroups along the sequence); simdgroups: per threadgroup.
inline fmkv_metal_attention_params attention_params(const AttentionArgs& a, int32_t simdgroups, int32_t splits) {
  const fmkv_config& c = a.cfg;
  fmkv_metal_attention_params p{};
  p.head_dim = c.head_dim;
  p.num_kv_heads = c.num_kv_heads;
  p.k_bits = c.k_bits;
  p.v_bits = c.v_bits;
  p.page_size = c.page_size;
  p.sink_tokens = c.sink_tokens;
  p.window_tokens = c.window_tokens;
  p.scale_rule = c.scale_rule;
  p.seed = c.seed;
  p.num_pages = a.layer.num_pages;
  p.num_slots = a.layer.num_slots;
  p.layer = a.layer.layer;
  p.num_seqs = a.batch.num_seqs;
  p.has_slots = a.batch.slots != nullptr;
  p.block_table_stride = a.batch.block_table_stride;
  p.q_heads = a.q.heads;
  p.q_dtype = a.q.dtype;
  p.q_row_stride = a.q.row_stride;
  p.q_head_stride = a.q.head_stride;
  p.out_dtype = a.out.dtype;
  p.out_row_stride = a.out.row_stride;
  p.out_head_stride = a.out.head_stride;
  p.softmax_scale = a.opts.softmax_scale > 0 ? a.opts.softmax_scale : 1.0f / __builtin_sqrtf((float)c.head_dim);
  p.softcap = a.opts.softcap;
  int64_t max_rows = 0, max_len = 1;
  for (int32_t s = 0; s < a.batch.num_seqs; ++s) {
    int64_t n = a.batch.row_offsets[s + 1] - a.batch.row_offsets[s];
    max_rows = n > max_rows ? n : max_rows;
    max_len = a.batch.seq_lens[s] > max_len ? a.batch.seq_lens[s] : max_len;
  }
  const int32_t group = a.q.heads / c.num_kv_heads;
  p.max_rows = (int32_t)max_rows;
  p.tiles = (int32_t)((max_rows * group + FMKV_METAL_QTILE - 1) / FMKV_METAL_QTILE);
  if (p.tiles < 1) p.tiles = 1;
  p.num_splits = splits < 1 ? 1 : splits;
  p.split_len = (max_len + p.num_splits - 1) / p.num_splits;
  p.parts = p.num_splits * simdgroups;
  p.format_version = c.format_version;
  p.page_bytes = page_bytes(c);
  p.scale_group = c.scale_group;
  p.has_lse = a.lse.data != nullptr;  // fmkv_attention_lse: the merge writes M + log L of (row, q head)
  p.lse_row_stride = a.lse.data ? a.lse.row_stride : 0;
  p.lse_head_stride = a.lse.data ? a.lse.head_stride : 0;
  return p;
}

inline int64_t attention_items(const fmkv_metal_attention_params& p) {
  return (int64_t)p.num_seqs * p.num_kv_heads * p.tiles * FMKV_METAL_QTILE;
}
inline int64_t attention_workspace_floats(const fmkv_metal_attention_params& p) {
  return attention_items(p) * p.parts * (2 + (int64_t)p.head_dim);
}
inline uint32_t attention_partial_groups(const fmkv_metal_attention_params& p) {
  return (uint32_t)((int64_t)p.num_seqs * p.num_kv_heads * p.tiles * p.num_splits);
}
inline uint32_t attention_merge_groups(const fmkv_metal_attention_params& p, int32_t simdgroups) {
  return (uint32_t)((attention_items(p) + simdgroups - 1) / simdgroups);
}

}  // namespace fmkv::metal
