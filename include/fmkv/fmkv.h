/* fmkv C API: compressed KV cache (Hadamard rotation + Lloyd-Max codes, 2-4 bits) and attention
 * directly on it. Every function returns FMKV_OK or an error code; fmkv_last_error() then names
 * the problem (thread-local). Nothing is written on error, except: a CUDA append that fails on a
 * device-detected error may already have written compressed token slots at or past the sequence's
 * compressed length (slots nothing reads until a successful append rewrites them); the visible
 * cache -- tokens below the length, sink and window -- is unchanged (docs/FORMAT.md section 2). */
#ifndef FMKV_H
#define FMKV_H

#include "fmkv/format.h"
#include "fmkv/params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FMKV_VERSION "0.1.0"

typedef enum fmkv_status {
  FMKV_OK = 0,
  FMKV_ERR_INVALID_ARGUMENT = 1, /* shape, dtype, bits, head_dim, stride, null pointer */
  FMKV_ERR_OUT_OF_RANGE = 2,     /* page table entry, slot or length outside the storage */
  FMKV_ERR_NON_FINITE = 3,       /* NaN/Inf or beyond-fp16 value in K/V, NaN/Inf in Q */
  FMKV_ERR_OVERFLOW = 4,         /* a size or offset does not fit the index types */
  FMKV_ERR_UNSUPPORTED = 5,      /* backend or combination not compiled / not available */
  FMKV_ERR_BACKEND = 6,          /* CUDA/Metal runtime failure */
  FMKV_ERR_INTERNAL = 7
} fmkv_status;

const char* fmkv_version(void);
int fmkv_format_version(void);
const char* fmkv_last_error(void);
/* "ref", "cpu", "cuda", "metal" (FMKV_BACKEND_NAMES); "unknown" for another value. */
const char* fmkv_backend_name(fmkv_backend b);
/* The id named `name` into *b: 1, or 0 when no backend has that name (compiled or not). */
int fmkv_backend_from_name(const char* name, fmkv_backend* b);
/* 1 if compiled in and a device is usable, 0 otherwise. */
int fmkv_backend_available(fmkv_backend b);
/* Human-readable device name of a backend ("" when unavailable). */
const char* fmkv_backend_device(fmkv_backend b);

/* Bytes of memory this process may use on the host: the physical memory, or the cgroup memory limit
 * when lower (Linux); 0 when unknown. HostCache refuses a cache larger than this. */
int64_t fmkv_host_memory_bytes(void);

/* Defaults: head_dim 128, 8 kv heads, k3v3, page 64, no sink/window, LSQ scales, seed 0. */
void fmkv_config_default(fmkv_config* cfg);
fmkv_status fmkv_config_validate(const fmkv_config* cfg);
/* FMKV_OK when backend b is usable and its ops read and write caches of this valid config (its format version,
 * scale group and code widths); otherwise the error every op of b would return for it (FMKV_ERR_UNSUPPORTED naming
 * the option and the backends that have it, FMKV_ERR_INVALID_ARGUMENT for an invalid config). */
fmkv_status fmkv_backend_check_config(fmkv_backend b, const fmkv_config* cfg);
/* FMKV_OK when fmkv_backend_check_config accepts (b, cfg) and b's decode attention (fmkv_attention,
 * fmkv_attention_lse, fmkv_append_attention) has a kernel for cfg in this build; otherwise the error those calls
 * would return (FMKV_ERR_UNSUPPORTED naming the (head_dim, K, V) combination and the compiled ones: a CUDA build
 * compiles a grid of combinations, docs/ARCHITECTURE.md; every other backend has every combination). Appends do
 * not depend on it. */
fmkv_status fmkv_backend_check_attention(fmkv_backend b, const fmkv_config* cfg);
/* Bytes of one page (one layer, all kv heads, K and V), or -1 on an invalid config. */
int64_t fmkv_config_page_bytes(const fmkv_config* cfg);
/* Bytes of the fp16 sink+window region of one sequence slot, K and V, one layer. */
int64_t fmkv_config_fp16_slot_bytes(const fmkv_config* cfg);

/* Append the rows of k and v ([rows][kv_heads][head_dim]) to the batch's sequences. On CUDA,
 * errors the device detects (block table, slot, NaN/Inf) surface at fmkv_device_synchronize. */
fmkv_status fmkv_append(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                        const fmkv_batch* batch, const fmkv_tensor* k, const fmkv_tensor* v,
                        void* stream);

/* out[row][qh][d] = attention of q[row][qh][d] over the cache (causal for multi-row queries). */
fmkv_status fmkv_attention(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                           const fmkv_batch* batch, const fmkv_tensor* q,
                           const fmkv_attention_opts* opts, fmkv_tensor* out, void* workspace,
                           size_t workspace_bytes, void* stream);

/* fmkv_attention that also writes lse[row][qh] (a float32 tensor of q's rows and heads, last dimension 1):
 * the natural log of the softmax denominator, log sum_p exp(s_p) over the row's visible tokens, with the
 * scores s_p scaled (and softcapped) as the softmax sees them. Attention over a union of disjoint token
 * sets is then sum_i w_i out_i with w_i = exp(lse_i - log sum_j exp(lse_j)) (how a context-parallel
 * cache merges the shards of one sequence). Backends: ref, cpu, cuda and metal (the output is fmkv_attention's, bit
 * for bit); a backend without it fails with FMKV_ERR_UNSUPPORTED naming the ones that have it. */
