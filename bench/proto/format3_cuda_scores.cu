// Prototype for format 3 (integer operands) on CUDA: the K side of the decode tile loop -- S = K Q^T of
// one 16-token tile, d = 128, 3-bit K, 8 query vectors per warp -- format 2's real code against a
// format-3 candidate, in the same kernel shape (each warp loops over tiles staged in its shared memory,
// the scores summed so nothing is dead code):
//   f2_scores   fmkv::cuda::tile_scores<128, 3> itself (src/cuda/decode_attention.cuh: mma.m16n8k16 fp16,
//               selector-form words, one prmt per fp16 pair, the sign plane moved in by a multiply);
//   f3_scores   mma.m16n8k32 s8 with the codes of 4 consecutive coordinates of a token decoded by ONE prmt
//               from the 8 signed int8 levels (two registers). Lane (gID, tid) holds for tokens a = gID,
//               b = gID + 8 and each group g of 32 coordinates the A fragment's 16 codes in 48 bits: X (32
//               bits: token a's 8 codes at nibble bits 0-2, 8 more bits in the nibbles' bit 3) and Y (16
//               bits: 4 codes of token b at nibble bits 0-2, 4 bits in bit 3); the 12 bit-3 bits are token
//               b's other 4 codes. Selectors: X & 0x7777, (X >> 16) & 0x7777, Y & 0x7777 and the bit-3
//               gather. The query in two int8 parts (q = 256 qh + ql): D = mma(A, Bh) << 8, then
//               mma(A, Bl, D): exact int32 per group; per group I2F and an FMA with the token's scale.
//   f3v_scores  the same with one scale per vector instead of per 32-coordinate group (a format option):
//               the int32 chain runs over all 4 groups, one conversion and scale per tile.
// On a GPU, main() times each kernel (CUDA events, same run, median of 9) over 132 x 8 CTAs of 4 warps x
// 2048 tiles and checks f3_scores against a host int64 computation. Without a GPU it prints nothing
// but an error; the static instruction counts come from bench/proto/format3_sass_count.py.
// The integer levels are the generator's (tools/lloyd_max.h, integer_levels_gaussian(3, 127)).
//   nvcc -O3 -std=c++17 -arch=sm_90 -I src -I include -I tools bench/proto/format3_cuda_scores.cu tools/lloyd_max.cpp \
//     -o /tmp/f3cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/decode_attention.cuh"
#include "proto_timing.cuh"
#include "lloyd_max.h"

namespace proto {

constexpr int D = 128, G = D / 32, kWarps = 4, kTiles = 2048;

// ---- format 2: the real tile_scores<128, 3> over a staged tile (layout of split_tile_loop) ----
constexpr int KB = 3, TB2 = G * KB * 64 + G * 64;  // bytes per staged tile: code words + scales

__global__ void __launch_bounds__(128) f2_scores(const uint8_t* tiles, const uint32_t* tab, const uint32_t* kmul,
                                                 const uint2* qsrc, float* out, int ntiles) {
  __shared__ __align__(16) uint8_t st[kWarps][2][TB2];
  __shared__ uint2 qb[kWarps][1][G][2][32];  // one half of 8 query vectors (NH = 1)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gID = lane / 4, tid = lane % 4;
  for (int i = lane; i < 2 * TB2 / 4; i += 32) ((uint32_t*)st[warp])[i] = ((const uint32_t*)tiles)[i];
  for (int i = lane; i < G * 2 * 32; i += 32) (&qb[warp][0][0][0][0])[i] = qsrc[i];
  fmkv::cuda::TileLane L;
  for (int k = 0; k < 4; ++k) L.TK[k] = tab[k];
  L.kmul[0] = kmul[0];
  L.kmul[1] = kmul[1];
  __syncwarp();
  float acc[4] = {0, 0, 0, 0};
  for (int t = 0; t < ntiles; ++t) {
    const uint8_t* s = st[warp][t & 1];
    float sc[1][4] = {{0, 0, 0, 0}};
    const uint32_t* kw = (const uint32_t*)s + 2 * gID;
    const uint32_t* ks = (const uint32_t*)(s + G * KB * 64) + gID;
    fmkv::cuda::tile_scores<D, KB, false, 1>(nullptr, kw, ks, qb[warp], lane, tid, L, sc);
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] += sc[0][k];
  }
  for (int k = 0; k < 4; ++k) out[(blockIdx.x * blockDim.x + threadIdx.x) * 4 + k] = acc[k];
}

