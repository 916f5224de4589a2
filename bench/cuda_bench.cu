// fmkv CUDA benchmark: decode attention on the compressed cache (CUDA graph, median over replays,
// rotating cache copies when one copy would sit in L2), quantize-append throughput, and the device
// copy bandwidth, and one decode step per layer (append + attention: separate vs fused, in a CUDA
// graph). Prints one JSON object per line. Driver: bench/cuda_bench.py.
//   fmkv_cuda_bench [--quick]
// FMKV_BENCH_FORMAT_VERSION=3 runs every case in format version 3 (3-bit codes in tile blocks); each record
// names its format_version.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/trace.h"
#include "fmkv/fmkv.h"

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
#define FK(x)                                                                               \
  do {                                                                                      \
    fmkv_status s_ = (x);                                                                   \
    if (s_ != FMKV_OK) {                                                                    \
      std::fprintf(stderr, "fmkv error %d: %s at %s:%d\n", (int)s_, fmkv_last_error(), __FILE__, __LINE__); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return (uint32_t)x;
}
// Approximately N(0, sd^2) fp16 values (sum of 4 uniforms), channel-dependent sd for keys.
__global__ void fill_normal(__half* p, int64_t n, uint64_t seed, int d, float outlier) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float s = 0;
    for (int k = 0; k < 4; ++k) s += (hash32(seed * 0x9E3779B97F4A7C15ull + i * 4 + k) >> 8) * (1.0f / 16777216.0f) - 0.5f;
    float chan = 1.0f + outlier * ((hash32(seed + (i % d) * 7919) >> 8) * (1.0f / 16777216.0f));
    p[i] = __float2half(s * 1.7320508f * chan);
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time (ms) of one of `copies` calls: capture enqueue() (which issues the calls on st) in a
// CUDA graph, warm up, replay `reps` times.
template <typename F>
static float graph_ms_per_call(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, int copies, int reps, F enqueue) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  enqueue();
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms / copies);
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return median(t);
}

static double copy_gbps() {
  const size_t bytes = (size_t)2 << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) t.push_back(ms);
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (median(t) * 1e-3) / 1e9;
}

struct Fmt {
  int kb, vb;
  int sg = 0;  // fmkv_config.scale_group (0: the default, 32)
};

// --ragged lengths: comma-separated items, each L (one sequence), LxN (N of them) or A-BxN (N lengths evenly
// spaced from A to B); a k suffix multiplies by 1024 ("1k-64kx16": 16 sequences of 1024 .. 65536 tokens).
static int64_t parse_len(const std::string& t) {
  if (t.empty()) return -1;
  const bool k = t.back() == 'k' || t.back() == 'K';
  char* end = nullptr;
  const long long v = std::strtoll(t.c_str(), &end, 10);
  if (end != t.c_str() + t.size() - (k ? 1 : 0) || v < 1 || v > (1ll << 24)) return -1;
  return k ? v * 1024 : v;
}
static std::vector<int64_t> parse_lengths(const std::string& spec) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i <= spec.size()) {
    const size_t j = std::min(spec.find(',', i), spec.size());
    const std::string item = spec.substr(i, j - i);
    const size_t x = item.find('x'), dash = item.find('-');
    const long long n = x == std::string::npos ? 1 : std::atoll(item.c_str() + x + 1);
    const std::string range = item.substr(0, x);
    const int64_t a = parse_len(range.substr(0, dash)), b = dash == std::string::npos ? a : parse_len(range.substr(dash + 1));
    if (a < 1 || b < 1 || n < 1 || n > 4096) {
      std::fprintf(stderr, "--ragged: bad lengths item '%s' (L, LxN or A-BxN, e.g. 1k-64kx16)\n", item.c_str());
      std::exit(2);
    }
    for (long long q = 0; q < n; ++q) out.push_back(n == 1 ? a : a + (int64_t)((double)(b - a) * q / (n - 1) + 0.5));
    i = j + 1;
  }
  return out;
}

