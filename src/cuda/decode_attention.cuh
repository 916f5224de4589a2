// CUDA decode attention on the compressed cache: flash-decoding with tensor cores. One kernel,
// attn_kernel, whose CTAs take one of three roles. Grid (kv heads, sequences, nraw + nsplit):
// blockIdx.z < nraw are the raw-domain CTAs (sp = nsplit + blockIdx.z), the rest the split CTAs
// (sp = blockIdx.z - nraw), so that CTAs are dispatched (in linear block order) raw-domain first, then
// split 0 of every (sequence, kv head) pair, split 1, ...: a fused step's append never waits for a second
// wave (docs/history/cuda-split-count.md). A balanced call (2 .. kBalanceMaxSeqs sequences, split_count.h)
// shares the split CTAs out by the sequences' compressed tiles on the device (balanced_plan.cuh): sequence s
// has ns_s splits, and a split CTA whose own sequence needs fewer than nsplit takes an extra split of a
// longer one; otherwise ns_s = nsplit. Roles of CTA (sp, sequence s, kv head h):
//   split_cta, sp < nsplit: split k of the ns_s of its sequence (k = sp unless the plan moved it), a
//     contiguous range of 16-token tiles of the sequence's compressed tokens, for up to NH x kQV query
//     vectors per pass (all q heads of the GQA group x query rows; kQV = 8, NH = 1, or 2 in the wide
//     kernels of calls with more than 8 vectors per (sequence, kv head), attn_compiled_wide), so every K/V
//     byte is read and decoded once per NH x 8 query vectors; partial slot split_slot(k) (attn_params.cuh).
//   fp16_part (fp16_part.cuh), sp == nsplit of an attention call or sp == nsplit + 1 of a fused step with
//     fp16 regions (nraw = 2): the fp16 sink and window tokens (a fused step's: those before the step);
//     partial slot raw_slot(z).
//   fused_step (fused_step.cuh), sp == nsplit of a fused step: the append, then the attention over the
//     step's own tokens (fresh_part); partial slot raw_slot(0).
// In a balanced call the raw-domain CTA z = 0 of kv head 0 also writes its rows' partial count (part_n).
// Every partial (m, l, acc) is in the raw domain; merge_kernel (decode_attention.cu) adds them with their
// weights (no rotation).
//
// Split CTA, per warp and 16-token tile (staged in shared memory by cp.async NST - 1 tiles ahead of the
// one computed, NST = 3 stages per warp, 2 where 3 do not fit 64 KB; branch-free issue: a missing tile or a
// bad page entry zero-fills its stage, the entry error is reported after the loop):
//   S = K Q^T     mma.m16n8k16 (m = 16 tokens, n = 8 q vectors, k = 16 coordinates), two per group;
//                 the K fragment is decoded in registers: field word -> selector-form bytes -> one
//                 64-bit multiply-add for two byte-permute selectors -> one prmt per fp16 pair from
//                 the level table, the sign plane moved into bits 15/31 by a multiply (FMA pipe; the
//                 integer ALU pipe is the loop's busiest) and XORed in (FORMAT.md section 6). 2-bit codes
//                 index a signed 4-entry table instead (make_x2s): no sign work. 4-bit codes are nibbles
//                 (format version 2): a half-word of 4 codes is the selector of two byte permutes (low /
//                 high bytes of the levels), a sign-replicating permute ORs the signs into the high
//                 bytes, two permutes interleave them into 2 fp16 pairs (nibble_bytes). 5-bit codes: the
//                 4-bit magnitude nibbles the same way from a 16-entry table (four byte permutes, picked
//                 per byte by the nibble's bit 3), the signs of plane 4 spread to the high bytes' bit 7
//                 by multiplies (nibble16_bytes, sign_bytes). fp16 K: the pairs straight from the staged rows.
//                 Coordinates are permuted consistently in Q and K (the dot product does not care);
//                 the Q fragments are read from shared memory per tile (registers for occupancy).
//                 Per-group fp16 scales are applied in fp32 to each group's mma result.
//   online softmax in fp32 (ex2.approx, log2 units), P kept in registers; the running max moves
//                 (8-lane reduction, O and l rescaled) only in tiles where a score exceeds it.
//   O^T += V^T P^T  mma.m16n8k16 (m = 16 coordinates, n = 8 q vectors, k = 16 tokens); the V fragment
//                 pairs two tokens of one coordinate; P is multiplied by the token's V scale in fp32
//                 (p <= 1, |scale| <= 65504: the fp16 operand cannot overflow) and transposed into
//                 the B operand by movmatrix.
// Q is rotated once per pass (in registers, a warp per query vector; fp16 K is stored unrotated, so its Q
// is not) and normalised to max |q| = 1 before fp16 rounding. After the tile loop the split CTA combines
// its 4 warps, applies the inverse rotation once per vector (half a warp per query vector) and writes its
// partial to the workspace.
// Split CTA functions, in call order: split_cta (tile range, copy plan, the warp's tiles; per pass:)
// split_q_request, split_q_rotate, tile_lane_setup, split_tile_loop (tile_scores, tile_softmax, tile_pv),
// split_combine_store.
#pragma once
#include "attn_params.cuh"
#include "balanced_plan.cuh"
#include "code_widths.cuh"
#include "fp16_part.cuh"
#include "fused_step.cuh"
#include "tile_blocks.cuh"

namespace fmkv {
namespace cuda {

// Code decoding (FORMAT.md section 6). A "selector-form word" holds in bytes 0..3 the magnitude
// fields (the 2-bit field, or the magnitude bit for 2-bit codes) of four values, each byte < 4.
// pair_selectors() turns it into two byte-permute selectors (nibbles 2m, 2m+1 fetch the two bytes
// of fp16 level m from T[0..1]); lookup() fetches an fp16 pair. 4-bit codes fetch levels m and 4 + m
// and pick per half by the magnitude bit-2 mask; signs are XORed into bits 15/31 by the caller. 2-bit
// codes index a signed table instead (T[0..1] = levels 0, 1, then their negatives; make_x2s).
//
// Both selectors of a selector-form word x: .x fetches the pair (byte 0, byte 1), .y the pair
// (byte 2, byte 3). One 64-bit multiply-add: x * 0x00220022 puts 0x22 m of bytes 0,1 in the low half
// of the low word and of bytes 2,3 in the low half of the high word (bytes < 4: every byte of
// x * 0x22 is <= 0x66, so nothing carries between them or out of the low word).
__device__ __forceinline__ uint2 pair_selectors(uint32_t x) {
  const uint64_t w = (uint64_t)x * 0x00220022u + 0x0000101000001010ull;
  return make_uint2((uint32_t)w, (uint32_t)(w >> 32));
}


// 8-byte shared-memory load the compiler keeps where it is written (inside the tile loop)
__device__ __forceinline__ uint2 load_shared_u2(const uint2* a) {
  uint2 v;
  asm volatile("ld.volatile.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"((uint32_t)__cvta_generic_to_shared(a)));
  return v;
}

__device__ __forceinline__ uint32_t lookup(uint32_t sel, const uint32_t (&T)[4]) { return prmt(T[0], T[1], sel); }

// 4-bit codes (FORMAT.md version 2: nibble words, sign in the nibble's bit 3). The 8 magnitudes' fp16
// levels split into a low-byte table (L[0..1]) and a high-byte table (H[0..1]), 8 bytes each. For the
// four nibbles of the low half-word of x: returns their low bytes (lo) and high bytes with the sign
// ORed in (hi), bytes in nibble order. The sign mask: byte k of prmt(x, 16 x, 0x9D8C) replicates bit 7 of
// x's byte 0 / 1 (nibbles 1, 3) or of (16 x)'s byte 0 / 1 (nibbles 0, 2), i.e. each nibble's bit 3;
// 16 x is a multiply by k16 = 16 read from shared memory (FMA pipe, not a shift on the ALU pipe).
struct NibbleTables {
  uint32_t L[2], H[2];
};
__device__ __forceinline__ void nibble_bytes(uint32_t x, uint32_t k16, const NibbleTables& t, uint32_t& lo, uint32_t& hi) {
  const uint32_t sel = x & 0x7777u;
  lo = prmt(t.L[0], t.L[1], sel);
  hi = prmt(t.H[0], t.H[1], sel) | (prmt(x, x * k16, 0x9D8Cu) & 0x80808080u);
}
// the two tables from the fp16x2 level registers T[k] = level 2k | level 2k + 1 << 16
__device__ __forceinline__ NibbleTables nibble_tables(const uint32_t (&T)[4]) {
  NibbleTables t;
  t.L[0] = prmt(T[0], T[1], 0x6420u);
  t.L[1] = prmt(T[2], T[3], 0x6420u);
  t.H[0] = prmt(T[0], T[1], 0x7531u);
  t.H[1] = prmt(T[2], T[3], 0x7531u);
  return t;
}

// 5-bit codes (FORMAT.md section 6: a nibble word of the 4-bit magnitude, the sign in plane 4): the 16
// magnitudes' fp16 levels as byte tables, low bytes L[0..3] and high bytes H[0..3] (levels 0..7 in [0..1],
// 8..15 in [2..3]). For the four nibbles of the low half-word of x: their levels' low bytes (lo) and high
// bytes (hi), bytes in nibble order, from both halves of the tables, picked per byte by the nibble's bit 3
// (byte k of prmt(x, 16 x, 0x9D8C) replicates it, as in nibble_bytes); the caller ORs the signs into hi.
struct NibbleTables16 {
  uint32_t L[4], H[4];
};
__device__ __forceinline__ void nibble16_bytes(uint32_t x, uint32_t k16, const NibbleTables16& t, uint32_t& lo, uint32_t& hi) {
  const uint32_t sel = x & 0x7777u, up = prmt(x, x * k16, 0x9D8Cu);
  lo = (prmt(t.L[0], t.L[1], sel) & ~up) | (prmt(t.L[2], t.L[3], sel) & up);
  hi = (prmt(t.H[0], t.H[1], sel) & ~up) | (prmt(t.H[2], t.H[3], sel) & up);
}
// the tables from the fp16x2 level registers T[k] = level 2k | level 2k + 1 << 16 (k < 8)
__device__ __forceinline__ NibbleTables16 nibble16_tables(const uint32_t (&T)[8]) {
  NibbleTables16 t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    t.L[2 * h] = prmt(T[4 * h], T[4 * h + 1], 0x6420u);
    t.L[2 * h + 1] = prmt(T[4 * h + 2], T[4 * h + 3], 0x6420u);
    t.H[2 * h] = prmt(T[4 * h], T[4 * h + 1], 0x7531u);
    t.H[2 * h + 1] = prmt(T[4 * h + 2], T[4 * h + 3], 0x7531u);
  }
  return t;
}
// The signs of four coordinates (u: bits 0..3) as bit 7 of bytes 0..3 (bit k -> bit 8 k + 7; u < 16, so
// the four shifted copies do not overlap and nothing carries); the caller masks 0x80808080.
__device__ __forceinline__ uint32_t sign_bytes(uint32_t u) { return u * 0x10204080u; }

// Selector-form word of coordinates (i0, i0+16, i0+1, i0+17) of a group (i0 even, < 16) of one token,
// 3-bit codes: f is the field word (i0 >> 3). (2-bit codes: make_x2s; 4- and 5-bit codes are nibbles.)
__device__ __forceinline__ uint32_t make_x(uint32_t f, int i0) { return (f >> (i0 & 7)) & 0x03030303u; }

// 2-bit codes with the sign in the table index (idx = m | s << 1; the table holds levels 0, 1 and their
// negatives, so the lookup yields signed values and no sign work follows): bytes 0..3 = idx of
// coordinates i0, i0 + 1, i0 + 16, i0 + 17 from the magnitude plane f and the sign plane g (bit j =
// coordinate j). Masks on the integer ALU pipe, the moves as multiplies (FMA pipe).
__device__ __forceinline__ uint32_t make_x2s(uint32_t f, uint32_t g, int i0) {
  const uint32_t yf = f >> i0, yg = g >> i0;
  uint32_t z = yf & 0x00010001u;    // m(i0) -> bit 0, m(i0 + 16) -> bit 16
  z += (yg & 0x00010001u) * 2u;     // their signs -> bits 1, 17
  z += (yf & 0x00020002u) * 128u;   // m(i0 + 1) -> bit 8, m(i0 + 17) -> bit 24
  z += (yg & 0x00020002u) * 256u;   // their signs -> bits 9, 25
  return z;
}

// Sequence-level checks of a CTA (row offsets, length, slot, block-table stride). Reported once per
// sequence (by split 0 of kv head 0); every CTA of a bad sequence returns without writing.
__device__ __forceinline__ bool attn_sequence_ok(const AttnParams& p, int s, int h, int k, int64_t r0, int64_t n,
                                                 int64_t len, int32_t slot, int ns) {
  const bool rep = k == 0 && h == 0 && threadIdx.x == 0;
  const int64_t r1 = r0 + n;
  bool ok = true;
  if (s == 0 && r0 != 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 0, 0); }
  if (n < 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 1, 0); }
  if (s == p.num_seqs - 1 && r1 != p.q_rows) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, r1, 2, p.q_rows); }
  if (r0 < 0 || r1 > p.q_rows) ok = false;  // reported by the sequence whose offsets are wrong
  if (len < 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrNegLen, s, 0, len, 0); }
  if (n > len && len >= 0) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrQRows, s, n, len, 0); }
  if (p.max_len > 0 && len > p.max_len) { ok = false; if (rep) report_error(p.err, kInvalidArgument, kErrMaxSeqLen, s, len, p.max_len, 0); }
  if (!ok) return false;
  if (p.R > 0 && n > 0) {
    if (slot < 0 || slot >= p.num_slots) {
      if (rep) report_error(p.err, kOutOfRange, kErrSlot, s, 0, slot, p.num_slots);
      return false;
    }
  }
  const int64_t E = fmkv_compressed_end(p.S, p.W, len);
  // the tile loop counts token offsets within a split in 32 bits (vis, cnt): at most 2^30 per split
  if (E - p.S > ((int64_t)ns << 30)) {
    if (rep) report_error(p.err, kOverflow, kErrSplitSpan, s, E - p.S, ns, 0);
    return false;
  }
  // (E - 1 - S) / P >= stride, without the 64-bit division when stride * P cannot overflow (P <= 256)
  const bool short_table = p.bt_stride <= (INT64_MAX >> 8) ? E - 1 - p.S >= p.bt_stride * p.P
                                                            : (E - 1 - p.S) / p.P >= p.bt_stride;
  if (E > p.S && short_table) {
    if (rep) report_error(p.err, kOutOfRange, kErrTableStride, s, (E - 1 - p.S) / p.P + 1, 0, p.bt_stride);
    return false;
  }
  return true;
}

