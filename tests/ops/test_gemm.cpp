// GEMM and the linear layer: cpu vs ref over swept shapes and every transpose (forward, both
// gradients, beta = 0 / 1), finite differences of ref, the BLAS edge cases (C not read when
// beta = 0, K = 0), bad input, the probe, and `ops run`.
#include <cmath>
#include <limits>

#include "ops/dense_test_util.h"
#include "ops/gemm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

// Stored shape of an operand whose op() is [rows, cols].
OwnedTensor operand(int64_t rows, int64_t cols, bool trans, uint64_t seed) {
  return trans ? randn({cols, rows}, seed) : randn({rows, cols}, seed);
}

struct GemmOut {
  OwnedTensor c, da, db;
};

// Forward C = alpha op(A) op(B) + beta C0, then backward with da written and db accumulated onto
// db0, all in `dt` (F64 -> ref, F32 -> cpu).
GemmOut run(const Tensor& a64, const Tensor& b64, const Tensor& c64, const Tensor& dc64,
            const Tensor& db64, bool ta, bool tb, double alpha, double beta, DType dt) {
  OwnedTensor a = convert(a64, dt), b = convert(b64, dt), dc = convert(dc64, dt);
  GemmOut o{convert(c64, dt), OwnedTensor::zeros(dt, a64.shape()), convert(db64, dt)};
  gemm({a, b, o.c, ta, tb, alpha, beta});
  gemm_backward({a, b, dc, o.da, o.db, ta, tb, alpha, false, true});
  return o;
}

class GemmSweep
    : public ::testing::TestWithParam<std::tuple<std::tuple<int, int, int>, bool, bool, double>> {};

TEST_P(GemmSweep, CpuMatchesRef) {
  auto [mnk, ta, tb, beta] = GetParam();
  auto [M, N, K] = mnk;
  const double alpha = 0.75;
  auto a = testing::rounded(operand(M, K, ta, 1), DType::F32);
  auto b = testing::rounded(operand(K, N, tb, 2), DType::F32);
  auto c = testing::rounded(randn({M, N}, 3), DType::F32);
  auto dc = testing::rounded(randn({M, N}, 4), DType::F32);
  auto db_init = testing::rounded(tb ? randn({N, K}, 5) : randn({K, N}, 5), DType::F32);
  GemmOut ref = run(a, b, c, dc, db_init, ta, tb, alpha, beta, DType::F64);
  GemmOut cpu = run(a, b, c, dc, db_init, ta, tb, alpha, beta, DType::F32);
  // fp32 dot products of length K against fp64: a few ulps times sqrt(K) relative.
  testing::expect_close(cpu.c, ref.c, 2e-6, "c");
  testing::expect_close(cpu.da, ref.da, 2e-6, "da");
  testing::expect_close(cpu.db, ref.db, 2e-6, "db");
}

std::string gemm_case_name(
    const ::testing::TestParamInfo<std::tuple<std::tuple<int, int, int>, bool, bool, double>>&
        info) {
  const auto& p = info.param;
  const auto& mnk = std::get<0>(p);
  return fmt::format("M{}_N{}_K{}_{}{}_beta{}", std::get<0>(mnk), std::get<1>(mnk),
                     std::get<2>(mnk), std::get<1>(p) ? "T" : "N", std::get<2>(p) ? "T" : "N",
                     static_cast<int>(std::get<3>(p)));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmSweep,
    ::testing::Combine(::testing::Values(std::tuple{1, 1, 1}, std::tuple{1, 9, 33},
                                         std::tuple{7, 1, 5}, std::tuple{13, 11, 1},
                                         std::tuple{33, 65, 17}, std::tuple{64, 48, 129}),
                       ::testing::Bool(), ::testing::Bool(), ::testing::Values(0.0, 1.0)),
    gemm_case_name);

TEST(Gemm, BetaZeroDoesNotReadC) {
  for (DType dt : {DType::F64, DType::F32}) {
    auto a = convert(randn({5, 7}, 10), dt), b = convert(randn({7, 3}, 11), dt);
    std::vector<double> nans(15, std::numeric_limits<double>::quiet_NaN());
    auto c = from_f64(nans, dt, {5, 3});
    gemm({a, b, c, false, false, 1.0, 0.0});
    auto ref = OwnedTensor::zeros(DType::F64, {5, 3});
    gemm({convert(a, DType::F64), convert(b, DType::F64), ref, false, false, 1.0, 0.0});
    testing::expect_close(c, ref, 1e-6, std::string("c, dtype ") + std::string(dtype_name(dt)));
  }
}

