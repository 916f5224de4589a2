// Quantizers of the format (FORMAT.md, version 2) on the GPU. Every float op is explicitly rounded (__fadd_rn/__fmul_rn/
// __fdiv_rn/__fsqrt_rn: no FMA contraction) and sums follow tree_sum32's order, so the bytes equal
// the reference's (src/format/quantize_group.h, src/ref/quantize.cpp) bit for bit.
//  * warp level (warp_rotate, warp_quantize_groups): one warp per head vector, lane l holds
//    coordinates l + 32 r, so register r across the warp is code group r.
//  * thread level (thread_fwht, thread_square_sum + thread_group_codes, or thread_quantize_group; used by
//    append.cu): one thread owns 64 coordinates, i.e. two whole code groups; D/64 threads per vector. See
//    thread_fwht for the mapping.
//  * scale group 64 (ss = fmkv_scale_shift = 1): code groups 2k and 2k + 1 share one scale, their tree sums
//    added (FORMAT.md "Scale"): the warp quantizers add registers 2k and 2k + 1 (pair_group_sums); the
//    thread quantizer the thread's two groups (d = 64) or the partner lane's (lane ^ 1, append.cu).
#pragma once
#include <array>
#include <cmath>
#include <cstring>

#include "../format/quantize_group.h"
#include "../format/rows.h"
#include "code_widths.cuh"
#include "common.cuh"

namespace fmkv {
namespace cuda {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_tree_sum32(float t) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) t = __fadd_rn(t, __shfl_xor_sync(kFull, t, m));
  return t;
}

// Per b-bit codebook (index b - 2), filled on the host from src/format/quantize_group.h (sized for the widest
// code of the CUDA kernels, src/cuda/code_widths.cuh).
constexpr int kMaxMagnitudes = 1 << (FMKV_CUDA_CODE_BITS_MAX - 1);
struct QuantTables {
  float thr[kMaxMagnitudes - 1];   // t_i = codebook_threshold(b, i): the reference's decision thresholds
  float hulp[kMaxMagnitudes - 1];  // ulp(t_i) / 2 (a power of two)
  float mag[kMaxMagnitudes];       // positive levels mag_b[m] as float (exact fp16 values)
};

__device__ __forceinline__ float f16_bits_to_f32_hw(uint32_t h16) {  // exact (cvt.f32.f16)
  return __half2float(__ushort_as_half((unsigned short)h16));
}

// Thresholds of src/format/codebook.h and the facts the division-free code search relies on: <= 13 significant
// bits and an even significand (checked once per width; constants of the format, unchanged since v1).
// bits FMKV_CODE_BITS_MIN .. FMKV_CUDA_CODE_BITS_MAX; host side.
inline const QuantTables& quant_tables(int bits) {
  auto make = [](int b) {
    QuantTables q;
    std::memset(&q, 0, sizeof(q));
    for (int m = 0; m < magnitude_count(b); ++m) q.mag[m] = codebook_mag(b, m);
    for (int i = 0; i + 1 < magnitude_count(b); ++i) {
      const float t = codebook_threshold(b, i);
      const uint32_t u = f32_bits(t), sig = (u & 0x7fffffu) | 0x800000u;
      if ((u & 0x7f800000u) == 0 || (sig & ((1u << 11) - 1u)) != 0)
        throw Error(kBackendError, "cuda quantizer: codebook threshold outside the exact-compare assumptions");
      q.thr[i] = t;
      q.hulp[i] = (std::nextafter(t, INFINITY) - t) * 0.5f;
    }
    return q;
  };
  static const auto tables = [&] {
    std::array<QuantTables, FMKV_CUDA_CODE_BITS_MAX - FMKV_CODE_BITS_MIN + 1> t;
    for (int b = FMKV_CODE_BITS_MIN; b <= FMKV_CUDA_CODE_BITS_MAX; ++b) t[b - FMKV_CODE_BITS_MIN] = make(b);
    return t;
  }();
  if (!is_code_bits(bits)) throw Error(kBackendError, "cuda quantizer: no code tables for " + std::to_string(bits) + " bits");
  return tables[bits - FMKV_CODE_BITS_MIN];
}

