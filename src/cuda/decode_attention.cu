// CUDA decode attention: host side (validation launch, split choice, workspace layout, dispatch)
// and the merge kernel. See decode_attention.cuh for the main kernel. No host synchronisation and
// no allocation here: safe to capture in a CUDA graph (the workspace comes from the caller).
#include <algorithm>

#include "decode_attention.cuh"

namespace fmkv {
namespace cuda {
namespace {

// Batch arrays live on the device: check them there (row offsets, lengths, slots, every block-table
// entry of the compressed range). Errors go to the device error word; the other kernels then skip.
__global__ void validate_attn(AttnParams p) {
  const int s = blockIdx.x;
  const int64_t r0 = p.ro[s], r1 = p.ro[s + 1], n = r1 - r0, len = p.seq_lens[s];
  if (threadIdx.x == 0) {
    if (s == 0 && r0 != 0) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 0, 0);
    if (n < 0) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 1, 0);
    if (s == p.num_seqs - 1 && r1 != p.q_rows) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, r1, 2, p.q_rows);
    if (len < 0) report_error(p.err, kInvalidArgument, kErrNegLen, s, 0, len, 0);
    if (n > len && len >= 0) report_error(p.err, kInvalidArgument, kErrQRows, s, n, len, 0);
    if (p.R > 0 && n > 0) {
      int32_t slot = p.slots ? p.slots[s] : 0;
      if (slot < 0 || slot >= p.num_slots) report_error(p.err, kOutOfRange, kErrSlot, s, 0, slot, p.num_slots);
    }
  }
  if (n <= 0 || len < 0 || n > len) return;
  const int64_t E = dev_compressed_end(p.S, p.W, len);
  if (E <= p.S) return;
  const int64_t p1 = (E - 1 - p.S) / p.P;
  if (p1 >= p.bt_stride) {
    if (threadIdx.x == 0) report_error(p.err, kOutOfRange, kErrTableStride, s, p1 + 1, 0, p.bt_stride);
    return;
  }
  const int32_t* bt = p.bt + (int64_t)s * p.bt_stride;
  for (int64_t q = threadIdx.x; q <= p1; q += blockDim.x) {
    int32_t pg = bt[q];
    if (pg < 0 || pg >= p.num_pages) report_error(p.err, kOutOfRange, kErrBlockTable, s, q, pg, p.num_pages);
  }
}

__global__ void validate_q(AttnParams p, int32_t d) {
  const int64_t total = p.q_rows * p.HQ * d;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / ((int64_t)p.HQ * d);
    const int32_t h = (int32_t)((idx / d) % p.HQ), i = (int32_t)(idx % d);
    const float x = load_elem(p.q, p.q_dtype, r * p.q_rs + h * p.q_hs + i);
    if (!isfinite(x)) report_error(p.err, kNonFinite, kErrNonFiniteQ, 0, r, h, i);
  }
}

// One CTA (D threads) per (query row, q head): combine the split partials, un-rotate the compressed
// part once (FWHT in shared memory), add the fp16 (sink/window) part, normalise, store.
template <int D>
__global__ void __launch_bounds__(D) merge_kernel(AttnParams p) {
  __shared__ float y[D];
  if (error_set(p.err)) return;
  const int64_t row = blockIdx.x;
  const int hq = blockIdx.y, c = threadIdx.x;
  const int64_t base = (row * p.HQ + hq) * (p.nsplit + 1);
  float M = -INFINITY;
  for (int i = 0; i <= p.nsplit; ++i) M = fmaxf(M, p.part_ml[base + i].x);
  float L = 0.0f, A = 0.0f, Araw = 0.0f;
  if (M != -INFINITY) {
    for (int i = 0; i <= p.nsplit; ++i) {
      const float2 ml = p.part_ml[base + i];
      if (ml.x == -INFINITY) continue;
      const float f = exp2f((ml.x - M) * kLog2e);
      L += ml.y * f;
      const float a = p.part_acc[(base + i) * D + c] * f;
      if (i < p.nsplit) A += a;
      else Araw = a;
    }
  }
  y[c] = A;
  __syncthreads();
  for (int hh = 1; hh < D; hh <<= 1) {
    if ((c & hh) == 0) {
      const float a = y[c], b = y[c + hh];
      y[c] = a + b;
      y[c + hh] = a - b;
    }
    __syncthreads();
  }
  float x = y[c] * rotation_norm(D);
  if (sign_negative(p.sw, c)) x = -x;
  const float o = (x + Araw) / L;
  const int64_t off = row * p.o_rs + hq * p.o_hs + c;
  if (p.o_dtype == FMKV_F32) ((float*)p.out)[off] = o;
  else if (p.o_dtype == FMKV_F16) ((uint16_t*)p.out)[off] = f32_to_f16(o);
  else ((uint16_t*)p.out)[off] = f32_to_bf16(o);
}

int32_t preferred_splits(int32_t num_seqs, int32_t kv_heads) {
  const int64_t ctas = (int64_t)std::max(num_seqs, 1) * std::max(kv_heads, 1);
  int64_t ns = (1056 + ctas - 1) / ctas;
  return (int32_t)std::min<int64_t>(std::max<int64_t>(ns, 1), 64);
}