fmkv_status fmkv_attention_lse(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                               const fmkv_batch* batch, const fmkv_tensor* q, const fmkv_attention_opts* opts,
                               fmkv_tensor* out, fmkv_tensor* lse, void* workspace, size_t workspace_bytes,
                               void* stream);

/* One decode step in one call: append the rows of k and v (new tokens) to the batch's sequences
 * and attend q (one query row per new token, causal) over the cache including them -- the same
 * result as fmkv_append followed by fmkv_attention with seq_lens + rows (pages and fp16 regions
 * bit-exact). batch->seq_lens are the lengths BEFORE the append; the caller advances them after.
 * At most FMKV_FUSED_MAX_ROWS rows per sequence (decode, speculative verification); use the two
 * calls for prefill. On CUDA this is one attention launch (plus the merge) instead of an append
 * and an attention; device-detected errors (bad block-table entry, NaN/Inf) leave the failing
 * sequence's visible cache unchanged (the token slots the step was compressing into, at or past its
 * compressed length, may have been written: docs/FORMAT.md section 2) and are returned by
 * fmkv_device_synchronize. Workspace as fmkv_attention. */
#define FMKV_FUSED_MAX_ROWS 16
fmkv_status fmkv_append_attention(fmkv_backend b, const fmkv_config* cfg, const fmkv_layer_cache* layer,
                                  const fmkv_batch* batch, const fmkv_tensor* k, const fmkv_tensor* v,
                                  const fmkv_tensor* q, const fmkv_attention_opts* opts, fmkv_tensor* out,
                                  void* workspace, size_t workspace_bytes, void* stream);

/* Workspace bytes fmkv_attention needs on backend b for at most max_rows query rows of
 * q_heads heads and sequences of at most max_seq_len tokens (0: unknown), i.e. for calls planned with
 * opts.max_seq_len = max_seq_len (0 for host backends). On CUDA it depends on the current device
 * (its SM count: few (sequence, kv head) pairs get more splits) and on the bound (a short one needs
 * fewer splits); a smaller workspace than this is accepted down to one split, with fewer splits. */
int64_t fmkv_attention_workspace_bytes(fmkv_backend b, const fmkv_config* cfg, int32_t q_heads,
                                       int64_t max_rows, int32_t num_seqs, int64_t max_seq_len);

/* Memory of a backend's device (host malloc for ref/cpu): for tests, the CLI and bindings. */
void* fmkv_device_alloc(fmkv_backend b, size_t bytes);
void fmkv_device_free(fmkv_backend b, void* p);
/* to_device = 1: host -> device, 0: device -> host. Synchronous. */
fmkv_status fmkv_device_copy(fmkv_backend b, void* dst, const void* src, size_t bytes, int to_device);
fmkv_status fmkv_device_synchronize(fmkv_backend b);

/* Format primitives on one head vector (host memory, reference arithmetic), with format 2's codebooks. */
fmkv_status fmkv_quantize_vector(int32_t head_dim, int32_t bits, int32_t scale_rule, uint64_t seed,
                                 int32_t layer, const uint16_t* x_f16, uint8_t* codes,
                                 uint16_t* scales);
fmkv_status fmkv_dequantize_vector(int32_t head_dim, int32_t bits, uint64_t seed, int32_t layer,
                                   const uint8_t* codes, const uint16_t* scales, float* x_out);
/* The same for a K (is_v = 0) or V (is_v = 1) vector of a cache in format version format_version (0 = the
 * default) with scale group scale_group (0 = the default; scales: head_dim / scale_group values): format 3's
 * 3-bit codes use its integer-level codebooks (fmkv_codebook_levels). */
fmkv_status fmkv_quantize_vector_as(int32_t format_version, int32_t is_v, int32_t scale_group, int32_t head_dim,
                                    int32_t bits, int32_t scale_rule, uint64_t seed, int32_t layer,
                                    const uint16_t* x_f16, uint8_t* codes, uint16_t* scales);
fmkv_status fmkv_dequantize_vector_as(int32_t format_version, int32_t is_v, int32_t scale_group, int32_t head_dim,
                                      int32_t bits, uint64_t seed, int32_t layer, const uint8_t* codes,
                                      const uint16_t* scales, float* x_out);
/* The format's number conversions (FORMAT.md "Input") of n values: float32 -> fp16 bits rounded to
 * nearest even (overflow gives +-inf, NaN stays NaN), fp16 / bf16 bits -> float32 (exact). */
void fmkv_f32_to_f16(const float* x, uint16_t* out, int64_t n);
void fmkv_f16_to_f32(const uint16_t* x, float* out, int64_t n);
void fmkv_bf16_to_f32(const uint16_t* x, float* out, int64_t n);

/* The 2^(bits-1) positive levels of the b-bit codebook (fp16 values as float), ascending: format 2's,
 * which every width of format 2 and the 2- and 4-bit codes of format 3 use. */
fmkv_status fmkv_codebook(int32_t bits, float* mags);
/* The 2^(bits-1) positive levels (ascending) that b-bit codes of K (is_v = 0) or V (is_v = 1) stand for in
 * format version format_version (0 = FMKV_FORMAT_VERSION): format 3's 3-bit codes use integer levels times
 * an fp16 step, one table for K and one for V (FORMAT.md section 4). */
fmkv_status fmkv_codebook_levels(int32_t format_version, int32_t bits, int32_t is_v, float* mags);

#ifdef __cplusplus
}
#endif
#endif /* FMKV_H */
