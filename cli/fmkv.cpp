// The fmkv command: info, spec, capacity, demo. Uses only the public C/C++ API.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fmkv/fmkv.hpp"

namespace {

using Args = std::map<std::string, std::string>;

void usage() {
  std::puts(
      "usage: fmkv <command> [options]\n"
      "  info                      version, format version, backends and devices\n"
      "  spec [--head-dims 64,128,256]\n"
      "                            bytes per token per head and compression for each bit width\n"
      "  capacity [--preset NAME] [--layers N --kv-heads N --head-dim D] --memory 141GB\n"
      "           [--weights 16GB] [--batch B] [--page-size P] [--sink S] [--window W]\n"
      "                            maximum context per format (presets: llama-3-8b, qwen2.5-7b,\n"
      "                            smollm2-135m, gemma-3-270m)\n"
      "  demo [--context N] [--backend ref|cpu|cuda] [--formats k4v4,k3v3,...]\n"
      "                            compress a synthetic KV cache, run attention, report\n"
      "                            compression, error vs fp16 attention and time");
}

Args parse(int argc, char** argv, int first) {
  Args a;
  for (int i = first; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "unexpected argument '" + k + "'");
    if (i + 1 >= argc) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "option " + k + " needs a value");
    a[k.substr(2)] = argv[++i];
  }
  return a;
}

int64_t to_int(const std::string& s, const char* what) {
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, std::string(what) + ": '" + s + "' is not an integer");
  return v;
}

// "141GB", "16GiB", "512MB", "1e9" -> bytes (GB = 1e9, GiB = 2^30).
double to_bytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string u = end;
  for (auto& c : u) c = (char)std::toupper(c);
  double m = u.empty() || u == "B" ? 1 : u == "KB" ? 1e3 : u == "MB" ? 1e6 : u == "GB" ? 1e9 : u == "TB" ? 1e12
           : u == "KIB" ? 1024.0 : u == "MIB" ? 1048576.0 : u == "GIB" ? 1073741824.0 : u == "TIB" ? 1099511627776.0 : -1;
  if (end == s.c_str() || m < 0 || v < 0) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "memory size '" + s + "' not understood (e.g. 141GB, 16GiB)");
  return v * m;
}

std::string fmt_bytes(double b) {
  char buf[64];
  const char* u[] = {"B", "KB", "MB", "GB", "TB"};
  int i = 0;
  while (b >= 1000 && i < 4) { b /= 1000; ++i; }
  std::snprintf(buf, sizeof buf, "%.2f %s", b, u[i]);
  return buf;
}

std::string fmt_tokens(int64_t t) {
  char buf[64];
  if (t >= 1000000) std::snprintf(buf, sizeof buf, "%.2fM", t / 1e6);
  else if (t >= 1000) std::snprintf(buf, sizeof buf, "%.1fk", t / 1e3);
  else std::snprintf(buf, sizeof buf, "%lld", (long long)t);
  return buf;
}

// "k3v3" -> (3, 3); "fp16" -> (16, 16).
std::pair<int, int> parse_format(const std::string& f) {
  if (f == "fp16") return {16, 16};
  int k = 0, v = 0;
  if (std::sscanf(f.c_str(), "k%dv%d", &k, &v) != 2)
    throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "format '" + f + "' is not fp16 or kXvY (e.g. k3v3, k16v4)");
  return {k, v};
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q > p) out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

