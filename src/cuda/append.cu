// CUDA quantize-append (issue 4, kernel 1). Stream-ordered launches, no host sync:
//   1. validate_seq:  per sequence, row_offsets / seq_lens / slot / every block-table entry the
//                     append touches (device arrays); errors go to the device error word.
//   2. compress:      every newly compressed token (the row's j-th slot of the sequence's range
//                     [ce(len0), ce(len0 + n)) -- either a new row (q >= len0) or a token aging
//                     out of the fp16 ring window, read BEFORE the ring is rewritten). A warp takes
//                     32 / (D/64) consecutive rows of one (kv head, K|V); D/64 threads per vector,
//                     each owning two whole code groups (quantize.cuh, thread_fwht; scale group 64:
//                     quantize_pair adds a pair's sums in the thread or with lane ^ 1). The next
//                     task's 4 KB tile is copied (cp.async) while the current one is computed.
//                     Finiteness of a new row is checked here, on the rotated values: every output
//                     of the FWHT is a signed sum of all inputs, so one NaN/Inf input makes every
//                     output non-finite and finite fp16 inputs never do (|y| < 2^25); k16 rows
//                     (copied, not rotated) chunk by chunk.
//   3. fp16_rows<check>: the new rows that go to the sink / ring window, checked for NaN/Inf;
//   4. fp16_rows<write>: ... and written (only when no error is set).
// Every kernel returns at once while the error word is set. A failed call leaves the visible cache
// unchanged (compressed tokens below the sequence's length, sink and ring); compress may already have
// written token slots at or past the sequence's compressed length, which nothing reads until a
// successful append rewrites them (FORMAT.md section 2).
// The portable fp16 conversions of half.h (not cvt): this file converts only on rare paths (f32 / bf16
// input, error reports), and with cvt there ptxas scheduled compress's quantizer loop differently:
// prefill 2-3% slower (docs/history/cuda-quantize.md, f5c839f; docs/history/results/cuda_ab_append_cvt.jsonl).
#define FMKV_PORTABLE_HALF 1
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "../format/quantize_group.h"
#include "code_widths.cuh"
#include "quantize.cuh"
#include "tile_blocks.cuh"

namespace fmkv {
namespace cuda {
namespace {

struct AppendParams {
  uint8_t* pages;
  int64_t num_pages, page_bytes;
  uint16_t *fp16_k, *fp16_v;
  int32_t num_slots, num_seqs;
  const int32_t* slots;
  const int64_t* seq_lens;
  const int64_t* ro;
  const int32_t* bt;
  int64_t bt_stride;
  const void *k, *v;
  int32_t k_dtype, v_dtype;
  int64_t k_rs, k_hs, v_rs, v_hs, rows;
  int32_t d, H, kb, vb, P, lgP, S, W, R, rule;
  int32_t ss;  // scale shift, fmkv_scale_shift(scale_group): code group g's scale is row g >> ss of a section
  // 16-byte paths: in16[isv] = fp16 input whose vectors all start 16-byte aligned; ring16 = the fp16
  // regions are 16-byte aligned; pages16 = the page pool is 16-byte aligned.
  int32_t in16[2], ring16, pages16;
  uint32_t items;  // compress: warp tasks, 2 H ceil(rows / vectors per warp)
  SignWords sw;
  QuantTables qt[FMKV_CUDA_CODE_BITS_MAX - 1];  // code widths 2 .. FMKV_CUDA_CODE_BITS_MAX (index bits - 2)
  long long* err;
  int32_t f3;          // format 3 with a 3-bit side: the compress<..., true> kernels (tile blocks)
  QuantTables qt3[2];  // format 3: the 3-bit tables of K (table 1) and V (table 2)
};

__global__ void validate_seq(AppendParams p) {
  const int s = blockIdx.x;
  const int64_t r0 = p.ro[s], r1 = p.ro[s + 1], n = r1 - r0, len = p.seq_lens[s];
  bool ok = true;
  if (threadIdx.x == 0) {
    if (s == 0 && r0 != 0) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 0, 0);
    if (n < 0) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 1, 0);
    if (s == p.num_seqs - 1 && r1 != p.rows) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, r1, 2, p.rows);
    if (len < 0) report_error(p.err, kInvalidArgument, kErrNegLen, s, 0, len, 0);
    if (n >= 0 && len > INT64_MAX - n) report_error(p.err, kOverflow, kErrLenOverflow, s, 0, len, 0);
    if (p.R > 0 && n > 0) {
      int32_t slot = p.slots ? p.slots[s] : 0;
      if (slot < 0 || slot >= p.num_slots) report_error(p.err, kOutOfRange, kErrSlot, s, 0, slot, p.num_slots);
    }
  }
  if (n < 0 || len < 0 || len > INT64_MAX - n) ok = false;
  if (!ok || n == 0) return;
  const int64_t first = fmkv_compressed_end(p.S, p.W, len), e_end = fmkv_compressed_end(p.S, p.W, len + n);
  if (e_end <= first) return;
  const int64_t p0 = (first - p.S) / p.P, p1 = (e_end - 1 - p.S) / p.P;
  if (p1 >= p.bt_stride) {
    if (threadIdx.x == 0) report_error(p.err, kOutOfRange, kErrTableStride, s, p1 + 1, 0, p.bt_stride);
    return;
  }
  const int32_t* bt = p.bt + (int64_t)s * p.bt_stride;
  for (int64_t q = p0 + threadIdx.x; q <= p1; q += blockDim.x) {
    int32_t pg = bt[q];
    if (pg < 0 || pg >= p.num_pages) report_error(p.err, kOutOfRange, kErrBlockTable, s, q, pg, p.num_pages);
  }
}

