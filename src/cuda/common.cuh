// Shared pieces of the fmkv CUDA backend: error reporting from kernels, small PTX helpers,
// codebook tables in constant memory. Included by every src/cuda/*.cu.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <cstdlib>

#include <string>

#include "../core/ops.h"
#include "../format/numbers.h"
#include "../format/rotation.h"
#include "backend.h"
#include "fmkv/format.h"
#include "trace.h"

namespace fmkv {
namespace cuda {
namespace tab {
#define FMKV_TABLE static __constant__
#include "../format/codebooks.inc"
#undef FMKV_TABLE
}  // namespace tab
// The same levels in global memory, for loads that must be issued at a chosen point (load_now:
// constant-memory loads cannot be volatile, and ptxas moves them to their first use).
namespace gtab {
#define FMKV_TABLE static __device__ const
#define FMKV_CODEBOOK_LEVELS_ONLY
#include "../format/codebooks.inc"
#undef FMKV_CODEBOOK_LEVELS_ONLY
#undef FMKV_TABLE
}  // namespace gtab

// ---- errors -------------------------------------------------------------------------------------
// Device-side error word (one per device, 8 x int64, allocated once by runtime.cu):
//   [0] fmkv status code (0 = none)  [1] kind  [2] sequence  [3] index  [4] value  [5] bound
// Kernels that detect invalid batch arrays (device pointers the host cannot read) record the first
// error with atomicCAS and write nothing; every fmkv CUDA kernel returns at once while the word is
// set, so the cache is never corrupted. synchronize() reads, clears and throws it.
enum ErrKind : int {
  kErrBlockTable = 1,   // block_table entry outside [0, num_pages)
  kErrTableStride = 2,  // more pages needed than block_table_stride
  kErrSlot = 3,         // slot outside [0, num_slots)
  kErrRowOffsets = 4,   // row_offsets malformed (value = sub-kind)
  kErrNegLen = 5,       // negative seq_len
  kErrNonFiniteKV = 6,  // k/v element NaN/Inf/beyond fp16 (seq = 0 k / 1 v, index = row, value = head, bound = i)
  kErrQRows = 7,        // more query rows than cached tokens
  kErrNonFiniteQ = 8,   // q element NaN/Inf (index = row, value = head, bound = i)
  kErrLenOverflow = 9,  // len + rows overflows
  kErrFusedRows = 10,   // fused append + attention: more rows in a sequence than it takes (index = rows, value = limit)
  kErrSplitSpan = 11,   // attention: more than 2^30 compressed tokens per split (index = tokens, value = splits)
  kErrMaxSeqLen = 12    // attention: a sequence longer than opts.max_seq_len (index = length, value = bound)
};

long long* error_word();  // device pointer of the current device's error word
void check_cuda(cudaError_t e, const char* what);
inline cudaStream_t to_stream(void* s) { return (cudaStream_t)s; }
int sm_count();
// A measurement switch NAME=0 in the environment (FMKV_CUDA_PDL, FMKV_CUDA_BALANCE, FMKV_CUDA_WIDE: a feature
// off for A/B timing); read by each caller once per process.
inline bool env_switched_off(const char* name) {
  const char* e = std::getenv(name);
  return e && std::string(e) == "0";
}

__device__ __forceinline__ void report_error(long long* err, int code, int kind, long long seq,
                                             long long index, long long value, long long bound) {
  unsigned long long* w = (unsigned long long*)err;
  if (atomicCAS(w, 0ull, (unsigned long long)code) == 0ull) {
    err[1] = kind;
    err[2] = seq;
    err[3] = index;
    err[4] = value;
    err[5] = bound;
    __threadfence();
  }
}
__device__ __forceinline__ bool error_set(const long long* err) {
  return *(volatile const long long*)err != 0;
}

// ---- programmatic dependent launch (sm_90) -----------------------------------------------------
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start before its
// predecessor finishes; grid_dependency_wait() blocks until the predecessor's memory is visible,
// grid_dependents_launch() lets the dependent start launching. Both are no-ops below sm_90 (and
// without the attribute the launch is ordinary).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
bool programmatic_launch_supported();  // compute capability >= 9.0 (runtime.cu)

// ---- latency trace (diagnostic builds with -DFMKV_CUDA_TRACE=ON only; layout in trace.h) ----------
#ifdef FMKV_CUDA_TRACE
__device__ __forceinline__ void trace_mark(unsigned long long* tr, int kernel, int phase, int role = 0) {
  if (threadIdx.x != 0 || tr == nullptr) return;
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= (unsigned)kTraceCtas) return;
  unsigned long long* row = tr + ((size_t)kernel * kTraceCtas + cta) * kTraceSlots;
  row[phase] = clock64();
  if (phase == 0 || phase == kTracePhases - 1) {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    row[phase == 0 ? kTraceEntryTime : kTraceExitTime] = g;
  }
  if (phase == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    row[kTraceSm] = sm;
  }
  if (role) row[kTraceRole] = (unsigned long long)role;
}
#define FMKV_TRACE(P, KERNEL, PHASE, ...) ::fmkv::cuda::trace_mark((P).trace, KERNEL, PHASE, ##__VA_ARGS__)
#else
#define FMKV_TRACE(P, KERNEL, PHASE, ...) ((void)0)
#endif

// ---- small helpers ------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// D = A(16x16 f16, row) * B(16x8 f16, col) + C (f32)
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Transpose of an 8x8 b16 matrix held in the mma fragment layout (lane: row lane/4, columns
// 2 (lane%4) + {0,1}).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

// Asynchronous 16-byte global -> shared copies (sm_80+), grouped per commit; wait_group<N> returns
// when at most N of this thread's groups are still in flight.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gsrc) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gsrc) : "memory");
}
// 16 bytes if `valid`, else nothing is read and the 16 destination bytes are zeroed (source size 0)
__device__ __forceinline__ void cp_async16_zfill(void* smem_dst, const void* gsrc, bool valid) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gsrc), "r"(valid ? 16u : 0u) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gsrc) {  // 4 bytes (through L1)
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gsrc) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *(uint32_t*)&h;
}