// fp16x2 words of a side's level table in shared memory (attn_kernel's s_tab, a copy per lane): two magnitudes
// per word, at least 4 (the 2-4 bit tables' layout; fp16 K keeps 4 unused rows): 8 for 5-bit codes.
__host__ __device__ constexpr int level_table_rows(int bits) {
  return bits == FMKV_FP16_BITS || bits < 5 ? 4 : 1 << (bits - 2);  // 2^(bits - 1) magnitudes, two per word
}

// Bytes of one 16-token tile of one kv head as staged in shared memory: the rows of the page layout
// (FORMAT.md) cut to 16 tokens, in page order: K code planes (64 B each), K scale rows (32 B each, one per
// code group: with scale group 64 each page row is staged twice, tile_copy_plan; k16: 16 tokens x D fp16
// instead), then the same for V.
template <int D, int KB, int VB>
struct TileGeom {
  static constexpr int G = D / 32;
  static constexpr int kbytes = KB == FMKV_FP16_BITS ? 32 * D : G * KB * 64 + G * 32;
  static constexpr int vbytes = G * VB * 64 + G * 32;
  static constexpr int bytes = kbytes + vbytes;
  static constexpr int chunks = bytes / 16;
  // per-warp pipeline depth: 3 stages (the tile computed and 2 in flight) when the CTA's stages fit
  // in 64 KB, else 2
  static constexpr int stages = kAttnWarps * 3 * bytes <= 64 * 1024 ? 3 : 2;
  static constexpr int stage_bytes = kAttnWarps * stages * bytes;
  static constexpr int combine_bytes = kAttnWarps * kQV * D * 4;  // sm_acc (one half of a pass at a time)
  static constexpr int smem = stage_bytes > combine_bytes ? stage_bytes : combine_bytes;
  // + the Q rotation buffer of a pass of NH x kQV vectors; the sink/window CTA uses the same dynamic shared
  // memory for the fp16 part (Fp16Geom)
  static constexpr int smem_total(int NH) {
    return smem + NH * kQV * D * 4 > Fp16Geom<D>::bytes ? smem + NH * kQV * D * 4 : Fp16Geom<D>::bytes;
  }
};

// ---- Split CTAs. Warp w of split sp takes the tiles tb + w + 4k of the split's range [tb, te) (the warp
// steps kTokensPerStep = 64 tokens per tile), lane = 4 gID + tid. Mapping of one warp and 16-token tile
// (mma.m16n8k16 fragments): mma row / k index r of the tile stands for token pi(r) = 2r (r < 8),
// 2(r - 8) + 1 (r >= 8), so that a lane's two K tokens are adjacent words of a staged plane row (one 8-byte
// load) and its four V tokens one 16-byte load:
//   K (A operand, 16 tokens x 16 coordinates): tokens 2 gID (a0, a2) and 2 gID + 1 (a1, a3); coordinates:
//     tile_scores.   Q (B operand): query vector gID, the same coordinates (tile_lane_setup packs them).
//   S (C fragment): tokens 2 gID, 2 gID + 1 x query vectors 2 tid, 2 tid + 1: a lane's softmax state is that
//     of queries 2 tid, 2 tid + 1 (tile_softmax).
//   P -> B operand of the V mma (k = 2 tid, 2 tid + 1, 2 tid + 8, 2 tid + 9, i.e. tokens 4 tid, 4 tid + 2,
//     4 tid + 1, 4 tid + 3, x query gID) by movmatrix.trans, after the token's V scale has been folded into
//     P (fp32, before fp16 rounding).
//   V (A operand, 16 coordinates x 16 tokens): tokens 4 tid .. 4 tid + 3 (pairs (4 tid, 4 tid + 2),
//     (4 tid + 1, 4 tid + 3)); coordinates of each group: 2 gID, 2 gID + 16 (mma 0) and 2 gID + 1,
//     2 gID + 17 (mma 1), 4- and 5-bit V: 4 gID, 4 gID + 1 (mma 0) and 4 gID + 2, 4 gID + 3 (mma 1).
//   O^T (C fragment of the V mma): those coordinates x queries 2 tid, 2 tid + 1.
// A pass of a split CTA takes NH halves of kQV query vectors (NH = 2: "wide" kernels, groups of more than kQV
// query vectors per (sequence, kv head), attn_compiled_wide): vector i of the pass is column i % kQV of half
// i / kQV, whose mma columns, softmax state and accumulators are the lane's own (a second set of each); a tile is
// staged and decoded once per pass for both halves.
constexpr uint32_t kTokensPerStep = 16 * kAttnWarps;  // a warp's consecutive tiles are this many tokens apart
constexpr int kQVPerWarp = kQV / kAttnWarps;          // query vectors a warp loads and rotates per half
constexpr int kMaxHalves = 2;                         // NH <= kMaxHalves
static_assert(kQV % kAttnWarps == 0, "whole query vectors per warp");

// The split CTA's static shared memory (declared in attn_kernel; the kernel's prologue fills tab and pow2).
template <int D, int NH>
struct SplitShared {
  float (&qmax)[NH * kQV];                       // max |q| of the pass's vectors
  const uint32_t (*tab)[32];                     // K (rows 0 .. kTabRows(KB) - 1) and V level tables, a copy per lane
  uint32_t (&pow2)[32];                          // 1 << i (the multipliers of TileLane::kmul, vmul, kmul5, vmul5)
  uint2 (&qb)[kAttnWarps][NH][D / 32][2][32];    // each warp's copy of its lanes' Q fragments (B operand), per half
  float (&m)[kAttnWarps][NH * kQV], (&l)[kAttnWarps][NH * kQV];  // each warp's (m, l) for the combine
  int64_t (&vpos)[NH * kQV], (&vpart)[NH * kQV];  // the pass's vectors: position (causal limit), partial index
};

