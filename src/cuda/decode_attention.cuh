// CUDA decode attention on the compressed cache (issue 4, kernel 2): flash-decoding with tensor
// cores. Grid (nsplit + 1, kv heads, sequences). CTA (split sp < nsplit, sequence s, kv head h) takes
// a contiguous range of 16-token tiles of the compressed tokens, for up to 8 query vectors at a time
// (all q heads of the GQA group x query rows), so every K/V byte is read once per 8 query vectors.
// The last split (sp == nsplit) does the fp16 sink + window tokens (scalar fp32, raw domain).
//
// Per warp and 16-token tile:
//   S^T = Q K^T   mma.m16n8k16 (m = 8 q vectors padded to 16, n = 8 tokens, k = 16 coordinates),
//                 one mma per (group, field word); the K fragment is decoded in registers with a byte
//                 permute from the field plane: (word >> 2s) & 0x0303 -> levels of coordinates
//                 (i0, i0+16) as an fp16x2, the sign plane shifted into bits 15/31. Coordinates are
//                 permuted consistently in Q and K (the dot product does not care). Per-group fp16
//                 scales are applied in fp32 to each group's mma result.
//   online softmax in fp32 (exp2), P kept in registers: the C fragment of S is exactly the B fragment
//                 of the next mma.
//   O^T += V^T P^T  mma.m16n8k16 (m = 16 coordinates, n = 8 q vectors, k = 16 tokens); the V fragment
//                 pairs two tokens of one coordinate; the token scales multiply P (relative to the
//                 tile's largest scale, which multiplies the fp32 result), so fp16 operands never
//                 overflow or lose the small terms.
// Q is rotated once per CTA in shared memory and normalised to max |q| = 1 before fp16 rounding.
// Partials (m, l, acc in the rotated domain) go to the workspace; merge_kernel combines them, applies
// the inverse rotation once (FWHT in shared memory) and adds the fp16 part.
#pragma once
#include "quantize.cuh"

