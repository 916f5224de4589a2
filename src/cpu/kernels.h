// CPU backend kernel table: one instance per instruction set (kernels_scalar.cpp, kernels_avx2.cpp,
// kernels_avx512.cpp, kernels_neon.cpp), chosen once at run time (select_kernels,
// __builtin_cpu_supports on x86-64; NEON is always present on AArch64).
// Kernels are single-threaded; the drivers (append.cpp, decode_attention.cpp) split work across
// the thread pool.
#pragma once
#include <cstdint>

namespace fmkv::cpu {

// Per-call constants of the quantizer (quantize.cpp builds them).
struct QuantParams {
  int32_t d, bits, rule;
  int32_t tiled, is_v;                 // codes written into tile blocks (format 3, 3 bits: tile.h); K or V section
  int32_t ssh;                         // fmkv_scale_shift of the cache's scale group: code group g uses scale g >> ssh
  alignas(64) uint32_t sign_xor[256];  // 0x80000000 where the rotation sign is -1, else 0
  float thr[15];                       // decision thresholds of the section's codebook, ascending (magnitude_count - 1)
  alignas(64) float mag16[16];         // mag16[i] = its level i & (magnitude_count - 1) (table_mag)
  float norm;                          // rotation_norm(d)
};

// Online-softmax state of one query vector over a token range. acc holds sum p * V (rotated domain,
// in the kernel's lane order for compressed tokens, natural order for fp16 tokens).
struct AttnState {
  float m, l;
  float* acc;  // [head_dim]
};

// One kv head of one sequence, compressed tokens [c0, c1) (compressed index), c0 % 16 == 0.
struct AttnJob {
  const uint8_t* pages;
  int64_t page_bytes, k_off, v_off;  // section offsets of the head inside a page
  const int32_t* block_table;
  int32_t P, d, k_bits, v_bits;
  int32_t k_tiled, v_tiled;  // 3-bit codes in tile blocks (format 3; tile.h)
  int32_t ssh;               // fmkv_scale_shift of the cache's scale group: code group g uses scale g >> ssh
  int64_t c0, c1;
  float softcap;
  int64_t prefetch_tokens;  // software prefetch distance (multiple of 16; 0 = off)
  // Level tables: magnitudes as in QuantParams::mag16; for a tiled section the signed level of code i & 7.
  alignas(64) float tk[16], tv[16];
  // 4-bit codes: the signed level of the whole nibble (sign in bit 3), for traits whose lut16 is one permute.
  alignas(64) float tk4[16], tv4[16];
  // Tiled K (format 3): the same levels as integers, tk[i] = tk_int[i] * tk_step exactly (integer dot products).
  int8_t tk_int[16];
  float tk_step;
};

// The most query vectors of one attention kernel call (Kernels::max_tile: 8 on the x86 sets, 4 on scalar and NEON):
// each call reads and decodes its tokens once for all of them.
constexpr int kMaxTile = 8;

struct Kernels {
  const char* name;
  int lanes;
  int max_tile;  // the most query vectors per attend call (<= kMaxTile)
  // Quantize one fp16 head vector x into token slot t of a quantized section (bits 2..5; tile blocks
  // when qp.tiled: only the token's bits of its block change).
  void (*quantize)(const QuantParams& qp, const uint16_t* x, uint8_t* section, int32_t P, int32_t t);
  // Convert n values of dtype (fmkv_dtype) to fp16 bits, round to nearest even.
  void (*to_f16)(const void* src, int32_t dtype, int32_t n, uint16_t* dst);
  // R <= max_tile query vectors (q: scaled, rotated when k_bits != 16, in tile_k_query_order when K is
  // tiled) against job's tokens; climit[r]: compressed index limit (exclusive) of query r. Updates st[r]
  // (acc in lane order: unpermute's, or tile_v_unpermute's when V is tiled).
  void (*attend)(const AttnJob& job, int R, const float* const* q, const int64_t* climit, AttnState* st);
  // fp16 tokens (sink/window, unrotated, natural order): ntok tokens with K/V rows k[i], v[i] at
  // positions pos[i]; query r sees tokens with pos[i] <= qpos[r]. Updates st[r] (acc natural order).
  void (*attend_fp16)(int32_t d, int64_t ntok, const uint16_t* const* k, const uint16_t* const* v, const int64_t* pos,
                      int R, const float* const* q, const int64_t* qpos, float softcap, AttnState* st);
  // Lane order -> natural coordinate order of an acc vector written by attend (sections in code words).
  void (*unpermute)(const float* acc, int32_t d, float* out);
};

const Kernels& kernels_scalar();
#if defined(__x86_64__)
const Kernels& kernels_avx2();
const Kernels& kernels_avx2vnni();
const Kernels& kernels_avx512();
const Kernels& kernels_avx512vnni();
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
const Kernels& kernels_neon();
#endif
// The kernels used by the backend: best supported ISA, or FMKV_CPU_ISA=scalar|avx2|avx2vnni|avx512|avx512vnni|neon.
const Kernels& kernels();

}  // namespace fmkv::cpu
