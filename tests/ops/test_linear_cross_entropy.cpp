// Linear cross-entropy: cpu vs ref over reductions x smoothing x z-loss x chunk plans (full-V,
// several row blocks, vocabulary slabs), a 50k vocabulary, ignored and all-ignored targets,
// upstream gradients, caller denominators, dW accumulation, confident rows (p_y ~ 1),
// finite-difference checks of ref (dx, dW, the z-loss gradient alone), the workspace bound,
// `ops run`, bad input.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "gdn/backend/op_run.h"
#include "gdn/core/env.h"
#include "gdn/core/safetensors.h"
#include "ops/linear_cross_entropy/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

struct Opts {
  LceReduction reduction = LceReduction::Mean;
  double lam = 0, eps = 0, den = -1;
  int64_t chunk_bytes = 0;
  const Tensor* dloss = nullptr;    // F64: [N] (none) or [1] (sum, mean)
  const Tensor* dw_init = nullptr;  // F64 [V, D]: dW starts from it (accumulation)
  DType target_dtype = DType::I64;
  bool backward = true;
  const Tensor* workspace = nullptr;
};

struct Out {
  OwnedTensor loss, lse, z, dx, dw;
};

OwnedTensor targets_tensor(const std::vector<int64_t>& t, DType dt) {
  OwnedTensor v = OwnedTensor::empty(DType::I64, {static_cast<int64_t>(t.size())});
  std::copy(t.begin(), t.end(), v.ptr<int64_t>());
  return convert(v, dt);
}

// Runs the op on tensors of `dt` (F64 -> ref, F32 -> cpu) through the public entry points.
Out run(const Tensor& x64, const Tensor& w64, const std::vector<int64_t>& targets, const Opts& o,
        DType dt) {
  const int64_t N = x64.size(0), D = x64.size(1), V = w64.size(0);
  const DType st = lce_stat_dtype(dt);
  const int64_t ln = o.reduction == LceReduction::None ? N : 1;
  OwnedTensor x = convert(x64, dt), w = convert(w64, dt);
  OwnedTensor t = targets_tensor(targets, o.target_dtype);
  Out out{OwnedTensor::zeros(st, {ln}), OwnedTensor::zeros(st, {N}), OwnedTensor::zeros(st, {ln}),
          OwnedTensor::zeros(dt, {N, D}),
          o.dw_init ? convert(*o.dw_init, st) : OwnedTensor::zeros(st, {V, D})};
  LinearCrossEntropyArgs a;
  a.x = x, a.w = w, a.targets = t, a.loss = out.loss, a.lse = out.lse, a.z_loss = out.z;
  a.reduction = o.reduction, a.z_loss_scale = o.lam, a.label_smoothing = o.eps;
  a.denominator = o.den, a.chunk_bytes = o.chunk_bytes;
  if (o.workspace) a.workspace = *o.workspace;
  OwnedTensor dl;
  if (!o.backward) {
    linear_cross_entropy_forward(a);
    return out;
  }
  if (o.dloss) {
    dl = convert(*o.dloss, st);
    a.dloss = dl;
  }
  a.dx = out.dx, a.dw = out.dw;
  linear_cross_entropy_forward_backward(a);
  return out;
}

// Targets in [0, V) with a few ignored rows.
std::vector<int64_t> make_targets(int64_t n, int64_t v, std::vector<int64_t> ignored = {2, 11}) {
  std::vector<int64_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = (i * 7919 + 5) % v;
  for (int64_t i : ignored)
    if (i < n) t[i] = kLceIgnoreIndex;
  return t;
}

// Relative L2 tolerances of fp32 vs fp64 at these sizes (measured errors are ~1e-7..1e-6).
constexpr double kTolFwd = 5e-7, kTolBwd = 5e-6;

void expect_match(const Out& cpu, const Out& ref, const std::string& what, bool backward = true) {
  testing::expect_close(cpu.loss, ref.loss, kTolFwd, what + " loss");
  testing::expect_close(cpu.lse, ref.lse, kTolFwd, what + " lse");
  // z_loss is exactly 0 with lambda = 0: the absolute scale guards the division.
  testing::expect_close(cpu.z, ref.z, kTolFwd, what + " z_loss", 1e-12);
  if (!backward) return;
  testing::expect_close(cpu.dx, ref.dx, kTolBwd, what + " dx");
  testing::expect_close(cpu.dw, ref.dw, kTolBwd, what + " dw");
}