TEST(Gemm, EmptyInnerDimensionScalesC) {
  for (DType dt : {DType::F64, DType::F32}) {
    auto a = OwnedTensor::zeros(dt, {4, 0}), b = OwnedTensor::zeros(dt, {0, 3});
    auto c0 = randn({4, 3}, 12);
    auto c = convert(c0, dt);
    gemm({a, b, c, false, false, 1.0, 0.5});
    auto got = to_f64_vector(c), want = to_f64_vector(c0);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], 0.5 * want[i], 1e-6 * std::abs(want[i])) << i;
    gemm({a, b, c, false, false, 1.0, 0.0});
    for (double x : to_f64_vector(c)) EXPECT_EQ(x, 0.0);
  }
}

TEST(Gemm, RefGradientsMatchFiniteDifferences) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int64_t M = 3, N = 4, K = 5;
      auto a = operand(M, K, ta, 20), b = operand(K, N, tb, 21);
      auto c0 = randn({M, N}, 22), up = randn({M, N}, 23);  // loss = sum(up * C)
      auto da = OwnedTensor::zeros(DType::F64, a.view().shape());
      auto db = OwnedTensor::zeros(DType::F64, b.view().shape());
      gemm_backward({a, b, up, da, db, ta, tb, 0.75, false, false});
      auto loss = [&] {
        auto c = convert(c0, DType::F64);
        gemm({a, b, c, ta, tb, 0.75, 0.5});
        return testing::dot(c, up);
      };
      EXPECT_LE(testing::fd_check(loss, a, da), 1e-8) << "da, ta=" << ta << " tb=" << tb;
      EXPECT_LE(testing::fd_check(loss, b, db), 1e-8) << "db, ta=" << ta << " tb=" << tb;
    }
  }
}

TEST(Gemm, BackwardAccumulatesWhenAsked) {
  auto a = randn({6, 4}, 30), b = randn({4, 5}, 31), dc = randn({6, 5}, 32);
  auto da1 = OwnedTensor::zeros(DType::F64, {6, 4}), db1 = OwnedTensor::zeros(DType::F64, {4, 5});
  gemm_backward({a, b, dc, da1, db1, false, false, 1.0, false, false});
  auto da2 = convert(da1, DType::F64), db2 = convert(db1, DType::F64);
  gemm_backward({a, b, dc, da2, db2, false, false, 1.0, true, true});
  auto x1 = to_f64_vector(da1), x2 = to_f64_vector(da2);
  for (size_t i = 0; i < x1.size(); ++i) EXPECT_DOUBLE_EQ(x2[i], 2 * x1[i]);
  auto y1 = to_f64_vector(db1), y2 = to_f64_vector(db2);
  for (size_t i = 0; i < y1.size(); ++i) EXPECT_DOUBLE_EQ(y2[i], 2 * y1[i]);
  // And "=" overwrites whatever was there.
  gemm_backward({a, b, dc, da2, Tensor(), false, false, 1.0, false, false});
  x2 = to_f64_vector(da2);
  for (size_t i = 0; i < x1.size(); ++i) EXPECT_DOUBLE_EQ(x2[i], x1[i]);
}

// The linear layer: y = x W^T, dx = dy W (= or +=), dW += dy^T x; cpu vs ref and vs FD.
struct LinOut {
  OwnedTensor y, dx, dw;
};
LinOut run_linear(const Tensor& x64, const Tensor& w64, const Tensor& dy64, const Tensor& dw0,
                  DType dt) {
  OwnedTensor x = convert(x64, dt), w = convert(w64, dt), dy = convert(dy64, dt);
  LinOut o{OwnedTensor::zeros(dt, {x64.size(0), w64.size(0)}), OwnedTensor::zeros(dt, x64.shape()),
           convert(dw0, dt)};
  linear_forward({x, w, o.y});
  linear_backward({x, w, dy, o.dx, o.dw, false});
  return o;
}

