// The A/B switches of the fused kernel routes (issue 8; model/qwen35.h, docs/TRAINING.md): each
// kernels.fused_* key at false really runs its unfused composition (its ops show up in the profiled
// step, the fused op does not), and the step-1 and step-2 losses of the tiny model agree with the
// fused routes' to the precision the unfused route's intermediates are rounded to (fp32 here; the
// cuda twin in test_train_cuda.cpp holds them to bf16 precision). Invalid values are errors that
// name the key; the environment knobs these keys replaced are errors naming the key.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "gdn/core/env.h"
#include "gdn/core/error.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

// The tiny model, 2 steps of 2 micro-batches (a caller denominator: the global batch's targets)
// of 4 MQAR examples each.
ConfigTree two_steps(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / fmt::format("gdn_fr_{}_{}", ::getpid(), tag);
  fs::remove_all(d);
  ConfigTree c(default_train_config());
  c.set(fmt::format("run.dir=\"{}\"", d.string()));
  c.set("train.steps=2");
  c.set("train.grad_accum=2");
  c.set("train.micro_batch_tokens=128");
  c.set("data.mqar.seq_len=32");
  c.set("data.mqar.num_pairs=4");
  c.set("eval.every=0");
  c.set("checkpoint.every=0");
  c.set("checkpoint.at_end=false");
  return c;
}

struct RouteRun {
  std::vector<double> losses;
  std::map<std::string, int64_t> calls;  // profiled step 2: range name -> calls
};

// Runs two_steps with the given run config keys set (every other one at its default).
RouteRun run_with(const std::map<std::string, std::string>& keys, const std::string& tag,
                  const char* recompute = "none") {
  TrainOptions o;
  o.quiet = true;
  o.profile_step = 2;
  RouteRun r;
  ConfigTree cfg = two_steps(tag);
  cfg.set(fmt::format("train.recompute=\"{}\"", recompute));
  for (const auto& [k, v] : keys) cfg.set(k + "=" + v);
  TrainResult t = run_training(cfg, o);
  r.losses = t.losses;
  for (const auto& row : t.profile) r.calls[row.name] = row.calls;
  return r;
}

struct Case {
  const char* knob;
  std::vector<const char*> unfused_ranges;  // profile ranges only the unfused route has
  const char* fused_range;                  // a range only the fused route has (or nullptr)
  bool cpu_bitwise;                         // the same fp32 expressions on the cpu (see below)
};

const Case kCases[] = {
    {"kernels.fused_conv", {"conv.silu.fwd", "conv.silu.bwd"}, nullptr, true},
    {"kernels.fused_qk_l2norm", {"gdn.l2norm.fwd", "gdn.l2norm.bwd"}, nullptr, true},
    {"kernels.fused_swiglu",
     {"swiglu.mul.fwd", "swiglu.mul.bwd", "swiglu.silu.bwd"},
     nullptr,
     true},
    {"kernels.fused_zc_norm", {"zc_norm.materialise"}, nullptr, true},
    {"kernels.fused_lm_head",
     {"lm_head.logits", "lm_head.ce", "lm_head.grad"},
     "lm_head_loss",
     false},
};

// fp32 activations on the cpu: the unfused routes store their intermediate (the conv's
// pre-activation, the normalised q, k and their gradients, silu(gate), 1 + w) in fp32, the very
// value the fused cpu kernels hold in an fp32 register or buffer, and the silu / mul / l2norm /
// plain-norm kernels evaluate the fused kernels' expressions (same operations, same order), so
// those four knobs leave the cpu losses bitwise unchanged (on cuda the intermediates are rounded
// to bf16 and they are not). The LM head's cross_entropy sums its rows in another order (and on
// the host) than linear_cross_entropy: fp32 rounding, seen 3e-8 relative; 1e-5 relative still
// rejects a wrong term, which moves the loss by 1e-3 or more.
constexpr double kCpuRelTol = 1e-5;

TEST(FusedRoutes, EachUnfusedRouteRunsAndAgreesWithTheFusedOne) {
  const RouteRun base = run_with({}, "base");
  ASSERT_EQ(base.losses.size(), 2u);
  for (const Case& c : kCases) {
    for (const char* r : c.unfused_ranges) EXPECT_FALSE(base.calls.count(r)) << r;
    if (c.fused_range != nullptr) {
      EXPECT_TRUE(base.calls.count(c.fused_range)) << c.fused_range;
    }
  }
  // The tiny model: 3 GDN layers (conv), 4 MLPs, 9 zero-centred norms; 2 micro-batches.
  for (const Case& c : kCases) {
    const RouteRun u = run_with({{c.knob, "false"}}, std::string("u_") + c.knob);
    ASSERT_EQ(u.losses.size(), 2u) << c.knob;
    for (const char* r : c.unfused_ranges)
      EXPECT_TRUE(u.calls.count(r))
          << c.knob << "=false: range " << r << " missing (route not run)";
    if (c.fused_range != nullptr) {
      EXPECT_FALSE(u.calls.count(c.fused_range)) << c.knob << "=false still ran " << c.fused_range;
    }
    for (size_t i = 0; i < 2; ++i) {
      std::printf("%s step %zu: fused %.9f unfused %.9f (%+.2e relative)\n", c.knob, i + 1,
                  base.losses[i], u.losses[i], (u.losses[i] - base.losses[i]) / base.losses[i]);
      if (c.cpu_bitwise) {
        EXPECT_EQ(u.losses[i], base.losses[i]) << c.knob << "=false, step " << i + 1;
      } else {
        EXPECT_NEAR(u.losses[i], base.losses[i], kCpuRelTol * base.losses[i])
            << c.knob << "=false, step " << i + 1;
      }
    }
  }
  if (const auto it = base.calls.find("swiglu.fwd"); it != base.calls.end()) {
    EXPECT_EQ(it->second, 2 * 4);  // 4 MLPs x 2 micro-batches
  }
}