// Where lane `lane`'s cp.async chunks of a tile come from: chunk c = lane + 32 i of the tile (TileGeom
// order) lands at byte 16 c of the stage; its source is the page's head base + ch_off[i] + t0 ch_mul[i]
// (t0 = the tile's first token in its page); ch_off[i] = -1: the lane has no chunk i.
template <int D, int KB, int VB, int P, int NCH, bool F3>
__device__ __forceinline__ void tile_copy_plan(const AttnParams& p, int lane, int (&ch_off)[NCH], int (&ch_mul)[NCH]) {
  using TG = TileGeom<D, KB, VB>;
  constexpr int G = D / 32;
  constexpr bool K16 = KB == FMKV_FP16_BITS;
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    const int c = lane + 32 * i;
    ch_off[i] = -1;
    ch_mul[i] = 0;
    if (c < TG::chunks) {
      int off = 16 * c, sec = 0, sec_page_off = 0, bits = KB;
      if (off >= TG::kbytes) { off -= TG::kbytes; sec = 1; sec_page_off = (int)p.ksec_bytes; bits = VB; }
      const bool tiled = sec == 0 ? kTiled<KB, F3> : kTiled<VB, F3>;
      if (sec == 0 && K16) {
        ch_off[i] = off;
        ch_mul[i] = 2 * D;
      } else if (off < G * bits * 64 && tiled) {  // format 3: the tile's code block (t0 a multiple of 16)
        ch_off[i] = sec_page_off + off;
        ch_mul[i] = 4 * G * bits;
      } else if (off < G * bits * 64) {  // code plane row r, part q
        ch_off[i] = sec_page_off + (off / 64) * P * 4 + off % 64;
        ch_mul[i] = 4;
      } else {  // scale row of code group off / 32: the page's row (off / 32) >> ss (scale group 64: twice)
        off -= G * bits * 64;
        ch_off[i] = sec_page_off + G * bits * P * 4 + ((off / 32) >> p.ss) * P * 2 + off % 32;
        ch_mul[i] = 2;
      }
    }
  }
}

// Q of a pass, requested: warp w loads query vectors vb + w + 4 u (u < NH x kQVPerWarp; lane: coordinates
// lane + 32 r) into xq[u] (0 past the call's vectors: load_elems skips offset -1) and lane 0 records each
// vector's position and partial index (-1 past the call's vectors) in sh.vpos / sh.vpart.
template <int D, int NH>
__device__ __forceinline__ void split_q_request(const AttnParams& p, int h, int64_t r0, int64_t n, int64_t len,
                                                int64_t vb, int64_t nqv, int warp, int lane, const SplitShared<D, NH>& sh,
                                                float (&xq)[NH * kQVPerWarp][D / 32], int64_t (&qrow)[NH * kQVPerWarp],
                                                int (&qhead)[NH * kQVPerWarp]) {
  constexpr int NR = D / 32, NU = NH * kQVPerWarp;
  int64_t qoff[NU * NR];
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    const int i = warp + u * kAttnWarps;
    const int64_t v = vb + i;
    int64_t vr;  // query row (within the sequence) and q head of vector v (warp-uniform)
    int vh;
    split_vector(v, p.gq, vr, vh);
    qrow[u] = r0 + vr;
    qhead[u] = h * p.gq + vh;
    if (lane == 0) {  // this vector's position and partial index, for the softmax mask and the combine
      sh.vpos[i] = v < nqv ? len - n + vr : -1;
      sh.vpart[i] = v < nqv ? partial_row_base(p, qrow[u], qhead[u]) : -1;
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) qoff[u * NR + r] = v < nqv ? qrow[u] * p.q_rs + qhead[u] * p.q_hs + lane + 32 * r : -1;
  }
  load_elems<NU * NR>(p.q, p.q_dtype, qoff, reinterpret_cast<float(&)[NU * NR]>(xq));
}

// Q of a pass, prepared (same mapping as split_q_request): each value checked (NaN / Inf: reported, used as
// 0), the vector rotated in the warp's registers (signs, FWHT, 1/sqrt(D); not for fp16 K, which the cache
// holds unrotated) and stored to sq[i] (i = w + 4 u), its max |q| to sh.qmax[i].
template <int D, bool K16, int NH>
__device__ __forceinline__ void split_q_rotate(const AttnParams& p, int warp, int lane, float (&xq)[NH * kQVPerWarp][D / 32],
                                               const int64_t (&qrow)[NH * kQVPerWarp], const int (&qhead)[NH * kQVPerWarp],
                                               float (*sq)[D], const SplitShared<D, NH>& sh) {
  constexpr int NR = D / 32;
#pragma unroll
  for (int u = 0; u < NH * kQVPerWarp; ++u) {
    const int i = warp + u * kAttnWarps;
    float(&x)[NR] = xq[u];
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (!isfinite(x[r])) {
        report_error(p.err, kNonFinite, kErrNonFiniteQ, 0, qrow[u], qhead[u], lane + 32 * r);
        x[r] = 0.0f;
      }
    if (!K16) warp_rotate<D>(x, p.sw, lane);  // signs, FWHT, 1/sqrt(D)
    float m = 0.0f;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      sq[i][lane + 32 * r] = x[r];
      m = fmaxf(m, fabsf(x[r]));
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) sh.qmax[i] = m;
  }
}

// A lane's loop-invariant values of the tile loop (tile_lane_setup).
struct TileLane {
  uint32_t TK[4], TV[4];   // fp16x2 level tables T[k] = level 2k | level 2k + 1 << 16 (2-bit: T[1] negated T[0])
  NibbleTables NK, NV;     // 4-bit codes: the same levels as byte tables (nibble_bytes)
  NibbleTables16 NK5, NV5; // 5-bit codes: the 16 magnitudes as byte tables (nibble16_bytes)
  uint32_t kmul5[2], vmul5;  // 5-bit codes: multipliers that move a lane's four sign bits to bits 28..31
  uint32_t k16, vsel;      // 16 (the sign move of nibble_bytes); 4-bit V: the byte interleave of two tokens
  uint32_t z;              // format-3 V: 0x0808, the zero low bytes' selector nibbles (tile_v_fragment)
  bool softcapped;
  float inv_cap, fac2[kMaxHalves][2];  // 1 / softcap; score factor of queries 2 tid + j of half hh (max |q| x scale, log2 units)
  uint32_t kmul[2], vmul;  // multipliers that move sign / magnitude-bit planes into bits 15 / 31
  int vlim[kMaxHalves][2], tlim;  // visibility thresholds on a tile's token offset (tile_softmax, tile_pv)
};

// Before the tile loop of a pass (after the barrier that publishes sq, sh.qmax and sh.tab): this lane's
// TileLane, and this warp's Q fragments (B operand of half hh: query vector kQV hh + gID normalised to max |q| = 1,
// fp16) to qb = sh.qb[warp], in the coordinate order the K decode of tile_scores pairs. ci_first: the warp's first
// compressed token; C: the sequence's compressed tokens.
template <int D, int KB, int VB, bool F3, int NH>
__device__ __forceinline__ void tile_lane_setup(const AttnParams& p, int lane, int gID, int tid, const SplitShared<D, NH>& sh,
                                                const float (*sq)[D], uint2 (&qbh)[NH][D / 32][2][32], uint64_t ci_first,
                                                int64_t C, TileLane& L) {
  constexpr int G = D / 32, RK = level_table_rows(KB);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    L.TK[k] = sh.tab[k][lane];
    L.TV[k] = sh.tab[RK + k][lane];
  }
  if (KB == 2) L.TK[1] = L.TK[0] ^ kSignMask;  // 2-bit: the signed table of make_x2s
  if (VB == 2) L.TV[1] = L.TV[0] ^ kSignMask;
  L.NK = nibble_tables(L.TK);  // 4-bit codes (used only then)
  L.NV = nibble_tables(L.TV);
  if constexpr (KB == 5) {
    uint32_t T[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) T[k] = sh.tab[k][lane];
    L.NK5 = nibble16_tables(T);
  }
  if constexpr (VB == 5) {
    uint32_t T[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) T[k] = sh.tab[RK + k][lane];
    L.NV5 = nibble16_tables(T);
  }
  // 5-bit K: the signs of coordinates 8 tid + 4 c .. + 3 (bits of sign plane 4) x kmul5[c] -> bits 28..31;
  // 5-bit V: those of 4 gID .. + 3 x vmul5
  L.kmul5[0] = sh.pow2[28 - 8 * tid];
  L.kmul5[1] = sh.pow2[24 - 8 * tid];
  L.vmul5 = sh.pow2[28 - 4 * gID];
  L.k16 = sh.pow2[4];
  // 4- and 5-bit K: this lane's nibbles are word tid of the group, half-word c for chunk c (coordinates
  // 8 tid + 4 c .. + 3); 4- and 5-bit V: half-word gID & 1 of word gID >> 1 (coordinates 4 gID .. + 3),
  // the two tokens' bytes interleaved first (selector vsel)
  L.vsel = (gID & 1) ? 0x7362u : 0x5140u;
  L.z = sh.pow2[3] * 0x0101u;  // 0x0808, from shared memory: a register operand of the LOP3
  // B operand: query vector gID of each half, normalised to max |q| = 1; kept in shared memory and read per tile
  // (ld.volatile: not hoisted into 16 registers, which would cost occupancy)
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    const int qi = kQV * hh + gID;
    uint2(&qb)[D / 32][2][32] = qbh[hh];
    if constexpr (kTiled<KB, F3>) {
      // format 3: q16 = q x 32639 / max |q| rounded, in two int8 parts (qh, ql): b0 / b1 of mma.m16n8k32 =
      // coordinates 32 g + 4 tid .. + 3 / 32 g + 16 + 4 tid .. + 3 (tile_k_fragment's k order)
      const float qmax = sh.qmax[qi], qs = qmax > 0.0f ? kTileQScale / qmax : 0.0f;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        uint32_t hw[2], lw[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          hw[j] = 0u;
          lw[j] = 0u;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int q16 = __float2int_rn(sq[qi][32 * g + 16 * j + 4 * tid + e] * qs);
            const int qh = (q16 + 128) >> 8, ql = q16 - 256 * qh;
            hw[j] |= ((uint32_t)qh & 0xffu) << (8 * e);
            lw[j] |= ((uint32_t)ql & 0xffu) << (8 * e);
          }
        }
        qb[g][0][lane] = make_uint2(hw[0], hw[1]);
        qb[g][1][lane] = make_uint2(lw[0], lw[1]);
      }
    } else {
      const float qmax = sh.qmax[qi], qinv = qmax > 0.0f ? 1.0f / qmax : 0.0f;
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          // k pairs (2 tid, 2 tid + 1) and (2 tid + 8, 2 tid + 9) hold the coordinates the K decode pairs:
          // 3 bits and fp16 K: (b, b + 16), (b + 1, b + 17) with b = 32 g + 8 c + 2 tid; 2 bits (make_x2s order):
          // (b, b + 1), (b + 16, b + 17)
          // 4 and 5 bits (nibbles): (b, b + 1), (b + 2, b + 3) with b = 32 g + 8 tid + 4 c
          constexpr bool NIB = KB == 4 || KB == 5;
          const int b = NIB ? 32 * g + 8 * tid + 4 * c : 32 * g + 8 * c + 2 * tid;
          const int o1 = KB == 2 || NIB ? 1 : 16, o2 = KB == 2 ? 16 : NIB ? 2 : 1, o3 = NIB ? 3 : 17;
          qb[g][c][lane] = make_uint2(pack_half2(sq[qi][b] * qinv, sq[qi][b + o1] * qinv),
                                      pack_half2(sq[qi][b + o2] * qinv, sq[qi][b + o3] * qinv));
        }
    }
  }
  // this lane's softmax rows: query vectors 2 tid + j of each half
  L.softcapped = p.softcap > 0.0f;
  L.inv_cap = L.softcapped ? 1.0f / p.softcap : 0.0f;