namespace fmkv {
namespace cuda {

struct AttnParams {
  const uint8_t* pages;
  int64_t num_pages, page_bytes, head_stride, ksec_bytes;
  const uint16_t *fp16_k, *fp16_v;
  int32_t num_slots, num_seqs;
  const int32_t* slots;
  const int64_t* seq_lens;
  const int64_t* ro;
  const int32_t* bt;
  int64_t bt_stride;
  const void* q;
  int32_t q_dtype;
  int64_t q_rs, q_hs, q_rows;
  void* out;
  int32_t o_dtype;
  int64_t o_rs, o_hs;
  int32_t H, HQ, gq, P, S, W, R;
  float sm_scale, softcap;
  SignWords sw;
  float2* part_ml;
  float* part_acc;
  int32_t nsplit;
  long long* err;
  // Fused decode step (fmkv_append_attention): the sink/window CTA of each (sequence, kv head) first
  // appends that head's rows of k / v; seq_lens are then the lengths before the append.
  int32_t fused;
  const void *k, *v;
  int32_t k_dtype, v_dtype;
  int64_t k_rs, k_hs, v_rs, v_hs;
  int32_t kb, vb, rule;
};
using AttnFnPtr = void (*)(AttnParams);
struct AttnFn {  // a compiled decode-attention kernel and its dynamic shared memory bytes
  AttnFnPtr fn = nullptr;
  int smem = 0;
  explicit operator bool() const { return fn != nullptr; }
};

// CTAs per SM the register allocation must allow for head_dim <= 128 (4: 128 registers, no spill in
// the tile loop; 5: 96 registers with spills) -- a tuning knob, see docs/CUDA-NOTES.md.
#ifndef FMKV_ATTN_MIN_BLOCKS
#define FMKV_ATTN_MIN_BLOCKS 4
#endif
constexpr int kAttnWarps = 4, kQV = 8, kMinTilesPerSplit = 4;
constexpr int kFusedMaxRows = 16;  // rows per sequence of a fused append + attention call
constexpr float kLog2e = 1.4426950408889634f;
constexpr uint32_t kSignMask = 0x80008000u;

template <int B>
struct BitsTraits {
  static constexpr uint32_t mask = B == 2 ? 0x0101u : B == 3 ? 0x0303u : 0x0707u;
};

// fp16x2 magnitude table: T[k] = level 2k | level 2k+1 << 16.
__device__ __forceinline__ void load_tables(int bits, uint32_t (&T)[4]) {
  const int M = 1 << (bits - 1), off = FMKV_CODEBOOK_OFFSET(bits);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t lo = 2 * k < M ? tab::fmkv_codebook_mag_f16[off + 2 * k] : 0u;
    uint32_t hi = 2 * k + 1 < M ? tab::fmkv_codebook_mag_f16[off + 2 * k + 1] : 0u;
    T[k] = lo | (hi << 16);
  }
}

// t: magnitude of value a in byte 0, of value b in byte 1 (bits above b-1 of these bytes clear;
// bytes 2,3 are ignored: the selector uses the low 16 bits only) -> fp16x2 (a, b).
template <int B>
__device__ __forceinline__ uint32_t lookup(uint32_t t, const uint32_t (&T)[4]) {
  if (B == 2) return prmt(T[0], T[0], t * 0x22u + 0x1010u);
  if (B == 3) return prmt(T[0], T[1], t * 0x22u + 0x1010u);
  const uint32_t sel = (t & 0x0303u) * 0x22u + 0x1010u;
  const uint32_t lo = prmt(T[0], T[1], sel), hi = prmt(T[2], T[3], sel);
  const uint32_t msk = prmt(t << 5, 0u, 0x9988u);  // sign-replicate bit 2 of each magnitude
  return (lo & ~msk) | (hi & msk);
}

// Selector form of a lookup, computed once per token word and shared by its four values: byte k of
// s = 0x10 + 0x22 m_k (the nibbles 2m, 2m+1 fetch the two bytes of fp16 level m), bit 7 of byte k of
// h = magnitude bit 2 (B == 4). lookup_sel() uses bytes 0 and 1 of both; byte pairs of two tokens are
// combined with one prmt before the lookup (V), or bytes 2,3 shifted down (K).
template <int B>
struct Sel {
  uint32_t s, h;
};
template <int B>
__device__ __forceinline__ Sel<B> make_sel(uint32_t x) {
  if (B == 4) return {(x & 0x03030303u) * 0x22u + 0x10101010u, x << 5};
  return {x * 0x22u + 0x10101010u, 0u};
}
template <int B>
__device__ __forceinline__ uint32_t lookup_sel(uint32_t s, uint32_t h, const uint32_t (&T)[4]) {
  if (B == 2) return prmt(T[0], T[0], s);
  if (B == 3) return prmt(T[0], T[1], s);
  const uint32_t lo = prmt(T[0], T[1], s), hi = prmt(T[2], T[3], s);
  const uint32_t msk = prmt(h, 0u, 0x9988u);  // sign-replicate bit 7 of bytes 0, 1
  return (lo & ~msk) | (hi & msk);
}

// Bytes 0..3 = magnitudes of coordinates (i0, i0+16, i0+1, i0+17) of a group (i0 even, < 16), each
// byte clean (higher bits zero), so lookup() may be given bytes 0,1 with garbage in bytes 2,3.
// f: the field word (i0 >> 3) for B >= 3, the magnitude plane for B == 2; p2: bit-2 plane (B == 4).
template <int B>
__device__ __forceinline__ uint32_t make_x(uint32_t f, uint32_t p2, int i0) {
  if (B == 2) {
    const uint32_t y = f >> i0;
    return (y & 1u) | ((y >> 8) & 0x100u) | ((y << 15) & 0x10000u) | ((y << 7) & 0x1000000u);
  }
  if (B == 3) return (f >> (i0 & 7)) & 0x03030303u;
  const uint32_t y = p2 >> i0;
  return ((f >> (i0 & 7)) & 0x03030303u) | ((y & 1u) << 2) | ((y >> 6) & 0x400u) | ((y << 17) & 0x40000u) |
         ((y << 9) & 0x4000000u);
}

__device__ __forceinline__ float h_lo(uint32_t x) { return __half2float(__ushort_as_half((unsigned short)(x & 0xffffu))); }
__device__ __forceinline__ float h_hi(uint32_t x) { return __half2float(__ushort_as_half((unsigned short)(x >> 16))); }

__device__ __forceinline__ float apply_softcap(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

// Sink + window tokens (fp16, unrotated) and, for a fused step, the tokens compressed by this step
// (positions [e0, e1), dequantized to the raw domain in shared memory dk/dv): scalar fp32, one warp
// per query vector. Ring tokens are [E, len).
template <int D>
__device__ void fp16_part(const AttnParams& p, int s, int h, int64_t len, int64_t r0, int64_t n, int64_t E,
                          const float* dk = nullptr, const float* dv = nullptr, int64_t e0 = 0, int64_t e1 = 0) {
  constexpr int NR = D / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nqv = n * p.gq;
  const int32_t slot = p.slots ? p.slots[s] : 0;
  for (int64_t v = warp; v < nqv; v += kAttnWarps) {
    const int64_t row = r0 + v / p.gq, pos = len - n + v / p.gq;
    const int hq = h * p.gq + (int)(v % p.gq);
    float q[NR], acc[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      q[r] = load_elem(p.q, p.q_dtype, row * p.q_rs + hq * p.q_hs + lane + 32 * r);
      acc[r] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const int64_t sink_end = len < p.S ? len : p.S;
    for (int pass = 0; pass < 3; ++pass) {
      if (pass != 1 && p.R == 0) continue;
      const int64_t b = pass == 0 ? 0 : pass == 1 ? e0 : E, e = pass == 0 ? sink_end : pass == 1 ? e1 : len;
      for (int64_t pp = b; pp < e && pp <= pos; ++pp) {
        float kx[NR], vx[NR];
        if (pass == 1) {
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            kx[r] = dk[(pp - e0) * D + lane + 32 * r];
            vx[r] = dv[(pp - e0) * D + lane + 32 * r];
          }
        } else {
          const int32_t fs = pp < p.S ? (int32_t)pp : p.S + (int32_t)((pp - p.S) % p.W);
          const int64_t off = (((int64_t)slot * p.H + h) * p.R + fs) * D;
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            kx[r] = f16_to_f32(p.fp16_k[off + lane + 32 * r]);
            vx[r] = f16_to_f32(p.fp16_v[off + lane + 32 * r]);
          }
        }
        float dot = 0.0f;
#pragma unroll
        for (int r = 0; r < NR; ++r) dot += q[r] * kx[r];
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float x = apply_softcap(dot * p.sm_scale, p.softcap);
        const float mn = fmaxf(m, x), corr = exp2f((m - mn) * kLog2e), pw = exp2f((x - mn) * kLog2e);
        l = l * corr + pw;
#pragma unroll
        for (int r = 0; r < NR; ++r) acc[r] = acc[r] * corr + pw * vx[r];
        m = mn;
      }
    }
    const int64_t idx = ((row * p.HQ + hq) * (p.nsplit + 1) + p.nsplit);
#pragma unroll
    for (int r = 0; r < NR; ++r) p.part_acc[idx * D + lane + 32 * r] = acc[r];
    if (lane == 0) p.part_ml[idx] = make_float2(m, l);
  }
}

// Element bits -> "not finite": fp16_range also rejects values beyond fp16 (the quantizer's canonical
// input is fp16, FORMAT.md), as the append's validation does.
__device__ __forceinline__ bool elem_bad(uint32_t bits, int32_t dtype, bool fp16_range) {
  if (dtype == FMKV_F16) return (bits & 0x7c00u) == 0x7c00u;
  const float f = dtype == FMKV_F32 ? __uint_as_float(bits) : bf16_to_f32((uint16_t)bits);
  if (!fp16_range) return !isfinite(f);
  return (f32_to_f16(f) & 0x7c00u) == 0x7c00u;
}

// Any bad element among rows [r0, r0 + n) x heads x D of a [rows][heads][D] tensor? The CTA reads it
// in 16-byte chunks, 4 chunks in flight per thread (element-wise when not 16-byte aligned), and
// reports the first bad element it meets (code kNonFinite, kind, seq = which).
__device__ inline bool block_any_bad(const void* base, int32_t dtype, int64_t rs, int64_t hs, int64_t r0, int64_t n, int heads,
                              int D, bool fp16_range, long long* err, int kind, int which) {
  const int es = dtype == FMKV_F32 ? 4 : 2, vec = 16 / es, per = D / vec;
  const bool aligned = reinterpret_cast<uintptr_t>(base) % 16 == 0 && (rs * es) % 16 == 0 && (hs * es) % 16 == 0;
  bool bad = false;
  if (aligned) {
    const int64_t total = n * heads * per;
    for (int64_t c0 = threadIdx.x; c0 < total; c0 += 4 * (int64_t)blockDim.x) {
      uint4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t c = c0 + u * (int64_t)blockDim.x;
        if (c < total) {
          const int64_t r = c / ((int64_t)heads * per);
          const int hh = (int)((c / per) % heads), part = (int)(c % per);
          x[u] = *reinterpret_cast<const uint4*>(static_cast<const char*>(base) + ((r0 + r) * rs + hh * hs) * es + part * 16);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t c = c0 + u * (int64_t)blockDim.x;
        if (c >= total) continue;
        const uint32_t w[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
        for (int k = 0; k < vec; ++k) {
          const uint32_t b = es == 4 ? w[k] : (w[k >> 1] >> (16 * (k & 1))) & 0xffffu;
          if (elem_bad(b, dtype, fp16_range)) {
            const int64_t r = c / ((int64_t)heads * per);
            const int hh = (int)((c / per) % heads), part = (int)(c % per);
            report_error(err, kNonFinite, kind, which, r0 + r, hh, part * vec + k);
            bad = true;
          }
        }
      }
    }
  } else {
    const int64_t total = n * heads * D;
    for (int64_t e = threadIdx.x; e < total; e += blockDim.x) {
      const int64_t r = e / ((int64_t)heads * D);
      const int hh = (int)((e / D) % heads), i = (int)(e % D);
      const int64_t off = (r0 + r) * rs + hh * hs + i;
      const uint32_t b = dtype == FMKV_F32 ? __float_as_uint(static_cast<const float*>(base)[off])
                                           : static_cast<const uint16_t*>(base)[off];
      if (elem_bad(b, dtype, fp16_range)) {
        report_error(err, kNonFinite, kind, which, r0 + r, hh, i);
        bad = true;
      }
    }
  }
  return bad;
}

// Fused decode step, sink/window CTA of (sequence s, kv head h), 4 warps:
//   1. validate every input of the sequence (rows, block table up to the new end, k/v/q finite):
//      all CTAs of the sequence take the same decision, so a bad sequence is left untouched;
//   2. compress the tokens [E0, E1) that leave the window (read from the ring) or arrive compressed
//      (new rows): one warp per head vector, the quantizer of append.cu (bit-exact);
//   3. write the new rows that land in the sink or the ring (after 2 read the ring);
//   4. dequantize the tokens [E0, E1) of head h to the raw domain in shared memory (inverse FWHT by
//      warp shuffles);
//   5. attention of the sequence's query vectors of head h over sink + [E0, E1) + ring.
// The split CTAs meanwhile attend [S, E0), which this step does not write.
template <int D>
__device__ void fused_step(const AttnParams& p, int s, int h, int64_t len0, int64_t r0, int64_t n, uint8_t* smem) {
  constexpr int NR = D / 32;
  const int tidx = threadIdx.x, warp = tidx >> 5, lane = tidx & 31;
  const int64_t len = len0 + n;
  const int64_t E0 = dev_compressed_end(p.S, p.W, len0), E1 = dev_compressed_end(p.S, p.W, len);
  const int32_t slot = p.slots ? p.slots[s] : 0;
  const int32_t* btrow = p.bt + (int64_t)s * p.bt_stride;
  uint8_t* pages = const_cast<uint8_t*>(p.pages);  // the layer's pages are writable (fmkv_layer_cache)
  uint16_t* fk = const_cast<uint16_t*>(p.fp16_k);
  uint16_t* fv = const_cast<uint16_t*>(p.fp16_v);

  // 1. validation
  int bad = 0;
  if (n > kFusedMaxRows) {
    bad = 1;
    if (tidx == 0) report_error(p.err, kInvalidArgument, kErrFusedRows, s, n, kFusedMaxRows, 0);
  }
  if (!bad) {
    if (E1 > p.S) {  // every block-table entry up to the new end, 4 loads in flight per thread
      const int64_t np = (E1 - 1 - p.S) / p.P + 1;
      for (int64_t q0 = tidx; q0 < np; q0 += 4 * (int64_t)blockDim.x) {
        int32_t pg[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) pg[u] = q0 + u * blockDim.x < np ? btrow[q0 + u * blockDim.x] : 0;
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (pg[u] < 0 || pg[u] >= p.num_pages) {
            bad = 1;
            report_error(p.err, kOutOfRange, kErrBlockTable, s, q0 + u * blockDim.x, pg[u], p.num_pages);
          }
      }
    }
    bad |= block_any_bad(p.k, p.k_dtype, p.k_rs, p.k_hs, r0, n, p.H, D, true, p.err, kErrNonFiniteKV, 0);
    bad |= block_any_bad(p.v, p.v_dtype, p.v_rs, p.v_hs, r0, n, p.H, D, true, p.err, kErrNonFiniteKV, 1);
    bad |= block_any_bad(p.q, p.q_dtype, p.q_rs, p.q_hs, r0, n, p.HQ, D, false, p.err, kErrNonFiniteQ, 0);
  }
  if (__syncthreads_or(bad)) return;

  // 2. compress [E0, E1) of head h
  const int64_t ncomp = E1 - E0;
  for (int64_t vj = warp; vj < 2 * ncomp; vj += kAttnWarps) {
    const int isv = (int)(vj & 1);
    const int64_t q = E0 + (vj >> 1), ci = q - p.S;
    const int32_t pg = btrow[ci / p.P];
    const int32_t t = (int32_t)(ci % p.P);
    uint16_t x[NR];
    if (q >= len0) {
      const int64_t rr = r0 + (q - len0);
      const void* src = isv ? p.v : p.k;
      const int32_t dt = isv ? p.v_dtype : p.k_dtype;
      const int64_t base = rr * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs);
#pragma unroll
      for (int i = 0; i < NR; ++i) x[i] = load_f16_bits(src, dt, base + lane + 32 * i);
    } else {  // aged out of the ring window (read before step 3 rewrites the ring)
      const int32_t fs = p.S + (int32_t)((q - p.S) % p.W);
      const uint16_t* ring = (isv ? fv : fk) + (((int64_t)slot * p.H + h) * p.R + fs) * D;
#pragma unroll
      for (int i = 0; i < NR; ++i) x[i] = ring[lane + 32 * i];
    }
    const int bits = isv ? p.vb : p.kb;
    uint8_t* sec = pages + (int64_t)pg * p.page_bytes + fmkv_section_offset(D, p.kb, p.vb, p.P, h, isv);
    if (bits == FMKV_FP16_BITS) {
      uint16_t* dst = (uint16_t*)sec + (int64_t)t * D;
#pragma unroll
      for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = x[i];
      continue;
    }
    float v[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) v[i] = f16_to_f32(x[i]);
    warp_rotate<D>(v, p.sw, lane);
    uint32_t* words = (uint32_t*)sec;
    uint16_t* scales = (uint16_t*)(sec + fmkv_scales_offset(D, bits, p.P));
#pragma unroll
    for (int g = 0; g < NR; ++g)
      warp_quantize_group(v[g], bits, p.rule, lane, words + fmkv_code_word_index(bits, p.P, g, 0, t), p.P,
                          scales + (int64_t)g * p.P + t);
  }
  __syncthreads();

  // 3. new rows that land in the sink or in the ring
  if (p.R > 0)
    for (int64_t vj = warp; vj < 2 * n; vj += kAttnWarps) {
      const int isv = (int)(vj & 1);
      const int64_t j = vj >> 1, pos = len0 + j;
      int32_t fs;
      if (pos < p.S) fs = (int32_t)pos;
      else if (p.W > 0 && pos >= len - p.W) fs = p.S + (int32_t)((pos - p.S) % p.W);
      else continue;
      uint16_t* dst = (isv ? fv : fk) + (((int64_t)slot * p.H + h) * p.R + fs) * D;
      const void* src = isv ? p.v : p.k;
      const int32_t dt = isv ? p.v_dtype : p.k_dtype;
      const int64_t base = (r0 + j) * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs);
#pragma unroll
      for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = load_f16_bits(src, dt, base + lane + 32 * i);
    }

