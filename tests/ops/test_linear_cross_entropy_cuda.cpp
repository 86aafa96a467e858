// Linear cross-entropy on CUDA (label gpu): cuda vs ref for loss, lse, z_loss, dx and dW over
// reductions x smoothing x z-loss x chunk plans (full-V in one block, full-V with a partial last
// block, vocabulary slabs that do not divide V, the minimum budget), edge shapes (one row, V = 1,
// odd D), ignored rows and an all-ignored batch (loss 0, no NaN), per-token upstream gradients
// with reduction none, the caller's denominator and upstream scalar, dW += into a non-zero buffer,
// a 50k vocabulary, confident rows (p_y ~ 1), forward-only, determinism, the caller's workspace,
// out-of-range targets (NaN loss, no fault), the resolver's choice and probe, wrong
// implementations rejected by the probe, `ops run` on the cuda backend, and bad input.
// Tolerances come from src/backend/tolerances.h.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "backend/tolerances.h"
#include "ops/dense_test_util.h"
#include "ops/linear_cross_entropy/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

constexpr ProbeError kTol = bf16_tolerance("linear_cross_entropy");

class LceCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

// A device tensor whose every element is NaN: an output element the op does not write fails the
// comparison as non-finite.
OwnedTensor poisoned(DType dt, std::span<const int64_t> shape) {
  Tensor probe(nullptr, dt, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()),
                        std::numeric_limits<double>::quiet_NaN());
  return from_f64(v, dt, shape, Device::CUDA);
}

struct Opts {
  LceReduction reduction = LceReduction::Mean;
  double lam = 0, eps = 0, den = -1;
  int64_t chunk_bytes = 0;
  const Tensor* dloss = nullptr;    // F64 host: [N] (none) or [1] (sum, mean)
  const Tensor* dw_init = nullptr;  // F64 host [V, D]: dW starts from it (accumulation)
  DType target_dtype = DType::I64;
  bool backward = true;
  const Tensor* workspace = nullptr;  // a device buffer (cuda only)
};

struct Out {
  OwnedTensor loss, lse, z, dx, dw;
};

OwnedTensor targets_tensor(const std::vector<int64_t>& t, DType dt, Device dev) {
  OwnedTensor v = OwnedTensor::empty(DType::I64, {static_cast<int64_t>(t.size())});
  std::copy(t.begin(), t.end(), v.ptr<int64_t>());
  return convert(v, dt, dev);
}

// Runs the op through the public entry points: on ref (F64 host) or on cuda (bf16 device tensors,
// outputs poisoned). x64 and w64 are already bf16-rounded, so both see the same numbers.
Out run(const Tensor& x64, const Tensor& w64, const std::vector<int64_t>& targets, const Opts& o,
        bool cuda) {
  const int64_t N = x64.size(0), D = x64.size(1), V = w64.size(0);
  const Device dev = cuda ? Device::CUDA : Device::CPU;
  const DType act = cuda ? DType::BF16 : DType::F64, st = lce_stat_dtype(act);
  const int64_t ln = o.reduction == LceReduction::None ? N : 1;
  OwnedTensor x = convert(x64, act, dev), w = convert(w64, act, dev);
  OwnedTensor t = targets_tensor(targets, o.target_dtype, dev);
  const int64_t sl[] = {ln}, sn[] = {N}, snd[] = {N, D};
  Out out;
  if (cuda) {
    out.loss = poisoned(st, sl), out.lse = poisoned(st, sn), out.z = poisoned(st, sl);
    out.dx = poisoned(act, snd);
  } else {
    out.loss = OwnedTensor::zeros(st, sl), out.lse = OwnedTensor::zeros(st, sn);
    out.z = OwnedTensor::zeros(st, sl), out.dx = OwnedTensor::zeros(act, snd);
  }
  out.dw = o.dw_init ? convert(*o.dw_init, st, dev) : OwnedTensor::zeros(st, {V, D}, dev);
  LinearCrossEntropyArgs a;
  a.x = x, a.w = w, a.targets = t, a.loss = out.loss, a.lse = out.lse, a.z_loss = out.z;
  a.reduction = o.reduction, a.z_loss_scale = o.lam, a.label_smoothing = o.eps;
  a.denominator = o.den, a.chunk_bytes = o.chunk_bytes;
  if (o.workspace && cuda) a.workspace = *o.workspace;
  if (!o.backward) {
    linear_cross_entropy_forward(a);
    return out;
  }
  OwnedTensor dl;
  if (o.dloss) {
    dl = convert(*o.dloss, st, dev);
    a.dloss = dl;
  }
  a.dx = out.dx, a.dw = out.dw;
  linear_cross_entropy_forward_backward(a);
  device_synchronize(Device::CUDA);  // dl and the inputs are freed on return
  return out;
}

