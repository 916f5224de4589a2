// Runs the Metal backend's single-source kernel core (src/metal/kernel_core.h over
// src/format/portability.h, __CUDACC__ branch: SIMD group = warp of 32 lanes) as CUDA kernels and
// compares the results with the reference, like tests/metal/test_metal.cpp does with the CPU
// emulator:
//   * per-SIMD-group primitives (tree sum by xor butterfly, FWHT rotation by shuffles, RMS/LSQ
//     scale, codes, plane packing by ballots) bit-exact against src/format/quantize_group.h
//     (tree_sum32, quantize_group) and src/ref (rotate, pack_group), on adversarial inputs;
//   * an attention building block (plane-word code lookup + scale = dequantized section values,
//     dot products with a lane-partial sum and the butterfly, online-softmax update) bit-exact
//     against a host mirror (the exp values are the device's, recorded by the kernel and checked
//     separately against exp in double, rounded to float, within 2 ulp: CUDA's expf is not correctly
//     rounded, its documented bound is 2 ulp);
//   * whole kernels: quantize-append (pages and fp16 regions bit-exact against fmkv_append with
//     FMKV_BACKEND_REF, state poisoned first, several block sizes, multi-call, sink/window, k16),
//     decode attention partial + merge (within the emulator test's relative error bounds of the
//     reference), the same with lse (fmkv_attention_lse: NaN-poisoned lse within 2 x the f32 bound of the
//     reference's, output bits equal to the call without lse, row- or head-major), kernel-side error reporting.
// Prints one line per case and "N passed, M failed"; exit status 1 on any failure, 2 on a CUDA
// error. Fresh inputs every run (the seed is printed; FMKV_METAL_SEED=<n> repeats a run).
// Build (tests/cuda/build_gpu1.sh has the exact command): nvcc -std=c++17 -arch=sm_90 -fmad=false
//   -Xcompiler -ffp-contract=off -Iinclude -Isrc tests/metal/cuda_core_test.cu build-ci/libfmkv.a
//   (a CUDA-enabled libfmkv for the reference backend and the C API).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "metal/kernel_core.h"

#include "core/ops.h"
#include "format/numbers.h"
#include "format/quantize_group.h"
#include "format/rotation.h"
#include "fmkv/fmkv.hpp"
#include "metal/host_plan.h"
#include "test_util.h"
#include "ref/quantize.h"

// Portable binaries (tests/cuda/build_gpu1.sh defines FMKV_GLIBC_COMPAT_ARC4RANDOM): the statically
// linked libstdc++ of GCC 12 on glibc 2.36 calls arc4random (GLIBC_2.36) from std::random_device;
// defining it here keeps the binary loadable on glibc 2.35 (the other symbols need <= 2.35).
#ifdef FMKV_GLIBC_COMPAT_ARC4RANDOM
#include <sys/random.h>
extern "C" __uint32_t arc4random(void) __THROW {
  __uint32_t x = 0;
  if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x) x ^= (__uint32_t)(uintptr_t)&x;
  return x;
}
#endif

#define CK(call)                                                                                      \
  do {                                                                                                \
    cudaError_t e_ = (call);                                                                          \
    if (e_ != cudaSuccess) {                                                                          \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__,        \
              cudaGetErrorString(e_));                                                                \
      exit(2);                                                                                        \
    }                                                                                                 \
  } while (0)
#define CK_LAUNCH()                   \
  do {                                \
    CK(cudaGetLastError());           \
    CK(cudaDeviceSynchronize());      \
  } while (0)

// ================================================================================ kernels
struct CoreTestParams {
  fmkv_i32 head_dim, bits, scale_rule, layer;
  fmkv_u64 seed;
  fmkv_i32 vectors, reserved;
};

// tests/metal/core_test.metal, as CUDA.
__global__ void k_core_test(CoreTestParams p, const float* x, float* sums, float* rotated, fmkv_u32* codes,
                            fmkv_u16* scales, fmkv_u32* words) {
  const fmkv_u32 sg = threadIdx.x / 32, nsg = blockDim.x / 32, lane = threadIdx.x % 32;
  const fmkv_i64 vec = (fmkv_i64)blockIdx.x * nsg + sg;
  if (vec >= p.vectors) return;
  const int d = p.head_dim, G = d / 32;
  float v[FMKV_METAL_GMAX];
  for (int g = 0; g < G; ++g) v[g] = x[vec * d + g * 32 + lane];
  for (int g = 0; g < G; ++g) {
    sums[(vec * G + g) * 32 + lane] = fmkv_simd_tree_sum(v[g]);
    fmkv_u16 scale;
    fmkv_u32 code = fmkv_quantize_group_lane(v[g], p.bits, p.scale_rule, &scale);
    codes[vec * d + g * 32 + lane] = code;
    fmkv_u32 w[4];
    fmkv_pack_group_lanes(code, p.bits, w);
    for (int b = 0; b < p.bits; ++b)
      if ((int)lane == b) words[(vec * G + g) * 4 + b] = w[b];
    if (lane == 0u) scales[vec * G + g] = scale;
  }
  fmkv_u64 sw[4];
  fmkv::rotation_sign_words(p.seed, p.layer, d, sw);
  fmkv_rotate_lanes(v, G, sw, fmkv_rotation_norm(d), lane);
  for (int g = 0; g < G; ++g) rotated[vec * d + g * 32 + lane] = v[g];
}

