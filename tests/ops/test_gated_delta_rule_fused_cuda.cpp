// Gated delta rule on CUDA (label gpu): the fused forward route (cuda.fused_fwd, chosen with
// GDN_OP_GATED_DELTA_RULE=cuda.fused_fwd; op.h), which keeps the state on chip across chunks and
// saves the same tensors as the decomposed route for the one backward.
//   - over the swept shapes of the CUDA tests (gdr_cuda_test_util.h: partial chunks, 1-token, empty
//     and 50 documents, r in {1, 2, 3}, dk != dv, with and without h0 / dhT and the l2norm, strong
//     and no decay, beta near 0 and 1): o and hT against ref (fp64), and every gradient of the
//     shared backward given the fused forward's `saved` (NaN-poisoned first, so a slot the backward
//     reads that the fused kernel did not write fails); shapes the fused route takes must not log a
//     rejection, the others (head dims above 128 or not multiples of 8) are an error when forced;
//   - the fused and decomposed routes agree: o, hT, their `saved` (Vt exact zeros past a partial
//     chunk's end on both), and each backward given the other's `saved`;
//   - forced, the op resolves to cuda.fused_fwd, whose own probe passes, and the probe rejects a
//     wrong fused forward; without it the production class resolves to cuda.chunk64;
//   - forcing it for a class it does not take is an error naming it and the reason.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/tolerances.h"
#include "gdn/backend/registry.h"
#include "gdn/core/env.h"
#include "gdn/core/log.h"
#include "ops/cuda_test_util.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gdr_cuda_test_util.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using namespace gdr_test;  // NOLINT: the shared GDR test helpers
using GdrFused = GdrCudaTest;

constexpr ProbeError kTol = bf16_tolerance("gated_delta_rule");

// Forces cuda.fused_fwd (GDN_OP_GATED_DELTA_RULE; and optionally sets GDN_STRICT_KERNELS) for
// the life of the object; resolutions are forgotten on both ends.
struct Knobs {
  explicit Knobs(bool fused, bool strict = false) {
    if (fused) setenv("GDN_OP_GATED_DELTA_RULE", "cuda.fused_fwd", 1);
    if (strict) setenv("GDN_STRICT_KERNELS", "1", 1);
    env::reset_cache_for_testing();
    Registry::global().clear_resolutions();
  }
  ~Knobs() {
    unsetenv("GDN_OP_GATED_DELTA_RULE");
    unsetenv("GDN_STRICT_KERNELS");
    env::reset_cache_for_testing();
    Registry::global().clear_resolutions();
  }
  Knobs(const Knobs&) = delete;
  Knobs& operator=(const Knobs&) = delete;
};

// Collects warnings while alive.
struct LogLines {
  std::vector<std::string> lines;
  LogLines() {
    log::set_sink([this](log::Level, std::string_view l) { lines.emplace_back(l); });
  }
  ~LogLines() { log::set_sink({}); }
  LogLines(const LogLines&) = delete;
  LogLines& operator=(const LogLines&) = delete;
  int count(std::string_view what) const {
    int n = 0;
    for (const std::string& l : lines) n += l.find(what) != std::string::npos;
    return n;
  }
};
// The resolver's line for an implementation it passes over.
constexpr std::string_view kFallback = "cuda.fused_fwd:";

bool fused_takes(const Spec& s) {
  return s.dk <= 128 && s.dv <= 128 && s.dk % 8 == 0 && s.dv % 8 == 0;
}

std::pair<Fwd, Grads> run_ref(const Inputs& in, bool l2) {
  OwnedTensor cu = testing::i32_tensor(in.cu);
  Fwd f{OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dv}),
        OwnedTensor::zeros(DType::F64, {in.N, in.Hv, in.dk, in.dv})};
  Grads g{OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dv}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hv}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hv}),
          OwnedTensor::zeros(DType::F64, {in.N, in.Hv, in.dk, in.dv})};
  gated_delta_rule_forward(
      {in.q, in.k, in.v, in.g, in.beta, cu, view_or_empty(in.h0), f.o, f.hT, 0.0, l2});
  gated_delta_rule_backward({in.q, in.k, in.v, in.g, in.beta, cu, view_or_empty(in.h0), in.dout,
                             view_or_empty(in.dhT), g.dq, g.dk, g.dv, g.dg, g.dbeta, g.dh0, 0.0,
                             l2});
  return {std::move(f), std::move(g)};
}