// Inputs rounded through bf16 (ref and cuda multiply the same numbers). Logit std = sx sw sqrt(D).
struct Problem {
  OwnedTensor x, w;
  std::vector<int64_t> targets;
};
Problem make_problem(int64_t N, int64_t D, int64_t V, uint64_t seed, double sx, double sw,
                     std::vector<int64_t> ignored = {2, 11}) {
  Problem p{testing::rounded(randn({N, D}, seed, sx), DType::BF16),
            testing::rounded(randn({V, D}, seed + 1, sw), DType::BF16),
            std::vector<int64_t>(static_cast<size_t>(N))};
  for (int64_t i = 0; i < N; ++i) p.targets[i] = (i * 7919 + 5) % V;
  for (int64_t i : ignored)
    if (i < N) p.targets[i] = kLceIgnoreIndex;
  return p;
}

void expect_match(const Out& got, const Out& ref, const std::string& what, bool backward = true) {
  testing::expect_close(got.loss, ref.loss, kTol.fwd, what + " loss");
  testing::expect_close(got.lse, ref.lse, kTol.fwd, what + " lse");
  // z_loss is exactly 0 with lambda = 0: the absolute scale guards the division.
  testing::expect_close(got.z, ref.z, kTol.fwd, what + " z_loss", 1e-12);
  if (!backward) return;
  testing::expect_close(got.dx, ref.dx, kTol.bwd, what + " dx");
  testing::expect_close(got.dw, ref.dw, kTol.bwd, what + " dw");
}

const char* red_name(LceReduction r) {
  return r == LceReduction::Mean ? "mean" : r == LceReduction::Sum ? "sum" : "none";
}

std::vector<double> host(const Tensor& t) { return to_f64_vector(t); }

// --- the sweep ----------------------------------------------------------------------------------

// (reduction, smoothing on, z-loss on, budget)
class LceCudaSweep
    : public LceCuda,
      public ::testing::WithParamInterface<std::tuple<LceReduction, bool, bool, int64_t>> {};

TEST_P(LceCudaSweep, MatchesRef) {
  auto [red, smooth, zl, budget] = GetParam();
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 1, 1.0, 0.6);  // logit std ~2.9
  auto up = testing::rounded(randn({N}, 3), DType::F32);
  Opts o;
  o.reduction = red, o.lam = zl ? 1e-2 : 0, o.eps = smooth ? 0.1 : 0, o.chunk_bytes = budget;
  if (red == LceReduction::None) o.dloss = &up.view();
  Out ref = run(p.x, p.w, p.targets, o, false);
  Out got = run(p.x, p.w, p.targets, o, true);
  expect_match(got, ref, std::string(red_name(red)) + " budget " + std::to_string(budget));
  // Ignored rows: no loss, no gradient, but an lse.
  auto dx = host(got.dx), loss = host(got.loss), lse = host(got.lse);
  for (int64_t i : {2, 11}) {
    if (red == LceReduction::None) {
      EXPECT_EQ(loss[i], 0.0) << "ignored row " << i;
    }
    EXPECT_TRUE(std::isfinite(lse[i]));
    for (int64_t k = 0; k < D; ++k) ASSERT_EQ(dx[i * D + k], 0.0) << "ignored row " << i;
  }
}

