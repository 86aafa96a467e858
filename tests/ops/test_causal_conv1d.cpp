// Causal conv1d: cpu vs ref swept over widths, document layouts (T < W, 1-token documents,
// zero-length documents, 50 documents) and options (bias, SiLU, initial state, final-state
// gradient), forward and every gradient; packed == documents one by one; the tap and state
// conventions on hand-made inputs; finite differences of ref; accumulation; determinism across
// thread counts; bad input; `ops run` through run_op_file.
#include <omp.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gdn/backend/op_run.h"
#include "gdn/core/rng.h"
#include "gdn/core/safetensors.h"
#include "ops/causal_conv1d/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

// One problem, held in F64 (values rounded to fp32 so that ref and cpu see the same numbers).
struct Case {
  int64_t C = 0, W = 0;
  std::vector<int32_t> cu;  // document boundaries
  bool use_cu = true;       // false: pass no cu_seqlens (needs cu == {0, T})
  bool bias = false, silu = false, init = false, dfin = false;
  OwnedTensor x, w, b, s0, dy, dsN;  // [T, C], [C, W], [C], [N, C, W-1], [T, C], [N, C, W-1]
  int64_t T() const { return cu.back(); }
  int64_t N() const { return static_cast<int64_t>(cu.size()) - 1; }
};

Case make_case(int64_t C, int64_t W, std::vector<int32_t> cu, bool bias, bool silu, bool init,
               bool dfin, uint64_t seed) {
  Case k;
  k.C = C;
  k.W = W;
  k.cu = std::move(cu);
  k.bias = bias;
  k.silu = silu;
  k.init = init;
  k.dfin = dfin;
  const int64_t T = k.T(), N = k.N(), S = W - 1;
  auto r = [](const OwnedTensor& t) { return testing::rounded(t, DType::F32); };
  k.x = r(randn({T, C}, seed, 1.5));
  k.w = r(randn({C, W}, seed + 1, 0.5));
  k.b = r(randn({C}, seed + 2, 0.3));
  k.s0 = r(randn({N, C, S}, seed + 3));
  k.dy = r(randn({T, C}, seed + 4));
  k.dsN = r(randn({N, C, S}, seed + 5));
  return k;
}

struct Out {
  OwnedTensor y, fin, dx, dw, db, dinit;
};

OwnedTensor conv(const OwnedTensor& t, DType dt) { return convert(t, dt); }
Tensor opt(bool on, const OwnedTensor& t) { return on ? t.view() : Tensor(); }

// Forward + backward on `dt` (F64 -> ref, F32 -> cpu). Accumulated gradients start at zero.
Out run(const Case& k, DType dt) {
  const int64_t T = k.T(), N = k.N(), C = k.C, S = k.W - 1;
  const DType gt = causal_conv1d_grad_dtype(dt);
  OwnedTensor x = conv(k.x, dt), w = conv(k.w, dt), b = conv(k.b, dt), s0 = conv(k.s0, dt),
              dy = conv(k.dy, dt), dsN = conv(k.dsN, dt), cu = testing::i32_tensor(k.cu);
  Out o{OwnedTensor::zeros(dt, {T, C}), OwnedTensor::zeros(dt, {N, C, S}),
        OwnedTensor::zeros(dt, {T, C}), OwnedTensor::zeros(gt, {C, k.W}),
        OwnedTensor::zeros(gt, {C}),    OwnedTensor::zeros(dt, {N, C, S})};
  const Tensor cuv = opt(k.use_cu, cu);
  causal_conv1d_forward({x, w, opt(k.bias, b), cuv, opt(k.init, s0), o.y, o.fin, k.silu});
  causal_conv1d_backward({x, w, opt(k.bias, b), cuv, opt(k.init, s0), dy, opt(k.dfin, dsN), o.dx,
                          o.dw, opt(k.bias, o.db), opt(k.init, o.dinit), k.silu});
  return o;
}

// Random document lengths in [lo, hi].
std::vector<int32_t> random_cu(int n, int lo, int hi, uint64_t seed) {
  std::vector<int32_t> cu = {0};
  for (int i = 0; i < n; ++i)
    cu.push_back(cu.back() + lo + static_cast<int32_t>(rng::bits(seed, 9, i) % (hi - lo + 1)));
  return cu;
}

