// Format 3's 3-bit tile blocks (docs/FORMAT.md section 6 "Tile blocks"; the rule is fmkv_tile_code_bit in
// include/fmkv/format.h, one code at a time in src/format/pack.h) in the word form the CPU backend uses:
//   * append: one token's codes of one group written from its three bit planes (tile_write_planes);
//   * attention: a whole 16-token block unpacked into per-tile scratches that the attention loops read
//     with lane = token (K) or lane = coordinate (V): both are the transpose of the block's 16 x 4 G word
//     matrix (rows: X and YH words of 8 lane quads, columns: (lane in quad, group)), in two row orders;
//     and the fixed coordinate orders of those scratches (the rotated query is permuted once for K, the V
//     accumulator is un-permuted once).
// Word form of a block (G = d / 32 groups): X[lane][g] uint32 at word lane G + g, Y[lane][g] uint16 after
// the 32 G X words (byte 128 G). Of a lane's 16 nibbles (X's 8, Y's 4, 4 "hole" codes j whose bits 0, 1, 2
// sit in bit 3 of X nibble j, X nibble 4 + j and Y nibble j) the hole word of the lane is
//   hole(x, y) = ((x >> 3) & 0x1111) | ((x >> 18) & 0x2222) | ((y >> 1) & 0x4444)   (hole j in nibble j),
// and y | hole(x, y) << 16 ("YH") holds Y's 4 codes in nibbles 0-3 and the holes in nibbles 4-7. In X and
// YH bit 3 of a nibble is not part of that nibble's code: readers look codes up in 8-periodic tables.
//   K (tile token t, p = t >> 1, coordinate c of group g): lane 4 p + q with q = (c & 15) >> 2; nibble
//     n = 4 (c >> 4) + (c & 3) of X (even t) or of YH (odd t). So lane 4 p + q holds tokens 2 p, 2 p + 1 at
//     the coordinates ck(q, n) = 4 q + (n & 3) + 16 (n >> 2) in the same nibble order.
//   V (t = 4 kb + 2 h + o, bx = h + 2 o): lane 4 ra + kb, byte bx of X holds coordinates ra (low nibble)
//     and ra + 8 (high nibble), byte bx of YH holds 16 + ra and 24 + ra, for ra = 0..7. So the X (YH) word
//     of lane 4 ra + kb holds the four tokens 4 kb + (0, 2, 1, 3) of coordinate pair (ra, ra + 8)
//     ((16 + ra, 24 + ra)) in its bytes 0..3.
// All functions here have internal linkage: this header is compiled into every per-ISA kernel file.
#pragma once
#include <cstdint>
#include <cstring>

#include "../../include/fmkv/format.h"

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(FMKV_CPU_NEON_TU)
#include <arm_neon.h>
#endif

