// Gated delta rule on CUDA (label gpu): the optional `saved` tensor (op.h), the forward's state
// pass output that lets the backward skip its own. On both routes of cuda.cu (fast and generic,
// cuda.chunk64 and cuda.chunk64_generic) over swept shapes (partial chunks, 1-token, empty and 50
// documents, r in {1, 2, 3}, dk != dv, with and without h0 / dhT and the l2norm, dims the fast
// route takes and dims only the generic one takes, up to 256):
//   - a forward given `saved` returns bitwise the o and hT of one without it;
//   - a backward given that `saved` returns bitwise the dq, dk, dv, dg, dbeta, dh0 of the backward
//     that recomputes (the recomputed states are bitwise those the forward wrote); `saved` starts
//     as NaN, so a slot the backward reads but the forward did not write shows up as a mismatch;
//   - the same at every forced dk split of the fast route's state passes;
//   - the backward really reads `saved` (zeroing it changes the gradients);
//   - the routes share the layout: each route's forward writes `saved` close to the other's, and a
//     backward of one route given the other's `saved` matches ref and its own recomputing backward
//     within the bf16 tolerance;
//   - a bad `saved` (size, dtype, device, alignment) is an error naming it.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backend/tolerances.h"
#include "gdn/core/env.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gdr_cuda_test_util.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using namespace gdr_test;  // NOLINT: the shared GDR test helpers
using GdrSavedCuda = GdrCudaTest;

constexpr ProbeError kTol = bf16_tolerance("gated_delta_rule");

// The number of elements whose bytes differ (0 = bitwise equal), with the first one reported.
int64_t bitwise_mismatches(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_EQ(a.numel(), b.numel()) << what;
  EXPECT_EQ(a.dtype(), b.dtype()) << what;
  if (a.numel() != b.numel() || a.dtype() != b.dtype()) return -1;
  OwnedTensor ha = convert(a, a.dtype()), hb = convert(b, b.dtype());
  const size_t es = static_cast<size_t>(dtype_size(a.dtype()));
  const char* pa = static_cast<const char*>(ha.view().data());
  const char* pb = static_cast<const char*>(hb.view().data());
  int64_t bad = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(pa + i * es, pb + i * es, es) == 0) continue;
    if (bad == 0)
      ADD_FAILURE() << what << ": first differing element " << i << ": "
                    << to_f64_vector(ha)[static_cast<size_t>(i)] << " vs "
                    << to_f64_vector(hb)[static_cast<size_t>(i)];
    ++bad;
  }
  return bad;
}

void expect_bitwise(const Tensor& a, const Tensor& b, const std::string& what) {
  const int64_t bad = bitwise_mismatches(a, b, what);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << a.numel() << " elements differ";
}

void expect_grads_bitwise(const Grads& a, const Grads& b, const std::string& what) {
  expect_bitwise(a.dq, b.dq, what + " dq");
  expect_bitwise(a.dk, b.dk, what + " dk");
  expect_bitwise(a.dv, b.dv, what + " dv");
  expect_bitwise(a.dg, b.dg, what + " dg");
  expect_bitwise(a.dbeta, b.dbeta, what + " dbeta");
  expect_bitwise(a.dh0, b.dh0, what + " dh0");
}

// The ref (fp64) gradients of the inputs.
Grads ref_grads(const Inputs& in, bool l2) {
  OwnedTensor cu = testing::i32_tensor(in.cu);
  OwnedTensor o = OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dv});
  Grads r{OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dv}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hv}),
          OwnedTensor::zeros(DType::F64, {in.T, in.Hv}),
          OwnedTensor::zeros(DType::F64, {in.N, in.Hv, in.dk, in.dv})};
  gated_delta_rule_forward(
      {in.q, in.k, in.v, in.g, in.beta, cu, view_or_empty(in.h0), o, Tensor(), 0.0, l2});
  gated_delta_rule_backward({in.q, in.k, in.v, in.g, in.beta, cu, view_or_empty(in.h0), in.dout,
                             view_or_empty(in.dhT), r.dq, r.dk, r.dv, r.dg, r.dbeta, r.dh0, 0.0,
                             l2});
  return r;
}

