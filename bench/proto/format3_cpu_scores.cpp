// Prototype for format 3 (integer operands): the K side of CPU decode attention -- the scores of R = 4
// query vectors (one GQA group) against n tokens of 3-bit K at d = 128 -- in two layouts, same run, one
// thread, AVX-512:
//   format2   the loop of src/cpu/kernels_impl.h attend_t (lane = token; per coordinate: shift the plane
//             word, permute the codebook, XOR the sign, R fp32 FMAs with the broadcast rotated q[j]; the
//             per-group scale by an FMA), on format 2's planes (3 words per token and group);
//   format3   a candidate: 4 consecutive coordinates of a token are 4 int8 levels in one 32-bit lane
//             (vpdpbusd's operand, also CUDA mma.m16n8k32's and NEON sdot's); codes packed densely
//             (12 bits per token and 4-coordinate chunk, 24 bytes per 16 tokens); one vpermb spreads
//             the 24 bytes over 8 qwords, one vpmultishiftqb puts every code in bits 0-2 of its byte,
//             one vpermb looks it up in the 8 integer levels (+128, u8) replicated 8x (bits 3-7 of the
//             index are don't-care); the query in two int8 parts (q16 = 256 qh + ql), two vpdpbusd per
//             query and chunk: exact int32 sums; per group (acc_h << 8) + acc_l - 128 sum(q16), one
//             convert and one FMA with the token's scale;
//   format3-1 the same with the query in one int8 part (one vpdpbusd; shows the cost of the second part).
// The format-3 scores are checked against a float64 computation of the same integer quantizer (exit status 1
// when the two-part scores are off by more than 1e-4 of the largest score).
// The integer levels are the generator's (tools/lloyd_max.h, integer_levels_gaussian(3, 127)).
//   g++ -O3 -std=c++17 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx512vbmi -mf16c -mfma -I src -I include \
//       -I tools bench/proto/format3_cpu_scores.cpp tools/lloyd_max.cpp -o /tmp/f3 && /tmp/f3 [reps]   (JSON lines)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "format/numbers.h"
#include "format/pack.h"
#include "lloyd_max.h"

namespace {

constexpr int D = 128, G = D / 32, R = 4, N = 16;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ---- format 2 (attend_t's K side, 3 bits) ----
struct F2 {
  int64_t n;
  std::vector<uint32_t> words;   // [g][w][t]
  std::vector<uint16_t> scales;  // [g][t]
  alignas(64) float tk[16];
};

__attribute__((noinline)) void scores_f2(const F2& k, const float* const* q, float* out) {
  const __m512 tk = _mm512_loadu_ps(k.tk);
  const __m512i signbit = _mm512_set1_epi32((int)0x80000000u);
  for (int64_t b0 = 0; b0 < k.n; b0 += N) {
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g) {
      __m512i W[3];
      for (int w = 0; w < 3; ++w) W[w] = _mm512_loadu_si512(k.words.data() + ((int64_t)g * 3 + w) * k.n + b0);
      __m512 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
#pragma GCC unroll 32
      for (int j = 0; j < 32; ++j) {
        const __m512i idx = _mm512_srli_epi32(W[fmkv_field_word(j)], (unsigned)fmkv_field_shift(j));
        const __m512 lev = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
            _mm512_castps_si512(_mm512_permutexvar_ps(idx, tk)), _mm512_slli_epi32(W[2], 31 - j), signbit, 0x78));
        for (int r = 0; r < R; ++r) part[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][g * 32 + j]), lev, part[r]);
      }
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k.scales.data() + (int64_t)g * k.n + b0)));
      for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(part[r], sc, s[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (int64_t)r * k.n + b0, s[r]);
  }
}

// ---- format 3 candidate ----
struct F3 {
  int64_t n;
  std::vector<uint8_t> codes;    // [block][g][chunk c][24 bytes]: token t's 4 codes at bits 12 t .. 12 t + 11
  std::vector<uint16_t> scales;  // [g][t]
  int levels[8];                 // integer levels, ascending (code = index)
  alignas(64) uint8_t table[64];  // levels + 128, replicated 8x
};

struct Q3 {
  // per query r and group g: the 32 coordinates as int8 pairs (qh, ql), 4 per 32-bit word, and 128 sum(q16)
  alignas(64) int8_t qh[R][D], ql[R][D], q1[R][D];
  int32_t corr[R][G], corr1[R][G];
  float qscale[R], qscale1[R];
};

