// Prototype for format 3 (integer-ready codes) on CUDA: the V side of the decode tile loop -- O^T += V^T P^T of
// one 16-token tile, d = 128, 3-bit V, mma.m16n8k16 fp16 (P stays fp16) -- format 2's real code against a
// format-3 candidate, in one kernel shape (each warp loops over tiles staged in its shared memory):
//   f2_pv   fmkv::cuda::tile_pv<128, 3> itself (src/cuda/decode_attention.cuh: selector-form words, one prmt per
//           fp16 pair from the level table, the sign plane moved in by multiplies and XORed);
//   f3_pv   V levels with 3 significant bits (fp16 values whose low byte is 0; docs/history/format3-prototypes.md:
//           +1.03% distortion at 3 bits): an fp16 pair is ONE prmt from the 8 levels' high bytes (two
//           registers) with selector nibbles (0xC, code, 0xC, code) -- nibble 0xC sign-replicates byte 4, the
//           high byte of a positive level, giving the zero low byte -- and no sign work. The lane's 16 codes of a
//           group are 48 bits in the K prototype's layout (X: 8 codes at nibble bits 0-2 + 8 bits in bit 3;
//           Y: 4 codes + 4 bits; the 12 bit-3 bits are 4 more codes); a pair selector is (v & 0x7070) | 0x0C0C
//           of X or Y shifted so that the pair's two codes sit in nibbles 1 and 3.
//   f3v_pv  the same with one V scale per vector: P x scale, its fp16 packing and transpose once per tile.
// The P side (P x the token's V scale, fp16, movmatrix transpose) is otherwise format 2's. f3_v_fragment is
// also compiled for the host: main() checks it against a bit-level model of the layout for random words
// (no GPU needed), then, on a GPU, times both kernels (same run, median of 9).
//   nvcc -O3 -std=c++17 -arch=sm_90 -I src -I include bench/proto/format3_cuda_pv.cu -o /tmp/f3pv
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/decode_attention.cuh"
#include "prmt_host.h"
#include "proto_timing.cuh"