// Where global row r compresses to (for kv head h, K or V) and where its source vector is.
struct VecTask {
  uint64_t src;  // address of the source vector's element 0, bit 0 set: fp16 ring region; 0: none
  uint8_t* sec;  // the page section (nullptr: nothing to write)
  int32_t tok;   // token slot in the page
};

// Element offset of kv head h's vector of input row rr in k (isv = 0) or v.
__device__ __forceinline__ int64_t input_offset(const AppendParams& p, int64_t rr, int32_t h, int isv) {
  return rr * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs);
}

// The token that global row r of the call compresses: the (r - row0)-th newly compressed token of
// sequence s, at position q; q >= len0 is the new input row row0 + q - len0, q < len0 a token
// leaving the fp16 ring window.
struct CompressedToken {
  int s;
  int64_t row0, n, len0, q;
};
__device__ __forceinline__ CompressedToken compressed_token(const AppendParams& p, int64_t r) {
  CompressedToken c;
  c.s = seq_of_row(p.ro, p.num_seqs, r);
  c.row0 = p.ro[c.s];
  c.n = p.ro[c.s + 1] - c.row0;
  c.len0 = p.seq_lens[c.s];
  c.q = fmkv_compressed_end(p.S, p.W, c.len0) + (r - c.row0);
  return c;
}

template <int D>
__device__ __forceinline__ VecTask locate(const AppendParams& p, int64_t r, int32_t h, int isv) {
  VecTask v{0, nullptr, 0};
  if (r >= p.rows) return v;
  const CompressedToken c = compressed_token(p, r);
  const int s = c.s;
  const int64_t j = r - c.row0, q = c.q;
  if (j < 0 || j >= c.n) return v;
  if (q >= fmkv_compressed_end(p.S, p.W, c.len0 + c.n)) return v;
  const int64_t ci = q - p.S;
  const int32_t pg = p.bt[(int64_t)s * p.bt_stride + (ci >> p.lgP)];
  if (pg < 0 || pg >= p.num_pages) return v;
  v.tok = (int32_t)(ci & (p.P - 1));
  v.sec = p.pages + (int64_t)pg * p.page_bytes + fmkv_section_offset(D, p.kb, p.vb, p.P, h, isv, FMKV_GROUP_SIZE << p.ss);
  if (q >= c.len0) {
    const int64_t off = input_offset(p, c.row0 + (q - c.len0), h, isv);
    const int32_t dt = isv ? p.v_dtype : p.k_dtype;
    v.src = (uint64_t)(uintptr_t)((const uint8_t*)(isv ? p.v : p.k) + off * (dt == FMKV_F32 ? 4 : 2));
  } else {  // aged out of the ring window: read the ring before fp16_rows<write> overwrites it
    const int32_t slot = p.slots ? p.slots[s] : 0;
    const int32_t fs = p.S + (int32_t)((q - p.S) % p.W);
    const uint16_t* ring = (isv ? p.fp16_v : p.fp16_k) + fmkv_fp16_offset(p.H, p.R, D, slot, h, fs);
    v.src = (uint64_t)(uintptr_t)ring | 1u;
  }
  return v;
}

