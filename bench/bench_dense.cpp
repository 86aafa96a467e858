// CPU benchmarks of the dense ops: gemm / linear (OpenBLAS), swiglu, embedding, adamw.
// Built but never run by CI. Run by hand, e.g.
//   OMP_NUM_THREADS=2 build/cpu/bench/bench_dense --benchmark_min_time=0.2
// Counters: FLOP/s for the GEMMs, bytes/s (minimum traffic: every input read once, every output
// written once) for the memory-bound ops.
#include <benchmark/benchmark.h>

#include <vector>

#include "gdn/core/rng.h"
#include "ops/adamw/op.h"
#include "ops/embedding/op.h"
#include "ops/gemm/op.h"
#include "ops/swiglu/op.h"

namespace gdn::ops {
namespace {

OwnedTensor randn_f32(std::initializer_list<int64_t> shape, uint64_t seed, double std = 1.0) {
  OwnedTensor t = OwnedTensor::empty(DType::F32, shape);
  rng::fill_normal(t, seed, 1, 0.0, std);
  return t;
}

void rate(benchmark::State& s, const char* name, double per_iter) {
  s.counters[name] = benchmark::Counter(per_iter, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Gemm(benchmark::State& s) {
  const int64_t n = s.range(0);
  auto a = randn_f32({n, n}, 1), b = randn_f32({n, n}, 2), c = randn_f32({n, n}, 3);
  for (auto _ : s) gemm({a, b, c, false, false, 1.0, 0.0});
  rate(s, "FLOP/s", 2.0 * n * n * n);
}
BENCHMARK(BM_Gemm)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

// Linear 2048 x 1024 -> 3072 (x W^T with W [3072, 1024]).
constexpr int64_t kT = 2048, kIn = 1024, kOut = 3072;

void BM_LinearForward(benchmark::State& s) {
  auto x = randn_f32({kT, kIn}, 4), w = randn_f32({kOut, kIn}, 5, 0.02);
  auto y = OwnedTensor::zeros(DType::F32, {kT, kOut});
  for (auto _ : s) linear_forward({x, w, y});
  rate(s, "FLOP/s", 2.0 * kT * kIn * kOut);
}
BENCHMARK(BM_LinearForward)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_LinearBackward(benchmark::State& s) {  // dx = dy W and dW += dy^T x: two GEMMs
  auto x = randn_f32({kT, kIn}, 6), w = randn_f32({kOut, kIn}, 7, 0.02);
  auto dy = randn_f32({kT, kOut}, 8);
  auto dx = OwnedTensor::zeros(DType::F32, {kT, kIn}),
       dw = OwnedTensor::zeros(DType::F32, {kOut, kIn});
  for (auto _ : s) linear_backward({x, w, dy, dx, dw, false});
  rate(s, "FLOP/s", 4.0 * kT * kIn * kOut);
}
BENCHMARK(BM_LinearBackward)->Unit(benchmark::kMillisecond)->UseRealTime();

constexpr int64_t kR = 2048, kI = 3072;

void BM_SwigluForward(benchmark::State& s) {
  auto g = randn_f32({kR, kI}, 9, 3.0), u = randn_f32({kR, kI}, 10);
  auto y = OwnedTensor::zeros(DType::F32, {kR, kI});
  for (auto _ : s) swiglu_forward({g, u, y});
  rate(s, "bytes/s", 3.0 * 4 * kR * kI);
}
BENCHMARK(BM_SwigluForward)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_SwigluBackward(benchmark::State& s) {
  auto g = randn_f32({kR, kI}, 11, 3.0), u = randn_f32({kR, kI}, 12), dy = randn_f32({kR, kI}, 13);
  auto dg = OwnedTensor::zeros(DType::F32, {kR, kI}), du = OwnedTensor::zeros(DType::F32, {kR, kI});
  for (auto _ : s) swiglu_backward({g, u, dy, dg, du});
  rate(s, "bytes/s", 5.0 * 4 * kR * kI);
}
BENCHMARK(BM_SwigluBackward)->Unit(benchmark::kMillisecond)->UseRealTime();

// Embedding: T = 2048 tokens, D = 1024, V = 32768 (ids drawn from the first 4096 rows, so ids
// repeat as real text does).
constexpr int64_t kTok = 2048, kD = 1024, kV = 32768;

OwnedTensor bench_ids() {
  auto ids = OwnedTensor::empty(DType::I32, {kTok});
  for (int64_t t = 0; t < kTok; ++t)
    ids.ptr<int32_t>()[t] = static_cast<int32_t>(rng::bits(14, 1, static_cast<uint64_t>(t)) % 4096);
  return ids;
}

void BM_EmbeddingForward(benchmark::State& s) {
  auto ids = bench_ids();
  auto w = randn_f32({kV, kD}, 15), y = OwnedTensor::zeros(DType::F32, {kTok, kD});
  for (auto _ : s) embedding_forward({ids, w, y});
  rate(s, "bytes/s", 2.0 * 4 * kTok * kD);
}
BENCHMARK(BM_EmbeddingForward)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_EmbeddingBackward(benchmark::State& s) {
  auto ids = bench_ids();
  auto dy = randn_f32({kTok, kD}, 16), dw = OwnedTensor::zeros(DType::F32, {kV, kD});
  for (auto _ : s) embedding_backward({ids, dy, dw});
  rate(s, "bytes/s", 3.0 * 4 * kTok * kD);  // dy read, dW rows read and written
}
BENCHMARK(BM_EmbeddingBackward)->Unit(benchmark::kMicrosecond)->UseRealTime();

// AdamW over 16M parameters in 4 tensors of 4M (decay on 3 of them), with and without the fused
// bf16 copy; and the global gradient norm over the same gradients.
constexpr int64_t kParams = 1 << 22, kTensors = 4;

struct OptState {
  std::vector<OwnedTensor> own;
  std::vector<AdamWParam> params;
  std::vector<Tensor> grads;
  explicit OptState(bool with_bf16) {
    for (int64_t k = 0; k < kTensors; ++k) {
      own.push_back(randn_f32({kParams}, 20 + k));
      own.push_back(randn_f32({kParams}, 30 + k, 1e-3));
      own.push_back(OwnedTensor::zeros(DType::F32, {kParams}));
      own.push_back(OwnedTensor::zeros(DType::F32, {kParams}));
      own.push_back(with_bf16 ? OwnedTensor::zeros(DType::BF16, {kParams}) : OwnedTensor());
    }
    for (int64_t k = 0; k < kTensors; ++k) {
      const auto* o = &own[static_cast<size_t>(5 * k)];
      params.push_back({o[0], o[1], o[2], o[3], o[4].view(), k != 3, {}});
      grads.push_back(o[1]);
    }
  }
};

void BM_AdamWStep(benchmark::State& s) {
  OptState st(s.range(0) != 0);
  AdamWHyper h;
  for (auto _ : s) {
    adamw_step(st.params, h);
    ++h.step;
  }
  // Read p, g, m, v; write p, m, v (+ the bf16 copy).
  rate(s, "bytes/s", (7.0 * 4 + (s.range(0) ? 2 : 0)) * kParams * kTensors);
  rate(s, "params/s", 1.0 * kParams * kTensors);
}
BENCHMARK(BM_AdamWStep)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("bf16_copy")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_GradGlobalNorm(benchmark::State& s) {
  OptState st(false);
  for (auto _ : s) benchmark::DoNotOptimize(grad_global_norm(st.grads));
  rate(s, "bytes/s", 4.0 * kParams * kTensors);
}
BENCHMARK(BM_GradGlobalNorm)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace gdn::ops

BENCHMARK_MAIN();
