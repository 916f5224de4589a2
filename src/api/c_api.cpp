// The C API: validation, dispatch to a backend through the registry (src/core/backend.h), exceptions
// turned into status codes (src/core/status.h).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../core/backend.h"
#include "../core/status.h"
#include "fmkv/format_text.hpp"
#include "../format/codebook.h"
#include "../format/numbers.h"
#include "../format/rotation.h"
#include "../ref/quantize.h"
#include "fmkv/fmkv.h"
#include "validate.h"
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace {
using fmkv::BackendOps;
using fmkv::guarded;
using fmkv::require;

// The backend b, compiled and usable, or an error naming why not.
const BackendOps& usable_backend(fmkv_backend b) {
  const BackendOps* ops = fmkv::find_backend(b);
  require((int)b >= 0 && (int)b < FMKV_BACKEND_COUNT, FMKV_ERR_INVALID_ARGUMENT, [&] { return "unknown backend " + std::to_string((int)b); });
  require(ops && ops->available(), FMKV_ERR_UNSUPPORTED,
          [&] { return std::string("backend '") + fmkv_backend_name(b) + "' is not compiled into this build or has no usable device"; });
  return *ops;
}

// Fails with FMKV_ERR_UNSUPPORTED when backend b's `limit` (a BackendOps capability: the newest format version, the
// largest scale group, the widest code) is below `value`, naming the option (`what`, e.g. "format version"; `plural` for the limit)
// and the compiled backends that have it.
void require_capability(fmkv_backend b, const BackendOps& ops, int32_t BackendOps::*limit, int32_t value,
                        const char* what, const char* plural) {
  if (value <= ops.*limit) return;
  std::string which;  // the compiled backends that do
  for (int i = 0; i < FMKV_BACKEND_COUNT; ++i)
    if (const BackendOps* o = fmkv::find_backend((fmkv_backend)i); o && o->*limit >= value)
      which += (which.empty() ? "" : ", ") + std::string(fmkv_backend_name((fmkv_backend)i));
  const std::string v = std::string(what) + " " + std::to_string(value);
  fmkv::fail(fmkv::kUnsupported, v + " is not supported by the '" + fmkv_backend_name(b) + "' backend (it reads and writes " +
                                     plural + " up to " + std::to_string(ops.*limit) + "; " + v + " in this build: " + which + ")");
}

// The widest code of a config's quantized sides (fp16 K has none).
int32_t widest_code_bits(const fmkv_config& cfg) {
  return std::max(cfg.k_bits == FMKV_FP16_BITS ? 0 : cfg.k_bits, cfg.v_bits);
}

// usable_backend(b), for a valid config whose format version, scale group and code widths the backend reads and
// writes.
const BackendOps& backend_for(fmkv_backend b, const fmkv_config& cfg) {
  const BackendOps& ops = usable_backend(b);
  fmkv::validate_config(cfg);
  require_capability(b, ops, &BackendOps::max_format_version, fmkv_resolved_format_version(cfg.format_version),
                     "format version", "format versions");
  require_capability(b, ops, &BackendOps::max_scale_group, fmkv_resolved_scale_group(cfg.scale_group), "scale_group",
                     "scale groups");
  require_capability(b, ops, &BackendOps::max_code_bits, widest_code_bits(cfg), "code width", "code widths");
  return ops;
}

// backend_for(b, cfg), for a config whose decode attention (and fused step) b has in this build.
const BackendOps& attention_backend_for(fmkv_backend b, const fmkv_config& cfg) {
  const BackendOps& ops = backend_for(b, cfg);
  if (ops.check_attention) ops.check_attention(cfg);
  return ops;
}
}  // namespace