#pragma unroll
  for (int hh = 0; hh < NH; ++hh)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      // (format-3 K: int32 sums of q16 x integer levels, so also x step / 32639)
      const float fac =
          sh.qmax[kQV * hh + 2 * tid + j] * p.sm_scale * (kTiled<KB, F3> ? p.tile_step[0] / kTileQScale : 1.0f);
      // scores are kept in log2 units (x log2 e) inside the tile loop; m is converted back at the end
      L.fac2[hh][j] = p.softcap > 0.0f ? fac : fac * kLog2e;
    }
  // Sign (and 4-bit magnitude bit 2) planes are moved into bits 15 / 31 by multiplying with per-lane
  // powers of two: IMAD issues to the FMA pipe, a shift (SHF) to the integer ALU pipe, the tile
  // loop's busiest (CUDA-NOTES "Floors"). K: coordinate 8c + 2 tid -> bit 15; V: coordinate 2 gID.
  // Read from shared memory: a multiplier ptxas knows to be a power of two becomes a shift again.
  L.kmul[0] = sh.pow2[15 - 2 * tid];
  L.kmul[1] = sh.pow2[7 - 2 * tid];
  L.vmul = sh.pow2[15 - 2 * gID];
  // Per-lane thresholds on koff (tile k's first token offset from the warp's first token, 64 k): this
  // lane's token 2 gID + e of the tile is visible to query 2 tid + j iff koff + e <= vlim[j] (causal
  // limit and last token, relative to the lane's token 2 gID), and exists iff koff + e < tlim. In 32
  // bits: offsets are clamped to 2^30, beyond every token of the warp's tiles (attn_sequence_ok
  // rejects a split of more than 2^30 tokens).
  const int64_t rel0 = (int64_t)p.S + (int64_t)ci_first, crem = (int64_t)C - (int64_t)ci_first;
  const int cnt = crem > (1 << 30) ? (1 << 30) : (int)crem;  // tokens from the warp's first one
#pragma unroll
  for (int hh = 0; hh < NH; ++hh)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t pj = sh.vpos[kQV * hh + 2 * tid + j], r = pj < 0 ? -1 : pj - rel0;  // causal limit (-1: none)
      const int lim = r < cnt - 1 ? (int)r : cnt - 1;
      L.vlim[hh][j] = lim - 2 * gID;
    }
  L.tlim = cnt - 2 * gID;
}

// c4[hh] += K Q^T of one K fragment (a0 .. a3) and the Q fragments of group g, chunk c of each half hh.
template <int NH, int G>
__device__ __forceinline__ void mma_halves(float (&c4)[NH][4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           const uint2 (&qb)[NH][G][2][32], int g, int c, int lane) {
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
    const uint2 qf = load_shared_u2(&qb[hh][g][c][lane]);
    mma16816(c4[hh], a0, a1, a2, a3, qf.x, qf.y);
  }
}

// S = K Q^T of one staged tile: sc[hh][k] (zero on entry) += score of token 2 gID + (k >> 1) and query
// 2 tid + (k & 1) of half hh, in units of the normalised Q (tile_softmax applies max |q| x scale); the K
// fragments are decoded once for every half. The lane decodes
// tokens a = 2 gID, b = 2 gID + 1 (ka: their fp16 K rows; else kw: their words of code plane 0 of group 0,
// ks: their scales of group 0) and, of each group g and chunk c (an mma each): 3 bits and fp16 K
// coordinates (i0, i0 + 16) (a0 / a1) and (i0 + 1, i0 + 17) (a2 / a3) with i0 = 8 c + 2 tid; 2 bits
// (i0, i0 + 1) and (i0 + 16, i0 + 17); 4 and 5 bits the nibbles of half-word c of word tid (coordinates
// 8 tid + 4 c .. + 3; 5 bits: with bits 8 tid + 4 c .. + 3 of sign plane 4) -- the pairs qb (this warp's Q
// fragments) holds Q in. Each group's mma result (its
// own accumulator) is multiplied by the token's fp16 scale in fp32.
template <int D, int KB, bool F3, int NH>
__device__ __forceinline__ void tile_scores(const uint16_t* ka, const uint32_t* kw, const uint32_t* ks,
                                            const uint2 (&qb)[NH][D / 32][2][32], int lane, int tid, const TileLane& L,
                                            float (&sc)[NH][4]) {
  constexpr int G = D / 32;
  constexpr bool K16 = KB == FMKV_FP16_BITS;
  constexpr int KW = K16 ? 1 : KB;  // code words per group and token (K)
  if constexpr (kTiled<KB, F3>) {  // format 3 (kw: the staged tile block): two IMMA per group, exact int32
    uint32_t X[G], Y[G];
    tile_load<G>((const uint8_t*)kw, lane, X, Y);
    int d[G][NH][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      uint32_t a[4];
      tile_k_fragment(X[g], Y[g], a);
#pragma unroll
      for (int hh = 0; hh < NH; ++hh) {
#pragma unroll
        for (int i = 0; i < 4; ++i) d[g][hh][i] = 0;
        const uint2 qh = load_shared_u2(&qb[hh][g][0][lane]);
        mma16832s8(d[g][hh], a[0], a[1], a[2], a[3], qh.x, qh.y);
#pragma unroll
        for (int i = 0; i < 4; ++i) d[g][hh][i] <<= 8;
        const uint2 ql = load_shared_u2(&qb[hh][g][1][lane]);
        mma16832s8(d[g][hh], a[0], a[1], a[2], a[3], ql.x, ql.y);
      }
    }
#pragma unroll
    for (int g = G - 1; g >= 0; --g) {
      const uint32_t s2 = ks[g * 8];
      const float fa = h_lo(s2), fb = h_hi(s2);
#pragma unroll
      for (int hh = 0; hh < NH; ++hh) {
        sc[hh][0] += (float)d[g][hh][0] * fa;
        sc[hh][1] += (float)d[g][hh][1] * fa;
        sc[hh][2] += (float)d[g][hh][2] * fb;
        sc[hh][3] += (float)d[g][hh][3] * fb;
      }
    }
  } else if constexpr (K16) {
    const uint16_t* kb = ka + D;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int b = 32 * g + 8 * c + 2 * tid;
        const uint32_t a0 = (uint32_t)ka[b] | ((uint32_t)ka[b + 16] << 16);
        const uint32_t a1 = (uint32_t)kb[b] | ((uint32_t)kb[b + 16] << 16);
        const uint32_t a2 = (uint32_t)ka[b + 1] | ((uint32_t)ka[b + 17] << 16);
        const uint32_t a3 = (uint32_t)kb[b + 1] | ((uint32_t)kb[b + 17] << 16);
        mma_halves<NH, G>(sc, a0, a1, a2, a3, qb, g, c, lane);
      }
  } else {
    float c4g[G][NH][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float(&c4)[NH][4] = c4g[g];
#pragma unroll
      for (int hh = 0; hh < NH; ++hh)
#pragma unroll
        for (int i = 0; i < 4; ++i) c4[hh][i] = 0.0f;
      if constexpr (KB == 5) {  // magnitude nibbles as for 4 bits, from 16-entry tables; signs from plane 4
        const uint2 w2 = *(const uint2*)(kw + (g * 5 + tid) * 16);  // word tid of tokens a, b
        const uint2 s2 = *(const uint2*)(kw + (g * 5 + 4) * 16);    // their sign planes
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          uint32_t la, ha, lb, hb;
          nibble16_bytes(c ? w2.x >> 16 : w2.x, L.k16, L.NK5, la, ha);
          nibble16_bytes(c ? w2.y >> 16 : w2.y, L.k16, L.NK5, lb, hb);
          ha |= sign_bytes((s2.x * L.kmul5[c]) >> 28) & 0x80808080u;
          hb |= sign_bytes((s2.y * L.kmul5[c]) >> 28) & 0x80808080u;
          mma_halves<NH, G>(c4, prmt(la, ha, 0x5140u), prmt(lb, hb, 0x5140u), prmt(la, ha, 0x7362u),
                            prmt(lb, hb, 0x7362u), qb, g, c, lane);
        }
      } else if constexpr (KB == 4) {  // nibbles: two pairs per token from one half-word, no sign work after
        const uint2 w2 = *(const uint2*)(kw + (g * 4 + tid) * 16);  // word tid of tokens a, b
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          uint32_t la, ha, lb, hb;
          nibble_bytes(c ? w2.x >> 16 : w2.x, L.k16, L.NK, la, ha);
          nibble_bytes(c ? w2.y >> 16 : w2.y, L.k16, L.NK, lb, hb);
          mma_halves<NH, G>(c4, prmt(la, ha, 0x5140u), prmt(lb, hb, 0x5140u), prmt(la, ha, 0x7362u),
                            prmt(lb, hb, 0x7362u), qb, g, c, lane);
        }
      } else {  // planes: the group's words of tokens a (2 gID) and b (2 gID + 1)
        uint32_t wa[KW], wb[KW];
#pragma unroll
        for (int k = 0; k < KW; ++k) {
          const uint2 w2 = *(const uint2*)(kw + (g * KB + k) * 16);
          wa[k] = w2.x;
          wb[k] = w2.y;
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int i0 = 8 * c + 2 * tid;
          const uint32_t m0 = L.kmul[c], m1 = L.kmul[c] >> 1;  // x m0 (m1): coordinate i0 (+1) -> bit 15
          const uint2 sa = pair_selectors(KB == 2 ? make_x2s(wa[0], wa[1], i0) : make_x(wa[c], i0));
          const uint2 sb = pair_selectors(KB == 2 ? make_x2s(wb[0], wb[1], i0) : make_x(wb[c], i0));
          uint32_t a0, a1, a2, a3;
          if (KB == 2) {  // signed table: (i0, i0 + 1) and (i0 + 16, i0 + 17) of tokens a, b
            a0 = lookup(sa.x, L.TK);
            a1 = lookup(sb.x, L.TK);
            a2 = lookup(sa.y, L.TK);
            a3 = lookup(sb.y, L.TK);
          } else {
            a0 = lookup(sa.x, L.TK) ^ ((wa[KW - 1] * m0) & kSignMask);
            a1 = lookup(sb.x, L.TK) ^ ((wb[KW - 1] * m0) & kSignMask);
            a2 = lookup(sa.y, L.TK) ^ ((wa[KW - 1] * m1) & kSignMask);
            a3 = lookup(sb.y, L.TK) ^ ((wb[KW - 1] * m1) & kSignMask);
          }
          mma_halves<NH, G>(c4, a0, a1, a2, a3, qb, g, c, lane);
        }
      }
    }
    // Scaled and summed from the last group to the first: group 0's accumulator is consumed
    // last, so every group's mma pair has its own registers and the pairs overlap (consumed in
    // mma order, ptxas reused one accumulator and each group's mma waited for the previous
    // group's result: 1.010-1.019x, docs/history/cuda-decode-tile-loop.md)
