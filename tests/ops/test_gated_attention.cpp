// Gated attention: cpu vs ref over swept shapes (forward, saved tensors and every gradient),
// hand-computed cases for ref's forward conventions, finite-difference checks of ref, packing
// (documents run together == run alone, RoPE positions restart per document), bad input, and
// `gdntrain ops run` through run_op_file.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "gdn/backend/op_run.h"
#include "gdn/core/safetensors.h"
#include "ops/gated_attention/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

// F64 inputs of one case (rounded through F32 so that ref and cpu see the same numbers).
struct Inputs {
  OwnedTensor qg, k, v, wq, wk, cu, dout;
  int64_t rot = 0;
  double theta = 1e4;
};

std::vector<int32_t> offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

Inputs make_inputs(const std::vector<int32_t>& lens, int64_t Hq, int64_t Hkv, int64_t hd,
                   int64_t rot, double theta, uint64_t seed) {
  const std::vector<int32_t> cu = offsets(lens);
  const int64_t T = cu.back();
  auto r = [](const OwnedTensor& t) { return testing::rounded(t, DType::F32); };
  return {r(randn({T, Hq, 2 * hd}, seed + 1, 1.5)),
          r(randn({T, Hkv, hd}, seed + 2)),
          r(randn({T, Hkv, hd}, seed + 3)),
          r(randn({hd}, seed + 4, 0.3)),
          r(randn({hd}, seed + 5, 0.3)),
          testing::i32_tensor(cu),
          r(randn({T, Hq, hd}, seed + 6)),
          rot,
          theta};
}

struct Result {
  OwnedTensor o, q_hat, k_hat, attn, lse, q_rstd, k_rstd;  // forward
  OwnedTensor dqg, dk, dv, dwq, dwk;                       // backward
};

// Forward (and backward unless fwd_only) of `in` on tensors of `dt` (F64 -> ref, F32 -> cpu).
Result run(const Inputs& in, DType dt, bool fwd_only = false) {
  const int64_t T = in.qg.view().size(0), Hq = in.qg.view().size(1), Hkv = in.k.view().size(1),
                hd = in.k.view().size(2);
  const DType st = gated_attention_stat_dtype(dt);
  OwnedTensor qg = convert(in.qg, dt), k = convert(in.k, dt), v = convert(in.v, dt),
              wq = convert(in.wq, dt), wk = convert(in.wk, dt), dout = convert(in.dout, dt);
  Result r;
  r.o = OwnedTensor::zeros(dt, {T, Hq, hd});
  r.q_hat = OwnedTensor::zeros(dt, {T, Hq, hd});
  r.k_hat = OwnedTensor::zeros(dt, {T, Hkv, hd});
  r.attn = OwnedTensor::zeros(dt, {T, Hq, hd});
  r.lse = OwnedTensor::zeros(st, {T, Hq});
  r.q_rstd = OwnedTensor::zeros(st, {T, Hq});
  r.k_rstd = OwnedTensor::zeros(st, {T, Hkv});
  gated_attention_forward({qg, k, v, wq, wk, in.cu, r.o, r.q_hat, r.k_hat, r.attn, r.lse, r.q_rstd,
                           r.k_rstd, in.rot, in.theta, 1e-6});
  if (fwd_only) return r;
  // Garbage in the `=` outputs must be overwritten; the `+=` outputs start at zero.
  r.dqg = OwnedTensor::empty(dt, {T, Hq, 2 * hd});
  r.dk = OwnedTensor::empty(dt, {T, Hkv, hd});
  r.dv = OwnedTensor::empty(dt, {T, Hkv, hd});
  for (const OwnedTensor* t : {&r.dqg, &r.dk, &r.dv}) rng::fill_normal(*t, 99, 1, 0.0, 1e3);
  r.dwq = OwnedTensor::zeros(st, {hd});
  r.dwk = OwnedTensor::zeros(st, {hd});
  gated_attention_backward({qg,      k,      v,     wq,       wk,       in.cu,    r.q_hat,
                            r.k_hat, r.attn, r.lse, r.q_rstd, r.k_rstd, dout,     r.dqg,
                            r.dk,    r.dv,   r.dwq, r.dwk,    in.rot,   in.theta, 1e-6});
  return r;
}

struct SweepCase {
  const char* name;
  std::vector<int32_t> lens;
  int64_t Hq, Hkv, hd;
  double factor;
  double theta;
};