// Chunk from a source without the 16-byte fp16 layout (fp32 / bf16 input, unaligned strides):
// element by element, converted to fp16 like the reference. Kept out of line (rare path).
__device__ __noinline__ uint4 load_chunk_elems(const uint8_t* base, int32_t dt, int pos) {
  uint32_t w[4];
#pragma unroll
  for (int e = 0; e < 4; ++e)
    w[e] = (uint32_t)load_f16_bits(base, dt, 8 * pos + 2 * e) | ((uint32_t)load_f16_bits(base, dt, 8 * pos + 2 * e + 1) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 16-byte chunk `pos` (fp16 coordinates 8 pos .. 8 pos + 7) of a source vector, as fp16 bits.
__device__ __forceinline__ uint4 load_chunk(const AppendParams& p, uint64_t src, int pos, int isv) {
  const bool ring = src & 1u;
  const uint8_t* base = (const uint8_t*)(uintptr_t)(src & ~(uint64_t)1);
  if (ring ? p.ring16 : p.in16[isv]) return __ldcs((const uint4*)base + pos);
  return load_chunk_elems(base, ring ? (int32_t)FMKV_F16 : (isv ? p.v_dtype : p.k_dtype), pos);
}

__device__ __forceinline__ uint64_t shfl64(uint64_t x, int src_lane) {
  const uint32_t lo = __shfl_sync(kFull, (uint32_t)x, src_lane), hi = __shfl_sync(kFull, (uint32_t)(x >> 32), src_lane);
  return ((uint64_t)hi << 32) | lo;
}

// The thread's two code groups (r[0..31]: group t, r[32..63]: group t + NT, times their pending sign and
// 1/sqrt(d): cn) quantized: w[b] the words and sc[b] the scale of group t + NT b. SS = 1 (scale group 64):
// groups 2k and 2k + 1 share the scale of their scale group, their tree sums added (group 2k's first; one
// addition commutes exactly): the thread's own pair at d = 64 (NT = 1), else group g ^ 1 is the same
// register half of the partner lane (lane ^ 1: t ^ 1, the same vector). Every lane takes part (shuffles).
// EXACT / NIB: thread_group_codes' (format 3's 3-bit tables, nibble output).
template <int BITS, bool LSQ, int NT, int SS, bool EXACT, bool NIB>
__device__ __forceinline__ void quantize_pair(const float (&r)[64], const float (&cn)[2], const QuantTables& qt,
                                              const float* smag, uint32_t (&w)[2][NIB ? 4 : BITS], uint16_t (&sc)[2]) {
  if constexpr (SS == 0) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float y[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) y[k] = __fmul_rn(r[32 * b + k], cn[b]);
      sc[b] = thread_quantize_group<BITS, LSQ, EXACT, NIB>(y, qt, smag, w[b]);
    }
  } else {
    float y[2][32], ss[2], num[2], den[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int k = 0; k < 32; ++k) y[b][k] = __fmul_rn(r[32 * b + k], cn[b]);
      ss[b] = thread_square_sum(y[b]);
    }
    auto scale_group_sums = [](float (&x)[2]) {
      if constexpr (NT == 1) {
        x[0] = x[1] = __fadd_rn(x[0], x[1]);
      } else {
#pragma unroll
        for (int b = 0; b < 2; ++b) x[b] = __fadd_rn(x[b], __shfl_xor_sync(kFull, x[b], 1));
      }
    };
    scale_group_sums(ss);
    uint16_t s0[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      s0[b] = rms_scale(ss[b], 2 * FMKV_GROUP_SIZE);
      thread_group_codes<BITS, LSQ, EXACT, NIB>(y[b], qt, smag, f16_bits_to_f32_hw(s0[b]), w[b], num[b], den[b]);
    }
    if constexpr (LSQ) {
      scale_group_sums(num);
      scale_group_sums(den);
    }
#pragma unroll
    for (int b = 0; b < 2; ++b) sc[b] = thread_group_scale<LSQ>(s0[b], num[b], den[b], w[b]);
  }
}

// Quantize the thread's two groups and store them (code group g's scale at row g >> SS: the even group's
// thread writes it).
template <int BITS, bool LSQ, int NT, int SS>
__device__ __forceinline__ void quantize_store(const float (&r)[64], const float (&cn)[2], const QuantTables& qt,
                                               const float* smag, const VecTask& vt, int t, int P) {
  uint32_t* words = (uint32_t*)vt.sec + vt.tok;
  uint16_t* scales = (uint16_t*)(vt.sec + (int64_t)(2 * NT) * BITS * P * 4) + vt.tok;  // fmkv_scales_offset
  uint32_t w[2][BITS];
  uint16_t sc[2];
  quantize_pair<BITS, LSQ, NT, SS, false, false>(r, cn, qt, smag, w, sc);
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int g = t + NT * b;
    if (vt.sec) {
#pragma unroll
      for (int i = 0; i < BITS; ++i) words[(int64_t)(g * BITS + i) * P] = w[b][i];
      if ((g & SS) == 0) scales[(int64_t)(g >> SS) * P] = sc[b];
    }
  }
}