// Attention building block: one SIMD group per query over ntok tokens of one K section and one V
// section (format pages written by the reference). Outputs per query: dequantized K of every token
// (query 0 only), scores, the exp values of each softmax step, and the final (m, l, acc).
struct BlockParams {
  fmkv_i32 d, k_bits, v_bits, P, ntok, nq;
  float scale;
};
__global__ void k_attn_block(BlockParams p, const fmkv_u8* ksec, const fmkv_u8* vsec, const float* q, float* kdeq,
                             float* scores, float* exps, float* ml, float* accout) {
  const fmkv_u32 sg = threadIdx.x / 32, nsg = blockDim.x / 32, lane = threadIdx.x % 32;
  const int qi = (int)(blockIdx.x * nsg + sg);
  if (qi >= p.nq) return;
  const int d = p.d, G = d / 32;
  float qq[FMKV_METAL_GMAX], m = FMKV_NEG_BIG, l = 0.0f, acc[FMKV_METAL_GMAX];
  for (int g = 0; g < G; ++g) {
    qq[g] = q[(fmkv_i64)qi * d + g * 32 + lane];
    acc[g] = 0.0f;
  }
  for (int t = 0; t < p.ntok; ++t) {
    float kv[FMKV_METAL_GMAX], vv[FMKV_METAL_GMAX];
    fmkv_load_section_lanes(ksec, p.k_bits, d, p.P, t, lane, kv);
    if (qi == 0)
      for (int g = 0; g < G; ++g) kdeq[(fmkv_i64)t * d + g * 32 + lane] = kv[g];
    float part = 0.0f;
    for (int g = 0; g < G; ++g) part = part + qq[g] * kv[g];
    const float sc = fmkv_simd_tree_sum(part) * p.scale;
    fmkv_load_section_lanes(vsec, p.v_bits, d, p.P, t, lane, vv);
    if (lane == 0u) {  // the same expressions fmkv_softmax_update evaluates (deterministic)
      const float mn = fmkv_max_f32(m, sc);
      scores[(fmkv_i64)qi * p.ntok + t] = sc;
      exps[((fmkv_i64)qi * p.ntok + t) * 2] = FMKV_EXP(m - mn);
      exps[((fmkv_i64)qi * p.ntok + t) * 2 + 1] = FMKV_EXP(sc - mn);
    }
    fmkv_softmax_update(&m, &l, acc, vv, G, sc);
  }
  if (lane == 0u) {
    ml[qi * 2] = m;
    ml[qi * 2 + 1] = l;
  }
  for (int g = 0; g < G; ++g) accout[(fmkv_i64)qi * d + g * 32 + lane] = acc[g];
}

// The four whole-kernel bodies (as tests/metal/cuda_check.cu, parameter blocks by value).
__global__ void k_append_compress(fmkv_metal_append_params p, fmkv_u8* pages, const fmkv_u16* fp16_k,
                                  const fmkv_u16* fp16_v, const fmkv_u8* k, const fmkv_u8* v, const fmkv_i64* seq_lens,
                                  const fmkv_i64* row_offsets, const fmkv_i32* block_table, const fmkv_i32* slots,
                                  fmkv_u32* status) {
  fmkv_append_compress_impl(p, pages, fp16_k, fp16_v, k, v, seq_lens, row_offsets, block_table, slots, status,
                            blockIdx.x, threadIdx.x / 32, blockDim.x / 32, threadIdx.x % 32, blockDim.x);
}
__global__ void k_append_fp16(fmkv_metal_append_params p, fmkv_u16* fp16_k, fmkv_u16* fp16_v, const fmkv_u8* k,
                              const fmkv_u8* v, const fmkv_i64* seq_lens, const fmkv_i64* row_offsets,
                              const fmkv_i32* slots) {
  fmkv_append_fp16_impl(p, fp16_k, fp16_v, k, v, seq_lens, row_offsets, slots, blockIdx.x * blockDim.x + threadIdx.x);
}
__global__ void k_attention_partial(fmkv_metal_attention_params p, const fmkv_u8* pages, const fmkv_u16* fp16_k,
                                    const fmkv_u16* fp16_v, const fmkv_u8* q, const fmkv_i64* seq_lens,
                                    const fmkv_i64* row_offsets, const fmkv_i32* block_table, const fmkv_i32* slots,
                                    float* ws, fmkv_u32* status) {
  FMKV_THREADGROUP_ARRAY(float, q_rot, FMKV_METAL_QTILE * 256);
  FMKV_THREADGROUP_ARRAY(float, q_raw, FMKV_METAL_QTILE * 256);
  fmkv_attention_partial_impl(p, pages, fp16_k, fp16_v, q, seq_lens, row_offsets, block_table, slots, ws, status,
                              q_rot, q_raw, blockIdx.x, threadIdx.x / 32, blockDim.x / 32, threadIdx.x % 32,
                              blockDim.x);
}
__global__ void k_attention_merge(fmkv_metal_attention_params p, const fmkv_i64* row_offsets, const float* ws,
                                  fmkv_u8* out, float* lse, fmkv_u32* status) {
  fmkv_attention_merge_impl(p, row_offsets, ws, out, lse, status, blockIdx.x, threadIdx.x / 32, blockDim.x / 32,
                            threadIdx.x % 32, blockDim.x);
}

