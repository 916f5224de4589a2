#include "lloyd_max.h"

#include <algorithm>
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

std::vector<int> level_grid_values(LevelGrid grid) {
  std::vector<int> g;
  switch (grid) {
    case LevelGrid::kInt8:
      for (int v = 1; v <= 127; ++v) g.push_back(v);
      break;
    case LevelGrid::kOddGrid:
      for (int t = 0; t <= 127; ++t) g.push_back(2 * t + 1);
      break;
    case LevelGrid::kThreeSignificantBits:
    case LevelGrid::kFourSignificantBits: {
      const int limit = grid == LevelGrid::kThreeSignificantBits ? 8 : 16;
      for (int v = 1; v <= (1 << 14); ++v) {
        int m = v;
        while (m % 2 == 0) m /= 2;
        if (m < limit) g.push_back(v);  // odd part below 2^n: at most n significant bits
      }
      break;
    }
  }
  return g;
}

namespace {
// The grid indices for one step: rounded Lloyd-Max levels (nearest grid value), then moves of single levels
// to a neighbouring grid value while one lowers the distortion.
std::vector<int> descend(const std::vector<double>& lm_positive, double step, const std::vector<int>& grid, double* dist) {
  const int n = (int)grid.size();
  std::vector<int> ix(lm_positive.size());
  for (size_t i = 0; i < ix.size(); ++i) {
    const double want = lm_positive[i] / step;
    int j = (int)(std::lower_bound(grid.begin(), grid.end(), want) - grid.begin());
    if (j == n || (j > 0 && want - grid[j - 1] < grid[j] - want)) --j;
    ix[i] = j;
  }
  for (size_t i = 1; i < ix.size(); ++i)  // distinct and ascending
    if (ix[i] <= ix[i - 1]) ix[i] = ix[i - 1] + 1;
  if (ix.back() >= n) return {};
  auto values = [&](const std::vector<int>& x) {
    std::vector<int> p(x.size());
    for (size_t i = 0; i < x.size(); ++i) p[i] = grid[x[i]];
    return p;
  };
  double d = integer_levels_distortion(values(ix), step);
  for (bool improved = true; improved;) {
    improved = false;
    for (size_t i = 0; i < ix.size(); ++i)
      for (int delta : {-1, 1}) {
        std::vector<int> t = ix;
        t[i] += delta;
        if (t[i] < 0 || t[i] >= n || (i > 0 && t[i] <= t[i - 1]) || (i + 1 < t.size() && t[i] >= t[i + 1])) continue;
        const double dt = integer_levels_distortion(values(t), step);
        if (dt < d) {
          d = dt;
          ix = t;
          improved = true;
        }
      }
  }
  *dist = d;
  return values(ix);
}

// The search over steps for the grid values in [min_top, grid.back()] as the largest level, then the step
// refined for the chosen integers (the distortion is unimodal in the step near its optimum).
IntegerLevels search(int bits, const std::vector<int>& grid, double min_top) {
  const int k = 1 << (bits - 1);
  const LloydMax lm = lloyd_max_gaussian(bits);
  const std::vector<double> pos(lm.levels.begin() + k, lm.levels.end());
  const double top = pos.back();
  IntegerLevels best;
  best.bits = bits;
  best.max_level = grid.back();
  best.distortion = INFINITY;
  const int scan = 4000;
  // the largest level's value from the grid's largest down to min_top: linearly, or geometrically for a grid
  // that repeats per octave (min_top = half the largest: one octave)
  const double hi = grid.back();
  const bool octave = min_top * 2 == hi;
  for (int i = 0; i <= scan; ++i) {
    const double top_int = octave ? hi * std::pow(min_top / hi, (double)i / scan) : hi - (hi - min_top) * (double)i / scan;
    const double step = top / top_int;
    double d = 0;
    std::vector<int> p = descend(pos, step, grid, &d);
    if (!p.empty() && d < best.distortion) {
      best.distortion = d;
      best.step = step;
      best.levels = p;
    }
  }
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
}  // namespace

IntegerLevels integer_levels_gaussian(int bits, int max_level) {
  if (bits < 1 || bits > 4) throw std::invalid_argument("integer_levels_gaussian: bits must be 1..4");
  const int k = 1 << (bits - 1);
  if (max_level < k || max_level > 127)
    throw std::invalid_argument("integer_levels_gaussian: max_level must be in [2^(bits-1), 127]");
  std::vector<int> grid;
  for (int v = 1; v <= max_level; ++v) grid.push_back(v);
  return search(bits, grid, k);
}

IntegerLevels integer_levels_on_grid(int bits, LevelGrid grid) {
  if (bits < 1 || bits > 4) throw std::invalid_argument("integer_levels_on_grid: bits must be 1..4");
  const std::vector<int> g = level_grid_values(grid);
  // the significant-bit grids repeat per octave: the largest level within the top octave of the grid
  const bool per_octave = grid == LevelGrid::kThreeSignificantBits || grid == LevelGrid::kFourSignificantBits;
  return search(bits, g, per_octave ? g.back() / 2.0 : (double)g[(1 << (bits - 1)) - 1]);
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

double f16_bits_to_f64(unsigned short h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp((double)m, -24) : std::ldexp((double)(m | 1024), e - 25);
  return (h & 0x8000u) ? -v : v;
}

}  // namespace fmkv