const char* red_name(LceReduction r) {
  return r == LceReduction::Mean ? "mean" : r == LceReduction::Sum ? "sum" : "none";
}

// (reduction, smoothing on, z-loss on, budget)
class LceSweep : public ::testing::TestWithParam<std::tuple<LceReduction, bool, bool, int64_t>> {};

TEST_P(LceSweep, CpuMatchesRef) {
  auto [red, smooth, zl, budget] = GetParam();
  const int64_t N = 37, D = 24, V = 1000;
  auto x = testing::rounded(randn({N, D}, 1, 1.5), DType::F32);
  auto w = testing::rounded(randn({V, D}, 2, 0.5), DType::F32);
  auto up = testing::rounded(randn({N}, 3), DType::F32);
  auto targets = make_targets(N, V);
  Opts o;
  o.reduction = red, o.lam = zl ? 1e-2 : 0, o.eps = smooth ? 0.1 : 0, o.chunk_bytes = budget;
  if (red == LceReduction::None) o.dloss = &up.view();
  Out ref = run(x, w, targets, o, DType::F64);
  Out cpu = run(x, w, targets, o, DType::F32);
  expect_match(cpu, ref, std::string(red_name(red)) + " budget " + std::to_string(budget));
  // Ignored rows: no loss, no gradient.
  for (int64_t i : {2, 11}) {
    if (red == LceReduction::None) {
      EXPECT_EQ(cpu.loss.ptr<float>()[i], 0.0f);
    }
    for (int64_t k = 0; k < D; ++k) ASSERT_EQ(cpu.dx.ptr<float>()[i * D + k], 0.0f);
  }
}

// Budgets: 0 = the knob's default (full-V, one block); 133056 = full-V with blocks of 33 rows
// (37 = 33 + 4); 50000 = 32-row blocks x slabs of 382 columns (1000 = 382 + 382 + 236);
// 4096 = the minimum: 32-row blocks x slabs of 24 columns (42 slabs, the last of 16).
INSTANTIATE_TEST_SUITE_P(Cases, LceSweep,
                         ::testing::Combine(::testing::Values(LceReduction::Mean, LceReduction::Sum,
                                                              LceReduction::None),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(0, 133056, 50000, 4096)));

TEST(LinearCrossEntropy, PlansOfTheSweepAreTheIntendedOnes) {
  auto p = linear_cross_entropy_plan(37, 1000, 0);
  EXPECT_EQ(p.rows, 37);
  EXPECT_EQ(p.cols, 1000);
  p = linear_cross_entropy_plan(37, 1000, 133056);
  EXPECT_EQ(p.rows, 33);
  EXPECT_EQ(p.cols, 1000);
  p = linear_cross_entropy_plan(37, 1000, 50000);
  EXPECT_EQ(p.rows, 32);
  EXPECT_EQ(p.cols, 382);
  p = linear_cross_entropy_plan(37, 1000, 4096);
  EXPECT_EQ(p.rows, 32);
  EXPECT_EQ(p.cols, 24);
  p = linear_cross_entropy_plan(6, 50000, 65536);  // slab mode with fewer than 32 rows
  EXPECT_EQ(p.rows, 6);
  EXPECT_EQ(p.cols, 65536 / 24 - 8);
}

TEST(LinearCrossEntropy, BudgetDefaultsWhenNotGiven) {
  auto p = linear_cross_entropy_plan(37, 1000, 0);
  EXPECT_EQ(p.budget, kLceDefaultChunkBytes);
  EXPECT_EQ(p.budget, int64_t{256} << 20);
  EXPECT_EQ(p.rows, 37);  // full-V mode: every row fits
  EXPECT_EQ(p.cols, 1000);
}

