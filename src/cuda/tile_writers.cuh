// The append's writers of format 3's tile blocks (FORMAT.md section 6 "Tile blocks"): one token's 3-bit codes of
// one group, from the thread quantizer's nibble words, into its 16-token block -- as whole words stored once
// when a warp holds every token that shares them (tile_put_group_words, a prefill chunk), else merged word by
// word with reductions that commute with other tokens' writers (tile_put_group_red). Device code that needs only
// __byte_perm, __shfl_xor_sync, atomicAnd and atomicOr, so tests/cuda/tile_writers_host_check.cpp runs it on
// the host (a thread per lane) against the format core's tile_put_code.
#pragma once
#include <cstdint>

#include "fmkv/format.h"

namespace fmkv {
namespace cuda {

// Tile token t16's bits of one group, from its 3-bit codes as nibble words cw (coordinate c at nibble c & 7 of
// word c >> 3: magnitude bits 0-1, sign bit 2; thread_quantize_group's NIB output), word by word:
// f(slot, kind, lane, mask, bits) for each block word the token shares -- kind kTileX: the X word of `lane`,
// kTileY: its Y half-word (bits 0-15); mask: the token's bits in it. K: the even token's 4 X words (slots 0-3:
// bits 0-2 of every nibble), or the odd token's hole bits in the same X words (slots 0-3: bit 3 of every
// nibble) and its 4 Y half-words (slots 4-7, whole); V: for gID 0..7 the X word (slot gID) and Y half-word
// (slot 8 + gID) of lane 4 gID + tid, which the 4 tokens 4 tid .. 4 tid + 3 share (disjoint bits; together
// every bit of the word). The nibble order makes these byte moves: K's X word j is the 16-bit halves j & 1
// of nibble words j >> 1 and 2 + (j >> 1) (one permute); V's bytes (code(gID) | code(gID + 8) << 4) and
// (code(gID + 16) | code(gID + 24) << 4) are nibble interleaves of words 0, 1 and 2, 3, gID even / odd apart.
enum TileWordKind { kTileX, kTileY };
template <class F>
__device__ __forceinline__ void tile_token_words(int is_v, int t16, const uint32_t (&cw)[4], F&& f) {
  if (!is_v) {
    const int l0 = 4 * (t16 >> 1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // low half: coordinates 4 j + e (nibble e), high half: 16 + 4 j + e (nibble 4 + e)
      const uint32_t lohi = __byte_perm(cw[j >> 1], cw[2 + (j >> 1)], (j & 1) ? 0x7632u : 0x5410u);
      if ((t16 & 1) == 0) {  // X nibbles: the codes (bits 0-2)
        f(j, kTileX, l0 + j, 0x77777777u, lohi);
      } else {  // hole codes hc = the high half: Y nibble e gets code(4 j + e) and hc bit 2 in bit 3, X bit 3s hc bits 0, 1
        const uint32_t hc = lohi >> 16;
        f(j, kTileX, l0 + j, 0x88888888u, (hc & 0x1111u) << 3 | (hc & 0x2222u) << 18);
        f(4 + j, kTileY, l0 + j, 0xffffu, (lohi & 0x7777u) | (hc & 0x4444u) << 1);
      }
    }
    return;
  }
  // V: k = the token's mma k index, lanes 4 gID + tid; coordinates gID, gID + 8 (mma 0) and gID + 16, gID + 24
  const int k = (t16 & 1) == 0 ? t16 >> 1 : 8 + (t16 >> 1), tid = (k & 7) >> 1, h = k & 1;
  const bool hole = k >= 8;
  // byte gID >> 1 of xe (gID even) / xo (odd): code(gID) | code(gID + 8) << 4; of ye / yo: code(gID + 16) | code(gID + 24) << 4
  const uint32_t xe = (cw[0] & 0x0F0F0F0Fu) | (cw[1] & 0x0F0F0F0Fu) << 4, xo = (cw[0] >> 4 & 0x0F0F0F0Fu) | (cw[1] & 0xF0F0F0F0u);
  const uint32_t ye = (cw[2] & 0x0F0F0F0Fu) | (cw[3] & 0x0F0F0F0Fu) << 4, yo = (cw[2] >> 4 & 0x0F0F0F0Fu) | (cw[3] & 0xF0F0F0F0u);
  // The token's bytes of every gID of one parity at once (byte gID >> 1), then one permute per word and gID:
  //  k < 8:  X byte h = the x byte (X nibbles 2h, 2h + 1, bits 0-2), Y byte h = the y byte (the same in Y);
  //  k >= 8: X byte 2 + h = the x byte (X nibbles 4 + 2h, 5 + 2h) with the y byte's bits 1 / 5 in bits 3 / 7, X byte h
  //          = its bits 0 / 4 in bits 3 / 7, Y byte h = its bits 2 / 6 in bits 3 / 7 (the holes of code(gID + 16),
  //          code(gID + 24)).
  // P (-> X byte h), Q (-> X byte 2 + h; 0 for k < 8) and R (-> Y byte h) of gID parity e (0 even, 1 odd):
  uint32_t P[2], Q[2], R[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const uint32_t x = e ? xo : xe, y = e ? yo : ye;
    P[e] = hole ? (y & 0x11111111u) << 3 : x;
    Q[e] = hole ? x | (y & 0x22222222u) << 2 : 0u;
    R[e] = hole ? (y & 0x44444444u) << 1 : y;
  }
  // permute selectors for byte b = gID >> 1: X takes P's byte b into byte h and Q's into byte 2 + h (the other two
  // bytes masked off), Y takes R's byte b into byte h and zero bytes elsewhere
  const uint32_t sx0 = 4u << (4 * (2 + h)), sxi = 1u << (4 * h) | 1u << (4 * (2 + h));
  const uint32_t sy0 = 0x4444u - (4u << (4 * h)), syi = 1u << (4 * h);
  const uint32_t xkeep = 0xffu << (8 * h) | 0xffu << (16 + 8 * h);
  // the token's bits of the words (masks of the reductions): X nibbles 2h, 2h + 1 / Y nibbles 2h, 2h + 1 (bits 0-2),
  // or X nibbles 4 + 2h, 5 + 2h (bits 0-2) and bit 3 of X nibbles 2h, 2h + 1, 4 + 2h, 5 + 2h / of Y nibbles 2h, 2h + 1
  const uint32_t xm = hole ? 0x77u << (16 + 8 * h) | 0x88u << (8 * h) | 0x88u << (16 + 8 * h) : 0x77u << (8 * h);
  const uint32_t ym = (hole ? 0x88u : 0x77u) << (8 * h);
#pragma unroll
  for (int gid = 0; gid < 8; ++gid) {
    const int e = gid & 1, bb = gid >> 1;
    const uint32_t xb = __byte_perm(P[e], Q[e], sx0 + bb * sxi) & xkeep, yb = __byte_perm(R[e], 0u, sy0 + bb * syi);
    f(gid, kTileX, 4 * gid + tid, xm, xb);
    f(8 + gid, kTileY, 4 * gid + tid, ym, yb);
  }
}

// Byte offsets in a block of G groups: X[lane][g] (32 bits), Y[lane][g] (16 bits).
template <int G>
__device__ __forceinline__ int tile_x_offset(int lane, int g) { return 4 * (G * lane + g); }
template <int G>
__device__ __forceinline__ int tile_y_offset(int lane, int g) { return 128 * G + 2 * (G * lane + g); }

// Group g of tile token t16 (its nibble words w) into the tile block, merged by reductions (red.and clears the token's bits,
// red.or sets them): other tokens' bits never change, so writers of other tokens of the tile (other threads of
// the append) commute with these. K's Y half-words belong to the odd token alone (plain stores); V's are
// merged in their 32-bit words.
template <int G>
__device__ __forceinline__ void tile_put_group_red(uint8_t* block, int is_v, int t16, int g, const uint32_t (&w)[4]) {
  auto merge = [&](int byte_off, uint32_t mask, uint32_t bits) {
    unsigned int* a = reinterpret_cast<unsigned int*>(block + byte_off);
    atomicAnd(a, bits | ~mask);
    atomicOr(a, bits);
  };
  tile_token_words(is_v, t16, w, [&](int, int kind, int lane, uint32_t mask, uint32_t bits) {
    if (kind == kTileX) {
      merge(tile_x_offset<G>(lane, g), mask, bits);
    } else if (!is_v) {
      *reinterpret_cast<uint16_t*>(block + tile_y_offset<G>(lane, g)) = (uint16_t)bits;
    } else {  // the half-word's 32-bit word (G is even)
      const int off = tile_y_offset<G>(lane, g), sh = 8 * (off & 2);
      merge(off & ~3, mask << sh, bits << sh);
    }
  });
}

// Group g of tile token t16 (its nibble words w) into the tile block as whole words, when the warp's lanes hold consecutive tokens
// of one section from a multiple of 8 (lane = (token - first) NT + thread, NT threads per vector, every lane
// calling with its own token): the tokens sharing a word -- K: t16 and t16 ^ 1, V: the quad t16 ^ {0, 1, 2, 3}
// -- sit NT and 2 NT lanes apart, so their bits are ORed by shuffles and each word stored once (no atomics, no
// read of the old block). K: the even token stores the X words, the odd token its Y half-words. V: the quad's 16
// words (8 X, 8 Y) are reduced and scattered in two rounds (round 1 pairs tokens q, q ^ 1 and keeps the words
// whose slot has bit 0 = q & 1; round 2 pairs q, q ^ 2 and keeps bit 1 = q >> 1), so token q of the quad stores
// slots q, 4 + q (X of gID q, 4 + q) and 8 + q, 12 + q (Y of the same). Every lane of the warp must call it.
template <int G, int NT>
__device__ __forceinline__ void tile_put_group_words(uint8_t* block, int is_v, int t16, int g, const uint32_t (&w)[4]) {
  uint32_t val[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) val[i] = 0u;
  tile_token_words(is_v, t16, w, [&](int slot, int, int, uint32_t, uint32_t bits) { val[slot] = bits; });
  if (!is_v) {
    const int l0 = 4 * (t16 >> 1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, val[j], NT);
      if ((t16 & 1) == 0) *reinterpret_cast<uint32_t*>(block + tile_x_offset<G>(l0 + j, g)) = val[j] | other;
      else *reinterpret_cast<uint16_t*>(block + tile_y_offset<G>(l0 + j, g)) = (uint16_t)val[4 + j];
    }
    return;
  }
  const int q = t16 & 3, tid = t16 >> 2;  // the quad 4 tid .. 4 tid + 3 shares lanes 4 gID + tid
  uint32_t v8[8];  // v8[i]: slot 2 i + (q & 1), ORed over tokens q, q ^ 1
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t keep = (q & 1) ? val[2 * i + 1] : val[2 * i], send = (q & 1) ? val[2 * i] : val[2 * i + 1];
    v8[i] = keep | __shfl_xor_sync(0xffffffffu, send, NT);
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) {  // slot 4 m + q, ORed over the quad
    const uint32_t keep = (q & 2) ? v8[2 * m + 1] : v8[2 * m], send = (q & 2) ? v8[2 * m] : v8[2 * m + 1];
    const uint32_t word = keep | __shfl_xor_sync(0xffffffffu, send, 2 * NT);
    const int lane = 4 * ((4 * m + q) & 7) + tid;
    if (m < 2) *reinterpret_cast<uint32_t*>(block + tile_x_offset<G>(lane, g)) = word;
    else *reinterpret_cast<uint16_t*>(block + tile_y_offset<G>(lane, g)) = (uint16_t)word;
  }
}

}  // namespace cuda
}  // namespace fmkv