// Budgets (plans checked in test_linear_cross_entropy_plan.cpp): 0 = the knob's default (full-V,
// one block of 37); 66000 = full-V blocks of 32 + 5; 50000 = 32-row blocks x slabs 712 + 288;
// 20000 = slabs 4 x 240 + 40; 4096 = the minimum: 28-row blocks x 125 slabs of 8.
INSTANTIATE_TEST_SUITE_P(Cases, LceCudaSweep,
                         ::testing::Combine(::testing::Values(LceReduction::Mean, LceReduction::Sum,
                                                              LceReduction::None),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(0, 66000, 50000, 20000, 4096)),
                         [](const auto& info) {
                           return std::string(red_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_smooth" : "") +
                                  (std::get<2>(info.param) ? "_zloss" : "") + "_B" +
                                  std::to_string(std::get<3>(info.param));
                         });

TEST_F(LceCuda, EdgeShapes) {
  // One row; V = 1 (loss = z-loss only, G = 2 lambda lse); odd D (unaligned GEMM rows); V not a
  // multiple of 8 (padded tile rows); a budget that forces rows of 2 (V = 1 at the minimum).
  struct Shape {
    int64_t N, D, V, budget;
  };
  for (const Shape& s : {Shape{1, 8, 5, 0}, Shape{1, 7, 13, 0}, Shape{3, 33, 1, 4096},
                         Shape{5, 16, 8, 0}, Shape{9, 40, 77, 4096}, Shape{64, 8, 3, 4096}}) {
    Problem p = make_problem(s.N, s.D, s.V, 40 + static_cast<uint64_t>(s.V), 1.0, 0.4,
                             {});  // logit std <= 2.5
    for (LceReduction red : {LceReduction::Sum, LceReduction::None}) {
      auto up = testing::rounded(randn({s.N}, 41), DType::F32);
      Opts o;
      o.reduction = red, o.lam = 1e-2, o.eps = 0.1, o.chunk_bytes = s.budget;
      if (red == LceReduction::None) o.dloss = &up.view();
      Out ref = run(p.x, p.w, p.targets, o, false);
      Out got = run(p.x, p.w, p.targets, o, true);
      expect_match(got, ref, fmt::format("N {} D {} V {} {}", s.N, s.D, s.V, red_name(red)));
    }
  }
}

TEST_F(LceCuda, EmptyBatch) {
  // N = 0: no GEMM, no row kernel; sum and mean write loss = z_loss = 0 (not left unwritten).
  const int64_t D = 8, V = 10;
  Problem p = make_problem(0, D, V, 45, 1.0, 0.7, {});
  for (LceReduction red : {LceReduction::Mean, LceReduction::Sum, LceReduction::None}) {
    Opts o;
    o.reduction = red, o.lam = 1e-2;
    auto up = OwnedTensor::zeros(DType::F64, {0});
    if (red == LceReduction::None) o.dloss = &up.view();
    Out got = run(p.x, p.w, p.targets, o, true);
    for (double v : host(got.loss)) EXPECT_EQ(v, 0.0) << red_name(red);
    for (double v : host(got.z)) EXPECT_EQ(v, 0.0) << red_name(red);
    for (double v : host(got.dw)) ASSERT_EQ(v, 0.0) << red_name(red);
  }
}

// --- semantics ----------------------------------------------------------------------------------

TEST_F(LceCuda, AllTargetsIgnoredGivesZeroLossAndGradients) {
  const int64_t N = 7, D = 16, V = 50;
  Problem p = make_problem(N, D, V, 11, 1.0, 0.7);
  auto dw0 = testing::rounded(randn({V, D}, 13), DType::F32);
  std::vector<int64_t> targets(N, kLceIgnoreIndex);
  auto up = testing::rounded(randn({N}, 14), DType::F32);
  for (int64_t budget : {int64_t{0}, int64_t{4096}})
    for (LceReduction red : {LceReduction::Mean, LceReduction::Sum, LceReduction::None})
      for (double den : {-1.0, 0.0, 64.0}) {
        Opts o;
        o.reduction = red, o.lam = 1e-2, o.eps = 0.1, o.den = den, o.chunk_bytes = budget;
        o.dw_init = &dw0.view();
        if (red == LceReduction::None) o.dloss = &up.view();
        Out r = run(p.x, p.w, targets, o, true);
        const std::string what = fmt::format("{} den {} budget {}", red_name(red), den, budget);
        for (double v : host(r.loss)) EXPECT_EQ(v, 0.0) << what;
        for (double v : host(r.z)) EXPECT_EQ(v, 0.0) << what;
        for (double v : host(r.lse)) EXPECT_TRUE(std::isfinite(v)) << what;
        for (double v : host(r.dx)) ASSERT_EQ(v, 0.0) << what;
        // dW is untouched (+= 0 exactly).
        EXPECT_EQ(host(r.dw), host(dw0)) << what;
      }
}

TEST_F(LceCuda, DwAccumulatesIntoANonZeroBuffer) {
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 15, 1.0, 0.6);
  auto dw0 = testing::rounded(randn({V, D}, 17, 0.01), DType::F32);
  for (int64_t budget : {int64_t{0}, int64_t{66000}, int64_t{20000}}) {
    Opts o;
    o.reduction = LceReduction::Sum, o.lam = 1e-3, o.chunk_bytes = budget;
    Out fresh = run(p.x, p.w, p.targets, o, false);
    o.dw_init = &dw0.view();
    Out got = run(p.x, p.w, p.targets, o, true);
    // dW - dw0 against the fresh fp64 gradient: dW accumulates in fp32, so subtracting dw0
    // leaves the added part with fp32 noise only.
    auto g = host(got.dw), base = host(dw0), add = host(fresh.dw);
    double num = 0, den = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      num += (g[i] - base[i] - add[i]) * (g[i] - base[i] - add[i]);
      den += add[i] * add[i];
    }
    EXPECT_LE(std::sqrt(num / den), kTol.bwd) << "dW += budget " << budget;
    EXPECT_GT(std::sqrt(den), 0.1);  // the added part is not negligible next to dw0
  }
}

