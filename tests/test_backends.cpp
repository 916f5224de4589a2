// One harness for every backend: each compiled, usable backend is compared with the reference.
// Quantize/append: bit-exact bytes (pages and fp16 regions, untouched bytes included).
// Attention: within a stated relative error of the float64 reference, output poisoned first.
#include "core/backend.h"
#include "harness.h"
#include "ref/quantize.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace fmkv::test {
namespace {

// Stated error bounds (||out - ref|| / ||ref||): the backend's own (src/core/backend.h
// attention_rel_error, for fp32 outputs), widened to the output dtype's rounding.
double attention_tolerance(fmkv_backend b, fmkv_dtype out) {
  const BackendOps* ops = find_backend(b);
  const double base = ops ? ops->attention_rel_error : 0.0;
  return out == FMKV_F32 ? base : std::max(base, out == FMKV_F16 ? 2e-3 : 1.2e-2);
}

// Every backend id but the reference, compiled or not (those not usable here skip by name).
std::vector<fmkv_backend> backends_under_test() {
  std::vector<fmkv_backend> v;
  for (int b = 0; b < FMKV_BACKEND_COUNT; ++b)
    if (b != FMKV_BACKEND_REF) v.push_back((fmkv_backend)b);
  return v;
}

class Backends : public ::testing::TestWithParam<fmkv_backend> {
 protected:
  void SetUp() override {
    if (!fmkv_backend_available(GetParam()))
      GTEST_SKIP() << "backend " << fmkv_backend_name(GetParam()) << " not available in this build/machine";
  }
};

struct Shape {
  int d, kb, vb, kv_heads, group, page, sink, window, rule;
  std::vector<int64_t> lens, rows;
  fmkv_dtype in;
};

std::vector<Shape> shapes() {
  std::vector<Shape> v;
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 16})
      for (int vb : {2, 3, 4}) {
        int page = kb == 3 ? 16 : kb == 4 ? 64 : 32;
        v.push_back({d, kb, vb, 2, 4, page, 0, 0, (kb + vb) % 2, {37, 0, 120}, {1, 2, 1}, FMKV_F16});
      }
  // every (K width, V width) with the other scale rule than the grid above, at every head_dim: the
  // CUDA append compiles one kernel per K width, V width and rule
  for (int d : {64, 128, 256})
    for (int b : {2, 3, 4}) v.push_back({d, b, b, 2, 4, 32, 0, 0, FMKV_SCALE_LSQ, {21, 50}, {2, 1}, FMKV_F16});
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 16})
      for (int vb : {2, 3, 4})
        if (kb != vb) v.push_back({d, kb, vb, 2, 4, 32, 0, 0, 1 - (kb + vb) % 2, {21, 50}, {2, 1}, FMKV_F16});
  v.push_back({128, 3, 3, 8, 4, 16, 4, 16, FMKV_SCALE_LSQ, {300, 9, 64}, {1, 16, 3}, FMKV_BF16});
  v.push_back({64, 4, 2, 3, 3, 128, 0, 32, FMKV_SCALE_RMS, {500}, {7}, FMKV_F32});
  v.push_back({128, 2, 2, 1, 8, 256, 2, 0, FMKV_SCALE_LSQ, {700, 1}, {1, 12}, FMKV_F16});
  // one or two kv heads at B <= 2: the CUDA backend uses up to 254 splits per (sequence, kv head) to fill
  // the GPU (more than 64: the merge's later rounds); long enough that most of them hold tokens
  v.push_back({128, 3, 3, 1, 4, 64, 0, 0, FMKV_SCALE_LSQ, {17000}, {1}, FMKV_F16});
  v.push_back({64, 4, 2, 1, 4, 32, 0, 16, FMKV_SCALE_RMS, {12000}, {2}, FMKV_BF16});
  v.push_back({256, 4, 4, 1, 2, 64, 0, 0, FMKV_SCALE_LSQ, {9000, 3}, {1, 1}, FMKV_F16});
  // ragged batches: on CUDA the balanced plan gives the long sequences more splits than the grid's count
  // (spare CTAs of the short ones; the merge's second round) -- one dominant sequence, empty and one-token
  // ones, several rows, sink and window, one kv head with a few sequences
  v.push_back({128, 3, 3, 8, 4, 64, 0, 0, FMKV_SCALE_LSQ, {20000, 5, 900, 0, 3000, 64, 1, 7000, 16, 333},
               {1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, FMKV_F16});
  v.push_back({64, 4, 4, 4, 2, 32, 4, 32, FMKV_SCALE_RMS, {40, 9000, 300, 2500, 0, 77}, {2, 1, 4, 1, 1, 3}, FMKV_BF16});
  v.push_back({128, 4, 2, 1, 4, 16, 0, 0, FMKV_SCALE_LSQ, {1, 12000, 50}, {1, 1, 2}, FMKV_F16});
  // 5-bit codes (magnitude nibbles + a sign plane; CUDA's default grid has k5v4 and k5v5 at d 64 / 128): many tiles
  // and splits, GQA 4 and 8, a ragged batch with sinks and a window
  v.push_back({128, 5, 4, 2, 4, 64, 0, 0, FMKV_SCALE_LSQ, {6000, 3}, {1, 2}, FMKV_F16});
  v.push_back({64, 5, 5, 3, 2, 32, 4, 32, FMKV_SCALE_RMS, {40, 4000, 0, 77}, {2, 1, 1, 3}, FMKV_BF16});
  v.push_back({128, 5, 5, 1, 8, 16, 0, 0, FMKV_SCALE_LSQ, {5000}, {1}, FMKV_F16});
  // FMKV_TEST_SHAPE_TOKENS=N leaves out the shapes of more than N tokens in all (tests/cross/aarch64.sh under qemu:
  // the longest shapes exist for CUDA's split counts and balanced plans, and emulated they are most of the suite's
  // time; the CPU kernels meet every code path in the shorter ones, and the chunking of longer sequences is portable
// code the native runs check)
  if (const char* cap = std::getenv("FMKV_TEST_SHAPE_TOKENS")) {
    const int64_t n = std::atoll(cap);
    std::vector<Shape> kept;
    for (const Shape& sh : v) {
      int64_t t = 0;
      for (size_t i = 0; i < sh.lens.size(); ++i) t += sh.lens[i] + sh.rows[i];
      if (t <= n) kept.push_back(sh);
    }
    std::printf("[ note ] FMKV_TEST_SHAPE_TOKENS=%lld: %zu of %zu shapes\n", (long long)n, kept.size(), v.size());
    v = kept;
  }
  return v;
}

