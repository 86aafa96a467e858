// Gated attention on the CPU (cpu.flash): forward and backward at Qwen3.5-like head shapes.
// Args: T tokens, N equal documents, Hq, Hkv, hd (rotary dims hd/4). The "GFLOP/s" counter counts
// the causal attention GEMMs only (forward 4·hd, backward 10·hd FLOPs per visible (query, key)
// pair per query head, the FlashAttention-2 convention; the CPU backward recomputes P twice and
// really does 14·hd), so it compares with a GEMM rate.
//   build/cpu/bench/bench_attention [--benchmark_filter=Fwd]
#include <benchmark/benchmark.h>

#include <vector>

#include "gdn/core/rng.h"
#include "ops/gated_attention/op.h"

namespace gdn::ops {
namespace {

struct Case {
  int64_t T, N, Hq, Hkv, hd, rot;
  OwnedTensor qg, k, v, wq, wk, cu, dout;
  OwnedTensor o, q_hat, k_hat, attn, lse, q_rstd, k_rstd;
  OwnedTensor dqg, dk, dv, dwq, dwk;

  explicit Case(const benchmark::State& st)
      : T(st.range(0)),
        N(st.range(1)),
        Hq(st.range(2)),
        Hkv(st.range(3)),
        hd(st.range(4)),
        rot(hd / 4) {
    const DType f = DType::F32;
    auto randn = [&](std::initializer_list<int64_t> shape, uint64_t stream, double std) {
      OwnedTensor t = OwnedTensor::empty(f, shape);
      rng::fill_normal(t, 1, stream, 0.0, std);
      return t;
    };
    qg = randn({T, Hq, 2 * hd}, 1, 1.0);
    k = randn({T, Hkv, hd}, 2, 1.0);
    v = randn({T, Hkv, hd}, 3, 1.0);
    wq = randn({hd}, 4, 0.1);
    wk = randn({hd}, 5, 0.1);
    dout = randn({T, Hq, hd}, 6, 1.0);
    cu = OwnedTensor::empty(DType::I32, {N + 1});
    for (int64_t n = 0; n <= N; ++n) cu.ptr<int32_t>()[n] = static_cast<int32_t>(T * n / N);
    o = OwnedTensor::zeros(f, {T, Hq, hd});
    q_hat = OwnedTensor::zeros(f, {T, Hq, hd});
    k_hat = OwnedTensor::zeros(f, {T, Hkv, hd});
    attn = OwnedTensor::zeros(f, {T, Hq, hd});
    lse = OwnedTensor::zeros(f, {T, Hq});
    q_rstd = OwnedTensor::zeros(f, {T, Hq});
    k_rstd = OwnedTensor::zeros(f, {T, Hkv});
    dqg = OwnedTensor::zeros(f, {T, Hq, 2 * hd});
    dk = OwnedTensor::zeros(f, {T, Hkv, hd});
    dv = OwnedTensor::zeros(f, {T, Hkv, hd});
    dwq = OwnedTensor::zeros(f, {hd});
    dwk = OwnedTensor::zeros(f, {hd});
  }
  void forward() {
    gated_attention_forward(
        {qg, k, v, wq, wk, cu, o, q_hat, k_hat, attn, lse, q_rstd, k_rstd, rot, 1e7, 1e-6});
  }
  void backward() {
    gated_attention_backward({qg,     k,    v,   wq, wk, cu,  q_hat, k_hat, attn, lse, q_rstd,
                              k_rstd, dout, dqg, dk, dv, dwq, dwk,   rot,   1e7,  1e-6});
  }
  // Visible (query, key) pairs per query head: Σ_n L_n (L_n + 1) / 2.
  double pairs() const {
    double p = 0;
    for (int64_t n = 0; n < N; ++n) {
      const double L = static_cast<double>(T * (n + 1) / N - T * n / N);
      p += L * (L + 1) / 2;
    }
    return p;
  }
};

void BM_GatedAttentionFwd(benchmark::State& st) {
  Case c(st);
  c.forward();  // resolve (and probe) outside the timed loop
  for (auto _ : st) {
    c.forward();
    benchmark::DoNotOptimize(c.o.ptr<float>());
  }
  const double iters = static_cast<double>(st.iterations());
  st.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(c.T) * iters, benchmark::Counter::kIsRate);
  st.counters["GFLOP/s"] =
      benchmark::Counter(4.0 * static_cast<double>(c.hd * c.Hq) * c.pairs() * iters * 1e-9,
                         benchmark::Counter::kIsRate);
}

void BM_GatedAttentionBwd(benchmark::State& st) {
  Case c(st);
  c.forward();
  c.backward();
  for (auto _ : st) {
    c.backward();
    benchmark::DoNotOptimize(c.dqg.ptr<float>());
  }
  const double iters = static_cast<double>(st.iterations());
  st.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(c.T) * iters, benchmark::Counter::kIsRate);
  st.counters["GFLOP/s"] =
      benchmark::Counter(10.0 * static_cast<double>(c.hd * c.Hq) * c.pairs() * iters * 1e-9,
                         benchmark::Counter::kIsRate);
}

// {T, N documents, Hq, Hkv, hd}
void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "N", "Hq", "Hkv", "hd"});
  b->Args({1024, 1, 8, 2, 64})->Args({1024, 4, 8, 2, 64})->Args({1024, 1, 8, 2, 256});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_GatedAttentionFwd)->Apply(shapes);
BENCHMARK(BM_GatedAttentionBwd)->Apply(shapes);

}  // namespace
}  // namespace gdn::ops

BENCHMARK_MAIN();
