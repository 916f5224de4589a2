// The C API: validation, dispatch to a backend, exceptions turned into status codes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../core/backends.h"
#include "../core/quant_math.h"
#include "../ref/append.h"
#include "../ref/decode_attention.h"
#include "../ref/quantize.h"
#include "fmkv/fmkv.h"
#include "validate.h"
#ifdef FMKV_WITH_METAL
#include "../metal/backend.h"
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace {
thread_local std::string g_last_error;

template <typename F>
fmkv_status guarded(F&& f) {
  try {
    f();
    g_last_error.clear();
    return FMKV_OK;
  } catch (const fmkv::Error& e) {
    g_last_error = e.what();
    return (fmkv_status)e.code();
  } catch (const std::bad_alloc&) {
    g_last_error = "out of host memory";
    return FMKV_ERR_INTERNAL;
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
    return FMKV_ERR_INTERNAL;
  }
}

void require(bool ok, int code, const std::string& msg) {
  if (!ok) throw fmkv::Error(code, msg);
}

void require_backend(fmkv_backend b) {
  require(b >= FMKV_BACKEND_REF && b <= FMKV_BACKEND_METAL, FMKV_ERR_INVALID_ARGUMENT,
          "unknown backend " + std::to_string((int)b));
  require(fmkv_backend_available(b), FMKV_ERR_UNSUPPORTED,
          std::string("backend '") + fmkv_backend_name(b) + "' is not compiled into this build or has no usable device");
}
}  // namespace

namespace fmkv {
void set_last_error(const std::string& msg) { g_last_error = msg; }  // used by src/io (snapshots)
}  // namespace fmkv

extern "C" {

const char* fmkv_version(void) { return FMKV_VERSION; }
int fmkv_format_version(void) { return FMKV_FORMAT_VERSION; }
const char* fmkv_last_error(void) { return g_last_error.c_str(); }

const char* fmkv_backend_name(fmkv_backend b) {
  switch (b) {
    case FMKV_BACKEND_REF: return "ref";
    case FMKV_BACKEND_CPU: return "cpu";
    case FMKV_BACKEND_CUDA: return "cuda";
    case FMKV_BACKEND_METAL: return "metal";
  }
  return "unknown";
}

int fmkv_backend_available(fmkv_backend b) {
  switch (b) {
    case FMKV_BACKEND_REF: return 1;
    case FMKV_BACKEND_CPU:
#ifdef FMKV_WITH_CPU
      return 1;
#else
      return 0;
#endif
    case FMKV_BACKEND_CUDA:
#ifdef FMKV_WITH_CUDA
      return fmkv::cuda::available() ? 1 : 0;
#else
      return 0;
#endif
    case FMKV_BACKEND_METAL:
#ifdef FMKV_WITH_METAL
      return fmkv::metal::available() ? 1 : 0;
#else
      return 0;
#endif
  }
  return 0;
}

const char* fmkv_backend_device(fmkv_backend b) {
  static thread_local std::string name;
  name.clear();
  if (b == FMKV_BACKEND_REF) name = "host (scalar reference)";
#ifdef FMKV_WITH_CPU
  if (b == FMKV_BACKEND_CPU) name = fmkv::cpu::device_name();
#endif
#ifdef FMKV_WITH_CUDA
  if (b == FMKV_BACKEND_CUDA && fmkv::cuda::available()) name = fmkv::cuda::device_name();
#endif
#ifdef FMKV_WITH_METAL
  if (b == FMKV_BACKEND_METAL && fmkv::metal::available()) name = fmkv::metal::device_name();
#endif
  return name.c_str();
}

int64_t fmkv_host_memory_bytes(void) {
  int64_t bytes = 0;
#if defined(__unix__) || defined(__APPLE__)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 && pages <= INT64_MAX / page) bytes = (int64_t)pages * page;
#endif
#if defined(__linux__)
  // A cgroup limit below the physical memory is where the OOM killer acts (v2, then v1).
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    if (FILE* f = std::fopen(path, "r")) {
      long long v = 0;
      const bool ok = std::fscanf(f, "%lld", &v) == 1;  // "max" (no limit) does not parse
      std::fclose(f);
      if (ok && v > 0 && (bytes == 0 || v < bytes)) bytes = v;
      break;
    }
  }
#endif
  return bytes;
}