  // 4. dequantize [E0, E1) of head h (pages written in 2 are visible to this CTA after the barrier)
  float* dk = reinterpret_cast<float*>(smem);
  float* dv = dk + kFusedMaxRows * D;
  for (int64_t vj = warp; vj < 2 * ncomp; vj += kAttnWarps) {
    const int isv = (int)(vj & 1);
    const int64_t j = vj >> 1, ci = E0 + j - p.S;
    const int32_t pg = btrow[ci / p.P];
    const int32_t t = (int32_t)(ci % p.P);
    const int bits = isv ? p.vb : p.kb;
    const uint8_t* sec = pages + (int64_t)pg * p.page_bytes + fmkv_section_offset(D, p.kb, p.vb, p.P, h, isv);
    float y[NR];
    if (bits == FMKV_FP16_BITS) {
#pragma unroll
      for (int r = 0; r < NR; ++r) y[r] = f16_to_f32(((const uint16_t*)sec)[(int64_t)t * D + lane + 32 * r]);
    } else {
      const uint32_t* words = (const uint32_t*)sec;
      const uint16_t* sc = (const uint16_t*)(sec + fmkv_scales_offset(D, bits, p.P));
#pragma unroll
      for (int g = 0; g < NR; ++g) {  // group g = register g: coordinate lane of the group
        const uint32_t w0 = words[fmkv_code_word_index(bits, p.P, g, 0, t)];
        const uint32_t w1 = bits >= 3 ? words[fmkv_code_word_index(bits, p.P, g, 1, t)] : 0u;
        const uint32_t w2 = bits == 4 ? words[fmkv_code_word_index(bits, p.P, g, 2, t)] : 0u;
        const uint32_t sgn = words[fmkv_code_word_index(bits, p.P, g, bits - 1, t)];
        uint32_t m;
        if (bits == 2) m = (w0 >> lane) & 1u;
        else m = ((fmkv_field_word(lane) ? w1 : w0) >> fmkv_field_shift(lane)) & 3u;
        if (bits == 4) m |= ((w2 >> lane) & 1u) << 2;
        const float l = dev_mag(bits, (int)m) * f16_to_f32(sc[(int64_t)g * p.P + t]);
        y[g] = ((sgn >> lane) & 1u) ? -l : l;
      }
      // inverse rotation: x = signs * FWHT(y) / sqrt(D) (the FWHT is its own inverse up to D)
#pragma unroll
      for (int hh = 1; hh < 32; hh <<= 1)
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          const float o = __shfl_xor_sync(0xffffffffu, y[r], hh);
          y[r] = (lane & hh) ? o - y[r] : y[r] + o;
        }
#pragma unroll
      for (int hr = 1; hr < NR; hr <<= 1)
#pragma unroll
        for (int r = 0; r < NR; ++r)
          if ((r & hr) == 0) {
            const float a = y[r], b = y[r + hr];
            y[r] = a + b;
            y[r + hr] = a - b;
          }
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        y[r] *= rotation_norm(D);
        if (sign_negative(p.sw, lane + 32 * r)) y[r] = -y[r];
      }
    }
    float* dst = (isv ? dv : dk) + j * D;
