// Host check of the format-3 decode sequences proposed for the other code widths (docs/history/
// format3-prototypes.md, "What this gives each width"; the 3-bit ones are checked by format3_decode_check):
// random codes are written into each proposed per-lane word layout, decoded with the exact byte-permute
// sequences a kernel would issue (prmt.b32 modelled by prmt_host.h), and compared with the generated level
// tables (tools/lloyd_max: the int8 grid, the odd grid, the three-significant-bit grid):
//   * 2-bit K, int8 operands of mma.m16n8k32 s8: one word per lane and group, nibble e of the low half = codes
//     e of registers a0 (bits 0-1) and a1 (bits 2-3), the high half the same for a2 / a3; a_i = prmt(T, 0,
//     (X >> s_i) & 0x3333) from the 4 signed int8 levels in T (1 permute + 1 mask per 4 codes).
//   * 4-bit K on the odd grid: two words per lane and group (X0 = a0 | a1 << 16, X1 = a2 | a3 << 16, nibble =
//     sign << 3 | magnitude); a_i = prmt(P0, P1, half & 0x7777) ^ prmt(X, 16 X, 0x9D8C / 0xBFAE): the int8 T
//     of the magnitude or its complement ~T for a negative code, whose level is 2 T + 1 -- checked as values
//     and through a dot product, sum q (2 T + 1) = 2 sum q T + sum q.
//   * 2-bit V, fp16 pairs of mma.m16n8k16 (levels with 3 significant bits: zero low bytes): one word W per lane
//     and group; pair i's two codes sit at bits 4-5 and 12-13 of v_i = W shifted right by 0, 2, -4, -2 (pairs
//     0-3, the low half; negative: left) or 16, 18, 12, 14 (pairs 4-7); pair = prmt(TV, 0, (v_i & 0x3030) |
//     0x0404) from the 4 signed high bytes in TV, the low bytes zero (1 permute + 1 mask, + a shift for 7 of 8).
// Exit status 0: every decoded value matches; 1: a mismatch (printed).
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "lloyd_max.h"
#include "prmt_host.h"

namespace {

long failures = 0;
void check(bool ok, const char* what, int it, int i) {
  if (!ok && ++failures <= 10) std::printf("mismatch: %s (trial %d, value %d)\n", what, it, i);
}

// The signed level table of a b-bit sign-magnitude code (bit b-1 = sign, the rest the magnitude index).
std::vector<int> signed_levels(const fmkv::IntegerLevels& q) {
  const int k = (int)q.levels.size() / 2;
  std::vector<int> t(2 * k);
  for (int m = 0; m < k; ++m) {
    t[m] = q.levels[k + m];       // positive, magnitude m
    t[k + m] = -q.levels[k + m];  // negative
  }
  return t;
}

void k2(std::mt19937_64& rng) {
  const std::vector<int> lv = signed_levels(fmkv::integer_levels_gaussian(2, 127));
  uint32_t T = 0;
  for (int c = 0; c < 4; ++c) T |= (uint32_t)(uint8_t)(int8_t)lv[c] << (8 * c);
  for (int it = 0; it < 2000; ++it) {
    int code[4][4];  // [register a_i][byte e]
    uint32_t X = 0;
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) {
        code[i][e] = (int)(rng() & 3u);
        X |= (uint32_t)code[i][e] << (16 * (i >> 1) + 4 * e + 2 * (i & 1));
      }
    const int shift[4] = {0, 2, 16, 18};
    for (int i = 0; i < 4; ++i) {
      const uint32_t a = prmt_host(T, 0u, (X >> shift[i]) & 0x3333u);
      for (int e = 0; e < 4; ++e) check((int8_t)(a >> (8 * e)) == lv[code[i][e]], "2-bit K", it, 4 * i + e);
    }
  }
}

void k4(std::mt19937_64& rng) {
  const fmkv::IntegerLevels q = fmkv::integer_levels_on_grid(4, fmkv::LevelGrid::kOddGrid);
  const std::vector<int> lv = signed_levels(q);  // odd integers 2 T + 1
  uint32_t P[2] = {0, 0};                           // T of magnitudes 0..7
  for (int m = 0; m < 8; ++m) P[m / 4] |= (uint32_t)((lv[m] - 1) / 2) << (8 * (m % 4));
  for (int it = 0; it < 2000; ++it) {
    int code[4][4];
    uint32_t X[2] = {0, 0};
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) {
        code[i][e] = (int)(rng() & 15u);
        X[i >> 1] |= (uint32_t)code[i][e] << (16 * (i & 1) + 4 * e);
      }
    long dot = 0, want = 0, qsum = 0;
    for (int i = 0; i < 4; ++i) {
      const uint32_t x = X[i >> 1], half = (i & 1) ? x >> 16 : x;
      const uint32_t a = prmt_host(P[0], P[1], half & 0x7777u) ^ prmt_host(x, x * 16u, (i & 1) ? 0xBFAEu : 0x9D8Cu);
      for (int e = 0; e < 4; ++e) {
        const int t = (int8_t)(a >> (8 * e)), level = lv[code[i][e]];
        check(2 * t + 1 == level, "4-bit K on the odd grid", it, 4 * i + e);
        const int qv = (int)(rng() % 255) - 127;  // an int8 query part
        dot += (long)qv * t;
        qsum += qv;
        want += (long)qv * level;
      }
    }
    check(2 * dot + qsum == want, "4-bit K dot product (2 sum q T + sum q)", it, -1);
  }
}

void v2(std::mt19937_64& rng) {
  const std::vector<int> lv = signed_levels(fmkv::integer_levels_on_grid(2, fmkv::LevelGrid::kThreeSignificantBits));
  uint32_t TV = 0;  // fp16 high bytes of the 4 signed levels (their low bytes are zero)
  for (int c = 0; c < 4; ++c) {
    const unsigned short h = fmkv::f64_to_f16_bits((double)lv[c]);
    check((h & 0xffu) == 0, "2-bit V level with a nonzero low byte", -1, c);
    TV |= (uint32_t)(h >> 8) << (8 * c);
  }
  // pair i (0..7) of a lane: v_i = W >> r_i (or << for the low groups), codes at bits 4-5 and 12-13 of v_i
  const int rot[8] = {0, 2, -4, -2, 16, 18, 12, 14};  // right shift (negative: left)
  for (int it = 0; it < 2000; ++it) {
    int code[8][2];
    uint32_t W = 0;
    for (int i = 0; i < 8; ++i)
      for (int h = 0; h < 2; ++h) {
        code[i][h] = (int)(rng() & 3u);
        const int bit = 4 + 8 * h + rot[i];  // where v_i's field lands in W
        W |= (uint32_t)code[i][h] << bit;
      }
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = rot[i] >= 0 ? W >> rot[i] : W << -rot[i];
      const uint32_t pair = prmt_host(TV, 0u, (v & 0x3030u) | 0x0404u);
      for (int h = 0; h < 2; ++h) {
        const unsigned short want = fmkv::f64_to_f16_bits((double)lv[code[i][h]]);
        check((uint16_t)(pair >> (16 * h)) == want, "2-bit V fp16 pair", it, 2 * i + h);
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(12345);
  k2(rng);
  k4(rng);
  v2(rng);
  std::printf("{\"suite\": \"format3_widths_check\", \"checks\": [\"2-bit K\", \"4-bit K odd grid\", \"2-bit V\"], "
              "\"mismatches\": %ld, \"ok\": %s}\n", failures, failures ? "false" : "true");
  return failures ? 1 : 0;
}
