#pragma once
#include "fp16_part.cuh"
#include "tile_blocks.cuh"

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

// Conservative test of a 16-byte chunk of elements of type dtype: false only if no element is bad
// (elem_bad); a true answer is settled element by element. fp16 and bf16 / f32 without fp16_range:
// exponent all ones. With fp16_range, bf16: |x| >= 0x477f (65280; the next bf16 value, 65536,
// overflows fp16); f32: |x| >= 65504 (values from 65520 up round to Inf).
__device__ __forceinline__ bool chunk_maybe_bad(const uint4& x, int32_t dtype, bool fp16_range) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  bool any = false;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (dtype == FMKV_F32)
      any |= fp16_range ? (w[k] & 0x7fffffffu) >= 0x477fe000u : (w[k] & 0x7f800000u) == 0x7f800000u;
    else if (dtype == FMKV_BF16 && fp16_range)
      any |= __vcmpgeu2(w[k] & 0x7fff7fffu, 0x477f477fu) != 0u;
    else {
      const uint32_t m = dtype == FMKV_F16 ? 0x7c007c00u : 0x7f807f80u;
      any |= __vcmpeq2(w[k] & m, m) != 0u;
    }
  }
  return any;
}

// The fused step's k, v and q rows [r0, r0 + n) x heads x D ([rows][heads][D] tensors), checked for
// bad elements (kind kNonFinite, reported with the row, head and element) through shared memory.
// Chunk c (16 bytes) of the 16-byte-aligned tensors taken together (k's chunks, then v's, then q's) is
// copied by cp.async to stage + 16 (c mod cap) in rounds of cap chunks; validation thread vt of nv
// (the CTA's threads that take part: vt = threadIdx.x - first) copies, then checks, chunks vt, vt + nv,
// ... of a round, so a round is one round trip with all its copies in flight, no registers held while
// they are, and no barrier (a thread reads back only its own copies). A decode step (1 row, 8 kv / 32 q
// heads, d = 128, fp16: 768 chunks) is one round. A chunk's source address needs no division when the
// tensor's rows are dense ([rows][heads][D] contiguous; else one division by the head count). A tensor
// that is not 16-byte aligned (a strided view) is read element by element. n <= 16 rows, so chunk
// indices fit 32 bits.
struct RowsToCheck {
  const void* base;
  int32_t dtype;
  int64_t rs, hs;
  int heads;
  bool fp16_range;
  int kind, which;
};
struct StagedRowCheck {
  RowsToCheck t[3];  // indexed by compile-time j only (unrolled loops), so it stays in registers
  int64_t r0, n;
  int D;
  uint8_t* stage;
  uint32_t cap, per[3], hp[3], first[3], total[3], all;  // chunks: per head row, per row; tensor j's range
  uint32_t lgper[3];  // log2 per[j] (a power of two: D * element size / 16)
  bool aligned[3], dense[3];
  int vt, nv;  // this thread's index among the validation threads (< 0: not one), their count