TEST(Linear, CpuMatchesRefAndAccumulates) {
  for (auto [T, in, out] : {std::tuple{1, 16, 8}, std::tuple{37, 24, 40}, std::tuple{70, 65, 3}}) {
    auto x = testing::rounded(randn({T, in}, 40), DType::F32);
    auto w = testing::rounded(randn({out, in}, 41, 0.1), DType::F32);
    auto dy = testing::rounded(randn({T, out}, 42), DType::F32);
    auto dw0 = testing::rounded(randn({out, in}, 43), DType::F32);
    LinOut ref = run_linear(x, w, dy, dw0, DType::F64);
    LinOut cpu = run_linear(x, w, dy, dw0, DType::F32);
    testing::expect_close(cpu.y, ref.y, 2e-6, "y");
    testing::expect_close(cpu.dx, ref.dx, 2e-6, "dx");
    testing::expect_close(cpu.dw, ref.dw, 2e-6, "dw");
    // ref against the definition, element by element: y[t][o] = sum_i x[t][i] w[o][i].
    auto xv = to_f64_vector(x), wv = to_f64_vector(w), yv = to_f64_vector(ref.y);
    for (int64_t t = 0; t < T; t += 7) {
      for (int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (int64_t i = 0; i < in; ++i) s += xv[t * in + i] * wv[o * in + i];
        EXPECT_NEAR(yv[t * out + o], s, 1e-12);
      }
    }
  }
  // dx += with accumulate_dx (x feeding two projections).
  auto x = randn({5, 6}, 44), w1 = randn({3, 6}, 45), w2 = randn({4, 6}, 46);
  auto dy1 = randn({5, 3}, 47), dy2 = randn({5, 4}, 48);
  auto dx = OwnedTensor::zeros(DType::F64, {5, 6}), dxa = OwnedTensor::zeros(DType::F64, {5, 6});
  auto dxb = OwnedTensor::zeros(DType::F64, {5, 6});
  linear_backward({x, w1, dy1, dx, Tensor(), false});
  linear_backward({x, w2, dy2, dx, Tensor(), true});
  linear_backward({x, w1, dy1, dxa, Tensor(), false});
  linear_backward({x, w2, dy2, dxb, Tensor(), false});
  auto s = to_f64_vector(dx), sa = to_f64_vector(dxa), sb = to_f64_vector(dxb);
  for (size_t i = 0; i < s.size(); ++i) EXPECT_NEAR(s[i], sa[i] + sb[i], 1e-12);
}

TEST(Linear, RefGradientsMatchFiniteDifferences) {
  const int64_t T = 4, in = 5, out = 3;
  auto x = randn({T, in}, 50), w = randn({out, in}, 51), up = randn({T, out}, 52);
  auto dx = OwnedTensor::zeros(DType::F64, {T, in}), dw = OwnedTensor::zeros(DType::F64, {out, in});
  linear_backward({x, w, up, dx, dw, false});
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {T, out});
    linear_forward({x, w, y});
    return testing::dot(y, up);
  };
  EXPECT_LE(testing::fd_check(loss, x, dx), 1e-8);
  EXPECT_LE(testing::fd_check(loss, w, dw), 1e-8);
}