void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

class GatedAttentionSweep : public ::testing::TestWithParam<SweepCase> {};

TEST_P(GatedAttentionSweep, CpuMatchesRef) {
  const SweepCase& c = GetParam();
  const int64_t rot = gated_attention_rotary_dim(c.hd, c.factor);
  Inputs in = make_inputs(c.lens, c.Hq, c.Hkv, c.hd, rot, c.theta, 7 * c.hd + c.Hq);
  Result ref = run(in, DType::F64);
  Result cpu = run(in, DType::F32);
  const double tf = 1e-6, tb = 3e-6;
  // dq_hat, dk_hat and the norm-weight gradients are built from dS = P o (dP - D), which cancels
  // to 0 for a query that sees one key (P = 1, dP = D): with only one-token documents they are 0
  // exactly, and what the fp32 kernel returns is rounding noise of the size of dP's terms (which
  // OpenBLAS kernel set computes dP decides whether it cancels to 0 or to 1e-8). Measure them
  // against the norm of dv = P^T dA, a gradient of the same chain that does not cancel; a wrong
  // term still shows at O(1) against it.
  const double ds_scale = testing::l2(ref.dv);
  struct Cmp {
    const OwnedTensor *got, *want;
    const char* what;
    double tol;
    double scale;
  };
  const Cmp cmps[] = {{&cpu.o, &ref.o, "o", tf, 0},
                      {&cpu.q_hat, &ref.q_hat, "q_hat", tf, 0},
                      {&cpu.k_hat, &ref.k_hat, "k_hat", tf, 0},
                      {&cpu.attn, &ref.attn, "attn", tf, 0},
                      {&cpu.lse, &ref.lse, "lse", tf, 0},
                      {&cpu.q_rstd, &ref.q_rstd, "q_rstd", tf, 0},
                      {&cpu.k_rstd, &ref.k_rstd, "k_rstd", tf, 0},
                      {&cpu.dqg, &ref.dqg, "dqg", tb, 0},
                      {&cpu.dk, &ref.dk, "dk", tb, ds_scale},
                      {&cpu.dv, &ref.dv, "dv", tb, 0},
                      {&cpu.dwq, &ref.dwq, "dq_norm_w", tb, ds_scale},
                      {&cpu.dwk, &ref.dwk, "dk_norm_w", tb, ds_scale}};
  double worst_fwd = 0, worst_bwd = 0;  // printed for the record
  for (const Cmp& x : cmps) {
    testing::expect_close(*x.got, *x.want, x.tol, x.what, x.scale);
    double& w = x.tol == tf ? worst_fwd : worst_bwd;
    w = std::max(w, testing::rel_err(*x.got, *x.want, x.scale));
  }
  std::printf("%s: worst relative L2 error cpu vs ref: forward %.3g, backward %.3g\n", c.name,
              worst_fwd, worst_bwd);
  // The query and gate halves of dqg separately (the gate half alone must not hide the other).
  auto half = [&](const Tensor& t, int64_t part) {
    const int64_t T = t.size(0), H = t.size(1), hd = t.size(2) / 2;
    auto all = to_f64_vector(t);
    std::vector<double> out;
    for (int64_t i = 0; i < T * H; ++i)
      out.insert(out.end(), all.begin() + (2 * i + part) * hd,
                 all.begin() + (2 * i + part + 1) * hd);
    return out;
  };
  for (int64_t part : {0, 1}) {
    const std::vector<double> got = half(cpu.dqg, part), want = half(ref.dqg, part);
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      num += (got[i] - want[i]) * (got[i] - want[i]);
      den += want[i] * want[i];
    }
    // The query half is dq_hat's (ds_scale, above); the gate half does not cancel.
    const double e = std::sqrt(num) / std::max({std::sqrt(den), part ? 0.0 : ds_scale, 1e-300});
    EXPECT_LE(e, tb) << (part ? "dqg gate half" : "dqg query half");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GatedAttentionSweep,
    ::testing::Values(SweepCase{"OneToken", {1}, 2, 1, 16, 0.25, 1e4},
                      SweepCase{"OneDocPartialBlock", {100}, 4, 2, 16, 0.25, 1e4},
                      SweepCase{"ManyDocsGqa4", {1, 65, 3, 1, 130}, 4, 1, 16, 0.25, 1e4},
                      SweepCase{"Hd64Gqa1", {70, 1, 20}, 2, 2, 64, 0.25, 1e7},
                      SweepCase{"Hd64Gqa4HalfRope", {129, 2}, 4, 1, 64, 0.5, 1e4},
                      SweepCase{"Gqa2FullRope", {64, 64, 1}, 4, 2, 16, 1.0, 1e4},
                      SweepCase{"NoRope", {33, 31}, 2, 1, 16, 0.0, 1e4},
                      SweepCase{"EmptyDocument", {5, 0, 7, 0}, 2, 2, 16, 0.25, 1e4}),
    [](const ::testing::TestParamInfo<SweepCase>& i) { return std::string(i.param.name); });