int64_t align256(int64_t x) { return (x + 255) & ~(int64_t)255; }
// Bytes of the workspace for `rows` query rows of q_heads heads and ns compressed splits.
int64_t workspace_for(int64_t rows, int32_t q_heads, int32_t d, int32_t ns) {
  const int64_t parts = rows * q_heads * (int64_t)(ns + 1);
  return align256(parts * (int64_t)sizeof(float2)) + parts * d * (int64_t)sizeof(float);
}

}  // namespace

int64_t attention_workspace_bytes(const fmkv_config& cfg, int32_t q_heads, int64_t max_rows, int32_t num_seqs,
                                  int64_t max_seq_len) {
  (void)max_seq_len;
  if (q_heads <= 0 || max_rows <= 0) return 0;
  return workspace_for(max_rows, q_heads, cfg.head_dim, preferred_splits(num_seqs, cfg.num_kv_heads));
}

void decode_attention(const AttentionArgs& a) {
  const fmkv_config& c = a.cfg;
  if (a.batch.num_seqs == 0 || a.q.rows == 0) return;
  const int32_t d = c.head_dim, HQ = a.q.heads;
  int32_t ns = preferred_splits(a.batch.num_seqs, c.num_kv_heads);
  while (ns > 1 && workspace_for(a.q.rows, HQ, d, ns) > (int64_t)a.workspace_bytes) --ns;
  const int64_t need = workspace_for(a.q.rows, HQ, d, ns);
  if (!a.workspace || (int64_t)a.workspace_bytes < need)
    throw Error(kInvalidArgument, "cuda attention: workspace of " + std::to_string(a.workspace_bytes) +
                                      " bytes is too small (need at least " + std::to_string(need) +
                                      "; see fmkv_attention_workspace_bytes)");
  if (a.batch.num_seqs > 65535 || HQ > 65535)
    throw Error(kUnsupported, "cuda attention: more than 65535 sequences or q heads in one call");
  AttnFn fn = nullptr;
  switch (c.k_bits) {
    case 2: fn = attn_kernel_k2(d, c.v_bits); break;
    case 3: fn = attn_kernel_k3(d, c.v_bits); break;
    case 4: fn = attn_kernel_k4(d, c.v_bits); break;
    case 16: fn = attn_kernel_k16(d, c.v_bits); break;
  }
  if (!fn)
    throw Error(kUnsupported, "cuda attention: k" + std::to_string(c.k_bits) + "v" + std::to_string(c.v_bits) +
                                  " d=" + std::to_string(d) + " is not compiled");
  AttnParams p;
  p.pages = a.layer.pages;
  p.num_pages = a.layer.num_pages;
  p.page_bytes = page_bytes(c);
  p.head_stride = fmkv_head_stride_bytes(d, c.k_bits, c.v_bits, c.page_size);
  p.ksec_bytes = fmkv_section_bytes(d, c.k_bits, c.page_size);
  p.fp16_k = a.layer.fp16_k;
  p.fp16_v = a.layer.fp16_v;
  p.num_slots = a.layer.num_slots;
  p.num_seqs = a.batch.num_seqs;
  p.slots = a.batch.slots;
  p.seq_lens = a.batch.seq_lens;
  p.ro = a.batch.row_offsets;
  p.bt = a.batch.block_table;
  p.bt_stride = a.batch.block_table_stride;
  p.q = a.q.data;
  p.q_dtype = a.q.dtype;
  p.q_rs = a.q.row_stride;
  p.q_hs = a.q.head_stride;
  p.q_rows = a.q.rows;
  p.out = a.out.data;
  p.o_dtype = a.out.dtype;
  p.o_rs = a.out.row_stride;
  p.o_hs = a.out.head_stride;
  p.H = c.num_kv_heads;
  p.HQ = HQ;
  p.gq = HQ / c.num_kv_heads;
  p.P = c.page_size;
  p.S = c.sink_tokens;
  p.W = c.window_tokens;
  p.R = fp16_slots(c);
  p.sm_scale = a.opts.softmax_scale > 0 ? a.opts.softmax_scale : 1.0f / sqrtf((float)d);
  p.softcap = a.opts.softcap;
  p.sw = make_sign_words(c.seed, a.layer.layer, d);
  const int64_t parts = a.q.rows * HQ * (int64_t)(ns + 1);
  p.part_ml = (float2*)a.workspace;
  p.part_acc = (float*)((char*)a.workspace + align256(parts * (int64_t)sizeof(float2)));
  p.nsplit = ns;
  p.err = error_word();
  cudaStream_t st = to_stream(a.stream);
  validate_attn<<<(unsigned)p.num_seqs, 128, 0, st>>>(p);
  {
    const int64_t total = a.q.rows * HQ * (int64_t)d;
    const int64_t blocks = std::min<int64_t>((total + 255) / 256, 4 * (int64_t)sm_count());
    validate_q<<<(unsigned)blocks, 256, 0, st>>>(p, d);
  }
  fn<<<dim3((unsigned)(ns + 1), (unsigned)c.num_kv_heads, (unsigned)p.num_seqs), 128, 0, st>>>(p);
  const dim3 mg((unsigned)a.q.rows, (unsigned)HQ);
  switch (d) {
    case 64: merge_kernel<64><<<mg, 64, 0, st>>>(p); break;
    case 128: merge_kernel<128><<<mg, 128, 0, st>>>(p); break;
    default: merge_kernel<256><<<mg, 256, 0, st>>>(p); break;
  }
  check_cuda(cudaGetLastError(), "attention kernel launch");
}

}  // namespace cuda
}  // namespace fmkv
