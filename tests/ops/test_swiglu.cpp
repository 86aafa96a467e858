// SwiGLU: cpu vs ref over swept shapes (forward and both gradients), saturated gates, in-place
// backward, finite differences of ref, bad input, the probe and `ops run`.
#include <cmath>
#include <cstring>

#include "ops/dense_test_util.h"
#include "ops/swiglu/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

struct SwOut {
  OwnedTensor y, dgate, dup;
};

SwOut run(const Tensor& g64, const Tensor& u64, const Tensor& dy64, DType dt) {
  OwnedTensor g = convert(g64, dt), u = convert(u64, dt), dy = convert(dy64, dt);
  SwOut o{OwnedTensor::zeros(dt, g64.shape()), OwnedTensor::zeros(dt, g64.shape()),
          OwnedTensor::zeros(dt, g64.shape())};
  swiglu_forward({g, u, o.y});
  swiglu_backward({g, u, dy, o.dgate, o.dup});
  return o;
}

class SwigluSweep : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(SwigluSweep, CpuMatchesRef) {
  auto [R, I] = GetParam();
  auto g = testing::rounded(randn({R, I}, 1, 4.0), DType::F32);  // reaches both sigmoid tails
  auto u = testing::rounded(randn({R, I}, 2), DType::F32);
  auto dy = testing::rounded(randn({R, I}, 3), DType::F32);
  SwOut ref = run(g, u, dy, DType::F64);
  SwOut cpu = run(g, u, dy, DType::F32);
  testing::expect_close(cpu.y, ref.y, 1e-6, "y");
  testing::expect_close(cpu.dgate, ref.dgate, 1e-6, "dgate");
  testing::expect_close(cpu.dup, ref.dup, 1e-6, "dup");
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluSweep,
                         ::testing::Combine(::testing::Values(1, 3, 64),
                                            ::testing::Values(1, 7, 1031)));

TEST(Swiglu, SaturatedGatesStayFiniteAndAccurate) {
  std::vector<double> gv = {-1000, -100, -88.8, -50, -20, -1e-3, 0, 1e-3, 20, 50, 88.8, 100, 1000};
  const int64_t n = static_cast<int64_t>(gv.size());
  auto g = from_f64(gv, DType::F64, {1, n});
  auto u = testing::rounded(randn({1, n}, 4), DType::F32);
  auto dy = testing::rounded(randn({1, n}, 5), DType::F32);
  SwOut ref = run(g, u, dy, DType::F64);
  SwOut cpu = run(g, u, dy, DType::F32);
  auto y = to_f64_vector(cpu.y), yr = to_f64_vector(ref.y);
  auto dg = to_f64_vector(cpu.dgate), dgr = to_f64_vector(ref.dgate);
  auto du = to_f64_vector(cpu.dup), dur = to_f64_vector(ref.dup);
  for (int64_t i = 0; i < n; ++i) {
    // Per element: fp32 rounding of each term, relative to the element's own scale.
    EXPECT_NEAR(y[i], yr[i], 1e-6 * (std::abs(yr[i]) + 1e-30)) << "y at gate " << gv[i];
    EXPECT_NEAR(dg[i], dgr[i], 1e-6 * (std::abs(dgr[i]) + 1e-30)) << "dgate at gate " << gv[i];
    EXPECT_NEAR(du[i], dur[i], 1e-6 * (std::abs(dur[i]) + 1e-30)) << "dup at gate " << gv[i];
  }
}

TEST(Swiglu, RefGradientsMatchFiniteDifferences) {
  const int64_t R = 3, I = 11;
  auto g = randn({R, I}, 6, 2.0), u = randn({R, I}, 7), up = randn({R, I}, 8);
  SwOut o = run(g, u, up, DType::F64);
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {R, I});
    swiglu_forward({g, u, y});
    return testing::dot(y, up);
  };
  EXPECT_LE(testing::fd_check(loss, g, o.dgate), 1e-8);
  EXPECT_LE(testing::fd_check(loss, u, o.dup), 1e-8);
}

TEST(Swiglu, InPlaceBackwardEqualsOutOfPlace) {
  for (DType dt : {DType::F64, DType::F32}) {
    auto g64 = randn({9, 33}, 9, 3.0), u64 = randn({9, 33}, 10), dy64 = randn({9, 33}, 11);
    SwOut o = run(g64, u64, dy64, dt);
    auto g = convert(g64, dt), u = convert(u64, dt), dy = convert(dy64, dt);
    swiglu_backward({g, u, dy, g, u});  // dgate over gate, dup over up
    EXPECT_EQ(std::memcmp(g.view().data(), o.dgate.view().data(), g.view().nbytes()), 0)
        << dtype_name(dt);
    EXPECT_EQ(std::memcmp(u.view().data(), o.dup.view().data(), u.view().nbytes()), 0)
        << dtype_name(dt);
  }
}