  __device__ StagedRowCheck(const RowsToCheck (&rows)[3], int64_t r0_, int64_t n_, int D_, uint8_t* stage_,
                            int stage_bytes, int first_thread)
      : r0(r0_), n(n_), D(D_), stage(stage_), cap((uint32_t)stage_bytes / 16u), all(0),
        vt((int)threadIdx.x - first_thread), nv((int)blockDim.x - first_thread) {
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      t[j] = rows[j];
      const int es = t[j].dtype == FMKV_F32 ? 4 : 2;
      aligned[j] = reinterpret_cast<uintptr_t>(t[j].base) % 16 == 0 && (t[j].rs * es) % 16 == 0 &&
                   (t[j].hs * es) % 16 == 0;
      per[j] = (uint32_t)(D * es / 16);
      lgper[j] = 31u - (uint32_t)__clz(per[j]);
      dense[j] = t[j].hs == D && t[j].rs == (int64_t)t[j].heads * D;
      hp[j] = (uint32_t)t[j].heads * per[j];
      total[j] = aligned[j] ? (uint32_t)n * hp[j] : 0u;
      first[j] = all;
      all += total[j];
    }
  }
  __device__ uint32_t rounds() const { return (all + cap - 1) / cap; }
  // Calls f(j, c - first[j], c - c0) for this thread's chunks c of round `round` that belong to tensor j
  // (c = c0 + vt + k nv), tensor by tensor.
  template <class F>
  __device__ void for_own_chunks(uint32_t round, F&& f) const {
    if (vt < 0) return;
    const uint32_t c0 = round * cap, c1 = c0 + cap < all ? c0 + cap : all;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const uint32_t lo = first[j] > c0 ? first[j] : c0, e = first[j] + total[j], hi = e < c1 ? e : c1;
      uint32_t c = c0 + (uint32_t)vt;
      if (c < lo) c += (lo - c + nv - 1) / nv * nv;
      for (; c < hi; c += nv) f(j, c - first[j], c - c0);
    }
  }
  // cp.async of this thread's chunks of a round, one commit group
  __device__ void issue(uint32_t round) const {
    for_own_chunks(round, [&](int j, uint32_t lc, uint32_t si) {
      const int es = t[j].dtype == FMKV_F32 ? 4 : 2;
      const char* row0 = static_cast<const char*>(t[j].base) + r0 * t[j].rs * es;
      if (dense[j]) {
        cp_async16(stage + 16 * si, row0 + (int64_t)lc * 16);
      } else {
        const uint32_t rh = lc >> lgper[j], r = rh / (uint32_t)t[j].heads, hh = rh - r * (uint32_t)t[j].heads;
        cp_async16(stage + 16 * si, row0 + (r * t[j].rs + hh * t[j].hs) * es + (lc & (per[j] - 1u)) * 16);
      }
    });
    cp_async_commit();
  }
  // this thread's chunks of a round (after cp_async_wait): true if any element is bad (reported)
  __device__ bool check(uint32_t round, long long* err) const {
    bool bad = false;
    for_own_chunks(round, [&](int j, uint32_t lc, uint32_t si) {
      const uint4 x = *reinterpret_cast<const uint4*>(stage + 16 * si);
      if (!chunk_maybe_bad(x, t[j].dtype, t[j].fp16_range)) return;
      const uint32_t r = lc / hp[j], hh = (lc % hp[j]) / per[j], part = lc % per[j];
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
      if (t[j].dtype == FMKV_F32) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (elem_bad(w[k], FMKV_F32, t[j].fp16_range)) {
            report_error(err, kNonFinite, t[j].kind, t[j].which, r0 + r, hh, part * 4 + k);
            bad = true;
          }
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (elem_bad((w[k >> 1] >> (16 * (k & 1))) & 0xffffu, t[j].dtype, t[j].fp16_range)) {
            report_error(err, kNonFinite, t[j].kind, t[j].which, r0 + r, hh, part * 8 + k);
            bad = true;
          }
      }
    });
    return bad;
  }
  // the tensors that are not 16-byte aligned, element by element
  __device__ bool check_unaligned(long long* err) const {
    bool bad = false;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      if (aligned[j] || vt < 0) continue;
      const uint32_t els = (uint32_t)n * (uint32_t)t[j].heads * (uint32_t)D;
      for (uint32_t e = (uint32_t)vt; e < els; e += (uint32_t)nv) {
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
};

// One head vector (x[r] = fp16 bits of coordinate lane + 32 r) written to token slot t of a page section
// (bit-exact with the append), and its dequantized value in the raw domain to dst[0, D) (one warp).
// A vector with a NaN / Inf element writes nothing and returns false (every rotated value is then
// non-finite: each is a signed sum of all inputs; k16 rows are tested element by element). Format 3's
// tiled sections (kTiled<B, F3>; is_v: the section's side): the exact quantizer, the codes set bit by bit
// with atomics in the tile block (the step's other tokens of the tile may be written by other warps).
template <int D, int B, int P, bool F3>
__device__ __forceinline__ bool compress_vector(const uint16_t (&x)[D / 32], uint8_t* sec, int32_t t, const SignWords& sw,
                                                const QuantTables& q, int rule, int ss, int lane, float* dst, int is_v) {
  constexpr int NR = D / 32;
  float v[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) v[i] = f16_to_f32(x[i]);
  if constexpr (B == FMKV_FP16_BITS) {
    bool finite = true;
#pragma unroll
    for (int i = 0; i < NR; ++i) finite &= f16_is_finite(x[i]);
    if (!__all_sync(kFull, finite)) return false;
    uint16_t* raw = (uint16_t*)sec + (int64_t)t * D;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      raw[lane + 32 * i] = x[i];
      dst[lane + 32 * i] = v[i];
    }
  } else {
    warp_rotate<D>(v, sw, lane);
    if (!__all_sync(kFull, isfinite(v[0]))) return false;
    if constexpr (kTiled<B, F3>) {
      uint32_t code[NR];
      uint16_t sc[NR];
      warp_quantize_exact<NR>(v, q, rule, ss, code, sc);
      tile_put_codes_atomic<NR>(sec + fmkv_tile_block_offset(D, t), is_v, t & 15, code, lane);
      uint16_t* scales = (uint16_t*)(sec + fmkv_scales_offset(D, B, P)) + t;
#pragma unroll
      for (int g = 0; g < NR; ++g)
        if (lane == g && (g & ss) == 0) scales[(int64_t)(g >> ss) * P] = sc[g];
      warp_unrotate<D>(v, sw, lane);
#pragma unroll
      for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = v[i];
      return true;
    }
    uint32_t* words = (uint32_t*)sec;
    uint16_t* scales = (uint16_t*)(sec + fmkv_scales_offset(D, B, P));
    // group g = register g: coordinate lane of the group
    warp_quantize_groups<NR, B>(v, q, rule, ss, lane, words + fmkv_code_word_index(B, P, 0, 0, t), P, scales + t);
    warp_unrotate<D>(v, sw, lane);
#pragma unroll
    for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = v[i];
  }
  return true;
}

