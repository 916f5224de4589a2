// Balanced ragged batches, the device side of split_count.h's plan: which (sequence, split) a split CTA of
// attn_kernel takes in a balanced call (p.balanced: 2 .. kBalanceMaxSeqs sequences, when balance_pays), and
// how many splits its sequence has. Every CTA evaluates the same plan from the call's lengths, so no CTA waits
// for another and the launch stays graph-safe (grid and workspace as the host sized them).
//
// Thread -> data: every warp of the CTA evaluates the plan alike (no shared memory, no barrier); lane l takes
// sequences l + 32 c, c < ceil(B / 32) (the lengths of chunks c < kPlanInline requested with the CTA's other
// batch-array loads, plan_request: one round trip; further ones read in the plan). Sequence s takes
// ns_s = balanced_splits(tiles_s, total, nsplit x B, B, cap) splits. CTA (y, k) of the grid (split k < nsplit
// of sequence y) keeps (y, k) when k < ns_y; else it is a spare CTA, rank r = (spare CTAs of sequences before
// y) + k - ns_y, and takes the r-th of the splits that sequences with ns_s > nsplit hold beyond the grid's
// nsplit, in sequence order (none left: no work). With equal lengths every ns_s = nsplit (or fewer, each split
// then holding >= kMinTilesPerSplit tiles): the uniform plan.
#pragma once
#include "attn_params.cuh"

namespace fmkv {
namespace cuda {

struct SplitAssign {
  int s;   // the sequence (-1: a spare CTA no sequence needs)
  int k;   // its split index (-1 for a raw-domain CTA)
  int ns;  // the sequence's compressed splits
};

// Lengths of sequences lane + 32 c, c < kPlanInline (B <= 64), requested with the CTA's other batch-array
// loads (one round trip); the plan reads any further ones itself.
constexpr int kPlanInline = 2;
struct PlanLens {
  int64_t v[kPlanInline];
};
__device__ __forceinline__ PlanLens plan_request(const AttnParams& p, int lane) {
  PlanLens l;
#pragma unroll
  for (int c = 0; c < kPlanInline; ++c) l.v[c] = lane + 32 * c < p.num_seqs ? load_now(p.seq_lens + lane + 32 * c) : 0;
  return l;
}

__device__ __forceinline__ int64_t warp_sum64(int64_t x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// What the plan reads of a call (by value: a noinline function taking AttnParams by reference would make
// the kernel keep its parameters in addressable memory, and its pointers generic).
struct PlanArgs {
  const int64_t* seq_lens;
  int32_t num_seqs, S, W, nsplit, cap;
};
__device__ __forceinline__ PlanArgs plan_args(const AttnParams& p) {
  return {p.seq_lens, p.num_seqs, p.S, p.W, p.nsplit, p.pstride - kRawParts};
}

// Tiles of the lane's sequence of chunk c (the first kPlanInline chunks from plan_request). Negative lengths
// count no tiles: the sequence checks reject them.
__device__ __forceinline__ int64_t plan_tiles_of(const PlanArgs& p, int c, int lane, const PlanLens& l) {
  const int i = lane + 32 * c;
  int64_t len = c >= kPlanInline && i < p.num_seqs ? p.seq_lens[i] : 0;
#pragma unroll
  for (int j = 0; j < kPlanInline; ++j)
    if (c == j) len = l.v[j];
  return len > 0 ? plan_tiles(fmkv_compressed_end(p.S, p.W, len) - p.S) : 0;
}

// The assignment of CTA (y, k) (k = -1: a raw-domain CTA of sequence y, which keeps it). Not inlined, with
// rolled loops: the kernel's hot paths keep their code and registers (inlined, the plan moved ptxas's
// schedule of the tile loop and made every decode slower).
static __device__ __noinline__ SplitAssign plan_assign(PlanArgs p, int y, int k, int lane, PlanLens len0) {
  const int B = p.num_seqs, nchunks = (B + 31) / 32;
  const int64_t ctas = (int64_t)B * p.nsplit, cap = p.cap;
  int64_t total = 0, ty = 0;
#pragma unroll 1
  for (int c = 0; c < nchunks; ++c) {
    const int64_t t = plan_tiles_of(p, c, lane, len0);
    total += t;
    if (lane + 32 * c == y) ty = t;
  }
  total = warp_sum64(total);
  ty = warp_sum64(ty);  // (one lane holds it)
  const int ns_y = (int)balanced_splits(ty, total, ctas, B, cap);
  if (k < ns_y) return {y, k, ns_y};
  // a spare CTA (ns_y <= k < nsplit): its rank among the spare CTAs, then the r-th extra split
  int64_t spare_before = 0;
#pragma unroll 1
  for (int c = 0; c < nchunks; ++c) {
    const int i = lane + 32 * c;
    const int64_t ns = balanced_splits(plan_tiles_of(p, c, lane, len0), total, ctas, B, cap);
    if (i < y && ns < p.nsplit) spare_before += p.nsplit - ns;
  }
  const int64_t r = warp_sum64(spare_before) + (k - ns_y);
  int64_t run = 0;  // extra splits of the chunks before
#pragma unroll 1
  for (int c = 0; c < nchunks; ++c) {
    const int i = lane + 32 * c;
    const int64_t ns = i < B ? balanced_splits(plan_tiles_of(p, c, lane, len0), total, ctas, B, cap) : 0;
    const int64_t d = ns > p.nsplit ? ns - p.nsplit : 0;
    int64_t incl = d;  // inclusive scan over the chunk's lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    incl += run;
    const int64_t excl = incl - d;
    const unsigned hit = __ballot_sync(0xffffffffu, d > 0 && excl <= r && r < incl);
    if (hit) {
      const int src = __ffs(hit) - 1;
      const int64_t e = __shfl_sync(0xffffffffu, excl, src);
      const int nss = (int)__shfl_sync(0xffffffffu, ns, src);
      return {32 * c + src, p.nsplit + (int)(r - e), nss};
    }
    run = __shfl_sync(0xffffffffu, incl, 31);
  }
  return {-1, -1, 0};
}

}  // namespace cuda
}  // namespace fmkv
