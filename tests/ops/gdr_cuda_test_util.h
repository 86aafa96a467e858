// Shared by the gated delta rule's CUDA tests (test_gated_delta_rule_cuda.cpp and
// test_gated_delta_rule_saved_cuda.cpp): the GPU fixture, the swept shape spec, inputs rounded
// exactly as the cuda path sees them, their device copies, NaN-poisoned outputs, and the scoped
// route / state-split switches.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gdn/core/env.h"
#include "gdn/core/rng.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gdr_test_specs.h"
#include "support/op_test_util.h"

namespace gdn::ops::gdr_test {

using testing::randn;
using testing::randu;
using testing::rounded;

class GdrCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

// F64 host tensors holding exactly what the cuda path sees: activations rounded through bf16,
// gates and states through fp32.
struct Inputs {
  int64_t T = 0, N = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
  std::vector<int32_t> cu;
  OwnedTensor q, k, v, g, beta, h0, dout, dhT;
};

inline Inputs make_inputs(const Spec& s, bool l2) {
  Inputs in;
  in.cu = {0};
  for (int32_t l : s.lens) in.cu.push_back(in.cu.back() + l);
  in.T = in.cu.back();
  in.N = static_cast<int64_t>(s.lens.size());
  in.Hk = s.Hk;
  in.Hv = s.Hk * s.r;
  in.dk = s.dk;
  in.dv = s.dv;
  const uint64_t sd = s.seed * 100;
  // Without the l2norm keep |k|^2 ~ 0.5 so that (I - beta k k^T) stays a contraction.
  const double qk_std = l2 ? 1.0 : 0.7 / std::sqrt(static_cast<double>(s.dk));
  in.q = rounded(randn({in.T, in.Hk, in.dk}, sd + 1, qk_std), DType::BF16);
  in.k = rounded(randn({in.T, in.Hk, in.dk}, sd + 2, qk_std), DType::BF16);
  in.v = rounded(randn({in.T, in.Hv, in.dv}, sd + 3), DType::BF16);
  in.g = rounded(randu({in.T, in.Hv}, sd + 4, s.g_lo, s.g_hi), DType::F32);
  in.beta = rounded(randu({in.T, in.Hv}, sd + 5, s.b_lo, s.b_hi), DType::F32);
  if (s.init) in.h0 = rounded(randn({in.N, in.Hv, in.dk, in.dv}, sd + 6, 0.5), DType::F32);
  in.dout = rounded(randn({in.T, in.Hv, in.dv}, sd + 7), DType::BF16);
  if (s.dhT) in.dhT = rounded(randn({in.N, in.Hv, in.dk, in.dv}, sd + 8, 0.5), DType::F32);
  return in;
}

inline Tensor view_or_empty(const OwnedTensor& t) { return t.defined() ? t.view() : Tensor(); }

// Every element NaN: an element the kernels forget to write fails the comparison as non-finite.
inline OwnedTensor poisoned(DType dt, std::initializer_list<int64_t> shape) {
  Tensor probe(nullptr, dt, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()),
                        std::numeric_limits<double>::quiet_NaN());
  return from_f64(v, dt, std::span<const int64_t>(shape.begin(), shape.size()), Device::CUDA);
}

// Device copies of the inputs (kept alive for repeated calls).
struct Dev {
  OwnedTensor q, k, v, g, beta, cu, h0, dout, dhT;
};
inline Dev to_device(const Inputs& in) {
  auto opt = [](const OwnedTensor& t, DType dt) {
    return t.defined() ? convert(t, dt, Device::CUDA) : OwnedTensor();
  };
  return {convert(in.q, DType::BF16, Device::CUDA),
          convert(in.k, DType::BF16, Device::CUDA),
          convert(in.v, DType::BF16, Device::CUDA),
          convert(in.g, DType::F32, Device::CUDA),
          convert(in.beta, DType::F32, Device::CUDA),
          convert(testing::i32_tensor(in.cu), DType::I32, Device::CUDA),
          opt(in.h0, DType::F32),
          convert(in.dout, DType::BF16, Device::CUDA),
          opt(in.dhT, DType::F32)};
}

