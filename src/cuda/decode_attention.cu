// CUDA decode attention: host side (split choice, workspace layout, dispatch) and the merge kernel.
// See decode_attention.cuh for the main kernel, which also checks the device-side batch arrays and
// Q (errors go to the device error word; the merge kernel then writes nothing). Two launches per
// call, no host synchronisation, no allocation: safe to capture in a CUDA graph (the workspace comes
// from the caller).
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "decode_attention.cuh"

namespace fmkv {
namespace cuda {
static_assert(kFusedMaxRows == FMKV_FUSED_MAX_ROWS, "split_count.h and fmkv.h agree");
namespace {

// One CTA per (query row, q head): combine the partials -- the compressed splits' and the raw-domain
// (sink/window, fused step) ones, all in the raw domain (the split CTAs un-rotate theirs) --
// normalise, store. NT threads: 256 for up to 64 splits (every call with >= 8 (sequence, kv head)
// pairs); 1024 (512 at D = 256: registers) for more (few kv heads, preferred_splits), where most
// splits are empty at short contexts.
// Thread -> data: every warp forms the weights itself from all (m, l) (lane c: partials c + 32 k;
// shuffles, no barrier; the wide variants stage the (m, l) through shared memory, one load each);
// thread t takes the float4 of coordinates 4 (t % (D/4)) .. +3 of the partials i = t / (D/4) + k *
// (NT / (D/4)) (i / 32 is warp-uniform, so a weight is one shuffle). The first KE x SL >= kFirst
// partials (all of them without the wide variant) are requested with every other load of the kernel
// (error word included) before the first is used -- one L2 round trip -- then the weighted slices are
// summed in shared memory (one barrier; the wide variant by 8-row groups first, a second one) and thread
// c < D stores coordinate c (thread 0 also the row's log-denominator M + log L when the call asks for it).
// Partials from KE x SL on (wide): requested once the weights are known, only where the weight is non-zero
// and up to the last such partial, so a short sequence (its splits >= 64 empty) costs no second round trip.
constexpr int kMergeThreads = 256;  // up to 64 splits
constexpr int merge_threads_wide(int d) { return d > 128 ? 512 : 1024; }
template <int D, int NT>
__global__ void __launch_bounds__(NT) merge_kernel(AttnParams p) {
  constexpr int LPS = D / 4, SL = NT / LPS;
  constexpr bool kWide = NT > kMergeThreads;
  static_assert(kMaxSplits + kRawParts <= kMergeThreads, "one thread per partial");
  constexpr int kFirst = 64 + kRawParts;          // every partial of a call with <= 64 splits
  constexpr int KE = (kFirst + SL - 1) / SL;      // slices per thread of the first partials
  constexpr int kRest = kMaxSplits + kRawParts - KE * SL;
  constexpr int KW = kWide ? ((kRest + SL - 1) / SL < 17 ? (kRest + SL - 1) / SL : 17) : 1;  // per later round
  constexpr int G = kWide ? SL / 8 : 1;           // wide: slice sums reduced by 8-row groups first
  constexpr int NPL = kWide ? (kMaxSplits + kRawParts + 31) / 32 : (kFirst + 31) / 32;  // (m, l) per lane
  static_assert(SL % 2 == 0 && (LPS % 32 == 0 || LPS == 16), "a warp's slices share i / 32");
  static_assert(D <= NT, "one thread per output coordinate");
  __shared__ __align__(16) float s_red[SL][D];
  __shared__ __align__(16) float s_red8[G][D];
  __shared__ float2 s_ml[kWide ? kMaxSplits + kRawParts : 1];
  // Launched as a programmatic dependent of attn_kernel (sm_90): wait until its partials are written.
  FMKV_TRACE(p, 1, 0);
  grid_dependency_wait();
  const int64_t row = blockIdx.x;
  const int hq = blockIdx.y, t = threadIdx.x, lane = t & 31;
  // partials i < nparts of this row's vector: slots kRawParts - nraw + i (attn_params.cuh). A balanced call's
  // count comes with the loads (part_n); until then every slot that may hold one is requested (nmax), and
  // the accumulators of the grid's count (nspec: the uniform plan's; more only for a long sequence, requested
  // in a second round once the weights are known).
  const int nspec = p.nsplit + p.nraw, nmax = p.pstride - kRawParts + p.nraw;
  const int nparts_req = p.balanced ? load_now(p.part_n + row) : nspec;
  const int64_t base = (row * p.HQ + hq) * p.pstride + (kRawParts - p.nraw);
  const int sl = t / LPS, j = t % LPS;  // slice sl of the partials, coordinates 4 j .. 4 j + 3
  // All loads first. A partial's acc is used only when its weight is non-zero (an empty split
  // writes only (m, l) = (-inf, 0), so its acc slot holds stale bytes, loaded but never used).
  const bool upstream_error = error_set(p.err);
  float2 ml[NPL];
  if constexpr (kWide) {
    ml[0] = t < nmax ? load_now(p.part_ml + base + t) : make_float2(-INFINITY, 0.0f);
  } else {
#pragma unroll
    for (int k = 0; k < NPL; ++k)
      ml[k] = lane + 32 * k < nmax ? load_now(p.part_ml + base + lane + 32 * k) : make_float2(-INFINITY, 0.0f);
  }
  float4 xs[KE > KW ? KE : KW];
  const float4* pa = reinterpret_cast<const float4*>(p.part_acc + base * D) + j;
#pragma unroll
  for (int k = 0; k < KE; ++k)
    xs[k] = sl + k * SL < nspec ? load_now(pa + (int64_t)(sl + k * SL) * LPS) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (upstream_error) return;
  const int nparts = nparts_req < nmax ? nparts_req : nmax;
  if constexpr (!kWide) {
#pragma unroll
    for (int k = 0; k < NPL; ++k)
      if (lane + 32 * k >= nparts) ml[k] = make_float2(-INFINITY, 0.0f);
  } else if (t >= nparts) {
    ml[0] = make_float2(-INFINITY, 0.0f);
  }
  if constexpr (kWide) {
    if (t < kMaxSplits + kRawParts) s_ml[t] = ml[0];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NPL; ++k) ml[k] = s_ml[lane + 32 * k];
  }
  FMKV_TRACE(p, 1, 1);
  // weights f_i = exp(m_i - M) (partial i: lane i % 32, register i / 32 of every warp) and
  // L = sum l_i f_i, formed by every warp alike
  float M = -INFINITY;
#pragma unroll
  for (int k = 0; k < NPL; ++k) M = fmaxf(M, ml[k].x);
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  float f[NPL], L = 0.0f;
#pragma unroll
  for (int k = 0; k < NPL; ++k) {
    f[k] = partial_weight(ml[k].x, M);
    L += ml[k].y * f[k];
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  auto weight = [&](int i) -> float {  // f_i (0 past the partials)
    if constexpr (kWide) {  // from the staged (m, l): a register chosen by a runtime index would be local memory
      return partial_weight(i < nparts ? s_ml[i].x : -INFINITY, M);
    } else {  // by a shuffle from the lane that holds it (i / 32 is warp-uniform)
      float x = f[0];
#pragma unroll
      for (int k = 1; k < NPL; ++k)
        if ((i >> 5) == k) x = f[k];
      x = __shfl_sync(0xffffffffu, x, i & 31);
      return i < nparts ? x : 0.0f;
    }
  };
  FMKV_TRACE(p, 1, 2);
  // a balanced call's long sequence: the accumulators of its partials [nspec, nparts) among the first KE SL
  if (nparts > nspec) {
#pragma unroll
    for (int k = 0; k < KE; ++k) {
      const int i = sl + k * SL;
      if (i >= nspec && i < nparts) xs[k] = load_now(pa + (int64_t)i * LPS);
    }
  }
  // slice sl of the partials, coordinates 4 j .. 4 j + 3
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int k = 0; k < KE; ++k) {
    const float w = weight(sl + k * SL);
    if (w != 0.0f) add_weighted(acc, w, xs[k]);  // (w == 0 when M = -inf too)
  }
  if constexpr (kWide) {  // partials KE SL .. the last with a non-zero weight, in rounds of KW SL
    int last = -1;
#pragma unroll
    for (int k = 0; k < NPL; ++k) {
      const unsigned b = __ballot_sync(0xffffffffu, f[k] != 0.0f && 32 * k + lane < nparts);
      if (b) last = 32 * k + 31 - __clz((int)b);
    }
    for (int i0 = KE * SL; i0 <= last; i0 += KW * SL) {
      float wk[KW];
#pragma unroll
      for (int k = 0; k < KW; ++k) {
        const int i = i0 + sl + k * SL;
        wk[k] = i <= last ? weight(i) : 0.0f;
        xs[k] = wk[k] != 0.0f ? load_now(pa + (int64_t)i * LPS) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int k = 0; k < KW; ++k) add_weighted(acc, wk[k], xs[k]);  // (xs[k] = 0 where the weight is 0)
    }
  }
  *reinterpret_cast<float4*>(&s_red[sl][4 * j]) = acc;
  __syncthreads();
  if constexpr (kWide) {  // SL rows -> G rows of 8
    if (t < G * D) {
      const int g = t / D, c = t % D;
      float a = 0.0f;
#pragma unroll
      for (int k = 0; k < 8; ++k) a += s_red[8 * g + k][c];
      s_red8[g][c] = a;
    }
    __syncthreads();
  }
  FMKV_TRACE(p, 1, 3);
  if (p.lse != nullptr && t == 0) p.lse[row * p.l_rs + hq * p.l_hs] = M + logf(L);  // -inf: no visible token
  if (t >= D) return;
  float o = 0.0f;
  if constexpr (kWide) {
#pragma unroll
    for (int k = 0; k < G; ++k) o += s_red8[k][t];
  } else {
#pragma unroll
    for (int k = 0; k < SL; ++k) o += s_red[k][t];
  }
  o *= 1.0f / L;
  const int64_t off = row * p.o_rs + hq * p.o_hs + t;
  if (p.o_dtype == FMKV_F32) ((float*)p.out)[off] = o;
  else if (p.o_dtype == FMKV_F16) ((uint16_t*)p.out)[off] = f32_to_f16(o);
  else ((uint16_t*)p.out)[off] = f32_to_bf16(o);
  FMKV_TRACE(p, 1, 7, kTraceMerge);
}

// The split count (split_count.h), or FMKV_CUDA_SPLITS=n (1..254) for measurements. max_len: the
// call's length bound (opts.max_seq_len, 0: unknown) -> the most compressed tokens of a sequence.
int32_t split_count(const fmkv_config& c, int32_t num_seqs, int32_t q_heads, int64_t rows, int32_t nraw,
                    const SplitDevice& dev, int64_t max_len, int vectors_per_pass) {
  static const int forced = [] {
    const char* e = std::getenv("FMKV_CUDA_SPLITS");
    const int n = e ? std::atoi(e) : 0;
    return n >= 1 && n <= kMaxSplits ? n : 0;
  }();
  if (forced) return forced;
  const int64_t compressed = max_len > 0 ? compressed_end(c, max_len) - c.sink_tokens : -1;
  return preferred_splits(num_seqs, c.num_kv_heads, q_heads, rows, nraw, dev, compressed, vectors_per_pass);
}

int64_t align256(int64_t x) { return (x + 255) & ~(int64_t)255; }
// Partials of `rows` query rows of q_heads heads with up to `cap` compressed splits a sequence (+ the
// raw-domain slots).
int64_t partial_count(int64_t rows, int32_t q_heads, int32_t cap) { return rows * q_heads * (int64_t)(cap + kRawParts); }
// Bytes of the workspace: the partials' (m, l), 256-aligned, then their accumulators; for a balanced call,
// 256-aligned after them, the partial count of each query row (part_n).
int64_t workspace_for(int64_t rows, int32_t q_heads, int32_t d, int32_t cap, bool balanced) {
  const int64_t parts = partial_count(rows, q_heads, cap), acc = parts * d * (int64_t)sizeof(float);
  return align256(parts * (int64_t)sizeof(float2)) + (balanced ? align256(acc) + rows * (int64_t)sizeof(int32_t) : acc);
}
// Whether a call of num_seqs sequences is balanced (split_count.h): 2 .. kBalanceMaxSeqs sequences, unless
// FMKV_CUDA_BALANCE=0 (measurements: the uniform plan for every sequence).
bool balanced_call(int32_t num_seqs) {
  static const bool on = !env_switched_off("FMKV_CUDA_BALANCE");
  return on && num_seqs >= 2 && num_seqs <= kBalanceMaxSeqs;
}

// Does the config store a side in format 3's tile blocks (the F3 kernels)?
bool tiled_config(const fmkv_config& c) {
  return fmkv_tiled_codes(c.format_version, c.k_bits) || fmkv_tiled_codes(c.format_version, c.v_bits);
}

// The kernel of a config: kQV query vectors per pass, or with `wide` the wide kernel (attn_compiled_wide: 2 x kQV);
// {} where not compiled.
AttnFn attn_kernel(const fmkv_config& c, bool wide = false) {
  const bool f3 = tiled_config(c);
  AttnFn fn{};
  with_k_bits(c.k_bits,
              [&](auto kb) { fn = attn_kernel_k<decltype(kb)::value>(c.head_dim, c.v_bits, c.page_size, f3, wide); });
  return fn;
}
// The kernel of a call of `rows` query rows over num_seqs sequences and q_heads q heads: the wide one when a
// (sequence, kv head) pair has more than kQV query vectors on average (rows per sequence x GQA group) and it is
// compiled, unless FMKV_CUDA_WIDE=0 (measurements: the kQV-vector passes for every call). *vectors_per_pass: what
// the split count plans with (split_count.h).
AttnFn attn_kernel_for_call(const fmkv_config& c, int32_t num_seqs, int32_t q_heads, int64_t rows, int* vectors_per_pass) {
  static const bool wide_on = !env_switched_off("FMKV_CUDA_WIDE");
  if (wide_on && vectors_per_pair(num_seqs, c.num_kv_heads, q_heads, rows) > kQV) {
    const AttnFn wide = attn_kernel(c, true);
    if (wide) {
      *vectors_per_pass = 2 * kQV;
      return wide;
    }
  }
  *vectors_per_pass = kQV;
  return attn_kernel(c);
}

// The current device's CTA slots for `fn` (SMs, CTAs per SM: split_count.h), after opting the kernel in to
// its dynamic shared memory (static + dynamic may exceed 48 KB) and the largest shared-memory carveout, so
// that its CTAs per SM are bound by registers (the kernel needs little L1); once per (device, kernel).
// {0, 0}: fn not compiled or no device.
SplitDevice split_device(const AttnFn& fn) {
  int dev = 0;
  if (!fn || cudaGetDevice(&dev) != cudaSuccess) {  // (no device: workspace sizes are still answered)
    (void)cudaGetLastError();
    return {};
  }
  static std::mutex mu;
  static std::map<std::pair<int, AttnFnPtr>, SplitDevice> known;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(dev, fn.fn);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  check_cuda(cudaFuncSetAttribute(fn.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, fn.smem),
             "attention kernel shared memory attribute");
  check_cuda(cudaFuncSetAttribute(fn.fn, cudaFuncAttributePreferredSharedMemoryCarveout, (int)cudaSharedmemCarveoutMaxShared),
             "attention kernel carveout attribute");
  int sms = 0, per_sm = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "multiprocessor count");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn.fn, 128, (size_t)fn.smem), "attention kernel occupancy");
  SplitDevice d;
  d.sms = sms;
  d.per_sm = std::max(per_sm, 1);
  // A head_dim <= 128 kernel resident 3 per SM (its launch bound, 168 registers) is planned as 4 slots per SM
  // and its one-wave grids cut to the 3 resident (SplitDevice, split_count.h): the split counts of
  // docs/CUDA-NOTES.md "Split count" were measured with 4 resident CTAs.
  if (per_sm == FMKV_ATTN_MIN_BLOCKS && FMKV_ATTN_MIN_BLOCKS == 3) {
    d.per_sm = 4;
    d.resident = 3;
  }
  return known[key] = d;
}
}  // namespace