// Forward with and without `saved`, then backward with `saved` (first, so that no scratch left by
// a recomputing call can stand in for it) and without: bitwise equal.
void check_bitwise(const Spec& s, bool l2, const std::string& what) {
  Inputs in = make_inputs(s, l2);
  Dev d = to_device(in);
  OwnedTensor saved = poisoned(DType::BF16, {saved_numel(in)});
  const Fwd with = forward(in, d, l2, saved);
  const Fwd without = forward(in, d, l2, Tensor());
  expect_bitwise(with.o, without.o, what + " o");
  expect_bitwise(with.hT, without.hT, what + " hT");
  const Grads from_saved = backward(in, d, l2, saved);
  const Grads recomputed = backward(in, d, l2, Tensor());
  expect_grads_bitwise(from_saved, recomputed, what);
  std::printf("[gdr saved] %-36s bitwise checked (T=%lld N=%lld saved %lld elements)\n",
              what.c_str(), static_cast<long long>(in.T), static_cast<long long>(in.N),
              static_cast<long long>(saved_numel(in)));
}

class GdrSavedSweep : public GdrSavedCuda,
                      public ::testing::WithParamInterface<std::tuple<int, bool, bool>> {};

TEST_P(GdrSavedSweep, BackwardGivenSavedIsBitwiseTheRecomputingOne) {
  auto [idx, l2, generic] = GetParam();
  const Spec s = sweep_specs()[static_cast<size_t>(idx)];
  Route route(generic);
  check_bitwise(s, l2, s.name + (l2 ? " l2" : "") + (generic ? " generic" : " fast"));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GdrSavedSweep,
    ::testing::Combine(::testing::Range(0, static_cast<int>(sweep_specs().size())),
                       ::testing::Bool(), ::testing::Bool()),
    [](const auto& info) {
      return sweep_specs()[static_cast<size_t>(std::get<0>(info.param))].name +
             (std::get<1>(info.param) ? "_l2" : "") +
             (std::get<2>(info.param) ? "_generic" : "_fast");
    });

// The fast route's state passes at every forced dk split: the forward's Ht and Vt (what the split
// changes in the last bits) are what the backward reads.
TEST_F(GdrSavedCuda, EveryStateSplitIsBitwiseTheRecomputingOne) {
  const Spec s{.name = "d128_split",
               .lens = {300, 1, 63},
               .Hk = 1,
               .r = 2,
               .dk = 128,
               .dv = 128,
               .g_lo = -1,
               .seed = 30};
  for (int ks : {1, 2, 4, 8}) {
    StateSplit split(ks);
    check_bitwise(s, true, "d128 ks=" + std::to_string(ks));
  }
}

// Zeroing `saved` between forward and backward changes the gradients: the backward reads it (and
// does not recompute the states it holds), on both routes.
TEST_F(GdrSavedCuda, TheBackwardReadsSaved) {
  const Spec s{.name = "reads", .lens = {100, 30}, .Hk = 1, .r = 2, .dk = 64, .dv = 64, .seed = 31};
  for (bool generic : {false, true}) {
    Route route(generic);
    Inputs in = make_inputs(s, true);
    Dev d = to_device(in);
    OwnedTensor saved = OwnedTensor::zeros(DType::BF16, {saved_numel(in)}, Device::CUDA);
    forward(in, d, true, saved);
    const Grads good = backward(in, d, true, saved);
    const Grads recomputed = backward(in, d, true, Tensor());
    expect_grads_bitwise(good, recomputed, generic ? "generic" : "fast");
    OwnedTensor zero = OwnedTensor::zeros(DType::BF16, {saved_numel(in)}, Device::CUDA);
    const Grads wrong = backward(in, d, true, zero);
    // dq reads the chunk-start states (q . H terms): zero states change it.
    EXPECT_GT(testing::rel_err(wrong.dq, good.dq), 1e-2)
        << (generic ? "generic" : "fast") << ": a zeroed 'saved' left dq unchanged";
    EXPECT_GT(testing::rel_err(wrong.dk, good.dk), 1e-2)
        << (generic ? "generic" : "fast") << ": a zeroed 'saved' left dk unchanged";
  }
}