// Format 3: the thread's two groups of a 3-bit tiled section (FORMAT.md section 6) -- the exact quantizer
// (EXACT, codes as nibbles), then the token's codes into its tile block and its scales as format 2 stores them.
// whole (warp-uniform): the warp's lanes hold consecutive tokens of one section from a multiple of 8, so every
// block word is stored whole (tile_put_group_words: every lane takes part); otherwise each token's bits are
// merged by reductions (tile_put_group_red).
template <bool LSQ, int NT, int SS>
__device__ __forceinline__ void quantize_store_tiled(const float (&r)[64], const float (&cn)[2], const QuantTables& qt,
                                                     const VecTask& vt, int t, int P, int is_v, bool whole) {
  constexpr int G = 2 * NT;
  uint8_t* block = vt.sec ? vt.sec + fmkv_tile_block_offset(32 * G, vt.tok) : nullptr;
  uint16_t* scales = vt.sec ? (uint16_t*)(vt.sec + (int64_t)G * 3 * P * 4) + vt.tok : nullptr;  // fmkv_scales_offset
  uint32_t w[2][4];
  uint16_t sc[2];
  quantize_pair<3, LSQ, NT, SS, true, true>(r, cn, qt, nullptr, w, sc);
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    const int g = t + NT * b;
    if (whole) tile_put_group_words<G, NT>(block, is_v, vt.tok & 15, g, w[b]);
    else if (vt.sec) tile_put_group_red<G>(block, is_v, vt.tok & 15, g, w[b]);
    if (vt.sec && (g & SS) == 0) scales[(int64_t)(g >> SS) * P] = sc[b];
  }
}

// A warp task of a tiled side: VPW = 32 / NT vectors. When they are consecutive tokens of one page section
// from a multiple of 8 (a prefill chunk), the tokens that share a block word are all in the warp and the words
// are stored whole; otherwise (a decode step's rows, a chunk's ragged edges) by reductions.
template <int D, bool LSQ, int SS>
__device__ __forceinline__ void tiled_task(const AppendParams& p, const float (&r)[64], const float (&cn)[2],
                                           const VecTask& vt, int t, int lane, int is_v) {
  constexpr int NT = D / 64;
  const uint64_t sec0 = __shfl_sync(kFull, (uint64_t)(uintptr_t)vt.sec, 0);
  const int32_t tok0 = __shfl_sync(kFull, vt.tok, 0);
  const bool whole = __all_sync(kFull, (tok0 & 7) == 0 && vt.sec && (uint64_t)(uintptr_t)vt.sec == sec0 &&
                                           vt.tok == tok0 + lane / NT);
  quantize_store_tiled<LSQ, NT, SS>(r, cn, p.qt3[is_v], vt, t, p.P, is_v, whole);
}

// One side's quantizer and store (TILED: format 3's 3-bit tile blocks) for the cache's scale group: p.ss is
// uniform over the launch, so each launch runs one of the two.
template <int D, int BITS, bool LSQ, bool TILED>
__device__ __forceinline__ void quantize_side(const AppendParams& p, const float (&r)[64], const float (&cn)[2],
                                              const float* smag, const VecTask& vt, int t, int lane, int is_v) {
  constexpr int NT = D / 64;
  if constexpr (TILED) {
    if (p.ss) tiled_task<D, LSQ, 1>(p, r, cn, vt, t, lane, is_v);
    else tiled_task<D, LSQ, 0>(p, r, cn, vt, t, lane, is_v);
  } else {
    if (p.ss) quantize_store<BITS, LSQ, NT, 1>(r, cn, p.qt[BITS - 2], smag, vt, t, p.P);
    else quantize_store<BITS, LSQ, NT, 0>(r, cn, p.qt[BITS - 2], smag, vt, t, p.P);
  }
}

// Place of chunk c (< 256) of a warp's 4 KB tile: segment c / 8 (= the owner lane), 16-byte slot
// (c % 8) ^ (segment % 8). Conflict-free for the loader (8 consecutive chunks per quarter warp) and
// for the owner's reads.
__device__ __forceinline__ int tile_slot(int c) { return (c >> 3) * 8 + ((c & 7) ^ ((c >> 3) & 7)); }