TEST_F(LceCuda, PerTokenUpstreamGradientIsHonouredBeforeDw) {
  // reduction none: dW must be sum_t g_t dL_t/dW, not g_0 * sum_t (Liger issues #678, #968).
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 20, 1.0, 0.6);
  std::vector<double> gv(N);
  for (int64_t i = 0; i < N; ++i) gv[i] = i % 3 == 0 ? 0.0 : (i % 3 == 1 ? 1.0 : -2.0);
  auto g = from_f64(gv, DType::F64, {N});
  for (int64_t budget : {int64_t{0}, int64_t{66000}, int64_t{20000}}) {
    Opts o;
    o.reduction = LceReduction::None, o.dloss = &g.view(), o.eps = 0.1, o.lam = 1e-2;
    o.chunk_bytes = budget;
    Out ref = run(p.x, p.w, p.targets, o, false);
    Out got = run(p.x, p.w, p.targets, o, true);
    expect_match(got, ref, "per-token upstream budget " + std::to_string(budget));
    auto dx = host(got.dx);
    for (int64_t k = 0; k < D; ++k) ASSERT_EQ(dx[3 * D + k], 0.0) << "row 3 has g = 0";
  }
}

TEST_F(LceCuda, CallerDenominatorAndUpstreamScalar) {
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 18, 1.0, 0.6);
  auto g = from_f64(std::vector<double>{2.5}, DType::F64, {1});
  for (int64_t budget : {int64_t{0}, int64_t{20000}}) {
    Opts o;
    o.reduction = LceReduction::Mean, o.lam = 1e-2, o.eps = 0.05, o.den = 100;
    o.dloss = &g.view(), o.chunk_bytes = budget;
    Out ref = run(p.x, p.w, p.targets, o, false);
    Out got = run(p.x, p.w, p.targets, o, true);
    expect_match(got, ref, "denominator 100, upstream 2.5, budget " + std::to_string(budget));
    // Without a denominator, mean divides by the 35 non-ignored targets (counted on the device).
    Opts m = o;
    m.den = -1, m.dloss = nullptr;
    Out mref = run(p.x, p.w, p.targets, m, false);
    Out mgot = run(p.x, p.w, p.targets, m, true);
    expect_match(mgot, mref, "count denominator budget " + std::to_string(budget));
    EXPECT_NEAR(host(mgot.loss)[0] * 35, host(got.loss)[0] * 100,
                1e-5 * std::abs(host(got.loss)[0] * 100));
  }
}

