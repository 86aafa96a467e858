// Gated delta rule: cpu (chunked WY/UT, fp32) vs ref (token recurrence, fp64) over swept shapes,
// forward and every gradient; packing; zero-length documents; grouped heads; finite differences of
// ref; the probe; `ops run`; bad input.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "gdn/backend/op_run.h"
#include "gdn/backend/registry.h"
#include "gdn/core/env.h"
#include "gdn/core/safetensors.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gdr_test_specs.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using gdr_test::common_sweep_specs;
using gdr_test::random_lens;
using gdr_test::Spec;
using testing::randn;
using testing::randu;
using testing::rounded;

// F64 host tensors whose values are exactly representable in F32, so ref and cpu see the same
// numbers. h0 / dhT are empty when the spec leaves them out.
struct Inputs {
  int64_t T = 0, N = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
  OwnedTensor q, k, v, g, beta, cu, h0, dout, dhT;
};

Inputs make_inputs(const Spec& s, bool l2) {
  Inputs in;
  std::vector<int32_t> cu{0};
  for (int32_t l : s.lens) cu.push_back(cu.back() + l);
  in.T = cu.back();
  in.N = static_cast<int64_t>(s.lens.size());
  in.Hk = s.Hk;
  in.Hv = s.Hk * s.r;
  in.dk = s.dk;
  in.dv = s.dv;
  const uint64_t sd = s.seed * 100;
  // Without the in-kernel l2norm keep |k|^2 ~ 0.5 so that (I - beta k k^T) stays a contraction.
  const double qk_std = l2 ? 1.0 : 0.7 / std::sqrt(static_cast<double>(s.dk));
  in.q = rounded(randn({in.T, in.Hk, in.dk}, sd + 1, qk_std), DType::F32);
  in.k = rounded(randn({in.T, in.Hk, in.dk}, sd + 2, qk_std), DType::F32);
  in.v = rounded(randn({in.T, in.Hv, in.dv}, sd + 3), DType::F32);
  in.g = rounded(randu({in.T, in.Hv}, sd + 4, s.g_lo, s.g_hi), DType::F32);
  in.beta = rounded(randu({in.T, in.Hv}, sd + 5, s.b_lo, s.b_hi), DType::F32);
  in.cu = testing::i32_tensor(cu);
  if (s.init) in.h0 = rounded(randn({in.N, in.Hv, in.dk, in.dv}, sd + 6, 0.5), DType::F32);
  in.dout = rounded(randn({in.T, in.Hv, in.dv}, sd + 7), DType::F32);
  if (s.dhT) in.dhT = rounded(randn({in.N, in.Hv, in.dk, in.dv}, sd + 8, 0.5), DType::F32);
  return in;
}

struct Result {
  OwnedTensor o, hT, dq, dk, dv, dg, dbeta, dh0;
};

OwnedTensor maybe(const OwnedTensor& t, DType dt) {
  return t.defined() ? convert(t, dt) : OwnedTensor();
}
Tensor view_or_empty(const OwnedTensor& t) { return t.defined() ? t.view() : Tensor(); }

// Forward and backward through the public entry points (validation + dispatch): F64 -> ref,
// F32 -> cpu.
// `saved` (op.h) is passed to both when given.
Result run(const Inputs& in, DType dt, bool l2, double scale = 0, bool backward = true,
           const Tensor& saved = Tensor()) {
  const DType st = gdr_state_dtype(dt);
  OwnedTensor q = convert(in.q, dt), k = convert(in.k, dt), v = convert(in.v, dt);
  OwnedTensor g = convert(in.g, st), beta = convert(in.beta, st);
  OwnedTensor h0 = maybe(in.h0, st), dout = convert(in.dout, dt), dhT = maybe(in.dhT, st);
  Result r{OwnedTensor::zeros(dt, {in.T, in.Hv, in.dv}),
           OwnedTensor::zeros(st, {in.N, in.Hv, in.dk, in.dv}),
           OwnedTensor::zeros(dt, {in.T, in.Hk, in.dk}),
           OwnedTensor::zeros(dt, {in.T, in.Hk, in.dk}),
           OwnedTensor::zeros(dt, {in.T, in.Hv, in.dv}),
           OwnedTensor::zeros(st, {in.T, in.Hv}),
           OwnedTensor::zeros(st, {in.T, in.Hv}),
           OwnedTensor::zeros(st, {in.N, in.Hv, in.dk, in.dv})};
  gated_delta_rule_forward(
      {q, k, v, g, beta, in.cu, view_or_empty(h0), r.o, r.hT, scale, l2, saved});
  if (backward)
    gated_delta_rule_backward({q, k, v, g, beta, in.cu, view_or_empty(h0), dout, view_or_empty(dhT),
                               r.dq, r.dk, r.dv, r.dg, r.dbeta, r.dh0, scale, l2, saved});
  return r;
}

struct Errors {
  double o, hT, dq, dk, dv, dg, dbeta, dh0;
};

Errors errors(const Result& got, const Result& want) {
  auto e = [](const OwnedTensor& a, const OwnedTensor& b) { return testing::rel_err(a, b); };
  return {e(got.o, want.o),   e(got.hT, want.hT), e(got.dq, want.dq),       e(got.dk, want.dk),
          e(got.dv, want.dv), e(got.dg, want.dg), e(got.dbeta, want.dbeta), e(got.dh0, want.dh0)};
}

