// Code packing of the format core (FORMAT.md "Code words"): the 32 codes of a scale group <-> its
// `bits` uint32 code words (bit planes and the 2-bit field plane for 2 / 3 bits, nibble words for 4, nibble
// words of the magnitude and a sign plane for 5),
// scalar form; and format 3's 3-bit tile blocks, code by code. The positions come from include/fmkv/format.h
// (fmkv_field_*, fmkv_nibble_*, fmkv_tile_code_bit).
// Portable: host C++, CUDA host and device, MSL. Backends that pack in parallel (CUDA and MSL
// ballots, CPU SIMD masks) produce exactly these words.
#ifndef FMKV_FORMAT_PACK_H
#define FMKV_FORMAT_PACK_H
#include "../../include/fmkv/format.h"
#include "portability.h"

namespace fmkv {

// The `bits` code words of the 32 codes of one group (codes[j]: sign at bit bits-1, magnitude below).
FMKV_HD void pack_group_words(FMKV_THREAD const uint8_t* codes, int32_t bits, FMKV_THREAD uint32_t* w) {
  for (int32_t k = 0; k < bits; ++k) w[k] = 0;
  for (int32_t j = 0; j < 32; ++j) {
    const uint32_t c = codes[j], sign = c >> (bits - 1), m = c & ((1u << (bits - 1)) - 1u);
    if (bits == 4) {  // nibble words: the whole code
      w[fmkv_nibble_word(j)] |= c << fmkv_nibble_shift(j);
      continue;
    }
    w[bits - 1] |= sign << j;  // the sign plane is the last word
    if (bits == 2) w[0] |= m << j;
    if (bits == 3) w[fmkv_field_word(j)] |= m << fmkv_field_shift(j);
    if (bits == 5) w[fmkv_nibble_word(j)] |= m << fmkv_nibble_shift(j);
  }
}

// Code of coordinate j (0..31) of a group whose code words are words[0], words[stride], ...
FMKV_HD uint32_t unpack_code(FMKV_DEVICE const uint32_t* words, int64_t stride, int32_t bits, int32_t j) {
  if (bits == 4) return (words[fmkv_nibble_word(j) * stride] >> fmkv_nibble_shift(j)) & 15u;
  const uint32_t sign = (words[(bits - 1) * stride] >> j) & 1u;
  const uint32_t m = bits == 2   ? (words[0] >> j) & 1u
                     : bits == 3 ? (words[fmkv_field_word(j) * stride] >> fmkv_field_shift(j)) & 3u
                                 : (words[fmkv_nibble_word(j) * stride] >> fmkv_nibble_shift(j)) & 15u;
  return (sign << (bits - 1)) | m;
}

// Format 3, 3-bit codes (tile blocks, include/fmkv/format.h): write the 3-bit code of tile token t16, group
// g, coordinate c (K: is_v = 0) into the tile block (its three bits replaced; the other tokens' bits kept),
// and read it back, byte by byte.
FMKV_HD void tile_put_code(FMKV_DEVICE uint8_t* block, int32_t G, int is_v, int32_t t16, int32_t g, int32_t c, uint32_t code) {
  for (int32_t b = 0; b < 3; ++b) {
    const int32_t n = fmkv_tile_code_bit(G, is_v, t16, g, c, b);
    const uint8_t m = (uint8_t)(1u << (n & 7));
    block[n >> 3] = (uint8_t)(((code >> b) & 1u) ? (block[n >> 3] | m) : (block[n >> 3] & ~m));
  }
}
FMKV_HD uint32_t tile_get_code(FMKV_DEVICE const uint8_t* block, int32_t G, int is_v, int32_t t16, int32_t g, int32_t c) {
  uint32_t code = 0;
  for (int32_t b = 0; b < 3; ++b) {
    const int32_t n = fmkv_tile_code_bit(G, is_v, t16, g, c, b);
    code |= (uint32_t)((block[n >> 3] >> (n & 7)) & 1u) << b;
  }
  return code;
}

// The same two through the block's aligned little-endian uint32 words (bit n of the block is bit n & 31 of
// word n >> 5, so a uint16 Y word is the low or high half of its containing uint32 word), for writers that run
// concurrently with writers of other tokens of the same block: the code's bits are replaced with atomic AND /
// OR on their containing words (one AND and one OR per word at most), so every other bit keeps its value
// whatever the interleaving. `block` must be 4-byte aligned (sections are 16-byte aligned, blocks 64 G 3 bytes).
FMKV_HD void tile_put_code_atomic(FMKV_DEVICE uint32_t* block, int32_t G, int is_v, int32_t t16, int32_t g, int32_t c,
                                  uint32_t code) {
  int32_t n[3];
  for (int32_t b = 0; b < 3; ++b) n[b] = fmkv_tile_code_bit(G, is_v, t16, g, c, b);
  for (int32_t b = 0; b < 3; ++b) {
    const int32_t w = n[b] >> 5;
    if ((b > 0 && (n[0] >> 5) == w) || (b > 1 && (n[1] >> 5) == w)) continue;  // word done with an earlier bit
    uint32_t mask = 0, set = 0;
    for (int32_t b2 = b; b2 < 3; ++b2)
      if ((n[b2] >> 5) == w) {
        mask |= 1u << (n[b2] & 31);
        set |= ((code >> b2) & 1u) << (n[b2] & 31);
      }
    if (set != mask) FMKV_ATOMIC_AND_U32(block + w, ~mask | set);
    if (set != 0u) FMKV_ATOMIC_OR_U32(block + w, set);
  }
}
FMKV_HD uint32_t tile_get_code_words(FMKV_DEVICE const uint32_t* block, int32_t G, int is_v, int32_t t16, int32_t g,
                                     int32_t c) {
  uint32_t code = 0, word = 0;
  int32_t loaded = -1;
  for (int32_t b = 0; b < 3; ++b) {
    const int32_t n = fmkv_tile_code_bit(G, is_v, t16, g, c, b);
    if ((n >> 5) != loaded) {
      loaded = n >> 5;
      word = block[loaded];
    }
    code |= ((word >> (n & 31)) & 1u) << b;
  }
  return code;
}

}  // namespace fmkv

#endif  // FMKV_FORMAT_PACK_H
