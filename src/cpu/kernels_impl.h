// CPU kernels written once over the SIMD traits of simd.h; each per-ISA .cpp includes this file
// after defining nothing but its -m flags, and instantiates make_kernels<Traits>().
// Everything here has internal linkage (anonymous namespace, no std:: templates) so that code built
// with different -m flags is never merged by the linker.
#pragma once
#include <cstring>

#include "../format/quantize_group.h"
#include "fmkv/params.h"
#include "kernels.h"
#include "nibble_v_scratch.h"
#include "simd.h"
#include "tile.h"

namespace fmkv::cpu {
namespace {

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }


// Lane order of V accumulators (all V widths): lane u (0..31) of a group holds coordinate pi(u), the
// coordinate whose 2-bit field sits in field word u >> 4 at shift 2 * (u & 15). With this order a
// broadcast field word shifted by a constant per-lane vector yields every lane's magnitude, no
// shuffles (b = 3). b = 2 shifts the broadcast 1-bit planes by per-lane constants (pi_srl, sign_shl).
// b = 4 (nibble words): lane u needs nibble pi(u) & 7 of word nib_word[u] = pi(u) >> 3; written out,
//   pi(u) = 16 * ((u >> 2) & 1) + 8 * (u >> 4) + 2 * (u & 3) + ((u >> 3) & 1),
//   nib_word[u] = 2 * ((u >> 2) & 1) + (u >> 4),
// so every run of 4 lanes u = 4k .. 4k + 3 reads one word: a block of N <= 4 lanes one word, a block of
// N = 8 or 16 lanes (u0 = hv * N, a multiple of 8) word u0 >> 4 in the lanes with lane-index bit 2
// clear and word (u0 >> 4) + 2 in those with it set (one blend of two broadcasts per token).
struct LaneTables {
  alignas(64) uint32_t pi[32], field_shift[32], pi_srl[32], sign_shl[32], nib_word[32], nib_shift[32],
      nib_sign_shl[32];
  LaneTables() {
    for (int j = 0; j < 32; ++j) {
      int u = 16 * fmkv_field_word(j) + fmkv_field_shift(j) / 2;
      pi[u] = (uint32_t)j;
    }
    for (int u = 0; u < 32; ++u) {
      int j = (int)pi[u];
      field_shift[u] = (uint32_t)(2 * (u & 15));
      pi_srl[u] = (uint32_t)j;                                  // bit j -> bit 0
      sign_shl[u] = (uint32_t)(31 - j);                         // bit j -> bit 31
      nib_word[u] = (uint32_t)fmkv_nibble_word(j);              // the nibble word holding code j
      nib_shift[u] = (uint32_t)fmkv_nibble_shift(j);            // its nibble -> bits 0..3
      nib_sign_shl[u] = (uint32_t)(28 - fmkv_nibble_shift(j));  // nibble bit 3 (sign) -> bit 31
    }
  }
};
const LaneTables& lane_tables() {
  static const LaneTables t;
  return t;
}

void unpermute_acc(const float* acc, int32_t d, float* out) {
  const LaneTables& lt = lane_tables();
  for (int32_t g = 0; g < d / 32; ++g)
    for (int u = 0; u < 32; ++u) out[g * 32 + (int)lt.pi[u]] = acc[g * 32 + u];
}

// ---- quantize: rotate (FWHT), group scale, codes, code words -------------------------------
// One head vector per call, single thread. Bit-exact with ref::quantize_vector + write_token_codes:
// identical float32 operations (no fma), tree_sum32 pairing reproduced across and inside vectors; codes
// from the exactly rounded quotient y / s compared with the codebook's thresholds (qp.thr: any table).
// TILED (B = 3, format 3): the group's three bit planes go into the token's tile block (tile_write_planes).
template <class T, int D, int B, bool TILED>
void quantize_t(const QuantParams& qp, const uint16_t* x, uint8_t* section, int32_t P, int32_t t) {
  using F = typename T::F;
  using I = typename T::I;
  constexpr int N = T::N, NV = D / N, K = 32 / N, NM = 1 << (B - 1);
  F y[NV];
  for (int k = 0; k < NV; ++k) y[k] = T::xor_i(T::load_h(x + k * N), T::loadi(qp.sign_xor + k * N));
  for (int h = 1; h < D; h <<= 1) {
    if (h < N) {  // in-register stage: lane i pairs with lane i ^ h
      for (int k = 0; k < NV; ++k) {
        F p = T::perm_xor(y[k], h);
        y[k] = T::blend_hbit(T::add(y[k], p), T::sub(p, y[k]), h);
      }
    } else {
      const int hv = h / N;
      for (int k0 = 0; k0 < NV; k0 += 2 * hv)
        for (int k = k0; k < k0 + hv; ++k) {
          F a = y[k], b = y[k + hv];
          y[k] = T::add(a, b);
          y[k + hv] = T::sub(a, b);
        }
    }
  }
  const F nv = T::set1(qp.norm);
  for (int k = 0; k < NV; ++k) y[k] = T::mul(y[k], nv);
  const typename T::Table tmag = T::load_table(qp.mag16);
  const typename T::Table16 tmag16 = T::load_table16(qp.mag16);  // B = 5: 16 magnitudes

  uint32_t* words = (uint32_t*)section;
  uint16_t* scales = (uint16_t*)(section + fmkv_scales_offset(D, B, P));
  const int n = 1 << qp.ssh;  // code groups per scale (FORMAT.md "Scale groups")
  for (int sgi = 0; sgi < D / 32 / n; ++sgi) {
    float ss = 0.0f;  // the scale group's sum of squares: its code groups' tree sums, added in order
    for (int h = 0; h < n; ++h) {
      const F* yg = y + (sgi * n + h) * K;
      F tt[K];
      for (int k = 0; k < K; ++k) tt[k] = T::mul(yg[k], yg[k]);
      for (int s = K / 2; s >= 1; s >>= 1)
        for (int k = 0; k < s; ++k) tt[k] = T::add(tt[k], tt[k + s]);
      const float a = T::tree_reduce(tt[0]);
      ss = h == 0 ? a : ss + a;
    }
    const uint16_t s0 = rms_scale(ss, 32 * n);
    const float s0f = T::f_from_h(s0);
    float num = 0.0f, den = 0.0f;  // LSQ sums over the scale group, added the same way
    for (int h = 0; h < n; ++h) {
      const int g = sgi * n + h;
      const F* yg = y + g * K;
      uint32_t w[5] = {0, 0, 0, 0, 0};
      uint32_t sign = 0, b0 = 0, b1 = 0;  // 2, 3, 5 bits: bit j = coordinate j's sign; 2, 3: magnitude bits 0, 1
      if (s0f != 0.0f) {
        const F sv = T::set1(s0f);
        I mm[K], cc[K];
        F u[K];
        for (int k = 0; k < K; ++k) {
          u[k] = T::div(yg[k], sv);
          const F a = T::abs(u[k]);
          I m = T::set1i(0);
          for (int i = 0; i + 1 < NM; ++i) m = T::count_gt(m, a, qp.thr[i]);
          mm[k] = m;
          if constexpr (B == 4) {
            cc[k] = T::code4(m, u[k]);  // whole code m | sign << 3
          } else if constexpr (B == 5) {
            cc[k] = m;  // the magnitude's nibble; the sign goes to the sign plane
            sign |= T::ltzero_mask(u[k]) << (k * N);
          } else {
            sign |= T::ltzero_mask(u[k]) << (k * N);
            b0 |= T::bitmask(m, 0) << (k * N);
            if (B == 3) b1 |= T::bitmask(m, 1) << (k * N);
          }
        }
        if (B == 2) {
          w[0] = b0;
          w[1] = sign;
        } else if (B == 3 && !TILED) {  // 2-bit field plane (words 0, 1), sign plane (word 2)
          for (int fw = 0; fw < 2; ++fw)
            for (int byte = 0; byte < 4; ++byte) {
              const int base = 8 * fw + (byte >> 1) + 16 * (byte & 1);
              const uint32_t v = ((b0 >> base) & 0x55u) | (((b1 >> base) & 0x55u) << 1);
              w[fw] |= v << (8 * byte);
            }
          w[2] = sign;
        } else if (B == 4) {  // nibble words: code j at bits 4 (j & 7) .. of word j >> 3
          T::pack_nibbles(cc, w);
        } else if (B == 5) {  // nibble words of the magnitudes (words 0..3), sign plane (word 4)
          T::pack_nibbles(cc, w);
          w[4] = sign;
        }  // (B = 3 tiled: the planes sign, b0, b1 are written below)
        if (qp.rule == FMKV_SCALE_LSQ) {
          F nn[K], dd[K];
          for (int k = 0; k < K; ++k) {
            const F lv = T::negate_if_lt0(B == 5 ? T::lut16(tmag16, mm[k]) : T::lut(tmag, mm[k]), u[k]);
            nn[k] = T::mul(yg[k], lv);
            dd[k] = T::mul(lv, lv);
          }
          for (int s = K / 2; s >= 1; s >>= 1)
            for (int k = 0; k < s; ++k) {
              nn[k] = T::add(nn[k], nn[k + s]);
              dd[k] = T::add(dd[k], dd[k + s]);
            }
          const float a = T::tree_reduce(nn[0]), b = T::tree_reduce(dd[0]);
          num = h == 0 ? a : num + a;
          den = h == 0 ? b : den + b;
        }
      }
      if constexpr (TILED) {
        tile_write_planes(section + fmkv_tile_block_offset(D, t), D / 32, qp.is_v, t & 15, g, b0, b1, sign);
      } else {
        for (int wi = 0; wi < B; ++wi) words[((int64_t)g * B + wi) * P + t] = w[wi];
      }
    }
    scales[(int64_t)sgi * P + t] = s0f != 0.0f && qp.rule == FMKV_SCALE_LSQ ? lsq_scale(num, den) : s0;
  }
}

template <class T>
void quantize_dispatch(const QuantParams& qp, const uint16_t* x, uint8_t* section, int32_t P, int32_t t) {
#define FMKV_Q(D, B) \
  if (qp.d == D && qp.bits == B) return quantize_t<T, D, B, false>(qp, x, section, P, t);
#define FMKV_QT(D) \
  if (qp.d == D && qp.bits == 3 && qp.tiled) return quantize_t<T, D, 3, true>(qp, x, section, P, t);
  FMKV_QT(64) FMKV_QT(128) FMKV_QT(256)
  FMKV_Q(64, 2) FMKV_Q(64, 3) FMKV_Q(64, 4) FMKV_Q(64, 5)
  FMKV_Q(128, 2) FMKV_Q(128, 3) FMKV_Q(128, 4) FMKV_Q(128, 5)
  FMKV_Q(256, 2) FMKV_Q(256, 3) FMKV_Q(256, 4) FMKV_Q(256, 5)
#undef FMKV_QT
#undef FMKV_Q
}

// ---- format 3's K with integer dot products (traits with kIntDot: AVX-512 VNNI) ------------------
// A group's rotated query (32 coordinates, K scratch order) as integers q24 on a per-(vector, group) scale
// qs = max |q| / kQMax, written as kQParts int8 parts q24 = 65536 p0 + 256 p1 + p2 (each in [-128, 127]):
// 24 bits, as precise as the float32 path. The levels are the table's integers L (|L| <= 127) biased to
// u8 (L + 128) for vpdpbusd's unsigned operand; the bias is taken out by starting each part's
// accumulator at -128 * (the part's sum over the group). Every int32 sum is exact: |sum L p| <= 32 * 127
// * 128, and (acc1 << 8) + acc2 < 2^31; the parts are joined in float: 65536 acc0 + ((acc1 << 8) + acc2).
constexpr int kQParts = 3;
constexpr int32_t kQMax = 127 * 65536;

template <int R>
struct IntQuery {
  uint32_t dw[R][8][4][2][kQParts];  // [r][g][word w][half h][part]: int8 parts of coordinates 8 w + h + {0, 2, 4, 6}
  int32_t corr[R][8][kQParts];       // -128 * sum of the part over the group
  float scale[R][8];                 // qs * the level table's step
};

template <int R>
void make_int_query(const float* const* q, int32_t d, float step, IntQuery<R>& o) {
  for (int r = 0; r < R; ++r)
    for (int32_t g = 0; g < d / 32; ++g) {
      const float* qg = q[r] + 32 * g;
      float mx = 0.0f;
      for (int j = 0; j < 32; ++j) mx = __builtin_fabsf(qg[j]) > mx ? __builtin_fabsf(qg[j]) : mx;
      int8_t part[kQParts][32];
      for (int j = 0; j < 32; ++j) {
        int32_t v = mx > 0.0f ? (int32_t)__builtin_lrint((double)qg[j] * kQMax / mx) : 0;  // |v| <= kQMax
        for (int k = kQParts - 1; k >= 0; --k) {  // lowest part first, each in [-128, 127]
          const int32_t lo = ((v + 128) & 255) - 128;
          part[k][j] = (int8_t)lo;
          v = (v - lo) / 256;
        }
      }
      for (int k = 0; k < kQParts; ++k) {
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) sum += part[k][j];
        o.corr[r][g][k] = -128 * sum;
        for (int w = 0; w < 4; ++w)
          for (int h = 0; h < 2; ++h) {
            uint32_t x = 0;
            for (int b = 0; b < 4; ++b) x |= (uint32_t)(uint8_t)part[k][8 * w + h + 2 * b] << (8 * b);
            o.dw[r][g][w][h][k] = x;
          }
      }
      o.scale[r][g] = (float)((double)mx / kQMax * step);
    }
}