int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows, int32_t num_seqs,
                                  int64_t max_seq_len) {
  if (q_heads <= 0 || max_rows <= 0) return 0;
  // the larger of an attention call's plan (one raw-domain CTA per pair) and a fused step's with fp16
  // regions (two)
  int vpp = kQV;
  const SplitDevice dev = split_device(attn_kernel_for_call(cfg, num_seqs, q_heads, max_rows, &vpp));
  // (a balanced call may take up to balance_cap partial slots; whether it runs is known only at the call)
  const bool balanced = balanced_call(num_seqs);
  int32_t cap = 1;
  for (int32_t nraw = 1; nraw <= 2; ++nraw) {
    const int32_t ns = split_count(cfg, num_seqs, q_heads, max_rows, nraw, dev, max_seq_len, vpp);
    cap = std::max(cap, balanced ? balance_cap(num_seqs, ns) : ns);
  }
  return workspace_for(max_rows, q_heads, cfg.head_dim, cap, balanced);
}

void check_attention(const fmkv_config& c) {
  if (attn_kernel(c)) return;
  const bool f3 = tiled_config(c);
  throw Error(kUnsupported, "cuda attention: k" + std::to_string(c.k_bits) + "v" + std::to_string(c.v_bits) +
                                " with head_dim " + std::to_string(c.head_dim) + (f3 ? " in format version 3" : "") +
                                " is not compiled into this build (compiled: " + (f3 ? kAttnDefaultGridF3 : kAttnDefaultGrid) +
                                "; configure with -DFMKV_CUDA_FULL_GRID=ON for every combination)");
}