// Compares (expect_close) and prints the relative errors on one line.
void expect_fwd_close(const Fwd& got, const Fwd& want, double tol, const std::string& what) {
  testing::expect_close(got.o, want.o, tol, what + " o");
  testing::expect_close(got.hT, want.hT, tol, what + " hT");
  std::printf("[gdr fused] %-36s o %.1e hT %.1e\n", what.c_str(), testing::rel_err(got.o, want.o),
              testing::rel_err(got.hT, want.hT));
}

class GdrFusedSweep : public GdrFused,
                      public ::testing::WithParamInterface<std::tuple<int, bool>> {};

TEST_P(GdrFusedSweep, MatchesRefThroughTheSharedBackward) {
  auto [idx, l2] = GetParam();
  const Spec s = sweep_specs()[static_cast<size_t>(idx)];
  const std::string tag = s.name + (l2 ? " l2" : "");
  Inputs in = make_inputs(s, l2);
  const auto [ref_f, ref_g] = run_ref(in, l2);
  Dev d = to_device(in);
  Knobs knobs(true);
  LogLines log;
  OwnedTensor saved = poisoned(DType::BF16, {saved_numel(in)});
  if (!fused_takes(s)) {  // forced for a class it does not take: an error naming it
    try {
      forward(in, d, l2, saved);
      ADD_FAILURE() << tag << ": forcing cuda.fused_fwd at dk " << s.dk << ", dv " << s.dv
                    << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cuda.fused_fwd"), std::string::npos) << e.what();
    }
    return;
  }
  const Fwd f = forward(in, d, l2, saved);
  expect_fwd_close(f, ref_f, kTol.fwd, tag);
  // The fused forward's o and hT do not depend on whether it also writes `saved`.
  const Fwd f2 = forward(in, d, l2, Tensor());
  testing::expect_bitwise_equal(f2.o, f.o, tag + " o without saved");
  testing::expect_bitwise_equal(f2.hT, f.hT, tag + " hT without saved");
  const Grads g = backward(in, d, l2, saved);
  expect_grads_close(g, ref_g, kTol.bwd, tag + " bwd given fused saved", "[gdr fused]");
  EXPECT_EQ(log.count(kFallback), 0) << tag << ": " << log.lines.front();
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GdrFusedSweep,
    ::testing::Combine(::testing::Range(0, static_cast<int>(sweep_specs().size())),
                       ::testing::Bool()),
    [](const auto& info) {
      return sweep_specs()[static_cast<size_t>(std::get<0>(info.param))].name +
             (std::get<1>(info.param) ? "_l2" : "");
    });