// ---- the R maxima of a block's scores in one reduction -------------------------------------------
// out[r] = the largest lane of x[r]. For N >= 8, vectors are folded in pairs at lane distance h = N / 2, N / 4, ...
// (fold(a, b, h): lanes with bit h clear hold max(a[i], a[i ^ h]), the others max(b[i], b[i ^ h]); 4 operations
// for two vectors) until one vector remains, which then folds into itself at the remaining distances: vector r's
// maximum ends in lane sum over levels k of bit k of r times N >> (k + 1). R = 4 at N = 16: 16 operations where
// four separate reductions take about 32. N < 8 (NEON's across-vector max is one instruction; scalar): one by one.
template <class T, int R>
void hmax_rows(const typename T::F* x, float* out) {
  using F = typename T::F;
  constexpr int N = T::N;
  constexpr int L = R <= 1 ? 0 : R <= 2 ? 1 : R <= 4 ? 2 : 3;  // pair levels
  if constexpr (N < 8 || (1 << L) > N) {
    for (int r = 0; r < R; ++r) out[r] = T::hmax(x[r]);
  } else {
    F v[R];
    for (int r = 0; r < R; ++r) v[r] = x[r];
    int n = R, h = N / 2;
    for (int k = 0; k < L; ++k, h /= 2) {
      for (int j = 0; 2 * j < n; ++j) {
        const F a = v[2 * j], b = 2 * j + 1 < n ? v[2 * j + 1] : a;
        v[j] = T::max(T::blend_hbit(a, b, h), T::perm_xor(T::blend_hbit(b, a, h), h));
      }
      n = (n + 1) / 2;
    }
    for (; h >= 1; h /= 2) v[0] = T::max(v[0], T::perm_xor(v[0], h));
    alignas(64) float lanes[N];
    T::store(lanes, v[0]);
    for (int r = 0; r < R; ++r) {
      int lane = 0;
      for (int k = 0; k < L; ++k) lane += ((r >> k) & 1) * (N >> (k + 1));
      out[r] = lanes[lane];
    }
  }
}