#ifdef FMKV_CUDA_TRACE
// Latency trace of the last decode call (a -DFMKV_CUDA_TRACE=ON build, --trace): per CTA role, when
// the CTAs entered and left (globaltimer, from the first attention CTA's entry) and the time between
// consecutive recorded phases (clock64, converted with the clock rate measured from the same CTAs).
static void print_trace(const char* label, int64_t ctx, int B, int kb, int vb) {
  using namespace fmkv::cuda;
  constexpr int C = kTraceCtas, S = kTraceSlots;
  std::vector<unsigned long long> t((size_t)2 * C * S);
  fmkv::cuda::trace_read(t.data(), t.size());
  auto row = [&](int k, int c) { return &t[((size_t)k * C + c) * S]; };
  unsigned long long g0 = ~0ull;
  std::vector<double> ghz;
  for (int k = 0; k < 2; ++k)
    for (int c = 0; c < C; ++c) {
      const unsigned long long* r = row(k, c);
      if (!r[kTraceRole]) continue;
      if (k == 0) g0 = std::min(g0, r[kTraceEntryTime]);
      const unsigned long long t0 = r[kTraceEntryTime], t1 = r[kTraceExitTime], last = r[kTracePhases - 1];
      if (t1 > t0 + 2000 && last > r[0]) ghz.push_back((double)(last - r[0]) / (double)(t1 - t0));
    }
  if (g0 == ~0ull || ghz.empty()) {
    std::printf("{\"kind\":\"trace\",\"label\":\"%s\",\"error\":\"no trace recorded\"}\n", label);
    return;
  }
  std::sort(ghz.begin(), ghz.end());
  const double f = ghz[ghz.size() / 2];  // cycles per ns
  auto role_name = [](int role) {
    switch (role) {
      case kTraceSplit: return "split";
      case kTraceFp16Part: return "fp16_part";
      case kTraceFused: return "fused";
      case kTraceEmptySplit: return "empty_split";
      default: return "merge";
    }
  };
  auto stats = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    char b[96];
    std::snprintf(b, sizeof b, "[%.2f,%.2f,%.2f]", v.front(), v[v.size() / 2], v.back());
    return std::string(b);
  };
  for (int role = kTraceSplit; role <= kTraceMerge; ++role) {
    const int k = role == kTraceMerge ? 1 : 0;
    std::vector<double> entry, exit_;
    std::vector<std::vector<double>> ph(kTracePhases);  // ph[i]: time from the previous recorded phase to phase i
    for (int c = 0; c < C; ++c) {
      const unsigned long long* r = row(k, c);
      if ((int)r[kTraceRole] != role) continue;
      entry.push_back((double)(r[kTraceEntryTime] - g0) * 1e-3);
      exit_.push_back((double)(r[kTraceExitTime] - g0) * 1e-3);
      int prev = 0;
      for (int i = 1; i < kTracePhases; ++i)
        if (r[i]) {
          ph[i].push_back((double)(r[i] - r[prev]) / f * 1e-3);
          prev = i;
        }
    }
    if (entry.empty()) continue;
    std::string phases;
    for (int i = 1; i < kTracePhases; ++i)
      if (!ph[i].empty()) phases += std::string(phases.empty() ? "" : ",") + "\"" + std::to_string(i) + "\":" + stats(ph[i]);
    std::printf("{\"kind\":\"trace\",\"label\":\"%s\",\"batch\":%d,\"context\":%lld,\"role\":\"%s\",\"ctas\":%zu,"
                "\"sm_ghz\":%.3f,\"entry_us\":%s,\"exit_us\":%s,\"phase_us\":{%s}}\n",
                label, B, (long long)ctx, role_name(role), entry.size(), f, stats(entry).c_str(), stats(exit_).c_str(),
                phases.c_str());
  }
  // FMKV_TRACE_CTAS=path: also append one JSON line per CTA (grid position, SM, entry / exit and the
  // recorded phases in us) for placement analyses (tests/cuda/trace_sm.py)
  if (const char* path = std::getenv("FMKV_TRACE_CTAS")) {
    if (FILE* fp = std::fopen(path, "a")) {
      for (int k = 0; k < 2; ++k)
        for (int c = 0; c < C; ++c) {
          const unsigned long long* r = row(k, c);
          if (!r[kTraceRole]) continue;
          std::string ph;
          for (int i = 1; i < kTracePhases; ++i)
            if (r[i]) ph += (ph.empty() ? "" : ",") + std::string("\"") + std::to_string(i) + "\":" +
                            std::to_string((double)(r[i] - r[0]) / f * 1e-3);
          std::fprintf(fp,
                       "{\"label\":\"%s\",\"batch\":%d,\"context\":%lld,\"k_bits\":%d,\"v_bits\":%d,\"kernel\":%d,"
                       "\"cta\":%d,\"role\":\"%s\",\"sm\":%llu,\"entry_us\":%.3f,\"exit_us\":%.3f,\"phase_us\":{%s}}\n",
                       label, B, (long long)ctx, kb, vb, k, c, role_name((int)r[kTraceRole]), r[kTraceSm],
                       (double)(r[kTraceEntryTime] - g0) * 1e-3, (double)(r[kTraceExitTime] - g0) * 1e-3, ph.c_str());
        }
      std::fclose(fp);
    }
  }
  std::fflush(stdout);
}
#endif