TEST_P(Backends, AppendBitExact) {
  const fmkv_backend b = GetParam();
  for (const Shape& sh : shapes()) {
    fmkv_config c = config(sh.d, sh.kb, sh.vb, sh.kv_heads, sh.page, sh.sink, sh.window, sh.rule);
    int64_t n1 = 0;
    Scenario s = filled_scenario(c, sh.lens, sh.rows, sh.in, &n1);
    auto k1 = random_tensor(sh.in, n1, c.num_kv_heads, c.head_dim, 3.0), v1 = random_tensor(sh.in, n1, c.num_kv_heads, c.head_dim);
    fmkv_tensor kt = make_tensor(k1.data(), sh.in, n1, c.num_kv_heads, c.head_dim);
    fmkv_tensor vt = make_tensor(v1.data(), sh.in, n1, c.num_kv_heads, c.head_dim);
    LayerState want = run_append(FMKV_BACKEND_REF, s, kt, vt), got = run_append(b, s, kt, vt);
    EXPECT_TRUE(got.pages == want.pages) << "pages differ: d=" << sh.d << " k" << sh.kb << "v" << sh.vb;
    EXPECT_TRUE(got.fp16_k == want.fp16_k && got.fp16_v == want.fp16_v) << "fp16 regions differ";
  }
}

// An attention case of shape sh: its cache filled by the reference (fresh random K / V), query rows q (scale
// q_scale) and options -- softcap 20 at d = 256, opts.max_seq_len by bound_mode: 0 (none), the exact longest
// length, or 100 more.
struct AttentionCase {
  fmkv_config c;
  Scenario s;
  LayerState st;
  std::vector<uint8_t> qb;
  fmkv_tensor q;
  fmkv_attention_opts o;
  int32_t HQ;
  int64_t nq = 0;
  AttentionCase(const AttentionCase&) = delete;  // q points into qb
  AttentionCase& operator=(const AttentionCase&) = delete;
  AttentionCase(const Shape& sh, int bound_mode, double q_scale) {
    c = config(sh.d, sh.kb, sh.vb, sh.kv_heads, sh.page, sh.sink, sh.window, sh.rule);
    s = make_scenario(c, sh.lens, sh.rows);
    Scenario fill = s;
    fill.lens.assign(s.lens.size(), 0);
    int64_t n = 0;
    for (size_t i = 0; i < s.lens.size(); ++i) { fill.rows[i] = s.lens[i] + s.rows[i]; n += fill.rows[i]; nq += s.rows[i]; }
    auto kb = random_tensor(sh.in, n, c.num_kv_heads, c.head_dim, 3.0), vb = random_tensor(sh.in, n, c.num_kv_heads, c.head_dim);
    st = run_append(FMKV_BACKEND_REF, fill, make_tensor(kb.data(), sh.in, n, c.num_kv_heads, c.head_dim),
                    make_tensor(vb.data(), sh.in, n, c.num_kv_heads, c.head_dim));
    HQ = sh.kv_heads * sh.group;
    qb = random_tensor(sh.in, nq, HQ, c.head_dim, q_scale);
    q = make_tensor(qb.data(), sh.in, nq, HQ, c.head_dim);
    o = fmkv_attention_opts{0.0f, sh.d == 256 ? 20.0f : 0.0f, 0};
    if (bound_mode > 0) o.max_seq_len = max_length_after(s) + (bound_mode == 2 ? 100 : 0);
  }
};

TEST_P(Backends, AttentionMatchesReference) {
  const fmkv_backend b = GetParam();
  int index = 0;
  for (const Shape& sh : shapes())
    for (fmkv_dtype out : {FMKV_F32, FMKV_F16, FMKV_BF16}) {
      if (out != FMKV_F32 && sh.kb != 3) continue;
      const AttentionCase ac(sh, index++ % 3, 1.0);
      const Scenario& s = ac.s;
      const LayerState& st = ac.st;
      const fmkv_tensor& q = ac.q;
      const fmkv_attention_opts& o = ac.o;
      auto want = run_attention(FMKV_BACKEND_REF, s, st, q, FMKV_F32, o);
      std::vector<float> got;
      try {
        got = run_attention(b, s, st, q, out, o);
      } catch (const fmkv::Error& e) {
        if (cuda_combination_not_compiled(b, e, sh.d, sh.kb, sh.vb)) {
          std::printf("[ note ] cuda d=%d k%dv%d not compiled in this build (FMKV_CUDA_FULL_GRID=OFF): %s\n", sh.d, sh.kb,
                      sh.vb, e.what());
          continue;
        }
        throw;
      }
      double err = rel_error(got, want);
      EXPECT_LT(err, attention_tolerance(b, out)) << fmkv_backend_name(b) << " d=" << sh.d << " k" << sh.kb << "v" << sh.vb
                                                  << " out dtype " << out << " max_seq_len " << o.max_seq_len;
    }
}

// Queries of one GQA group whose scores lie far apart: the keys share a large common part M u (u a unit vector),
// query head h is o_h sqrt(d) / M u + a small random part, so its scores are o_h + O(1), and the offsets o_h (which
// softmax ignores) of any 4 consecutive heads are -150, -50, 50, 150 in some order: 100 or more apart. Each query's
// softmax must use its own maximum: one that took another query's (a joint reduction of several queries' maxima
// gone wrong) overflows exp or weights every token alike, while a maximum off by less than ~88 would give the same
// result. The CPU kernels reduce the maxima of up to 4 queries together (R = 4 at GQA 4 and 8, R = 3 at GQA 3); CUDA's
// wide kernels keep two halves of 8 query vectors (GQA 12 and 16), each with its own softmax state.
// V has a common part too, so the output is not near zero and the bound is met with room.
TEST_P(Backends, AttentionQueriesWithScoresFarApart) {
  const fmkv_backend b = GetParam();
  const double offsets[4] = {-150.0, 50.0, 150.0, -50.0};
  const double tol = attention_tolerance(b, FMKV_F32);
  for (int version : {2, 3})
    for (const auto& [d, kb, vb, group] :
         std::vector<std::array<int, 4>>{{128, 3, 3, 4}, {128, 4, 4, 8}, {64, 3, 4, 3}, {128, 4, 2, 2}, {64, 3, 3, 4},
                                         {128, 3, 3, 16}, {64, 4, 4, 12}}) {
      if (version > find_backend(b)->max_format_version) continue;
      const int32_t kvh = 2, HQ = kvh * group;
      fmkv_config c = config(d, kb, vb, kvh, 64);
      c.format_version = version;
      const Scenario a = make_scenario(c, {700, 301}, {1, 1});  // one query row per sequence after its tokens
      Scenario fill = a;  // the cache holds the query rows' tokens too
      fill.lens = {0, 0};
      fill.rows = {701, 302};
      const int64_t n = 1003;
      std::normal_distribution<double> nd(0.0, 1.0);
      std::vector<double> u(d), w(d);  // K's direction (unit) and V's common part, the same for every kv head
      double un = 0.0;
      for (int32_t i = 0; i < d; ++i) u[i] = nd(rng()), un += u[i] * u[i], w[i] = nd(rng());
      for (auto& x : u) x /= std::sqrt(un);
      const double M = 400.0;
      std::vector<float> kf((size_t)n * kvh * d), vf((size_t)n * kvh * d);
      for (size_t i = 0; i < kf.size(); ++i) kf[i] = (float)(M * u[i % d] + nd(rng())), vf[i] = (float)(w[i % d] + nd(rng()));
      const LayerState st = run_append(FMKV_BACKEND_REF, fill, make_tensor(kf.data(), FMKV_F32, n, kvh, d),
                                       make_tensor(vf.data(), FMKV_F32, n, kvh, d));
      std::vector<float> qf((size_t)2 * HQ * d);
      for (int64_t row = 0; row < 2; ++row)
        for (int32_t h = 0; h < HQ; ++h)
          for (int32_t i = 0; i < d; ++i)
            qf[((size_t)row * HQ + h) * d + i] = (float)(offsets[(h + row) % 4] * std::sqrt((double)d) / M * u[i] + 0.3 * nd(rng()));
      const fmkv_tensor q = make_tensor(qf.data(), FMKV_F32, 2, HQ, d);
      const auto want = run_attention(FMKV_BACKEND_REF, a, st, q, FMKV_F32);
      std::vector<float> got;
      try {
        got = run_attention(b, a, st, q, FMKV_F32);
      } catch (const fmkv::Error& e) {
        if (cuda_combination_not_compiled(b, e, d, kb, vb, version >= 3)) continue;
        throw;
      }
      const double err = rel_error(got, want);
      EXPECT_LT(err, tol) << fmkv_backend_name(b) << " format " << version << " d=" << d << " k" << kb << "v" << vb
                          << " GQA " << group;
    }
}