// Copy the source vectors of a warp task (vt of lane = vector * NT + t) into a tile: chunk
// c = lane + 32 i (i < 8) is chunk c % CPV of vector c / CPV. cp.async when every vector of the task
// allows 16-byte loads (the common case: all 8 copies of a lane in flight, no registers held), element
// loads converted to fp16 otherwise. Rotation signs are applied by the reader.
template <int D>
__device__ __forceinline__ void stage_task(const AppendParams& p, const VecTask& vt, int isv, uint4* tile, int lane) {
  constexpr int NT = D / 64, CPV = D / 8;
  const int pos = lane % CPV;
  const bool own16 = !vt.src || ((vt.src & 1u) ? p.ring16 : p.in16[isv]);
  if (__all_sync(kFull, own16)) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint64_t src = shfl64(vt.src, ((lane + 32 * i) / CPV) * NT);
      uint4* dst = tile + tile_slot(lane + 32 * i);
      if (src) cp_async16(dst, (const uint4*)(uintptr_t)(src & ~(uint64_t)1) + pos);
      else *dst = make_uint4(0, 0, 0, 0);
    }
  } else {
#pragma unroll 1
    for (int i = 0; i < 8; ++i) {
      const uint64_t src = shfl64(vt.src, ((lane + 32 * i) / CPV) * NT);
      tile[tile_slot(lane + 32 * i)] = src ? load_chunk(p, src, pos, isv) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Nonzero iff one of the two fp16 values in x has an all-ones exponent (NaN / Inf): the exponent
// field plus one carries into the halfword's sign position only then (no carry between halves).
__device__ __forceinline__ uint32_t nonfinite2(uint32_t x) { return ((x & 0x7c007c00u) + 0x04000400u) & 0x80008000u; }

// A non-finite new row found by compress (global row r of the call, kv head h): find its first bad
// element and report it as the host backends name it (rare path; inlined: a call would make the
// compiler save live registers around it).
__device__ __forceinline__ void report_nonfinite_row(const AppendParams& p, int64_t r, int32_t h, int isv) {
  const CompressedToken c = compressed_token(p, r);
  const int64_t rr = c.row0 + (c.q - c.len0);
  const void* src = isv ? p.v : p.k;
  const int32_t dt = isv ? p.v_dtype : p.k_dtype;
  const int64_t base = input_offset(p, rr, h, isv);
  for (int i = 0; i < p.d; ++i)
    if (!f16_is_finite(load_f16_bits(src, dt, base + i))) {
      report_error(p.err, kNonFinite, kErrNonFiniteKV, isv, rr, h, i);
      return;
    }
}

// A warp task is VPW = 32 / NT consecutive global rows of one (kv head, K|V); lane = vector * NT + t.
// Task k of a warp is copied into stage k % 2 of the warp's tiles while task k - 1 is computed from
// the other stage. Thread t of vector v reads its own 128 bytes (segment v NT + t, chunks 8 t .. 8 t
// + 7 of the vector), applies the rotation signs (one xor per 16 bytes, masks of fwht_input_mask in
// shared memory) and runs thread_fwht + quantize_side.
constexpr int kCompressWarps = 8, kCompressStages = 2;

constexpr int kCompressSmem = kCompressWarps * kCompressStages * 256 * 16;

// One kernel per (K width, V width, scale rule): KB a code width or 16 (K kept in fp16, copied), VB a code
// width. A kernel holds at most two quantizers (one when KB == VB, except format 3's k3v3: one per side), so its hot loop stays in
// the instruction cache (a runtime switch over all six was 175 KB of code: a one-token k4v2 append in a
// CUDA-graph decode step took ~21 us through it, ~12 us now; docs/history/cuda-quantize.md, d6d8e90).
// F3: format 3, whose 3-bit sides are written as tile blocks (quantize_store_tiled); compiled for the width
// pairs with a 3-bit side only.
template <int D, int KB, int VB, bool LSQ, bool F3>
__global__ void __launch_bounds__(256, 2) compress(AppendParams p) {
  constexpr int NT = D / 64, VPW = 32 / NT, CPV = D / 8;
  extern __shared__ __align__(16) uint4 tiles[];  // [warp][stage][256]
  __shared__ uint4 s_mask[CPV];
  // The code levels of K (row 0) and V (row 1) for the 4- and 5-bit quantizers' LSQ sums: one indexed shared load
  // per value instead of a select tree over constants (whose values would take registers).
  __shared__ float s_mag[2][kMaxMagnitudes];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x < 2 * kMaxMagnitudes) {
    const int side = threadIdx.x / kMaxMagnitudes, m = threadIdx.x % kMaxMagnitudes, b = side ? VB : KB;
    s_mag[side][m] = b >= 2 && b <= FMKV_CUDA_CODE_BITS_MAX ? p.qt[b - 2].mag[m] : 0.0f;
  }
  uint4* wtiles = tiles + warp * kCompressStages * 256;
  const int t = lane % NT, vec = lane / NT;
  if (threadIdx.x < CPV) s_mask[threadIdx.x] = fwht_input_mask<D>(p.sw, threadIdx.x);
  float cn[2];
  fwht_pending_signs<D>(t, cn[0], cn[1]);
  cn[0] = cn[0] * rotation_norm(D);  // exact: +-1 times the float nearest to 1/sqrt(d)
  cn[1] = cn[1] * rotation_norm(D);
  // validate_seq's verdict before anything is read: locate() trusts the slots and lengths it checked
  // (one decision per CTA: another CTA may set the word meanwhile)
  if (__syncthreads_or(error_set(p.err) ? 1 : 0)) return;
  // Task order: every K task (row group major, kv head minor), then every V task. With K and V of
  // different widths an SM then runs one quantizer at a time, not both at once (measured at 10b828f:
  // interleaved K and V tasks thrash the instruction cache; k4v2 1.25x, docs/history/cuda-quantize.md).
  const uint32_t H = (uint32_t)p.H, half = p.items / 2u, stride = gridDim.x * (uint32_t)kCompressWarps;
  // Task `it` (if it exists): this lane's vector located and, unless it is k16, its tile copies
  // issued into `stage`; one cp.async group per call either way.
  auto begin_task = [&](uint64_t it, int stage, int& isv, int32_t& h, int64_t& r, VecTask& vt) {
    if (it < p.items) {  // items is 32-bit: so is the task index here (no 64-bit division)
      const uint32_t it32 = (uint32_t)it, kv = it32 >= half ? 1u : 0u, t32 = it32 - kv * half;
      isv = (int)kv;
      h = (int32_t)(t32 % H);
      r = (int64_t)(t32 / H) * VPW + vec;
      vt = locate<D>(p, r, h, isv);
      if (isv || KB != FMKV_FP16_BITS) stage_task<D>(p, vt, isv, wtiles + stage * 256, lane);
    }
    cp_async_commit();
  };
  uint64_t it = blockIdx.x * (uint64_t)kCompressWarps + warp;
  int isv = 0;
  int32_t h = 0;
  int64_t r = 0;
  VecTask vt{0, nullptr, 0};
  begin_task(it, 0, isv, h, r, vt);
  for (int k = 0; it < p.items; ++k, it += stride) {
    if (__any_sync(kFull, error_set(p.err))) break;  // one decision per warp
    // the next task: located and its copies issued before this one is computed
    int isv_n = 0;
    int32_t h_n = 0;
    int64_t r_n = 0;
    VecTask vt_n{0, nullptr, 0};
    begin_task(it + stride, (k + 1) & 1, isv_n, h_n, r_n, vt_n);
    bool bad = false;
    if (KB == FMKV_FP16_BITS && !isv) {  // K kept in fp16, unrotated: copy chunk by chunk (not staged)
      const int pos = lane % CPV;
      const uint64_t dst_own = vt.sec ? (uint64_t)(uintptr_t)(vt.sec + (int64_t)vt.tok * D * 2) : 0;
      int bad_vec = -1;  // a vector of the task with a non-finite new-row chunk (reported below)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = lane + 32 * i, owner = (c / CPV) * NT;
        const uint64_t src = shfl64(vt.src, owner), dst = shfl64(dst_own, owner);
        if (!dst) continue;
        const uint4 x = load_chunk(p, src, pos, isv);
        if (!(src & 1u) && (nonfinite2(x.x) | nonfinite2(x.y) | nonfinite2(x.z) | nonfinite2(x.w))) bad_vec = c / CPV;
        if (p.pages16) {
          *((uint4*)(uintptr_t)dst + pos) = x;
        } else {
          uint16_t* d16 = (uint16_t*)(uintptr_t)dst + 8 * pos;
          const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) d16[e] = (uint16_t)(w[e >> 1] >> (16 * (e & 1)));
        }
      }
      if (bad_vec >= 0) report_nonfinite_row(p, r - vec + bad_vec, h, isv);
    } else {
      cp_async_wait<1>();  // this lane's copies of the current task have landed ...
      __syncwarp();        // ... and every lane's
      const uint4* tile = wtiles + (k & 1) * 256;
      float r8[64];
#pragma unroll
      for (int k8 = 0; k8 < 8; ++k8) {
        uint4 x = tile[lane * 8 + (k8 ^ (lane & 7))];
        const uint4 m = s_mask[8 * t + k8];
        x.x ^= m.x;
        x.y ^= m.y;
        x.z ^= m.z;
        x.w ^= m.w;
        const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          r8[8 * k8 + 2 * e] = f16_bits_to_f32_hw(w[e] & 0xffffu);
          r8[8 * k8 + 2 * e + 1] = f16_bits_to_f32_hw(w[e] >> 16);
        }
      }
      thread_fwht<D>(r8, lane);
      // one non-finite input makes every output non-finite (header comment); ring rows were checked
      // when they were appended. Reported after the quantization (no live values around the call).
      bad = !(fabsf(r8[0]) <= 3.402823466e38f) && t == 0 && vt.src && !(vt.src & 1u);
      if constexpr (KB == VB && kTiled<VB, F3>) {
        // Format 3's K and V 3-bit tables differ (qt3[side]): one quantizer per side, each reading its table as
        // constants. With the side a runtime index every table read was an indexed constant load and the kernel
        // spilled (ncu, H100: 165,952 local-memory requests per 32k-token chunk; docs/history/cuda-quantize.md).
        if (isv) quantize_side<D, VB, LSQ, true>(p, r8, cn, s_mag[1], vt, t, lane, 1);
        else quantize_side<D, VB, LSQ, true>(p, r8, cn, s_mag[0], vt, t, lane, 0);
      } else if constexpr (KB == VB) {  // one width, one table: not tiled (the branch above)
        quantize_side<D, VB, LSQ, false>(p, r8, cn, s_mag[0], vt, t, lane, isv);
      } else if (isv) {
        quantize_side<D, VB, LSQ, kTiled<VB, F3>>(p, r8, cn, s_mag[1], vt, t, lane, 1);
      } else if constexpr (KB != FMKV_FP16_BITS) {
        quantize_side<D, KB, LSQ, kTiled<KB, F3>>(p, r8, cn, s_mag[0], vt, t, lane, 0);
      }
    }
    if (bad) report_nonfinite_row(p, r, h, isv);
    __syncwarp();  // every lane is done with this stage before the task after next refills it
    vt = vt_n;
    isv = isv_n;
    h = h_n;
    r = r_n;
  }
  cp_async_wait<0>();
}