// ---- format 3 candidate ----
struct F3Tile {          // one staged 16-token tile
  uint32_t X[G][32];     // [g][lane]
  uint16_t Y[G][32];
  uint32_t S[G][8];      // [g][gID]: fp16 scales of tokens gID (low) and gID + 8 (high)
};

__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The A fragment (tokens gID, gID + 8 x the lane's 16 coordinates of group g) from X, Y.
__device__ __forceinline__ void f3_fragment(uint32_t X, uint32_t Y, uint32_t T0, uint32_t T1, uint32_t (&a)[4]) {
  const uint32_t sa0 = X & 0x7777u, sa1 = (X >> 16) & 0x7777u, sb0 = Y & 0x7777u;
  const uint32_t sb1 = ((X >> 3) & 0x1111u) | ((X >> 18) & 0x2222u) | ((Y >> 1) & 0x4444u);
  a[0] = __byte_perm(T0, T1, sa0);  // row gID (token a), coordinates 4 tid .. + 3
  a[1] = __byte_perm(T0, T1, sb0);  // row gID + 8 (token b)
  a[2] = __byte_perm(T0, T1, sa1);  // token a, coordinates 16 + 4 tid .. + 3
  a[3] = __byte_perm(T0, T1, sb1);  // token b
}

template <bool PerVector>
__global__ void __launch_bounds__(128) f3_scores(const F3Tile* tiles, uint32_t T0, uint32_t T1, const uint32_t* qsrc,
                                                 float* out, int ntiles) {
  __shared__ F3Tile st[kWarps][2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gID = lane / 4;
  for (int i = lane; i < (int)(2 * sizeof(F3Tile) / 4); i += 32) ((uint32_t*)st[warp])[i] = ((const uint32_t*)tiles)[i];
  uint32_t qh[G][2], ql[G][2];  // B fragments: k = 4 tid .. + 3 (and + 16), n = gID
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2; ++j) {
      qh[g][j] = qsrc[((g * 2 + j) * 2 + 0) * 32 + lane];
      ql[g][j] = qsrc[((g * 2 + j) * 2 + 1) * 32 + lane];
    }
  __syncwarp();
  float acc[4] = {0, 0, 0, 0};
  for (int t = 0; t < ntiles; ++t) {
    const F3Tile& s = st[warp][t & 1];
    float sc[4] = {0, 0, 0, 0};
    if constexpr (PerVector) {
      uint32_t a[G][4];
#pragma unroll
      for (int g = 0; g < G; ++g) f3_fragment(s.X[g][lane], s.Y[g][lane], T0, T1, a[g]);
      int d[4] = {0, 0, 0, 0};
#pragma unroll
      for (int g = 0; g < G; ++g) mma_s8(d, a[g][0], a[g][1], a[g][2], a[g][3], qh[g][0], qh[g][1]);
#pragma unroll
      for (int k = 0; k < 4; ++k) d[k] <<= 8;
#pragma unroll
      for (int g = 0; g < G; ++g) mma_s8(d, a[g][0], a[g][1], a[g][2], a[g][3], ql[g][0], ql[g][1]);
      const uint32_t s2 = s.S[0][gID];
      const float fa = __half2float(__ushort_as_half((unsigned short)s2)), fb = __half2float(__ushort_as_half((unsigned short)(s2 >> 16)));
      sc[0] = (float)d[0] * fa;
      sc[1] = (float)d[1] * fa;
      sc[2] = (float)d[2] * fb;
      sc[3] = (float)d[3] * fb;
    } else {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        uint32_t a[4];
        f3_fragment(s.X[g][lane], s.Y[g][lane], T0, T1, a);
        int d[4] = {0, 0, 0, 0};
        mma_s8(d, a[0], a[1], a[2], a[3], qh[g][0], qh[g][1]);
#pragma unroll
        for (int k = 0; k < 4; ++k) d[k] <<= 8;
        mma_s8(d, a[0], a[1], a[2], a[3], ql[g][0], ql[g][1]);
        const uint32_t s2 = s.S[g][gID];
        const float fa = __half2float(__ushort_as_half((unsigned short)s2)), fb = __half2float(__ushort_as_half((unsigned short)(s2 >> 16)));
        sc[0] += (float)d[0] * fa;
        sc[1] += (float)d[1] * fa;
        sc[2] += (float)d[2] * fb;
        sc[3] += (float)d[3] * fb;
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] += sc[k];
  }
  for (int k = 0; k < 4; ++k) out[(blockIdx.x * blockDim.x + threadIdx.x) * 4 + k] = acc[k];
}

// Host model of f3's layout: code of token r (0..15) and coordinate c (0..31) of group g in a tile. Lane
// (gID, tid) holds tokens gID, gID + 8; its coordinates are 4 tid + e (chunk 0) and 16 + 4 tid + e (chunk 1).
int f3_code(const F3Tile& t, int g, int r, int c) {
  const int gID = r % 8, tid = (c % 16) / 4, e = c % 4, chunk = c / 16, lane = 4 * gID + tid;
  const uint32_t X = t.X[g][lane], Y = t.Y[g][lane];
  if (r < 8) return (int)((X >> (16 * chunk + 4 * e)) & 7u);
  if (chunk == 0) return (int)((Y >> (4 * e)) & 7u);
  return (int)(((X >> (4 * e + 3)) & 1u) | (((X >> (16 + 4 * e + 3)) & 1u) << 1) | (((Y >> (4 * e + 3)) & 1u) << 2));
}

float h2f(uint16_t h) {
  const uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? m * (1.0f / 16777216.0f) : (float)(1024 + m) * std::ldexp(1.0f, (int)e - 25);
  return s ? -v : v;
}

}  // namespace proto