#pragma unroll
    for (int g = G - 1; g >= 0; --g) {
      const uint32_t s2 = ks[g * 8];
      const float fa = h_lo(s2), fb = h_hi(s2);
#pragma unroll
      for (int hh = 0; hh < NH; ++hh) {
        sc[hh][0] += c4g[g][hh][0] * fa;
        sc[hh][1] += c4g[g][hh][1] * fa;
        sc[hh][2] += c4g[g][hh][2] * fb;
        sc[hh][3] += c4g[g][hh][3] * fb;
      }
    }
  }
}

// Online softmax of the lane's queries 2 tid + j of half hh over its tokens 2 gID + e of the tile (koff: the
// tile's first token from the warp's first; the 8 lanes of equal tid share a query): pr[k] = exp2(score - m_run)
// of token 2 gID + (k >> 1), query 2 tid + (k & 1) (0 where not visible); m_run (log2 units) and l_run
// updated, acc (O of the same queries) rescaled when the running max moves.
template <int G>
__device__ __forceinline__ void tile_softmax(const AttnParams& p, const float (&sc)[4], int koff, const TileLane& L, int hh,
                                             float (&m_run)[2], float (&l_run)[2], float (&acc)[G][2][4],
                                             float (&pr)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) pr[k] = sc[k] * L.fac2[hh][k & 1];
  if (L.softcapped) {  // uniform branch
#pragma unroll
    for (int k = 0; k < 4; ++k) pr[k] = p.softcap * tanhf(pr[k] * L.inv_cap) * kLog2e;
  }
  // Lazy running max: m_run (uniform over the 8 lanes of a query) moves only when a score of the
  // tile exceeds it. Then (a uniform branch; per tile 1 - 1/(k + 1) of iid tiles skip it) the max
  // over the 8 lanes, the factor, and l and O rescaled; else P uses m_run as it is -- the same
  // values as an update every tile (m_new == m_run, factor 1), without its shuffles and ex2.
  float lm[2] = {-INFINITY, -INFINITY};  // this lane's max of query 2 tid + j over its 2 tokens
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int e = k >> 1, j = k & 1;  // token 2 gID + e, query 2 tid + j
    pr[k] = koff + e <= L.vlim[hh][j] ? pr[k] : -INFINITY;
    lm[j] = fmaxf(lm[j], pr[k]);
  }
  if (__any_sync(0xffffffffu, lm[0] > m_run[0] || lm[1] > m_run[1])) {
    float corr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int o = 4; o <= 16; o <<= 1) lm[j] = fmaxf(lm[j], __shfl_xor_sync(0xffffffffu, lm[j], o));
      const float m_new = fmaxf(m_run[j], lm[j]);
      corr[j] = m_new == -INFINITY ? 1.0f : fast_exp2(m_run[j] - m_new);
      l_run[j] *= corr[j];
      m_run[j] = m_new;
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[g][mt][k] *= corr[k & 1];
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float ms = m_run[j] == -INFINITY ? 0.0f : m_run[j];  // all masked so far: p = exp2(-inf) = 0
    pr[j] = fast_exp2(pr[j] - ms);
    pr[j + 2] = fast_exp2(pr[j + 2] - ms);
    l_run[j] += pr[j] + pr[j + 2];
  }
}

// O^T += V^T P^T of one staged tile: the lane's V coordinates of each group (the V mapping above) x its
// tokens 4 tid .. 4 tid + 3 (vw: their words of code plane 0 of group 0; vs: the V scales of tokens 2 gID,
// 2 gID + 1 of group 0), P of each half (pr[hh], tile_softmax's C-fragment layout) times the tokens' V scales (0
// from token offset tlim on), rounded to fp16 and transposed into the B operand; the V fragments are decoded once
// for every half.
template <int D, int VB, bool F3, int NH>
__device__ __forceinline__ void tile_pv(const uint32_t* vw, const uint32_t* vs, const float (&pr)[NH][4], int koff, int tlim,
                                        int gID, const TileLane& L, float (&acc)[NH][D / 32][2][4], int lane) {
  constexpr int G = D / 32;
  const int i0v = 2 * gID, fwv = gID >> 2;
  uint32_t XV[G], YV[G];  // format 3: the lane's words of the staged V tile block
  if constexpr (kTiled<VB, F3>) tile_load<G>((const uint8_t*)vw, lane, XV, YV);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    // P x token scale (fp32, then fp16: p <= 1 and |scale| <= 65504 cannot overflow), transposed
    // (tokens past the end get scale 0: their bytes may be uninitialised, and 0 x Inf is NaN)
    const uint32_t vs2 = vs[g * 8];
    const float sa = koff < tlim ? h_lo(vs2) : 0.0f, sb = koff + 1 < tlim ? h_hi(vs2) : 0.0f;
    uint32_t pb0[NH], pb1[NH];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      pb0[hh] = movmatrix_trans(pack_half2(pr[hh][0] * sa, pr[hh][1] * sa));
      pb1[hh] = movmatrix_trans(pack_half2(pr[hh][2] * sb, pr[hh][3] * sb));
    }
    uint32_t aA0, aA1, aA2, aA3, aB0, aB1, aB2, aB3;
    if constexpr (kTiled<VB, F3>) {
      uint32_t a[8];
      tile_v_fragment(XV[g], YV[g], L.z, a);
      aA0 = a[0]; aA1 = a[1]; aA2 = a[2]; aA3 = a[3];
      aB0 = a[4]; aB1 = a[5]; aB2 = a[6]; aB3 = a[7];
    } else if constexpr (VB == 5) {
      // as for 4 bits (below), the magnitudes from 16-entry tables; the signs of coordinates 4 gID .. + 3 of
      // tokens a .. d (plane 4) as bits 0..3 of ua .. ud, moved to bit 7 of the hi bytes (nibble order a n, a n',
      // b n, b n': n, n' = coordinates 4 gID, + 1 of the low half-word, + 2, + 3 of the high one; each
      // product's shifted copies of a value < 16 are disjoint, so nothing carries)
      const uint4 n4 = *(const uint4*)(vw + (g * 5 + (gID >> 1)) * 16);
      const uint4 s4 = *(const uint4*)(vw + (g * 5 + 4) * 16);
      const uint32_t zab = prmt(n4.x, n4.z, L.vsel), zcd = prmt(n4.y, n4.w, L.vsel);
      const uint32_t ua = (s4.x * L.vmul5) >> 28, ub = (s4.z * L.vmul5) >> 28;
      const uint32_t uc = (s4.y * L.vmul5) >> 28, ud = (s4.w * L.vmul5) >> 28;
      auto pairs = [&](uint32_t z, uint32_t sg, uint32_t& p0, uint32_t& p1) {
        uint32_t lo, hi;
        nibble16_bytes(z, L.k16, L.NV5, lo, hi);
        hi |= sg & 0x80808080u;
        p0 = prmt(lo, hi, 0x6240u);
        p1 = prmt(lo, hi, 0x7351u);
      };
      pairs(zab, ua * 0x00004080u + ub * 0x40800000u, aA0, aA1);
      pairs(zcd, uc * 0x00004080u + ud * 0x40800000u, aA2, aA3);
      pairs(zab >> 16, ua * 0x00001020u + ub * 0x10200000u, aB0, aB1);
      pairs(zcd >> 16, uc * 0x00001020u + ud * 0x10200000u, aB2, aB3);
    } else if constexpr (VB == 4) {
      // nibbles of tokens (a, b), (c, d) interleaved bytewise, then per half-word two fp16 pairs
      // (coordinate n; token pair): aA = n0, n1 = 4 gID, 4 gID + 1, aB = n2, n3
      const uint4 n4 = *(const uint4*)(vw + (g * 4 + (gID >> 1)) * 16);
      const uint32_t zab = prmt(n4.x, n4.z, L.vsel), zcd = prmt(n4.y, n4.w, L.vsel);
      auto pairs = [&](uint32_t z, uint32_t& p0, uint32_t& p1) {
        uint32_t lo, hi;
        nibble_bytes(z, L.k16, L.NV, lo, hi);
        p0 = prmt(lo, hi, 0x6240u);
        p1 = prmt(lo, hi, 0x7351u);
      };
      pairs(zab, aA0, aA1);
      pairs(zcd, aA2, aA3);
      pairs(zab >> 16, aB0, aB1);
      pairs(zcd >> 16, aB2, aB3);
    } else {
      const int wi = (g * VB + (VB == 2 ? 0 : fwv)) * 16, si = (g * VB + VB - 1) * 16;
      // token pairs (a, b) = (4 tid, 4 tid + 2), (c, d) = (4 tid + 1, 4 tid + 3)
      const uint4 f4 = *(const uint4*)(vw + wi), g4 = *(const uint4*)(vw + si);
      const uint2 fab = make_uint2(f4.x, f4.z), fcd = make_uint2(f4.y, f4.w);
      const uint2 gab = make_uint2(g4.x, g4.z), gcd = make_uint2(g4.y, g4.w);
      const uint32_t m0 = L.vmul, m1 = L.vmul >> 1;  // x m0 (m1): coordinate i0v (+1) -> bit 15
      if (VB == 2) {  // signed table (make_x2s): no sign planes to pair or apply
        const uint32_t xa = make_x2s(fab.x, gab.x, i0v), xb = make_x2s(fab.y, gab.y, i0v);
        const uint32_t xc = make_x2s(fcd.x, gcd.x, i0v), xd = make_x2s(fcd.y, gcd.y, i0v);
        // selector-form words of token pairs: bytes (a, b) of coordinate i0 | i0+16 (s1), i0+1 | i0+17 (s2)
        const uint2 s1ab = pair_selectors(prmt(xa, xb, 0x6240u)), s2ab = pair_selectors(prmt(xa, xb, 0x7351u));
        const uint2 s1cd = pair_selectors(prmt(xc, xd, 0x6240u)), s2cd = pair_selectors(prmt(xc, xd, 0x7351u));
        aA0 = lookup(s1ab.x, L.TV);
        aA1 = lookup(s1ab.y, L.TV);
        aA2 = lookup(s1cd.x, L.TV);
        aA3 = lookup(s1cd.y, L.TV);
        aB0 = lookup(s2ab.x, L.TV);
        aB1 = lookup(s2ab.y, L.TV);
        aB2 = lookup(s2cd.x, L.TV);
        aB3 = lookup(s2cd.y, L.TV);
      } else {
        // selector-form words of token pairs: bytes (a, b) of coordinate i0 | i0+16 (x1), i0+1 | i0+17 (x2)
        const uint32_t xa = make_x(fab.x, i0v), xb = make_x(fab.y, i0v);
        const uint32_t xc = make_x(fcd.x, i0v), xd = make_x(fcd.y, i0v);
        const uint2 s1ab = pair_selectors(prmt(xa, xb, 0x5140u)), s2ab = pair_selectors(prmt(xa, xb, 0x7362u));
        const uint2 s1cd = pair_selectors(prmt(xc, xd, 0x5140u)), s2cd = pair_selectors(prmt(xc, xd, 0x7362u));
        // sign planes of token pairs: coordinates 0..15 (lo) / 16..31 (hi) of token a | token b
        const uint32_t wlo_ab = prmt(gab.x, gab.y, 0x5410u), whi_ab = prmt(gab.x, gab.y, 0x7632u);
        const uint32_t wlo_cd = prmt(gcd.x, gcd.y, 0x5410u), whi_cd = prmt(gcd.x, gcd.y, 0x7632u);
        aA0 = lookup(s1ab.x, L.TV) ^ ((wlo_ab * m0) & kSignMask);
        aA1 = lookup(s1ab.y, L.TV) ^ ((whi_ab * m0) & kSignMask);
        aA2 = lookup(s1cd.x, L.TV) ^ ((wlo_cd * m0) & kSignMask);
        aA3 = lookup(s1cd.y, L.TV) ^ ((whi_cd * m0) & kSignMask);
        aB0 = lookup(s2ab.x, L.TV) ^ ((wlo_ab * m1) & kSignMask);
        aB1 = lookup(s2ab.y, L.TV) ^ ((whi_ab * m1) & kSignMask);
        aB2 = lookup(s2cd.x, L.TV) ^ ((wlo_cd * m1) & kSignMask);
        aB3 = lookup(s2cd.y, L.TV) ^ ((whi_cd * m1) & kSignMask);
      }
    }
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      mma16816(acc[hh][g][0], aA0, aA1, aA2, aA3, pb0[hh], pb1[hh]);
      mma16816(acc[hh][g][1], aB0, aB1, aB2, aB3, pb0[hh], pb1[hh]);
    }
  }
}