// fmkv_attention_lse on every backend that has it (BackendOps::attention_lse): the output is fmkv_attention's bit
// for bit, and lse (log sum exp of the scaled, softcapped scores) is the float64 reference's within the backend's
// attention bound, |lse - ref| <= 2 x attention_rel_error x (1 + |ref|) -- the shards a context-parallel merge
// weights by exp(lse) then carry that relative error. Every shape of the attention test (sinks and windows,
// several query rows, ragged batches whose long sequences get the balanced plan's extra splits, more than 64
// splits, softcap at d = 256), plus a refused call (an lse tensor of the wrong rows) that writes nothing.
TEST_P(Backends, AttentionLseMatchesReference) {
  const fmkv_backend b = GetParam();
  const BackendOps* ops = find_backend(b);
  if (!ops->attention_lse) GTEST_SKIP() << fmkv_backend_name(b) << " does not return the lse (BackendOps::attention_lse)";
  const double tol = 2.0 * ops->attention_rel_error;
  double worst = 0.0;
  int index = 0, run = 0;
  for (const Shape& sh : shapes()) {
    const AttentionCase ac(sh, index++ % 3, 2.0);
    const fmkv_config& c = ac.c;
    const Scenario& s = ac.s;
    const LayerState& st = ac.st;
    const fmkv_tensor& q = ac.q;
    const fmkv_attention_opts& o = ac.o;
    const int32_t HQ = ac.HQ;
    const int64_t nq = ac.nq;
    std::pair<std::vector<float>, std::vector<float>> got;
    try {
      got = run_attention_lse(b, s, st, q, o);
    } catch (const fmkv::Error& e) {
      if (cuda_combination_not_compiled(b, e, sh.d, sh.kb, sh.vb)) continue;
      throw;
    }
    ++run;
    const auto want = run_attention_lse(FMKV_BACKEND_REF, s, st, q, o);
    const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(sh.d) + " k" + std::to_string(sh.kb) +
                             "v" + std::to_string(sh.vb) + " max_seq_len " + std::to_string(o.max_seq_len);
    EXPECT_TRUE(got.first == run_attention(b, s, st, q, FMKV_F32, o)) << what << ": output differs from fmkv_attention's";
    ASSERT_EQ(got.second.size(), want.second.size());
    for (size_t i = 0; i < want.second.size(); ++i) {
      const double e = std::fabs((double)got.second[i] - want.second[i]) / (1.0 + std::fabs((double)want.second[i]));
      worst = std::max(worst, std::isnan(e) ? INFINITY : e);
      EXPECT_LE(e, tol) << what << " lse[" << i << "] = " << got.second[i] << ", reference " << want.second[i];
    }
    // a refused call (lse of the wrong rows): an error naming lse, output and lse untouched
    if (index == 1) {
      DeviceLayer L(b, s, st.pages, st.fp16_k, st.fp16_v, lengths_after(s));
      DeviceTensor qd(b, q);
      DeviceOutput od(b, q, FMKV_F32), ld(b, make_tensor(nullptr, FMKV_F32, nq + 1, HQ, 1), FMKV_F32);
      const int64_t ws = fmkv_attention_workspace_bytes(b, &c, HQ, nq, s.seqs(), o.max_seq_len);
      DeviceBuf work(b, (size_t)ws + 16);
      EXPECT_EQ(fmkv_attention_lse(b, &c, &L.lc, &L.bt, &qd.t, &o, &od.t, &ld.t, work.p, (size_t)ws, nullptr),
                FMKV_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(fmkv_last_error()).find("lse"), std::string::npos) << fmkv_last_error();
      check(fmkv_device_synchronize(b));
      for (float x : od.as_f32()) ASSERT_TRUE(std::isnan(x)) << "output written by a refused call";
      for (float x : ld.as_f32()) ASSERT_TRUE(std::isnan(x)) << "lse written by a refused call";
    }
  }
  EXPECT_GT(run, 0);
  std::printf("[ note ] %s lse: %d shapes, worst |lse - ref| / (1 + |ref|) = %.3g (bound %.3g)\n", fmkv_backend_name(b), run,
              worst, tol);
}