// The two routes at the head dims: outputs, `saved` and cross-route backwards agree.
TEST_F(GdrFused, FusedAndDecomposedRoutesAgree) {
  for (bool l2 : {false, true}) {
    const Spec s{.name = "routes",
                 .lens = {130, 1, 64, 20},
                 .Hk = 2,
                 .r = 2,
                 .dk = 128,
                 .dv = 128,
                 .g_lo = -3,
                 .seed = 41};
    const std::string tag = l2 ? " l2" : "";
    Inputs in = make_inputs(s, l2);
    Dev d = to_device(in);
    // Zero-initialised: slots past the batch's chunks (never written) compare equal.
    OwnedTensor saved_fused = OwnedTensor::zeros(DType::BF16, {saved_numel(in)}, Device::CUDA);
    OwnedTensor saved_dec = OwnedTensor::zeros(DType::BF16, {saved_numel(in)}, Device::CUDA);
    Fwd fused, dec;
    Grads fused_from_dec, dec_from_fused, recompute;
    {
      Knobs k(true);
      fused = forward(in, d, l2, saved_fused);
    }
    {
      Knobs k(false);
      dec = forward(in, d, l2, saved_dec);
      dec_from_fused = backward(in, d, l2, saved_fused);
      recompute = backward(in, d, l2, Tensor());
    }
    {
      Knobs k(true);
      fused_from_dec = backward(in, d, l2, saved_dec);
    }
    expect_fwd_close(fused, dec, kTol.fwd, "fused vs decomposed" + tag);
    // The bf16 sections to bf16 precision; gamma bitwise (both routes take the fast prep's).
    const int64_t ga = saved_gamma_at(in), n = saved_numel(in);
    const double e =
        testing::rel_err(saved_fused.view().slice0(0, ga), saved_dec.view().slice0(0, ga));
    std::printf("[gdr fused] fused vs decomposed saved%s: rel err %.1e\n", tag.c_str(), e);
    EXPECT_LT(e, kTol.fwd) << "the two routes' 'saved' differ beyond rounding" << tag;
    testing::expect_bitwise_equal(saved_fused.view().slice0(ga, n), saved_dec.view().slice0(ga, n),
                                  "the two routes' saved gamma" + tag);
    {
      const int64_t nt = gdr_saved_chunks(in.T, in.N);
      const std::vector<double> vf =
          to_f64_vector(saved_fused.view().slice0(nt * in.Hv * in.dv * in.dk, saved_numel(in)));
      const std::vector<int> lens = {64, 64, 2, 1, 64, 20};  // the batch's chunks in order
      int64_t nonzero_tail = 0;
      for (size_t c = 0; c < lens.size(); ++c)
        for (int64_t h = 0; h < in.Hv; ++h)
          for (int64_t e2 = 0; e2 < in.dv; ++e2)
            for (int i = lens[c]; i < 64; ++i)
              nonzero_tail +=
                  vf[static_cast<size_t>(((static_cast<int64_t>(c) * in.Hv + h) * in.dv + e2) * 64 +
                                         i)] != 0;
      EXPECT_EQ(nonzero_tail, 0) << "fused Vt past a partial chunk's end must be exact zeros"
                                 << tag;
    }
    const auto [ref_f, ref_g] = run_ref(in, l2);
    expect_fwd_close(fused, ref_f, kTol.fwd, "fused vs ref" + tag);
    expect_grads_close(dec_from_fused, ref_g, kTol.bwd, "bwd given fused saved vs ref" + tag,
                       "[gdr fused]");
    expect_grads_close(dec_from_fused, recompute, kTol.bwd, "given fused saved vs recompute" + tag,
                       "[gdr fused]");
    expect_grads_close(fused_from_dec, recompute, kTol.bwd, "given dec saved vs recompute" + tag,
                       "[gdr fused]");
  }
}

// Many documents at dk = dv = 128 (more blocks than SMs, documents of 1..150 tokens), l2norm on.
TEST_F(GdrFused, ManyDocumentsAtHeadDim128) {
  const Spec s{.name = "d128_many_docs",
               .lens = random_lens(24, 1, 150, 43),
               .Hk = 2,
               .r = 2,
               .dk = 128,
               .dv = 128,
               .seed = 44};
  Inputs in = make_inputs(s, true);
  const auto [ref_f, ref_g] = run_ref(in, true);
  Dev d = to_device(in);
  Knobs knobs(true);
  OwnedTensor saved = poisoned(DType::BF16, {saved_numel(in)});
  expect_fwd_close(forward(in, d, true, saved), ref_f, kTol.fwd, s.name);
  expect_grads_close(backward(in, d, true, saved), ref_g, kTol.bwd, s.name + " bwd", "[gdr fused]");
}

