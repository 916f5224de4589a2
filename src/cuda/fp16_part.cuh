#pragma once
#include "attn_params.cuh"

namespace fmkv {
namespace cuda {

// ---- fp16 part: sink + window tokens (fp16, unrotated), attended in fp32 by a sink/window CTA of
// (sequence, kv head). Token list: sink [0, min(S, tend)) at region slots 0.., ring [E, tend) at slots
// S + (p - S) mod W. An attention call's CTA takes every such token (tend = len, E = ce(len)); a fused
// step's second sink/window CTA takes the tokens the step does not write (tend = len0, E = ce(len0 + n)),
// in parallel with the step's own CTA, so the step's critical path holds only its own tokens (fresh_part).
// Per batch of kQV query vectors (q in shared memory) and chunk of kFp16Chunk tokens:
//   0. the chunk's V rows are copied to shared memory (cp.async, 2 threads per token) while
//   1. scores: threads 2t, 2t+1 take the two halves of token t's K row (16-byte loads, all in flight
//      together) against all kQV vectors, the halves summed by one shuffle;
//   2. online softmax: warp w keeps the running max / sum of vectors 2w, 2w+1;
//   (a batch with at most kQV / 2 live vectors -- a decode step of 4 q heads per kv head -- skips the
//   others in 1-3);
//   3. O = O x corr + P V: warp w owns coordinates [w D/4, (w+1) D/4) (lane: 1 (D=128), 2 (D=256) or,
//      for D=64, 1 coordinate of every other token), over every token of the chunk (V from shared memory).
// The partial goes to slot `part` of the query vector's partials (raw domain, like every partial: the
// merge adds them with their weights). Shared memory (dynamic, Fp16Geom): q [kQV][D] floats, P [chunk][kQV] floats,
// V [chunk][D] fp16, after the fused step's dk, dv [16][D] floats (unused here).
constexpr int kFp16Chunk = 64;

// Element i of a shared-memory copy of a tensor of dtype fp16, bf16 or f32, as float.
__device__ __forceinline__ float staged_elem(const uint8_t* base, int32_t dtype, int64_t i) {
  if (dtype == FMKV_F32) return reinterpret_cast<const float*>(base)[i];
  return half_bits_to_f32(reinterpret_cast<const uint16_t*>(base)[i], dtype == FMKV_F16);
}
// The same element rounded to fp16 bits (as load_f16_bits_n rounds a global one).
__device__ __forceinline__ uint16_t staged_f16_bits(const uint8_t* base, int32_t dtype, int64_t i) {
  return dtype == FMKV_F16 ? reinterpret_cast<const uint16_t*>(base)[i] : f32_to_f16(staged_elem(base, dtype, i));
}
template <int D>
struct Fp16Geom {
  static constexpr int fresh_bytes = 2 * kFusedMaxRows * D * 4;
  static constexpr int q_off = fresh_bytes, p_off = q_off + kQV * D * 4, v_off = p_off + kFp16Chunk * kQV * 4;
  static constexpr int bytes = v_off + kFp16Chunk * D * 2;
};
static_assert(2 * kFp16Chunk == 128, "two threads per token of a chunk");

// qpos0: the position of the first query row (row r sees positions <= qpos0 + r).
template <int D>
__device__ void fp16_part(const AttnParams& p, int s, int h, int64_t qpos0, int64_t r0, int64_t n, int64_t E,
                          int64_t tend, int part, uint8_t* smem) {
  using FG = Fp16Geom<D>;
  constexpr int CW = D / kAttnWarps;                    // coordinates per warp in P V
  constexpr int CPL = CW >= 32 ? CW / 32 : 1;           // ... per lane
  constexpr int TPH = CW >= 32 ? 1 : 32 / CW;           // token phases per warp (D = 64: 2)
  constexpr int HALF = D / 2;
  const int tidx = threadIdx.x, warp = tidx >> 5, lane = tidx & 31;
  float(*qs)[D] = reinterpret_cast<float(*)[D]>(smem + FG::q_off);
  float(*ps)[kQV] = reinterpret_cast<float(*)[kQV]>(smem + FG::p_off);
  uint16_t(*vs)[D] = reinterpret_cast<uint16_t(*)[D]>(smem + FG::v_off);
  __shared__ float s_corr[kQV], s_m[kQV], s_l[kQV];
  __shared__ int64_t s_pos[kQV], s_qoff[kQV], s_part[kQV];
  const int64_t nqv = n * p.gq;
  const int32_t slot = p.slots ? p.slots[s] : 0;
  const int64_t Ts = tend < p.S ? tend : p.S, Tr = tend > E ? tend - E : 0;
  const int64_t T = Ts + Tr;
  const int32_t ring0 = p.W > 0 ? (int32_t)((E - p.S) % p.W) : 0;  // ring slot offset of position E
  const int64_t reg = fmkv_fp16_offset(p.H, p.R, D, slot, h, 0);
  const uint16_t* kreg = p.fp16_k + (p.R > 0 ? reg : 0);
  const uint16_t* vreg = p.fp16_v + (p.R > 0 ? reg : 0);
  // token ti of the list -> its position and its region row
  auto token = [&](int64_t ti, int64_t& pos) -> int64_t {
    if (ti < Ts) {
      pos = ti;
      return ti;
    }
    const int32_t k = (int32_t)(ti - Ts);
    int32_t fs = ring0 + k;
    if (fs >= p.W) fs -= p.W;
    pos = E + k;
    return p.S + fs;
  };
  const int cbase = warp * CW + (CW >= 32 ? CPL * lane : (lane % CW)), tphase = CW >= 32 ? 0 : lane / CW;
  const int tt = tidx >> 1, hf = tidx & 1;  // phases 0/1: token tt of the chunk, half hf of its row

  for (int64_t vb = 0; vb < nqv; vb += kQV) {
    if (tidx < kQV) {
      const int64_t v = vb + tidx;
      int64_t vr;
      int vh;
      split_vector(v, p.gq, vr, vh);
      const int64_t row = r0 + vr;
      const int hq = h * p.gq + vh;
      s_pos[tidx] = v < nqv ? qpos0 + vr : -1;
      s_qoff[tidx] = v < nqv ? row * p.q_rs + hq * p.q_hs : -1;
      s_part[tidx] = v < nqv ? partial_row_base(p, row, hq) + part : -1;
    }
    __syncthreads();
    {  // all kQV x D / 128 loads of a thread in flight together (blockDim.x == 128)
      constexpr int QE = kQV * D / 128;
      float x[QE];
      int64_t off[QE];
#pragma unroll
      for (int k = 0; k < QE; ++k) {
        const int e = tidx + 128 * k, i = e / D, c = e % D;
        off[k] = s_qoff[i] >= 0 ? s_qoff[i] + c : -1;
      }
      load_elems<QE>(p.q, p.q_dtype, off, x);
#pragma unroll
      for (int k = 0; k < QE; ++k) {
        const int e = tidx + 128 * k;
        qs[e / D][e % D] = x[k];
      }
    }
    __syncthreads();
    const bool hi = nqv - vb > kQV / 2;  // vectors kQV/2 .. kQV - 1 of the batch are live (CTA-uniform)
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    float acc[kQV][CPL];
#pragma unroll
    for (int i = 0; i < kQV; ++i)
#pragma unroll
      for (int c = 0; c < CPL; ++c) acc[i][c] = 0.0f;

    for (int64_t c0 = 0; c0 < T; c0 += kFp16Chunk) {
      const int cnt = T - c0 < kFp16Chunk ? (int)(T - c0) : kFp16Chunk;
      // 0 + 1. V half-row to shared memory (in flight during the scores), scores (log2 units; -inf masked)
      {
        float sc[kQV];
#pragma unroll
        for (int i = 0; i < kQV; ++i) sc[i] = -INFINITY;
        int64_t pos = 0;
        const int64_t rr = tt < cnt ? token(c0 + tt, pos) : -1;
        if (tt < cnt) {
#pragma unroll
          for (int c = 0; c < HALF; c += 8) cp_async16(&vs[tt][hf * HALF + c], vreg + rr * D + hf * HALF + c);
        }
        cp_async_commit();
        float dot[kQV];
#pragma unroll
        for (int i = 0; i < kQV; ++i) dot[i] = 0.0f;
        if (tt < cnt) {
          // the half row's 16-byte K loads all in flight together (one round trip; D = 256: two)
          constexpr int KL = HALF / 8 <= 8 ? HALF / 8 : 8;
          uint4 kw[KL];
#pragma unroll
          for (int u = 0; u < KL; ++u) kw[u] = *reinterpret_cast<const uint4*>(kreg + rr * D + hf * HALF + 8 * u);
#pragma unroll
          for (int c = hf * HALF; c < (hf + 1) * HALF; c += 8) {
            const int u = (c - hf * HALF) / 8;
            if (u >= KL && u % KL == 0) {  // D = 256: the second half of the half row
#pragma unroll
              for (int x = 0; x < KL; ++x) kw[x] = *reinterpret_cast<const uint4*>(kreg + rr * D + c + 8 * x);
            }
            const uint4 w = kw[u % KL];
            const float2 a = h2_to_f2(w.x), b = h2_to_f2(w.y), cc = h2_to_f2(w.z), d = h2_to_f2(w.w);
            const float kx[8] = {a.x, a.y, b.x, b.y, cc.x, cc.y, d.x, d.y};
#pragma unroll
            for (int i = 0; i < kQV; ++i) {
              if (i == kQV / 2 && !hi) break;  // vectors kQV/2.. unused (a decode step of 4 q heads per kv head)
              const float4 qa = *reinterpret_cast<const float4*>(&qs[i][c]);
              const float4 qb = *reinterpret_cast<const float4*>(&qs[i][c + 4]);
              dot[i] += qa.x * kx[0] + qa.y * kx[1] + qa.z * kx[2] + qa.w * kx[3] + qb.x * kx[4] + qb.y * kx[5] +
                        qb.z * kx[6] + qb.w * kx[7];
            }
          }
        }
#pragma unroll
        for (int i = 0; i < kQV; ++i) dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], 1);
        if (tt < cnt) {
#pragma unroll
          for (int i = 0; i < kQV; ++i)
            if (pos <= s_pos[i]) sc[i] = apply_softcap(dot[i] * p.sm_scale, p.softcap) * kLog2e;
        }
        if (hf == 0) {
          *reinterpret_cast<float4*>(&ps[tt][0]) = make_float4(sc[0], sc[1], sc[2], sc[3]);
          *reinterpret_cast<float4*>(&ps[tt][4]) = make_float4(sc[4], sc[5], sc[6], sc[7]);
        }
      }
      __syncthreads();
      // 2. online softmax of vectors 2 warp + j over the chunk
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int i = 2 * warp + j;
        if (i >= kQV / 2 && !hi) break;  // (warp-uniform)
        float x[kFp16Chunk / 32], cm = -INFINITY;
#pragma unroll
        for (int k = 0; k < kFp16Chunk / 32; ++k) {
          x[k] = ps[lane + 32 * k][i];
          cm = fmaxf(cm, x[k]);
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
        const float m_new = fmaxf(m_run[j], cm);
        const float corr = m_new == -INFINITY ? 1.0f : fast_exp2(m_run[j] - m_new);
        const float ms = m_new == -INFINITY ? 0.0f : m_new;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < kFp16Chunk / 32; ++k) {
          x[k] = fast_exp2(x[k] - ms);
          ps[lane + 32 * k][i] = x[k];
          sum += x[k];
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        l_run[j] = l_run[j] * corr + sum;
        m_run[j] = m_new;
        if (lane == 0) s_corr[i] = corr;
      }
      cp_async_wait<0>();  // this thread's V copies ...
      __syncthreads();     // ... and everyone's, and P, corr
      // 3. O = O x corr + P V over the chunk (this lane's coordinates)
#pragma unroll
      for (int i = 0; i < kQV; ++i) {
        const float cr = i < kQV / 2 || hi ? s_corr[i] : 1.0f;
#pragma unroll
        for (int c = 0; c < CPL; ++c) acc[i][c] *= cr;
      }
#pragma unroll 4
      for (int t = tphase; t < cnt; t += TPH) {
        float vx[CPL];
        if (CPL == 1) {
          vx[0] = f16_to_f32(vs[t][cbase]);
        } else {
#pragma unroll
          for (int c = 0; c < CPL; c += 2) {
            const float2 f = h2_to_f2(*reinterpret_cast<const uint32_t*>(&vs[t][cbase + c]));
            vx[c] = f.x;
            vx[c + 1] = f.y;
          }
        }
        auto add_pv = [&](int i0) {  // vectors i0 .. i0 + 3 (P of token t from one 16-byte load)
          const float4 pw = *reinterpret_cast<const float4*>(&ps[t][i0]);
#pragma unroll
          for (int c = 0; c < CPL; ++c) {
            acc[i0][c] += pw.x * vx[c];
            acc[i0 + 1][c] += pw.y * vx[c];
            acc[i0 + 2][c] += pw.z * vx[c];
            acc[i0 + 3][c] += pw.w * vx[c];
          }
        };
        add_pv(0);
        if (hi) add_pv(4);
      }
      __syncthreads();  // ps and vs are rewritten by the next chunk
    }
    if (TPH > 1) {
#pragma unroll
      for (int i = 0; i < kQV; ++i)
#pragma unroll
        for (int c = 0; c < CPL; ++c)
#pragma unroll
          for (int o = 16; o >= 32 / TPH; o >>= 1) acc[i][c] += __shfl_xor_sync(0xffffffffu, acc[i][c], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s_m[2 * warp + j] = m_run[j] * 0.69314718055994531f;  // back to natural-log units
        s_l[2 * warp + j] = l_run[j];
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kQV; ++i) {
      const int64_t idx = s_part[i];
      if (idx < 0) continue;
      if (tphase == 0)
#pragma unroll
        for (int c = 0; c < CPL; ++c) p.part_acc[idx * D + cbase + c] = acc[i][c];
      if (tidx == 0) p.part_ml[idx] = make_float2(s_m[i], s_l[i]);
    }
    __syncthreads();  // s_* and qs are rewritten by the next batch
  }
}

// The step's rows that stay fp16 (land in the sink or the window) as the fused step's attention part
// reads them: K (isv = 0) or V row j of the call, this thread's CP coordinates from c0, rounded to fp16
// as the region stores them. From the validation's copy when it is whole (stage_k / stage_v: [rows][H][D]
// elements of the tensor's dtype), else from the tensor.
template <int CP>
__device__ __forceinline__ void new_row_part(const AttnParams& p, int h, int64_t r0, int64_t j, int isv, int c0,
                                             const uint8_t* stage, float (&x)[CP]) {
  const int32_t dt = isv ? p.v_dtype : p.k_dtype;
  uint16_t b[CP];
  if (stage != nullptr) {
    const int64_t e = (j * p.H + h) * (int64_t)(CP * 16) + c0;
#pragma unroll
    for (int c = 0; c < CP; ++c) b[c] = staged_f16_bits(stage, dt, e + c);
  } else {
    const int64_t base = (r0 + j) * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs) + c0;
    int64_t off[CP];
#pragma unroll
    for (int c = 0; c < CP; ++c) off[c] = base + c;
    load_f16_bits_n<CP>(isv ? p.v : p.k, dt, off, b);
  }
#pragma unroll
  for (int c = 0; c < CP; ++c) x[c] = f16_to_f32(b[c]);
}

