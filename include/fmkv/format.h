/* fmkv compressed KV-cache format, version 2: constants, layout arithmetic and token regions.
 *
 * docs/FORMAT.md is normative; this header is its executable form and the public part of the one
 * format core (src/format/ holds the rest: number formats, rotation, codebook, packing, the group
 * quantizer). Every backend (reference, CPU, CUDA, Metal) and the Python binding locate bytes only
 * through these functions. No allocation; the same text compiles as C99, C++, CUDA (host and device:
 * FMKV_HD; nvcc and NVRTC) and MSL (Apple's compiler, the type-check shim and the CPU emulator of tests/metal).
 */
#ifndef FMKV_FORMAT_H
#define FMKV_FORMAT_H

#if defined(__METAL_VERSION__)
/* MSL defines the fixed-width types itself */
#elif defined(__CUDACC_RTC__)
#include <cuda/std/cstdint> /* NVRTC (MLX's cuda_kernel): no C library; libcu++'s fixed-width types */
#else
#include <stdint.h>
#endif

#if defined(__METAL_VERSION__)
#define FMKV_HD inline
#elif defined(__CUDACC__)
#define FMKV_HD __host__ __device__ __forceinline__
#else
#define FMKV_HD static inline
#endif

#if defined(__cplusplus) && !defined(__METAL_VERSION__)
extern "C" {
#endif

#define FMKV_FORMAT_VERSION 2        /* the version of a cache whose fmkv_config.format_version is 0 */
#define FMKV_FORMAT_VERSION_NEWEST 3 /* the newest version a cache can be created in (format_version 2 or 3) */
#define FMKV_GROUP_SIZE 32 /* rotated coordinates per code group (the unit of code words and tile lanes) */
#define FMKV_SCALE_GROUP 32 /* rotated coordinates per fp16 scale of a cache whose fmkv_config.scale_group is 0 */
#define FMKV_FP16_BITS 16  /* k_bits value meaning "K kept in fp16, unrotated" */
#define FMKV_CODE_BITS_MIN 2 /* code widths of a K or V side: FMKV_CODE_BITS_MIN .. FMKV_CODE_BITS_MAX */
#define FMKV_CODE_BITS_MAX 5 /* (tools/gen_codebooks.cpp generates the codebooks of widths 1 .. this) */
#define FMKV_TILED_CODE_BITS 3 /* the width format version 3 stores in tile blocks (fmkv_tiled_codes) */
#define FMKV_MIN_PAGE_SIZE 16
#define FMKV_MAX_PAGE_SIZE 256
#define FMKV_MAX_HEAD_DIM 256 /* largest supported head_dim */
#define FMKV_MAX_SIGN_WORDS (FMKV_MAX_HEAD_DIM / 64) /* rotation sign words of one layer, at most */

/* Scale rule (FORMAT.md "Scale"): how a group's fp16 scale is chosen. */
enum fmkv_scale_rule {
  FMKV_SCALE_RMS = 0, /* scale = RMS of the group */
  FMKV_SCALE_LSQ = 1  /* code with the RMS scale, then least-squares rescale (v1 default) */
};

/* Is v a format version a cache can be created in? (FORMAT.md section 1) */
FMKV_HD int fmkv_format_version_supported(int32_t v) { return v == 2 || v == 3; }
/* The version of a config's format_version field: 0 means FMKV_FORMAT_VERSION. */
FMKV_HD int32_t fmkv_resolved_format_version(int32_t v) { return v == 0 ? FMKV_FORMAT_VERSION : v; }

/* Is head_dim supported by the format? (power of two, 64..256) */
FMKV_HD int fmkv_head_dim_supported(int32_t d) { return d == 64 || d == 128 || d == 256; }
/* Is this a supported code width? (K may also be FMKV_FP16_BITS: kept in fp16) */
FMKV_HD int fmkv_code_bits_supported(int32_t bits) { return bits >= FMKV_CODE_BITS_MIN && bits <= FMKV_CODE_BITS_MAX; }
/* Is page_size supported (a power of two in [FMKV_MIN_PAGE_SIZE, FMKV_MAX_PAGE_SIZE])? */
FMKV_HD int fmkv_page_size_supported(int32_t p) {
  return p >= FMKV_MIN_PAGE_SIZE && p <= FMKV_MAX_PAGE_SIZE && (p & (p - 1)) == 0;
}

FMKV_HD int32_t fmkv_groups(int32_t d) { return d / FMKV_GROUP_SIZE; }

/* ---- scale groups (FORMAT.md section 4, "Scale groups") ------------------------------------------
 * A cache's scale group sg (fmkv_config.scale_group: 0 means FMKV_SCALE_GROUP) is 32 or 64 rotated
 * coordinates: one fp16 scale per code group, or one per two consecutive code groups (d = 64: one scale per
 * vector). Code group g uses scale g >> fmkv_scale_shift(sg); a section stores d / sg scales per token. */
FMKV_HD int fmkv_scale_group_supported(int32_t sg) { return sg == 0 || sg == 32 || sg == 64; }
FMKV_HD int32_t fmkv_resolved_scale_group(int32_t sg) { return sg == 0 ? FMKV_SCALE_GROUP : sg; }
FMKV_HD int32_t fmkv_scale_shift(int32_t sg) { return fmkv_resolved_scale_group(sg) == 64 ? 1 : 0; }
FMKV_HD int32_t fmkv_scales_per_vector(int32_t d, int32_t sg) { return fmkv_groups(d) >> fmkv_scale_shift(sg); }

/* Bytes of one token of one kv head for one of K or V (codes + scales, or fp16 when bits == 16), scale group sg. */
FMKV_HD int64_t fmkv_bytes_per_token_head(int32_t d, int32_t bits, int32_t sg) {
  if (bits == FMKV_FP16_BITS) return 2 * (int64_t)d;
  return (int64_t)fmkv_groups(d) * 4 * (int64_t)bits + 2 * (int64_t)fmkv_scales_per_vector(d, sg);
}

/* ---- page layout -------------------------------------------------------------------------
 * A page holds page_size (P) consecutive compressed tokens of one layer, all kv heads, K and V:
 *   page = for head h in [0, H): { K section, V section }
 *   quantized section (bits b) = codes[G][b][P] uint32  then  scales[G_s][P] fp16 (G_s = fmkv_scales_per_vector)
 *   fp16 section (k_bits == 16) = values[P][d] fp16 (unrotated)
 * Every section size is a multiple of 16 bytes because P is a power of two >= 16.
 */
FMKV_HD int64_t fmkv_section_bytes(int32_t d, int32_t bits, int32_t page_size, int32_t sg) {
  return fmkv_bytes_per_token_head(d, bits, sg) * page_size;
}
FMKV_HD int64_t fmkv_head_stride_bytes(int32_t d, int32_t k_bits, int32_t v_bits, int32_t page_size, int32_t sg) {
  return fmkv_section_bytes(d, k_bits, page_size, sg) + fmkv_section_bytes(d, v_bits, page_size, sg);
}
FMKV_HD int64_t fmkv_page_bytes(int32_t d, int32_t kv_heads, int32_t k_bits, int32_t v_bits,
                                int32_t page_size, int32_t sg) {
  return (int64_t)kv_heads * fmkv_head_stride_bytes(d, k_bits, v_bits, page_size, sg);
}
/* Byte offset, inside a page, of the K (is_v = 0) or V (is_v = 1) section of kv head h. */
FMKV_HD int64_t fmkv_section_offset(int32_t d, int32_t k_bits, int32_t v_bits, int32_t page_size,
                                    int32_t h, int is_v, int32_t sg) {
  return (int64_t)h * fmkv_head_stride_bytes(d, k_bits, v_bits, page_size, sg) +
         (is_v ? fmkv_section_bytes(d, k_bits, page_size, sg) : 0);
}
/* Inside a quantized section: index (in uint32 words) of code word w of group g for token slot t. */
FMKV_HD int64_t fmkv_code_word_index(int32_t bits, int32_t page_size, int32_t g, int32_t w,
                                     int32_t t) {
  return ((int64_t)g * bits + w) * page_size + t;
}
/* Inside a quantized section: byte offset of the scale array (fp16 [G_s][P]; code group g's scale of token
 * slot t is element (g >> fmkv_scale_shift(sg)) * P + t). */
FMKV_HD int64_t fmkv_scales_offset(int32_t d, int32_t bits, int32_t page_size) {
  return (int64_t)fmkv_groups(d) * bits * page_size * 4;
}

/* ---- codes and bit planes -----------------------------------------------------------------
 * A b-bit code is sign-magnitude: bit (b-1) is the sign (1 = negative), bits [0, b-2] are the
 * magnitude index m into the codebook's ascending positive levels. The 32 codes of a group are
 * stored in b uint32 words ("planes"):
 *   b=2: word 0 = magnitude bit plane,              word 1 = sign plane
 *   b=3: words 0,1 = 2-bit magnitude field plane,   word 2 = sign plane
 *   b=4: words 0..3 = nibble words (version 2): the whole code of coordinate j is the nibble at
 *        bits fmkv_nibble_shift(j) .. + 3 of word fmkv_nibble_word(j) (sign in the nibble's bit 3)
 *   b=5: words 0..3 = nibble words of the 4-bit magnitude (coordinate j's at the same nibble as a 4-bit
 *        code), word 4 = sign plane
 * In a 1-bit plane coordinate j is bit j. In the 2-bit field plane coordinate j occupies two bits
 * of word fmkv_field_word(j) at fmkv_field_shift(j); with i = j & 15, lo = j >> 4:
 *   word = i >> 3, shift = 8 * (2 * (i & 1) + lo) + 2 * ((i >> 1) & 3).
 * So (word >> 2s) & 0x03030303 yields coordinates (i0, i0+16, i0+1, i0+17), i0 = 8*word + 2s, in
 * bytes 0..3, and the sign bits of the pair (i, i+16) sit 16 bits apart: both map to fp16x2
 * registers with a byte permute and one shift (see docs/FORMAT.md, "Why this bit order").
 */
FMKV_HD int32_t fmkv_field_word(int32_t j) { return (j & 15) >> 3; }
/* b = 4 (version 2): coordinate j's code is nibble j & 7 of word j >> 3. Four codes of a half-word are
 * one byte-permute selector as stored: two permutes fetch the low / high bytes of their fp16 levels
 * from 8-entry byte tables (the magnitude, bits 0-2), one sign-replicating permute makes the sign
 * mask (docs/FORMAT.md, "Why this bit order"). */
FMKV_HD int32_t fmkv_nibble_word(int32_t j) { return j >> 3; }
FMKV_HD int32_t fmkv_nibble_shift(int32_t j) { return 4 * (j & 7); }
FMKV_HD int32_t fmkv_field_shift(int32_t j) {
  int32_t i = j & 15, lo = j >> 4;
  return 8 * (2 * (i & 1) + lo) + 2 * ((i >> 1) & 3);
}

/* ---- tile blocks (format version 3, 3-bit codes; FORMAT.md section 6, "Tile blocks") -----------------
 * In format 3 the code region of a 3-bit section is P / 16 tile blocks of 64 G 3 bytes (the same bytes as
 * format 2's code words): block k holds the codes of token slots 16 k .. 16 k + 15, as 32 "lanes" of G
 * uint32 words X[lane][g] followed by 32 lanes of G uint16 words Y[lane][g] (little-endian). A lane's
 * 48 bits of group g hold 16 codes in 16 nibbles (X's 8, then Y's 4 and 4 codes whose three bits fill the
 * nibbles' bit 3: the "hole" codes j = 0..3 at X bit 4 j + 3, X bit 16 + 4 j + 3, Y bit 4 j + 3). Which
 * codes a lane holds follows the mma fragments that consume them (docs/FORMAT.md "Why tile blocks"):
 *   K: lane 4 (t >> 1) + ((c & 15) >> 2) holds token t's coordinate c; even t: X nibble 4 (c >> 4) + (c & 3);
 *      odd t: Y nibble (c & 3) for c < 16, hole (c & 3) for c >= 16.
 *   V: with r = c & 15, k = t even ? t / 2 : 8 + t / 2, i = 4 (c >> 4) + (r >> 3) + 2 (k >> 3), h = k & 1:
 *      lane 4 (r & 7) + ((k & 7) >> 1); i = 0, 1: X nibble 2 h + i; i = 2, 3: X nibble 2 + 2 h + i;
 *      i = 4, 5: Y nibble 2 h + i - 4; i = 6, 7: hole 2 h + i - 6.
 * fmkv_tile_code_bit gives the bit of the block (bit n = bit n & 7 of byte n >> 3) that holds bit b of the
 * code of tile token t16, group g, coordinate c. */
FMKV_HD int fmkv_tiled_codes(int32_t format_version, int32_t bits) {
  return fmkv_resolved_format_version(format_version) >= 3 && bits == FMKV_TILED_CODE_BITS;
}
FMKV_HD int64_t fmkv_tile_block_bytes(int32_t d) { return 64 * 3 * (int64_t)fmkv_groups(d); }
/* Byte offset, inside a section, of the tile block holding token slot t. */
FMKV_HD int64_t fmkv_tile_block_offset(int32_t d, int32_t t) { return (int64_t)(t >> 4) * fmkv_tile_block_bytes(d); }
FMKV_HD int32_t fmkv_tile_code_bit(int32_t G, int is_v, int32_t t16, int32_t g, int32_t c, int32_t b) {
  int32_t lane, nib, hole = -1, in_y = 0;
  if (!is_v) {
    lane = 4 * (t16 >> 1) + ((c & 15) >> 2);
    if ((t16 & 1) == 0) nib = 4 * (c >> 4) + (c & 3);
    else if (c < 16) { nib = c & 3; in_y = 1; }
    else { nib = 0; hole = c & 3; }
  } else {
    const int32_t r = c & 15, k = (t16 & 1) == 0 ? t16 >> 1 : 8 + (t16 >> 1);
    const int32_t i = 4 * (c >> 4) + (r >> 3) + 2 * (k >> 3), h = k & 1;
    lane = 4 * (r & 7) + ((k & 7) >> 1);
    if (i < 2) nib = 2 * h + i;
    else if (i < 4) nib = 2 + 2 * h + i;
    else if (i < 6) { nib = 2 * h + i - 4; in_y = 1; }
    else { nib = 0; hole = 2 * h + i - 6; }
  }
  const int32_t xw = 32 * (G * lane + g), yw = 1024 * G + 16 * (G * lane + g);
  if (hole >= 0) return b == 0 ? xw + 4 * hole + 3 : b == 1 ? xw + 16 + 4 * hole + 3 : yw + 4 * hole + 3;
  return (in_y ? yw : xw) + 4 * nib + b;
}

/* ---- rotation (FORMAT.md "Rotation") ---------------------------------------------------------
 * Head vectors are stored rotated, y = H diag(s) x / sqrt(d). The signs s of layer `layer` come from
 * splitmix64 seeded with fmkv_rotation_state(seed, layer): output k + 1 is word k, whose bit i set
 * means s_{64k+i} = -1. (Literals with `ul`: MSL has no long long.) */
FMKV_HD uint64_t fmkv_rotation_state(uint64_t seed, int32_t layer) {
  return seed ^ ((uint64_t)(uint32_t)layer * (uint64_t)0xD6E8FEB86659FD93ul);
}
FMKV_HD uint64_t fmkv_rotation_sign_word(uint64_t seed, int32_t layer, int32_t k) {
  uint64_t z = fmkv_rotation_state(seed, layer) + (uint64_t)(k + 1) * (uint64_t)0x9E3779B97F4A7C15ul;
  z = (z ^ (z >> 30)) * (uint64_t)0xBF58476D1CE4E5B9ul;
  z = (z ^ (z >> 27)) * (uint64_t)0x94D049BB133111EBul;
  return z ^ (z >> 31);
}
/* float32 nearest to 1/sqrt(d) (0x3E000000, 0x3DB504F3, 0x3D800000): the factor applied after the
 * unnormalised FWHT. */
FMKV_HD float fmkv_rotation_norm(int32_t d) { return d == 64 ? 0.125f : d == 128 ? 0.0883883461356163f : 0.0625f; }

/* ---- token regions (FORMAT.md "Token regions") ------------------------------------------------
 * A sequence of len tokens with S sink and W window tokens: positions [0, min(S, len)) are the fp16
 * sink, [S, E) are compressed and [E, len) are the fp16 window, E = fmkv_compressed_end(S, W, len) =
 * max(S, len - W). Compressed position p has compressed index p - S: page (p - S) / P of the
 * sequence's block table, token slot (p - S) % P. The fp16 tokens of a sequence live in its region
 * slot of the layer's fp16 arrays, [num_slots][kv_heads][S + W][head_dim] fp16: the sink at rows
 * [0, S), the window as a ring of W rows after it (fmkv_fp16_row). */
FMKV_HD int64_t fmkv_compressed_end(int32_t S, int32_t W, int64_t len) {
  int64_t e = len - W;
  return e > S ? e : (int64_t)S;
}
/* Row of position p inside its sequence's fp16 region: p itself in the sink, else the window ring. */
FMKV_HD int64_t fmkv_fp16_row(int32_t S, int32_t W, int64_t p) {
  return p < S ? p : (int64_t)S + (p - S) % W;
}
/* Element offset of fp16 row r of kv head h in region slot `slot` (d values per row, R = S + W rows). */
FMKV_HD int64_t fmkv_fp16_offset(int32_t kv_heads, int32_t R, int32_t d, int64_t slot, int32_t h, int64_t r) {
  return ((slot * kv_heads + h) * R + r) * d;
}

#if defined(__cplusplus) && !defined(__METAL_VERSION__)
}
#endif
#endif /* FMKV_FORMAT_H */
