// The CPU backend in the backend registry: identity, run-time ISA selection and its table.
//   FMKV_CPU_ISA=scalar|avx2|avx2vnni|avx512|avx512vnni|neon forces a kernel set (an unsupported request falls back
//   to the default one; NEON is the default on AArch64); FMKV_NUM_THREADS sets the pool size (thread_pool.h).
//   The default on x86 is avx512, else avx2. avx512vnni and avx2vnni (format 3's K scored with vpdpbusd) are
//   opt-in: avx512vnni measured 1.05x the avx512 set on a Zen 4 core (within the run-to-run spread) and 0.83x /
//   0.91x at d = 128, 32k / 128k tokens on a Xeon; avx2vnni 0.87-0.88x the avx2 set at d = 128 on the Zen 4
//   (docs/history/cpu-decode.md).
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "../core/backend.h"
#include "backend.h"
#include "kernels.h"
#include "thread_pool.h"

namespace fmkv::cpu {
namespace {
const Kernels& select_kernels() {
  const char* e = std::getenv("FMKV_CPU_ISA");
  std::string want = e ? e : "";
#if defined(__x86_64__) && defined(FMKV_CPU_HAVE_AVX512)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  const bool vnni = avx512 && __builtin_cpu_supports("avx512vnni");
  const bool avx2vnni = avx2 && __builtin_cpu_supports("avxvnni");
  if (want == "scalar") return kernels_scalar();
  if (want == "avx2" && avx2) return kernels_avx2();
  if (want == "avx2vnni" && avx2vnni) return kernels_avx2vnni();
  if (want == "avx512vnni" && vnni) return kernels_avx512vnni();
  if (avx512) return kernels_avx512();
  if (avx2) return kernels_avx2();
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(FMKV_CPU_HAVE_NEON)
  if (want == "scalar") return kernels_scalar();
  return kernels_neon();  // Advanced SIMD is part of the AArch64 baseline
#endif
  return kernels_scalar();
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    for (const char* key : {"model name", "Model", "CPU part"}) {
      if (line.rfind(key, 0) == 0) {
        size_t c = line.find(':');
        if (c != std::string::npos) {
          size_t b = line.find_first_not_of(" \t", c + 1);
          return b == std::string::npos ? std::string("unknown CPU") : line.substr(b);
        }
      }
    }
  }
#if defined(__aarch64__)
  return "aarch64 CPU";
#else
  return "unknown CPU";
#endif
}
}  // namespace

const Kernels& kernels() {
  static const Kernels& k = select_kernels();
  return k;
}

std::string device_name() {
  return cpu_model() + " (" + kernels().name + ", " + std::to_string(ThreadPool::instance().num_threads()) + " threads)";
}

}  // namespace fmkv::cpu

namespace fmkv {
extern const BackendOps cpu_backend = {
    FMKV_BACKEND_CPU, /*host_memory=*/true, /*attention_rel_error=*/1e-5,
    [] { return true; },
    cpu::device_name,
    cpu::append, cpu::decode_attention,
    /*append_attention=*/nullptr, /*attention_workspace_bytes=*/nullptr,
    /*alloc=*/nullptr, /*free=*/nullptr, /*copy=*/nullptr, /*synchronize=*/nullptr, /*attention_lse=*/true,
    /*max_format_version=*/3, /*max_scale_group=*/64, /*max_code_bits=*/5,
    /*check_attention=*/nullptr};
}  // namespace fmkv