// The fused step's attention part: the sequence's query vectors attend the tokens this step wrote --
// the ones it compressed, [e0, e1) (at most kFusedMaxRows: the dequantized rows dk / dv in shared
// memory), and its new rows that stay fp16: rows [0, a) (in the sink) and [b, n) (in the window) of the
// call, positions len0 + j -- with no barrier. (The tokens before the step that stay fp16 are the second
// sink/window CTA's, fp16_part.) Thread mapping: a batch of 8 query vectors, 16 threads per vector
// (vector tid / 16); thread j = tid % 16 owns coordinates [j D/16, (j + 1) D/16). A score is the
// threads' partial dot products summed by 4 xor-shuffles (offsets < 16 stay within the vector's
// threads); the online softmax and P V stay in registers. q comes from qstage ([rows][HQ][D] elements
// of q's dtype, the validation's copy) when given, new rows from stage_k / stage_v likewise.
template <int D>
__device__ void fresh_part(const AttnParams& p, int h, int64_t len0, int64_t r0, int64_t n, const uint8_t* smem,
                           int64_t e0, int64_t e1, int64_t a, int64_t b, const uint8_t* qstage, const uint8_t* stage_k,
                           const uint8_t* stage_v) {
  constexpr int CP = D / 16;
  const int tidx = threadIdx.x, vi = tidx >> 4, j = tidx & 15;
  const float* dk = reinterpret_cast<const float*>(smem) + j * CP;
  const float* dv = dk + kFusedMaxRows * D;
  const int tn = (int)(e1 - e0), nr = (int)(a + n - b);  // compressed rows, new fp16 rows
  const int64_t nqv = n * p.gq;
  for (int64_t vb = 0; vb < nqv; vb += 8) {
    const int64_t v = vb + vi;
    const bool live = v < nqv;
    int64_t vr;
    int vh;
    split_vector(live ? v : 0, p.gq, vr, vh);
    const int hq = h * p.gq + vh;
    const int64_t qpos = len0 + vr;  // the vector's position: it sees tokens at positions <= qpos
    float q[CP];
    if (qstage != nullptr) {
      const int64_t o = (vr * p.HQ + hq) * D + j * CP;
#pragma unroll
      for (int c = 0; c < CP; ++c) q[c] = staged_elem(qstage, p.q_dtype, o + c);
    } else {
      int64_t off[CP];
#pragma unroll
      for (int c = 0; c < CP; ++c) off[c] = (r0 + vr) * p.q_rs + hq * p.q_hs + j * CP + c;
      load_elems<CP>(p.q, p.q_dtype, off, q);
    }
    float m = -INFINITY, l = 0.0f, acc[CP];
#pragma unroll
    for (int c = 0; c < CP; ++c) acc[c] = 0.0f;
    // token t: compressed row t (t < tn), else new row a' = t - tn of the fp16 rows [0, a) + [b, n)
    for (int t = 0; t < tn + nr; ++t) {
      float kx[CP], vx[CP];
      int64_t pos;
      if (t < tn) {
        pos = e0 + t;
#pragma unroll
        for (int c = 0; c < CP; c += 4) {
          const float4 k4 = *reinterpret_cast<const float4*>(dk + t * D + c);
          const float4 v4 = *reinterpret_cast<const float4*>(dv + t * D + c);
          kx[c] = k4.x; kx[c + 1] = k4.y; kx[c + 2] = k4.z; kx[c + 3] = k4.w;
          vx[c] = v4.x; vx[c + 1] = v4.y; vx[c + 2] = v4.z; vx[c + 3] = v4.w;
        }
      } else {
        const int64_t rj = t - tn < a ? t - tn : b + (t - tn - a);
        pos = len0 + rj;
        new_row_part<CP>(p, h, r0, rj, 0, j * CP, stage_k, kx);
        new_row_part<CP>(p, h, r0, rj, 1, j * CP, stage_v, vx);
      }
      float dot = 0.0f;
#pragma unroll
      for (int c = 0; c < CP; ++c) dot += q[c] * kx[c];
#pragma unroll
      for (int o = 8; o >= 1; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (pos > qpos) continue;  // causal mask (uniform over the vector's 16 threads)
      const float sc = apply_softcap(dot * p.sm_scale, p.softcap) * kLog2e;
      const float m_new = fmaxf(m, sc), corr = fast_exp2(m - m_new), w = fast_exp2(sc - m_new);
      l = l * corr + w;
#pragma unroll
      for (int c = 0; c < CP; ++c) acc[c] = acc[c] * corr + w * vx[c];
      m = m_new;
    }
    if (live) {
      const int64_t idx = partial_row_base(p, r0 + vr, hq) + raw_slot(p, 0);  // the fused step's CTA is z = 0
#pragma unroll
      for (int c = 0; c < CP; c += 4)
        *reinterpret_cast<float4*>(p.part_acc + idx * D + j * CP + c) = make_float4(acc[c], acc[c + 1], acc[c + 2], acc[c + 3]);
      if (j == 0) p.part_ml[idx] = make_float2(m * 0.69314718055994531f, l);  // natural-log units
    }
  }
}

}  // namespace cuda
}  // namespace fmkv
