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
constexpr int kMinTilesPerSplit = 4, kMaxSplits = 254, kFusedMaxRows = 16;

// Splits that can hold work when no sequence has more than `compressed` compressed tokens: each split
// takes >= kMinTilesPerSplit tiles, so ceil(ceil(compressed / 16) / 4) (>= 1); more would only be empty
// CTAs and a wider merge. compressed < 0: unknown (no cap).
inline int64_t useful_splits(int64_t compressed) {
  if (compressed < 0) return kMaxSplits;
  const int64_t tiles = compressed / 16 + (compressed % 16 != 0);
  return std::max<int64_t>(1, tiles / kMinTilesPerSplit + (tiles % kMinTilesPerSplit != 0));
}

// Compressed splits per (sequence, kv head) of a call with num_seqs sequences, kv_heads kv heads, rows
// query rows in all, nraw raw-domain CTAs per pair (1, or 2 for a fused step with fp16 regions), on a
// device whose split CTAs fill `target` slots (SMs x min(2, CTAs per SM); 0: no device).
//  * Many pairs: ceil(1056 / pairs) capped at 64 (~8 split CTAs per SM on the H200's 132 SMs).
//  * Few pairs -- a decode call (at most 16 query rows per sequence on average: the workspace grows with
//    rows x splits) whose CTAs would occupy at most half of `target` -- more splits, up to `target` CTAs
//    (2 per SM reach the tile loop's per-SM rate): B = 1 with 1 kv head 64 -> 254, 2 kv heads 64 -> 131.
//  * A known length bound (`compressed` >= 0: the most compressed tokens any sequence of the call has,
//    from fmkv_attention_opts.max_seq_len) caps the count at useful_splits(compressed): a short call
//    launches no empty splits (they cost ~1-1.7 us at 4k with 1-2 kv heads).
inline int32_t preferred_splits(int32_t num_seqs, int32_t kv_heads, int64_t rows, int32_t nraw, int64_t target,
                                int64_t compressed) {
  const int64_t seqs = std::max(num_seqs, 1), pairs = seqs * std::max(kv_heads, 1);
  int64_t ns = std::min<int64_t>(std::max<int64_t>((1056 + pairs - 1) / pairs, 1), 64);
  if (rows <= (int64_t)kFusedMaxRows * seqs && 2 * (ns + nraw) * pairs <= target)
    ns = std::max<int64_t>(ns, target / pairs - nraw);
  ns = std::min<int64_t>(ns, useful_splits(compressed));
  return (int32_t)std::min<int64_t>(ns, kMaxSplits);
}

}  // namespace cuda
}  // namespace fmkv
