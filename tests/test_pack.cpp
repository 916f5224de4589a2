#include <gtest/gtest.h>

#include <random>
#include <set>

#include "format/pack.h"
#include "format/quantize_group.h"
#include "ref/quantize.h"

namespace {

TEST(Pack, FieldPositionsAreABijection) {
  std::set<int> seen;
  for (int j = 0; j < 32; ++j) {
    int pos = fmkv_field_word(j) * 32 + fmkv_field_shift(j);
    EXPECT_EQ(pos % 2, 0);
    seen.insert(pos);
  }
  EXPECT_EQ(seen.size(), 32u);
  // (word >> 2s) & 0x03030303 yields coordinates i0, i0+16, i0+1, i0+17 in bytes 0..3.
  for (int w = 0; w < 2; ++w)
    for (int s = 0; s < 4; ++s) {
      int i0 = 8 * w + 2 * s, want[4] = {i0, i0 + 16, i0 + 1, i0 + 17};
      for (int byte = 0; byte < 4; ++byte) {
        EXPECT_EQ(fmkv_field_word(want[byte]), w);
        EXPECT_EQ(fmkv_field_shift(want[byte]), 8 * byte + 2 * s);
      }
    }
}

// Format version 2: a 4-bit code is the nibble 4 (j & 7) of word j >> 3, sign in the nibble's bit 3.
TEST(Pack, FourBitCodesAreNibbles) {
  std::mt19937 r(std::random_device{}());
  uint8_t codes[32];
  for (auto& c : codes) c = (uint8_t)(r() % 16u);
  uint32_t w[4] = {0, 0, 0, 0};
  fmkv::ref::pack_group(codes, 4, w, 1);
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(fmkv_nibble_word(j), j / 8);
    EXPECT_EQ(fmkv_nibble_shift(j), 4 * (j % 8));
    EXPECT_EQ((w[j / 8] >> (4 * (j % 8))) & 15u, codes[j]) << "coordinate " << j;
  }
}

// A 5-bit code: its magnitude (bits 0-3) is the nibble 4 (j & 7) of word j >> 3 (a 4-bit code's place), its sign
// (bit 4) bit j of word 4, the sign plane.
TEST(Pack, FiveBitCodesAreMagnitudeNibblesAndASignPlane) {
  std::mt19937 r(std::random_device{}());
  uint8_t codes[32];
  for (auto& c : codes) c = (uint8_t)(r() % 32u);
  uint32_t w[5] = {0, 0, 0, 0, 0};
  fmkv::ref::pack_group(codes, 5, w, 1);
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ((w[j / 8] >> (4 * (j % 8))) & 15u, codes[j] & 15u) << "coordinate " << j;
    EXPECT_EQ((w[4] >> j) & 1u, (uint32_t)codes[j] >> 4) << "coordinate " << j;
  }
}

TEST(Pack, RoundTripEveryBitWidthAndHeadDim) {
  std::mt19937 r(std::random_device{}());
  for (int bits = FMKV_CODE_BITS_MIN; bits <= FMKV_CODE_BITS_MAX; ++bits)
    for (int d : {64, 128, 256}) {
      const int64_t stride = 16;
      std::vector<uint8_t> codes(d), back(d);
      std::vector<uint32_t> words((size_t)(d / 32) * bits * stride, 0xDEADBEEFu);
      for (auto& c : codes) c = (uint8_t)(r() % (1u << bits));
      for (int g = 0; g < d / 32; ++g) fmkv::ref::pack_group(&codes[g * 32], bits, &words[(size_t)g * bits * stride], stride);
      for (int g = 0; g < d / 32; ++g) fmkv::ref::unpack_group(&words[(size_t)g * bits * stride], stride, bits, &back[g * 32]);
      EXPECT_EQ(codes, back) << bits << " bits, d=" << d;
      // 100% storage efficiency: every bit of every written word carries information.
      uint32_t all_or = 0;
      for (int g = 0; g < d / 32; ++g)
        for (int w = 0; w < bits; ++w) all_or |= ~words[(size_t)(g * bits + w) * stride] | words[(size_t)(g * bits + w) * stride];
      EXPECT_EQ(all_or, 0xFFFFFFFFu);
    }
}

TEST(Pack, EveryBitIsUsed) {
  for (int bits = FMKV_CODE_BITS_MIN; bits <= FMKV_CODE_BITS_MAX; ++bits) {
    std::vector<uint32_t> acc(bits, 0);
    for (int j = 0; j < 32; ++j) {
      uint8_t codes[32] = {0};
      for (uint32_t bit = 0; bit < (uint32_t)bits; ++bit) {
        codes[j] = (uint8_t)(1u << bit);
        uint32_t w[FMKV_CODE_BITS_MAX] = {};
        fmkv::ref::pack_group(codes, bits, w, 1);
        int set = 0;
        for (int k = 0; k < bits; ++k) { set += __builtin_popcount(w[k]); acc[k] |= w[k]; }
        EXPECT_EQ(set, 1);
      }
    }
    for (int k = 0; k < bits; ++k) EXPECT_EQ(acc[k], 0xFFFFFFFFu) << bits << " bits word " << k;
  }
}

