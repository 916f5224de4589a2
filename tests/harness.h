// Cross-backend test harness: builds random paged-cache scenarios, runs an op on any backend
// through the public C API (device memory via fmkv_device_*), and compares with the reference.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "compare.h"
#include "format/numbers.h"
#include "fmkv/fmkv.hpp"

namespace fmkv::test {

inline std::mt19937_64& rng() {
  static std::mt19937_64 r(std::random_device{}());  // fresh inputs every run
  return r;
}

// Buffer mirrored between host and a backend's device memory.
struct DeviceBuf {
  fmkv_backend b;
  size_t n = 0;
  void* p = nullptr;
  DeviceBuf(fmkv_backend be, size_t bytes) : b(be), n(bytes) { p = fmkv_device_alloc(b, bytes); }
  ~DeviceBuf() { fmkv_device_free(b, p); }
  DeviceBuf(const DeviceBuf&) = delete;
  template <typename T> void upload(const std::vector<T>& v) { check(fmkv_device_copy(b, p, v.data(), v.size() * sizeof(T), 1)); }
  template <typename T> std::vector<T> download() const {
    std::vector<T> v(n / sizeof(T));
    check(fmkv_device_copy(b, v.data(), p, n, 0));
    return v;
  }
};

// Random values of a given dtype, stored as raw bytes; heavy-tailed channels like real keys.
inline std::vector<uint8_t> random_tensor(fmkv_dtype dt, int64_t rows, int32_t heads, int32_t d,
                                          double outlier_scale = 1.0) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> chan(d);
  for (auto& c : chan) c = 1.0f + (float)outlier_scale * std::fabs(nd(rng()));
  size_t es = dt == FMKV_F32 ? 4 : 2, n = (size_t)rows * heads * d;
  std::vector<uint8_t> out(n * es);
  for (size_t i = 0; i < n; ++i) {
    float x = nd(rng()) * chan[i % d];
    if (dt == FMKV_F32) std::memcpy(&out[i * 4], &x, 4);
    else {
      uint16_t h = dt == FMKV_F16 ? f32_to_f16(x) : f32_to_bf16(x);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

inline std::vector<uint8_t> random_bytes(size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = (uint8_t)rng()();
  return v;
}

// A batch of sequences with a host image of the whole layer state.
struct Scenario {
  fmkv_config cfg;
  int32_t layer = 0;
  std::vector<int64_t> lens;    // tokens in cache before the op
  std::vector<int64_t> rows;    // new rows per sequence
  int64_t table_stride = 0;
  std::vector<int32_t> table;   // [seqs][table_stride], a random permutation of pages
  std::vector<int32_t> slots;
  int64_t num_pages = 0;
  std::vector<uint8_t> pages;   // host image (poisoned with random bytes)
  std::vector<uint16_t> fp16_k, fp16_v;

  int32_t seqs() const { return (int32_t)lens.size(); }
  std::vector<int64_t> offsets() const {
    std::vector<int64_t> o(1, 0);
    for (auto r : rows) o.push_back(o.back() + r);
    return o;
  }
};

inline Scenario make_scenario(const fmkv_config& cfg, std::vector<int64_t> lens, std::vector<int64_t> rows) {
  Scenario s;
  s.cfg = cfg;
  s.layer = (int32_t)(rng()() % 40);
  s.lens = lens;
  s.rows = rows;
  int64_t max_pages = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    int64_t comp = std::max<int64_t>(0, lens[i] + rows[i] - cfg.window_tokens - cfg.sink_tokens);
    max_pages = std::max(max_pages, (comp + cfg.page_size - 1) / cfg.page_size);
  }
  s.table_stride = max_pages + 1;
  s.num_pages = s.table_stride * (int64_t)lens.size() + 3;
  std::vector<int32_t> perm(s.num_pages);
  for (int64_t i = 0; i < s.num_pages; ++i) perm[i] = (int32_t)i;
  std::shuffle(perm.begin(), perm.end(), rng());
  s.table.assign(perm.begin(), perm.begin() + s.table_stride * lens.size());
  for (size_t i = 0; i < lens.size(); ++i) s.slots.push_back((int32_t)(lens.size() - 1 - i));
  s.pages = random_bytes((size_t)(s.num_pages * fmkv_config_page_bytes(&cfg)));
  size_t fe = (size_t)(fmkv_config_fp16_slot_bytes(&cfg) / 4) * lens.size();
  s.fp16_k.resize(fe);
  s.fp16_v.resize(fe);
  for (auto& x : s.fp16_k) x = f32_to_f16(std::normal_distribution<float>()(rng()));
  for (auto& x : s.fp16_v) x = f32_to_f16(std::normal_distribution<float>()(rng()));
  return s;
}

struct LayerState {
  std::vector<uint8_t> pages;
  std::vector<uint16_t> fp16_k, fp16_v;
};

// The CUDA decode attention of a default build covers this grid (at least k4v4, k3v3, k4v2, k16v3, and the
// 5-bit k5v4, k5v5 for head_dim 64/128; src/cuda/decode_attention.cuh attn_compiled); -DFMKV_CUDA_FULL_GRID=ON compiles every combination. Outside it the
// backend must fail with FMKV_ERR_UNSUPPORTED saying "not compiled"; inside it, it must run.
inline bool in_default_cuda_grid(int d, int kb, int vb) {
  const bool small = (kb == 2 && vb == 2) || (kb == 3 && vb == 3) || (kb == 4 && vb == 4) || (kb == 4 && vb == 2) ||
                     (kb == 16 && vb == 3) || (kb == 5 && vb == 4) || (kb == 5 && vb == 5);
  return ((d == 64 || d == 128) && small) || (d == 256 && kb == vb && (kb == 3 || kb == 4));
}

// Format 3 (a 3-bit side in tile blocks): the default CUDA grid has k3v3 for every head_dim and k16v3 (64/128).
inline bool in_default_cuda_grid_f3(int d, int kb, int vb) {
  return in_default_cuda_grid(d, kb, vb) && vb == 3 && (kb == 3 || kb == 16);
}

// True when e says that backend b (CUDA) lacks a combination outside the default grid (of format 3 when
// f3): the caller skips it.
inline bool cuda_combination_not_compiled(fmkv_backend b, const fmkv::Error& e, int d, int kb, int vb, bool f3 = false) {
  return b == FMKV_BACKEND_CUDA && e.code() == FMKV_ERR_UNSUPPORTED &&
         std::string(e.what()).find("not compiled") != std::string::npos &&
         !(f3 ? in_default_cuda_grid_f3(d, kb, vb) : in_default_cuda_grid(d, kb, vb));
}

// n output elements of dtype out_dtype (raw bytes) as float.
inline std::vector<float> output_as_f32(const std::vector<uint8_t>& raw, fmkv_dtype out_dtype, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (out_dtype == FMKV_F32) std::memcpy(&out[i], &raw[i * 4], 4);
    else {
      uint16_t h;
      std::memcpy(&h, &raw[i * 2], 2);
      out[i] = out_dtype == FMKV_F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
  }
  return out;
}

// One layer's state and one batch on backend b's memory: pages, fp16 regions, lengths (given:
// before or after the op's rows), row offsets, block table and slots of scenario s.
struct DeviceLayer {
  DeviceBuf pages, fk, fv, lens, offs, table, slots;
  fmkv_layer_cache lc;
  fmkv_batch bt;
  DeviceLayer(fmkv_backend b, const Scenario& s, const std::vector<uint8_t>& page_bytes,
              const std::vector<uint16_t>& fp16_k, const std::vector<uint16_t>& fp16_v, const std::vector<int64_t>& lengths)
      : pages(b, page_bytes.size()), fk(b, fp16_k.size() * 2 + 2), fv(b, fp16_v.size() * 2 + 2),
        lens(b, lengths.size() * 8 + 8), offs(b, s.offsets().size() * 8), table(b, s.table.size() * 4 + 4),
        slots(b, s.slots.size() * 4 + 4) {
    pages.upload(page_bytes);
    fk.upload(fp16_k);
    fv.upload(fp16_v);
    lens.upload(lengths);
    offs.upload(s.offsets());
    table.upload(s.table);
    slots.upload(s.slots);
    lc = fmkv_layer_cache{(uint8_t*)pages.p, s.num_pages, (uint16_t*)fk.p, (uint16_t*)fv.p, std::max<int32_t>(1, s.seqs()), s.layer};
    bt = fmkv_batch{s.seqs(), (int32_t*)slots.p, (int64_t*)lens.p, (int64_t*)offs.p, (int32_t*)table.p, s.table_stride};
  }
  LayerState state(const Scenario& s) const {
    LayerState out;
    out.pages = pages.download<uint8_t>();
    out.fp16_k = fk.download<uint16_t>();
    out.fp16_v = fv.download<uint16_t>();
    out.fp16_k.resize(s.fp16_k.size());
    out.fp16_v.resize(s.fp16_v.size());
    return out;
  }
};

// A [rows][heads][dim] host tensor copied to backend memory; t is the same tensor over that copy.
struct DeviceTensor {
  DeviceBuf buf;
  fmkv_tensor t;
  DeviceTensor(fmkv_backend b, const fmkv_tensor& host)
      : buf(b, (size_t)host.rows * host.heads * host.dim * (host.dtype == FMKV_F32 ? 4 : 2) + 1), t(host) {
    check(fmkv_device_copy(b, buf.p, host.data, buf.n - 1, 1));
    t.data = buf.p;
  }
};

// An output tensor like q (dtype out_dtype) in backend memory, poisoned with NaN in every float format.
struct DeviceOutput {
  DeviceBuf buf;
  fmkv_tensor t;
  fmkv_dtype dtype;
  size_t n;
  DeviceOutput(fmkv_backend b, const fmkv_tensor& q, fmkv_dtype out_dtype)
      : buf(b, (size_t)q.rows * q.heads * q.dim * (out_dtype == FMKV_F32 ? 4 : 2) + 1), dtype(out_dtype),
        n((size_t)q.rows * q.heads * q.dim) {
    std::vector<uint8_t> poison(buf.n, 0xFF);
    check(fmkv_device_copy(b, buf.p, poison.data(), poison.size(), 1));
    t = make_tensor(buf.p, out_dtype, q.rows, q.heads, q.dim);
  }
  std::vector<float> as_f32() const { return output_as_f32(buf.download<uint8_t>(), dtype, n); }
};

// Lengths after the op's rows (what attention takes).
inline std::vector<int64_t> lengths_after(const Scenario& s) {
  std::vector<int64_t> l(s.lens.size());
  for (size_t i = 0; i < l.size(); ++i) l[i] = s.lens[i] + s.rows[i];
  return l;
}

// Runs append on backend b over a copy of the scenario's state; returns the new host image.
inline LayerState run_append(fmkv_backend b, const Scenario& s, const fmkv_tensor& k_host,
                             const fmkv_tensor& v_host, fmkv_status* status = nullptr) {
  DeviceLayer L(b, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
  DeviceTensor k(b, k_host), v(b, v_host);
  fmkv_status st = fmkv_append(b, &s.cfg, &L.lc, &L.bt, &k.t, &v.t, nullptr);
  if (status) *status = st;
  else check(st);
  check(fmkv_device_synchronize(b));
  return L.state(s);
}

// A scenario whose cache already holds s.lens tokens per sequence (random K/V appended by the
// reference), ready for an op that adds s.rows more; *added = rows in total.
inline Scenario filled_scenario(const fmkv_config& c, const std::vector<int64_t>& lens, const std::vector<int64_t>& rows,
                         fmkv_dtype in, int64_t* added) {
  Scenario s = make_scenario(c, lens, rows);
  Scenario fill = s;
  fill.lens.assign(s.lens.size(), 0);
  fill.rows = s.lens;
  int64_t n0 = 0;
  for (auto x : s.lens) n0 += x;
  *added = 0;
  for (auto x : s.rows) *added += x;
  auto k0 = random_tensor(in, n0, c.num_kv_heads, c.head_dim, 3.0), v0 = random_tensor(in, n0, c.num_kv_heads, c.head_dim);
  LayerState st = run_append(FMKV_BACKEND_REF, fill, make_tensor(k0.data(), in, n0, c.num_kv_heads, c.head_dim),
                             make_tensor(v0.data(), in, n0, c.num_kv_heads, c.head_dim));
  s.pages = st.pages;
  s.fp16_k = st.fp16_k;
  s.fp16_v = st.fp16_v;
  return s;
}

// The longest sequence of the scenario after its query rows (attention) / appended rows (fused step).
inline int64_t max_length_after(const Scenario& s) {
  const std::vector<int64_t> lens = lengths_after(s);
  return lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
}

// Runs attention on backend b over the given layer state; output is fp32 [rows][q_heads][d],
// poisoned with NaN before the call.
inline std::vector<float> run_attention(fmkv_backend b, const Scenario& s, const LayerState& st,
                                        const fmkv_tensor& q_host, fmkv_dtype out_dtype,
                                        fmkv_attention_opts opts = {0.0f, 0.0f, 0}) {
  const std::vector<int64_t> lens = lengths_after(s);  // attention: tokens in cache including the query rows
  DeviceLayer L(b, s, st.pages, st.fp16_k, st.fp16_v, lens);
  DeviceTensor q(b, q_host);
  DeviceOutput o(b, q_host, out_dtype);
  // the workspace of the call's plan: sized for opts.max_seq_len (0: no bound, the most splits)
  const int64_t ws = fmkv_attention_workspace_bytes(b, &s.cfg, q_host.heads, q_host.rows, s.seqs(), opts.max_seq_len);
  DeviceBuf work(b, (size_t)ws + 16);
  check(fmkv_attention(b, &s.cfg, &L.lc, &L.bt, &q.t, &opts, &o.t, work.p, (size_t)ws, nullptr));
  check(fmkv_device_synchronize(b));
  return o.as_f32();
}

// run_attention through fmkv_attention_lse: the fp32 output and lse[row][q head] (the softmax log-denominators),
// both poisoned with NaN before the call.
inline std::pair<std::vector<float>, std::vector<float>> run_attention_lse(fmkv_backend b, const Scenario& s, const LayerState& st,
                                                                           const fmkv_tensor& q_host,
                                                                           fmkv_attention_opts opts = {0.0f, 0.0f, 0}) {
  DeviceLayer L(b, s, st.pages, st.fp16_k, st.fp16_v, lengths_after(s));
  DeviceTensor q(b, q_host);
  DeviceOutput o(b, q_host, FMKV_F32);
  const fmkv_tensor lse_shape = make_tensor(nullptr, FMKV_F32, q_host.rows, q_host.heads, 1);
  DeviceOutput lse(b, lse_shape, FMKV_F32);
  const int64_t ws = fmkv_attention_workspace_bytes(b, &s.cfg, q_host.heads, q_host.rows, s.seqs(), opts.max_seq_len);
  DeviceBuf work(b, (size_t)ws + 16);
  check(fmkv_attention_lse(b, &s.cfg, &L.lc, &L.bt, &q.t, &opts, &o.t, &lse.t, work.p, (size_t)ws, nullptr));
  check(fmkv_device_synchronize(b));
  return {o.as_f32(), lse.as_f32()};
}

// The fused decode step on backend b: appends k/v (s.rows per sequence after s.lens tokens) and
// attends q over the result in one fmkv_append_attention call. Returns the new layer state and the
// fp32 output (poisoned with NaN before the call).
inline std::pair<LayerState, std::vector<float>> run_append_attention(
    fmkv_backend b, const Scenario& s, const fmkv_tensor& k_host, const fmkv_tensor& v_host, const fmkv_tensor& q_host,
    fmkv_dtype out_dtype, fmkv_attention_opts opts = {0.0f, 0.0f, 0}) {
  DeviceLayer L(b, s, s.pages, s.fp16_k, s.fp16_v, s.lens);  // lengths before the append
  DeviceTensor k(b, k_host), v(b, v_host), q(b, q_host);
  DeviceOutput o(b, q_host, out_dtype);
  const int64_t ws = fmkv_attention_workspace_bytes(b, &s.cfg, q_host.heads, q_host.rows, s.seqs(), opts.max_seq_len);
  DeviceBuf work(b, (size_t)ws + 16);
  check(fmkv_append_attention(b, &s.cfg, &L.lc, &L.bt, &k.t, &v.t, &q.t, &opts, &o.t, work.p, (size_t)ws, nullptr));
  check(fmkv_device_synchronize(b));
  return {L.state(s), o.as_f32()};
}

inline fmkv_config config(int32_t d, int32_t kb, int32_t vb, int32_t kv_heads = 2, int32_t page = 16,
                          int32_t sink = 0, int32_t window = 0, int32_t rule = FMKV_SCALE_LSQ) {
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = d;
  c.num_kv_heads = kv_heads;
  c.k_bits = kb;
  c.v_bits = vb;
  c.page_size = page;
  c.sink_tokens = sink;
  c.window_tokens = window;
  c.scale_rule = rule;
  c.seed = rng()();
  return c;
}

}  // namespace fmkv::test