// Document layouts: 0 one document shorter than W (or 1 token for W = 1); 1 six 1-token
// documents; 2 mixed with zero-length documents at the start, middle and end; 3 fifty documents
// of 0..12 tokens; 4 one document of 300 tokens; 5 documents that start just before the cpu
// backward's 256-token chunk boundaries and cross them.
std::vector<int32_t> layout(int which, int64_t W) {
  switch (which) {
    case 0:
      return {0, static_cast<int32_t>(std::max<int64_t>(1, W - 1))};
    case 1:
      return {0, 1, 2, 3, 4, 5, 6};
    case 2:
      return {0, 0, 3, 3, 4, 11, 11, 30, 30};
    case 3:
      return random_cu(50, 0, 12, 77);
    case 4:
      return {0, 300};
    default:
      return {0, 254, 257, 511, 515, 530};
  }
}

// One test per (W, layout); the eight option combinations (bias, SiLU, initial state with its
// final-state gradient) run inside it, to keep the number of test processes small.
class ConvSweep : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

TEST_P(ConvSweep, CpuMatchesRef) {
  auto [W, lay] = GetParam();
  for (int flags = 0; flags < 8; ++flags) {
    const bool bias = flags & 1, silu = flags & 2, state = flags & 4;
    SCOPED_TRACE(fmt::format("bias={} silu={} state={}", bias, silu, state));
    // 300 channels (layout 5): one full 256-channel cpu backward block and a partial one.
    Case k = make_case(lay == 5 ? 300 : 70, W, layout(lay, W), bias, silu, state, state,
                       1000 + W * 31 + lay * 7 + flags);
    Out ref = run(k, DType::F64), cpu = run(k, DType::F32);
    testing::expect_close(cpu.y, ref.y, 1e-6, "y");
    testing::expect_close(cpu.fin, ref.fin, 0.0, "final_state");  // copies of inputs: exact
    testing::expect_close(cpu.dx, ref.dx, 1e-6, "dx");
    testing::expect_close(cpu.dw, ref.dw, 2e-6, "dweight");
    if (bias) {
      testing::expect_close(cpu.db, ref.db, 2e-6, "dbias");
    }
    if (state) {
      testing::expect_close(cpu.dinit, ref.dinit, 1e-6, "dinitial_state");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ConvSweep,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Range(0, 6)));

// A packed batch gives the same outputs and gradients as its documents run one by one (without
// cu_seqlens, each with its own slice of the initial state). Exact on cpu for everything that is
// not a sum over documents; dweight / dbias (accumulated over the documents) agree to rounding.
TEST(CausalConv1d, PackedEqualsDocumentsOneByOne) {
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t C = 67, W = 4, S = W - 1;
    Case k = make_case(C, W, {0, 5, 6, 6, 8, 40, 41}, true, true, true, true, 5);
    Out packed = run(k, dt);
    const DType gt = causal_conv1d_grad_dtype(dt);
    auto dw = OwnedTensor::zeros(gt, {C, W}), db = OwnedTensor::zeros(gt, {C});
    const int64_t N = k.N();
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = k.cu[n], L = k.cu[n + 1] - s;
      SCOPED_TRACE("document " + std::to_string(n));
      auto x = conv(k.x, dt), dy = conv(k.dy, dt), w = conv(k.w, dt), b = conv(k.b, dt);
      auto s0 = conv(k.s0, dt), dsN = conv(k.dsN, dt);
      const Tensor xs = x.view().slice0(s, s + L), dys = dy.view().slice0(s, s + L);
      const Tensor s0n = s0.view().slice0(n, n + 1), dsNn = dsN.view().slice0(n, n + 1);
      auto y = OwnedTensor::zeros(dt, {L, C}), dx = OwnedTensor::zeros(dt, {L, C});
      auto fin = OwnedTensor::zeros(dt, {1, C, S}), dinit = OwnedTensor::zeros(dt, {1, C, S});
      causal_conv1d_forward({xs, w, b, Tensor(), s0n, y, fin, true});
      causal_conv1d_backward({xs, w, b, Tensor(), s0n, dys, dsNn, dx, dw, db, dinit, true});
      EXPECT_EQ(to_f64_vector(y), to_f64_vector(packed.y.view().slice0(s, s + L)));
      EXPECT_EQ(to_f64_vector(dx), to_f64_vector(packed.dx.view().slice0(s, s + L)));
      EXPECT_EQ(to_f64_vector(fin), to_f64_vector(packed.fin.view().slice0(n, n + 1)));
      EXPECT_EQ(to_f64_vector(dinit), to_f64_vector(packed.dinit.view().slice0(n, n + 1)));
    }
    const double tol = dt == DType::F64 ? 1e-14 : 1e-6;
    testing::expect_close(dw, packed.dw, tol, "dweight");
    testing::expect_close(db, packed.db, tol, "dbias");
  }
}