// Selects the gated delta rule's route for the life of the object: the resolver's choice (the fast
// route cuda.chunk64 where its class allows) or cuda.chunk64_generic, forced with
// GDN_OP_GATED_DELTA_RULE (decisions are per process and
// shape class: forgotten on both ends).
struct Route {
  explicit Route(bool generic) {
    // The fast route is the resolver's own choice wherever its class allows it (a class it does
    // not take resolves to the generic route, as the old in-kernel fallback did).
    if (generic)
      setenv("GDN_OP_GATED_DELTA_RULE", "cuda.chunk64_generic", 1);
    else
      unsetenv("GDN_OP_GATED_DELTA_RULE");
    env::reset_cache_for_testing();
    Registry::global().clear_resolutions();
  }
  ~Route() {
    unsetenv("GDN_OP_GATED_DELTA_RULE");
    env::reset_cache_for_testing();
    Registry::global().clear_resolutions();
  }
  Route(const Route&) = delete;
  Route& operator=(const Route&) = delete;
};

// Forces the dk split of the fast route's state passes for the life of the object.
struct StateSplit {
  explicit StateSplit(int ks) { gdr_set_state_split(ks); }
  ~StateSplit() { gdr_set_state_split(0); }
  StateSplit(const StateSplit&) = delete;
  StateSplit& operator=(const StateSplit&) = delete;
};

// The swept shapes of both tests: partial chunks, 1-token, empty and 50 documents, r in {1, 2, 3},
// dk != dv, with and without h0 / dhT, strong and no decay, beta near 0 and 1, dims the fast route
// takes and dims only the generic one takes (not multiples of 8, up to 256).
inline std::vector<Spec> sweep_specs() {
  std::vector<Spec> s = common_sweep_specs(90);
  s.push_back({.name = "zero_length_docs", .lens = {0, 5, 0, 70, 0}, .r = 2, .seed = 12});
  s.push_back({.name = "d128_fast_path",
               .lens = {200, 1, 63},
               .Hk = 2,
               .r = 2,
               .dk = 128,
               .dv = 128,
               .g_lo = -2,
               .seed = 13});
  // The fast route at its own sizes: long and many documents, strong decay, dims that leave part of
  // a 16-column tile or of a 32-column state block empty, dk != dv.
  s.push_back({.name = "d128_long",
               .lens = {1000},
               .Hk = 1,
               .r = 2,
               .dk = 128,
               .dv = 128,
               .g_lo = -0.3,
               .seed = 18});
  s.push_back({.name = "d128_strong_decay",
               .lens = {100, 30},
               .Hk = 1,
               .r = 2,
               .dk = 128,
               .dv = 128,
               .g_lo = -21,
               .g_hi = -19,
               .seed = 19});
  s.push_back({.name = "d64_thirty_docs",
               .lens = random_lens(30, 1, 140, 20),
               .Hk = 2,
               .r = 2,
               .dk = 64,
               .dv = 64,
               .seed = 20});
  s.push_back({.name = "dk96_dv120_r3",
               .lens = {90, 40},
               .Hk = 1,
               .r = 3,
               .dk = 96,
               .dv = 120,
               .seed = 21});
  s.push_back({.name = "dk128_dv40_no_state",
               .lens = {150},
               .Hk = 1,
               .r = 2,
               .dk = 128,
               .dv = 40,
               .init = false,
               .dhT = false,
               .seed = 22});
  s.push_back({.name = "dk64_dv128_beta1",
               .lens = {77, 64},
               .Hk = 1,
               .r = 2,
               .dk = 64,
               .dv = 128,
               .b_lo = 0.99,
               .b_hi = 1.0,
               .seed = 23});
  // Head dims that are not multiples of 8: the generic route's scalar (unaligned) staging path.
  s.push_back(
      {.name = "dk20_dv12_scalar", .lens = {70, 9}, .r = 2, .dk = 20, .dv = 12, .seed = 14});
  s.push_back({.name = "dk40_dv8", .lens = {65, 1}, .r = 2, .dk = 40, .dv = 8, .seed = 15});
  // The largest head dims (single-buffered reverse state pass, near the shared-memory limit).
  s.push_back({.name = "d256_max", .lens = {70}, .r = 1, .dk = 256, .dv = 256, .seed = 16});
  s.push_back({.name = "dk256_dv100", .lens = {33, 64}, .r = 2, .dk = 256, .dv = 100, .seed = 17});
  return s;
}