extern "C" {

const char* fmkv_version(void) { return FMKV_VERSION; }
int fmkv_format_version(void) { return FMKV_FORMAT_VERSION; }
const char* fmkv_last_error(void) { return fmkv::last_error().c_str(); }

const char* fmkv_backend_name(fmkv_backend b) {
  static const char* const kNames[FMKV_BACKEND_COUNT] = FMKV_BACKEND_NAMES;
  return (int)b >= 0 && (int)b < FMKV_BACKEND_COUNT ? kNames[b] : "unknown";
}

int fmkv_backend_from_name(const char* name, fmkv_backend* b) {
  for (int i = 0; name && i < FMKV_BACKEND_COUNT; ++i)
    if (std::strcmp(name, fmkv_backend_name((fmkv_backend)i)) == 0) {
      if (b) *b = (fmkv_backend)i;
      return 1;
    }
  return 0;
}

int fmkv_backend_available(fmkv_backend b) {
  const BackendOps* ops = fmkv::find_backend(b);
  return ops && ops->available() ? 1 : 0;
}

const char* fmkv_backend_device(fmkv_backend b) {
  static thread_local std::string name;
  const BackendOps* ops = fmkv::find_backend(b);
  name = ops && ops->available() ? ops->device_name() : "";
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

fmkv_status fmkv_backend_check_config(fmkv_backend b, const fmkv_config* c) {
  return guarded([&] {
    require(c != nullptr, FMKV_ERR_INVALID_ARGUMENT, "config is NULL");
    backend_for(b, *c);
  });
}

fmkv_status fmkv_backend_check_attention(fmkv_backend b, const fmkv_config* c) {
  return guarded([&] {
    require(c != nullptr, FMKV_ERR_INVALID_ARGUMENT, "config is NULL");
    attention_backend_for(b, *c);
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
    const BackendOps& ops = backend_for(b, *cfg);
    fmkv::AppendArgs a{*cfg, *layer, *batch, *k, *v, stream};
    fmkv::validate_append_shapes(a);
    if (ops.host_memory) fmkv::validate_append_host(a);
    ops.append(a);
  });
}

fmkv_status fmkv_attention(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                           const fmkv_batch* batch, const fmkv_tensor* q,
                           const fmkv_attention_opts* opts, fmkv_tensor* out, void* workspace,
                           size_t workspace_bytes, void* stream) {
  return guarded([&] {
    require(cfg && layer && batch && q && out, FMKV_ERR_INVALID_ARGUMENT, "fmkv_attention: NULL argument");
    const BackendOps& ops = attention_backend_for(b, *cfg);
    fmkv_attention_opts o = opts ? *opts : fmkv_attention_opts{0.0f, 0.0f, 0};
    fmkv::AttentionArgs a{*cfg, *layer, *batch, *q, *out, o, workspace, workspace_bytes, stream};
    fmkv::validate_attention_shapes(a);
    if (ops.host_memory) fmkv::validate_attention_host(a);
    ops.decode_attention(a);
  });
}

fmkv_status fmkv_attention_lse(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                               const fmkv_batch* batch, const fmkv_tensor* q, const fmkv_attention_opts* opts,
                               fmkv_tensor* out, fmkv_tensor* lse, void* workspace, size_t workspace_bytes,
                               void* stream) {
  return guarded([&] {
    require(cfg && layer && batch && q && out && lse, FMKV_ERR_INVALID_ARGUMENT, "fmkv_attention_lse: NULL argument");
    const BackendOps& ops = attention_backend_for(b, *cfg);
    require(ops.attention_lse, FMKV_ERR_UNSUPPORTED, [&] {
      std::string which;  // the compiled backends that do
      for (int i = 0; i < FMKV_BACKEND_COUNT; ++i)
        if (const BackendOps* o = fmkv::find_backend((fmkv_backend)i); o && o->attention_lse)
          which += (which.empty() ? "" : ", ") + std::string(fmkv_backend_name((fmkv_backend)i));
      return std::string("fmkv_attention_lse: the ") + fmkv_backend_name(b) +
             " backend does not return the softmax log-denominator (in this build: " + which + ")";
    });
    fmkv_attention_opts o = opts ? *opts : fmkv_attention_opts{0.0f, 0.0f, 0};
    fmkv::AttentionArgs a{*cfg, *layer, *batch, *q, *out, o, workspace, workspace_bytes, stream, *lse};
    fmkv::validate_attention_shapes(a);
    fmkv::validate_attention_lse(a);
    if (ops.host_memory) fmkv::validate_attention_host(a);
    ops.decode_attention(a);
  });
}

fmkv_status fmkv_append_attention(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                                  const fmkv_batch* batch, const fmkv_tensor* k, const fmkv_tensor* v,
                                  const fmkv_tensor* q, const fmkv_attention_opts* opts, fmkv_tensor* out,
                                  void* workspace, size_t workspace_bytes, void* stream) {
  return guarded([&] {
    require(cfg && layer && batch && k && v && q && out, FMKV_ERR_INVALID_ARGUMENT, "fmkv_append_attention: NULL argument");
    const BackendOps& ops = attention_backend_for(b, *cfg);
    fmkv_attention_opts o = opts ? *opts : fmkv_attention_opts{0.0f, 0.0f, 0};
    fmkv::AppendArgs ap{*cfg, *layer, *batch, *k, *v, stream};
    fmkv::validate_append_shapes(ap);
    require(k->rows == q->rows, FMKV_ERR_INVALID_ARGUMENT,
            [&] { return "fmkv_append_attention: k has " + std::to_string(k->rows) + " rows but q has " + std::to_string(q->rows) +
                " (one query row per appended token)"; });
    if (!ops.host_memory) {  // device arrays: the backend checks them (and the row limit) itself
      fmkv::AttentionArgs a{*cfg, *layer, *batch, *q, *out, o, workspace, workspace_bytes, stream};
      fmkv::validate_attention_shapes(a);
      require(ops.append_attention != nullptr, FMKV_ERR_UNSUPPORTED,
              [&] { return std::string("fmkv_append_attention: backend '") + fmkv_backend_name(b) + "' has no fused step"; });
      ops.append_attention(ap, a);
      return;
    }
    // Host-visible arrays: check everything (with the lengths after the append) before writing.
    fmkv::validate_append_host(ap);
    std::vector<int64_t> after((size_t)batch->num_seqs);
    for (int32_t s = 0; s < batch->num_seqs; ++s) {
      const int64_t rows = batch->row_offsets[s + 1] - batch->row_offsets[s];
      require(rows <= FMKV_FUSED_MAX_ROWS, FMKV_ERR_INVALID_ARGUMENT,
              [&] { return "fmkv_append_attention: sequence " + std::to_string(s) + ": " + std::to_string(rows) +
                  " rows, but the fused call takes at most " + std::to_string(FMKV_FUSED_MAX_ROWS) +
                  " per sequence (use fmkv_append, then fmkv_attention)"; });
      after[(size_t)s] = batch->seq_lens[s] + rows;  // validate_append_host checked for overflow
    }
    fmkv_batch b2 = *batch;
    b2.seq_lens = after.data();
    fmkv::AttentionArgs a{*cfg, *layer, b2, *q, *out, o, workspace, workspace_bytes, stream};
    fmkv::validate_attention_shapes(a);
    fmkv::validate_attention_host(a);
    if (ops.append_attention) {
      fmkv::AttentionArgs before = a;
      before.batch = *batch;
      ops.append_attention(ap, before);
    } else {
      ops.append(ap);
      ops.decode_attention(a);
    }
  });
}

int64_t fmkv_attention_workspace_bytes(fmkv_backend b, const fmkv_config* cfg, int32_t q_heads,
                                       int64_t max_rows, int32_t num_seqs, int64_t max_seq_len) {
  const BackendOps* ops = fmkv::find_backend(b);
  if (!ops || !ops->attention_workspace_bytes || !cfg || fmkv_config_validate(cfg) != FMKV_OK ||
      fmkv_resolved_format_version(cfg->format_version) > ops->max_format_version ||
      fmkv_resolved_scale_group(cfg->scale_group) > ops->max_scale_group || widest_code_bits(*cfg) > ops->max_code_bits)
    return 0;
  return ops->attention_workspace_bytes(*cfg, q_heads, max_rows, num_seqs, max_seq_len);
}

void* fmkv_device_alloc(fmkv_backend b, size_t bytes) {
  const BackendOps* ops = fmkv::find_backend(b);
  if (!ops || !ops->available()) return nullptr;
  return ops->alloc ? ops->alloc(bytes) : std::malloc(bytes ? bytes : 1);
}

void fmkv_device_free(fmkv_backend b, void* p) {
  const BackendOps* ops = fmkv::find_backend(b);
  if (!ops) return;
  if (ops->free) ops->free(p);
  else std::free(p);
}

fmkv_status fmkv_device_copy(fmkv_backend b, void* dst, const void* src, size_t bytes, int to_device) {
  return guarded([&] {
    const BackendOps& ops = usable_backend(b);
    if (bytes == 0) return;
    require(dst && src, FMKV_ERR_INVALID_ARGUMENT, "fmkv_device_copy: NULL pointer");
    if (ops.copy) ops.copy(dst, src, bytes, to_device != 0);
    else std::memcpy(dst, src, bytes);
  });
}

fmkv_status fmkv_device_synchronize(fmkv_backend b) {
  return guarded([&] {
    const BackendOps& ops = usable_backend(b);
    if (ops.synchronize) ops.synchronize();
  });
}

namespace {
// Checks shared by the format primitives below (one message each).
void require_format_version(int32_t format_version) {
  require(format_version == 0 || fmkv_format_version_supported(format_version), FMKV_ERR_INVALID_ARGUMENT,
          [&] { return "format_version " + std::to_string(format_version) + " is not supported (0 = default, " +
                fmkv::supported_format_versions_text() + ")"; });
}
void require_is_v(int32_t is_v) {
  require(is_v == 0 || is_v == 1, FMKV_ERR_INVALID_ARGUMENT, [&] { return "is_v must be 0 (K) or 1 (V), got " + std::to_string(is_v); });
}
void require_head_dim(int32_t d) {
  require(fmkv_head_dim_supported(d), FMKV_ERR_INVALID_ARGUMENT,
          [&] { return "head_dim " + std::to_string(d) + " is not supported (" + fmkv::supported_head_dims_text() + ")"; });
}
void require_code_bits(int32_t bits) {
  require(fmkv_code_bits_supported(bits), FMKV_ERR_INVALID_ARGUMENT,
          [&] { return "bits " + std::to_string(bits) + " is not supported (" + fmkv::supported_code_bits_text(false) + ")"; });
}
// The codebook table of (format_version, is_v, bits), checked.
int vector_table(int32_t format_version, int32_t is_v, int32_t bits) {
  require_format_version(format_version);
  require_is_v(is_v);
  return fmkv::codebook_table(fmkv_resolved_format_version(format_version), bits, is_v);
}
}  // namespace

// A scale_group argument, checked.
void require_scale_group(int32_t sg) {
  require(fmkv_scale_group_supported(sg), FMKV_ERR_INVALID_ARGUMENT,
          [&] { return "scale_group " + std::to_string(sg) + " is not supported (0 = default, 32 or 64)"; });
}

fmkv_status fmkv_quantize_vector_as(int32_t format_version, int32_t is_v, int32_t sg, int32_t d, int32_t bits, int32_t rule,
                                    uint64_t seed, int32_t layer, const uint16_t* x, uint8_t* codes, uint16_t* scales) {
  return guarded([&] {
    require(x && codes && scales, FMKV_ERR_INVALID_ARGUMENT, "fmkv_quantize_vector: NULL argument");
    require_head_dim(d);
    require_code_bits(bits);
    require_scale_group(sg);
    require(rule == FMKV_SCALE_RMS || rule == FMKV_SCALE_LSQ, FMKV_ERR_INVALID_ARGUMENT, "unknown scale_rule");
    const int table = vector_table(format_version, is_v, bits);
    for (int32_t i = 0; i < d; ++i)
      require(fmkv::f16_is_finite(x[i]), FMKV_ERR_NON_FINITE, [&] { return "x[" + std::to_string(i) + "] is NaN or Inf"; });
    auto sw = fmkv::ref::sign_words(seed, layer, d);
    fmkv::ref::quantize_vector(x, d, bits, rule, sw.data(), codes, scales, table, sg);
  });
}

fmkv_status fmkv_quantize_vector(int32_t d, int32_t bits, int32_t rule, uint64_t seed, int32_t layer,
                                 const uint16_t* x, uint8_t* codes, uint16_t* scales) {
  return fmkv_quantize_vector_as(2, 0, 0, d, bits, rule, seed, layer, x, codes, scales);
}

fmkv_status fmkv_dequantize_vector_as(int32_t format_version, int32_t is_v, int32_t sg, int32_t d, int32_t bits, uint64_t seed,
                                      int32_t layer, const uint8_t* codes, const uint16_t* scales, float* out) {
  return guarded([&] {
    require(codes && scales && out, FMKV_ERR_INVALID_ARGUMENT, "fmkv_dequantize_vector: NULL argument");
    require_head_dim(d);
    require_code_bits(bits);
    require_scale_group(sg);
    const int table = vector_table(format_version, is_v, bits);
    for (int32_t i = 0; i < d; ++i)
      require(codes[i] < (1u << bits), FMKV_ERR_INVALID_ARGUMENT, [&] { return "code " + std::to_string(codes[i]) + " does not fit in " + std::to_string(bits) + " bits"; });
    auto sw = fmkv::ref::sign_words(seed, layer, d);
    std::vector<double> y(d), x(d);
    fmkv::ref::dequantize_vector(codes, scales, d, bits, y.data(), table, sg);
    fmkv::ref::unrotate_f64(y.data(), d, sw.data(), x.data());
    for (int32_t i = 0; i < d; ++i) out[i] = (float)x[i];
  });
}

fmkv_status fmkv_dequantize_vector(int32_t d, int32_t bits, uint64_t seed, int32_t layer,
                                   const uint8_t* codes, const uint16_t* scales, float* out) {
  return fmkv_dequantize_vector_as(2, 0, 0, d, bits, seed, layer, codes, scales, out);
}

void fmkv_f32_to_f16(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fmkv::f32_to_f16(x[i]);
}
void fmkv_f16_to_f32(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fmkv::f16_to_f32(x[i]);
}
void fmkv_bf16_to_f32(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fmkv::bf16_to_f32(x[i]);
}

fmkv_status fmkv_codebook(int32_t bits, float* mags) {
  return guarded([&] {
    require(mags != nullptr, FMKV_ERR_INVALID_ARGUMENT, "mags is NULL");
    require(bits >= 1 && bits <= FMKV_CODEBOOK_MAX_BITS, FMKV_ERR_INVALID_ARGUMENT, [&] { return "bits must be 1.." + std::to_string(FMKV_CODEBOOK_MAX_BITS); });
    for (int m = 0; m < fmkv::magnitude_count(bits); ++m) mags[m] = fmkv::codebook_mag(bits, m);
  });
}

fmkv_status fmkv_codebook_levels(int32_t format_version, int32_t bits, int32_t is_v, float* mags) {
  return guarded([&] {
    require(mags != nullptr, FMKV_ERR_INVALID_ARGUMENT, "mags is NULL");
    require_format_version(format_version);
    require_code_bits(bits);
    require_is_v(is_v);
    const int table = fmkv::codebook_table(fmkv_resolved_format_version(format_version), bits, is_v);
    for (int m = 0; m < fmkv::magnitude_count(bits); ++m) mags[m] = fmkv::table_mag(table, bits, m);
  });
}

}  // extern "C"
