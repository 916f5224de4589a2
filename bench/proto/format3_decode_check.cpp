// The layout check of format 3's tile blocks against the decode the CUDA kernel was prototyped with: random
// 3-bit codes are written with the format core's tile_put_code (FORMAT.md section 6), then decoded the way the
// prototype's fragment code did (f3_k_fragment / f3_v_fragment, as tile_k_fragment / tile_v_fragment in
// src/cuda/tile_blocks.cuh, with a host prmt and the mma fragment layouts of the PTX ISA): 0 mismatches, or exit 1.
// (Its device mode checked the prototype's patched decode loop at 42dc6b5; format 3's own CUDA kernels replaced the
// patch, and their correctness is the cross-backend harness: tests/test_backends.cpp, tests/golden/v3.txt.)
// The ctest format3_candidate_layout_host_check runs it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "fmkv/fmkv.h"
#include "format/pack.h"
#include "prmt_host.h"

namespace {

constexpr int kLevelsK[8] = {-88, -55, -31, -10, 10, 31, 55, 88};  // the kernel's int8 K table
constexpr int kLevelsV[8] = {-64, -40, -24, -8, 8, 24, 40, 64};    // the kernel's V table (fp16 high bytes)

// One section (K or V) of one 16-token tile of one kv head: the code block X[lane][G], Y[lane][G], written
// through the format core (format 3's tile blocks, tile_put_code); X and Y read as the kernel's fragment decode
// reads them.
struct TileWriter {
  uint8_t* block;  // the tile's code block (64 G 3 bytes)
  int G;
  uint32_t X(int lane, int g) const { return *reinterpret_cast<const uint32_t*>(block + 4 * (G * lane + g)); }
  uint16_t Y(int lane, int g) const { return *reinterpret_cast<const uint16_t*>(block + 128 * G + 2 * (G * lane + g)); }
  // code of tile token t (0..15), group g, coordinate c (0..31)
  void put_k(int t, int g, int c, int code) { fmkv::tile_put_code(block, G, 0, t, g, c, (uint32_t)code); }
  void put_v(int t, int g, int c, int code) { fmkv::tile_put_code(block, G, 1, t, g, c, (uint32_t)code); }
};

uint32_t bit3(uint32_t X, uint32_t Y) { return ((X >> 3) & 0x1111u) | ((X >> 18) & 0x2222u) | ((Y >> 1) & 0x4444u); }

// One random tile per section through the writer, decoded as the kernel does; 0 mismatches expected.
long layout_self_check(std::mt19937_64& rng) {
  constexpr int G = 4;
  const uint32_t TK0 = 0xF6E1C9A8u, TK1 = 0x58371F0Au, TV0 = 0xC8CED1D4u, TV1 = 0x54514E48u;
  long bad = 0;
  for (int it = 0; it < 64; ++it) {
    std::vector<uint8_t> blk(64 * G * 3, 0);
    TileWriter w{blk.data(), G};
    int ck[16][G][32], cv[16][G][32];
    for (int sv = 0; sv < 2; ++sv) {
      std::fill(blk.begin(), blk.end(), 0);
      for (int t = 0; t < 16; ++t)
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 32; ++c) {
            const int cd = (int)(rng() & 7u);
            if (sv) cv[t][g][c] = cd, w.put_v(t, g, c, cd);
            else ck[t][g][c] = cd, w.put_k(t, g, c, cd);
          }
      for (int lane = 0; lane < 32; ++lane)
        for (int g = 0; g < G; ++g) {
          const int gID = lane / 4, tid = lane % 4;
          const uint32_t X = w.X(lane, g), Y = w.Y(lane, g);
          if (!sv) {  // m16n8k32 s8 A: a0 (row gID, k 4 tid + e), a1 (row gID + 8), a2 / a3: k + 16
            const uint32_t a[4] = {prmt_host(TK0, TK1, X & 0x7777u), prmt_host(TK0, TK1, Y & 0x7777u),
                                   prmt_host(TK0, TK1, (X >> 16) & 0x7777u), prmt_host(TK0, TK1, bit3(X, Y))};
            for (int i = 0; i < 4; ++i)
              for (int e = 0; e < 4; ++e) {
                const int t = 2 * gID + (i & 1), c = 4 * tid + e + 16 * (i >> 1);
                bad += (int8_t)(a[i] >> (8 * e)) != kLevelsK[ck[t][g][c]];
              }
          } else {  // m16n8k16 f16 A of mma mt: a0 (row gID, k 2 tid + h), a1 (row gID + 8), a2 / a3: k + 8
            const uint32_t z = 0x0C0Cu, gg = bit3(X, Y);
            auto pair = [&](uint32_t v) { return prmt_host(TV0, TV1, (v & 0x7070u) | z); };
            const uint32_t a[8] = {pair(X << 4), pair(X), pair(X >> 12), pair(X >> 16),
                                   pair(Y << 4), pair(Y), pair(gg << 4), pair(gg)};
            for (int i = 0; i < 8; ++i)
              for (int h = 0; h < 2; ++h) {
                const int mt = i / 4, r = i % 4, c = 16 * mt + gID + 8 * (r & 1), k = 2 * tid + 8 * (r >> 1) + h;
                const int t = k < 8 ? 2 * k : 2 * (k - 8) + 1;
                const uint16_t hv = (uint16_t)(a[i] >> (16 * h));
                float f;
                fmkv_f16_to_f32(&hv, &f, 1);
                bad += f != (float)kLevelsV[cv[t][g][c]];
              }
          }
        }
    }
  }
  return bad;
}

}  // namespace

int main() {
  std::mt19937_64 rng(2026);
  const long bad = layout_self_check(rng);
  std::printf("{\"suite\": \"format3_decode_check\", \"check\": \"host writer vs the kernel's fragment decode\", "
              "\"mismatches\": %ld, \"ok\": %s}\n", bad, bad == 0 ? "true" : "false");
  return bad ? 1 : 0;
}
