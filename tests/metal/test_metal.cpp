// Metal backend tests on Linux: the exact MSL kernel text runs in the fiber emulator and is compared
// with the reference backend (src/ref through the public C API, FMKV_BACKEND_REF) on the same inputs:
//   * quantize-append: pages and fp16 regions bit-exact (untouched bytes included; state poisoned
//     with random bytes first), several threadgroup sizes (partial SIMD groups for the fp16 pass)
//     and fiber schedule orders, multi-call appends, sink/window rings, every code width of the format
//     (FMKV_CODE_BITS_MIN..FMKV_CODE_BITS_MAX) and k16, format versions 2 and 3, scale groups 32 and 64;
//   * decode attention: outputs (poisoned with NaN first, workspace too) within the stated relative
//     error (||out - ref|| / ||ref||, as tests/test_backends.cpp) of the float64 reference; the same
//     cases with lse (fmkv_attention_lse: lse poisoned, within 2 x that bound of the reference's lse,
//     output bits equal to the call without lse);
//   * kernel-side error reporting (block table out of range, bad threadgroup size);
//   * the golden vectors of tests/golden (v2, v3, v3_scale_group64, v3_code_width5) reproduced.
// Prints one line per case and a final "N passed, M failed"; exit status 1 on any failure.
// FMKV_METAL_SEED=<n> fixes the inputs (the seed is printed); FMKV_METAL_QUICK=1 runs a subset.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "format/numbers.h"
#include "core/ops.h"
#include "format/quantize_group.h"
#include "format/rotation.h"
#include "ref/quantize.h"
#include "fmkv/fmkv.hpp"
#include "../golden_cases.h"
#include "kernels_emu.h"
#include "metal/host_plan.h"
#include "test_util.h"