TEST_F(LceCuda, VocabularyOf50k) {
  const int64_t N = 40, D = 64, V = 50000;
  Problem p = make_problem(N, D, V, 4, 1.0, 0.35, {4, 39});  // logit std ~2.8
  for (int64_t budget : {int64_t{0}, int64_t{1} << 20}) {    // full-V; slabs 3 x 16232 + 1304
    Opts o;
    o.lam = 1e-4, o.eps = 0.1, o.chunk_bytes = budget;
    Out ref = run(p.x, p.w, p.targets, o, false);
    Out got = run(p.x, p.w, p.targets, o, true);
    expect_match(got, ref, "V = 50000 budget " + std::to_string(budget));
  }
}

TEST_F(LceCuda, I32TargetsGiveTheSameResult) {
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 6, 1.0, 0.6);
  Opts o;
  o.eps = 0.2, o.lam = 1e-3, o.chunk_bytes = 20000;
  Out a = run(p.x, p.w, p.targets, o, true);
  o.target_dtype = DType::I32;
  Out b = run(p.x, p.w, p.targets, o, true);
  EXPECT_EQ(host(a.loss), host(b.loss));
  EXPECT_EQ(host(a.dx), host(b.dx));
  EXPECT_EQ(host(a.dw), host(b.dw));
}

TEST_F(LceCuda, ConfidentRowsKeepTheirGradient) {
  // w = I and x = 20 e_y + noise: the logits are x itself, exactly representable in bf16, and
  // 1 - p_y ~ 3e-8 is below fp32's resolution at 1: p_y - 1 formed as p_y - 1 would be 0 (or one
  // ulp, 6e-8) and G_y off by ~100%; expm1((z_y - m) - log s) keeps it to fp32 accuracy.
  const int64_t N = 16, D = 16, V = 16;
  std::vector<double> wv(V * D, 0.0), xv(N * D);
  for (int64_t j = 0; j < V; ++j) wv[j * D + j] = 1.0;
  auto noise = randn({N * D}, 22, 0.5);
  std::vector<int64_t> targets(N);
  for (int64_t i = 0; i < N; ++i) {
    targets[i] = (i * 5) % V;
    for (int64_t k = 0; k < D; ++k)
      xv[i * D + k] = (k == targets[i] ? 20.0 : 0.0) + noise.ptr<double>()[i * D + k];
  }
  auto w = from_f64(wv, DType::F64, {V, D});
  auto x = testing::rounded(from_f64(xv, DType::F64, {N, D}), DType::BF16);
  Opts o;
  o.reduction = LceReduction::Sum;
  Out ref = run(x, w, targets, o, false);
  Out got = run(x, w, targets, o, true);
  const double pmax = std::exp(-host(ref.loss)[0] / N);
  EXPECT_GT(pmax, 1 - 2e-7);  // as confident as intended (fp32 ulp below 1: 6e-8)
  // The logits are exact here, so the only errors are G's and dx's bf16 roundings.
  testing::expect_close(got.dx, ref.dx, 8e-3, "confident dx");
  testing::expect_close(got.dw, ref.dw, 8e-3, "confident dw");
  testing::expect_close(got.loss, ref.loss, 1e-4, "confident loss");
}