// fp16 (f16) or bf16 bits as float, exactly: cvt.f32.f16, or a shift.
__device__ __forceinline__ float half_bits_to_f32(uint16_t x, bool f16) {
  return f16 ? __half2float(__ushort_as_half(x)) : __uint_as_float((uint32_t)x << 16);
}

// Load element i of a [rows][heads][dim] tensor as float.
__device__ __forceinline__ float load_elem(const void* base, int32_t dtype, int64_t off) {
  if (dtype == FMKV_F32) return ((const float*)base)[off];
  uint16_t h = ((const uint16_t*)base)[off];
  return dtype == FMKV_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}
// The quantizer's canonical fp16 input (FORMAT.md "Input"): value rounded to fp16.
__device__ __forceinline__ uint16_t load_f16_bits(const void* base, int32_t dtype, int64_t off) {
  if (dtype == FMKV_F16) return ((const uint16_t*)base)[off];
  return f32_to_f16(load_elem(base, dtype, off));
}

// Elements off[i] of a [rows][heads][dim] tensor (a negative offset gives 0), as float, or as the
// quantizer's fp16 bits. All N loads are issued before the first is converted, so they cost one round
// trip rather than N (a conversion inside a dtype branch would wait for each load in turn).
template <int N>
__device__ __forceinline__ void load_elems(const void* base, int32_t dtype, const int64_t (&off)[N], float (&out)[N]) {
  if (dtype == FMKV_F32) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = off[i] >= 0 ? static_cast<const float*>(base)[off[i]] : 0.0f;
  } else {
    uint16_t raw[N];
#pragma unroll
    for (int i = 0; i < N; ++i) raw[i] = off[i] >= 0 ? static_cast<const uint16_t*>(base)[off[i]] : (uint16_t)0;
    const bool f16 = dtype == FMKV_F16;  // branch-free conversions
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = half_bits_to_f32(raw[i], f16);
  }
}
template <int N>
__device__ __forceinline__ void load_f16_bits_n(const void* base, int32_t dtype, const int64_t (&off)[N],
                                                uint16_t (&out)[N]) {
  if (dtype == FMKV_F16) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<const uint16_t*>(base)[off[i]];
  } else {
    float f[N];
    load_elems<N>(base, dtype, off, f);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = f32_to_f16(f[i]);
  }
}