namespace {

using emu::Order;
using namespace mtest;


const char* order_name(Order o) { return o == Order::kForward ? "fwd" : o == Order::kReverse ? "rev" : "rand"; }


// Appends one batch (rows per sequence after lens tokens; K / V rows of dtype dt) with the emulated Metal
// kernels, through host_plan.h as backend.mm does; status: the kernels' status words.
void append_metal(Layer& met, const std::vector<int64_t>& lens, const std::vector<int64_t>& offs,
                  std::vector<uint8_t>& kbytes, std::vector<uint8_t>& vbytes, fmkv_dtype dt, uint32_t threads,
                  uint32_t fp16_threads, Order order, uint32_t status[2]) {
  const fmkv_config& c = met.cfg;
  const int64_t total = offs.back();
  fmkv_tensor k = fmkv::make_tensor(kbytes.data(), dt, total, c.num_kv_heads, c.head_dim);
  fmkv_tensor v = fmkv::make_tensor(vbytes.data(), dt, total, c.num_kv_heads, c.head_dim);
  fmkv_batch mb{met.seqs(), met.slots.data(), lens.data(), offs.data(), met.table.data(), met.stride};
  fmkv::AppendArgs a{c, met.cache(), mb, k, v, nullptr};
  const fmkv_metal_append_params p = fmkv::metal::append_params(a);
  const fmkv::metal::AppendLaunch launch = fmkv::metal::append_launch(p, threads);
  emu_kernels::AppendBuffers b{met.pages.data(), met.fk.data(), met.fv.data(), kbytes.data(), vbytes.data(),
                               lens.data(),      offs.data(),    met.table.data(), met.slots.data(), status};
  const uint64_t seed = g_rng();
  if (launch.compress_groups > 0)
    emu_kernels::append_compress(p, b, {launch.compress_groups, launch.compress_threads, order, seed});
  if (launch.fp16_threads > 0)
    emu_kernels::append_fp16(p, b, {(launch.fp16_threads + fp16_threads - 1) / fp16_threads, fp16_threads, order, seed});
}

// Appends one batch with the reference and with the emulated Metal kernels; returns the emulator's
// status words.
void append_both(Layer& ref, Layer& met, const std::vector<int64_t>& lens, const std::vector<int64_t>& rows,
                 fmkv_dtype dt, uint32_t threads, uint32_t fp16_threads, Order order, uint32_t status[2]) {
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
  append_metal(met, lens, offs, kbytes, vbytes, dt, threads, fp16_threads, order, status);
}

// Decode attention with the emulated Metal kernels (lens include the query rows; q_heads query heads);
// out (out_dt) and the workspace are poisoned with NaN first. lse (fmkv_attention_lse): nullptr, or f32
// [rows][q_heads] at element strides (lse_rs, lse_hs), left as the caller poisoned it except where written.
void attention_metal(Layer& L, const std::vector<int64_t>& lens, const std::vector<int64_t>& offs,
                     std::vector<uint8_t>& qbytes, fmkv_dtype q_dt, int32_t q_heads, fmkv_dtype out_dt,
                     const fmkv_attention_opts& opts, int simdgroups, int splits, int merge_simdgroups, Order order,
                     std::vector<uint8_t>& out, uint32_t status[2], float* lse = nullptr, int64_t lse_rs = 0,
                     int64_t lse_hs = 0) {
  const fmkv_config& c = L.cfg;
  const int64_t nrows = offs.back();
  const int d = c.head_dim;
  out.assign((size_t)nrows * q_heads * d * (out_dt == FMKV_F32 ? 4 : 2), 0xFF);  // NaN
  fmkv_tensor q = fmkv::make_tensor(qbytes.data(), q_dt, nrows, q_heads, d);
  fmkv_tensor o = fmkv::make_tensor(out.data(), out_dt, nrows, q_heads, d);
  fmkv_batch bt{L.seqs(), L.slots.data(), lens.data(), offs.data(), L.table.data(), L.stride};
  const fmkv_tensor lt{lse, FMKV_F32, nrows, q_heads, 1, lse_rs, lse_hs};
  fmkv::AttentionArgs a{c, L.cache(), bt, q, o, opts, nullptr, 0, nullptr, lt};
  const fmkv_metal_attention_params p = fmkv::metal::attention_params(a, simdgroups, splits);
  std::vector<float> ws((size_t)fmkv::metal::attention_workspace_floats(p), NAN);
  emu_kernels::AttentionBuffers b{L.pages.data(), L.fk.data(), L.fv.data(),   qbytes.data(), lens.data(),
                                  offs.data(),    L.table.data(), L.slots.data(), ws.data(),  out.data(),
                                  status,         lse};
  const uint64_t seed = g_rng();
  emu_kernels::attention_partial(p, b, {fmkv::metal::attention_partial_groups(p), (uint32_t)simdgroups * 32, order, seed});
  emu_kernels::attention_merge(p, b, {fmkv::metal::attention_merge_groups(p, merge_simdgroups),
                                      (uint32_t)merge_simdgroups * 32, order, seed + 1});
}


struct AppendCase {
  fmkv_config cfg;
  std::vector<int64_t> lens;
  std::vector<std::vector<int64_t>> steps;  // rows per sequence, one entry per append call
  fmkv_dtype dt;
  uint32_t threads, fp16_threads;
  Order order;
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
    append_both(ref, met, lens, st, ac.dt, ac.threads, ac.fp16_threads, ac.order, status);
    if (status[0] || status[1]) err = "kernel status " + std::to_string(status[0]) + "/" + std::to_string(status[1]);
    for (size_t i = 0; i < st.size(); ++i) lens[i] += st[i];
  }
  if (err.empty()) err = first_diff(met.pages, ref.pages, "page bytes");
  if (err.empty()) err = first_diff(met.fk, ref.fk, "fp16_k region");
  if (err.empty()) err = first_diff(met.fv, ref.fv, "fp16_v region");
  char name[256];
  snprintf(name, sizeof name, "append %s %s calls=%zu tg=%u fp16_tg=%u %s", config_name(ac.cfg).c_str(),
           ac.dt == FMKV_F32 ? "f32" : ac.dt == FMKV_F16 ? "f16" : "bf16", ac.steps.size(), ac.threads,
           ac.fp16_threads, order_name(ac.order));
  report(err.empty(), name, err, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}


struct AttentionCase {
  fmkv_config cfg;
  int group;
  std::vector<int64_t> lens, rows;  // lens include the query rows
  fmkv_dtype q_dt, out_dt;
  float scale, softcap;
  int simdgroups, splits, merge_simdgroups;
  Order order;
};

void run_attention_case(const AttentionCase& ac) {
  auto t0 = std::chrono::steady_clock::now();
  const fmkv_config& c = ac.cfg;
  const int d = c.head_dim, HQ = c.num_kv_heads * ac.group;
  Layer L = make_layer(c, ac.lens);
  // Fill the cache with the reference append (the Metal append is tested bit-exact separately).
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
  std::vector<uint8_t> out_ref(nout * out_es, 0xFF), out_met;  // NaN poison
  fmkv_tensor oref = fmkv::make_tensor(out_ref.data(), ac.out_dt, nrows, HQ, d);
  fmkv_batch bt{L.seqs(), L.slots.data(), ac.lens.data(), offs.data(), L.table.data(), L.stride};
  fmkv_layer_cache lc = L.cache();
  fmkv_attention_opts opts{ac.scale, ac.softcap, 0};
  fmkv::check(fmkv_attention(FMKV_BACKEND_REF, &c, &lc, &bt, &q, &opts, &oref, nullptr, 0, nullptr));
  uint32_t status[2] = {0, 0};
  attention_metal(L, ac.lens, offs, qbytes, ac.q_dt, HQ, ac.out_dt, opts, ac.simdgroups, ac.splits,
                  ac.merge_simdgroups, ac.order, out_met, status);
  const double tol = ac.out_dt == FMKV_F32 ? 1e-5 : ac.out_dt == FMKV_F16 ? 2e-3 : 1.2e-2;
  const double err = rel_error(as_floats(out_met, ac.out_dt, nout), as_floats(out_ref, ac.out_dt, nout));
  std::string detail;
  char buf[160];
  snprintf(buf, sizeof buf, "rel error %.3g (bound %.0e)", err, tol);
  detail = buf;
  if (status[0] || status[1]) detail += ", kernel status " + std::to_string(status[0]) + "/" + std::to_string(status[1]);
  char name[300];
  int64_t maxq = *std::max_element(ac.rows.begin(), ac.rows.end());
  snprintf(name, sizeof name, "attention %s group%d q_len<=%lld %s->%s scale=%g cap=%g sg=%d splits=%d merge_sg=%d %s",
           config_name(c).c_str(), ac.group, (long long)maxq, ac.q_dt == FMKV_F32 ? "f32" : ac.q_dt == FMKV_F16 ? "f16" : "bf16",
           ac.out_dt == FMKV_F32 ? "f32" : ac.out_dt == FMKV_F16 ? "f16" : "bf16", ac.scale, ac.softcap, ac.simdgroups,
           ac.splits, ac.merge_simdgroups, order_name(ac.order));
  report(err <= tol && !status[0] && !status[1], name, detail,
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  // fmkv_attention_lse on the same inputs: lse (poisoned with NaN: an element the merge does not write fails)
  // within 2 x the attention bound of the float64 reference's, |lse - ref| / (1 + |ref|) (as
  // Backends.AttentionLseMatchesReference), and the output bits equal to the call without lse above. Every
  // other case stores lse head-major ([q heads][rows]), so the kernel's strides are exercised too.
  t0 = std::chrono::steady_clock::now();
  static int lse_cases = 0;
  const bool head_major = lse_cases++ % 2 == 1;
  std::vector<float> lse_ref((size_t)nrows * HQ, NAN), lse_met((size_t)nrows * HQ, NAN);
  std::vector<uint8_t> out_ref2(nout * out_es, 0xFF), out_lse;
  fmkv_tensor oref2 = fmkv::make_tensor(out_ref2.data(), ac.out_dt, nrows, HQ, d);
  fmkv_tensor lref = fmkv::make_tensor(lse_ref.data(), FMKV_F32, nrows, HQ, 1);
  fmkv::check(fmkv_attention_lse(FMKV_BACKEND_REF, &c, &lc, &bt, &q, &opts, &oref2, &lref, nullptr, 0, nullptr));
  const int64_t lrs = head_major ? 1 : HQ, lhs = head_major ? nrows : 1;
  uint32_t lstatus[2] = {0, 0};
  attention_metal(L, ac.lens, offs, qbytes, ac.q_dt, HQ, ac.out_dt, opts, ac.simdgroups, ac.splits,
                  ac.merge_simdgroups, ac.order, out_lse, lstatus, lse_met.data(), lrs, lhs);
  const double lse_tol = 2.0 * 1e-5;  // 2 x the stated attention bound (backend.mm attention_rel_error)
  const auto verdict =
      lse_case_verdict(lse_met, lse_ref, nrows, HQ, lrs, lhs, lse_tol, out_lse == out_met, lstatus[0], lstatus[1]);
  report(verdict.first, std::string("lse ") + name + (head_major ? " lse head-major" : ""), verdict.second,
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// Golden vectors (tests/golden/v<version><suffix>.txt, written by the reference; cases and inputs in tests/golden_cases.h):
// the emulated Metal kernels reproduce the page bytes (a pool of 0xA5 bytes: unwritten slots of partly filled
// pages and tile blocks keep them) and fp16 region bytes exactly, and the attention output within 1e-5 relative.
// FMKV_GOLDEN_DIR overrides the directory (default tests/golden, run.sh runs from the repository root). Every case
// runs, scale group 64 included.
std::string hex_of(const void* p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += digits[((const uint8_t*)p)[i] >> 4];
    s += digits[((const uint8_t*)p)[i] & 15];
  }
  return s;
}

void run_golden_cases(int32_t version, const std::vector<fmkv::test::GoldenCase>& cases, const std::string& suffix = "") {
  using namespace fmkv::test;
  const char* dir = std::getenv("FMKV_GOLDEN_DIR");
  const std::string path = std::string(dir ? dir : "tests/golden") + "/v" + std::to_string(version) + suffix + ".txt";
  std::vector<std::string> lines;
  {
    FILE* f = std::fopen(path.c_str(), "r");
    std::string cur;
    for (int ch; f && (ch = std::fgetc(f)) != EOF;) {
      if (ch != '\n') {
        cur += (char)ch;
        continue;
      }
      if (!cur.empty() && cur[0] != '#') lines.push_back(cur);
      cur.clear();
    }
    if (f) std::fclose(f);
  }
  if (lines.size() != 4 * cases.size()) {
    report(false, "golden v" + std::to_string(version) + suffix, path + " missing or malformed", 0.0);
    return;
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    const GoldenCase& g = cases[i];
    Layer L;
    L.cfg = golden_config(g, (int)i, version);
    const fmkv_config& c = L.cfg;
    L.layer = (int32_t)i;
    L.stride = (int64_t)kGoldenTable.size();
    L.num_pages = kGoldenPages;
    L.table = kGoldenTable;
    L.slots = {0};
    L.pages.assign((size_t)(kGoldenPages * fmkv_config_page_bytes(&c)), 0xA5);
    L.fk.assign((size_t)fmkv_config_fp16_slot_bytes(&c) / 4, 0x7E00);
    L.fv = L.fk;
    const size_t n = (size_t)g.tokens * g.d;
    auto bytes_of = [](const std::vector<uint16_t>& h) {
      std::vector<uint8_t> b(h.size() * 2 + 16);
      std::memcpy(b.data(), h.data(), h.size() * 2);
      return b;
    };
    std::vector<uint8_t> kb = bytes_of(golden_values(100 + i, n)), vb = bytes_of(golden_values(200 + i, n));
    std::vector<uint8_t> qb = bytes_of(golden_values(300 + i, (size_t)2 * g.d));
    const Order order = (Order)(i % 3);
    uint32_t status[2] = {0, 0};
    append_metal(L, {0}, {0, g.tokens}, kb, vb, FMKV_F16, 32u * (uint32_t)(1 + i % 4), 64, order, status);
    std::string err;
    if (hex_of(L.pages.data(), L.pages.size()) != lines[4 * i + 1]) {
      const std::string got = hex_of(L.pages.data(), L.pages.size());
      size_t at = 0;
      while (at < got.size() && at < lines[4 * i + 1].size() && got[at] == lines[4 * i + 1][at]) ++at;
      err = "page bytes differ from the golden file at byte " + std::to_string(at / 2);
    }
    const std::string fp16 = L.fk.empty() ? "-" : hex_of(L.fk.data(), L.fk.size() * 2) + hex_of(L.fv.data(), L.fv.size() * 2);
    if (err.empty() && fp16 != lines[4 * i + 2]) err = "fp16 region bytes differ from the golden file";
    std::vector<uint8_t> out;
    uint32_t st2[2] = {0, 0};
    attention_metal(L, {g.tokens}, {0, 1}, qb, FMKV_F16, 2, FMKV_F32, fmkv_attention_opts{0.0f, 0.0f, 0}, 2, 2, 1, order,
                    out, st2);
    const std::string& h = lines[4 * i + 3];
    std::vector<float> want((size_t)2 * g.d);
    double rel = 1.0;
    if (h.size() == want.size() * 8) {
      for (size_t j = 0; j < want.size(); ++j) {
        uint8_t b4[4];
        for (int k = 0; k < 4; ++k) b4[k] = (uint8_t)std::stoul(h.substr(j * 8 + k * 2, 2), nullptr, 16);
        std::memcpy(&want[j], b4, 4);
      }
      rel = rel_error(as_floats(out, FMKV_F32, want.size()), want);
    }
    if (err.empty() && !(rel <= 1e-5)) err = "attention rel error " + std::to_string(rel) + " vs the golden output";
    if (status[0] || status[1] || st2[0] || st2[1]) err += " kernel status set";
    char name[200];
    snprintf(name, sizeof name, "golden v%d%s: %s (%s)", version, suffix.c_str(), lines[4 * i].c_str(), order_name(order));
    char detail[64];
    snprintf(detail, sizeof detail, "pages and fp16 bytes equal, attention rel error %.3g", rel);
    report(err.empty(), name, err.empty() ? detail : err,
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

// Per-SIMD-group primitives of kernel_core.h (tests/metal/core_test.metal) against the scalar
// definitions (src/format: tree_sum32 / quantize_scale_group_table, pack_group_words, rotate), bit for bit, on
// adversarial inputs: wide dynamic range (summation order shows: the code group sums and the scale group sums,
// which with scale group 64 add two code groups of different kinds, are compared as float32 bits), values exactly
// on decision thresholds of the scale group's scale (ties), zero / -0 / subnormal / overflowing groups (saturating
// scales). sg: fmkv_config.scale_group (32 or 64).
void run_core_case(int d, int bits, int rule, int table, int sg, uint32_t threads, Order order) {
  auto t0 = std::chrono::steady_clock::now();
  const int G = d / 32, nvec = 48, n = 1 << fmkv_scale_shift(sg);
  std::vector<float> x((size_t)nvec * d);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-40, 40);
  auto kind_of = [](int vi, int g) { return (vi + g) % 6; };
  auto ties_kind = [&](int vi, int g) { return kind_of(vi, g) == 2 || kind_of(vi, g) == 5; };
  // The RMS scale s0 of the scale group at y (n code groups), as float: the reference's sum order.
  auto scale_group_s0 = [&](const float* y) {
    float ss = 0.0f;
    for (int h = 0; h < n; ++h) {
      float t[32];
      for (int j = 0; j < 32; ++j) t[j] = y[32 * h + j] * y[32 * h + j];
      ss = h == 0 ? fmkv::tree_sum32(t) : ss + fmkv::tree_sum32(t);
    }
    return fmkv::f16_to_f32(fmkv::rms_scale(ss, 32 * n));
  };
  for (int vi = 0; vi < nvec; ++vi)
    for (int g = 0; g < G; ++g) {
      float* y = &x[((size_t)vi * G + g) * 32];
      const int kind = kind_of(vi, g);
      for (int j = 0; j < 32; ++j) {
        if (kind == 0) y[j] = nd(g_rng) * std::pow(10.0f, (float)(g_rng() % 7) - 3.0f);
        else if (kind == 1) y[j] = (g_rng() & 1 ? -1.0f : 1.0f) * std::ldexp(1.0f + (float)(g_rng() % 1024) / 1024.0f, ex(g_rng));
        else if (kind == 2 || kind == 5) y[j] = nd(g_rng);
        else if (kind == 3 && vi % 2) y[j] = j % 3 == 0 ? 0.0f : j % 3 == 1 ? -0.0f : (j == 2 ? 1e-41f : 0.0f);
        else if (kind == 3) y[j] = j % 4 == 1 ? -0.0f : j % 4 == 3 ? 0.0f : nd(g_rng);  // -0 codes as positive
        else y[j] = (j % 2 ? -1.0f : 1.0f) * (vi % 2 ? 1e30f : 3.0e-39f) * (1.0f + (float)j / 32.0f);
      }
    }
  // Put coordinates of the tie groups exactly on thresholds of their scale group's fp16 scale.
  for (int vi = 0; vi < nvec; ++vi)
    for (int g0 = 0; g0 < G; g0 += n) {
      float* ys = &x[((size_t)vi * G + g0) * 32];
      int ms[2][32];
      for (int h = 0; h < n; ++h)
        for (int j = 0; j < 32; ++j) ms[h][j] = (int)(g_rng() % (uint64_t)(fmkv::magnitude_count(bits) - 1));
      for (int it = 0; it < 8; ++it) {  // iterate to a fixed point of the scale group's fp16 scale
        const float s0f = scale_group_s0(ys);
        for (int h = 0; h < n; ++h)
          if (ties_kind(vi, g0 + h))
            for (int j = 0; j < 32; j += 3)
              ys[32 * h + j] = (j % 2 ? -1.0f : 1.0f) * fmkv::table_threshold(table, bits, ms[h][j]) * s0f;
      }
    }
  const size_t nsum = (size_t)nvec * G * 32;
  std::vector<float> sums(nsum, NAN), gsums(nsum, NAN), rot((size_t)nvec * d, NAN);
  std::vector<uint32_t> codes((size_t)nvec * d, 0xDEADBEEFu), words((size_t)nvec * G * FMKV_CODE_BITS_MAX, 0xDEADBEEFu);
  std::vector<uint16_t> scales((size_t)nvec * G, 0xFFFFu);
  emu_kernels::CoreTestParams p{d, bits, rule, (int32_t)(g_rng() % 40), g_rng(), nvec, table, sg, 0};
  emu_kernels::CoreTestBuffers b{x.data(), sums.data(), rot.data(), codes.data(), scales.data(), words.data(),
                                 gsums.data()};
  const uint32_t nsg = threads / 32;
  emu_kernels::core_test(p, b, {(uint32_t)((nvec + nsg - 1) / nsg), threads, order, g_rng()});
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
    }
    for (int g0 = 0; g0 < G && err.empty(); g0 += n) {
      const float* ys = &x[((size_t)vi * G + g0) * 32];
      float want = 0.0f;  // the scale group's sum in the reference's order (quantize_scale_group_table)
      for (int h = 0; h < n; ++h) {
        float t[32];
        std::memcpy(t, ys + 32 * h, sizeof t);
        want = h == 0 ? fmkv::tree_sum32(t) : want + fmkv::tree_sum32(t);
      }
      for (int h = 0; h < n; ++h)
        for (int lane = 0; lane < 32 && err.empty(); ++lane) {
          const float got = gsums[((size_t)vi * G + g0 + h) * 32 + lane];
          if (h == 0 ? fmkv::f32_bits(got) != fmkv::f32_bits(want) : !std::isnan(got))
            err = "scale group sum differs from the reference's order (vector " + std::to_string(vi) + ", scale group " +
                  std::to_string(g0 / n) + ", lane " + std::to_string(lane) + ")";
        }
      uint8_t rc[64];
      const uint16_t rs = fmkv::quantize_scale_group_table(ys, n, bits, table, rule, rc);
      const std::string at = " (vector " + std::to_string(vi) + ", scale group " + std::to_string(g0 / n) + ")";
      if (scales[(size_t)vi * G + g0] != rs) err = "scale differs" + at;
      for (int h = 1; h < n && err.empty(); ++h)
        if (scales[(size_t)vi * G + g0 + h] != 0xFFFFu) err = "scale slot of a second code group written" + at;
      for (int h = 0; h < n && err.empty(); ++h) {
        const int g = g0 + h;
        uint32_t rw[FMKV_CODE_BITS_MAX] = {};
        fmkv::ref::pack_group(rc + 32 * h, bits, rw, 1);
        for (int j = 0; j < 32 && err.empty(); ++j)
          if (codes[(size_t)vi * d + g * 32 + j] != rc[32 * h + j]) err = "code differs" + at;
        for (int w = 0; w < bits && err.empty(); ++w)
          if (words[((size_t)vi * G + g) * FMKV_CODE_BITS_MAX + w] != rw[w]) err = "code word " + std::to_string(w) + " differs" + at;
      }
      const float s0f = scale_group_s0(ys);  // count coordinates that landed on a threshold
      for (int h = 0; h < n; ++h)
        if (ties_kind(vi, g0 + h))
          for (int j = 0; j < 32; ++j)
            for (int m = 0; m + 1 < fmkv::magnitude_count(bits); ++m)
              ties += s0f != 0.0f && std::fabs(ys[32 * h + j] / s0f) == fmkv::table_threshold(table, bits, m);
    }
  }
  char name[192];
  snprintf(name, sizeof name, "core primitives d%d %d-bit table%d %s sg%d tg=%u %s (tree sums, FWHT, scale, codes, code words)",
           d, bits, table, rule ? "lsq" : "rms", fmkv_resolved_scale_group(sg), threads, order_name(order));
  report(err.empty() && ties > 0, name, err.empty() ? std::to_string(ties) + " threshold ties" : err,
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// Kernel-side error reporting: an out-of-range block table entry sets status[0] and writes nothing
// for that token; a threadgroup size that is not a multiple of 32 sets status[1].
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
  emu_kernels::AppendBuffers b{L.pages.data(), L.fk.data(), L.fv.data(), kb.data(), vb.data(), lens.data(),
                               offs.data(),    L.table.data(), L.slots.data(), status};
  auto launch = fmkv::metal::append_launch(p, 64);
  emu_kernels::append_compress(p, b, {launch.compress_groups, 64, Order::kForward, 1});
  // Only page table[0] may have changed.
  const int64_t pb = fmkv_config_page_bytes(&c);
  bool outside_untouched = true;
  for (int64_t pg = 0; pg < L.num_pages; ++pg)
    if (pg != L.table[0])
      outside_untouched = outside_untouched && std::equal(before.begin() + pg * pb, before.begin() + (pg + 1) * pb,
                                                          L.pages.begin() + pg * pb);
  report(status[0] == FMKV_METAL_ERR_BLOCK_TABLE && status[1] == 0 && outside_untouched,
         "append: out-of-range block table entry is reported, nothing written for it",
         "status " + std::to_string(status[0]) + "/" + std::to_string(status[1]),
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  t0 = std::chrono::steady_clock::now();
  uint32_t st2[2] = {0, 0};
  b.status = st2;
  const std::vector<uint8_t> before2 = L.pages;
  emu_kernels::append_compress(p, b, {4, 48, Order::kForward, 1});
  report(st2[1] == FMKV_METAL_ERR_LAUNCH && L.pages == before2,
         "append: threadgroup size 48 (partial SIMD group) is refused by the SIMD-group kernel",
         "status " + std::to_string(st2[0]) + "/" + std::to_string(st2[1]),
         std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// The parameter blocks must have the layout python/fmkv/mlx/kernels.py packs (no implicit padding).
void run_layout_case() {
  bool ok = sizeof(fmkv_metal_append_params) == 136 && sizeof(fmkv_metal_attention_params) == 184 &&
            offsetof(fmkv_metal_append_params, seed) == 32 && offsetof(fmkv_metal_append_params, page_bytes) == 120 &&
            offsetof(fmkv_metal_append_params, format_version) == 128 &&
            offsetof(fmkv_metal_append_params, scale_group) == 132 &&
            offsetof(fmkv_metal_attention_params, softmax_scale) == 120 &&
            offsetof(fmkv_metal_attention_params, format_version) == 148 &&
            offsetof(fmkv_metal_attention_params, page_bytes) == 152 &&
            offsetof(fmkv_metal_attention_params, scale_group) == 160 &&
            offsetof(fmkv_metal_attention_params, has_lse) == 164 &&
            offsetof(fmkv_metal_attention_params, lse_row_stride) == 168 &&
            offsetof(fmkv_metal_attention_params, lse_head_stride) == 176;
  char d[128];
  snprintf(d, sizeof d, "sizeof append %zu, attention %zu", sizeof(fmkv_metal_append_params),
           sizeof(fmkv_metal_attention_params));
  report(ok, "parameter block layout (136 / 184 bytes, natural alignment, no padding)", d, 0.0);
}

// Parameter blocks of a fixed configuration as hex, for tests/metal/run.sh to compare with
// python/fmkv/mlx/kernels.py's packing.
int dump_params() {
  fmkv_config c = make_config(128, 3, 4, 2, 16, 2, 8, FMKV_SCALE_RMS);
  c.seed = 0x1234567890abcdefull;
  c.format_version = 3;
  c.scale_group = 64;
  std::vector<int64_t> lens{40, 100}, offs{0, 3, 4};
  std::vector<int32_t> slots{1, 0}, table(18, 0);
  fmkv_layer_cache lc{nullptr, 77, nullptr, nullptr, 3, 5};
  fmkv_batch bt{2, slots.data(), lens.data(), offs.data(), table.data(), 9};
  fmkv_tensor k{nullptr, FMKV_F16, 4, 2, 128, 256, 128}, v{nullptr, FMKV_BF16, 4, 2, 128, 256, 128};
  fmkv::AppendArgs a{c, lc, bt, k, v, nullptr};
  const fmkv_metal_append_params ap = fmkv::metal::append_params(a);
  fmkv_tensor q{nullptr, FMKV_F32, 4, 8, 128, 1024, 128}, out{nullptr, FMKV_F16, 4, 8, 128, 1024, 128};
  fmkv::AttentionArgs at{c, lc, bt, q, out, fmkv_attention_opts{0.0f, 30.0f, 0}, nullptr, 0, nullptr};
  const fmkv_metal_attention_params tp = fmkv::metal::attention_params(at, 4, 3);
  const unsigned char* b = (const unsigned char*)&ap;
  for (size_t i = 0; i < sizeof ap; ++i) printf("%02x", b[i]);
  printf("\n");
  b = (const unsigned char*)&tp;
  for (size_t i = 0; i < sizeof tp; ++i) printf("%02x", b[i]);
  printf("\n");
  return 0;
}

// Emulator self-tests: each scenario breaks one rule and must abort with the emulator's message
// (tests/metal/run.sh runs them as negative controls). Scenario "ok" must run cleanly.
int emulator_selftest(const std::string& what) {
  using emu::Op;
  auto run = [&](uint32_t threads, const std::function<void(const emu::ThreadIds&)>& body) {
    emu::dispatch(1, threads, Order::kRandom, 7, body);
  };
  if (what == "ok") {  // shuffles, ballots and a barrier in a 64-thread group
    run(64, [](const emu::ThreadIds& t) {
      uint64_t v = emu::sync_op(Op::kShuffleXor, t.lane, 5);
      uint64_t b = emu::sync_op(Op::kBallot, t.lane & 1, 0);
      emu::sync_op(Op::kBarrier, 0, 0);
      if (v != (t.lane ^ 5u) || b != 0xAAAAAAAAull) emu::fail("wrong shuffle/ballot result");
    });
  } else if (what == "divergent") {  // half the lanes shuffle, the other half ballot
    run(32, [](const emu::ThreadIds& t) {
      if (t.lane < 16) emu::sync_op(Op::kShuffleXor, 1, 1);
      else emu::sync_op(Op::kBallot, 1, 0);
    });
  } else if (what == "exited") {  // lanes return before a SIMD operation of the others
    run(32, [](const emu::ThreadIds& t) {
      if (t.lane >= 8) emu::sync_op(Op::kShuffleXor, 1, 1);
    });
  } else if (what == "partial") {  // xor-shuffle across a 20-lane partial SIMD group
    run(52, [](const emu::ThreadIds& t) { emu::sync_op(Op::kShuffleXor, 1, 16); });
  } else if (what == "barrier") {  // a barrier some threads never reach
    run(64, [](const emu::ThreadIds& t) {
      if (t.simdgroup == 0) emu::sync_op(Op::kBarrier, 0, 0);
    });
  } else if (what == "tgmem") {  // more than 32 KiB of threadgroup memory
    run(32, [](const emu::ThreadIds&) {
      static const char k1 = 0, k2 = 0;
      emu::threadgroup_alloc(&k1, 20000);
      emu::threadgroup_alloc(&k2, 20000);
    });
  } else {
    fprintf(stderr, "unknown self-test %s\n", what.c_str());
    return 2;
  }
  printf("self-test %s ran to completion\n", what.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--dump-params") return dump_params();
  if (argc > 2 && std::string(argv[1]) == "--emulator-selftest") return emulator_selftest(argv[2]);
  const char* seed_env = std::getenv("FMKV_METAL_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10)
                                 : (uint64_t)std::chrono::system_clock::now().time_since_epoch().count() % 1000000007ull;
  const bool quick = std::getenv("FMKV_METAL_QUICK") != nullptr;
  g_rng.seed(seed);
  printf("metal emulator tests, FMKV_METAL_SEED=%llu\n", (unsigned long long)seed);
  auto t0 = std::chrono::steady_clock::now();

  run_layout_case();

  // ---- kernel core primitives, bit-exact on adversarial inputs ----
  for (int d : {64, 128, 256})
    for (int bits = FMKV_CODE_BITS_MIN; bits <= FMKV_CODE_BITS_MAX; ++bits)
      for (int rule : {0, 1}) {
        if (quick && (d + bits + rule) % 2) continue;
        run_core_case(d, bits, rule, 0, 0, 32u * (uint32_t)(1 + (d / 64 + bits + rule) % 4), (Order)((bits + rule) % 3));
      }
  // format 3's 3-bit codebooks: table 1 (K) and 2 (V), integer levels x fp16 step
  for (int d : {64, 128, 256})
    for (int table : {1, 2})
      for (int rule : {0, 1}) {
        if (quick && (d / 64 + table + rule) % 2) continue;
        run_core_case(d, 3, rule, table, 0, 32u * (uint32_t)(1 + (d / 64 + table + rule) % 4), (Order)((table + rule) % 3));
      }
  // scale group 64: one scale per two code groups (two registers of a lane), every width and codebook table
  for (int d : {64, 128, 256})
    for (int bits = FMKV_CODE_BITS_MIN; bits <= FMKV_CODE_BITS_MAX; ++bits)
      for (int table = 0; table <= (bits == 3 ? 2 : 0); ++table)
        for (int rule : {0, 1}) {
          if (quick && (d / 64 + bits + table + rule) % 2) continue;
          run_core_case(d, bits, rule, table, 64, 32u * (uint32_t)(1 + (d / 64 + bits + table + rule) % 4),
                        (Order)((bits + table + rule + 1) % 3));
        }

  // ---- quantize-append, bit-exact ----
  std::vector<AppendCase> ap;
  std::vector<int> k_widths, v_widths;  // every width of the format (K also fp16)
  for (int b = FMKV_CODE_BITS_MIN; b <= FMKV_CODE_BITS_MAX; ++b) v_widths.push_back(b);
  k_widths = v_widths;
  k_widths.push_back(FMKV_FP16_BITS);
  for (int d : {64, 128, 256})
    for (int kb : k_widths)
      for (int vb : v_widths) {
        if (quick && (kb + vb + d / 64) % 3 != 0) continue;
        int page = kb == 3 ? 16 : kb == 4 ? 64 : 32;
        Order o = (Order)((kb + vb) % 3);
        ap.push_back({make_config(d, kb, vb, 2, page, 0, 0, (kb + vb) % 2), {37, 0, 20}, {{3, 17, 2}}, FMKV_F16,
                      (uint32_t)(32 * (1 + (d + kb + vb) % 4)), 64, o});
      }
  ap.push_back({make_config(128, 3, 3, 2, 16, 4, 16, FMKV_SCALE_LSQ), {30, 9, 0}, {{1, 16, 25}}, FMKV_BF16, 96, 48,
                Order::kReverse});
  ap.push_back({make_config(64, 4, 2, 3, 128, 0, 32, FMKV_SCALE_RMS), {50}, {{40}}, FMKV_F32, 32, 7, Order::kRandom});
  ap.push_back({make_config(128, 2, 2, 1, 256, 2, 0, FMKV_SCALE_LSQ), {70, 1}, {{1, 12}}, FMKV_F16, 128, 33,
                Order::kRandom});
  ap.push_back({make_config(256, 16, 4, 2, 16, 3, 5, FMKV_SCALE_LSQ), {10, 0}, {{4, 9}}, FMKV_F32, 64, 1,
                Order::kReverse});
  ap.push_back({make_config(128, 3, 4, 2, 16, 2, 8, FMKV_SCALE_RMS), {0, 5}, {{7, 3}, {1, 1}, {12, 0}, {0, 9}},
                FMKV_F16, 64, 64, Order::kRandom});
  ap.push_back({make_config(64, 2, 4, 2, 32, 3, 6, FMKV_SCALE_LSQ), {5, 9, 0}, {{4, 0, 30}, {0, 2, 0}}, FMKV_F16, 64,
                40, Order::kReverse});  // sequences without rows
  for (Order o : {Order::kForward, Order::kReverse, Order::kRandom})
    for (uint32_t tg : {32u, 96u, 256u}) {
      if (quick && tg != 96u) continue;
      ap.push_back({make_config(256, 4, 3, 1, 16, 1, 4, FMKV_SCALE_LSQ), {3, 20}, {{9, 2}}, FMKV_F32, tg, tg / 2 + 1, o});
    }
  // Format version 3 (tests/test_backends.cpp FormatVersion3MatchesOrIsRefused): 3-bit sections in tile blocks of
  // 16 slots. Calls start mid-tile and end in partial tiles, so one tile block is written by several calls and,
  // within a call, by several SIMD groups of one threadgroup (their fibers interleave at every SIMD-group
  // operation) and by several threadgroups; bytes of slots no call writes (random) must survive.
  ap.push_back({make_config3(64, 3, 3, 2, 16, 0, 0, FMKV_SCALE_LSQ), {5, 0, 29}, {{3, 17, 2}, {9, 1, 16}, {1, 30, 5}},
                FMKV_F16, 256, 64, Order::kRandom});
  ap.push_back({make_config3(64, 3, 3, 1, 16, 0, 0, FMKV_SCALE_RMS), {7, 1}, {{11, 2}, {13, 29}}, FMKV_F32, 1024, 64,
                Order::kReverse});
  ap.push_back({make_config3(128, 3, 3, 2, 64, 4, 16, FMKV_SCALE_LSQ), {30, 9, 0}, {{1, 16, 25}, {21, 3, 40}, {2, 1, 1}},
                FMKV_BF16, 128, 48, Order::kRandom});
  ap.push_back({make_config3(256, 3, 2, 1, 32, 0, 0, FMKV_SCALE_RMS), {13}, {{20}, {1}, {35}}, FMKV_F16, 256, 64,
                Order::kForward});
  ap.push_back({make_config3(128, 16, 3, 2, 16, 0, 32, FMKV_SCALE_LSQ), {40, 33}, {{9, 1}, {30, 17}}, FMKV_F16, 192, 64,
                Order::kRandom});
  ap.push_back({make_config3(128, 4, 3, 2, 128, 2, 0, FMKV_SCALE_LSQ), {70}, {{25}, {6}, {40}}, FMKV_F32, 128, 33,
                Order::kReverse});
  ap.push_back({make_config3(256, 2, 3, 2, 16, 1, 3, FMKV_SCALE_LSQ), {3, 20}, {{9, 2}, {18, 7}}, FMKV_F16, 96, 64,
                Order::kRandom});
  ap.push_back({make_config3(64, 3, 4, 2, 32, 3, 6, FMKV_SCALE_LSQ), {5, 9, 0}, {{4, 0, 30}, {0, 2, 0}, {17, 5, 1}},
                FMKV_F16, 64, 40, Order::kForward});  // sequences without rows
  // 5-bit codes (magnitude nibble words + sign plane): K, V and both, with a tiled 3-bit side, sinks / windows,
  // multi-call appends, formats 2 and 3.
  ap.push_back({make_config(64, 5, 4, 2, 16, 2, 8, FMKV_SCALE_LSQ), {5, 0, 29}, {{3, 17, 2}, {9, 1, 16}}, FMKV_BF16, 96,
                48, Order::kRandom});
  ap.push_back({make_config(128, 4, 5, 2, 32, 0, 16, FMKV_SCALE_RMS), {40, 3}, {{1, 20}, {33, 2}}, FMKV_F32, 64, 33,
                Order::kReverse});
  ap.push_back({make_config(128, 5, 5, 1, 64, 3, 0, FMKV_SCALE_LSQ), {70}, {{25}, {6}}, FMKV_F16, 128, 64,
                Order::kForward});
  ap.push_back({make_config3(64, 5, 5, 2, 32, 0, 0, FMKV_SCALE_RMS), {13, 1}, {{20, 3}, {1, 40}}, FMKV_F16, 256, 64,
                Order::kRandom});
  ap.push_back({make_config3(128, 5, 4, 2, 16, 2, 4, FMKV_SCALE_LSQ), {30, 9, 0}, {{1, 16, 25}, {21, 3, 4}}, FMKV_BF16,
                96, 48, Order::kReverse});
  ap.push_back({make_config3(128, 4, 5, 1, 128, 0, 32, FMKV_SCALE_LSQ), {50}, {{40}, {3}}, FMKV_F32, 32, 7,
                Order::kRandom});
  ap.push_back({make_config3(64, 5, 3, 2, 16, 1, 3, FMKV_SCALE_LSQ), {3, 20}, {{9, 2}, {18, 7}}, FMKV_F16, 64, 64,
                Order::kForward});  // 3-bit V in tile blocks
  ap.push_back({make_config3(128, 3, 5, 2, 16, 0, 0, FMKV_SCALE_RMS), {5, 29}, {{3, 17}, {9, 16}}, FMKV_F16, 192, 64,
                Order::kRandom});  // 3-bit K in tile blocks
  ap.push_back({make_config3(128, 16, 5, 2, 16, 0, 16, FMKV_SCALE_LSQ), {40, 33}, {{9, 1}, {30, 17}}, FMKV_F16, 64, 64,
                Order::kReverse});
  // Scale group 64 (one fp16 scale per 64 rotated coordinates: at d 64 one per vector), formats 2 and 3 (3-bit
  // sides in tile blocks), both rules, sinks / windows, multi-call appends, every input dtype.
  auto sg64 = [](fmkv_config c) {
    c.scale_group = 64;
    return c;
  };
  const int sg_widths[][2] = {{2, 2}, {3, 3}, {4, 3}, {5, 4}, {16, 3}};
  for (int d : {64, 128, 256})
    for (int i = 0; i < 5; ++i)
      for (int fmt : {2, 3}) {
        const int kb = sg_widths[i][0], vb = sg_widths[i][1], rule = (i + fmt + d / 64) % 2;
        if (quick && (i + fmt + d / 64) % 3 != 0) continue;
        const int sink = i % 3 == 1 ? 2 : 0, window = (i + fmt) % 2 ? 8 : 0, page = (i + d / 64) % 2 ? 16 : 32;
        fmkv_config c = fmt == 3 ? make_config3(d, kb, vb, 2, page, sink, window, rule)
                                 : make_config(d, kb, vb, 2, page, sink, window, rule);
        const fmkv_dtype dt = (fmkv_dtype)((i + fmt) % 3 == 0 ? FMKV_F16 : (i + fmt) % 3 == 1 ? FMKV_BF16 : FMKV_F32);
        ap.push_back({sg64(c), {5, 0, 29}, {{3, 17, 2}, {9, 1, 16}, {1, 30, 5}}, dt,
                      (uint32_t)(32 * (1 + (d / 32 + i + fmt) % 4)), 48, (Order)((i + fmt + d / 64) % 3)});
      }
  ap.push_back({sg64(make_config(128, 3, 3, 1, 16, 4, 16, FMKV_SCALE_LSQ)), {30, 9, 0}, {{1, 16, 25}, {21, 3, 40}},
                FMKV_BF16, 1024, 64, Order::kRandom});
  ap.push_back({sg64(make_config3(64, 2, 3, 2, 16, 0, 0, FMKV_SCALE_RMS)), {7, 1}, {{11, 2}, {13, 29}}, FMKV_F32, 256,
                64, Order::kReverse});
  for (auto& c : ap) run_append_case(c);

  // ---- decode attention ----
  std::vector<AttentionCase> at;
  for (int d : {64, 128, 256})
    for (int kb : k_widths) {
      if (quick && (kb + d / 64) % 2) continue;
      int vb = kb == FMKV_FP16_BITS ? FMKV_CODE_BITS_MAX : kb == FMKV_CODE_BITS_MAX ? 4 : kb == 4 ? 2 : kb + 1;
      int page = kb == 3 ? 16 : 32;
      at.push_back({make_config(d, kb, vb, 2, page, 0, 0, (kb + vb) % 2), 2, {37, 5, 90}, {1, 3, 1}, FMKV_F32, FMKV_F32,
                    0.0f, 0.0f, 1 + (d / 64 + kb) % 3, 1 + kb % 3, 2, (Order)((d / 64 + kb) % 3)});
    }
  at.push_back({make_config(128, 3, 3, 2, 16, 4, 16, FMKV_SCALE_LSQ), 4, {120, 9, 30}, {16, 2, 5}, FMKV_BF16,
                FMKV_F32, 0.0f, 0.0f, 4, 2, 1, Order::kRandom});
  at.push_back({make_config(64, 4, 2, 3, 128, 0, 32, FMKV_SCALE_RMS), 3, {150}, {7}, FMKV_F32, FMKV_F16, 0.2f, 0.0f,
                2, 3, 4, Order::kReverse});
  at.push_back({make_config(128, 2, 2, 1, 256, 2, 0, FMKV_SCALE_LSQ), 8, {100, 13}, {1, 12}, FMKV_F16, FMKV_F32, 0.0f,
                30.0f, 3, 1, 2, Order::kForward});
  at.push_back({make_config(256, 16, 4, 2, 16, 3, 5, FMKV_SCALE_LSQ), 1, {40, 6}, {2, 6}, FMKV_F32, FMKV_BF16, 0.0f,
                5.0f, 1, 4, 1, Order::kRandom});
  at.push_back({make_config(64, 3, 4, 1, 16, 1, 1, FMKV_SCALE_LSQ), 1, {1, 2, 17}, {1, 2, 16}, FMKV_F32, FMKV_F32,
                0.0f, 0.0f, 2, 5, 1, Order::kReverse});
  at.push_back({make_config(128, 4, 3, 2, 16, 2, 4, FMKV_SCALE_RMS), 2, {30, 7, 12}, {2, 0, 3}, FMKV_F16, FMKV_F32,
                0.0f, 0.0f, 2, 2, 2, Order::kRandom});  // a sequence without query rows
  // Format version 3 (FormatVersion3MatchesOrIsRefused's shapes, lengths scaled to the emulator), state from the
  // reference append.
  at.push_back({make_config3(64, 3, 3, 2, 16, 0, 0, FMKV_SCALE_LSQ), 4, {37, 2, 120}, {1, 2, 1}, FMKV_F16, FMKV_F32,
                0.0f, 0.0f, 2, 3, 2, Order::kRandom});
  at.push_back({make_config3(128, 3, 3, 4, 64, 4, 16, FMKV_SCALE_LSQ), 2, {300, 25, 64}, {1, 16, 3}, FMKV_F16,
                FMKV_F32, 0.0f, 0.0f, 4, 2, 2, Order::kReverse});
  at.push_back({make_config3(256, 3, 2, 1, 32, 0, 0, FMKV_SCALE_RMS), 8, {400}, {2}, FMKV_F32, FMKV_F32, 0.0f, 0.0f,
                3, 2, 1, Order::kForward});
  at.push_back({make_config3(128, 16, 3, 2, 16, 0, 32, FMKV_SCALE_LSQ), 4, {90, 33}, {1, 1}, FMKV_F16, FMKV_F32, 0.0f,
                0.0f, 2, 2, 2, Order::kRandom});
  at.push_back({make_config3(128, 4, 3, 2, 128, 2, 0, FMKV_SCALE_LSQ), 3, {700}, {1}, FMKV_F16, FMKV_F32, 0.0f, 0.0f,
                4, 3, 1, Order::kRandom});
  at.push_back({make_config3(64, 2, 3, 1, 16, 1, 1, FMKV_SCALE_LSQ), 2, {1, 2, 47}, {1, 2, 16}, FMKV_F32, FMKV_F32,
                0.0f, 30.0f, 1, 4, 2, Order::kReverse});
  at.push_back({make_config3(256, 3, 4, 2, 16, 2, 4, FMKV_SCALE_RMS), 1, {60, 7}, {3, 0}, FMKV_BF16, FMKV_F32, 0.0f,
                0.0f, 2, 1, 2, Order::kRandom});  // a sequence without query rows
  // 5-bit codes: K, V and both, formats 2 and 3, with a tiled 3-bit side, sinks / windows, softcap, q_len up to 16.
  at.push_back({make_config(64, 5, 4, 2, 16, 2, 8, FMKV_SCALE_LSQ), 2, {37, 5, 90}, {1, 3, 1}, FMKV_F32, FMKV_F32, 0.0f,
                0.0f, 2, 3, 2, Order::kRandom});
  at.push_back({make_config(128, 4, 5, 2, 32, 0, 16, FMKV_SCALE_RMS), 4, {120, 9, 30}, {16, 2, 5}, FMKV_BF16, FMKV_F32,
                0.0f, 0.0f, 4, 2, 1, Order::kReverse});
  at.push_back({make_config(128, 5, 5, 1, 64, 3, 0, FMKV_SCALE_LSQ), 8, {100, 13}, {1, 12}, FMKV_F16, FMKV_F32, 0.0f,
                30.0f, 3, 1, 2, Order::kForward});
  at.push_back({make_config3(64, 5, 5, 2, 32, 0, 0, FMKV_SCALE_RMS), 2, {1, 2, 47}, {1, 2, 16}, FMKV_F32, FMKV_F32,
                0.0f, 0.0f, 1, 4, 2, Order::kRandom});
  at.push_back({make_config3(128, 5, 4, 2, 16, 2, 4, FMKV_SCALE_LSQ), 3, {150, 40}, {7, 1}, FMKV_F32, FMKV_F16, 0.2f,
                0.0f, 2, 3, 4, Order::kReverse});
  at.push_back({make_config3(128, 4, 5, 2, 128, 0, 32, FMKV_SCALE_LSQ), 2, {300, 25}, {1, 3}, FMKV_F16, FMKV_F32, 0.0f,
                0.0f, 4, 2, 2, Order::kRandom});
  at.push_back({make_config3(64, 5, 3, 2, 16, 1, 3, FMKV_SCALE_LSQ), 4, {37, 2, 120}, {1, 2, 1}, FMKV_F16, FMKV_F32,
                0.0f, 0.0f, 2, 3, 2, Order::kForward});  // 3-bit V in tile blocks
  at.push_back({make_config3(128, 3, 5, 2, 16, 0, 0, FMKV_SCALE_RMS), 2, {90, 33}, {1, 1}, FMKV_F16, FMKV_F32, 0.0f,
                5.0f, 2, 2, 2, Order::kRandom});  // 3-bit K in tile blocks
  at.push_back({make_config3(256, 16, 5, 2, 16, 0, 16, FMKV_SCALE_LSQ), 1, {40, 6}, {2, 6}, FMKV_F32, FMKV_F32, 0.0f,
                0.0f, 1, 4, 1, Order::kRandom});
  // Scale group 64: formats 2 and 3, both rules, GQA groups 1..8, sinks / windows, q_len up to 16, softcap;
  // state from the reference append.
  for (int d : {64, 128, 256})
    for (int i = 0; i < 5; ++i)
      for (int fmt : {2, 3}) {
        const int kb = sg_widths[i][0], vb = sg_widths[i][1], rule = (i + fmt + d / 64 + 1) % 2;
        if (quick && (i + fmt + d / 64) % 3 != 1) continue;
        const int sink = i % 2 ? 2 : 0, window = (i + fmt + d / 64) % 2 ? 16 : 0, group = 1 << ((i + fmt) % 4);
        fmkv_config c = fmt == 3 ? make_config3(d, kb, vb, 2, 16, sink, window, rule)
                                 : make_config(d, kb, vb, 2, 32, sink, window, rule);
        at.push_back({sg64(c), group, {37, 5, 90}, {1, 3, group == 2 ? 16 : 1}, i % 2 ? FMKV_F16 : FMKV_F32,
                      FMKV_F32, 0.0f, i == 2 ? 30.0f : 0.0f, 1 + (d / 64 + i) % 3, 1 + (i + fmt) % 3, 2,
                      (Order)((d / 64 + i + fmt) % 3)});
      }
  at.push_back({sg64(make_config3(128, 3, 3, 4, 64, 4, 16, FMKV_SCALE_LSQ)), 2, {300, 25, 64}, {1, 16, 3}, FMKV_F16,
                FMKV_F32, 0.0f, 0.0f, 4, 2, 2, Order::kReverse});
  at.push_back({sg64(make_config(64, 4, 2, 3, 128, 0, 32, FMKV_SCALE_RMS)), 3, {150}, {7}, FMKV_F32, FMKV_F16, 0.2f,
                0.0f, 2, 3, 4, Order::kRandom});
  for (auto& c : at) run_attention_case(c);

  run_error_cases();
  run_golden_cases(2, fmkv::test::kCasesV2);
  run_golden_cases(3, fmkv::test::kCasesV3);
  run_golden_cases(3, fmkv::test::kCasesScaleGroup64, "_scale_group64");
  run_golden_cases(3, fmkv::test::kCasesCodeWidth5, "_code_width5");

  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const emu::Stats& st = emu::stats();
  printf("emulator: %llu threads, %llu fiber switches, %llu SIMD-group ops, %llu barriers in %.1f s\n",
         (unsigned long long)st.threads, (unsigned long long)st.switches, (unsigned long long)st.simd_ops,
         (unsigned long long)st.barriers, secs);
  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