// Every route unfused together, and the unfused routes under the
// recompute policies, which re-run the layer forward (now the unfused one) before each backward:
// bitwise the losses of recompute none, as with the fused routes.
TEST(FusedRoutes, AllUnfusedAtOnceAgreesWithTheFusedRoutes) {
  const RouteRun base = run_with({}, "base_all");
  const std::map<std::string, std::string> all = {{"kernels.fused_conv", "false"},
                                                  {"kernels.fused_qk_l2norm", "false"},
                                                  {"kernels.fused_swiglu", "false"},
                                                  {"kernels.fused_zc_norm", "false"},
                                                  {"kernels.fused_lm_head", "false"}};
  const RouteRun u = run_with(all, "all_unfused");
  ASSERT_EQ(u.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(u.losses[i], base.losses[i], kCpuRelTol * base.losses[i]) << "step " << i + 1;
  for (const char* policy : {"selective", "full"}) {
    const RouteRun r = run_with(all, std::string("all_unfused_") + policy, policy);
    ASSERT_EQ(r.losses.size(), 2u);
    for (size_t i = 0; i < 2; ++i)
      EXPECT_EQ(r.losses[i], u.losses[i]) << "recompute " << policy << ", step " << i + 1;
  }
}

// The unfused LM head with a logits chunk of a few rows (memory.lce_chunk_bytes = 5 rows of the
// tiny model's vocabulary): the same losses as with one chunk, to fp32 rounding.
TEST(FusedRoutes, UnfusedLmHeadChunksRows) {
  const RouteRun one = run_with({{"kernels.fused_lm_head", "false"}}, "lm_one");
  const RouteRun many =
      run_with({{"kernels.fused_lm_head", "false"}, {"memory.lce_chunk_bytes", "4096"}}, "lm_many");
  ASSERT_EQ(many.losses.size(), 2u);
  ASSERT_TRUE(many.calls.count("lm_head.ce"));
  EXPECT_GT(many.calls.at("lm_head.ce"), one.calls.at("lm_head.ce"));
  for (size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(many.losses[i], one.losses[i], kCpuRelTol * one.losses[i]) << "step " << i + 1;
}

TEST(FusedRoutes, InvalidValuesAreErrorsNamingTheKey) {
  for (const char* key : {"kernels.fused_conv", "kernels.fused_qk_l2norm", "kernels.fused_swiglu",
                          "kernels.fused_zc_norm", "kernels.fused_lm_head"}) {
    std::string msg;
    try {
      run_with({{key, "2"}}, "bad");
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(fmt::format("key '{}' expects a boolean value, got 2", key)),
              std::string::npos)
        << key << ": '" << msg << "'";
  }
}

// The environment knobs that became run config keys: setting one is an error naming its key (it
// would otherwise be ignored silently); every route is fused by default.
TEST(FusedRoutes, OldKnobsAreErrorsNamingTheirKeys) {
  const std::pair<const char*, const char*> moved[] = {
      {"GDN_FUSED_CONV", "kernels.fused_conv"},
      {"GDN_FUSED_QK_L2NORM", "kernels.fused_qk_l2norm"},
      {"GDN_FUSED_SWIGLU", "kernels.fused_swiglu"},
      {"GDN_FUSED_ZC_NORM", "kernels.fused_zc_norm"},
      {"GDN_FUSED_LM_HEAD", "kernels.fused_lm_head"},
      {"GDN_FLCE_CHUNK_BYTES", "memory.lce_chunk_bytes"},
      {"GDN_GDR_SAVED_MIN_DOC_TOKENS", "memory.gdr_saved_min_doc_tokens"},
      {"GDN_GRADS_IN_ACTIVATIONS", "memory.grads_in_activations"},
      {"GDN_SPLIT_MASTER", "optim.split_master"},
      {"GDN_FAIL_ON_NONFINITE", "train.fail_on_nonfinite"}};
  for (const auto& [knob, key] : moved) {
    setenv(knob, "0", 1);
    std::string msg;
    try {
      env::check_environment();
    } catch (const Error& e) {
      msg = e.what();
    }
    unsetenv(knob);
    EXPECT_NE(msg.find(fmt::format("{} is no longer read: it is the run config key {}", knob, key)),
              std::string::npos)
        << knob << ": '" << msg << "'";
    for (const env::Knob& k : env::knobs()) EXPECT_NE(std::string_view(k.name), knob);
  }
  const ConfigTree d(default_train_config());
  for (const char* key : {"kernels.fused_conv", "kernels.fused_qk_l2norm", "kernels.fused_swiglu",
                          "kernels.fused_zc_norm", "kernels.fused_lm_head"})
    EXPECT_TRUE(d.get_bool(key)) << key;
}

}  // namespace
}  // namespace gdn::train