// Fused decode step, sink/window CTA of (sequence s, kv head h), 4 warps. Every load this CTA needs
// before it can decide is issued at once, so the decision costs about one round trip (each dependent
// round trip is long while the split CTAs stream pages):
//   1. validation, started: the block-table entries up to the new end (the first 1024 by cp.async
//      into shared memory; any beyond, in step 3 from registers) and the first round of 16-byte chunks
//      of the sequence's k, v and q rows (cp.async into shared memory, StagedRowCheck; the later rounds,
//      if any, in step 3; a decode step's rows are one round) are requested;
//   2. meanwhile, compress the tokens [E0, E1) that leave the window (read from the ring) or arrive
//      compressed (new rows): one warp per head vector, the warp-level quantizer (compress_vector;
//      bit-exact with the reference, as append.cu's thread-level one is); the warp keeps the
//      dequantized values and un-rotates them (shuffles) into shared memory. These
//      token slots lie at or past the compressed length before the step, which nothing reads, so
//      they are written before the decision (a vector whose page entry is out of range or whose
//      values are not finite is skipped: the validation reports it);
//   3. validation, completed: all CTAs of the sequence take the same decision; a bad sequence
//      returns here, its visible cache unchanged (FORMAT.md section 2);
//   4. write the new rows that land in the sink or the ring (after 2 read the ring);
//   5. attention of the sequence's query vectors of head h over the step's own tokens: [E0, E1) and the
//      new rows that land in the sink or the ring (fresh_part).
// The split CTAs meanwhile attend [S, E0), and (with fp16 regions) a second sink/window CTA the sink and
// ring tokens before the step, [0, min(S, len0)) and [E1, len0) (fp16_part): none of them does this step write.
template <int D, int P, int KB, int VB, bool F3>
__device__ void fused_step(const AttnParams& p, int s, int h, int64_t len0, int64_t r0, int64_t n, uint8_t* smem) {
  constexpr int NR = D / 32;
  using FG = Fp16Geom<D>;
  const int tidx = threadIdx.x, warp = tidx >> 5, lane = tidx & 31;
  const int64_t len = len0 + n;
  const int64_t E0 = fmkv_compressed_end(p.S, p.W, len0), E1 = fmkv_compressed_end(p.S, p.W, len);
  const int32_t* btrow = p.bt + (int64_t)s * p.bt_stride;
  uint8_t* pages = const_cast<uint8_t*>(p.pages);  // the layer's pages are writable (fmkv_layer_cache)
  uint16_t* fk = const_cast<uint16_t*>(p.fp16_k);
  uint16_t* fv = const_cast<uint16_t*>(p.fp16_v);
  if (n > kFusedMaxRows) {  // the same for every CTA of the sequence
    if (tidx == 0) report_error(p.err, kInvalidArgument, kErrFusedRows, s, n, kFusedMaxRows, 0);
    return;
  }
  const int32_t slot = p.slots ? p.slots[s] : 0;

  // 1. start the validation: the first kTableStaged block-table entries and round 0 of the rows'
  //    chunks are copied into shared memory (after the dk / dv rows that step 2 fills), so nothing
  //    is held in registers across step 2
  constexpr int kTableStaged = 1024;
  int32_t* tab = reinterpret_cast<int32_t*>(smem + FG::fresh_bytes);
  uint8_t* stage = smem + FG::fresh_bytes + 4 * kTableStaged;
  constexpr int kStageBytes = FG::bytes - FG::fresh_bytes - 4 * kTableStaged;
  static_assert(kStageBytes >= 128 * 16, "a round of at least one chunk per thread");
  const int64_t np = E1 > p.S ? (int64_t)((uint64_t)(E1 - 1 - p.S) / P) + 1 : 0;
  const int npst = np < kTableStaged ? (int)np : kTableStaged;
  for (int e = tidx; e < npst; e += blockDim.x) cp_async4(tab + e, btrow + e);
  // The rows' chunks are copied and checked by the warps that have no vector to compress in step 2,
  // when there are such (a one-token decode step compresses 2 vectors per kv head: warps 2 and 3
  // validate while warps 0 and 1 compress from the start), else by every thread before step 2.
  const int64_t ncomp = E1 - E0;
  const int vfirst = 2 * ncomp < kAttnWarps ? (int)(2 * ncomp) * 32 : 0;
  auto row_check = [&]() {  // built where used, twice: nothing of it stays live across step 2
    const RowsToCheck rows[3] = {{p.k, p.k_dtype, p.k_rs, p.k_hs, p.H, true, kErrNonFiniteKV, 0},
                                 {p.v, p.v_dtype, p.v_rs, p.v_hs, p.H, true, kErrNonFiniteKV, 1},
                                 {p.q, p.q_dtype, p.q_rs, p.q_hs, p.HQ, false, kErrNonFiniteQ, 0}};
    return StagedRowCheck(rows, r0, n, D, stage, kStageBytes, vfirst);
  };
  {
    const StagedRowCheck chk = row_check();
    if (chk.all > 0) chk.issue(0);
    else cp_async_commit();
  }

  // 2. compress [E0, E1) of head h into its (not yet visible) token slots; the warp keeps the
  //    dequantized values, un-rotates them and leaves them in shared memory (dk / dv rows) for step 5
  float* dk = reinterpret_cast<float*>(smem);
  float* dv = dk + kFusedMaxRows * D;
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
      int64_t off[NR];
#pragma unroll
      for (int i = 0; i < NR; ++i) off[i] = base + lane + 32 * i;
      load_f16_bits_n<NR>(src, dt, off, x);
    } else {  // aged out of the ring window (read before step 4 rewrites the ring)
      const int32_t fs = p.S + (int32_t)((q - p.S) % p.W);
      const uint16_t* ring = (isv ? fv : fk) + fmkv_fp16_offset(p.H, p.R, D, slot, h, fs);
#pragma unroll
      for (int i = 0; i < NR; ++i) x[i] = ring[lane + 32 * i];
    }
    if (pg < 0 || pg >= p.num_pages) continue;  // reported by the table check
    uint8_t* sec = pages + (int64_t)pg * p.page_bytes + fmkv_section_offset(D, KB, VB, P, h, isv, FMKV_GROUP_SIZE << p.ss);
    float* dst = (isv ? dv : dk) + j * D;
    // K and V of one width share one copy of the code (the second warp's instruction fetches hit)
    if (KB == VB) compress_vector<D, KB, P, F3>(x, sec, t, p.sw, F3 && isv ? p.vq : p.kq, p.rule, p.ss, lane, dst, isv);
    else if (isv) compress_vector<D, VB, P, F3>(x, sec, t, p.sw, p.vq, p.rule, p.ss, lane, dst, isv);
    else compress_vector<D, KB, P, F3>(x, sec, t, p.sw, p.kq, p.rule, p.ss, lane, dst, isv);
  }
  FMKV_TRACE(p, 0, 3);

  // 3. complete the validation (a row with a bad element was skipped by step 2 and is reported here)
  int bad = 0;
  const StagedRowCheck chk = row_check();
  const uint32_t nrounds = chk.rounds();
  cp_async_wait<0>();
  for (uint32_t r = 0; r < nrounds; ++r) {
    if (r > 0) {
      chk.issue(r);
      cp_async_wait<0>();
    }
    bad |= chk.check(r, p.err);
  }
  bad |= chk.check_unaligned(p.err);
  auto entry_ok = [&](int64_t e, int32_t pg) {
    if (pg >= 0 && pg < p.num_pages) return true;
    report_error(p.err, kOutOfRange, kErrBlockTable, s, e, pg, p.num_pages);
    return false;
  };
  for (int e = tidx; e < npst; e += blockDim.x) bad |= !entry_ok(e, tab[e]);
  constexpr int UB = 8;  // entries past the staged ones (> 1024 pages): 8 loads in flight per thread
  for (int64_t e0 = kTableStaged + tidx; e0 < np; e0 += UB * (int64_t)blockDim.x) {
    int32_t pg[UB];
#pragma unroll
    for (int u = 0; u < UB; ++u) pg[u] = e0 + u * blockDim.x < np ? btrow[e0 + u * blockDim.x] : 0;
#pragma unroll
    for (int u = 0; u < UB; ++u)
      if (e0 + u * blockDim.x < np) bad |= !entry_ok(e0 + u * blockDim.x, pg[u]);
  }
  if (__syncthreads_or(bad)) return;  // also: dk / dv complete
  FMKV_TRACE(p, 0, 4);

  // 4. new rows that land in the sink or in the ring (from the validation's copy when it is whole)
  const bool kv_staged = nrounds == 1 && chk.aligned[0] && chk.aligned[1];
  if (p.R > 0)
    for (int64_t vj = warp; vj < 2 * n; vj += kAttnWarps) {
      const int isv = (int)(vj & 1);
      const int64_t j = vj >> 1, pos = len0 + j;
      int32_t fs;
      if (pos < p.S) fs = (int32_t)pos;
      else if (p.W > 0 && pos >= len - p.W) fs = p.S + (int32_t)((pos - p.S) % p.W);
      else continue;
      uint16_t* dst = (isv ? fv : fk) + fmkv_fp16_offset(p.H, p.R, D, slot, h, fs);
      const int32_t dt = isv ? p.v_dtype : p.k_dtype;
      uint16_t x[NR];
      if (kv_staged) {  // staged element (row j, head h, i) of tensor isv: chunk order [rows][heads][D]
        const uint8_t* sb = stage + 16 * chk.first[isv];
        const int64_t e = (j * p.H + h) * D + lane;
#pragma unroll
        for (int i = 0; i < NR; ++i) x[i] = staged_f16_bits(sb, dt, e + 32 * i);
      } else {
        const void* src = isv ? p.v : p.k;
        const int64_t base = (r0 + j) * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs);
        int64_t off[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) off[i] = base + lane + 32 * i;
        load_f16_bits_n<NR>(src, dt, off, x);
      }
#pragma unroll
      for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = x[i];
    }
  __syncthreads();  // ring rows complete
  FMKV_TRACE(p, 0, 5);

  // 5. attention over the step's own tokens: [E0, E1) and the new rows that stay fp16 (rows [0, a) in
  //    the sink, [b, n) in the window); the tokens before the step that stay fp16 are the second
  //    sink/window CTA's (fp16_part). q and the new rows from the validation's copy when it is whole.
  const uint8_t* qstage = nrounds == 1 && chk.aligned[2] ? stage + 16 * chk.first[2] : nullptr;
  const int64_t a = p.S > len0 ? (p.S - len0 < n ? p.S - len0 : n) : 0;
  const int64_t b = E1 - len0 < a ? a : E1 - len0 > n ? n : E1 - len0;
  fresh_part<D>(p, h, len0, r0, n, smem, E0, E1, a, b, qstage, kv_staged ? stage + 16 * chk.first[0] : nullptr,
                kv_staged ? stage + 16 * chk.first[1] : nullptr);
  FMKV_TRACE(p, 0, 6);
}

}  // namespace cuda
}  // namespace fmkv