TEST(Gemm, BadInputIsAClearError) {
  auto a = OwnedTensor::zeros(DType::F32, {2, 4});
  auto b = OwnedTensor::zeros(DType::F32, {5, 3});
  auto c = OwnedTensor::zeros(DType::F32, {2, 3});
  testing::expect_error(
      [&] {
        gemm({a, b, c, false, false, 1.0, 0.0});
      },
      "gemm: tensor 'b' has shape [5, 3], expected [4, *]");
  auto bt = OwnedTensor::zeros(DType::F32, {3, 5});
  testing::expect_error(
      [&] {
        gemm({a, bt, c, false, true, 1.0, 0.0});
      },
      "gemm: tensor 'b' has shape [3, 5], expected [*, 4]");
  auto b_ok = OwnedTensor::zeros(DType::F32, {4, 3});
  auto c_bad = OwnedTensor::zeros(DType::F32, {3, 2});
  testing::expect_error(
      [&] {
        gemm({a, b_ok, c_bad, false, false, 1.0, 0.0});
      },
      "gemm: tensor 'c' has shape [3, 2], expected [2, 3]");
  auto b64 = OwnedTensor::zeros(DType::F64, {4, 3});
  testing::expect_error(
      [&] {
        gemm({a, b64, c, false, false, 1.0, 0.0});
      },
      "gemm: tensor 'b' has dtype F64, expected F32");
  auto a3 = OwnedTensor::zeros(DType::F32, {2, 2, 2});
  testing::expect_error(
      [&] {
        gemm({a3, b_ok, c, false, false, 1.0, 0.0});
      },
      "gemm: tensor 'a' has shape [2, 2, 2], expected [*, *]");
  testing::expect_error(
      [&] {
        gemm({a, b_ok, c, false, false, std::numeric_limits<double>::infinity(), 0.0});
      },
      "alpha and beta must be finite");
  auto dc_bad = OwnedTensor::zeros(DType::F32, {2, 4});
  testing::expect_error(
      [&] {
        gemm_backward({a, b_ok, dc_bad, Tensor(), Tensor(), false, false, 1.0, false, false});
      },
      "gemm: tensor 'dc' has shape [2, 4], expected [2, 3]");
  // The linear layer names its own tensors.
  auto x = OwnedTensor::zeros(DType::F32, {6, 4});
  auto w = OwnedTensor::zeros(DType::F32, {3, 5});
  auto y = OwnedTensor::zeros(DType::F32, {6, 3});
  testing::expect_error(
      [&] {
        linear_forward({x, w, y});
      },
      "linear: tensor 'w' has shape [3, 5], expected [*, 4]");
  auto w_ok = OwnedTensor::zeros(DType::F32, {3, 4});
  auto dy = OwnedTensor::zeros(DType::F32, {5, 3});
  testing::expect_error(
      [&] {
        linear_backward({x, w_ok, dy, Tensor(), Tensor(), false});
      },
      "linear: tensor 'dy' has shape [5, 3], expected [6, 3]");
  auto dw_bad = OwnedTensor::zeros(DType::F32, {4, 3});
  auto dy_ok = OwnedTensor::zeros(DType::F32, {6, 3});
  testing::expect_error(
      [&] {
        linear_backward({x, w_ok, dy_ok, Tensor(), dw_bad, false});
      },
      "linear: tensor 'dw' has shape [4, 3], expected [3, 4]");
}

// The registered probe accepts cpu.openblas and rejects a gemm that ignores beta.
void gemm_ignoring_beta(const GemmArgs& g) {
  GemmArgs h = g;
  h.beta = 0.0;
  Registry::global().table<GemmTable>("gemm", OpQuery{Backend::Cpu, "", {}}).gemm(h);
}
const GemmTable kBroken{gemm_ignoring_beta};

TEST(Gemm, ProbeAcceptsCpuAndRejectsABrokenGemm) {
  const Resolution& r = Registry::global().resolve("gemm", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.openblas");
  EXPECT_LE(r.error.fwd, 1e-6);
  EXPECT_LE(r.error.bwd, 1e-6);
  const OpDesc& op = Registry::global().op("gemm");
  ImplDesc bad{"gemm", "cpu.broken", Backend::Cpu, 0, nullptr, &kBroken};
  ProbeError e = op.probe(bad, OpQuery{Backend::Cpu, "", {}});
  EXPECT_GT(e.fwd, op.tolerance(DType::F32).fwd);
  EXPECT_GT(e.bwd, op.tolerance(DType::F32).bwd);
}

TEST(Gemm, OpsRunFromFile) {
  auto a = testing::rounded(randn({5, 7}, 60), DType::F32);
  auto b = testing::rounded(randn({3, 7}, 61), DType::F32);  // trans_b: b is [N, K]
  auto c = testing::rounded(randn({5, 3}, 62), DType::F32);
  auto dc = testing::rounded(randn({5, 3}, 63), DType::F32);
  auto out =
      testing::run_op_via_file("gemm", Backend::Cpu, {{"a", a}, {"b", b}, {"c", c}, {"dc", dc}},
                               true, {{"trans_b", 1}, {"beta", 1}, {"alpha", 2}});
  ASSERT_TRUE(out.contains("c") && out.contains("da") && out.contains("db"));
  auto c_ref = convert(c, DType::F64);
  auto da_ref = OwnedTensor::zeros(DType::F64, {5, 7}),
       db_ref = OwnedTensor::zeros(DType::F64, {3, 7});
  gemm({a, b, c_ref, false, true, 2.0, 1.0});
  gemm_backward({a, b, dc, da_ref, db_ref, false, true, 2.0, false, false});
  testing::expect_close(out.at("c"), c_ref, 2e-6, "c");
  testing::expect_close(out.at("da"), da_ref, 2e-6, "da");
  testing::expect_close(out.at("db"), db_ref, 2e-6, "db");
}

}  // namespace
}  // namespace gdn::ops
