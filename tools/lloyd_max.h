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

// Integer levels (a draft for format 3, not used by format 2): the 2^bits levels are step * L[i] with
// L[i] integers, |L[i]| <= max_level, symmetric about 0 (no zero level), thresholds at the midpoints.
// The step and the integers minimise the N(0,1) distortion: a scan of the step over the range where the
// largest level lies in [2^(bits-1), max_level], each step's integers from the rounded Lloyd-Max levels
// improved by +-1 moves until none lowers the distortion, then the step refined by a golden-section
// search for the best integers. The per-group scale absorbs the step, so a kernel sees only L.
struct IntegerLevels {
  int bits = 0, max_level = 0;
  std::vector<int> levels;  // 2^bits integers, ascending, levels[n-1-i] == -levels[i]
  double step = 0;          // the real levels are step * levels[i]
  double distortion = 0;    // E[(X - Q(X))^2], X ~ N(0,1), with step * levels and midpoint thresholds
};

// bits in [1, 4], max_level in [2^(bits-1), 127].
IntegerLevels integer_levels_gaussian(int bits, int max_level);

// Operand grids for format 3's decode paths (drafts, measured in docs/history/format3-prototypes.md): the
// positive levels restricted to
//  * kOddGrid: odd integers 1 .. 255, i.e. 2 T + 1 for an int8 T in [0, 127]: the negative level of T is its
//    bitwise complement ~T = -T - 1 (2 ~T + 1 = -(2 T + 1)), so a sign-magnitude code decodes to int8 by one
//    permute of the magnitude and one XOR with the sign mask; a dot product over T then needs + sum(q) / 2 per
//    group, a per-query constant;
//  * kThreeSignificantBits: integers with at most 3 significant bits, 1 .. 2^14 (1, 2, 3, 4, 5, 6, 7, 8, 10,
//    12, 14, 16, 20, ...): exactly the fp16 values whose low byte is zero, so an fp16 operand pair is one
//    permute of high bytes (the V side).
//  * kFourSignificantBits: at most 4 significant bits, 1 .. 2^14: fp16 values whose low byte is 0x00 or 0x80
//    (the third mantissa bit), the next-cheapest fp16 operand (4-bit V, where 3 bits miss the 1%).
// Same search as integer_levels_gaussian, with the +-1 moves to the neighbouring grid value. max_level in the
// result is the grid's largest value.
enum class LevelGrid { kInt8, kOddGrid, kThreeSignificantBits, kFourSignificantBits };
IntegerLevels integer_levels_on_grid(int bits, LevelGrid grid);
// The grid's positive values, ascending.
std::vector<int> level_grid_values(LevelGrid grid);

// Distortion of the symmetric quantizer step * {-p[k-1] .. -p[0], p[0] .. p[k-1]} (p ascending, > 0).
double integer_levels_distortion(const std::vector<int>& positive, double step);

// double -> fp16 bits with a single round-to-nearest-even (no double rounding through float).
unsigned short f64_to_f16_bits(double v);
// fp16 bits -> double (exact; finite values).
double f16_bits_to_f64(unsigned short h);

}  // namespace fmkv
