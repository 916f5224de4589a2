// Split count of the CUDA decode attention: host arithmetic only (no CUDA headers), so the rule is
// unit-tested by the CPU test suite (tests/test_split_count.cpp). docs/CUDA-NOTES.md "Split count"; the
// measurements behind each rule, by the commit named: docs/history/cuda-split-count.md.
#pragma once
#include <algorithm>
#include <cstdint>

// The rules below that the device also evaluates (the balanced plan) are host-device functions under nvcc.
#if defined(__CUDACC__)
#define FMKV_SPLIT_HD __host__ __device__ __forceinline__
#else
#define FMKV_SPLIT_HD inline
#endif

namespace fmkv {
namespace cuda {

// kMinTilesPerSplit: 16-token tiles a non-empty split takes at least (one per warp of its 4).
// kMaxSplits: compressed splits per (sequence, kv head); more than 64 only when few (sequence, kv head)
// pairs would leave SMs idle (one kv head per GPU under tensor parallelism, B = 1); the merge kernel takes
// one partial's (m, l) per thread (kMaxSplits + kRawParts <= its 256 threads).
// kFusedMaxRows: rows per sequence of a fused append + attention call (FMKV_FUSED_MAX_ROWS).
// kSplitWarps: warps per split CTA (kAttnWarps); kSplitVectors: query vectors a split CTA takes per pass
// over its tiles (kQV).
constexpr int kMinTilesPerSplit = 4, kMaxSplits = 254, kFusedMaxRows = 16, kSplitWarps = 4, kSplitVectors = 8;

// Splits that can hold work when no sequence has more than `compressed` compressed tokens: each split
// takes >= kMinTilesPerSplit tiles, so ceil(ceil(compressed / 16) / 4) (>= 1); more would only be empty
// CTAs and a wider merge. compressed < 0: unknown (no cap).
FMKV_SPLIT_HD constexpr int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }  // a >= 0, b > 0
FMKV_SPLIT_HD constexpr int64_t tiles_of(int64_t compressed) { return ceil_div(compressed, 16); }   // 16-token tiles
FMKV_SPLIT_HD int64_t useful_splits(int64_t compressed) {
  if (compressed < 0) return kMaxSplits;
  const int64_t n = ceil_div(tiles_of(compressed), kMinTilesPerSplit);
  return n > 1 ? n : 1;
}

// The device's CTA slots for the attention kernel: SMs and CTAs per SM the plan assumes (per_sm), and CTAs
// per SM that are resident when fewer (resident; 0: per_sm). sms = 0: no device. The H200's d <= 128 kernels
// are resident 3 per SM (168 registers) and planned as 4: the counts below were measured with 4 resident;
// a one-wave grid of the 4-per-SM plan that exceeds the resident slots is then cut to one resident wave.
struct SplitDevice {
  int64_t sms = 0, per_sm = 0, resident = 0;
  int64_t target() const { return sms * std::min<int64_t>(per_sm, 2); }  // 2 CTAs per SM
  int64_t wave() const { return sms * per_sm; }                          // every slot once
  int64_t resident_wave() const { return sms * resident; }               // every resident slot once (0: none)
};

// Tiles the busiest warp of a split takes when `tiles` tiles are cut into n splits of kSplitWarps warps
// (ceil(tiles / n) per split, at least kMinTilesPerSplit; ceil(ceil(a / n) / 4) = ceil(a / 4n)).
inline int64_t warp_rounds(int64_t tiles, int64_t n) {
  return std::max<int64_t>(1, ceil_div(std::max<int64_t>(tiles, 1), n * kSplitWarps));
}
// Whether trimming `usual` splits to `trimmed` (2 CTAs per SM) pays for a call of `tiles` tiles per
// sequence whose split CTAs make `passes` passes over their tiles (one per kSplitVectors query vectors).
// With u tiles per warp at the usual count (warp_rounds):
//  * u <= kTrimAlwaysRounds: it does (short calls: the usual count's extra CTAs and partials cost more
//    than a tile);
//  * one pass, u <= kTrimMaxRounds: while it at most doubles the busiest warp's tiles (a warp at 2 CTAs per
//    SM runs a tile in about half the time it takes at 4);
//  * beyond (the long loop wants 4 CTAs per SM, e32caa1: 128k 0.94x), and for several passes beyond
//    kTrimAlwaysRounds (each pass streams the tiles again, as a longer context would): it does not.
// Measured (8ddabdb, fused step with a 64-token window: nraw = 2, 31 splits, against 64): 4k 1 vs 3 tiles
// per warp 1.16x, 8k 2 vs 5 1.07x, 16k 4 vs 9 1.02x, 32k 8 vs 17 0.97x; without a window (32 splits) 32k
// 8 vs 16 1.03x (e32caa1); 4-16 rows per sequence at 32k (u = 8, 2-8 passes) 0.95-0.98x.
constexpr int64_t kTrimAlwaysRounds = 4, kTrimMaxRounds = 8;
// A plan of several waves (B >= 2 with 8 kv heads) is trimmed only to at least kMinTrimmedSplits splits, the
// range measured at ff7539c (B = 2 / 4 / 8: 15 / 7 / 3 splits); B = 16 at 4k would get 1 (0.79x measured).
constexpr int64_t kMinTrimmedSplits = 3;
inline bool trim_pays(int64_t tiles, int64_t usual, int64_t trimmed, int64_t passes) {
  const int64_t u = warp_rounds(tiles, usual);
  if (u <= kTrimAlwaysRounds) return true;
  return passes == 1 && u <= kTrimMaxRounds && warp_rounds(tiles, trimmed) <= 2 * u;
}
// Small batches at mid lengths (5a0426e): a bounded one-pass call of several waves on a device whose kernel is
// resident at fewer CTAs per SM than planned (SplitDevice::resident) is cut to one resident wave when its warps
// then take between kResidentCutMinRounds and kResidentCutMaxRounds tiles (warp_rounds), the count being at
// least kMinCutSplits. Shorter, the 2-per-SM trim (or the usual count) stays: its short CTAs cost less than
// the wave's; longer, several waves of the usual count balance the SMs better. 0: no cut. Measured (5a0426e,
// k3v3, 8 kv heads, against the usual count): B = 2 / 3 / 4 / 6 / 8 at 32k / 16k / 16k / 8k / 8k (23 / 15 / 11
// / 7 / 5 splits, 12-26 tiles per warp) 1.19 / 1.24 / 1.15 / 1.24 / 1.16x; B = 2 64k 1.07x, B = 3 32k 1.16x,
// B = 6 16k 1.11x; over the trim: B = 6 / 8 at 4k (10 / 13 tiles) 1.06x, B = 3 at 8k (9 tiles) 0.98x; beyond
// 72 tiles within -6 / +1% (B = 6 32k 74, B = 2 128k 90, B = 4 64k 94, B = 8 32k 103) and 0.86-0.95x from 137.
// Where the resident wave would be fewer than kMinCutSplits splits (B = 9-16 with 8 kv heads), one planned wave
// (dev.wave(), 1.1-1.3 resident waves) instead, of at least kMinTrimmedSplits splits and at most
// kWaveCutMaxRounds tiles per warp: B = 9 / 10 / 12 / 14 / 16 at 2k-4k (6 / 5 / 4 / 3 / 3 splits against 15 /
// 14 / 11 / 10 / 9; 6-22 tiles) 1.10-1.41x; beyond, B = 12 / 16 still gain (8k 1.21x / 1.11x) but B = 9 / 10
// / 14 lose (0.97x at 43 / 0.96x at 26 / 0.98x at 86 tiles, down to 0.88x).
constexpr int64_t kResidentCutMinRounds = 10, kResidentCutMaxRounds = 72, kMinCutSplits = 5, kWaveCutMaxRounds = 24;
inline int64_t resident_cut(int64_t tiles, int64_t pairs, int64_t nraw, const SplitDevice& dev) {
  if (dev.resident <= 0) return 0;
  const int64_t n = dev.resident_wave() / pairs - nraw;
  if (n < kMinCutSplits) {
    const int64_t w = dev.wave() / pairs - nraw;
    return w >= kMinTrimmedSplits && warp_rounds(tiles, w) <= kWaveCutMaxRounds ? w : 0;
  }
  const int64_t u = warp_rounds(tiles, n);
  return u >= kResidentCutMinRounds && u <= kResidentCutMaxRounds ? n : 0;
}
// Compressed splits per (sequence, kv head) of a call with num_seqs sequences, kv_heads kv heads and q_heads
// q heads, rows query rows in all, nraw raw-domain CTAs per pair (1, or 2 for a fused step with fp16 regions).
//  * Usual count: ceil(1056 / pairs) capped at 64 (~8 split CTAs per SM on the H200's 132 SMs when there
//    are many pairs: several waves).
//  * A decode call (at most 16 query rows per sequence on average: the workspace grows with rows x
//    splits) whose usual grid fits in one wave is sized to 2 CTAs per SM, which reach the tile loop's
//    per-SM rate (docs/CUDA-NOTES.md "Split count"):
//      - few pairs, usual grid <= 1 CTA per SM: filled up (bfa95f7): B = 1 with 1 kv head 64 -> 254
//        splits, 2 kv heads 64 -> 131;
//      - otherwise, for a short call (a length bound is known) where the trim pays (trim_pays), trimmed
//        down (e32caa1): B = 1 with 8 kv heads 64 -> 32 splits up to 32k tokens (4k 1.16x, 16k 1.09x, 32k
//        1.02x faster: half the CTAs per SM, half the partials to merge; at 128k / 1M 32 splits are 0.94x /
//        0.89x); a fused step with fp16 regions (nraw = 2) gets 31 splits up to 16k but keeps 64 at 32k,
//        and a call of several passes (more than kSplitVectors query vectors per (sequence, kv head), e.g.
//        4 rows of 4 q heads per kv head in speculative verification) trims only up to 16k (77e7f81: at
//        4k 1.07-1.17x for 2-16 rows, 16k 1.01-1.08x; at 32k 2 rows (one pass) 1.01x, 4 / 8 / 16 rows 0.98
//        / 0.96 / 0.95x); never above the usual count (4 kv heads stay at 64: 65 would take the wide
//        merge, 0.967x at bfa95f7).
//      - a bounded decode call of several waves (small batches) trims the same way where it pays, to at
//        least kMinTrimmedSplits (ff7539c: B = 2 / 4 / 8 with 8 kv heads at 4k 64 / 33 / 17 -> 15 / 7 / 3
//        splits, 1.74x / 1.50x / 1.20x). trim_pays stops it above 16k / 8k / 4.3k tokens;
//      - ... unless, with fewer CTAs resident per SM than planned, one resident wave leaves each warp 10-72
//        tiles (resident_cut, 5a0426e): then that wave (B = 2 at 16k-64k 15 / 64 -> 23 splits, 1.01-1.19x; B = 8
//        at 4k-16k 3 / 17 -> 5, 1.03-1.16x), or for B = 9-16 one planned wave up to 24 tiles per warp (2k-4k:
//        1.10-1.40x); longer calls and B >= 17 keep the usual count;
//      - then, with fewer CTAs resident per SM than planned (SplitDevice::resident), a grid beyond the
//        resident slots is cut to them (f2c759d): B = 1 with 8 kv heads at 3 per SM 64 -> 48 splits.
//  * A known length bound (`compressed` >= 0: the most compressed tokens any sequence of the call has,
//    from fmkv_attention_opts.max_seq_len) caps the count at useful_splits(compressed): a short call
//    launches no empty splits (they cost ~1-1.7 us at 4k with 1-2 kv heads).
// Query vectors per (sequence, kv head) of a call of `rows` query rows over num_seqs sequences: rows per sequence
// (the average, rounded up) x q heads per kv head. A split CTA takes them in passes (preferred_splits), and the
// CUDA backend picks its wide kernels above kSplitVectors (attn_kernel_for_call, decode_attention.cu).
inline int64_t vectors_per_pair(int32_t num_seqs, int32_t kv_heads, int32_t q_heads, int64_t rows) {
  const int64_t gq = std::max<int64_t>(q_heads / std::max(kv_heads, 1), 1);
  return ceil_div(std::max<int64_t>(rows, 1), std::max<int32_t>(num_seqs, 1)) * gq;
}

inline int32_t preferred_splits(int32_t num_seqs, int32_t kv_heads, int32_t q_heads, int64_t rows, int32_t nraw,
                                const SplitDevice& dev, int64_t compressed, int vectors_per_pass = kSplitVectors) {
  const int64_t seqs = std::max(num_seqs, 1), pairs = seqs * std::max(kv_heads, 1);
  // passes of a split CTA over its tiles: query vectors per (sequence, kv head) in batches of vectors_per_pass
  // (kSplitVectors, or twice that for the wide kernels)
  const int64_t passes = ceil_div(vectors_per_pair(num_seqs, kv_heads, q_heads, rows), vectors_per_pass);
  int64_t ns = std::min<int64_t>(std::max<int64_t>(ceil_div(1056, pairs), 1), 64);
  if (dev.sms > 0 && rows <= (int64_t)kFusedMaxRows * seqs) {
    const int64_t two_per_sm = std::max<int64_t>(dev.target() / pairs - nraw, 1);
    const bool one_wave = (ns + nraw) * pairs <= dev.wave();
    const int64_t cut = !one_wave && compressed >= 0 && passes == 1 ? resident_cut(tiles_of(compressed), pairs, nraw, dev) : 0;
    if (one_wave && 2 * (ns + nraw) * pairs <= dev.target()) ns = std::max(ns, two_per_sm);
    else if (cut > 0) ns = std::min(ns, cut);
    else if (compressed >= 0 && (one_wave || two_per_sm >= kMinTrimmedSplits) &&
             trim_pays(tiles_of(compressed), ns, two_per_sm, passes))
      ns = std::min(ns, two_per_sm);
    // fewer resident CTAs than planned (f2c759d, 3 per SM): a grid beyond them runs its last CTAs of an SM
    // after the others; one resident wave instead (B = 1, 8 kv heads: 64 -> 48 splits, 47 with nraw = 2;
    // 128k 1.049x, 1M 1.021x, a 32k fused step with a window 1.33x, 4 rows at 32k 1.14x)
    if (one_wave && dev.resident > 0 && (ns + nraw) * pairs > dev.resident_wave())
      ns = std::max<int64_t>(dev.resident_wave() / pairs - nraw, 1);
  }
  ns = std::min<int64_t>(ns, useful_splits(compressed));
  return (int32_t)std::min<int64_t>(ns, kMaxSplits);
}

// ---- Balanced ragged batches ---------------------------------------------------------------------------
// With ns splits per (sequence, kv head) for every sequence, a ragged batch's longest sequence gives its
// split CTAs the most tiles, and they set the call's time. A call of 2 .. kBalanceMaxSeqs sequences is
// instead planned on the device, from the lengths (graph-safe: the grid and the workspace are what the
// host chose): the grid's ns x num_seqs split CTAs per kv head are shared out by compressed tiles,
// sequence s taking balanced_splits(tiles_s, ...) of them, at most `cap` (partial slots per query vector,
// the workspace's row stride). A sequence that takes fewer than ns gives its spare CTAs to those that take
// more (balanced_plan.cuh, plan_assign). Equal lengths keep ns each: the uniform plan's tiles per CTA.
constexpr int64_t kBalanceMaxSeqs = 256;  // beyond, every sequence keeps ns (the plan's per-CTA scan grows)
constexpr int64_t kBalanceMaxCapFactor = 4;  // a sequence takes at most 4 ns splits (and at most 64)
// Tiles of a sequence for the plan, clamped so that the plan's sums cannot overflow (2^36 tiles are 2^40
// tokens: more than any block table addresses).
FMKV_SPLIT_HD int64_t plan_tiles(int64_t compressed) {
  const int64_t t = compressed > 0 ? tiles_of(compressed) : 0;
  return t < ((int64_t)1 << 36) ? t : ((int64_t)1 << 36);
}
// Compressed splits of a sequence of `tiles` tiles when `total` tiles (every sequence's) share `ctas`
// split CTAs among `seqs` sequences: one each, and the other ctas - seqs in proportion to the tiles
// (rounded down, so the shares never exceed ctas), capped by the sequence's useful splits and by cap.
FMKV_SPLIT_HD int64_t balanced_splits(int64_t tiles, int64_t total, int64_t ctas, int64_t seqs, int64_t cap) {
  int64_t n = 1 + (total > 0 && ctas > seqs ? (ctas - seqs) * tiles / total : 0);
  const int64_t useful = useful_splits(tiles * 16);
  n = n < useful ? n : useful;
  n = n < cap ? n : cap;
  return n > 1 ? n : 1;
}
// Whether a call of ns splits per sequence, whose sequences have at most `compressed` compressed tokens
// (-1: unknown), is worth the plan (a few hundred instructions and a call per CTA: B = 2 / 8 at 4k, where no
// split can be long -- 5 / 13 tiles per warp -- ran 0.964x / 0.967x with it): only when a split of the longest
// possible sequence would give each warp more than kBalanceMinRounds tiles (warp_rounds), or the bound is
// unknown.
constexpr int64_t kBalanceMinRounds = 16;
inline bool balance_pays(int64_t compressed, int32_t ns) {
  return compressed < 0 || warp_rounds(tiles_of(compressed), ns) > kBalanceMinRounds;
}
// Partial slots per query vector (the cap) of a call with ns splits per sequence: ns itself when the
// call is not balanced (one sequence, or more than kBalanceMaxSeqs), else up to kBalanceMaxCapFactor ns,
// at most 64 (the merge's narrow variant) unless ns already exceeds it.
inline int32_t balance_cap(int32_t num_seqs, int32_t ns) {
  if (num_seqs < 2 || num_seqs > kBalanceMaxSeqs || ns >= 64) return ns;
  return (int32_t)std::min<int64_t>((int64_t)ns * kBalanceMaxCapFactor, 64);
}

}  // namespace cuda
}  // namespace fmkv
