// Long-context decode through the public C API on any backend (issue 7): allocate a whole
// multi-layer compressed cache for one sequence of N tokens, fill it by quantizing synthetic K/V
// (a fixed random fp16 chunk appended repeatedly), time one decode step's attention over all
// layers, and check layer 0's output on sampled kv heads against a float64 evaluation over the
// same compressed bytes.
//   fmkv_longctx --backend cuda --context 4194304 --layers 32 [--kv-heads 8 --q-heads 32
//                --head-dim 128 --k-bits 3 --v-bits 3 --page-size 64 --chunk 65536 --reps 5
//                --check-kv-heads 2 --copy-gbps 4256 --commit SHA --jsonl out.jsonl]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "format/numbers.h"
#include "fmkv/fmkv.hpp"
#include "ref/quantize.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Opts {
  fmkv_backend backend = FMKV_BACKEND_CPU;
  int64_t context = 131072, chunk = 65536;
  int32_t layers = 2, kv_heads = 8, q_heads = 32, d = 128, k_bits = 3, v_bits = 3, page = 64;
  int32_t reps = 5, check_kv_heads = 2;
  double copy_gbps = 0;
  std::string commit = "unknown", jsonl;
};

void die(const std::string& m) {
  std::fprintf(stderr, "fmkv_longctx: %s\n", m.c_str());
  std::exit(1);
}
void ok(fmkv_status s, const char* what) {
  if (s != FMKV_OK) die(std::string(what) + ": " + fmkv_last_error());
}

struct DevBuf {
  fmkv_backend b;
  void* p;
  size_t n;
  DevBuf(fmkv_backend be, size_t bytes) : b(be), p(fmkv_device_alloc(be, bytes)), n(bytes) {
    if (!p) die("cannot allocate " + std::to_string(bytes) + " bytes on " + fmkv_backend_name(be));
  }
  ~DevBuf() { fmkv_device_free(b, p); }
  void up(const void* src, size_t bytes) { ok(fmkv_device_copy(b, p, src, bytes, 1), "upload"); }
  void down(void* dst, size_t bytes) const { ok(fmkv_device_copy(b, dst, p, bytes, 0), "download"); }
};

// float64 attention of one q head over a kv head's compressed tokens [0, n), page table identity.
struct Partial { double m = -INFINITY, l = 0; std::vector<double> acc; };

Partial attend_range(const fmkv_config& c, const uint8_t* pages, int64_t page_bytes, int32_t h,
                     const std::vector<double>& qr, double scale, int64_t t0, int64_t t1) {
  const int32_t d = c.head_dim, G = d / 32;
  Partial p;
  p.acc.assign(d, 0.0);
  std::vector<uint8_t> codes(d);
  std::vector<uint16_t> sc(G);
  std::vector<double> k(d), v(d);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* page = pages + (t / c.page_size) * page_bytes;
    const int32_t slot = (int32_t)(t % c.page_size);
    for (int which = 0; which < 2; ++which) {
      const int32_t bits = which ? c.v_bits : c.k_bits;
      const uint8_t* sec = page + fmkv_section_offset(d, c.k_bits, c.v_bits, c.page_size, h, which, c.scale_group);
      const uint16_t* scales = (const uint16_t*)(sec + fmkv_scales_offset(d, bits, c.page_size));
      for (int32_t g = 0; g < G; ++g) {
        fmkv::ref::unpack_group((const uint32_t*)sec + fmkv_code_word_index(bits, c.page_size, g, 0, slot),
                                c.page_size, bits, &codes[g * 32]);
        sc[g] = scales[(int64_t)g * c.page_size + slot];
      }
      fmkv::ref::dequantize_vector(codes.data(), sc.data(), d, bits, which ? v.data() : k.data());
    }
    double s = 0;
    for (int32_t i = 0; i < d; ++i) s += qr[i] * k[i];
    s *= scale;
    double mn = std::max(p.m, s), corr = std::exp(p.m - mn), w = std::exp(s - mn);
    p.l = p.l * corr + w;
    for (int32_t i = 0; i < d; ++i) p.acc[i] = p.acc[i] * corr + w * v[i];
    p.m = mn;
  }
  return p;
}

