// The CUDA device's fp16 conversions (src/format/numbers.h: cvt.rn.f16.f32 / cvt.f32.f16 under
// __CUDA_ARCH__) against the portable ones (f32_to_f16_soft / f16_to_f32_soft, the functions
// tests/test_half.cpp checks against exact double arithmetic), bit for bit, for every input: all
// 2^32 float bit patterns and all 2^16 fp16 bit patterns (NaN payloads included). Both run on the
// device, so the comparison needs no transfer of results. Exit status: 0 pass, 1 mismatch, 77 no
// usable CUDA device (ctest: skipped).
#include <cstdio>

#include <cuda_runtime.h>

#include "format/numbers.h"

namespace {

struct Mismatches {
  unsigned long long count;
  unsigned int first;  // the input bits of one mismatch (valid when count > 0)
};

__global__ void check_f32_to_f16(unsigned long long begin, unsigned long long end, Mismatches* m) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = begin + blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < end; i += stride) {
    const float f = fmkv::bits_f32((uint32_t)i);
    if (fmkv::f32_to_f16(f) != fmkv::f32_to_f16_soft(f)) {
      atomicAdd(&m->count, 1ull);
      m->first = (unsigned int)i;
    }
  }
}

__global__ void check_f16_to_f32(Mismatches* m) {
  const uint32_t h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= 65536u) return;
  if (fmkv::f32_bits(fmkv::f16_to_f32((uint16_t)h)) != fmkv::f32_bits(fmkv::f16_to_f32_soft((uint16_t)h))) {
    atomicAdd(&m->count, 1ull);
    m->first = h;
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "half_cuda_test: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("half_cuda_test: no usable CUDA device, skipped\n");
    return 77;
  }
  Mismatches* m = nullptr;
  if (!ok(cudaMallocManaged(&m, 2 * sizeof(Mismatches)), "cudaMallocManaged")) return 2;
  m[0] = {0, 0};
  m[1] = {0, 0};
  check_f32_to_f16<<<4096, 256>>>(0, 1ull << 32, &m[0]);
  check_f16_to_f32<<<256, 256>>>(&m[1]);
  if (!ok(cudaDeviceSynchronize(), "kernels")) return 2;
  std::printf("f32 -> f16, all 4294967296 inputs: %llu mismatches%s", m[0].count, m[0].count ? "" : "\n");
  if (m[0].count) std::printf(" (e.g. input bits 0x%08x)\n", m[0].first);
  std::printf("f16 -> f32, all 65536 inputs: %llu mismatches%s", m[1].count, m[1].count ? "" : "\n");
  if (m[1].count) std::printf(" (e.g. input bits 0x%04x)\n", m[1].first);
  const bool pass = m[0].count == 0 && m[1].count == 0;
  std::printf("%s\n", pass ? "PASSED" : "FAILED");
  cudaFree(m);
  return pass ? 0 : 1;
}