TEST_F(LceCuda, ForwardOnlyEqualsForwardOfForwardBackward) {
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 8, 1.0, 0.6);
  auto up = testing::rounded(randn({N}, 10), DType::F32);
  for (int64_t budget : {int64_t{0}, int64_t{20000}})
    for (LceReduction red : {LceReduction::Mean, LceReduction::Sum, LceReduction::None}) {
      Opts o;
      o.reduction = red, o.lam = 1e-2, o.eps = 0.1, o.chunk_bytes = budget;
      if (red == LceReduction::None) o.dloss = &up.view();
      Out fb = run(p.x, p.w, p.targets, o, true);
      o.backward = false;
      o.dloss = nullptr;
      Out f = run(p.x, p.w, p.targets, o, true);
      const std::string what = fmt::format("forward-only {} budget {}", red_name(red), budget);
      // The same statistics code on the same tile: equal up to (in practice exactly) fp32 noise.
      testing::expect_close(f.loss, fb.loss, 1e-6, what + " loss");
      testing::expect_close(f.lse, fb.lse, 1e-6, what + " lse");
      testing::expect_close(f.z, fb.z, 1e-6, what + " z_loss", 1e-12);
      Out r = run(p.x, p.w, p.targets, o, false);
      expect_match(f, r, what, false);
    }
}

TEST_F(LceCuda, IsDeterministic) {
  const int64_t N = 300, D = 64, V = 3000;
  Problem p = make_problem(N, D, V, 30, 1.0, 0.35);
  auto dw0 = testing::rounded(randn({V, D}, 31, 0.01), DType::F32);
  for (int64_t budget : {int64_t{0}, int64_t{400000}, int64_t{60000}}) {
    Opts o;
    o.lam = 1e-4, o.eps = 0.1, o.chunk_bytes = budget, o.dw_init = &dw0.view();
    Out first = run(p.x, p.w, p.targets, o, true);
    for (int rep = 0; rep < 2; ++rep) {
      Out again = run(p.x, p.w, p.targets, o, true);
      EXPECT_EQ(host(again.loss), host(first.loss)) << "budget " << budget << " rep " << rep;
      EXPECT_EQ(host(again.lse), host(first.lse)) << "budget " << budget << " rep " << rep;
      EXPECT_EQ(host(again.dx), host(first.dx)) << "budget " << budget << " rep " << rep;
      EXPECT_EQ(host(again.dw), host(first.dw)) << "budget " << budget << " rep " << rep;
    }
  }
}

TEST_F(LceCuda, CallerWorkspaceGivesTheSameResult) {
  const int64_t N = 37, D = 24, V = 1000;
  Problem p = make_problem(N, D, V, 28, 1.0, 0.6);
  for (int64_t budget : {int64_t{4096}, int64_t{20000}, int64_t{66000}, int64_t{0}}) {
    Opts o;
    o.lam = 1e-2, o.eps = 0.1, o.chunk_bytes = budget;
    Out own = run(p.x, p.w, p.targets, o, true);
    const int64_t bytes = linear_cross_entropy_workspace_bytes(N, V, budget);
    auto ws = OwnedTensor::zeros(DType::F32, {bytes / 4}, Device::CUDA);
    o.workspace = &ws.view();
    Out given = run(p.x, p.w, p.targets, o, true);
    EXPECT_EQ(host(own.loss), host(given.loss)) << budget;
    EXPECT_EQ(host(own.dx), host(given.dx)) << budget;
    EXPECT_EQ(host(own.dw), host(given.dw)) << budget;
    auto small = OwnedTensor::zeros(DType::F32, {bytes / 4 - 1}, Device::CUDA);
    o.workspace = &small.view();
    testing::expect_error(
        [&] { run(p.x, p.w, p.targets, o, true); },
        fmt::format("tensor 'workspace' has {} bytes, needs {}", bytes - 4, bytes));
  }
  // A workspace that is not 16-byte aligned.
  const int64_t bytes = linear_cross_entropy_workspace_bytes(N, V, 0);
  auto buf = OwnedTensor::zeros(DType::BF16, {bytes / 2 + 8}, Device::CUDA);
  Tensor shifted(static_cast<char*>(buf.view().data()) + 2, DType::BF16, {bytes / 2}, Device::CUDA);
  Opts o;
  o.workspace = &shifted;
  testing::expect_error([&] { run(p.x, p.w, p.targets, o, true); },
                        "tensor 'workspace' must be 16-byte aligned on cuda");
}