// fmkv_append_attention == fmkv_append then fmkv_attention: pages and fp16 regions bit-exact with
// the reference append, output within the backend's attention bound of the float64 reference.
// Decode (1 row), speculative (several rows), windows sliding over page boundaries, sinks, a new
// compressed token landing on a fresh page, several sequences, fp16 K; k, v and q as dense
// [rows][heads][dim] tensors or head-major views ([heads][rows][dim] memory, as a [B, H, T, D] layout).
TEST_P(Backends, FusedAppendAttention) {
  const fmkv_backend b = GetParam();
  struct F {
    int d, kb, vb, kv_heads, group, page, sink, window, rule;
    std::vector<int64_t> lens, rows;
    fmkv_dtype in;
    bool head_major = false;
  };
  const std::vector<F> cases = {
      {128, 3, 3, 2, 4, 64, 0, 0, FMKV_SCALE_LSQ, {4095, 0, 63}, {1, 1, 1}, FMKV_F16},
      {128, 4, 4, 2, 4, 16, 4, 32, FMKV_SCALE_LSQ, {300, 35, 7}, {1, 3, 16}, FMKV_BF16},
      {64, 4, 2, 3, 3, 32, 0, 64, FMKV_SCALE_RMS, {500, 64}, {5, 1}, FMKV_F32},
      {64, 2, 2, 1, 9, 16, 2, 0, FMKV_SCALE_LSQ, {17, 1000}, {16, 2}, FMKV_F16},
      {128, 16, 3, 2, 4, 16, 0, 8, FMKV_SCALE_LSQ, {200, 8}, {2, 1}, FMKV_F16},
      {256, 3, 3, 1, 2, 16, 0, 16, FMKV_SCALE_LSQ, {90}, {4}, FMKV_F16},
      {256, 4, 4, 1, 2, 16, 0, 0, FMKV_SCALE_LSQ, {90, 20}, {2, 1}, FMKV_BF16},
      {128, 4, 4, 2, 4, 64, 0, 0, FMKV_SCALE_LSQ, {100, 31}, {3, 1}, FMKV_F16, true},
      {64, 4, 2, 3, 3, 32, 0, 64, FMKV_SCALE_RMS, {500, 64}, {5, 1}, FMKV_F32, true},
      // one kv head, B = 1: up to 254 splits on CUDA (with a window: two raw-domain CTAs)
      {128, 4, 4, 1, 4, 64, 0, 64, FMKV_SCALE_LSQ, {17000}, {1}, FMKV_F16},
      {64, 4, 2, 1, 4, 32, 0, 0, FMKV_SCALE_RMS, {16500}, {3}, FMKV_F32},
      // ragged batches (CUDA: the balanced plan), with and without fp16 regions
      {128, 3, 3, 8, 4, 64, 0, 64, FMKV_SCALE_LSQ, {15000, 3, 700, 64, 2000, 1}, {1, 1, 1, 2, 1, 1}, FMKV_F16},
      {128, 4, 4, 4, 4, 32, 0, 0, FMKV_SCALE_LSQ, {9000, 10, 300, 2500, 0, 40}, {1, 2, 1, 4, 1, 1}, FMKV_F16},
  };
  int index = 0;
  for (const F& f : cases) {
    const bool bounded = index++ % 2 == 1;  // every other case passes opts.max_seq_len = the longest length after
    fmkv_config c = config(f.d, f.kb, f.vb, f.kv_heads, f.page, f.sink, f.window, f.rule);
    int64_t n1 = 0;
    Scenario s = filled_scenario(c, f.lens, f.rows, f.in, &n1);
    auto k1 = random_tensor(f.in, n1, c.num_kv_heads, c.head_dim, 3.0), v1 = random_tensor(f.in, n1, c.num_kv_heads, c.head_dim);
    const int32_t HQ = f.kv_heads * f.group;
    auto qb = random_tensor(f.in, n1, HQ, c.head_dim, 1.0);
    fmkv_tensor kt = make_tensor(k1.data(), f.in, n1, c.num_kv_heads, c.head_dim);
    fmkv_tensor vt = make_tensor(v1.data(), f.in, n1, c.num_kv_heads, c.head_dim);
    fmkv_tensor q = make_tensor(qb.data(), f.in, n1, HQ, c.head_dim);
    if (f.head_major)
      for (fmkv_tensor* t : {&kt, &vt, &q}) {
        t->row_stride = t->dim;
        t->head_stride = t->rows * t->dim;
      }
    LayerState want = run_append(FMKV_BACKEND_REF, s, kt, vt);
    std::vector<float> want_out = run_attention(FMKV_BACKEND_REF, s, want, q, FMKV_F32);
    std::pair<LayerState, std::vector<float>> got;
    try {
      got = run_append_attention(b, s, kt, vt, q, FMKV_F32, {0.0f, 0.0f, bounded ? max_length_after(s) : 0});
    } catch (const fmkv::Error& e) {
      if (cuda_combination_not_compiled(b, e, f.d, f.kb, f.vb)) continue;
      throw;
    }
    const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(f.d) + " k" +
                             std::to_string(f.kb) + "v" + std::to_string(f.vb) + " window " + std::to_string(f.window) +
                             (bounded ? " (max_seq_len)" : "");
    EXPECT_TRUE(got.first.pages == want.pages) << "pages differ: " << what;
    EXPECT_TRUE(got.first.fp16_k == want.fp16_k && got.first.fp16_v == want.fp16_v) << "fp16 regions differ: " << what;
    EXPECT_LT(rel_error(got.second, want_out), attention_tolerance(b, FMKV_F32)) << what;
  }
}

// More than FMKV_FUSED_MAX_ROWS rows in a sequence: a clear error, nothing written.
TEST_P(Backends, FusedAppendAttentionRowLimit) {
  const fmkv_backend b = GetParam();
  fmkv_config c = config(64, 3, 3, 1, 16, 0, 8);
  Scenario s = make_scenario(c, {40}, {FMKV_FUSED_MAX_ROWS + 1});
  const int64_t n = FMKV_FUSED_MAX_ROWS + 1;
  auto k = random_tensor(FMKV_F16, n, 1, 64), v = random_tensor(FMKV_F16, n, 1, 64), q = random_tensor(FMKV_F16, n, 2, 64);
  try {
    run_append_attention(b, s, make_tensor(k.data(), FMKV_F16, n, 1, 64), make_tensor(v.data(), FMKV_F16, n, 1, 64),
                         make_tensor(q.data(), FMKV_F16, n, 2, 64), FMKV_F32);
    ADD_FAILURE() << "no error for " << n << " rows";
  } catch (const fmkv::Error& e) {
    EXPECT_EQ(e.code(), FMKV_ERR_INVALID_ARGUMENT) << e.what();
    EXPECT_NE(std::string(e.what()).find("at most 16"), std::string::npos) << e.what();
  }
}