void fmkv_config_default(fmkv_config* c) {
  std::memset(c, 0, sizeof *c);
  c->head_dim = 128;
  c->num_kv_heads = 8;
  c->k_bits = 3;
  c->v_bits = 3;
  c->page_size = 64;
  c->scale_rule = FMKV_SCALE_LSQ;
}

fmkv_status fmkv_config_validate(const fmkv_config* c) {
  return guarded([&] {
    require(c != nullptr, FMKV_ERR_INVALID_ARGUMENT, "config is NULL");
    fmkv::validate_config(*c);
  });
}

int64_t fmkv_config_page_bytes(const fmkv_config* c) {
  if (fmkv_config_validate(c) != FMKV_OK) return -1;
  return fmkv::page_bytes(*c);
}

int64_t fmkv_config_fp16_slot_bytes(const fmkv_config* c) {
  if (fmkv_config_validate(c) != FMKV_OK) return -1;
  return 2LL * 2 * c->num_kv_heads * fmkv::fp16_slots(*c) * c->head_dim;
}

fmkv_status fmkv_append(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                        const fmkv_batch* batch, const fmkv_tensor* k, const fmkv_tensor* v,
                        void* stream) {
  return guarded([&] {
    require(cfg && layer && batch && k && v, FMKV_ERR_INVALID_ARGUMENT, "fmkv_append: NULL argument");
    require_backend(b);
    fmkv::AppendArgs a{*cfg, *layer, *batch, *k, *v, stream};
    fmkv::validate_append_shapes(a);
    if (b == FMKV_BACKEND_CUDA) {
#ifdef FMKV_WITH_CUDA
      fmkv::cuda::append(a);
#endif
      return;
    }
    fmkv::validate_append_host(a);  // ref, cpu and metal (unified memory) arrays are host-visible
    if (b == FMKV_BACKEND_REF) fmkv::ref::append(a);
#ifdef FMKV_WITH_METAL
    if (b == FMKV_BACKEND_METAL) fmkv::metal::append(a);
#endif
#ifdef FMKV_WITH_CPU
    if (b == FMKV_BACKEND_CPU) fmkv::cpu::append(a);
#endif
  });
}

fmkv_status fmkv_attention(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                           const fmkv_batch* batch, const fmkv_tensor* q,
                           const fmkv_attention_opts* opts, fmkv_tensor* out, void* workspace,
                           size_t workspace_bytes, void* stream) {
  return guarded([&] {
    require(cfg && layer && batch && q && out, FMKV_ERR_INVALID_ARGUMENT, "fmkv_attention: NULL argument");
    require_backend(b);
    fmkv_attention_opts o = opts ? *opts : fmkv_attention_opts{0.0f, 0.0f, 0};
    fmkv::AttentionArgs a{*cfg, *layer, *batch, *q, *out, o, workspace, workspace_bytes, stream};
    fmkv::validate_attention_shapes(a);
    if (b == FMKV_BACKEND_CUDA) {
#ifdef FMKV_WITH_CUDA
      fmkv::cuda::decode_attention(a);
#endif
      return;
    }
    fmkv::validate_attention_host(a);
    if (b == FMKV_BACKEND_REF) fmkv::ref::decode_attention(a);
#ifdef FMKV_WITH_METAL
    if (b == FMKV_BACKEND_METAL) fmkv::metal::decode_attention(a);
#endif
#ifdef FMKV_WITH_CPU
    if (b == FMKV_BACKEND_CPU) fmkv::cpu::decode_attention(a);
#endif
  });
}