// The tile loop of one warp and pass: tile k (k < nmy) is computed from stage k % NST of the warp's
// stages wst while tile k + NST - 1 is copied into the stage freed by tile k - 1 (issue) and the page
// entry of tile k + NST is read (entry_k; pg_ahead carries it to the next issue).
template <int D, int KB, int VB, bool F3, int NH, class EntryK, class Issue>
__device__ __forceinline__ void split_tile_loop(const AttnParams& p, int nmy, const EntryK& entry_k, const Issue& issue,
                                                int32_t& pg_ahead, const uint8_t* wst, int lane, int gID, int tid,
                                                const uint2 (&qb)[NH][D / 32][2][32], const TileLane& L,
                                                float (&m_run)[NH][2], float (&l_run)[NH][2],
                                                float (&acc)[NH][D / 32][2][4]) {
  constexpr int G = D / 32;
  using TG = TileGeom<D, KB, VB>;
  constexpr int NST = TG::stages, TB = TG::bytes;
  int stage = 0, stage_fill = NST - 1;  // k % NST and (k + NST - 1) % NST
#pragma unroll 1
  for (int k = 0; k < nmy; ++k) {
    const int32_t pn = entry_k(k + NST);
    issue(k + NST - 1, stage_fill, pg_ahead);
    pg_ahead = pn;
    stage_fill = stage;
    cp_async_wait<NST - 1>();  // this lane's copies of tile k have landed
    __syncwarp();              // ... and every lane's
    if (k == 0) FMKV_TRACE(p, 0, 5);
    const int koff = (int)kTokensPerStep * k;  // first token of tile k, from the warp's first
    const uint8_t* st = wst + stage * TB;  // the staged tile
    stage = stage + 1 == NST ? 0 : stage + 1;
    // this lane's words of the staged tile (the mapping above)
    float sc[NH][4];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh)
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[hh][i] = 0.0f;
    const uint16_t* ka = (const uint16_t*)st + 2 * gID * D;           // fp16 K: tokens 2 gID, 2 gID + 1
    // tokens 2 gID, 2 gID + 1, plane 0 (format 3: the tile block)
    const uint32_t* kw = kTiled<KB, F3> ? (const uint32_t*)st : (const uint32_t*)st + 2 * gID;
    const uint32_t* ks = (const uint32_t*)(st + G * KB * 64) + gID;   // their scales, group 0
    tile_scores<D, KB, F3, NH>(ka, kw, ks, qb, lane, tid, L, sc);
    float pr[NH][4];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) tile_softmax<G>(p, sc[hh], koff, L, hh, m_run[hh], l_run[hh], acc[hh], pr[hh]);
    const uint8_t* vst = st + TG::kbytes;
    // tokens 4 tid .. 4 tid + 3, plane 0 (format 3: the tile block)
    const uint32_t* vw = kTiled<VB, F3> ? (const uint32_t*)vst : (const uint32_t*)vst + 4 * tid;
    const uint32_t* vs = (const uint32_t*)(vst + G * VB * 64) + gID;  // V scales of tokens 2 gID, 2 gID + 1
    tile_pv<D, VB, F3, NH>(vw, vs, pr, koff, L.tlim, gID, L, acc, lane);
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
}

// Combine the 4 warps' (m_run, l_run, acc) of half hh of a pass and store the split's partial of each live vector
// (sh.vpart[i] + slot, the split's partial slot): (m in natural-log units, l) and acc in the raw domain. A warp's (m, l, O) go to its
// own stages wst when they fit (no other warp touches those: no barrier before the stores), else to
// sm_acc (which overlaps the other warps' stages: wait for them first). One barrier, then thread -> data:
// vector i = kQV hh + tidx / 16 of the pass, float4 columns 4 (tidx % 16) + 64 u (u < D / 64); each thread forms
// its vector's combined max, the warps' factors and sum itself (no second barrier), and the half warp of
// the vector applies the inverse rotation (half_warp_unrotate).
template <int D, int KB, int VB, bool F3, int NH>
__device__ __forceinline__ void split_combine_store(const AttnParams& p, int slot, int64_t vb, int64_t nqv, int hh, int tidx,
                                                    int warp, int gID, int tid, uint8_t* smem, uint8_t* wst,
                                                    const SplitShared<D, NH>& sh, const float (&m_run)[2],
                                                    float (&l_run)[2], const float (&acc)[D / 32][2][4]) {
  using TG = TileGeom<D, KB, VB>;
  constexpr int G = D / 32, NST = TG::stages, TB = TG::bytes;
  float(*sm_acc)[kQV][D] = reinterpret_cast<float(*)[kQV][D]>(smem);
  constexpr bool kOwnStage = NST * TB >= kQV * D * 4;
  float* const wacc = kOwnStage ? reinterpret_cast<float*>(wst) : &sm_acc[warp][0][0];
  if constexpr (kOwnStage) __syncwarp();  // every lane's copies (zero fills included) have landed
  else __syncthreads();                   // every warp is done with its stages
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) l_run[j] += __shfl_xor_sync(0xffffffffu, l_run[j], o);
    if (gID == 0) {
      sh.m[warp][kQV * hh + 2 * tid + j] = m_run[j] * 0.69314718055994531f;  // back to natural-log units
      sh.l[warp][kQV * hh + 2 * tid + j] = l_run[j];
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wacc[(2 * tid + (k & 1)) * D + (kTiled<VB, F3> ? 32 * g + 16 * mt + gID + ((k & 2) ? 8 : 0)
                                        : VB >= 4     ? 32 * g + 4 * gID + 2 * mt + (k >> 1)
                                                      : 32 * g + 2 * gID + mt + ((k & 2) ? 16 : 0))] =
            kTiled<VB, F3> ? acc[g][mt][k] * p.tile_step[1] : acc[g][mt][k];  // format 3: V levels x step
  __syncthreads();
  constexpr int TPV = 128 / kQV, NU = D / (4 * TPV);  // threads per vector, float4 columns per thread
  static_assert(TPV == 16 && NU * 64 == D, "a half warp per vector (half_warp_unrotate's mapping)");
  const int i = tidx / TPV, c0 = 4 * (tidx % TPV), iv = kQV * hh + i;  // vector iv of the pass
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sh.m[w][iv]);
  float f[kAttnWarps], L = 0.0f;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) {
    f[w] = M == -INFINITY ? 0.0f : fast_exp2((sh.m[w][iv] - M) * kLog2e);  // (M = -inf: every warp empty)
    L += sh.l[w][iv] * f[w];
  }
  float y[4 * NU];
#pragma unroll
  for (int u = 0; u < NU; ++u) {
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float* src = kOwnStage ? reinterpret_cast<const float*>(smem + w * NST * TB) : &sm_acc[w][0][0];
      add_weighted(a, f[w], *reinterpret_cast<const float4*>(src + i * D + c0 + 64 * u));
    }
    y[4 * u] = a.x;
    y[4 * u + 1] = a.y;
    y[4 * u + 2] = a.z;
    y[4 * u + 3] = a.w;
  }
  // the partial leaves in the raw domain (the merge then needs no rotation: it is linear), every
  // thread taking part in the shuffles (vectors past the call's are computed on (-inf, 0) and dropped)
  half_warp_unrotate<D>(y, p.sw, tidx % TPV);
  if (vb + iv < nqv) {
    const int64_t idx = sh.vpart[iv] + slot;
    if (c0 == 0) p.part_ml[idx] = make_float2(M, L);
#pragma unroll
    for (int u = 0; u < NU; ++u)
      *reinterpret_cast<float4*>(p.part_acc + idx * D + c0 + 64 * u) =
          make_float4(y[4 * u], y[4 * u + 1], y[4 * u + 2], y[4 * u + 3]);
  }
}