// A decision threshold for any t (t + hulp and s with at most 29 + 24 significant bits together): the float
// T with |y| > T <=> fl(|y| / s) > t for every float |y|. The boundary B = (t + hulp) s (the quotient's
// rounding boundary above t; t has an even significand, so a tie rounds to t) is exact in double; its
// nearest float Tn, or the float below Tn when Tn > B (no float lies strictly between B and Tn).
__device__ __forceinline__ float exact_threshold(float t, float hulp, float s) {
  const double b = ((double)t + (double)hulp) * (double)s;
  const float tn = __double2float_rn(b);
  return (double)tn > b ? __uint_as_float(__float_as_uint(tn) - 1u) : tn;
}

// Decision thresholds of a group with fp16 scale s (as float): fl(|y| / s) > t_i <=> |y| > T_i =
// RD(t_i s + hulp_i s) (see thread_quantize_group for why this is exact). Uniform per group.
template <int BITS>
__device__ __forceinline__ void group_thresholds(const QuantTables& q, float s, float (&T)[(1 << (BITS - 1)) - 1]) {
#pragma unroll
  for (int i = 0; i < (1 << (BITS - 1)) - 1; ++i) T[i] = __fadd_rd(__fmul_rn(q.thr[i], s), __fmul_rn(q.hulp[i], s));
}

// 5-bit codes: the thermometer count m over the 15 thresholds T (ascending), by binary search (c = bits 0-3 of
// m), with compares and selects only (no indexed load: T stays in registers).
__device__ __forceinline__ void search_code5(float a, const float* T, bool (&c)[4]) {
  c[3] = a > T[7];
  c[2] = a > (c[3] ? T[11] : T[3]);
  c[1] = a > (c[2] ? (c[3] ? T[13] : T[5]) : (c[3] ? T[9] : T[1]));
  float u[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) u[k] = c[3] ? T[8 + 2 * k] : T[2 * k];  // T[8 c3 + 4 c2 + 2 c1], stepwise
  c[0] = a > (c[1] ? (c[2] ? u[3] : u[1]) : (c[2] ? u[2] : u[0]));
}
// ... and its level mag[m] by a select tree (the parameter bank's table, no indexed load); c = the bits of m.
__device__ __forceinline__ float search_magnitude5(float a, const float* T, const QuantTables& q, bool (&c)[4]) {
  search_code5(a, T, c);
  float r[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) r[k] = c[3] ? q.mag[8 + k] : q.mag[k];
#pragma unroll
  for (int k = 0; k < 4; ++k) r[k] = c[2] ? r[4 + k] : r[k];
  const float r0 = c[1] ? r[2] : r[0], r1 = c[1] ? r[3] : r[1];
  return c[0] ? r1 : r0;
}

// Magnitude code of a = |y| (the thermometer count over T, by binary search: its bits c[0..BITS-2])
// and the level mag[m], by compares and selects (no division, no indexed table load).
template <int BITS>
__device__ __forceinline__ float search_magnitude(float a, const float (&T)[(1 << (BITS - 1)) - 1], const QuantTables& q,
                                                 bool (&c)[4]) {
  c[0] = c[1] = c[2] = c[3] = false;
  if constexpr (BITS == 5) {
    return search_magnitude5(a, T, q, c);
  } else if constexpr (BITS == 2) {
    c[0] = a > T[0];
    return c[0] ? q.mag[1] : q.mag[0];
  } else if constexpr (BITS == 3) {
    c[1] = a > T[1];
    c[0] = a > (c[1] ? T[2] : T[0]);
    const float lo = c[1] ? q.mag[2] : q.mag[0], hi = c[1] ? q.mag[3] : q.mag[1];
    return c[0] ? hi : lo;
  } else {
    c[2] = a > T[3];
    c[1] = a > (c[2] ? T[5] : T[1]);
    c[0] = a > (c[2] ? (c[1] ? T[6] : T[4]) : (c[1] ? T[2] : T[0]));
    const float q0 = c[2] ? q.mag[4] : q.mag[0], q1 = c[2] ? q.mag[5] : q.mag[1];
    const float q2 = c[2] ? q.mag[6] : q.mag[2], q3 = c[2] ? q.mag[7] : q.mag[3];
    const float r0 = c[1] ? q2 : q0, r1 = c[1] ? q3 : q1;
    return c[0] ? r1 : r0;
  }
}

