#include "lloyd_max.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>

namespace fmkv {
namespace {
const double kInvSqrt2Pi = 0.39894228040143267794;
double pdf(double x) { return std::isinf(x) ? 0.0 : kInvSqrt2Pi * std::exp(-0.5 * x * x); }
double cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double x_pdf(double x) { return std::isinf(x) ? 0.0 : x * pdf(x); }
}  // namespace

double gaussian_distortion(const std::vector<double>& levels, const std::vector<double>& thr) {
  double d = 0;
  for (size_t i = 0; i < levels.size(); ++i) {
    double a = i == 0 ? -INFINITY : thr[i - 1], b = i + 1 == levels.size() ? INFINITY : thr[i];
    double p = cdf(b) - cdf(a);                 // ∫φ
    double m1 = pdf(a) - pdf(b);                // ∫xφ
    double m2 = p - (x_pdf(b) - x_pdf(a));      // ∫x²φ
    double y = levels[i];
    d += m2 - 2 * y * m1 + y * y * p;
  }
  return d;
}

LloydMax lloyd_max_gaussian(int bits) {
  if (bits < 1 || bits > 8) throw std::invalid_argument("lloyd_max_gaussian: bits must be 1..8");
  const int n = 1 << bits;
  LloydMax q;
  q.bits = bits;
  q.levels.resize(n);
  q.thresholds.resize(n - 1);
  for (int i = 0; i < n; ++i) q.levels[i] = -3.0 + 6.0 * (i + 0.5) / n;  // uniform start
  for (int it = 1; it <= 1000000; ++it) {
    for (int i = 0; i + 1 < n; ++i) q.thresholds[i] = 0.5 * (q.levels[i] + q.levels[i + 1]);
    double change = 0;
    for (int i = 0; i < n; ++i) {
      double a = i == 0 ? -INFINITY : q.thresholds[i - 1], b = i + 1 == n ? INFINITY : q.thresholds[i];
      double y = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a));  // centroid E[X | a < X < b]
      change = std::fmax(change, std::fabs(y - q.levels[i]));
      q.levels[i] = y;
    }
    q.iterations = it;
    if (change < 1e-15) break;
  }
  // Exact symmetry: average mirrored pairs so that level(-c) == -level(c) bit for bit.
  for (int i = 0; i < n / 2; ++i) {
    double m = 0.5 * (q.levels[n - 1 - i] - q.levels[i]);
    q.levels[i] = -m;
    q.levels[n - 1 - i] = m;
  }
  for (int i = 0; i + 1 < n; ++i) q.thresholds[i] = 0.5 * (q.levels[i] + q.levels[i + 1]);
  q.distortion = gaussian_distortion(q.levels, q.thresholds);
  return q;
}

double integer_levels_distortion(const std::vector<int>& positive, double step) {
  const size_t k = positive.size();
  std::vector<double> levels(2 * k), thr(2 * k - 1);
  for (size_t i = 0; i < k; ++i) {
    levels[k + i] = step * positive[i];
    levels[k - 1 - i] = -step * positive[i];
  }
  for (size_t i = 0; i + 1 < levels.size(); ++i) thr[i] = 0.5 * (levels[i] + levels[i + 1]);
  return gaussian_distortion(levels, thr);
}

namespace {
bool valid_positive(const std::vector<int>& p, int max_level) {
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] < 1 || p[i] > max_level || (i > 0 && p[i] <= p[i - 1])) return false;
  return true;
}

