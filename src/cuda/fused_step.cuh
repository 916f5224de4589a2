#pragma once
#include "fp16_part.cuh"

namespace fmkv {
namespace cuda {

// Element bits -> "not finite": fp16_range also rejects values beyond fp16 (the quantizer's canonical
// input is fp16, FORMAT.md), as the append's validation does.
__device__ __forceinline__ bool elem_bad(uint32_t bits, int32_t dtype, bool fp16_range) {
  if (dtype == FMKV_F16) return !f16_is_finite((uint16_t)bits);
  const float f = dtype == FMKV_F32 ? __uint_as_float(bits) : bf16_to_f32((uint16_t)bits);
  if (!fp16_range) return !isfinite(f);
  return !f16_is_finite(f32_to_f16(f));
}

// The fused step's k, v and q rows [r0, r0 + n) x heads x D ([rows][heads][D] tensors) checked for
// bad elements (kind kNonFinite, reported with the row, head and element). A 16-byte-aligned tensor is
// read in 16-byte chunks, and the three tensors together: every thread has up to 2 chunks of each in
// flight per round (a decode step with 32 q heads, d = 128: 512 q chunks, 2 rounds; more chunks in
// flight spill registers of the tile loop, which shares this kernel); a tensor that is not aligned is
// read element by element. n <= 16 rows (fused step), so chunk indices fit 32 bits.
struct RowsToCheck {
  const void* base;
  int32_t dtype;
  int64_t rs, hs;
  int heads;
  bool fp16_range;
  int kind, which;
};
__device__ inline bool rows_any_bad3(const RowsToCheck (&t)[3], int64_t r0, int64_t n, int D, long long* err) {
  constexpr int U = 2;  // chunks of each tensor per thread and round (4: tile-loop spills)
  bool aligned[3];
  uint32_t per[3], hp[3], total[3], maxtotal = 0;  // chunks per head row, per row, in all (aligned only)
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    const int es = t[j].dtype == FMKV_F32 ? 4 : 2;
    aligned[j] = reinterpret_cast<uintptr_t>(t[j].base) % 16 == 0 && (t[j].rs * es) % 16 == 0 &&
                 (t[j].hs * es) % 16 == 0;
    per[j] = (uint32_t)(D * es / 16);
    hp[j] = (uint32_t)t[j].heads * per[j];
    total[j] = aligned[j] ? (uint32_t)n * hp[j] : 0u;
    maxtotal = total[j] > maxtotal ? total[j] : maxtotal;
  }
  bool bad = false;
  for (uint32_t c0 = threadIdx.x; c0 < maxtotal; c0 += U * blockDim.x) {
    uint4 x[3][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t c = c0 + u * blockDim.x;
#pragma unroll
      for (int j = 0; j < 3; ++j)
        if (c < total[j]) {
          const int es = t[j].dtype == FMKV_F32 ? 4 : 2;
          const uint32_t r = c / hp[j], hh = (c % hp[j]) / per[j], part = c % per[j];
          x[j][u] = *reinterpret_cast<const uint4*>(static_cast<const char*>(t[j].base) +
                                                    ((r0 + r) * t[j].rs + hh * t[j].hs) * es + part * 16);
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t c = c0 + u * blockDim.x;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (c >= total[j]) continue;
        const int es = t[j].dtype == FMKV_F32 ? 4 : 2, vec = 16 / es;
        const uint32_t w[4] = {x[j][u].x, x[j][u].y, x[j][u].z, x[j][u].w};
        for (int k = 0; k < vec; ++k) {
          const uint32_t b = es == 4 ? w[k] : (w[k >> 1] >> (16 * (k & 1))) & 0xffffu;
          if (elem_bad(b, t[j].dtype, t[j].fp16_range)) {
            const uint32_t r = c / hp[j], hh = (c % hp[j]) / per[j], part = c % per[j];
            report_error(err, kNonFinite, t[j].kind, t[j].which, r0 + r, hh, part * vec + k);
            bad = true;
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    if (aligned[j]) continue;
    const uint32_t all = (uint32_t)n * (uint32_t)t[j].heads * (uint32_t)D;
    for (uint32_t e = threadIdx.x; e < all; e += blockDim.x) {
      const uint32_t r = e / ((uint32_t)t[j].heads * D), hh = (e / D) % t[j].heads, i = e % D;
      const int64_t off = (r0 + r) * t[j].rs + hh * t[j].hs + i;
      const uint32_t b = t[j].dtype == FMKV_F32 ? __float_as_uint(static_cast<const float*>(t[j].base)[off])
                                                : static_cast<const uint16_t*>(t[j].base)[off];
      if (elem_bad(b, t[j].dtype, t[j].fp16_range)) {
        report_error(err, kNonFinite, t[j].kind, t[j].which, r0 + r, hh, i);
        bad = true;
      }
    }
  }
  return bad;
}

// One head vector (x[r] = fp16 bits of coordinate lane + 32 r) written to token slot t of a page section
// (bit-exact with the append), and its dequantized value in the raw domain to dst[0, D) (one warp).
template <int D, int B, int P>
__device__ __forceinline__ void compress_vector(const uint16_t (&x)[D / 32], uint8_t* sec, int32_t t, const SignWords& sw,
                                                int rule, int lane, float* dst) {
  constexpr int NR = D / 32;
  float v[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) v[i] = f16_to_f32(x[i]);
  if constexpr (B == FMKV_FP16_BITS) {
    uint16_t* raw = (uint16_t*)sec + (int64_t)t * D;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      raw[lane + 32 * i] = x[i];
      dst[lane + 32 * i] = v[i];
    }
  } else {
    warp_rotate<D>(v, sw, lane);
    uint32_t* words = (uint32_t*)sec;
    uint16_t* scales = (uint16_t*)(sec + fmkv_scales_offset(D, B, P));
    // group g = register g: coordinate lane of the group
    warp_quantize_groups<NR, B>(v, rule, lane, words + fmkv_code_word_index(B, P, 0, 0, t), P, scales + t);
    warp_unrotate<D>(v, sw, lane);
#pragma unroll
    for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = v[i];
  }
}

// Fused decode step, sink/window CTA of (sequence s, kv head h), 4 warps:
//   1. validate every input of the sequence (rows, block table up to the new end, k/v/q finite):
//      all CTAs of the sequence take the same decision, so a bad sequence is left untouched;
//   2. compress the tokens [E0, E1) that leave the window (read from the ring) or arrive compressed
//      (new rows): one warp per head vector, the quantizer of append.cu (bit-exact); the warp keeps
//      the dequantized values and un-rotates them (shuffles) into shared memory;
//   3. write the new rows that land in the sink or the ring (after 2 read the ring);
//   4. attention of the sequence's query vectors of head h over sink + [E0, E1) + ring (fp16_part).
// The split CTAs meanwhile attend [S, E0), which this step does not write.
template <int D, int P, int KB, int VB>
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
  {
  if (n > kFusedMaxRows) {
    bad = 1;
    if (tidx == 0) report_error(p.err, kInvalidArgument, kErrFusedRows, s, n, kFusedMaxRows, 0);
  }
  if (!bad) {
    // every block-table entry up to the new end, 8 loads in flight per thread and round; the first
    // round's loads are issued before the k/v/q checks, so the two overlap
    constexpr int UB = 8;
    const int64_t np = E1 > p.S ? (int64_t)((uint64_t)(E1 - 1 - p.S) / P) + 1 : 0;
    auto table_round = [&](int64_t q0, int32_t(&pg)[UB]) {
#pragma unroll
      for (int u = 0; u < UB; ++u) pg[u] = q0 + u * blockDim.x < np ? btrow[q0 + u * blockDim.x] : 0;
    };
    auto table_check = [&](int64_t q0, const int32_t(&pg)[UB]) {
#pragma unroll
      for (int u = 0; u < UB; ++u)
        if (pg[u] < 0 || pg[u] >= p.num_pages) {
          bad = 1;
          report_error(p.err, kOutOfRange, kErrBlockTable, s, q0 + u * blockDim.x, pg[u], p.num_pages);
        }
    };
    int32_t pg[UB];
    table_round(tidx, pg);
    const RowsToCheck rows[3] = {{p.k, p.k_dtype, p.k_rs, p.k_hs, p.H, true, kErrNonFiniteKV, 0},
                                 {p.v, p.v_dtype, p.v_rs, p.v_hs, p.H, true, kErrNonFiniteKV, 1},
                                 {p.q, p.q_dtype, p.q_rs, p.q_hs, p.HQ, false, kErrNonFiniteQ, 0}};
    bad |= rows_any_bad3(rows, r0, n, D, p.err);
    table_check(tidx, pg);
    for (int64_t q0 = tidx + UB * (int64_t)blockDim.x; q0 < np; q0 += UB * (int64_t)blockDim.x) {
      table_round(q0, pg);
      table_check(q0, pg);
    }
  }
  }
  if (__syncthreads_or(bad)) return;
  FMKV_TRACE(p, 0, 3);

  // 2. compress [E0, E1) of head h; the warp keeps the dequantized values, un-rotates them and leaves
  //    them in shared memory (dk / dv rows) for step 4
  float* dk = reinterpret_cast<float*>(smem);
  float* dv = dk + kFusedMaxRows * D;
  const int64_t ncomp = E1 - E0;
  for (int64_t vj = warp; vj < 2 * ncomp; vj += kAttnWarps) {
    const int isv = (int)(vj & 1);
    const int64_t j = vj >> 1, q = E0 + j;
    const uint64_t ci = (uint64_t)(q - p.S);
    const int32_t pg = btrow[ci / P];
    const int32_t t = (int32_t)(ci % P);
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
    uint8_t* sec = pages + (int64_t)pg * p.page_bytes + fmkv_section_offset(D, KB, VB, P, h, isv);
    float* dst = (isv ? dv : dk) + j * D;
    if (isv) compress_vector<D, VB, P>(x, sec, t, p.sw, p.rule, lane, dst);
    else compress_vector<D, KB, P>(x, sec, t, p.sw, p.rule, lane, dst);
  }
  __syncthreads();
  FMKV_TRACE(p, 0, 4);

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
  __syncthreads();  // ring rows and dk / dv complete
  FMKV_TRACE(p, 0, 5);

  // 4. attention over sink + [E0, E1) + ring
  fp16_part<D>(p, s, h, len, r0, n, E1, smem, E0, E1);
  FMKV_TRACE(p, 0, 6);
}

}  // namespace cuda
}  // namespace fmkv