void make_q3(const float* const* q, Q3& o) {
  for (int r = 0; r < R; ++r) {
    float mx = 0;
    for (int i = 0; i < D; ++i) mx = std::max(mx, std::fabs(q[r][i]));
    const float s16 = mx > 0 ? mx / 32639.0f : 1.0f, s8 = mx > 0 ? mx / 127.0f : 1.0f;
    o.qscale[r] = s16;
    o.qscale1[r] = s8;
    for (int g = 0; g < G; ++g) {
      int32_t sum16 = 0, sum8 = 0;
      for (int i = g * 32; i < g * 32 + 32; ++i) {
        const int q16 = (int)std::lrintf(q[r][i] / s16);  // |q16| <= 32639: hi <= 127
        const int hi = (q16 + 128) >> 8, lo = q16 - 256 * hi;  // hi in [-128, 128), lo in [-128, 127]
        o.qh[r][i] = (int8_t)hi;
        o.ql[r][i] = (int8_t)lo;
        sum16 += q16;
        const int q8 = (int)std::lrintf(q[r][i] / s8);
        o.q1[r][i] = (int8_t)q8;
        sum8 += q8;
      }
      o.corr[r][g] = 128 * sum16;
      o.corr1[r][g] = 128 * sum8;
    }
  }
}

template <bool TwoParts>
__attribute__((noinline)) void scores_f3(const F3& k, const Q3& q, float* out) {
  const __m512i table = _mm512_loadu_si512(k.table);
  // qword i (tokens 2i, 2i+1) <- bytes 3i .. 3i + 2 of the chunk (the other 5 bytes: anything in range)
  alignas(64) uint8_t spread[64], shifts[64];
  for (int i = 0; i < 8; ++i)
    for (int b = 0; b < 8; ++b) {
      spread[8 * i + b] = (uint8_t)(3 * i + (b < 3 ? b : 2));
      shifts[8 * i + b] = (uint8_t)(3 * b);  // byte b of qword i: code b of its 8 (token 2i: 0..3, 2i+1: 4..7)
    }
  const __m512i vspread = _mm512_loadu_si512(spread), vshift = _mm512_loadu_si512(shifts);
  const __mmask64 m24 = (1ull << 24) - 1;
  for (int64_t b0 = 0; b0 < k.n; b0 += N) {
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    const uint8_t* blk = k.codes.data() + (b0 / N) * (G * 8 * 24);
    for (int g = 0; g < G; ++g) {
      __m512i ah[R], al[R];
      for (int r = 0; r < R; ++r) ah[r] = al[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i raw = _mm512_maskz_loadu_epi8(m24, blk + (g * 8 + c) * 24);
        const __m512i idx = _mm512_multishift_epi64_epi8(vshift, _mm512_permutexvar_epi8(vspread, raw));
        const __m512i lev = _mm512_permutexvar_epi8(idx, table);
        for (int r = 0; r < R; ++r) {
          if (TwoParts) {
            ah[r] = _mm512_dpbusd_epi32(ah[r], lev, _mm512_set1_epi32(*(const int32_t*)&q.qh[r][g * 32 + 4 * c]));
            al[r] = _mm512_dpbusd_epi32(al[r], lev, _mm512_set1_epi32(*(const int32_t*)&q.ql[r][g * 32 + 4 * c]));
          } else {
            ah[r] = _mm512_dpbusd_epi32(ah[r], lev, _mm512_set1_epi32(*(const int32_t*)&q.q1[r][g * 32 + 4 * c]));
          }
        }
      }
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k.scales.data() + (int64_t)g * k.n + b0)));
      for (int r = 0; r < R; ++r) {
        __m512i S = TwoParts ? _mm512_add_epi32(_mm512_slli_epi32(ah[r], 8), al[r]) : ah[r];
        S = _mm512_sub_epi32(S, _mm512_set1_epi32(TwoParts ? q.corr[r][g] : q.corr1[r][g]));
        s[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sc, s[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + (int64_t)r * k.n + b0, _mm512_mul_ps(s[r], _mm512_set1_ps(TwoParts ? q.qscale[r] : q.qscale1[r])));
  }
}