// ================================================================================ host side
namespace {

// Device copy of a host vector; download() brings it back.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) { CK(cudaMalloc((void**)&p, std::max<size_t>(1, n) * sizeof(T))); }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) { upload(v); }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void upload(const std::vector<T>& v) {
    if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  void fill(uint8_t byte) { CK(cudaMemset(p, byte, std::max<size_t>(1, n) * sizeof(T))); }
  std::vector<T> download() const {
    std::vector<T> v(n);
    if (n) CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

using namespace mtest;

// Runs both append passes of the kernel core on the device over met's state (uploaded, run,
// downloaded back into met). Returns the status words.
void cuda_append(Layer& met, const fmkv_metal_append_params& p, const std::vector<int64_t>& lens,
                 const std::vector<int64_t>& offs, const std::vector<uint8_t>& kbytes,
                 const std::vector<uint8_t>& vbytes, uint32_t threads, uint32_t fp16_threads, uint32_t status[2],
                 bool run_fp16 = true) {
  Dev<uint8_t> pages(met.pages), k(kbytes), v(vbytes);
  Dev<uint16_t> fk(met.fk), fv(met.fv);
  Dev<int64_t> dl(lens), doff(offs);
  Dev<int32_t> table(met.table), slots(met.slots);
  Dev<uint32_t> st(2);
  st.fill(0);
  const fmkv::metal::AppendLaunch launch = fmkv::metal::append_launch(p, threads);
  if (launch.compress_groups > 0) {
    k_append_compress<<<launch.compress_groups, threads>>>(p, pages.p, fk.p, fv.p, k.p, v.p, (const fmkv_i64*)dl.p, (const fmkv_i64*)doff.p, table.p,
                                                          slots.p, st.p);
    CK_LAUNCH();
  }
  if (run_fp16 && launch.fp16_threads > 0) {
    k_append_fp16<<<(launch.fp16_threads + fp16_threads - 1) / fp16_threads, fp16_threads>>>(p, fk.p, fv.p, k.p, v.p,
                                                                                             (const fmkv_i64*)dl.p, (const fmkv_i64*)doff.p, slots.p);
    CK_LAUNCH();
  }
  met.pages = pages.download();
  met.fk = fk.download();
  met.fv = fv.download();
  auto s = st.download();
  status[0] = s[0];
  status[1] = s[1];
}

void append_both(Layer& ref, Layer& met, const std::vector<int64_t>& lens, const std::vector<int64_t>& rows,
                 fmkv_dtype dt, uint32_t threads, uint32_t fp16_threads, uint32_t status[2]) {
  const fmkv_config& c = ref.cfg;
  const auto offs = offsets_of(rows);
  const int64_t total = offs.back();
  auto kbytes = random_tensor(dt, total, c.num_kv_heads, c.head_dim);
  auto vbytes = random_tensor(dt, total, c.num_kv_heads, c.head_dim);
  fmkv_tensor k = fmkv::make_tensor(kbytes.data(), dt, total, c.num_kv_heads, c.head_dim);
  fmkv_tensor v = fmkv::make_tensor(vbytes.data(), dt, total, c.num_kv_heads, c.head_dim);
  fmkv_batch bt{ref.seqs(), ref.slots.data(), lens.data(), offs.data(), ref.table.data(), ref.stride};
  fmkv_layer_cache rl = ref.cache();
  fmkv::check(fmkv_append(FMKV_BACKEND_REF, &c, &rl, &bt, &k, &v, nullptr));

  fmkv_batch mb{met.seqs(), met.slots.data(), lens.data(), offs.data(), met.table.data(), met.stride};
  fmkv::AppendArgs a{c, met.cache(), mb, k, v, nullptr};
  const fmkv_metal_append_params p = fmkv::metal::append_params(a);
  cuda_append(met, p, lens, offs, kbytes, vbytes, threads, fp16_threads, status);
}


struct AppendCase {
  fmkv_config cfg;
  std::vector<int64_t> lens;
  std::vector<std::vector<int64_t>> steps;
  fmkv_dtype dt;
  uint32_t threads, fp16_threads;
};

void run_append_case(const AppendCase& ac) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> final_lens = ac.lens;
  for (auto& st : ac.steps)
    for (size_t i = 0; i < st.size(); ++i) final_lens[i] += st[i];
  Layer ref = make_layer(ac.cfg, final_lens), met = ref;
  std::vector<int64_t> lens = ac.lens;
  std::string err;
  for (auto& st : ac.steps) {
    uint32_t status[2] = {0, 0};
    append_both(ref, met, lens, st, ac.dt, ac.threads, ac.fp16_threads, status);
    if (status[0] || status[1]) err = "kernel status " + std::to_string(status[0]) + "/" + std::to_string(status[1]);
    for (size_t i = 0; i < st.size(); ++i) lens[i] += st[i];
  }
  if (err.empty()) err = first_diff(met.pages, ref.pages, "page bytes", "cuda");
  if (err.empty()) err = first_diff(met.fk, ref.fk, "fp16_k region", "cuda");
  if (err.empty()) err = first_diff(met.fv, ref.fv, "fp16_v region", "cuda");
  char name[256];
  snprintf(name, sizeof name, "append %s %s calls=%zu block=%u fp16_block=%u", config_name(ac.cfg).c_str(),
           dt_name(ac.dt), ac.steps.size(), ac.threads, ac.fp16_threads);
  report(err.empty(), name, err.empty() ? "pages + fp16 regions bit-exact" : err, since(t0));
}


struct AttentionCase {
  fmkv_config cfg;
  int group;
  std::vector<int64_t> lens, rows;
  fmkv_dtype q_dt, out_dt;
  float scale, softcap;
  int simdgroups, splits, merge_simdgroups;
};

// Decode attention with the kernel core's CUDA kernels (the query rows' lens included; q_heads query heads); out
// and the workspace are poisoned with NaN first. lse (fmkv_attention_lse): empty, or f32 [rows][q_heads] at element
// strides (lse_rs, lse_hs), downloaded into lse after the merge (poisoned with NaN before it).
void attention_cuda(const Layer& L, const std::vector<int64_t>& lens, const std::vector<int64_t>& offs,
                    const std::vector<uint8_t>& qbytes, fmkv_dtype q_dt, int32_t q_heads, fmkv_dtype out_dt,
                    const fmkv_attention_opts& opts, int simdgroups, int splits, int merge_simdgroups,
                    std::vector<uint8_t>& out, std::vector<uint32_t>& status, std::vector<float>* lse = nullptr,
                    int64_t lse_rs = 0, int64_t lse_hs = 0) {
  const fmkv_config& c = L.cfg;
  const int64_t nrows = offs.back();
  const int d = c.head_dim;
  out.assign((size_t)nrows * q_heads * d * (out_dt == FMKV_F32 ? 4 : 2), 0xFF);  // NaN
  std::vector<uint8_t> qcopy = qbytes;
  fmkv_tensor q = fmkv::make_tensor(qcopy.data(), q_dt, nrows, q_heads, d);
  fmkv_tensor o = fmkv::make_tensor(out.data(), out_dt, nrows, q_heads, d);
  Layer Lc = L;
  fmkv_batch bt{Lc.seqs(), Lc.slots.data(), lens.data(), offs.data(), Lc.table.data(), Lc.stride};
  if (lse) lse->assign((size_t)nrows * q_heads, NAN);
  const fmkv_tensor lt{lse ? lse->data() : nullptr, FMKV_F32, nrows, q_heads, 1, lse_rs, lse_hs};
  fmkv::AttentionArgs a{c, Lc.cache(), bt, q, o, opts, nullptr, 0, nullptr, lt};
  const fmkv_metal_attention_params p = fmkv::metal::attention_params(a, simdgroups, splits);
  Dev<uint8_t> pages(L.pages), dq(qbytes), dout(out);
  Dev<uint16_t> fk(L.fk), fv(L.fv);
  Dev<int64_t> dl(lens), doff(offs);
  Dev<int32_t> table(L.table), slots(L.slots);
  Dev<float> ws((size_t)fmkv::metal::attention_workspace_floats(p));
  ws.fill(0xFF);  // NaN poison
  std::vector<float> lse_init(lse ? lse->size() : 1, NAN);
  Dev<float> dlse(lse_init);
  Dev<uint32_t> st(2);
  st.fill(0);
  k_attention_partial<<<fmkv::metal::attention_partial_groups(p), simdgroups * 32>>>(
      p, pages.p, fk.p, fv.p, dq.p, (const fmkv_i64*)dl.p, (const fmkv_i64*)doff.p, table.p, slots.p, ws.p, st.p);
  CK_LAUNCH();
  k_attention_merge<<<fmkv::metal::attention_merge_groups(p, merge_simdgroups), merge_simdgroups * 32>>>(
      p, (const fmkv_i64*)doff.p, ws.p, dout.p, lse ? dlse.p : nullptr, st.p);
  CK_LAUNCH();
  out = dout.download();
  status = st.download();
  if (lse) *lse = dlse.download();
}

void run_attention_case(const AttentionCase& ac) {
  auto t0 = std::chrono::steady_clock::now();
  const fmkv_config& c = ac.cfg;
  const int d = c.head_dim, HQ = c.num_kv_heads * ac.group;
  Layer L = make_layer(c, ac.lens);
  {
    std::vector<int64_t> zeros(ac.lens.size(), 0);
    auto offs = offsets_of(ac.lens);
    auto kb = random_tensor(FMKV_F16, offs.back(), c.num_kv_heads, d);
    auto vb = random_tensor(FMKV_F16, offs.back(), c.num_kv_heads, d);
    fmkv_tensor k = fmkv::make_tensor(kb.data(), FMKV_F16, offs.back(), c.num_kv_heads, d);
    fmkv_tensor v = fmkv::make_tensor(vb.data(), FMKV_F16, offs.back(), c.num_kv_heads, d);
    fmkv_batch bt{L.seqs(), L.slots.data(), zeros.data(), offs.data(), L.table.data(), L.stride};
    fmkv_layer_cache lc = L.cache();
    fmkv::check(fmkv_append(FMKV_BACKEND_REF, &c, &lc, &bt, &k, &v, nullptr));
  }
  const auto offs = offsets_of(ac.rows);
  const int64_t nrows = offs.back();
  auto qbytes = random_tensor(ac.q_dt, nrows, HQ, d);
  fmkv_tensor q = fmkv::make_tensor(qbytes.data(), ac.q_dt, nrows, HQ, d);
  const size_t out_es = ac.out_dt == FMKV_F32 ? 4 : 2, nout = (size_t)nrows * HQ * d;
  std::vector<uint8_t> out_ref(nout * out_es, 0xFF), out_met;
  fmkv_tensor oref = fmkv::make_tensor(out_ref.data(), ac.out_dt, nrows, HQ, d);
  fmkv_batch bt{L.seqs(), L.slots.data(), ac.lens.data(), offs.data(), L.table.data(), L.stride};
  fmkv_layer_cache lc = L.cache();
  fmkv_attention_opts opts{ac.scale, ac.softcap, 0};
  fmkv::check(fmkv_attention(FMKV_BACKEND_REF, &c, &lc, &bt, &q, &opts, &oref, nullptr, 0, nullptr));

  std::vector<uint32_t> status;
  attention_cuda(L, ac.lens, offs, qbytes, ac.q_dt, HQ, ac.out_dt, opts, ac.simdgroups, ac.splits,
                 ac.merge_simdgroups, out_met, status);
  const double tol = ac.out_dt == FMKV_F32 ? 1e-5 : ac.out_dt == FMKV_F16 ? 2e-3 : 1.2e-2;
  const double err = rel_error(as_floats(out_met, ac.out_dt, nout), as_floats(out_ref, ac.out_dt, nout));
  char buf[160];
  snprintf(buf, sizeof buf, "rel error %.3g (bound %.0e)", err, tol);
  std::string detail = buf;
  if (status[0] || status[1]) detail += ", kernel status " + std::to_string(status[0]) + "/" + std::to_string(status[1]);
  char name[300];
  int64_t maxq = *std::max_element(ac.rows.begin(), ac.rows.end());
  snprintf(name, sizeof name, "attention %s group%d q_len<=%lld %s->%s scale=%g cap=%g sg=%d splits=%d merge_sg=%d",
           config_name(c).c_str(), ac.group, (long long)maxq, dt_name(ac.q_dt), dt_name(ac.out_dt), ac.scale,
           ac.softcap, ac.simdgroups, ac.splits, ac.merge_simdgroups);
  report(err <= tol && !status[0] && !status[1], name, detail, since(t0));

  // fmkv_attention_lse on the same inputs (as tests/metal/test_metal.cpp's emulator cases): lse (NaN-poisoned: an
  // element the merge does not write fails) within 2 x the f32 attention bound of the float64 reference's,
  // |lse - ref| / (1 + |ref|), and the output bits equal to the call without lse; every other case head-major.
  t0 = std::chrono::steady_clock::now();
  static int lse_cases = 0;
  const bool head_major = lse_cases++ % 2 == 1;
  std::vector<float> lse_ref((size_t)nrows * HQ, NAN), lse_met;
  std::vector<uint8_t> out_ref2(nout * out_es, 0xFF), out_lse;
  fmkv_tensor oref2 = fmkv::make_tensor(out_ref2.data(), ac.out_dt, nrows, HQ, d);
  fmkv_tensor lref = fmkv::make_tensor(lse_ref.data(), FMKV_F32, nrows, HQ, 1);
  fmkv::check(fmkv_attention_lse(FMKV_BACKEND_REF, &c, &lc, &bt, &q, &opts, &oref2, &lref, nullptr, 0, nullptr));
  const int64_t lrs = head_major ? 1 : HQ, lhs = head_major ? nrows : 1;
  std::vector<uint32_t> lstatus;
  attention_cuda(L, ac.lens, offs, qbytes, ac.q_dt, HQ, ac.out_dt, opts, ac.simdgroups, ac.splits,
                 ac.merge_simdgroups, out_lse, lstatus, &lse_met, lrs, lhs);
  const auto verdict =
      lse_case_verdict(lse_met, lse_ref, nrows, HQ, lrs, lhs, 2.0 * 1e-5, out_lse == out_met, lstatus[0], lstatus[1]);
  report(verdict.first, std::string("lse ") + name + (head_major ? " lse head-major" : ""), verdict.second, since(t0));
}

// Per-SIMD-group primitives, bit for bit, on adversarial inputs (as test_metal.cpp run_core_case).
void run_core_case(int d, int bits, int rule, uint32_t threads) {
  auto t0 = std::chrono::steady_clock::now();
  const int G = d / 32, nvec = 96;
  std::vector<float> x((size_t)nvec * d);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-40, 40);
  for (int vi = 0; vi < nvec; ++vi)
    for (int g = 0; g < G; ++g) {
      float* y = &x[((size_t)vi * G + g) * 32];
      const int kind = (vi + g) % 6;
      for (int j = 0; j < 32; ++j) {
        if (kind == 0) y[j] = nd(g_rng) * std::pow(10.0f, (float)(g_rng() % 7) - 3.0f);
        else if (kind == 1) y[j] = (g_rng() & 1 ? -1.0f : 1.0f) * std::ldexp(1.0f + (float)(g_rng() % 1024) / 1024.0f, ex(g_rng));
        else if (kind == 2 || kind == 5) y[j] = nd(g_rng);
        else if (kind == 3 && vi % 2) y[j] = j % 3 == 0 ? 0.0f : j % 3 == 1 ? -0.0f : (j == 2 ? 1e-41f : 0.0f);
        else if (kind == 3) y[j] = j % 4 == 1 ? -0.0f : j % 4 == 3 ? 0.0f : nd(g_rng);
        else y[j] = (j % 2 ? -1.0f : 1.0f) * (vi % 2 ? 1e30f : 3.0e-39f) * (1.0f + (float)j / 32.0f);
      }
      if (kind == 2 || kind == 5) {  // coordinates exactly on decision thresholds of the group's scale
        const int nm = fmkv::magnitude_count(bits);
        int ms[32];
        for (int j = 0; j < 32; ++j) ms[j] = (int)(g_rng() % (uint64_t)(nm - 1));
        for (int it = 0; it < 8; ++it) {
          float t[32];
          for (int j = 0; j < 32; ++j) t[j] = y[j] * y[j];
          const float s0f = fmkv::f16_to_f32(fmkv::scale_to_f16(__builtin_sqrtf(fmkv::tree_sum32(t) / 32.0f)));
          for (int j = 0; j < 32; j += 3) y[j] = (j % 2 ? -1.0f : 1.0f) * fmkv::codebook_threshold(bits, ms[j]) * s0f;
        }
      }
    }
  const size_t nsum = (size_t)nvec * G * 32;
  CoreTestParams p{d, bits, rule, (int32_t)(g_rng() % 40), g_rng(), nvec, 0};
  Dev<float> dx(x), dsums(nsum), drot((size_t)nvec * d);
  Dev<uint32_t> dcodes((size_t)nvec * d), dwords((size_t)nvec * G * 4);
  Dev<uint16_t> dscales((size_t)nvec * G);
  dsums.fill(0xFF);
  drot.fill(0xFF);
  dcodes.fill(0xEF);
  dwords.fill(0xEF);
  dscales.fill(0xFF);
  const uint32_t nsg = threads / 32;
  k_core_test<<<(nvec + nsg - 1) / nsg, threads>>>(p, dx.p, dsums.p, drot.p, dcodes.p, dscales.p, dwords.p);
  CK_LAUNCH();
  const auto sums = dsums.download(), rot = drot.download();
  const auto codes = dcodes.download(), words = dwords.download();
  const auto scales = dscales.download();
  std::string err;
  const std::vector<uint64_t> sw = fmkv::ref::sign_words(p.seed, p.layer, d);
  int ties = 0;
  for (int vi = 0; vi < nvec && err.empty(); ++vi) {
    std::vector<float> ry(d);
    fmkv::rotate(&x[(size_t)vi * d], d, sw.data(), ry.data());
    for (int i = 0; i < d && err.empty(); ++i)
      if (fmkv::f32_bits(ry[i]) != fmkv::f32_bits(rot[(size_t)vi * d + i]))
        err = "rotation differs at vector " + std::to_string(vi) + " coordinate " + std::to_string(i);
    for (int g = 0; g < G && err.empty(); ++g) {
      const float* y = &x[((size_t)vi * G + g) * 32];
      float t[32];
      std::memcpy(t, y, sizeof t);
      const float want = fmkv::tree_sum32(t);
      for (int lane = 0; lane < 32; ++lane)
        if (fmkv::f32_bits(sums[((size_t)vi * G + g) * 32 + lane]) != fmkv::f32_bits(want))
          err = "group sum differs from tree_sum32 (vector " + std::to_string(vi) + ", group " + std::to_string(g) +
                ", lane " + std::to_string(lane) + ")";
      uint8_t rc[32];
      const uint16_t rs = fmkv::quantize_group(y, bits, rule, rc);
      uint32_t rw[4] = {0, 0, 0, 0};
      fmkv::ref::pack_group(rc, bits, rw, 1);
      if (scales[(size_t)vi * G + g] != rs)
        err = "scale differs (vector " + std::to_string(vi) + ", group " + std::to_string(g) + ")";
      for (int j = 0; j < 32 && err.empty(); ++j)
        if (codes[(size_t)vi * d + g * 32 + j] != rc[j]) err = "code differs (vector " + std::to_string(vi) + ")";
      for (int w = 0; w < bits && err.empty(); ++w)
        if (words[((size_t)vi * G + g) * 4 + w] != rw[w]) err = "plane word " + std::to_string(w) + " differs";
      if ((vi + g) % 6 == 2 || (vi + g) % 6 == 5) {
        float t2[32];
        for (int j = 0; j < 32; ++j) t2[j] = y[j] * y[j];
        const float s0f = fmkv::f16_to_f32(fmkv::scale_to_f16(__builtin_sqrtf(fmkv::tree_sum32(t2) / 32.0f)));
        for (int j = 0; j < 32; ++j)
          for (int m = 0; m + 1 < fmkv::magnitude_count(bits); ++m)
            ties += s0f != 0.0f && std::fabs(y[j] / s0f) == fmkv::codebook_threshold(bits, m);
      }
    }
  }
  char name[200];
  snprintf(name, sizeof name, "core primitives d%d %d-bit %s block=%u (tree sum, FWHT, scale, codes, code words)", d,
           bits, rule ? "lsq" : "rms", threads);
  report(err.empty() && ties > 0, name, err.empty() ? std::to_string(ties) + " threshold ties, bit-exact" : err,
         since(t0));
}