TEST(LinearCrossEntropy, VocabularyOf50k) {
  const int64_t N = 6, D = 8, V = 50000;
  auto x = testing::rounded(randn({N, D}, 4, 2.0), DType::F32);
  auto w = testing::rounded(randn({V, D}, 5, 1.0), DType::F32);
  auto targets = make_targets(N, V, {4});
  for (int64_t budget : {int64_t{0}, int64_t{65536}}) {  // full-V; 19 slabs of 2722 columns
    Opts o;
    o.lam = 1e-4, o.eps = 0.1, o.chunk_bytes = budget;
    Out ref = run(x, w, targets, o, DType::F64);
    Out cpu = run(x, w, targets, o, DType::F32);
    expect_match(cpu, ref, "V=50000 budget " + std::to_string(budget));
  }
}

TEST(LinearCrossEntropy, I32TargetsGiveTheSameResult) {
  const int64_t N = 9, D = 5, V = 40;
  auto x = randn({N, D}, 6), w = randn({V, D}, 7);
  auto targets = make_targets(N, V);
  Opts o;
  o.eps = 0.2, o.lam = 1e-3;
  Out a = run(x, w, targets, o, DType::F32);
  o.target_dtype = DType::I32;
  Out b = run(x, w, targets, o, DType::F32);
  EXPECT_EQ(to_f64_vector(a.loss), to_f64_vector(b.loss));
  EXPECT_EQ(to_f64_vector(a.dw), to_f64_vector(b.dw));
}

TEST(LinearCrossEntropy, ForwardOnlyEqualsForwardOfForwardBackward) {
  const int64_t N = 37, D = 24, V = 1000;
  auto x = randn({N, D}, 8), w = randn({V, D}, 9, 0.5);
  auto targets = make_targets(N, V);
  for (int64_t budget : {int64_t{0}, int64_t{4096}})
    for (LceReduction red : {LceReduction::Mean, LceReduction::Sum, LceReduction::None}) {
      Opts o;
      o.reduction = red, o.lam = 1e-2, o.eps = 0.1, o.chunk_bytes = budget;
      auto up = randn({N}, 10);
      if (red == LceReduction::None) o.dloss = &up.view();
      Out fb = run(x, w, targets, o, DType::F32);
      o.backward = false;
      o.dloss = nullptr;
      Out f = run(x, w, targets, o, DType::F32);
      EXPECT_EQ(to_f64_vector(f.loss), to_f64_vector(fb.loss)) << red_name(red);
      EXPECT_EQ(to_f64_vector(f.lse), to_f64_vector(fb.lse)) << red_name(red);
      EXPECT_EQ(to_f64_vector(f.z), to_f64_vector(fb.z)) << red_name(red);
      Out r = run(x, w, targets, o, DType::F64);
      expect_match(f, r, std::string("forward-only ") + red_name(red), false);
    }
}

TEST(LinearCrossEntropy, AllTargetsIgnoredGivesZeroLossAndGradients) {
  const int64_t N = 7, D = 6, V = 50;
  auto x = randn({N, D}, 11), w = randn({V, D}, 12);
  auto dw0 = randn({V, D}, 13);
  std::vector<int64_t> targets(N, kLceIgnoreIndex);
  auto up = randn({N}, 14);
  for (DType dt : {DType::F64, DType::F32})
    for (int64_t budget : {int64_t{0}, int64_t{4096}})
      for (LceReduction red : {LceReduction::Mean, LceReduction::Sum, LceReduction::None})
        for (double den : {-1.0, 0.0, 64.0}) {
          Opts o;
          o.reduction = red, o.lam = 1e-2, o.eps = 0.1, o.den = den, o.chunk_bytes = budget;
          o.dw_init = &dw0.view();
          if (red == LceReduction::None) o.dloss = &up.view();
          Out r = run(x, w, targets, o, dt);
          const std::string what = std::string(red_name(red)) + " den " + std::to_string(den);
          for (double v : to_f64_vector(r.loss)) EXPECT_EQ(v, 0.0) << what;
          for (double v : to_f64_vector(r.z)) EXPECT_EQ(v, 0.0) << what;
          for (double v : to_f64_vector(r.lse)) EXPECT_TRUE(std::isfinite(v)) << what;
          for (double v : to_f64_vector(r.dx)) ASSERT_EQ(v, 0.0) << what;
          // dW is untouched (+= 0), bit for bit in the buffer's dtype.
          EXPECT_EQ(to_f64_vector(r.dw), to_f64_vector(convert(dw0, lce_stat_dtype(dt)))) << what;
        }
}

