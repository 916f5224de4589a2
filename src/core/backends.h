// Entry points each backend provides (one op per file under src/<backend>/). Arguments arrive
// validated by src/api/; kernels throw fmkv::Error for what only they can detect.
#pragma once
#include <string>

#include "ops.h"

namespace fmkv {
namespace cpu {
void append(const AppendArgs& a);
void decode_attention(const AttentionArgs& a);
std::string device_name();  // CPU model and the SIMD level selected at run time
}  // namespace cpu
namespace cuda {
bool available();
std::string device_name();
// Host-side checks done, arrays are device pointers: kernels bounds-check block tables.
void append(const AppendArgs& a);
void decode_attention(const AttentionArgs& a);
// Fused decode step: append ap's rows, then attend a.q over the cache including them, in one
// attention launch (a.batch.seq_lens: lengths before the append).
void append_attention(const AppendArgs& ap, const AttentionArgs& a);
void* alloc(size_t bytes);
void free(void* p);
void copy(void* dst, const void* src, size_t bytes, bool to_device);
void synchronize();
int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows,
                                  int32_t num_seqs, int64_t max_seq_len);
}  // namespace cuda
namespace metal {  // src/metal/backend.mm (Apple only); unified memory: host validation applies
bool available();
std::string device_name();
void append(const AppendArgs& a);
void decode_attention(const AttentionArgs& a);
void* alloc(size_t bytes);
void free(void* p);
void copy(void* dst, const void* src, size_t bytes, bool to_device);
void synchronize();
int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows,
                                  int32_t num_seqs, int64_t max_seq_len);
}  // namespace metal
}  // namespace fmkv
