/* fmkv kernel parameters: plain structs of raw pointers shared by every backend (no framework
 * headers). Memory is owned by the caller; pointers live on the backend's device.
 * Shapes use [rows][heads][dim] tensors with element strides, 64-bit everywhere. */
#ifndef FMKV_PARAMS_H
#define FMKV_PARAMS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fmkv_dtype { FMKV_F32 = 0, FMKV_F16 = 1, FMKV_BF16 = 2 } fmkv_dtype;

typedef enum fmkv_backend {
  FMKV_BACKEND_REF = 0,   /* scalar reference (the oracle), host memory */
  FMKV_BACKEND_CPU = 1,   /* SIMD + threads, host memory */
  FMKV_BACKEND_CUDA = 2,  /* NVIDIA GPU, device memory, stream-ordered */
  FMKV_BACKEND_METAL = 3, /* Apple GPU */
  FMKV_BACKEND_COUNT      /* number of backend ids (compiled or not) */
} fmkv_backend;
/* fmkv_backend_name() of each id, in id order. */
#define FMKV_BACKEND_NAMES {"ref", "cpu", "cuda", "metal"}

/* Cache-wide format parameters (fixed for the cache's life). */
typedef struct fmkv_config {
  int32_t head_dim;      /* 64, 128, 256 */
  int32_t num_kv_heads;  /* >= 1 */
  int32_t k_bits;        /* 2, 3, 4, 5, or 16 (K kept in fp16) */
  int32_t v_bits;        /* 2, 3, 4, 5 */
  int32_t page_size;     /* tokens per page: power of two in [16, 256] */
  int32_t sink_tokens;   /* first S tokens kept in fp16 (never compressed) */
  int32_t window_tokens; /* last W tokens kept in fp16, compressed as they age out */
  int32_t scale_rule;    /* FMKV_SCALE_LSQ (default) or FMKV_SCALE_RMS */
  uint64_t seed;         /* rotation seed (with the layer index) */
  int32_t format_version; /* 0 (= FMKV_FORMAT_VERSION, 2), 2 or 3 (3-bit codes in tile blocks; FORMAT.md) */
  int32_t scale_group;    /* rotated coordinates per fp16 scale: 0 (= FMKV_SCALE_GROUP, 32), 32 or 64 (FORMAT.md
                             section 4; 64 at head_dim 64 is one scale per vector); every backend has both */
} fmkv_config;

/* One layer's storage. pages: num_pages * fmkv_page_bytes(); fp16_k / fp16_v: sink + window
 * tokens, [num_slots][num_kv_heads][sink + window][head_dim] fp16 (NULL when sink + window == 0).
 * The CUDA backend needs pages, fp16_k and fp16_v 16-byte aligned (cudaMalloc and torch give 256). */
typedef struct fmkv_layer_cache {
  uint8_t* pages;
  int64_t num_pages;
  uint16_t* fp16_k;
  uint16_t* fp16_v;
  int32_t num_slots;
  int32_t layer; /* selects the rotation signs */
} fmkv_layer_cache;

/* A batch of sequences. Rows of the token tensors (new K/V for append, queries for attention)
 * are packed: sequence i owns rows [row_offsets[i], row_offsets[i+1]).
 * seq_lens[i]: for append, tokens already in the cache before the call; for attention, tokens in
 * the cache including the query tokens (appended before attention).
 * block_table[i * block_table_stride + j]: page holding compressed tokens [j*P, (j+1)*P) of
 * sequence i (compressed index = position - sink_tokens). */
typedef struct fmkv_batch {
  int32_t num_seqs;
  const int32_t* slots;       /* [num_seqs] fp16 region slot of each sequence */
  const int64_t* seq_lens;    /* [num_seqs] */
  const int64_t* row_offsets; /* [num_seqs + 1] */
  const int32_t* block_table; /* [num_seqs][block_table_stride] */
  int64_t block_table_stride;
} fmkv_batch;

/* A [rows][heads][dim] tensor with element strides (dim stride is 1). */
typedef struct fmkv_tensor {
  void* data;
  int32_t dtype; /* fmkv_dtype */
  int64_t rows;
  int32_t heads;
  int32_t dim;
  int64_t row_stride;
  int64_t head_stride;
} fmkv_tensor;

/* Attention options. softmax_scale <= 0 means 1/sqrt(head_dim); softcap > 0 applies
 * cap * tanh(score / cap) to scaled scores. max_seq_len > 0 promises that no sequence of the call is
 * longer (attention: seq_lens; fmkv_append_attention: seq_lens + rows): CUDA then plans the call for
 * that length (no empty splits at short contexts; graph-safe: the host never reads the lengths); a
 * longer sequence is an FMKV_ERR_INVALID_ARGUMENT error (CUDA: on the device, reported by
 * fmkv_device_synchronize), never a slower or wrong result. 0: no bound. */
typedef struct fmkv_attention_opts {
  float softmax_scale;
  float softcap;
  int64_t max_seq_len;
} fmkv_attention_opts;

#ifdef __cplusplus
}
#endif
#endif /* FMKV_PARAMS_H */