// Tap W-1 multiplies the current token, tap 0 the oldest; positions before a document read its
// initial state (oldest column first) or zeros; no output reads another document.
TEST(CausalConv1d, TapAndStateConventions) {
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t C = 1, W = 4, S = 3;
    // Documents [10, 20] and [30, 40, 50] of one channel.
    auto x = from_f64(std::vector<double>{10, 20, 30, 40, 50}, dt, {5, C});
    auto cu = testing::i32_tensor({0, 2, 5});
    auto s0 = from_f64(std::vector<double>{1, 2, 3, 4, 5, 6}, dt, {2, C, S});
    auto run_taps = [&](std::vector<double> taps, bool with_state) {
      auto w = from_f64(taps, dt, {C, W});
      auto y = OwnedTensor::zeros(dt, {5, C});
      auto fin = OwnedTensor::zeros(dt, {2, C, S});
      causal_conv1d_forward({x, w, Tensor(), cu, with_state ? s0.view() : Tensor(), y, fin, false});
      return std::pair{to_f64_vector(y), to_f64_vector(fin)};
    };
    // Only the current-token tap: y = x.
    EXPECT_EQ(run_taps({0, 0, 0, 1}, true).first, (std::vector<double>{10, 20, 30, 40, 50}));
    // Only the oldest tap: y[t] = input 3 positions back = state columns 0, 1 of each document.
    EXPECT_EQ(run_taps({1, 0, 0, 0}, true).first, (std::vector<double>{1, 2, 4, 5, 6}));
    EXPECT_EQ(run_taps({1, 0, 0, 0}, false).first, (std::vector<double>{0, 0, 0, 0, 0}));
    // Tap 2 (one back): document 2's first token reads its state's last column, never 20.
    EXPECT_EQ(run_taps({0, 0, 1, 0}, true).first, (std::vector<double>{3, 10, 6, 30, 40}));
    EXPECT_EQ(run_taps({0, 0, 1, 0}, false).first, (std::vector<double>{0, 10, 0, 30, 40}));
    // Final state: the last W-1 inputs, oldest first; document 1 is shorter than W-1 and keeps
    // the newest state column (or a zero) in front.
    EXPECT_EQ(run_taps({0, 0, 0, 1}, true).second, (std::vector<double>{3, 10, 20, 30, 40, 50}));
    EXPECT_EQ(run_taps({0, 0, 0, 1}, false).second, (std::vector<double>{0, 10, 20, 30, 40, 50}));
  }
}

// Zero-length documents: no output, final state = initial state (or zeros), d initial state =
// d final state.
TEST(CausalConv1d, ZeroLengthDocuments) {
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t C = 5, W = 3, S = 2;
    Case k = make_case(C, W, {0, 0, 4, 4, 4, 6, 6}, true, true, true, true, 9);
    Out o = run(k, dt);
    auto s0 = to_f64_vector(k.s0), dsN = to_f64_vector(k.dsN);
    auto fin = to_f64_vector(o.fin), dinit = to_f64_vector(o.dinit);
    for (int64_t n : {0, 2, 3, 5})
      for (int64_t i = n * C * S; i < (n + 1) * C * S; ++i) {
        EXPECT_EQ(fin[i], s0[i]) << "document " << n;
        EXPECT_EQ(dinit[i], dsN[i]) << "document " << n;
      }
    k.init = false;
    Out z = run(k, dt);
    auto fin0 = to_f64_vector(z.fin);
    for (int64_t i = 0; i < C * S; ++i) EXPECT_EQ(fin0[i], 0.0);
  }
  // An empty batch: T = 0 with one zero-length document, and T = 0 with no document at all.
  for (auto cu : {std::vector<int32_t>{0, 0}, std::vector<int32_t>{0}}) {
    Case k = make_case(3, 4, cu, true, true, true, true, 10);
    Out cpu = run(k, DType::F32), ref = run(k, DType::F64);
    EXPECT_EQ(to_f64_vector(cpu.fin), to_f64_vector(k.s0));
    EXPECT_EQ(to_f64_vector(ref.dinit), to_f64_vector(k.dsN));
    EXPECT_EQ(to_f64_vector(cpu.dw), std::vector<double>(12, 0.0));
  }
}