// opts.max_seq_len below the sequence's length after the step: a clear error, nothing written (CUDA:
// detected on the device, every CTA of the sequence returns before writing).
TEST_P(Backends, FusedAppendAttentionLengthBound) {
  const fmkv_backend b = GetParam();
  for (int32_t window : {0, 16}) {
    fmkv_config c = config(128, 3, 3, 2, 16, 0, window);
    int64_t n1 = 0;
    Scenario s = filled_scenario(c, {300}, {1}, FMKV_F16, &n1);
    auto k = random_tensor(FMKV_F16, n1, 2, 128, 3.0), v = random_tensor(FMKV_F16, n1, 2, 128), q = random_tensor(FMKV_F16, n1, 8, 128);
    DeviceLayer L(b, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
    DeviceTensor kt(b, make_tensor(k.data(), FMKV_F16, n1, 2, 128)), vt(b, make_tensor(v.data(), FMKV_F16, n1, 2, 128));
    DeviceTensor qt(b, make_tensor(q.data(), FMKV_F16, n1, 8, 128));
    DeviceOutput o(b, qt.t, FMKV_F32);
    const fmkv_attention_opts opts{0.0f, 0.0f, 300};  // the sequence has 301 tokens after the step
    const int64_t ws = fmkv_attention_workspace_bytes(b, &c, 8, n1, 1, opts.max_seq_len);
    DeviceBuf work(b, (size_t)ws + 16);
    fmkv_status st = fmkv_append_attention(b, &c, &L.lc, &L.bt, &kt.t, &vt.t, &qt.t, &opts, &o.t, work.p, (size_t)ws, nullptr);
    if (st == FMKV_OK) st = fmkv_device_synchronize(b);  // CUDA: reported by the device
    EXPECT_EQ(st, FMKV_ERR_INVALID_ARGUMENT) << fmkv_backend_name(b) << " window " << window;
    EXPECT_NE(std::string(fmkv_last_error()).find("sequence 0: 301 tokens, more than opts.max_seq_len = 300"),
              std::string::npos) << fmkv_last_error();
    const LayerState after = L.state(s);
    EXPECT_TRUE(after.pages == s.pages && after.fp16_k == s.fp16_k && after.fp16_v == s.fp16_v)
        << fmkv_backend_name(b) << " window " << window << ": the failed step wrote the cache";
  }
}

// Format 3 (3-bit codes in tile blocks): a backend that reads and writes it matches the reference (append
// bit-exact, attention within its bound, the fused step both); one that does not refuses each op with
// FMKV_ERR_UNSUPPORTED naming the version, and writes nothing.
// A config option the backend states (format version 3, scale group 64): the append writes the reference's bytes, the
// attention and the fused step are within the backend's bound of the reference's (a CUDA combination outside the
// build's grid is noted and skipped).
void expect_matches_reference(fmkv_backend b, const Scenario& s, const fmkv_tensor& kt, const fmkv_tensor& vt,
                              const fmkv_tensor& qt, int d, int kb, int vb, const std::string& what) {
  const LayerState want = run_append(FMKV_BACKEND_REF, s, kt, vt), got = run_append(b, s, kt, vt);
  EXPECT_TRUE(got.pages == want.pages) << "pages differ: " << what;
  EXPECT_TRUE(got.fp16_k == want.fp16_k && got.fp16_v == want.fp16_v) << "fp16 regions differ: " << what;
  const std::vector<float> ref_out = run_attention(FMKV_BACKEND_REF, s, want, qt, FMKV_F32);
  std::vector<float> out;
  try {
    out = run_attention(b, s, want, qt, FMKV_F32);
  } catch (const fmkv::Error& e) {
    if (!cuda_combination_not_compiled(b, e, d, kb, vb, s.cfg.format_version >= 3)) throw;
    std::printf("[ note ] %s: not compiled in this build (FMKV_CUDA_FULL_GRID=OFF)\n", what.c_str());
    return;
  }
  EXPECT_LT(rel_error(out, ref_out), attention_tolerance(b, FMKV_F32)) << what;
  bool fused_rows_ok = true;
  for (int64_t r : s.rows) fused_rows_ok = fused_rows_ok && r <= FMKV_FUSED_MAX_ROWS;
  if (fused_rows_ok) {
    auto [st, fout] = run_append_attention(b, s, kt, vt, qt, FMKV_F32);
    EXPECT_TRUE(st.pages == want.pages && st.fp16_k == want.fp16_k && st.fp16_v == want.fp16_v)
        << "fused step state differs: " << what;
    EXPECT_LT(rel_error(fout, ref_out), attention_tolerance(b, FMKV_F32)) << "fused step: " << what;
  }
}

// A config option the backend does not state: every op fails with FMKV_ERR_UNSUPPORTED and a message containing
// `needle`, the workspace query answers 0, and nothing of the cache changes.
void expect_refused_unchanged(fmkv_backend b, const Scenario& s, const fmkv_tensor& kt, const fmkv_tensor& vt,
                              const fmkv_tensor& qt, const std::string& needle, const std::string& what) {
  const fmkv_config& c = s.cfg;
  DeviceLayer L(b, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
  DeviceTensor k(b, kt), v(b, vt), q(b, qt);
  DeviceOutput o(b, qt, FMKV_F32);
  auto refused = [&](fmkv_status st, const char* op) {
    EXPECT_EQ(st, FMKV_ERR_UNSUPPORTED) << op << ": " << what;
    EXPECT_NE(std::string(fmkv_last_error()).find(needle), std::string::npos) << op << ": " << fmkv_last_error();
  };
  refused(fmkv_append(b, &c, &L.lc, &L.bt, &k.t, &v.t, nullptr), "append");
  refused(fmkv_attention(b, &c, &L.lc, &L.bt, &q.t, nullptr, &o.t, nullptr, 0, nullptr), "attention");
  refused(fmkv_append_attention(b, &c, &L.lc, &L.bt, &k.t, &v.t, &q.t, nullptr, &o.t, nullptr, 0, nullptr), "fused step");
  EXPECT_EQ(fmkv_attention_workspace_bytes(b, &c, qt.heads, qt.rows, s.seqs(), 0), 0) << what;
  check(fmkv_device_synchronize(b));
  const LayerState after = L.state(s);
  EXPECT_TRUE(after.pages == s.pages && after.fp16_k == s.fp16_k && after.fp16_v == s.fp16_v)
      << what << ": a refused op wrote the cache";
}

// One case of a config option: a filled scenario of c, fresh fp16 K, V and `group` query heads per kv head; checked
// against the reference where the backend states the option, refused (message containing `needle`) where not.
void check_option_case(fmkv_backend b, bool supported, const fmkv_config& c, const std::vector<int64_t>& lens,
                       const std::vector<int64_t>& rows, int group, const std::string& needle, const std::string& what) {
  int64_t n1 = 0;
  Scenario s = filled_scenario(c, lens, rows, FMKV_F16, &n1);
  const int32_t H = c.num_kv_heads, HQ = H * group, d = c.head_dim;
  auto k1 = random_tensor(FMKV_F16, n1, H, d, 3.0), v1 = random_tensor(FMKV_F16, n1, H, d), q1 = random_tensor(FMKV_F16, n1, HQ, d);
  const fmkv_tensor kt = make_tensor(k1.data(), FMKV_F16, n1, H, d), vt = make_tensor(v1.data(), FMKV_F16, n1, H, d);
  const fmkv_tensor qt = make_tensor(q1.data(), FMKV_F16, n1, HQ, d);
  if (supported) expect_matches_reference(b, s, kt, vt, qt, d, c.k_bits, c.v_bits, what);
  else expect_refused_unchanged(b, s, kt, vt, qt, needle, what);
}

TEST_P(Backends, FormatVersion3MatchesOrIsRefused) {
  const fmkv_backend b = GetParam();
  const bool supported = find_backend(b)->max_format_version >= 3;
  struct S3 {
    int d, kb, vb, kv_heads, group, page, sink, window, rule;
    std::vector<int64_t> lens, rows;
  };
  const S3 cases[] = {
      {64, 3, 3, 2, 4, 16, 0, 0, FMKV_SCALE_LSQ, {37, 0, 120}, {1, 2, 1}},
      {128, 3, 3, 8, 4, 64, 4, 16, FMKV_SCALE_LSQ, {300, 9, 64}, {1, 16, 3}},
      {256, 3, 2, 1, 8, 32, 0, 0, FMKV_SCALE_RMS, {1000}, {2}},
      {128, 16, 3, 2, 4, 16, 0, 32, FMKV_SCALE_LSQ, {90, 33}, {1, 1}},
      {128, 4, 3, 2, 3, 128, 2, 0, FMKV_SCALE_LSQ, {17000}, {1}},
  };
  for (const S3& sh : cases) {
    fmkv_config c = config(sh.d, sh.kb, sh.vb, sh.kv_heads, sh.page, sh.sink, sh.window, sh.rule);
    c.format_version = 3;
    const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(sh.d) + " k" +
                             std::to_string(sh.kb) + "v" + std::to_string(sh.vb);
    check_option_case(b, supported, c, sh.lens, sh.rows, sh.group, "format version 3 is not supported", what + " in format 3");
  }
}

// More than 8 query vectors per (sequence, kv head): GQA groups of 9, 12 and 16, and query rows x group up to 48
// (speculative verification). The CUDA backend runs them through its wide kernels (16 vectors per pass, each tile
// decoded once for both halves; a half with dead columns, several passes) where compiled, else in passes of 8; the
// CPU kernels in calls of up to 8. Formats 2 and 3, the widths of CUDA's default wide grid and others, every
// head_dim, sinks and windows, ragged rows; attention and the fused step against the reference.
TEST_P(Backends, AttentionGroupsOverEightVectors) {
  const fmkv_backend b = GetParam();
  struct W {
    int d, kb, vb, kv_heads, group, page, sink, window, rule, version;
    std::vector<int64_t> lens, rows;
  };
  const W cases[] = {
      {128, 3, 3, 2, 16, 64, 0, 0, FMKV_SCALE_LSQ, 3, {3000, 700}, {1, 1}},
      {128, 3, 3, 2, 12, 16, 4, 16, FMKV_SCALE_RMS, 2, {1500, 40}, {1, 3}},
      {128, 4, 4, 1, 16, 64, 0, 32, FMKV_SCALE_LSQ, 2, {5000}, {1}},
      {64, 4, 4, 2, 9, 32, 2, 0, FMKV_SCALE_RMS, 3, {900, 0, 260}, {2, 1, 1}},
      {64, 3, 3, 3, 8, 128, 0, 0, FMKV_SCALE_LSQ, 3, {2000, 65}, {3, 6}},
      {128, 2, 2, 2, 16, 32, 0, 0, FMKV_SCALE_LSQ, 2, {800}, {1}},
      {256, 3, 3, 1, 12, 64, 0, 0, FMKV_SCALE_RMS, 3, {1200}, {2}},
  };
  for (const W& sh : cases) {
    fmkv_config c = config(sh.d, sh.kb, sh.vb, sh.kv_heads, sh.page, sh.sink, sh.window, sh.rule);
    c.format_version = sh.version;
    if (sh.version > find_backend(b)->max_format_version) continue;  // (its own test checks the refusal)
    const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(sh.d) + " k" +
                             std::to_string(sh.kb) + "v" + std::to_string(sh.vb) + " format " +
                             std::to_string(sh.version) + " GQA " + std::to_string(sh.group);
    check_option_case(b, true, c, sh.lens, sh.rows, sh.group, "", what);
  }
}

// The visible state of sequence 0 of a one-sequence scenario is the same in a and b: its fp16 regions, and the
// codes and scales of its compressed tokens [0, compressed) -- read through the reference's reader, so tile
// blocks compare token by token (a failed step may have written token slots at or past the compressed length,
// FORMAT.md section 2, and in format 3 those share words with the visible tokens).
bool same_visible_state(const Scenario& s, const LayerState& a, const LayerState& b, int64_t compressed) {
  const fmkv_config& c = s.cfg;
  if (a.fp16_k != b.fp16_k || a.fp16_v != b.fp16_v) return false;
  const int64_t pb = fmkv_config_page_bytes(&c);
  const int32_t d = c.head_dim;
  std::vector<uint8_t> ca(d), cb(d);
  std::vector<uint16_t> sa(fmkv_scales_per_vector(d, c.scale_group)), sb(sa.size());
  for (int64_t ci = 0; ci < compressed; ++ci)
    for (int32_t h = 0; h < c.num_kv_heads; ++h)
      for (int is_v = 0; is_v < 2; ++is_v) {
        const int64_t off = (int64_t)s.table[ci / c.page_size] * pb + fmkv_section_offset(d, c.k_bits, c.v_bits, c.page_size, h, is_v, c.scale_group);
        const int32_t bits = is_v ? c.v_bits : c.k_bits, t = (int32_t)(ci % c.page_size);
        ref::read_token_codes(a.pages.data() + off, c.format_version, is_v, d, bits, c.page_size, t, ca.data(), sa.data(),
                              c.scale_group);
        ref::read_token_codes(b.pages.data() + off, c.format_version, is_v, d, bits, c.page_size, t, cb.data(), sb.data(),
                              c.scale_group);
        if (ca != cb || sa != sb) return false;
      }
  return true;
}

// Prefill-sized appends (hundreds of rows per sequence in one call), formats 2 and 3: chunks that start on
// a multiple of 8 tokens and chunks that do not, several sequences in one call, chunks that cross pages, every
// head_dim. On CUDA a warp task of consecutive tokens from a multiple of 8 stores format 3's tile-block words
// whole, and any other task by reductions: both must write the reference's bytes. fp16, bf16 and fp32 inputs.
TEST_P(Backends, PrefillChunksBitExact) {
  const fmkv_backend b = GetParam();
  struct C {
    int d, kb, vb, kv_heads, page, sink, window, rule;
    std::vector<int64_t> lens, rows;
    fmkv_dtype in;  // bf16 / f32 inputs take CUDA's element-load staging instead of cp.async
  };
  const C cases[] = {
      {128, 3, 3, 2, 64, 0, 0, FMKV_SCALE_LSQ, {0, 40}, {512, 300}, FMKV_F16},
      {128, 4, 3, 3, 16, 4, 0, FMKV_SCALE_LSQ, {5, 0, 64}, {203, 96, 333}, FMKV_F16},
      {64, 3, 2, 2, 32, 0, 32, FMKV_SCALE_RMS, {0, 13}, {250, 129}, FMKV_F16},
      {256, 3, 3, 1, 128, 2, 16, FMKV_SCALE_LSQ, {8, 100}, {400, 37}, FMKV_F16},
      {128, 2, 3, 2, 64, 0, 0, FMKV_SCALE_RMS, {3}, {261}, FMKV_F16},
      {128, 3, 4, 2, 32, 0, 0, FMKV_SCALE_LSQ, {0, 24}, {160, 72}, FMKV_BF16},
      {64, 3, 3, 1, 16, 0, 16, FMKV_SCALE_LSQ, {16}, {96}, FMKV_F32},
      // the 4- and 5-bit quantizers with the LSQ rule (CUDA: their levels by a shared-memory lookup)
      {128, 5, 4, 2, 64, 0, 0, FMKV_SCALE_LSQ, {0, 40}, {320, 200}, FMKV_F16},
      {64, 4, 5, 2, 32, 0, 0, FMKV_SCALE_LSQ, {8}, {300}, FMKV_F16},
      {256, 5, 5, 1, 64, 0, 16, FMKV_SCALE_LSQ, {0}, {150}, FMKV_BF16},
      {128, 4, 4, 2, 64, 0, 0, FMKV_SCALE_LSQ, {3, 64}, {250, 129}, FMKV_F16},
  };
  for (int version : {2, 3}) {
    if (version > find_backend(b)->max_format_version) continue;
    for (const C& sh : cases) {
      if ((sh.kb == 5 || sh.vb == 5) && find_backend(b)->max_code_bits < 5) continue;  // refused (CodeWidth5MatchesOrIsRefused)
      fmkv_config c = config(sh.d, sh.kb, sh.vb, sh.kv_heads, sh.page, sh.sink, sh.window, sh.rule);
      c.format_version = version;
      int64_t n1 = 0;
      Scenario s = filled_scenario(c, sh.lens, sh.rows, sh.in, &n1);
      auto k = random_tensor(sh.in, n1, c.num_kv_heads, c.head_dim, 3.0), v = random_tensor(sh.in, n1, c.num_kv_heads, c.head_dim);
      const fmkv_tensor kt = make_tensor(k.data(), sh.in, n1, c.num_kv_heads, c.head_dim);
      const fmkv_tensor vt = make_tensor(v.data(), sh.in, n1, c.num_kv_heads, c.head_dim);
      const LayerState want = run_append(FMKV_BACKEND_REF, s, kt, vt), got = run_append(b, s, kt, vt);
      const std::string what = std::string(fmkv_backend_name(b)) + " format " + std::to_string(version) + " d=" +
                               std::to_string(sh.d) + " k" + std::to_string(sh.kb) + "v" + std::to_string(sh.vb);
      EXPECT_TRUE(got.pages == want.pages) << "pages differ: " << what;
      EXPECT_TRUE(got.fp16_k == want.fp16_k && got.fp16_v == want.fp16_v) << "fp16 regions differ: " << what;
    }
  }
}

// A format-3 decode step that fails its checks (q with a NaN, a length past opts.max_seq_len, more rows than
// the fused step takes) leaves the visible cache unchanged (same_visible_state).
TEST_P(Backends, FormatVersion3StepErrorsWriteNothing) {
  const fmkv_backend b = GetParam();
  if (find_backend(b)->max_format_version < 3) GTEST_SKIP() << fmkv_backend_name(b) << " does not write format 3";
  for (int32_t window : {0, 16}) {
    fmkv_config c = config(128, 3, 3, 2, 16, 0, window);
    c.format_version = 3;
    for (int kind = 0; kind < 3; ++kind) {
      const int64_t rows = kind == 2 ? FMKV_FUSED_MAX_ROWS + 1 : 1;
      int64_t n1 = 0;
      Scenario s = filled_scenario(c, {300}, {rows}, FMKV_F16, &n1);
      auto k = random_tensor(FMKV_F16, n1, 2, 128, 3.0), v = random_tensor(FMKV_F16, n1, 2, 128);
      auto q = random_tensor(FMKV_F16, n1, 8, 128);
      if (kind == 0) reinterpret_cast<uint16_t*>(q.data())[8 * 128 - 3] = 0x7e00;  // NaN in the last q head
      DeviceLayer L(b, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
      DeviceTensor kt(b, make_tensor(k.data(), FMKV_F16, n1, 2, 128)), vt(b, make_tensor(v.data(), FMKV_F16, n1, 2, 128));
      DeviceTensor qt(b, make_tensor(q.data(), FMKV_F16, n1, 8, 128));
      DeviceOutput o(b, qt.t, FMKV_F32);
      const fmkv_attention_opts opts{0.0f, 0.0f, kind == 1 ? 300 : 0};  // kind 1: 301 tokens after the step
      const int64_t ws = fmkv_attention_workspace_bytes(b, &c, 8, n1, 1, opts.max_seq_len);
      DeviceBuf work(b, (size_t)ws + 16);
      fmkv_status st = fmkv_append_attention(b, &c, &L.lc, &L.bt, &kt.t, &vt.t, &qt.t, &opts, &o.t, work.p, (size_t)ws, nullptr);
      if (st == FMKV_OK) st = fmkv_device_synchronize(b);  // CUDA: reported by the device
      EXPECT_EQ(st, kind == 0 ? FMKV_ERR_NON_FINITE : FMKV_ERR_INVALID_ARGUMENT) << fmkv_backend_name(b) << " kind " << kind;
      const char* needle = kind == 0 ? "q[0][7][125]" : kind == 1 ? "more than opts.max_seq_len = 300" : "at most 16";
      EXPECT_NE(std::string(fmkv_last_error()).find(needle), std::string::npos) << fmkv_last_error();
      const LayerState after = L.state(s);
      const int64_t compressed = fmkv_compressed_end(c.sink_tokens, c.window_tokens, 300) - c.sink_tokens;
      EXPECT_TRUE(same_visible_state(s, after, LayerState{s.pages, s.fp16_k, s.fp16_v}, compressed))
          << fmkv_backend_name(b) << " window " << window << " kind " << kind << ": the failed step changed the visible cache";
    }
  }
}

// Scale group 64 (one fp16 scale per two code groups; FORMAT.md section 4): a backend that writes it appends the
// reference's bytes and attends within its bound, by the separate ops and the fused step, in formats 2 and 3, every
// head_dim, every width pair, both scale rules, sinks and windows; one that does not refuses every op with
// FMKV_ERR_UNSUPPORTED naming the option, and writes nothing.
TEST_P(Backends, ScaleGroup64MatchesOrIsRefused) {
  const fmkv_backend b = GetParam();
  const bool supported = find_backend(b)->max_scale_group >= 64;
  struct SG {
    int d, kb, vb, kv_heads, group, page, sink, window, rule, version;
    std::vector<int64_t> lens, rows;
  };
  std::vector<SG> cases;
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 16})
      for (int vb : {2, 3, 4})
        cases.push_back({d, kb, vb, 2, 3, kb == 3 ? 16 : 32, 0, 0, (kb + vb + d / 64) % 2, 2 + (kb + vb) % 2, {37, 0, 90}, {1, 2, 1}});
  cases.push_back({64, 2, 2, 3, 3, 64, 4, 32, FMKV_SCALE_LSQ, 3, {700, 5}, {1, 3}});
  cases.push_back({64, 3, 2, 1, 9, 16, 0, 16, FMKV_SCALE_RMS, 3, {2000}, {2}});
  cases.push_back({128, 3, 3, 8, 4, 64, 2, 0, FMKV_SCALE_LSQ, 3, {300, 9, 64}, {1, 16, 3}});
  for (const SG& sh : cases) {
    fmkv_config c = config(sh.d, sh.kb, sh.vb, sh.kv_heads, sh.page, sh.sink, sh.window, sh.rule);
    c.format_version = sh.version;
    c.scale_group = 64;
    const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(sh.d) + " k" +
                             std::to_string(sh.kb) + "v" + std::to_string(sh.vb) + " format " + std::to_string(sh.version);
    check_option_case(b, supported, c, sh.lens, sh.rows, sh.group, "scale_group 64 is not supported", what);
  }
}

// 5-bit codes (FORMAT.md section 6: the magnitude in nibble words, a sign plane): a backend that writes them appends
// the reference's bytes and attends within its bound; one that does not refuses every op with FMKV_ERR_UNSUPPORTED
// naming the width, and writes nothing. Every pair with a 5-bit side, every head_dim, formats 2 and 3, both scale
// groups and rules, sinks and windows.
TEST_P(Backends, CodeWidth5MatchesOrIsRefused) {
  const fmkv_backend b = GetParam();
  const bool supported = find_backend(b)->max_code_bits >= 5;
  int n = 0;
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 5, 16})
      for (int vb : {2, 3, 4, 5}) {
        if (kb != 5 && vb != 5) continue;
        ++n;
        const int sink = n % 3 == 0 ? 2 : 0, window = n % 4 == 1 ? 16 : 0;
        fmkv_config c = config(d, kb, vb, 2, n % 2 ? 16 : 32, sink, window, n % 2 ? FMKV_SCALE_RMS : FMKV_SCALE_LSQ);
        c.format_version = 2 + n % 2;
        c.scale_group = n % 5 == 0 ? 64 : 0;
        if (c.scale_group > find_backend(b)->max_scale_group) continue;  // refused for the scale group (its own test)
        const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(d) + " k" +
                                 std::to_string(kb) + "v" + std::to_string(vb) + " format " +
                                 std::to_string(c.format_version) + " sg " + std::to_string(c.scale_group);
        check_option_case(b, supported, c, {41, 0, 77}, {1, 2, 1}, 2 + n % 3, "code width 5 is not supported", what);
      }
}

