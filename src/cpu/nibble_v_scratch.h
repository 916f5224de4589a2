// 4-bit V (nibble words: code j of a group at bit fmkv_nibble_shift(j) of word fmkv_nibble_word(j), FORMAT.md
// section 6) of a 16-token tile rewritten into the V scratch layout of format 3's tile blocks (tile.h), so that the
// attention's V loop reads one scratch word per token for two lanes of a group, as it does for tile blocks, instead
// of two broadcast words, a blend and a variable shift per 16 lanes.
//
// Scratch vs[16 (kb G + g) + m] (uint32, kb = tile token >> 2 the token's column, m = 0..15): byte
// tile_v_shift(t) / 8 of the word holds token t's codes of lanes m (low nibble) and m + 16 (high nibble), lanes in
// the nibble-V lane order of kernels_impl.h (lane u stands for coordinate pi(u); the accumulator is un-permuted as
// before). With pi(m) = c and pi(m + 16) = c + 8, the two codes are nibble n = c & 7 of the token's words
// w0 = c >> 3 and w0 + 1 (w0 = 0 or 2: the format core's j >> 3 and j & 7), and m = 4 (2 (n & 1) + w0 / 2) + (n >> 1).
// So per token the 16 bytes are
//   vector i = 2 (n & 1) + w0 / 2: even nibbles of (W0, W1), of (W2, W3), odd nibbles of (W0, W1), of (W2, W3),
//   byte n >> 1 of each: one select of a nibble mask and a 4-bit shift per vector (tokens are the SIMD lanes),
// then a byte shuffle inside each 128-bit lane (4 tokens x 4 bytes -> the column's 4 words, bytes in token order
// 0, 2, 1, 3) and a 4 x 4 transpose of 128-bit blocks (512-bit) or 128-bit permutes (256-bit) gather a column's 16
// words: about 28 (512-bit) or 64 (256-bit) operations per group and tile, against 5 per token and group (80 per
// tile) saved in the V loop at 16 lanes.
// Built for AVX2 and AVX-512 (F + BW) (kNibbleVScratch); elsewhere the V loop reads the nibble words directly.
// All functions here have internal linkage: this header is compiled into every per-ISA kernel file.
#pragma once
#include <cstdint>