// Loads the compiler keeps where they are written (ld.volatile): independent loads placed before an
// early return then share one round trip with the branch's own load, where ptxas would otherwise
// move them past the branch to their first use (a second round trip).
#define FMKV_LOAD_NOW(T, R, PTX, C)                                         \
  __device__ __forceinline__ R load_now(const T* a) {                       \
    T v;                                                                    \
    asm volatile("ld.volatile.global." PTX " %0, [%1];" : "=" C(v) : "l"(a)); \
    return v;                                                               \
  }
FMKV_LOAD_NOW(int64_t, int64_t, "s64", "l")
FMKV_LOAD_NOW(uint16_t, uint32_t, "u16", "h")
FMKV_LOAD_NOW(int32_t, int32_t, "s32", "r")
FMKV_LOAD_NOW(float, float, "f32", "f")
#undef FMKV_LOAD_NOW
__device__ __forceinline__ float2 load_now(const float2* a) {
  float2 v;
  asm volatile("ld.volatile.global.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(a));
  return v;
}
__device__ __forceinline__ float4 load_now(const float4* a) {
  float4 v;
  asm volatile("ld.volatile.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(a));
  return v;
}

// The rotation sign words of a layer, passed by value in kernel parameters (read with fmkv::sign_negative(s.w, i)).
struct SignWords {
  uint64_t w[FMKV_MAX_SIGN_WORDS];
};
inline SignWords make_sign_words(uint64_t seed, int32_t layer, int32_t d) {
  SignWords s{{0, 0, 0, 0}};
  rotation_sign_words(seed, layer, d, s.w);
  return s;
}

// ---- kernel parameter structs (host side) -------------------------------------------------------
// AppendParams and AttnParams name their layer / batch / config / k,v fields alike; these fill them
// from the C API structs in one place.
template <typename Params>
void fill_layer_batch(Params& p, const fmkv_config& c, const fmkv_layer_cache& layer, const fmkv_batch& batch) {
  p.pages = layer.pages;
  p.num_pages = layer.num_pages;
  p.page_bytes = page_bytes(c);
  p.fp16_k = layer.fp16_k;
  p.fp16_v = layer.fp16_v;
  p.num_slots = layer.num_slots;
  p.num_seqs = batch.num_seqs;
  p.slots = batch.slots;
  p.seq_lens = batch.seq_lens;
  p.ro = batch.row_offsets;
  p.bt = batch.block_table;
  p.bt_stride = batch.block_table_stride;
  p.H = c.num_kv_heads;
  p.kb = c.k_bits;
  p.vb = c.v_bits;
  p.P = c.page_size;
  p.S = c.sink_tokens;
  p.W = c.window_tokens;
  p.R = fp16_slots(c);
  p.rule = c.scale_rule;
  p.ss = fmkv_scale_shift(c.scale_group);
  p.sw = make_sign_words(c.seed, layer.layer, c.head_dim);
  p.err = error_word();
}
template <typename Params>
void fill_kv(Params& p, const fmkv_tensor& k, const fmkv_tensor& v) {
  p.k = k.data;
  p.v = v.data;
  p.k_dtype = k.dtype;
  p.v_dtype = v.dtype;
  p.k_rs = k.row_stride;
  p.k_hs = k.head_stride;
  p.v_rs = v.row_stride;
  p.v_hs = v.head_stride;
}

}  // namespace cuda
}  // namespace fmkv
