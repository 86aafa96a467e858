// dist.shard = optimizer on the device (label gpu): the sharded optimizer (zero_optimizer.cpp)
// over a world-size-1 NCCL communicator, against the device optimizer on the same gradients.
// At world size 1 the reduce-scatter and the all-gather are copies, so the whole sharded path
// runs (packing into buckets of 1000 elements, so that parameters straddle buckets; the update
// over pieces; the bf16 compute copy gathered back; the state gathered for a checkpoint).
// Without clipping the two must agree bit for bit; with clipping the norm's sum runs in another
// order (the fp32-compute tensors last), so to fp64 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>
#include <vector>

#include "dist/comm.h"
#include "model/config.h"
#include "model/qwen35.h"
#include "model/weights.h"
#include "ops/adamw/op.h"
#include "train/optimizer.h"

namespace gdn::train {
namespace {

struct Pair {
  model::Qwen35Config cfg = model::tiny_config();
  std::vector<model::ParamSpec> specs = model::param_specs(cfg);
  model::Qwen35Model a{cfg, Backend::Cuda, 64, 2, {}}, b{cfg, Backend::Cuda, 64, 2, {}};

  OptimizerState fresh() const {
    OptimizerState s;
    s.master = model::ParamStore(specs);
    model::init_params(s.master, cfg, 5);
    return s;
  }
  // The same gradients in both models (step t's pattern).
  void fill_grads(int t) {
    for (model::Qwen35Model* m : {&a, &b})
      for (const Tensor& g : m->grads()) {
        std::vector<float> h(static_cast<size_t>(g.numel()));
        for (size_t j = 0; j < h.size(); ++j)
          h[j] = 0.01f * static_cast<float>(t) * static_cast<float>(1 + (j * 7 + t) % 13) -
                 0.06f * static_cast<float>(t);
        copy_bytes(g.data(), Device::CUDA, h.data(), Device::CPU, h.size() * sizeof(float));
      }
  }
};

std::vector<char> host_bytes(const Tensor& t) {
  std::vector<char> h(static_cast<size_t>(t.nbytes()));
  copy_bytes(h.data(), Device::CPU, t.data(), t.device(), h.size());
  return h;
}

OwnedTensor device_scalar(DType dt, double value) {
  OwnedTensor t = OwnedTensor::empty(dt, {1}, Device::CUDA);
  if (dt == DType::F64) {
    copy_bytes(t.view().data(), Device::CUDA, &value, Device::CPU, sizeof(double));
  } else {
    const auto f = static_cast<float>(value);
    copy_bytes(t.view().data(), Device::CUDA, &f, Device::CPU, sizeof(float));
  }
  return t;
}

// Three steps of both optimizers: the compute copies after each (bitwise, when expected) and the
// gathered state at the end (bitwise, or within 1e-5 relative); then a skipped step.
void run_pair(bool split_master, double clip, bool expect_bitwise) {
  Pair p;
  OptimizerConfig oc;
  oc.hyper.weight_decay = 0.1;
  oc.clip = clip;
  oc.split_master = split_master;
  auto comm = dist::make_comm(dist::LaunchInfo{}, dist::CommKind::Nccl, {.timeout_s = 60});
  auto dense = make_device_optimizer(p.a, p.specs, p.fresh(), false, oc, nullptr);
  auto sharded = make_sharded_optimizer(p.b, p.specs, p.fresh(), oc, *comm, 1000);
  ASSERT_TRUE(sharded->sharded());
  ASSERT_GT(sharded->device_bytes(), 0u);
  const OwnedTensor losses = device_scalar(DType::F32, 1.0);
  const OwnedTensor sa = device_scalar(DType::F64, 0), sb = device_scalar(DType::F64, 0);
  for (int t = 1; t <= 3; ++t) {
    p.fill_grads(t);
    ops::grad_sumsq_into(p.a.grads(), sa);
    sharded->reduce_grads();
    ASSERT_TRUE(sharded->grad_sumsq_into(sb));
    double x = 0, y = 0;
    copy_bytes(&x, Device::CPU, sa.view().data(), Device::CUDA, sizeof(double));
    copy_bytes(&y, Device::CPU, sb.view().data(), Device::CUDA, sizeof(double));
    EXPECT_NEAR(y, x, 1e-12 * x) << "step " << t;
    dense->step(1e-2, t, GradCheck{0, 0, sa, losses});
    sharded->step(1e-2, t, GradCheck{0, 0, sb, losses});
    device_synchronize(Device::CUDA);
    for (size_t i = 0; i < p.specs.size() && expect_bitwise; ++i)
      ASSERT_EQ(host_bytes(p.a.param(i)), host_bytes(p.b.param(i)))
          << p.specs[i].name << " after step " << t;
  }
  // The state a checkpoint holds.
  const OptimizerState& x = dense->host_state();
  const OptimizerState& y = sharded->host_state();
  double worst = 0;
  for (size_t i = 0; i < p.specs.size(); ++i)
    for (auto [s, u] : {std::pair{&x.master, &y.master}, {&x.m, &y.m}, {&x.v, &y.v}}) {
      const float* e = s->tensor(i).ptr<float>();  // [numel]
      const float* g = u->tensor(i).ptr<float>();  // [numel]
      for (int64_t j = 0; j < s->tensor(i).numel(); ++j) {
        const double scale = std::max(std::fabs(e[j]), std::fabs(g[j]));
        if (scale > 0) worst = std::max(worst, std::fabs(e[j] - g[j]) / scale);
      }
    }
  if (expect_bitwise)
    EXPECT_EQ(worst, 0.0);
  else
    EXPECT_LT(worst, 1e-5);
  std::printf("split_master %d, clip %g: largest relative difference of the state %.3e\n",
              split_master, clip, worst);
  // A non-finite loss skips the step on the device: nothing moves.
  const OwnedTensor nan = device_scalar(DType::F32, std::numeric_limits<double>::quiet_NaN());
  const std::vector<char> before = host_bytes(p.b.param(0));
  p.fill_grads(4);
  sharded->reduce_grads();
  ASSERT_TRUE(sharded->grad_sumsq_into(sb));
  sharded->step(1e-2, 4, GradCheck{0, 0, sb, nan});
  device_synchronize(Device::CUDA);
  EXPECT_EQ(host_bytes(p.b.param(0)), before);
}

TEST(ShardedOptimizerCuda, WorldOneNcclEqualsTheDeviceOptimizerBitwiseWithoutClipping) {
  run_pair(/*split_master=*/true, /*clip=*/0, true);
  run_pair(/*split_master=*/false, /*clip=*/0, true);
}

TEST(ShardedOptimizerCuda, WorldOneNcclWithClippingAgreesToRounding) {
  run_pair(/*split_master=*/true, /*clip=*/0.01, false);
}

}  // namespace
}  // namespace gdn::train