// fmkv_backend_check_attention answers what the attention calls do: for every head_dim x K width x V width x format
// version, either it accepts the config and the attention and fused step run within the backend's bound of the
// reference, or it refuses with FMKV_ERR_UNSUPPORTED naming the pair, and both calls fail with the same status and
// message and write nothing. Only CUDA may refuse a valid config, and only outside its default grid; bad arguments
// (NULL, an invalid config, an unknown backend) are errors, not answers.
TEST_P(Backends, AttentionCheckAgreesWithTheCalls) {
  const fmkv_backend b = GetParam();
  int n = 0, refused = 0;
  for (int d : {64, 128, 256})
    for (int kb : {2, 3, 4, 5, 16})
      for (int vb : {2, 3, 4, 5})
        for (int fv : {2, 3}) {
          ++n;
          fmkv_config c = config(d, kb, vb, 2, n % 2 ? 16 : 32, 0, n % 3 == 0 ? 16 : 0);
          c.format_version = fv;
          const std::string what = std::string(fmkv_backend_name(b)) + " d=" + std::to_string(d) + " k" +
                                   std::to_string(kb) + "v" + std::to_string(vb) + " format " + std::to_string(fv);
          const fmkv_status st = fmkv_backend_check_attention(b, &c);
          const std::string msg = st == FMKV_OK ? "" : fmkv_last_error();
          int64_t n1 = 0;
          Scenario s = filled_scenario(c, {40}, {1}, FMKV_F16, &n1);
          auto k1 = random_tensor(FMKV_F16, n1, 2, d, 3.0), v1 = random_tensor(FMKV_F16, n1, 2, d);
          auto q1 = random_tensor(FMKV_F16, n1, 4, d);
          const fmkv_tensor kt = make_tensor(k1.data(), FMKV_F16, n1, 2, d), vt = make_tensor(v1.data(), FMKV_F16, n1, 2, d);
          const fmkv_tensor qt = make_tensor(q1.data(), FMKV_F16, n1, 4, d);
          if (st == FMKV_OK) {
            expect_matches_reference(b, s, kt, vt, qt, d, kb, vb, what);
            continue;
          }
          ++refused;
          EXPECT_EQ(st, FMKV_ERR_UNSUPPORTED) << what << ": " << msg;
          EXPECT_EQ(b, FMKV_BACKEND_CUDA) << what << " refused: " << msg;
          const bool tiled = fmkv_tiled_codes(fv, kb) || fmkv_tiled_codes(fv, vb);
          EXPECT_FALSE(tiled ? in_default_cuda_grid_f3(d, kb, vb) : in_default_cuda_grid(d, kb, vb))
              << what << ": in the default grid but refused: " << msg;
          EXPECT_NE(msg.find("k" + std::to_string(kb) + "v" + std::to_string(vb)), std::string::npos) << msg;
          // the calls, with a workspace of the plan's size: the same answer, nothing written
          DeviceLayer L(b, s, s.pages, s.fp16_k, s.fp16_v, s.lens);
          DeviceTensor k(b, kt), v(b, vt), q(b, qt);
          DeviceOutput o(b, qt, FMKV_F32);
          const int64_t ws = fmkv_attention_workspace_bytes(b, &c, qt.heads, qt.rows, s.seqs(), 0);
          DeviceBuf work(b, (size_t)ws + 16);
          EXPECT_EQ(fmkv_attention(b, &c, &L.lc, &L.bt, &q.t, nullptr, &o.t, work.p, (size_t)ws, nullptr), st) << what;
          EXPECT_EQ(std::string(fmkv_last_error()), msg) << what;
          EXPECT_EQ(fmkv_append_attention(b, &c, &L.lc, &L.bt, &k.t, &v.t, &q.t, nullptr, &o.t, work.p, (size_t)ws, nullptr),
                    st) << what;
          EXPECT_EQ(std::string(fmkv_last_error()), msg) << what;
          check(fmkv_device_synchronize(b));
          const LayerState after = L.state(s);
          EXPECT_TRUE(after.pages == s.pages && after.fp16_k == s.fp16_k && after.fp16_v == s.fp16_v)
              << what << ": a refused call wrote the cache";
          for (float x : o.as_f32()) ASSERT_TRUE(std::isnan(x)) << what << ": a refused call wrote the output";
        }
  std::printf("[ note ] %s: %d of %d combinations refused by fmkv_backend_check_attention\n", fmkv_backend_name(b), refused, n);
  fmkv_config c = config(128, 3, 3);
  EXPECT_EQ(fmkv_backend_check_attention(b, nullptr), FMKV_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(fmkv_backend_check_attention((fmkv_backend)FMKV_BACKEND_COUNT, &c), FMKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fmkv_last_error()).find("unknown backend"), std::string::npos) << fmkv_last_error();
  c.head_dim = 96;
  EXPECT_EQ(fmkv_backend_check_attention(b, &c), FMKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fmkv_last_error()).find("head_dim"), std::string::npos) << fmkv_last_error();
}

INSTANTIATE_TEST_SUITE_P(All, Backends,
                         ::testing::ValuesIn(backends_under_test()),
                         [](const ::testing::TestParamInfo<fmkv_backend>& i) { return std::string(fmkv_backend_name(i.param)); });

}  // namespace
}  // namespace fmkv::test
