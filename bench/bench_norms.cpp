// CPU benchmarks of the norm ops (forward and backward) at small-model shapes: rmsnorm plain and
// zero-centred over [2048, 1024] (tokens x hidden), gated_rmsnorm over [2048*8, 128] (tokens x
// value heads, dv) and l2norm over [2048*8, 128] (tokens x key heads, dk). Bytes processed count
// every tensor read or written once (the memory-traffic floor of each pass).
#include <benchmark/benchmark.h>

#include "gdn/core/rng.h"
#include "gdn/core/tensor.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/l2norm/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn::ops {
namespace {

constexpr int64_t kBytes = 4;  // fp32

OwnedTensor randn(std::initializer_list<int64_t> shape, uint64_t seed, double mean = 0.0) {
  OwnedTensor t = OwnedTensor::empty(DType::F32, shape);
  rng::fill_normal(t, seed, 1, mean, 1.0);
  return t;
}

// args: R, D, zero_centred
void BM_RmsNormForward(benchmark::State& state) {
  const int64_t R = state.range(0), D = state.range(1);
  const bool zc = state.range(2) != 0;
  auto x = randn({R, D}, 1), w = randn({D}, 2, zc ? 0.0 : 1.0);
  auto y = OwnedTensor::zeros(DType::F32, {R, D}), rstd = OwnedTensor::zeros(DType::F32, {R});
  for (auto _ : state) {
    rmsnorm_forward({x, w, y, rstd, 1e-6, zc});
    benchmark::DoNotOptimize(y.ptr<float>());
  }
  // read x, w; write y, rstd
  state.SetBytesProcessed(state.iterations() * kBytes * (2 * R * D + D + R));
}

void BM_RmsNormBackward(benchmark::State& state) {
  const int64_t R = state.range(0), D = state.range(1);
  const bool zc = state.range(2) != 0;
  auto x = randn({R, D}, 1), w = randn({D}, 2, zc ? 0.0 : 1.0), dy = randn({R, D}, 3);
  auto y = OwnedTensor::zeros(DType::F32, {R, D}), rstd = OwnedTensor::zeros(DType::F32, {R});
  auto dx = OwnedTensor::zeros(DType::F32, {R, D}), dw = OwnedTensor::zeros(DType::F32, {D});
  rmsnorm_forward({x, w, y, rstd, 1e-6, zc});
  for (auto _ : state) {
    rmsnorm_backward({x, w, rstd, dy, dx, dw, zc});
    benchmark::DoNotOptimize(dx.ptr<float>());
  }
  // read x, dy, w, rstd; write dx; read+write dw
  state.SetBytesProcessed(state.iterations() * kBytes * (3 * R * D + 3 * D + R));
}

// args: R, D
void BM_GatedRmsNormForward(benchmark::State& state) {
  const int64_t R = state.range(0), D = state.range(1);
  auto x = randn({R, D}, 1), z = randn({R, D}, 2), w = randn({D}, 3, 1.0);
  auto y = OwnedTensor::zeros(DType::F32, {R, D}), rstd = OwnedTensor::zeros(DType::F32, {R});
  for (auto _ : state) {
    gated_rmsnorm_forward({x, z, w, y, rstd, 1e-6});
    benchmark::DoNotOptimize(y.ptr<float>());
  }
  // read x, z, w; write y, rstd
  state.SetBytesProcessed(state.iterations() * kBytes * (3 * R * D + D + R));
}

void BM_GatedRmsNormBackward(benchmark::State& state) {
  const int64_t R = state.range(0), D = state.range(1);
  auto x = randn({R, D}, 1), z = randn({R, D}, 2), w = randn({D}, 3, 1.0), dy = randn({R, D}, 4);
  auto y = OwnedTensor::zeros(DType::F32, {R, D}), rstd = OwnedTensor::zeros(DType::F32, {R});
  auto dx = OwnedTensor::zeros(DType::F32, {R, D}), dz = OwnedTensor::zeros(DType::F32, {R, D});
  auto dw = OwnedTensor::zeros(DType::F32, {D});
  gated_rmsnorm_forward({x, z, w, y, rstd, 1e-6});
  for (auto _ : state) {
    gated_rmsnorm_backward({x, z, w, rstd, dy, dx, dz, dw});
    benchmark::DoNotOptimize(dx.ptr<float>());
  }
  // read x, z, dy, w, rstd; write dx, dz; read+write dw
  state.SetBytesProcessed(state.iterations() * kBytes * (5 * R * D + 3 * D + R));
}

void BM_L2NormForward(benchmark::State& state) {
  const int64_t R = state.range(0), D = state.range(1);
  auto x = randn({R, D}, 1);
  auto y = OwnedTensor::zeros(DType::F32, {R, D}), rstd = OwnedTensor::zeros(DType::F32, {R});
  for (auto _ : state) {
    l2norm_forward({x, y, rstd, 1e-6});
    benchmark::DoNotOptimize(y.ptr<float>());
  }
  // read x; write y, rstd
  state.SetBytesProcessed(state.iterations() * kBytes * (2 * R * D + R));
}

void BM_L2NormBackward(benchmark::State& state) {
  const int64_t R = state.range(0), D = state.range(1);
  auto x = randn({R, D}, 1), dy = randn({R, D}, 2);
  auto y = OwnedTensor::zeros(DType::F32, {R, D}), rstd = OwnedTensor::zeros(DType::F32, {R});
  auto dx = OwnedTensor::zeros(DType::F32, {R, D});
  l2norm_forward({x, y, rstd, 1e-6});
  for (auto _ : state) {
    l2norm_backward({y, rstd, dy, dx});
    benchmark::DoNotOptimize(dx.ptr<float>());
  }
  // read y, dy, rstd; write dx
  state.SetBytesProcessed(state.iterations() * kBytes * (3 * R * D + R));
}

BENCHMARK(BM_RmsNormForward)
    ->ArgNames({"R", "D", "zc"})
    ->Args({2048, 1024, 0})
    ->Args({2048, 1024, 1})
    ->UseRealTime();
BENCHMARK(BM_RmsNormBackward)
    ->ArgNames({"R", "D", "zc"})
    ->Args({2048, 1024, 0})
    ->Args({2048, 1024, 1})
    ->UseRealTime();
BENCHMARK(BM_GatedRmsNormForward)->ArgNames({"R", "D"})->Args({2048 * 8, 128})->UseRealTime();
BENCHMARK(BM_GatedRmsNormBackward)->ArgNames({"R", "D"})->Args({2048 * 8, 128})->UseRealTime();
BENCHMARK(BM_L2NormForward)->ArgNames({"R", "D"})->Args({2048 * 8, 128})->UseRealTime();
BENCHMARK(BM_L2NormBackward)->ArgNames({"R", "D"})->Args({2048 * 8, 128})->UseRealTime();

}  // namespace
}  // namespace gdn::ops

BENCHMARK_MAIN();