// Format 3, 3-bit codes: the tile block's bit positions are a bijection of (token, group, coordinate, bit) onto
// the block (dense: 3 bits per code), for K and V and every head_dim.
TEST(Pack, TileBlockPositionsAreABijection) {
  for (int d : {64, 128, 256}) {
    const int G = d / 32;
    ASSERT_EQ(fmkv_tile_block_bytes(d) * 8, 16 * G * 32 * 3);
    for (int is_v = 0; is_v < 2; ++is_v) {
      std::vector<int> hits((size_t)fmkv_tile_block_bytes(d) * 8, 0);
      for (int t = 0; t < 16; ++t)
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 32; ++c)
            for (int b = 0; b < 3; ++b) {
              const int n = fmkv_tile_code_bit(G, is_v, t, g, c, b);
              ASSERT_GE(n, 0);
              ASSERT_LT(n, (int)hits.size());
              ++hits[(size_t)n];
            }
      for (size_t n = 0; n < hits.size(); ++n) ASSERT_EQ(hits[n], 1) << "d=" << d << (is_v ? " V" : " K") << " bit " << n;
    }
  }
}

// Writing one token's codes changes only that token's bits; reading gives back every token's codes.
TEST(Pack, TileBlockWritesKeepTheOtherTokens) {
  std::mt19937 r(std::random_device{}());
  for (int d : {64, 128, 256})
    for (int is_v = 0; is_v < 2; ++is_v) {
      const int G = d / 32;
      std::vector<uint8_t> block((size_t)fmkv_tile_block_bytes(d));
      for (auto& x : block) x = (uint8_t)r();
      std::vector<uint8_t> codes((size_t)16 * d);
      for (int t : {5, 0, 15, 1, 10, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14}) {  // any order
        const std::vector<uint8_t> before = block;
        for (int i = 0; i < d; ++i) {
          codes[(size_t)t * d + i] = (uint8_t)(r() % 8u);
          fmkv::tile_put_code(block.data(), G, is_v, t, i / 32, i % 32, codes[(size_t)t * d + i]);
        }
        int changed_other = 0;
        for (int t2 = 0; t2 < 16; ++t2)
          if (t2 != t)
            for (int i = 0; i < d; ++i)
              for (int b = 0; b < 3; ++b) {
                const int n = fmkv_tile_code_bit(G, is_v, t2, i / 32, i % 32, b);
                changed_other += ((block[n >> 3] ^ before[n >> 3]) >> (n & 7)) & 1;
              }
        EXPECT_EQ(changed_other, 0) << "writing token " << t << " changed other tokens' bits";
      }
      for (int t = 0; t < 16; ++t)
        for (int i = 0; i < d; ++i)
          ASSERT_EQ(fmkv::tile_get_code(block.data(), G, is_v, t, i / 32, i % 32), codes[(size_t)t * d + i])
              << "d=" << d << " t=" << t << " i=" << i;
    }
}

TEST(Format, BytesPerTokenPerHead) {
  EXPECT_EQ(fmkv_bytes_per_token_head(128, 3, 0), 56);
  EXPECT_EQ(fmkv_bytes_per_token_head(128, 4, 0), 72);
  EXPECT_EQ(fmkv_bytes_per_token_head(128, 2, 0), 40);
  EXPECT_EQ(fmkv_bytes_per_token_head(128, 16, 0), 256);
  EXPECT_EQ(fmkv_bytes_per_token_head(64, 3, 0), 28);
  // scale group 64: one scale per 64 coordinates (d = 64: per vector; 36 B for k2v2)
  EXPECT_EQ(fmkv_bytes_per_token_head(64, 2, 64), 18);
  EXPECT_EQ(fmkv_bytes_per_token_head(64, 3, 64), 26);
  EXPECT_EQ(fmkv_bytes_per_token_head(128, 4, 64), 68);
  EXPECT_EQ(fmkv_bytes_per_token_head(256, 16, 64), 512);
  EXPECT_EQ(fmkv_bytes_per_token_head(128, 3, 32), fmkv_bytes_per_token_head(128, 3, 0));
  EXPECT_FALSE(fmkv_scale_group_supported(16));
  EXPECT_FALSE(fmkv_scale_group_supported(128));
  for (int P = 16; P <= 256; P *= 2)
    for (int d : {64, 128, 256})
      for (int b : {2, 3, 4, 16}) {
        EXPECT_EQ(fmkv_section_bytes(d, b, P, 0) % 16, 0);
        EXPECT_EQ(fmkv_section_bytes(d, b, P, 64) % 16, 0);
        if (b != 16) {
          EXPECT_EQ(fmkv_scales_offset(d, b, P) % 16, 0);
        }
      }
}

}  // namespace