// `saved`'s chunk factors (W, T, gamma: op.h): the fast backward reads them instead of rebuilding
// them (zeroing them alone changes its gradients), the generic backward rebuilds its own (zeroing
// them leaves its gradients bitwise unchanged).
TEST_F(GdrSavedCuda, OnlyTheFastBackwardReadsTheChunkFactors) {
  const Spec s{
      .name = "factors", .lens = {100, 30}, .Hk = 1, .r = 2, .dk = 64, .dv = 64, .seed = 33};
  Inputs in = make_inputs(s, true);
  const int64_t nt = gdr_saved_chunks(in.T, in.N), n = saved_numel(in);
  const int64_t factors_at = nt * in.Hv * in.dv * (in.dk + kGdrChunk);  // after Ht and Vt
  for (bool generic : {false, true}) {
    Route route(generic);
    const std::string tag = generic ? "generic" : "fast";
    Dev d = to_device(in);
    OwnedTensor saved = OwnedTensor::zeros(DType::BF16, {n}, Device::CUDA);
    forward(in, d, true, saved);
    const Grads good = backward(in, d, true, saved);
    copy_into(saved.view().slice0(factors_at, n),
              OwnedTensor::zeros(DType::BF16, {n - factors_at}, Device::CUDA).view());
    const Grads without_factors = backward(in, d, true, saved);
    if (generic) {
      expect_grads_bitwise(without_factors, good, tag + " with the chunk factors zeroed");
    } else {
      // dk goes through T and W (the WY backward): zero factors change it.
      EXPECT_GT(testing::rel_err(without_factors.dk, good.dk), 1e-2)
          << tag << ": zeroed chunk factors left dk unchanged";
      EXPECT_GT(testing::rel_err(without_factors.dv, good.dv), 1e-2)
          << tag << ": zeroed chunk factors left dv unchanged";
    }
  }
}

// One layout for both routes: the fast forward's `saved` and the generic forward's agree to bf16
// precision (a transposed or shifted part would not), and a backward of either route given the
// other route's `saved` matches ref and its own recomputing backward within the tolerance.
TEST_F(GdrSavedCuda, RoutesShareTheLayout) {
  for (bool l2 : {false, true}) {
    const Spec s{.name = "routes",
                 .lens = {130, 1, 64, 20},
                 .Hk = 2,
                 .r = 2,
                 .dk = 128,
                 .dv = 64,
                 .g_lo = -3,
                 .seed = 32};
    Inputs in = make_inputs(s, l2);
    Dev d = to_device(in);
    const std::string tag = l2 ? " l2" : "";
    // Zero-initialised: slots past the batch's chunks (never written) compare equal.
    OwnedTensor saved_fast = OwnedTensor::zeros(DType::BF16, {saved_numel(in)}, Device::CUDA);
    OwnedTensor saved_generic = OwnedTensor::zeros(DType::BF16, {saved_numel(in)}, Device::CUDA);
    Grads fast_rec, generic_rec;
    {
      Route route(false);
      forward(in, d, l2, saved_fast);
      fast_rec = backward(in, d, l2, Tensor());
    }
    {
      Route route(true);
      forward(in, d, l2, saved_generic);
      generic_rec = backward(in, d, l2, Tensor());
    }
    // The bf16 sections to bf16 precision; gamma bitwise (both routes take the fast prep's).
    const int64_t ga = saved_gamma_at(in), n = saved_numel(in);
    const double e =
        testing::rel_err(saved_generic.view().slice0(0, ga), saved_fast.view().slice0(0, ga));
    std::printf("[gdr saved] fast vs generic forward's saved%s: rel err %.1e\n", tag.c_str(), e);
    EXPECT_LT(e, kTol.fwd) << "the two routes' 'saved' differ beyond rounding" << tag;
    expect_bitwise(saved_generic.view().slice0(ga, n), saved_fast.view().slice0(ga, n),
                   "the two routes' saved gamma" + tag);
    // The Vt part past each partial chunk's end is exact zeros on both routes.
    {
      const int64_t nt = gdr_saved_chunks(in.T, in.N);
      const std::vector<double> vf =
          to_f64_vector(saved_fast.view().slice0(nt * in.Hv * in.dv * in.dk, saved_numel(in)));
      const std::vector<double> vg =
          to_f64_vector(saved_generic.view().slice0(nt * in.Hv * in.dv * in.dk, saved_numel(in)));
      // Chunks of the batch in order: document lengths 130 (64, 64, 2), 1, 64, 20.
      const std::vector<int> lens = {64, 64, 2, 1, 64, 20};
      int64_t nonzero_tail = 0;
      for (size_t c = 0; c < lens.size(); ++c)
        for (int64_t h = 0; h < in.Hv; ++h)
          for (int64_t e2 = 0; e2 < in.dv; ++e2)
            for (int i = lens[c]; i < 64; ++i) {
              const size_t at = static_cast<size_t>(
                  ((static_cast<int64_t>(c) * in.Hv + h) * in.dv + e2) * 64 + i);
              nonzero_tail += vf[at] != 0 || vg[at] != 0;
            }
      EXPECT_EQ(nonzero_tail, 0) << "Vt past a partial chunk's end must be exact zeros" << tag;
    }
    const Grads ref = ref_grads(in, l2);
    Grads generic_from_fast, fast_from_generic;
    {
      Route route(true);
      generic_from_fast = backward(in, d, l2, saved_fast);
    }
    {
      Route route(false);
      fast_from_generic = backward(in, d, l2, saved_generic);
    }
    expect_grads_close(generic_from_fast, ref, kTol.bwd, "generic bwd, fast saved vs ref" + tag,
                       "[gdr saved]");
    expect_grads_close(fast_from_generic, ref, kTol.bwd, "fast bwd, generic saved vs ref" + tag,
                       "[gdr saved]");
    expect_grads_close(generic_from_fast, generic_rec, kTol.bwd,
                       "generic bwd, fast saved vs recompute" + tag, "[gdr saved]");
    expect_grads_close(fast_from_generic, fast_rec, kTol.bwd,
                       "fast bwd, generic saved vs recompute" + tag, "[gdr saved]");
  }
}