// y (fp16 input as float, already loaded per lane: x[r] = coordinate lane + 32 r) -> rotated values.
template <int D>
__device__ __forceinline__ void warp_rotate(float (&v)[D / 32], const SignWords& sw, int lane) {
  constexpr int NR = D / 32;
#pragma unroll
  for (int r = 0; r < NR; ++r)
    if (fmkv::sign_negative(sw.w, lane + 32 * r)) v[r] = -v[r];
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float o = __shfl_xor_sync(kFull, v[r], h);
      v[r] = (lane & h) ? __fsub_rn(o, v[r]) : __fadd_rn(v[r], o);
    }
  }
#pragma unroll
  for (int hr = 1; hr < NR; hr <<= 1) {
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if ((r & hr) == 0) {
        float a = v[r], b = v[r + hr];
        v[r] = __fadd_rn(a, b);
        v[r + hr] = __fsub_rn(a, b);
      }
  }
  const float norm = rotation_norm(D);
#pragma unroll
  for (int r = 0; r < NR; ++r) v[r] = __fmul_rn(v[r], norm);
}

// FWHT butterflies (a, b) -> (a + b, a - b) for the inverse rotations below (not part of the format, so
// ordinary float arithmetic): in the thread over register-index bits h, H0 <= h < H1 (pairs k, k + h with
// bit h of k clear), or across lanes over lane bits h (the lane with bit h clear keeps the sum).
template <int H0, int H1, int N>
__device__ __forceinline__ void butterflies_in_thread(float (&y)[N]) {
#pragma unroll
  for (int h = H0; h < H1; h <<= 1)
#pragma unroll
    for (int k = 0; k < N; ++k)
      if ((k & h) == 0) {
        const float a = y[k], b = y[k + h];
        y[k] = a + b;
        y[k + h] = a - b;
      }
}
template <int H0, int H1, int N>
__device__ __forceinline__ void butterflies_across_lanes(float (&y)[N], int lane) {
#pragma unroll
  for (int h = H0; h < H1; h <<= 1)
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float o = __shfl_xor_sync(kFull, y[k], h);
      y[k] = (lane & h) ? o - y[k] : y[k] + o;
    }
}
// The last step of an inverse rotation: y[k] (coordinate coord(k)) x 1/sqrt(D), then its sign.
template <int D, int N, class Coord>
__device__ __forceinline__ void unrotate_scale_signs(float (&y)[N], const SignWords& sw, Coord coord) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    y[k] *= rotation_norm(D);
    if (fmkv::sign_negative(sw.w, coord(k))) y[k] = -y[k];
  }
}

// Inverse rotation of one vector held by a warp (y[r] = rotated coordinate lane + 32 r): x = signs x
// FWHT(y) / sqrt(D) (the Sylvester FWHT is its own inverse up to the factor D).
template <int D>
__device__ __forceinline__ void warp_unrotate(float (&y)[D / 32], const SignWords& sw, int lane) {
  butterflies_across_lanes<1, 32>(y, lane);
  butterflies_in_thread<1, D / 32>(y);
  unrotate_scale_signs<D>(y, sw, [&](int r) { return lane + 32 * r; });
}

// The same inverse rotation of one vector held by the 16 lanes of a half warp (l = lane % 16): y[4 u + e]
// is coordinate 4 l + 64 u + e (u < D / 64, e < 4). Index bits 0-1 (e) and 6.. (u) are butterflies in
// the thread (register bits 0-1 and 2..), bits 2-5 (l) shuffles with xor 1, 2, 4, 8 (they stay in the
// half warp). Every lane of the warp must take part (both halves, each with its own vector).
template <int D>
__device__ __forceinline__ void half_warp_unrotate(float (&y)[D / 16], const SignWords& sw, int l) {
  butterflies_in_thread<1, 4>(y);
  butterflies_across_lanes<1, 16>(y, l);
  butterflies_in_thread<4, D / 16>(y);
  unrotate_scale_signs<D>(y, sw, [&](int k) { return 4 * l + 64 * (k >> 2) + (k & 3); });
}