int main() {
  using namespace proto;
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::fprintf(stderr, "format3_cuda_scores: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  srand(7);
  auto rnd = [] { return (uint32_t)rand() ^ ((uint32_t)rand() << 16); };
  // format 2 inputs: two staged tiles of random code words, fp16 scales in [0.05, 0.1), a level table
  std::vector<uint8_t> t2(2 * TB2);
  for (int i = 0; i < 2 * TB2; i += 4) *(uint32_t*)&t2[i] = rnd();
  for (int k = 0; k < 2; ++k)
    for (int i = G * KB * 64; i < TB2; i += 2) *(uint16_t*)&t2[k * TB2 + i] = (uint16_t)(0x2A66 + (rnd() & 0x1ff));
  const uint32_t tab[4] = {0x39003400u, 0x3d003b00u, 0x39003400u, 0x3d003b00u}, kmul[2] = {0x8000u, 0x4000u};
  std::vector<uint2> q2(G * 2 * 32);
  for (auto& q : q2) q = make_uint2(0x3c003800u ^ (rnd() & 0x80008000u), 0x3a003600u ^ (rnd() & 0x80008000u));
  // format 3 inputs
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
  int8_t levels[8];
  const fmkv::IntegerLevels il = fmkv::integer_levels_gaussian(3, 127);
  for (int i = 0; i < 8; ++i) levels[i] = (int8_t)il.levels[i];
  uint32_t T[2];
  std::memcpy(T, levels, 8);
  std::vector<int8_t> qh(8 * D), ql(8 * D);  // [query n][coordinate], q = 256 qh + ql
  for (int i = 0; i < 8 * D; ++i) {
    const int q16 = (int)(rnd() % 65279) - 32639;
    const int hi = (q16 + 128) >> 8;
    qh[i] = (int8_t)hi;
    ql[i] = (int8_t)(q16 - 256 * hi);
  }
  std::vector<uint32_t> q3(G * 2 * 2 * 32);  // [g][j][part][lane]: k = 16 j + 4 tid .. + 3, n = gID
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2; ++j)
      for (int l = 0; l < 32; ++l) {
        const int n = l / 4, k0 = 32 * g + 16 * j + 4 * (l % 4);
        uint32_t h = 0, lo = 0;
        for (int e = 0; e < 4; ++e) {
          h |= (uint32_t)(uint8_t)qh[n * D + k0 + e] << (8 * e);
          lo |= (uint32_t)(uint8_t)ql[n * D + k0 + e] << (8 * e);
        }
        q3[((g * 2 + j) * 2 + 0) * 32 + l] = h;
        q3[((g * 2 + j) * 2 + 1) * 32 + l] = lo;
      }
  uint8_t *d_t2;
  uint32_t *d_tab, *d_kmul, *d_q3;
  uint2* d_q2;
  F3Tile* d_t3;
  float* d_out;
  const int blocks = prop.multiProcessorCount * 8, threads = 32 * kWarps;
  cudaMalloc(&d_t2, t2.size());
  cudaMalloc(&d_tab, sizeof tab);
  cudaMalloc(&d_kmul, sizeof kmul);
  cudaMalloc(&d_q2, q2.size() * sizeof(uint2));
  cudaMalloc(&d_t3, t3.size() * sizeof(F3Tile));
  cudaMalloc(&d_q3, q3.size() * 4);
  cudaMalloc(&d_out, (size_t)blocks * threads * 4 * sizeof(float));
  cudaMemcpy(d_t2, t2.data(), t2.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_tab, tab, sizeof tab, cudaMemcpyHostToDevice);
  cudaMemcpy(d_kmul, kmul, sizeof kmul, cudaMemcpyHostToDevice);
  cudaMemcpy(d_q2, q2.data(), q2.size() * sizeof(uint2), cudaMemcpyHostToDevice);
  cudaMemcpy(d_t3, t3.data(), t3.size() * sizeof(F3Tile), cudaMemcpyHostToDevice);
  cudaMemcpy(d_q3, q3.data(), q3.size() * 4, cudaMemcpyHostToDevice);
  // correctness of f3 (per group scales) for 2 tiles: out = sum over tiles of the scores
  f3_scores<false><<<1, threads>>>(d_t3, T[0], T[1], d_q3, d_out, 2);
  std::vector<float> out(threads * 4);
  cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost);
  double max_rel = 0;
  for (int w = 0; w < kWarps; ++w)
    for (int l = 0; l < 32; ++l)
      for (int k = 0; k < 4; ++k) {
        const int r = l / 4 + 8 * (k >> 1), n = 2 * (l % 4) + (k & 1);
        double ref = 0, mag = 0;
        for (int ti = 0; ti < 2; ++ti)
          for (int g = 0; g < G; ++g) {
            int64_t dot = 0;
            for (int c = 0; c < 32; ++c) dot += (int64_t)levels[f3_code(t3[ti], g, r, c)] * (256 * qh[n * D + 32 * g + c] + ql[n * D + 32 * g + c]);
            const uint32_t s2 = t3[ti].S[g][r % 8];
            const double sc = h2f((uint16_t)(r < 8 ? s2 : s2 >> 16));
            ref += (double)dot * sc;
            mag += std::abs((double)dot) * sc;
          }
        max_rel = std::max(max_rel, std::abs(out[(w * 32 + l) * 4 + k] - ref) / mag);
      }
  std::printf("{\"suite\": \"format3_proto_cuda_scores\", \"check\": \"f3_scores vs host int64\", \"max_rel_err\": %.3g, \"ok\": %s}\n",
              max_rel, max_rel < 1e-5 ? "true" : "false");
  const char* names[3] = {"f2_scores", "f3_scores", "f3v_scores"};
  const std::vector<double> med = median_ms_interleaved(3, 10, [&](int k) {
    if (k == 0) f2_scores<<<blocks, threads>>>(d_t2, d_tab, d_kmul, d_q2, d_out, kTiles);
    else if (k == 1) f3_scores<false><<<blocks, threads>>>(d_t3, T[0], T[1], d_q3, d_out, kTiles);
    else f3_scores<true><<<blocks, threads>>>(d_t3, T[0], T[1], d_q3, d_out, kTiles);
  });
  if (med.empty()) return 1;
  const double base = med[0];
  for (int k = 0; k < 3; ++k) {
    const double t = med[k];
    const double tiles = (double)blocks * kWarps * kTiles;
    std::printf("{\"suite\": \"format3_proto_cuda_scores\", \"device\": \"%s\", \"impl\": \"%s\", \"k_bits\": 3, \"head_dim\": %d, "
                "\"blocks\": %d, \"warps_per_block\": %d, \"tiles_per_warp\": %d, \"time_ms\": %.4f, "
                "\"ns_per_tile_per_sm\": %.3f, \"speedup_vs_f2\": %.3f}\n",
                prop.name, names[k], D, blocks, kWarps, kTiles, t, t * 1e6 / (tiles / prop.multiProcessorCount), base / t);
  }
  return 0;
}
