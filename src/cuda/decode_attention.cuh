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
#include "common.cuh"

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
};
using AttnFn = void (*)(AttnParams);

// CTAs per SM the register allocation must allow for head_dim <= 128 (4: 128 registers, no spill in
// the tile loop; 5: 96 registers with spills) -- a tuning knob, see docs/CUDA-NOTES.md.
#ifndef FMKV_ATTN_MIN_BLOCKS
#define FMKV_ATTN_MIN_BLOCKS 4
#endif
constexpr int kAttnWarps = 4, kQV = 8, kMinTilesPerSplit = 4;
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

// Sink + window tokens (fp16, unrotated): scalar fp32, one warp per query vector.
template <int D>
__device__ void fp16_part(const AttnParams& p, int s, int h, int64_t len, int64_t r0, int64_t n, int64_t E) {
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
    if (p.R > 0) {
      const int64_t sink_end = len < p.S ? len : p.S;
      for (int pass = 0; pass < 2; ++pass) {
        const int64_t b = pass ? E : 0, e = pass ? len : sink_end;
        for (int64_t pp = b; pp < e && pp <= pos; ++pp) {
          const int32_t fs = pp < p.S ? (int32_t)pp : p.S + (int32_t)((pp - p.S) % p.W);
          const int64_t off = (((int64_t)slot * p.H + h) * p.R + fs) * D;
          float dot = 0.0f;
#pragma unroll
          for (int r = 0; r < NR; ++r) dot += q[r] * f16_to_f32(p.fp16_k[off + lane + 32 * r]);
#pragma unroll
          for (int o = 16; o >= 1; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
          const float x = apply_softcap(dot * p.sm_scale, p.softcap);
          const float mn = fmaxf(m, x), corr = exp2f((m - mn) * kLog2e), pw = exp2f((x - mn) * kLog2e);
          l = l * corr + pw;
#pragma unroll
          for (int r = 0; r < NR; ++r) acc[r] = acc[r] * corr + pw * f16_to_f32(p.fp16_v[off + lane + 32 * r]);
          m = mn;
        }
      }
    }
    const int64_t idx = ((row * p.HQ + hq) * (p.nsplit + 1) + p.nsplit);
#pragma unroll
    for (int r = 0; r < NR; ++r) p.part_acc[idx * D + lane + 32 * r] = acc[r];
    if (lane == 0) p.part_ml[idx] = make_float2(m, l);
  }
}