TEST_F(LceCuda, OutOfRangeTargetGivesNanLossAndNoFault) {
  // The host never reads device targets: a bad one must not be read out of bounds, must poison
  // the loss (the trainer's non-finite check names it) and must not send a gradient.
  const int64_t N = 9, D = 16, V = 30;
  Problem p = make_problem(N, D, V, 35, 1.0, 0.7, {1});
  for (int64_t bad : {int64_t{30}, int64_t{-1}, int64_t{1} << 40})
    for (int64_t budget : {int64_t{0}, int64_t{4096}}) {
      auto t = p.targets;
      t[5] = bad;
      Opts o;
      o.reduction = LceReduction::None, o.chunk_bytes = budget;
      auto up = testing::rounded(randn({N}, 36), DType::F32);
      o.dloss = &up.view();
      Out got = run(p.x, p.w, t, o, true);
      auto loss = host(got.loss), dx = host(got.dx);
      const std::string what = fmt::format("target {} budget {}", bad, budget);
      for (int64_t i = 0; i < N; ++i)
        EXPECT_EQ(std::isnan(loss[i]), i == 5) << what << " row " << i << " loss " << loss[i];
      for (int64_t k = 0; k < D; ++k) ASSERT_EQ(dx[5 * D + k], 0.0) << what;
      for (double v : host(got.dw)) ASSERT_TRUE(std::isfinite(v)) << what;
      Opts s = o;
      s.reduction = LceReduction::Mean, s.dloss = nullptr;
      Out m = run(p.x, p.w, t, s, true);
      EXPECT_TRUE(std::isnan(host(m.loss)[0])) << what;
    }
}

// --- tools ----------------------------------------------------------------------------------

TEST_F(LceCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  const Resolution& r =
      Registry::global().resolve("linear_cross_entropy", OpQuery{Backend::Cuda, "", {}});
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, "cuda.chunked");
  EXPECT_LE(r.error.fwd, kTol.fwd);
  EXPECT_LE(r.error.bwd, kTol.bwd);
  EXPECT_GT(r.error.fwd, 0.0);  // bf16 logits cannot match fp64: zero means nothing was compared
  EXPECT_GT(r.error.bwd, 0.0);
  EXPECT_TRUE(r.rejected.empty()) << r.rejected.front();
}

const LinearCrossEntropyTable* real_cuda_table() {
  for (const ImplDesc* i : Registry::global().impls("linear_cross_entropy", Backend::Cuda))
    if (i->name == "cuda.chunked") return static_cast<const LinearCrossEntropyTable*>(i->table);
  return nullptr;
}
void no_zloss(const LinearCrossEntropyArgs& a) {
  LinearCrossEntropyArgs b = a;
  b.z_loss_scale = 0;
  real_cuda_table()->forward_backward(b);
}
void no_smoothing(const LinearCrossEntropyArgs& a) {
  LinearCrossEntropyArgs b = a;
  b.label_smoothing = 0;
  real_cuda_table()->forward_backward(b);
}
void real_forward(const LinearCrossEntropyArgs& a) { real_cuda_table()->forward(a); }
const LinearCrossEntropyTable kNoZloss{real_forward, no_zloss};
const LinearCrossEntropyTable kNoSmoothing{real_forward, no_smoothing};

