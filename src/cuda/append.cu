// CUDA quantize-append (issue 4, kernel 1). Four stream-ordered launches, no host sync:
//   1. validate_seq:    per sequence, row_offsets / seq_lens / slot / every block-table entry the
//                       append touches (device arrays); errors go to the device error word.
//   2. validate_finite: every k/v element must be finite in fp16 (as the host check of the
//                       reference does).
//   3. compress:        one warp per (row, kv head, K|V): the row's j-th slot of the sequence's newly
//                       compressed range [ce(len0), ce(len0 + n)) -- either a new row (q >= len0) or a
//                       token aging out of the fp16 ring window (read BEFORE the ring is rewritten).
//   4. write_fp16:      new sink tokens and the new tokens that end in the ring window.
// Every kernel returns at once while the error word is set, so a failed call writes nothing.
#include "quantize.cuh"

namespace fmkv {
namespace cuda {
namespace {

struct AppendParams {
  uint8_t* pages;
  int64_t num_pages, page_bytes;
  uint16_t *fp16_k, *fp16_v;
  int32_t num_slots, num_seqs;
  const int32_t* slots;
  const int64_t* seq_lens;
  const int64_t* ro;
  const int32_t* bt;
  int64_t bt_stride;
  const void *k, *v;
  int32_t k_dtype, v_dtype;
  int64_t k_rs, k_hs, v_rs, v_hs, rows;
  int32_t d, H, kb, vb, P, S, W, R, rule;
  SignWords sw;
  long long* err;
};

__global__ void validate_seq(AppendParams p) {
  const int s = blockIdx.x;
  const int64_t r0 = p.ro[s], r1 = p.ro[s + 1], n = r1 - r0, len = p.seq_lens[s];
  bool ok = true;
  if (threadIdx.x == 0) {
    if (s == 0 && r0 != 0) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 0, 0);
    if (n < 0) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, 0, 1, 0);
    if (s == p.num_seqs - 1 && r1 != p.rows) report_error(p.err, kInvalidArgument, kErrRowOffsets, s, r1, 2, p.rows);
    if (len < 0) report_error(p.err, kInvalidArgument, kErrNegLen, s, 0, len, 0);
    if (n >= 0 && len > INT64_MAX - n) report_error(p.err, kOverflow, kErrLenOverflow, s, 0, len, 0);
    if (p.R > 0 && n > 0) {
      int32_t slot = p.slots ? p.slots[s] : 0;
      if (slot < 0 || slot >= p.num_slots) report_error(p.err, kOutOfRange, kErrSlot, s, 0, slot, p.num_slots);
    }
  }
  if (n < 0 || len < 0 || len > INT64_MAX - n) ok = false;
  if (!ok || n == 0) return;
  const int64_t first = dev_compressed_end(p.S, p.W, len), e_end = dev_compressed_end(p.S, p.W, len + n);
  if (e_end <= first) return;
  const int64_t p0 = (first - p.S) / p.P, p1 = (e_end - 1 - p.S) / p.P;
  if (p1 >= p.bt_stride) {
    if (threadIdx.x == 0) report_error(p.err, kOutOfRange, kErrTableStride, s, p1 + 1, 0, p.bt_stride);
    return;
  }
  const int32_t* bt = p.bt + (int64_t)s * p.bt_stride;
  for (int64_t q = p0 + threadIdx.x; q <= p1; q += blockDim.x) {
    int32_t pg = bt[q];
    if (pg < 0 || pg >= p.num_pages) report_error(p.err, kOutOfRange, kErrBlockTable, s, q, pg, p.num_pages);
  }
}

__global__ void validate_finite(AppendParams p) {
  const int hd = p.H * p.d;  // elements of one row
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    for (int e = threadIdx.x; e < 2 * hd; e += blockDim.x) {
      const int which = e >= hd;
      const int ee = which ? e - hd : e;
      const int h = ee / p.d, i = ee - h * p.d;
      const uint16_t x = which ? load_f16_bits(p.v, p.v_dtype, r * p.v_rs + h * p.v_hs + i)
                               : load_f16_bits(p.k, p.k_dtype, r * p.k_rs + h * p.k_hs + i);
      if ((x & 0x7c00u) == 0x7c00u) report_error(p.err, kNonFinite, kErrNonFiniteKV, which, r, h, i);
    }
  }
}

