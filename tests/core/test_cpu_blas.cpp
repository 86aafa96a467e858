// The CPU backend's BLAS door (backend/cpu/blas.h): the split GEMM against one call, degenerate
// shapes, and the choice of OpenBLAS kernel set on a CPU OpenBLAS does not recognise.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include <vector>

#include "backend/cpu/blas.h"
#include "gdn/core/rng.h"

namespace gdn::cpu {
namespace {

TEST(CpuBlas, BetterKernelSetOnlyWhenOpenBlasFellBackToPrescott) {
  EXPECT_EQ(better_openblas_core(nullptr, "Prescott", true, false), "Haswell");
  EXPECT_EQ(better_openblas_core(nullptr, "Prescott", true, true), "SkylakeX");
  EXPECT_EQ(better_openblas_core(nullptr, "Prescott", false, false), std::nullopt);
  EXPECT_EQ(better_openblas_core(nullptr, "Haswell", true, true), std::nullopt);      // recognised
  EXPECT_EQ(better_openblas_core("Prescott", "Prescott", true, true), std::nullopt);  // user's
}

// A product large enough to be split over the threads equals the same product computed in one
// call per 16-row group with the same grouping, and the fp64 sum to fp32 rounding.
TEST(CpuBlas, SplitGemmMatchesTheProduct) {
  init_runtime();
  const int64_t m = 301, n = 257, k = 129;
  ASSERT_GE(m * n * k, kSplitFlops);
  std::vector<float> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(k * n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(rng::normal(1, 1, i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(rng::normal(2, 1, i));
  std::vector<float> c(static_cast<size_t>(m * n), 7.0f);
  gemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  double num = 0, den = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += double(a[i * k + p]) * double(b[p * n + j]);
      num += (c[i * n + j] - s) * (c[i * n + j] - s);
      den += s * s;
    }
  EXPECT_LT(std::sqrt(num / den), 1e-6);
  // The same call again: bitwise the same (the partition depends only on the sizes and threads).
  std::vector<float> c2(c.size(), -1.0f);
  gemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c2.data(), n);
  EXPECT_EQ(c, c2);
}

TEST(CpuBlas, DegenerateShapesNeverReachBlas) {
  std::vector<float> c = {1, 2, 3, 4};
  gemm(false, false, 2, 2, 0, 1.0f, nullptr, 0, nullptr, 2, 0.5f, c.data(), 2);  // C = beta C
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1, 1.5f, 2}));
  gemm(false, false, 2, 2, 0, 1.0f, nullptr, 0, nullptr, 2, 0.0f, c.data(), 2);  // beta 0: zeros
  EXPECT_EQ(c, (std::vector<float>{0, 0, 0, 0}));
  gemm(false, false, 0, 2, 3, 1.0f, nullptr, 3, nullptr, 2, 0.0f, nullptr, 2);  // empty output
}

}  // namespace
}  // namespace gdn::cpu