int code3(const F3& k, int64_t t, int i) {  // token t, coordinate i
  const int64_t blk = t / N;
  const int tt = (int)(t % N), g = i / 32, c = (i % 32) / 4, e = i % 4;
  const uint8_t* p = k.codes.data() + blk * (G * 8 * 24) + (g * 8 + c) * 24;
  const int bit = 12 * tt + 3 * e;
  const unsigned w = p[bit / 8] | (bit / 8 + 1 < 24 ? p[bit / 8 + 1] << 8 : 0);
  return (int)((w >> (bit % 8)) & 7u);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  if (reps < 1 || reps > 100000) { std::fprintf(stderr, "reps must be in 1..100000\n"); return 2; }
  std::mt19937_64 rng(42);
  bool failed = false;
  std::normal_distribution<float> nd;
  const fmkv::IntegerLevels il = fmkv::integer_levels_gaussian(3, 127);
  const int* int_levels = il.levels.data();
  for (int64_t n : {4096, 32768, 131072}) {
    F2 k2;
    k2.n = n;
    k2.words.resize((size_t)G * 3 * n);
    k2.scales.resize((size_t)G * n);
    for (auto& w : k2.words) w = (uint32_t)rng();
    for (auto& s : k2.scales) s = fmkv::f32_to_f16(0.05f + 0.01f * std::fabs(nd(rng)));
    for (int i = 0; i < 16; ++i) k2.tk[i] = 0.25f + 0.5f * (i & 3);
    F3 k3;
    k3.n = n;
    k3.codes.resize((size_t)(n / N) * G * 8 * 24 + 64);
    for (auto& c : k3.codes) c = (uint8_t)rng();
    k3.scales = k2.scales;
    std::memcpy(k3.levels, int_levels, sizeof k3.levels);
    for (int i = 0; i < 64; ++i) k3.table[i] = (uint8_t)(int_levels[i & 7] + 128);
    std::vector<float> qv((size_t)R * D);
    for (auto& x : qv) x = nd(rng);
    const float* q[R];
    for (int r = 0; r < R; ++r) q[r] = qv.data() + (size_t)r * D;
    Q3 q3;
    make_q3(q, q3);
    std::vector<float> o2((size_t)R * n), o3((size_t)R * n), o31((size_t)R * n);
    // float64 check of format 3 (two parts and one part) against the same integer levels and scales
    scores_f3<true>(k3, q3, o3.data());
    scores_f3<false>(k3, q3, o31.data());
    double err = 0, err1 = 0, ref_max = 0;
    for (int64_t t = 0; t < n; t += 7)
      for (int r = 0; r < R; ++r) {
        double ref = 0;
        for (int i = 0; i < D; ++i)
          ref += (double)q[r][i] * k3.levels[code3(k3, t, i)] * fmkv::f16_to_f32(k3.scales[(size_t)(i / 32) * n + t]);
        ref_max = std::max(ref_max, std::fabs(ref));
        err = std::max(err, std::fabs(o3[(size_t)r * n + t] - ref));
        err1 = std::max(err1, std::fabs(o31[(size_t)r * n + t] - ref));
      }
    if (!(err <= 1e-4 * ref_max)) {  // the two-part query must be exact up to fp32 rounding
      std::fprintf(stderr, "format3 scores off by %g (max |score| %g) at %lld tokens\n", err, ref_max, (long long)n);
      failed = true;
    }
    struct Case { const char* name; int kind; };
    const Case cases[3] = {{"format2", 0}, {"format3", 1}, {"format3-1", 2}};
    std::vector<double> tm[3];
    for (int rep = 0; rep < reps; ++rep)
      for (int c = 0; c < 3; ++c) {  // interleaved: the cases see the same machine state
        const double t0 = now();
        if (c == 0) scores_f2(k2, q, o2.data());
        else if (c == 1) scores_f3<true>(k3, q3, o3.data());
        else scores_f3<false>(k3, q3, o31.data());
        tm[c].push_back(now() - t0);
      }
    const double base = median(tm[0]);
    double load = -1;
    if (FILE* f = std::fopen("/proc/loadavg", "r")) {
      if (std::fscanf(f, "%lf", &load) != 1) load = -1;
      std::fclose(f);
    }
    for (int c = 0; c < 3; ++c) {
      const double t = median(tm[c]);
      const double bytes = (double)n * (G * 12 + G * 2);  // codes + scales: 56 B per token in both layouts
      std::printf("{\"suite\": \"format3_proto_cpu_scores\", \"impl\": \"%s\", \"tokens\": %lld, \"q_vectors\": %d, "
                  "\"head_dim\": %d, \"k_bits\": 3, \"threads\": 1, \"reps\": %d, \"loadavg_1min\": %.2f, \"time_us\": %.2f, "
                  "\"ns_per_token\": %.3f, \"gb_per_s\": %.2f, \"speedup_vs_format2\": %.3f",
                  cases[c].name, (long long)n, R, D, reps, load, t * 1e6, t * 1e9 / n, bytes / t * 1e-9, base / t);
      if (c > 0) std::printf(", \"max_abs_err_vs_f64\": %.3g, \"max_abs_score\": %.3g", c == 1 ? err : err1, ref_max);
      std::printf("}\n");
    }
  }
  return failed ? 1 : 0;
}