TEST(LinearCrossEntropy, DwAccumulatesIntoANonZeroBuffer) {
  const int64_t N = 37, D = 24, V = 1000;
  auto x = testing::rounded(randn({N, D}, 15), DType::F32);
  auto w = testing::rounded(randn({V, D}, 16, 0.5), DType::F32);
  auto dw0 = testing::rounded(randn({V, D}, 17, 0.01), DType::F32);
  auto targets = make_targets(N, V);
  for (int64_t budget : {int64_t{0}, int64_t{4096}}) {
    Opts o;
    o.reduction = LceReduction::Sum, o.lam = 1e-3, o.chunk_bytes = budget;
    Out fresh = run(x, w, targets, o, DType::F64);
    o.dw_init = &dw0.view();
    Out ref = run(x, w, targets, o, DType::F64);
    Out cpu = run(x, w, targets, o, DType::F32);
    expect_match(cpu, ref, "accumulate budget " + std::to_string(budget));
    auto a = to_f64_vector(ref.dw), f = to_f64_vector(fresh.dw), z = to_f64_vector(dw0);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], f[i] + z[i], 1e-12);
  }
}

TEST(LinearCrossEntropy, CallerDenominatorAndUpstreamScalar) {
  const int64_t N = 37, D = 24, V = 1000;
  auto x = testing::rounded(randn({N, D}, 18), DType::F32);
  auto w = testing::rounded(randn({V, D}, 19, 0.5), DType::F32);
  auto targets = make_targets(N, V);
  auto g = from_f64(std::vector<double>{2.5}, DType::F64, {1});
  Opts s;
  s.reduction = LceReduction::Sum, s.lam = 1e-2, s.eps = 0.05;
  Out sum = run(x, w, targets, s, DType::F64);
  for (int64_t budget : {int64_t{0}, int64_t{4096}}) {
    Opts o = s;
    o.reduction = LceReduction::Mean, o.den = 100, o.dloss = &g.view(), o.chunk_bytes = budget;
    Out ref = run(x, w, targets, o, DType::F64);
    Out cpu = run(x, w, targets, o, DType::F32);
    expect_match(cpu, ref, "denominator 100, upstream 2.5");
    // mean over a caller's 100 = sum / 100; gradients also times the upstream 2.5.
    EXPECT_NEAR(ref.loss.ptr<double>()[0], sum.loss.ptr<double>()[0] / 100, 1e-12);
    EXPECT_NEAR(ref.z.ptr<double>()[0], sum.z.ptr<double>()[0] / 100, 1e-14);
    auto a = to_f64_vector(ref.dx), b = to_f64_vector(sum.dx);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i] * 0.025, 1e-12);
  }
  // Without a denominator, mean divides by the 35 non-ignored targets.
  Opts m = s;
  m.reduction = LceReduction::Mean;
  Out mean = run(x, w, targets, m, DType::F64);
  EXPECT_NEAR(mean.loss.ptr<double>()[0], sum.loss.ptr<double>()[0] / 35, 1e-12);
}

TEST(LinearCrossEntropy, PerTokenUpstreamGradientIsHonouredBeforeDw) {
  // reduction none: dW must be sum_t g_t dL_t/dW, not g_0 * sum_t (Liger issues #678, #968).
  const int64_t N = 37, D = 24, V = 1000;
  auto x = testing::rounded(randn({N, D}, 20), DType::F32);
  auto w = testing::rounded(randn({V, D}, 21, 0.5), DType::F32);
  auto targets = make_targets(N, V);
  std::vector<double> gv(N);
  for (int64_t i = 0; i < N; ++i) gv[i] = i % 3 == 0 ? 0.0 : (i % 3 == 1 ? 1.0 : -2.0);
  auto g = from_f64(gv, DType::F64, {N});
  for (int64_t budget : {int64_t{0}, int64_t{4096}}) {
    Opts o;
    o.reduction = LceReduction::None, o.dloss = &g.view(), o.eps = 0.1, o.lam = 1e-2;
    o.chunk_bytes = budget;
    Out ref = run(x, w, targets, o, DType::F64);
    Out cpu = run(x, w, targets, o, DType::F32);
    expect_match(cpu, ref, "per-token upstream");
    // Rows with g_t = 0 get dx = 0; dW equals the sum over rows of g_t times one-row results.
    for (int64_t k = 0; k < D; ++k) ASSERT_EQ(cpu.dx.ptr<float>()[3 * D + k], 0.0f);
  }
  Opts o;
  o.reduction = LceReduction::None, o.dloss = &g.view(), o.eps = 0.1, o.lam = 1e-2;
  Out all = run(x, w, targets, o, DType::F64);
  std::vector<double> want(static_cast<size_t>(V * D), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (gv[i] == 0 || targets[i] == kLceIgnoreIndex) continue;
    auto xi = OwnedTensor::zeros(DType::F64, {1, D});
    std::copy_n(x.ptr<double>() + i * D, D, xi.ptr<double>());
    Opts s;
    s.reduction = LceReduction::Sum, s.eps = 0.1, s.lam = 1e-2;
    Out one = run(xi, w, {targets[i]}, s, DType::F64);
    auto d = to_f64_vector(one.dw);
    for (size_t j = 0; j < d.size(); ++j) want[j] += gv[i] * d[j];
  }
  auto got = to_f64_vector(all.dw);
  for (size_t j = 0; j < got.size(); ++j) ASSERT_NEAR(got[j], want[j], 1e-12);
}