fmkv_status fmkv_append_attention(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                                  const fmkv_batch* batch, const fmkv_tensor* k, const fmkv_tensor* v,
                                  const fmkv_tensor* q, const fmkv_attention_opts* opts, fmkv_tensor* out,
                                  void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    require(cfg && layer && batch && k && v && q && out, FMKV_ERR_INVALID_ARGUMENT, "fmkv_append_attention: NULL argument");
    require_backend(b);
    fmkv_attention_opts o = opts ? *opts : fmkv_attention_opts{0.0f, 0.0f, 0};
    fmkv::AppendArgs ap{*cfg, *layer, *batch, *k, *v, stream};
    fmkv::validate_append_shapes(ap);
    require(k->rows == q->rows, FMKV_ERR_INVALID_ARGUMENT,
            "fmkv_append_attention: k has " + std::to_string(k->rows) + " rows but q has " + std::to_string(q->rows) +
                " (one query row per appended token)");
    if (b == FMKV_BACKEND_CUDA) {
      fmkv::AttentionArgs a{*cfg, *layer, *batch, *q, *out, o, workspace, workspace_bytes, stream};
      fmkv::validate_attention_shapes(a);
#ifdef FMKV_WITH_CUDA
      fmkv::cuda::append_attention(ap, a);
#endif
      return;
    }
    // Host-visible arrays: check everything (with the lengths after the append) before writing.
    fmkv::validate_append_host(ap);
    std::vector<int64_t> after((size_t)batch->num_seqs);
    for (int32_t s = 0; s < batch->num_seqs; ++s) {
      const int64_t rows = batch->row_offsets[s + 1] - batch->row_offsets[s];
      require(rows <= FMKV_FUSED_MAX_ROWS, FMKV_ERR_INVALID_ARGUMENT,
              "fmkv_append_attention: sequence " + std::to_string(s) + ": " + std::to_string(rows) +
                  " rows, but the fused call takes at most " + std::to_string(FMKV_FUSED_MAX_ROWS) +
                  " per sequence (use fmkv_append, then fmkv_attention)");
      after[(size_t)s] = batch->seq_lens[s] + rows;  // validate_append_host checked for overflow
    }
    fmkv_batch b2 = *batch;
    b2.seq_lens = after.data();
    fmkv::AttentionArgs a{*cfg, *layer, b2, *q, *out, o, workspace, workspace_bytes, stream};
    fmkv::validate_attention_shapes(a);
    fmkv::validate_attention_host(a);
    if (b == FMKV_BACKEND_REF) {
      fmkv::ref::append(ap);
      fmkv::ref::decode_attention(a);
    }
#ifdef FMKV_WITH_METAL
    if (b == FMKV_BACKEND_METAL) {
      fmkv::metal::append(ap);
      fmkv::metal::decode_attention(a);
    }
#endif
#ifdef FMKV_WITH_CPU
    if (b == FMKV_BACKEND_CPU) {
      fmkv::cpu::append(ap);
      fmkv::cpu::decode_attention(a);
    }
#endif
  });
}

int64_t fmkv_attention_workspace_bytes(fmkv_backend b, const fmkv_config* cfg, int32_t q_heads,
                                       int64_t max_rows, int32_t num_seqs, int64_t max_seq_len) {
#ifdef FMKV_WITH_CUDA
  if (b == FMKV_BACKEND_CUDA && cfg && fmkv_config_validate(cfg) == FMKV_OK)
    return fmkv::cuda::attention_workspace_bytes(*cfg, q_heads, max_rows, num_seqs, max_seq_len);
#endif
#ifdef FMKV_WITH_METAL
  if (b == FMKV_BACKEND_METAL && cfg && fmkv_config_validate(cfg) == FMKV_OK)
    return fmkv::metal::attention_workspace_bytes(*cfg, q_heads, max_rows, num_seqs, max_seq_len);
#endif
  (void)b; (void)cfg; (void)q_heads; (void)max_rows; (void)num_seqs; (void)max_seq_len;
  return 0;
}

void* fmkv_device_alloc(fmkv_backend b, size_t bytes) {
#ifdef FMKV_WITH_CUDA
  if (b == FMKV_BACKEND_CUDA) return fmkv_backend_available(b) ? fmkv::cuda::alloc(bytes) : nullptr;
#endif
#ifdef FMKV_WITH_METAL
  if (b == FMKV_BACKEND_METAL) return fmkv_backend_available(b) ? fmkv::metal::alloc(bytes) : nullptr;
#endif
  return b == FMKV_BACKEND_REF || b == FMKV_BACKEND_CPU ? std::malloc(bytes ? bytes : 1) : nullptr;
}

void fmkv_device_free(fmkv_backend b, void* p) {
#ifdef FMKV_WITH_CUDA
  if (b == FMKV_BACKEND_CUDA) { fmkv::cuda::free(p); return; }
#endif
#ifdef FMKV_WITH_METAL
  if (b == FMKV_BACKEND_METAL) { fmkv::metal::free(p); return; }
#endif
  if (b == FMKV_BACKEND_REF || b == FMKV_BACKEND_CPU) std::free(p);
}