// Split sp of the ns compressed splits of (sequence s, kv head h), after the kernel's prologue: the tiles
// [tb, te) of its share of the sequence's C compressed tokens (partial slot split_slot(sp)); an empty share (a short sequence) writes (m, l) = (-inf, 0)
// for every query vector and returns. Per pass of NH x kQV query vectors: Q requested, the warp's first tiles'
// copies issued, Q rotated (split_q_*), the tile loop (tile_lane_setup, split_tile_loop), the combine of each
// half (split_combine_store).
template <int D, int KB, int VB, int P, bool F3, int NH>
__device__ __forceinline__ void split_cta(const AttnParams& p, int s, int h, int sp, int ns, int tidx, int warp, int lane, int gID,
                                          int tid, int64_t r0, int64_t n, int64_t len, int64_t C, uint8_t* smem,
                                          const SplitShared<D, NH>& sh) {
  constexpr bool K16 = KB == FMKV_FP16_BITS;
  using TG = TileGeom<D, KB, VB>;
  constexpr int NST = TG::stages, TB = TG::bytes;
  // Dynamic shared memory: tile staging (per warp NST x TB bytes), reused by the combine; then the
  // rotated Q (sq, its own region: the first tiles are in flight while Q is rotated).
  float(*sq)[D] = reinterpret_cast<float(*)[D]>(smem + TG::smem);
  const int64_t nqv = n * p.gq;
  const int64_t ntiles = (C + 15) / 16;
  int64_t tps = div_small(ntiles + ns - 1, ns);
  if (tps < kMinTilesPerSplit) tps = kMinTilesPerSplit;
  const int64_t tb = (int64_t)sp * tps, te = ntiles < tb + tps ? ntiles : tb + tps;
  if (tb >= ntiles) {  // an empty split (short sequence): partial (m, l) = (-inf, 0), no Q work
    for (int64_t v = tidx; v < nqv; v += blockDim.x) {
      int64_t vr;
      int vh;
      split_vector(v, p.gq, vr, vh);
      p.part_ml[partial_row_base(p, r0 + vr, h * p.gq + vh) + split_slot(sp)] = make_float2(-INFINITY, 0.0f);
    }
    FMKV_TRACE(p, 0, 7, kTraceEmptySplit);
    return;
  }

  FMKV_TRACE(p, 0, 3);

  constexpr int NCH = (TG::chunks + 31) / 32;
  int ch_off[NCH], ch_mul[NCH];
  tile_copy_plan<D, KB, VB, P, NCH, F3>(p, lane, ch_off, ch_mul);

  // This warp's tiles: ti = tb + warp + 4 k, k < nmy, i.e. compressed tokens ci_first + 64 k + [0, 16).
  // Tile k is staged into stage k % NST by cp.async NST - 1 tiles ahead of its use; its page index
  // is read one issue earlier still. Token offsets are unsigned (non-negative), so / P and % P are
  // shifts and masks.
  const int32_t* btrow = p.bt + (int64_t)s * p.bt_stride;
  const int64_t first = tb + warp;
  const int nmy = te > first ? (int)((te - first + kAttnWarps - 1) / kAttnWarps) : 0;
  uint8_t* wst = smem + warp * NST * TB;
  const uint8_t* head_base = p.pages + (int64_t)h * p.head_stride;
  const uint64_t ci_first = (uint64_t)first * 16u;
  // P <= 64: every tile of this warp starts at the same slot of its page (the warp steps 64 tokens),
  // so the chunks' in-page source offsets are loop-invariant (4 registers instead of 8, no multiply)
  constexpr bool kFixedSlot = P <= (int)kTokensPerStep;
  const uint32_t slot0 = (uint32_t)(ci_first % P);  // the slot of the warp's first token in its page
  if constexpr (kFixedSlot) {
#pragma unroll
    for (int i = 0; i < NCH; ++i)
      if (ch_off[i] >= 0) ch_off[i] += (int)slot0 * ch_mul[i];
  }
  // Table entry of tile k: bt_first[(slot0 + 64 k) / P], a 32-bit index from one base pointer. Read
  // one issue ahead of its use and checked only there (a check at the load would wait for it); for
  // k >= nmy the last tile's entry is read instead (an in-range load, unused), so no branch. A warp
  // without tiles (nmy = 0) reads entry 0 of the row (it exists: the split has tiles).
  const int32_t* bt_first = nmy > 0 ? btrow + ci_first / P : btrow;
  const uint32_t np32 = p.num_pages < ((int64_t)1 << 31) ? (uint32_t)p.num_pages : (1u << 31);
  auto entry_k = [&](int k) -> int32_t {
    const uint32_t kk = (uint32_t)(k < nmy ? k : nmy > 0 ? nmy - 1 : 0);
    return bt_first[(slot0 + kTokensPerStep * kk) / P];
  };
  // Copies of tile k into `stage`, branch-free: a tile that does not exist (k >= nmy) or whose entry
  // is out of range (one unsigned compare; num_pages clamped to 2^31, above every non-negative int32)
  // copies nothing (cp.async with source size 0 zero-fills the stage). A bad entry is remembered
  // (bad_k, the first one) and reported after the loop: the call fails, the merge writes nothing,
  // so the tile loop may compute on the zeroed stage (no per-stage validity flag to keep).
  int bad_k = -1;
  auto issue = [&](int k, int stage, int32_t pg) {
    const bool exists = k < nmy, ok = exists && (uint32_t)pg < np32;
    bad_k = bad_k < 0 && exists && !ok ? k : bad_k;
    const uint8_t* hb = head_base + (int64_t)(ok ? (uint32_t)pg : 0u) * p.page_bytes;
    const uint32_t t0 = (slot0 + kTokensPerStep * (uint32_t)k) % P;
    uint8_t* dst = wst + stage * TB + 16 * lane;
#pragma unroll
    for (int i = 0; i < NCH; ++i)
      if (ch_off[i] >= 0)
        cp_async16_zfill(dst + 512 * i, hb + (uint32_t)(kFixedSlot ? ch_off[i] : ch_off[i] + (int)t0 * ch_mul[i]), ok);
    cp_async_commit();  // one group per tile slot, so wait_group counts tiles
  };
  for (int64_t vb = 0; vb < nqv; vb += NH * kQV) {
    // Q is requested first (one round trip, in flight while the first tiles' page entries are read
    // and their copies issued), then checked and rotated. (Requesting the entries first and issuing
    // the copies after the rotation made ptxas spill in the k4v3 tile loop; its gain was not
    // separable from run-to-run spread.)
    float xq[NH * kQVPerWarp][D / 32];
    int64_t qrow[NH * kQVPerWarp];
    int qhead[NH * kQVPerWarp];
    split_q_request<D, NH>(p, h, r0, n, len, vb, nqv, warp, lane, sh, xq, qrow, qhead);
    // Start streaming this warp's first tiles before the Q work, so their latency overlaps it.
    int32_t pg_ahead = entry_k(0);
#pragma unroll 1
    for (int k = 0; k < NST - 1; ++k) {
      const int32_t pn = entry_k(k + 1);
      issue(k, k, pg_ahead);
      pg_ahead = pn;
    }
    split_q_rotate<D, K16, NH>(p, warp, lane, xq, qrow, qhead, sq, sh);
    __syncthreads();  // also: sh.tab filled
    FMKV_TRACE(p, 0, 4);
    TileLane L;
    tile_lane_setup<D, KB, VB, F3, NH>(p, lane, gID, tid, sh, sq, sh.qb[warp], ci_first, C, L);
    float m_run[NH][2], l_run[NH][2], acc[NH][D / 32][2][4];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        m_run[hh][j] = -INFINITY;
        l_run[hh][j] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < D / 32; ++g)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[hh][g][mt][k] = 0.0f;
    }
    split_tile_loop<D, KB, VB, F3, NH>(p, nmy, entry_k, issue, pg_ahead, wst, lane, gID, tid, sh.qb[warp], L, m_run, l_run,
                                       acc);
    cp_async_wait<0>();
    if (bad_k >= 0 && lane == 0) {  // the first out-of-range entry of this warp's tiles
      const uint32_t rel = (slot0 + kTokensPerStep * (uint32_t)bad_k) / P;
      report_error(p.err, kOutOfRange, kErrBlockTable, s, (long long)(ci_first / P + rel), bt_first[rel], p.num_pages);
    }
    FMKV_TRACE(p, 0, 6);
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      if (hh > 0) __syncthreads();  // every thread is done reading the previous half's warp results
      split_combine_store<D, KB, VB, F3, NH>(p, split_slot(sp), vb, nqv, hh, tidx, warp, gID, tid, smem, wst, sh, m_run[hh],
                                             l_run[hh], acc[hh]);
    }
    if (vb + NH * kQV < nqv) __syncthreads();  // the next pass rewrites the stages, sh.vpart and sh.m / sh.l
  }
  FMKV_TRACE(p, 0, 7, kTraceSplit);
  grid_dependents_launch();  // the merge kernel may start launching (it waits for this grid's writes)
}

