// The CUDA decode attention's split-count rule (src/cuda/split_count.h): host arithmetic, tested
// without a GPU. The H200 numbers: 132 SMs, 4 CTAs per SM (d <= 128): 2 per SM = 264 CTAs, a wave 528.
#include <gtest/gtest.h>

#include "core/ops.h"
#include "cuda/split_count.h"
#include "fmkv/fmkv.h"

namespace fmkv::cuda {
namespace {

const SplitDevice kH200{132, 4};
const SplitDevice kH200d256{132, 2};  // d = 256: 2 CTAs per SM
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

TEST(SplitCount, ManyPairsAsBefore) {
  // grids of more than one wave keep ceil(1056 / pairs) capped at 64: B = 64 x 8 kv heads 3, B = 2 x 8 kv
  // heads 64 (1040 CTAs)
  EXPECT_EQ(preferred_splits(64, 8, 64, 1, kH200, -1), 3);
  EXPECT_EQ(preferred_splits(2, 8, 2, 1, kH200, 4096), 64);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kNone, 4096), 64);  // no device: the usual count
  // 4 kv heads: 2 per SM would be 65 (the wide merge): stays 64; d = 256 (2 CTAs per SM) keeps 64 at 8 kv heads
  EXPECT_EQ(preferred_splits(1, 4, 1, 1, kH200, 4096), 64);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200d256, 4096), 64);
  // a bound at or above what the count can use changes nothing
  EXPECT_EQ(preferred_splits(64, 8, 64, 1, kH200, 32768), 3);
}

TEST(SplitCount, ShortOneWaveCallsTrimmedToTwoPerSm) {
  // B = 1, 8 kv heads: 64 + 1 CTAs x 8 = 520 fit one wave; with a bound of at most 8 tiles per warp at 64
  // splits (32k tokens) -> 264 / 8 - 1 = 32 splits (- 2: a fused step with a window)
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, 32768), 32);
  EXPECT_EQ(preferred_splits(1, 8, 1, 2, kH200, 16384), 31);
  EXPECT_EQ(preferred_splits(1, 6, 1, 1, kH200, 8192), 43);
  // longer, or no bound: the usual 64 (the long loop wants 4 CTAs per SM)
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, 32769), 64);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, 131072), 64);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, -1), 64);
  EXPECT_EQ(preferred_splits(1, 8, 17, 1, kH200, 4096), 64);  // prefill-sized rows: the usual count
}

TEST(SplitCount, FewPairsFillTheDevice) {
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kH200, -1), 254);  // min(264 - 1, 254)
  EXPECT_EQ(preferred_splits(1, 2, 1, 1, kH200, -1), 131);  // 264 / 2 - 1
  EXPECT_EQ(preferred_splits(1, 2, 1, 2, kH200, -1), 130);  // a fused step with fp16 regions
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kNone, -1), 64);         // no device: the usual count
  // prefill-sized row counts keep the usual count (the workspace grows with rows x splits)
  EXPECT_EQ(preferred_splits(1, 1, 17, 1, kH200, -1), 64);
}

TEST(SplitCount, BoundCapsShortCalls) {
  // 1 kv head at 4k: 64 splits hold every tile (was 254, 190 of them empty)
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kH200, 4096), 64);
  EXPECT_EQ(preferred_splits(1, 2, 1, 1, kH200, 8192), 128);
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kH200, 32768), 254);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, 1024), 16);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, 4096), 32);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200, 0), 1);  // everything fp16
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
