// Training on the GPU (issue 8): the tiny model trained on the cuda backend tracks the same model
// trained on the cpu backend from the same initialisation; the gated delta rule's two CUDA routes
// and the fused kernel routes' unfused A/B counterparts (kernels.fused_*) agree to bf16 precision;
// split fp32 masters resume bit-exactly; a 1000-step run under train.fail_on_nonfinite has no
// non-finite step.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "gdn/backend/registry.h"
#include "gdn/core/env.h"
#include "ops/gated_delta_rule/op.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

ConfigTree tiny(const std::string& tag, const std::string& device, int64_t steps) {
  fs::path d = fs::temp_directory_path() / fmt::format("gdn_trc_{}_{}", ::getpid(), tag);
  fs::remove_all(d);
  ConfigTree c(default_train_config());
  c.set(fmt::format("run.dir=\"{}\"", d.string()));
  c.set(fmt::format("train.device=\"{}\"", device));
  c.set(fmt::format("train.steps={}", steps));
  c.set("eval.every=0");
  c.set("checkpoint.at_end=false");
  c.set("checkpoint.every=0");
  return c;
}

double window_mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  for (size_t i = begin; i < end; ++i) s += v[i];
  return s / static_cast<double>(end - begin);
}

// Two steps of the tiny model on cuda under recompute none, selective and full: the losses of the
// three runs are bitwise equal.
void expect_recompute_policies_bitwise_equal(const std::string& tag,
                                             const std::vector<std::string>& sets = {}) {
  TrainOptions quiet;
  quiet.quiet = true;
  std::vector<double> base;
  for (const char* policy : {"none", "selective", "full"}) {
    auto cfg = tiny(tag + policy, "cuda", 2);
    cfg.set(fmt::format("train.recompute=\"{}\"", policy));
    for (const std::string& s : sets) cfg.set(s);
    TrainResult r = run_training(cfg, quiet);
    ASSERT_EQ(r.losses.size(), 2u);
    if (base.empty()) {
      base = r.losses;
      continue;
    }
    for (size_t i = 0; i < 2; ++i)
      EXPECT_EQ(r.losses[i], base[i]) << policy << ": step " << i + 1 << " loss differs";
  }
}

TEST(TrainCuda, TracksTheCpuRunFromTheSameInitialisation) {
  TrainOptions quiet;
  quiet.quiet = true;
  TrainResult gpu = run_training(tiny("gpu", "cuda", 200), quiet);
  TrainResult cpu = run_training(tiny("cpu", "cpu", 200), quiet);
  ASSERT_EQ(gpu.losses.size(), 200u);
  ASSERT_EQ(cpu.losses.size(), 200u);
  // Step 1 runs the same weights on the same batch: bf16 activations vs fp32 only.
  EXPECT_NEAR(gpu.losses[0], cpu.losses[0], 2e-2 * cpu.losses[0]);
  // Then the runs drift apart by rounding, and this model's training amplifies rounding: on the
  // CPU alone, rounding the weights to bf16 once after step 1 (scripts/round_checkpoint_bf16.py,
  // then --resume; docs/TRAINING.md) moves the 20-step means by 0.7% at steps 21-40, 1.6%, 2.2%
  // and 2.8% at steps 41-100, and sets off the recall phase transition at steps 121-140, which the
  // unrounded run has not reached by step 200 (-81% at steps 181-200). The GPU rounds activations
  // and its weight copy to bf16 at every step, so its distance from the CPU run grows the same way
  // (seen 2026-11-29: 3.0% to 6.4% at steps 41-100), and that is chaos, not a defect. Steps 1-20
  // must agree to 0.5% (seen: 0.02%, and -0.01% in docs/PERF.md run 18); steps 21-40 to 3%: they
  // were 0.05% in session 5 and 1.52% in run 18 (commit 3994692), after changes that only move
  // last bits (the compute copy rounds exact ties away from zero with split masters, and the
  // norms' weight-gradient sums run in another order), which is about twice the CPU's own 0.7%
  // from one bf16 rounding of the weights. Past step 40 both runs must keep learning.
  for (size_t w = 0; w < 200; w += 20) {
    const double g = window_mean(gpu.losses, w, w + 20), c = window_mean(cpu.losses, w, w + 20);
    std::printf("steps %3zu-%3zu: cuda %.4f cpu %.4f (%+.2f%%)\n", w + 1, w + 20, g, c,
                100.0 * (g - c) / c);
    if (w < 40) {
      EXPECT_NEAR(g, c, (w < 20 ? 0.005 : 0.03) * c) << "steps " << w + 1 << "-" << w + 20;
    }
  }
  for (const auto* l : {&gpu.losses, &cpu.losses})
    EXPECT_LT(window_mean(*l, 180, 200), 0.5 * window_mean(*l, 0, 20));
}

