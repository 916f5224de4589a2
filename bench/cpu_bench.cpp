// CPU backend benchmark: decode attention on compressed pages, quantize-append throughput, and a
// STREAM-style copy bandwidth measured in the same run. Prints one JSON object per line.
//   cpu_bench [--contexts 4096,32768,131072] [--reps N] [--quick] [--format-version 2|3] [--kbits B]
//             [--geom 0|1|2] [--skip-quant]
// (geometries: 0 = 32 q / 8 kv heads, d = 128; 1 = 9 q / 3 kv heads, d = 64; 2 = 64 q / 8 kv heads, d = 128, GQA 8,
// only with --geom 2)
// (an unknown flag, a missing value or an out-of-range number is an error: exit 2 with a message)
// Timing: median of several runs (fewer at long contexts); the cache is filled with random valid
// codes and finite fp16 scales (values do not change the work done).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.h"
#include "format/numbers.h"  // the backend interface: times the CPU entry point without the C API's validation
#include "fmkv/fmkv.h"

namespace {

using Clock = std::chrono::steady_clock;

double cpu_now_us() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}
double g_cpu_us = 0;  // median process CPU time of the last median_us() (all threads)

double now_us() { return std::chrono::duration<double, std::micro>(Clock::now().time_since_epoch()).count(); }

template <typename F>
double median_us(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t, c;
  for (int i = 0; i < reps; ++i) {
    double t0 = now_us(), c0 = cpu_now_us();
    f();
    t.push_back(now_us() - t0);
    c.push_back(cpu_now_us() - c0);
  }
  std::sort(t.begin(), t.end());
  std::sort(c.begin(), c.end());
  g_cpu_us = c[c.size() / 2];
  return t[t.size() / 2];
}

void check(fmkv_status s, const char* what) {
  if (s != FMKV_OK) {
    std::fprintf(stderr, "%s failed: %s\n", what, fmkv_last_error());
    std::exit(1);
  }
}

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

// STREAM-style copy with `threads` threads; returns (read + write) GB/s, best of reps.
double copy_gbps(int threads) {
  const size_t n = (size_t)64 << 20;  // 64M floats = 256 MiB per array
  std::vector<float> a(n, 1.0f), b(n, 0.0f);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = now_us();
    std::vector<std::thread> th;
    for (int i = 0; i < threads; ++i)
      th.emplace_back([&, i] {
        size_t lo = n * i / threads, hi = n * (i + 1) / threads;
        std::memcpy(&b[lo], &a[lo], (hi - lo) * 4);
      });
    for (auto& t : th) t.join();
    double dt = now_us() - t0;
    best = std::max(best, 2.0 * n * 4 / (dt * 1e3));
  }
  return best;
}

double loadavg1() {  // 1-minute load average (other processes compete for the cores)
  double l = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = -1;
    std::fclose(f);
  }
  return l;
}

struct Fmt {
  int kb, vb;
};