TEST(LinearCrossEntropy, ConfidentRowsKeepTheirGradient) {
  // Every token predicts its target with p_y ~ 1 - 2e-6: G is tiny and p_y - 1 would lose ~3% to
  // fp32 rounding if formed as p_y - 1; expm1(z_y - lse) keeps it to fp32 logit accuracy.
  const int64_t N = 16, D = 16, V = 16;
  std::vector<double> wv(V * D), xv(N * D);
  auto noise = randn({V * D + N * D}, 22, 0.01);
  const double* nz = noise.ptr<double>();
  for (int64_t j = 0; j < V; ++j)
    for (int64_t k = 0; k < D; ++k) wv[j * D + k] = (j == k ? 1.0 : 0.0) + nz[j * D + k];
  std::vector<int64_t> targets(N);
  for (int64_t i = 0; i < N; ++i) {
    targets[i] = (i * 5) % V;
    for (int64_t k = 0; k < D; ++k)
      xv[i * D + k] = (k == targets[i] ? 16.0 : 0.0) + nz[V * D + i * D + k];
  }
  auto w = testing::rounded(from_f64(wv, DType::F64, {V, D}), DType::F32);
  auto x = testing::rounded(from_f64(xv, DType::F64, {N, D}), DType::F32);
  for (int64_t budget : {int64_t{0}, int64_t{4096}}) {
    Opts o;
    o.reduction = LceReduction::Sum, o.chunk_bytes = budget;
    Out ref = run(x, w, targets, o, DType::F64);
    Out cpu = run(x, w, targets, o, DType::F32);
    const double pmax = std::exp(-to_f64_vector(ref.loss)[0] / N);
    EXPECT_GT(pmax, 1 - 1e-5);  // the case is as confident as intended
    testing::expect_close(cpu.dx, ref.dx, 2e-5, "confident dx");
    testing::expect_close(cpu.dw, ref.dw, 2e-5, "confident dw");
  }
}

// --- finite differences of ref ---------------------------------------------------------------

TEST(LinearCrossEntropy, RefGradientsMatchFiniteDifferences) {
  const int64_t N = 5, D = 4, V = 7;
  auto x = randn({N, D}, 23), w = randn({V, D}, 24, 0.7);
  auto targets = make_targets(N, V, {1});
  auto up = randn({N}, 25);
  for (LceReduction red : {LceReduction::Mean, LceReduction::Sum, LceReduction::None})
    for (double eps : {0.0, 0.3})
      for (double lam : {0.0, 0.2}) {
        Opts o;
        o.reduction = red, o.eps = eps, o.lam = lam;
        if (red == LceReduction::None) o.dloss = &up.view();
        Out g = run(x, w, targets, o, DType::F64);
        // Scalar objective whose gradient ref returns: the loss, or sum_t up_t L_t for none.
        auto loss = [&] {
          Opts f = o;
          f.backward = false;
          f.dloss = nullptr;
          Out r = run(x, w, targets, f, DType::F64);
          return red == LceReduction::None ? testing::dot(r.loss, up) : r.loss.ptr<double>()[0];
        };
        const std::string what = std::string(red_name(red)) + " eps " + std::to_string(eps) +
                                 " lambda " + std::to_string(lam);
        EXPECT_LE(testing::fd_check(loss, x, g.dx), 1e-8) << "dx " << what;
        EXPECT_LE(testing::fd_check(loss, w, g.dw), 1e-8) << "dw " << what;
      }
}

