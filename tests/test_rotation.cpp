#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/rotation.h"
#include "ref/quantize.h"

namespace {

TEST(Rotation, SignGeneratorIsSplitmix64) {
  // splitmix64 from state 0: first output 0xE220A8397B1DCDAF (Vigna's reference implementation).
  uint64_t st = 0;
  EXPECT_EQ(fmkv::splitmix64_next(&st), 0xE220A8397B1DCDAFull);
  uint64_t w[2];
  fmkv::rotation_sign_words(0, 0, 128, w);
  EXPECT_EQ(w[0], 0xE220A8397B1DCDAFull);
  uint64_t w1[2];
  fmkv::rotation_sign_words(0, 1, 128, w1);
  EXPECT_NE(w1[0], w[0]);
}

TEST(Rotation, OrthonormalAndInvertible) {
  std::mt19937_64 r(std::random_device{}());
  std::normal_distribution<double> nd;
  for (int d : {64, 128, 256}) {
    auto sw = fmkv::ref::sign_words(r(), (int)(r() % 100), d);
    // Columns of R: rotate unit vectors; check R^T R = I to 1e-12.
    std::vector<std::vector<double>> cols(d, std::vector<double>(d));
    for (int i = 0; i < d; ++i) {
      std::vector<double> e(d, 0.0);
      e[i] = 1;
      fmkv::ref::rotate_f64(e.data(), d, sw.data(), cols[i].data());
    }
    double worst = 0;
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) {
        double dot = 0;
        for (int k = 0; k < d; ++k) dot += cols[i][k] * cols[j][k];
        worst = std::max(worst, std::fabs(dot - (i == j)));
      }
    EXPECT_LT(worst, 1e-12) << d;
    std::vector<double> x(d), y(d), z(d);
    for (auto& v : x) v = nd(r);
    fmkv::ref::rotate_f64(x.data(), d, sw.data(), y.data());
    fmkv::ref::unrotate_f64(y.data(), d, sw.data(), z.data());
    for (int i = 0; i < d; ++i) EXPECT_NEAR(z[i], x[i], 1e-12);
    // float32 rotation agrees with the float64 one to float rounding.
    std::vector<float> xf(d), yf(d);
    for (int i = 0; i < d; ++i) xf[i] = (float)x[i];
    fmkv::ref::rotate(xf.data(), d, sw.data(), yf.data());
    for (int i = 0; i < d; ++i) EXPECT_NEAR(yf[i], y[i], 1e-5 * (1 + std::fabs(y[i])));
  }
}

}  // namespace