// fp32 chunked vs fp64 recurrence, relative L2 per tensor. The measured errors of the sweep are
// 5e-8..7e-7 (printed by the sweep); these limits leave ~4x headroom.
constexpr double kTolFwd = 1e-6;
constexpr double kTolBwd = 3e-6;

void expect_cpu_matches_ref(const Result& cpu, const Result& ref, const std::string& what,
                            bool has_dh0 = true) {
  testing::expect_close(cpu.o, ref.o, kTolFwd, what + " o");
  testing::expect_close(cpu.hT, ref.hT, kTolFwd, what + " hT");
  testing::expect_close(cpu.dq, ref.dq, kTolBwd, what + " dq");
  testing::expect_close(cpu.dk, ref.dk, kTolBwd, what + " dk");
  testing::expect_close(cpu.dv, ref.dv, kTolBwd, what + " dv");
  testing::expect_close(cpu.dg, ref.dg, kTolBwd, what + " dg");
  testing::expect_close(cpu.dbeta, ref.dbeta, kTolBwd, what + " dbeta");
  if (has_dh0) testing::expect_close(cpu.dh0, ref.dh0, kTolBwd, what + " dh0");
}

std::vector<Spec> sweep_specs() {
  std::vector<Spec> s = common_sweep_specs(40);
  s.push_back({.name = "mixed_decay", .lens = {130, 64, 2}, .r = 2, .g_lo = -5, .seed = 12});
  return s;
}

