// The trainer's host optimizer (train/optimizer.h) on its own: which tensors decay, the skip of a
// non-finite step, the compute copy following the masters, and the Adam step count. The device
// optimizer runs in tests/train/test_train_cuda.cpp (whole runs against the CPU).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "model/config.h"
#include "model/qwen35.h"
#include "model/weights.h"
#include "ops/adamw/op.h"
#include "train/optimizer.h"

namespace gdn::train {
namespace {

struct Fixture {
  model::Qwen35Config cfg = model::tiny_config();
  model::Qwen35Model model{cfg, Backend::Cpu, 64, 2, {}};
  std::vector<model::ParamSpec> specs = model::param_specs(cfg);

  // Masters drawn from seed 5 (a second call gives the same bits).
  OptimizerState fresh_state() const {
    OptimizerState s;
    s.master = model::ParamStore(specs);
    model::init_params(s.master, cfg, 5);
    return s;
  }
  void fill_grads(float value) {
    for (const Tensor& g : model.grads()) {
      float* p = g.ptr<float>();  // [numel] F32 (cpu)
      for (int64_t j = 0; j < g.numel(); ++j) p[j] = value * static_cast<float>(1 + j % 7);
    }
  }
};

OptimizerConfig config(double weight_decay) {
  OptimizerConfig oc;
  oc.hyper.beta1 = 0.9;
  oc.hyper.beta2 = 0.95;
  oc.hyper.eps = 1e-8;
  oc.hyper.weight_decay = weight_decay;
  oc.clip = 1.0;
  return oc;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), static_cast<size_t>(a.nbytes())) == 0;
}

bool decays(const std::string& n) {
  return !(n.ends_with("norm.weight") || n.ends_with("A_log") || n.ends_with("dt_bias") ||
           n.find("embed_tokens") != std::string::npos);
}

// With zero gradients and zero moments the Adam term is exactly 0 (ops/adamw/op.h), so a step
// only decays: matrices by the factor (1 - lr * wd) rounded to fp32 once, while norms, A_log,
// dt_bias and the embedding stay bit for bit.
TEST(HostOptimizer, DecaysMatricesOnlyAndReloadsTheComputeCopy) {
  Fixture f;
  const OptimizerState before = f.fresh_state();
  auto opt = make_host_optimizer(f.model, f.specs, f.fresh_state(), config(0.1));
  f.model.zero_grads();
  f.fill_grads(0.0f);
  const double lr = 0.01;
  opt->step(lr, 1, GradCheck{1.0, 0.0, {}, {}});
  const OptimizerState& st = opt->host_state();
  const float factor = static_cast<float>(1.0 - lr * 0.1);
  int decayed = 0, kept = 0;
  for (size_t i = 0; i < f.specs.size(); ++i) {
    const std::string& name = f.specs[i].name;
    const float* b = before.master.tensor(i).ptr<float>();
    const float* a = st.master.tensor(i).ptr<float>();
    const bool d = decays(name);
    for (int64_t j = 0; j < st.master.tensor(i).numel(); ++j) {
      const float want = d ? b[j] * factor : b[j];
      ASSERT_EQ(a[j], want) << name << " element " << j;
    }
    (d ? decayed : kept) += 1;
    // The model computes with the updated masters (cpu: fp32 compute copy).
    EXPECT_TRUE(same_bits(f.model.param(i), st.master.tensor(i))) << name;
  }
  EXPECT_GT(decayed, 0);
  EXPECT_GT(kept, 0);
  EXPECT_EQ(opt->device_bytes(), 0u);
}

// A non-finite loss or gradient norm leaves masters, moments and compute copy untouched.
TEST(HostOptimizer, NonFiniteStepIsSkipped) {
  Fixture f;
  const OptimizerState before = f.fresh_state();
  auto opt = make_host_optimizer(f.model, f.specs, f.fresh_state(), config(0.1));
  f.model.zero_grads();
  f.fill_grads(1e-3f);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double norm = ops::grad_global_norm(f.model.grads());
  opt->step(1e-2, 1, GradCheck{nan, norm, {}, {}});
  opt->step(1e-2, 1, GradCheck{1.0, std::numeric_limits<double>::infinity(), {}, {}});
  const OptimizerState& st = opt->host_state();
  for (size_t i = 0; i < f.specs.size(); ++i) {
    EXPECT_TRUE(same_bits(st.master.tensor(i), before.master.tensor(i))) << f.specs[i].name;
    EXPECT_TRUE(same_bits(f.model.param(i), before.master.tensor(i))) << f.specs[i].name;
    for (const model::ParamStore* mv : {&st.m, &st.v}) {
      const float* p = mv->tensor(i).ptr<float>();
      for (int64_t j = 0; j < mv->tensor(i).numel(); ++j) ASSERT_EQ(p[j], 0.0f);
    }
  }
  // A finite step then moves every tensor (the gradients are non-zero everywhere).
  opt->step(1e-2, 1, GradCheck{1.0, norm, {}, {}});
  for (size_t i = 0; i < f.specs.size(); ++i)
    EXPECT_FALSE(same_bits(st.master.tensor(i), before.master.tensor(i))) << f.specs[i].name;
}

// The state handed in (a resume's masters and moments) is the one updated, and the step count t
// is the caller's: two optimizers given the same state and t agree bit for bit, and a different
// t (another bias correction) gives other bits.
TEST(HostOptimizer, UpdatesTheGivenStateWithTheCallersStepCount) {
  Fixture f;
  auto with_moments = [&] {
    OptimizerState s = f.fresh_state();
    s.ensure(f.specs);
    for (const model::ParamStore* mv : {&s.m, &s.v})
      for (size_t i = 0; i < f.specs.size(); ++i) {
        float* p = mv->tensor(i).ptr<float>();
        for (int64_t j = 0; j < mv->tensor(i).numel(); ++j) p[j] = 1e-4f;
      }
    return s;
  };
  f.model.zero_grads();
  f.fill_grads(2e-3f);
  const double norm = ops::grad_global_norm(f.model.grads());
  auto a = make_host_optimizer(f.model, f.specs, with_moments(), config(0.1));
  auto b = make_host_optimizer(f.model, f.specs, with_moments(), config(0.1));
  auto c = make_host_optimizer(f.model, f.specs, with_moments(), config(0.1));
  a->step(3e-3, 7, GradCheck{1.0, norm, {}, {}});
  b->step(3e-3, 7, GradCheck{1.0, norm, {}, {}});
  c->step(3e-3, 2, GradCheck{1.0, norm, {}, {}});
  bool differs = false;
  for (size_t i = 0; i < f.specs.size(); ++i) {
    EXPECT_TRUE(same_bits(a->host_state().master.tensor(i), b->host_state().master.tensor(i)));
    EXPECT_TRUE(same_bits(a->host_state().m.tensor(i), b->host_state().m.tensor(i)));
    differs =
        differs || !same_bits(a->host_state().master.tensor(i), c->host_state().master.tensor(i));
  }
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace gdn::train