// Quantize all NR groups of a warp-held vector (y[g] = coordinate lane of group g) and write their
// code words (planes; nibble words for 4 bits; the magnitude's nibble words and the sign plane for 5) and scales, bit-exact with the reference (FORMAT.md
// 4-6): per scale group rms = sqrt(tree_sum(y^2) / (32 << ss)) -> fp16 s0; codes of y / s0 against the midpoint
// thresholds, found without a division by comparing |y| with group_thresholds (the equivalences of
// thread_quantize_group); LSQ rescale tree_sum(y l) / tree_sum(l l) with y l = |y| mag[m]. The groups
// run in lockstep: no branch and no per-lane table index, so their shuffle trees and the few divisions
// (one sqrt, and for LSQ one division, per group) overlap; a zero scale is handled by selects.
// Group g's words at words0 + g * BITS * P (stride P between words), its scale at scales0 + (g >> ss) * P.
// y[g] becomes the dequantized value level(code) x scale.
template <int NR>
__device__ __forceinline__ void warp_tree_sum32_n(float (&t)[NR]) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1)
#pragma unroll
    for (int g = 0; g < NR; ++g) t[g] = __fadd_rn(t[g], __shfl_xor_sync(kFull, t[g], m));
}
// Scale group 64: code groups 2k and 2k + 1 (registers of a warp quantizer) take the sum of their scale group,
// group 2k's tree sum plus group 2k + 1's (quantize_scale_group_table's order; one addition commutes exactly).
template <int NR>
__device__ __forceinline__ void pair_group_sums(float (&t)[NR]) {
#pragma unroll
  for (int k = 0; k < NR / 2; ++k) t[2 * k] = t[2 * k + 1] = __fadd_rn(t[2 * k], t[2 * k + 1]);
}
// ss: the scale shift (0: a scale per code group; 1: scale group 64, group g's scale at row g >> 1, written by
// the even group).
template <int NR, int BITS>
__device__ __forceinline__ void warp_quantize_groups(float (&y)[NR], const QuantTables& q, int rule, int ss, int lane,
                                                     uint32_t* words0, int64_t P, uint16_t* scales0) {
  float t[NR];
#pragma unroll
  for (int g = 0; g < NR; ++g) t[g] = __fmul_rn(y[g], y[g]);
  warp_tree_sum32_n<NR>(t);
  if (ss) pair_group_sums<NR>(t);
  float l[NR], num[NR], den[NR];
  uint16_t scale[NR];
  uint32_t sign[NR], m[NR];
#pragma unroll
  for (int g = 0; g < NR; ++g) {
    const uint16_t s0 = rms_scale(t[g], FMKV_GROUP_SIZE << ss);
    const bool nz = s0 != 0;  // warp-uniform; a zero scale: every code 0 (FORMAT.md 5.2)
    float T[(1 << (BITS - 1)) - 1];
    group_thresholds<BITS>(q, f16_bits_to_f32_hw(s0), T);
    const float a = fabsf(y[g]);
    bool c[4];
    const float mag = nz ? search_magnitude<BITS>(a, T, q, c) : 0.0f;
    m[g] = nz ? (uint32_t)c[0] | (uint32_t)c[1] << 1 | (uint32_t)c[2] << 2 | (uint32_t)c[3] << 3 : 0u;
    sign[g] = nz && y[g] < 0.0f ? 1u : 0u;
    l[g] = sign[g] ? -mag : mag;
    scale[g] = s0;
    num[g] = __fmul_rn(a, mag);
    den[g] = __fmul_rn(mag, mag);
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
  for (int g = 0; g < NR; ++g) {
    uint32_t wd[5] = {0u, 0u, 0u, 0u, 0u};
    if (BITS >= 4) {  // nibble words: the whole code of coordinate `lane` (5 bits: its magnitude; sign plane word 4)
      const uint32_t c = (BITS == 4 ? (sign[g] << 3) | m[g] : m[g]) << fmkv_nibble_shift(lane);
      const int nw = fmkv_nibble_word(lane);
#pragma unroll
      for (int k = 0; k < 4; ++k) wd[k] = __reduce_or_sync(kFull, nw == k ? c : 0u);
      if (BITS == 5) wd[4] = __ballot_sync(kFull, sign[g]);
    } else {  // planes: magnitude plane (2 bits) or field plane (3 bits), then the sign plane
      if (BITS == 2) wd[0] = __ballot_sync(kFull, m[g] & 1u);
      if (BITS == 3) {
        const uint32_t f = (m[g] & 3u) << fmkv_field_shift(lane);
        const int fw = fmkv_field_word(lane);
        wd[0] = __reduce_or_sync(kFull, fw == 0 ? f : 0u);
        wd[1] = __reduce_or_sync(kFull, fw == 1 ? f : 0u);
      }
      wd[BITS - 1] = __ballot_sync(kFull, sign[g]);
    }
    if (lane < BITS) {
      const uint32_t out = lane == 0 ? wd[0] : lane == 1 ? wd[1] : lane == 2 ? wd[2] : lane == 3 ? wd[3] : wd[4];
      words0[(int64_t)g * BITS * P + lane * P] = out;
    }
    if (lane == 31 && (g & ss) == 0) scales0[(int64_t)(g >> ss) * P] = scale[g];
    y[g] = l[g] * f16_bits_to_f32_hw(scale[g]);  // l carries the sign (0 when the scale is 0)
  }
}

// ---- thread-level quantizer ----------------------------------------------------------------------
// Thread mapping of thread_fwht. NT = D/64 threads per vector; thread t (0 <= t < NT, bits tb0 and
// tb1 of t are bits 0 and 1 of the lane index) starts with input coordinate 64 t + k in r[k] (k < 64),
// multiplied by the rotation sign and, where tb0 = 1 and k >= 32 (coordinate bits 5 and 6 both set),
// by an extra -1 ("pre-negation", see below). All of it is one xor of fp16 sign bits, done by the
// loader with the mask of fwht_input_mask.
//  1. stages h = 1..32 in registers: (r[k], r[k+h]) -> (r[k] + r[k+h], r[k] - r[k+h]), k & h == 0.
//     For a tb0 = 1 thread the pre-negated upper half makes stage 32 compute L + (-U) = L - U (the
//     new coordinate k+32) into r[k] and L - (-U) = L + U (the new coordinate k) into r[k+32]: its
//     registers now hold local coordinate k ^ 32 in r[k], with exact values and no pending sign.
//  2. stage 64 (D >= 128), partners lane ^ 1: both threads send r[32+k], keep r[k] and compute
//     lo = r[k] + o, hi = r[k] - o. The tb0 = 0 thread holds (a, b) = (r[k], o): exact a+b, a-b;
//     the tb0 = 1 thread holds (b, a): exact b+a = a+b and b-a = -(a-b) (pending sign -1).
//  3. stage 128 (D = 256), partners lane ^ 2: the tb1 = 0 thread keeps r[k] and sends r[32+k], the
//     tb1 = 1 thread keeps r[32+k] and sends r[k]; lo = kept + o, hi = kept - o (tb1 = 1: pending
//     sign -1 on hi). Pairs always join values with the same pending sign.
// Result: r[k] = coordinate 32 t + k (group t, j = k) times sign_a, r[32+k] = coordinate
// 32 (t + NT) + k (group t + NT) times sign_b, see fwht_pending_signs; the caller multiplies by
// sign * 1/sqrt(d). fl(-a + -b) = -fl(a + b) and fl(-a * c) = -fl(a * c) for nonzero results;
// a zero may come out with the other sign, which changes no byte: every consumer (y < 0, |y|, y*y,
// and sums of non-negative terms) ignores the sign of zero.
template <int D>
__device__ __forceinline__ uint4 fwht_input_mask(const SignWords& sw, int pos) {
  uint32_t m[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int lo = 8 * pos + 2 * e, hi = lo + 1;
    const uint32_t flo = (uint32_t)fmkv::sign_negative(sw.w, lo) ^ (uint32_t)((lo >> 5) & (lo >> 6) & 1);
    const uint32_t fhi = (uint32_t)fmkv::sign_negative(sw.w, hi) ^ (uint32_t)((hi >> 5) & (hi >> 6) & 1);
    m[e] = (flo << 15) | (fhi << 31);
  }
  return make_uint4(m[0], m[1], m[2], m[3]);
}

// Pending signs (+1/-1) of the two blocks after thread_fwht, for thread t of its vector.
template <int D>
__device__ __forceinline__ void fwht_pending_signs(int t, float& sa, float& sb) {
  const int tb0 = t & 1, tb1 = (t >> 1) & 1;
  if (D == 64) { sa = 1.0f; sb = 1.0f; }
  if (D == 128) { sa = 1.0f; sb = tb0 ? -1.0f : 1.0f; }
  if (D == 256) {
    const float s1 = tb0 ? -1.0f : 1.0f;
    sa = tb1 ? s1 : 1.0f;
    sb = tb1 ? -s1 : 1.0f;
  }
}

template <int D>
__device__ __forceinline__ void thread_fwht(float (&r)[64], int lane) {
#pragma unroll
  for (int h = 1; h < 64; h <<= 1) {
#pragma unroll
    for (int k = 0; k < 64; ++k)
      if ((k & h) == 0) {
        const float a = r[k], b = r[k + h];
        r[k] = __fadd_rn(a, b);
        r[k + h] = __fsub_rn(a, b);
      }
  }
  if (D >= 128) {
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const float o = __shfl_xor_sync(kFull, r[32 + k], 1), a = r[k];
      r[k] = __fadd_rn(a, o);
      r[32 + k] = __fsub_rn(a, o);
    }
  }
  if (D == 256) {
    const bool tb1 = (lane >> 1) & 1;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const float send = tb1 ? r[k] : r[32 + k], kept = tb1 ? r[32 + k] : r[k];
      const float o = __shfl_xor_sync(kFull, send, 2);
      r[k] = __fadd_rn(kept, o);
      r[32 + k] = __fsub_rn(kept, o);
    }
  }
}