class GdrSweep : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(GdrSweep, CpuMatchesRef) {
  auto [idx, l2] = GetParam();
  const Spec s = sweep_specs()[static_cast<size_t>(idx)];
  Inputs in = make_inputs(s, l2);
  Result ref = run(in, DType::F64, l2);
  Result cpu = run(in, DType::F32, l2);
  const std::string what = s.name + (l2 ? " l2" : "");
  expect_cpu_matches_ref(cpu, ref, what);
  Errors e = errors(cpu, ref);
  std::printf("[gdr] %-22s o %.1e hT %.1e | dq %.1e dk %.1e dv %.1e dg %.1e dbeta %.1e dh0 %.1e\n",
              what.c_str(), e.o, e.hT, e.dq, e.dk, e.dv, e.dg, e.dbeta, e.dh0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GdrSweep,
    ::testing::Combine(::testing::Range(0, static_cast<int>(sweep_specs().size())),
                       ::testing::Bool()),
    [](const auto& info) {
      return sweep_specs()[static_cast<size_t>(std::get<0>(info.param))].name +
             (std::get<1>(info.param) ? "_l2" : "");
    });

// One case at model-like head dims (dk = dv = 64), several chunks, grouped heads.
TEST(GatedDeltaRule, ModerateSizeCpuMatchesRef) {
  Spec s{.name = "T200_d64",
         .lens = {200},
         .Hk = 2,
         .r = 2,
         .dk = 64,
         .dv = 64,
         .g_lo = -2,
         .seed = 21};
  Inputs in = make_inputs(s, true);
  Result ref = run(in, DType::F64, true);
  Result cpu = run(in, DType::F32, true);
  expect_cpu_matches_ref(cpu, ref, s.name);
}

// cpu is bitwise deterministic whatever the thread count (op.h).
TEST(GatedDeltaRule, CpuIsBitwiseIndependentOfThreadCount) {
  Spec s{.name = "threads", .lens = {70, 1, 33, 64}, .Hk = 2, .r = 2, .seed = 95};
  Inputs in = make_inputs(s, true);
  const int keep = omp_get_max_threads();
  omp_set_num_threads(1);
  Result one = run(in, DType::F32, true);
  omp_set_num_threads(2);
  Result two = run(in, DType::F32, true);
  omp_set_num_threads(keep);
  for (auto [a, b] : {std::pair{&one.o, &two.o},
                      {&one.hT, &two.hT},
                      {&one.dq, &two.dq},
                      {&one.dk, &two.dk},
                      {&one.dv, &two.dv},
                      {&one.dg, &two.dg},
                      {&one.dbeta, &two.dbeta},
                      {&one.dh0, &two.dh0}})
    EXPECT_EQ(to_f64_vector(*a), to_f64_vector(*b));
}

// Isolated huge decays (a document reset in all but name) next to mild ones: the chunked gates
// are formed from direct sums of g, so a -1e30 never swamps the -0.5 beside it.
TEST(GatedDeltaRule, ExtremeDecaySpikesCpuMatchesRef) {
  Spec s{.name = "spikes", .lens = {150, 40}, .Hk = 1, .r = 2, .seed = 91};
  for (bool l2 : {false, true}) {
    Inputs in = make_inputs(s, l2);
    double* g = in.g.ptr<double>();  // [T, Hv]
    g[10 * 2 + 0] = -1e30;
    g[70 * 2 + 1] = -1e4;
    g[100 * 2 + 0] = -80;
    g[160 * 2 + 1] = -1e30;
    Result ref = run(in, DType::F64, l2);
    Result cpu = run(in, DType::F32, l2);
    expect_cpu_matches_ref(cpu, ref, std::string("spikes") + (l2 ? " l2" : ""));
  }
}

// Every tensor of `packed` restricted to document n equals `single` (a run of that document only).
void expect_doc_equal(const Result& packed, const Result& single, int64_t n, int64_t bos,
                      int64_t len, double tol, const std::string& what) {
  auto rows = [](const OwnedTensor& t, int64_t b, int64_t e) { return t.view().slice0(b, e); };
  const std::string w = what + " doc " + std::to_string(n);
  testing::expect_close(rows(packed.o, bos, bos + len), single.o, tol, w + " o");
  testing::expect_close(rows(packed.hT, n, n + 1), single.hT, tol, w + " hT");
  testing::expect_close(rows(packed.dh0, n, n + 1), single.dh0, tol, w + " dh0");
  if (len == 0) return;
  testing::expect_close(rows(packed.dq, bos, bos + len), single.dq, tol, w + " dq");
  testing::expect_close(rows(packed.dk, bos, bos + len), single.dk, tol, w + " dk");
  testing::expect_close(rows(packed.dv, bos, bos + len), single.dv, tol, w + " dv");
  testing::expect_close(rows(packed.dg, bos, bos + len), single.dg, tol, w + " dg");
  testing::expect_close(rows(packed.dbeta, bos, bos + len), single.dbeta, tol, w + " dbeta");
}

// The sub-batch of document n as its own Inputs (N = 1).
Inputs single_doc(const Inputs& in, int64_t n) {
  const int32_t* cu = in.cu.ptr<int32_t>();
  const int64_t bos = cu[n], eos = cu[n + 1];
  Inputs s;
  s.T = eos - bos;
  s.N = 1;
  s.Hk = in.Hk;
  s.Hv = in.Hv;
  s.dk = in.dk;
  s.dv = in.dv;
  auto cp = [](const OwnedTensor& t, int64_t b, int64_t e) {
    return t.defined() ? convert(t.view().slice0(b, e), DType::F64) : OwnedTensor();
  };
  s.q = cp(in.q, bos, eos);
  s.k = cp(in.k, bos, eos);
  s.v = cp(in.v, bos, eos);
  s.g = cp(in.g, bos, eos);
  s.beta = cp(in.beta, bos, eos);
  s.dout = cp(in.dout, bos, eos);
  s.h0 = cp(in.h0, n, n + 1);
  s.dhT = cp(in.dhT, n, n + 1);
  s.cu = testing::i32_tensor({0, static_cast<int32_t>(s.T)});
  return s;
}

TEST(GatedDeltaRule, PackedBatchEqualsDocumentsOneByOne) {
  for (bool l2 : {false, true}) {
    Spec s{.name = "packed", .lens = {5, 70, 1, 130, 64}, .Hk = 2, .r = 2, .g_lo = -3, .seed = 31};
    Inputs in = make_inputs(s, l2);
    for (DType dt : {DType::F64, DType::F32}) {
      Result packed = run(in, dt, l2);
      const int32_t* cu = in.cu.ptr<int32_t>();
      for (int64_t n = 0; n < in.N; ++n) {
        Result one = run(single_doc(in, n), dt, l2);
        // Same operations on the same numbers: equal up to BLAS kernel-path differences.
        expect_doc_equal(packed, one, n, cu[n], cu[n + 1] - cu[n], dt == DType::F64 ? 1e-13 : 1e-6,
                         std::string(dtype_name(dt)) + (l2 ? " l2" : ""));
      }
    }
  }
}

// Zero-length documents are accepted: no tokens, hT = h0, dh0 = dhT, and the other documents are
// unaffected.
TEST(GatedDeltaRule, ZeroLengthDocumentsPassStateThrough) {
  Spec s{.name = "zero_len", .lens = {0, 5, 0, 0, 70, 0}, .Hk = 1, .r = 2, .seed = 41};
  Inputs in = make_inputs(s, true);
  Result ref = run(in, DType::F64, true);
  Result cpu = run(in, DType::F32, true);
  expect_cpu_matches_ref(cpu, ref, "zero_len");
  for (int64_t n : {0, 2, 3, 5}) {
    auto slice = [&](const Tensor& t) { return t.slice0(n, n + 1); };
    for (const Result* r : {&ref, &cpu}) {
      testing::expect_close(slice(r->hT), slice(in.h0), 0, "hT of an empty document");
      testing::expect_close(slice(r->dh0), slice(in.dhT), 0, "dh0 of an empty document");
    }
  }
  // Same as the batch without the empty documents.
  for (int64_t n : {1, 4}) {
    const int32_t* cu = in.cu.ptr<int32_t>();
    expect_doc_equal(cpu, run(single_doc(in, n), DType::F32, true), n, cu[n], cu[n + 1] - cu[n],
                     1e-6, "zero_len");
  }
  // An all-empty batch (T = 0) passes the state through too.
  Spec e{.name = "empty", .lens = {0, 0}, .Hk = 1, .r = 1, .seed = 42};
  Inputs ein = make_inputs(e, false);
  Result er = run(ein, DType::F32, false);
  testing::expect_close(er.hT, ein.h0, 0, "hT of an empty batch");
  testing::expect_close(er.dh0, ein.dhT, 0, "dh0 of an empty batch");
}

// Grouped heads: value head h reads key head h / r, and dq, dk sum over the r value heads. Checked
// against the same problem with q and k repeated to Hv heads by hand (r = 1).
TEST(GatedDeltaRule, GroupedHeadsEqualRepeatedKeys) {
  Spec s{.name = "grouped", .lens = {20, 9}, .Hk = 2, .r = 3, .dk = 8, .dv = 5, .seed = 51};
  for (bool l2 : {false, true}) {
    Inputs in = make_inputs(s, l2);
    Inputs rep = in;
    rep.Hk = in.Hv;
    rep.q = OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dk});
    rep.k = OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dk});
    for (int64_t t = 0; t < in.T; ++t)
      for (int64_t h = 0; h < in.Hv; ++h)
        for (int64_t e = 0; e < in.dk; ++e) {
          const int64_t src = (t * in.Hk + h / s.r) * in.dk + e, dst = (t * in.Hv + h) * in.dk + e;
          rep.q.ptr<double>()[dst] = in.q.ptr<double>()[src];
          rep.k.ptr<double>()[dst] = in.k.ptr<double>()[src];
        }
    Result a = run(in, DType::F64, l2), b = run(rep, DType::F64, l2);
    testing::expect_close(a.o, b.o, 1e-14, "o");
    testing::expect_close(a.dv, b.dv, 1e-14, "dv");
    testing::expect_close(a.dg, b.dg, 1e-13, "dg");
    // The l2norm backward is linear in the upstream gradient, so summing after it is the same.
    auto sum_groups = [&](const OwnedTensor& x) {
      OwnedTensor y = OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk});
      for (int64_t t = 0; t < in.T; ++t)
        for (int64_t h = 0; h < in.Hv; ++h)
          for (int64_t e = 0; e < in.dk; ++e)
            y.ptr<double>()[(t * in.Hk + h / s.r) * in.dk + e] +=
                x.ptr<double>()[(t * in.Hv + h) * in.dk + e];
      return y;
    };
    testing::expect_close(a.dq, sum_groups(b.dq), 1e-13, "dq");
    testing::expect_close(a.dk, sum_groups(b.dk), 1e-13, "dk");
  }
}

