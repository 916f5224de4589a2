// Metal backend entry points (implemented in src/metal/backend.mm, Apple platforms only, which also
// defines the backend's table for the registry). Memory from alloc() is MTLBuffer storage in shared
// (unified) mode, so host validation (validate_*_host) can read batch arrays and tensors directly.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/ops.h"

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

bool available();
std::string device_name();
void append(const AppendArgs& a);
void decode_attention(const AttentionArgs& a);
void* alloc(size_t bytes);
void free(void* p);
void copy(void* dst, const void* src, size_t bytes, bool to_device);
void synchronize();
int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows, int32_t num_seqs,
                                  int64_t max_seq_len);

}  // namespace fmkv::metal