// Quantize one group of 32 rotated values y[0..31] (FORMAT.md 4-6, src/format/quantize_group.h
// quantize_scale_group_table): the fp16 scale and w[0..BITS-1], the packed words (FORMAT.md section 6: planes
// for 2 / 3 bits, nibble words for 4, the magnitude's nibble words and the sign plane for 5). Equivalences
// used (all exact):
//  * sum / 32 == sum * 2^-5, sum / 64 == sum * 2^-6 (the rounding of the same real number);
//  * code magnitude: fl(|y| / s) > t_i  <=>  |y| > T_i = RD(t_i*s + hulp_i*s). t_i has <= 13
//    significant bits and an even significand (checked on the host), s is fp16 (<= 11 bits), so
//    t_i*s and hulp_i*s are exact floats and __fadd_rd rounds their exact sum down; the rounding
//    boundary of fl(z) between t_i and its successor is t_i + hulp_i, a tie rounds to the even t_i
//    (not above it), and |y| > P <=> |y| > RD(P) for a float |y|. Thresholds ascend, so a binary
//    search over them gives the thermometer count m;
//  * sign = (y / s < 0) == (y < 0): |y| >= 2^-28 when nonzero (a multiple of 2^-24 times 1/sqrt(d)),
//    so y / s never underflows to zero; -0 gives a positive sign in both;
//  * LSQ numerator terms y * level(code) == |y| * mag[m] for y != 0 (level has the sign of y); for
//    y = +-0 the term is a zero of either sign, and the sum of these non-negative terms is positive
//    (s0 != 0), so zero signs never reach the result.
// Sums keep tree_sum32's pairs, each formed as soon as both of its terms exist (the LSQ sums depth first: few
// partial sums live next to the thread's 64 values and the thresholds).
// smag (shared memory): the side's levels mag[m]; the 4- and 5-bit LSQ quantizers read a code's level there (one
// indexed shared load) instead of selecting it among the table's constants, which took registers and made every
// 5-bit LSQ kernel spill (docs/history/cuda-quantize.md, 2026-12-07: 5-bit prefill 1.34-1.48x).
// EXACT (format 3's 3-bit tables, whose thresholds have up to 18 significant bits: t_i s is not exact in
// float): the group's thresholds from exact_threshold instead, the same compares after.
// NIB (3 bits only): the codes as nibbles instead of planes, coordinate j at nibble fmkv_nibble_shift(j) of
// word fmkv_nibble_word(j) (magnitude bits 0-1, sign bit 2): the input of the tile writers (tile_token_words).
// The whole quantizer of one code group with its own scale (scale group 32) is thread_quantize_group; scale
// group 64 composes its steps (append.cu quantize_store): thread_square_sum (the group's tree sum of y^2),
// the scale from the scale group's sum, thread_group_codes (codes, and the LSQ tree sums num / den of
// y l and l l), the LSQ scale from the scale group's num / den.
__device__ __forceinline__ float thread_square_sum(const float (&y)[32]) {
  float s8[8];  // tree_sum32 after steps 16 and 8
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float a = __fadd_rn(__fmul_rn(y[j], y[j]), __fmul_rn(y[j + 16], y[j + 16]));
    const float b = __fadd_rn(__fmul_rn(y[j + 8], y[j + 8]), __fmul_rn(y[j + 24], y[j + 24]));
    s8[j] = __fadd_rn(a, b);
  }
