// The reference against independent float64 formulations.
#include <cmath>

#include "harness.h"
#include "core/tensor_io.h"
#include "format/codebook.h"
#include "format/rotation.h"
#include "ref/quantize.h"

namespace fmkv::test {
namespace {

// Naive float64 attention on the dequantized cache: dequantize every token to the unrotated
// domain, then softmax(scale * q k^T) v with a causal mask.
std::vector<float> naive_attention(const Scenario& s, const LayerState& st, const fmkv_tensor& q,
                                   double scale, double softcap) {
  const fmkv_config& c = s.cfg;
  const int32_t d = c.head_dim, H = c.num_kv_heads, HQ = q.heads, R = c.sink_tokens + c.window_tokens;
  auto sw = ref::sign_words(c.seed, s.layer, d);
  int64_t pb = fmkv_config_page_bytes(&c);
  auto off = s.offsets();
  std::vector<float> out((size_t)q.rows * HQ * d);
  for (int32_t i = 0; i < s.seqs(); ++i) {
    int64_t len = s.lens[i] + s.rows[i], E = std::max<int64_t>(c.sink_tokens, len - c.window_tokens);
    // K, V of every position, unrotated, float64.
    std::vector<std::vector<double>> K(len, std::vector<double>(d)), V = K;
    for (int32_t h = 0; h < H; ++h) {
      for (int64_t p = 0; p < len; ++p) {
        for (int which = 0; which < 2; ++which) {
          std::vector<double>& dst = which ? V[p] : K[p];
          int bits = which ? c.v_bits : c.k_bits;
          if (p < c.sink_tokens || p >= E) {
            int32_t sl = p < c.sink_tokens ? (int32_t)p : c.sink_tokens + (int32_t)((p - c.sink_tokens) % c.window_tokens);
            const std::vector<uint16_t>& reg = which ? st.fp16_v : st.fp16_k;
            for (int k = 0; k < d; ++k) dst[k] = f16_to_f32(reg[(((size_t)s.slots[i] * H + h) * R + sl) * d + k]);
            continue;
          }
          int64_t ci = p - c.sink_tokens;
          const uint8_t* sec = st.pages.data() + (int64_t)s.table[i * s.table_stride + ci / c.page_size] * pb +
                               fmkv_section_offset(d, c.k_bits, c.v_bits, c.page_size, h, which, c.scale_group);
          int32_t t = (int32_t)(ci % c.page_size);
          if (bits == 16) {
            for (int k = 0; k < d; ++k) dst[k] = f16_to_f32(((const uint16_t*)sec)[(int64_t)t * d + k]);
            continue;
          }
          std::vector<uint8_t> codes(d);
          std::vector<uint16_t> sc(d / 32);
          const int32_t version = fmkv_resolved_format_version(c.format_version);
          ref::read_token_codes(sec, version, which, d, bits, c.page_size, t, codes.data(), sc.data());
          std::vector<double> y(d);
          ref::dequantize_vector(codes.data(), sc.data(), d, bits, y.data(), codebook_table(version, bits, which));
          ref::unrotate_f64(y.data(), d, sw.data(), dst.data());
        }
      }
      for (int32_t hq = h * (HQ / H); hq < (h + 1) * (HQ / H); ++hq)
        for (int64_t j = 0; j < s.rows[i]; ++j) {
          int64_t pos = len - s.rows[i] + j;
          std::vector<double> sc(pos + 1);
          double mx = -INFINITY;
          for (int64_t p = 0; p <= pos; ++p) {
            double dot = 0;
            for (int k = 0; k < d; ++k) dot += (double)load_f32(q, off[i] + j, hq, k) * K[p][k];
            dot *= scale;
            if (softcap > 0) dot = softcap * std::tanh(dot / softcap);
            sc[p] = dot;
            mx = std::max(mx, dot);
          }
          double sum = 0;
          for (auto& v : sc) sum += (v = std::exp(v - mx));
          for (int k = 0; k < d; ++k) {
            double o = 0;
            for (int64_t p = 0; p <= pos; ++p) o += sc[p] * V[p][k];
            out[((size_t)(off[i] + j) * HQ + hq) * d + k] = (float)(o / sum);
          }
        }
    }
  }
  return out;
}

struct RefCase {
  int d, kb, vb, kv_heads, group, page, sink, window;
  std::vector<int64_t> lens, rows;
  float softcap;
  int32_t format_version = 0;
};

TEST(Reference, AttentionEqualsNaiveFloat64) {
  const RefCase cases[] = {
      {64, 3, 3, 2, 4, 16, 0, 0, {40, 0, 17}, {1, 3, 2}, 0.0f},
      {128, 4, 2, 1, 8, 32, 4, 8, {70, 5}, {4, 1}, 0.0f},      // MQA, sink + window, causal
      {256, 2, 4, 3, 1, 16, 0, 16, {50}, {16}, 0.0f},           // MHA, q_len 16
      {128, 16, 3, 2, 2, 16, 2, 0, {33, 18}, {1, 2}, 30.0f},    // k16, softcap
      {64, 4, 4, 2, 3, 64, 0, 0, {130}, {5}, 0.0f},
      // format 3 (3-bit codes in tile blocks): partly filled tiles, several pages, sink + window, fp16 K
      {64, 3, 3, 2, 4, 16, 0, 0, {40, 0, 17}, {1, 3, 2}, 0.0f, 3},
      {128, 3, 2, 1, 8, 32, 4, 8, {70, 5}, {4, 1}, 0.0f, 3},
      {256, 4, 3, 2, 1, 16, 0, 16, {50}, {16}, 0.0f, 3},
      {128, 16, 3, 2, 2, 16, 2, 0, {33, 18}, {1, 2}, 30.0f, 3},
      // 5-bit codes (either side, both formats), MQA with sink + window, fp16 K
      {64, 5, 5, 2, 4, 16, 0, 0, {40, 0, 17}, {1, 3, 2}, 0.0f},
      {128, 5, 4, 1, 8, 32, 4, 8, {70, 5}, {4, 1}, 0.0f, 3},
      {256, 3, 5, 2, 1, 16, 0, 16, {50}, {16}, 0.0f, 3},
      {128, 16, 5, 2, 2, 16, 2, 0, {33, 18}, {1, 2}, 30.0f},
  };
  for (const RefCase& rc : cases) {
    fmkv_config c = config(rc.d, rc.kb, rc.vb, rc.kv_heads, rc.page, rc.sink, rc.window);
    c.format_version = rc.format_version;
    Scenario s = make_scenario(c, rc.lens, rc.rows);
    // Build the cache: append [0, len) then the query rows, as a model would.
    std::vector<int64_t> total(rc.lens.size());
    for (size_t i = 0; i < total.size(); ++i) total[i] = rc.lens[i] + rc.rows[i];
    Scenario fill = s;
    fill.lens.assign(total.size(), 0);
    fill.rows = total;
    int64_t n = 0;
    for (auto t : total) n += t;
    auto kb = random_tensor(FMKV_F16, n, c.num_kv_heads, c.head_dim, 2.0);
    auto vb = random_tensor(FMKV_F16, n, c.num_kv_heads, c.head_dim);
    LayerState st = run_append(FMKV_BACKEND_REF, fill,
                               make_tensor(kb.data(), FMKV_F16, n, c.num_kv_heads, c.head_dim),
                               make_tensor(vb.data(), FMKV_F16, n, c.num_kv_heads, c.head_dim));
    int64_t nq = 0;
    for (auto r : rc.rows) nq += r;
    int32_t HQ = rc.kv_heads * rc.group;
    auto qb = random_tensor(FMKV_F32, nq, HQ, c.head_dim);
    fmkv_tensor q = make_tensor(qb.data(), FMKV_F32, nq, HQ, c.head_dim);
    fmkv_attention_opts o{0.0f, rc.softcap, 0};
    auto got = run_attention(FMKV_BACKEND_REF, s, st, q, FMKV_F32, o);
    auto want = naive_attention(s, st, q, 1.0 / std::sqrt((double)c.head_dim), rc.softcap);
    // Output is stored as float32, so the comparison is limited by float32 rounding of each value.
    EXPECT_LT(rel_error(got, want), 1e-7) << "d=" << rc.d << " k" << rc.kb << "v" << rc.vb << " format " << rc.format_version;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs((double)got[i] - want[i]) / (1e-30 + std::fabs(want[i]) + 1e-3));
    EXPECT_LT(worst, 1e-6);
  }
}

TEST(Reference, AttentionFloat64ToTenDigits) {
  // Same comparison without float32 output rounding: the per-token dot products of the reference
  // (rotated domain) and the naive path (unrotated) agree to 1e-10.
  std::mt19937_64& r = rng();
  for (int d : {64, 128, 256}) {
    auto sw = ref::sign_words(r(), 3, d);
    std::vector<double> q(d), k(d), qr(d), kr(d);
    std::normal_distribution<double> nd;
    for (int i = 0; i < d; ++i) { q[i] = nd(r); kr[i] = nd(r); }
    ref::rotate_f64(q.data(), d, sw.data(), qr.data());
    ref::unrotate_f64(kr.data(), d, sw.data(), k.data());
    double a = 0, b = 0;
    for (int i = 0; i < d; ++i) { a += qr[i] * kr[i]; b += q[i] * k[i]; }
    EXPECT_NEAR(a, b, 1e-10 * (1 + std::fabs(b)));
  }
}

// Appending in chunks, token by token, or all at once yields identical bytes.
TEST(Reference, AppendIsChunkingInvariant) {
  for (int window : {0, 8}) {
    fmkv_config c = config(128, 3, 4, 2, 16, 3, window);
    const int64_t n = 75;
    auto kb = random_tensor(FMKV_BF16, n, 2, 128);
    auto vb = random_tensor(FMKV_BF16, n, 2, 128);
    Scenario whole = make_scenario(c, {0}, {n});
    LayerState a = run_append(FMKV_BACKEND_REF, whole, make_tensor(kb.data(), FMKV_BF16, n, 2, 128),
                              make_tensor(vb.data(), FMKV_BF16, n, 2, 128));
    Scenario part = whole;
    LayerState st{whole.pages, whole.fp16_k, whole.fp16_v};
    int64_t done = 0;
    for (int64_t chunk : {1, 1, 7, 20, 1, 45}) {
      part.pages = st.pages;
      part.fp16_k = st.fp16_k;
      part.fp16_v = st.fp16_v;
      part.lens = {done};
      part.rows = {chunk};
      st = run_append(FMKV_BACKEND_REF, part, make_tensor(kb.data() + done * 2 * 128 * 2, FMKV_BF16, chunk, 2, 128),
                      make_tensor(vb.data() + done * 2 * 128 * 2, FMKV_BF16, chunk, 2, 128));
      done += chunk;
    }
    EXPECT_EQ(st.pages, a.pages) << "window " << window;
    EXPECT_EQ(st.fp16_k, a.fp16_k);
    EXPECT_EQ(st.fp16_v, a.fp16_v);
  }
}

// Quantization error is what the codebook predicts for Gaussian-like rotated data (format 2's tables and
// format 3's 3-bit K and V tables, tables 1 and 2).
TEST(Reference, QuantizationMseNearLloydMax) {
  std::normal_distribution<float> nd;
  const double max_d[6] = {0, 0, 0.1175, 0.03455, 0.009501, 0.002505};
  const std::pair<int, int> tables[] = {{2, 0}, {3, 0}, {3, 1}, {3, 2}, {4, 0}, {5, 0}};
  for (auto [bits, table] : tables)
    for (int rule : {FMKV_SCALE_RMS, FMKV_SCALE_LSQ}) {
      double err = 0, ref = 0;
      for (int t = 0; t < 400; ++t) {
        std::vector<uint16_t> x(128);
        for (auto& v : x) v = f32_to_f16(nd(rng()) * (t % 7 == 0 ? 10.0f : 1.0f));
        auto sw = ref::sign_words(7, 0, 128);
        std::vector<uint8_t> codes(128);
        std::vector<uint16_t> sc(4);
        ref::quantize_vector(x.data(), 128, bits, rule, sw.data(), codes.data(), sc.data(), table);
        std::vector<double> y(128), xr(128);
        ref::dequantize_vector(codes.data(), sc.data(), 128, bits, y.data(), table);
        ref::unrotate_f64(y.data(), 128, sw.data(), xr.data());
        for (int i = 0; i < 128; ++i) {
          double xi = f16_to_f32(x[i]);
          err += (xr[i] - xi) * (xr[i] - xi);
          ref += xi * xi;
        }
      }
      EXPECT_LT(err / ref, max_d[bits] * 1.25) << bits << " bits table " << table << " rule " << rule;
      EXPECT_GT(err / ref, max_d[bits] * 0.75);
    }
}

// Scale group 64 (FORMAT.md section 4) against an independent float64 statement of the rule: one scale per 64
// rotated coordinates, the RMS of all 64 rounded to fp16 (within one fp16 step of the float64 value: the format
// sums in float32), codes by the thresholds at that scale, and for LSQ the least-squares scale of those codes over
// all 64 coordinates; the dequantized vector is within the codebook's error and shares the scale across the two
// code groups. Scale group 32 gives d / 32 scales, each of its own 32 coordinates.
TEST(Reference, ScaleGroup64IsOneScalePer64Coordinates) {
  std::normal_distribution<float> nd;
  for (int d : {64, 128, 256})
    for (int bits : {2, 3, 4, 5})
      for (int rule : {FMKV_SCALE_RMS, FMKV_SCALE_LSQ})
        for (int trial = 0; trial < 20; ++trial) {
          std::vector<uint16_t> x(d);
          const float amp = trial % 5 == 0 ? 40.0f : 1.0f;
          for (int i = 0; i < d; ++i) x[i] = f32_to_f16(nd(rng()) * amp * (i < d / 2 ? 1.0f : 3.0f));
          auto sw = ref::sign_words(11 + trial, trial, d);
          std::vector<float> xf(d), y(d);
          for (int i = 0; i < d; ++i) xf[i] = f16_to_f32(x[i]);
          rotate(xf.data(), d, sw.data(), y.data());
          std::vector<uint8_t> codes(d);
          std::vector<uint16_t> sc(d / 64);
          ref::quantize_vector(x.data(), d, bits, rule, sw.data(), codes.data(), sc.data(), 0, 64);
          for (int s = 0; s < d / 64; ++s) {
            double ss = 0, num = 0, den = 0;
            for (int j = 0; j < 64; ++j) ss += (double)y[64 * s + j] * y[64 * s + j];
            const double rms = std::sqrt(ss / 64);
            const float s0 = f16_to_f32(f32_to_f16((float)rms));
            ASSERT_GT(s0, 0.0f);
            for (int j = 0; j < 64; ++j) {
              const double u = y[64 * s + j] / (double)s0;
              // the code's level is the nearest level to u, away from near-ties (float32 sums may put s0 one fp16
              // step from this float64 one)
              const double lv = decode_level_table(codes[64 * s + j], bits, 0);
              for (int m = 0; m < magnitude_count(bits); ++m) {
                const double other = table_mag(0, bits, m) * (u < 0 ? -1 : 1);
                if (std::fabs(std::fabs(u - other) - std::fabs(u - lv)) > 2e-3 * std::fabs(u) + 1e-4) {
                  EXPECT_LE(std::fabs(u - lv), std::fabs(u - other)) << "d=" << d << " bits " << bits << " coord " << 64 * s + j;
                }
              }
              num += y[64 * s + j] * lv;
              den += lv * lv;
            }
            const double want = rule == FMKV_SCALE_RMS ? rms : num / den;
            const double got = f16_to_f32(sc[s]);
            EXPECT_NEAR(got, want, std::ldexp(std::fabs(want), -10)) << "d=" << d << " bits " << bits << " rule " << rule;
          }
          std::vector<double> yd(d);
          ref::dequantize_vector(codes.data(), sc.data(), d, bits, yd.data(), 0, 64);
          for (int i = 0; i < d; ++i)
            EXPECT_EQ(yd[i], (double)decode_level_table(codes[i], bits, 0) * f16_to_f32(sc[i / 64]));
          std::vector<uint16_t> sc32(d / 32);
          ref::quantize_vector(x.data(), d, bits, rule, sw.data(), codes.data(), sc32.data(), 0, 32);
          std::vector<uint16_t> sc0(d / 32);
          ref::quantize_vector(x.data(), d, bits, rule, sw.data(), codes.data(), sc0.data(), 0, 0);
          EXPECT_EQ(sc32, sc0) << "scale group 0 is 32";
        }
}

}  // namespace
}  // namespace fmkv::test
