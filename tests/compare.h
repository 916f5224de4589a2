// Output comparison shared by every test driver (gtest harness, Metal emulator, CUDA programs).
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

namespace fmkv::test {

// ||a - b|| / ||b||; NaN or Inf anywhere gives +inf (poisoned outputs never pass).
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    den += (double)b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace fmkv::test
