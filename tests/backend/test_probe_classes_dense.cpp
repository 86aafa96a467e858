// Fault injection for the dense ops' shape-class probes (issue 21 §2): a deliberately wrong CPU
// implementation, above the real one, that wraps the real one and corrupts its output only in one
// production shape class. The resolver must reject it at that class (the probe runs the class)
// and accept it at a class where it is correct (the probe is not simply failing everything).
// Planted implementations cannot be unregistered: each is armed only inside its test (otherwise
// its supports() declines), and every test ends with clear_resolutions().
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <string>
#include <string_view>

#include "backend/planted_util.h"
#include "backend/shape_class.h"
#include "gdn/backend/registry.h"
#include "ops/adamw/op.h"
#include "ops/embedding/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/gemm/op.h"
#include "ops/linear_cross_entropy/op.h"
#include "ops/swiglu/op.h"

namespace gdn::ops {
namespace {

// --- planted implementations -------------------------------------------------------------------

// swiglu: wrong only when every pointer is 16-byte aligned (the vec class).
void swiglu_fwd(const SwigluFwd& a) {
  testing::real_cpu<SwigluTable>("swiglu").forward(a);
  if (all_aligned16(a.gate, a.up, a.y)) testing::corrupt(a.y);
}
void swiglu_bwd(const SwigluBwd& a) {
  testing::real_cpu<SwigluTable>("swiglu").backward(a);
  if (all_aligned16(a.gate, a.up, a.dy, a.dgate, a.dup)) testing::corrupt(a.dup);
}
const SwigluTable kSwiglu{swiglu_fwd, swiglu_bwd};

// gdn_gates: wrong only at the model's head counts (Hv % 16 == 0), in the backward's dA_log.
void gates_fwd(const GdnGatesFwd& a) { testing::real_cpu<GdnGatesTable>("gdn_gates").forward(a); }
void gates_bwd(const GdnGatesBwd& a) {
  testing::real_cpu<GdnGatesTable>("gdn_gates").backward(a);
  if (a.a.size(1) % 16 == 0) testing::corrupt(a.dA_log);
}
const GdnGatesTable kGates{gates_fwd, gates_bwd};

// gemm: wrong only when accumulating into C (beta != 0: every dW of a step).
void gemm_wrong(const GemmArgs& a) {
  testing::real_cpu<GemmTable>("gemm").gemm(a);
  if (a.beta != 0) testing::corrupt(a.c);
}
const GemmTable kGemm{gemm_wrong};

// adamw: wrong only on the device clip path (clip.sumsq given): every first moment bumped.
void adamw_step_wrong(const AdamWStep& s) {
  testing::real_cpu<AdamWTable>("adamw").step(s);
  if (s.clip.sumsq.defined())
    for (const AdamWParam& e : s.params) testing::corrupt(e.m);
}
double adamw_sumsq(std::span<const Tensor> g) {
  return testing::real_cpu<AdamWTable>("adamw").grad_sumsq(g);
}
void adamw_sumsq_into(std::span<const Tensor> g, const Tensor& out) {
  testing::real_cpu<AdamWTable>("adamw").grad_sumsq_into(g, out);
}
void adamw_refresh(std::span<const Bf16Copy> c) {
  testing::real_cpu<AdamWTable>("adamw").refresh_bf16(c);
}
const AdamWTable kAdamw{adamw_step_wrong, adamw_sumsq, adamw_sumsq_into, adamw_refresh};

// linear_cross_entropy: wrong only with I32 targets (the model's labels), in lse.
void lce_fwd(const LinearCrossEntropyArgs& a) {
  testing::real_cpu<LinearCrossEntropyTable>("linear_cross_entropy").forward(a);
  if (a.targets.dtype() == DType::I32) testing::corrupt(a.lse);
}
void lce_fwd_bwd(const LinearCrossEntropyArgs& a) {
  testing::real_cpu<LinearCrossEntropyTable>("linear_cross_entropy").forward_backward(a);
  if (a.targets.dtype() == DType::I32) testing::corrupt(a.lse);
}
const LinearCrossEntropyTable kLce{lce_fwd, lce_fwd_bwd};

// embedding: wrong only when a plan is given (the model's cuda calls), in dW.
void emb_fwd(const EmbeddingFwd& a) { testing::real_cpu<EmbeddingTable>("embedding").forward(a); }
void emb_bwd(const EmbeddingBwd& a) {
  testing::real_cpu<EmbeddingTable>("embedding").backward(a);
  if (a.plan.defined()) testing::corrupt(a.dw);
}
const EmbeddingTable kEmbedding{emb_fwd, emb_bwd};

// embedding: wrong only at widths of whole 8-element packs (the CUDA gather's vector path).
void emb8_fwd(const EmbeddingFwd& a) {
  testing::real_cpu<EmbeddingTable>("embedding").forward(a);
  if (a.w.size(1) % 8 == 0) testing::corrupt(a.y);
}
void emb8_bwd(const EmbeddingBwd& a) { testing::real_cpu<EmbeddingTable>("embedding").backward(a); }
const EmbeddingTable kEmbedding8{emb8_fwd, emb8_bwd};

void register_planted() {
  static const bool once = [] {
    Registry& r = Registry::global();
    r.add_impl({"swiglu", "cpu.planted_vec", Backend::Cpu, 100, testing::planted_armed, &kSwiglu});
    r.add_impl(
        {"gdn_gates", "cpu.planted_hv16", Backend::Cpu, 100, testing::planted_armed, &kGates});
    r.add_impl(
        {"gemm", "cpu.planted_accumulate", Backend::Cpu, 100, testing::planted_armed, &kGemm});
    r.add_impl({"adamw", "cpu.planted_clip", Backend::Cpu, 100, testing::planted_armed, &kAdamw});
    r.add_impl({"linear_cross_entropy", "cpu.planted_i32", Backend::Cpu, 100,
                testing::planted_armed, &kLce});
    r.add_impl(
        {"embedding", "cpu.planted_plan", Backend::Cpu, 100, testing::planted_armed, &kEmbedding});
    r.add_impl(
        {"embedding", "cpu.planted_d8", Backend::Cpu, 99, testing::planted_armed, &kEmbedding8});
    return true;
  }();
  (void)once;
}

class ProbeClasses : public testing::PlantedTest<register_planted> {
 protected:
  void SetUp() override {
    for (const char* op :
         {"SWIGLU", "GDN_GATES", "GEMM", "ADAMW", "LINEAR_CROSS_ENTROPY", "EMBEDDING"})
      unsetenv((std::string("GDN_OP_") + op).c_str());
    PlantedTest::SetUp();
  }
};

ShapeClass cpu() { return testing::cpu_class(); }

TEST_F(ProbeClasses, SwigluVecClass) {
  expect_rejected("swiglu", cpu().flag("vec", true), "cpu.planted_vec");
  expect_accepted("swiglu", cpu().flag("vec", false), "cpu.planted_vec");
  expect_rejected("swiglu", cpu(), "cpu.planted_vec");  // the default class runs both layouts
}

// Through the public entry point: the op builds the class the test resolved above.
TEST_F(ProbeClasses, SwigluEntryPointResolvesTheVecClass) {
  const int64_t R = 4, I = 64;
  OwnedTensor gate = OwnedTensor::zeros(DType::F32, {R, I}),
              up = OwnedTensor::zeros(DType::F32, {R, I}),
              y = OwnedTensor::zeros(DType::F32, {R, I});
  swiglu_forward({gate, up, y});
  bool seen = false;
  for (const Registry::Decision& d : Registry::global().decisions()) {
    if (d.op != "swiglu") continue;
    seen = true;
    EXPECT_EQ(d.query.shape_class, "vec=1");
    EXPECT_EQ(d.result.impl->name, "cpu.elementwise");
    ASSERT_FALSE(d.result.rejected.empty());
    EXPECT_NE(d.result.rejected[0].find("cpu.planted_vec"), std::string::npos);
  }
  EXPECT_TRUE(seen);
  EXPECT_EQ(to_f64_vector(y)[0], 0.0);  // silu(0) * 0 from the real implementation
}

TEST_F(ProbeClasses, GdnGatesHeadsClass) {
  expect_rejected("gdn_gates", cpu().dim("Hv", 32).flag("vec", true), "cpu.planted_hv16");
  expect_rejected("gdn_gates", cpu().dim("Hv", 16).flag("vec", false), "cpu.planted_hv16");
  expect_accepted("gdn_gates", cpu().dim("Hv", 5).flag("vec", true), "cpu.planted_hv16");
}

TEST_F(ProbeClasses, GemmAccumulateClass) {
  expect_rejected("gemm", cpu().flag("c_f32", false).flag("beta", true), "cpu.planted_accumulate");
  expect_accepted("gemm", cpu().flag("c_f32", false).flag("beta", false), "cpu.planted_accumulate");
}

TEST_F(ProbeClasses, AdamwClipClass) {
  expect_rejected("adamw", cpu().flag("split", false).flag("clip", true), "cpu.planted_clip");
  expect_rejected("adamw", cpu().flag("split", true).flag("clip", true), "cpu.planted_clip");
  expect_rejected("adamw", cpu(), "cpu.planted_clip");  // the default class runs the clip path
  expect_accepted("adamw", cpu().flag("split", true).flag("clip", false), "cpu.planted_clip");
}

TEST_F(ProbeClasses, LinearCrossEntropyTargetClass) {
  auto c = [](bool t32) {
    return cpu().dim("D", 64).flag("t32", t32).flag("ws", true).flag("den", true);
  };
  expect_rejected("linear_cross_entropy", c(true), "cpu.planted_i32");
  expect_accepted("linear_cross_entropy", c(false), "cpu.planted_i32");
}

TEST_F(ProbeClasses, EmbeddingPlanAndWidthClasses) {
  auto c = [](int64_t D, bool plan) {
    return cpu().dim("D", D).flag("vec", true).flag("plan", plan).flag("i64", false);
  };
  // cpu.planted_plan (priority 100) is tried first: wrong with a plan only.
  expect_rejected("embedding", c(24, true), "cpu.planted_plan");
  // The default class runs a plan and a width of whole packs (D = 64): both are rejected.
  expect_rejected("embedding", cpu(), "cpu.planted_plan");
  // Without a plan cpu.planted_plan is right and chosen; cpu.planted_d8 (wrong at D % 8 == 0)
  // is behind it: checked at a class with a plan, where the first is rejected.
  expect_accepted("embedding", c(24, false), "cpu.planted_plan");
  const Resolution& r = Registry::global().resolve("embedding", c(24, true).query());
  EXPECT_EQ(r.impl->name, "cpu.column_blocks");
  bool d8 = false;
  for (const std::string& line : r.rejected)
    d8 = d8 || line.find("cpu.planted_d8") != std::string::npos;
  EXPECT_TRUE(d8) << "cpu.planted_d8 not rejected at D = 24";
  expect_accepted("embedding", c(25, true), "cpu.planted_d8");
}

}  // namespace
}  // namespace gdn::ops
