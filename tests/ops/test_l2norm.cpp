// L2 normalisation: cpu vs ref over swept shapes, finite-difference check of ref, the eps
// convention (inside the sqrt, added to the sum), written dx, bad input.
#include <gmock/gmock.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops/l2norm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using ::testing::HasSubstr;
using testing::randn;

struct L2Out {
  OwnedTensor y, rstd, dx;
};

// Runs forward + backward on tensors of `dt` (F64 -> ref, F32 -> cpu).
L2Out run(const Tensor& x64, const Tensor& dy64, DType dt, double eps = 1e-6) {
  const int64_t R = x64.size(0), D = x64.size(1);
  OwnedTensor x = convert(x64, dt), dy = convert(dy64, dt);
  L2Out o{OwnedTensor::zeros(dt, {R, D}), OwnedTensor::zeros(l2norm_stat_dtype(dt), {R}),
          OwnedTensor::zeros(dt, {R, D})};
  l2norm_forward({x, o.y, o.rstd, eps});
  l2norm_backward({o.y, o.rstd, dy, o.dx});
  return o;
}

// Rows with very different scales: row i is multiplied by 10^((i % 5) - 2), so sums of squares
// range from ~1e-4 to ~1e4 times D.
OwnedTensor scaled_rows(int64_t R, int64_t D, uint64_t seed) {
  auto v = to_f64_vector(randn({R, D}, seed));
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < D; ++j)
      v[static_cast<size_t>(i * D + j)] *= std::pow(10.0, static_cast<double>(i % 5) - 2.0);
  return from_f64(v, DType::F64, {R, D});
}

class L2NormSweep : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(L2NormSweep, CpuMatchesRef) {
  auto [R, D] = GetParam();
  auto x = testing::rounded(scaled_rows(R, D, 1), DType::F32);
  auto dy = testing::rounded(randn({R, D}, 2), DType::F32);
  L2Out ref = run(x, dy, DType::F64);
  L2Out cpu = run(x, dy, DType::F32);
  testing::expect_close(cpu.y, ref.y, 2e-6, "y");
  testing::expect_close(cpu.rstd, ref.rstd, 2e-6, "rstd");
  // dx cancels when D = 1 (y = +-1 up to eps, dx = r*dy*(1 - y^2)): measure it against r * dy.
  auto r = to_f64_vector(ref.rstd);
  const double rmax = *std::max_element(r.begin(), r.end());
  testing::expect_close(cpu.dx, ref.dx, 5e-6, "dx", testing::l2(dy) * rmax);
}

INSTANTIATE_TEST_SUITE_P(Shapes, L2NormSweep,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257),
                                            ::testing::Values(1, 7, 128, 129)));

TEST(L2Norm, RefGradientMatchesFiniteDifferences) {
  const int64_t R = 4, D = 9;
  auto x = randn({R, D}, 10);
  auto up = randn({R, D}, 11);  // loss = sum(up * y)
  L2Out g = run(x, up, DType::F64);
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {R, D});
    auto r = OwnedTensor::zeros(DType::F64, {R});
    l2norm_forward({x, y, r, 1e-6});
    return testing::dot(y, up);
  };
  EXPECT_LE(testing::fd_check(loss, x, g.dx), 1e-7) << "dx";
}

// With eps comparable to sum(x^2) the eps term changes the gradient: the backward formula from
// y and rstd must stay exact there (it is: d rstd / dx = -rstd^3 x holds with eps).
TEST(L2Norm, RefGradientExactWhenEpsMatters) {
  const int64_t R = 2, D = 5;
  auto x = randn({R, D}, 12, 3e-4);  // sum(x^2) ~ 5e-7 ~ eps
  auto up = randn({R, D}, 13);
  L2Out g = run(x, up, DType::F64);
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {R, D});
    auto r = OwnedTensor::zeros(DType::F64, {R});
    l2norm_forward({x, y, r, 1e-6});
    return testing::dot(y, up);
  };
  EXPECT_LE(testing::fd_check(loss, x, g.dx, 1e-9), 1e-8) << "dx";
}

