// fmkv_attention_lse: the same output as fmkv_attention plus the log of the softmax denominator, and the
// merge it exists for: a sequence split into two caches by token range (the first keeps the sinks, the
// second the fp16 window, so every token is stored exactly as in one cache) gives, merged by the lse
// weights, the one cache's attention within the backend's bound. Errors: a wrong lse tensor, a NULL one.
#include <cmath>
#include <vector>

#include "harness.h"

namespace fmkv::test {
namespace {

struct Lse {
  std::vector<float> out, lse;
};

Lse attention_lse(fmkv_backend b, const HostCache& c, const fmkv_tensor& q, fmkv_attention_opts o = {0.0f, 0.0f, 0}) {
  Lse r;
  r.out.assign((size_t)q.rows * q.heads * q.dim, NAN);  // poisoned
  r.lse.assign((size_t)q.rows * q.heads, NAN);
  fmkv_tensor ot = make_tensor(r.out.data(), FMKV_F32, q.rows, q.heads, q.dim);
  fmkv_tensor lt = make_tensor(r.lse.data(), FMKV_F32, q.rows, q.heads, 1);
  c.attention(b, 0, 0, q, ot, lt, o);
  return r;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    den += (double)b[i] * b[i];
  }
  return std::sqrt(num / den);
}

TEST(AttentionLse, MatchesAttentionAndMergesShards) {
  struct Case { int d, kb, vb, sink, window; float softcap; };
  const Case cases[] = {{128, 3, 3, 0, 0, 0.0f}, {64, 4, 2, 4, 32, 0.0f}, {128, 2, 4, 2, 16, 30.0f}, {256, 16, 3, 0, 8, 0.0f}};
  for (const Case& cs : cases)
    for (fmkv_backend b : {FMKV_BACKEND_REF, FMKV_BACKEND_CPU}) {
      if (!fmkv_backend_available(b)) continue;
      SCOPED_TRACE(std::string(fmkv_backend_name(b)) + " d" + std::to_string(cs.d) + " k" + std::to_string(cs.kb) + "v" +
                   std::to_string(cs.vb) + " sink " + std::to_string(cs.sink) + " window " + std::to_string(cs.window));
      const int H = 2, HQ = 8, n = 700, n1 = 300;
      const fmkv_config full_cfg = config(cs.d, cs.kb, cs.vb, H, 16, cs.sink, cs.window);
      fmkv_config first_cfg = full_cfg, second_cfg = full_cfg;
      first_cfg.window_tokens = 0;  // the first shard: the sinks, the rest compressed
      second_cfg.sink_tokens = 0;   // the second: compressed, then the window
      auto k = random_tensor(FMKV_F32, n, H, cs.d), v = random_tensor(FMKV_F32, n, H, cs.d);
      auto rows = [&](const std::vector<uint8_t>& x, int64_t r0, int64_t r1) {
        return make_tensor(x.data() + (size_t)r0 * H * cs.d * 4, FMKV_F32, r1 - r0, H, cs.d);
      };
      HostCache full(full_cfg, 1, 64, 1), first(first_cfg, 1, 64, 1), second(second_cfg, 1, 64, 1);
      for (HostCache* c : {&full, &first, &second}) c->add_sequence();
      full.append(b, 0, 0, rows(k, 0, n), rows(v, 0, n));
      first.append(b, 0, 0, rows(k, 0, n1), rows(v, 0, n1));
      second.append(b, 0, 0, rows(k, n1, n), rows(v, n1, n));
      auto q = random_tensor(FMKV_F32, 1, HQ, cs.d, 2.0);
      const fmkv_tensor qt = make_tensor(q.data(), FMKV_F32, 1, HQ, cs.d);
      const fmkv_attention_opts o{0.0f, cs.softcap, 0};

      // The same output as fmkv_attention, bit for bit.
      const Lse whole = attention_lse(b, full, qt, o);
      std::vector<float> plain((size_t)HQ * cs.d, NAN);
      fmkv_tensor pt = make_tensor(plain.data(), FMKV_F32, 1, HQ, cs.d);
      full.attention(b, 0, 0, qt, pt, o);
      EXPECT_EQ(whole.out, plain);
      // lse equals the oracle's (float64 inside, rounded once) within float32 accumulation error.
      const Lse ref = attention_lse(FMKV_BACKEND_REF, full, qt, o);
      for (int h = 0; h < HQ; ++h) EXPECT_NEAR(whole.lse[h], ref.lse[h], 2e-5 * (1 + std::fabs(ref.lse[h]))) << h;

      // Shards merged by their lse weights equal the whole cache's attention.
      const Lse a = attention_lse(b, first, qt, o), c = attention_lse(b, second, qt, o);
      std::vector<float> merged((size_t)HQ * cs.d);
      for (int h = 0; h < HQ; ++h) {
        const double m = std::max(a.lse[h], c.lse[h]);
        const double wa = std::exp(a.lse[h] - m), wc = std::exp(c.lse[h] - m), lse = m + std::log(wa + wc);
        EXPECT_NEAR(lse, whole.lse[h], 2e-5 * (1 + std::fabs(whole.lse[h]))) << h;
        for (int i = 0; i < cs.d; ++i)
          merged[(size_t)h * cs.d + i] = (float)((wa * a.out[(size_t)h * cs.d + i] + wc * c.out[(size_t)h * cs.d + i]) / (wa + wc));
      }
      EXPECT_LT(rel_error(merged, whole.out), 1e-5);
    }
}

TEST(AttentionLse, BadLseTensorIsRefused) {
  const fmkv_config c = config(128, 3, 3, 2, 16);
  HostCache cache(c, 1, 8, 1);
  cache.add_sequence();
  auto k = random_tensor(FMKV_F32, 20, 2, 128);
  cache.append(FMKV_BACKEND_REF, 0, 0, make_tensor(k.data(), FMKV_F32, 20, 2, 128), make_tensor(k.data(), FMKV_F32, 20, 2, 128));
  auto q = random_tensor(FMKV_F32, 1, 4, 128);
  const fmkv_tensor qt = make_tensor(q.data(), FMKV_F32, 1, 4, 128);
  std::vector<float> out(4 * 128), lse(8, -7.0f);
  fmkv_tensor ot = make_tensor(out.data(), FMKV_F32, 1, 4, 128);
  struct Bad { fmkv_tensor t; const char* what; };
  std::vector<uint16_t> half(4);
  const Bad bad[] = {{make_tensor(lse.data(), FMKV_F32, 1, 2, 1), "heads"},
                     {make_tensor(lse.data(), FMKV_F32, 2, 4, 1), "rows"},
                     {make_tensor(lse.data(), FMKV_F32, 1, 4, 2), "last dimension"},
                     {make_tensor(half.data(), FMKV_F16, 1, 4, 1), "not f32"},
                     {make_tensor(nullptr, FMKV_F32, 1, 4, 1), "NULL"}};
  for (const Bad& x : bad) {
    fmkv_tensor t = x.t;
    try {
      cache.attention(FMKV_BACKEND_REF, 0, 0, qt, ot, t);
      ADD_FAILURE() << x.what << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), FMKV_ERR_INVALID_ARGUMENT) << e.what();
      EXPECT_NE(std::string(e.what()).find("lse"), std::string::npos) << e.what();
    }
  }
  for (float x : lse) EXPECT_EQ(x, -7.0f);  // nothing written by a refused call
  fmkv_layer_cache lc = cache.layer_view(0);
  int32_t s = 0;
  int64_t len = 20, ro[2] = {0, 1};
  fmkv_batch bt{1, &s, &len, ro, cache.block_table(0).data(), (int64_t)cache.block_table(0).size()};
  EXPECT_EQ(fmkv_attention_lse(FMKV_BACKEND_REF, &c, &lc, &bt, &qt, nullptr, &ot, nullptr, nullptr, 0, nullptr),
            FMKV_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fmkv_last_error()).find("NULL"), std::string::npos) << fmkv_last_error();
}

}  // namespace
}  // namespace fmkv::test
