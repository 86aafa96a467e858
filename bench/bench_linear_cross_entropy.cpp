// Linear cross-entropy on the CPU: the fused forward+backward (what the trainer runs) and the
// forward-only eval path, at N = 512, D = 512, V = 32768, with the default budget (full-V blocks,
// 3 GEMMs) and with a 1 MiB budget (32-row blocks x vocabulary slabs, 4 GEMMs).
// Counter GFLOP/s counts the 2 N D V FLOPs of each logits, dx and dW GEMM the path needs.
#include <benchmark/benchmark.h>

#include "gdn/core/rng.h"
#include "ops/linear_cross_entropy/op.h"

namespace gdn::ops {
namespace {

struct Case {
  int64_t N = 512, D = 512, V = 32768;
  OwnedTensor x, w, t, loss, lse, z, dx, dw;
  Case() {
    x = OwnedTensor::empty(DType::F32, {N, D});
    w = OwnedTensor::empty(DType::F32, {V, D});
    rng::fill_normal(x, 1, 1, 0.0, 1.0);
    rng::fill_normal(w, 2, 1, 0.0, 0.05);
    t = OwnedTensor::empty(DType::I64, {N});
    for (int64_t i = 0; i < N; ++i) t.ptr<int64_t>()[i] = i % 17 == 0 ? -100 : (i * 7919) % V;
    loss = OwnedTensor::zeros(DType::F32, {1});
    lse = OwnedTensor::zeros(DType::F32, {N});
    z = OwnedTensor::zeros(DType::F32, {1});
    dx = OwnedTensor::zeros(DType::F32, {N, D});
    dw = OwnedTensor::zeros(DType::F32, {V, D});
  }
  LinearCrossEntropyArgs args(int64_t budget) const {
    LinearCrossEntropyArgs a;
    a.x = x, a.w = w, a.targets = t, a.loss = loss, a.lse = lse, a.z_loss = z;
    a.z_loss_scale = 1e-4, a.chunk_bytes = budget;
    return a;
  }
};

void BM_LceForwardBackward(benchmark::State& state) {
  static Case c;
  const int64_t budget = state.range(0);
  LinearCrossEntropyArgs a = c.args(budget);
  a.dx = c.dx, a.dw = c.dw;
  const auto plan = linear_cross_entropy_plan(c.N, c.V, budget);
  for (auto _ : state) {
    linear_cross_entropy_forward_backward(a);
    benchmark::DoNotOptimize(c.loss.ptr<float>()[0]);
  }
  const double gemms = plan.cols >= c.V ? 3 : 4;
  state.counters["GFLOP/s"] = benchmark::Counter(gemms * 2.0 * c.N * c.D * c.V * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["rows"] = static_cast<double>(plan.rows);
  state.counters["cols"] = static_cast<double>(plan.cols);
  state.counters["ws_MiB"] = static_cast<double>(plan.workspace_bytes) / (1 << 20);
}

void BM_LceForward(benchmark::State& state) {
  static Case c;
  const int64_t budget = state.range(0);
  LinearCrossEntropyArgs a = c.args(budget);
  for (auto _ : state) {
    linear_cross_entropy_forward(a);
    benchmark::DoNotOptimize(c.loss.ptr<float>()[0]);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * c.N * c.D * c.V * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// 268435456 = the default budget (kLceDefaultChunkBytes); 1048576 forces slab mode.
BENCHMARK(BM_LceForwardBackward)
    ->Arg(268435456)
    ->Arg(1048576)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_LceForward)
    ->Arg(268435456)
    ->Arg(1048576)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace gdn::ops

BENCHMARK_MAIN();