TEST(GatedDeltaRule, ScaleDefaultsToInverseSqrtDk) {
  Spec s{.name = "scale", .lens = {9}, .Hk = 1, .r = 1, .dk = 16, .dv = 4, .seed = 61};
  Inputs in = make_inputs(s, true);
  for (DType dt : {DType::F64, DType::F32}) {
    Result d = run(in, dt, true, 0.0, false);
    Result q = run(in, dt, true, 0.25, false);  // 1/sqrt(16)
    Result h = run(in, dt, true, 0.125, false);
    testing::expect_close(d.o, q.o, 0, "scale 0 vs dk^-1/2");
    auto half = to_f64_vector(h.o), full = to_f64_vector(q.o);
    for (size_t i = 0; i < half.size(); ++i) EXPECT_NEAR(2 * half[i], full[i], 1e-6);
  }
}

// Finite differences of ref in fp64: every input that has a gradient.
TEST(GatedDeltaRule, RefGradientsMatchFiniteDifferences) {
  for (bool l2 : {false, true}) {
    Spec s{.name = "fd",
           .lens = {3, 6},
           .Hk = 1,
           .r = 2,
           .dk = 4,
           .dv = 3,
           .g_lo = -1.0,
           .g_hi = -0.1,
           .b_lo = 0.1,
           .b_hi = 0.9,
           .seed = 71};
    Inputs in = make_inputs(s, l2);
    Result gr = run(in, DType::F64, l2, 0.7);
    auto loss = [&] {
      Result r = run(in, DType::F64, l2, 0.7, false);
      return testing::dot(r.o, in.dout) + testing::dot(r.hT, in.dhT);
    };
    const std::string tag = l2 ? " (l2norm)" : "";
    EXPECT_LE(testing::fd_check(loss, in.q, gr.dq), 1e-7) << "dq" << tag;
    EXPECT_LE(testing::fd_check(loss, in.k, gr.dk), 1e-7) << "dk" << tag;
    EXPECT_LE(testing::fd_check(loss, in.v, gr.dv), 1e-7) << "dv" << tag;
    EXPECT_LE(testing::fd_check(loss, in.g, gr.dg), 1e-7) << "dg" << tag;
    EXPECT_LE(testing::fd_check(loss, in.beta, gr.dbeta), 1e-7) << "dbeta" << tag;
    EXPECT_LE(testing::fd_check(loss, in.h0, gr.dh0), 1e-7) << "dh0" << tag;
  }
}

TEST(GatedDeltaRule, ProbeAcceptsCpuAndMeasuresSmallError) {
  Registry& reg = Registry::global();
  const Resolution& r = reg.resolve("gated_delta_rule", OpQuery{Backend::Cpu, "", {}});
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, "cpu.chunk64");
  ProbeError tol = reg.op("gated_delta_rule").tolerance(DType::F32);
  EXPECT_LE(r.error.fwd, tol.fwd);
  EXPECT_LE(r.error.bwd, tol.bwd);
  EXPECT_GT(r.error.fwd, 0);  // fp32 vs fp64: exactly 0 would mean the probe compared nothing
  std::printf("[gdr] probe cpu.chunk64: fwd %.2e bwd %.2e\n", r.error.fwd, r.error.bwd);
}