// New rows that go to the fp16 regions (sink, ring window): kCheck = true checks them for NaN/Inf
// (reported like compress does), false writes them (nothing while the error word is set, so a failed
// call leaves the regions unchanged). One warp per (row, kv head, K|V), lane i: elements i + 32 r.
template <int D, bool kCheck>
__global__ void __launch_bounds__(256) fp16_rows(AppendParams p) {
  constexpr int NR = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = p.rows * p.H * 2;
  for (int64_t gw = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; gw < nwarps;
       gw += ((int64_t)gridDim.x * blockDim.x) >> 5) {
    if (error_set(p.err)) return;
    const int isv = (int)(gw & 1);
    const int32_t h = (int32_t)((gw >> 1) % p.H);
    const int64_t r = gw / (2 * (int64_t)p.H);
    const int s = seq_of_row(p.ro, p.num_seqs, r);
    const int64_t row0 = p.ro[s], n = p.ro[s + 1] - row0, len0 = p.seq_lens[s], j = r - row0;
    if (j < 0 || j >= n) continue;
    const int64_t pos = len0 + j;
    int32_t fs;
    if (pos < p.S) fs = (int32_t)pos;
    else if (p.W > 0 && pos >= len0 + n - p.W) fs = p.S + (int32_t)((pos - p.S) % p.W);
    else continue;
    const void* src = isv ? p.v : p.k;
    const int32_t dt = isv ? p.v_dtype : p.k_dtype;
    const int64_t base = input_offset(p, r, h, isv);
    uint16_t x[NR];
    int64_t off[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) off[i] = base + lane + 32 * i;
    load_f16_bits_n<NR>(src, dt, off, x);
    if (kCheck) {
#pragma unroll
      for (int i = 0; i < NR; ++i)
        if (!f16_is_finite(x[i])) report_error(p.err, kNonFinite, kErrNonFiniteKV, isv, r, h, lane + 32 * i);
    } else {
      const int32_t slot = p.slots ? p.slots[s] : 0;
      uint16_t* dst = (isv ? p.fp16_v : p.fp16_k) + fmkv_fp16_offset(p.H, p.R, D, slot, h, fs);
#pragma unroll
      for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = x[i];
    }
  }
}

