// RMSNorm: cpu vs ref over swept shapes, finite-difference checks of ref, bad input.
#include <algorithm>

#include "ops/rmsnorm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

struct NormOut {
  OwnedTensor y, rstd, dx, dw;
};

// Runs forward + backward on tensors of `dt` (F64 -> ref, F32 -> cpu).
NormOut run(const Tensor& x64, const Tensor& w64, const Tensor& dy64, bool zc, DType dt) {
  const int64_t R = x64.size(0), D = x64.size(1);
  OwnedTensor x = convert(x64, dt), w = convert(w64, dt), dy = convert(dy64, dt);
  DType st = rmsnorm_stat_dtype(dt);
  NormOut o{OwnedTensor::zeros(dt, {R, D}), OwnedTensor::zeros(st, {R}),
            OwnedTensor::zeros(dt, {R, D}), OwnedTensor::zeros(st, {D})};
  rmsnorm_forward({x, w, o.y, o.rstd, 1e-6, zc});
  rmsnorm_backward({x, w, o.rstd, dy, o.dx, o.dw, zc});
  return o;
}

class RmsNormSweep : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, bool>> {};

TEST_P(RmsNormSweep, CpuMatchesRef) {
  auto [R, D, zc] = GetParam();
  auto x = testing::rounded(randn({R, D}, 1, 3.0), DType::F32);
  auto w = testing::rounded(randn({D}, 2, 0.2, zc ? 0.0 : 1.0), DType::F32);
  auto dy = testing::rounded(randn({R, D}, 3), DType::F32);
  NormOut ref = run(x, w, dy, zc, DType::F64);
  NormOut cpu = run(x, w, dy, zc, DType::F32);
  testing::expect_close(cpu.y, ref.y, 2e-6, "y");
  testing::expect_close(cpu.rstd, ref.rstd, 2e-6, "rstd");
  // dx cancels to ~0 when D = 1 (xhat = +-1): measure it against the scale of r * dy.
  auto r = to_f64_vector(ref.rstd);
  double rmax = *std::max_element(r.begin(), r.end());
  testing::expect_close(cpu.dx, ref.dx, 5e-6, "dx", testing::l2(dy) * rmax);
  testing::expect_close(cpu.dw, ref.dw, 5e-6, "dw");
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormSweep,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257),
                                            ::testing::Values(1, 7, 128, 1031), ::testing::Bool()));

TEST(RmsNorm, ZeroCentredDiffersFromPlain) {
  auto x = randn({4, 16}, 5);
  auto w = randn({16}, 6, 0.1);
  auto dy = randn({4, 16}, 7);
  NormOut a = run(x, w, dy, true, DType::F64);
  NormOut b = run(x, w, dy, false, DType::F64);
  EXPECT_GT(testing::rel_err(a.y, b.y), 1.0);  // (1+w) vs w with w ~ 0.1: very different
}

TEST(RmsNorm, RefGradientsMatchFiniteDifferences) {
  for (bool zc : {false, true}) {
    const int64_t R = 3, D = 9;
    auto x = randn({R, D}, 8);
    auto w = randn({D}, 9, 0.3, 1.0);
    auto up = randn({R, D}, 10);  // loss = sum(up * y)
    NormOut g = run(x, w, up, zc, DType::F64);
    auto loss = [&] {
      auto y = OwnedTensor::zeros(DType::F64, {R, D});
      auto r = OwnedTensor::zeros(DType::F64, {R});
      rmsnorm_forward({x, w, y, r, 1e-6, zc});
      return testing::dot(y, up);
    };
    EXPECT_LE(testing::fd_check(loss, x, g.dx), 1e-7) << "dx, zero_centred=" << zc;
    EXPECT_LE(testing::fd_check(loss, w, g.dw), 1e-7) << "dw, zero_centred=" << zc;
  }
}

TEST(RmsNorm, BackwardAccumulatesDw) {
  auto x = randn({5, 8}, 11);
  auto w = randn({8}, 12);
  auto dy = randn({5, 8}, 13);
  NormOut once = run(x, w, dy, false, DType::F32);
  auto dw = convert(once.dw, DType::F32);  // start from the first result and add again
  auto dx = OwnedTensor::zeros(DType::F32, {5, 8});
  auto xf = convert(x, DType::F32), wf = convert(w, DType::F32), dyf = convert(dy, DType::F32);
  rmsnorm_backward({xf, wf, once.rstd, dyf, dx, dw, false});
  auto a = to_f64_vector(dw), b = to_f64_vector(once.dw);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], 2 * b[i], 1e-5 * (1 + std::abs(b[i])));
}

TEST(RmsNorm, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::F32, {4, 8});
  auto w = OwnedTensor::zeros(DType::F32, {5});
  auto y = OwnedTensor::zeros(DType::F32, {4, 8});
  auto r = OwnedTensor::zeros(DType::F32, {4});
  try {
    rmsnorm_forward({x, w, y, r, 1e-6, false});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'w' has shape [5], expected [8]"),
              std::string::npos)
        << e.what();
  }
  auto w64 = OwnedTensor::zeros(DType::F64, {8});
  EXPECT_THROW(rmsnorm_forward({x, w64, y, r, 1e-6, false}), Error);  // dtype mismatch
  auto rbad = OwnedTensor::zeros(DType::F32, {3});
  EXPECT_THROW(rmsnorm_forward({x, OwnedTensor::zeros(DType::F32, {8}), y, rbad, 1e-6, false}),
               Error);
  EXPECT_THROW(rmsnorm_forward({x, OwnedTensor::zeros(DType::F32, {8}), y, r, 0.0, false}), Error);
}

}  // namespace
}  // namespace gdn::ops