// One forward / backward call of the op on the device tensors (outputs poisoned first, so an
// unwritten element shows), with an optional `saved` (op.h); shared by the saved-state and the
// fused-forward tests.
inline int64_t saved_numel(const Inputs& in) {
  return gdr_saved_numel(in.T, in.N, in.Hv, in.dk, in.dv);
}
// `saved`'s first element of its gamma section (op.h: fp32 values in pairs of bf16 elements, after
// the bf16 sections Ht, Vt, W and T), so that tests compare the two kinds apart: as numbers, bf16
// pairs holding fp32 bits would read as anything, NaN included.
inline int64_t saved_gamma_at(const Inputs& in) {
  return gdr_saved_chunks(in.T, in.N) * in.Hv *
         (in.dv * in.dk + in.dv * kGdrChunk + kGdrChunk * in.dk + kGdrChunk * kGdrChunk);
}

struct Fwd {
  OwnedTensor o, hT;
};
struct Grads {
  OwnedTensor dq, dk, dv, dg, dbeta, dh0;
};

inline Fwd forward(const Inputs& in, const Dev& d, bool l2, const Tensor& saved) {
  Fwd f{poisoned(DType::BF16, {in.T, in.Hv, in.dv}),
        poisoned(DType::F32, {in.N, in.Hv, in.dk, in.dv})};
  GatedDeltaRuleFwd a{d.q, d.k, d.v, d.g, d.beta, d.cu, view_or_empty(d.h0), f.o, f.hT, 0.0, l2};
  a.saved = saved;
  gated_delta_rule_forward(a);
  return f;
}

inline Grads backward(const Inputs& in, const Dev& d, bool l2, const Tensor& saved) {
  Grads r{poisoned(DType::BF16, {in.T, in.Hk, in.dk}),
          poisoned(DType::BF16, {in.T, in.Hk, in.dk}),
          poisoned(DType::BF16, {in.T, in.Hv, in.dv}),
          poisoned(DType::F32, {in.T, in.Hv}),
          poisoned(DType::F32, {in.T, in.Hv}),
          poisoned(DType::F32, {in.N, in.Hv, in.dk, in.dv})};
  GatedDeltaRuleBwd a{d.q,
                      d.k,
                      d.v,
                      d.g,
                      d.beta,
                      d.cu,
                      view_or_empty(d.h0),
                      d.dout,
                      view_or_empty(d.dhT),
                      r.dq,
                      r.dk,
                      r.dv,
                      r.dg,
                      r.dbeta,
                      r.dh0,
                      0.0,
                      l2};
  a.saved = saved;
  gated_delta_rule_backward(a);
  return r;
}

// Relative errors of every gradient against another set, checked against `tol` and printed on one
// line after `tag`.
inline void expect_grads_close(const Grads& got, const Grads& want, double tol,
                               const std::string& what, const char* tag) {
  const std::pair<const char*, std::pair<const OwnedTensor*, const OwnedTensor*>> all[] = {
      {"dq", {&got.dq, &want.dq}},          {"dk", {&got.dk, &want.dk}},
      {"dv", {&got.dv, &want.dv}},          {"dg", {&got.dg, &want.dg}},
      {"dbeta", {&got.dbeta, &want.dbeta}}, {"dh0", {&got.dh0, &want.dh0}}};
  std::string line;
  for (const auto& [name, p] : all) {
    testing::expect_close(*p.first, *p.second, tol, what + " " + name);
    char buf[48];
    std::snprintf(buf, sizeof(buf), " %s %.1e", name, testing::rel_err(*p.first, *p.second));
    line += buf;
  }
  std::printf("%s %-36s%s\n", tag, what.c_str(), line.c_str());
}

}  // namespace gdn::ops::gdr_test