// A cuda implementation forced with GDN_OP_GATED_DELTA_RULE is not one of the cpu's: forcing it on
// the cpu is an error naming it, and without the knob the cpu results are those of cpu.chunk64.
TEST(GatedDeltaRule, ForcingACudaImplementationOnTheCpuIsAnError) {
  Registry& reg = Registry::global();
  for (const ImplDesc* i : reg.impls("gated_delta_rule", Backend::Cpu))
    EXPECT_EQ(i->name.find("cuda."), std::string::npos) << i->name;
  const int64_t T = 70, Hk = 1, Hv = 2, dk = 16, dv = 8;
  OwnedTensor q = convert(testing::randn({T, Hk, dk}, 61, 0.3), DType::F32);
  OwnedTensor k = convert(testing::randn({T, Hk, dk}, 62, 0.3), DType::F32);
  OwnedTensor v = convert(testing::randn({T, Hv, dv}, 63), DType::F32);
  OwnedTensor g = convert(testing::randu({T, Hv}, 64, -1.0, 0.0), DType::F32);
  OwnedTensor beta = convert(testing::randu({T, Hv}, 65, 0.0, 1.0), DType::F32);
  OwnedTensor cu = testing::i32_tensor({0, 30, 70});
  auto run = [&] {
    OwnedTensor o = OwnedTensor::zeros(DType::F32, {T, Hv, dv});
    gated_delta_rule_forward({q, k, v, g, beta, cu, Tensor(), o, Tensor(), 0.0, true});
    return o;
  };
  OwnedTensor want = run();
  setenv("GDN_OP_GATED_DELTA_RULE", "cuda.chunk64", 1);
  env::reset_cache_for_testing();
  reg.clear_resolutions();
  try {
    run();
    ADD_FAILURE() << "forcing cuda.chunk64 on the cpu was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda.chunk64"), std::string::npos) << e.what();
  }
  unsetenv("GDN_OP_GATED_DELTA_RULE");
  env::reset_cache_for_testing();
  reg.clear_resolutions();
  EXPECT_EQ(testing::rel_err(run(), want), 0.0);
}

// Deliberately wrong variants of the cpu implementation: the probe must reject each one.
const GatedDeltaRuleTable& cpu_table() {
  for (const ImplDesc* i : Registry::global().impls("gated_delta_rule", Backend::Cpu))
    if (i->name == "cpu.chunk64") return *static_cast<const GatedDeltaRuleTable*>(i->table);
  throw std::runtime_error("cpu.chunk64 not registered");
}
void fwd_ok(const GatedDeltaRuleFwd& a) { cpu_table().forward(a); }
void bwd_ok(const GatedDeltaRuleBwd& a) { cpu_table().backward(a); }
void fwd_no_h0(const GatedDeltaRuleFwd& a) {
  GatedDeltaRuleFwd b = a;
  b.h0 = Tensor();
  cpu_table().forward(b);
}
void fwd_no_l2(const GatedDeltaRuleFwd& a) {
  GatedDeltaRuleFwd b = a;
  b.use_qk_l2norm = false;
  cpu_table().forward(b);
}
void bwd_no_dhT(const GatedDeltaRuleBwd& a) {
  GatedDeltaRuleBwd b = a;
  b.dhT = Tensor();
  cpu_table().backward(b);
}
void bwd_zero_dg(const GatedDeltaRuleBwd& a) {
  cpu_table().backward(a);
  std::fill_n(a.dg.ptr<float>(), a.dg.numel(), 0.f);
}

TEST(GatedDeltaRule, ProbeRejectsWrongImplementations) {
  const OpDesc& op = Registry::global().op("gated_delta_rule");
  const ProbeError tol = op.tolerance(DType::F32);
  struct Wrong {
    const char* what;
    GatedDeltaRuleTable table;
  };
  static const Wrong wrong[] = {{"ignores h0", {fwd_no_h0, bwd_ok}},
                                {"ignores use_qk_l2norm", {fwd_no_l2, bwd_ok}},
                                {"ignores dhT", {fwd_ok, bwd_no_dhT}},
                                {"drops dg", {fwd_ok, bwd_zero_dg}}};
  for (const Wrong& w : wrong) {
    ImplDesc impl{"gated_delta_rule", "cpu.wrong", Backend::Cpu, 0, nullptr, &w.table};
    ProbeError e = op.probe(impl, OpQuery{Backend::Cpu, "", {}});
    EXPECT_TRUE(e.fwd > tol.fwd || e.bwd > tol.bwd)
        << w.what << ": probe errors fwd " << e.fwd << " bwd " << e.bwd << " pass";
  }
}