// A chunk index scope (the model's way: one index for every layer) gives the same bits as well.
TEST_F(GdrSavedCuda, ChunkIndexScopeWithSaved) {
  const Spec s{.name = "scope", .lens = {3, 130, 0, 64}, .Hk = 1, .r = 2, .seed = 33};
  Inputs in = make_inputs(s, true);
  Dev d = to_device(in);
  OwnedTensor saved = poisoned(DType::BF16, {saved_numel(in)});
  OwnedTensor ix =
      OwnedTensor::empty(DType::I32, {gdr_chunk_index_numel(in.T, in.N)}, Device::CUDA);
  const Grads recomputed = backward(in, d, true, Tensor());
  {
    GdrChunkIndexScope scope(d.cu, in.T, ix.view());
    forward(in, d, true, saved);
    expect_grads_bitwise(backward(in, d, true, saved), recomputed, "scope");
  }
}

using testing::expect_error;

TEST_F(GdrSavedCuda, BadSavedIsAClearError) {
  const Spec s{.name = "bad", .lens = {70, 6}, .Hk = 1, .r = 2, .dk = 32, .dv = 32, .seed = 34};
  Inputs in = make_inputs(s, true);
  Dev d = to_device(in);
  const int64_t n = saved_numel(in);
  OwnedTensor short_one = OwnedTensor::zeros(DType::BF16, {n - 1}, Device::CUDA);
  OwnedTensor f32 = OwnedTensor::zeros(DType::F32, {n}, Device::CUDA);
  OwnedTensor host = OwnedTensor::zeros(DType::BF16, {n});
  OwnedTensor big = OwnedTensor::zeros(DType::BF16, {n + 8}, Device::CUDA);
  // One element in: 2-byte aligned only.
  Tensor misaligned(static_cast<char*>(big.view().data()) + 2, DType::BF16, {n}, Device::CUDA);
  for (bool generic : {false, true}) {
    Route route(generic);
    expect_error([&] { forward(in, d, true, short_one); }, "tensor 'saved' has shape");
    expect_error([&] { backward(in, d, true, short_one); }, "tensor 'saved' has shape");
    expect_error([&] { forward(in, d, true, f32); }, "tensor 'saved' has dtype F32, expected BF16");
    expect_error([&] { backward(in, d, true, host); }, "tensor 'saved' is on cpu, expected cuda");
    expect_error([&] { forward(in, d, true, misaligned); },
                 "tensor 'saved' must be 16-byte aligned");
    expect_error([&] { backward(in, d, true, misaligned); },
                 "tensor 'saved' must be 16-byte aligned");
  }
}

}  // namespace
}  // namespace gdn::ops