template <int D, int KB, int VB>
__global__ void __launch_bounds__(128, D <= 128 ? FMKV_ATTN_MIN_BLOCKS : 2) attn_kernel(AttnParams p) {
  constexpr int G = D / 32;
  __shared__ float sq[kQV][D];
  __shared__ float s_qmax[kQV];
  __shared__ float sm_m[kAttnWarps][kQV], sm_l[kAttnWarps][kQV];
  __shared__ float sm_acc[kAttnWarps][kQV][D];
  if (error_set(p.err)) return;
  const int s = blockIdx.z, h = blockIdx.y, sp = blockIdx.x;
  const int tidx = threadIdx.x, warp = tidx >> 5, lane = tidx & 31, gID = lane >> 2, tid = lane & 3;
  const int64_t len = p.seq_lens[s], r0 = p.ro[s], n = p.ro[s + 1] - r0;
  if (n <= 0) return;
  const int64_t E = dev_compressed_end(p.S, p.W, len), C = E - p.S;
  if (sp == p.nsplit) {
    fp16_part<D>(p, s, h, len, r0, n, E);
    return;
  }
  const int64_t nqv = n * p.gq;
  const int64_t ntiles = (C + 15) / 16;
  int64_t tps = (ntiles + p.nsplit - 1) / p.nsplit;
  if (tps < kMinTilesPerSplit) tps = kMinTilesPerSplit;
  const int64_t tb = (int64_t)sp * tps, te = ntiles < tb + tps ? ntiles : tb + tps;

  uint32_t TK[4], TV[4];
  if (KB != FMKV_FP16_BITS) load_tables(KB, TK);
  load_tables(VB, TV);
  const int64_t kscales_off = KB == FMKV_FP16_BITS ? 0 : fmkv_scales_offset(D, KB, p.P);
  const int64_t vscales_off = fmkv_scales_offset(D, VB, p.P);
  const int P = p.P;

  for (int64_t vb = 0; vb < nqv; vb += kQV) {
    // ---- Q: load 8 query vectors, rotate (unnormalised FWHT of s*q) in shared memory
    for (int e = tidx; e < kQV * D; e += blockDim.x) {
      const int i = e / D, c = e % D;
      const int64_t v = vb + i;
      float x = 0.0f;
      if (v < nqv) {
        const int64_t row = r0 + v / p.gq;
        const int hq = h * p.gq + (int)(v % p.gq);
        x = load_elem(p.q, p.q_dtype, row * p.q_rs + hq * p.q_hs + c);
      }
      if (KB != FMKV_FP16_BITS && sign_negative(p.sw, c)) x = -x;
      sq[i][c] = x;
    }
    __syncthreads();
    if (KB != FMKV_FP16_BITS) {
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
    const float qmax = s_qmax[gID], qinv = qmax > 0.0f ? 1.0f / qmax : 0.0f;
    uint32_t qa[G][2][2];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int b = 32 * g + 8 * c + 2 * tid;
        qa[g][c][0] = pack_half2(sq[gID][b] * qinv, sq[gID][b + 16] * qinv);
        qa[g][c][1] = pack_half2(sq[gID][b + 1] * qinv, sq[gID][b + 17] * qinv);
      }
    const int64_t myv = vb + gID;
    const int64_t pos = myv < nqv ? len - n + myv / p.gq : -1;
    const float fac = qmax * (KB != FMKV_FP16_BITS ? rotation_norm(D) : 1.0f) * p.sm_scale;
    // scores are kept in log2 units (x log2 e) inside the tile loop; m is converted back at the end
    const float fac2 = p.softcap > 0.0f ? fac : fac * kLog2e;
    const float post = p.softcap > 0.0f ? kLog2e : 1.0f;

    float m_run = -INFINITY, l_run = 0.0f;
    float acc[G][2][4];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[g][mt][k] = 0.0f;

    // Page of tile ti (or -1); the next tile's page is loaded one iteration ahead and its bytes are
    // prefetched into L2 one tile ahead, so the dependent loads of a tile mostly hit L2.
    const int32_t* btrow = p.bt + (int64_t)s * p.bt_stride;
    auto page_of = [&](int64_t ti) -> int32_t {
      if (ti >= te) return -1;
      const int32_t pg = btrow[(ti * 16) / P];
      return pg >= 0 && pg < p.num_pages ? pg : -1;
    };
    int32_t pg_next = page_of(tb + warp), pg_after = page_of(tb + warp + kAttnWarps);
    for (int64_t ti = tb + warp; ti < te; ti += kAttnWarps) {
      const int64_t ci0 = ti * 16;
      const int32_t pg = pg_next;
      pg_next = pg_after;                          // loaded one iteration ago
      pg_after = page_of(ti + 2 * kAttnWarps);     // used next iteration
      if (pg_next >= 0) {  // L2 prefetch of the next tile: one 16-token row segment per lane
        constexpr int KS = KB == FMKV_FP16_BITS ? 0 : G, KR = KB == FMKV_FP16_BITS ? 0 : G * KB, VR = G * VB;
        constexpr int ROWS = KR + KS + VR + G, EXTRA = KB == FMKV_FP16_BITS ? D / 4 : 0;  // k16: 128 B lines
        const int tn = (int)(((ti + kAttnWarps) * 16) % P);
        const uint8_t* kn = p.pages + (int64_t)pg_next * p.page_bytes + (int64_t)h * p.head_stride;
        const uint8_t* vn = kn + p.ksec_bytes;
        for (int r = lane; r < ROWS + EXTRA; r += 32) {
          const uint8_t* a;
          if (r >= ROWS) a = kn + (int64_t)tn * D * 2 + (int64_t)(r - ROWS) * 128;
          else if (r < KR) a = kn + ((int64_t)r * P + tn) * 4;
          else if (r < KR + KS) a = kn + kscales_off + ((int64_t)(r - KR) * P + tn) * 2;
          else if (r < KR + KS + VR) a = vn + ((int64_t)(r - KR - KS) * P + tn) * 4;
          else a = vn + vscales_off + ((int64_t)(r - KR - KS - VR) * P + tn) * 2;
          asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
        }
      }
      if (pg < 0) continue;
      const int t0 = (int)(ci0 % P);
      const uint8_t* ksec = p.pages + (int64_t)pg * p.page_bytes + (int64_t)h * p.head_stride;
      const uint8_t* vsec = ksec + p.ksec_bytes;
      // valid tokens: offset o in [0,16) is valid for K/V if o < nvalid, visible to this q vector if
      // o <= nvis (causal)
      const int64_t rem = C - ci0, vis = pos - (p.S + ci0);
      const int nvalid = rem < 16 ? (int)rem : 16;
      const int nvis = vis < 16 ? (vis < -1 ? -1 : (int)vis) : 16;

      // ---- scores S = Q K^T for tokens (t0 + 8 nt + 2 tid + {0,1}) of query vector gID
      float sc[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int tk = t0 + 8 * nt + gID;
        float s0 = 0.0f, s1 = 0.0f;
        if constexpr (KB == FMKV_FP16_BITS) {
          float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          const uint16_t* kr = (const uint16_t*)ksec + (int64_t)tk * D;
#pragma unroll
          for (int g = 0; g < G; ++g)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int b = 32 * g + 8 * c + 2 * tid;
              const uint32_t b0 = (uint32_t)kr[b] | ((uint32_t)kr[b + 16] << 16);
              const uint32_t b1 = (uint32_t)kr[b + 1] | ((uint32_t)kr[b + 17] << 16);
              mma16816(c4, qa[g][c][0], 0u, qa[g][c][1], 0u, b0, b1);
            }
          s0 = c4[0];
          s1 = c4[1];
        } else {
          const uint32_t* kw = (const uint32_t*)ksec;
          const uint32_t* ks = (const uint32_t*)(ksec + kscales_off);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            uint32_t w[KB == FMKV_FP16_BITS ? 1 : KB];
#pragma unroll
            for (int k = 0; k < (KB == FMKV_FP16_BITS ? 1 : KB); ++k) w[k] = kw[(int64_t)(g * KB + k) * P + tk];
            const uint32_t sgn = w[KB - 1];
            float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int i0 = 8 * c + 2 * tid;
              const uint32_t x = make_x<KB>(KB == 2 ? w[0] : w[c], KB == 4 ? w[KB == 4 ? 2 : 0] : 0u, i0);
              const uint32_t u = sgn >> i0;
              const uint32_t b0 = lookup<KB>(x, TK) ^ ((u << 15) & kSignMask);
              const uint32_t b1 = lookup<KB>(x >> 16, TK) ^ ((u << 14) & kSignMask);
              mma16816(c4, qa[g][c][0], 0u, qa[g][c][1], 0u, b0, b1);
            }
            const uint32_t s2 = ks[((int64_t)g * P + t0 + 8 * nt + 2 * tid) >> 1];
            s0 += c4[0] * h_lo(s2);
            s1 += c4[1] * h_hi(s2);
          }
        }
        sc[nt][0] = s0;
        sc[nt][1] = s1;
      }

      // ---- online softmax (query vector gID; tokens a=2tid, b=2tid+1, c=8+2tid, d=9+2tid)
      float pr[4];
      float mt_ = -INFINITY;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int o = 8 * (k >> 1) + 2 * tid + (k & 1);
        const bool ok = o < nvalid && o <= nvis;
        const float x = apply_softcap(sc[k >> 1][k & 1] * fac2, p.softcap) * post;
        pr[k] = ok ? x : -INFINITY;
        mt_ = fmaxf(mt_, pr[k]);
      }
      mt_ = fmaxf(mt_, __shfl_xor_sync(0xffffffffu, mt_, 1));
      mt_ = fmaxf(mt_, __shfl_xor_sync(0xffffffffu, mt_, 2));
      const float m_new = fmaxf(m_run, mt_);
      float corr = 1.0f;
      if (m_new == -INFINITY) {
#pragma unroll
        for (int k = 0; k < 4; ++k) pr[k] = 0.0f;
      } else {
        corr = exp2f(m_run - m_new);
#pragma unroll
        for (int k = 0; k < 4; ++k) pr[k] = exp2f(pr[k] - m_new);
      }
      l_run = l_run * corr + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
      m_run = m_new;
      if (__any_sync(0xffffffffu, corr != 1.0f)) {  // the running max moved for some query vector
        const float corrA = __shfl_sync(0xffffffffu, corr, 8 * tid), corrB = __shfl_sync(0xffffffffu, corr, 8 * tid + 4);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[g][mt][k] *= (k & 1) ? corrB : corrA;
      }

      // ---- O^T += V^T P^T; this thread: coordinates i0v + {0,16,1,17} of each group, tokens a,b,c,d
      const bool va = 2 * tid < nvalid, vbb = 2 * tid + 1 < nvalid, vc = 2 * tid + 8 < nvalid,
                 vd = 2 * tid + 9 < nvalid;
      const uint32_t* vw = (const uint32_t*)vsec;
      const uint32_t* vs = (const uint32_t*)(vsec + vscales_off);
      const int i0v = 2 * gID, fwv = gID >> 2;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const uint32_t sab = vs[((int64_t)g * P + t0 + 2 * tid) >> 1], scd = vs[((int64_t)g * P + t0 + 2 * tid + 8) >> 1];
        const float fa = va ? h_lo(sab) : 0.0f, fb = vbb ? h_hi(sab) : 0.0f;
        const float fc = vc ? h_lo(scd) : 0.0f, fd = vd ? h_hi(scd) : 0.0f;
        // P x token scale as the fp16 B operand: p <= 1 and |scale| <= 65504, so it cannot overflow
        const uint32_t pb0 = pack_half2(pr[0] * fa, pr[1] * fb);
        const uint32_t pb1 = pack_half2(pr[2] * fc, pr[3] * fd);
        const int64_t wi = (int64_t)(g * VB + (VB == 2 ? 0 : fwv)) * P + t0 + 2 * tid;
        const int64_t si = (int64_t)(g * VB + VB - 1) * P + t0 + 2 * tid;
        const uint2 fab = *(const uint2*)(vw + wi), fcd = *(const uint2*)(vw + wi + 8);
        const uint2 gab = *(const uint2*)(vw + si), gcd = *(const uint2*)(vw + si + 8);
        uint2 pab = make_uint2(0u, 0u), pcd = make_uint2(0u, 0u);
        if (VB == 4) {
          const int64_t pi = (int64_t)(g * VB + 2) * P + t0 + 2 * tid;
          pab = *(const uint2*)(vw + pi);
          pcd = *(const uint2*)(vw + pi + 8);
        }
        const uint32_t xa = make_x<VB>(fab.x, pab.x, i0v), xb = make_x<VB>(fab.y, pab.y, i0v);
        const uint32_t xc = make_x<VB>(fcd.x, pcd.x, i0v), xd = make_x<VB>(fcd.y, pcd.y, i0v);
        const uint32_t ua = gab.x >> i0v, ub = gab.y >> i0v, uc = gcd.x >> i0v, ud = gcd.y >> i0v;
        const uint32_t wlo_ab = prmt(ua, ub, 0x5410u), whi_ab = prmt(ua, ub, 0x7632u);
        const uint32_t wlo_cd = prmt(uc, ud, 0x5410u), whi_cd = prmt(uc, ud, 0x7632u);
        const uint32_t aA0 = lookup<VB>(prmt(xa, xb, 0x40u), TV) ^ ((wlo_ab << 15) & kSignMask);
        const uint32_t aA1 = lookup<VB>(prmt(xa, xb, 0x51u), TV) ^ ((whi_ab << 15) & kSignMask);
        const uint32_t aA2 = lookup<VB>(prmt(xc, xd, 0x40u), TV) ^ ((wlo_cd << 15) & kSignMask);
        const uint32_t aA3 = lookup<VB>(prmt(xc, xd, 0x51u), TV) ^ ((whi_cd << 15) & kSignMask);
        const uint32_t aB0 = lookup<VB>(prmt(xa, xb, 0x62u), TV) ^ ((wlo_ab << 14) & kSignMask);
        const uint32_t aB1 = lookup<VB>(prmt(xa, xb, 0x73u), TV) ^ ((whi_ab << 14) & kSignMask);
        const uint32_t aB2 = lookup<VB>(prmt(xc, xd, 0x62u), TV) ^ ((wlo_cd << 14) & kSignMask);
        const uint32_t aB3 = lookup<VB>(prmt(xc, xd, 0x73u), TV) ^ ((whi_cd << 14) & kSignMask);
        mma16816(acc[g][0], aA0, aA1, aA2, aA3, pb0, pb1);
        mma16816(acc[g][1], aB0, aB1, aB2, aB3, pb0, pb1);
      }
    }

    // ---- combine the 4 warps, write this split's partial
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if (tid == 0) {
      sm_m[warp][gID] = m_run * 0.69314718055994531f;  // back to natural-log units
      sm_l[warp][gID] = l_run;
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
}

AttnFn attn_kernel_k2(int d, int vb);
AttnFn attn_kernel_k3(int d, int vb);
AttnFn attn_kernel_k4(int d, int vb);
AttnFn attn_kernel_k16(int d, int vb);

#define FMKV_ATTN_DISPATCH(KB)                                     \
  AttnFn attn_kernel_k##KB(int d, int vb) {                        \
    switch (d * 10 + vb) {                                         \
      case 642: return attn_kernel<64, KB, 2>;                     \
      case 643: return attn_kernel<64, KB, 3>;                     \
      case 644: return attn_kernel<64, KB, 4>;                     \
      case 1282: return attn_kernel<128, KB, 2>;                   \
      case 1283: return attn_kernel<128, KB, 3>;                   \
      case 1284: return attn_kernel<128, KB, 4>;                   \
      case 2562: return attn_kernel<256, KB, 2>;                   \
      case 2563: return attn_kernel<256, KB, 3>;                   \
      case 2564: return attn_kernel<256, KB, 4>;                   \
    }                                                              \
    return nullptr;                                                \
  }

}  // namespace cuda
}  // namespace fmkv