TEST_F(GdrFused, KnobSelectsTheFusedImplementationWhichPassesItsOwnProbe) {
  const auto last_decision = [] {
    const std::vector<Registry::Decision> all = Registry::global().decisions();
    for (auto it = all.rbegin(); it != all.rend(); ++it)
      if (it->op == "gated_delta_rule") return *it;
    ADD_FAILURE() << "no gated_delta_rule decision";
    return Registry::Decision{};
  };
  Inputs in =
      make_inputs({.name = "d128", .lens = {10, 70}, .dk = 128, .dv = 128, .seed = 45}, true);
  Dev d = to_device(in);
  {
    Knobs knobs(true);
    forward(in, d, true, Tensor());
    const Registry::Decision r = last_decision();
    ASSERT_NE(r.result.impl, nullptr);
    EXPECT_EQ(r.result.impl->name, "cuda.fused_fwd");
    EXPECT_LE(r.result.error.fwd, kTol.fwd);
    EXPECT_LE(r.result.error.bwd, kTol.bwd);
    EXPECT_GT(r.result.error.fwd, 0.0);  // bf16 outputs: exactly 0 would mean nothing compared
    EXPECT_TRUE(r.result.rejected.empty()) << r.result.rejected.front();
    std::printf("[gdr fused] probe cuda.fused_fwd [%s]: fwd %.2e bwd %.2e\n",
                r.query.shape_class.c_str(), r.result.error.fwd, r.result.error.bwd);
  }
  Knobs none(false);
  forward(in, d, true, Tensor());
  const Registry::Decision r0 = last_decision();
  ASSERT_NE(r0.result.impl, nullptr);
  EXPECT_EQ(r0.result.impl->name, "cuda.chunk64");
  std::vector<std::string> names;
  for (const ImplDesc* i : Registry::global().impls("gated_delta_rule", Backend::Cuda))
    names.push_back(i->name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"cuda.chunk64", "cuda.chunk64_generic", "cuda.fused_fwd"}));
}

const GatedDeltaRuleTable* fused_table() {
  for (const ImplDesc* i : Registry::global().impls("gated_delta_rule", Backend::Cuda))
    if (i->name == "cuda.fused_fwd") return static_cast<const GatedDeltaRuleTable*>(i->table);
  return nullptr;
}
void fwd_wrong_scale(const GatedDeltaRuleFwd& a) {
  GatedDeltaRuleFwd b = a;
  b.scale = 2 * gdr_effective_scale(a.scale, a.q.size(2));
  fused_table()->forward(b);
}
void fwd_no_h0(const GatedDeltaRuleFwd& a) {
  GatedDeltaRuleFwd b = a;
  b.h0 = Tensor();
  fused_table()->forward(b);
}
void bwd_ok(const GatedDeltaRuleBwd& a) { fused_table()->backward(a); }

TEST_F(GdrFused, ProbeRejectsAWrongFusedForward) {
  ASSERT_NE(fused_table(), nullptr) << "cuda.fused_fwd is not registered";
  const OpDesc& op = Registry::global().op("gated_delta_rule");
  static const GatedDeltaRuleTable wrong[] = {{fwd_wrong_scale, bwd_ok}, {fwd_no_h0, bwd_ok}};
  for (const GatedDeltaRuleTable& w : wrong) {
    ImplDesc impl{"gated_delta_rule", "cuda.wrong", Backend::Cuda, 0, nullptr, &w};
    const ProbeError e = op.probe(impl, OpQuery{Backend::Cuda, "", {}});
    EXPECT_GT(e.fwd, kTol.fwd) << "probe errors fwd " << e.fwd << " bwd " << e.bwd << " pass";
  }
}

// dk = 136 (above the fused route's 128): forcing it is an error that names the implementation and
// why it cannot run, with or without GDN_STRICT_KERNELS (the knob asked for it by name).
TEST_F(GdrFused, ForcingItForAClassItDoesNotTakeIsAnError) {
  const Spec s{.name = "dk136", .lens = {70, 5}, .r = 2, .dk = 136, .dv = 16, .seed = 46};
  Inputs in = make_inputs(s, true);
  Dev d = to_device(in);
  for (bool strict : {false, true}) {
    Knobs knobs(true, strict);
    try {
      forward(in, d, true, Tensor());
      ADD_FAILURE() << "forcing cuda.fused_fwd at dk 136 was accepted (strict " << strict << ")";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("cuda.fused_fwd"), std::string::npos) << m;
      EXPECT_NE(m.find("dk = 136"), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace gdn::ops
