// Arguments of the cache ops as every backend receives them (after validation in src/api/), and
// the config-level forms of the format's token-region rules (include/fmkv/format.h).
#pragma once
#include <cstddef>
#include <string>

#include "fmkv/fmkv.h"
#include "status.h"

namespace fmkv {

struct AppendArgs {
  fmkv_config cfg;
  fmkv_layer_cache layer;
  fmkv_batch batch;
  fmkv_tensor k, v;
  void* stream = nullptr;
};

struct AttentionArgs {
  fmkv_config cfg;
  fmkv_layer_cache layer;
  fmkv_batch batch;
  fmkv_tensor q, out;
  fmkv_attention_opts opts;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  void* stream = nullptr;
  fmkv_tensor lse{};  // fmkv_attention_lse: f32 [rows][q heads][1]; data == nullptr: not requested
};

// Token layout of a cache of length len (fmkv_compressed_end): [0, min(S, len)) sink fp16, [S, E)
// compressed and [E, len) fp16 window.
inline int64_t compressed_end(const fmkv_config& c, int64_t len) {
  return fmkv_compressed_end(c.sink_tokens, c.window_tokens, len);
}
inline int32_t fp16_slots(const fmkv_config& c) { return c.sink_tokens + c.window_tokens; }
// Row of position p (p < S, or p in the window) inside its sequence's fp16 region.
inline int32_t fp16_slot_of(const fmkv_config& c, int64_t p) {
  return (int32_t)fmkv_fp16_row(c.sink_tokens, c.window_tokens, p);
}
inline int64_t page_bytes(const fmkv_config& c) {
  return fmkv_page_bytes(c.head_dim, c.num_kv_heads, c.k_bits, c.v_bits, c.page_size, c.scale_group);
}
// Byte offset, inside a page, of the K (is_v = 0) or V section of kv head h.
inline int64_t section_offset(const fmkv_config& c, int32_t h, int is_v) {
  return fmkv_section_offset(c.head_dim, c.k_bits, c.v_bits, c.page_size, h, is_v, c.scale_group);
}
inline size_t dtype_size(int32_t dt) { return dt == FMKV_F32 ? 4 : 2; }

}  // namespace fmkv