// Any finite input is accepted: SiLU saturates (silu(z) -> 0 for z -> -inf, -> z for z -> +inf)
// without inf/NaN in y or in the gradients, and cpu's vectorised exp agrees with ref there.
TEST(CausalConv1d, ExtremeFiniteInputs) {
  const std::vector<double> xs = {-1e30, -3e38, -100, -88.5, -87, -20, 0, 20, 87, 88.5, 100, 1e30};
  const int64_t T = static_cast<int64_t>(xs.size()), C = 1, W = 2;
  Case k = make_case(C, W, {0, static_cast<int32_t>(T)}, false, true, false, false, 11);
  k.x = testing::rounded(from_f64(xs, DType::F64, {T, C}), DType::F32);
  k.w = from_f64(std::vector<double>{0.0, 1.0}, DType::F64, {C, W});  // y = silu(x)
  Out ref = run(k, DType::F64), cpu = run(k, DType::F32);
  const auto yr = to_f64_vector(ref.y), yc = to_f64_vector(cpu.y);
  const auto dr = to_f64_vector(ref.dx), dc = to_f64_vector(cpu.dx);
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_NEAR(yc[i], yr[i], 1e-6 * std::abs(yr[i]) + 1e-30) << "y at x = " << xs[i];
    EXPECT_NEAR(dc[i], dr[i], 1e-6 * std::abs(dr[i]) + 1e-30) << "dx at x = " << xs[i];
  }
  EXPECT_EQ(yc.back(), 1e30f);
  testing::expect_close(cpu.dw, ref.dw, 1e-6, "dweight");
}

TEST(CausalConv1d, RefGradientsMatchFiniteDifferences) {
  for (int64_t W : {1, 2, 4}) {
    for (bool silu : {false, true}) {
      SCOPED_TRACE("W=" + std::to_string(W) + " silu=" + std::to_string(silu));
      const int64_t C = 3, S = W - 1;
      Case k = make_case(C, W, {0, 1, 1, 3, 9}, true, silu, true, true, 60 + W);
      Out g = run(k, DType::F64);
      // loss = <y, dy> + <final_state, dfinal_state>
      auto cu = testing::i32_tensor(k.cu);
      auto loss = [&] {
        auto y = OwnedTensor::zeros(DType::F64, {k.T(), C});
        auto fin = OwnedTensor::zeros(DType::F64, {k.N(), C, S});
        causal_conv1d_forward({k.x, k.w, k.b, cu, k.s0, y, fin, silu});
        return testing::dot(y, k.dy) + testing::dot(fin, k.dsN);
      };
      EXPECT_LE(testing::fd_check(loss, k.x, g.dx), 1e-7) << "dx";
      EXPECT_LE(testing::fd_check(loss, k.w, g.dw), 1e-7) << "dweight";
      EXPECT_LE(testing::fd_check(loss, k.b, g.db), 1e-7) << "dbias";
      if (S > 0) {
        EXPECT_LE(testing::fd_check(loss, k.s0, g.dinit), 1e-7) << "dinitial_state";
      }
    }
  }
}

TEST(CausalConv1d, BackwardAccumulatesAndWritesWhatItShould) {
  Case k = make_case(9, 4, {0, 3, 20}, true, true, true, true, 70);
  Out once = run(k, DType::F32);
  auto x = conv(k.x, DType::F32), w = conv(k.w, DType::F32), b = conv(k.b, DType::F32),
       s0 = conv(k.s0, DType::F32), dy = conv(k.dy, DType::F32), dsN = conv(k.dsN, DType::F32);
  auto cu = testing::i32_tensor(k.cu);
  auto dw = convert(once.dw, DType::F32), db = convert(once.db, DType::F32);
  // dx and dinitial_state start from garbage: they must be overwritten.
  auto dx = from_f64(std::vector<double>(20 * 9, 123.0), DType::F32, {20, 9});
  auto dinit = from_f64(std::vector<double>(2 * 9 * 3, -7.0), DType::F32, {2, 9, 3});
  causal_conv1d_backward({x, w, b, cu, s0, dy, dsN, dx, dw, db, dinit, true});
  auto a = to_f64_vector(dw), a1 = to_f64_vector(once.dw);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], 2 * a1[i]);
  auto c = to_f64_vector(db), c1 = to_f64_vector(once.db);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], 2 * c1[i]);
  EXPECT_EQ(to_f64_vector(dx), to_f64_vector(once.dx));
  EXPECT_EQ(to_f64_vector(dinit), to_f64_vector(once.dinit));
}

