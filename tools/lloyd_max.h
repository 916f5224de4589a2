// Lloyd-Max scalar quantizers for N(0,1), computed from the Gaussian density (Lloyd iteration).
// The single source of fmkv's codebooks: tools/gen_codebooks.cpp emits them for every backend.
#pragma once
#include <vector>

namespace fmkv {

struct LloydMax {
  int bits = 0;
  std::vector<double> levels;      // 2^bits levels, ascending, symmetric about 0
  std::vector<double> thresholds;  // 2^bits - 1 midpoints between adjacent levels
  double distortion = 0;           // E[(X - Q(X))^2] for X ~ N(0,1)
  int iterations = 0;
};

// Lloyd iteration to a fixed point (levels change < 1e-15), bits in [1, 8].
LloydMax lloyd_max_gaussian(int bits);

// Mean squared error of the quantizer with the given ascending levels and thresholds, X ~ N(0,1).
double gaussian_distortion(const std::vector<double>& levels, const std::vector<double>& thresholds);

// double -> fp16 bits with a single round-to-nearest-even (no double rounding through float).
unsigned short f64_to_f16_bits(double v);

}  // namespace fmkv
