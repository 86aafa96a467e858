// Gated delta rule on the CPU (cpu.chunk64): forward and backward at small-model shapes.
// Arguments: T, number of documents (equal lengths), Hk, Hv, dk, dv. Reported: tokens/s and the
// useful FLOP rate counted as in gdn_spec.md §3.8 (~11 dk dv per token and value head forward).
//   build/cpu/bench/bench_gated_delta_rule --benchmark_min_time=1
#include <benchmark/benchmark.h>

#include <vector>

#include "gdn/core/rng.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops {
namespace {

struct Problem {
  int64_t T, N, Hk, Hv, dk, dv;
  OwnedTensor q, k, v, g, beta, cu, h0, o, hT, dout, dhT, dq, dk_, dv_, dg, db, dh0;

  Problem(int64_t T_, int64_t N_, int64_t Hk_, int64_t Hv_, int64_t dk__, int64_t dv__)
      : T(T_), N(N_), Hk(Hk_), Hv(Hv_), dk(dk__), dv(dv__) {
    auto randn = [](std::initializer_list<int64_t> shape, uint64_t stream, double std) {
      OwnedTensor t = OwnedTensor::empty(DType::F32, shape);
      rng::fill_normal(t, 7, stream, 0.0, std);
      return t;
    };
    auto randu = [](std::initializer_list<int64_t> shape, uint64_t stream, double lo, double hi) {
      OwnedTensor t = OwnedTensor::empty(DType::F32, shape);
      rng::fill_uniform(t, 7, stream, lo, hi);
      return t;
    };
    q = randn({T, Hk, dk}, 1, 1.0);
    k = randn({T, Hk, dk}, 2, 1.0);
    v = randn({T, Hv, dv}, 3, 1.0);
    g = randu({T, Hv}, 4, -1.0, 0.0);
    beta = randu({T, Hv}, 5, 0.0, 1.0);
    h0 = randn({N, Hv, dk, dv}, 6, 0.1);
    dout = randn({T, Hv, dv}, 7, 1.0);
    dhT = randn({N, Hv, dk, dv}, 8, 0.1);
    cu = OwnedTensor::empty(DType::I32, {N + 1});
    for (int64_t n = 0; n <= N; ++n) cu.ptr<int32_t>()[n] = static_cast<int32_t>(n * T / N);
    o = OwnedTensor::zeros(DType::F32, {T, Hv, dv});
    hT = OwnedTensor::zeros(DType::F32, {N, Hv, dk, dv});
    dq = OwnedTensor::zeros(DType::F32, {T, Hk, dk});
    dk_ = OwnedTensor::zeros(DType::F32, {T, Hk, dk});
    dv_ = OwnedTensor::zeros(DType::F32, {T, Hv, dv});
    dg = OwnedTensor::zeros(DType::F32, {T, Hv});
    db = OwnedTensor::zeros(DType::F32, {T, Hv});
    dh0 = OwnedTensor::zeros(DType::F32, {N, Hv, dk, dv});
  }
  GatedDeltaRuleFwd fwd() const { return {q, k, v, g, beta, cu, h0, o, hT, 0.0, true}; }
  GatedDeltaRuleBwd bwd() const {
    return {q, k, v, g, beta, cu, h0, dout, dhT, dq, dk_, dv_, dg, db, dh0, 0.0, true};
  }
};

Problem make(const benchmark::State& s) {
  return Problem(s.range(0), s.range(1), s.range(2), s.range(3), s.range(4), s.range(5));
}

void set_counters(benchmark::State& s, const Problem& p, double flop_per_token_head) {
  const double tokens = static_cast<double>(p.T);
  s.counters["tok/s"] =
      benchmark::Counter(tokens * static_cast<double>(s.iterations()), benchmark::Counter::kIsRate);
  s.counters["GFLOP/s"] =
      benchmark::Counter(tokens * static_cast<double>(p.Hv) * flop_per_token_head * 1e-9 *
                             static_cast<double>(s.iterations()),
                         benchmark::Counter::kIsRate);
}

void BM_gdr_forward(benchmark::State& s) {
  Problem p = make(s);
  const GatedDeltaRuleFwd a = p.fwd();
  for (auto _ : s) {
    gated_delta_rule_forward(a);
    benchmark::DoNotOptimize(p.o.ptr<float>());
  }
  set_counters(s, p, 11.0 * static_cast<double>(p.dk * p.dv));
}

void BM_gdr_backward(benchmark::State& s) {
  Problem p = make(s);
  const GatedDeltaRuleBwd a = p.bwd();
  for (auto _ : s) {
    gated_delta_rule_backward(a);
    benchmark::DoNotOptimize(p.dq.ptr<float>());
  }
  // Backward ~ 2.5x forward plus the recomputed forward (gdn_spec.md §3.8).
  set_counters(s, p, 3.5 * 11.0 * static_cast<double>(p.dk * p.dv));
}

// {T, N, Hk, Hv, dk, dv}
void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "N", "Hk", "Hv", "dk", "dv"});
  b->Args({1024, 1, 4, 8, 64, 64});    // the small model shape
  b->Args({1024, 8, 4, 8, 64, 64});    // same tokens packed as 8 documents of 128
  b->Args({1024, 1, 2, 4, 128, 128});  // Qwen3.5 head dims
  b->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}

BENCHMARK(BM_gdr_forward)->Apply(shapes);
BENCHMARK(BM_gdr_backward)->Apply(shapes);

}  // namespace
}  // namespace gdn::ops

BENCHMARK_MAIN();