int main(int argc, char** argv) {
  // --quick: fewer cases; --only B ctx kb vb [--step]: one decode case (for profilers; with --step also
  // its decode step, separate and fused); --window W [ctx ...]: k3v3 at
  // B=1 with a W-token fp16 window (attention and decode step; no quantize timing); --quant-only kb vb:
  // the quantize-append timing alone (for profilers)
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  const char* fv_env = std::getenv("FMKV_BENCH_FORMAT_VERSION");
  const int format_version = fv_env ? std::atoi(fv_env) : 0;
  if (fv_env && format_version != 2 && format_version != 3) {
    std::fprintf(stderr, "FMKV_BENCH_FORMAT_VERSION=%s: expected 2 or 3\n", fv_env);
    return 2;
  }
  const int fv_out = format_version ? format_version : fmkv_format_version();
  const bool quant_only = argc > 3 && std::string(argv[1]) == "--quant-only";
  // --latency: k3v3 at B=1 4k / 32k / 128k and B=64 8k, attention and decode step (no quantize timing)
  const bool latency = argc > 1 && std::string(argv[1]) == "--latency";
  // --trace B ctx kb vb [W] (a -DFMKV_CUDA_TRACE=ON build): one decode case (B = 1 with a W-token fp16
  // window), then the latency trace of its last attention call and of its last fused decode step (print_trace)
  const bool trace = argc > 5 && std::string(argv[1]) == "--trace";
  const bool only = argc > 5 && (std::string(argv[1]) == "--only" || std::string(argv[1]) == "--step-only" || trace);
  // --ragged kb vb LENGTHS: one decode case of sequences of the given lengths (parse_lengths), attention only
  const bool ragged = argc > 4 && std::string(argv[1]) == "--ragged";
  // --step-only B ctx kb vb: plain (non-graph) launches of the fused decode step, for profilers
  const bool step_only = only && std::string(argv[1]) == "--step-only";
  // --only B ctx kb vb --step: also the decode step per layer (separate and fused, CUDA graph)
  const bool only_step = only && !step_only && argc > 6 && std::string(argv[6]) == "--step";
  const int window = argc > 2 && std::string(argv[1]) == "--window" ? std::atoi(argv[2])
                     : trace && argc > 6                                 ? std::atoi(argv[6])
                                                                         : 0;
  if (window > 0 && trace && std::atoi(argv[2]) != 1) {
    std::fprintf(stderr, "--trace with a window: B must be 1 (one fp16 region slot)\n");
    return 1;
  }
  if (!fmkv_backend_available(FMKV_BACKEND_CUDA)) {
    std::fprintf(stderr, "CUDA backend not available\n");
    return 1;
  }
#ifdef FMKV_CUDA_TRACE
  if (trace) fmkv::cuda::trace_clear();  // allocates the trace buffer (not allowed during graph capture)
#endif
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double cbw = copy_gbps();
  std::printf("{\"kind\":\"copy\",\"device\":\"%s\",\"gbps\":%.1f,\"l2_bytes\":%d,\"sms\":%d}\n", prop.name, cbw,
              prop.l2CacheSize, prop.multiProcessorCount);
  std::fflush(stdout);

  // FMKV_BENCH_KV_HEADS: kv heads (default 8; q heads = 4 x kv heads), e.g. 1 for one GPU's share of a
  // tensor-parallel model (bench/cuda_bench.py --kv-heads-sweep)
  const char* kvh = std::getenv("FMKV_BENCH_KV_HEADS");
  // FMKV_BENCH_HEAD_DIM: head_dim of every case (64, 128 or 256; default 128)
  const char* hdv = std::getenv("FMKV_BENCH_HEAD_DIM");
  const int d = hdv ? std::atoi(hdv) : 128;
  if (!fmkv_head_dim_supported(d)) {
    std::fprintf(stderr, "FMKV_BENCH_HEAD_DIM=%s: expected 64, 128 or 256\n", hdv);
    return 2;
  }
  // FMKV_BENCH_Q_PER_KV: q heads per kv head (the GQA group; default 4, 1 to 32), e.g. 7 for 28 q / 4 kv heads
  // (bench/cuda_bench.py --shape-sweep)
  const char* qpk = std::getenv("FMKV_BENCH_Q_PER_KV");
  const int group = qpk ? std::atoi(qpk) : 4;
  if (group < 1 || group > 32) {
    std::fprintf(stderr, "FMKV_BENCH_Q_PER_KV=%s: expected 1 to 32\n", qpk);
    return 2;
  }
  const int H = kvh && std::atoi(kvh) > 0 ? std::atoi(kvh) : 8, HQ = group * H, P = 64;
  // FMKV_BENCH_Q_LEN: query rows per sequence (default 1; up to FMKV_FUSED_MAX_ROWS: speculative
  // verification), causal over the sequence's last q_len tokens; the decode step appends as many
  const char* qlv = std::getenv("FMKV_BENCH_Q_LEN");
  const int qlen = qlv && std::atoi(qlv) > 0 ? std::min(std::atoi(qlv), (int)FMKV_FUSED_MAX_ROWS) : 1;
  // FMKV_BENCH_MAX_SEQ_LEN=0: attention calls without a length bound (opts.max_seq_len = 0, the split
  // count of an unknown length); default: the context length, as a serving loop that knows it passes
  const char* msl = std::getenv("FMKV_BENCH_MAX_SEQ_LEN");
  const bool pass_bound = !(msl && std::atoll(msl) == 0);
  const int64_t chunk = 32768;  // prefill chunk for filling / quantize timing
  __half *kin, *vin;
  CK(cudaMalloc(&kin, chunk * H * d * 2));
  CK(cudaMalloc(&vin, chunk * H * d * 2));
  fill_normal<<<1024, 256>>>(kin, chunk * H * d, 1, d, 3.0f);
  fill_normal<<<1024, 256>>>(vin, chunk * H * d, 2, d, 0.0f);
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  std::vector<Fmt> fmts = {{3, 3}, {4, 4}, {4, 2}};
  // FMKV_BENCH_FORMATS="kb,vb[,sg];...": the formats of the default mode (bench/cuda_bench.py --formats; sg: the
  // scale group, 32 or 64, default 32)
  if (const char* fe = std::getenv("FMKV_BENCH_FORMATS")) {
    fmts.clear();
    std::string spec(fe);
    for (size_t at = 0; at < spec.size();) {
      size_t end = spec.find(';', at);
      if (end == std::string::npos) end = spec.size();
      int kb = 0, vb = 0, sg = 0;
      const int got = std::sscanf(spec.substr(at, end - at).c_str(), "%d,%d,%d", &kb, &vb, &sg);
      if (got < 2 || (got == 3 && (sg == 0 || !fmkv_scale_group_supported(sg)))) {
        std::fprintf(stderr, "FMKV_BENCH_FORMATS=%s: expected kb,vb[,sg];kb,vb[,sg];... (sg 32 or 64)\n", fe);
        return 2;
      }
      fmts.push_back({kb, vb, got == 3 ? sg : 0});
      at = end + 1;
    }
  }
  struct Case {
    int B;
    int64_t ctx;
    std::vector<int64_t> lens = {};  // a ragged batch's lengths (empty: B x ctx)
  };
  std::vector<Case> cases = {{1, 4096}, {1, 32768}, {1, 131072}, {1, 262144}, {1, 1048576}, {64, 8192}, {64, 32768}};
  if (quick) cases = {{1, 4096}, {1, 131072}, {64, 8192}};
  if (only) {
    cases = {{std::atoi(argv[2]), std::atoll(argv[3])}};
    // FMKV_BENCH_SCALE_GROUP: the scale group of the --only / --trace case (32 or 64; default 32)
    const char* sgv = std::getenv("FMKV_BENCH_SCALE_GROUP");
    const int sg = sgv ? std::atoi(sgv) : 0;
    if (sgv && (sg == 0 || !fmkv_scale_group_supported(sg))) {
      std::fprintf(stderr, "FMKV_BENCH_SCALE_GROUP=%s: expected 32 or 64\n", sgv);
      return 2;
    }
    fmts = {{std::atoi(argv[4]), std::atoi(argv[5]), sg}};
  }
  if (window > 0 && !only) {  // --window W [ctx ...]: the contexts given, else 4k / 32k / 128k
    cases = {{1, 4096}, {1, 32768}, {1, 131072}};
    if (argc > 3) {
      cases.clear();
      for (int i = 3; i < argc; ++i) cases.push_back({1, std::atoll(argv[i])});
    }
    fmts = {{3, 3}};
  }
  if (latency) {
    cases = {{1, 4096}, {1, 32768}, {1, 131072}, {64, 8192}};
    fmts = {{3, 3}};
  }
  if (ragged) {
    const std::vector<int64_t> ls = parse_lengths(argv[4]);
    cases = {{(int)ls.size(), *std::max_element(ls.begin(), ls.end()), ls}};
    fmts = {{std::atoi(argv[2]), std::atoi(argv[3])}};
  }
  if (quant_only) {
    cases.clear();
    fmts = {{std::atoi(argv[2]), std::atoi(argv[3])}};
  }

  for (const Fmt& f : fmts) {
    fmkv_config cfg;
    fmkv_config_default(&cfg);
    cfg.head_dim = d;
    cfg.num_kv_heads = H;
    cfg.k_bits = f.kb;
    cfg.v_bits = f.vb;
    cfg.page_size = P;
    cfg.seed = 1234;
    cfg.window_tokens = window;
    cfg.format_version = format_version;
    cfg.scale_group = f.sg;
    const int sg_out = fmkv_resolved_scale_group(f.sg);
    const int64_t pb = fmkv_config_page_bytes(&cfg);

    // ---- quantize-append throughput: one 32k-token prefill chunk, fp16 input
    if (!only && !latency && !ragged && window == 0) {
      const int64_t np = chunk / P;
      uint8_t* pages;
      CK(cudaMalloc(&pages, np * pb));
      std::vector<int32_t> table(np);
      for (int64_t i = 0; i < np; ++i) table[i] = (int32_t)i;
      int32_t* dt;
      int64_t *dl, *dro;
      CK(cudaMalloc(&dt, np * 4));
      CK(cudaMalloc(&dl, 8));
      CK(cudaMalloc(&dro, 16));
      int64_t zero = 0, ro[2] = {0, chunk};
      CK(cudaMemcpy(dt, table.data(), np * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dl, &zero, 8, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dro, ro, 16, cudaMemcpyHostToDevice));
      fmkv_layer_cache lc{pages, np, nullptr, nullptr, 1, 0};
      fmkv_batch bt{1, nullptr, dl, dro, dt, np};
      fmkv_tensor kt{kin, FMKV_F16, chunk, H, d, (int64_t)H * d, d}, vt{vin, FMKV_F16, chunk, H, d, (int64_t)H * d, d};
      std::vector<float> t;
      for (int i = 0; i < 12; ++i) {
        CK(cudaEventRecord(e0, st));
        FK(fmkv_append(FMKV_BACKEND_CUDA, &cfg, &lc, &bt, &kt, &vt, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) t.push_back(ms);
      }
      FK(fmkv_device_synchronize(FMKV_BACKEND_CUDA));
      const double us = median(t) * 1e3;
      const double bytes = (double)chunk * H * d * 2 * 2 + (double)np * pb;
      std::printf("{\"kind\":\"quantize\",\"k_bits\":%d,\"v_bits\":%d,\"tokens\":%lld,\"head_dim\":%d,\"kv_heads\":%d,"
                  "\"page_size\":%d,\"time_us\":%.2f,\"bytes\":%.0f,\"gbps\":%.1f,\"mtok_per_s\":%.2f,\"format_version\":%d,"
                  "\"scale_group\":%d}\n",
                  f.kb, f.vb, (long long)chunk, d, H, P, us, bytes, bytes / us / 1e3, chunk / us, fv_out, sg_out);
      std::fflush(stdout);
      CK(cudaFree(pages));
      CK(cudaFree(dt));
      CK(cudaFree(dl));
      CK(cudaFree(dro));
    }

    // ---- decode attention
    for (const Case& c : cases) {
      const int B = c.B;
      const int64_t ctx = c.ctx;  // the longest sequence
      const std::vector<int64_t> lens = c.lens.empty() ? std::vector<int64_t>(B, ctx) : c.lens;
      int64_t total_len = 0;
      for (int64_t l : lens) total_len += l;
      const int64_t pps = (ctx + P - 1) / P;  // pages per sequence (the table stride)
      const int64_t np1 = pps * B;            // pages per copy
      const double copy_bytes = (double)np1 * pb;
      int copies = 1;  // up to 8 (x 8 / kv heads: fewer heads, smaller copies) until 4x the L2 size
      while (copies < 8 * std::max(8 / H, 1) && copies * copy_bytes < 4.0 * prop.l2CacheSize) ++copies;
      uint8_t* pages;
      CK(cudaMalloc(&pages, (size_t)(copies * np1 * pb)));
      // fill copy 0 with real appends (chunks of <= 32k tokens per sequence)
      std::vector<int32_t> table(np1 * copies);
      for (int cp = 0; cp < copies; ++cp)
        for (int64_t i = 0; i < np1; ++i) table[cp * np1 + i] = (int32_t)(cp * np1 + i);
      int32_t* dt;
      CK(cudaMalloc(&dt, table.size() * 4));
      CK(cudaMemcpy(dt, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      int64_t *dl, *dro;
      CK(cudaMalloc(&dl, 8 * B));
      CK(cudaMalloc(&dro, 8 * (B + 1)));
      uint16_t *f16k = nullptr, *f16v = nullptr;  // the fp16 window of slot 0 (B = 1 with --window)
      if (window > 0) {
        CK(cudaMalloc(&f16k, (size_t)H * window * d * 2));
        CK(cudaMalloc(&f16v, (size_t)H * window * d * 2));
      }
      fmkv_layer_cache lc{pages, copies * np1, f16k, f16v, 1, 0};
      for (int s = 0; s < B; ++s)
        for (int64_t done = 0; done < lens[s]; done += chunk) {
          const int64_t n = std::min(chunk, lens[s] - done);
          int64_t ro[2] = {0, n};
          CK(cudaMemcpy(dl, &done, 8, cudaMemcpyHostToDevice));
          CK(cudaMemcpy(dro, ro, 16, cudaMemcpyHostToDevice));
          fmkv_batch bt{1, nullptr, dl, dro, dt + s * pps, pps};
          fmkv_tensor kt{kin, FMKV_F16, n, H, d, (int64_t)H * d, d}, vt{vin, FMKV_F16, n, H, d, (int64_t)H * d, d};
          FK(fmkv_append(FMKV_BACKEND_CUDA, &cfg, &lc, &bt, &kt, &vt, st));
        }
      FK(fmkv_device_synchronize(FMKV_BACKEND_CUDA));
      for (int cp = 1; cp < copies; ++cp) CK(cudaMemcpy(pages + cp * np1 * pb, pages, (size_t)(np1 * pb), cudaMemcpyDeviceToDevice));
      std::vector<int64_t> ros(B + 1);
      for (int s = 0; s <= B; ++s) ros[s] = (int64_t)s * qlen;
      const int64_t qrows = (int64_t)B * qlen;
      CK(cudaMemcpy(dl, lens.data(), 8 * B, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dro, ros.data(), 8 * (B + 1), cudaMemcpyHostToDevice));
      __half *q, *o;
      CK(cudaMalloc(&q, (size_t)qrows * HQ * d * 2));
      CK(cudaMalloc(&o, (size_t)qrows * HQ * d * 2));
      fill_normal<<<64, 256>>>(q, qrows * HQ * d, 3, d, 0.0f);
      const int64_t bound = pass_bound ? ctx : 0;  // no sequence has more than ctx tokens (after the step's append)
      const int64_t ws = fmkv_attention_workspace_bytes(FMKV_BACKEND_CUDA, &cfg, HQ, qrows, B, bound);
      void* work;
      CK(cudaMalloc(&work, ws + 16));
      fmkv_tensor qt{q, FMKV_F16, qrows, HQ, d, (int64_t)HQ * d, d}, ot{o, FMKV_F16, qrows, HQ, d, (int64_t)HQ * d, d};
      fmkv_attention_opts opts{0.0f, 0.0f, bound};
      // a decode step re-appends the last q_len tokens: lengths ctx - q_len before it, their K/V rows
      int64_t* dl0;
      CK(cudaMalloc(&dl0, 8 * B));
      std::vector<int64_t> before(B);
      for (int s = 0; s < B; ++s) before[s] = lens[s] - qlen;
      CK(cudaMemcpy(dl0, before.data(), 8 * B, cudaMemcpyHostToDevice));
      fmkv_tensor kt{kin, FMKV_F16, qrows, H, d, (int64_t)H * d, d}, vt{vin, FMKV_F16, qrows, H, d, (int64_t)H * d, d};
      if (step_only) {  // 5 plain fused steps, then the next case
        fmkv_batch b0{B, nullptr, dl0, dro, dt, pps};
        for (int i = 0; i < 5; ++i)
          FK(fmkv_append_attention(FMKV_BACKEND_CUDA, &cfg, &lc, &b0, &kt, &vt, &qt, &opts, &ot, work, (size_t)ws, st));
        FK(fmkv_device_synchronize(FMKV_BACKEND_CUDA));
        std::printf("{\"kind\":\"step_only\",\"context\":%lld}\n", (long long)ctx);
        continue;  // (buffers of this case are left to process exit)
      }
      // one graph holding one call per copy
      CK(cudaDeviceSynchronize());
      const float attn_ms = graph_ms_per_call(st, e0, e1, copies, ctx >= 1048576 ? 20 : 50, [&] {
        for (int cp = 0; cp < copies; ++cp) {
          fmkv_batch bt{B, nullptr, dl, dro, dt + cp * np1, pps};
          FK(fmkv_attention(FMKV_BACKEND_CUDA, &cfg, &lc, &bt, &qt, &opts, &ot, work, (size_t)ws, st));
        }
      });
      FK(fmkv_device_synchronize(FMKV_BACKEND_CUDA));
#ifdef FMKV_CUDA_TRACE
      if (trace) print_trace("attention", ctx, B, cfg.k_bits, cfg.v_bits);
#endif
      // ---- one decode step per layer (append this token's K/V + attention), inside a CUDA graph:
      // separate calls (fmkv_append + fmkv_attention) vs fused (fmkv_append_attention). The step
      // re-appends token ctx - 1 (lengths ctx - 1 before, ctx after), so every replay is identical.
      double step_sep_us = 0, step_fused_us = 0;
      if ((!only || trace || only_step) && !ragged && ctx <= 131072) {
        auto time_graph = [&](bool fused) {
          const float ms = graph_ms_per_call(st, e0, e1, copies, 50, [&] {
            for (int cp = 0; cp < copies; ++cp) {
              fmkv_batch b0{B, nullptr, dl0, dro, dt + cp * np1, pps}, b1{B, nullptr, dl, dro, dt + cp * np1, pps};
              if (fused) {
                FK(fmkv_append_attention(FMKV_BACKEND_CUDA, &cfg, &lc, &b0, &kt, &vt, &qt, &opts, &ot, work, (size_t)ws, st));
              } else {
                FK(fmkv_append(FMKV_BACKEND_CUDA, &cfg, &lc, &b0, &kt, &vt, st));
                FK(fmkv_attention(FMKV_BACKEND_CUDA, &cfg, &lc, &b1, &qt, &opts, &ot, work, (size_t)ws, st));
              }
            }
          });
          FK(fmkv_device_synchronize(FMKV_BACKEND_CUDA));
          return ms * 1e3;
        };
        step_sep_us = time_graph(false);
#ifdef FMKV_CUDA_TRACE
        if (trace) fmkv::cuda::trace_clear();
#endif
        step_fused_us = time_graph(true);
#ifdef FMKV_CUDA_TRACE
        if (trace) print_trace("fused_step", ctx, B, cfg.k_bits, cfg.v_bits);
#endif
      }
      CK(cudaFree(dl0));
      std::vector<__half> oh((size_t)qrows * HQ * d);
      CK(cudaMemcpy(oh.data(), o, oh.size() * 2, cudaMemcpyDeviceToHost));
      int nonfinite = 0;
      for (auto x : oh) nonfinite += !std::isfinite(__half2float(x));
      const double us = attn_ms * 1e3;
      const double kv = (double)total_len * H *
                        (fmkv_bytes_per_token_head(d, f.kb, f.sg) + fmkv_bytes_per_token_head(d, f.vb, f.sg));
      const double bytes = kv + 2.0 * qrows * HQ * d * 2;
      // a ragged batch: context = the mean length (the uniform batch of the same bytes, BENCHMARKS.md), lengths
      std::string rag;
      if (!c.lens.empty()) {
        rag = ",\"case\":\"ragged\",\"lengths_spec\":\"" + std::string(argv[4]) + "\",\"lengths\":[";
        for (int s = 0; s < B; ++s) rag += (s ? "," : "") + std::to_string(lens[s]);
        rag += "]";
      }
      const long long ctx_out = c.lens.empty() ? (long long)ctx : (long long)((total_len + B / 2) / B);
      std::printf("{\"kind\":\"decode\",\"k_bits\":%d,\"v_bits\":%d,\"batch\":%d,\"q_len\":%d,\"context\":%lld,"
                  "\"head_dim\":%d,\"q_heads\":%d,\"kv_heads\":%d,\"page_size\":%d,\"time_us\":%.3f,\"bytes\":%.0f,"
                  "\"gbps\":%.1f,\"copy_gbps\":%.1f,\"pct_copy_bw\":%.1f,\"copies\":%d,\"nonfinite_out\":%d,"
                  "\"window\":%d,\"max_seq_len\":%lld,\"format_version\":%d,\"scale_group\":%d%s}\n",
                  f.kb, f.vb, B, qlen, ctx_out, d, HQ, H, P, us, bytes, bytes / us / 1e3, cbw,
                  100.0 * bytes / us / 1e3 / cbw, copies, nonfinite, window, (long long)bound, fv_out, sg_out, rag.c_str());
      if (step_fused_us > 0)
        std::printf("{\"kind\":\"step\",\"k_bits\":%d,\"v_bits\":%d,\"batch\":%d,\"q_len\":%d,\"context\":%lld,"
                    "\"head_dim\":%d,\"q_heads\":%d,\"kv_heads\":%d,\"page_size\":%d,\"fused_us\":%.3f,"
                    "\"separate_us\":%.3f,\"attention_only_us\":%.3f,\"copies\":%d,\"window\":%d,"
                    "\"max_seq_len\":%lld,\"format_version\":%d,\"scale_group\":%d}\n",
                    f.kb, f.vb, B, qlen, (long long)ctx, d, HQ, H, P, step_fused_us, step_sep_us, us, copies, window,
                    (long long)bound, fv_out, sg_out);
      std::fflush(stdout);
      CK(cudaFree(pages));
      CK(cudaFree(dt));
      CK(cudaFree(dl));
      CK(cudaFree(dro));
      CK(cudaFree(q));
      CK(cudaFree(o));
      CK(cudaFree(work));
      if (f16k) CK(cudaFree(f16k));
      if (f16v) CK(cudaFree(f16v));
    }
  }
  return 0;
}