// --- ref's forward conventions, checked against formulas written out here ---------------------

// q_hat of a token at position 3 of its document: zero-centred RMSNorm, then rotate-half on the
// first rot dims with θ_i = p · theta^(−2i/rot).
TEST(GatedAttention, RefQueryNormAndRopeMatchFormula) {
  const int64_t hd = 8, rot = 4;
  Inputs in = make_inputs({2, 5}, 1, 1, hd, rot, 100.0, 3);
  Result r = run(in, DType::F64, true);
  const int64_t t = 2 + 3;  // document 1, position 3
  auto qg = to_f64_vector(in.qg), w = to_f64_vector(in.wq), qh = to_f64_vector(r.q_hat);
  const double* x = qg.data() + t * 2 * hd;  // [hd] query part
  double ss = 0;
  for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
  const double rs = 1 / std::sqrt(ss / hd + 1e-6);
  std::vector<double> u(hd), want(hd);
  for (int64_t i = 0; i < hd; ++i) u[i] = want[i] = x[i] * rs * (1 + w[i]);
  for (int64_t i = 0; i < 2; ++i) {
    const double th = 3.0 * std::pow(100.0, -2.0 * i / 4.0);
    want[i] = u[i] * std::cos(th) - u[i + 2] * std::sin(th);
    want[i + 2] = u[i + 2] * std::cos(th) + u[i] * std::sin(th);
  }
  for (int64_t i = 0; i < hd; ++i) EXPECT_NEAR(qh[t * hd + i], want[i], 1e-14) << i;
  EXPECT_NEAR(to_f64_vector(r.q_rstd)[t], rs, 1e-14);
}

// Single-token documents: softmax over one key, so attn = v of the head's kv group (h / 2 with
// Hq = 4, Hkv = 2) and o = v ⊙ σ(gate).
TEST(GatedAttention, RefOneTokenDocumentsGiveGatedValues) {
  const int64_t Hq = 4, Hkv = 2, hd = 6;
  Inputs in = make_inputs({1, 1, 1}, Hq, Hkv, hd, 2, 1e4, 5);
  Result r = run(in, DType::F64, true);
  auto qg = to_f64_vector(in.qg), v = to_f64_vector(in.v), o = to_f64_vector(r.o);
  for (int64_t t = 0; t < 3; ++t)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < hd; ++i) {
        const double g = qg[(t * Hq + h) * 2 * hd + hd + i];
        EXPECT_NEAR(o[(t * Hq + h) * hd + i], v[(t * Hkv + h / 2) * hd + i] / (1 + std::exp(-g)),
                    1e-14);
      }
}

// Second token of a 2-token document: attn = (e^{s0} v0 + e^{s1} v1) / (e^{s0} + e^{s1}) with
// s_u = <q_hat_1, k_hat_u> / sqrt(hd); the first token sees only itself.
TEST(GatedAttention, RefTwoTokenSoftmaxMatchesFormula) {
  const int64_t hd = 4;
  Inputs in = make_inputs({2}, 1, 1, hd, 4, 10.0, 6);
  Result r = run(in, DType::F64, true);
  auto qh = to_f64_vector(r.q_hat), kh = to_f64_vector(r.k_hat), v = to_f64_vector(in.v);
  auto at = to_f64_vector(r.attn), lse = to_f64_vector(r.lse);
  double s[2] = {0, 0};
  for (int u = 0; u < 2; ++u)
    for (int64_t i = 0; i < hd; ++i) s[u] += qh[hd + i] * kh[u * hd + i] / 2.0;
  const double z = std::exp(s[0]) + std::exp(s[1]);
  for (int64_t i = 0; i < hd; ++i) {
    EXPECT_NEAR(at[i], v[i], 1e-14);
    EXPECT_NEAR(at[hd + i], (std::exp(s[0]) * v[i] + std::exp(s[1]) * v[hd + i]) / z, 1e-13);
  }
  EXPECT_NEAR(lse[1], std::log(z), 1e-13);
}

