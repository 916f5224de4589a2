#include "validate.h"

#include <cmath>
#include <limits>
#include <string>

#include "../core/tensor_io.h"

namespace fmkv {
namespace {

std::string S(int64_t v) { return std::to_string(v); }

void validate_tensor(const char* name, const fmkv_tensor& t, int64_t rows, int32_t heads_req,
                     bool heads_multiple_ok, int32_t d) {
  std::string n = name;
  if (t.dtype != FMKV_F32 && t.dtype != FMKV_F16 && t.dtype != FMKV_BF16)
    fail(kInvalidArgument, n + ": dtype " + S(t.dtype) + " is not f32, f16 or bf16");
  if (t.dim != d) fail(kInvalidArgument, n + ": last dimension is " + S(t.dim) + " but head_dim is " + S(d));
  if (heads_multiple_ok ? (t.heads < heads_req || t.heads % heads_req != 0) : t.heads != heads_req)
    fail(kInvalidArgument, n + ": " + S(t.heads) + " heads, expected " +
                               (heads_multiple_ok ? "a multiple of num_kv_heads " : "") + S(heads_req));
  if (t.rows != rows)
    fail(kInvalidArgument, n + ": " + S(t.rows) + " rows but the batch's row_offsets end at " + S(rows));
  if (t.row_stride < 0 || t.head_stride < 0)
    fail(kInvalidArgument, n + ": negative stride");
  if (t.rows > 0 && !t.data) fail(kInvalidArgument, n + ": data is NULL");
  // Largest byte offset touched: ((rows-1)*row_stride + (heads-1)*head_stride + d) * 4.
  int64_t a = 0, b = 0, e = 0;
  if (__builtin_mul_overflow(t.rows > 0 ? t.rows - 1 : 0, t.row_stride, &a) ||
      __builtin_mul_overflow((int64_t)(t.heads > 0 ? t.heads - 1 : 0), t.head_stride, &b) ||
      __builtin_add_overflow(a, b, &e) || __builtin_add_overflow(e, (int64_t)d, &e) ||
      __builtin_mul_overflow(e, (int64_t)4, &e))
    fail(kOverflow, n + ": extent overflows 64-bit byte offsets");
}

void validate_batch_arrays(const fmkv_batch& b) {
  if (b.num_seqs < 0) fail(kInvalidArgument, "batch: num_seqs is negative");
  if (b.num_seqs > 0 && (!b.seq_lens || !b.row_offsets))
    fail(kInvalidArgument, "batch: seq_lens and row_offsets must not be NULL");
  if (b.block_table_stride > 0 && !b.block_table)
    fail(kInvalidArgument, "batch: block_table is NULL but block_table_stride is " + S(b.block_table_stride));
  if (b.block_table_stride < 0) fail(kInvalidArgument, "batch: negative block_table_stride");
}

// Host check of the sequences: offsets, lengths, slots and every page the op will touch.
void validate_batch_host(const fmkv_config& c, const fmkv_layer_cache& l, const fmkv_batch& b,
                         bool attention) {
  if (b.num_seqs > 0 && b.row_offsets[0] != 0) fail(kInvalidArgument, "batch: row_offsets[0] must be 0");
  for (int32_t s = 0; s < b.num_seqs; ++s) {
    const int64_t n = b.row_offsets[s + 1] - b.row_offsets[s], len = b.seq_lens[s];
    const std::string q = "batch: sequence " + S(s) + ": ";
    if (n < 0) fail(kInvalidArgument, q + "row_offsets decrease");
    if (len < 0) fail(kInvalidArgument, q + "negative length");
    if (attention && n > len) fail(kInvalidArgument, q + S(n) + " query rows but only " + S(len) + " tokens cached (append first)");
    if (attention && n == 0) continue;
    if (len > std::numeric_limits<int64_t>::max() - n) fail(kOverflow, q + "length overflows");
    const int64_t end = attention ? len : len + n;
    if (fp16_slots(c) > 0) {
      int32_t slot = b.slots ? b.slots[s] : 0;
      if (slot < 0 || slot >= l.num_slots)
        fail(kOutOfRange, q + "slot " + S(slot) + " outside [0, " + S(l.num_slots) + ")");
    }
    // Pages holding compressed tokens touched by this op: [first, last] compressed indices.
    int64_t e_end = compressed_end(c, end);
    int64_t first = attention ? c.sink_tokens : compressed_end(c, len);
    if (e_end <= first) continue;
    int64_t p0 = (first - c.sink_tokens) / c.page_size, p1 = (e_end - 1 - c.sink_tokens) / c.page_size;
    if (p1 >= b.block_table_stride)
      fail(kOutOfRange, q + "needs " + S(p1 + 1) + " pages but block_table_stride is " + S(b.block_table_stride));
    if (p1 >= std::numeric_limits<int32_t>::max())
      fail(kOverflow, q + "more pages than a 32-bit block table can address");
    const int32_t* bt = b.block_table + (int64_t)s * b.block_table_stride;
    for (int64_t p = attention ? 0 : p0; p <= p1; ++p)
      if (bt[p] < 0 || bt[p] >= l.num_pages)
        fail(kOutOfRange, q + "block_table[" + S(p) + "] = " + S(bt[p]) + " outside [0, " + S(l.num_pages) + ")");
  }
}

// Index of the first element of row r, head h that is NaN/Inf or rounds to Inf in fp16, or -1.
// Branch-free scans per dtype (vectorised by the compiler); the slow path only locates the element.
int32_t first_non_fp16(const fmkv_tensor& t, int64_t r, int32_t h) {
  const void* p = tensor_ptr(t, r, h);
  bool bad = false;
  if (t.dtype == FMKV_F16) {
    const uint16_t* x = (const uint16_t*)p;
    for (int32_t i = 0; i < t.dim; ++i) bad |= (x[i] & 0x7c00u) == 0x7c00u;
  } else if (t.dtype == FMKV_BF16) {
    const uint16_t* x = (const uint16_t*)p;  // |x| >= 65520 is bf16 bits >= 0x4780 (65536)
    for (int32_t i = 0; i < t.dim; ++i) bad |= (x[i] & 0x7fffu) >= 0x4780u;
  } else {
    const uint32_t* x = (const uint32_t*)p;  // 65520.0f = 0x477ff000: rounds to fp16 inf
    for (int32_t i = 0; i < t.dim; ++i) bad |= (x[i] & 0x7fffffffu) >= 0x477ff000u;
  }
  if (!bad) return -1;
  for (int32_t i = 0; i < t.dim; ++i)
    if (!f16_is_finite(load_f16(t, r, h, i))) return i;
  return -1;
}

}  // namespace

void validate_append_shapes(const AppendArgs& a) {
  validate_config(a.cfg);
  validate_layer(a.cfg, a.layer);
  validate_batch_arrays(a.batch);
  if (a.k.rows != a.v.rows) fail(kInvalidArgument, "k has " + S(a.k.rows) + " rows but v has " + S(a.v.rows));
  validate_tensor("k", a.k, a.k.rows, a.cfg.num_kv_heads, false, a.cfg.head_dim);
  validate_tensor("v", a.v, a.k.rows, a.cfg.num_kv_heads, false, a.cfg.head_dim);
}

void validate_attention_shapes(const AttentionArgs& a) {
  validate_config(a.cfg);
  validate_layer(a.cfg, a.layer);
  validate_batch_arrays(a.batch);
  validate_tensor("q", a.q, a.q.rows, a.cfg.num_kv_heads, true, a.cfg.head_dim);
  validate_tensor("out", a.out, a.q.rows, a.q.heads, false, a.cfg.head_dim);
  if (!std::isfinite(a.opts.softmax_scale) || !std::isfinite(a.opts.softcap) || a.opts.softcap < 0)
    fail(kInvalidArgument, "softmax_scale and softcap must be finite, softcap >= 0");
  if (a.opts.max_seq_len < 0)
    fail(kInvalidArgument, "max_seq_len is " + S(a.opts.max_seq_len) + " (must be >= 0; 0: no bound)");
}

void validate_attention_lse(const AttentionArgs& a) {
  if (a.lse.dtype != FMKV_F32) fail(kInvalidArgument, "lse: dtype " + S(a.lse.dtype) + " is not f32");
  validate_tensor("lse", a.lse, a.q.rows, a.q.heads, false, 1);
}

void validate_append_host(const AppendArgs& a) {
  if (a.batch.num_seqs > 0 && a.batch.row_offsets[a.batch.num_seqs] != a.k.rows)
    fail(kInvalidArgument, "k has " + S(a.k.rows) + " rows but row_offsets end at " + S(a.batch.row_offsets[a.batch.num_seqs]));
  validate_batch_host(a.cfg, a.layer, a.batch, false);
  for (int which = 0; which < 2; ++which) {
    const fmkv_tensor& t = which ? a.v : a.k;
    for (int64_t r = 0; r < t.rows; ++r)
      for (int32_t h = 0; h < t.heads; ++h) {
        int32_t i = first_non_fp16(t, r, h);
        if (i >= 0)
          fail(kNonFinite, std::string(which ? "v" : "k") + "[" + S(r) + "][" + S(h) + "][" + S(i) +
                               "] is NaN, Inf or beyond the fp16 range (|x| >= 65520)");
      }
  }
}

void validate_attention_host(const AttentionArgs& a) {
  if (a.batch.num_seqs > 0 && a.batch.row_offsets[a.batch.num_seqs] != a.q.rows)
    fail(kInvalidArgument, "q has " + S(a.q.rows) + " rows but row_offsets end at " + S(a.batch.row_offsets[a.batch.num_seqs]));
  validate_batch_host(a.cfg, a.layer, a.batch, true);
  for (int32_t s = 0; s < a.batch.num_seqs; ++s)
    if (a.opts.max_seq_len > 0 && a.batch.seq_lens[s] > a.opts.max_seq_len)
      fail(kInvalidArgument, "batch: sequence " + S(s) + ": " + S(a.batch.seq_lens[s]) +
                                 " tokens, more than opts.max_seq_len = " + S(a.opts.max_seq_len) +
                                 " (the bound the call's split count was chosen for; pass 0 when unknown)");
  for (int64_t r = 0; r < a.q.rows; ++r)
    for (int32_t h = 0; h < a.q.heads; ++h)
      for (int32_t i = 0; i < a.q.dim; ++i)
        if (!std::isfinite(load_f32(a.q, r, h, i)))
          fail(kNonFinite, "q[" + S(r) + "][" + S(h) + "][" + S(i) + "] is NaN or Inf");
}

}  // namespace fmkv