#if defined(__x86_64__) && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fmkv::cpu {
namespace {

#if defined(__x86_64__) && defined(__AVX2__)
constexpr bool kNibbleVScratch = true;

// Dest byte 4 b + k of a 128-bit lane = source byte 4 tok(k) + b, tok = (0, 2, 1, 3): tile_v_shift's byte order.
#define FMKV_NIBBLE_V_BYTES 0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15

#if defined(__AVX512BW__)  // the avx512 and avx512vnni sets
// w: the section's words from the tile's first token (word w of group g, tile token t: w[(4 g + w) P + t]).
inline void nibble_unpack_v(const uint32_t* w, int64_t P, int32_t G, uint32_t* vs) {
  const __m512i m4 = _mm512_set1_epi32(0x0F0F0F0F);
  const __m512i bt = _mm512_broadcast_i32x4(_mm_setr_epi8(FMKV_NIBBLE_V_BYTES));
  for (int32_t g = 0; g < G; ++g) {
    const uint32_t* wg = w + 4 * g * P;
    const __m512i w0 = _mm512_loadu_si512((const void*)wg), w1 = _mm512_loadu_si512((const void*)(wg + P));
    const __m512i w2 = _mm512_loadu_si512((const void*)(wg + 2 * P)), w3 = _mm512_loadu_si512((const void*)(wg + 3 * P));
    __m512i y[4];  // m4 ? a : b (ternary logic 0xCA), then the in-lane byte transpose
    y[0] = _mm512_shuffle_epi8(_mm512_ternarylogic_epi32(m4, w0, _mm512_slli_epi32(w1, 4), 0xCA), bt);
    y[1] = _mm512_shuffle_epi8(_mm512_ternarylogic_epi32(m4, w2, _mm512_slli_epi32(w3, 4), 0xCA), bt);
    y[2] = _mm512_shuffle_epi8(_mm512_ternarylogic_epi32(m4, _mm512_srli_epi32(w0, 4), w1, 0xCA), bt);
    y[3] = _mm512_shuffle_epi8(_mm512_ternarylogic_epi32(m4, _mm512_srli_epi32(w2, 4), w3, 0xCA), bt);
    // 128-bit lane kb of y[i] holds words 4 i .. 4 i + 3 of column kb: column kb = lanes kb of y[0..3]
    const __m512i t0 = _mm512_shuffle_i32x4(y[0], y[1], 0x44), t1 = _mm512_shuffle_i32x4(y[0], y[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(y[2], y[3], 0x44), t3 = _mm512_shuffle_i32x4(y[2], y[3], 0xEE);
    _mm512_storeu_si512((void*)(vs + 16 * g), _mm512_shuffle_i32x4(t0, t2, 0x88));
    _mm512_storeu_si512((void*)(vs + 16 * (G + g)), _mm512_shuffle_i32x4(t0, t2, 0xDD));
    _mm512_storeu_si512((void*)(vs + 16 * (2 * G + g)), _mm512_shuffle_i32x4(t1, t3, 0x88));
    _mm512_storeu_si512((void*)(vs + 16 * (3 * G + g)), _mm512_shuffle_i32x4(t1, t3, 0xDD));
  }
}
#else
inline __m256i nibble_select(__m256i m, __m256i a, __m256i b) {  // m ? a : b
  return _mm256_or_si256(_mm256_and_si256(m, a), _mm256_andnot_si256(m, b));
}
inline void nibble_unpack_v(const uint32_t* w, int64_t P, int32_t G, uint32_t* vs) {
  const __m256i m4 = _mm256_set1_epi32(0x0F0F0F0F);
  const __m256i bt = _mm256_setr_epi8(FMKV_NIBBLE_V_BYTES, FMKV_NIBBLE_V_BYTES);
  for (int32_t g = 0; g < G; ++g)
    for (int32_t half = 0; half < 2; ++half) {  // tokens 8 half .. 8 half + 7: columns 2 half, 2 half + 1
      const uint32_t* wg = w + 4 * g * P + 8 * half;
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)wg), w1 = _mm256_loadu_si256((const __m256i*)(wg + P));
      const __m256i w2 = _mm256_loadu_si256((const __m256i*)(wg + 2 * P)), w3 = _mm256_loadu_si256((const __m256i*)(wg + 3 * P));
      __m256i y[4];
      y[0] = _mm256_shuffle_epi8(nibble_select(m4, w0, _mm256_slli_epi32(w1, 4)), bt);
      y[1] = _mm256_shuffle_epi8(nibble_select(m4, w2, _mm256_slli_epi32(w3, 4)), bt);
      y[2] = _mm256_shuffle_epi8(nibble_select(m4, _mm256_srli_epi32(w0, 4), w1), bt);
      y[3] = _mm256_shuffle_epi8(nibble_select(m4, _mm256_srli_epi32(w2, 4), w3), bt);
      for (int32_t c = 0; c < 2; ++c) {  // column 2 half + c: 128-bit lanes c of y[0..3]
        uint32_t* o = vs + 16 * ((2 * half + c) * G + g);
        const __m256i lo = c ? _mm256_permute2x128_si256(y[0], y[1], 0x31) : _mm256_permute2x128_si256(y[0], y[1], 0x20);
        const __m256i hi = c ? _mm256_permute2x128_si256(y[2], y[3], 0x31) : _mm256_permute2x128_si256(y[2], y[3], 0x20);
        _mm256_storeu_si256((__m256i*)o, lo);
        _mm256_storeu_si256((__m256i*)(o + 8), hi);
      }
    }
}
#endif
#undef FMKV_NIBBLE_V_BYTES
#else
constexpr bool kNibbleVScratch = false;
inline void nibble_unpack_v(const uint32_t*, int64_t, int32_t, uint32_t*) {}  // never called (kNibbleVScratch)
#endif

}  // namespace
}  // namespace fmkv::cpu