namespace fmkv::cpu {
namespace {

// ---- coordinate orders of the scratch --------------------------------------------------------
// K scratch: nibble j (word j >> 3 = q, nibble j & 7 = n) of a token's group stands for coordinate tile_k_coord(j).
inline int tile_k_coord(int j) { return 4 * (j >> 3) + (j & 3) + 16 * ((j >> 2) & 1); }
// V scratch: lane u (word u & 15 of the token's column, its nibble u >> 4: see tile_v_word) stands for
// coordinate tile_v_coord(u).
inline int tile_v_coord(int u) { return (u & 7) + 16 * ((u >> 3) & 1) + 8 * (u >> 4); }

// The rotated query of tiled K in scratch order: out[32 g + j] = q[32 g + tile_k_coord(j)].
inline void tile_k_query_order(const float* q, int32_t d, float* out) {
  for (int32_t g = 0; g < d / 32; ++g)
    for (int j = 0; j < 32; ++j) out[g * 32 + j] = q[g * 32 + tile_k_coord(j)];
}
// An accumulator of tiled V (scratch lane order) in natural coordinate order.
inline void tile_v_unpermute(const float* acc, int32_t d, float* out) {
  for (int32_t g = 0; g < d / 32; ++g)
    for (int u = 0; u < 32; ++u) out[g * 32 + tile_v_coord(u)] = acc[g * 32 + u];
}
// V scratch word of lane m (0..15) for tile token t, group g: word vs[tile_v_word(t, g, G) + m]; the token's
// codes of lanes m, 16 + m are its nibbles at bit tile_v_shift(t) and tile_v_shift(t) + 4.
inline int32_t tile_v_word(int32_t t, int32_t g, int32_t G) { return 16 * ((t >> 2) * G + g); }
inline int tile_v_shift(int32_t t) { return 8 * (((t >> 1) & 1) | ((t & 1) << 1)); }

inline uint32_t tile_hole_word(uint32_t x, uint32_t y) {
  return ((x >> 3) & 0x1111u) | ((x >> 18) & 0x2222u) | ((y >> 1) & 0x4444u);
}

// ---- append: one token's codes --------------------------------------------------------------
// Bit i (0..15) of x to bit 4 i.
inline uint64_t tile_spread16(uint64_t x) {
  x = (x | x << 24) & 0x000000FF000000FFull;
  x = (x | x << 12) & 0x000F000F000F000Full;
  x = (x | x << 6) & 0x0303030303030303ull;
  x = (x | x << 3) & 0x1111111111111111ull;
  return x;
}
// Transpose of the 8 x 8 bit matrix whose row i is byte i of x (bit j of byte i -> bit i of byte j).
inline uint64_t tile_transpose8x8(uint64_t x) {
  uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
  x ^= t ^ (t << 14);
  t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
  x ^= t ^ (t << 28);
  return x;
}

// Write the 3-bit codes of tile token t16, group g (K: is_v = 0) into a tile block: bit c of plane b is
// bit b of coordinate c's code. Only the token's own bits change (tile_put_code for every c, in words).
inline void tile_write_planes(uint8_t* block, int32_t G, int is_v, int32_t t16, int32_t g, uint32_t p0, uint32_t p1,
                              uint32_t p2) {
  uint32_t* X = (uint32_t*)block;
  uint16_t* Y = (uint16_t*)(block + 128 * G);
  if (!is_v) {
    // z_lo / z_hi: nibble i holds the code of coordinate i / 16 + i (i = 0..15).
    const uint64_t z_lo = tile_spread16(p0 & 0xFFFFu) | tile_spread16(p1 & 0xFFFFu) << 1 | tile_spread16(p2 & 0xFFFFu) << 2;
    const uint64_t z_hi = tile_spread16(p0 >> 16) | tile_spread16(p1 >> 16) << 1 | tile_spread16(p2 >> 16) << 2;
    const int32_t p = t16 >> 1;
    for (int q = 0; q < 4; ++q) {
      const int64_t i = (int64_t)(4 * p + q) * G + g;
      const uint32_t lo = (uint32_t)(z_lo >> (16 * q)) & 0xFFFFu, hi = (uint32_t)(z_hi >> (16 * q)) & 0xFFFFu;
      if ((t16 & 1) == 0) {  // X nibbles, bits 0-2
        X[i] = (X[i] & 0x88888888u) | lo | hi << 16;
      } else {  // Y nibbles (coordinates < 16) and the holes (coordinates >= 16)
        Y[i] = (uint16_t)((lo & 0x7777u) | (hi & 0x4444u) << 1);
        X[i] = (X[i] & 0x77777777u) | (hi & 0x1111u) << 3 | (hi & 0x2222u) << 18;
      }
    }
    return;
  }
  // xb / yb byte ra: the codes of coordinates ra, ra + 8 / 16 + ra, 24 + ra in its nibbles' bits 0-2.
  auto rows = [](uint32_t a0, uint32_t a1, uint32_t a2, uint32_t b0, uint32_t b1, uint32_t b2) {
    return tile_transpose8x8((uint64_t)a0 | (uint64_t)a1 << 8 | (uint64_t)a2 << 16 | (uint64_t)b0 << 32 |
                             (uint64_t)b1 << 40 | (uint64_t)b2 << 48);
  };
  const uint64_t xb = rows(p0 & 0xFF, p1 & 0xFF, p2 & 0xFF, (p0 >> 8) & 0xFF, (p1 >> 8) & 0xFF, (p2 >> 8) & 0xFF);
  const uint64_t yb = rows((p0 >> 16) & 0xFF, (p1 >> 16) & 0xFF, (p2 >> 16) & 0xFF, p0 >> 24, p1 >> 24, p2 >> 24);
  const int32_t kb = t16 >> 2, h = (t16 >> 1) & 1, o = t16 & 1, bx = h + 2 * o;
  for (int ra = 0; ra < 8; ++ra) {
    const int64_t i = (int64_t)(4 * ra + kb) * G + g;
    const uint32_t x = (uint32_t)(xb >> (8 * ra)) & 0xFFu, y = (uint32_t)(yb >> (8 * ra)) & 0xFFu;
    X[i] = (X[i] & ~(0x77u << (8 * bx))) | x << (8 * bx);
    if (o == 0) {  // Y byte h
      Y[i] = (uint16_t)((Y[i] & ~(0x77u << (8 * h))) | y << (8 * h));
    } else {  // holes 2 h, 2 h + 1: bit 0 in X byte h, bit 1 in X byte 2 + h, bit 2 in Y byte h (bits 3 and 7)
      X[i] = (X[i] & ~(0x88u << (8 * h) | 0x88u << (16 + 8 * h))) | (y & 0x11u) << (3 + 8 * h) |
             (y & 0x22u) << (18 + 8 * h);
      Y[i] = (uint16_t)((Y[i] & ~(0x88u << (8 * h))) | (y & 0x44u) << (1 + 8 * h));
    }
  }
}

// ---- attention: a 16-token block -> scratch ------------------------------------------------------
// K scratch ks[16 (q G + g) + t] (uint32, 4 G x 16): token t's nibble word q of group g (X of lane
// 4 (t >> 1) + q for even t, YH for odd t). It is the transpose of the 16 x 4 G word matrix whose row t
// is those words of token t (rows in the order X of quad 0, YH of quad 0, X of quad 1, ...).
// V scratch vs[16 (kb G + g) + m] (uint32, 4 G x 16): the X word (m < 8) or YH word (m >= 8) of lane
// 4 (m & 7) + kb, group g: the transpose of the same matrix with rows in the order X of quads 0..7, YH of
// quads 0..7. Lane m of tile token t is byte tile_v_shift(t) / 8 of word tile_v_word(t, g, G) + m.
inline void tile_unpack_k_scalar(const uint8_t* block, int32_t G, uint32_t* ks) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t p = 0; p < 8; ++p)
    for (int32_t col = 0; col < 4 * G; ++col) {  // col = q G + g: lane 4 p + q, group g
      const uint32_t x = X[4 * G * p + col], y = Y[4 * G * p + col];
      ks[16 * col + 2 * p] = x;
      ks[16 * col + 2 * p + 1] = y | tile_hole_word(x, y) << 16;
    }
}
inline void tile_unpack_v_scalar(const uint8_t* block, int32_t G, uint32_t* vs) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t ra = 0; ra < 8; ++ra)
    for (int32_t col = 0; col < 4 * G; ++col) {  // col = kb G + g: lane 4 ra + kb, group g
      const uint32_t x = X[4 * G * ra + col], y = Y[4 * G * ra + col];
      vs[16 * col + ra] = x;
      vs[16 * col + 8 + ra] = y | tile_hole_word(x, y) << 16;
    }
}

