// The fmkv command: info, spec, capacity, demo, inspect. Uses only the public C/C++ API.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fmkv/fmkv.hpp"
#include "fmkv/format_text.hpp"
#include "fmkv/io.hpp"

namespace {

// Exit codes: 0 success; 1 the library failed while running a valid command (fmkv error);
// 2 a usage error (unknown command or option, missing or malformed value, value out of range).
// On a usage error nothing is written to stdout: every option is checked before the first line.
constexpr int kExitOk = 0, kExitError = 1, kExitUsage = 2;

const char* kUsage =
    "usage: fmkv <command> [options]\n"
    "  info                      version, format version, backends and devices\n"
    "  spec [--head-dims 64,128,256]\n"
    "                            bytes per token per head and compression for each bit width\n"
    "  capacity [--preset NAME] [--layers N --kv-heads N --head-dim D] --memory 141GB\n"
    "           [--weights 16GB] [--batch B] [--page-size P] [--sink S] [--window W]\n"
    "                            maximum context per format (presets: llama-3-8b, qwen2.5-7b,\n"
    "                            smollm2-135m, gemma-3-270m; sizes: B, KB, MB, GB, TB, KiB..TiB)\n"
    "  demo [--context N] [--backend ref|cpu] [--formats k4v4,k3v3,...]\n"
    "                            compress a synthetic KV cache, run attention, report\n"
    "                            compression, error vs fp16 attention and time (formats kXvY:\n"
    "                            X a code width or 16 for fp16 K, Y a code width; `fmkv spec`)\n"
    "  inspect FILE              check a snapshot file whole (checksums, sizes, geometry) and print\n"
    "                            its config, layers and sequences (exit 1 naming the problem if bad)\n"
    "exit status: 0 success, 1 error while running, 2 bad command line";

// A bad command line: reported with the usage line, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Args = std::map<std::string, std::string>;

// --name value or --name=value; each option at most once, only the command's own options.
Args parse(int argc, char** argv, int first, const std::string& cmd, const std::vector<std::string>& allowed) {
  Args a;
  for (int i = first; i < argc; ++i) {
    std::string k = argv[i], v;
    if (k.rfind("--", 0) != 0 || k.size() == 2) throw UsageError("unexpected argument '" + k + "'");
    const size_t eq = k.find('=');
    if (eq != std::string::npos) {
      v = k.substr(eq + 1);
      k = k.substr(0, eq);
    }
    const std::string name = k.substr(2);
    if (std::find(allowed.begin(), allowed.end(), name) == allowed.end())
      throw UsageError("unknown option " + k + " for '" + cmd + "'" +
                       (allowed.empty() ? " (it takes no options)" : ""));
    if (eq == std::string::npos) {
      if (i + 1 >= argc) throw UsageError("option " + k + " needs a value");
      v = argv[++i];
    }
    if (!a.emplace(name, v).second) throw UsageError("option " + k + " given twice");
  }
  return a;
}

// The one number parser of the CLI. Integer: optional '-', decimal digits, nothing else.
// Size: a finite decimal number (digits, optional fraction and exponent; no inf, nan or hex) and an
// optional unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), any
// case, rounded to whole bytes. Both are range-checked into [lo, hi]; the message quotes the text.
enum class Number { Integer, Size };

int64_t parse_number(const std::string& flag, const std::string& s, Number kind, int64_t lo, int64_t hi) {
  const std::string range = " (expected " + std::to_string(lo) + " to " + std::to_string(hi) + ")";
  if (kind == Number::Integer) {
    int64_t v = 0;
    const char* b = s.data();
    const char* e = s.data() + s.size();
    const auto r = std::from_chars(b, e, v);
    if (s.empty() || r.ptr != e || (r.ec != std::errc() && r.ec != std::errc::result_out_of_range))
      throw UsageError(flag + ": '" + s + "' is not an integer");
    if (r.ec == std::errc::result_out_of_range || v < lo || v > hi) throw UsageError(flag + ": " + s + " is out of range" + range);
    return v;
  }
  size_t i = 0, digits = 0;
  while (i < s.size() && std::isdigit((unsigned char)s[i])) ++i, ++digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit((unsigned char)s[i])) ++i, ++digits;
  }
  if (digits && i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t j = i + 1;
    if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
    size_t exp_digits = 0;
    while (j < s.size() && std::isdigit((unsigned char)s[j])) ++j, ++exp_digits;
    if (exp_digits) i = j;
  }
  std::string unit = s.substr(i);
  for (auto& c : unit) c = (char)std::toupper((unsigned char)c);
  const long double m = unit.empty() || unit == "B" ? 1.0L : unit == "KB" ? 1e3L : unit == "MB" ? 1e6L : unit == "GB" ? 1e9L
                      : unit == "TB" ? 1e12L : unit == "KIB" ? 1024.0L : unit == "MIB" ? 1048576.0L
                      : unit == "GIB" ? 1073741824.0L : unit == "TIB" ? 1099511627776.0L : -1.0L;
  if (!digits || m < 0)
    throw UsageError(flag + ": size '" + s + "' not understood (a number and a unit, e.g. 141GB, 16GiB, 512MB, 1e9)");
  const long double bytes = std::strtold(s.substr(0, i).c_str(), nullptr) * m;
  if (!std::isfinite(bytes) || bytes > (long double)hi + 0.5L || bytes < (long double)lo - 0.5L)
    throw UsageError(flag + ": " + s + " is out of range (expected " + std::to_string(lo) + " to " + std::to_string(hi) + " bytes)");
  return (int64_t)std::llroundl(bytes);
}