template <int D, int KB, int VB, bool LSQ, bool F3>
int compress_blocks_per_sm() {  // same for every device of the one compiled architecture
  static const int n = [] {
    check_cuda(cudaFuncSetAttribute(compress<D, KB, VB, LSQ, F3>, cudaFuncAttributeMaxDynamicSharedMemorySize, kCompressSmem),
               "compress shared memory");
    int b = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, compress<D, KB, VB, LSQ, F3>, 32 * kCompressWarps,
                                                             kCompressSmem),
               "occupancy");
    return b > 0 ? b : 1;
  }();
  return n;
}

template <int D, int KB, int VB, bool LSQ, bool F3>
void launch_compress_f(const AppendParams& p, cudaStream_t st) {
  const int64_t blocks = std::min<int64_t>(((int64_t)p.items + kCompressWarps - 1) / kCompressWarps,
                                           (int64_t)compress_blocks_per_sm<D, KB, VB, LSQ, F3>() * sm_count());
  compress<D, KB, VB, LSQ, F3><<<(unsigned)blocks, 32 * kCompressWarps, kCompressSmem, st>>>(p);
}

// format 3 with a 3-bit side: its own kernel (the format-2 one keeps its code)
template <int D, int KB, int VB, bool LSQ>
void launch_compress(const AppendParams& p, cudaStream_t st) {
  if constexpr (kTiled<KB, true> || kTiled<VB, true>) {
    if (p.f3) return launch_compress_f<D, KB, VB, LSQ, true>(p, st);
  }
  launch_compress_f<D, KB, VB, LSQ, false>(p, st);
}