// Decode attention kernel (see the file header): head_dim D, K / V bits, page size P (compile-time, so
// every load of a tile is a constant offset from one tile pointer). The prologue, shared by every CTA:
// the codebook levels requested (split CTAs), the dependency wait, the error word and the sequence's batch
// arrays in one round trip, the sequence checks; then the CTA's role: fused_step (CTA nsplit of a fused
// step), fp16_part (CTA nsplit of an attention call, CTA nsplit + 1 of a fused step) or split_cta. NH: halves of
// kQV query vectors per pass of a split CTA (2: the wide kernels, attn_compiled_wide).
template <int D, int KB, int VB, int P, bool F3, int NH>
__global__ void __launch_bounds__(128, D > 128 ? 2 : NH > 1 ? FMKV_ATTN_WIDE_MIN_BLOCKS : FMKV_ATTN_MIN_BLOCKS)
    attn_kernel(AttnParams p) {
  constexpr int G = D / 32;
  constexpr bool K16 = KB == FMKV_FP16_BITS;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float s_qmax[NH * kQV];
  constexpr int RK = level_table_rows(KB), RV = level_table_rows(VB);
  __shared__ uint32_t s_tab[RK + RV][32];
  __shared__ uint32_t s_pow2[32];
  __shared__ uint2 s_qb[kAttnWarps][NH][G][2][32];
  __shared__ float sm_m[kAttnWarps][NH * kQV], sm_l[kAttnWarps][NH * kQV];
  __shared__ int64_t s_vpos[NH * kQV], s_vpart[NH * kQV];
  FMKV_TRACE(p, 0, 0);
  const int y = blockIdx.y, h = blockIdx.x, z = blockIdx.z, sp = z < p.nraw ? p.nsplit + z : z - p.nraw;
  const int tidx = threadIdx.x, warp = tidx >> 5, lane = tidx & 31, gID = lane >> 2, tid = lane & 3;
  // Codebook tables in ordinary registers: a table in a uniform register costs a move per lookup,
  // so every lane reads its own copy (a lane-dependent shared-memory address is never uniform).
  // fp16x2 level tables: T[k] = level 2k | level 2k+1 << 16 (levels 0..3 in T[0..1], 4..7 in T[2..3]; 5-bit
  // codes' 16 magnitudes in T[0..7], level_table_rows).
  // No kernel writes the levels, so threads 0..7 request theirs before the dependency wait (the
  // round trip hides in it and in the batch-array loads) and store them to s_tab after those.
  uint32_t tab_lo = 0u, tab_hi = 0u;  // entry tidx of the K table (tidx < RK), else entry tidx - RK of the V table
  if (sp < p.nsplit && tidx < RK + RV) {
    const int bits = tidx < RK ? (K16 ? VB : KB) : VB, k = tidx < RK ? tidx : tidx - RK;
    const int M = 1 << (bits - 1), off = FMKV_CODEBOOK_OFFSET(bits);
    if (2 * k < M) tab_lo = load_now(gtab::fmkv_codebook_mag_f16 + off + 2 * k);
    if (2 * k + 1 < M) tab_hi = load_now(gtab::fmkv_codebook_mag_f16 + off + 2 * k + 1);
  }
  grid_dependency_wait();  // launched as a programmatic dependent: nothing upstream is read before this
  // One round trip: the error word, the sequence's batch arrays (written upstream) and, for a balanced
  // plan, every sequence's length are requested together; the error word decides first.
  const bool upstream_error = error_set(p.err);
  int s = y;  // this CTA's sequence: blockIdx.y, unless a balanced plan gives a spare CTA to another
  int64_t len0 = load_now(p.seq_lens + s);
  const int64_t ry0 = load_now(p.ro + s), ry1 = load_now(p.ro + s + 1);
  // a moved CTA's row offsets are ry + (its sequence's - y's): redefined outright (r0 = a load in the branch)
  // they made ptxas schedule the tile loop's shared loads late, and every decode ran 3-15% slower
  // (docs/history/cuda-split-count.md)
  int64_t d0 = 0, d1 = 0;
  int32_t slot = p.R > 0 && p.slots ? load_now(p.slots + s) : 0;
  const PlanLens plan_len = p.balanced ? plan_request(p, lane) : PlanLens{};
  if (upstream_error) return;
  int k = sp < p.nsplit ? sp : -1, ns = p.nsplit;  // split index (-1: a raw-domain CTA), the sequence's splits
  if (p.balanced) {
    const SplitAssign a = plan_assign(plan_args(p), y, k, lane, plan_len);
    if (a.s < 0) return;  // a spare CTA that no sequence needs
    ns = a.ns;
    k = a.k;
    if (a.s != y) {  // a spare CTA given to sequence a.s: its batch arrays (a second round trip)
      s = a.s;
      len0 = load_now(p.seq_lens + s);
      d0 = load_now(p.ro + s) - ry0;
      d1 = load_now(p.ro + s + 1) - ry1;
      slot = p.R > 0 && p.slots ? load_now(p.slots + s) : 0;
    }
  }
  const int64_t r0 = ry0 + d0, r1 = ry1 + d1;
  const int64_t n = r1 - r0;
  FMKV_TRACE(p, 0, 1);
  // fused step: attention over len0 + n tokens, of which [S, ce(len0)) were compressed before it
  if (p.fused && n > 0 && len0 > INT64_MAX - n) {
    if (sp == 0 && h == 0 && tidx == 0) report_error(p.err, kOverflow, kErrLenOverflow, s, 0, len0, 0);
    return;
  }
  const int64_t len = p.fused && n > 0 && len0 >= 0 ? len0 + n : len0;
  if (!attn_sequence_ok(p, s, h, k, r0, n, len, slot, ns) || n <= 0) return;
  if (p.balanced && z == 0 && h == 0)  // the sequence's rows: partials to merge (merge_kernel)
    for (int64_t r = tidx; r < n; r += blockDim.x) p.part_n[r0 + r] = p.nraw + ns;
  const int64_t E = fmkv_compressed_end(p.S, p.W, p.fused ? len0 : len), C = E - p.S;
  if (sp < p.nsplit && tidx < RK + RV)
    for (int l = 0; l < 32; ++l) s_tab[tidx][l] = tab_lo | (tab_hi << 16);
  if (sp < p.nsplit && tidx < 32) s_pow2[tidx] = 1u << tidx;
  FMKV_TRACE(p, 0, 2);
  // CTA nsplit: the fp16 tokens (attention) or the fused step; CTA nsplit + 1 (a fused step with fp16
  // regions): the fp16 tokens before the step. (Two equality tests: with `sp >= nsplit` ptxas lays the
  // tile loop out after this code, and the split CTAs' prologue ran ~1 us slower.)
  if (sp == p.nsplit || sp == p.nsplit + 1) {
    if (p.fused && sp == p.nsplit) fused_step<D, P, KB, VB, F3>(p, s, h, len0, r0, n, smem);
    else fp16_part<D>(p, s, h, len - n, r0, n, fmkv_compressed_end(p.S, p.W, len), p.fused ? len0 : len, raw_slot(p, z), smem);
    FMKV_TRACE(p, 0, 7, p.fused && sp == p.nsplit ? kTraceFused : kTraceFp16Part);
    return;
  }
  split_cta<D, KB, VB, P, F3, NH>(p, s, h, k, ns, tidx, warp, lane, gID, tid, r0, n, len, C, smem,
                          {s_qmax, s_tab, s_pow2, s_qb, sm_m, sm_l, s_vpos, s_vpart});
}


// Compiled (head_dim, K bits, V bits) combinations: a default build compiles the grid below for
// every page size; -DFMKV_CUDA_FULL_GRID=ON compiles every head_dim x K width (the code widths and fp16) x
// V width (x 5 page sizes). Anything else fails with FMKV_ERR_UNSUPPORTED naming the combination
// (decode_attention.cu), never a fallback.
constexpr bool attn_compiled(int d, int kb, int vb) {
#ifdef FMKV_CUDA_FULL_GRID
  return (d == 64 || d == 128 || d == 256) && is_k_bits(kb) && is_code_bits(vb);
#else
  return ((d == 64 || d == 128) && ((kb == 2 && vb == 2) || (kb == 3 && vb == 3) || (kb == 4 && vb == 4) ||
                                    (kb == 4 && vb == 2) || (kb == 16 && vb == 3) || (kb == 5 && vb == 4) ||
                                    (kb == 5 && vb == 5))) ||
         (d == 256 && ((kb == 3 && vb == 3) || (kb == 4 && vb == 4)));
#endif
}
const char* const kAttnDefaultGrid =
    "k2v2, k3v3, k4v4, k4v2, k16v3, k5v4, k5v5 for head_dim 64/128 and k3v3, k4v4 for head_dim 256";
// Format 3 (a side in tile blocks): a default build compiles k3v3 (every head_dim) and k16v3 (head_dim 64/128:
// the format-2 grid's pairs with a 3-bit side, so every default pair runs in both formats); the full grid every
// combination with a tiled side.
constexpr bool attn_compiled_f3(int d, int kb, int vb) {
#ifdef FMKV_CUDA_FULL_GRID
  return attn_compiled(d, kb, vb) && (is_tiled_bits(kb) || is_tiled_bits(vb));
#else
  return attn_compiled(d, kb, vb) && ((kb == 3 && vb == 3) || (kb == 16 && vb == 3));
#endif
}
const char* const kAttnDefaultGridF3 = "k3v3 for head_dim 64/128/256 and k16v3 for head_dim 64/128";
// The wide kernels (NH = 2: 16 query vectors per pass, each tile decoded once for both halves), used for calls of
// more than kQV query vectors per (sequence, kv head) (GQA groups over 8, query rows x group over 8 in
// speculative verification); without one a call runs the kQV-vector kernel's passes (each pass decodes every
// tile again). head_dim <= 128 (at 256 the second set of accumulators does not fit the registers); a default
// build compiles them for the README table's widths at head_dim 128 (k3v3 in formats 2 and 3, k4v4; every page
// size: the models with GQA groups over 8 have head_dim 128), the full grid for every combination it compiles.
constexpr bool attn_compiled_wide(int d, int kb, int vb, bool f3) {
#ifdef FMKV_CUDA_FULL_GRID
  return d <= 128 && (f3 ? attn_compiled_f3(d, kb, vb) : attn_compiled(d, kb, vb));
#else
  return d == 128 && ((kb == 3 && vb == 3) || (!f3 && kb == 4 && vb == 4));
#endif
}

template <int D, int KB, int VB, bool F3, int NH>
AttnFn attn_kernel_for_page(int page) {
  if constexpr (F3 ? !attn_compiled_f3(D, KB, VB) : !attn_compiled(D, KB, VB)) {
    return {};
  } else if constexpr (NH > 1 && !attn_compiled_wide(D, KB, VB, F3)) {
    return {};
  } else {
    constexpr int smem = TileGeom<D, KB, VB>::smem_total(NH);
    switch (page) {
      case 16: return {attn_kernel<D, KB, VB, 16, F3, NH>, smem};
      case 32: return {attn_kernel<D, KB, VB, 32, F3, NH>, smem};
      case 64: return {attn_kernel<D, KB, VB, 64, F3, NH>, smem};
      case 128: return {attn_kernel<D, KB, VB, 128, F3, NH>, smem};
      case 256: return {attn_kernel<D, KB, VB, 256, F3, NH>, smem};
    }
    return {};
  }
}

// The compiled kernel of K width KB for (head_dim d, V width vb, page size, f3: format 3's tile blocks, passed
// only when a side is tiled; wide: the NH = 2 kernel); {} where not compiled. Defined in decode_k.cuh and
// instantiated once per K width in its own translation unit (generated by cmake/cuda.cmake from the width
// range), so the K widths compile in parallel and this header's includers (decode_attention.cu) compile none of
// the kernels.
template <int KB>
AttnFn attn_kernel_k(int d, int vb, int page, bool f3, bool wide);

}  // namespace cuda
}  // namespace fmkv