// ---- decode attention over compressed pages ------------------------------------------------
// One call = one kv head, R query vectors (GQA group heads x query rows), compressed tokens
// [c0, c1) in blocks of N tokens (N = SIMD lanes; a block never crosses a page since P >= 16).
// K (quantized): lane = token. For each coordinate j the N tokens' codes are extracted from the
// code words of N consecutive tokens (one contiguous load per word: planes for 2 / 3 bits, nibble
// words for 4 bits, nibble words and the sign plane for 5 bits) with constant shifts, looked up in the
// codebook (register permute; 5 bits: a 16-entry table, T::lut16), signed, and
// fma'd with the broadcast rotated q[j] into two partial sums per query (even / odd j: two FMA dependency
// chains, so that R = 3 queries still keep the FMA pipes busy; one on 8-lane sets with R > 4); per-group fp16 scales multiply the group
// sums. 4-bit codes on traits whose lut16 is one permute (T::kLut16: scalar, AVX-512) index a signed
// 16-entry table with the whole nibble (job.tk4 / tv4), so no sign step.
// Scores come out as one vector per query.
// K (fp16, k_bits == 16): lane = coordinate, one dot product per token.
// Softmax: online, per block in registers: the R queries' block maxima in one reduction (hmax_rows), the
// correction exp only where a maximum grew, the sums of weights as vectors reduced once per call.
// V: lane = coordinate (lane order pi, see LaneTables). Per token: broadcast the code words (4 and 5 bits:
// the block's one or two nibble words, blended; 5 bits also the sign plane), shift by per-lane constants, look up, fma into
// accumulators with weight p * scale; lanes u and u + 16 of a group share one token loop (one weight broadcast,
// one sign-plane broadcast, and for tile blocks one scratch word serve both). 4-bit V on AVX2 / AVX-512 (VS): the
// tile's nibble words are first rewritten into the tile-block V scratch layout (nibble_v_scratch.h, lanes still in
// pi order), and the loop reads one scratch word per token as for tile blocks.
// Tile blocks (format 3, 3-bit K: KT, V: VT; tile.h): at the first block of each 16-token tile the tile
// block is unpacked into a scratch (tile_unpack_k / tile_unpack_v: K as 4 nibble words per token and
// group, V as the X / YH words of a 4-token column per lane); K then runs the 4-bit loop on it (q in
// tile_k_query_order), V shifts the token's nibbles of its column into place (lanes in tile_v_coord order). The
// tables are signed and 8-periodic (job.tk / job.tv), so no sign step and no mask of the nibbles' bit 3. With
// integer dot products (T::kIntDot: the avx512vnni and avx2vnni sets) K's nibble words become u8 levels by byte permutes and
// each of the query's three int8 parts takes 4 coordinates per vpdpbusd (IntQuery; exact int32 sums).
// Nothing is dequantized to memory; each page is read once for all R queries.
template <class T, int KB, int VB, int R, bool KT, bool VT>
void attend_t(const AttnJob& job, const float* const* q, const int64_t* climit, AttnState* st) {
  using F = typename T::F;
  using I = typename T::I;
  constexpr int N = T::N, HV = 32 / N;
  // More than 4 queries on an 8-lane set (16 vector registers): one partial sum per query in the K loop (R chains
  // are enough) and one half of a group's V lanes per token loop, so the 2 R accumulators of either do not spill.
  constexpr bool kFewRegs = N < 16 && R > 4;
  constexpr int KP = kFewRegs ? 1 : 2;  // K partial sums per query (2: two FMA chains, for R = 3)
  const int d = job.d, G = d / 32, P = job.P, ssh = job.ssh;
  const LaneTables& lt = lane_tables();
  const typename T::Table tk = T::load_table(job.tk), tv = T::load_table(job.tv);
  // 5-bit magnitudes; with T::kLut16 the signed 4-bit levels (no sign step)
  const typename T::Table16 tk16 = T::load_table16(T::kLut16 && KB == 4 ? job.tk4 : job.tk);
  const typename T::Table16 tv16 = T::load_table16(T::kLut16 && VB == 4 ? job.tv4 : job.tv);
  const float NEG_INF = -__builtin_inff();
  float m[R], l[R];
  F lv[R];  // this call's sums of weights, per lane (l[r] + hsum(lv[r]) is the softmax denominator)
  for (int r = 0; r < R; ++r) m[r] = st[r].m, l[r] = st[r].l, lv[r] = T::zero();
  alignas(64) float wbuf[R][N];
  alignas(64) float sbuf[R][N];
  alignas(64) uint32_t kscr[KT ? 4 * 8 * 16 : 1];  // tiled K: the tile's nibble words [q G + g][16 tokens]
  // 4-bit V through a scratch (nibble_v_scratch.h): the tile's nibble words rewritten in the tiled V scratch layout
  constexpr bool VS = VB == 4 && kNibbleVScratch && N >= 8;
  alignas(64) uint32_t vscr[VT || VS ? 4 * 8 * 16 : 1];  // tiled V: the tile's column words [kb G + g][16 lanes]
  constexpr bool IK = KT && T::kIntDot;  // tiled K scored with integer dot products
  IntQuery<IK ? R : 1> iq;
  alignas(16) uint8_t ktab[16];  // IK: u8 levels + 128 of the nibble (8-periodic)
  if constexpr (IK) {
    make_int_query<R>(q, d, job.tk_step, iq);
    for (int i = 0; i < 16; ++i) ktab[i] = (uint8_t)(job.tk_int[i] + 128);
  }
  // Software prefetch kAhead tokens ahead: each plane of a page is only P * 4 bytes long, too short
  // for the hardware stream prefetchers, and a block's compute hides one block of latency at most.
  const int64_t kAhead = job.prefetch_tokens;
  // (Plain loop, not a lambda: GCC deems a prefetch-only lambda pure and deletes its calls.)
  for (int64_t b0 = job.c0, pf = job.c0; b0 < job.c1; b0 += N) {
    for (; pf < job.c1 && pf <= b0 + kAhead; pf += 16) {  // the 16 tokens starting at pf
      const uint8_t* pg = job.pages + (int64_t)job.block_table[pf / P] * job.page_bytes;
      const int64_t t = pf % P;
      if (KB == 16) {
        const uint8_t* kx = pg + job.k_off + t * d * 2;
        for (int64_t o = 0; o < 16 * d * 2; o += 64) __builtin_prefetch(kx + o);
      } else {
        const uint8_t* ks = pg + job.k_off;
        if (KT)
          for (int64_t o = 0; o < fmkv_tile_block_bytes(d); o += 64) __builtin_prefetch(ks + fmkv_tile_block_offset(d, (int32_t)t) + o);
        for (int g = 0; g < G; ++g) {
          for (int w = 0; w < KB && !KT; ++w) __builtin_prefetch(ks + (((int64_t)g * KB + w) * P + t) * 4);
          __builtin_prefetch(ks + fmkv_scales_offset(d, KB, P) + ((int64_t)(g >> ssh) * P + t) * 2);
        }
      }
      const uint8_t* vs = pg + job.v_off;
      if (VT)
        for (int64_t o = 0; o < fmkv_tile_block_bytes(d); o += 64) __builtin_prefetch(vs + fmkv_tile_block_offset(d, (int32_t)t) + o);
      for (int g = 0; g < G; ++g) {
        for (int w = 0; w < VB && !VT; ++w) __builtin_prefetch(vs + (((int64_t)g * VB + w) * P + t) * 4);
        __builtin_prefetch(vs + fmkv_scales_offset(d, VB, P) + ((int64_t)(g >> ssh) * P + t) * 2);
      }
    }
    const int32_t page = job.block_table[b0 / P];
    const int32_t t0 = (int32_t)(b0 % P);
    const uint8_t* pg = job.pages + (int64_t)page * job.page_bytes;
    const uint8_t* ksec = pg + job.k_off;
    const uint8_t* vsec = pg + job.v_off;
    const int nany = (int)imin(N, job.c1 - b0);
    if ((KT || VT || VS) && (t0 & 15) == 0) {  // the first block of a tile (blocks never cross one: N <= 16)
      if (KT) tile_unpack_k(ksec + fmkv_tile_block_offset(d, t0), G, kscr);
      if (VT) tile_unpack_v(vsec + fmkv_tile_block_offset(d, t0), G, vscr);
      if (VS) nibble_unpack_v((const uint32_t*)vsec + t0, P, G, vscr);
    }
    F s[R];
    if constexpr (KB == 16) {
      const uint16_t* kx = (const uint16_t*)ksec + (int64_t)t0 * d;
      for (int t = 0; t < N; ++t) {
        if (t < nany) {
          F a[R];
          for (int r = 0; r < R; ++r) a[r] = T::zero();
          for (int i = 0; i < d; i += N) {
            const F kv = T::load_h(kx + (int64_t)t * d + i);
            for (int r = 0; r < R; ++r) a[r] = T::fmadd(T::load(q[r] + i), kv, a[r]);
          }
          for (int r = 0; r < R; ++r) sbuf[r][t] = T::hsum(a[r]);
        } else {
          for (int r = 0; r < R; ++r) sbuf[r][t] = 0.0f;
        }
      }
      for (int r = 0; r < R; ++r) s[r] = T::load(sbuf[r]);
    } else if constexpr (IK) {
      // Nibble words as in the KT branch below; per word, its low and high nibbles (scratch coordinates
      // 8 w + {0, 2, 4, 6} and 8 w + {1, 3, 5, 7}) become u8 levels by one byte permute each, and every
      // query part takes them in one vpdpbusd per 4 coordinates (IntQuery).
      static_assert(!IK || N == 8 || N == 16, "the integer K path runs on 8- or 16-lane blocks of a 16-token tile");
      for (int r = 0; r < R; ++r) s[r] = T::zero();
      const uint32_t* kw = kscr + (t0 & 15);
      const uint16_t* ksc = (const uint16_t*)(ksec + fmkv_scales_offset(d, KB, P));
      const I nib = T::set1i(0x0F0F0F0Fu), tab = T::table_u8(ktab);
      for (int g = 0; g < G; ++g) {
        I acc[R][kQParts];
        for (int r = 0; r < R; ++r)
          for (int k = 0; k < kQParts; ++k) acc[r][k] = T::set1_i32(iq.corr[r][g][k]);
        for (int w = 0; w < 4; ++w) {
          const I W = T::loadi(kw + 16 * (w * G + g));
          const I lev[2] = {T::lut_u8(tab, T::and_i(W, nib)), T::lut_u8(tab, T::and_i(T::srl(W, 4), nib))};
          for (int h = 0; h < 2; ++h)
            for (int r = 0; r < R; ++r)
              for (int k = 0; k < kQParts; ++k) acc[r][k] = T::dot_u8s8(acc[r][k], lev[h], T::set1i(iq.dw[r][g][w][h][k]));
        }
        const F sc = T::load_h(ksc + (int64_t)(g >> ssh) * P + t0);
        for (int r = 0; r < R; ++r) {
          const F v = T::fmadd(T::cvt_f(acc[r][0]), T::set1(65536.0f), T::cvt_f(T::add_i(T::sll(acc[r][1], 8), acc[r][2])));
          s[r] = T::fmadd(v, T::mul(sc, T::set1(iq.scale[r][g])), s[r]);
        }
      }
    } else if constexpr (KT) {
      // Nibble words of the tile scratch: word q of token t (lane t - tile start) at kscr[16 (q G + g) + t].
      for (int r = 0; r < R; ++r) s[r] = T::zero();
      const uint32_t* kw = kscr + (t0 & 15);
      const uint16_t* ksc = (const uint16_t*)(ksec + fmkv_scales_offset(d, KB, P));
      for (int g = 0; g < G; ++g) {
        I W[4];
        for (int w = 0; w < 4; ++w) W[w] = T::loadi(kw + 16 * (w * G + g));
        F part[KP][R];
        for (int k = 0; k < KP; ++k)
          for (int r = 0; r < R; ++r) part[k][r] = T::zero();
        const float* qg[R];
        for (int r = 0; r < R; ++r) qg[r] = q[r] + g * 32;
#pragma GCC unroll 32
        for (int j = 0; j < 32; ++j) {
          const F lev = T::lut(tk, T::srl(W[j >> 3], 4 * (j & 7)));  // T::lut reads idx mod 8 or 16: 8-periodic table
          for (int r = 0; r < R; ++r) part[j % KP][r] = T::fmadd(T::set1(qg[r][j]), lev, part[j % KP][r]);
        }
        const F sc = T::load_h(ksc + (int64_t)(g >> ssh) * P + t0);
        for (int r = 0; r < R; ++r) s[r] = T::fmadd(KP == 2 ? T::add(part[0][r], part[KP - 1][r]) : part[0][r], sc, s[r]);
      }
    } else {
      for (int r = 0; r < R; ++r) s[r] = T::zero();
      const uint32_t* kw = (const uint32_t*)ksec;
      const uint16_t* ksc = (const uint16_t*)(ksec + fmkv_scales_offset(d, KB, P));
      for (int g = 0; g < G; ++g) {
        I W[KB];
        for (int w = 0; w < KB; ++w) W[w] = T::loadi(kw + ((int64_t)g * KB + w) * P + t0);
        F part[KP][R];
        for (int k = 0; k < KP; ++k)
          for (int r = 0; r < R; ++r) part[k][r] = T::zero();
        const float* qg[R];
        for (int r = 0; r < R; ++r) qg[r] = q[r] + g * 32;
#pragma GCC unroll 32
        for (int j = 0; j < 32; ++j) {
          F lev;
          // 4 bits: code j is nibble j & 7 of word j >> 3. T::lut reads idx mod 16 (scalar, AVX-512) or
          // mod 8 (AVX2, NEON) and the 4-bit table has period 8, so the sign (nibble bit 3) and the
          // higher nibbles need no mask; the sign bit is shifted to bit 31 separately.
          if constexpr (KB == 4 && T::kLut16) {  // the whole nibble indexes the signed table
            lev = T::lut16(tk16, T::srl(W[fmkv_nibble_word(j)], fmkv_nibble_shift(j)));
          } else if constexpr (KB == 4) {
            const I wj = W[fmkv_nibble_word(j)];
            lev = T::xor_sign(T::lut(tk, T::srl(wj, fmkv_nibble_shift(j))), T::sll(wj, 28 - fmkv_nibble_shift(j)));
          } else if constexpr (KB == 5) {  // the magnitude nibble (lut16 reads it mod 16), the sign plane
            lev = T::xor_sign(T::lut16(tk16, T::srl(W[fmkv_nibble_word(j)], fmkv_nibble_shift(j))), T::sll(W[4], 31 - j));
          } else {
            const I idx = KB == 2 ? T::srl(W[0], j) : T::srl(W[fmkv_field_word(j)], fmkv_field_shift(j));
            lev = T::xor_sign(T::lut(tk, idx), T::sll(W[KB - 1], 31 - j));
          }
          for (int r = 0; r < R; ++r) part[j % KP][r] = T::fmadd(T::set1(qg[r][j]), lev, part[j % KP][r]);
        }
        const F sc = T::load_h(ksc + (int64_t)(g >> ssh) * P + t0);
        for (int r = 0; r < R; ++r) s[r] = T::fmadd(KP == 2 ? T::add(part[0][r], part[KP - 1][r]) : part[0][r], sc, s[r]);
      }
    }
    // online softmax over the block: the R block maxima in one reduction; the max correction only where a
    // query's maximum grew; the weights' sums kept as vectors lv (reduced once, at the end)
    F p[R];
    float corr[R], bm[R];
    int lim[R];
    for (int r = 0; r < R; ++r) {
      const int64_t lim64 = climit[r] - b0;
      lim[r] = lim64 <= 0 ? 0 : lim64 >= N ? N : (int)lim64;
      if (lim[r] > 0 && job.softcap > 0.0f) {
        T::store(sbuf[r], s[r]);
        for (int t = 0; t < lim[r]; ++t) sbuf[r][t] = job.softcap * __builtin_tanhf(sbuf[r][t] / job.softcap);
        s[r] = T::load(sbuf[r]);
      }
      s[r] = T::select_valid(s[r], T::set1(NEG_INF), lim[r]);
    }
    hmax_rows<T, R>(s, bm);
    for (int r = 0; r < R; ++r) {
      p[r] = T::zero();
      corr[r] = 1.0f;
      if (lim[r] == 0) continue;
      if (bm[r] > m[r]) {
        corr[r] = m[r] == NEG_INF ? 0.0f : __builtin_expf(m[r] - bm[r]);
        l[r] *= corr[r];
        lv[r] = T::mul(lv[r], T::set1(corr[r]));
        m[r] = bm[r];
      }
      p[r] = T::select_valid(T::exp(T::sub(s[r], T::set1(m[r]))), T::zero(), lim[r]);
      lv[r] = T::add(lv[r], p[r]);
    }
    // V accumulation
    const uint32_t* vw = (const uint32_t*)vsec;
    const uint16_t* vsc = (const uint16_t*)(vsec + fmkv_scales_offset(d, VB, P));
    for (int g = 0; g < G; ++g) {
      const F sv = T::load_h(vsc + (int64_t)(g >> ssh) * P + t0);
      for (int r = 0; r < R; ++r) T::store(wbuf[r], T::select_valid(T::mul(p[r], sv), T::zero(), nany));
      const uint32_t* wg = vw + (int64_t)g * VB * P + t0;  // word w of token t: wg[w * P + t]
      // Lanes u and u + 16 of the group in one token loop (HP = 2 halves of N lanes: u0[0] = hv N, u0[1] = u0[0] +
      // 16): one broadcast weight per query serves both, and tiled V reads both from one scratch word.
      constexpr int HP = HV >= 2 && !kFewRegs ? 2 : 1;
      for (int hv = 0; hv < HV / HP; ++hv) {
        int u0[HP];
        for (int h = 0; h < HP; ++h) u0[h] = hv * N + 16 * h;
        F A[HP][R];
        for (int h = 0; h < HP; ++h)
          for (int r = 0; r < R; ++r) {  // rescale by the max correction (usually exactly 1)
            A[h][r] = T::load(st[r].acc + g * 32 + u0[h]);
            if (corr[r] != 1.0f) A[h][r] = T::mul(A[h][r], T::set1(corr[r]));
          }
        if constexpr (VT || VS) {
          // Lanes u0 .. u0 + N - 1 of token t: words u0 & 15 .. of its column, its nibble u0 >> 4 (tile_v_word):
          // the same words for both halves, their nibbles 4 bits apart. Tile blocks: 8-periodic signed levels;
          // 4-bit codes (VS): the whole nibble indexes the signed 16-entry table (T::kLut16), or its bits 0-2 the
          // magnitudes and bit 3 the sign.
          // (t16 is a multiple of N: 0 for N = 16, so the word offsets are constants; for N >= 4 the shift depends
          // on t only and unrolls to immediates)
          const int32_t t16 = N >= 16 ? 0 : t0 & 15;
          const uint32_t* vc = vscr + (u0[0] & 15);
#pragma GCC unroll 16
          for (int t = 0; t < N; ++t) {
            if (t >= nany) break;
            const int sh = tile_v_shift(N >= 4 ? t : t16 + t);
            const I W = T::loadi(vc + tile_v_word(t16 + t, g, G));
            F lev[HP];
            for (int h = 0; h < HP; ++h) {
              const I x = T::srl(W, sh + 4 * (u0[h] >> 4));  // lanes 16..31: the high nibble
              if constexpr (VT) lev[h] = T::lut(tv, x);
              else if constexpr (T::kLut16) lev[h] = T::lut16(tv16, x);
              else lev[h] = T::xor_sign(T::lut(tv, x), T::sll(W, 28 - sh - 4 * (u0[h] >> 4)));
            }
            for (int r = 0; r < R; ++r) {
              const F w = T::set1(wbuf[r][t]);
              for (int h = 0; h < HP; ++h) A[h][r] = T::fmadd(w, lev[h], A[h][r]);
            }
          }
        } else if constexpr (VB == 4 || VB == 5) {
          // Nibble words (see LaneTables): lane u takes word nib_word[u], a single word for N <= 4,
          // for N = 8 / 16 word u0 >> 4 in lanes with lane-index bit 2 clear, word (u0 >> 4) + 2 in
          // the others. Shift the lane's nibble to bits 0..3 (no mask: see K). 4 bits: the nibble's bit 3 is
          // the sign, shifted to bit 31; 5 bits: the nibble is the magnitude (lut16 reads it mod 16), the sign
          // comes from the sign plane (word 4) as for 2 and 3 bits.
          I sh_n[HP], sh_s[HP];
          const uint32_t *wa[HP], *wb[HP];
          for (int h = 0; h < HP; ++h) {
            sh_n[h] = T::loadi(lt.nib_shift + u0[h]);
            sh_s[h] = T::loadi((VB == 4 ? lt.nib_sign_shl : lt.sign_shl) + u0[h]);
            wa[h] = wg + (int64_t)lt.nib_word[u0[h]] * P;
            wb[h] = wg + (int64_t)lt.nib_word[N >= 8 ? u0[h] + 4 : u0[h]] * P;
          }
          for (int t = 0; t < nany; ++t) {
            const I sw = T::set1i(VB == 5 ? wg[4 * P + t] : 0u);  // 5 bits: the sign plane
            F lev[HP];
            for (int h = 0; h < HP; ++h) {
              I w = T::set1i(wa[h][t]);
              if constexpr (N >= 8) w = T::blend_i_hbit(w, T::set1i(wb[h][t]), 4);
              if constexpr (VB == 4 && T::kLut16) lev[h] = T::lut16(tv16, T::srlv(w, sh_n[h]));
              else if constexpr (VB == 4) lev[h] = T::xor_sign(T::lut(tv, T::srlv(w, sh_n[h])), T::sllv(w, sh_s[h]));
              else lev[h] = T::xor_sign(T::lut16(tv16, T::srlv(w, sh_n[h])), T::sllv(sw, sh_s[h]));
            }
            for (int r = 0; r < R; ++r) {
              const F w = T::set1(wbuf[r][t]);
              for (int h = 0; h < HP; ++h) A[h][r] = T::fmadd(w, lev[h], A[h][r]);
            }
          }
        } else {
          I sh_m[HP], sh_s[HP];
          const uint32_t* wm[HP];
          for (int h = 0; h < HP; ++h) {
            sh_m[h] = VB == 2 ? T::loadi(lt.pi_srl + u0[h]) : T::loadi(lt.field_shift + u0[h]);
            sh_s[h] = T::loadi(lt.sign_shl + u0[h]);
            wm[h] = VB == 2 ? wg : wg + (int64_t)(u0[h] >> 4) * P;
          }
          for (int t = 0; t < nany; ++t) {
            const I sw = T::set1i(wg[(VB - 1) * P + t]);  // the sign plane
            F lev[HP];
            for (int h = 0; h < HP; ++h)
              lev[h] = T::xor_sign(T::lut(tv, T::srlv(T::set1i(wm[h][t]), sh_m[h])), T::sllv(sw, sh_s[h]));
            for (int r = 0; r < R; ++r) {
              const F w = T::set1(wbuf[r][t]);
              for (int h = 0; h < HP; ++h) A[h][r] = T::fmadd(w, lev[h], A[h][r]);
            }
          }
        }
        for (int h = 0; h < HP; ++h)
          for (int r = 0; r < R; ++r) T::store(st[r].acc + g * 32 + u0[h], A[h][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) st[r].m = m[r], st[r].l = l[r] + T::hsum(lv[r]);
}

// fp16 tokens (sink + window): lane = coordinate; per token one dot product per query (hsum),
// scalar online softmax, acc = acc * corr + p * v. Few tokens per call (<= sink + window).
template <class T>
void attend_fp16_t(int32_t d, int64_t ntok, const uint16_t* const* k, const uint16_t* const* v, const int64_t* pos,
                   int R, const float* const* q, const int64_t* qpos, float softcap, AttnState* st) {
  using F = typename T::F;
  constexpr int N = T::N;
  const float NEG_INF = -__builtin_inff();
  for (int64_t i = 0; i < ntok; ++i) {
    for (int r = 0; r < R; ++r) {
      if (pos[i] > qpos[r]) continue;
      F a = T::zero();
      for (int32_t c = 0; c < d; c += N) a = T::fmadd(T::load(q[r] + c), T::load_h(k[i] + c), a);
      float sc = T::hsum(a);
      if (softcap > 0.0f) sc = softcap * __builtin_tanhf(sc / softcap);
      const float mn = st[r].m > sc ? st[r].m : sc;
      const float corr = st[r].m == NEG_INF ? 0.0f : __builtin_expf(st[r].m - mn), pw = __builtin_expf(sc - mn);
      st[r].l = st[r].l * corr + pw;
      st[r].m = mn;
      const F cv = T::set1(corr), pv = T::set1(pw);
      for (int32_t c = 0; c < d; c += N)
        T::store(st[r].acc + c, T::fmadd(pv, T::load_h(v[i] + c), T::mul(T::load(st[r].acc + c), cv)));
    }
  }
}

using AttendFn = void (*)(const AttnJob&, const float* const*, const int64_t*, AttnState*);

// Query vectors per attend call (Kernels::max_tile): 8 on the 16-lane sets (32 vector registers: the K loop's 2 R
// partial sums and the V loop's 2 R accumulators fit) and on the 8-lane sets (attend_t's kFewRegs: R accumulators in
// each loop), 4 on scalar and NEON.
template <class T>
constexpr int kMaxTileOf = T::N >= 8 ? kMaxTile : 4;

// Two calls of 4 and R - 4 queries over the same tokens: 5 to 7 queries (only R = 8 is compiled beyond 4: each
// instantiation of attend_t costs compile time in every kernel set), and more than 4 on the integer K path (its 3 R
// int32 accumulators do not fit the registers: R = 8 measured 0.95x there).
template <class T, int KB, int VB, int R, bool KT, bool VT>
void attend_in_two(const AttnJob& job, const float* const* q, const int64_t* climit, AttnState* st) {
  attend_t<T, KB, VB, 4, KT, VT>(job, q, climit, st);
  attend_t<T, KB, VB, R - 4, KT, VT>(job, q + 4, climit + 4, st + 4);
}

// The kernel of R queries: attend_t, or attend_in_two (above).
template <class T, int KB, int VB, int R, bool KT, bool VT>
constexpr AttendFn attend_r() {
  if constexpr (R > 4 && (R < 8 || (KT && T::kIntDot))) return attend_in_two<T, KB, VB, R, KT, VT>;
  else return attend_t<T, KB, VB, R, KT, VT>;
}

template <class T, int KB, int VB, bool KT, bool VT>
AttendFn pick_r(int R) {
  if constexpr (kMaxTileOf<T> >= 8) {
    switch (R) {
      case 5: return attend_r<T, KB, VB, 5, KT, VT>();
      case 6: return attend_r<T, KB, VB, 6, KT, VT>();
      case 7: return attend_r<T, KB, VB, 7, KT, VT>();
      case 8: return attend_r<T, KB, VB, 8, KT, VT>();
      default: break;
    }
  }
  switch (R) {
    case 1: return attend_r<T, KB, VB, 1, KT, VT>();
    case 2: return attend_r<T, KB, VB, 2, KT, VT>();
    case 3: return attend_r<T, KB, VB, 3, KT, VT>();
    default: return attend_r<T, KB, VB, 4, KT, VT>();
  }
}
// KT: K is 3-bit in tile blocks. A cache has tile blocks for every 3-bit section or for none (format 3 or 2).
template <class T, int KB, bool KT>
AttendFn pick_v(int VB, bool tiled, int R) {
  if constexpr (KT) {
    if (VB == 3) return pick_r<T, KB, 3, true, true>(R);
  } else {
    if (VB == 3) return tiled ? pick_r<T, KB, 3, false, true>(R) : pick_r<T, KB, 3, false, false>(R);
  }
  return VB == 2 ? pick_r<T, KB, 2, KT, false>(R) : VB == 4 ? pick_r<T, KB, 4, KT, false>(R) : pick_r<T, KB, 5, KT, false>(R);
}

template <class T>
void attend_dispatch(const AttnJob& job, int R, const float* const* q, const int64_t* climit, AttnState* st) {
  const bool tiled = job.k_tiled || job.v_tiled;
  AttendFn f = job.k_bits == 2 ? pick_v<T, 2, false>(job.v_bits, tiled, R)
             : job.k_bits == 3 ? (tiled ? pick_v<T, 3, true>(job.v_bits, true, R) : pick_v<T, 3, false>(job.v_bits, false, R))
             : job.k_bits == 4 ? pick_v<T, 4, false>(job.v_bits, tiled, R)
             : job.k_bits == 5 ? pick_v<T, 5, false>(job.v_bits, tiled, R)
                               : pick_v<T, 16, false>(job.v_bits, tiled, R);
  f(job, q, climit, st);
}

}  // namespace
}  // namespace fmkv::cpu
