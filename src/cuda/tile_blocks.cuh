// Format version 3's 3-bit codes on the GPU (FORMAT.md section 4 "Integer levels", section 6 "Tile
// blocks"): the exact quantizer of one vector with tables 1 / 2, the writers of a token's codes into its
// tile block, and the decode of a lane's tile-block words into mma operands.
//  * tile_quantizer_tables (host): thresholds and levels of table 1 (K) or 2 (V) from the format core.
//  * warp_quantize_exact: one warp per head vector (lane = coordinate lane + 32 r of group r, as
//    warp_quantize_groups): codes by the reference's own compare of fl(y / s) with the thresholds (these
//    thresholds have up to 18 significant bits, so the division-free compare of format 2's quantizers does
//    not apply), tree sums in tree_sum32's order: bytes equal to the reference's.
//  * tile_put_codes_atomic: a lane's codes written bit by bit with global atomics (set / clear one bit
//    each), so writers of different tokens of one tile never race (the fused step).
//  * tile_writers.cuh: the append's writers of one token's group (the thread quantizer's nibble words):
//    whole words when a warp holds the tokens sharing them, else red.and / red.or per word.
//  * Decode (decode_attention.cuh): a lane's X[g] / Y[g] words are its operands of the tile's
//    mma fragments; one prmt per four int8 K levels (tile_k_fragment) or per fp16 V pair
//    (tile_v_fragment), from 8-byte tables built at compile time from the generated integer levels.
#pragma once
#include "../format/codebook.h"
#include "../format/pack.h"
#include "code_widths.cuh"
#include "quantize.cuh"
#include "tile_writers.cuh"