// The FLA / HF convention: rstd = 1/sqrt(sum(x^2) + 1e-6), eps added to the sum inside the root.
TEST(L2Norm, EpsConventionMatchesFla) {
  std::vector<double> xv{3, 4, 0, 0, 1e-3, 0};  // rows: (3,4), (0,0), (1e-3,0)
  auto x = from_f64(xv, DType::F64, {3, 2});
  auto dy = randn({3, 2}, 14);
  for (DType dt : {DType::F64, DType::F32}) {
    L2Out o = run(x, dy, dt);
    auto r = to_f64_vector(o.rstd), y = to_f64_vector(o.y);
    const double tol = dt == DType::F64 ? 1e-15 : 1e-7;
    EXPECT_NEAR(r[0], 1.0 / std::sqrt(25.0 + 1e-6), tol * r[0]);
    EXPECT_NEAR(y[0], 3.0 / std::sqrt(25.0 + 1e-6), tol);
    EXPECT_NEAR(r[1], 1000.0, tol * 1000.0);  // all-zero row: 1/sqrt(eps), y = 0
    EXPECT_EQ(y[2], 0.0);
    EXPECT_EQ(y[3], 0.0);
    // sum = 1e-6 = eps: y = 1e-3 / sqrt(2e-6) = 1/sqrt(2), not 1 (F.normalize) and not
    // 1e-3/sqrt(1e-6/2 + 1e-6) (an eps added to the mean).
    EXPECT_NEAR(y[4], 1.0 / std::sqrt(2.0), 10 * tol);
  }
}

TEST(L2Norm, EpsAttributeIsUsed) {
  auto x = from_f64(std::vector<double>{1e-3, 0}, DType::F64, {1, 2});
  auto dy = randn({1, 2}, 15);
  L2Out o = run(x, dy, DType::F64, 3e-6);
  EXPECT_NEAR(to_f64_vector(o.rstd)[0], 1.0 / std::sqrt(4e-6), 1e-9);
}

// dx is written (=), not accumulated: backward into a garbage-filled dx gives the same result.
TEST(L2Norm, BackwardWritesDx) {
  auto x = randn({5, 8}, 16);
  auto dy = randn({5, 8}, 17);
  L2Out once = run(x, dy, DType::F32);
  auto dx = convert(from_f64(std::vector<double>(40, 7.0), DType::F64, {5, 8}), DType::F32);
  l2norm_backward({once.y, once.rstd, convert(dy, DType::F32), dx});
  testing::expect_close(dx, once.dx, 0.0, "dx written, not accumulated");
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(L2Norm, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::F32, {4, 8});
  auto y = OwnedTensor::zeros(DType::F32, {4, 8});
  auto r = OwnedTensor::zeros(DType::F32, {4});
  auto ybad = OwnedTensor::zeros(DType::F32, {4, 9});
  EXPECT_THAT(error_of([&] {
                l2norm_forward({x, ybad, r, 1e-6});
              }),
              HasSubstr("l2norm: tensor 'y' has shape [4, 9], expected [4, 8]"));
  auto r64 = OwnedTensor::zeros(DType::F64, {4});
  EXPECT_THAT(error_of([&] {
                l2norm_forward({x, y, r64, 1e-6});
              }),
              HasSubstr("tensor 'rstd' has dtype F64, expected F32"));
  auto x1 = OwnedTensor::zeros(DType::F32, {32});
  EXPECT_THAT(error_of([&] {
                l2norm_forward({x1, y, r, 1e-6});
              }),
              HasSubstr("tensor 'x' has shape [32], expected [*, *]"));
  EXPECT_THAT(error_of([&] { l2norm_forward({x, y, r, -1.0}); }), HasSubstr("eps"));

  auto dx = OwnedTensor::zeros(DType::F32, {4, 8});
  auto rbad = OwnedTensor::zeros(DType::F32, {5});
  EXPECT_THAT(error_of([&] {
                l2norm_backward({y, rbad, x, dx});
              }),
              HasSubstr("tensor 'rstd' has shape [5], expected [4]"));
  auto dy_bf16 = OwnedTensor::zeros(DType::BF16, {4, 8});
  EXPECT_THAT(error_of([&] {
                l2norm_backward({y, r, dy_bf16, dx});
              }),
              HasSubstr("tensor 'dy' has dtype BF16, expected F32"));
  EXPECT_THAT(error_of([&] {
                l2norm_backward({y, r, x, Tensor()});
              }),
              HasSubstr("tensor 'dx' is required"));
}

}  // namespace
}  // namespace gdn::ops