namespace {
// Attention (ap == nullptr) or the fused decode step (append ap's rows of k / v first).
void launch(const AttentionArgs& a, const AppendArgs* ap) {
  const fmkv_config& c = a.cfg;
  if (a.batch.num_seqs == 0 || a.q.rows == 0) return;
  const int32_t d = c.head_dim, HQ = a.q.heads;
  int vpp = kQV;
  const AttnFn fn = attn_kernel_for_call(c, a.batch.num_seqs, HQ, a.q.rows, &vpp);
  if (!fn) check_attention(c);  // throws, naming the combination (the C API asked it before the call)
  // a fused step with fp16 regions: a second sink/window CTA attends the tokens before the step
  const int32_t nraw = ap != nullptr && c.sink_tokens + c.window_tokens > 0 ? 2 : 1;
  // splits per (sequence, kv head) of the grid, and partial slots per query vector (cap >= ns: a balanced
  // call's long sequences take more, split_count.h); a smaller workspace than planned lowers cap first
  int32_t ns = split_count(c, a.batch.num_seqs, HQ, a.q.rows, nraw, split_device(fn), a.opts.max_seq_len, vpp);
  const int64_t bound = a.opts.max_seq_len > 0 ? compressed_end(c, a.opts.max_seq_len) - c.sink_tokens : -1;
  const bool balanced = balanced_call(a.batch.num_seqs) && balance_pays(bound, ns);
  int32_t cap = balanced ? balance_cap(a.batch.num_seqs, ns) : ns;
  while (cap > ns && workspace_for(a.q.rows, HQ, d, cap, balanced) > (int64_t)a.workspace_bytes) --cap;
  while (ns > 1 && workspace_for(a.q.rows, HQ, d, ns, balanced) > (int64_t)a.workspace_bytes) cap = --ns;
  const int64_t need = workspace_for(a.q.rows, HQ, d, cap, balanced);
  if (!a.workspace || (int64_t)a.workspace_bytes < need)
    throw Error(kInvalidArgument, "cuda attention: workspace of " + std::to_string(a.workspace_bytes) +
                                      " bytes is too small (need at least " + std::to_string(need) +
                                      "; see fmkv_attention_workspace_bytes)");
  if (a.batch.num_seqs > 65535 || HQ > 65535)
    throw Error(kUnsupported, "cuda attention: more than 65535 sequences or q heads in one call");
  AttnParams p{};
  fill_layer_batch(p, c, a.layer, a.batch);
  p.head_stride = fmkv_head_stride_bytes(d, c.k_bits, c.v_bits, c.page_size, c.scale_group);
  p.ksec_bytes = fmkv_section_bytes(d, c.k_bits, c.page_size, c.scale_group);
  p.q = a.q.data;
  p.q_dtype = a.q.dtype;
  p.q_rs = a.q.row_stride;
  p.q_hs = a.q.head_stride;
  p.q_rows = a.q.rows;
  p.out = a.out.data;
  p.o_dtype = a.out.dtype;
  p.o_rs = a.out.row_stride;
  p.o_hs = a.out.head_stride;
  p.lse = ap == nullptr ? (float*)a.lse.data : nullptr;  // (the fused step has no lse)
  p.l_rs = a.lse.row_stride;
  p.l_hs = a.lse.head_stride;
  p.HQ = HQ;
  p.gq = HQ / c.num_kv_heads;
  p.sm_scale = a.opts.softmax_scale > 0 ? a.opts.softmax_scale : 1.0f / sqrtf((float)d);
  p.softcap = a.opts.softcap;
  p.tile_step[0] = f16_to_f32(codebook_step_f16(1));
  p.tile_step[1] = f16_to_f32(codebook_step_f16(2));
  const int64_t parts = partial_count(a.q.rows, HQ, cap);
  p.part_ml = (float2*)a.workspace;
  p.part_acc = (float*)((char*)a.workspace + align256(parts * (int64_t)sizeof(float2)));
  p.part_n = (int32_t*)((char*)p.part_acc + align256(parts * d * (int64_t)sizeof(float)));
  p.nsplit = ns;
  p.pstride = cap + kRawParts;
  p.balanced = balanced;
  p.max_len = a.opts.max_seq_len;
  p.fused = ap != nullptr;
  p.nraw = nraw;
  if (ap) {
    fill_kv(p, ap->k, ap->v);
    // format 3's tiled sides: the 3-bit tables of K (1) and V (2) for the exact quantizer
    if (c.k_bits != FMKV_FP16_BITS)
      p.kq = fmkv_tiled_codes(c.format_version, c.k_bits) ? tile_quantizer_tables(1) : quant_tables(c.k_bits);
    p.vq = fmkv_tiled_codes(c.format_version, c.v_bits) ? tile_quantizer_tables(2) : quant_tables(c.v_bits);
  }
#ifdef FMKV_CUDA_TRACE
  p.trace = trace_buffer();
#endif
  cudaStream_t st = to_stream(a.stream);
  if (reinterpret_cast<uintptr_t>(a.layer.pages) % 16 != 0)
    throw Error(kInvalidArgument, "cuda attention: layer pages must be 16-byte aligned (tiles are copied in 16-byte chunks)");
  if (c.sink_tokens + c.window_tokens > 0 &&
      (reinterpret_cast<uintptr_t>(a.layer.fp16_k) % 16 != 0 || reinterpret_cast<uintptr_t>(a.layer.fp16_v) % 16 != 0))
    throw Error(kInvalidArgument, "cuda attention: layer fp16_k / fp16_v must be 16-byte aligned (rows are read in 16-byte chunks)");
  // Both launches are programmatic dependents of what precedes them in the stream (sm_90): their
  // launch overlaps the predecessor's tail; each kernel waits (griddepcontrol.wait) before reading.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  const unsigned nattr = programmatic_launch_supported() ? 1 : 0;
  {
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3((unsigned)c.num_kv_heads, (unsigned)p.num_seqs, (unsigned)(p.nraw + ns));  // raw CTAs first
    lc.blockDim = dim3(128);
    lc.dynamicSmemBytes = (size_t)fn.smem;
    lc.stream = st;
    lc.attrs = attr;
    lc.numAttrs = nattr;
    check_cuda(cudaLaunchKernelEx(&lc, fn.fn, p), "attention kernel launch");
  }
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3((unsigned)a.q.rows, (unsigned)HQ);
  const bool wide = cap > 64;
  lc.blockDim = dim3((unsigned)(wide ? merge_threads_wide(d) : kMergeThreads));
  lc.stream = st;
  lc.attrs = attr;
  lc.numAttrs = nattr;
  cudaError_t merr;
  switch (d) {
    case 64: merr = cudaLaunchKernelEx(&lc, wide ? merge_kernel<64, merge_threads_wide(64)> : merge_kernel<64, kMergeThreads>, p); break;
    case 128: merr = cudaLaunchKernelEx(&lc, wide ? merge_kernel<128, merge_threads_wide(128)> : merge_kernel<128, kMergeThreads>, p); break;
    default: merr = cudaLaunchKernelEx(&lc, wide ? merge_kernel<256, merge_threads_wide(256)> : merge_kernel<256, kMergeThreads>, p); break;
  }
  check_cuda(merr, "merge kernel launch");
  check_cuda(cudaGetLastError(), "attention kernel launch");
}

}  // namespace

void decode_attention(const AttentionArgs& a) { launch(a, nullptr); }

void append_attention(const AppendArgs& ap, const AttentionArgs& a) {
  if (ap.k.rows != a.q.rows)
    throw Error(kInvalidArgument, "cuda append_attention: k has " + std::to_string(ap.k.rows) + " rows but q has " +
                                      std::to_string(a.q.rows) + " (one query row per appended token)");
  launch(a, &ap);
}

}  // namespace cuda
}  // namespace fmkv
