// The building blocks of the unfused A/B routes (kernels.fused_* false, docs/TRAINING.md): silu,
// mul and cross_entropy. cpu vs ref (forward and gradients), finite differences of ref, in-place
// use, saturated inputs, bad input, the probe (and its rejection of a wrong gradient), `ops run`.
#include <cmath>
#include <cstring>

#include "ops/cross_entropy/op.h"
#include "ops/dense_test_util.h"
#include "ops/mul/op.h"
#include "ops/silu/op.h"
#include "ops/swiglu/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

// --- silu
struct SiluOut {
  OwnedTensor y, dx;
};
SiluOut run_silu(const Tensor& x64, const Tensor& dy64, DType dt) {
  OwnedTensor x = convert(x64, dt), dy = convert(dy64, dt);
  SiluOut o{OwnedTensor::zeros(dt, x64.shape()), OwnedTensor::zeros(dt, x64.shape())};
  silu_forward({x, o.y});
  silu_backward({x, dy, o.dx});
  return o;
}

TEST(Silu, CpuMatchesRefIncludingSaturatedInputs) {
  for (int64_t n : {1, 7, 1031, 70001}) {
    auto x = testing::rounded(randn({n}, 1, 5.0), DType::F32);
    auto xv = to_f64_vector(x);
    xv[0] = -1000;  // exp(-x) overflows: s = 0, silu = -0, never NaN
    if (n > 1) xv[1] = 100;
    auto xs = from_f64(xv, DType::F64, {n});
    auto dy = testing::rounded(randn({n}, 2), DType::F32);
    SiluOut ref = run_silu(xs, dy, DType::F64), cpu = run_silu(xs, dy, DType::F32);
    testing::expect_close(cpu.y, ref.y, 1e-6, "y");
    testing::expect_close(cpu.dx, ref.dx, 1e-6, "dx");
  }
}

TEST(Silu, RefGradientMatchesFiniteDifferencesAndInPlaceEqualsOutOfPlace) {
  auto x = randn({37}, 3, 2.0), w = randn({37}, 4);
  SiluOut o = run_silu(x, w, DType::F64);
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {37});
    silu_forward({x, y});
    return testing::dot(y, w);
  };
  EXPECT_LE(testing::fd_check(loss, x, o.dx), 1e-8);
  for (DType dt : {DType::F64, DType::F32}) {
    auto xd = convert(x, dt), dy = convert(w, dt);
    SiluOut ref = run_silu(x, w, dt);
    silu_backward({xd, dy, dy});  // dx over dy
    EXPECT_EQ(std::memcmp(dy.view().data(), ref.dx.view().data(), dy.view().nbytes()), 0);
    silu_forward({xd, xd});  // y over x
    EXPECT_EQ(std::memcmp(xd.view().data(), ref.y.view().data(), xd.view().nbytes()), 0);
  }
}

// silu is the swiglu op with up = 1: the cpu kernels give bitwise the same values (the unfused
// SwiGLU route relies on this for its bitwise cpu A/B, tests/train/test_fused_routes.cpp).
TEST(Silu, CpuEqualsSwigluWithUpOneBitwise) {
  const int64_t n = 4097;
  OwnedTensor x = convert(randn({1, n}, 12, 4.0), DType::F32),
              dy = convert(randn({1, n}, 13), DType::F32);
  std::vector<double> one(static_cast<size_t>(n), 1.0);
  OwnedTensor up = from_f64(one, DType::F32, {1, n});
  auto y = OwnedTensor::zeros(DType::F32, {1, n}), ys = OwnedTensor::zeros(DType::F32, {1, n});
  auto dx = OwnedTensor::zeros(DType::F32, {1, n}), dg = OwnedTensor::zeros(DType::F32, {1, n}),
       du = OwnedTensor::zeros(DType::F32, {1, n});
  silu_forward({x, y});
  silu_backward({x, dy, dx});
  swiglu_forward({x, up, ys});
  swiglu_backward({x, up, dy, dg, du});
  EXPECT_EQ(std::memcmp(y.view().data(), ys.view().data(), y.view().nbytes()), 0);
  EXPECT_EQ(std::memcmp(dx.view().data(), dg.view().data(), dx.view().nbytes()), 0);
}

