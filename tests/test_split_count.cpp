// The CUDA decode attention's split-count rule (src/cuda/split_count.h): host arithmetic, tested
// without a GPU. The H200 numbers: 132 SMs, 4 CTAs per SM (d <= 128): 2 per SM = 264 CTAs, a wave 528.
#include <gtest/gtest.h>

#include <vector>

#include "core/ops.h"
#include "cuda/split_count.h"
#include "fmkv/fmkv.h"

namespace fmkv::cuda {
namespace {

const SplitDevice kH200{132, 4};
const SplitDevice kH200d256{132, 2};  // d = 256: 2 CTAs per SM
const SplitDevice kH200r3{132, 4, 3};  // d <= 128 since f2c759d: planned as 4 per SM, 3 resident (396)
const SplitDevice kNone{};

TEST(SplitCount, UsefulSplitsFollowTheLength) {
  EXPECT_EQ(useful_splits(-1), kMaxSplits);  // unknown
  EXPECT_EQ(useful_splits(0), 1);
  EXPECT_EQ(useful_splits(1), 1);
  EXPECT_EQ(useful_splits(64), 1);           // 4 tiles
  EXPECT_EQ(useful_splits(65), 2);           // 5 tiles
  EXPECT_EQ(useful_splits(4096), 64);        // 256 tiles
  EXPECT_EQ(useful_splits(4096 + 1), 65);
  EXPECT_EQ(useful_splits(131072), 2048);
}

// preferred_splits(num_seqs, kv_heads, q_heads, rows, nraw, device, compressed) == want, and why.
struct Case {
  int32_t seqs, kv_heads, q_heads;
  int64_t rows;
  int32_t nraw;
  SplitDevice dev;
  int64_t compressed;  // -1: no bound
  int32_t want;
  const char* why;
};

// The wide kernels (16 query vectors per pass, 2 CTAs per SM) count passes of 16: 4 rows x 4 q heads per kv head
// is one pass there (trimmed at 32k like one-row decode) and two passes of the 8-vector kernel (not trimmed).
TEST(SplitCount, WideKernelsCountPassesOf16Vectors) {
  const SplitDevice wide{132, 2};
  EXPECT_EQ(preferred_splits(1, 8, 32, 4, 1, wide, 32768, 2 * kSplitVectors), 32);
  EXPECT_EQ(preferred_splits(1, 8, 32, 4, 1, wide, 32768, kSplitVectors), 64);
  EXPECT_EQ(preferred_splits(1, 8, 128, 1, 1, wide, 32768, 2 * kSplitVectors), 32);  // GQA 16, one row
  EXPECT_EQ(preferred_splits(1, 8, 128, 2, 1, wide, 32768, 2 * kSplitVectors), 64);  // 2 rows: two passes of 16
}

TEST(SplitCount, Rule) {
  const Case cases[] = {
      // grids of more than one wave keep ceil(1056 / pairs) capped at 64
      {64, 8, 32, 64, 1, kH200, -1, 3, "B = 64 x 8 kv heads"},
      {64, 8, 32, 64, 1, kH200, 32768, 3, "B = 64: a bound the count cannot use changes nothing"},
      {2, 8, 32, 2, 1, kH200, 4096, 15, "B = 2 x 8 kv heads at 4k: 1040 CTAs, two waves, trimmed (stop 27)"},
      {2, 8, 32, 2, 1, kH200, 131072, 64, "B = 2 x 8 kv heads at 128k: two waves"},
      {1, 8, 32, 1, 1, kNone, 4096, 64, "no device: the usual count"},
      {1, 4, 16, 1, 1, kH200, 4096, 64, "4 kv heads: 2 per SM would be 65 (the wide merge)"},
      {1, 8, 32, 1, 1, kH200d256, 4096, 32, "d = 256 (2 CTAs per SM) at 4k: 520 CTAs, two waves, trimmed"},
      {1, 8, 32, 1, 1, kH200d256, 131072, 64, "d = 256 at 128k: two waves"},
      // short bounded one-wave calls: 2 CTAs per SM (at most 8 tiles per warp at the usual count: 32k)
      {1, 8, 32, 1, 1, kH200, 32768, 32, "8 kv heads, 32k: 264 / 8 - 1"},
      {1, 8, 32, 1, 2, kH200, 4096 - 64, 31, "a fused step with a 64-token window at 4k: - 2"},
      {1, 8, 32, 1, 2, kH200, 32768 - 64, 64, "... at 32k: 31 splits would give 17 tiles per warp (2 x 8 at 64)"},
      {1, 8, 32, 1, 2, kH200, 16384 - 64, 31, "... at 16k: 4 tiles per warp at 64 (a short call): trimmed"},
      {1, 8, 32, 1, 2, kH200, 8192 - 64, 31, "... at 8k"},
      {1, 8, 32, 1, 2, kH200, 16 * 1260, 64, "1260 tiles: 5 tiles per warp at 64, 11 at 31 (> 2 x 5)"},
      {1, 8, 32, 1, 2, kH200, 16 * 1240, 31, "1240 tiles: 5 and 10 (= 2 x 5)"},
      {1, 8, 32, 1, 1, kH200, 8192 - 64, 32, "an attention call with the window at 8k: 4 tiles per warp (2 x 2)"},
      {1, 8, 32, 1, 1, kH200, 32768 - 64, 32, "... at 32k: 16 tiles per warp (2 x 8)"},
      {1, 8, 32, 1, 1, kH200, 5000, 32, "8 kv heads, 5000 tokens: 3 tiles per warp (2 x 2)"},
      {1, 6, 24, 1, 1, kH200, 8192, 43, "6 kv heads: 264 / 6 - 1"},
      {1, 8, 32, 1, 1, kH200, 32769, 64, "longer than 32k: the long loop wants 4 CTAs per SM"},
      {1, 8, 32, 1, 1, kH200, 131072, 64, "128k"},
      {1, 8, 32, 1, 1, kH200, -1, 64, "no bound"},
      {1, 8, 32, 17, 1, kH200, 4096, 64, "prefill-sized rows: the usual count"},
      // few pairs: filled to 2 CTAs per SM
      {1, 1, 4, 1, 1, kH200, -1, 254, "1 kv head: min(264 - 1, 254)"},
      {1, 2, 8, 1, 1, kH200, -1, 131, "2 kv heads: 264 / 2 - 1"},
      {1, 2, 8, 1, 2, kH200, -1, 130, "2 kv heads, a fused step with fp16 regions"},
      {1, 1, 4, 1, 1, kNone, -1, 64, "1 kv head, no device"},
      {1, 1, 4, 17, 1, kH200, -1, 64, "prefill-sized rows (the workspace grows with rows x splits)"},
      // the bound caps the count at the splits that can hold work
      {1, 1, 4, 1, 1, kH200, 4096, 64, "1 kv head at 4k: 64 splits hold every tile (190 of 254 were empty)"},
      {1, 2, 8, 1, 1, kH200, 8192, 128, "2 kv heads at 8k"},
      {1, 1, 4, 1, 1, kH200, 32768, 254, "1 kv head at 32k: the fill"},
      {1, 8, 32, 1, 1, kH200, 1024, 16, "8 kv heads at 1k"},
      {1, 8, 32, 1, 1, kH200, 4096, 32, "8 kv heads at 4k: trimmed"},
      {1, 8, 32, 1, 1, kH200, 0, 1, "everything fp16"},
      // speculative verification: more than 8 query vectors per (sequence, kv head) take two or more passes
      // over the split's tiles; the trim then stops at 4 tiles per warp at the usual count (16k)
      {1, 8, 32, 2, 1, kH200, 32768, 32, "2 rows x 4 q heads = 8 vectors: one pass, trimmed at 32k"},
      {1, 8, 32, 4, 1, kH200, 32768, 64, "4 rows: two passes, 32k keeps 64 (0.98x trimmed)"},
      {1, 8, 32, 16, 1, kH200, 32768, 64, "16 rows: 32k keeps 64 (0.95x trimmed)"},
      {1, 8, 32, 16, 1, kH200, 16384, 32, "16 rows at 16k: trimmed (1.01x)"},
      {1, 8, 32, 4, 1, kH200, 4096, 32, "4 rows at 4k: trimmed (1.17x)"},
      {1, 8, 64, 2, 1, kH200, 32768, 64, "8 q heads per kv head, 2 rows: two passes"},
      // 3 resident CTAs per SM: a one-wave grid of the 4-per-SM plan beyond 396 CTAs is cut to 396
      {1, 8, 32, 1, 1, kH200r3, 131072, 48, "128k: 65 x 8 = 520 CTAs -> 396 / 8 - 1"},
      {1, 8, 32, 1, 1, kH200r3, -1, 48, "no bound"},
      {1, 8, 32, 1, 2, kH200r3, 32768 - 64, 47, "a fused step with a window at 32k: 396 / 8 - 2"},
      {1, 8, 32, 4, 1, kH200r3, 32768, 48, "4 rows at 32k"},
      {1, 7, 28, 1, 1, kH200r3, -1, 55, "7 kv heads: 65 x 7 = 455 -> 396 / 7 - 1"},
      {1, 8, 32, 1, 1, kH200r3, 32768, 32, "32k: trimmed to 264 CTAs, which fit"},
      {1, 8, 32, 1, 1, kH200r3, 4096, 32, "4k: trimmed"},
      {1, 8, 32, 1, 2, kH200r3, 4096 - 64, 31, "a fused step with a window at 4k: trimmed"},
      {1, 4, 16, 1, 1, kH200r3, -1, 64, "4 kv heads: 260 CTAs fit"},
      {1, 2, 8, 1, 1, kH200r3, -1, 131, "2 kv heads: filled to 264 CTAs"},
      {1, 1, 4, 1, 1, kH200r3, -1, 254, "1 kv head: filled"},
      {2, 8, 32, 2, 1, kH200r3, 131072, 64, "B = 2: more than one wave of the plan, unchanged"},
      {64, 8, 32, 64, 1, kH200r3, 32768, 3, "B = 64: unchanged"},
      // small batches: a bounded short call of several waves trims to 2 CTAs per SM where trim_pays says so,
      // to at least kMinTrimmedSplits (ff7539c, docs/history/cuda-split-count.md)
      {2, 8, 32, 2, 1, kH200r3, 4096, 15, "B = 2 at 4k: 64 -> 264 / 16 - 1"},
      {2, 8, 32, 2, 1, kH200r3, 8192, 15, "B = 2 at 8k: 2 tiles per warp at 64 (6 at the resident wave)"},
      {2, 8, 32, 2, 1, kH200, 16384 + 64, 64, "B = 2 above 16k, 4 CTAs per SM resident: the trim does not pay"},
      {2, 8, 32, 2, 1, kH200r3, -1, 64, "B = 2 without a bound"},
      {2, 8, 32, 2, 2, kH200r3, 4096 - 64, 14, "B = 2, a fused step with a window at 4k: 264 / 16 - 2"},
      {4, 8, 32, 4, 1, kH200r3, 4096, 7, "B = 4 at 4k: 33 -> 264 / 32 - 1"},
      {4, 8, 32, 4, 1, kH200, 8704, 33, "B = 4 at 8.5k, 4 per SM: 5 tiles per warp at 33, 20 at 7"},
      {8, 8, 32, 8, 1, kH200, 4096, 3, "B = 8 at 4k, 4 per SM: 17 -> 264 / 64 - 1"},
      {8, 8, 32, 8, 1, kH200, 4416, 17, "B = 8 at 4.4k, 4 per SM: 5 tiles per warp at 17, 24 at 3"},
      {16, 8, 32, 16, 1, kH200, 4096, 9, "B = 16 at 4k, 4 per SM: the trim would leave 1 split (< kMinTrimmedSplits)"},
      {64, 8, 32, 64, 1, kH200r3, 512, 3, "B = 64 at 512 tokens: unchanged"},
      {2, 8, 32, 34, 1, kH200r3, 4096, 64, "B = 2 with 17 rows per sequence: not a decode call"},
      // ... and with 3 resident per SM, cut to one resident wave where its warps take 10-72 tiles (5a0426e)
      {2, 8, 32, 2, 1, kH200r3, 16384, 23, "B = 2 at 16k: 396 / 16 - 1, 12 tiles per warp (over the trim)"},
      {2, 8, 32, 2, 1, kH200r3, 32768, 23, "B = 2 at 32k: 23 tiles per warp (1.20x over 64)"},
      {2, 8, 32, 2, 1, kH200r3, 65536, 23, "B = 2 at 64k: 45"},
      {2, 8, 32, 2, 1, kH200r3, 131072, 64, "B = 2 at 128k: 90 tiles per warp, the usual count"},
      {2, 8, 32, 2, 2, kH200r3, 32768 - 64, 22, "B = 2, a fused step with a window at 32k: 396 / 16 - 2"},
      {3, 8, 32, 3, 1, kH200r3, 8192, 10, "B = 3 at 8k: 9 tiles per warp at the resident wave, trimmed"},
      {3, 8, 32, 3, 1, kH200r3, 16384, 15, "B = 3 at 16k: 396 / 24 - 1"},
      {3, 8, 32, 3, 1, kH200r3, 65536, 15, "B = 3 at 64k: 69 tiles per warp"},
      {4, 8, 32, 4, 1, kH200r3, 4096, 7, "B = 4 at 4k: 6 tiles per warp at the resident wave, trimmed"},
      {4, 8, 32, 4, 1, kH200r3, 8704, 11, "B = 4 at 8.5k: 13 tiles per warp"},
      {4, 8, 32, 4, 1, kH200r3, 32768, 11, "B = 4 at 32k: 47"},
      {4, 8, 32, 4, 1, kH200r3, 65536, 33, "B = 4 at 64k: 94, the usual count"},
      {4, 8, 32, 16, 1, kH200r3, 16384, 33, "B = 4 with 4 rows each: two passes, not cut"},
      {6, 8, 32, 6, 1, kH200r3, 4096, 7, "B = 6 at 4k: 396 / 48 - 1, 10 tiles per warp (over the trim's 4)"},
      {6, 8, 32, 6, 1, kH200r3, 32768, 22, "B = 6 at 32k: 74 tiles per warp, the usual count"},
      {8, 8, 32, 8, 1, kH200r3, 4096, 5, "B = 8 at 4k: 396 / 64 - 1, 13 tiles per warp (over the trim's 3)"},
      {8, 8, 32, 8, 1, kH200r3, 16384, 5, "B = 8 at 16k: 52"},
      {8, 8, 32, 8, 1, kH200r3, 32768, 17, "B = 8 at 32k: 103, the usual count"},
      {8, 8, 32, 8, 2, kH200r3, 4096 - 64, 6, "B = 8, a fused step with a window: 4 < kMinCutSplits, 528 / 64 - 2"},
      {8, 8, 32, 8, 2, kH200r3, 16384 - 64, 17, "... at 16k: 43 tiles per warp at 6 (> kWaveCutMaxRounds)"},
      {8, 8, 32, 8, 1, kH200r3, -1, 17, "B = 8 without a bound"},
      {12, 8, 32, 12, 1, kH200r3, 16384, 11, "B = 12 at 16k: 396 / 96 - 1 = 3 < kMinCutSplits, 528 / 96 - 1 = 4: 64 tiles"},
      {12, 8, 32, 12, 1, kH200r3, 4096, 4, "B = 12 at 4k: one planned wave, 16 tiles per warp (1.31x)"},
      {9, 8, 32, 9, 1, kH200r3, 8192, 6, "B = 9 at 8k: 528 / 72 - 1, 22 tiles per warp"},
      {10, 8, 32, 10, 1, kH200r3, 8192, 14, "B = 10 at 8k: 26 tiles per warp at 5 (0.96x), the usual count"},
      {16, 8, 32, 16, 1, kH200r3, 4096, 3, "B = 16 at 4k: 528 / 128 - 1 (1.24x)"},
      {16, 8, 32, 16, 1, kH200r3, 2048, 3, "B = 16 at 2k (1.40x)"},
      {16, 8, 32, 16, 1, kH200r3, 8192, 9, "B = 16 at 8k: 43 tiles per warp, the usual count"},
      {17, 8, 32, 17, 1, kH200r3, 4096, 8, "B = 17: 528 / 136 - 1 = 2 < kMinTrimmedSplits"},
      {64, 8, 32, 64, 1, kH200r3, 4096, 3, "B = 64: unchanged"},
  };
  for (const Case& c : cases)
    EXPECT_EQ(preferred_splits(c.seqs, c.kv_heads, c.q_heads, c.rows, c.nraw, c.dev, c.compressed), c.want) << c.why;
}

TEST(SplitCount, TrimPays) {
  EXPECT_EQ(warp_rounds(256, 64), 1);
  EXPECT_EQ(warp_rounds(252, 31), 3);   // 9 tiles per split: warp 0 takes 3
  EXPECT_EQ(warp_rounds(2044, 31), 17);
  EXPECT_EQ(warp_rounds(2044, 64), 8);
  EXPECT_EQ(warp_rounds(0, 64), 1);
  EXPECT_TRUE(trim_pays(252, 64, 31, 1));    // 1 tile per warp at 64, 3 at 31: short
  EXPECT_TRUE(trim_pays(1020, 64, 31, 1));   // 4 and 9: still short
  EXPECT_TRUE(trim_pays(1028, 64, 31, 1));   // 5 and 9 <= 2 x 5
  EXPECT_FALSE(trim_pays(1260, 64, 31, 1));  // 5 and 11 > 2 x 5
  EXPECT_TRUE(trim_pays(2048, 64, 32, 1));   // 8 and 16 = 2 x 8
  EXPECT_FALSE(trim_pays(2044, 64, 31, 1));  // 8 and 17 > 2 x 8
  EXPECT_FALSE(trim_pays(2304, 64, 32, 1));  // 9 tiles per warp at 64: the long loop wants 4 CTAs per SM
  EXPECT_FALSE(trim_pays(2048, 64, 32, 2));  // two passes: only up to 4 tiles per warp
  EXPECT_TRUE(trim_pays(1024, 64, 32, 8));   // 4: short, however many passes
}

TEST(SplitCount, ResidentCut) {
  EXPECT_EQ(resident_cut(2048, 16, 1, kH200r3), 23);  // B = 2 at 32k: 23 tiles per warp
  EXPECT_EQ(resident_cut(256, 16, 1, kH200r3), 0);    // B = 2 at 4k: 3 (< kResidentCutMinRounds)
  EXPECT_EQ(resident_cut(9 * 92, 16, 1, kH200r3), 0);             // 9 tiles per warp (23 x 4 warps) ...
  EXPECT_EQ(resident_cut(9 * 92 + 1, 16, 1, kH200r3), 23);        // ... 10
  EXPECT_EQ(resident_cut(72 * 92, 16, 1, kH200r3), 23);           // 72
  EXPECT_EQ(resident_cut(72 * 92 + 1, 16, 1, kH200r3), 0);        // 73
  EXPECT_EQ(resident_cut(2048, 16, 1, kH200), 0);     // 4 per SM resident: no cut
  EXPECT_EQ(resident_cut(2048, 72, 1, kH200r3), 0);   // 396 / 72 - 1 = 4 < kMinCutSplits
  EXPECT_EQ(resident_cut(1024, 64, 1, kH200r3), 5);   // B = 8 at 16k
  EXPECT_EQ(resident_cut(24 * 12, 128, 1, kH200r3), 3);      // B = 16: the planned wave, 24 tiles per warp
  EXPECT_EQ(resident_cut(24 * 12 + 1, 128, 1, kH200r3), 0);  // 25
  EXPECT_EQ(resident_cut(1, 128, 1, kH200r3), 3);            // no lower bound
  EXPECT_EQ(resident_cut(256, 136, 1, kH200r3), 0);          // B = 17: 528 / 136 - 1 = 2 < kMinTrimmedSplits
}

// The balanced plan's per-sequence share (the device evaluates the same function; the assignment of CTAs is
// tested on the device, tests/cuda/balanced_plan_cuda_test.cu).
TEST(SplitCount, BalancedSharesFollowTheTiles) {
  // equal lengths: the grid's count each (when the sequences have that many useful splits)
  for (int64_t ns : {1, 3, 9, 64})
    for (int64_t B : {2, 16, 64}) EXPECT_EQ(balanced_splits(2048, 2048 * B, ns * B, B, balance_cap((int32_t)B, (int32_t)ns)), ns);
  EXPECT_EQ(balanced_splits(10, 10 * 16, 9 * 16, 16, 36), 3);  // 10 tiles: at most ceil(10 / 4) = 3 useful
  // 16 sequences of 1k .. 64k (9 splits each in the grid): the 64k one takes 1 + 128 x 4096 / total
  int64_t total = 0;
  for (int i = 0; i < 16; ++i) total += (1024 + i * 64512 / 15) / 16;
  EXPECT_EQ(balanced_splits(4096, total, 144, 16, 36), 1 + 128 * 4096 / total);
  EXPECT_EQ(balanced_splits(64, total, 144, 16, 36), 1);
  // one dominant sequence: capped (4 x the grid's count, at most 64)
  EXPECT_EQ(balance_cap(16, 9), 36);
  EXPECT_EQ(balance_cap(2, 64), 64);
  EXPECT_EQ(balance_cap(64, 3), 12);
  EXPECT_EQ(balance_cap(1, 64), 64);    // one sequence: nothing to balance
  EXPECT_EQ(balance_cap(257, 1), 1);    // beyond kBalanceMaxSeqs
  EXPECT_EQ(balance_cap(2, 131), 131);  // already beyond 64 (few kv heads): the grid's count
  EXPECT_EQ(balanced_splits(4096, 4096 + 15 * 64, 144, 16, 36), 36);
  // no tiles anywhere, or a sequence without tiles: one split (it writes the empty partial)
  EXPECT_EQ(balanced_splits(0, 0, 144, 16, 36), 1);
  EXPECT_EQ(balanced_splits(0, 5000, 144, 16, 36), 1);
  // the shares never exceed the grid
  for (int64_t B : {2, 5, 16, 100, 256}) {
    int64_t tot = 0, sum = 0;
    std::vector<int64_t> t(B);
    for (int64_t i = 0; i < B; ++i) tot += t[i] = (i * 7919) % 3001 + (i % 5 == 0 ? 40000 : 0);
    for (int64_t i = 0; i < B; ++i) sum += balanced_splits(t[i], tot, 5 * B, B, balance_cap((int32_t)B, 5));
    EXPECT_LE(sum, 5 * B) << B;
  }
  // the plan runs only where a split of the longest possible sequence is long
  EXPECT_TRUE(balance_pays(-1, 9));                 // no bound
  EXPECT_FALSE(balance_pays(4096, 15));             // B = 2 at 4k: 256 tiles over 15 splits, 5 per warp
  EXPECT_FALSE(balance_pays(4096, 5));              // B = 8 at 4k: 13 per warp
  EXPECT_FALSE(balance_pays(16 * 4 * 16 * 9, 9));   // exactly 16 tiles per warp
  EXPECT_TRUE(balance_pays(16 * 4 * 16 * 9 + 16, 9));
  EXPECT_TRUE(balance_pays(65536, 9));              // 16 sequences up to 64k
  EXPECT_TRUE(balance_pays(8192, 3));               // B = 64 at 8k: 43 tiles per warp
  EXPECT_EQ(plan_tiles(-3), 0);
  EXPECT_EQ(plan_tiles(17), 2);
  EXPECT_EQ(plan_tiles(INT64_MAX), (int64_t)1 << 36);
}

TEST(SplitCount, ConstantsMatchThePublicApi) {
  EXPECT_EQ(kFusedMaxRows, FMKV_FUSED_MAX_ROWS);
  // the compressed bound of a length bound: sink and window tokens are not split
  fmkv_config c;
  fmkv_config_default(&c);
  c.sink_tokens = 4;
  c.window_tokens = 64;
  EXPECT_EQ(compressed_end(c, 4096) - c.sink_tokens, 4096 - 64 - 4);
  EXPECT_EQ(compressed_end(c, 10) - c.sink_tokens, 0);
}

}  // namespace
}  // namespace fmkv::cuda
