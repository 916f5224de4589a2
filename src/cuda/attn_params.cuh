// Decode attention: the launch parameters shared by the kernel (decode_attention.cuh), its fp16 part
// (fp16_part.cuh) and the fused step (fused_step.cuh), and small float helpers.
#pragma once
#include "quantize.cuh"
#include "split_count.h"

namespace fmkv {
namespace cuda {

struct AttnParams {
  const uint8_t* pages;
  int64_t num_pages, page_bytes, head_stride, ksec_bytes;
  const uint16_t *fp16_k, *fp16_v;
  int32_t num_slots, num_seqs;
  const int32_t* slots;
  const int64_t* seq_lens;
  const int64_t* ro;
  const int32_t* bt;
  int64_t bt_stride;
  const void* q;
  int32_t q_dtype;
  int64_t q_rs, q_hs, q_rows;
  void* out;
  int32_t o_dtype;
  int64_t o_rs, o_hs;
  float* lse;  // fmkv_attention_lse: the merge writes log(sum exp(score)) of (row, q head) at lse[row l_rs + hq l_hs]; else null
  int64_t l_rs, l_hs;
  int32_t H, HQ, gq, P, S, W, R;
  int32_t ss;  // scale shift, fmkv_scale_shift(scale_group): code group g's scale is row g >> ss of a section
  float sm_scale, softcap;
  float tile_step[2];  // format 3: the steps of the 3-bit K and V tables (fp16 values; the kernels use the integers)
  SignWords sw;
  float2* part_ml;
  float* part_acc;
  int32_t nsplit;   // split CTAs per (sequence, kv head) in the grid (a balanced call shares them out)
  int32_t nraw;     // raw-domain partials per query vector (1 or 2)
  int32_t pstride;  // partial slots per query vector: kRawParts + the most compressed splits of a sequence
  int32_t balanced; // the split plan is balanced on the device (split_count.h, balanced_plan.cuh)
  int32_t* part_n;  // balanced calls: partials of each query row, written by its sequence's raw-domain CTA
  long long* err;
  // Fused decode step (fmkv_append_attention): the sink/window CTA of each (sequence, kv head) first
  // appends that head's rows of k / v; seq_lens are then the lengths before the append.
  int32_t fused;
  const void *k, *v;
  int32_t k_dtype, v_dtype;
  int64_t k_rs, k_hs, v_rs, v_hs;
  int32_t kb, vb, rule;
  QuantTables kq, vq;  // the fused step's quantizer tables for K and V (zero for k16)
  unsigned long long* trace;  // FMKV_CUDA_TRACE builds: per-CTA phase timestamps (common.cuh)
  int64_t max_len;  // opts.max_seq_len: no sequence may be longer (checked); 0 = no bound
};
using AttnFnPtr = void (*)(AttnParams);
struct AttnFn {  // a compiled decode-attention kernel and its dynamic shared memory bytes
  AttnFnPtr fn = nullptr;
  int smem = 0;
  explicit operator bool() const { return fn != nullptr; }
};

// CTAs per SM the register allocation must allow for head_dim <= 128 (3, since f2c759d: up to 168 registers;
// 4: 128, 0.4-16% slower there; 5: 96 registers with spills; 2: 255 registers, B = 1 up to 3% faster but
// B = 64 4% slower) -- a tuning knob, see docs/history/cuda-occupancy.md. With 3 the split count plans 4
// slots per SM and cuts one-wave grids to the 3 resident (split_device, decode_attention.cu; SplitDevice,
// split_count.h).
#ifndef FMKV_ATTN_MIN_BLOCKS
#define FMKV_ATTN_MIN_BLOCKS 3
#endif
// The same for the wide kernels (two halves of kQV query vectors per pass, attn_compiled_wide): their second
// set of accumulators and softmax state does not fit 168 registers.
#ifndef FMKV_ATTN_WIDE_MIN_BLOCKS
#define FMKV_ATTN_WIDE_MIN_BLOCKS 2
#endif
// kMinTilesPerSplit, kMaxSplits, kFusedMaxRows: split_count.h
constexpr int kAttnWarps = 4, kQV = 8;
static_assert(kAttnWarps == kSplitWarps && kQV == kSplitVectors, "split_count.h counts tiles per warp and passes");
// Partial slots per query vector (pstride of them): up to kRawParts from the raw-domain CTAs (the
// sink/window CTA; a fused step with fp16 regions has two), then the compressed splits (un-rotated by
// their split CTA); every partial is in the raw domain. Raw-domain CTA z < nraw writes slot
// kRawParts - nraw + z, split k slot kRawParts + k, so a query vector's partials are one contiguous
// range from slot kRawParts - nraw (merge_kernel).
constexpr int kRawParts = 2;
constexpr float kLog2e = 1.4426950408889634f;
constexpr uint32_t kSignMask = 0x80008000u;

// First partial slot of query row `row`, q head hq (its slot 0).
__device__ __forceinline__ int64_t partial_row_base(const AttnParams& p, int64_t row, int hq) {
  return (row * p.HQ + hq) * p.pstride;
}
__device__ __forceinline__ int raw_slot(const AttnParams& p, int z) { return kRawParts - p.nraw + z; }
__device__ __forceinline__ int split_slot(int k) { return kRawParts + k; }

__device__ __forceinline__ float h_lo(uint32_t x) { return __half2float(__ushort_as_half((unsigned short)(x & 0xffffu))); }
__device__ __forceinline__ float h_hi(uint32_t x) { return __half2float(__ushort_as_half((unsigned short)(x >> 16))); }

__device__ __forceinline__ float apply_softcap(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

// 2^x by the SFU (ex2.approx.ftz: relative error ~2^-22, 2^-inf = 0; results below 2^-126 flush to 0,
// which is below what an fp32 softmax weight can contribute next to the running maximum's 1).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Combining partial softmax results: the weight exp(m - M) of a partial whose (natural-log) running max
// is m, against the combined max M >= m; 0 for an empty partial (m = -inf, also when M = -inf).
__device__ __forceinline__ float partial_weight(float m, float M) {
  return m == -INFINITY ? 0.0f : fast_exp2((m - M) * kLog2e);
}
// a += w x (componentwise), the weighted sum of partial accumulators.
__device__ __forceinline__ void add_weighted(float4& a, float w, const float4& x) {
  a.x += w * x.x;
  a.y += w * x.y;
  a.z += w * x.z;
  a.w += w * x.w;
}

// a / b for a >= 0, b > 0: a 32-bit division when a fits, which is every practical case (the 64-bit
// division is a long subroutine).
__device__ __forceinline__ int64_t div_small(int64_t a, int32_t b) {
  return (uint64_t)a <= 0xffffffffull ? (int64_t)((uint32_t)a / (uint32_t)b) : a / b;
}
// Query vector v (>= 0) of a sequence -> its row v / gq and GQA member v % gq.
__device__ __forceinline__ void split_vector(int64_t v, int gq, int64_t& row, int& member) {
  row = div_small(v, gq);
  member = (int)(v - row * gq);
}

// fp16x2 -> two floats
__device__ __forceinline__ float2 h2_to_f2(uint32_t x) { return make_float2(h_lo(x), h_hi(x)); }

}  // namespace cuda
}  // namespace fmkv