TEST(CausalConv1d, CpuIsDeterministicAcrossThreadCounts) {
  Case k = make_case(200, 4, random_cu(20, 0, 40, 3), true, true, true, true, 80);
  const int keep = omp_get_max_threads();
  omp_set_num_threads(1);
  Out one = run(k, DType::F32);
  omp_set_num_threads(3);
  Out three = run(k, DType::F32);
  omp_set_num_threads(keep);
  EXPECT_EQ(to_f64_vector(one.dw), to_f64_vector(three.dw));
  EXPECT_EQ(to_f64_vector(one.db), to_f64_vector(three.db));
  EXPECT_EQ(to_f64_vector(one.dx), to_f64_vector(three.dx));
  EXPECT_EQ(to_f64_vector(one.y), to_f64_vector(three.y));
}

using testing::expect_error;

TEST(CausalConv1d, BadInputIsAClearError) {
  const int64_t T = 6, C = 4, W = 4;
  auto z = [](std::initializer_list<int64_t> s, DType dt = DType::F32) {
    return OwnedTensor::zeros(dt, s);
  };
  auto x = z({T, C}), w = z({C, W}), y = z({T, C}), b = z({C});
  auto cu = testing::i32_tensor({0, 2, 6});
  auto fwd = [&](Tensor wt, Tensor cus, Tensor init = Tensor(), Tensor fin = Tensor()) {
    causal_conv1d_forward({x, wt, b, cus, init, y, fin, true});
  };
  expect_error(
      [&] {
        fwd(z({C, 9}), cu);
      },
      "causal_conv1d: tensor 'weight' has shape [4, 9]: width W = 9 is outside 1..8");
  expect_error([&] { fwd(z({C, 0}), cu); }, "width W = 0 is outside 1..8");
  expect_error(
      [&] {
        fwd(z({C + 1, W}), cu);
      },
      "causal_conv1d: tensor 'weight' has shape [5, 4], expected [4, *]");
  expect_error(
      [&] {
        fwd(w, testing::i32_tensor({1, 2, 6}));
      },
      "tensor 'cu_seqlens' must start at 0, got cu_seqlens[0] = 1");
  expect_error(
      [&] {
        fwd(w, testing::i32_tensor({0, 4, 3, 6}));
      },
      "tensor 'cu_seqlens' decreases at index 2: cu_seqlens[2] = 3 < cu_seqlens[1] = 4");
  expect_error(
      [&] {
        fwd(w, testing::i32_tensor({0, 2, 5}));
      },
      "tensor 'cu_seqlens' must end at T = 6 (the rows of 'x'), got cu_seqlens[2] = 5");
  expect_error([&] { fwd(w, testing::i32_tensor({0, 2, 7})); }, "got cu_seqlens[2] = 7");
  expect_error([&] { fwd(w, z({0}, DType::I32)); }, "tensor 'cu_seqlens' is empty");
  expect_error([&] { fwd(w, z({3}, DType::I64)); }, "tensor 'cu_seqlens' has dtype");
  expect_error(
      [&] {
        fwd(w, cu, z({2, C, W}));
      },
      "tensor 'initial_state' has shape [2, 4, 4], expected [2, 4, 3]");
  expect_error(
      [&] {
        fwd(w, cu, Tensor(), z({3, C, W - 1}));
      },
      "tensor 'final_state' has shape [3, 4, 3], expected [2, 4, 3]");
  expect_error(
      [&] {
        fwd(w, Tensor(), z({2, C, W - 1}));
      },
      "tensor 'initial_state' has shape [2, 4, 3], expected [1, 4, 3]");
  expect_error(
      [&] {
        causal_conv1d_forward({x, w, z({C + 2}), cu, {}, y, {}, true});
      },
      "tensor 'bias' has shape [6], expected [4]");
  expect_error(
      [&] {
        causal_conv1d_forward({x, w, b, cu, {}, z({T - 1, C}), {}, true});
      },
      "tensor 'y' has shape [5, 4], expected [6, 4]");
  expect_error(
      [&] {
        causal_conv1d_forward({x, z({C, W}, DType::F64), b, cu, {}, y, {}, true});
      },
      "tensor 'weight' has dtype");
  auto dx = z({T, C}), dw = z({C, W}), db = z({C}), dinit = z({2, C, W - 1});
  expect_error(
      [&] {
        causal_conv1d_backward({x, w, Tensor(), cu, {}, y, {}, dx, dw, db, {}, true});
      },
      "tensor 'dbias' was given but 'bias' was not");
  expect_error(
      [&] {
        causal_conv1d_backward({x, w, b, cu, Tensor(), y, {}, dx, dw, db, dinit, true});
      },
      "tensor 'dinitial_state' was given but 'initial_state' was not");
  expect_error(
      [&] {
        causal_conv1d_backward({x, w, b, cu, {}, y, {}, dx, z({C, 3}), db, {}, true});
      },
      "tensor 'dweight' has shape [4, 3], expected [4, 4]");
  expect_error(
      [&] {
        causal_conv1d_backward({x, w, b, cu, {}, y, {}, dx, Tensor(), db, {}, true});
      },
      "tensor 'dweight' is required");
  expect_error(
      [&] {
        causal_conv1d_backward({x, w, b, cu, {}, z({T, C + 1}), {}, dx, dw, db, {}, true});
      },
      "tensor 'dy' has shape [6, 5], expected [6, 4]");
  expect_error(
      [&] {
        causal_conv1d_backward(
            {x, w, b, testing::i32_tensor({0, 7, 6}), {}, y, {}, dx, dw, db, {}, true});
      },
      "tensor 'cu_seqlens' decreases at index 2");
}

