// The balanced split plan on the device (src/cuda/balanced_plan.cuh, plan_assign) for ragged and uniform
// batches: every CTA (y, k) of a grid of B x nsplit split CTAs evaluates the plan as attn_kernel does (one
// warp each); the host checks that every split (s, j < ns_s) of every sequence is taken by exactly one CTA,
// that ns_s is split_count.h's balanced_splits of the sequence, that a CTA keeps its own (y, k) when k < ns_y,
// that the shares fit the grid (sum ns_s <= B x nsplit) and that equal lengths give the uniform plan. Raw
// CTAs (k = -1) keep their sequence. Exit status: 0 pass, 1 failure, 77 no usable CUDA device (ctest: skipped).
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/balanced_plan.cuh"

namespace {

using fmkv::cuda::AttnParams;
using fmkv::cuda::SplitAssign;

__global__ void assign_all(AttnParams p, int3* out) {  // grid (B, nsplit + 1): z = nsplit is the raw CTA
  const int y = blockIdx.x, k = blockIdx.y < (unsigned)p.nsplit ? (int)blockIdx.y : -1, lane = threadIdx.x;
  const SplitAssign a = fmkv::cuda::plan_assign(fmkv::cuda::plan_args(p), y, k, lane, fmkv::cuda::plan_request(p, lane));
  if (lane == 0) out[blockIdx.x * gridDim.y + blockIdx.y] = make_int3(a.s, a.k, a.ns);
}

int failures = 0;
void fail(const std::string& what) {
  if (++failures <= 20) std::printf("FAIL: %s\n", what.c_str());
}

void check(const std::string& name, const std::vector<int64_t>& lens, int nsplit, int S, int W) {
  const int B = (int)lens.size();
  const int cap = fmkv::cuda::balance_cap(B, nsplit);
  int64_t* dl = nullptr;
  int3* dout = nullptr;
  cudaMalloc(&dl, 8 * B);
  cudaMalloc(&dout, sizeof(int3) * B * (nsplit + 1));
  cudaMemcpy(dl, lens.data(), 8 * B, cudaMemcpyHostToDevice);
  AttnParams p{};
  p.num_seqs = B;
  p.seq_lens = dl;
  p.S = S;
  p.W = W;
  p.nsplit = nsplit;
  p.pstride = cap + fmkv::cuda::kRawParts;
  p.balanced = 1;
  assign_all<<<dim3(B, nsplit + 1), 32>>>(p, dout);
  std::vector<int3> out(B * (nsplit + 1));
  if (cudaMemcpy(out.data(), dout, sizeof(int3) * out.size(), cudaMemcpyDeviceToHost) != cudaSuccess) {
    fail(name + ": kernel failed: " + cudaGetErrorString(cudaGetLastError()));
    return;
  }
  cudaFree(dl);
  cudaFree(dout);
  // the host's expectation from the shared rule
  std::vector<int64_t> tiles(B);
  int64_t total = 0;
  for (int s = 0; s < B; ++s) {
    const int64_t e = lens[s] - W > S ? lens[s] - W : S;
    tiles[s] = fmkv::cuda::plan_tiles(e - S);
    total += tiles[s];
  }
  std::vector<int> ns(B);
  int64_t sum = 0;
  bool uniform = true;
  for (int s = 0; s < B; ++s) {
    ns[s] = (int)fmkv::cuda::balanced_splits(tiles[s], total, (int64_t)B * nsplit, B, cap);
    sum += ns[s];
    uniform = uniform && tiles[s] == tiles[0];
  }
  if (sum > (int64_t)B * nsplit) fail(name + ": the shares exceed the grid");
  std::vector<std::vector<int>> taken(B);
  for (int s = 0; s < B; ++s) taken[s].assign(ns[s], 0);
  for (int y = 0; y < B; ++y)
    for (int z = 0; z <= nsplit; ++z) {
      const int3 a = out[y * (nsplit + 1) + z];
      const int k = z < nsplit ? z : -1;
      const std::string at = name + ": CTA (" + std::to_string(y) + ", " + std::to_string(k) + ") -> (" +
                             std::to_string(a.x) + ", " + std::to_string(a.y) + ", ns " + std::to_string(a.z) + ")";
      if (k < 0 || k < ns[y]) {  // keeps its own
        if (a.x != y || a.y != k || a.z != ns[y]) fail(at + ": should keep its own, ns " + std::to_string(ns[y]));
        if (k >= 0 && a.x == y && a.y == k) ++taken[y][k];
        continue;
      }
      if (a.x < 0) continue;  // a spare CTA without work
      if (a.x >= B || a.y < nsplit || a.y >= ns[a.x] || a.z != ns[a.x]) {
        fail(at + ": not an extra split of a sequence");
        continue;
      }
      ++taken[a.x][a.y];
    }
  for (int s = 0; s < B; ++s)
    for (int j = 0; j < ns[s]; ++j)
      if (taken[s][j] != 1)
        fail(name + ": split " + std::to_string(j) + " of sequence " + std::to_string(s) + " taken " +
             std::to_string(taken[s][j]) + " times");
  if (uniform)
    for (int s = 0; s < B; ++s)
      if (ns[s] != std::min<int64_t>(nsplit, fmkv::cuda::useful_splits(tiles[s] * 16)))
        fail(name + ": equal lengths should keep the grid's count");
  int64_t most = 0;
  for (int s = 0; s < B; ++s) most = std::max<int64_t>(most, (tiles[s] + ns[s] - 1) / ns[s]);
  std::printf("%-34s B=%3d nsplit=%2d cap=%2d: splits %lld of %lld CTAs, most tiles per split %lld\n", name.c_str(), B,
              nsplit, cap, (long long)sum, (long long)B * nsplit, (long long)most);
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no usable CUDA device: skipped\n");
    return 77;
  }
  check("16 x 1k-64k", [] { std::vector<int64_t> v; for (int i = 0; i < 16; ++i) v.push_back(1024 + i * 64512 / 15); return v; }(), 9, 0, 0);
  check("64k + 15 x 1k", [] { std::vector<int64_t> v(16, 1024); v[0] = 65536; return v; }(), 9, 0, 0);
  check("15 x 1k + 64k (last)", [] { std::vector<int64_t> v(16, 1024); v[15] = 65536; return v; }(), 9, 0, 0);
  check("uniform 64 x 32k", std::vector<int64_t>(64, 32768), 3, 0, 0);
  check("uniform 16 x 100 (useful < nsplit)", std::vector<int64_t>(16, 100), 9, 0, 0);
  check("2 x (1M, 1)", {1 << 20, 1}, 64, 0, 0);
  check("sink + window, some all-fp16", {5000, 40, 0, 70000, 3, 200}, 11, 4, 64);
  check("negative and zero lengths", {-5, 0, 9000, -1, 300}, 13, 0, 0);
  std::mt19937_64 rng(7);
  for (int t = 0; t < 40; ++t) {
    const int B = 2 + (int)(rng() % 255);
    const int nsplit = 1 + (int)(rng() % 64);
    std::vector<int64_t> v(B);
    for (auto& x : v) x = (int64_t)(rng() % 4 == 0 ? rng() % 300000 : rng() % 5000);
    check("random " + std::to_string(t), v, nsplit, (int)(rng() % 3) * 4, (int)(rng() % 2) * 32);
  }
  std::printf(failures ? "FAILED: %d\n" : "PASSED\n", failures);
  return failures ? 1 : 0;
}