// --- gradients -----------------------------------------------------------------------------

TEST(GatedAttention, RefGradientsMatchFiniteDifferences) {
  // Documents of 3, 1 and 3 tokens; grouped heads; partial RoPE with a small base so it matters.
  Inputs in = make_inputs({3, 1, 3}, 4, 2, 8, 4, 100.0, 11);
  Result g = run(in, DType::F64);
  auto loss = [&] {
    Result r = run(in, DType::F64, true);
    return testing::dot(r.o, in.dout);
  };
  const double e[5] = {testing::fd_check(loss, in.qg, g.dqg, 1e-6, 96),
                       testing::fd_check(loss, in.k, g.dk), testing::fd_check(loss, in.v, g.dv),
                       testing::fd_check(loss, in.wq, g.dwq),
                       testing::fd_check(loss, in.wk, g.dwk)};
  const char* names[5] = {"dqg", "dk", "dv", "dq_norm_w", "dk_norm_w"};
  for (int i = 0; i < 5; ++i) {
    std::printf("finite differences vs ref %s: %.3g\n", names[i], e[i]);
    EXPECT_LE(e[i], 1e-8) << names[i];
  }
}

TEST(GatedAttention, CpuBackwardAccumulatesNormWeightGrads) {
  Inputs in = make_inputs({9, 4}, 2, 1, 8, 2, 1e4, 12);
  Result once = run(in, DType::F32);
  OwnedTensor qg = convert(in.qg, DType::F32), k = convert(in.k, DType::F32),
              v = convert(in.v, DType::F32), wq = convert(in.wq, DType::F32),
              wk = convert(in.wk, DType::F32), dout = convert(in.dout, DType::F32);
  OwnedTensor dwq = convert(once.dwq, DType::F32), dwk = convert(once.dwk, DType::F32);
  OwnedTensor dqg = OwnedTensor::zeros(DType::F32, {13, 2, 16});
  OwnedTensor dk = OwnedTensor::zeros(DType::F32, {13, 1, 8}),
              dv = OwnedTensor::zeros(DType::F32, {13, 1, 8});
  gated_attention_backward({qg,         k,          v,         wq,       wk,          in.cu,
                            once.q_hat, once.k_hat, once.attn, once.lse, once.q_rstd, once.k_rstd,
                            dout,       dqg,        dk,        dv,       dwq,         dwk,
                            in.rot,     in.theta,   1e-6});
  for (auto [acc, one] : {std::pair{&dwq, &once.dwq}, {&dwk, &once.dwk}}) {
    auto a = to_f64_vector(*acc), b = to_f64_vector(*one);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], 2 * b[i], 1e-5 * (1 + std::abs(b[i])));
  }
  EXPECT_EQ(to_f64_vector(dqg), to_f64_vector(once.dqg));  // `=` outputs: deterministic
}

// --- packing ---------------------------------------------------------------------------------

// Rows [b, e) of a [T, ...] tensor as doubles.
std::vector<double> rows(const Tensor& t, int64_t b, int64_t e) {
  auto all = to_f64_vector(t);
  const int64_t per = t.numel() / std::max<int64_t>(t.size(0), 1);
  return {all.begin() + b * per, all.begin() + e * per};
}

// Inputs of document [b, e) of `in` as a batch of its own.
Inputs slice_doc(const Inputs& in, int64_t b, int64_t e) {
  auto cut = [&](const OwnedTensor& t) {
    std::vector<double> r = rows(t, b, e);
    std::vector<int64_t> shape = t.view().shape_vec();
    shape[0] = e - b;
    return from_f64(r, DType::F64, shape);
  };
  return {cut(in.qg),
          cut(in.k),
          cut(in.v),
          convert(in.wq, DType::F64),
          convert(in.wk, DType::F64),
          testing::i32_tensor({0, static_cast<int32_t>(e - b)}),
          cut(in.dout),
          in.rot,
          in.theta};
}