// `gdntrain ops run causal_conv1d`: the file runner gives the same numbers as a direct call, on
// the cpu and ref backends, forward and backward, with HF's [C, 1, W] weight shape.
TEST(CausalConv1d, OpsRunMatchesDirectCall) {
  Case k = make_case(6, 4, {0, 2, 2, 9}, true, true, true, true, 90);
  auto f = [](const OwnedTensor& t) { return convert(t, DType::F32); };
  auto x = f(k.x), w = f(k.w), b = f(k.b), s0 = f(k.s0), dy = f(k.dy), dsN = f(k.dsN);
  auto cu = testing::i32_tensor(k.cu);
  const Tensor w3 = w.view().reshape({k.C, 1, k.W});
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/causal_conv1d_in.safetensors";
  const std::string out_path = dir + "/causal_conv1d_out.safetensors";
  write_safetensors(in_path, {{"x", x, {}, {}, nullptr, 0},
                              {"weight", w3, {}, {}, nullptr, 0},
                              {"bias", b, {}, {}, nullptr, 0},
                              {"cu_seqlens", cu, {}, {}, nullptr, 0},
                              {"initial_state", s0, {}, {}, nullptr, 0},
                              {"dy", dy, {}, {}, nullptr, 0},
                              {"dfinal_state", dsN, {}, {}, nullptr, 0}});
  for (Backend be : {Backend::Cpu, Backend::Ref}) {
    SCOPED_TRACE(std::string(backend_name(be)));
    OpRunResult r = run_op_file("causal_conv1d", be, in_path, out_path, true, {{"silu", 1}});
    EXPECT_EQ(r.written.size(), 6u);
    Out want = run(k, be == Backend::Ref ? DType::F64 : DType::F32);
    SafeTensorsFile out(out_path);
    const std::pair<const char*, const OwnedTensor*> names[] = {
        {"y", &want.y},        {"final_state", &want.fin}, {"dx", &want.dx},
        {"dweight", &want.dw}, {"dbias", &want.db},        {"dinitial_state", &want.dinit}};
    for (const auto& [name, t] : names)
      EXPECT_EQ(to_f64_vector(out.load(name, DType::F64)), to_f64_vector(*t)) << name;
  }
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
}

}  // namespace
}  // namespace gdn::ops
