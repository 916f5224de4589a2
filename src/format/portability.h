// The dialect layer of the format core (src/format/) and of the single-source kernel core
// (src/metal/kernel_core.h): fixed-width types, address spaces, SIMD-group intrinsics.
//
// The same text compiles four ways:
//   * MSL (__METAL_VERSION__): Apple's compiler, or clang with the type-check shim
//     tests/metal/shim/metal_stdlib (which defines __METAL_VERSION__ and address spaces).
//   * host C++ inside the CPU emulator (FMKV_EMULATOR, set by tests/metal/emu/metal_stdlib): the
//     MSL names (simd_shuffle_xor, simd_ballot, threadgroup_barrier, half, as_type, precise::)
//     are provided by the emulator, which runs every thread as a fiber (atomic_fetch_or_explicit /
//     atomic_fetch_and_explicit as host atomics: genuinely atomic, whatever the fiber schedule).
//   * CUDA (__CUDACC__): warp = SIMD group of 32 lanes, compiled by nvcc (tests/metal/cuda_check.cu,
//     cuda_core_test.cu) or by NVRTC at run time (__CUDACC_RTC__: MLX's mx.fast.cuda_kernel, whose
//     generated source includes only CUDA's own headers, no C library).
//   * plain host C++ (none of the above: src/ref, src/cpu, src/io, src/metal/backend.mm): the
//     fixed-width types and empty address-space qualifiers, so that the scalar format core and
//     params_msl.h are shared with the host.
// Rules for code written on top of this layer (the strictest of the three dialects): no lambdas,
// no double, no std library, no recursion, threadgroup arrays only at kernel scope (declared with
// FMKV_THREADGROUP_ARRAY), every pointer with an explicit address space.
#ifndef FMKV_FORMAT_PORTABILITY_H
#define FMKV_FORMAT_PORTABILITY_H

#if defined(__METAL_VERSION__) || defined(FMKV_EMULATOR)
// ------------------------------------------------------------------------------ MSL (real or emulated)
#include <metal_stdlib>
using namespace metal;
#define FMKV_MSL 1
#define FMKV_DEVICE device
#define FMKV_CONSTANT constant
#define FMKV_THREADGROUP threadgroup
#define FMKV_THREAD thread
typedef uchar fmkv_u8;
typedef ushort fmkv_u16;
typedef uint fmkv_u32;
typedef int fmkv_i32;
typedef ulong fmkv_u64;
typedef long fmkv_i64;
#ifdef FMKV_EMULATOR
#define FMKV_INLINE static inline
// Emulator: threadgroup memory is allocated (and poisoned) per threadgroup by the emulator;
// every thread of the group gets the same pointer.
#define FMKV_THREADGROUP_ARRAY(T, name, n) FMKV_EMU_THREADGROUP_ARRAY(T, name, n)
#else
#define FMKV_INLINE inline
// (The type-check shim defines FMKV_SHIM_TG_STORAGE as `static`: clang rejects address-space
// qualified automatic variables, which MSL allows at kernel scope.)
#ifndef FMKV_SHIM_TG_STORAGE
#define FMKV_SHIM_TG_STORAGE
#endif
#define FMKV_THREADGROUP_ARRAY(T, name, n) FMKV_SHIM_TG_STORAGE threadgroup T name[n]
// Bit-exact quantization needs IEEE float32 without contraction (FORMAT.md §3, §5). The host also
// compiles with fast math off (backend.mm; MLX: math mode safe); MSL >= 3.2 can say so in source.
#if __METAL_VERSION__ >= 320
#pragma METAL fp math_mode(safe)
#pragma METAL fp contract(off)
#endif
#endif
#define FMKV_SHUFFLE_XOR(x, m) simd_shuffle_xor((x), (ushort)(m))
#define FMKV_BALLOT(pred) ((fmkv_u32)(static_cast<simd_vote::vote_t>(simd_ballot((bool)(pred))) & 0xffffffffu))
#define FMKV_TG_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define FMKV_EXP(x) precise::exp(x)
#define FMKV_LOG(x) precise::log(x)
#define FMKV_TANH(x) precise::tanh(x)
// a * b rounded to float32, never fused with a following add (contraction is off, see above).
#define FMKV_MUL_RN(a, b) ((a) * (b))
// Atomic OR / AND of a device uint32 word (relaxed: only the bits a thread owns matter, nothing is
// ordered by them). The emulator's <metal_stdlib> implements the same MSL names with host atomics.
#define FMKV_ATOMIC_OR_U32(p, v) \
  atomic_fetch_or_explicit((FMKV_DEVICE atomic_uint*)(p), (fmkv_u32)(v), memory_order_relaxed)
