// Metal backend entry points (implemented in src/metal/backend.mm, Apple platforms only).
// Mirrors fmkv::cuda in src/core/backends.h; the C API dispatches here for FMKV_BACKEND_METAL when
// FMKV_WITH_METAL is defined. Memory from alloc() is MTLBuffer storage in shared (unified) mode, so
// host validation (validate_*_host) can read batch arrays and tensors directly.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/backends.h"

namespace fmkv::metal {

// Launch shape policy shared by backend.mm and attention_workspace_bytes.
constexpr int32_t kAppendThreads = 128;     // 4 SIMD groups per threadgroup (quantize pass)
constexpr int32_t kFp16Threads = 256;       // fp16 region pass
constexpr int32_t kAttentionSimdgroups = 4; // attention pass 1
constexpr int32_t kMergeSimdgroups = 2;     // attention pass 2
constexpr int64_t kKeysPerSplit = 256;      // split-K: one threadgroup per 256 keys, at most 32 splits
inline int32_t attention_splits(int64_t max_len) {
  int64_t s = (max_len + kKeysPerSplit - 1) / kKeysPerSplit;
  return (int32_t)(s < 1 ? 1 : s > 32 ? 32 : s);
}

// Entry points: declared with the other backends' in src/core/backends.h.

}  // namespace fmkv::metal