fmkv_status fmkv_device_copy(fmkv_backend b, void* dst, const void* src, size_t bytes, int to_device) {
  return guarded([&] {
    require_backend(b);
    if (bytes == 0) return;
    require(dst && src, FMKV_ERR_INVALID_ARGUMENT, "fmkv_device_copy: NULL pointer");
#ifdef FMKV_WITH_CUDA
    if (b == FMKV_BACKEND_CUDA) { fmkv::cuda::copy(dst, src, bytes, to_device != 0); return; }
#endif
#ifdef FMKV_WITH_METAL
    if (b == FMKV_BACKEND_METAL) { fmkv::metal::copy(dst, src, bytes, to_device != 0); return; }
#endif
    std::memcpy(dst, src, bytes);
  });
}

fmkv_status fmkv_device_synchronize(fmkv_backend b) {
  return guarded([&] {
    require_backend(b);
#ifdef FMKV_WITH_CUDA
    if (b == FMKV_BACKEND_CUDA) fmkv::cuda::synchronize();
#endif
#ifdef FMKV_WITH_METAL
    if (b == FMKV_BACKEND_METAL) fmkv::metal::synchronize();
#endif
  });
}

fmkv_status fmkv_quantize_vector(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer,
                                 const uint16_t* x, uint8_t* codes, uint16_t* scales) {
  return guarded([&] {
    require(x && codes && scales, FMKV_ERR_INVALID_ARGUMENT, "fmkv_quantize_vector: NULL argument");
    require(fmkv_head_dim_supported(d), FMKV_ERR_INVALID_ARGUMENT, "head_dim " + std::to_string(d) + " is not supported (64, 128, 256)");
    require(fmkv_code_bits_supported(bits), FMKV_ERR_INVALID_ARGUMENT, "bits " + std::to_string(bits) + " is not supported (2, 3, 4)");
    require(rule == FMKV_SCALE_RMS || rule == FMKV_SCALE_LSQ, FMKV_ERR_INVALID_ARGUMENT, "unknown scale_rule");
    for (int32_t i = 0; i < d; ++i)
      require(fmkv::f16_is_finite(x[i]), FMKV_ERR_NON_FINITE, "x[" + std::to_string(i) + "] is NaN or Inf");
    auto sw = fmkv::ref::sign_words(seed, layer, d);
    fmkv::ref::quantize_vector(x, d, bits, rule, sw.data(), codes, scales);
  });
}

fmkv_status fmkv_dequantize_vector(int32_t d, int32_t bits, uint64_t seed, int32_t layer,
                                   const uint8_t* codes, const uint16_t* scales, float* out) {
  return guarded([&] {
    require(codes && scales && out, FMKV_ERR_INVALID_ARGUMENT, "fmkv_dequantize_vector: NULL argument");
    require(fmkv_head_dim_supported(d), FMKV_ERR_INVALID_ARGUMENT, "head_dim " + std::to_string(d) + " is not supported (64, 128, 256)");
    require(fmkv_code_bits_supported(bits), FMKV_ERR_INVALID_ARGUMENT, "bits " + std::to_string(bits) + " is not supported (2, 3, 4)");
    for (int32_t i = 0; i < d; ++i)
      require(codes[i] < (1u << bits), FMKV_ERR_INVALID_ARGUMENT, "code " + std::to_string(codes[i]) + " does not fit in " + std::to_string(bits) + " bits");
    auto sw = fmkv::ref::sign_words(seed, layer, d);
    std::vector<double> y(d), x(d);
    fmkv::ref::dequantize_vector(codes, scales, d, bits, y.data());
    fmkv::ref::unrotate_f64(y.data(), d, sw.data(), x.data());
    for (int32_t i = 0; i < d; ++i) out[i] = (float)x[i];
  });
}

fmkv_status fmkv_codebook(int32_t bits, float* mags) {
  return guarded([&] {
    require(mags != nullptr, FMKV_ERR_INVALID_ARGUMENT, "mags is NULL");
    require(bits >= 1 && bits <= FMKV_CODEBOOK_MAX_BITS, FMKV_ERR_INVALID_ARGUMENT, "bits must be 1..4");
    for (int m = 0; m < fmkv::magnitude_count(bits); ++m) mags[m] = fmkv::codebook_mag(bits, m);
  });
}

}  // extern "C"