#pragma unroll
    for (int r = 0; r < NR; ++r) dst[lane + 32 * r] = y[r];
  }
  __syncthreads();

  // 5. attention over sink + [E0, E1) + ring
  fp16_part<D>(p, s, h, len, r0, n, E1, dk, dv, E0, E1);
}

// Sequence-level checks of a CTA (row offsets, length, slot, block-table stride). Reported once per
// sequence (by split 0 of kv head 0); every CTA of a bad sequence returns without writing.
__device__ __forceinline__ bool attn_sequence_ok(const AttnParams& p, int s, int h, int sp, int64_t r0, int64_t n,
                                                 int64_t len) {
  const bool rep = sp == 0 && h == 0 && threadIdx.x == 0;
  const int64_t r1 = r0 + n;
  bool ok = true;
  if (s == 0 && r0 != 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 0, 0); }
  if (n < 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 1, 0); }
  if (s == p.num_seqs - 1 && r1 != p.q_rows) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, r1, 2, p.q_rows); }
  if (r0 < 0 || r1 > p.q_rows) ok = false;  // reported by the sequence whose offsets are wrong
  if (len < 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrNegLen, s, 0, len, 0); }
  if (n > len && len >= 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrQRows, s, n, len, 0); }
  if (!ok) return false;
  if (p.R > 0 && n > 0) {
    const int32_t slot = p.slots ? p.slots[s] : 0;
    if (slot < 0 || slot >= p.num_slots) {
      if (rep) report_error(p.err, kOutOfRange, kErrSlot, s, 0, slot, p.num_slots);
      return false;
    }
  }
  const int64_t E = dev_compressed_end(p.S, p.W, len);
  if (E > p.S && (E - 1 - p.S) / p.P >= p.bt_stride) {
    if (rep) report_error(p.err, kOutOfRange, kErrTableStride, s, (E - 1 - p.S) / p.P + 1, 0, p.bt_stride);
    return false;
  }
  return true;
}