// Also compares the public C API's quantizer (fmkv_quantize_vector, src/ref) with the device path
// rotate + quantize_group_lane on fp16 head vectors.
void run_quantize_vector_case(int d, int bits, int rule) {
  auto t0 = std::chrono::steady_clock::now();
  const int G = d / 32, nvec = 64;
  std::vector<uint16_t> xh((size_t)nvec * d);
  std::normal_distribution<float> nd;
  for (auto& h : xh) h = fmkv::f32_to_f16(nd(g_rng) * (1.0f + (float)(g_rng() % 4)));
  std::vector<float> x(xh.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = fmkv::f16_to_f32(xh[i]);
  CoreTestParams p{d, bits, rule, (int32_t)(g_rng() % 40), g_rng(), nvec, 0};
  // Rotate on the device (k_core_test's `rotated`), then quantize the rotated vectors on the device.
  Dev<float> dx(x), dsums((size_t)nvec * G * 32), drot((size_t)nvec * d);
  Dev<uint32_t> dcodes((size_t)nvec * d), dwords((size_t)nvec * G * 4);
  Dev<uint16_t> dscales((size_t)nvec * G);
  k_core_test<<<nvec, 32>>>(p, dx.p, dsums.p, drot.p, dcodes.p, dscales.p, dwords.p);
  CK_LAUNCH();
  Dev<float> dy(drot.download());
  k_core_test<<<nvec / 2, 64>>>(p, dy.p, dsums.p, drot.p, dcodes.p, dscales.p, dwords.p);
  CK_LAUNCH();
  const auto codes = dcodes.download();
  const auto scales = dscales.download();
  std::string err;
  for (int vi = 0; vi < nvec && err.empty(); ++vi) {
    std::vector<uint8_t> rc(d);
    std::vector<uint16_t> rs(G);
    fmkv::check(fmkv_quantize_vector(d, bits, rule, p.seed, p.layer, &xh[(size_t)vi * d], rc.data(), rs.data()));
    for (int i = 0; i < d && err.empty(); ++i)
      if (codes[(size_t)vi * d + i] != rc[i]) err = "code differs from fmkv_quantize_vector at vector " + std::to_string(vi);
    for (int g = 0; g < G && err.empty(); ++g)
      if (scales[(size_t)vi * G + g] != rs[g]) err = "scale differs from fmkv_quantize_vector at vector " + std::to_string(vi);
  }
  char name[160];
  snprintf(name, sizeof name, "rotate+quantize vs fmkv_quantize_vector d%d %d-bit %s", d, bits, rule ? "lsq" : "rms");
  report(err.empty(), name, err.empty() ? "bit-exact" : err, since(t0));
}

bool within_ulps(float a, float b, int ulps) {
  if (a == b) return true;
  if (!std::isfinite(a) || !std::isfinite(b) || (a < 0) != (b < 0)) return false;
  int64_t ia = fmkv::f32_bits(a), ib = fmkv::f32_bits(b);
  return std::llabs(ia - ib) <= ulps;
}

// Attention building block: code lookup from plane words + scales (section written by the
// reference), dot products (lane partials + butterfly), online softmax, bit-exact against a host
// mirror in the same operation order.
void run_attn_block_case(int d, int kb, int vb, int rule) {
  auto t0 = std::chrono::steady_clock::now();
  const int P = 32, ntok = 29, nq = 6, G = d / 32;
  fmkv_config c = make_config(d, kb, vb, 1, P, 0, 0, rule);
  Layer L = make_layer(c, {ntok});
  {
    std::vector<int64_t> zero{0}, offs{0, ntok};
    auto k = random_tensor(FMKV_F16, ntok, 1, d), v = random_tensor(FMKV_F16, ntok, 1, d);
    fmkv_tensor kt = fmkv::make_tensor(k.data(), FMKV_F16, ntok, 1, d), vt = fmkv::make_tensor(v.data(), FMKV_F16, ntok, 1, d);
    fmkv_batch bt{1, L.slots.data(), zero.data(), offs.data(), L.table.data(), L.stride};
    fmkv_layer_cache lc = L.cache();
    fmkv::check(fmkv_append(FMKV_BACKEND_REF, &c, &lc, &bt, &kt, &vt, nullptr));
  }
  const int64_t pb = fmkv_config_page_bytes(&c);
  const uint8_t* page = &L.pages[(size_t)(L.table[0] * pb)];
  const int64_t koff = fmkv_section_offset(d, kb, vb, P, 0, 0, FMKV_SCALE_GROUP), voff = fmkv_section_offset(d, kb, vb, P, 0, 1, FMKV_SCALE_GROUP);
  std::vector<uint8_t> ksec(page + koff, page + voff), vsec(page + voff, page + pb);
  std::vector<float> q((size_t)nq * d);
  std::normal_distribution<float> nd;
  for (auto& e : q) e = nd(g_rng);
  const float scale = 1.0f / std::sqrt((float)d);
  BlockParams p{d, kb, vb, P, ntok, nq, scale};
  Dev<uint8_t> dk(ksec), dv(vsec);
  Dev<float> dq(q), dkdeq((size_t)ntok * d), dsc((size_t)nq * ntok), dexp((size_t)nq * ntok * 2), dml((size_t)nq * 2),
      dacc((size_t)nq * d);
  k_attn_block<<<(nq + 1) / 2, 64>>>(p, dk.p, dv.p, dq.p, dkdeq.p, dsc.p, dexp.p, dml.p, dacc.p);
  CK_LAUNCH();
  const auto kdeq = dkdeq.download(), sc = dsc.download(), ex = dexp.download(), ml = dml.download(),
             acc = dacc.download();
  // Host mirror: dequantize with ref::unpack_group + src/format/codebook.h decode_level (reference arithmetic).
  auto deq = [&](const std::vector<uint8_t>& sec, int bits, int t, std::vector<float>& out) {
    out.assign(d, 0.0f);
    if (bits == 16) {
      for (int i = 0; i < d; ++i) {
        uint16_t h;
        std::memcpy(&h, &sec[((size_t)t * d + i) * 2], 2);
        out[i] = fmkv::f16_to_f32(h);
      }
      return;
    }
    const uint32_t* words = (const uint32_t*)sec.data();
    const uint16_t* scl = (const uint16_t*)(sec.data() + (size_t)(d / 32) * bits * P * 4);
    for (int g = 0; g < G; ++g) {
      uint8_t codes[32];
      fmkv::ref::unpack_group(words + ((size_t)g * bits) * P + t, P, bits, codes);
      for (int j = 0; j < 32; ++j) out[g * 32 + j] = fmkv::decode_level(codes[j], bits) * fmkv::f16_to_f32(scl[(size_t)g * P + t]);
    }
  };
  std::string err;
  int exp_worst = 0;
  std::vector<std::vector<float>> K(ntok), V(ntok);
  for (int t = 0; t < ntok; ++t) {
    deq(ksec, kb, t, K[t]);
    deq(vsec, vb, t, V[t]);
    for (int i = 0; i < d && err.empty(); ++i)
      if (fmkv::f32_bits(K[t][i]) != fmkv::f32_bits(kdeq[(size_t)t * d + i]))
        err = "dequantized K differs at token " + std::to_string(t) + " coordinate " + std::to_string(i);
  }
  for (int qi = 0; qi < nq && err.empty(); ++qi) {
    float m = FMKV_NEG_BIG, l = 0.0f;
    std::vector<float> a(d, 0.0f);
    for (int t = 0; t < ntok && err.empty(); ++t) {
      float parts[32];
      for (int j = 0; j < 32; ++j) {
        float part = 0.0f;
        for (int g = 0; g < G; ++g) part = part + q[(size_t)qi * d + g * 32 + j] * K[t][g * 32 + j];
        parts[j] = part;
      }
      const float s = fmkv::tree_sum32(parts) * scale;
      if (fmkv::f32_bits(s) != fmkv::f32_bits(sc[(size_t)qi * ntok + t])) {
        err = "score differs (query " + std::to_string(qi) + ", token " + std::to_string(t) + ")";
        break;
      }
      const float mn = m > s ? m : s;
      const float corr = ex[((size_t)qi * ntok + t) * 2], pw = ex[((size_t)qi * ntok + t) * 2 + 1];
      for (int u = 0; u < 64; ++u)
        if (within_ulps(corr, (float)std::exp((double)(m - mn)), u) && within_ulps(pw, (float)std::exp((double)(s - mn)), u)) {
          exp_worst = std::max(exp_worst, u);
          break;
        } else if (u == 63) {
          err = "device expf more than 63 ulp from exp";
        }
      l = l * corr + pw;
      for (int i = 0; i < d; ++i) a[i] = a[i] * corr + pw * V[t][i];
      m = mn;
    }
    if (err.empty() && (fmkv::f32_bits(m) != fmkv::f32_bits(ml[qi * 2]) || fmkv::f32_bits(l) != fmkv::f32_bits(ml[qi * 2 + 1])))
      err = "softmax (m, l) differs for query " + std::to_string(qi);
    for (int i = 0; i < d && err.empty(); ++i)
      if (fmkv::f32_bits(a[i]) != fmkv::f32_bits(acc[(size_t)qi * d + i]))
        err = "softmax accumulator differs for query " + std::to_string(qi) + " coordinate " + std::to_string(i);
  }
  if (err.empty() && exp_worst > 2) err = "device expf " + std::to_string(exp_worst) + " ulp from exp (> 2)";
  char name[200];
  snprintf(name, sizeof name, "attention block %s (code lookup, dot products, online softmax)", config_name(c).c_str());
  report(err.empty(), name, err.empty() ? "bit-exact; device expf within " + std::to_string(exp_worst) + " ulp of exp" : err,
         since(t0));
}

void run_error_cases() {
  auto t0 = std::chrono::steady_clock::now();
  fmkv_config c = make_config(64, 3, 3, 1, 16, 0, 0, FMKV_SCALE_LSQ);
  std::vector<int64_t> lens{0}, rows{20};
  Layer L = make_layer(c, {20});
  L.table[1] = (int32_t)L.num_pages + 7;  // tokens 16..19 point outside the pool
  const std::vector<uint8_t> before = L.pages;
  const auto offs = offsets_of(rows);
  auto kb = random_tensor(FMKV_F16, 20, 1, 64), vb = random_tensor(FMKV_F16, 20, 1, 64);
  fmkv_tensor k = fmkv::make_tensor(kb.data(), FMKV_F16, 20, 1, 64), v = fmkv::make_tensor(vb.data(), FMKV_F16, 20, 1, 64);
  fmkv_batch bt{1, L.slots.data(), lens.data(), offs.data(), L.table.data(), L.stride};
  fmkv::AppendArgs a{c, L.cache(), bt, k, v, nullptr};
  const auto p = fmkv::metal::append_params(a);
  uint32_t status[2] = {0, 0};
  cuda_append(L, p, lens, offs, kb, vb, 64, 64, status, false);
  const int64_t pb = fmkv_config_page_bytes(&c);
  bool outside_untouched = true;
  for (int64_t pg = 0; pg < L.num_pages; ++pg)
    if (pg != L.table[0])
      outside_untouched = outside_untouched && std::equal(before.begin() + pg * pb, before.begin() + (pg + 1) * pb,
                                                          L.pages.begin() + pg * pb);
  report(status[0] == FMKV_METAL_ERR_BLOCK_TABLE && status[1] == 0 && outside_untouched,
         "append: out-of-range block table entry is reported, nothing written for it",
         "status " + std::to_string(status[0]) + "/" + std::to_string(status[1]), since(t0));
  t0 = std::chrono::steady_clock::now();
  uint32_t st2[2] = {0, 0};
  const std::vector<uint8_t> before2 = L.pages;
  cuda_append(L, p, lens, offs, kb, vb, 48, 64, st2, false);
  report(st2[1] == FMKV_METAL_ERR_LAUNCH && L.pages == before2,
         "append: block size 48 (partial warp) is refused by the SIMD-group kernel",
         "status " + std::to_string(st2[0]) + "/" + std::to_string(st2[1]), since(t0));
}

}  // namespace