// Sequence of global row r: largest s with ro[s] <= r.
__device__ __forceinline__ int find_seq(const int64_t* ro, int num_seqs, int64_t r) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (ro[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <int D>
__global__ void __launch_bounds__(256) compress(AppendParams p) {
  constexpr int NR = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = p.rows * p.H * 2;
  for (int64_t gw = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; gw < nwarps;
       gw += ((int64_t)gridDim.x * blockDim.x) >> 5) {
    if (error_set(p.err)) return;
    const int isv = (int)(gw & 1);
    const int32_t h = (int32_t)((gw >> 1) % p.H);
    const int64_t r = gw / (2 * (int64_t)p.H);
    const int s = find_seq(p.ro, p.num_seqs, r);
    const int64_t row0 = p.ro[s], n = p.ro[s + 1] - row0, len0 = p.seq_lens[s], j = r - row0;
    if (j < 0 || j >= n) continue;
    const int64_t cs = dev_compressed_end(p.S, p.W, len0), ce = dev_compressed_end(p.S, p.W, len0 + n);
    const int64_t q = cs + j;
    if (q >= ce) continue;
    const int64_t ci = q - p.S;
    const int32_t pg = p.bt[(int64_t)s * p.bt_stride + ci / p.P];
    if (pg < 0 || pg >= p.num_pages) continue;
    const int32_t t = (int32_t)(ci % p.P);
    uint16_t x[NR];
    if (q >= len0) {
      const int64_t rr = row0 + (q - len0);
      const void* src = isv ? p.v : p.k;
      const int32_t dt = isv ? p.v_dtype : p.k_dtype;
      const int64_t base = rr * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs);
#pragma unroll
      for (int i = 0; i < NR; ++i) x[i] = load_f16_bits(src, dt, base + lane + 32 * i);
    } else {  // aged out of the ring window: read the ring before write_fp16 overwrites it
      const int32_t slot = p.slots ? p.slots[s] : 0;
      const int32_t fs = p.S + (int32_t)((q - p.S) % p.W);
      const uint16_t* ring = (isv ? p.fp16_v : p.fp16_k) + (((int64_t)slot * p.H + h) * p.R + fs) * D;
#pragma unroll
      for (int i = 0; i < NR; ++i) x[i] = ring[lane + 32 * i];
    }
    const int bits = isv ? p.vb : p.kb;
    uint8_t* sec = p.pages + (int64_t)pg * p.page_bytes + fmkv_section_offset(D, p.kb, p.vb, p.P, h, isv);
    if (bits == FMKV_FP16_BITS) {
      uint16_t* dst = (uint16_t*)sec + (int64_t)t * D;
#pragma unroll
      for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = x[i];
      continue;
    }
    float v[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) v[i] = f16_to_f32(x[i]);
    warp_rotate<D>(v, p.sw, lane);
    uint32_t* words = (uint32_t*)sec;
    uint16_t* scales = (uint16_t*)(sec + fmkv_scales_offset(D, bits, p.P));
#pragma unroll
    for (int g = 0; g < NR; ++g)
      warp_quantize_group(v[g], bits, p.rule, lane, words + fmkv_code_word_index(bits, p.P, g, 0, t), p.P,
                          scales + (int64_t)g * p.P + t);
  }
}

template <int D>
__global__ void __launch_bounds__(256) write_fp16(AppendParams p) {
  constexpr int NR = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = p.rows * p.H * 2;
  for (int64_t gw = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5; gw < nwarps;
       gw += ((int64_t)gridDim.x * blockDim.x) >> 5) {
    if (error_set(p.err)) return;
    const int isv = (int)(gw & 1);
    const int32_t h = (int32_t)((gw >> 1) % p.H);
    const int64_t r = gw / (2 * (int64_t)p.H);
    const int s = find_seq(p.ro, p.num_seqs, r);
    const int64_t row0 = p.ro[s], n = p.ro[s + 1] - row0, len0 = p.seq_lens[s], j = r - row0;
    if (j < 0 || j >= n) continue;
    const int64_t pos = len0 + j;
    int32_t fs;
    if (pos < p.S) fs = (int32_t)pos;
    else if (p.W > 0 && pos >= len0 + n - p.W) fs = p.S + (int32_t)((pos - p.S) % p.W);
    else continue;
    const int32_t slot = p.slots ? p.slots[s] : 0;
    uint16_t* dst = (isv ? p.fp16_v : p.fp16_k) + (((int64_t)slot * p.H + h) * p.R + fs) * D;
    const void* src = isv ? p.v : p.k;
    const int32_t dt = isv ? p.v_dtype : p.k_dtype;
    const int64_t base = r * (isv ? p.v_rs : p.k_rs) + h * (isv ? p.v_hs : p.k_hs);
#pragma unroll
    for (int i = 0; i < NR; ++i) dst[lane + 32 * i] = load_f16_bits(src, dt, base + lane + 32 * i);
  }
}

template <int D>
void launch_append(const AppendParams& p, cudaStream_t st) {
  const int64_t warps = p.rows * p.H * 2;
  const int64_t blocks = std::min<int64_t>((warps + 7) / 8, 1 << 20);
  compress<D><<<(unsigned)blocks, 256, 0, st>>>(p);
  if (p.R > 0) write_fp16<D><<<(unsigned)blocks, 256, 0, st>>>(p);
}

}  // namespace