TEST(GatedAttention, PackedBatchEqualsDocumentsRunAlone) {
  const std::vector<int32_t> lens{40, 1, 70, 3};
  const std::vector<int32_t> cu = offsets(lens);
  Inputs in = make_inputs(lens, 4, 2, 16, 4, 1e4, 21);
  for (DType dt : {DType::F64, DType::F32}) {
    Result packed = run(in, dt);
    std::vector<double> dwq(16, 0.0), dwk(16, 0.0);
    const double tol = dt == DType::F64 ? 1e-12 : 2e-6;
    for (size_t n = 0; n < lens.size(); ++n) {
      Result alone = run(slice_doc(in, cu[n], cu[n + 1]), dt);
      const std::string doc =
          " of document " + std::to_string(n) + (dt == DType::F64 ? " (ref)" : " (cpu)");
      for (auto [p, a, what] : {std::tuple{&packed.o, &alone.o, "o"},
                                {&packed.lse, &alone.lse, "lse"},
                                {&packed.q_hat, &alone.q_hat, "q_hat"},
                                {&packed.k_hat, &alone.k_hat, "k_hat"},
                                {&packed.dqg, &alone.dqg, "dqg"},
                                {&packed.dk, &alone.dk, "dk"},
                                {&packed.dv, &alone.dv, "dv"}}) {
        double e = rel_l2_error(rows(*p, cu[n], cu[n + 1]), to_f64_vector(*a));
        EXPECT_LE(e, tol) << what << doc;
      }
      auto aq = to_f64_vector(alone.dwq), ak = to_f64_vector(alone.dwk);
      for (int i = 0; i < 16; ++i) dwq[i] += aq[i], dwk[i] += ak[i];
    }
    EXPECT_LE(rel_l2_error(to_f64_vector(packed.dwq), dwq), 10 * tol) << "dq_norm_w";
    EXPECT_LE(rel_l2_error(to_f64_vector(packed.dwk), dwk), 10 * tol) << "dk_norm_w";
  }
}

// RoPE is relative, so a wrong absolute position leaves the scores almost unchanged: the check
// is on q_hat / k_hat themselves. The second document of a 2-document batch must give the
// same q_hat and k_hat as the document alone (positions restart at 0), and different ones from
// the same tokens at positions 30.. (the batch taken as one document).
TEST(GatedAttention, RopePositionsRestartPerDocument) {
  const std::vector<int32_t> lens{30, 12};
  Inputs in = make_inputs(lens, 2, 1, 16, 8, 1e4, 31);
  Inputs as_one = make_inputs(lens, 2, 1, 16, 8, 1e4, 31);
  as_one.cu = testing::i32_tensor({0, 42});
  Inputs second = slice_doc(in, 30, 42);
  for (DType dt : {DType::F64, DType::F32}) {
    Result packed = run(in, dt, true), one = run(as_one, dt, true), alone = run(second, dt, true);
    for (auto [p, o, a, what] : {std::tuple{&packed.q_hat, &one.q_hat, &alone.q_hat, "q_hat"},
                                 {&packed.k_hat, &one.k_hat, &alone.k_hat, "k_hat"}}) {
      EXPECT_LE(rel_l2_error(rows(*p, 30, 42), to_f64_vector(*a)), 1e-6) << what;
      EXPECT_GT(rel_l2_error(rows(*o, 30, 42), to_f64_vector(*a)), 0.1) << what;
    }
    EXPECT_LE(rel_l2_error(rows(packed.o, 30, 42), to_f64_vector(alone.o)), 1e-6);
    // Taken as one document, the second document's tokens also attend to the first one's.
    EXPECT_GT(rel_l2_error(rows(one.o, 30, 42), to_f64_vector(alone.o)), 0.05);
  }
}

// --- bad input -------------------------------------------------------------------------------

using testing::expect_error;

