// Fault injection for the sequence ops' and norms' shape-class probes (issue 21 §2): a deliberately
// wrong CPU implementation, above the real one, that wraps it and corrupts its output only in one
// production class (the gated delta rule only at dk = dv = 128, Qwen3.5's; gated attention only at
// hd = 256; the norms only on rows of whole 8-element packs; the conv only at Qwen3.5's width and
// channel packs) or only on one-token documents. The resolver must reject each at its class (the
// probe runs that class's shapes) and, for the class faults, accept it where it is correct (the
// probe is not simply failing everything). Planted implementations stay registered: each is armed
// only inside a test (otherwise its supports() declines), and every test ends with
// clear_resolutions().
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "backend/planted_util.h"
#include "gdn/backend/registry.h"
#include "ops/causal_conv1d/op.h"
#include "ops/gated_attention/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/l2norm/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn::ops {
namespace {

// gated_delta_rule: wrong only at dk = dv = 128 (the fast route's constant-shape kernels), in dq.
void gdr_fwd(const GatedDeltaRuleFwd& a) {
  testing::real_cpu<GatedDeltaRuleTable>("gated_delta_rule").forward(a);
}
void gdr_bwd(const GatedDeltaRuleBwd& a) {
  testing::real_cpu<GatedDeltaRuleTable>("gated_delta_rule").backward(a);
  if (a.q.size(2) == 128 && a.v.size(2) == 128) testing::corrupt(a.dq);
}
const GatedDeltaRuleTable kGdr{gdr_fwd, gdr_bwd};

// gated_attention: wrong only at hd = 256 (Qwen3.5's head dim), in o.
void attn_fwd(const GatedAttentionFwd& a) {
  testing::real_cpu<GatedAttentionTable>("gated_attention").forward(a);
  if (a.k.size(2) == 256) testing::corrupt(a.o);
}
void attn_bwd(const GatedAttentionBwd& a) {
  testing::real_cpu<GatedAttentionTable>("gated_attention").backward(a);
}
const GatedAttentionTable kAttn{attn_fwd, attn_bwd};

// gated_attention: wrong only on the output rows of one-token documents.
void attn1_fwd(const GatedAttentionFwd& a) {
  testing::real_cpu<GatedAttentionTable>("gated_attention").forward(a);
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();
  const int64_t row = a.o.size(1) * a.o.size(2);
  for (int64_t n = 0; n + 1 < a.cu_seqlens.numel(); ++n)
    if (cu[n + 1] - cu[n] == 1) testing::corrupt(a.o, cu[n] * row, (cu[n] + 1) * row);
}
const GatedAttentionTable kAttn1{attn1_fwd, attn_bwd};

// rmsnorm / gated_rmsnorm / l2norm: wrong only on rows of whole 8-element packs (the CUDA
// kernels' vector path).
void rms_fwd(const RmsNormFwd& a) {
  testing::real_cpu<RmsNormTable>("rmsnorm").forward(a);
  if (a.x.size(1) % 8 == 0) testing::corrupt(a.y);
}
void rms_bwd(const RmsNormBwd& a) { testing::real_cpu<RmsNormTable>("rmsnorm").backward(a); }
const RmsNormTable kRms{rms_fwd, rms_bwd};

void grms_fwd(const GatedRmsNormFwd& a) {
  testing::real_cpu<GatedRmsNormTable>("gated_rmsnorm").forward(a);
}
void grms_bwd(const GatedRmsNormBwd& a) {
  testing::real_cpu<GatedRmsNormTable>("gated_rmsnorm").backward(a);
  if (a.x.size(1) % 8 == 0) testing::corrupt(a.dz);
}
const GatedRmsNormTable kGrms{grms_fwd, grms_bwd};

void l2_fwd(const L2NormFwd& a) {
  testing::real_cpu<L2NormTable>("l2norm").forward(a);
  if (a.x.size(1) == 128) testing::corrupt(a.y);
}
void l2_bwd(const L2NormBwd& a) { testing::real_cpu<L2NormTable>("l2norm").backward(a); }
const L2NormTable kL2{l2_fwd, l2_bwd};

// causal_conv1d: wrong only without bias and states at W = 4 (the model's calls), in dx.
void conv_fwd(const CausalConv1dFwd& a) {
  testing::real_cpu<CausalConv1dTable>("causal_conv1d").forward(a);
}
void conv_bwd(const CausalConv1dBwd& a) {
  testing::real_cpu<CausalConv1dTable>("causal_conv1d").backward(a);
  if (a.weight.size(1) == 4 && !a.bias.defined() && !a.initial_state.defined())
    testing::corrupt(a.dx);
}
const CausalConv1dTable kConv{conv_fwd, conv_bwd};

void register_planted() {
  static const bool once = [] {
    Registry& r = Registry::global();
    r.add_impl(
        {"gated_delta_rule", "cpu.planted_d128", Backend::Cpu, 100, testing::planted_armed, &kGdr});
    r.add_impl({"gated_attention", "cpu.planted_hd256", Backend::Cpu, 100, testing::planted_armed,
                &kAttn});
    r.add_impl({"gated_attention", "cpu.planted_one_token", Backend::Cpu, 101,
                testing::planted_armed, &kAttn1});
    r.add_impl({"rmsnorm", "cpu.planted_vec", Backend::Cpu, 100, testing::planted_armed, &kRms});
    r.add_impl(
        {"gated_rmsnorm", "cpu.planted_vec", Backend::Cpu, 100, testing::planted_armed, &kGrms});
    r.add_impl({"l2norm", "cpu.planted_d128", Backend::Cpu, 100, testing::planted_armed, &kL2});
    r.add_impl(
        {"causal_conv1d", "cpu.planted_plain", Backend::Cpu, 100, testing::planted_armed, &kConv});
    return true;
  }();
  (void)once;
}

class ProbeClassesSeq : public testing::PlantedTest<register_planted> {};

ShapeClass cpu() { return testing::cpu_class(); }
ShapeClass gdr(int64_t dk, int64_t dv) {
  return cpu()
      .dim("dk", dk)
      .dim("dv", dv)
      .flag("vec", true)
      .flag("l2", true)
      .flag("states", false)
      .flag("saved", false);
}

TEST_F(ProbeClassesSeq, GatedDeltaRuleHeadDim128) {
  expect_rejected("gated_delta_rule", gdr(128, 128), "cpu.planted_d128");
  expect_accepted("gated_delta_rule", gdr(64, 128), "cpu.planted_d128");
  // The default class (dk 32, dv 24) never reaches the fault: what the old single probe saw.
  expect_accepted("gated_delta_rule", cpu(), "cpu.planted_d128");
}

TEST_F(ProbeClassesSeq, GatedAttentionHeadDim256) {
  expect_rejected("gated_attention", cpu().dim("hd", 256).dim("rot", 64).dim("group", 4),
                  "cpu.planted_hd256");
  expect_accepted("gated_attention", cpu().dim("hd", 128).dim("rot", 32).dim("group", 4),
                  "cpu.planted_hd256");
}

TEST_F(ProbeClassesSeq, GatedAttentionOneTokenDocuments) {
  // Every class's probe has a one-token document (and the default class's too).
  for (const ShapeClass& c : {cpu(), cpu().dim("hd", 128).dim("rot", 32).dim("group", 4),
                              cpu().dim("hd", 256).dim("rot", 64).dim("group", 2)}) {
    Registry::global().clear_resolutions();
    const Resolution& r = Registry::global().resolve("gated_attention", c.query());
    EXPECT_NE(r.impl->name, "cpu.planted_one_token") << c.query().shape_class;
    bool named = false;
    for (const std::string& line : r.rejected)
      named = named || line.find("cpu.planted_one_token") != std::string::npos;
    EXPECT_TRUE(named) << c.query().shape_class;
  }
}

TEST_F(ProbeClassesSeq, NormsVectorRows) {
  expect_rejected("rmsnorm", cpu().dim("D", 2560).flag("vec", true), "cpu.planted_vec");
  expect_accepted("rmsnorm", cpu().dim("D", 97).flag("vec", false), "cpu.planted_vec");
  // A width of whole packs whose pointers were not aligned: the probe runs the scalar class.
  expect_accepted("rmsnorm", cpu().dim("D", 2560).flag("vec", false), "cpu.planted_vec");
  expect_rejected("gated_rmsnorm", cpu().dim("D", 128).flag("vec", true), "cpu.planted_vec");
  expect_accepted("gated_rmsnorm", cpu().dim("D", 12).flag("vec", false), "cpu.planted_vec");
  expect_rejected("l2norm", cpu().dim("D", 128).flag("vec", true), "cpu.planted_d128");
  expect_accepted("l2norm", cpu().dim("D", 64).flag("vec", true), "cpu.planted_d128");
}

TEST_F(ProbeClassesSeq, ConvModelCalls) {
  const auto conv = [](bool bias, bool states) {
    return cpu()
        .dim("W", 4)
        .dim("C", 2048)
        .flag("vec", true)
        .flag("silu", true)
        .flag("bias", bias)
        .flag("states", states);
  };
  expect_rejected("causal_conv1d", conv(false, false), "cpu.planted_plain");
  expect_accepted("causal_conv1d", conv(true, true), "cpu.planted_plain");
}

// Through the public entry point: a Qwen3.5-shaped gated delta rule call builds the dk 128 class
// and its probe rejects the planted implementation before the call runs.
TEST_F(ProbeClassesSeq, EntryPointResolvesTheProductionClass) {
  const int64_t T = 70, Hk = 1, Hv = 2, d = 128;
  auto t = [](std::initializer_list<int64_t> s, float v) {
    OwnedTensor x = OwnedTensor::zeros(DType::F32, s);
    for (int64_t i = 0; i < x.numel(); ++i) x.ptr<float>()[i] = v * std::sin(0.37f * i);
    return x;
  };
  OwnedTensor q = t({T, Hk, d}, 1), k = t({T, Hk, d}, 1), v = t({T, Hv, d}, 1);
  OwnedTensor g = t({T, Hv}, 0), beta = t({T, Hv}, 0);
  for (int64_t i = 0; i < T * Hv; ++i) {
    g.ptr<float>()[i] = -0.1f;
    beta.ptr<float>()[i] = 0.5f;
  }
  OwnedTensor cu = OwnedTensor::zeros(DType::I32, {2});
  cu.ptr<int32_t>()[1] = static_cast<int32_t>(T);
  OwnedTensor o = OwnedTensor::zeros(DType::F32, {T, Hv, d});
  gated_delta_rule_forward({q, k, v, g, beta, cu, Tensor(), o, Tensor(), 0.0, true});
  bool found = false;
  for (const Registry::Decision& dec : Registry::global().decisions())
    if (dec.op == "gated_delta_rule") {
      found = true;
      EXPECT_EQ(dec.query.dim("dk", 0), 128);
      EXPECT_EQ(dec.result.impl->name, "cpu.chunk64") << dec.query.shape_class;
    }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace gdn::ops