TEST_F(LceCuda, ProbeRejectsWrongCudaImplementations) {
  ASSERT_NE(real_cuda_table(), nullptr) << "cuda.chunked is not registered";
  Registry reg;
  reg.add_op(Registry::global().op("linear_cross_entropy"));
  reg.add_impl(Registry::global().ref("linear_cross_entropy"));
  for (const ImplDesc* i : Registry::global().impls("linear_cross_entropy", Backend::Cuda))
    reg.add_impl(*i);
  reg.add_impl({"linear_cross_entropy", "cuda.no_zloss", Backend::Cuda, 30, nullptr, &kNoZloss});
  reg.add_impl(
      {"linear_cross_entropy", "cuda.no_smoothing", Backend::Cuda, 20, nullptr, &kNoSmoothing});
  const Resolution& r = reg.resolve("linear_cross_entropy", OpQuery{Backend::Cuda, "", {}});
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, "cuda.chunked");
  ASSERT_EQ(r.rejected.size(), 2u);
  EXPECT_NE(r.rejected[0].find("rejecting cuda.no_zloss: probe error"), std::string::npos)
      << r.rejected[0];
  EXPECT_NE(r.rejected[1].find("rejecting cuda.no_smoothing: probe error"), std::string::npos)
      << r.rejected[1];
}

TEST_F(LceCuda, OpsRunOnCudaBackend) {
  const int64_t N = 9, D = 16, V = 30;
  Problem p = make_problem(N, D, V, 50, 1.0, 0.7, {4});
  auto up = testing::rounded(randn({N}, 52), DType::F32);
  auto tt = targets_tensor(p.targets, DType::I64, Device::CPU);
  auto out = testing::run_op_via_file(
      "linear_cross_entropy", Backend::Cuda,
      {{"x", p.x}, {"w", p.w}, {"targets", tt}, {"dloss", up}}, true,
      {{"reduction", 2}, {"label_smoothing", 0.1}, {"z_loss", 0.01}, {"chunk_bytes", 4096}});
  Opts o;
  o.reduction = LceReduction::None, o.eps = 0.1, o.lam = 0.01, o.dloss = &up.view();
  Out want = run(p.x, p.w, p.targets, o, false);
  testing::expect_close(out.at("loss"), want.loss, kTol.fwd, "file loss");
  testing::expect_close(out.at("lse"), want.lse, kTol.fwd, "file lse");
  testing::expect_close(out.at("z_loss"), want.z, kTol.fwd, "file z_loss");
  testing::expect_close(out.at("dx"), want.dx, kTol.bwd, "file dx");
  testing::expect_close(out.at("dw"), want.dw, kTol.bwd, "file dw");
}

TEST_F(LceCuda, BadInputIsAClearError) {
  const int64_t N = 6, D = 1024, V = 20;
  Problem p = make_problem(N, D, V, 60, 1.0, 0.05, {1});
  // A budget that cannot hold one row of either layout at this D (V large enough that full-V
  // rows do not fit either).
  Problem q = make_problem(2, D, 3000, 61, 1.0, 0.05, {});
  Opts tiny;
  tiny.chunk_bytes = kLceMinChunkBytes;
  testing::expect_error([&] { run(q.x, q.w, q.targets, tiny, true); },
                        "linear_cross_entropy (cuda): a logits budget of 4096 bytes");
  // F32 activations on the device: the contract wants bf16.
  auto x = convert(p.x, DType::F32, Device::CUDA), w = convert(p.w, DType::F32, Device::CUDA);
  auto t = targets_tensor(p.targets, DType::I64, Device::CUDA);
  auto loss = OwnedTensor::zeros(DType::F32, {1}, Device::CUDA);
  auto lse = OwnedTensor::zeros(DType::F32, {N}, Device::CUDA);
  auto z = OwnedTensor::zeros(DType::F32, {1}, Device::CUDA);
  LinearCrossEntropyArgs a;
  a.x = x, a.w = w, a.targets = t, a.loss = loss, a.lse = lse, a.z_loss = z;
  testing::expect_error([&] { linear_cross_entropy_forward(a); },
                        "linear_cross_entropy (cuda): x and w must be BF16, got F32");
  // A host tensor among device ones.
  auto xb = convert(p.x, DType::BF16, Device::CUDA), wb = convert(p.w, DType::BF16, Device::CUDA);
  auto lse_host = OwnedTensor::zeros(DType::F32, {N});
  a.x = xb, a.w = wb, a.lse = lse_host;
  testing::expect_error([&] { linear_cross_entropy_forward(a); },
                        "linear_cross_entropy: all tensors must be on cuda");
}

}  // namespace
}  // namespace gdn::ops