TEST(GatedAttention, BadInputIsAClearError) {
  const int64_t T = 6, Hq = 4, Hkv = 2, hd = 8;
  auto z = [](std::initializer_list<int64_t> s, DType dt = DType::F32) {
    return OwnedTensor::zeros(dt, s);
  };
  OwnedTensor qg = z({T, Hq, 2 * hd}), k = z({T, Hkv, hd}), v = z({T, Hkv, hd}), wq = z({hd}),
              wk = z({hd}), o = z({T, Hq, hd}), qh = z({T, Hq, hd}), kh = z({T, Hkv, hd}),
              at = z({T, Hq, hd}), lse = z({T, Hq}), qr = z({T, Hq}), kr = z({T, Hkv});
  OwnedTensor cu = testing::i32_tensor({0, 4, 6});
  GatedAttentionFwd good{qg, k, v, wq, wk, cu, o, qh, kh, at, lse, qr, kr, 2, 1e4, 1e-6};
  EXPECT_NO_THROW(gated_attention_forward(good));
  auto fwd = [&](auto edit, const std::string& needle) {
    GatedAttentionFwd a = good;
    edit(a);
    expect_error([&] { gated_attention_forward(a); }, needle);
  };
  OwnedTensor k5 = z({5, Hkv, hd}), v3 = z({T, 3, hd}), k3 = z({T, 3, hd}), k7 = z({T, Hkv, 7}),
              qg10 = z({T, Hq, 10}), w7 = z({7}), lse_bad = z({Hq, T}),
              v64 = z({T, Hkv, hd}, DType::F64);
  OwnedTensor cu1 = testing::i32_tensor({1, 4, 6}), cu_dec = testing::i32_tensor({0, 4, 2, 6}),
              cu_end = testing::i32_tensor({0, 4, 5}), cu_one = testing::i32_tensor({0});
  OwnedTensor cu64 = z({3}, DType::I64);
  fwd([&](auto& a) { a.k = k5; }, "tensor 'k' has shape [5, 2, 8], expected [6, *, *]");
  fwd([&](auto& a) { a.v = v3; }, "tensor 'v' has shape [6, 3, 8], expected [6, 2, 8]");
  fwd(
      [&](auto& a) {
        a.k = k3;
        a.v = v3;
      },
      "Hq = 4 query heads (tensor 'qg' dim 1) must be a "
      "positive multiple of Hkv = 3");
  fwd([&](auto& a) { a.k = k7; }, "head dim hd = 7 (tensor 'k' dim 2) must be even");
  fwd([&](auto& a) { a.qg = qg10; }, "tensor 'qg' has shape [6, 4, 10], expected [6, *, 16]");
  fwd([&](auto& a) { a.q_norm_w = w7; }, "tensor 'q_norm_w' has shape [7], expected [8]");
  fwd([&](auto& a) { a.v = v64; }, "tensor 'v' has dtype F64, expected F32");
  fwd([&](auto& a) { a.rotary_dim = 3; }, "rotary_dim = 3 must be even");
  fwd([&](auto& a) { a.rotary_dim = 10; }, "rotary_dim = 10 must be even and in [0, hd = 8]");
  fwd([&](auto& a) { a.cu_seqlens = cu1; }, "cu_seqlens[0] = 1, expected 0");
  fwd([&](auto& a) { a.cu_seqlens = cu_dec; }, "cu_seqlens[2] = 2 is less than cu_seqlens[1] = 4");
  fwd([&](auto& a) { a.cu_seqlens = cu_end; },
      "cu_seqlens[2] = 5 (the last offset) must equal T = 6");
  fwd([&](auto& a) { a.cu_seqlens = cu_one; }, "tensor 'cu_seqlens' has shape [1], expected [N+1]");
  fwd([&](auto& a) { a.cu_seqlens = cu64; }, "tensor 'cu_seqlens' has dtype I64, expected I32");
  fwd([&](auto& a) { a.lse = lse_bad; }, "tensor 'lse' has shape [4, 6], expected [6, 4]");
  fwd([&](auto& a) { a.eps = 0; }, "eps must be positive");
  expect_error([] { gated_attention_rotary_dim(256, 1.5); }, "partial_rotary_factor = 1.5");
  EXPECT_EQ(gated_attention_rotary_dim(256, 0.25), 64);
  EXPECT_EQ(gated_attention_rotary_dim(12, 0.25), 3);  // HF truncates; validation rejects it

  OwnedTensor d_o = z({T, Hq, hd}), dqg = z({T, Hq, 2 * hd}), dk = z({T, Hkv, hd}),
              dv = z({T, Hkv, hd}), dwq = z({hd}), dwk = z({hd});
  GatedAttentionBwd gb{qg, k,   v,   wq, wk, cu,  qh,  kh, at,  lse, qr,
                       kr, d_o, dqg, dk, dv, dwq, dwk, 2,  1e4, 1e-6};
  EXPECT_NO_THROW(gated_attention_backward(gb));
  auto bwd = [&](auto edit, const std::string& needle) {
    GatedAttentionBwd a = gb;
    edit(a);
    expect_error([&] { gated_attention_backward(a); }, needle);
  };
  OwnedTensor dwq64 = z({hd}, DType::F64), dqg_bad = z({T, Hq, hd});
  bwd([&](auto& a) { a.dq_norm_w = dwq64; }, "tensor 'dq_norm_w' has dtype F64, expected F32");
  bwd([&](auto& a) { a.dqg = dqg_bad; }, "tensor 'dqg' has shape [6, 4, 8], expected [6, 4, 16]");
  bwd([&](auto& a) { a.d_o = Tensor(); }, "tensor 'd_o' is required but was not given");
  bwd([&](auto& a) { a.cu_seqlens = cu_dec; }, "cu_seqlens[2] = 2 is less than");
}

