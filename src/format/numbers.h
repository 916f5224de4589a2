// Number formats of the format core (FORMAT.md "Input" and "Scale"): fp16 / bf16 conversions with
// exact IEEE round-to-nearest-even, the saturated fp16 scale, the correctly rounded square root.
// The format's bytes depend on these roundings, so every backend uses these functions or a hardware
// instruction proven bit-identical to them (tests/test_half.cpp; CUDA device code uses cvt, checked
// against the *_soft functions for every input by tests/cuda/half_cuda_test.cu; MSL's half
// conversion, emulated with the *_soft functions by tests/metal/emu).
// Portable: host C++, CUDA host and device, MSL (depends on include/fmkv/format.h only, so that the
// Metal emulator's <metal_stdlib> can include it).
#ifndef FMKV_FORMAT_NUMBERS_H
#define FMKV_FORMAT_NUMBERS_H
#include "../../include/fmkv/format.h"
#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#elif !defined(__CUDACC_RTC__)
#include <string.h>  // (NVRTC has no C library: device code reinterprets with intrinsics)
#endif
#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace fmkv {

FMKV_HD uint32_t f32_bits(float f) {
#if defined(__METAL_VERSION__)
  return metal::as_type<uint32_t>(f);
#elif defined(__CUDACC_RTC__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
FMKV_HD float bits_f32(uint32_t u) {
#if defined(__METAL_VERSION__)
  return metal::as_type<float>(u);
#elif defined(__CUDACC_RTC__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// float32 -> fp16 bits, round to nearest even; overflow gives +-inf, NaN gives a quiet NaN.
FMKV_HD uint16_t f32_to_f16_soft(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  int e = (int)(ax >> 23) - 127;
  if (e < -25) return (uint16_t)sign;
  uint32_t m = (ax & 0x7fffffu) | 0x800000u;  // 24-bit significand
  if (e < -14) {                              // fp16 subnormal: units of 2^-24
    int sh = -(e + 1);                        // 14..24
    uint32_t r = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  if (e > 15) return (uint16_t)(sign | 0x7c00u);
  uint32_t r = ((uint32_t)(e + 15) << 10) | ((ax & 0x7fffffu) >> 13), rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;  // a carry may reach inf: correct
  return (uint16_t)(sign | r);
}

FMKV_HD float f16_to_f32_soft(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return bits_f32(sign);
    float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

// The conversions every caller uses. On a CUDA device: cvt.rn.f16.f32 (IEEE round-to-nearest-even,
// subnormals, overflow to inf) and cvt.f32.f16 (exact), branch-free; NaN gets the soft functions'
// bits by a select (the hardware gives a canonical NaN). The soft versions compile to ~20
// instructions with branches, which made short device chains (the fused step's quantizer) slow.
// FMKV_PORTABLE_HALF (defined before this header) keeps the portable code on the device too.
// MSL: the language's own half conversion (round to nearest even).
FMKV_HD uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__) && !defined(FMKV_PORTABLE_HALF)
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  const uint32_t x = f32_bits(f);
  return (x & 0x7fffffffu) > 0x7f800000u ? (uint16_t)(((x >> 16) & 0x8000u) | 0x7e00u) : (uint16_t)h;
#elif defined(__METAL_VERSION__)
  return metal::as_type<uint16_t>(half(f));
#else
  return f32_to_f16_soft(f);
#endif
}
FMKV_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__) && !defined(FMKV_PORTABLE_HALF)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
  return (h & 0x7fffu) > 0x7c00u ? bits_f32(((uint32_t)(h & 0x8000u) << 16) | 0x7f800000u | ((uint32_t)(h & 0x3ffu) << 13)) : f;
#elif defined(__METAL_VERSION__)
  return (float)metal::as_type<half>(h);
#else
  return f16_to_f32_soft(h);
#endif
}

FMKV_HD float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

// float32 -> bf16 bits, round to nearest even (NaN stays NaN).
FMKV_HD uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

FMKV_HD bool f16_is_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

// fp16 scale with saturation (FORMAT.md "Scale"): a value beyond the fp16 range becomes 65504, never inf.
// (On a CUDA device the bare cvt.rn.f16.f32: a NaN saturates to 65504 whatever its fp16 bits.)
FMKV_HD uint16_t scale_to_f16(float s) {
#if defined(__CUDA_ARCH__)
  const uint16_t h = __half_as_ushort(__float2half_rn(s));
#else
  const uint16_t h = f32_to_f16(s);
#endif
  return (h & 0x7fffu) >= 0x7c00u ? (uint16_t)0x7bffu : h;
}

// Correctly rounded float32 square root (IEEE): the RMS of a scale group.
FMKV_HD float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#elif defined(__METAL_VERSION__)
  return metal::precise::sqrt(x);
#else
  return __builtin_sqrtf(x);
#endif
}

}  // namespace fmkv

#endif  // FMKV_FORMAT_NUMBERS_H