void append(const AppendArgs& a) {
  const fmkv_config& c = a.cfg;
  if (a.batch.num_seqs == 0) return;
  AppendParams p;
  p.pages = a.layer.pages;
  p.num_pages = a.layer.num_pages;
  p.page_bytes = page_bytes(c);
  p.fp16_k = a.layer.fp16_k;
  p.fp16_v = a.layer.fp16_v;
  p.num_slots = a.layer.num_slots;
  p.num_seqs = a.batch.num_seqs;
  p.slots = a.batch.slots;
  p.seq_lens = a.batch.seq_lens;
  p.ro = a.batch.row_offsets;
  p.bt = a.batch.block_table;
  p.bt_stride = a.batch.block_table_stride;
  p.k = a.k.data;
  p.v = a.v.data;
  p.k_dtype = a.k.dtype;
  p.v_dtype = a.v.dtype;
  p.k_rs = a.k.row_stride;
  p.k_hs = a.k.head_stride;
  p.v_rs = a.v.row_stride;
  p.v_hs = a.v.head_stride;
  p.rows = a.k.rows;
  p.d = c.head_dim;
  p.H = c.num_kv_heads;
  p.kb = c.k_bits;
  p.vb = c.v_bits;
  p.P = c.page_size;
  p.S = c.sink_tokens;
  p.W = c.window_tokens;
  p.R = fp16_slots(c);
  p.rule = c.scale_rule;
  p.sw = make_sign_words(c.seed, a.layer.layer, c.head_dim);
  p.err = error_word();
  cudaStream_t st = to_stream(a.stream);
  validate_seq<<<(unsigned)p.num_seqs, 128, 0, st>>>(p);
  if (p.rows > 0) {
    const int64_t blocks = std::min<int64_t>(p.rows, 16 * (int64_t)sm_count());
    validate_finite<<<(unsigned)blocks, 256, 0, st>>>(p);
    switch (p.d) {
      case 64: launch_append<64>(p, st); break;
      case 128: launch_append<128>(p, st); break;
      default: launch_append<256>(p, st); break;
    }
  }
  check_cuda(cudaGetLastError(), "append kernel launch");
}

}  // namespace cuda
}  // namespace fmkv