void progress(const char* what, int64_t done, int64_t total) {
  const int width = 30;
  int fill = total ? (int)(width * done / total) : width;
  std::fprintf(stderr, "\r%-28s [%.*s%*s] %3d%%", what, fill, "##############################", width - fill, "",
               total ? (int)(100 * done / total) : 100);
  if (done == total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

// ---------------------------------------------------------------------------------------------
int cmd_info() {
  std::printf("fmkv %s (format v%d)\n", fmkv_version(), fmkv_format_version());
  std::printf("%-8s %-10s %s\n", "backend", "usable", "device");
  for (fmkv_backend b : {FMKV_BACKEND_REF, FMKV_BACKEND_CPU, FMKV_BACKEND_CUDA, FMKV_BACKEND_METAL})
    std::printf("%-8s %-10s %s\n", fmkv_backend_name(b), fmkv_backend_available(b) ? "yes" : "no", fmkv_backend_device(b));
  return 0;
}

int cmd_spec(const Args& a) {
  std::vector<int> dims = {64, 128, 256};
  if (a.count("head-dims")) {
    dims.clear();
    for (auto& s : split(a.at("head-dims"))) dims.push_back((int)to_int(s, "--head-dims"));
  }
  std::printf("fmkv format v%d: group %d, fp16 scale per group, Lloyd-Max codes, randomized Hadamard rotation\n",
              fmkv_format_version(), FMKV_GROUP_SIZE);
  std::printf("%-8s %-5s %12s %12s %14s %10s\n", "head_dim", "bits", "codes B", "scales B", "B/token/head", "vs fp16");
  for (int d : dims) {
    if (!fmkv_head_dim_supported(d)) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "head_dim " + std::to_string(d) + " is not supported (64, 128, 256)");
    for (int b : {2, 3, 4, 16}) {
      int64_t total = fmkv_bytes_per_token_head(d, b);
      int64_t scales = b == 16 ? 0 : 2 * fmkv_groups(d);
      std::printf("%-8d %-5s %12lld %12lld %14lld %9.2fx\n", d, b == 16 ? "fp16" : std::to_string(b).c_str(),
                  (long long)(total - scales), (long long)scales, (long long)total, 2.0 * d / total);
    }
  }
  std::puts("(per K or per V; a kXvY cache stores both: e.g. k3v3 at d=128 = 112 B per token per kv head)");
  return 0;
}

struct Preset { const char* name; int layers, kv_heads, head_dim; double weights; };
const Preset kPresets[] = {
    {"llama-3-8b", 32, 8, 128, 16.06e9},
    {"qwen2.5-7b", 28, 4, 128, 15.23e9},
    {"smollm2-135m", 30, 3, 64, 0.27e9},
    {"gemma-3-270m", 18, 1, 256, 0.54e9},
};

int cmd_capacity(const Args& a) {
  int layers = 0, kv = 0, d = 0;
  double weights = 0;
  if (a.count("preset")) {
    const Preset* p = nullptr;
    for (auto& x : kPresets) if (a.at("preset") == x.name) p = &x;
    if (!p) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "unknown preset '" + a.at("preset") + "'");
    layers = p->layers; kv = p->kv_heads; d = p->head_dim; weights = p->weights;
  }
  if (a.count("layers")) layers = (int)to_int(a.at("layers"), "--layers");
  if (a.count("kv-heads")) kv = (int)to_int(a.at("kv-heads"), "--kv-heads");
  if (a.count("head-dim")) d = (int)to_int(a.at("head-dim"), "--head-dim");
  if (a.count("weights")) weights = to_bytes(a.at("weights"));
  if (!a.count("memory")) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "--memory is required (e.g. --memory 141GB)");
  if (layers < 1 || kv < 1 || !d) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "need --layers, --kv-heads, --head-dim (or --preset)");
  const double memory = to_bytes(a.at("memory"));
  const int64_t batch = a.count("batch") ? to_int(a.at("batch"), "--batch") : 1;
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = d;
  c.num_kv_heads = kv;
  c.page_size = a.count("page-size") ? (int)to_int(a.at("page-size"), "--page-size") : 64;
  c.sink_tokens = a.count("sink") ? (int)to_int(a.at("sink"), "--sink") : 0;
  c.window_tokens = a.count("window") ? (int)to_int(a.at("window"), "--window") : 0;
  if (batch < 1) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "--batch must be >= 1");
  const double avail = memory - weights;
  if (avail <= 0) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "weights do not leave any memory for the cache");
  std::printf("%d layers x %d kv heads x d=%d, batch %lld, page %d tokens, sink %d, window %d\n", layers, kv, d,
              (long long)batch, c.page_size, c.sink_tokens, c.window_tokens);
  std::printf("memory %s - weights %s = %s for the KV cache\n", fmt_bytes(memory).c_str(), fmt_bytes(weights).c_str(), fmt_bytes(avail).c_str());
  std::printf("%-6s %10s %14s %16s %12s %16s\n", "format", "B/tok", "page bytes", "max context/seq", "tokens", "cache bytes");
  for (const char* f : {"fp16", "k4v4", "k4v3", "k3v3", "k4v2", "k3v2", "k2v2", "k16v4", "k16v3"}) {
    auto [kb, vb] = parse_format(f);
    int64_t per_tok = (int64_t)layers * kv * (fmkv_bytes_per_token_head(d, kb) + fmkv_bytes_per_token_head(d, vb == 16 ? 16 : vb));
    int64_t max_ctx, used;
    double per_seq = avail / (double)batch;
    if (kb == 16 && vb == 16) {  // plain fp16 cache, contiguous (no pages)
      max_ctx = (int64_t)(per_seq / per_tok);
      used = max_ctx * per_tok * batch;
      std::printf("%-6s %10lld %14s %16s %12lld %16lld\n", f, (long long)per_tok, "-", fmt_tokens(max_ctx).c_str(),
                  (long long)max_ctx, (long long)used);
      continue;
    }
    c.k_bits = kb;
    c.v_bits = vb;
    fmkv::check(fmkv_config_validate(&c));
    // Per sequence: fp16 sink+window region per layer, then whole pages (every layer).
    int64_t page = fmkv_config_page_bytes(&c), fp16 = fmkv_config_fp16_slot_bytes(&c);
    double for_pages = per_seq - (double)layers * fp16;
    int64_t pages = for_pages > 0 ? (int64_t)(for_pages / ((double)layers * page)) : 0;
    max_ctx = for_pages > 0 ? c.sink_tokens + c.window_tokens + pages * c.page_size : 0;
    used = batch * layers * (pages * page + fp16);
    std::printf("%-6s %10lld %14lld %16s %12lld %16lld\n", f, (long long)per_tok, (long long)page, fmt_tokens(max_ctx).c_str(),
                (long long)max_ctx, (long long)used);
  }
  std::puts("B/tok: K+V bytes per token over all layers and kv heads (scales included); context rounded down to whole pages.");
  return 0;
}