// Bytes of one 16-token tile of one kv head as staged in shared memory: the rows of the page layout
// (FORMAT.md) cut to 16 tokens, in page order: K code planes (64 B each), K scale rows (32 B each;
// k16: 16 tokens x D fp16 instead), then the same for V.
template <int D, int KB, int VB>
struct TileGeom {
  static constexpr int G = D / 32;
  static constexpr int kbytes = KB == FMKV_FP16_BITS ? 32 * D : G * KB * 64 + G * 32;
  static constexpr int vbytes = G * VB * 64 + G * 32;
  static constexpr int bytes = kbytes + vbytes;
  static constexpr int chunks = bytes / 16;
  // per-warp pipeline depth: 3 tiles in flight when the CTA's stages fit in 64 KB, else 2
  static constexpr int stages = kAttnWarps * 3 * bytes <= 64 * 1024 ? 3 : 2;
  static constexpr int stage_bytes = kAttnWarps * stages * bytes;
  static constexpr int combine_bytes = kAttnWarps * kQV * D * 4;  // sm_acc; sq (kQV x D floats) is smaller
  static constexpr int smem = stage_bytes > combine_bytes ? stage_bytes : combine_bytes;
};

// Decode attention main kernel (see the file header). Template: head_dim D, K/V bits, page size P
// (compile-time, so every load of a tile is a constant offset from one tile pointer).
//
// Thread -> data mapping of one warp and 16-token tile [t0, t0 + 16) of a page (lane = 4 gID + tid):
//   K (mma A operand, 16 tokens x 16 coordinates): tokens gID and gID + 8; of each group g and chunk
//     c in {0, 1} the coordinates i0, i0+16 (a0/a1) and i0+1, i0+17 (a2/a3), i0 = 8c + 2 tid.
//   Q (mma B operand): query vector gID, the same coordinates.   S (C fragment): tokens gID, gID+8
//     x query vectors 2 tid, 2 tid + 1, so the softmax state of a lane is that of queries 2tid, 2tid+1.
//   P -> B operand of the V mma (tokens 2tid, 2tid+1, 2tid+8, 2tid+9 x query gID) by movmatrix.trans,
//     after the per-token V scale of group g has been folded into P (fp32, before fp16 rounding).
//   V (mma A operand, 16 coordinates x 16 tokens): coordinates 2gID (+16, +1, +17) of each group, tokens
//     2tid, 2tid+1, 2tid+8, 2tid+9.   O (C fragment): those coordinates x queries 2tid, 2tid+1.
template <int D, int KB, int VB, int P>
__global__ void __launch_bounds__(128, D <= 128 ? FMKV_ATTN_MIN_BLOCKS : 2) attn_kernel(AttnParams p) {
  constexpr int G = D / 32;
  constexpr bool K16 = KB == FMKV_FP16_BITS;
  constexpr int KW = K16 ? 1 : KB;                        // code words per group and token (K)
  using TG = TileGeom<D, KB, VB>;
  constexpr int NST = TG::stages, TB = TG::bytes;
  // Dynamic shared memory, reused by phase: Q rotation (sq), tile staging (per warp NST x TB bytes),
  // combination of the 4 warps (sm_acc). __syncthreads() separates the phases.
  extern __shared__ __align__(16) uint8_t smem[];
  float(*sq)[D] = reinterpret_cast<float(*)[D]>(smem);
  float(*sm_acc)[kQV][D] = reinterpret_cast<float(*)[kQV][D]>(smem);
  __shared__ float s_qmax[kQV];
  __shared__ uint32_t s_tab[8][32];
  __shared__ float sm_m[kAttnWarps][kQV], sm_l[kAttnWarps][kQV];
  __shared__ int32_t s_pg[kAttnWarps][NST];
  grid_dependency_wait();  // launched as a programmatic dependent: nothing upstream is read before this
  if (error_set(p.err)) return;
  const int s = blockIdx.z, h = blockIdx.y, sp = blockIdx.x;
  const int tidx = threadIdx.x, warp = tidx >> 5, lane = tidx & 31, gID = lane >> 2, tid = lane & 3;
  const int64_t len0 = p.seq_lens[s], r0 = p.ro[s], n = p.ro[s + 1] - r0;
  // fused step: attention over len0 + n tokens, of which [S, ce(len0)) were compressed before it
  if (p.fused && n > 0 && len0 > INT64_MAX - n) {
    if (sp == 0 && h == 0 && tidx == 0) report_error(p.err, kOverflow, kErrLenOverflow, s, 0, len0, 0);
    return;
  }
  const int64_t len = p.fused && n > 0 && len0 >= 0 ? len0 + n : len0;
  if (!attn_sequence_ok(p, s, h, sp, r0, n, len) || n <= 0) return;
  const int64_t E = dev_compressed_end(p.S, p.W, p.fused ? len0 : len), C = E - p.S;
  if (sp == p.nsplit) {
    if (p.fused) fused_step<D>(p, s, h, len0, r0, n, smem);
    else fp16_part<D>(p, s, h, len, r0, n, E);
    return;
  }
  const int64_t nqv = n * p.gq;
  const int64_t ntiles = (C + 15) / 16;
  int64_t tps = (ntiles + p.nsplit - 1) / p.nsplit;
  if (tps < kMinTilesPerSplit) tps = kMinTilesPerSplit;
  const int64_t tb = (int64_t)sp * tps, te = ntiles < tb + tps ? ntiles : tb + tps;

  // Codebook tables in ordinary registers: a table in a uniform register costs a move per lookup,
  // so every lane reads its own copy (a lane-dependent shared-memory address is never uniform).
  if (tidx < 8) {
    uint32_t T[4];
    load_tables(tidx < 4 ? (K16 ? VB : KB) : VB, T);
    for (int l = 0; l < 32; ++l) s_tab[tidx][l] = T[tidx & 3];
  }
  __syncthreads();
  uint32_t TK[4], TV[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    TK[k] = s_tab[k][lane];
    TV[k] = s_tab[4 + k][lane];
  }

  // cp.async chunks (16 B) of a tile copied by this lane: chunk c = lane + 32 i lands at byte 16 c of
  // the stage; its source is head base + ch_off + t0 * ch_mul (t0 = tile's first token in its page).
  constexpr int NCH = (TG::chunks + 31) / 32;
  int ch_off[NCH], ch_mul[NCH];
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int c = lane + 32 * i;
    ch_off[i] = -1;
    ch_mul[i] = 0;
    if (c < TG::chunks) {
      int off = 16 * c, sec = 0, sec_page_off = 0, bits = KB;
      if (off >= TG::kbytes) { off -= TG::kbytes; sec = 1; sec_page_off = (int)p.ksec_bytes; bits = VB; }
      if (sec == 0 && K16) {
        ch_off[i] = off;
        ch_mul[i] = 2 * D;
      } else if (off < G * bits * 64) {  // code plane row r, part q
        ch_off[i] = sec_page_off + (off / 64) * P * 4 + off % 64;
        ch_mul[i] = 4;
      } else {  // scale row
        off -= G * bits * 64;
        ch_off[i] = sec_page_off + G * bits * P * 4 + (off / 32) * P * 2 + off % 32;
        ch_mul[i] = 2;
      }
    }
  }

  for (int64_t vb = 0; vb < nqv; vb += kQV) {
    // ---- Q: load 8 query vectors (finite-checked), rotate (unnormalised FWHT of s*q) in shared memory
    for (int e = tidx; e < kQV * D; e += blockDim.x) {
      const int i = e / D, c = e % D;
      const int64_t v = vb + i;
      float x = 0.0f;
      if (v < nqv) {
        const int64_t row = r0 + v / p.gq;
        const int hq = h * p.gq + (int)(v % p.gq);
        x = load_elem(p.q, p.q_dtype, row * p.q_rs + hq * p.q_hs + c);
        if (!isfinite(x)) {
          report_error(p.err, kNonFinite, kErrNonFiniteQ, 0, row, hq, c);
          x = 0.0f;
        }
      }
      if (!K16 && sign_negative(p.sw, c)) x = -x;
      sq[i][c] = x;
    }
    __syncthreads();
    if (!K16) {
      for (int hh = 1; hh < D; hh <<= 1) {
        for (int e = tidx; e < kQV * D / 2; e += blockDim.x) {
          const int i = e / (D / 2), k = e % (D / 2), c = (k / hh) * 2 * hh + (k % hh);
          const float a = sq[i][c], b = sq[i][c + hh];
          sq[i][c] = a + b;
          sq[i][c + hh] = a - b;
        }
        __syncthreads();
      }
    }
    for (int i = warp; i < kQV; i += kAttnWarps) {
      float m = 0.0f;
      for (int c = lane; c < D; c += 32) m = fmaxf(m, fabsf(sq[i][c]));
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lane == 0) s_qmax[i] = m;
    }
    __syncthreads();
    uint32_t qb[G][2][2];  // B operand: query vector gID, normalised to max |q| = 1
    {
      const float qmax = s_qmax[gID], qinv = qmax > 0.0f ? 1.0f / qmax : 0.0f;
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int b = 32 * g + 8 * c + 2 * tid;
          qb[g][c][0] = pack_half2(sq[gID][b] * qinv, sq[gID][b + 16] * qinv);
          qb[g][c][1] = pack_half2(sq[gID][b + 1] * qinv, sq[gID][b + 17] * qinv);
        }
    }
    __syncthreads();  // sq is dead: the tile stages reuse its memory
    // this lane's softmax rows: query vectors 2 tid + j
    const float post = p.softcap > 0.0f ? kLog2e : 1.0f;
    float fac2[2];
    int64_t pos[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t v = vb + 2 * tid + j;
      pos[j] = v < nqv ? len - n + v / p.gq : -1;
      const float fac = s_qmax[2 * tid + j] * (K16 ? 1.0f : rotation_norm(D)) * p.sm_scale;
      // scores are kept in log2 units (x log2 e) inside the tile loop; m is converted back at the end
      fac2[j] = p.softcap > 0.0f ? fac : fac * kLog2e;
    }

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    float acc[G][2][4];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[g][mt][k] = 0.0f;

    // Page of tile ti (or -1, reported).
    const int32_t* btrow = p.bt + (int64_t)s * p.bt_stride;
    auto page_of = [&](int64_t ti) -> int32_t {
      const int64_t q = (ti * 16) / P;
      const int32_t pg = btrow[q];
      if (pg >= 0 && pg < p.num_pages) return pg;
      if (lane == 0) report_error(p.err, kOutOfRange, kErrBlockTable, s, q, pg, p.num_pages);
      return -1;
    };
    // This warp's tiles: ti = tb + warp + 4 k, k < nmy. Tile k is staged into stage k % NST by
    // cp.async NST - 1 tiles ahead of its use; its page index is read one issue earlier still.
    const int64_t first = tb + warp;
    const int nmy = te > first ? (int)((te - first + kAttnWarps - 1) / kAttnWarps) : 0;
    uint8_t* wst = smem + warp * NST * TB;
    auto page_k = [&](int k) -> int32_t { return k < nmy ? page_of(first + (int64_t)k * kAttnWarps) : -1; };
    auto issue = [&](int k, int32_t pg) {
      if (k < nmy) {
        if (lane == 0) s_pg[warp][k % NST] = pg;
        if (pg >= 0) {
          const uint8_t* hb = p.pages + (int64_t)pg * p.page_bytes + (int64_t)h * p.head_stride;
          const int t0 = (int)(((first + (int64_t)k * kAttnWarps) * 16) % P);
          uint8_t* dst = wst + (k % NST) * TB;
#pragma unroll
          for (int i = 0; i < NCH; ++i)
            if (ch_off[i] >= 0) cp_async16(dst + 16 * (lane + 32 * i), hb + ch_off[i] + t0 * ch_mul[i]);
        }
      }
      cp_async_commit();  // one group per tile slot, empty or not, so wait_group counts tiles
    };
    int32_t pg_ahead = page_k(0);