namespace fmkv {
namespace cuda {

// ---- quantizer -------------------------------------------------------------------------------------

// Table `table` (1: K, 2: V) of 3-bit codes as QuantTables. Host side.
inline QuantTables tile_quantizer_tables(int table) {
  QuantTables q;
  std::memset(&q, 0, sizeof(q));
  for (int m = 0; m < 4; ++m) q.mag[m] = table_mag(table, 3, m);
  for (int i = 0; i < 3; ++i) {
    q.thr[i] = table_threshold(table, 3, i);
    q.hulp[i] = (std::nextafter(q.thr[i], INFINITY) - q.thr[i]) * 0.5f;  // (exact_threshold)
  }
  return q;
}

// Quantize the NR groups of one rotated vector held by a warp (y[g]: coordinate lane of group g) with a
// 3-bit table q of format 3: code[g] (sign bit 2, magnitude bits 0-1), scale[g] (fp16 bits; uniform over the
// warp). y[g] becomes the dequantized value level x scale. Every lane computes the same tree sums. ss: the
// scale shift (1: scale group 64, groups 2k and 2k + 1 get their scale group's scale, pair_group_sums).
template <int NR>
__device__ __forceinline__ void warp_quantize_exact(float (&y)[NR], const QuantTables& q, int rule, int ss,
                                                    uint32_t (&code)[NR], uint16_t (&scale)[NR]) {
  float t[NR];
#pragma unroll
  for (int g = 0; g < NR; ++g) t[g] = __fmul_rn(y[g], y[g]);
  warp_tree_sum32_n<NR>(t);
  if (ss) pair_group_sums<NR>(t);
  float l[NR], num[NR], den[NR];
#pragma unroll
  for (int g = 0; g < NR; ++g) {
    const uint16_t s0 = rms_scale(t[g], FMKV_GROUP_SIZE << ss);
    const bool nz = s0 != 0;  // warp-uniform; a zero scale: every code 0, scale 0 (FORMAT.md 5)
    const float u = nz ? __fdiv_rn(y[g], f16_bits_to_f32_hw(s0)) : 0.0f;
    const float a = fabsf(u);
    const uint32_t m = (a > q.thr[0] ? 1u : 0u) + (a > q.thr[1] ? 1u : 0u) + (a > q.thr[2] ? 1u : 0u);
    const float mag = m == 0 ? q.mag[0] : m == 1 ? q.mag[1] : m == 2 ? q.mag[2] : q.mag[3];
    const bool neg = nz && u < 0.0f;
    code[g] = nz ? (neg ? 4u : 0u) | m : 0u;
    l[g] = nz ? (neg ? -mag : mag) : 0.0f;
    scale[g] = s0;
    num[g] = __fmul_rn(y[g], l[g]);
    den[g] = __fmul_rn(l[g], l[g]);
  }
  if (rule == FMKV_SCALE_LSQ) {
    warp_tree_sum32_n<NR>(num);
    warp_tree_sum32_n<NR>(den);
    if (ss) {
      pair_group_sums<NR>(num);
      pair_group_sums<NR>(den);
    }
#pragma unroll
    for (int g = 0; g < NR; ++g)
      if (scale[g] != 0) scale[g] = lsq_scale(num[g], den[g]);
  }
#pragma unroll
  for (int g = 0; g < NR; ++g) y[g] = l[g] * f16_bits_to_f32_hw(scale[g]);
}

// The codes of tile token t16 (code[g]: coordinate `lane` of group g) into the tile block at `block`,
// one global atomic per bit (atomicOr to set, atomicAnd to clear): other tokens' bits are untouched and
// concurrent writers of other tokens of the tile commute.
template <int NR>
__device__ __forceinline__ void tile_put_codes_atomic(uint8_t* block, int is_v, int t16, const uint32_t (&code)[NR],
                                                      int lane) {
#pragma unroll
  for (int g = 0; g < NR; ++g)
#pragma unroll
    for (int b = 0; b < 3; ++b) {
      const int n = fmkv_tile_code_bit(NR, is_v, t16, g, lane, b);
      unsigned int* w = reinterpret_cast<unsigned int*>(block) + (n >> 5);
      const unsigned int bit = 1u << (n & 31);
      if ((code[g] >> b) & 1u) atomicOr(w, bit);
      else atomicAnd(w, ~bit);
    }
}

// ---- decode --------------------------------------------------------------------------------------

// Is a b-bit section of a format-`F3 ? 3 : 2` kernel stored in tile blocks?
template <int BITS, bool F3>
constexpr bool kTiled = F3 && is_tiled_bits(BITS);

// The generated integer levels (codebooks.inc) at compile time.
constexpr int kTileInt[2][4] = FMKV_CODEBOOK3_INT;
// int8 bytes of K codes 0..7 (sign-magnitude: codes 4..7 are the negatives of 0..3), in two words.
constexpr uint32_t tile_k_table(int half) {
  uint32_t w = 0;
  for (int i = 0; i < 4; ++i) {
    const int c = 4 * half + i, v = c < 4 ? kTileInt[0][c] : -kTileInt[0][c - 4];
    w |= (uint32_t)(uint8_t)(int8_t)v << (8 * i);
  }
  return w;
}
// fp16 high byte of a small integer v (1 <= v <= 2^14 with at most 3 significant bits: the low byte is 0).
constexpr uint32_t f16_high_byte(int v) {
  int e = 0;
  while ((v >> (e + 1)) != 0) ++e;  // v = 1.m x 2^e
  const int mant = (v << 10 >> e) & 1023;
  return (uint32_t)(((e + 15) << 10 | mant) >> 8);
}
constexpr bool f16_low_byte_zero(int v) {
  int e = 0;
  while ((v >> (e + 1)) != 0) ++e;
  return (((v << 10 >> e) & 1023) & 0xff) == 0 && (v << 10 >> e << e >> 10) == v;
}
// fp16 high bytes of V codes 0..7 (sign in bit 7), in two words.
constexpr uint32_t tile_v_table(int half) {
  uint32_t w = 0;
  for (int i = 0; i < 4; ++i) {
    const int c = 4 * half + i;
    w |= (f16_high_byte(kTileInt[1][c & 3]) | (c >= 4 ? 0x80u : 0u)) << (8 * i);
  }
  return w;
}
static_assert(f16_low_byte_zero(kTileInt[1][0]) && f16_low_byte_zero(kTileInt[1][1]) && f16_low_byte_zero(kTileInt[1][2]) &&
                  f16_low_byte_zero(kTileInt[1][3]),
              "V levels of format 3 must be fp16 values with a zero low byte (one-permute fp16 pairs)");
static_assert(f16_high_byte(1) == 0x3c && f16_high_byte(8) == 0x48 && f16_high_byte(5) == 0x45, "fp16 high bytes");
constexpr uint32_t kTileK0 = tile_k_table(0), kTileK1 = tile_k_table(1);
constexpr uint32_t kTileV0 = tile_v_table(0), kTileV1 = tile_v_table(1);
// The rotated query in two int8 parts: q16 = 256 qh + ql with |q16| <= 32639 (= 256 x 127 + 127).
constexpr float kTileQScale = 32639.0f;

__device__ __forceinline__ void mma16832s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The hole codes of a lane's group: nibble j = (X bit 4 j + 3, X bit 16 + 4 j + 3, Y bit 4 j + 3).
__device__ __forceinline__ uint32_t tile_holes(uint32_t X, uint32_t Y) {
  return ((X >> 3) & 0x1111u) | ((X >> 18) & 0x2222u) | ((Y >> 1) & 0x4444u);
}
// K (A operand of mma.m16n8k32 s8; rows gID / gID + 8 = tile tokens 2 gID / 2 gID + 1, k = coordinates
// 4 tid .. + 3 (a0, a1) and 16 + 4 tid .. + 3 (a2, a3) of the group): int8 levels, one prmt per register.
__device__ __forceinline__ void tile_k_fragment(uint32_t X, uint32_t Y, uint32_t (&a)[4]) {
  a[0] = prmt(kTileK0, kTileK1, X & 0x7777u);
  a[1] = prmt(kTileK0, kTileK1, Y & 0x7777u);
  a[2] = prmt(kTileK0, kTileK1, (X >> 16) & 0x7777u);
  a[3] = prmt(kTileK0, kTileK1, tile_holes(X, Y));
}
// V (A operands of the two mma.m16n8k16 of a group; a[0..3] mma 0, a[4..7] mma 1; rows = coordinates
// 32 g + 16 mt + gID (+ 8), k = tile tokens in the transposed-P order): fp16 pairs of high bytes, the low
// bytes from selector nibble z (0x8: the sign of table byte 0, a positive level: 0x00).
__device__ __forceinline__ void tile_v_fragment(uint32_t X, uint32_t Y, uint32_t z, uint32_t (&a)[8]) {
  const uint32_t hole = tile_holes(X, Y);
  auto pair = [&](uint32_t v) { return prmt(kTileV0, kTileV1, (v & 0x7070u) | z); };
  a[0] = pair(X << 4);
  a[1] = pair(X);
  a[2] = pair(X >> 12);
  a[3] = pair(X >> 16);
  a[4] = pair(Y << 4);
  a[5] = pair(Y);
  a[6] = pair(hole << 4);
  a[7] = pair(hole);
}
// The lane's X[g] and Y[g] words of a staged tile block cb (X: 4 G bytes per lane, Y: 2 G after all X).
template <int G>
__device__ __forceinline__ void tile_load(const uint8_t* cb, int lane, uint32_t (&X)[G], uint32_t (&Y)[G]) {
  const uint8_t* xp = cb + 4 * G * lane;
  const uint8_t* yp = cb + 128 * G + 2 * G * lane;
  if constexpr (G % 4 == 0) {
#pragma unroll
    for (int i = 0; i < G; i += 4) {
      const uint4 w = *(const uint4*)(xp + 4 * i);
      X[i] = w.x;
      X[i + 1] = w.y;
      X[i + 2] = w.z;
      X[i + 3] = w.w;
    }
#pragma unroll
    for (int i = 0; i < G; i += 4) {
      const uint2 w = *(const uint2*)(yp + 2 * i);
      Y[i] = w.x & 0xffffu;
      Y[i + 1] = w.x >> 16;
      Y[i + 2] = w.y & 0xffffu;
      Y[i + 3] = w.y >> 16;
    }
  } else {
    static_assert(G == 2, "head_dim 64, 128 or 256");
    const uint2 w = *(const uint2*)xp;
    X[0] = w.x;
    X[1] = w.y;
    const uint32_t y = *(const uint32_t*)yp;
    Y[0] = y & 0xffffu;
    Y[1] = y >> 16;
  }
}

}  // namespace cuda
}  // namespace fmkv
