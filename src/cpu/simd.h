// Small SIMD abstraction of the CPU backend: one traits struct per instruction set, N float32 lanes.
// The kernels (kernels_impl.h) are templates over these traits; each per-ISA translation unit is
// compiled with its own -m flags and sees only the traits its flags enable. Scalar (N = 1) is the
// portable fallback (any architecture); NEON (N = 4) is the AArch64 baseline (no -m flags needed).
// Quantize code uses only exactly rounded ops here (add/sub/mul/div, no fmadd); fmadd is used only
// by attention, which is not bit-exact by contract.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../format/numbers.h"

#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(FMKV_CPU_NEON_TU)
#include <arm_neon.h>
#endif

// Internal linkage (anonymous namespace): each per-ISA translation unit has its own copy of every traits
// function, so the linker never merges one compiled with other -m flags (Avx512VnniT derives from Avx512T).
namespace fmkv::cpu {
namespace {

// ---- scalar (N = 1) ------------------------------------------------------------------------
struct ScalarT {
  static constexpr int N = 1;
  static constexpr bool kIntDot = false;  // integer dot products for format 3's K (kernels_impl.h)
  static constexpr bool kLut16 = true;  // lut16 is one permute, so 4-bit codes index signed 16-entry tables (kernels_impl.h)
  using F = float;
  using I = uint32_t;
  using Table = const float*;
  static F zero() { return 0.0f; }
  static F set1(float x) { return x; }
  static I set1i(uint32_t x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static I loadi(const uint32_t* p) { return *p; }
  static I load_u8(const uint8_t* p) { return *p; }  // N bytes, zero-extended to the N lanes
  static F load_h(const uint16_t* p) { return f16_to_f32(*p); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  static F max(F a, F b) { return a > b ? a : b; }
  static I srl(I a, int n) { return a >> n; }
  static I sll(I a, int n) { return a << n; }
  static I srlv(I a, I n) { return n > 31 ? 0u : a >> n; }
  static I sllv(I a, I n) { return n > 31 ? 0u : a << n; }
  static I select_bits(I a, I b, I c) { return (a & ~c) | (b & c); }
  static F xor_i(F x, I s) { return bits_f32(f32_bits(x) ^ s); }
  static F xor_sign(F x, I s) { return bits_f32(f32_bits(x) ^ (s & 0x80000000u)); }
  static Table load_table(const float* t16) { return t16; }
  static F lut(Table t, I idx) { return t[idx & 15u]; }
  // 16 distinct entries (5-bit magnitudes): lut16 reads idx mod 16 on every set (lut reads mod 8 on AVX2, NEON).
  using Table16 = const float*;
  static Table16 load_table16(const float* t16) { return t16; }
  static F lut16(Table16 t, I idx) { return t[idx & 15u]; }
  static F select_valid(F a, F b, int n) { return n > 0 ? a : b; }
  static float hmax(F x) { return x; }
  static float hsum(F x) { return x; }
  static F exp(F x) { return std::exp(x); }
  // quantize helpers (perm_xor / blend_hbit are never used with N = 1)
  static F perm_xor(F v, int) { return v; }
  static F blend_hbit(F a, F, int) { return a; }
  static float tree_reduce(F v) { return v; }
  static uint32_t ltzero_mask(F u) { return u < 0.0f ? 1u : 0u; }
  static F abs(F x) { return x < 0.0f ? -x : x; }
  static I count_gt(I m, F a, float thr) { return m + (a > thr ? 1u : 0u); }
  static uint32_t bitmask(I m, int bit) { return (m >> bit) & 1u; }
  // 4-bit codes (format version 2): code4 = m | (u < 0) << 3 per lane (m < 8); pack_nibbles: the 32 codes
  // of a group (K = 32 / N vectors, vector k lane i = coordinate k N + i) to nibble words w[0..3].
  static I code4(I m, F u) { return m | (u < 0.0f ? 8u : 0u); }
  static void pack_nibbles(const I* c, uint32_t* w) {
    for (int q = 0; q < 4; ++q) {
      uint32_t x = 0;
      for (int i = 0; i < 8; ++i) x |= c[8 * q + i] << (4 * i);
      w[q] = x;
    }
  }
  static F negate_if_lt0(F l, F u) { return u < 0.0f ? -l : l; }
  static uint16_t h_from_f(float x) { return f32_to_f16(x); }
  static float f_from_h(uint16_t h) { return f16_to_f32(h); }
};

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// ---- AVX2 + FMA + F16C (N = 8) -------------------------------------------------------------
struct Avx2T {
  static constexpr int N = 8;
  static constexpr bool kIntDot = false;  // integer dot products for format 3's K (kernels_impl.h)
  static constexpr bool kLut16 = false;  // lut16 costs more than lut: 4-bit codes keep the sign step (kernels_impl.h)
  using F = __m256;
  using I = __m256i;
  using Table = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static I set1i(uint32_t x) { return _mm256_set1_epi32((int)x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static I loadi(const uint32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static F load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static I srl(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I sll(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srlv(I a, I n) { return _mm256_srlv_epi32(a, n); }
  static I sllv(I a, I n) { return _mm256_sllv_epi32(a, n); }
  static I select_bits(I a, I b, I c) { return _mm256_or_si256(_mm256_andnot_si256(c, a), _mm256_and_si256(c, b)); }
  static F xor_i(F x, I s) { return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), s)); }
  static F xor_sign(F x, I s) { return xor_i(x, _mm256_and_si256(s, set1i(0x80000000u))); }
  static Table load_table(const float* t16) { return _mm256_loadu_ps(t16); }
  static F lut(Table t, I idx) { return _mm256_permutevar8x32_ps(t, idx); }
  struct Table16 {
    __m256 lo, hi;
  };
  static Table16 load_table16(const float* t16) { return {_mm256_loadu_ps(t16), _mm256_loadu_ps(t16 + 8)}; }
  static F lut16(Table16 t, I idx) {  // entry idx & 7 of the low or high half, by bit 3 (moved to the sign bit)
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, idx), _mm256_permutevar8x32_ps(t.hi, idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
  static F select_valid(F a, F b, int n) {
    if (n >= N) return a;
    F m = _mm256_castsi256_ps(_mm256_cmpgt_epi32(set1i((uint32_t)(n < 0 ? 0 : n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    return _mm256_blendv_ps(b, a, m);
  }
  static float hmax(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static float hsum(F x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static F exp(F x) {  // Cephes expf, ~1 ulp on [-87, 88]
    x = _mm256_min_ps(_mm256_max_ps(x, set1(-87.0f)), set1(88.0f));
    F n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    F y = set1(1.9875691500E-4f);
    y = fmadd(y, r, set1(1.3981999507E-3f));
    y = fmadd(y, r, set1(8.3334519073E-3f));
    y = fmadd(y, r, set1(4.1665795894E-2f));
    y = fmadd(y, r, set1(1.6666665459E-1f));
    y = fmadd(y, r, set1(5.0000001201E-1f));
    y = fmadd(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, set1(1.0f));
    I e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), set1i(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  static F perm_xor(F v, int h) {
    if (h == 1) return _mm256_permute_ps(v, 0xB1);
    if (h == 2) return _mm256_permute_ps(v, 0x4E);
    return _mm256_permute2f128_ps(v, v, 1);
  }
  static F blend_hbit(F a, F b, int h) {
    if (h == 1) return _mm256_blend_ps(a, b, 0xAA);
    if (h == 2) return _mm256_blend_ps(a, b, 0xCC);
    return _mm256_blend_ps(a, b, 0xF0);
  }
  // blend_hbit of integer lanes (V decode of 4-bit codes, N >= 8 only)
  static I blend_i_hbit(I a, I b, int h) {
    return _mm256_castps_si256(blend_hbit(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), h));
  }
  static float tree_reduce(F v) {  // steps 4, 2, 1: lane j += lane j + step
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static uint32_t ltzero_mask(F u) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(u, zero(), _CMP_LT_OQ)); }
  static F abs(F x) { return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), set1i(0x7fffffffu))); }
  static I count_gt(I m, F a, float thr) { return _mm256_sub_epi32(m, _mm256_castps_si256(_mm256_cmp_ps(a, set1(thr), _CMP_GT_OQ))); }
  static uint32_t bitmask(I m, int bit) { return (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_sll_epi32(m, _mm_cvtsi32_si128(31 - bit)))); }
  static I code4(I m, F u) {
    return _mm256_or_si256(m, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(u, zero(), _CMP_LT_OQ)), set1i(8)));
  }
  static void pack_nibbles(const I* c, uint32_t* w) {  // lane i << 4 i, then word k = sum of vector k's lanes
    const I sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const I h01 = _mm256_hadd_epi32(_mm256_sllv_epi32(c[0], sh), _mm256_sllv_epi32(c[1], sh));
    const I h23 = _mm256_hadd_epi32(_mm256_sllv_epi32(c[2], sh), _mm256_sllv_epi32(c[3], sh));
    const I h = _mm256_hadd_epi32(h01, h23);  // 128-bit half: vector k's lanes 0..3 (4..7) summed in lane k
    _mm_storeu_si128((__m128i*)w, _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
  static F negate_if_lt0(F l, F u) {
    return xor_i(l, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(u, zero(), _CMP_LT_OQ)), set1i(0x80000000u)));
  }
  // F16C conversions, bit-identical to half.h (tests/test_half.cpp checks the hardware rounding).
  static uint16_t h_from_f(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float f_from_h(uint16_t h) { return _cvtsh_ss(h); }
};
#endif

#if defined(__x86_64__) && defined(__AVX2__) && defined(__AVXVNNI__) && !defined(__AVX512F__)
// ---- AVX2 with AVX-VNNI (N = 8): Avx2T plus the byte operations of the integer K path ------------------
// Format 3's 3-bit K (tile blocks) is scored with the VEX-encoded vpdpbusd on int8 levels (kernels_impl.h, as
// Avx512VnniT at 8 lanes); everything else is Avx2T's.
struct Avx2VnniT : Avx2T {
  static constexpr bool kIntDot = true;
  static I set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
  static I and_i(I a, I b) { return _mm256_and_si256(a, b); }
  static I add_i(I a, I b) { return _mm256_add_epi32(a, b); }
  static I table_u8(const uint8_t* t16) {  // 16 bytes, repeated in each 128-bit lane
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)t16));
  }
  static I lut_u8(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }  // idx bytes < 16
  // acc + sum over the 4 bytes of each 32-bit lane of u8(a) * s8(b)
  static I dot_u8s8(I acc, I a, I b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
  static F cvt_f(I x) { return _mm256_cvtepi32_ps(x); }
};
#endif

#if defined(__x86_64__) && defined(__AVX512F__)
// ---- AVX-512F (N = 16) ---------------------------------------------------------------------
struct Avx512T {
  static constexpr int N = 16;
  static constexpr bool kIntDot = false;  // integer dot products for format 3's K (kernels_impl.h)
  static constexpr bool kLut16 = true;  // lut16 is one permute, so 4-bit codes index signed 16-entry tables (kernels_impl.h)
  using F = __m512;
  using I = __m512i;
  using Table = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static I set1i(uint32_t x) { return _mm512_set1_epi32((int)x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static I loadi(const uint32_t* p) { return _mm512_loadu_si512((const void*)p); }
  static I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static F load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static I srl(I a, int n) { return _mm512_srli_epi32(a, (unsigned)n); }
  static I sll(I a, int n) { return _mm512_slli_epi32(a, (unsigned)n); }
  static I srlv(I a, I n) { return _mm512_srlv_epi32(a, n); }
  static I sllv(I a, I n) { return _mm512_sllv_epi32(a, n); }
  static I select_bits(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0xD8); }  // c ? b : a
  static F xor_i(F x, I s) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), s)); }
  static F xor_sign(F x, I s) {  // x ^ (s & 0x80000000)
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(x), s, set1i(0x80000000u), 0x78));
  }
  static Table load_table(const float* t16) { return _mm512_loadu_ps(t16); }
  static F lut(Table t, I idx) { return _mm512_permutexvar_ps(idx, t); }
  using Table16 = __m512;
  static Table16 load_table16(const float* t16) { return _mm512_loadu_ps(t16); }
  static F lut16(Table16 t, I idx) { return _mm512_permutexvar_ps(idx, t); }
  static F select_valid(F a, F b, int n) {
    __mmask16 k = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
    return _mm512_mask_blend_ps(k, b, a);
  }
  static float hmax(F x) { return _mm512_reduce_max_ps(x); }
  static float hsum(F x) { return _mm512_reduce_add_ps(x); }
  static F exp(F x) {  // Cephes expf, ~1 ulp on [-87, 88]
    x = _mm512_min_ps(_mm512_max_ps(x, set1(-87.0f)), set1(88.0f));
    F n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm512_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    F y = set1(1.9875691500E-4f);
    y = fmadd(y, r, set1(1.3981999507E-3f));
    y = fmadd(y, r, set1(8.3334519073E-3f));
    y = fmadd(y, r, set1(4.1665795894E-2f));
    y = fmadd(y, r, set1(1.6666665459E-1f));
    y = fmadd(y, r, set1(5.0000001201E-1f));
    y = fmadd(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, set1(1.0f));
    return _mm512_scalef_ps(y, n);
  }
  static F perm_xor(F v, int h) {
    if (h == 1) return _mm512_permute_ps(v, 0xB1);
    if (h == 2) return _mm512_permute_ps(v, 0x4E);
    if (h == 4) return _mm512_shuffle_f32x4(v, v, 0xB1);
    return _mm512_shuffle_f32x4(v, v, 0x4E);
  }
  static F blend_hbit(F a, F b, int h) {
    __mmask16 k = h == 1 ? 0xAAAA : h == 2 ? 0xCCCC : h == 4 ? 0xF0F0 : 0xFF00;
    return _mm512_mask_blend_ps(k, a, b);
  }
  // blend_hbit of integer lanes (V decode of 4-bit codes, N >= 8 only)
  static I blend_i_hbit(I a, I b, int h) {
    return _mm512_castps_si512(blend_hbit(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), h));
  }
  static float tree_reduce(F v) {  // steps 8, 4, 2, 1: lane j += lane j + step
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static uint32_t ltzero_mask(F u) { return (uint32_t)_mm512_cmp_ps_mask(u, zero(), _CMP_LT_OQ); }
  static F abs(F x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), set1i(0x7fffffffu))); }
  static I count_gt(I m, F a, float thr) {
    return _mm512_mask_add_epi32(m, _mm512_cmp_ps_mask(a, set1(thr), _CMP_GT_OQ), m, set1i(1));
  }
  static uint32_t bitmask(I m, int bit) { return (uint32_t)_mm512_test_epi32_mask(m, set1i(1u << bit)); }
  static I code4(I m, F u) { return _mm512_mask_or_epi32(m, _mm512_cmp_ps_mask(u, zero(), _CMP_LT_OQ), m, set1i(8)); }
  static void pack_nibbles(const I* c, uint32_t* w) {  // lane i << 4 (i & 7), then word k = sum of its 8 lanes
    const I sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const I s0 = _mm512_sllv_epi32(c[0], sh), s1 = _mm512_sllv_epi32(c[1], sh);  // words 0, 1 and 2, 3
    const __m256i h01 = _mm256_hadd_epi32(_mm512_castsi512_si256(s0), _mm512_extracti64x4_epi64(s0, 1));
    const __m256i h23 = _mm256_hadd_epi32(_mm512_castsi512_si256(s1), _mm512_extracti64x4_epi64(s1, 1));
    const __m256i h = _mm256_hadd_epi32(h01, h23);
    _mm_storeu_si128((__m128i*)w, _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
  static F negate_if_lt0(F l, F u) {
    I li = _mm512_castps_si512(l);
    return _mm512_castsi512_ps(_mm512_mask_xor_epi32(li, _mm512_cmp_ps_mask(u, zero(), _CMP_LT_OQ), li, set1i(0x80000000u)));
  }
  static uint16_t h_from_f(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float f_from_h(uint16_t h) { return _cvtsh_ss(h); }
};
#endif

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// ---- AVX-512 with VNNI and BW (N = 16): Avx512T plus the byte operations of the integer K path ------
// Format 3's 3-bit K (tile blocks) is scored with vpdpbusd on int8 levels (kernels_impl.h, tile_scores_int);
// everything else is Avx512T's.
struct Avx512VnniT : Avx512T {
  static constexpr bool kIntDot = true;
  static I set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
  static I and_i(I a, I b) { return _mm512_and_si512(a, b); }
  static I add_i(I a, I b) { return _mm512_add_epi32(a, b); }
  static I table_u8(const uint8_t* t16) {  // 16 bytes, repeated in each 128-bit lane
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)t16));
  }
  static I lut_u8(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }  // idx bytes < 16
  // acc + sum over the 4 bytes of each 32-bit lane of u8(a) * s8(b)
  static I dot_u8s8(I acc, I a, I b) { return _mm512_dpbusd_epi32(acc, a, b); }
  static F cvt_f(I x) { return _mm512_cvtepi32_ps(x); }
};
#endif