TEST(LinearCrossEntropy, ZLossGradientAloneMatchesFiniteDifferences) {
  // d(lambda sum lse^2)/dx = dx(lambda) - dx(0): checked against finite differences of the
  // reported z_loss, so the 2 lambda lse p term is verified on its own.
  const int64_t N = 5, D = 4, V = 7;
  auto x = randn({N, D}, 26), w = randn({V, D}, 27, 0.7);
  auto targets = make_targets(N, V, {1});
  const double lam = 0.3;
  Opts o;
  o.reduction = LceReduction::Sum, o.lam = lam, o.eps = 0.1;
  Out with = run(x, w, targets, o, DType::F64);
  o.lam = 0;
  Out without = run(x, w, targets, o, DType::F64);
  auto diff = [](const Tensor& a, const Tensor& b) {
    auto va = to_f64_vector(a), vb = to_f64_vector(b);
    for (size_t i = 0; i < va.size(); ++i) va[i] -= vb[i];
    return from_f64(va, DType::F64, a.shape());
  };
  auto gx = diff(with.dx, without.dx), gw = diff(with.dw, without.dw);
  auto zloss = [&] {
    Opts f;
    f.reduction = LceReduction::Sum, f.lam = lam, f.eps = 0.1, f.backward = false;
    return run(x, w, targets, f, DType::F64).z.ptr<double>()[0];
  };
  EXPECT_GT(testing::l2(gx), 1e-3);  // the z-loss gradient is not trivially zero here
  EXPECT_LE(testing::fd_check(zloss, x, gx), 1e-8);
  EXPECT_LE(testing::fd_check(zloss, w, gw), 1e-8);
  // And the reported z_loss is lambda sum lse^2 over the non-ignored rows.
  double want = 0;
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] != kLceIgnoreIndex) want += lam * std::pow(with.lse.ptr<double>()[i], 2);
  EXPECT_NEAR(with.z.ptr<double>()[0], want, 1e-12);
}

// --- memory bound -----------------------------------------------------------------------------

TEST(LinearCrossEntropy, WorkspaceStaysWithinTheBudget) {
  for (int64_t v : {int64_t{7}, int64_t{248320}, int64_t{1} << 30, int64_t{1} << 40})
    for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{8192}, int64_t{1} << 20})
      for (int64_t b : {kLceMinChunkBytes, int64_t{1} << 20, int64_t{268435456}}) {
        auto p = linear_cross_entropy_plan(n, v, b);
        const std::string what =
            "N " + std::to_string(n) + " V " + std::to_string(v) + " B " + std::to_string(b);
        EXPECT_LE(p.workspace_bytes, b + kLceWorkspaceOverhead) << what;
        EXPECT_EQ(p.workspace_bytes, linear_cross_entropy_workspace_bytes(n, v, b)) << what;
        EXPECT_GE(p.rows, 1) << what;
        EXPECT_LE(p.rows, n) << what;
        EXPECT_GE(p.cols, 1) << what;
        EXPECT_LE(p.cols, v) << what;
        EXPECT_LE(4 * p.rows * p.cols + kLceRowStatBytes * p.rows, b) << what;
      }
  // The default budget at the Qwen3.5 shape: full-V blocks of 270 rows.
  auto p = linear_cross_entropy_plan(8192, 248320, 268435456);
  EXPECT_EQ(p.cols, 248320);
  EXPECT_EQ(p.rows, 270);
  EXPECT_EQ(linear_cross_entropy_plan(0, 10, 4096).workspace_bytes, 0);
}