#if defined(__x86_64__) && defined(__AVX2__)
inline __m256i tile_yh8(__m256i x, __m256i y) {  // y | hole(x, y) << 16, 8 lanes
  const __m256i h = _mm256_or_si256(
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(x, 3), _mm256_set1_epi32(0x1111)),
                      _mm256_and_si256(_mm256_srli_epi32(x, 18), _mm256_set1_epi32(0x2222))),
      _mm256_and_si256(_mm256_srli_epi32(y, 1), _mm256_set1_epi32(0x4444)));
  return _mm256_or_si256(y, _mm256_slli_epi32(h, 16));
}
// The two in-lane stages of an 8 x 8 word transpose (per 128-bit lane, for 256- and 512-bit registers):
// u[4 i + k], 128-bit lane l: rows 4 i .. 4 i + 3 of the lane's column k.
inline __m256i unpack_lo32(__m256i a, __m256i b) { return _mm256_unpacklo_epi32(a, b); }
inline __m256i unpack_hi32(__m256i a, __m256i b) { return _mm256_unpackhi_epi32(a, b); }
inline __m256i unpack_lo64(__m256i a, __m256i b) { return _mm256_unpacklo_epi64(a, b); }
inline __m256i unpack_hi64(__m256i a, __m256i b) { return _mm256_unpackhi_epi64(a, b); }
#if defined(__AVX512F__)
inline __m512i unpack_lo32(__m512i a, __m512i b) { return _mm512_unpacklo_epi32(a, b); }
inline __m512i unpack_hi32(__m512i a, __m512i b) { return _mm512_unpackhi_epi32(a, b); }
inline __m512i unpack_lo64(__m512i a, __m512i b) { return _mm512_unpacklo_epi64(a, b); }
inline __m512i unpack_hi64(__m512i a, __m512i b) { return _mm512_unpackhi_epi64(a, b); }
#endif
template <class V>
inline void tile_transpose8_in_lanes(const V* r, V* u) {
  V t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = unpack_lo32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = unpack_hi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = unpack_lo64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = unpack_hi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = unpack_lo64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = unpack_hi64(t[4 * i + 1], t[4 * i + 3]);
  }
}
// r[0..7] (rows of 8 words) -> r[j] = column j.
inline void tile_transpose8x8_epi32(__m256i* r) {
  __m256i u[8];
  tile_transpose8_in_lanes(r, u);
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}
inline void tile_unpack_k_avx2(const uint8_t* block, int32_t G, uint32_t* ks) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t cb = 0; cb < 4 * G; cb += 8) {  // 8 columns
    __m256i r[16];
    for (int p = 0; p < 8; ++p) {  // rows: even tokens 0..7 in r[0..7] (as 2 p), odd in r[8..15]
      const __m256i x = _mm256_loadu_si256((const __m256i*)(X + 4 * G * p + cb));
      const __m256i y = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(Y + 4 * G * p + cb)));
      r[p] = x;
      r[8 + p] = tile_yh8(x, y);
    }
    tile_transpose8x8_epi32(r);
    tile_transpose8x8_epi32(r + 8);
    for (int j = 0; j < 8; ++j) {  // column cb + j: tokens 0..15 interleaved from even r[j] and odd r[8 + j]
      const __m256i lo = _mm256_unpacklo_epi32(r[j], r[8 + j]), hi = _mm256_unpackhi_epi32(r[j], r[8 + j]);
      _mm256_storeu_si256((__m256i*)(ks + 16 * (cb + j)), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256((__m256i*)(ks + 16 * (cb + j) + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  }
}
inline void tile_unpack_v_avx2(const uint8_t* block, int32_t G, uint32_t* vs) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t cb = 0; cb < 4 * G; cb += 8) {  // 8 columns
    __m256i r[16];
    for (int ra = 0; ra < 8; ++ra) {  // rows: X of quads 0..7 in r[0..7], YH in r[8..15]
      const __m256i x = _mm256_loadu_si256((const __m256i*)(X + 4 * G * ra + cb));
      const __m256i y = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(Y + 4 * G * ra + cb)));
      r[ra] = x;
      r[8 + ra] = tile_yh8(x, y);
    }
    tile_transpose8x8_epi32(r);
    tile_transpose8x8_epi32(r + 8);
    for (int j = 0; j < 8; ++j) {  // column cb + j: lanes m = 0..7 from r[j], 8..15 from r[8 + j]
      _mm256_storeu_si256((__m256i*)(vs + 16 * (cb + j)), r[j]);
      _mm256_storeu_si256((__m256i*)(vs + 16 * (cb + j) + 8), r[8 + j]);
    }
  }
}
#if defined(__AVX512F__)
// y | hole(x, y) << 16, 16 lanes: x bit 4 j + 3 -> 16 + 4 j, x bit 19 + 4 j -> 17 + 4 j, y bit 4 j + 3 -> 18 + 4 j
inline __m512i tile_yh16(__m512i x, __m512i y) {
  __m512i h = _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x22220000), _mm512_srli_epi32(x, 2), _mm512_slli_epi32(x, 13), 0xCA);
  h = _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x44440000), _mm512_slli_epi32(y, 15), h, 0xCA);
  return _mm512_ternarylogic_epi32(h, _mm512_set1_epi32(0x77770000), y, 0xEA);  // (h & m) | y
}
// r[0..15] (rows of 16 words) -> r[j] = column j.
inline void tile_transpose16x16_epi32(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + k], 128-bit lane l: rows 4 i .. 4 i + 3 of column 4 l + k
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // t: lanes (l0 | l2 | l0' | l2'), (l1 | l3 | l1' | l3') of row quads (0, 1) and (2, 3)
    t[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    t[8 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xDD);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xDD);
  }
}
// 16 columns at a time (G >= 4): the 16 x 4 G word matrix transposed; row of X (YH) of lane quad p is
// row xrow(p) (yrow(p)): K's token order (2 p, 2 p + 1) or V's (p, 8 + p).
template <bool TokenRows>
inline void tile_unpack_avx512(const uint8_t* block, int32_t G, uint32_t* out) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t cb = 0; cb < 4 * G; cb += 16) {
    __m512i r[16];
    for (int p = 0; p < 8; ++p) {
      const __m512i x = _mm512_loadu_si512((const void*)(X + 4 * G * p + cb));
      const __m512i y = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(Y + 4 * G * p + cb)));
      r[TokenRows ? 2 * p : p] = x;
      r[TokenRows ? 2 * p + 1 : 8 + p] = tile_yh16(x, y);
    }
    tile_transpose16x16_epi32(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512((void*)(out + 16 * (cb + j)), r[j]);
  }
}
// G = 2 (d = 64): the block (64 X words, 64 Y half-words) in 4 + 4 registers; the 16 x 8 word matrix is
// transposed as two 8 x 8 matrices side by side: register row i holds matrix row i in its low 256 bits and
// row 8 + i in its high 256 bits, with rows in K's token order (token i | token 8 + i) or V's (X | YH of
// lane quad i). Lane quad p's 8 words are the 256-bit half p & 1 of register p >> 1.
template <bool TokenRows>
inline void tile_unpack_g2_avx512(const uint8_t* block, uint32_t* out) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * 2);
  __m512i x[4], yh[4];
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm512_loadu_si512((const void*)(X + 16 * k));
    const __m512i y = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(Y + 16 * k)));
    yh[k] = tile_yh16(x[k], y);
  }
  // _mm512_shuffle_i32x4 immediates taking half h of both sources: 0x44 (h = 0), 0xEE (h = 1).
  __m512i r[8], u[8];
  for (int i = 0; i < 8; ++i) {
    if (TokenRows) {  // tokens i and 8 + i: X (even i) or YH (odd i) of lane quads i >> 1 and (i >> 1) + 4
      const int p = i >> 1;
      const __m512i* src = (i & 1) ? yh : x;
      r[i] = (p & 1) ? _mm512_shuffle_i32x4(src[p >> 1], src[(p >> 1) + 2], 0xEE) : _mm512_shuffle_i32x4(src[p >> 1], src[(p >> 1) + 2], 0x44);
    } else {  // X and YH of lane quad i
      r[i] = (i & 1) ? _mm512_shuffle_i32x4(x[i >> 1], yh[i >> 1], 0xEE) : _mm512_shuffle_i32x4(x[i >> 1], yh[i >> 1], 0x44);
    }
  }
  tile_transpose8_in_lanes(r, u);
  // Per 256-bit half: the low (high) 128-bit lanes of u[j] and u[4 + j] make column j (4 + j).
  const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_si512((void*)(out + 16 * j), _mm512_permutex2var_epi64(u[j], lo, u[4 + j]));
    _mm512_storeu_si512((void*)(out + 16 * (4 + j)), _mm512_permutex2var_epi64(u[j], hi, u[4 + j]));
  }
}
inline void tile_unpack_k(const uint8_t* block, int32_t G, uint32_t* ks) {
  if (G == 2) return tile_unpack_g2_avx512<true>(block, ks);
  tile_unpack_avx512<true>(block, G, ks);
}
inline void tile_unpack_v(const uint8_t* block, int32_t G, uint32_t* vs) {
  if (G == 2) return tile_unpack_g2_avx512<false>(block, vs);
  tile_unpack_avx512<false>(block, G, vs);
}
#else
inline void tile_unpack_k(const uint8_t* block, int32_t G, uint32_t* ks) { tile_unpack_k_avx2(block, G, ks); }
inline void tile_unpack_v(const uint8_t* block, int32_t G, uint32_t* vs) { tile_unpack_v_avx2(block, G, vs); }
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(FMKV_CPU_NEON_TU)
inline uint32x4_t tile_yh4(uint32x4_t x, uint32x4_t y) {  // y | hole(x, y) << 16, 4 lanes
  const uint32x4_t h = vorrq_u32(vorrq_u32(vandq_u32(vshrq_n_u32(x, 3), vdupq_n_u32(0x1111u)),
                                           vandq_u32(vshrq_n_u32(x, 18), vdupq_n_u32(0x2222u))),
                                 vandq_u32(vshrq_n_u32(y, 1), vdupq_n_u32(0x4444u)));
  return vorrq_u32(y, vshlq_n_u32(h, 16));
}
inline void tile_unpack_k(const uint8_t* block, int32_t G, uint32_t* ks) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t cb = 0; cb < 4 * G; cb += 4)  // 4 columns
    for (int p = 0; p < 8; p += 2) {  // tokens 2 p .. 2 p + 3: rows X, YH of lane quads p and p + 1, 4 x 4 transposed
      const uint32x4_t x0 = vld1q_u32(X + 4 * G * p + cb), x1 = vld1q_u32(X + 4 * G * (p + 1) + cb);
      const uint32x4_t y0 = vmovl_u16(vld1_u16(Y + 4 * G * p + cb)), y1 = vmovl_u16(vld1_u16(Y + 4 * G * (p + 1) + cb));
      const uint32x4x2_t a = vtrnq_u32(x0, tile_yh4(x0, y0)), b = vtrnq_u32(x1, tile_yh4(x1, y1));
      uint32_t* o = ks + 16 * cb + 2 * p;
      vst1q_u32(o, vcombine_u32(vget_low_u32(a.val[0]), vget_low_u32(b.val[0])));
      vst1q_u32(o + 16, vcombine_u32(vget_low_u32(a.val[1]), vget_low_u32(b.val[1])));
      vst1q_u32(o + 32, vcombine_u32(vget_high_u32(a.val[0]), vget_high_u32(b.val[0])));
      vst1q_u32(o + 48, vcombine_u32(vget_high_u32(a.val[1]), vget_high_u32(b.val[1])));
    }
}
inline void tile_unpack_v(const uint8_t* block, int32_t G, uint32_t* vs) {
  const uint32_t* X = (const uint32_t*)block;
  const uint16_t* Y = (const uint16_t*)(block + 128 * G);
  for (int32_t cb = 0; cb < 4 * G; cb += 4)  // 4 columns
    for (int ra = 0; ra < 8; ra += 4) {  // rows ra .. ra + 3 of X (lanes m = ra ..) and of YH (m = 8 + ra ..), 4 x 4 transposed
      uint32x4_t x[4], yh[4];
      for (int i = 0; i < 4; ++i) {
        x[i] = vld1q_u32(X + 4 * G * (ra + i) + cb);
        yh[i] = tile_yh4(x[i], vmovl_u16(vld1_u16(Y + 4 * G * (ra + i) + cb)));
      }
      for (int h = 0; h < 2; ++h) {
        const uint32x4_t* r = h ? yh : x;
        const uint32x4x2_t a = vtrnq_u32(r[0], r[1]), b = vtrnq_u32(r[2], r[3]);
        uint32_t* o = vs + 16 * cb + 8 * h + ra;
        vst1q_u32(o, vcombine_u32(vget_low_u32(a.val[0]), vget_low_u32(b.val[0])));
        vst1q_u32(o + 16, vcombine_u32(vget_low_u32(a.val[1]), vget_low_u32(b.val[1])));
        vst1q_u32(o + 32, vcombine_u32(vget_high_u32(a.val[0]), vget_high_u32(b.val[0])));
        vst1q_u32(o + 48, vcombine_u32(vget_high_u32(a.val[1]), vget_high_u32(b.val[1])));
      }
    }
}
#else
inline void tile_unpack_k(const uint8_t* block, int32_t G, uint32_t* ks) { tile_unpack_k_scalar(block, G, ks); }
inline void tile_unpack_v(const uint8_t* block, int32_t G, uint32_t* vs) { tile_unpack_v_scalar(block, G, vs); }
#endif

}  // namespace
}  // namespace fmkv::cpu