// The gated delta rule's two CUDA routes (the fast mma.sync route and the generic WMMA route,
// GDN_OP_GATED_DELTA_RULE=cuda.chunk64_generic) compute the same function with different rounding:
// the first two training steps agree to bf16 precision.
void force_gdr(const char* impl) {
  if (impl != nullptr)
    setenv("GDN_OP_GATED_DELTA_RULE", impl, 1);
  else
    unsetenv("GDN_OP_GATED_DELTA_RULE");
  env::reset_cache_for_testing();
  Registry::global().clear_resolutions();
}

TEST(TrainCuda, GdrRouteKnobAgreesToBf16Precision) {
  TrainOptions quiet;
  quiet.quiet = true;
  force_gdr("cuda.chunk64");
  TrainResult a = run_training(tiny("fast", "cuda", 2), quiet);
  force_gdr("cuda.chunk64_generic");
  TrainResult b = run_training(tiny("generic", "cuda", 2), quiet);
  force_gdr(nullptr);
  for (size_t i = 0; i < 2; ++i) {
    std::printf("step %zu: fast route %.6f generic route %.6f\n", i + 1, a.losses[i], b.losses[i]);
    EXPECT_NEAR(a.losses[i], b.losses[i], 1e-2 * a.losses[i]) << "step " << i + 1;
  }
}

// Split fp32 masters (optim.split_master, the default: the bf16 compute copy plus an I16 low
// half, ops/adamw/op.h): a run stopped after step 3 and resumed from its checkpoint (the masters
// joined on the host to write it, split again on upload) repeats the uninterrupted run's losses
// bitwise, with checkpoints written every 2 steps on the way; and the key at false (a separate fp32
// master, the copy rounded ties-to-even) agrees to bf16 precision.
TEST(TrainCuda, SplitMastersResumeBitExactlyAndAgreeWithSeparateMasters) {
  TrainOptions quiet;
  quiet.quiet = true;
  auto cfg = [](const std::string& tag) {
    ConfigTree c = tiny(tag, "cuda", 6);
    c.set("checkpoint.every=2");
    return c;
  };
  env::reset_cache_for_testing();
  const TrainResult full = run_training(cfg("split_full"), quiet);
  const ConfigTree resumed = cfg("split_resumed");
  TrainOptions stop = quiet;
  stop.stop_after = 3;
  const TrainResult first = run_training(resumed, stop);
  TrainOptions resume = quiet;
  resume.resume = true;
  const TrainResult rest = run_training(resumed, resume);
  ASSERT_EQ(full.losses.size(), 6u);
  ASSERT_EQ(first.losses.size(), 3u);
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(first.losses[i], full.losses[i]) << "step " << i + 1;
    EXPECT_EQ(rest.losses[i], full.losses[i + 3]) << "step " << i + 4 << " after resume";
  }
  ConfigTree off = cfg("split_off");
  off.set("optim.split_master=false");
  const TrainResult separate = run_training(off, quiet);
  ASSERT_EQ(separate.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    std::printf("step %zu: split masters %.9f separate masters %.9f\n", i + 1, full.losses[i],
                separate.losses[i]);
    EXPECT_NEAR(separate.losses[i], full.losses[i], 1e-2 * full.losses[i]) << "step " << i + 1;
  }
}

