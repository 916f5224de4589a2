// Warp-level quantizer of format v1: one warp quantizes one head vector. Lane l holds coordinates
// l + 32 r (r < D/32), so register r across the warp is exactly scale group r. Every float op is
// explicitly rounded (__fadd_rn/__fmul_rn/__fdiv_rn/__fsqrt_rn: no FMA contraction), sums use the
// xor-butterfly order of tree_sum32, so the bytes equal the reference's bit for bit.
#pragma once
#include "common.cuh"

namespace fmkv {
namespace cuda {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_tree_sum32(float t) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) t = __fadd_rn(t, __shfl_xor_sync(kFull, t, m));
  return t;
}

__device__ __forceinline__ uint16_t dev_scale_to_f16(float s) {
  uint16_t h = f32_to_f16(s);
  return (h & 0x7fffu) >= 0x7c00u ? (uint16_t)0x7bffu : h;
}

__device__ __forceinline__ float dev_mag(int bits, int m) {
  return f16_to_f32(tab::fmkv_codebook_mag_f16[FMKV_CODEBOOK_OFFSET(bits) + m]);
}

// y (fp16 input as float, already loaded per lane: x[r] = coordinate lane + 32 r) -> rotated values.
template <int D>
__device__ __forceinline__ void warp_rotate(float (&v)[D / 32], const SignWords& sw, int lane) {
  constexpr int NR = D / 32;
#pragma unroll
  for (int r = 0; r < NR; ++r)
    if (sign_negative(sw, lane + 32 * r)) v[r] = -v[r];
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

// Quantize group value y of this lane (coordinate j = lane) and write the group's planes and scale:
// words[(w * P)] for w < bits, scale at *scale_dst. All lanes call it.
__device__ __forceinline__ void warp_quantize_group(float y, int bits, int rule, int lane,
                                                    uint32_t* words, int64_t P, uint16_t* scale_dst) {
  float rms = __fsqrt_rn(__fdiv_rn(warp_tree_sum32(__fmul_rn(y, y)), 32.0f));
  uint16_t s0 = dev_scale_to_f16(rms);
  float s0f = f16_to_f32(s0);
  uint32_t sign = 0, m = 0;
  uint16_t scale = 0;
  if (s0f != 0.0f) {  // warp-uniform
    float u = __fdiv_rn(y, s0f);
    sign = u < 0.0f ? 1u : 0u;
    float a = u < 0.0f ? -u : u;
    const int M = 1 << (bits - 1);
    for (int i = 0; i + 1 < M; ++i) {
      float thr = __fmul_rn(__fadd_rn(dev_mag(bits, i), dev_mag(bits, i + 1)), 0.5f);
      m += a > thr ? 1u : 0u;
    }
    scale = s0;
    if (rule == FMKV_SCALE_LSQ) {
      float l = dev_mag(bits, (int)m);
      if (sign) l = -l;
      float num = warp_tree_sum32(__fmul_rn(y, l));
      float den = warp_tree_sum32(__fmul_rn(l, l));
      scale = dev_scale_to_f16(__fdiv_rn(num, den));
    }
  }
  const uint32_t sw = __ballot_sync(kFull, sign);
  uint32_t w0 = 0, w1 = 0, w2 = 0;
  if (bits == 2) w0 = __ballot_sync(kFull, m & 1u);
  if (bits >= 3) {
    uint32_t f = (m & 3u) << fmkv_field_shift(lane);
    int fw = fmkv_field_word(lane);
    w0 = __reduce_or_sync(kFull, fw == 0 ? f : 0u);
    w1 = __reduce_or_sync(kFull, fw == 1 ? f : 0u);
  }
  if (bits == 4) w2 = __ballot_sync(kFull, (m >> 2) & 1u);
  if (lane < bits) {
    uint32_t out = lane == bits - 1 ? sw : lane == 0 ? w0 : lane == 1 ? w1 : w2;
    words[lane * P] = out;
  }
  if (lane == 31) *scale_dst = scale;
}

}  // namespace cuda
}  // namespace fmkv
