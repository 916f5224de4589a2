// Arguments of the two cache ops as every backend receives them (after validation in src/api/).
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

#include "fmkv/fmkv.hpp"

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
};

// Status codes (the values of fmkv_status in fmkv.h; fmkv::Error is in fmkv.hpp).
enum Status : int {
  kOk = 0,
  kInvalidArgument = 1,  // shape, dtype, bits, head_dim, strides, null pointers
  kOutOfRange = 2,       // page table entry, slot or length outside the storage
  kNonFinite = 3,        // NaN/Inf (or beyond fp16 range) in K/V/Q input
  kOverflow = 4,         // a size or offset does not fit the index types
  kUnsupported = 5,      // combination not compiled / backend not available
  kBackendError = 6,     // CUDA/Metal runtime failure
  kInternal = 7
};


// Token layout of a cache of length len: [0, min(S, len)) sink fp16, [S, E) compressed and
// [E, len) fp16 window, with E = compressed_end = max(S, len - W).
inline int64_t compressed_end(const fmkv_config& c, int64_t len) {
  int64_t e = len - c.window_tokens;
  return e > c.sink_tokens ? e : c.sink_tokens;
}
inline int32_t fp16_slots(const fmkv_config& c) { return c.sink_tokens + c.window_tokens; }
// Slot inside a sequence's fp16 region of position p (p < S, or p in the window).
inline int32_t fp16_slot_of(const fmkv_config& c, int64_t p) {
  return p < c.sink_tokens ? (int32_t)p
                           : c.sink_tokens + (int32_t)((p - c.sink_tokens) % c.window_tokens);
}
inline int64_t page_bytes(const fmkv_config& c) {
  return fmkv_page_bytes(c.head_dim, c.num_kv_heads, c.k_bits, c.v_bits, c.page_size);
}
inline size_t dtype_size(int32_t dt) { return dt == FMKV_F32 ? 4 : 2; }

}  // namespace fmkv
