// The CUDA append's tile-block writers (src/cuda/tile_writers.cuh) run on the host against the format core:
// a warp is 32 threads (one per lane) whose __shfl_xor_sync meets at a barrier; every block a writer produces
// must equal the one tile_put_code (src/format/pack.h) writes for the same codes. Cases: NT = 1, 2, 4 threads
// per vector (d = 64, 128, 256), K and V, warp tasks starting at several multiples of 8 (whole words), and the
// reduction writer applied token by token in reverse order over random earlier contents of the block.
// Exit status 1 on a difference (ctest cuda_tile_writers_host_check; no GPU needed).
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "fmkv/format.h"
#include "format/pack.h"

#define __device__
#define __forceinline__ inline

namespace {

uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {  // PTX prmt.b32 (default mode)
  const uint64_t v = (uint64_t)y << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}

// One emulated warp: each lane's thread posts its value, waits for all 32, reads its partner's, waits again.
struct Warp {
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  long phase = 0;
  uint32_t value[32];
  void barrier() {
    std::unique_lock<std::mutex> lk(mu);
    const long ph = phase;
    if (++arrived == 32) {
      arrived = 0;
      ++phase;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return phase != ph; });
    }
  }
};
Warp* g_warp = nullptr;
thread_local int t_lane = 0;

uint32_t __shfl_xor_sync(unsigned, uint32_t v, int m) {
  g_warp->value[t_lane] = v;
  g_warp->barrier();
  const uint32_t r = g_warp->value[t_lane ^ m];
  g_warp->barrier();
  return r;
}
void atomicAnd(unsigned int* a, unsigned int v) { *a &= v; }
void atomicOr(unsigned int* a, unsigned int v) { *a |= v; }

}  // namespace

#include "cuda/tile_writers.cuh"

namespace {

using fmkv::cuda::tile_put_group_red;
using fmkv::cuda::tile_put_group_words;

// The nibble words of one group's codes (thread_quantize_group's NIB output).
void nibble_words(const int* codes, uint32_t (&cw)[4]) {
  for (int i = 0; i < 4; ++i) cw[i] = 0;
  for (int c = 0; c < 32; ++c) cw[fmkv_nibble_word(c)] |= (uint32_t)codes[c] << fmkv_nibble_shift(c);
}

// One warp task of VPW = 32 / NT consecutive tokens from tok0 (a multiple of 8) of one section, K or V.
template <int NT>
int check_task(std::mt19937& rng, int tok0, int is_v) {
  constexpr int G = 2 * NT, VPW = 32 / NT;
  const int bb = fmkv_tile_block_bytes(32 * G), ntiles = (tok0 + VPW + 15) / 16 + 1;
  std::vector<uint8_t> init((size_t)ntiles * bb);
  for (auto& x : init) x = (uint8_t)rng();
  std::vector<int> codes((size_t)VPW * G * 32);
  for (auto& c : codes) c = (int)(rng() & 7u);
  auto code_of = [&](int v, int g) { return &codes[((size_t)v * G + g) * 32]; };
  std::vector<uint8_t> want = init;
  for (int v = 0; v < VPW; ++v)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 32; ++c)
        fmkv::tile_put_code(want.data() + ((tok0 + v) / 16) * bb, G, is_v, (tok0 + v) & 15, g, c, (uint32_t)code_of(v, g)[c]);

  std::vector<uint8_t> whole = init;  // lane = vector NT + thread, groups t and t + NT, as the append's threads
  Warp warp;
  g_warp = &warp;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane)
    lanes.emplace_back([&, lane] {
      t_lane = lane;
      const int v = lane / NT, t = lane % NT, tok = tok0 + v;
      for (int b = 0; b < 2; ++b) {
        uint32_t cw[4];
        nibble_words(code_of(v, t + NT * b), cw);
        tile_put_group_words<G, NT>(whole.data() + (tok / 16) * bb, is_v, tok & 15, t + NT * b, cw);
      }
    });
  for (auto& th : lanes) th.join();

  std::vector<uint8_t> red = init;
  for (int v = VPW - 1; v >= 0; --v)
    for (int g = 0; g < G; ++g) {
      uint32_t cw[4];
      nibble_words(code_of(v, g), cw);
      tile_put_group_red<G>(red.data() + ((tok0 + v) / 16) * bb, is_v, (tok0 + v) & 15, g, cw);
    }
  int bad = 0;
  if (whole != want) {
    std::printf("whole words differ: NT %d tok0 %d %s\n", NT, tok0, is_v ? "V" : "K");
    ++bad;
  }
  if (red != want) {
    std::printf("reductions differ: NT %d tok0 %d %s\n", NT, tok0, is_v ? "V" : "K");
    ++bad;
  }
  return bad;
}

}  // namespace

int main() {
  std::mt19937 rng(20261206);
  int bad = 0, cases = 0;
  for (int round = 0; round < 8; ++round)
    for (int is_v = 0; is_v < 2; ++is_v) {
      for (int tok0 : {0, 16, 32, 48}) bad += check_task<1>(rng, tok0, is_v), ++cases;
      for (int tok0 : {0, 8, 16, 40}) bad += check_task<2>(rng, tok0, is_v), ++cases;
      for (int tok0 : {0, 8, 24, 56}) bad += check_task<4>(rng, tok0, is_v), ++cases;
    }
  std::printf("tile writers vs tile_put_code: %d of %d warp tasks differ\n", bad, cases);
  return bad ? 1 : 0;
}
