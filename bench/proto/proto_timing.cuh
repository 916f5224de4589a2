// Timing of the format prototypes' kernels (bench/proto/format3_cuda_*.cu): nk kernels launched by
// launch(k), interleaved over `rounds` rounds (the first warms up), CUDA events around each launch;
// returns each kernel's median in ms, or an empty vector after a CUDA error (printed).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace proto {

template <class Launch>
std::vector<double> median_ms_interleaved(int nk, int rounds, Launch launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<std::vector<float>> ms((size_t)nk);
  for (int rep = 0; rep < rounds; ++rep)
    for (int k = 0; k < nk; ++k) {
      cudaEventRecord(e0);
      launch(k);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      if (rep > 0) ms[(size_t)k].push_back(t);
    }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(err));
    return {};
  }
  std::vector<double> med;
  for (auto& m : ms) {
    std::sort(m.begin(), m.end());
    med.push_back(m[m.size() / 2]);
  }
  return med;
}

}  // namespace proto
