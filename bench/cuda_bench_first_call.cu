// First call at a packed length never seen before vs the steady state at that length (issue 6/7
// target: <= 1.2x; fla's JIT kernels take up to 17.9 s there). Host wall time with a device
// synchronisation on each side, so plan creation, scratch growth and any other host work count.
//
//   cuda_bench_first_call
//
// Every op is first warmed up (resolution, probe, scratch) at T = 8192; then, for each new length,
// the first call is timed, followed by 5 more calls at that length whose median is the steady
// state.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/rng.h"
#include "gdn/core/tensor.h"
#include "ops/causal_conv1d/op.h"
#include "ops/gated_attention/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gemm/op.h"
#include "ops/linear_cross_entropy/op.h"

namespace gdn::bench {
namespace {

constexpr int64_t kT = 8192;

OwnedTensor rand_dev(DType dt, std::initializer_list<int64_t> shape, uint64_t seed, double lo,
                     double hi) {
  OwnedTensor h = OwnedTensor::empty(DType::F32, shape);
  rng::fill_uniform(h, seed, 1, lo, hi);
  return convert(h, dt, Device::CUDA);
}

OwnedTensor cu_for(int64_t T) {
  OwnedTensor h = OwnedTensor::empty(DType::I32, {2});
  h.ptr<int32_t>()[0] = 0;
  h.ptr<int32_t>()[1] = static_cast<int32_t>(T);
  return convert(h, DType::I32, Device::CUDA);
}

double wall_ms(const std::function<void()>& fn) {
  GDN_CUDA_CHECK(cudaDeviceSynchronize());
  auto t0 = std::chrono::steady_clock::now();
  fn();
  GDN_CUDA_CHECK(cudaDeviceSynchronize());
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct Op {
  std::string name;
  std::function<void(int64_t T)> run;  // forward + backward at length T (a prefix of the buffers)
};

int run_all() {
  using namespace gdn::ops;
  const DType bf = DType::BF16, f32 = DType::F32;
  std::vector<Op> ops;
  // linear 4096 -> 4096 (cuBLASLt: a new M is a new plan).
  auto lx = rand_dev(bf, {kT, 4096}, 1, -1, 1), lw = rand_dev(bf, {4096, 4096}, 2, -0.02, 0.02);
  auto ly = OwnedTensor::zeros(bf, {kT, 4096}, Device::CUDA);
  auto ldx = OwnedTensor::zeros(bf, {kT, 4096}, Device::CUDA);
  auto ldw = OwnedTensor::zeros(f32, {4096, 4096}, Device::CUDA);
  ops.push_back({"linear 4096->4096 fwd+bwd", [&](int64_t T) {
                   linear_forward({lx.view().slice0(0, T), lw, ly.view().slice0(0, T)});
                   linear_backward({lx.view().slice0(0, T), lw, ly.view().slice0(0, T),
                                    ldx.view().slice0(0, T), ldw, false});
                 }});
  // gated delta rule, Hk 16, Hv 32, d 128, l2norm in kernel.
  auto q = rand_dev(bf, {kT, 16, 128}, 3, -1, 1), k = rand_dev(bf, {kT, 16, 128}, 4, -1, 1),
       v = rand_dev(bf, {kT, 32, 128}, 5, -1, 1), g = rand_dev(f32, {kT, 32}, 6, -2, -0.01),
       beta = rand_dev(f32, {kT, 32}, 7, 0.05, 0.95), dout = rand_dev(bf, {kT, 32, 128}, 8, -1, 1);
  auto o = OwnedTensor::zeros(bf, {kT, 32, 128}, Device::CUDA);
  auto dq = OwnedTensor::zeros(bf, {kT, 16, 128}, Device::CUDA),
       dk = OwnedTensor::zeros(bf, {kT, 16, 128}, Device::CUDA),
       dv = OwnedTensor::zeros(bf, {kT, 32, 128}, Device::CUDA),
       dg = OwnedTensor::zeros(f32, {kT, 32}, Device::CUDA),
       dbeta = OwnedTensor::zeros(f32, {kT, 32}, Device::CUDA);
  ops.push_back({"gated_delta_rule fwd+bwd", [&](int64_t T) {
                   OwnedTensor cu = cu_for(T);
                   auto s = [T](const OwnedTensor& t) { return t.view().slice0(0, T); };
                   gated_delta_rule_forward(
                       {s(q), s(k), s(v), s(g), s(beta), cu, Tensor(), s(o), Tensor(), 0.0, true});
                   gated_delta_rule_backward({s(q), s(k), s(v), s(g), s(beta), cu, Tensor(),
                                              s(dout), Tensor(), s(dq), s(dk), s(dv), s(dg),
                                              s(dbeta), Tensor(), 0.0, true});
                 }});
  // causal conv1d + SiLU over 8192 channels, W = 4.
  auto cx = rand_dev(bf, {kT, 8192}, 9, -2, 2), cw = rand_dev(bf, {8192, 4}, 10, -0.5, 0.5),
       cdy = rand_dev(bf, {kT, 8192}, 11, -1, 1);
  auto cy = OwnedTensor::zeros(bf, {kT, 8192}, Device::CUDA),
       cdx = OwnedTensor::zeros(bf, {kT, 8192}, Device::CUDA);
  auto cdw = OwnedTensor::zeros(f32, {8192, 4}, Device::CUDA);
  ops.push_back(
      {"causal_conv1d fwd+bwd", [&](int64_t T) {
         OwnedTensor cu = cu_for(T);
         auto s = [T](const OwnedTensor& t) { return t.view().slice0(0, T); };
         causal_conv1d_forward({s(cx), cw, Tensor(), cu, Tensor(), s(cy), Tensor(), true});
         causal_conv1d_backward({s(cx), cw, Tensor(), cu, Tensor(), s(cdy), Tensor(), s(cdx), cdw,
                                 Tensor(), Tensor(), true});
       }});
  // gated attention, 16 q / 4 kv heads of 256.
  auto qg = rand_dev(bf, {kT, 16, 512}, 12, -1, 1), ak = rand_dev(bf, {kT, 4, 256}, 13, -1, 1),
       av = rand_dev(bf, {kT, 4, 256}, 14, -1, 1), qn = rand_dev(bf, {256}, 15, -0.1, 0.1),
       kn = rand_dev(bf, {256}, 16, -0.1, 0.1), ado = rand_dev(bf, {kT, 16, 256}, 17, -1, 1);
  auto ao = OwnedTensor::zeros(bf, {kT, 16, 256}, Device::CUDA),
       qh = OwnedTensor::zeros(bf, {kT, 16, 256}, Device::CUDA),
       kh = OwnedTensor::zeros(bf, {kT, 4, 256}, Device::CUDA),
       at = OwnedTensor::zeros(bf, {kT, 16, 256}, Device::CUDA),
       lse = OwnedTensor::zeros(f32, {kT, 16}, Device::CUDA),
       qr = OwnedTensor::zeros(f32, {kT, 16}, Device::CUDA),
       kr = OwnedTensor::zeros(f32, {kT, 4}, Device::CUDA),
       dqg = OwnedTensor::zeros(bf, {kT, 16, 512}, Device::CUDA),
       adk = OwnedTensor::zeros(bf, {kT, 4, 256}, Device::CUDA),
       adv = OwnedTensor::zeros(bf, {kT, 4, 256}, Device::CUDA),
       dqn = OwnedTensor::zeros(f32, {256}, Device::CUDA),
       dkn = OwnedTensor::zeros(f32, {256}, Device::CUDA);
  ops.push_back({"gated_attention fwd+bwd", [&](int64_t T) {
                   OwnedTensor cu = cu_for(T);
                   auto s = [T](const OwnedTensor& t) { return t.view().slice0(0, T); };
                   gated_attention_forward({s(qg), s(ak), s(av), qn, kn, cu, s(ao), s(qh), s(kh),
                                            s(at), s(lse), s(qr), s(kr), 64, 1e7, 1e-6});
                   gated_attention_backward({s(qg),  s(ak),  s(av),  qn,    kn,    cu,     s(qh),
                                             s(kh),  s(at),  s(lse), s(qr), s(kr), s(ado), s(dqg),
                                             s(adk), s(adv), dqn,    dkn,   64,    1e7,    1e-6});
                 }});
  // LM head + CE + z-loss at D = 4096, V = 248320.
  const int64_t V = 248320;
  auto hx = rand_dev(bf, {kT, 4096}, 18, -1, 1), hw = rand_dev(bf, {V, 4096}, 19, -0.02, 0.02);
  OwnedTensor th = OwnedTensor::empty(DType::I32, {kT});
  for (int64_t t = 0; t < kT; ++t)
    th.ptr<int32_t>()[t] = static_cast<int32_t>(rng::bits(5, 5, static_cast<uint64_t>(t)) % V);
  auto tgt = convert(th, DType::I32, Device::CUDA);
  auto hloss = OwnedTensor::zeros(f32, {1}, Device::CUDA),
       hlse = OwnedTensor::zeros(f32, {kT}, Device::CUDA),
       hz = OwnedTensor::zeros(f32, {1}, Device::CUDA),
       hdx = OwnedTensor::zeros(bf, {kT, 4096}, Device::CUDA),
       hdw = OwnedTensor::zeros(f32, {V, 4096}, Device::CUDA);
  ops.push_back({"linear_cross_entropy fwd+bwd", [&](int64_t T) {
                   auto s = [T](const OwnedTensor& t) { return t.view().slice0(0, T); };
                   LinearCrossEntropyArgs a;
                   a.x = s(hx);
                   a.w = hw;
                   a.targets = s(tgt);
                   a.loss = hloss;
                   a.lse = s(hlse);
                   a.z_loss = hz;
                   a.dx = s(hdx);
                   a.dw = hdw;
                   a.z_loss_scale = 1e-4;
                   linear_cross_entropy_forward_backward(a);
                 }});

  std::printf("%-32s %8s %12s %12s %8s\n", "op", "T", "first ms", "steady ms", "ratio");
  double worst = 0;
  for (Op& op : ops) {
    for (int i = 0; i < 3; ++i) wall_ms([&] { op.run(kT); });  // resolution, probe, scratch
    for (int64_t T : {8191, 7777, 6001}) {
      const double first = wall_ms([&] { op.run(T); });
      std::vector<double> rest;
      for (int i = 0; i < 5; ++i) rest.push_back(wall_ms([&] { op.run(T); }));
      std::sort(rest.begin(), rest.end());
      const double steady = rest[2];
      worst = std::max(worst, first / steady);
      std::printf("%-32s %8lld %12.3f %12.3f %8.2f\n", op.name.c_str(), static_cast<long long>(T),
                  first, steady, first / steady);
    }
  }
  std::printf("worst first-call / steady ratio: %.2f (target <= 1.2)\n", worst);
  return 0;
}

}  // namespace
}  // namespace gdn::bench

int main() {
  try {
    return gdn::bench::run_all();
  } catch (const gdn::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