// The A/B switches of the fused kernel routes (model/qwen35.h, docs/TRAINING.md): each
// kernels.fused_* key at false really runs its unfused composition (its ops show up in the profiled
// step 2), and the step-1 and step-2 losses agree with the fused routes' to bf16 precision: the
// unfused routes round an intermediate (the conv's pre-activation, the gradients of the normalised
// q and k, silu(gate), 1 + w, the logits and dlogits) to bf16 where the fused kernels keep it in
// fp32, so none of these switches is scheduling-only.
TEST(TrainCuda, FusedRouteKnobsAgreeToBf16Precision) {
  struct Case {
    const char* knob;
    const char* range;  // a profile range only the unfused route has
  };
  const Case cases[] = {{"kernels.fused_conv", "conv.silu.bwd"},
                        {"kernels.fused_qk_l2norm", "gdn.l2norm.bwd"},
                        {"kernels.fused_swiglu", "swiglu.mul.fwd"},
                        {"kernels.fused_zc_norm", "zc_norm.materialise"},
                        {"kernels.fused_lm_head", "lm_head.ce"}};
  TrainOptions o;
  o.quiet = true;
  o.profile_step = 2;
  env::reset_cache_for_testing();
  TrainResult base = run_training(tiny("fused", "cuda", 2), o);
  ASSERT_EQ(base.losses.size(), 2u);
  for (const Case& c : cases) {
    ConfigTree uc = tiny(std::string("unfused_") + c.knob, "cuda", 2);
    uc.set(std::string(c.knob) + "=false");
    TrainResult u = run_training(uc, o);
    ASSERT_EQ(u.losses.size(), 2u) << c.knob;
    std::set<std::string> names;
    for (const auto& row : u.profile) names.insert(row.name);
    EXPECT_TRUE(names.count(c.range)) << c.knob << "=false: range " << c.range << " missing";
    for (size_t i = 0; i < 2; ++i) {
      std::printf("%s step %zu: fused %.9f unfused %.9f (%+.2e relative)\n", c.knob, i + 1,
                  base.losses[i], u.losses[i], (u.losses[i] - base.losses[i]) / base.losses[i]);
      EXPECT_NEAR(u.losses[i], base.losses[i], 1e-2 * base.losses[i])
          << c.knob << " step " << i + 1;
    }
  }
}

// Every kernels.fused_* key at false, under the recompute policies: recompute re-runs the (unfused)
// layer forward before each backward, which only changes scheduling, so the losses are bitwise
// those of recompute none.
TEST(TrainCuda, UnfusedRoutesUnderRecomputeAreBitwiseUnchanged) {
  expect_recompute_policies_bitwise_equal(
      "unfused_rc_",
      {"kernels.fused_conv=false", "kernels.fused_qk_l2norm=false", "kernels.fused_swiglu=false",
       "kernels.fused_zc_norm=false", "kernels.fused_lm_head=false"});
}

// Recompute policies only change what is kept and when it is computed: the step-1 and step-2
// losses are bitwise those of recompute none (issue 8's rule for scheduling knobs).
TEST(TrainCuda, RecomputePoliciesLeaveTheLossesBitwiseUnchanged) {
  expect_recompute_policies_bitwise_equal("rc_");
}

// Recompute none keeps each GDN layer's gated delta rule states for its backward (the op's
// `saved`), which then skips its sequential state pass. memory.gdr_saved_min_doc_tokens = 32 plans
// them for the default MQAR micro-batches (64 examples of 32 tokens; the default 128 plans too
// little for so many documents and those batches recompute); 0 plans none. On both GDR routes the
// losses of three steps are bitwise the same either way (the saved states are bitwise the
// recomputed ones, so the gradients are too).
TEST(TrainCuda, GdrSavedStatesLeaveTheLossesBitwiseUnchanged) {
  TrainOptions quiet;
  quiet.quiet = true;
  for (const char* route : {"cuda.chunk64", "cuda.chunk64_generic"}) {
    force_gdr(route);
    std::vector<std::vector<double>> runs;
    for (const char* min_doc : {"32", "0"}) {
      auto cfg = tiny(fmt::format("saved_{}_{}", route, min_doc), "cuda", 3);
      cfg.set("train.recompute=\"none\"");
      cfg.set(fmt::format("memory.gdr_saved_min_doc_tokens={}", min_doc));
      runs.push_back(run_training(cfg, quiet).losses);
    }
    ASSERT_EQ(runs[0].size(), 3u);
    ASSERT_EQ(runs[1].size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      std::printf("%s step %zu: saved %.9f recomputed %.9f\n", route, i + 1, runs[0][i],
                  runs[1][i]);
      EXPECT_EQ(runs[0][i], runs[1][i]) << route << " step " << i + 1;
    }
  }
  force_gdr(nullptr);
}