TEST(LinearCrossEntropy, CallerWorkspaceGivesTheSameResult) {
  const int64_t N = 37, D = 24, V = 1000;
  auto x = randn({N, D}, 28), w = randn({V, D}, 29, 0.5);
  auto targets = make_targets(N, V);
  for (int64_t budget : {int64_t{4096}, int64_t{50000}, int64_t{133056}}) {
    Opts o;
    o.lam = 1e-2, o.eps = 0.1, o.chunk_bytes = budget;
    Out own = run(x, w, targets, o, DType::F32);
    const int64_t bytes = linear_cross_entropy_workspace_bytes(N, V, budget);
    auto ws = OwnedTensor::zeros(DType::F32, {bytes / 4});
    o.workspace = &ws.view();
    Out given = run(x, w, targets, o, DType::F32);
    EXPECT_EQ(to_f64_vector(own.loss), to_f64_vector(given.loss));
    EXPECT_EQ(to_f64_vector(own.dx), to_f64_vector(given.dx));
    EXPECT_EQ(to_f64_vector(own.dw), to_f64_vector(given.dw));
    auto small = OwnedTensor::zeros(DType::F32, {bytes / 4 - 1});
    o.workspace = &small.view();
    try {
      run(x, w, targets, o, DType::F32);
      FAIL() << "expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    fmt::format("tensor 'workspace' has {} bytes, needs {}", bytes - 4, bytes)),
                std::string::npos)
          << e.what();
    }
  }
}

// --- tools --------------------------------------------------------------------------------------

TEST(LinearCrossEntropy, ProbePassesForCpu) {
  const OpDesc& op = Registry::global().op("linear_cross_entropy");
  const ImplDesc* cpu = Registry::global().impls("linear_cross_entropy", Backend::Cpu).at(0);
  ProbeError e = op.probe(*cpu, OpQuery{Backend::Cpu, "", {}});
  ProbeError tol = op.tolerance(DType::F32);
  std::printf("probe %s: fwd %.3g bwd %.3g\n", cpu->name.c_str(), e.fwd, e.bwd);
  EXPECT_LE(e.fwd, tol.fwd);
  EXPECT_LE(e.bwd, tol.bwd);
}

TEST(LinearCrossEntropy, OpsRunFromAFile) {
  const int64_t N = 9, D = 6, V = 30;
  auto x = randn({N, D}, 30), w = randn({V, D}, 31), up = randn({N}, 32);
  auto targets = make_targets(N, V, {4});
  auto xf = convert(x, DType::F32), wf = convert(w, DType::F32), uf = convert(up, DType::F32);
  auto tt = targets_tensor(targets, DType::I64);
  const std::string dir = ::testing::TempDir();
  const std::string in = dir + "/lce_in.safetensors", out = dir + "/lce_out.safetensors";
  write_safetensors(in,
                    {NamedTensor{"x", xf.view(), {}, {}, nullptr, 0},
                     NamedTensor{"w", wf.view(), {}, {}, nullptr, 0},
                     NamedTensor{"targets", tt.view(), {}, {}, nullptr, 0},
                     NamedTensor{"dloss", uf.view(), {}, {}, nullptr, 0}},
                    {{"reduction", "2"}, {"label_smoothing", "0.1"}});
  OpRunResult r = run_op_file("linear_cross_entropy", Backend::Cpu, in, out, true,
                              {{"z_loss", 0.01}, {"chunk_bytes", 4096}});
  EXPECT_EQ(r.impl, "cpu.chunked");
  Opts o;
  o.reduction = LceReduction::None, o.eps = 0.1, o.lam = 0.01, o.dloss = &up.view();
  Out want = run(x, w, targets, o, DType::F64);
  SafeTensorsFile f(out);
  testing::expect_close(f.load("loss", DType::F64), want.loss, kTolFwd, "file loss");
  testing::expect_close(f.load("lse", DType::F64), want.lse, kTolFwd, "file lse");
  testing::expect_close(f.load("z_loss", DType::F64), want.z, kTolFwd, "file z_loss");
  testing::expect_close(f.load("dx", DType::F64), want.dx, kTolBwd, "file dx");
  testing::expect_close(f.load("dw", DType::F64), want.dw, kTolBwd, "file dw");
  std::filesystem::remove(in);
  std::filesystem::remove(out);
}

// --- bad input ----------------------------------------------------------------------------------

using testing::expect_error;