std::string jnum(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--backend") o.backend = v == "cuda" ? FMKV_BACKEND_CUDA : v == "ref" ? FMKV_BACKEND_REF : FMKV_BACKEND_CPU;
    else if (k == "--context") o.context = std::stoll(v);
    else if (k == "--chunk") o.chunk = std::stoll(v);
    else if (k == "--layers") o.layers = std::stoi(v);
    else if (k == "--kv-heads") o.kv_heads = std::stoi(v);
    else if (k == "--q-heads") o.q_heads = std::stoi(v);
    else if (k == "--head-dim") o.d = std::stoi(v);
    else if (k == "--k-bits") o.k_bits = std::stoi(v);
    else if (k == "--v-bits") o.v_bits = std::stoi(v);
    else if (k == "--page-size") o.page = std::stoi(v);
    else if (k == "--reps") o.reps = std::stoi(v);
    else if (k == "--check-kv-heads") o.check_kv_heads = std::stoi(v);
    else if (k == "--copy-gbps") o.copy_gbps = std::stod(v);
    else if (k == "--commit") o.commit = v;
    else if (k == "--jsonl") o.jsonl = v;
    else die("unknown option " + k);
  }
  if (!fmkv_backend_available(o.backend)) die(std::string("backend ") + fmkv_backend_name(o.backend) + " is not available");
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = o.d; c.num_kv_heads = o.kv_heads; c.k_bits = o.k_bits; c.v_bits = o.v_bits; c.page_size = o.page;
  c.seed = 0x5EED;
  ok(fmkv_config_validate(&c), "config");
  o.chunk = std::min(o.chunk, o.context);
  const int64_t page_bytes = fmkv_config_page_bytes(&c), pages = (o.context + o.page - 1) / o.page;
  const int64_t layer_bytes = pages * page_bytes, H = o.kv_heads, d = o.d;
  const double bytes_per_token = (double)o.layers * H * (fmkv_bytes_per_token_head(d, o.k_bits, 0) + fmkv_bytes_per_token_head(d, o.v_bits, 0));
  std::printf("%s (%s): %d layers x %lld tokens, %d kv / %d q heads, d=%lld, k%dv%d, page %d\n",
              fmkv_backend_name(o.backend), fmkv_backend_device(o.backend), o.layers, (long long)o.context,
              o.kv_heads, o.q_heads, (long long)d, o.k_bits, o.v_bits, o.page);
  std::printf("allocating %d x %lld pages x %lld B = %.3f GB (compressed); fp16 would need %.3f GB\n", o.layers,
              (long long)pages, (long long)page_bytes, o.layers * (double)layer_bytes / 1e9,
              (double)o.context * o.layers * H * d * 4 / 1e9);
  std::vector<DevBuf*> pools;
  for (int32_t l = 0; l < o.layers; ++l) pools.push_back(new DevBuf(o.backend, (size_t)layer_bytes));

  // Synthetic fp16 K/V chunk (keys with log-normal channel scales), uploaded once.
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> chan(d);
  for (auto& x : chan) x = std::exp(0.5f * nd(rng));
  const size_t chunk_elems = (size_t)o.chunk * H * d;
  std::vector<uint16_t> kh(chunk_elems), vh(chunk_elems), qh((size_t)o.q_heads * d);
  for (size_t i = 0; i < chunk_elems; ++i) {
    kh[i] = fmkv::f32_to_f16(nd(rng) * chan[i % d]);
    vh[i] = fmkv::f32_to_f16(nd(rng));
  }
  for (auto& x : qh) x = fmkv::f32_to_f16(2.0f * nd(rng));
  DevBuf kd(o.backend, chunk_elems * 2), vd(o.backend, chunk_elems * 2), qd(o.backend, qh.size() * 2);
  kd.up(kh.data(), chunk_elems * 2);
  vd.up(vh.data(), chunk_elems * 2);
  qd.up(qh.data(), qh.size() * 2);
  std::vector<int32_t> table(pages);
  for (int64_t i = 0; i < pages; ++i) table[i] = (int32_t)i;
  DevBuf tabd(o.backend, table.size() * 4), lend(o.backend, 8), offd(o.backend, 16), slotd(o.backend, 4);
  tabd.up(table.data(), table.size() * 4);
  int32_t slot0 = 0;
  slotd.up(&slot0, 4);

  // Fill.
  auto t0 = Clock::now();
  for (int32_t l = 0; l < o.layers; ++l) {
    fmkv_layer_cache lc{(uint8_t*)pools[l]->p, pages, nullptr, nullptr, 1, l};
    for (int64_t start = 0; start < o.context; start += o.chunk) {
      int64_t n = std::min(o.chunk, o.context - start), off[2] = {0, n};
      lend.up(&start, 8);
      offd.up(off, 16);
      fmkv_batch bt{1, (int32_t*)slotd.p, (int64_t*)lend.p, (int64_t*)offd.p, (int32_t*)tabd.p, pages};
      fmkv_tensor kt = fmkv::make_tensor(kd.p, FMKV_F16, n, (int32_t)H, (int32_t)d);
      fmkv_tensor vt = fmkv::make_tensor(vd.p, FMKV_F16, n, (int32_t)H, (int32_t)d);
      ok(fmkv_append(o.backend, &c, &lc, &bt, &kt, &vt, nullptr), "append");
    }
    ok(fmkv_device_synchronize(o.backend), "append (device)");
    std::fprintf(stderr, "\rfill: layer %d/%d", l + 1, o.layers);
  }
  double fill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::fprintf(stderr, "\n");
  std::printf("filled in %.2f s: %.1f GB/s of fp16 input quantized\n", fill_s,
              (double)o.context * o.layers * H * d * 4 / fill_s / 1e9);

  // One decode step = attention of one query row over every layer.
  int64_t len = o.context, off[2] = {0, 1};
  lend.up(&len, 8);
  offd.up(off, 16);
  const int64_t ws = fmkv_attention_workspace_bytes(o.backend, &c, o.q_heads, 1, 1, o.context);
  DevBuf work(o.backend, (size_t)ws + 16), outd(o.backend, (size_t)o.q_heads * d * 4);
  fmkv_batch bt{1, (int32_t*)slotd.p, (int64_t*)lend.p, (int64_t*)offd.p, (int32_t*)tabd.p, pages};
  fmkv_tensor qt = fmkv::make_tensor(qd.p, FMKV_F16, 1, o.q_heads, (int32_t)d);
  fmkv_tensor ot = fmkv::make_tensor(outd.p, FMKV_F32, 1, o.q_heads, (int32_t)d);
  auto step = [&](int32_t only_layer) {
    for (int32_t l = 0; l < o.layers; ++l) {
      if (only_layer >= 0 && l != only_layer) continue;
      fmkv_layer_cache lc{(uint8_t*)pools[l]->p, pages, nullptr, nullptr, 1, l};
      ok(fmkv_attention(o.backend, &c, &lc, &bt, &qt, nullptr, &ot, work.p, (size_t)ws, nullptr), "attention");
    }
    ok(fmkv_device_synchronize(o.backend), "attention (device)");
  };
  step(-1);  // warm-up
  std::vector<double> times;
  for (int32_t r = 0; r < o.reps; ++r) {
    auto a = Clock::now();
    step(-1);
    times.push_back(std::chrono::duration<double, std::micro>(Clock::now() - a).count());
  }
  std::sort(times.begin(), times.end());
  const double step_us = times[times.size() / 2];
  const double bytes = bytes_per_token * o.context, gbps = bytes / step_us / 1e3;
  std::printf("decode step (%d layers): %.3f ms median of %d, %.1f GB/s on compressed bytes", o.layers, step_us / 1e3,
              o.reps, gbps);
  if (o.copy_gbps > 0) std::printf(", %.1f%% of copy bandwidth %.0f GB/s", 100 * gbps / o.copy_gbps, o.copy_gbps);
  std::printf("\n");

  // Numerical check of layer 0 on sampled kv heads: float64 over the same compressed bytes.
  step(0);
  std::vector<float> out((size_t)o.q_heads * d);
  outd.down(out.data(), out.size() * 4);
  std::vector<uint8_t> host_pages((size_t)layer_bytes);
  pools[0]->down(host_pages.data(), host_pages.size());
  const auto sw = fmkv::ref::sign_words(c.seed, 0, (int32_t)d);
  const double scale = 1.0 / std::sqrt((double)d);
  const int nthreads = std::max(1u, std::thread::hardware_concurrency());
  double worst = 0;
  const int32_t group = o.q_heads / o.kv_heads;
  for (int32_t ci = 0; ci < std::min(o.check_kv_heads, o.kv_heads); ++ci) {
    const int32_t h = (int32_t)((int64_t)ci * (o.kv_heads - 1) / std::max(1, o.check_kv_heads - 1));
    const int32_t hq = h * group + ci % group;
    std::vector<double> q(d), qr(d);
    for (int32_t i = 0; i < d; ++i) q[i] = fmkv::f16_to_f32(qh[(size_t)hq * d + i]);
    fmkv::ref::rotate_f64(q.data(), (int32_t)d, sw.data(), qr.data());
    std::vector<Partial> parts(nthreads);
    std::vector<std::thread> th;
    for (int t = 0; t < nthreads; ++t)
      th.emplace_back([&, t] {
        parts[t] = attend_range(c, host_pages.data(), page_bytes, h, qr, scale, o.context * t / nthreads,
                                o.context * (t + 1) / nthreads);
      });
    for (auto& x : th) x.join();
    double m = -INFINITY, l = 0;
    std::vector<double> acc(d, 0.0), ref(d);
    for (auto& p : parts) m = std::max(m, p.m);
    for (auto& p : parts) {
      double w = std::exp(p.m - m);
      l += p.l * w;
      for (int32_t i = 0; i < d; ++i) acc[i] += p.acc[i] * w;
    }
    for (auto& x : acc) x /= l;
    fmkv::ref::unrotate_f64(acc.data(), (int32_t)d, sw.data(), ref.data());
    double num = 0, den = 0;
    for (int32_t i = 0; i < d; ++i) {
      double e = out[(size_t)hq * d + i] - ref[i];
      num += e * e;
      den += ref[i] * ref[i];
    }
    double rel = std::sqrt(num / den);
    worst = std::max(worst, rel);
    std::printf("check layer 0, kv head %d, q head %d: ||out - ref64|| / ||ref64|| = %.3g\n", h, hq, rel);
  }
  if (!o.jsonl.empty()) {
    FILE* f = std::fopen(o.jsonl.c_str(), "a");
    if (!f) die("cannot open " + o.jsonl);
    std::fprintf(f,
                 "{\"suite\": \"%s_longctx\", \"backend\": \"%s\", \"device\": \"%s\", \"commit\": \"%s\", "
                 "\"op\": \"decode_attention\", \"batch\": 1, \"q_len\": 1, \"context\": %lld, \"head_dim\": %lld, "
                 "\"q_heads\": %d, \"kv_heads\": %d, \"layers\": %d, \"k_bits\": %d, \"v_bits\": %d, "
                 "\"page_size\": %d, \"time_us\": %s, \"bytes\": %.0f, \"gbps\": %s, \"copy_gbps\": %s, "
                 "\"pct_copy_bw\": %s, \"alloc_bytes\": %lld, \"fp16_bytes_needed\": %.0f, \"fill_s\": %s, "
                 "\"check_rel_err_max\": %s, \"check_kv_heads\": %d, \"data\": \"synthetic: one random fp16 "
                 "chunk of %lld tokens appended repeatedly\"}\n",
                 fmkv_backend_name(o.backend), fmkv_backend_name(o.backend), fmkv_backend_device(o.backend),
                 o.commit.c_str(), (long long)o.context, (long long)d, o.q_heads, o.kv_heads, o.layers, o.k_bits,
                 o.v_bits, o.page, jnum(step_us).c_str(), bytes, jnum(gbps).c_str(), jnum(o.copy_gbps).c_str(),
                 jnum(o.copy_gbps > 0 ? 100 * gbps / o.copy_gbps : 0).c_str(), (long long)(o.layers * layer_bytes),
                 (double)o.context * o.layers * H * d * 4, jnum(fill_s).c_str(), jnum(worst).c_str(),
                 std::min(o.check_kv_heads, o.kv_heads), (long long)o.chunk);
    std::fclose(f);
  }
  for (auto* p : pools) delete p;
  return 0;
}