// `gdntrain ops run` path: a safetensors file in, results out, equal to a direct call.
TEST(GatedDeltaRule, OpsRunFromFileMatchesDirectCall) {
  Spec s{.name = "file", .lens = {3, 66}, .Hk = 1, .r = 2, .dk = 8, .dv = 6, .seed = 81};
  Inputs in = make_inputs(s, true);
  const auto dir =
      std::filesystem::temp_directory_path() / ("gdn_gdr_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string in_path = (dir / "in.safetensors").string(),
                    out_path = (dir / "out.safetensors").string();
  OwnedTensor q = convert(in.q, DType::F32), k = convert(in.k, DType::F32),
              v = convert(in.v, DType::F32), g = convert(in.g, DType::F32),
              beta = convert(in.beta, DType::F32), h0 = convert(in.h0, DType::F32),
              dout = convert(in.dout, DType::F32), dhT = convert(in.dhT, DType::F32);
  auto nt = [](const char* name, const Tensor& t) {
    return NamedTensor{name, t, {}, {}, nullptr, 0};
  };
  write_safetensors(in_path,
                    {nt("q", q), nt("k", k), nt("v", v), nt("g", g), nt("beta", beta),
                     nt("cu_seqlens", in.cu), nt("h0", h0), nt("do", dout), nt("dhT", dhT)},
                    {{"use_qk_l2norm", "1"}});
  OpRunResult res = run_op_file("gated_delta_rule", Backend::Cpu, in_path, out_path, true, {});
  EXPECT_EQ(res.impl, "cpu.chunk64");
  Result want = run(in, DType::F32, true);
  SafeTensorsFile out(out_path);
  auto check = [&](const char* name, const OwnedTensor& w) {
    testing::expect_close(out.load(name, DType::F32), w, 0, std::string("file ") + name);
  };
  check("o", want.o);
  check("hT", want.hT);
  check("dq", want.dq);
  check("dk", want.dk);
  check("dv", want.dv);
  check("dg", want.dg);
  check("dbeta", want.dbeta);
  check("dh0", want.dh0);

  // Without cu_seqlens and h0 the file holds one document starting from a zero state; the
  // attributes come from --attr (scale given explicitly).
  Spec s1{.name = "file1",
          .lens = {69},
          .Hk = 2,
          .r = 1,
          .dk = 8,
          .dv = 6,
          .init = false,
          .dhT = false,
          .seed = 82};
  Inputs in1 = make_inputs(s1, false);
  OwnedTensor q1 = convert(in1.q, DType::F32), k1 = convert(in1.k, DType::F32),
              v1 = convert(in1.v, DType::F32), g1 = convert(in1.g, DType::F32),
              beta1 = convert(in1.beta, DType::F32), dout1 = convert(in1.dout, DType::F32);
  write_safetensors(in_path, {nt("q", q1), nt("k", k1), nt("v", v1), nt("g", g1), nt("beta", beta1),
                              nt("do", dout1)});
  run_op_file("gated_delta_rule", Backend::Cpu, in_path, out_path, true, {{"scale", 0.3}});
  Result want1 = run(in1, DType::F32, false, 0.3);
  SafeTensorsFile out1(out_path);
  testing::expect_close(out1.load("o", DType::F32), want1.o, 0, "file1 o");
  testing::expect_close(out1.load("dq", DType::F32), want1.dq, 0, "file1 dq");
  testing::expect_close(out1.load("dg", DType::F32), want1.dg, 0, "file1 dg");
  testing::expect_close(out1.load("dh0", DType::F32), want1.dh0, 0, "file1 dh0");
  std::filesystem::remove_all(dir);
}

// --- bad input --------------------------------------------------------------------------------

// A valid F32 problem that the cases below break one field at a time.
struct Bad {
  Inputs in = make_inputs({.name = "bad", .lens = {4, 6}, .Hk = 2, .r = 2, .dk = 4, .dv = 3}, true);
  OwnedTensor q = convert(in.q, DType::F32), k = convert(in.k, DType::F32),
              v = convert(in.v, DType::F32), g = convert(in.g, DType::F32),
              beta = convert(in.beta, DType::F32), h0 = convert(in.h0, DType::F32),
              dout = convert(in.dout, DType::F32);
  OwnedTensor o = OwnedTensor::zeros(DType::F32, {10, 4, 3});
  OwnedTensor hT = OwnedTensor::zeros(DType::F32, {2, 4, 4, 3});
  OwnedTensor dq = OwnedTensor::zeros(DType::F32, {10, 2, 4}),
              dk = OwnedTensor::zeros(DType::F32, {10, 2, 4}),
              dv = OwnedTensor::zeros(DType::F32, {10, 4, 3}),
              dg = OwnedTensor::zeros(DType::F32, {10, 4}),
              db = OwnedTensor::zeros(DType::F32, {10, 4}),
              dh0 = OwnedTensor::zeros(DType::F32, {2, 4, 4, 3});
  GatedDeltaRuleFwd fwd() const { return {q, k, v, g, beta, in.cu, h0, o, hT, 0.0, true}; }
  GatedDeltaRuleBwd bwd() const {
    return {q, k, v, g, beta, in.cu, h0, dout, Tensor(), dq, dk, dv, dg, db, dh0, 0.0, true};
  }
};

using testing::expect_error;

TEST(GatedDeltaRule, BadInputIsAClearError) {
  Bad b;
  auto fwd = [&](auto&& edit) {
    GatedDeltaRuleFwd a = b.fwd();
    edit(a);
    return [a] { gated_delta_rule_forward(a); };
  };
  gated_delta_rule_forward(b.fwd());  // the unedited case is valid
  gated_delta_rule_backward(b.bwd());

  auto k5 = OwnedTensor::zeros(DType::F32, {10, 2, 5});
  expect_error(fwd([&](auto& a) { a.k = k5; }),
               "gated_delta_rule: tensor 'k' has shape [10, 2, 5], expected [10, 2, 4]");
  auto v9 = OwnedTensor::zeros(DType::F32, {9, 4, 3});
  expect_error(fwd([&](auto& a) { a.v = v9; }),
               "tensor 'v' has shape [9, 4, 3], expected [10, *, *]");
  auto v3 = OwnedTensor::zeros(DType::F32, {10, 3, 3});
  expect_error(fwd([&](auto& a) { a.v = v3; }),
               "value heads Hv = 3 (tensor 'v') must be a positive multiple of key heads Hk = 2");
  auto g64 = convert(b.in.g, DType::F64);
  expect_error(fwd([&](auto& a) { a.g = g64; }), "tensor 'g' has dtype F64, expected F32");
  auto h0bad = OwnedTensor::zeros(DType::F32, {3, 4, 4, 3});
  expect_error(fwd([&](auto& a) { a.h0 = h0bad; }),
               "tensor 'h0' has shape [3, 4, 4, 3], expected [2, 4, 4, 3]");
  auto obad = OwnedTensor::zeros(DType::F32, {10, 4, 4});
  expect_error(fwd([&](auto& a) { a.o = obad; }), "tensor 'o' has shape [10, 4, 4]");
  auto q300 = OwnedTensor::zeros(DType::F32, {10, 2, 300});
  auto k300 = OwnedTensor::zeros(DType::F32, {10, 2, 300});
  expect_error(fwd([&](auto& a) {
                 a.q = q300;
                 a.k = k300;
               }),
               "key head dim dk = 300 (tensor 'q') must be in [1, 256]");
  expect_error(fwd([&](auto& a) { a.scale = -1; }), "scale must be finite and >= 0");

  // cu_seqlens.
  auto cu1 = testing::i32_tensor({1, 4, 10});
  expect_error(fwd([&](auto& a) { a.cu_seqlens = cu1; }), "cu_seqlens[0] = 1, expected 0");
  auto cu2 = testing::i32_tensor({0, 6, 4, 10});
  auto h03 = OwnedTensor::zeros(DType::F32, {3, 4, 4, 3});
  expect_error(fwd([&](auto& a) {
                 a.cu_seqlens = cu2;
                 a.h0 = h03;
                 a.hT = Tensor();
               }),
               "cu_seqlens[2] = 4 is less than cu_seqlens[1] = 6");
  auto cu3 = testing::i32_tensor({0, 4, 9});
  expect_error(fwd([&](auto& a) { a.cu_seqlens = cu3; }), "cu_seqlens[2] = 9, expected T = 10");
  auto cu4 = testing::i32_tensor({0});
  expect_error(fwd([&](auto& a) { a.cu_seqlens = cu4; }),
               "tensor 'cu_seqlens' has 1 entries, expected N+1 >= 2");
  auto cu64 = convert(b.in.cu, DType::I64);
  expect_error(fwd([&](auto& a) { a.cu_seqlens = cu64; }),
               "tensor 'cu_seqlens' has dtype I64, expected I32");

  // Non-finite or positive gates, named by [t, h].
  auto gnan = convert(b.in.g, DType::F32);
  gnan.ptr<float>()[5 * 4 + 1] = std::nanf("");
  expect_error(fwd([&](auto& a) { a.g = gnan; }),
               "tensor 'g' has a non-finite value nan at [t=5, h=1]");
  auto gpos = convert(b.in.g, DType::F32);
  gpos.ptr<float>()[7 * 4 + 3] = 0.5f;
  expect_error(fwd([&](auto& a) { a.g = gpos; }),
               "tensor 'g' must be <= 0 (a log-decay), got 0.5 at [t=7, h=3]");
  auto binf = convert(b.in.beta, DType::F32);
  binf.ptr<float>()[2 * 4 + 0] = INFINITY;
  expect_error(fwd([&](auto& a) { a.beta = binf; }),
               "tensor 'beta' has a non-finite value inf at [t=2, h=0]");

  // Backward outputs and upstream gradients.
  auto bwd = [&](auto&& edit) {
    GatedDeltaRuleBwd a = b.bwd();
    edit(a);
    return [a] { gated_delta_rule_backward(a); };
  };
  auto do_bad = OwnedTensor::zeros(DType::F32, {10, 4, 2});
  expect_error(bwd([&](auto& a) { a.dout = do_bad; }), "tensor 'do' has shape [10, 4, 2]");
  auto dh0_bad = OwnedTensor::zeros(DType::F32, {2, 4, 3, 4});
  expect_error(bwd([&](auto& a) { a.dh0 = dh0_bad; }),
               "tensor 'dh0' has shape [2, 4, 3, 4], expected [2, 4, 4, 3]");
  auto dhT_nan = OwnedTensor::zeros(DType::F32, {2, 4, 4, 3});
  dhT_nan.ptr<float>()[3] = std::nanf("");
  expect_error(bwd([&](auto& a) { a.dhT = dhT_nan; }), "tensor 'dhT' has a non-finite value");
  auto dg_bad = OwnedTensor::zeros(DType::F64, {10, 4});
  expect_error(bwd([&](auto& a) { a.dg = dg_bad; }), "tensor 'dg' has dtype F64, expected F32");
  expect_error(bwd([&](auto& a) { a.dq = Tensor(); }), "tensor 'dq' is required but was not given");
}

// --- the optional `saved` tensor (op.h) -------------------------------------------------------

TEST(GatedDeltaRule, SavedSizeFollowsTheContract) {
  EXPECT_EQ(gdr_saved_chunks(8192, 1), 128);
  // Qwen3.5-9B's GDN layer at 8k tokens: 128 slots x 32 heads x (Ht 128 x 128 + Vt 128 x 64 + W 64
  // x 128 + T 64 x 64 + gamma 2 x 64), 289 MiB in bf16.
  EXPECT_EQ(gdr_saved_numel(8192, 1, 32, 128, 128), int64_t{151519232});
  EXPECT_EQ(gdr_saved_numel(8192, 1, 32, 128, 128) * 2, int64_t{289} << 20);
  EXPECT_EQ(gdr_saved_chunks(0, 1), 0);
  EXPECT_EQ(gdr_saved_chunks(64, 1), 1);
  EXPECT_EQ(gdr_saved_chunks(65, 1), 2);
  EXPECT_EQ(gdr_saved_numel(10, 2, 4, 4, 3), 2 * 4 * (3 * 4 + 3 * 64 + 64 * 4 + 64 * 64 + 128));
  // An upper bound on the chunk count of every split of T tokens into N documents (zero-length
  // ones included), non-decreasing in T and N (a plan sized for the largest batch fits them all).
  for (int64_t N = 1; N <= 6; ++N) {
    for (int64_t T = 0; T <= 400; T += 7) {
      EXPECT_LE(gdr_saved_chunks(T, N), gdr_saved_chunks(T + 1, N));
      EXPECT_LE(gdr_saved_chunks(T, N), gdr_saved_chunks(T, N + 1));
      for (uint64_t trial = 0; trial < 8; ++trial) {
        // N - 1 random cut points in [0, T].
        std::vector<int64_t> cuts{0, T};
        for (int64_t i = 1; i < N; ++i)
          cuts.push_back(T == 0 ? 0
                                : static_cast<int64_t>(
                                      rng::bits(trial, 9, static_cast<uint64_t>(i * 1000 + T)) %
                                      static_cast<uint64_t>(T + 1)));
        std::sort(cuts.begin(), cuts.end());
        int64_t chunks = 0;
        for (size_t i = 1; i < cuts.size(); ++i) chunks += (cuts[i] - cuts[i - 1] + 63) / 64;
        EXPECT_LE(chunks, gdr_saved_chunks(T, N)) << "T = " << T << ", N = " << N;
      }
    }
  }
}

// ref and cpu.chunk64 neither write nor read `saved`: the outputs are bitwise those without it and
// the tensor keeps its values.
TEST(GatedDeltaRule, RefAndCpuIgnoreSaved) {
  const Spec s{.name = "saved", .lens = {70, 1, 20}, .Hk = 1, .r = 2, .seed = 77};
  const Inputs in = make_inputs(s, true);
  for (DType dt : {DType::F64, DType::F32}) {
    const int64_t n = gdr_saved_numel(in.T, in.N, in.Hv, in.dk, in.dv);
    std::vector<double> sentinel(static_cast<size_t>(n), 7.0);
    OwnedTensor saved = from_f64(sentinel, dt, std::vector<int64_t>{n});
    const Result with = run(in, dt, true, 0, true, saved);
    const Result without = run(in, dt, true);
    const std::pair<const OwnedTensor*, const OwnedTensor*> all[] = {
        {&with.o, &without.o},         {&with.hT, &without.hT},  {&with.dq, &without.dq},
        {&with.dk, &without.dk},       {&with.dv, &without.dv},  {&with.dg, &without.dg},
        {&with.dbeta, &without.dbeta}, {&with.dh0, &without.dh0}};
    for (const auto& [a, b] : all)
      EXPECT_EQ(to_f64_vector(*a), to_f64_vector(*b)) << dtype_name(dt);
    EXPECT_EQ(to_f64_vector(saved), sentinel) << dtype_name(dt) << ": 'saved' was written";
  }
}

TEST(GatedDeltaRule, BadSavedIsAClearError) {
  Bad b;
  const int64_t n = gdr_saved_numel(10, 2, 4, 4, 3);
  OwnedTensor good = OwnedTensor::zeros(DType::F32, {n});
  OwnedTensor short_one = OwnedTensor::zeros(DType::F32, {n - 1});
  OwnedTensor two_d = OwnedTensor::zeros(DType::F32, {2, n / 2});
  OwnedTensor f64 = OwnedTensor::zeros(DType::F64, {n});
  GatedDeltaRuleFwd f = b.fwd();
  GatedDeltaRuleBwd g = b.bwd();
  f.saved = good;
  g.saved = good;
  gated_delta_rule_forward(f);  // the right size and dtype is accepted (and ignored) on cpu
  gated_delta_rule_backward(g);
  const std::string want_shape = "tensor 'saved' has shape [" + std::to_string(n - 1) +
                                 "], expected [" + std::to_string(n) +
                                 "] (gdr_saved_numel(T=10, N=2, Hv=4, dk=4, dv=3))";
  f.saved = short_one;
  expect_error([&] { gated_delta_rule_forward(f); }, want_shape);
  g.saved = short_one;
  expect_error([&] { gated_delta_rule_backward(g); }, want_shape);
  g.saved = two_d;
  expect_error([&] { gated_delta_rule_backward(g); }, "tensor 'saved' has shape [2, ");
  f.saved = f64;
  expect_error([&] { gated_delta_rule_forward(f); },
               "tensor 'saved' has dtype F64, expected F32 (the activation dtype of 'q')");
}

}  // namespace
}  // namespace gdn::ops