// ---------------------------------------------------------------------------------------------
// demo: synthetic keys with log-normal channel scales and a mean offset (as real
// keys have), Gaussian values, queries giving logits of standard deviation ~2.5.
int cmd_demo(const Args& a) {
  const int64_t ctx = a.count("context") ? to_int(a.at("context"), "--context") : 8192;
  const int H = 8, HQ = 32, d = 128, qrows = 1;
  if (ctx < 16 || ctx > (1 << 22)) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "--context must be in [16, 4194304]");
  fmkv_backend be = fmkv_backend_available(FMKV_BACKEND_CPU) ? FMKV_BACKEND_CPU : FMKV_BACKEND_REF;
  if (a.count("backend")) {
    std::string b = a.at("backend");
    be = b == "ref" ? FMKV_BACKEND_REF : b == "cpu" ? FMKV_BACKEND_CPU : b == "cuda" ? FMKV_BACKEND_CUDA : (fmkv_backend)-1;
    if ((int)be < 0) throw fmkv::Error(FMKV_ERR_INVALID_ARGUMENT, "unknown backend '" + b + "'");
  }
  if (be == FMKV_BACKEND_CUDA) throw fmkv::Error(FMKV_ERR_UNSUPPORTED, "demo runs host caches; use bench/cuda_bench.py for CUDA");
  std::vector<std::string> formats = split(a.count("formats") ? a.at("formats") : "k4v4,k3v3,k4v2,k2v2,k16v3");
  std::printf("fmkv demo: synthetic Llama-3-8B-like layer, %lld tokens, %d kv heads, %d q heads, d=%d, backend %s (%s)\n",
              (long long)ctx, H, HQ, d, fmkv_backend_name(be), fmkv_backend_device(be));
  std::mt19937_64 rng(1234);
  std::normal_distribution<float> nd;
  std::vector<float> chan(d);
  for (auto& c : chan) c = std::exp(0.5f * nd(rng));  // log-normal channel scales (outlier channels)
  std::vector<float> K((size_t)ctx * H * d), V(K.size()), Q((size_t)qrows * HQ * d);
  for (size_t i = 0; i < K.size(); ++i) { K[i] = nd(rng) * chan[i % d] + 0.3f * chan[i % d]; V[i] = nd(rng); }
  for (auto& x : Q) x = 2.0f * nd(rng);  // logits with a standard deviation of about 2.5
  // Exact attention over the fp16 cache (float64), for the error column.
  std::vector<double> exact((size_t)HQ * d, 0.0);
  {
    const double sc = 1.0 / std::sqrt((double)d);
    for (int h = 0; h < HQ; ++h) {
      std::vector<double> s(ctx);
      double mx = -INFINITY, sum = 0;
      for (int64_t t = 0; t < ctx; ++t) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += (double)Q[(size_t)h * d + i] * K[((size_t)t * H + h / 4) * d + i];
        s[t] = dot * sc;
        mx = std::max(mx, s[t]);
      }
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (int64_t t = 0; t < ctx; ++t)
        for (int i = 0; i < d; ++i) exact[(size_t)h * d + i] += s[t] / sum * V[((size_t)t * H + h / 4) * d + i];
    }
  }
  double fp16_bytes = (double)ctx * H * d * 2 * 2;
  std::printf("\n%-7s %12s %9s %12s %12s %12s\n", "format", "cache bytes", "vs fp16", "rel. error", "append ms", "attn ms");
  for (const std::string& f : formats) {
    auto [kb, vb] = parse_format(f);
    fmkv_config c;
    fmkv_config_default(&c);
    c.num_kv_heads = H;
    c.k_bits = kb;
    c.v_bits = vb;
    c.seed = 42;
    fmkv::check(fmkv_config_validate(&c));
    int64_t pages = (ctx + c.page_size - 1) / c.page_size;
    fmkv::HostCache cache(c, 1, pages, 1);
    int32_t s = cache.add_sequence();
    auto t0 = std::chrono::steady_clock::now();
    const int64_t chunk = 1024;
    for (int64_t done = 0; done < ctx; done += chunk) {
      int64_t n = std::min(chunk, ctx - done);
      cache.append(be, 0, s, fmkv::make_tensor(&K[(size_t)done * H * d], FMKV_F32, n, H, d),
                   fmkv::make_tensor(&V[(size_t)done * H * d], FMKV_F32, n, H, d));
      progress(("compress " + f).c_str(), done + n, ctx);
    }
    auto t1 = std::chrono::steady_clock::now();
    std::vector<float> out((size_t)qrows * HQ * d);
    fmkv_tensor qt = fmkv::make_tensor(Q.data(), FMKV_F32, qrows, HQ, d), ot = fmkv::make_tensor(out.data(), FMKV_F32, qrows, HQ, d);
    cache.attention(be, 0, s, qt, ot);  // warm-up
    auto t2 = std::chrono::steady_clock::now();
    const int reps = be == FMKV_BACKEND_REF ? 1 : 5;
    for (int r = 0; r < reps; ++r) cache.attention(be, 0, s, qt, ot);
    auto t3 = std::chrono::steady_clock::now();
    double num = 0, den = 0;
    for (size_t i = 0; i < out.size(); ++i) { num += (out[i] - exact[i]) * (out[i] - exact[i]); den += exact[i] * exact[i]; }
    std::printf("%-7s %12s %8.2fx %12.4f %12.1f %12.2f\n", f.c_str(), fmt_bytes((double)cache.used_bytes()).c_str(),
                fp16_bytes / cache.used_bytes(), std::sqrt(num / den),
                std::chrono::duration<double, std::milli>(t1 - t0).count(),
                std::chrono::duration<double, std::milli>(t3 - t2).count() / reps);
  }
  std::printf("\nfp16 cache: %s. rel. error: ||out - exact|| / ||exact|| of the attention output against float64\n"
              "attention over the fp16 cache. Times are this machine's wall clock (one run, not a benchmark).\n",
              fmt_bytes(fp16_bytes).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  try {
    std::string cmd = argv[1];
    Args a = parse(argc, argv, 2);
    if (cmd == "info") return cmd_info();
    if (cmd == "spec") return cmd_spec(a);
    if (cmd == "capacity") return cmd_capacity(a);
    if (cmd == "demo") return cmd_demo(a);
    std::fprintf(stderr, "fmkv: unknown command '%s'\n", cmd.c_str());
    usage();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fmkv: error: %s\n", e.what());
    return 1;
  }
}