#pragma unroll 1
    for (int k = 0; k < NST - 1; ++k) {
      const int32_t pn = page_k(k + 1);
      issue(k, pg_ahead);
      pg_ahead = pn;
    }
#pragma unroll 1
    for (int k = 0; k < nmy; ++k) {
      const int32_t pn = page_k(k + NST);
      issue(k + NST - 1, pg_ahead);
      pg_ahead = pn;
      cp_async_wait<NST - 1>();  // this lane's copies of tile k have landed
      __syncwarp();              // ... and every lane's
      const int32_t pg = s_pg[warp][k % NST];
      const int64_t ci0 = (first + (int64_t)k * kAttnWarps) * 16;
      const uint8_t* st = wst + (k % NST) * TB;  // the staged tile
      if (pg >= 0) {
      const int64_t rem = C - ci0;
      const int nvalid = rem < 16 ? (int)rem : 16;  // token offsets o < nvalid exist

      // ---- scores S = K Q^T: sc[k] = (token gID + 8 (k >> 1), query 2 tid + (k & 1))
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (K16) {
        const uint16_t* ka = (const uint16_t*)st + gID * D;
        const uint16_t* kb = ka + 8 * D;
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int b = 32 * g + 8 * c + 2 * tid;
            const uint32_t a0 = (uint32_t)ka[b] | ((uint32_t)ka[b + 16] << 16);
            const uint32_t a1 = (uint32_t)kb[b] | ((uint32_t)kb[b + 16] << 16);
            const uint32_t a2 = (uint32_t)ka[b + 1] | ((uint32_t)ka[b + 17] << 16);
            const uint32_t a3 = (uint32_t)kb[b + 1] | ((uint32_t)kb[b + 17] << 16);
            mma16816(sc, a0, a1, a2, a3, qb[g][c][0], qb[g][c][1]);
          }
      } else {
        const uint32_t* kw = (const uint32_t*)st + gID;                           // token gID, plane 0
        const uint16_t* ks = (const uint16_t*)(st + G * KB * 64) + gID;           // its scale, group 0
#pragma unroll
        for (int g = 0; g < G; ++g) {
          uint32_t wa[KW], wb[KW];
#pragma unroll
          for (int k = 0; k < KW; ++k) {
            wa[k] = kw[(g * KB + k) * 16];
            wb[k] = kw[(g * KB + k) * 16 + 8];
          }
          float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i0 = 8 * c + 2 * tid;
            const Sel<KB> sa_ = make_sel<KB>(make_x<KB>(KB == 2 ? wa[0] : wa[c], KB == 4 ? wa[KB == 4 ? 2 : 0] : 0u, i0));
            const Sel<KB> sb_ = make_sel<KB>(make_x<KB>(KB == 2 ? wb[0] : wb[c], KB == 4 ? wb[KB == 4 ? 2 : 0] : 0u, i0));
            const uint32_t ua = wa[KW - 1] >> i0, ub = wb[KW - 1] >> i0;
            const uint32_t a0 = lookup_sel<KB>(sa_.s, sa_.h, TK) ^ ((ua << 15) & kSignMask);
            const uint32_t a1 = lookup_sel<KB>(sb_.s, sb_.h, TK) ^ ((ub << 15) & kSignMask);
            const uint32_t a2 = lookup_sel<KB>(sa_.s >> 16, sa_.h >> 16, TK) ^ ((ua << 14) & kSignMask);
            const uint32_t a3 = lookup_sel<KB>(sb_.s >> 16, sb_.h >> 16, TK) ^ ((ub << 14) & kSignMask);
            mma16816(c4, a0, a1, a2, a3, qb[g][c][0], qb[g][c][1]);
          }
          const float fa = h_lo(ks[g * 16]), fb = h_lo(ks[g * 16 + 8]);
          sc[0] += c4[0] * fa;
          sc[1] += c4[1] * fa;
          sc[2] += c4[2] * fb;
          sc[3] += c4[3] * fb;
        }
      }

      // ---- online softmax of queries 2 tid + j over the tile's 16 tokens (8 lanes of equal tid)
      float pr[4];
      float mt_[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int o = gID + 8 * (k >> 1), j = k & 1;
        const bool ok = o < nvalid && p.S + ci0 + o <= pos[j];
        const float x = apply_softcap(sc[k] * fac2[j], p.softcap) * post;
        pr[k] = ok ? x : -INFINITY;
        mt_[j] = fmaxf(mt_[j], pr[k]);
      }
      float corr[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int o = 4; o <= 16; o <<= 1) mt_[j] = fmaxf(mt_[j], __shfl_xor_sync(0xffffffffu, mt_[j], o));
        const float m_new = fmaxf(m_run[j], mt_[j]);
        corr[j] = m_new == -INFINITY ? 1.0f : exp2f(m_run[j] - m_new);
        const float ms = m_new == -INFINITY ? 0.0f : m_new;  // all masked so far: p = exp2(-inf) = 0
        pr[j] = exp2f(pr[j] - ms);
        pr[j + 2] = exp2f(pr[j + 2] - ms);
        l_run[j] = l_run[j] * corr[j] + (pr[j] + pr[j + 2]);
        m_run[j] = m_new;
      }
      if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {  // some running max moved
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[g][mt][k] *= corr[k & 1];
      }

      // ---- O^T += V^T P^T; this lane: coordinates 2gID + {0,16,1,17} of each group, tokens a,b,c,d
      const uint8_t* vst = st + TG::kbytes;
      const uint32_t* vw = (const uint32_t*)vst + 2 * tid;                        // token a, plane 0
      const uint16_t* vs = (const uint16_t*)(vst + G * VB * 64) + gID;            // token gID's V scale
      const int i0v = 2 * gID, fwv = gID >> 2;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        // P x token scale (fp32, then fp16: p <= 1 and |scale| <= 65504 cannot overflow), transposed
        // (tokens past the end get scale 0: their bytes may be uninitialised, and 0 x Inf is NaN)
        const float sa = gID < nvalid ? h_lo(vs[g * 16]) : 0.0f, sb = gID + 8 < nvalid ? h_lo(vs[g * 16 + 8]) : 0.0f;
        uint32_t pb0 = pack_half2(pr[0] * sa, pr[1] * sa), pb1 = pack_half2(pr[2] * sb, pr[3] * sb);
        pb0 = movmatrix_trans(pb0);
        pb1 = movmatrix_trans(pb1);
        const int wi = (g * VB + (VB == 2 ? 0 : fwv)) * 16, si = (g * VB + VB - 1) * 16;
        const uint2 fab = *(const uint2*)(vw + wi), fcd = *(const uint2*)(vw + wi + 8);
        const uint2 gab = *(const uint2*)(vw + si), gcd = *(const uint2*)(vw + si + 8);
        uint2 pab = make_uint2(0u, 0u), pcd = make_uint2(0u, 0u);
        if (VB == 4) {
          pab = *(const uint2*)(vw + (g * VB + 2) * 16);
          pcd = *(const uint2*)(vw + (g * VB + 2) * 16 + 8);
        }
        const Sel<VB> xa = make_sel<VB>(make_x<VB>(fab.x, pab.x, i0v)), xb = make_sel<VB>(make_x<VB>(fab.y, pab.y, i0v));
        const Sel<VB> xc = make_sel<VB>(make_x<VB>(fcd.x, pcd.x, i0v)), xd = make_sel<VB>(make_x<VB>(fcd.y, pcd.y, i0v));
        const uint32_t ua = gab.x >> i0v, ub = gab.y >> i0v, uc = gcd.x >> i0v, ud = gcd.y >> i0v;
        const uint32_t wlo_ab = prmt(ua, ub, 0x5410u), whi_ab = prmt(ua, ub, 0x7632u);
        const uint32_t wlo_cd = prmt(uc, ud, 0x5410u), whi_cd = prmt(uc, ud, 0x7632u);
        // value pair (token a|c, token b|d) of coordinate byte k: prmt(x, y, 0x40 + 0x11 k)
