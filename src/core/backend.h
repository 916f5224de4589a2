// The interface every backend implements: one table of entry points and capabilities per backend
// (src/<backend>/backend.*), registered by one cmake line (fmkv_register_backend, cmake/backends.cmake)
// and dispatched by the C API (src/api/registry.cpp, src/api/c_api.cpp). Arguments arrive validated
// by src/api/ (shapes always; batch arrays and tensor contents too where host_memory is set);
// kernels throw fmkv::Error for what only they can detect.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "ops.h"

namespace fmkv {

struct BackendOps {
  fmkv_backend id;  // its name: fmkv_backend_name(id) (FMKV_BACKEND_NAMES)
  // Arrays (pages, fp16 regions, batch arrays, tensors) are readable by the host: the C API checks
  // every block-table entry, length and input value before the op writes anything. Otherwise the
  // backend checks device-side arrays itself (CUDA: the device error word, fmkv_device_synchronize).
  bool host_memory;
  // The stated bound of decode attention against the float64 reference: ||out - ref|| / ||ref||
  // for fp32 outputs (the cross-backend tests hold every backend to its own).
  double attention_rel_error;
  bool (*available)();             // compiled and a usable device present
  std::string (*device_name)();    // "" when unavailable
  void (*append)(const AppendArgs& a);
  void (*decode_attention)(const AttentionArgs& a);
  // Fused decode step (a.batch.seq_lens: lengths before the append); nullptr: the C API composes
  // append, then attention, validated as a whole first.
  void (*append_attention)(const AppendArgs& ap, const AttentionArgs& a);
  // Workspace of a decode-attention call; nullptr: the backend needs none.
  int64_t (*attention_workspace_bytes)(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows, int32_t num_seqs,
                                       int64_t max_seq_len);
  // Device memory; nullptr: host memory (malloc / free / memcpy, nothing to synchronize).
  void* (*alloc)(size_t bytes);
  void (*free)(void* p);
  void (*copy)(void* dst, const void* src, size_t bytes, bool to_device);
  void (*synchronize)();
  bool attention_lse;  // decode_attention writes AttentionArgs::lse when requested (fmkv_attention_lse)
  int32_t max_format_version;  // the newest format version (FORMAT.md section 1) its ops write and read
  int32_t max_scale_group;     // the largest fmkv_config.scale_group (FORMAT.md section 4) its ops write and read
  int32_t max_code_bits;       // the widest code (FORMAT.md section 6) of a quantized K or V side its ops write and read
  // Decode attention (and the fused step) of a config the ops read and write: throws FMKV_ERR_UNSUPPORTED naming the
  // combination when this build has no kernel for it (CUDA: the compiled grid); nullptr: every such config.
  void (*check_attention)(const fmkv_config& cfg);
};

// The backend compiled into this build under id b; nullptr when b is not one (unknown or not compiled).
const BackendOps* find_backend(fmkv_backend b);

}  // namespace fmkv