TEST(LinearCrossEntropy, BadInputIsAClearError) {
  const int64_t N = 6, D = 8, V = 20;
  auto x = randn({N, D}, 33), w = randn({V, D}, 34);
  auto good = make_targets(N, V, {1});
  auto call = [&](const Tensor& xx, const Tensor& ww, std::vector<int64_t> t, Opts o) {
    run(xx, ww, t, o, DType::F32);
  };
  Opts o;
  expect_error(
      [&] {
        call(x, randn({V, D + 1}, 35), good, o);
      },
      "linear_cross_entropy: tensor 'w' has shape [20, 9], expected [*, 8]");
  expect_error(
      [&] {
        call(randn({N, D, 1}, 36), w, good, o);
      },
      "tensor 'x' has shape [6, 8, 1], expected [*, *]");
  expect_error([&] { call(x, w, {0, 1, 2}, o); }, "tensor 'targets' has shape [3], expected [6]");
  auto bad = good;
  bad[4] = V;
  expect_error([&] { call(x, w, bad, o); },
               "linear_cross_entropy: targets[4] = 20 is out of range: a target must be in [0, "
               "20) (the vocabulary of 'w') or the ignore_index -100");
  bad[4] = -1;
  expect_error([&] { call(x, w, bad, o); }, "targets[4] = -1 is out of range");
  Opts i32 = o;
  i32.target_dtype = DType::I32;
  bad[4] = 1000;
  expect_error([&] { call(x, w, bad, i32); }, "targets[4] = 1000 is out of range");
  Opts none = o;
  none.reduction = LceReduction::None;
  expect_error([&] { call(x, w, good, none); },
               "reduction none needs tensor 'dloss' [6], the per-token upstream gradient");
  auto up1 = randn({1}, 37);
  none.dloss = &up1.view();
  expect_error([&] { call(x, w, good, none); }, "tensor 'dloss' has shape [1], expected [6]");
  Opts eps = o;
  eps.eps = 1.0;
  expect_error([&] { call(x, w, good, eps); }, "label_smoothing must be in [0, 1), got 1");
  Opts lam = o;
  lam.lam = -1;
  expect_error([&] { call(x, w, good, lam); }, "z_loss_scale must be finite and >= 0, got -1");
  Opts chunk = o;
  chunk.chunk_bytes = 100;
  expect_error([&] { call(x, w, good, chunk); }, "chunk_bytes = 100 is below the minimum 4096");
  Opts den = o;
  den.den = 0;
  expect_error([&] { call(x, w, good, den); },
               "the caller's mean denominator is 0 but 5 targets are not ignored");

  // Direct argument errors: wrong dtypes, a forward given gradients.
  auto xf = convert(x, DType::F32), wf = convert(w, DType::F32);
  auto tt = targets_tensor(good, DType::I64);
  auto loss = OwnedTensor::zeros(DType::F32, {1}), lse = OwnedTensor::zeros(DType::F32, {N});
  auto z = OwnedTensor::zeros(DType::F32, {1});
  LinearCrossEntropyArgs a;
  a.x = xf, a.w = wf, a.targets = tt, a.loss = loss, a.lse = lse, a.z_loss = z;
  auto tf = OwnedTensor::zeros(DType::F32, {N});
  LinearCrossEntropyArgs b = a;
  b.targets = tf;
  expect_error([&] { linear_cross_entropy_forward(b); },
               "tensor 'targets' has dtype F32, expected I64 or I32");
  auto lse64 = OwnedTensor::zeros(DType::F64, {N});
  b = a;
  b.lse = lse64;
  expect_error([&] { linear_cross_entropy_forward(b); },
               "tensor 'lse' has dtype F64, expected F32");
  auto dx = OwnedTensor::zeros(DType::F32, {N, D});
  b = a;
  b.dx = dx;
  expect_error([&] { linear_cross_entropy_forward(b); },
               "linear_cross_entropy_forward computes no gradients");
  auto dw_bf = OwnedTensor::zeros(DType::F32, {V, D + 1});
  b = a;
  b.dx = dx;
  b.dw = dw_bf;
  expect_error([&] { linear_cross_entropy_forward_backward(b); },
               "tensor 'dw' has shape [20, 9], expected [20, 8]");
  b = a;
  b.dx = dx;
  expect_error([&] { linear_cross_entropy_forward_backward(b); },
               "tensor 'dw' is required but was not given");
}

}  // namespace
}  // namespace gdn::ops