#define FMKV_VPAIR(X, Y, SEL) lookup_sel<VB>(prmt(X.s, Y.s, SEL), VB == 4 ? prmt(X.h, Y.h, SEL) : 0u, TV)
        const uint32_t aA0 = FMKV_VPAIR(xa, xb, 0x40u) ^ ((wlo_ab << 15) & kSignMask);
        const uint32_t aA1 = FMKV_VPAIR(xa, xb, 0x51u) ^ ((whi_ab << 15) & kSignMask);
        const uint32_t aA2 = FMKV_VPAIR(xc, xd, 0x40u) ^ ((wlo_cd << 15) & kSignMask);
        const uint32_t aA3 = FMKV_VPAIR(xc, xd, 0x51u) ^ ((whi_cd << 15) & kSignMask);
        const uint32_t aB0 = FMKV_VPAIR(xa, xb, 0x62u) ^ ((wlo_ab << 14) & kSignMask);
        const uint32_t aB1 = FMKV_VPAIR(xa, xb, 0x73u) ^ ((whi_ab << 14) & kSignMask);
        const uint32_t aB2 = FMKV_VPAIR(xc, xd, 0x62u) ^ ((wlo_cd << 14) & kSignMask);
        const uint32_t aB3 = FMKV_VPAIR(xc, xd, 0x73u) ^ ((whi_cd << 14) & kSignMask);