// memory.grads_in_activations (the gradients in activation memory the backward has consumed, one
// micro-batch a step) is scheduling-only on the GPU too: under recompute none (the GDR saved
// states among the activations) and full, the losses of three steps are bitwise those with the
// gradients in an arena of their own.
TEST(TrainCuda, GradsInActivationsLeaveTheLossesBitwiseUnchanged) {
  TrainOptions quiet;
  quiet.quiet = true;
  for (const char* policy : {"none", "full"}) {
    std::vector<std::vector<double>> runs;
    for (const char* knob : {"true", "false"}) {
      auto cfg = tiny(fmt::format("gia_{}_{}", policy, knob), "cuda", 3);
      cfg.set(fmt::format("train.recompute=\"{}\"", policy));
      cfg.set(fmt::format("memory.grads_in_activations={}", knob));
      runs.push_back(run_training(cfg, quiet).losses);
    }
    ASSERT_EQ(runs[0].size(), 3u);
    ASSERT_EQ(runs[1].size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_EQ(runs[0][i], runs[1][i]) << "recompute " << policy << ", step " << i + 1;
  }
}

// --profile-step on the GPU: CUDA-event ranges for every op group of the step, summing to no more
// than the synchronised step's wall time.
TEST(TrainCuda, ProfileStepTimesTheOpsWithCudaEvents) {
  TrainOptions o;
  o.quiet = true;
  o.profile_step = 3;
  auto cfg = tiny("profile", "cuda", 4);
  TrainResult r = run_training(cfg, o);
  ASSERT_FALSE(r.profile.empty());
  std::set<std::string> names;
  double sum = 0;
  for (const auto& row : r.profile) {
    names.insert(row.name);
    EXPECT_GT(row.ms, 0.0) << row.name;
    sum += row.ms;
  }
  for (const char* n : {"gdr.fwd", "gdr.bwd", "attn.core.fwd", "attn.core.bwd", "lm_head_loss",
                        "conv.bwd", "optimizer"})
    EXPECT_TRUE(names.count(n)) << n;
  EXPECT_LE(sum, r.profile_step_ms * 1.001);
  std::printf("%s\n", format_profile(r.profile, r.profile_step_ms).c_str());
}

// The step loop on the device issues no synchronisation (issue 8): the inputs go up through
// page-locked staging, the losses, gradient norm and clip-or-skip decision stay on the device and
// reach the host one step late. Between the third step and the last, the host never drains the
// device's queue; the losses are those of a fresh identical run, bit for bit.
TEST(TrainCuda, StepLoopNeverDrainsTheDevice) {
  TrainOptions quiet;
  quiet.quiet = true;
  auto cfg_a = tiny("nodrain_a", "cuda", 8), cfg_b = tiny("nodrain_b", "cuda", 8);
  cfg_a.set("train.grad_accum=2");
  cfg_b.set("train.grad_accum=2");
  TrainResult a = run_training(cfg_a, quiet);
  TrainResult b = run_training(cfg_b, quiet);
  EXPECT_EQ(a.steady_drains, 0);
  ASSERT_EQ(a.losses.size(), 8u);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.skipped_steps, 0);
  for (double l : a.losses) EXPECT_TRUE(std::isfinite(l));
}

TEST(TrainCuda, ThousandStepsWithoutANonFiniteStep) {
  TrainOptions quiet;
  quiet.quiet = true;
  auto cfg = tiny("long", "cuda", 1000);
  cfg.set("eval.every=500");
  cfg.set("train.fail_on_nonfinite=true");
  TrainResult r = run_training(cfg, quiet);  // throws at the first non-finite step
  EXPECT_EQ(r.steps_done, 1000);
  EXPECT_EQ(r.skipped_steps, 0);
  EXPECT_GE(r.eval_accuracy, 0.9);
  std::printf("1000 steps: final loss %.4f, eval recall accuracy %.3f\n", r.final_loss,
              r.eval_accuracy);
}

}  // namespace
}  // namespace gdn::train