#pragma unroll
  for (int step = 4; step >= 1; step >>= 1)
#pragma unroll
    for (int j = 0; j < step; ++j) s8[j] = __fadd_rn(s8[j], s8[j + step]);
  return s8[0];
}
template <int BITS, bool LSQ, bool EXACT = false, bool NIB = false>
__device__ __forceinline__ void thread_group_codes(const float (&y)[32], const QuantTables& q, const float* smag,
                                                   float s0f, uint32_t (&w)[NIB ? 4 : BITS], float& num,
                                                   float& den) {
  static_assert(!NIB || BITS == 3, "nibble output is for 3-bit codes");
  constexpr int NW = NIB ? 4 : BITS;
  constexpr int M = 1 << (BITS - 1);
  // The thresholds and the search below are the same as group_thresholds / search_magnitude, written
  // out: through the helpers ptxas scheduled compress's loop differently and the prefill ran 2-3%
  // slower (docs/history/cuda-quantize.md, f5c839f; as written, append.cu compiles to the same SASS as
  // before the helpers existed).
  float T[M - 1];
#pragma unroll
  for (int i = 0; i < M - 1; ++i)
    T[i] = EXACT ? exact_threshold(q.thr[i], q.hulp[i], s0f) : __fadd_rd(__fmul_rn(q.thr[i], s0f), __fmul_rn(q.hulp[i], s0f));
#pragma unroll
  for (int b = 0; b < NW; ++b) w[b] = 0u;
  float num8[8], den8[8];
  float num16[16], den16[16];
#pragma unroll
  for (int jj = 0; jj < 32; ++jj) {
    // visit j in the order 0, 16, 8, 24, 4, 20, 12, 28, 2, ... (j & 7 bit-reversed): every pair of the tree
    // combines as soon as both of its terms exist, so few partial sums are live at once
    const int k = jj >> 2, i8 = (k & 1) << 2 | (k & 2) | (k >> 2);
    const int j = i8 + 16 * (jj & 1) + 8 * ((jj >> 1) & 1);
    const float a = fabsf(y[j]);
    float l = 0.0f;
    if constexpr (BITS == 2) {
      const bool c0 = a > T[0];
      l = c0 ? q.mag[1] : q.mag[0];
      if (c0) w[0] |= 1u << j;
    } else if constexpr (BITS == 3) {
      const bool c1 = a > T[1];
      const bool c0 = a > (c1 ? T[2] : T[0]);
      const float lo = c1 ? q.mag[2] : q.mag[0], hi = c1 ? q.mag[3] : q.mag[1];
      l = c0 ? hi : lo;
      if constexpr (NIB) {
        const int nw = fmkv_nibble_word(j), ns = fmkv_nibble_shift(j);
        if (c0) w[nw] |= 1u << ns;
        if (c1) w[nw] |= 2u << ns;
        if (y[j] < 0.0f) w[nw] |= 4u << ns;
      } else {
        const int fw = fmkv_field_word(j), fs = fmkv_field_shift(j);
        if (c0) w[fw] |= 1u << fs;
        if (c1) w[fw] |= 2u << fs;
      }
    } else if constexpr (BITS == 5) {
      bool c[4];
      search_code5(a, T, c);
      // nibble j & 7 of word j >> 3: the magnitude (bits 0-3); the sign in plane 4 (below)
      const int nw = fmkv_nibble_word(j), ns = fmkv_nibble_shift(j);
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (c[b]) w[nw] |= 1u << (ns + b);
      if constexpr (LSQ) l = smag[(w[nw] >> ns) & 15u];  // the level of the code just written
    } else {
      const bool c2 = a > T[3];
      const bool c1 = a > (c2 ? T[5] : T[1]);
      const bool c0 = a > (c2 ? (c1 ? T[6] : T[4]) : (c1 ? T[2] : T[0]));
      // nibble j & 7 of word j >> 3: magnitude bits 0-2, sign bit 3 (one predicated OR per bit)
      const int nw = fmkv_nibble_word(j), ns = fmkv_nibble_shift(j);
      if (c0) w[nw] |= 1u << ns;
      if (c1) w[nw] |= 2u << ns;
      if (c2) w[nw] |= 4u << ns;
      if constexpr (LSQ) l = smag[(w[nw] >> ns) & 7u];  // the level of the code just written
      if (y[j] < 0.0f) w[nw] |= 8u << ns;
    }
    if (BITS != 4 && !NIB && y[j] < 0.0f) w[BITS - 1] |= 1u << j;
    if constexpr (LSQ) {
      const float tn = __fmul_rn(a, l), td = __fmul_rn(l, l);
      // jj & 1: second of the pair (j, j+16); jj & 2: second of the step-8 pair
      const int i16 = j & 15;
      if ((jj & 1) == 0) {
        num16[i16] = tn;
        den16[i16] = td;
      } else {
        num16[i16] = __fadd_rn(num16[i16], tn);
        den16[i16] = __fadd_rn(den16[i16], td);
        if (jj & 2) {  // sum i8 of step 8, then the steps 4, 2, 1 that it completes (pairs (i, i + step), i < step)
          num8[i8] = __fadd_rn(num16[i8], num16[i8 + 8]);
          den8[i8] = __fadd_rn(den16[i8], den16[i8 + 8]);
          if (i8 & 4) {
            num8[i8 - 4] = __fadd_rn(num8[i8 - 4], num8[i8]);
            den8[i8 - 4] = __fadd_rn(den8[i8 - 4], den8[i8]);
            if (i8 & 2) {
              num8[i8 - 6] = __fadd_rn(num8[i8 - 6], num8[i8 - 4]);
              den8[i8 - 6] = __fadd_rn(den8[i8 - 6], den8[i8 - 4]);
              if (i8 & 1) {
                num8[0] = __fadd_rn(num8[0], num8[1]);
                den8[0] = __fadd_rn(den8[0], den8[1]);
              }
            }
          }
        }
      }
    }
  }
  num = den = 0.0f;
  if constexpr (LSQ) {
    num = num8[0];
    den = den8[0];
  }
}
// A code group's stored scale from its scale group's RMS scale s0 and (LSQ) sums num / den; a zero s0 codes
// the group as zeros with scale 0 (FORMAT.md 5.2): w is cleared.
template <bool LSQ, int NW>
__device__ __forceinline__ uint16_t thread_group_scale(uint16_t s0, float num, float den, uint32_t (&w)[NW]) {
  uint16_t scale = s0;
  if constexpr (LSQ) scale = lsq_scale(num, den);
  if (s0 == 0) {
#pragma unroll
    for (int b = 0; b < NW; ++b) w[b] = 0u;
    scale = 0;
  }
  return scale;
}
// One code group with its own scale (scale group 32): returns the fp16 scale, w the packed words.
template <int BITS, bool LSQ, bool EXACT = false, bool NIB = false>
__device__ __forceinline__ uint16_t thread_quantize_group(const float (&y)[32], const QuantTables& q, const float* smag,
                                                         uint32_t (&w)[NIB ? 4 : BITS]) {
  const uint16_t s0 = rms_scale(thread_square_sum(y));
  float num, den;
  thread_group_codes<BITS, LSQ, EXACT, NIB>(y, q, smag, f16_bits_to_f32_hw(s0), w, num, den);
  return thread_group_scale<LSQ>(s0, num, den, w);
}

}  // namespace cuda
}  // namespace fmkv
