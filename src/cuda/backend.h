// Entry points of the CUDA backend (device memory, stream-ordered; one op per file): declared for
// the backend table (backend.cpp) and the kernels' own files.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../core/ops.h"

namespace fmkv::cuda {
bool available();          // runtime.cu
std::string device_name();  // runtime.cu
// Host-side checks done, arrays are device pointers: kernels bounds-check block tables.
void append(const AppendArgs& a);               // append.cu
void decode_attention(const AttentionArgs& a);  // decode_attention.cu
// Fused decode step: append ap's rows, then attend a.q over the cache including them, in one
// attention launch (a.batch.seq_lens: lengths before the append). decode_attention.cu
void append_attention(const AppendArgs& ap, const AttentionArgs& a);
// Throws FMKV_ERR_UNSUPPORTED naming the combination when (head_dim, K, V, page size, format version) is outside
// the compiled grid (decode_attention.cuh attn_compiled). decode_attention.cu
void check_attention(const fmkv_config& cfg);
int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows, int32_t num_seqs,
                                  int64_t max_seq_len);  // decode_attention.cu
void* alloc(size_t bytes);                                // runtime.cu
void free(void* p);
void copy(void* dst, const void* src, size_t bytes, bool to_device);
void synchronize();  // reads, clears and throws the device error word
}  // namespace fmkv::cuda
