// Helpers shared by the Metal kernel tests (tests/metal/test_metal.cpp, the CPU emulator driver)
// and the kernel core run as CUDA (tests/metal/cuda_core_test.cu): random inputs, one layer's
// storage with a shuffled block table, reporting. GoogleTest-free (both are plain drivers).
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../compare.h"
#include "format/numbers.h"
#include "fmkv/fmkv.hpp"

namespace mtest {

using fmkv::test::rel_error;

inline int g_passed = 0, g_failed = 0;
inline std::mt19937_64 g_rng;

inline void report(bool ok, const std::string& name, const std::string& detail, double seconds) {
  (ok ? g_passed : g_failed)++;
  printf("%s %s (%.3fs)%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), seconds, detail.empty() ? "" : ": ",
         detail.c_str());
  fflush(stdout);
}

// fmkv_attention_lse checks of the Metal kernel tests (the emulator's and the CUDA one's): got (at element strides
// rs, hs) against the reference's row-major [rows][heads] want, |got - want| / (1 + |want|) <= tol (NaN fails).
// Returns the first mismatch as text (empty when none) and sets worst to the largest error.
inline std::string lse_mismatch(const std::vector<float>& got, const std::vector<float>& want, int64_t rows,
                                int32_t heads, int64_t rs, int64_t hs, double tol, double& worst) {
  std::string err;
  worst = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    for (int32_t h = 0; h < heads; ++h) {
      const double g = got[(size_t)(r * rs + h * hs)], w = want[(size_t)(r * heads + h)];
      const double e = std::fabs(g - w) / (1.0 + std::fabs(w));
      worst = std::max(worst, std::isnan(e) ? INFINITY : e);
      if (err.empty() && !(e <= tol)) {
        char buf[160];
        snprintf(buf, sizeof buf, "lse[%lld][%d] = %.9g, reference %.9g; ", (long long)r, h, g, w);
        err = buf;
      }
    }
  return err;
}

// The verdict of an lse case (both Metal kernel tests): lse within tol (lse_mismatch), the output bits those of the
// call without lse (out_equal), the kernel's status words zero. Returns (passed, the report's message).
inline std::pair<bool, std::string> lse_case_verdict(const std::vector<float>& got, const std::vector<float>& want,
                                                     int64_t rows, int32_t heads, int64_t rs, int64_t hs, double tol,
                                                     bool out_equal, uint32_t status0, uint32_t status1) {
  double worst = 0.0;
  std::string err = lse_mismatch(got, want, rows, heads, rs, hs, tol, worst);
  if (!out_equal) err += "output bits differ from the call without lse; ";
  if (status0 || status1) err += "kernel status " + std::to_string(status0) + "/" + std::to_string(status1) + "; ";
  char buf[128];
  snprintf(buf, sizeof buf, "worst |lse - ref| / (1 + |ref|) %.3g (bound %.0e)", worst, tol);
  return {err.empty(), err.empty() ? std::string(buf) + ", output bits equal" : err + buf};
}

inline std::vector<uint8_t> random_tensor(fmkv_dtype dt, int64_t rows, int32_t heads, int32_t d) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> chan(d);
  for (auto& c : chan) c = 1.0f + std::fabs(nd(g_rng));  // heavy-tailed channels like real keys
  size_t es = dt == FMKV_F32 ? 4 : 2, n = (size_t)rows * heads * d;
  std::vector<uint8_t> out(n * es + 16);
  for (size_t i = 0; i < n; ++i) {
    float x = nd(g_rng) * chan[i % d];
    if (dt == FMKV_F32) {
      std::memcpy(&out[i * 4], &x, 4);
    } else {
      uint16_t h = dt == FMKV_F16 ? fmkv::f32_to_f16(x) : fmkv::f32_to_bf16(x);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

// One layer's storage plus a batch's block table / slots (tests/harness.h make_scenario).
struct Layer {
  fmkv_config cfg{};
  int32_t layer = 0;
  int64_t stride = 0, num_pages = 0;
  std::vector<int32_t> table, slots;
  std::vector<uint8_t> pages;
  std::vector<uint16_t> fk, fv;
  int32_t seqs() const { return (int32_t)slots.size(); }
  fmkv_layer_cache cache() {
    return fmkv_layer_cache{pages.data(), num_pages, fk.data(), fv.data(), std::max<int32_t>(1, seqs()), layer};
  }
};

inline Layer make_layer(const fmkv_config& cfg, const std::vector<int64_t>& final_lens) {
  Layer L;
  L.cfg = cfg;
  L.layer = (int32_t)(g_rng() % 40);
  int64_t max_pages = 0;
  for (int64_t len : final_lens) {
    int64_t comp = std::max<int64_t>(0, len - cfg.window_tokens - cfg.sink_tokens);
    max_pages = std::max(max_pages, (comp + cfg.page_size - 1) / cfg.page_size);
  }
  L.stride = max_pages + 1;
  L.num_pages = L.stride * (int64_t)final_lens.size() + 3;
  std::vector<int32_t> perm(L.num_pages);
  for (int64_t i = 0; i < L.num_pages; ++i) perm[i] = (int32_t)i;
  std::shuffle(perm.begin(), perm.end(), g_rng);
  L.table.assign(perm.begin(), perm.begin() + L.stride * final_lens.size());
  for (size_t i = 0; i < final_lens.size(); ++i) L.slots.push_back((int32_t)(final_lens.size() - 1 - i));
  L.pages.resize((size_t)(L.num_pages * fmkv_config_page_bytes(&cfg)));
  for (auto& b : L.pages) b = (uint8_t)g_rng();
  size_t fe = (size_t)(fmkv_config_fp16_slot_bytes(&cfg) / 4) * final_lens.size() + 1;
  L.fk.resize(fe);
  L.fv.resize(fe);
  std::normal_distribution<float> nd;
  for (auto& x : L.fk) x = fmkv::f32_to_f16(nd(g_rng));
  for (auto& x : L.fv) x = fmkv::f32_to_f16(nd(g_rng));
  return L;
}

inline std::vector<int64_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> o(1, 0);
  for (auto r : rows) o.push_back(o.back() + r);
  return o;
}

inline fmkv_config make_config(int d, int kb, int vb, int H, int page, int sink, int window, int rule) {
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = d;
  c.k_bits = kb;
  c.v_bits = vb;
  c.num_kv_heads = H;
  c.page_size = page;
  c.sink_tokens = sink;
  c.window_tokens = window;
  c.scale_rule = rule;
  c.seed = g_rng();
  return c;
}

// The same in format version 3 (3-bit codes: integer levels, tile blocks).
inline fmkv_config make_config3(int d, int kb, int vb, int H, int page, int sink, int window, int rule) {
  fmkv_config c = make_config(d, kb, vb, H, page, sink, window, rule);
  c.format_version = 3;
  return c;
}

inline double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline const char* dt_name(fmkv_dtype dt) { return dt == FMKV_F32 ? "f32" : dt == FMKV_F16 ? "f16" : "bf16"; }

inline std::string config_name(const fmkv_config& c) {
  char b[128];
  snprintf(b, sizeof b, "d%d k%dv%d H%d P%d S%d W%d %s%s%s", c.head_dim, c.k_bits, c.v_bits, c.num_kv_heads,
           c.page_size, c.sink_tokens, c.window_tokens, c.scale_rule == FMKV_SCALE_RMS ? "rms" : "lsq",
           c.format_version == 3 ? " fmt3" : "", fmkv_resolved_scale_group(c.scale_group) == 64 ? " sg64" : "");
  return b;
}

template <typename T>
std::string first_diff(const std::vector<T>& a, const std::vector<T>& b, const char* what,
                       const char* who = "metal") {
  if (a.size() != b.size()) return std::string(what) + ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) {
      char m[160];
      snprintf(m, sizeof m, "%s differ at element %zu of %zu (%s %#x, ref %#x)", what, i, a.size(), who, (unsigned)a[i],
               (unsigned)b[i]);
      return m;
    }
  return "";
}

inline std::vector<float> as_floats(const std::vector<uint8_t>& bytes, fmkv_dtype dt, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) {
    if (dt == FMKV_F32) {
      std::memcpy(&f[i], &bytes[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * 2], 2);
      f[i] = dt == FMKV_F16 ? fmkv::f16_to_f32(h) : fmkv::bf16_to_f32(h);
    }
  }
  return f;
}


}  // namespace mtest