// The compress kernel of (p.kb, p.vb, p.rule); the host checked the widths (fmkv_config validation).
template <int D, int KB>
void launch_compress_kb(const AppendParams& p, cudaStream_t st) {
  const bool lsq = p.rule == FMKV_SCALE_LSQ;
  with_code_bits(p.vb, [&](auto vb) {
    constexpr int VB = decltype(vb)::value;
    lsq ? launch_compress<D, KB, VB, true>(p, st) : launch_compress<D, KB, VB, false>(p, st);
  });
}

template <int D>
void launch_append(const AppendParams& p, cudaStream_t st) {
  with_k_bits(p.kb, [&](auto kb) { launch_compress_kb<D, decltype(kb)::value>(p, st); });
  if (p.R > 0) {
    const int64_t wblocks = std::min<int64_t>((p.rows * p.H * 2 + 7) / 8, 1 << 20);
    fp16_rows<D, true><<<(unsigned)wblocks, 256, 0, st>>>(p);
    fp16_rows<D, false><<<(unsigned)wblocks, 256, 0, st>>>(p);
  }
}

bool aligned16(const void* ptr) { return ((uintptr_t)ptr & 15u) == 0; }

}  // namespace

void append(const AppendArgs& a) {
  const fmkv_config& c = a.cfg;
  if (a.batch.num_seqs == 0) return;
  // compress's warp tasks (ceil(rows / vectors per warp) x 2 x kv heads), counted in 32 bits
  const int64_t vpw = 32 / (c.head_dim / 64), tasks = (a.k.rows + vpw - 1) / vpw * 2 * (int64_t)c.num_kv_heads;
  if (tasks > (int64_t)UINT32_MAX)
    throw Error(kOverflow, "cuda append: " + std::to_string(a.k.rows) + " rows x " + std::to_string(c.num_kv_heads) +
                               " kv heads are " + std::to_string(tasks) +
                               " quantizer tasks, more than 2^32 - 1 in one call; append in smaller chunks");
  AppendParams p{};
  fill_layer_batch(p, c, a.layer, a.batch);
  fill_kv(p, a.k, a.v);
  p.rows = a.k.rows;
  p.d = c.head_dim;
  p.lgP = 0;
  while ((1 << p.lgP) < p.P) ++p.lgP;
  for (int w = 0; w < 2; ++w) {
    const fmkv_tensor& x = w ? a.v : a.k;
    p.in16[w] = x.dtype == FMKV_F16 && aligned16(x.data) && x.row_stride % 8 == 0 && x.head_stride % 8 == 0;
  }
  p.ring16 = aligned16(a.layer.fp16_k) && aligned16(a.layer.fp16_v);
  p.pages16 = aligned16(a.layer.pages);
  p.items = (uint32_t)tasks;
  for (int b = FMKV_CODE_BITS_MIN; b <= FMKV_CUDA_CODE_BITS_MAX; ++b) p.qt[b - 2] = quant_tables(b);
  p.f3 = fmkv_tiled_codes(c.format_version, c.k_bits) || fmkv_tiled_codes(c.format_version, c.v_bits);
  p.qt3[0] = tile_quantizer_tables(1);
  p.qt3[1] = tile_quantizer_tables(2);
  p.err = error_word();
  cudaStream_t st = to_stream(a.stream);
  validate_seq<<<(unsigned)p.num_seqs, 128, 0, st>>>(p);
  if (p.rows > 0) {
    switch (p.d) {
      case 64: launch_append<64>(p, st); break;
      case 128: launch_append<128>(p, st); break;
      default: launch_append<256>(p, st); break;
    }
  }
  check_cuda(cudaGetLastError(), "append kernel launch");
}

}  // namespace cuda
}  // namespace fmkv
