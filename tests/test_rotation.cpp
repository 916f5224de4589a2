#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "format/rotation.h"
#include "ref/quantize.h"

namespace {

TEST(Rotation, SignGeneratorIsSplitmix64) {
  // splitmix64 from state 0: outputs 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4 (Vigna's reference
  // implementation); words k = 0, 1 of (seed 0, layer 0).
  EXPECT_EQ(fmkv_rotation_sign_word(0, 0, 0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(fmkv_rotation_sign_word(0, 0, 1), 0x6E789E6AA1B965F4ull);
  // the layer mixes into the state: (seed ^ layer * 0xD6E8FEB86659FD93, layer 0) is (seed, layer)
  EXPECT_EQ(fmkv_rotation_sign_word(fmkv_rotation_state(5, 7), 0, 3), fmkv_rotation_sign_word(5, 7, 3));
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
    fmkv::rotate(xf.data(), d, sw.data(), yf.data());
    for (int i = 0; i < d; ++i) EXPECT_NEAR(yf[i], y[i], 1e-5 * (1 + std::fabs(y[i])));
  }
}

}  // namespace
