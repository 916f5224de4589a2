// The CUDA decode attention's split-count rule (src/cuda/split_count.h): host arithmetic, tested
// without a GPU. The H200 numbers: 132 SMs x min(2, 4 CTAs per SM) = 264 CTA slots.
#include <gtest/gtest.h>

#include "core/ops.h"
#include "cuda/split_count.h"
#include "fmkv/fmkv.h"

namespace fmkv::cuda {
namespace {

constexpr int64_t kH200Target = 264;

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
  // B = 1, 8 kv heads: ceil(1056 / 8) capped at 64; B = 64: ceil(1056 / 512) = 3
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200Target, -1), 64);
  EXPECT_EQ(preferred_splits(64, 8, 64, 1, kH200Target, -1), 3);
  EXPECT_EQ(preferred_splits(1, 4, 1, 1, kH200Target, -1), 64);
  // a bound at or above what the count can use changes nothing
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200Target, 131072), 64);
  EXPECT_EQ(preferred_splits(64, 8, 64, 1, kH200Target, 32768), 3);
}

TEST(SplitCount, FewPairsFillTheDevice) {
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kH200Target, -1), 254);  // min(264 - 1, 254)
  EXPECT_EQ(preferred_splits(1, 2, 1, 1, kH200Target, -1), 131);  // 264 / 2 - 1
  EXPECT_EQ(preferred_splits(1, 2, 1, 2, kH200Target, -1), 130);  // a fused step with fp16 regions
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, 0, -1), 64);             // no device: the usual count
  // prefill-sized row counts keep the usual count (the workspace grows with rows x splits)
  EXPECT_EQ(preferred_splits(1, 1, 17, 1, kH200Target, -1), 64);
}

TEST(SplitCount, BoundCapsShortCalls) {
  // 1 kv head at 4k: 64 splits hold every tile (was 254, 190 of them empty)
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kH200Target, 4096), 64);
  EXPECT_EQ(preferred_splits(1, 2, 1, 1, kH200Target, 8192), 128);
  EXPECT_EQ(preferred_splits(1, 1, 1, 1, kH200Target, 32768), 254);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200Target, 1024), 16);
  EXPECT_EQ(preferred_splits(1, 8, 1, 1, kH200Target, 0), 1);  // everything fp16
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