TEST(Swiglu, BadInputIsAClearError) {
  auto g = OwnedTensor::zeros(DType::F32, {4, 8});
  auto u = OwnedTensor::zeros(DType::F32, {4, 7});
  auto y = OwnedTensor::zeros(DType::F32, {4, 8});
  testing::expect_error(
      [&] {
        swiglu_forward({g, u, y});
      },
      "swiglu: tensor 'up' has shape [4, 7], expected [4, 8]");
  auto u_ok = OwnedTensor::zeros(DType::F32, {4, 8});
  auto y64 = OwnedTensor::zeros(DType::F64, {4, 8});
  testing::expect_error(
      [&] {
        swiglu_forward({g, u_ok, y64});
      },
      "swiglu: tensor 'y' has dtype F64, expected F32");
  auto dy = OwnedTensor::zeros(DType::F32, {4, 8});
  auto dg_bad = OwnedTensor::zeros(DType::F32, {8, 4});
  auto du = OwnedTensor::zeros(DType::F32, {4, 8});
  testing::expect_error(
      [&] {
        swiglu_backward({g, u_ok, dy, dg_bad, du});
      },
      "swiglu: tensor 'dgate' has shape [8, 4], expected [4, 8]");
  testing::expect_error(
      [&] {
        swiglu_backward({g, u_ok, dy, u_ok, du});
      },
      "swiglu: tensor 'dgate' may alias only 'gate', not 'up'");
  testing::expect_error(
      [&] {
        swiglu_backward({g, u_ok, dy, y, y});
      },
      "tensors 'dgate' and 'dup' must not share memory");
  auto g1 = OwnedTensor::zeros(DType::F32, {32});
  testing::expect_error(
      [&] {
        swiglu_forward({g1, u_ok, y});
      },
      "swiglu: tensor 'gate' has shape [32], expected [*, *]");
}

// A backward that forgets the sigmoid's derivative (dgate = dy * up * s) must be rejected.
void wrong_backward(const SwigluBwd& a) {
  const int64_t n = a.gate.numel();
  const float* g = a.gate.ptr<float>();  // [R, I]
  const float* u = a.up.ptr<float>();    // [R, I]
  const float* d = a.dy.ptr<float>();    // [R, I]
  float* dg = a.dgate.ptr<float>();      // [R, I]
  float* du = a.dup.ptr<float>();        // [R, I]
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i], ui = u[i], di = d[i];
    const float s = 1.0f / (1.0f + std::exp(-gi));
    du[i] = di * gi * s;
    dg[i] = di * ui * s;
  }
}
void cpu_forward(const SwigluFwd& a) {
  Registry::global().table<SwigluTable>("swiglu", OpQuery{Backend::Cpu, "", {}}).forward(a);
}
const SwigluTable kWrong{cpu_forward, wrong_backward};

TEST(Swiglu, ProbeAcceptsCpuAndRejectsAWrongGradient) {
  const Resolution& r = Registry::global().resolve("swiglu", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.elementwise");
  EXPECT_LE(r.error.fwd, 1e-6);
  EXPECT_LE(r.error.bwd, 1e-6);
  const OpDesc& op = Registry::global().op("swiglu");
  ProbeError e = op.probe({"swiglu", "cpu.wrong", Backend::Cpu, 0, nullptr, &kWrong},
                          OpQuery{Backend::Cpu, "", {}});
  EXPECT_LE(e.fwd, op.tolerance(DType::F32).fwd);
  EXPECT_GT(e.bwd, op.tolerance(DType::F32).bwd);
}

TEST(Swiglu, OpsRunFromFileFlattensLeadingDims) {
  auto g = testing::rounded(randn({2, 3, 5}, 12, 2.0), DType::F32);
  auto u = testing::rounded(randn({2, 3, 5}, 13), DType::F32);
  auto dy = testing::rounded(randn({2, 3, 5}, 14), DType::F32);
  auto out = testing::run_op_via_file("swiglu", Backend::Cpu, {{"gate", g}, {"up", u}, {"dy", dy}},
                                      true, {});
  SwOut ref = run(g.view().reshape({6, 5}), u.view().reshape({6, 5}), dy.view().reshape({6, 5}),
                  DType::F64);
  testing::expect_close(out.at("y"), ref.y, 1e-6, "y");
  testing::expect_close(out.at("dgate"), ref.dgate, 1e-6, "dgate");
  testing::expect_close(out.at("dup"), ref.dup, 1e-6, "dup");
}

}  // namespace
}  // namespace gdn::ops