#if defined(__aarch64__) && defined(__ARM_NEON) && defined(FMKV_CPU_NEON_TU)
// ---- AArch64 Advanced SIMD (N = 4) ---------------------------------------------------------
// Visible only in kernels_neon.cpp (FMKV_CPU_NEON_TU). Quantize ops are the correctly rounded
// vaddq/vsubq/vmulq/vdivq (never vfmaq/vmlaq; the TU is built with -ffp-contract=off); vfmaq only in
// fmadd/exp (attention). fp16 conversions use FCVT/FCVTN (round to nearest even under the default
// FPCR, bit-identical to half.h for finite values; tests/cross/aarch64.sh checks it).
struct NeonT {
  static constexpr int N = 4;
  static constexpr bool kIntDot = false;  // integer dot products for format 3's K (kernels_impl.h)
  static constexpr bool kLut16 = false;  // lut16 costs more than lut: 4-bit codes keep the sign step (kernels_impl.h)
  using F = float32x4_t;
  using I = uint32x4_t;
  using Table = uint8x16x2_t;  // mag16[0..7] as bytes; indices are taken mod 8 (mag16 has period <= 8)
  static F zero() { return vdupq_n_f32(0.0f); }
  static F set1(float x) { return vdupq_n_f32(x); }
  static I set1i(uint32_t x) { return vdupq_n_u32(x); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F v) { vst1q_f32(p, v); }
  static I loadi(const uint32_t* p) { return vld1q_u32(p); }
  static I load_u8(const uint8_t* p) {  // 4 bytes -> 4 lanes
    uint32_t w;
    std::memcpy(&w, p, 4);
    return vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8((uint64_t)w))));
  }
  static F load_h(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }  // attention only
  static F max(F a, F b) { return vmaxq_f32(a, b); }
  static I srl(I a, int n) { return vshlq_u32(a, vdupq_n_s32(-n)); }  // n in 0..31 (folds to USHR)
  static I sll(I a, int n) { return vshlq_u32(a, vdupq_n_s32(n)); }
  // USHL: a shift count of +-32 gives 0, as the x86 variable shifts do.
  static I srlv(I a, I n) { return vshlq_u32(a, vnegq_s32(vreinterpretq_s32_u32(n))); }
  static I sllv(I a, I n) { return vshlq_u32(a, vreinterpretq_s32_u32(n)); }
  static I select_bits(I a, I b, I c) { return vbslq_u32(c, b, a); }
  static F xor_i(F x, I s) { return vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(x), s)); }
  static F xor_sign(F x, I s) { return xor_i(x, vandq_u32(s, vdupq_n_u32(0x80000000u))); }
  static Table load_table(const float* t16) {
    Table t;
    t.val[0] = vld1q_u8((const uint8_t*)t16);
    t.val[1] = vld1q_u8((const uint8_t*)(t16 + 4));
    return t;
  }
  static F lut(Table t, I idx) {  // byte index 4 * (idx & 7) + {0, 1, 2, 3} per lane
    const I b = vaddq_u32(vmulq_n_u32(vandq_u32(idx, vdupq_n_u32(7u)), 0x04040404u), vdupq_n_u32(0x03020100u));
    return vreinterpretq_f32_u8(vqtbl2q_u8(t, vreinterpretq_u8_u32(b)));
  }
  using Table16 = uint8x16x4_t;  // mag16[0..15] as bytes
  static Table16 load_table16(const float* t16) {
    Table16 t;
    for (int i = 0; i < 4; ++i) t.val[i] = vld1q_u8((const uint8_t*)(t16 + 4 * i));
    return t;
  }
  static F lut16(Table16 t, I idx) {  // byte index 4 * (idx & 15) + {0, 1, 2, 3} per lane
    const I b = vaddq_u32(vmulq_n_u32(vandq_u32(idx, vdupq_n_u32(15u)), 0x04040404u), vdupq_n_u32(0x03020100u));
    return vreinterpretq_f32_u8(vqtbl4q_u8(t, vreinterpretq_u8_u32(b)));
  }
  static I lane_ids() {
    static const uint32_t ids[4] = {0, 1, 2, 3};
    return vld1q_u32(ids);
  }
  static F select_valid(F a, F b, int n) {
    if (n >= N) return a;
    return vbslq_f32(vcltq_u32(lane_ids(), vdupq_n_u32((uint32_t)(n < 0 ? 0 : n))), a, b);
  }
  static float hmax(F x) { return vmaxvq_f32(x); }
  static float hsum(F x) { return vaddvq_f32(x); }
  static F exp(F x) {  // Cephes expf, ~1 ulp on [-87, 88] (same steps as Avx2T::exp)
    x = vminq_f32(vmaxq_f32(x, set1(-87.0f)), set1(88.0f));
    F n = vrndnq_f32(vmulq_f32(x, set1(1.44269504088896341f)));
    F r = vfmsq_f32(x, n, set1(0.693359375f));
    r = vfmsq_f32(r, n, set1(-2.12194440e-4f));
    F y = set1(1.9875691500E-4f);
    y = fmadd(y, r, set1(1.3981999507E-3f));
    y = fmadd(y, r, set1(8.3334519073E-3f));
    y = fmadd(y, r, set1(4.1665795894E-2f));
    y = fmadd(y, r, set1(1.6666665459E-1f));
    y = fmadd(y, r, set1(5.0000001201E-1f));
    y = fmadd(y, vmulq_f32(r, r), r);
    y = vaddq_f32(y, set1(1.0f));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(e));
  }
  static F perm_xor(F v, int h) {  // lane i <- lane i ^ h (h = 1, 2)
    if (h == 1) return vrev64q_f32(v);
    return vextq_f32(v, v, 2);
  }
  static F blend_hbit(F a, F b, int h) {  // lanes with bit h set from b
    static const uint32_t m1[4] = {0, ~0u, 0, ~0u}, m2[4] = {0, 0, ~0u, ~0u};
    return vbslq_f32(vld1q_u32(h == 1 ? m1 : m2), b, a);
  }
  static float tree_reduce(F v) {  // steps 2, 1: lane j += lane j + step
    const float32x2_t m = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(m, 0) + vget_lane_f32(m, 1);
  }
  static uint32_t lane_bits(I mask) {  // all-ones lanes -> bit i
    static const uint32_t w[4] = {1, 2, 4, 8};
    return vaddvq_u32(vandq_u32(mask, vld1q_u32(w)));
  }
  static uint32_t ltzero_mask(F u) { return lane_bits(vcltzq_f32(u)); }
  static F abs(F x) { return vabsq_f32(x); }
  static I count_gt(I m, F a, float thr) { return vsubq_u32(m, vcgtq_f32(a, vdupq_n_f32(thr))); }
  static uint32_t bitmask(I m, int bit) { return lane_bits(vtstq_u32(m, vdupq_n_u32(1u << bit))); }
  static I code4(I m, F u) { return vorrq_u32(m, vandq_u32(vcltzq_f32(u), vdupq_n_u32(8u))); }
  static void pack_nibbles(const I* c, uint32_t* w) {  // word q: vectors 2q, 2q+1 shifted to nibbles 0-3, 4-7, lanes summed
    static const int32_t lo[4] = {0, 4, 8, 12}, hi[4] = {16, 20, 24, 28};
    I v[4];
    for (int q = 0; q < 4; ++q) v[q] = vaddq_u32(vshlq_u32(c[2 * q], vld1q_s32(lo)), vshlq_u32(c[2 * q + 1], vld1q_s32(hi)));
    vst1q_u32(w, vpaddq_u32(vpaddq_u32(v[0], v[1]), vpaddq_u32(v[2], v[3])));
  }
  static F negate_if_lt0(F l, F u) { return xor_i(l, vandq_u32(vcltzq_f32(u), vdupq_n_u32(0x80000000u))); }
  static uint16_t h_from_f(float x) { return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(x))), 0); }
  static float f_from_h(uint16_t h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
};
#endif

}  // namespace
}  // namespace fmkv::cpu
