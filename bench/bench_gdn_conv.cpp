// CPU benchmarks of the GDN short conv (causal_conv1d, W = 4, SiLU) and the GDN gates, forward and
// backward, at a small-model shape: T = 2048 tokens, C = 2048 conv channels, Hv = 16 heads.
// Random data (never zeros). Bytes counted: what each call must read and write at least.
// Run: build/cpu/bench/bench_gdn_conv [--benchmark_filter=Conv]
#include <benchmark/benchmark.h>

#include <vector>

#include "gdn/core/rng.h"
#include "gdn/core/tensor.h"
#include "ops/causal_conv1d/op.h"
#include "ops/gdn_gates/op.h"

namespace {

using namespace gdn;
using namespace gdn::ops;

OwnedTensor randn(std::initializer_list<int64_t> shape, uint64_t seed, double std = 1.0,
                  double mean = 0.0) {
  OwnedTensor t = OwnedTensor::empty(DType::F32, shape);
  rng::fill_normal(t, seed, 1, mean, std);
  return t;
}

// Equal-length documents: args {T, C, W, N}.
struct ConvSetup {
  int64_t T, C, W, N;
  OwnedTensor x, w, cu, init, y, fin, dy, dx, dw, dinit;  // [T, C] [C, W] [N+1] ...
  explicit ConvSetup(const benchmark::State& st)
      : T(st.range(0)), C(st.range(1)), W(st.range(2)), N(st.range(3)) {
    x = randn({T, C}, 1, 1.0);
    w = randn({C, W}, 2, 0.5);
    cu = OwnedTensor::empty(DType::I32, {N + 1});
    for (int64_t n = 0; n <= N; ++n) cu.ptr<int32_t>()[n] = static_cast<int32_t>(n * T / N);
    init = randn({N, C, W - 1}, 3);
    y = OwnedTensor::zeros(DType::F32, {T, C});
    fin = OwnedTensor::zeros(DType::F32, {N, C, W - 1});
    dy = randn({T, C}, 4);
    dx = OwnedTensor::zeros(DType::F32, {T, C});
    dw = OwnedTensor::zeros(DType::F32, {C, W});
    dinit = OwnedTensor::zeros(DType::F32, {N, C, W - 1});
  }
};

void BM_ConvForward(benchmark::State& st) {
  ConvSetup s(st);
  for (auto _ : st) {
    causal_conv1d_forward({s.x, s.w, Tensor(), s.cu, s.init, s.y, s.fin, true});
    benchmark::DoNotOptimize(s.y.ptr<float>());
  }
  st.SetBytesProcessed(st.iterations() * 2 * s.T * s.C * 4);  // read x, write y
}

void BM_ConvBackward(benchmark::State& st) {
  ConvSetup s(st);
  for (auto _ : st) {
    causal_conv1d_backward(
        {s.x, s.w, Tensor(), s.cu, s.init, s.dy, Tensor(), s.dx, s.dw, Tensor(), s.dinit, true});
    benchmark::DoNotOptimize(s.dx.ptr<float>());
  }
  st.SetBytesProcessed(st.iterations() * 3 * s.T * s.C * 4);  // read x, dy, write dx
}

// args {T, Hv}
struct GateSetup {
  int64_t T, H;
  OwnedTensor a, b, A_log, dt_bias, g, beta, dg, dbeta, da, db, dA, ddt;
  explicit GateSetup(const benchmark::State& st) : T(st.range(0)), H(st.range(1)) {
    a = randn({T, H}, 5, 2.0);
    b = randn({T, H}, 6, 2.0);
    A_log = randn({H}, 7, 0.5, 1.5);
    dt_bias = randn({H}, 8, 0.5, 1.0);
    g = OwnedTensor::zeros(DType::F32, {T, H});
    beta = OwnedTensor::zeros(DType::F32, {T, H});
    dg = randn({T, H}, 9);
    dbeta = randn({T, H}, 10);
    da = OwnedTensor::zeros(DType::F32, {T, H});
    db = OwnedTensor::zeros(DType::F32, {T, H});
    dA = OwnedTensor::zeros(DType::F32, {H});
    ddt = OwnedTensor::zeros(DType::F32, {H});
  }
};

void BM_GatesForward(benchmark::State& st) {
  GateSetup s(st);
  for (auto _ : st) {
    gdn_gates_forward({s.a, s.b, s.A_log, s.dt_bias, s.g, s.beta});
    benchmark::DoNotOptimize(s.g.ptr<float>());
  }
  st.SetBytesProcessed(st.iterations() * 4 * s.T * s.H * 4);  // read a, b, write g, beta
}

void BM_GatesBackward(benchmark::State& st) {
  GateSetup s(st);
  for (auto _ : st) {
    gdn_gates_backward({s.a, s.b, s.A_log, s.dt_bias, s.dg, s.dbeta, s.da, s.db, s.dA, s.ddt});
    benchmark::DoNotOptimize(s.da.ptr<float>());
  }
  st.SetBytesProcessed(st.iterations() * 6 * s.T * s.H * 4);  // read a, b, dg, dbeta; write da, db
}

}  // namespace

BENCHMARK(BM_ConvForward)
    ->ArgNames({"T", "C", "W", "docs"})
    ->Args({2048, 2048, 4, 1})
    ->Args({2048, 2048, 4, 16})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_ConvBackward)
    ->ArgNames({"T", "C", "W", "docs"})
    ->Args({2048, 2048, 4, 1})
    ->Args({2048, 2048, 4, 16})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_GatesForward)
    ->ArgNames({"T", "Hv"})
    ->Args({2048, 16})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_GatesBackward)
    ->ArgNames({"T", "Hv"})
    ->Args({2048, 16})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

BENCHMARK_MAIN();