int64_t int_option(const Args& a, const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  auto it = a.find(name);
  return it == a.end() ? dflt : parse_number(std::string("--") + name, it->second, Number::Integer, lo, hi);
}

constexpr int64_t kMaxBytes = (int64_t)1 << 62;  // 4 EiB: no memory size the CLI accepts is larger
constexpr int64_t kI32Max = 2147483647;

int64_t size_option(const Args& a, const char* name, int64_t dflt, int64_t lo) {
  auto it = a.find(name);
  return it == a.end() ? dflt : parse_number(std::string("--") + name, it->second, Number::Size, lo, kMaxBytes);
}

// Overflow-checked arithmetic of the capacity table (byte counts are int64).
int64_t mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw fmkv::Error(FMKV_ERR_OVERFLOW, "cache size overflows 64-bit byte counts");
  return r;
}
int64_t add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw fmkv::Error(FMKV_ERR_OVERFLOW, "cache size overflows 64-bit byte counts");
  return r;
}

std::string fmt_bytes(double b) {
  char buf[64];
  const char* u[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
  int i = 0;
  while (b >= 1000 && i < 6) { b /= 1000; ++i; }
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

// "k3v3" -> (3, 3), strictly 'k' digits 'v' digits; "fp16" -> (16, 16) where allowed.
std::pair<int, int> parse_format(const std::string& flag, const std::string& f, bool allow_fp16) {
  if (f == "fp16") {
    if (allow_fp16) return {16, 16};
    throw UsageError(flag + ": 'fp16' is the uncompressed baseline the table compares against, not a cache format "
                            "(formats are kXvY with X in " + fmkv::supported_code_bits_text(true) + " and Y in " +
                     fmkv::supported_code_bits_text(false) + ", e.g. k3v3, k16v4)");
  }
  const size_t v = f.find('v');
  const std::string bad = flag + ": format '" + f + "' is not kXvY (X in " + fmkv::supported_code_bits_text(true) +
                          "; Y in " + fmkv::supported_code_bits_text(false) + "; e.g. k3v3, k16v4)";
  if (f.size() < 4 || f[0] != 'k' || v == std::string::npos || v == 1 || v + 1 == f.size()) throw UsageError(bad);
  auto digits = [&](const std::string& x) {
    if (x.size() > 2 || !std::all_of(x.begin(), x.end(), [](char c) { return c >= '0' && c <= '9'; })) throw UsageError(bad);
    return std::stoi(x);
  };
  const int k = digits(f.substr(1, v - 1)), vb = digits(f.substr(v + 1));
  if ((!fmkv_code_bits_supported(k) && k != FMKV_FP16_BITS) || !fmkv_code_bits_supported(vb)) throw UsageError(bad);
  return {k, vb};
}

// A comma-separated list with no empty items, and at least one item.
std::vector<std::string> split_list(const std::string& flag, const std::string& s) {
  std::vector<std::string> out;
  size_t p = 0;
  for (;;) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    if (q == p) throw UsageError(flag + ": empty item in list '" + s + "' (expected e.g. " +
                                 (flag == "--formats" ? "k4v4,k3v3" : "64,128") + ")");
    out.push_back(s.substr(p, q - p));
    if (q == s.size()) break;
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
  for (int bi = 0; bi < FMKV_BACKEND_COUNT; ++bi) {
    const fmkv_backend b = (fmkv_backend)bi;
    std::printf("%-8s %-10s %s\n", fmkv_backend_name(b), fmkv_backend_available(b) ? "yes" : "no", fmkv_backend_device(b));
  }
  // Which (head_dim, K, V) the usable backends' decode attention has (fmkv_backend_check_attention; appends take
  // every combination): "every" or the list per head_dim, for each format version whose 3-bit codes differ.
  std::printf("decode attention (head_dim: K x V pairs; K %s, V %s):\n", fmkv::supported_code_bits_text(true).c_str(),
              fmkv::supported_code_bits_text(false).c_str());
  std::vector<int32_t> kw = fmkv::supported_code_bits();
  kw.push_back(FMKV_FP16_BITS);
  for (int bi = 0; bi < FMKV_BACKEND_COUNT; ++bi) {
    const fmkv_backend b = (fmkv_backend)bi;
    if (!fmkv_backend_available(b)) continue;
    for (int32_t version = 1; version <= FMKV_FORMAT_VERSION_NEWEST; ++version) {
      if (!fmkv_format_version_supported(version)) continue;
      std::string pairs;
      int all = 0, ok = 0;
      for (int32_t d : fmkv::supported_head_dims()) {
        std::string row;
        for (int32_t kb : kw)
          for (int32_t vb : fmkv::supported_code_bits()) {
            fmkv_config c;
            fmkv_config_default(&c);
            c.head_dim = d;
            c.k_bits = kb;
            c.v_bits = vb;
            c.format_version = version;
            ++all;
            if (fmkv_backend_check_attention(b, &c) != FMKV_OK) continue;
            ++ok;
            row += " k" + std::to_string(kb) + "v" + std::to_string(vb);
          }
        if (!row.empty()) pairs += (pairs.empty() ? "" : "; ") + std::to_string(d) + ":" + row;
      }
      std::printf("%-8s format v%d: %s\n", fmkv_backend_name(b), version,
                  ok == all ? "every head_dim x K x V" : ok == 0 ? "none" : pairs.c_str());
    }
  }
  return kExitOk;
}

int cmd_spec(const Args& a) {
  std::vector<int32_t> dims = fmkv::supported_head_dims();
  if (a.count("head-dims")) {
    dims.clear();
    for (auto& s : split_list("--head-dims", a.at("head-dims"))) {
      const int64_t d = parse_number("--head-dims", s, Number::Integer, 1, kI32Max);
      if (!fmkv_head_dim_supported((int32_t)d)) throw UsageError("--head-dims: head_dim " + s + " is not supported (" + fmkv::supported_head_dims_text() + ")");
      dims.push_back((int32_t)d);
    }
  }
  std::printf("fmkv format v%d: code groups of %d, an fp16 scale per scale group (default %d coordinates), Lloyd-Max codes, "
              "randomized Hadamard rotation\n", fmkv_format_version(), FMKV_GROUP_SIZE, FMKV_SCALE_GROUP);
  std::printf("%-8s %-5s %-11s %12s %12s %14s %10s\n", "head_dim", "bits", "scale group", "codes B", "scales B",
              "B/token/head", "vs fp16");
  for (int d : dims) {
    std::vector<int32_t> widths = fmkv::supported_code_bits();
    widths.push_back(FMKV_FP16_BITS);
    for (int b : widths)
      for (int32_t sg = FMKV_GROUP_SIZE; sg <= d; sg *= 2) {
        if (!fmkv_scale_group_supported(sg) || (b == FMKV_FP16_BITS && sg != FMKV_SCALE_GROUP)) continue;
        int64_t total = fmkv_bytes_per_token_head(d, b, sg);
        int64_t scales = b == FMKV_FP16_BITS ? 0 : 2 * fmkv_scales_per_vector(d, sg);
        std::printf("%-8d %-5s %-11s %12lld %12lld %14lld %9.2fx\n", d, b == 16 ? "fp16" : std::to_string(b).c_str(),
                    b == FMKV_FP16_BITS ? "-" : std::to_string(sg).c_str(), (long long)(total - scales), (long long)scales,
                    (long long)total, 2.0 * d / total);
      }
  }
  std::puts("(per K or per V; a kXvY cache stores both: e.g. k3v3 at d=128 = 112 B per token per kv head)");
  return kExitOk;
}

struct Preset { const char* name; int layers, kv_heads, head_dim; int64_t weights; };
const Preset kPresets[] = {
    {"llama-3-8b", 32, 8, 128, 16060000000},
    {"qwen2.5-7b", 28, 4, 128, 15230000000},
    {"smollm2-135m", 30, 3, 64, 270000000},
    {"gemma-3-270m", 18, 1, 256, 540000000},
};

int cmd_capacity(const Args& a) {
  int64_t layers = 0, kv = 0, d = 0, weights = 0;
  if (a.count("preset")) {
    const Preset* p = nullptr;
    for (auto& x : kPresets) if (a.at("preset") == x.name) p = &x;
    if (!p) throw UsageError("--preset: unknown preset '" + a.at("preset") + "' (llama-3-8b, qwen2.5-7b, smollm2-135m, gemma-3-270m)");
    layers = p->layers; kv = p->kv_heads; d = p->head_dim; weights = p->weights;
  }
  layers = int_option(a, "layers", layers, 1, 65536);
  kv = int_option(a, "kv-heads", kv, 1, 65536);
  d = int_option(a, "head-dim", d, 1, kI32Max);
  weights = size_option(a, "weights", weights, 0);
  if (!a.count("memory")) throw UsageError("--memory is required (e.g. --memory 141GB)");
  if (!layers || !kv || !d) throw UsageError("need --layers, --kv-heads and --head-dim (or --preset)");
  if (!fmkv_head_dim_supported((int32_t)d)) throw UsageError("--head-dim: " + std::to_string(d) + " is not supported (" + fmkv::supported_head_dims_text() + ")");
  const int64_t memory = size_option(a, "memory", 0, 1);
  const int64_t batch = int_option(a, "batch", 1, 1, kI32Max);
  fmkv_config c;
  fmkv_config_default(&c);
  c.head_dim = (int32_t)d;
  c.num_kv_heads = (int32_t)kv;
  c.page_size = (int32_t)int_option(a, "page-size", 64, 1, kI32Max);
  c.sink_tokens = (int32_t)int_option(a, "sink", 0, 0, 1 << 20);
  c.window_tokens = (int32_t)int_option(a, "window", 0, 0, 1 << 20);
  if (fmkv_config_validate(&c) != FMKV_OK) throw UsageError(std::string("--page-size / --sink / --window: ") + fmkv_last_error());
  if (weights >= memory)
    throw UsageError("--weights " + fmt_bytes((double)weights) + " leave nothing of --memory " + fmt_bytes((double)memory) + " for the cache");
  const int64_t avail = memory - weights, per_seq = avail / batch;

  // Every row is computed (and every config validated) before the first line is printed.
  std::vector<std::string> rows;
  int64_t fp16_need = 0;  // bytes of one sequence's fp16 sink + window regions when they do not fit
  char line[256];
  for (const char* f : {"fp16", "k4v4", "k4v3", "k3v3", "k4v2", "k3v2", "k2v2", "k16v4", "k16v3"}) {
    auto [kb, vb] = parse_format("format", f, true);
    const int64_t per_tok = mul(mul(layers, kv), fmkv_bytes_per_token_head((int32_t)d, kb, 0) + fmkv_bytes_per_token_head((int32_t)d, vb, 0));
    if (kb == 16 && vb == 16) {  // plain fp16 cache, contiguous (no pages)
      const int64_t max_ctx = per_seq / per_tok, used = mul(mul(max_ctx, per_tok), batch);
      std::snprintf(line, sizeof line, "%-6s %10lld %14s %16s %12lld %16lld", f, (long long)per_tok, "-",
                    fmt_tokens(max_ctx).c_str(), (long long)max_ctx, (long long)used);
      rows.push_back(line);
      continue;
    }
    c.k_bits = kb;
    c.v_bits = vb;
    fmkv::check(fmkv_config_validate(&c));
    // Per sequence: the fp16 sink+window region of every layer, then whole pages (every layer).
    const int64_t page = fmkv_config_page_bytes(&c), fp16 = mul(layers, fmkv_config_fp16_slot_bytes(&c));
    int64_t pages = 0, max_ctx = 0, used = 0;
    if (fp16 <= per_seq) {
      pages = (per_seq - fp16) / mul(layers, page);
      max_ctx = add(c.sink_tokens + (int64_t)c.window_tokens, mul(pages, c.page_size));
      used = mul(batch, add(mul(mul(layers, pages), page), fp16));
    } else {
      fp16_need = fp16;
    }
    std::snprintf(line, sizeof line, "%-6s %10lld %14lld %16s %12lld %16lld", f, (long long)per_tok, (long long)page,
                  fmt_tokens(max_ctx).c_str(), (long long)max_ctx, (long long)used);
    rows.push_back(line);
  }
  std::printf("%lld layers x %lld kv heads x d=%lld, batch %lld, page %d tokens, sink %d, window %d\n", (long long)layers,
              (long long)kv, (long long)d, (long long)batch, c.page_size, c.sink_tokens, c.window_tokens);
  std::printf("memory %s - weights %s = %s for the KV cache\n", fmt_bytes((double)memory).c_str(), fmt_bytes((double)weights).c_str(),
              fmt_bytes((double)avail).c_str());
  std::printf("%-6s %10s %14s %16s %12s %16s\n", "format", "B/tok", "page bytes", "max context/seq", "tokens", "cache bytes");
  for (const auto& r : rows) std::puts(r.c_str());
  std::puts("B/tok: K+V bytes per token over all layers and kv heads (scales included); context rounded down to whole pages.");
  if (fp16_need)
    std::printf("compressed formats: no context fits: the fp16 sink + window regions of one sequence take %s over all\n"
                "layers, more than the %s per sequence\n", fmt_bytes((double)fp16_need).c_str(), fmt_bytes((double)per_seq).c_str());
  return kExitOk;
}

// ---------------------------------------------------------------------------------------------
// demo: synthetic keys with log-normal channel scales and a mean offset (as real
// keys have), Gaussian values, queries giving logits of standard deviation ~2.5.
int cmd_demo(const Args& a) {
  const int64_t ctx = int_option(a, "context", 8192, 16, 1 << 22);
  const int H = 8, HQ = 32, d = 128, qrows = 1;
  fmkv_backend be = fmkv_backend_available(FMKV_BACKEND_CPU) ? FMKV_BACKEND_CPU : FMKV_BACKEND_REF;
  if (a.count("backend")) {
    const std::string b = a.at("backend");
    if (b == "cuda" || b == "metal")
      throw UsageError("--backend " + b + ": demo runs host caches (ref or cpu); bench/ has the device benchmarks");
    if (b != "ref" && b != "cpu") throw UsageError("--backend: unknown backend '" + b + "' (ref or cpu)");
    be = b == "ref" ? FMKV_BACKEND_REF : FMKV_BACKEND_CPU;
    if (!fmkv_backend_available(be)) throw UsageError("--backend cpu: the cpu backend is not compiled into this build");
  }
  std::vector<fmkv_config> configs;
  const std::vector<std::string> formats = split_list("--formats", a.count("formats") ? a.at("formats") : "k4v4,k3v3,k4v2,k2v2,k16v3");
  for (const std::string& f : formats) {
    auto [kb, vb] = parse_format("--formats", f, false);
    fmkv_config c;
    fmkv_config_default(&c);
    c.num_kv_heads = H;
    c.k_bits = kb;
    c.v_bits = vb;
    c.seed = 42;
    fmkv::check(fmkv_config_validate(&c));
    configs.push_back(c);
  }
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
  for (size_t fi = 0; fi < formats.size(); ++fi) {
    const std::string& f = formats[fi];
    const fmkv_config& c = configs[fi];
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
  return kExitOk;
}

// A snapshot file (include/fmkv/io.h, docs/FILE-FORMAT.md): loaded by copy, which checks every byte (the
// mapping checks the same but defers nothing either); its header and sequences.
int cmd_inspect(const std::string& path) {
  fmkv_load_options o;
  fmkv_load_options_default(&o);
  const fmkv::Snapshot snap = fmkv::Snapshot::load(path, &o);
  const fmkv_snapshot_info i = snap.info();
  const fmkv_config& c = i.config;
  const int64_t pb = fmkv_config_page_bytes(&c);
  std::printf("%s: fmkv snapshot, file version %d, cache format v%d, checksums and geometry valid\n", path.c_str(),
              i.file_version, i.format_version);
  std::printf("config: head_dim %d, kv heads %d, k%dv%d, page %d tokens (%lld B), sink %d, window %d, scale %s per %d "
              "coordinates, seed %llu\n",
              c.head_dim, c.num_kv_heads, c.k_bits, c.v_bits, c.page_size, (long long)pb, c.sink_tokens,
              c.window_tokens, c.scale_rule == FMKV_SCALE_RMS ? "rms" : "lsq", fmkv_resolved_scale_group(c.scale_group),
              (unsigned long long)c.seed);
  std::printf("layers: %d, %lld pages each (%s per layer), fp16 region %s per sequence and layer\n", i.num_layers,
              (long long)i.file_pages, fmt_bytes((double)i.file_pages * (double)pb).c_str(),
              fmt_bytes((double)fmkv_config_fp16_slot_bytes(&c)).c_str());
  std::printf("%-9s %12s %8s %14s\n", "sequence", "tokens", "pages", "dequantized");
  for (int32_t s = 0; s < i.num_seqs; ++s) {
    const fmkv_snapshot_sequence q = snap.sequence(s);
    std::printf("%-9d %12lld %8lld %14d\n", s, (long long)q.num_tokens, (long long)q.num_pages, q.dequantized_tokens);
  }
  if (i.flags & 1u) std::printf("note: some window tokens were restored from their codes (saved as a prefix)\n");
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "-h") || !std::strcmp(argv[i], "--help")) {
      std::puts(kUsage);
      return kExitOk;
    }
  if (argc < 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return kExitUsage;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "info") {
      parse(argc, argv, 2, cmd, {});
      return cmd_info();
    }
    if (cmd == "spec") return cmd_spec(parse(argc, argv, 2, cmd, {"head-dims"}));
    if (cmd == "capacity")
      return cmd_capacity(parse(argc, argv, 2, cmd,
                                {"preset", "layers", "kv-heads", "head-dim", "memory", "weights", "batch", "page-size", "sink", "window"}));
    if (cmd == "demo") return cmd_demo(parse(argc, argv, 2, cmd, {"context", "backend", "formats"}));
    if (cmd == "inspect") {
      if (argc < 3 || std::strncmp(argv[2], "--", 2) == 0) throw UsageError("inspect needs a snapshot FILE");
      parse(argc, argv, 3, cmd, {});
      return cmd_inspect(argv[2]);
    }
    throw UsageError("unknown command '" + cmd + "'");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "fmkv: error: %s\n%s\n", e.what(), kUsage);
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fmkv: error: %s\n", e.what());
    return kExitError;
  }
}
