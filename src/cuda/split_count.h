// Split count of the CUDA decode attention: host arithmetic only (no CUDA headers), so the rule is
// unit-tested by the CPU test suite (tests/test_split_count.cpp). docs/CUDA-NOTES.md "Split count".
#pragma once
#include <algorithm>
#include <cstdint>

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
constexpr int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }  // a >= 0, b > 0
constexpr int64_t tiles_of(int64_t compressed) { return ceil_div(compressed, 16); }   // 16-token tiles
inline int64_t useful_splits(int64_t compressed) {
  if (compressed < 0) return kMaxSplits;
  return std::max<int64_t>(1, ceil_div(tiles_of(compressed), kMinTilesPerSplit));
}

// The device's CTA slots for the attention kernel: SMs and CTAs per SM (occupancy); sms = 0: no device.
struct SplitDevice {
  int64_t sms = 0, per_sm = 0;
  int64_t target() const { return sms * std::min<int64_t>(per_sm, 2); }  // 2 CTAs per SM
  int64_t wave() const { return sms * per_sm; }                          // every slot once
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
//  * beyond (the long loop wants 4 CTAs per SM, stop 23: 128k 0.94x), and for several passes beyond
//    kTrimAlwaysRounds (each pass streams the tiles again, as a longer context would): it does not.
// Measured (stop 24, fused step with a 64-token window: nraw = 2, 31 splits, against 64): 4k 1 vs 3 tiles
// per warp 1.16x, 8k 2 vs 5 1.07x, 16k 4 vs 9 1.02x, 32k 8 vs 17 0.97x; without a window (32 splits) 32k
// 8 vs 16 1.03x (stop 23); 4-16 rows per sequence at 32k (u = 8, 2-8 passes) 0.95-0.98x.
constexpr int64_t kTrimAlwaysRounds = 4, kTrimMaxRounds = 8;
inline bool trim_pays(int64_t tiles, int64_t usual, int64_t trimmed, int64_t passes) {
  const int64_t u = warp_rounds(tiles, usual);
  if (u <= kTrimAlwaysRounds) return true;
  return passes == 1 && u <= kTrimMaxRounds && warp_rounds(tiles, trimmed) <= 2 * u;
}
// Compressed splits per (sequence, kv head) of a call with num_seqs sequences, kv_heads kv heads and q_heads
// q heads, rows query rows in all, nraw raw-domain CTAs per pair (1, or 2 for a fused step with fp16 regions).
//  * Usual count: ceil(1056 / pairs) capped at 64 (~8 split CTAs per SM on the H200's 132 SMs when there
//    are many pairs: several waves).
//  * A decode call (at most 16 query rows per sequence on average: the workspace grows with rows x
//    splits) whose usual grid fits in one wave is sized to 2 CTAs per SM, which reach the tile loop's
//    per-SM rate (docs/CUDA-NOTES.md "Split count"):
//      - few pairs, usual grid <= 1 CTA per SM: filled up (stop 22): B = 1 with 1 kv head 64 -> 254
//        splits, 2 kv heads 64 -> 131;
//      - otherwise, for a short call (a length bound is known) where the trim pays (trim_pays), trimmed
//        down (stop 23): B = 1 with 8 kv heads 64 -> 32 splits up to 32k tokens (4k 1.16x, 16k 1.09x, 32k
//        1.02x faster: half the CTAs per SM, half the partials to merge; at 128k / 1M 32 splits are 0.94x /
//        0.89x); a fused step with fp16 regions (nraw = 2) gets 31 splits up to 16k but keeps 64 at 32k,
//        and a call of several passes (more than kSplitVectors query vectors per (sequence, kv head), e.g.
//        4 rows of 4 q heads per kv head in speculative verification) trims only up to 16k (stop 24: at
//        4k 1.07-1.17x for 2-16 rows, 16k 1.01-1.08x; at 32k 2 rows (one pass) 1.01x, 4 / 8 / 16 rows 0.98
//        / 0.96 / 0.95x); never above the usual count (4 kv heads stay at 64: 65 would take the wide
//        merge, 0.967x at stop 22).
//  * A known length bound (`compressed` >= 0: the most compressed tokens any sequence of the call has,
//    from fmkv_attention_opts.max_seq_len) caps the count at useful_splits(compressed): a short call
//    launches no empty splits (they cost ~1-1.7 us at 4k with 1-2 kv heads).
inline int32_t preferred_splits(int32_t num_seqs, int32_t kv_heads, int32_t q_heads, int64_t rows, int32_t nraw,
                                const SplitDevice& dev, int64_t compressed) {
  const int64_t seqs = std::max(num_seqs, 1), pairs = seqs * std::max(kv_heads, 1);
  // passes of a split CTA over its tiles: query vectors per (sequence, kv head) in batches of kSplitVectors
  const int64_t gq = std::max<int64_t>(q_heads / std::max(kv_heads, 1), 1);
  const int64_t passes = ceil_div(ceil_div(std::max<int64_t>(rows, 1), seqs) * gq, kSplitVectors);
  int64_t ns = std::min<int64_t>(std::max<int64_t>(ceil_div(1056, pairs), 1), 64);
  if (dev.sms > 0 && rows <= (int64_t)kFusedMaxRows * seqs && (ns + nraw) * pairs <= dev.wave()) {
    const int64_t two_per_sm = std::max<int64_t>(dev.target() / pairs - nraw, 1);
    if (2 * (ns + nraw) * pairs <= dev.target()) ns = std::max(ns, two_per_sm);
    else if (compressed >= 0 && trim_pays(tiles_of(compressed), ns, two_per_sm, passes)) ns = std::min(ns, two_per_sm);
  }
  ns = std::min<int64_t>(ns, useful_splits(compressed));
  return (int32_t)std::min<int64_t>(ns, kMaxSplits);
}

}  // namespace cuda
}  // namespace fmkv