// --- probe and `gdntrain ops run` --------------------------------------------------------------

TEST(GatedAttention, CpuPassesItsProbe) {
  Registry& reg = Registry::global();
  const ImplDesc* cpu = reg.impls("gated_attention", Backend::Cpu).at(0);
  EXPECT_EQ(cpu->name, "cpu.flash");
  const OpDesc& op = reg.op("gated_attention");
  ProbeError e = op.probe(*cpu, OpQuery{});
  ProbeError tol = op.tolerance(DType::F32);
  std::printf("gated_attention probe (cpu.flash): fwd %.3g, bwd %.3g\n", e.fwd, e.bwd);
  EXPECT_LE(e.fwd, tol.fwd);
  EXPECT_LE(e.bwd, tol.bwd);
  EXPECT_GT(e.bwd, 0.0);  // the probe really compared two computations
}

TEST(GatedAttention, OpsRunFromFileMatchesDirectCall) {
  Inputs in = make_inputs({5, 1, 9}, 2, 1, 8, 4, 1e4, 41);
  in.theta = 500.0;
  OwnedTensor qg = convert(in.qg, DType::F32), k = convert(in.k, DType::F32),
              v = convert(in.v, DType::F32), wq = convert(in.wq, DType::F32),
              wk = convert(in.wk, DType::F32), dout = convert(in.dout, DType::F32);
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/gated_attention_in.safetensors";
  const std::string out_path = dir + "/gated_attention_out.safetensors";
  write_safetensors(in_path,
                    {{"qg", qg, {}, {}, nullptr, 0},
                     {"k", k, {}, {}, nullptr, 0},
                     {"v", v, {}, {}, nullptr, 0},
                     {"q_norm_w", wq, {}, {}, nullptr, 0},
                     {"k_norm_w", wk, {}, {}, nullptr, 0},
                     {"cu_seqlens", in.cu, {}, {}, nullptr, 0},
                     {"do", dout, {}, {}, nullptr, 0}},
                    {{"partial_rotary_factor", "0.5"}});
  OpRunResult r = run_op_file("gated_attention", Backend::Cpu, in_path, out_path, true,
                              {{"rope_theta", 500.0}});
  EXPECT_EQ(r.impl, "cpu.flash");
  Result want = run(in, DType::F32);  // rot = 8 · 0.5 = 4, theta 500: the same as the file's
  SafeTensorsFile out(out_path);
  for (auto [name, t] : {std::pair{"o", &want.o},
                         {"lse", &want.lse},
                         {"dqg", &want.dqg},
                         {"dk", &want.dk},
                         {"dv", &want.dv},
                         {"dq_norm_w", &want.dwq},
                         {"dk_norm_w", &want.dwk}})
    EXPECT_EQ(to_f64_vector(out.load(name, DType::F32)), to_f64_vector(*t)) << name;
  // Without cu_seqlens the file is one document: compare with the op on cu = [0, T].
  write_safetensors(in_path, {{"qg", qg, {}, {}, nullptr, 0},
                              {"k", k, {}, {}, nullptr, 0},
                              {"v", v, {}, {}, nullptr, 0},
                              {"q_norm_w", wq, {}, {}, nullptr, 0},
                              {"k_norm_w", wk, {}, {}, nullptr, 0}});
  run_op_file("gated_attention", Backend::Ref, in_path, out_path, false,
              {{"rope_theta", 500.0}, {"partial_rotary_factor", 0.5}});
  in.cu = testing::i32_tensor({0, 15});
  Result one = run(in, DType::F64, true);
  SafeTensorsFile out2(out_path);
  EXPECT_LE(rel_l2_error(out2.load("o", DType::F64), one.o), 1e-15);
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
}

}  // namespace
}  // namespace gdn::ops