#define FMKV_ATOMIC_AND_U32(p, v) \
  atomic_fetch_and_explicit((FMKV_DEVICE atomic_uint*)(p), (fmkv_u32)(v), memory_order_relaxed)

#elif defined(__CUDACC__)
// ------------------------------------------------------------------------------ CUDA
#include <cuda_fp16.h>  // NVRTC finds it on the include path its caller passes (MLX: the CUDA toolkit's)
#define FMKV_CUDA_CORE 1
#define FMKV_DEVICE
#define FMKV_CONSTANT
#define FMKV_THREADGROUP
#define FMKV_THREAD
#if defined(__CUDACC_RTC__)
#include <cuda/std/cstdint>  // NVRTC: no C library; libcu++'s fixed-width types (include/fmkv/format.h too)
#else
#include <stdint.h>
#endif
typedef uint8_t fmkv_u8;  // the format core's fixed-width types, so that its functions take these
typedef uint16_t fmkv_u16;
typedef uint32_t fmkv_u32;
typedef int32_t fmkv_i32;
typedef uint64_t fmkv_u64;
typedef int64_t fmkv_i64;
#define FMKV_INLINE static __device__ __forceinline__
#define FMKV_THREADGROUP_ARRAY(T, name, n) __shared__ T name[n]
#define FMKV_SHUFFLE_XOR(x, m) __shfl_xor_sync(0xffffffffu, (x), (int)(m))
#define FMKV_BALLOT(pred) ((fmkv_u32)__ballot_sync(0xffffffffu, (int)(pred)))
#define FMKV_TG_BARRIER() __syncthreads()
#define FMKV_EXP(x) expf(x)
#define FMKV_LOG(x) logf(x)
#define FMKV_TANH(x) tanhf(x)
// a * b rounded to float32 and never contracted into an FMA: nvcc and NVRTC contract a*b + c by
// default (-fmad=true; MLX's NVRTC call passes no option to turn it off), __fmul_rn is exempt.
#define FMKV_MUL_RN(a, b) __fmul_rn((a), (b))
// Atomic OR / AND of a global uint32 word (relaxed, like MSL's memory_order_relaxed); callable from the
// format core's __host__ __device__ functions (the host pass uses the host compiler's atomics).
__host__ __device__ __forceinline__ fmkv_u32 fmkv_atomic_or_u32(fmkv_u32* p, fmkv_u32 v) {
#if defined(__CUDA_ARCH__)
  return atomicOr((unsigned int*)p, (unsigned int)v);
#else
  return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
#endif
}
__host__ __device__ __forceinline__ fmkv_u32 fmkv_atomic_and_u32(fmkv_u32* p, fmkv_u32 v) {
#if defined(__CUDA_ARCH__)
  return atomicAnd((unsigned int*)p, (unsigned int)v);
#else
  return __atomic_fetch_and(p, v, __ATOMIC_RELAXED);
#endif
}
#define FMKV_ATOMIC_OR_U32(p, v) fmkv_atomic_or_u32((fmkv_u32*)(p), (fmkv_u32)(v))
#define FMKV_ATOMIC_AND_U32(p, v) fmkv_atomic_and_u32((fmkv_u32*)(p), (fmkv_u32)(v))

#else
// ------------------------------------------------------------------------------ plain host (types only)
#include <stdint.h>
typedef uint8_t fmkv_u8;
typedef uint16_t fmkv_u16;
typedef uint32_t fmkv_u32;
typedef int32_t fmkv_i32;
typedef uint64_t fmkv_u64;
typedef int64_t fmkv_i64;
#define FMKV_DEVICE
#define FMKV_CONSTANT
#define FMKV_THREADGROUP
#define FMKV_THREAD
// Atomic OR / AND of a uint32 word (relaxed; GCC / Clang builtins), for host code that writes shared words
// from threads.
#define FMKV_ATOMIC_OR_U32(p, v) __atomic_fetch_or((fmkv_u32*)(p), (fmkv_u32)(v), __ATOMIC_RELAXED)
#define FMKV_ATOMIC_AND_U32(p, v) __atomic_fetch_and((fmkv_u32*)(p), (fmkv_u32)(v), __ATOMIC_RELAXED)
#endif

#endif  // FMKV_FORMAT_PORTABILITY_H