namespace proto {

constexpr int D = 128, G = D / 32, VB = 3, kWarps = 4, kTiles = 2048;

__host__ __device__ __forceinline__ uint32_t prmt_hd(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  return fmkv::cuda::prmt(a, b, s);  // prmt.b32 itself: __byte_perm ignores the nibbles' sign-replicate bit
#else
  return prmt_host(a, b, s);
#endif
}

// The A registers of the group's two mmas (a[0..3]: coordinates of mma 0, a[4..7]: mma 1), each an fp16 pair
// of two tokens, from X, Y and the 8 levels' high bytes T0 (codes 0-3), T1 (codes 4-7). z = 0x0C0C, passed in a
// register so that (v & 0x7070) | z is one LOP3 (a LOP3 takes one immediate).
__host__ __device__ __forceinline__ void f3_v_fragment(uint32_t X, uint32_t Y, uint32_t T0, uint32_t T1, uint32_t z,
                                                       uint32_t (&a)[8]) {
  const uint32_t g = ((X >> 3) & 0x1111u) | ((X >> 18) & 0x2222u) | ((Y >> 1) & 0x4444u);  // the 4 bit-3 codes
  auto pair = [&](uint32_t v) { return prmt_hd(T0, T1, (v & 0x7070u) | z); };
  a[0] = pair(X << 4);   // X nibbles 0, 2
  a[1] = pair(X);        // X nibbles 1, 3
  a[2] = pair(X >> 12);  // X nibbles 4, 6
  a[3] = pair(X >> 16);  // X nibbles 5, 7
  a[4] = pair(Y << 4);   // Y nibbles 0, 2
  a[5] = pair(Y);        // Y nibbles 1, 3
  a[6] = pair(g << 4);   // bit-3 codes 0, 2
  a[7] = pair(g);        // bit-3 codes 1, 3
}

// The layout model: the code of register i, half h (bit-level reading of X and Y).
int model_code(uint32_t X, uint32_t Y, int i, int h) {
  auto nib = [](uint32_t w, int n) { return (int)((w >> (4 * n)) & 7u); };
  auto bit3 = [](uint32_t w, int n) { return (int)((w >> (4 * n + 3)) & 1u); };
  auto hole = [&](int j) { return bit3(X, j) | (bit3(X, 4 + j) << 1) | (bit3(Y, j) << 2); };
  switch (i) {
    case 0: return nib(X, 2 * h);
    case 1: return nib(X, 1 + 2 * h);
    case 2: return nib(X, 4 + 2 * h);
    case 3: return nib(X, 5 + 2 * h);
    case 4: return nib(Y, 2 * h);
    case 5: return nib(Y, 1 + 2 * h);
    case 6: return hole(2 * h);
    default: return hole(1 + 2 * h);
  }
}

// ---- format 2: the real tile_pv<128, 3> (layout of split_tile_loop) ----
constexpr int TB2 = G * VB * 64 + G * 64;

__global__ void __launch_bounds__(128) f2_pv(const uint8_t* tiles, const uint32_t* tab, uint32_t vmul, const float* prs,
                                             float* out, int ntiles) {
  __shared__ __align__(16) uint8_t st[kWarps][2][TB2];
  __shared__ float sp[kWarps][2][4][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gID = lane / 4, tid = lane % 4;
  for (int i = lane; i < 2 * TB2 / 4; i += 32) ((uint32_t*)st[warp])[i] = ((const uint32_t*)tiles)[i];
  for (int i = lane; i < 2 * 4 * 32; i += 32) (&sp[warp][0][0][0])[i] = prs[i];
  fmkv::cuda::TileLane L;
  for (int k = 0; k < 4; ++k) L.TV[k] = tab[k];
  L.vmul = vmul;
  __syncwarp();
  float acc[1][G][2][4] = {};  // one half of 8 query vectors (NH = 1)
  for (int t = 0; t < ntiles; ++t) {
    const uint8_t* s = st[warp][t & 1];
    float pr[1][4];
    for (int k = 0; k < 4; ++k) pr[0][k] = sp[warp][t & 1][k][lane];
    const uint32_t* vw = (const uint32_t*)s + 4 * tid;  // the lane's token words (tokens 4 tid .. 4 tid + 3)
    const uint32_t* vs = (const uint32_t*)(s + G * VB * 64) + gID;  // V scales of tokens 2 gID, 2 gID + 1
    fmkv::cuda::tile_pv<D, VB, false, 1>(vw, vs, pr, 0, 16, gID, L, acc, lane);
  }
  float sum = 0;
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 4; ++k) sum += acc[0][g][j][k];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

// ---- format 3 candidate ----
struct F3Tile {
  uint32_t X[G][32];
  uint16_t Y[G][32];
  uint32_t S[G][8];  // [g][gID]: fp16 V scales of the lane's two P rows (as format 2's vs[g * 8])
};

template <bool PerVector>
__global__ void __launch_bounds__(128) f3_pv(const F3Tile* tiles, uint32_t T0, uint32_t T1, uint32_t z, const float* prs,
                                             float* out, int ntiles) {
  __shared__ F3Tile st[kWarps][2];
  __shared__ float sp[kWarps][2][4][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gID = lane / 4;
  for (int i = lane; i < (int)(2 * sizeof(F3Tile) / 4); i += 32) ((uint32_t*)st[warp])[i] = ((const uint32_t*)tiles)[i];
  for (int i = lane; i < 2 * 4 * 32; i += 32) (&sp[warp][0][0][0])[i] = prs[i];
  __syncwarp();
  float acc[G][2][4] = {};
  for (int t = 0; t < ntiles; ++t) {
    const F3Tile& s = st[warp][t & 1];
    float pr[4];
    for (int k = 0; k < 4; ++k) pr[k] = sp[warp][t & 1][k][lane];
    uint32_t pv0 = 0, pv1 = 0;  // PerVector: P x the token's one V scale, once per tile
    if constexpr (PerVector) {
      const uint32_t vs2 = s.S[0][gID];
      const float sa = fmkv::cuda::h_lo(vs2), sb = fmkv::cuda::h_hi(vs2);
      pv0 = fmkv::cuda::movmatrix_trans(fmkv::cuda::pack_half2(pr[0] * sa, pr[1] * sa));
      pv1 = fmkv::cuda::movmatrix_trans(fmkv::cuda::pack_half2(pr[2] * sb, pr[3] * sb));
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      uint32_t pb0 = pv0, pb1 = pv1;
      if constexpr (!PerVector) {
        const uint32_t vs2 = s.S[g][gID];
        const float sa = fmkv::cuda::h_lo(vs2), sb = fmkv::cuda::h_hi(vs2);
        pb0 = fmkv::cuda::movmatrix_trans(fmkv::cuda::pack_half2(pr[0] * sa, pr[1] * sa));
        pb1 = fmkv::cuda::movmatrix_trans(fmkv::cuda::pack_half2(pr[2] * sb, pr[3] * sb));
      }
      uint32_t a[8];
      f3_v_fragment(s.X[g][lane], s.Y[g][lane], T0, T1, z, a);
      fmkv::cuda::mma16816(acc[g][0], a[0], a[1], a[2], a[3], pb0, pb1);
      fmkv::cuda::mma16816(acc[g][1], a[4], a[5], a[6], a[7], pb0, pb1);
    }
  }
  float sum = 0;
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2; ++j)
      for (int k = 0; k < 4; ++k) sum += acc[g][j][k];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

}  // namespace proto

int main() {
  using namespace proto;
  srand(11);
  auto rnd = [] { return (uint32_t)rand() ^ ((uint32_t)rand() << 16); };
  // 3-bit V levels with 3 significant bits, ascending: -64 -40 -24 -8 8 24 40 64 (fp16 high bytes)
  const uint16_t lv[8] = {0xD400, 0xD100, 0xCE00, 0xC800, 0x4800, 0x4E00, 0x5100, 0x5400};
  uint32_t T0 = 0, T1 = 0;
  for (int i = 0; i < 4; ++i) {
    T0 |= (uint32_t)(lv[i] >> 8) << (8 * i);
    T1 |= (uint32_t)(lv[4 + i] >> 8) << (8 * i);
  }
  // host check of the decode against the layout model
  long bad = 0, n = 0;
  int seen[8] = {};
  for (int it = 0; it < 200000; ++it) {
    const uint32_t X = rnd(), Y = rnd() & 0xffffu;
    uint32_t a[8];
    f3_v_fragment(X, Y, T0, T1, 0x0C0Cu, a);
    for (int i = 0; i < 8; ++i)
      for (int h = 0; h < 2; ++h) {
        const int c = model_code(X, Y, i, h);
        ++seen[c];
        ++n;
        if ((uint16_t)(a[i] >> (16 * h)) != lv[c]) ++bad;
      }
  }
  int all = 1;
  for (int c = 0; c < 8; ++c) all &= seen[c] > 0;
  std::printf("{\"suite\": \"format3_proto_cuda_pv\", \"check\": \"f3_v_fragment vs the layout model (host)\", \"pairs\": %ld, "
              "\"mismatches\": %ld, \"ok\": %s}\n", n, bad, bad == 0 && all ? "true" : "false");
  if (bad || !all) return 1;
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::fprintf(stderr, "format3_cuda_pv: no CUDA device: the host check only\n");
    return 0;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::vector<uint8_t> t2(2 * TB2);
  for (int i = 0; i < 2 * TB2; i += 4) *(uint32_t*)&t2[i] = rnd();
  for (int k = 0; k < 2; ++k)
    for (int i = G * VB * 64; i < TB2; i += 2) *(uint16_t*)&t2[k * TB2 + i] = (uint16_t)(0x2A66 + (rnd() & 0x1ff));
  const uint32_t tab[4] = {0x39003400u, 0x3d003b00u, 0x39003400u, 0x3d003b00u};
  std::vector<F3Tile> t3(2);
  for (auto& t : t3) {
    for (int g = 0; g < G; ++g)
      for (int l = 0; l < 32; ++l) {
        t.X[g][l] = rnd();
        t.Y[g][l] = (uint16_t)rnd();
      }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 8; ++i) t.S[g][i] = (0x2A66u + (rnd() & 0x1ff)) | ((0x2A66u + (rnd() & 0x1ff)) << 16);
  }
  std::vector<float> prs(2 * 4 * 32);
  for (auto& p : prs) p = (rnd() % 1000) / 1000.0f;
  uint8_t* d_t2;
  uint32_t* d_tab;
  F3Tile* d_t3;
  float *d_pr, *d_out;
  const int blocks = prop.multiProcessorCount * 8, threads = 32 * kWarps;
  cudaMalloc(&d_t2, t2.size());
  cudaMalloc(&d_tab, sizeof tab);
  cudaMalloc(&d_t3, t3.size() * sizeof(F3Tile));
  cudaMalloc(&d_pr, prs.size() * sizeof(float));
  cudaMalloc(&d_out, (size_t)blocks * threads * sizeof(float));
  cudaMemcpy(d_t2, t2.data(), t2.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_tab, tab, sizeof tab, cudaMemcpyHostToDevice);
  cudaMemcpy(d_t3, t3.data(), t3.size() * sizeof(F3Tile), cudaMemcpyHostToDevice);
  cudaMemcpy(d_pr, prs.data(), prs.size() * sizeof(float), cudaMemcpyHostToDevice);
  const char* names[3] = {"f2_pv", "f3_pv", "f3v_pv"};
  const std::vector<double> med = median_ms_interleaved(3, 10, [&](int k) {
    if (k == 0) f2_pv<<<blocks, threads>>>(d_t2, d_tab, 0x8000u, d_pr, d_out, kTiles);
    else if (k == 1) f3_pv<false><<<blocks, threads>>>(d_t3, T0, T1, 0x0C0Cu, d_pr, d_out, kTiles);
    else f3_pv<true><<<blocks, threads>>>(d_t3, T0, T1, 0x0C0Cu, d_pr, d_out, kTiles);
  });
  if (med.empty()) return 1;
  const double base = med[0];
  for (int k = 0; k < 3; ++k) {
    const double t = med[k];
    const double tiles = (double)blocks * kWarps * kTiles;
    std::printf("{\"suite\": \"format3_proto_cuda_pv\", \"device\": \"%s\", \"impl\": \"%s\", \"v_bits\": 3, \"head_dim\": %d, "
                "\"time_ms\": %.4f, \"ns_per_tile_per_sm\": %.3f, \"speedup_vs_f2\": %.3f}\n",
                prop.name, names[k], D, t, t * 1e6 / (tiles / prop.multiProcessorCount), base / t);
  }
  return 0;
}