int main() {
  const char* seed_env = std::getenv("FMKV_METAL_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                                 : (uint64_t)std::chrono::system_clock::now().time_since_epoch().count() % 1000000007ull;
  g_rng.seed(seed);
  printf("metal kernel core as CUDA (warp = SIMD group), FMKV_METAL_SEED=%llu\n", (unsigned long long)seed);
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device 0: %s (sm_%d%d, warp %d)\n", prop.name, prop.major, prop.minor, prop.warpSize);
  auto t0 = std::chrono::steady_clock::now();

  for (int d : {64, 128, 256})
    for (int bits : {2, 3, 4})
      for (int rule : {0, 1}) run_core_case(d, bits, rule, 32u * (uint32_t)(1 + (d / 64 + bits + rule) % 4));
  for (int d : {64, 128, 256})
    for (int bits : {2, 3, 4}) run_quantize_vector_case(d, bits, (d + bits) % 2);
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 16}) run_attn_block_case(d, kb, kb == 16 ? 3 : 2 + (kb + d / 64) % 3, (kb + d) % 2);

  std::vector<AppendCase> ap;
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 16})
      for (int vb : {2, 3, 4}) {
        int page = kb == 3 ? 16 : kb == 4 ? 64 : 32;
        ap.push_back({make_config(d, kb, vb, 2, page, 0, 0, (kb + vb) % 2), {37, 0, 20}, {{3, 17, 2}}, FMKV_F16,
                      (uint32_t)(32 * (1 + (d + kb + vb) % 4)), 64});
      }
  ap.push_back({make_config(128, 3, 3, 2, 16, 4, 16, FMKV_SCALE_LSQ), {30, 9, 0}, {{1, 16, 25}}, FMKV_BF16, 96, 48});
  ap.push_back({make_config(64, 4, 2, 3, 128, 0, 32, FMKV_SCALE_RMS), {50}, {{40}}, FMKV_F32, 32, 7});
  ap.push_back({make_config(128, 2, 2, 1, 256, 2, 0, FMKV_SCALE_LSQ), {70, 1}, {{1, 12}}, FMKV_F16, 128, 33});
  ap.push_back({make_config(256, 16, 4, 2, 16, 3, 5, FMKV_SCALE_LSQ), {10, 0}, {{4, 9}}, FMKV_F32, 64, 1});
  ap.push_back({make_config(128, 3, 4, 2, 16, 2, 8, FMKV_SCALE_RMS), {0, 5}, {{7, 3}, {1, 1}, {12, 0}, {0, 9}}, FMKV_F16,
                64, 64});
  ap.push_back({make_config(64, 2, 4, 2, 32, 3, 6, FMKV_SCALE_LSQ), {5, 9, 0}, {{4, 0, 30}, {0, 2, 0}}, FMKV_F16, 64, 40});
  for (uint32_t tg : {32u, 96u, 256u, 1024u})
    ap.push_back({make_config(256, 4, 3, 1, 16, 1, 4, FMKV_SCALE_LSQ), {3, 20}, {{9, 2}}, FMKV_F32, tg, tg / 2 + 1});
  ap.push_back({make_config(128, 3, 3, 8, 64, 4, 64, FMKV_SCALE_LSQ), {0, 300, 17}, {{700, 1, 250}, {5, 300, 0}},
                FMKV_BF16, 256, 256});  // larger: many warps per block and many blocks
  for (auto& c : ap) run_append_case(c);

  std::vector<AttentionCase> at;
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 16}) {
      int vb = kb == 16 ? 4 : kb == 4 ? 2 : kb + 1;
      int page = kb == 3 ? 16 : 32;
      at.push_back({make_config(d, kb, vb, 2, page, 0, 0, (kb + vb) % 2), 2, {37, 5, 90}, {1, 3, 1}, FMKV_F32, FMKV_F32,
                    0.0f, 0.0f, 1 + (d / 64 + kb) % 3, 1 + kb % 3, 2});
    }
  at.push_back({make_config(128, 3, 3, 2, 16, 4, 16, FMKV_SCALE_LSQ), 4, {120, 9, 30}, {16, 2, 5}, FMKV_BF16, FMKV_F32,
                0.0f, 0.0f, 4, 2, 1});
  at.push_back({make_config(64, 4, 2, 3, 128, 0, 32, FMKV_SCALE_RMS), 3, {150}, {7}, FMKV_F32, FMKV_F16, 0.2f, 0.0f, 2,
                3, 4});
  at.push_back({make_config(128, 2, 2, 1, 256, 2, 0, FMKV_SCALE_LSQ), 8, {100, 13}, {1, 12}, FMKV_F16, FMKV_F32, 0.0f,
                30.0f, 3, 1, 2});
  at.push_back({make_config(256, 16, 4, 2, 16, 3, 5, FMKV_SCALE_LSQ), 1, {40, 6}, {2, 6}, FMKV_F32, FMKV_BF16, 0.0f,
                5.0f, 1, 4, 1});
  at.push_back({make_config(64, 3, 4, 1, 16, 1, 1, FMKV_SCALE_LSQ), 1, {1, 2, 17}, {1, 2, 16}, FMKV_F32, FMKV_F32, 0.0f,
                0.0f, 2, 5, 1});
  at.push_back({make_config(128, 4, 3, 2, 16, 2, 4, FMKV_SCALE_RMS), 2, {30, 7, 12}, {2, 0, 3}, FMKV_F16, FMKV_F32, 0.0f,
                0.0f, 2, 2, 2});
  at.push_back({make_config(128, 3, 3, 8, 64, 4, 64, FMKV_SCALE_LSQ), 4, {2000, 700, 65}, {1, 4, 1}, FMKV_BF16,
                FMKV_F32, 0.0f, 0.0f, 4, 8, 4});  // longer sequences, 8 key splits
  for (auto& c : at) run_attention_case(c);

  run_error_cases();

  printf("total %.2f s\n", since(t0));
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