void fill_cache(const fmkv_config& c, std::vector<uint8_t>& pages, int64_t num_pages, uint64_t seed) {
  Rng r{seed | 1};
  pages.resize((size_t)(num_pages * fmkv_config_page_bytes(&c)));
  uint64_t* p64 = (uint64_t*)pages.data();
  for (size_t i = 0; i < pages.size() / 8; ++i) p64[i] = r.next();
  std::vector<uint16_t> tab(1024);
  std::mt19937 g((uint32_t)seed);
  std::normal_distribution<float> nd;
  for (auto& h : tab) h = fmkv::f32_to_f16(nd(g));
  const int32_t d = c.head_dim, P = c.page_size;
  for (int64_t pg = 0; pg < num_pages; ++pg)
    for (int32_t h = 0; h < c.num_kv_heads; ++h)
      for (int is_v = 0; is_v < 2; ++is_v) {
        int32_t bits = is_v ? c.v_bits : c.k_bits;
        uint8_t* sec = pages.data() + pg * fmkv_config_page_bytes(&c) +
                       fmkv_section_offset(d, c.k_bits, c.v_bits, P, h, is_v, c.scale_group);
        if (bits == FMKV_FP16_BITS) {
          uint16_t* v = (uint16_t*)sec;
          for (int64_t i = 0; i < (int64_t)P * d; ++i) v[i] = tab[r.next() & 1023];
        } else {
          uint16_t* sc = (uint16_t*)(sec + fmkv_scales_offset(d, bits, P));
          for (int64_t i = 0; i < (int64_t)fmkv_scales_per_vector(d, c.scale_group) * P; ++i) sc[i] = (uint16_t)(0x3400u + (r.next() & 0x3ffu));
        }
      }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {4096, 32768, 131072};
  int reps_override = 0;
  bool skip_quant = false;
  int only_kb = 0, only_geom = -1;
  int32_t format_version = 0;  // the caches' fmkv_config.format_version (0: the library's default)
  int32_t scale_group = 0;     // the caches' fmkv_config.scale_group (0: the default)
  auto fail = [](const std::string& m) {
    std::fprintf(stderr, "cpu_bench: %s\n", m.c_str());
    std::exit(2);
  };
  auto number = [&](int& i, const std::string& flag, long long lo, long long hi) {
    if (i + 1 >= argc) fail(flag + " needs a value");
    const std::string v = argv[++i];
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || x < lo || x > hi)
      fail(flag + " " + v + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--contexts") {
      if (i + 1 >= argc) fail("--contexts needs a value");
      contexts.clear();
      std::string s = argv[++i];
      size_t p = 0;
      while (p <= s.size()) {
        size_t q = s.find(',', p);
        const std::string item = s.substr(p, q == std::string::npos ? std::string::npos : q - p);
        char* end = nullptr;
        const long long x = std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end || x < 1 || x > (1ll << 24)) fail("--contexts " + s + ": each context in [1, 2^24]");
        contexts.push_back(x);
        if (q == std::string::npos) break;
        p = q + 1;
      }
    } else if (a == "--reps") {
      reps_override = (int)number(i, a, 1, 1000);
    } else if (a == "--kbits") {
      only_kb = (int)number(i, a, 2, 16);
    } else if (a == "--geom") {
      only_geom = (int)number(i, a, 0, 2);
    } else if (a == "--format-version") {
      format_version = (int32_t)number(i, a, 0, 99);  // the C API names an unsupported version
    } else if (a == "--scale-group") {
      scale_group = (int32_t)number(i, a, 0, 4096);  // the C API names an unsupported scale group
    } else if (a == "--skip-quant") {
      skip_quant = true;
    } else if (a == "--quick") {
      contexts = {4096, 32768};
      reps_override = 3;
    } else {
      fail("unknown flag '" + a + "' (--contexts, --reps, --quick, --format-version, --scale-group, --kbits, --geom, "
           "--skip-quant)");
    }
  }
  if (!fmkv_backend_available(FMKV_BACKEND_CPU)) {
    std::fprintf(stderr, "CPU backend not compiled in\n");
    return 1;
  }
  const int threads = (int)std::max(1u, std::thread::hardware_concurrency());
  const char* env_threads = std::getenv("FMKV_NUM_THREADS");
  const int used_threads = env_threads && std::atoi(env_threads) > 0 ? std::atoi(env_threads) : threads;
  const std::string device = fmkv_backend_device(FMKV_BACKEND_CPU);
  const double copy = copy_gbps(used_threads);
  std::printf("{\"op\":\"info\",\"device\":\"%s\",\"threads\":%d,\"copy_gbps\":%.3f,\"loadavg\":%.2f}\n", device.c_str(),
              used_threads, copy, loadavg1());
  std::fflush(stdout);

  const Fmt fmts[] = {{5, 5}, {5, 4}, {4, 4}, {3, 3}, {2, 2}, {16, 4}};

  // ---- quantize-append: 4096 new tokens of fp32 K and V, 8 kv heads x d128 -------------------
  for (Fmt f : fmts) {
    if (skip_quant) break;
    fmkv_config c;
    fmkv_config_default(&c);
    c.head_dim = 128;
    c.num_kv_heads = 8;
    c.k_bits = f.kb;
    c.v_bits = f.vb;
    c.page_size = 64;
    c.format_version = format_version;
    c.scale_group = scale_group;
    check(fmkv_config_validate(&c), "config");
    const int64_t T = 4096, np = T / c.page_size;
    std::vector<uint8_t> pages((size_t)(np * fmkv_config_page_bytes(&c)));
    std::vector<int32_t> table(np);
    for (int64_t i = 0; i < np; ++i) table[i] = (int32_t)i;
    std::vector<float> k((size_t)T * 8 * 128), v(k.size());
    std::mt19937 g(7);
    std::normal_distribution<float> nd;
    for (auto& x : k) x = nd(g);
    for (auto& x : v) x = nd(g);
    int64_t lens[1] = {0}, offs[2] = {0, T};
    int32_t slots[1] = {0};
    fmkv_layer_cache lc{pages.data(), np, nullptr, nullptr, 1, 0};
    fmkv_batch bt{1, slots, lens, offs, table.data(), np};
    fmkv_tensor kt{k.data(), FMKV_F32, T, 8, 128, 8 * 128, 128}, vt{v.data(), FMKV_F32, T, 8, 128, 8 * 128, 128};
    // Through the C API (includes the host-side validation of every input value) and the backend
    // entry point alone (what the kernel costs).
    double us_api = median_us(5, [&] { check(fmkv_append(FMKV_BACKEND_CPU, &c, &lc, &bt, &kt, &vt, nullptr), "append"); });
    const fmkv::BackendOps* cpu = fmkv::find_backend(FMKV_BACKEND_CPU);
    double us = median_us(5, [&] { cpu->append(fmkv::AppendArgs{c, lc, bt, kt, vt, nullptr}); });
    double bytes = 2.0 * T * 8 * 128 * 4;
    std::printf("{\"op\":\"quantize_append_api\",\"batch\":1,\"q_len\":%lld,\"context\":%lld,\"head_dim\":128,\"q_heads\":32,"
                "\"kv_heads\":8,\"layers\":1,\"k_bits\":%d,\"v_bits\":%d,\"page_size\":64,\"time_us\":%.1f,\"bytes\":%.0f,"
                "\"gbps\":%.3f,\"gbps_per_core\":%.3f,\"threads\":%d,\"copy_gbps\":%.3f,\"pct_copy_bw\":%.2f,\"format_version\":%d,\"scale_group\":%d}\n",
                (long long)T, (long long)T, f.kb, f.vb, us_api, bytes, bytes / (us_api * 1e3), bytes / (us_api * 1e3) / used_threads,
                used_threads, copy, 100.0 * bytes / (us_api * 1e3) / copy, fmkv_resolved_format_version(format_version), fmkv_resolved_scale_group(scale_group));
    std::printf("{\"op\":\"quantize_append\",\"batch\":1,\"q_len\":%lld,\"context\":%lld,\"head_dim\":128,\"q_heads\":32,"
                "\"kv_heads\":8,\"layers\":1,\"k_bits\":%d,\"v_bits\":%d,\"page_size\":64,\"time_us\":%.1f,\"bytes\":%.0f,"
                "\"gbps\":%.3f,\"gbps_per_core\":%.3f,\"threads\":%d,\"copy_gbps\":%.3f,\"pct_copy_bw\":%.2f,\"format_version\":%d,\"scale_group\":%d}\n",
                (long long)T, (long long)T, f.kb, f.vb, us, bytes, bytes / (us * 1e3), bytes / (us * 1e3) / used_threads,
                used_threads, copy, 100.0 * bytes / (us * 1e3) / copy, fmkv_resolved_format_version(format_version), fmkv_resolved_scale_group(scale_group));
    std::fflush(stdout);
  }

  // ---- decode attention ---------------------------------------------------------------------
  struct Geom {
    int hq, hkv, d;
  };
  const Geom geoms[] = {{32, 8, 128}, {9, 3, 64}, {64, 8, 128}};
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());
  for (int gi = 0; gi < 3; ++gi)
    for (Fmt f : fmts) {
      const Geom gm = geoms[gi];
      if ((only_geom >= 0 ? gi != only_geom : gi == 2) || (only_kb && f.kb != only_kb)) continue;
      fmkv_config c;
      fmkv_config_default(&c);
      c.head_dim = gm.d;
      c.num_kv_heads = gm.hkv;
      c.k_bits = f.kb;
      c.v_bits = f.vb;
      c.page_size = 64;
      c.seed = 1234;
      c.format_version = format_version;
      c.scale_group = scale_group;
      check(fmkv_config_validate(&c), "config");
      const int64_t np = (max_ctx + c.page_size - 1) / c.page_size;
      std::vector<uint8_t> pages;
      fill_cache(c, pages, np, 99 + f.kb * 7 + f.vb + gm.d);
      std::vector<int32_t> table(np);
      for (int64_t i = 0; i < np; ++i) table[i] = (int32_t)i;
      std::shuffle(table.begin(), table.end(), std::mt19937(5));
      std::vector<float> q((size_t)gm.hq * gm.d), out(q.size());
      std::mt19937 g(3);
      std::normal_distribution<float> nd;
      for (auto& x : q) x = nd(g);
      for (int64_t ctx : contexts) {
        int64_t lens[1] = {ctx}, offs[2] = {0, 1};
        int32_t slots[1] = {0};
        fmkv_layer_cache lc{pages.data(), np, nullptr, nullptr, 1, 0};
        fmkv_batch bt{1, slots, lens, offs, table.data(), np};
        fmkv_tensor qt{q.data(), FMKV_F32, 1, gm.hq, gm.d, (int64_t)gm.hq * gm.d, gm.d};
        fmkv_tensor ot{out.data(), FMKV_F32, 1, gm.hq, gm.d, (int64_t)gm.hq * gm.d, gm.d};
        const int reps = reps_override > 0 ? reps_override : ctx >= 100000 ? 7 : ctx >= 30000 ? 15 : 40;
        double us = median_us(reps, [&] {
          check(fmkv_attention(FMKV_BACKEND_CPU, &c, &lc, &bt, &qt, nullptr, &ot, nullptr, 0, nullptr), "attention");
        });
        double bytes = (double)ctx * gm.hkv * (fmkv_bytes_per_token_head(gm.d, f.kb, scale_group) + fmkv_bytes_per_token_head(gm.d, f.vb, scale_group)) +
                       2.0 * gm.hq * gm.d * 4;
        double gbps = bytes / (us * 1e3);
        std::printf("{\"op\":\"decode_attention\",\"batch\":1,\"q_len\":1,\"context\":%lld,\"head_dim\":%d,\"q_heads\":%d,"
                    "\"kv_heads\":%d,\"layers\":1,\"k_bits\":%d,\"v_bits\":%d,\"page_size\":64,\"time_us\":%.1f,"
                    "\"bytes\":%.0f,\"gbps\":%.3f,\"copy_gbps\":%.3f,\"pct_copy_bw\":%.2f,\"threads\":%d,\"cpu_us\":%.1f,"
                    "\"format_version\":%d,\"scale_group\":%d}\n",
                    (long long)ctx, gm.d, gm.hq, gm.hkv, f.kb, f.vb, us, bytes, gbps, copy, 100.0 * gbps / copy, used_threads, g_cpu_us,
                    fmkv_resolved_format_version(format_version), fmkv_resolved_scale_group(scale_group));
        std::fflush(stdout);
      }
    }
  std::printf("{\"op\":\"info_end\",\"loadavg\":%.2f}\n", loadavg1());
  return 0;
}