// The integers for one step: rounded Lloyd-Max levels, then +-1 moves of single levels while one helps.
std::vector<int> descend(const std::vector<double>& lm_positive, double step, int max_level, double* dist) {
  std::vector<int> p(lm_positive.size());
  for (size_t i = 0; i < p.size(); ++i) {
    long r = std::lround(lm_positive[i] / step);
    p[i] = (int)(r < 1 ? 1 : r > max_level ? max_level : r);
  }
  for (size_t i = 1; i < p.size(); ++i)  // make them distinct and ascending
    if (p[i] <= p[i - 1]) p[i] = p[i - 1] + 1;
  if (!valid_positive(p, max_level)) return {};
  double d = integer_levels_distortion(p, step);
  for (bool improved = true; improved;) {
    improved = false;
    for (size_t i = 0; i < p.size(); ++i)
      for (int delta : {-1, 1}) {
        std::vector<int> t = p;
        t[i] += delta;
        if (!valid_positive(t, max_level)) continue;
        const double dt = integer_levels_distortion(t, step);
        if (dt < d) {
          d = dt;
          p = t;
          improved = true;
        }
      }
  }
  *dist = d;
  return p;
}
}  // namespace

IntegerLevels integer_levels_gaussian(int bits, int max_level) {
  if (bits < 1 || bits > 4) throw std::invalid_argument("integer_levels_gaussian: bits must be 1..4");
  const int k = 1 << (bits - 1);
  if (max_level < k || max_level > 127)
    throw std::invalid_argument("integer_levels_gaussian: max_level must be in [2^(bits-1), 127]");
  const LloydMax lm = lloyd_max_gaussian(bits);
  const std::vector<double> pos(lm.levels.begin() + k, lm.levels.end());
  const double top = pos.back();
  IntegerLevels best;
  best.bits = bits;
  best.max_level = max_level;
  best.distortion = INFINITY;
  const int scan = 4000;
  for (int i = 0; i <= scan; ++i) {  // the largest level's integer from max_level down to k
    const double top_int = max_level - (max_level - k) * (double)i / scan;
    const double step = top / top_int;
    double d = 0;
    std::vector<int> p = descend(pos, step, max_level, &d);
    if (!p.empty() && d < best.distortion) {
      best.distortion = d;
      best.step = step;
      best.levels = p;
    }
  }
  // Refine the step for the chosen integers (the distortion is unimodal in the step near its optimum).
  const std::vector<int> p = best.levels;
  double a = best.step * 0.9, b = best.step * 1.1;
  const double g = 0.5 * (std::sqrt(5.0) - 1);
  for (int it = 0; it < 200; ++it) {
    const double c = b - g * (b - a), e = a + g * (b - a);
    if (integer_levels_distortion(p, c) < integer_levels_distortion(p, e)) b = e; else a = c;
  }
  const double refined = 0.5 * (a + b), dr = integer_levels_distortion(p, refined);
  if (dr < best.distortion) {
    best.step = refined;
    best.distortion = dr;
  }
  std::vector<int> full(2 * k);
  for (int i = 0; i < k; ++i) {
    full[k + i] = p[i];
    full[k - 1 - i] = -p[i];
  }
  best.levels = full;
  return best;
}

unsigned short f64_to_f16_bits(double v) {
  uint64_t x;
  std::memcpy(&x, &v, 8);
  unsigned sign = (unsigned)(x >> 48) & 0x8000u;
  uint64_t ax = x & 0x7fffffffffffffffull;
  if (ax >= 0x7ff0000000000000ull) return (unsigned short)(sign | (ax > 0x7ff0000000000000ull ? 0x7e00u : 0x7c00u));
  int e = (int)(ax >> 52) - 1023;
  if (e < -25) return (unsigned short)sign;
  uint64_t m = (ax & 0xfffffffffffffull) | (1ull << 52);  // 53-bit significand
  int sh;
  uint64_t base;
  if (e < -14) {  // subnormal: value = m * 2^(e-52), unit 2^-24 -> shift by (52 - e - 24)
    sh = 28 - e;
    base = 0;
  } else {
    if (e > 15) return (unsigned short)(sign | 0x7c00u);
    sh = 42;
    base = (uint64_t)(e + 15) << 10;
    m &= 0xfffffffffffffull;
  }
  uint64_t r = m >> sh, rem = m & ((1ull << sh) - 1), half = 1ull << (sh - 1);
  r += base;
  if (rem > half || (rem == half && (r & 1))) r++;
  return (unsigned short)(sign | (unsigned)r);
}

}  // namespace fmkv