#undef FMKV_VPAIR
        mma16816(acc[g][0], aA0, aA1, aA2, aA3, pb0, pb1);
        mma16816(acc[g][1], aB0, aB1, aB2, aB3, pb0, pb1);
      }
      }  // pg >= 0
      __syncwarp();  // every lane is done with this stage before it is refilled
    }
    cp_async_wait<0>();

    __syncthreads();  // every warp is done with its stages: sm_acc reuses their memory
    // ---- combine the 4 warps, write this split's partial
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int o = 4; o <= 16; o <<= 1) l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], o);
      if (gID == 0) {
        sm_m[warp][2 * tid + j] = m_run[j] * 0.69314718055994531f;  // back to natural-log units
        sm_l[warp][2 * tid + j] = l_run[j];
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          sm_acc[warp][2 * tid + (k & 1)][32 * g + 2 * gID + mt + ((k & 2) ? 16 : 0)] = acc[g][mt][k];
    __syncthreads();
    for (int e = tidx; e < kQV * D; e += blockDim.x) {
      const int i = e / D, c = e % D;
      const int64_t v = vb + i;
      if (v >= nqv) continue;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sm_m[w][i]);
      float L = 0.0f, A = 0.0f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) {
          const float f = exp2f((sm_m[w][i] - M) * kLog2e);
          L += sm_l[w][i] * f;
          A += sm_acc[w][i][c] * f;
        }
      }
      const int64_t row = r0 + v / p.gq;
      const int hq = h * p.gq + (int)(v % p.gq);
      const int64_t idx = (row * p.HQ + hq) * (p.nsplit + 1) + sp;
      p.part_acc[idx * D + c] = A;
      if (c == 0) p.part_ml[idx] = make_float2(M, L);
    }
    __syncthreads();
  }
  grid_dependents_launch();  // the merge kernel may start launching (it waits for this grid's writes)
}

// Compiled (head_dim, K bits, V bits) combinations: a default build compiles the grid below for
// every page size; -DFMKV_CUDA_FULL_GRID=ON compiles all 36 (x 5 page sizes). Anything else fails
// with FMKV_ERR_UNSUPPORTED naming the combination (decode_attention.cu), never a fallback.
constexpr bool attn_compiled(int d, int kb, int vb) {
#ifdef FMKV_CUDA_FULL_GRID
  return (d == 64 || d == 128 || d == 256) && (kb == 2 || kb == 3 || kb == 4 || kb == 16) && vb >= 2 && vb <= 4;
#else
  return ((d == 64 || d == 128) && ((kb == 2 && vb == 2) || (kb == 3 && vb == 3) || (kb == 4 && vb == 4) ||
                                    (kb == 4 && vb == 2) || (kb == 16 && vb == 3))) ||
         (d == 256 && ((kb == 3 && vb == 3) || (kb == 4 && vb == 4)));
#endif
}
const char* const kAttnDefaultGrid = "k2v2, k3v3, k4v4, k4v2, k16v3 for head_dim 64/128 and k3v3, k4v4 for head_dim 256";

template <int D, int KB, int VB>
AttnFn attn_kernel_for_page(int page) {
  if constexpr (!attn_compiled(D, KB, VB)) {
    return {};
  } else {
    constexpr int smem = TileGeom<D, KB, VB>::smem;
    switch (page) {
      case 16: return {attn_kernel<D, KB, VB, 16>, smem};
      case 32: return {attn_kernel<D, KB, VB, 32>, smem};
      case 64: return {attn_kernel<D, KB, VB, 64>, smem};
      case 128: return {attn_kernel<D, KB, VB, 128>, smem};
      case 256: return {attn_kernel<D, KB, VB, 256>, smem};
    }
    return {};
  }
}

AttnFn attn_kernel_k2(int d, int vb, int page);
AttnFn attn_kernel_k3(int d, int vb, int page);
AttnFn attn_kernel_k4(int d, int vb, int page);
AttnFn attn_kernel_k16(int d, int vb, int page);

#define FMKV_ATTN_DISPATCH(KB)                                          \
  AttnFn attn_kernel_k##KB(int d, int vb, int page) {                   \
    switch (d * 10 + vb) {                                              \
      case 642: return attn_kernel_for_page<64, KB, 2>(page);           \
      case 643: return attn_kernel_for_page<64, KB, 3>(page);           \
      case 644: return attn_kernel_for_page<64, KB, 4>(page);           \
      case 1282: return attn_kernel_for_page<128, KB, 2>(page);         \
      case 1283: return attn_kernel_for_page<128, KB, 3>(page);         \
      case 1284: return attn_kernel_for_page<128, KB, 4>(page);         \
      case 2562: return attn_kernel_for_page<256, KB, 2>(page);         \
      case 2563: return attn_kernel_for_page<256, KB, 3>(page);         \
      case 2564: return attn_kernel_for_page<256, KB, 4>(page);         \
    }                                                                   \
    return {};                                                          \
  }

}  // namespace cuda
}  // namespace fmkv
