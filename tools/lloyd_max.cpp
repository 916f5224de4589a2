#include "lloyd_max.h"

#include <cmath>
#include <cstdint>
#include <cstring>
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
