// CUDA backend runtime: device discovery, memory, copies, and the device error word that kernels
// use to report invalid batch arrays (see common.cuh). synchronize() turns a recorded error into
// an fmkv::Error with a message naming the sequence and entry.
#include <cstdlib>
#include <mutex>
#include <string>

#include "common.cuh"

namespace fmkv {
namespace cuda {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(kBackendError, std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
}

namespace {
constexpr int kMaxDevices = 64;
std::mutex g_mu;
long long* g_err[kMaxDevices] = {};
int g_sms[kMaxDevices] = {};
int g_cc_major[kMaxDevices] = {};

int current_device() {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 0 || dev >= kMaxDevices) throw Error(kBackendError, "CUDA device index out of range");
  return dev;
}
}  // namespace

long long* error_word() {
  int dev = current_device();
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_err[dev]) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, 8 * sizeof(long long)), "cudaMalloc (error word)");
    check_cuda(cudaMemset(p, 0, 8 * sizeof(long long)), "cudaMemset (error word)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    g_err[dev] = (long long*)p;
  }
  return g_err[dev];
}

int sm_count() {
  int dev = current_device();
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_sms[dev]) {
    int n = 0;
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    g_sms[dev] = n > 0 ? n : 1;
  }
  return g_sms[dev];
}

bool programmatic_launch_supported() {
  const int dev = current_device();
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_cc_major[dev]) {
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    g_cc_major[dev] = major > 0 ? major : 1;
  }
  // FMKV_CUDA_PDL=0 turns programmatic launches off (for A/B timing; the kernels' griddepcontrol
  // instructions are no-ops in an ordinary launch)
  static const bool disabled = env_switched_off("FMKV_CUDA_PDL");
  return g_cc_major[dev] >= 9 && !disabled;
}

#ifdef FMKV_CUDA_TRACE
unsigned long long* trace_buffer() {  // one buffer (current device at first use), for diagnostics
  static unsigned long long* buf = [] {
    void* p = nullptr;
    const size_t bytes = sizeof(unsigned long long) * 2 * kTraceCtas * kTraceSlots;
    check_cuda(cudaMalloc(&p, bytes), "trace buffer");
    check_cuda(cudaMemset(p, 0, bytes), "trace buffer");
    return (unsigned long long*)p;
  }();
  return buf;
}
void trace_read(unsigned long long* host, size_t n) {
  check_cuda(cudaMemcpy(host, trace_buffer(), n * sizeof(unsigned long long), cudaMemcpyDeviceToHost), "trace read");
}
void trace_clear() {
  check_cuda(cudaMemset(trace_buffer(), 0, sizeof(unsigned long long) * 2 * kTraceCtas * kTraceSlots), "trace clear");
}
#endif

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  try {
    error_word();  // allocate the error word up front (keeps later calls allocation-free)
  } catch (const Error&) {
    return false;
  }
  return true;
}

std::string device_name() {
  int dev = current_device();
  cudaDeviceProp p;
  check_cuda(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, runtime " + std::to_string(rt) + ", driver " +
         std::to_string(drv) + ")";
}

void* alloc(size_t bytes) {
  void* p = nullptr;
  try {
    error_word();
  } catch (const Error&) {
    return nullptr;
  }
  if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void free(void* p) {
  if (p) cudaFree(p);
}

void copy(void* dst, const void* src, size_t bytes, bool to_device) {
  check_cuda(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost),
             "cudaMemcpy");
}

namespace {
std::string S(long long v) { return std::to_string(v); }
}  // namespace

void synchronize() {
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  long long* dw = error_word();
  long long e[8];
  check_cuda(cudaMemcpy(e, dw, sizeof e, cudaMemcpyDeviceToHost), "cudaMemcpy (error word)");
  if (e[0] == 0) return;
  check_cuda(cudaMemset(dw, 0, 8 * sizeof(long long)), "cudaMemset (error word)");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const std::string q = "batch: sequence " + S(e[2]) + ": ";
  std::string m;
  switch ((int)e[1]) {
    case kErrBlockTable:
      m = q + "block_table[" + S(e[3]) + "] = " + S(e[4]) + " outside [0, " + S(e[5]) + ")";
      break;
    case kErrTableStride:
      m = q + "needs " + S(e[3]) + " pages but block_table_stride is " + S(e[5]);
      break;
    case kErrSlot: m = q + "slot " + S(e[4]) + " outside [0, " + S(e[5]) + ")"; break;
    case kErrRowOffsets:
      m = e[4] == 0   ? std::string("batch: row_offsets[0] must be 0")
          : e[4] == 1 ? q + "row_offsets decrease"
                      : "batch: row_offsets end at " + S(e[3]) + " but the tensor has " + S(e[5]) + " rows";
      break;
    case kErrNegLen: m = q + "negative length"; break;
    case kErrNonFiniteKV:
      m = std::string(e[2] ? "v" : "k") + "[" + S(e[3]) + "][" + S(e[4]) + "][" + S(e[5]) +
          "] is NaN, Inf or beyond the fp16 range (|x| >= 65520)";
      break;
    case kErrQRows:
      m = q + S(e[3]) + " query rows but only " + S(e[4]) + " tokens cached (append first)";
      break;
    case kErrNonFiniteQ:
      m = "q[" + S(e[3]) + "][" + S(e[4]) + "][" + S(e[5]) + "] is NaN or Inf";
      break;
    case kErrLenOverflow: m = q + "length overflows"; break;
    case kErrFusedRows:
      m = q + S(e[3]) + " rows, but the fused append + attention takes at most " + S(e[4]) +
          " per sequence (use fmkv_append, then fmkv_attention)";
      break;
    case kErrSplitSpan:
      m = q + S(e[3]) + " compressed tokens over " + S(e[4]) +
          " splits: more than 2^30 per split (pass a larger workspace: more splits)";
      break;
    case kErrMaxSeqLen:
      m = q + S(e[3]) + " tokens, more than opts.max_seq_len = " + S(e[4]) +
          " (the bound the call's split count was chosen for; pass 0 when unknown)";
      break;
    default: m = "unknown device error kind " + S(e[1]); break;
  }
  throw Error((int)e[0], "cuda: " + m +
                             " (detected on the device by an earlier call, which wrote nothing; CUDA ops "
                             "were skipped until this synchronize)");
}

}  // namespace cuda
}  // namespace fmkv
