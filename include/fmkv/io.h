/* fmkv snapshots: save a compressed cache (or a prefix of its sequences) to a versioned,
 * checksummed, memory-mappable file and load it back (prompt / prefix caching).
 * docs/FILE-FORMAT.md defines the file. All functions return FMKV_OK or an error code with
 * fmkv_last_error() naming the problem; on error nothing is written (save leaves no file behind,
 * load returns no snapshot).
 *
 * Memory: both directions work on HOST memory. To save a CUDA cache, download the page pools and
 * fp16 regions first (fmkv_device_copy(..., to_device = 0)); to use a loaded snapshot on CUDA,
 * allocate device pools of fmkv_snapshot_info.num_pages pages and upload each layer's pages and
 * fp16 regions (the block tables are host arrays too). */
#ifndef FMKV_IO_H
#define FMKV_IO_H

#include "fmkv/fmkv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FMKV_FILE_VERSION 1 /* version of the snapshot container (docs/FILE-FORMAT.md) */

/* ---- save ------------------------------------------------------------------------------------ */

/* One sequence to save. Its cached tokens [0, num_tokens) are written (a prefix when num_tokens
 * is less than the cached length; -1 = everything cached). */
typedef struct fmkv_save_sequence {
  int32_t slot;                /* fp16 region slot of the sequence in the layers */
  int64_t seq_len;             /* tokens cached in every layer */
  const int64_t* layer_lens;   /* optional [num_layers]: per-layer lengths (NULL: seq_len everywhere) */
  int64_t num_tokens;          /* prefix length to save, <= every layer's length; -1: the shortest layer's length */
  const int32_t* block_table;  /* the sequence's pages (page j holds compressed tokens [jP, (j+1)P)) */
  int64_t block_table_len;     /* entries in block_table */
} fmkv_save_sequence;

/* Save flags. */
#define FMKV_SAVE_ALLOW_DEQUANTIZED 1u /* see "prefixes and the fp16 window" in FILE-FORMAT.md */
#define FMKV_SAVE_NO_FSYNC 2u          /* fmkv_save: skip fsync before the atomic rename */

/* Writes `path` atomically (a temporary file in the same directory, renamed over `path` once
 * complete). layers[i] is layer i of the snapshot; its `layer` field (the rotation-sign index) is
 * recorded. Sequence i of the file is seqs[i]. Host memory only (see above). */
fmkv_status fmkv_save(const char* path, const fmkv_config* cfg, int32_t num_layers,
                      const fmkv_layer_cache* layers, int32_t num_seqs, const fmkv_save_sequence* seqs,
                      uint32_t flags);
/* Same bytes into a malloc'ed buffer (*data, *size); release it with fmkv_buffer_free. */
fmkv_status fmkv_save_memory(const fmkv_config* cfg, int32_t num_layers, const fmkv_layer_cache* layers,
                             int32_t num_seqs, const fmkv_save_sequence* seqs, uint32_t flags,
                             void** data, size_t* size);
void fmkv_buffer_free(void* data);

/* ---- load ------------------------------------------------------------------------------------ */

typedef struct fmkv_snapshot fmkv_snapshot; /* a validated, loaded snapshot (owns its memory) */

typedef enum fmkv_load_mode {
  FMKV_LOAD_COPY = 0, /* read the file into owned, 4096-byte aligned host buffers */
  FMKV_LOAD_MMAP = 1  /* zero copy: pools and fp16 regions point into a MAP_PRIVATE mapping of
                         the file (copy-on-write: appends never modify the file). Falls back to
                         COPY where the OS page size does not divide 4096 or mmap fails;
                         fmkv_snapshot_info.mapped says which. */
} fmkv_load_mode;

/* Load flags. */
#define FMKV_LOAD_REJECT_DEQUANTIZED 1u /* reject snapshots whose window holds dequantized tokens */

typedef struct fmkv_load_options {
  int32_t mode;                      /* fmkv_load_mode */
  uint32_t flags;                    /* FMKV_LOAD_* */
  const fmkv_config* expect_config;  /* NULL, or every field (seed too) must match the file's */
  int32_t expect_num_layers;         /* 0, or the file's layer count must match */
  int64_t extra_pages;               /* zeroed free pages appended to every layer's pool, page
                                        indices [file_pages, file_pages + extra_pages), for appends */
} fmkv_load_options;

void fmkv_load_options_default(fmkv_load_options* opts); /* COPY, no checks, no extra pages */

/* Validates the whole file (magic, versions, header/section-table/section checksums, sizes,
 * section bounds, geometry, sequence records, block tables) before exposing anything. */
fmkv_status fmkv_load(const char* path, const fmkv_load_options* opts, fmkv_snapshot** out);
/* From bytes in memory (always copies; data may be freed afterwards; mode is ignored). */
fmkv_status fmkv_load_memory(const void* data, size_t size, const fmkv_load_options* opts,
                             fmkv_snapshot** out);
void fmkv_snapshot_free(fmkv_snapshot* s);

typedef struct fmkv_snapshot_info {
  fmkv_config config;
  int32_t num_layers;
  int32_t num_seqs;
  int64_t file_pages;     /* pages per layer stored in the file */
  int64_t num_pages;      /* pages per layer in the loaded pools: file_pages + extra_pages */
  int32_t mapped;         /* 1: zero-copy MAP_PRIVATE mapping, 0: owned copy */
  int32_t file_version;   /* FMKV_FILE_VERSION */
  int32_t format_version; /* the cache's format version, config.format_version (a version-1 file loads as 2) */
  uint32_t flags;         /* bit 0: some sequence has dequantized window tokens */
} fmkv_snapshot_info;

typedef struct fmkv_snapshot_sequence {
  int64_t num_tokens;         /* tokens of the sequence */
  int32_t slot;               /* its fp16 region slot in the loaded layers (= its index) */
  int32_t dequantized_tokens; /* window tokens restored from codes (0 = exact) */
  int64_t num_pages;          /* pages in its block table */
  const int32_t* block_table; /* [num_pages], valid until fmkv_snapshot_free */
} fmkv_snapshot_sequence;

fmkv_status fmkv_snapshot_get_info(const fmkv_snapshot* s, fmkv_snapshot_info* info);
/* FMKV_OK when the snapshot's config equals `expect` in every field (seed too; format_version and scale_group
 * compared as resolved, 0 meaning the default), else FMKV_ERR_INVALID_ARGUMENT naming each field that differs:
 * the check fmkv_load_options.expect_config makes at load, for a snapshot loaded without it. */
fmkv_status fmkv_snapshot_check_config(const fmkv_snapshot* s, const fmkv_config* expect);
/* Layer i of the snapshot (writable host storage, num_slots = num_seqs, `layer` = the saved
 * rotation-sign index), valid until fmkv_snapshot_free. */
fmkv_status fmkv_snapshot_layer(const fmkv_snapshot* s, int32_t i, fmkv_layer_cache* layer);
fmkv_status fmkv_snapshot_get_sequence(const fmkv_snapshot* s, int32_t i, fmkv_snapshot_sequence* seq);
/* All sequences as batch arrays: seq_lens[num_seqs], slots[num_seqs] and a block table
 * [num_seqs][*stride] (rows padded with -1); valid until fmkv_snapshot_free. */
fmkv_status fmkv_snapshot_batch(const fmkv_snapshot* s, const int64_t** seq_lens, const int32_t** slots,
                                const int32_t** block_table, int64_t* stride);

#ifdef __cplusplus
}
#endif
#endif /* FMKV_IO_H */