// A wrong backward for the probe to reject.
void wrong_silu_backward(const SiluBwd& a) {  // forgets the x s (1 - s) term
  const float* x = a.x.ptr<float>();
  const float* dy = a.dy.ptr<float>();
  float* dx = a.dx.ptr<float>();
  for (int64_t i = 0; i < a.x.numel(); ++i) dx[i] = dy[i] / (1.0f + std::exp(-x[i]));
}
void cpu_silu_forward(const SiluFwd& a) {
  Registry::global().table<SiluTable>("silu", OpQuery{Backend::Cpu, "", {}}).forward(a);
}
const SiluTable kWrongSilu{cpu_silu_forward, wrong_silu_backward};

TEST(Silu, ProbeAcceptsCpuAndRejectsAWrongGradient) {
  const Resolution& r = Registry::global().resolve("silu", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.elementwise");
  const OpDesc& op = Registry::global().op("silu");
  EXPECT_LE(r.error.bwd, op.tolerance(DType::F32).bwd);
  ProbeError e = op.probe({"silu", "cpu.wrong", Backend::Cpu, 0, nullptr, &kWrongSilu},
                          OpQuery{Backend::Cpu, "", {}});
  EXPECT_LE(e.fwd, op.tolerance(DType::F32).fwd);
  EXPECT_GT(e.bwd, op.tolerance(DType::F32).bwd);
}

TEST(Silu, BadInputAndOpsRun) {
  auto x = OwnedTensor::zeros(DType::F32, {4, 8});
  auto y7 = OwnedTensor::zeros(DType::F32, {4, 7});
  auto y64 = OwnedTensor::zeros(DType::F64, {4, 8});
  testing::expect_error(
      [&] {
        silu_forward({x, y7});
      },
      "silu: tensor 'y' has 28 elements but 'x' has 32");
  testing::expect_error(
      [&] {
        silu_forward({x, y64});
      },
      "silu: tensor 'y' has dtype F64, expected F32");
  auto xs = testing::rounded(randn({3, 5}, 5), DType::F32);
  auto dy = testing::rounded(randn({3, 5}, 6), DType::F32);
  auto out = testing::run_op_via_file("silu", Backend::Cpu, {{"x", xs}, {"dy", dy}}, true, {});
  SiluOut ref = run_silu(xs, dy, DType::F64);
  testing::expect_close(out.at("y"), ref.y, 1e-6, "y");
  testing::expect_close(out.at("dx"), ref.dx, 1e-6, "dx");
}

// --- mul
TEST(Mul, CpuMatchesRefInPlaceAndBadInput) {
  for (int64_t n : {1, 9, 70001}) {
    auto a = testing::rounded(randn({n}, 7, 2.0), DType::F32);
    auto b = testing::rounded(randn({n}, 8), DType::F32);
    auto yr = OwnedTensor::zeros(DType::F64, {n});
    mul({a, b, yr});
    auto a32 = convert(a, DType::F32), b32 = convert(b, DType::F32);
    auto y = OwnedTensor::zeros(DType::F32, {n});
    mul({a32, b32, y});
    testing::expect_close(y, yr, 1e-7, "y");
    mul({a32, b32, b32});  // over b
    EXPECT_EQ(std::memcmp(b32.view().data(), y.view().data(), y.view().nbytes()), 0);
  }
  auto a = OwnedTensor::zeros(DType::F32, {4});
  auto b = OwnedTensor::zeros(DType::F64, {4});
  testing::expect_error([&] { mul({a, b, a}); }, "mul: tensor 'b' has dtype F64, expected F32");
  const Resolution& r = Registry::global().resolve("mul", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.loop");
  EXPECT_LE(r.error.fwd, 1e-7);
}

// --- cross_entropy
struct CeOut {
  OwnedTensor loss, lse, zl, dz;
};
CeOut run_ce(const Tensor& z64, const Tensor& y, DType dt, double lam, double c, bool grad = true) {
  const int64_t R = z64.size(0), V = z64.size(1);
  const DType st = cross_entropy_stat_dtype(dt);
  OwnedTensor z = convert(z64, dt);
  CeOut o{OwnedTensor::zeros(st, {R}), OwnedTensor::zeros(st, {R}), OwnedTensor::zeros(st, {R}),
          OwnedTensor::zeros(dt, {R, V})};
  cross_entropy({z, y, o.loss, o.lse, o.zl, grad ? o.dz.view() : Tensor(), lam, c});
  return o;
}

TEST(CrossEntropy, CpuMatchesRef) {
  for (auto [R, V] : {std::pair<int64_t, int64_t>{1, 1}, {5, 97}, {33, 1031}}) {
    auto z = testing::rounded(randn({R, V}, 9, 3.0), DType::F32);
    std::vector<int32_t> yv;
    for (int64_t i = 0; i < R; ++i)
      yv.push_back(i % 4 == 3 ? -100 : static_cast<int32_t>((i * 37) % V));
    auto y = testing::i32_tensor(yv);
    CeOut ref = run_ce(z, y, DType::F64, 1e-2, 0.25), cpu = run_ce(z, y, DType::F32, 1e-2, 0.25);
    testing::expect_close(cpu.loss, ref.loss, 1e-6, "loss");
    testing::expect_close(cpu.lse, ref.lse, 1e-6, "lse");
    testing::expect_close(cpu.zl, ref.zl, 1e-6, "z_loss");
    testing::expect_close(cpu.dz, ref.dz, 1e-6, "dlogits");
    auto l = to_f64_vector(cpu.loss), zl = to_f64_vector(cpu.zl), dz = to_f64_vector(cpu.dz);
    for (int64_t i = 0; i < R; ++i)
      if (yv[static_cast<size_t>(i)] == -100) {
        EXPECT_EQ(l[static_cast<size_t>(i)], 0.0);
        EXPECT_EQ(zl[static_cast<size_t>(i)], 0.0);
        for (int64_t j = 0; j < V; ++j) EXPECT_EQ(dz[static_cast<size_t>(i * V + j)], 0.0);
      }
  }
}

// A confident row (p_y ~ 1): the gradient at the target, p_y - 1 ~ -3 e^-30, is not lost.
TEST(CrossEntropy, ConfidentRowKeepsItsGradient) {
  std::vector<double> zv = {30, 0, 0, 0};
  auto z = from_f64(zv, DType::F64, {1, 4});
  auto y = testing::i32_tensor({0});
  CeOut cpu = run_ce(z, y, DType::F32, 0.0, 1.0);
  const double want = -3 * std::exp(-30.0) / (1 + 3 * std::exp(-30.0));
  // p_y - 1 formed as 1 - p_y in fp32 would be 0; expm1(z_y - lse) keeps it, to the relative
  // precision of z_y - lse (lse = 30 + 2.8e-13 carries double's ~4e-15 absolute error at 30).
  EXPECT_NEAR(to_f64_vector(cpu.dz)[0], want, 1e-2 * std::abs(want));
}

TEST(CrossEntropy, RefGradientMatchesFiniteDifferencesAndInPlace) {
  const int64_t R = 3, V = 11;
  auto z = randn({R, V}, 10, 2.0);
  auto y = testing::i32_tensor({4, -100, 10});
  const double lam = 0.1, c = 0.7;
  CeOut o = run_ce(z, y, DType::F64, lam, c);
  auto loss = [&] {
    CeOut f = run_ce(z, y, DType::F64, lam, c, false);
    double s = 0;
    for (double v : to_f64_vector(f.loss)) s += v;
    return c * s;
  };
  EXPECT_LE(testing::fd_check(loss, z, o.dz), 1e-8);
  for (DType dt : {DType::F64, DType::F32}) {
    CeOut ref = run_ce(z, y, dt, lam, c);
    OwnedTensor zd = convert(z, dt);
    const DType st = cross_entropy_stat_dtype(dt);
    auto l = OwnedTensor::zeros(st, {R}), s = OwnedTensor::zeros(st, {R}),
         q = OwnedTensor::zeros(st, {R});
    cross_entropy({zd, y, l, s, q, zd, lam, c});  // gradient over the logits
    EXPECT_EQ(std::memcmp(zd.view().data(), ref.dz.view().data(), zd.view().nbytes()), 0);
    EXPECT_EQ(std::memcmp(l.view().data(), ref.loss.view().data(), l.view().nbytes()), 0);
  }
}

void wrong_ce(const CrossEntropyArgs& a) {  // forgets the z-loss term of the gradient
  CrossEntropyArgs b = a;
  Registry::global()
      .table<CrossEntropyTable>("cross_entropy", OpQuery{Backend::Cpu, "", {}})
      .run(b);
  if (!a.dlogits.defined()) return;
  CrossEntropyArgs c = a;
  c.z_loss_scale = 0;
  OwnedTensor scratch = OwnedTensor::zeros(DType::F32, {a.logits.size(0)});
  c.loss = scratch;  // the real loss stays
  Registry::global()
      .table<CrossEntropyTable>("cross_entropy", OpQuery{Backend::Cpu, "", {}})
      .run(c);
}
const CrossEntropyTable kWrongCe{wrong_ce};

TEST(CrossEntropy, ProbeBadInputAndOpsRun) {
  const Resolution& r = Registry::global().resolve("cross_entropy", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.rows");
  const OpDesc& op = Registry::global().op("cross_entropy");
  EXPECT_LE(r.error.fwd, op.tolerance(DType::F32).fwd);
  EXPECT_LE(r.error.bwd, op.tolerance(DType::F32).bwd);
  ProbeError e = op.probe({"cross_entropy", "cpu.wrong", Backend::Cpu, 0, nullptr, &kWrongCe},
                          OpQuery{Backend::Cpu, "", {}});
  EXPECT_GT(e.bwd, op.tolerance(DType::F32).bwd);

  auto z = OwnedTensor::zeros(DType::F32, {2, 5});
  auto l = OwnedTensor::zeros(DType::F32, {2});
  auto bad = testing::i32_tensor({1, 5});
  testing::expect_error(
      [&] {
        cross_entropy({z, bad, l, l, l, Tensor(), 0, 1});
      },
      "cross_entropy: targets[1] = 5 is outside [0, 5)");
  auto ok = testing::i32_tensor({1, -100});
  auto l3 = OwnedTensor::zeros(DType::F32, {3});
  testing::expect_error(
      [&] {
        cross_entropy({z, ok, l3, l, l, Tensor(), 0, 1});
      },
      "cross_entropy: tensor 'loss' has shape [3], expected [2]");
  testing::expect_error(
      [&] {
        cross_entropy({z, ok, l, l, l, Tensor(), -1, 1});
      },
      "z_loss_scale must be finite and >= 0");

  auto zs = testing::rounded(randn({4, 9}, 11, 2.0), DType::F32);
  auto y = testing::i32_tensor({0, 8, -100, 3});
  auto out =
      testing::run_op_via_file("cross_entropy", Backend::Cpu, {{"logits", zs}, {"targets", y}},
                               true, {{"z_loss_scale", 1e-3}, {"grad_scale", 0.5}});
  CeOut ref = run_ce(zs, y, DType::F64, 1e-3, 0.5);
  testing::expect_close(out.at("loss"), ref.loss, 1e-6, "loss (ops run)");
  testing::expect_close(out.at("dlogits"), ref.dz, 1e-6, "dlogits (ops run)");
}

}  // namespace
}  // namespace gdn::ops
