// Gated delta rule on CUDA (label gpu): cuda.chunk64 vs ref (fp64 recurrence) over swept shapes,
// forward and every gradient, with and without the in-kernel l2norm: T < 64, T = 64, partial
// chunks, 1-token, empty and 50 documents, r in {1, 2, 3}, dk != dv, strong and no decay, beta
// near 0 and 1, with and without h0 / dhT. Both routes of cuda.cu: the fast one (head dims
// multiples of 8 up to 128: 16..48 in most cases, and 64, 96, 120, 128 with long, many and
// strongly decaying documents) and the generic one (dims not multiples of 8: the scalar path; dims
// up to 256). Then: empty documents and an empty batch; a packed batch equals its documents run one
// by one; runs are bitwise reproducible; a GdrChunkIndexScope gives the same results as the op's
// own index; garbage device cu_seqlens are sanitised, not read out of bounds; the resolver picks
// cuda and its probe passes; the probe rejects wrong CUDA variants; the automatic choices of the
// fast route's schedule (state split, trailing output) and the shapes they meet match ref; `ops
// run` on the cuda backend; bad input. Tolerances come from the one table,
// src/backend/tolerances.h. Every case prints its errors.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "backend/tolerances.h"
#include "gdn/backend/op_run.h"
#include "gdn/core/env.h"
#include "gdn/core/safetensors.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gdr_cuda_test_util.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using namespace gdr_test;  // NOLINT: the shared GDR test helpers
using GdrCuda = GdrCudaTest;

constexpr ProbeError kTol = bf16_tolerance("gated_delta_rule");

struct Result {
  OwnedTensor o, hT, dq, dk, dv, dg, dbeta, dh0;
};

Result run_ref(const Inputs& in, bool l2, double scale = 0) {
  OwnedTensor cu = testing::i32_tensor(in.cu);
  Result r{OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dv}),
           OwnedTensor::zeros(DType::F64, {in.N, in.Hv, in.dk, in.dv}),
           OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk}),
           OwnedTensor::zeros(DType::F64, {in.T, in.Hk, in.dk}),
           OwnedTensor::zeros(DType::F64, {in.T, in.Hv, in.dv}),
           OwnedTensor::zeros(DType::F64, {in.T, in.Hv}),
           OwnedTensor::zeros(DType::F64, {in.T, in.Hv}),
           OwnedTensor::zeros(DType::F64, {in.N, in.Hv, in.dk, in.dv})};
  gated_delta_rule_forward(
      {in.q, in.k, in.v, in.g, in.beta, cu, view_or_empty(in.h0), r.o, r.hT, scale, l2});
  gated_delta_rule_backward({in.q, in.k, in.v, in.g, in.beta, cu, view_or_empty(in.h0), in.dout,
                             view_or_empty(in.dhT), r.dq, r.dk, r.dv, r.dg, r.dbeta, r.dh0, scale,
                             l2});
  return r;
}

Result run_cuda(const Inputs& in, const Dev& d, bool l2, double scale = 0) {
  Result r{poisoned(DType::BF16, {in.T, in.Hv, in.dv}),
           poisoned(DType::F32, {in.N, in.Hv, in.dk, in.dv}),
           poisoned(DType::BF16, {in.T, in.Hk, in.dk}),
           poisoned(DType::BF16, {in.T, in.Hk, in.dk}),
           poisoned(DType::BF16, {in.T, in.Hv, in.dv}),
           poisoned(DType::F32, {in.T, in.Hv}),
           poisoned(DType::F32, {in.T, in.Hv}),
           poisoned(DType::F32, {in.N, in.Hv, in.dk, in.dv})};
  gated_delta_rule_forward(
      {d.q, d.k, d.v, d.g, d.beta, d.cu, view_or_empty(d.h0), r.o, r.hT, scale, l2});
  gated_delta_rule_backward({d.q, d.k, d.v, d.g, d.beta, d.cu, view_or_empty(d.h0), d.dout,
                             view_or_empty(d.dhT), r.dq, r.dk, r.dv, r.dg, r.dbeta, r.dh0, scale,
                             l2});
  return r;
}

// Compares every output, prints the errors, returns the largest forward and backward ones.
ProbeError compare(const Result& got, const Result& want, const std::string& what) {
  struct Item {
    const char* name;
    const OwnedTensor* g;
    const OwnedTensor* w;
    bool fwd;
  };
  const Item items[] = {{"o", &got.o, &want.o, true},
                        {"hT", &got.hT, &want.hT, true},
                        {"dq", &got.dq, &want.dq, false},
                        {"dk", &got.dk, &want.dk, false},
                        {"dv", &got.dv, &want.dv, false},
                        {"dg", &got.dg, &want.dg, false},
                        {"dbeta", &got.dbeta, &want.dbeta, false},
                        {"dh0", &got.dh0, &want.dh0, false}};
  ProbeError worst;
  std::string line;
  for (const Item& it : items) {
    if (it.w->view().numel() == 0) continue;
    testing::expect_close(*it.g, *it.w, it.fwd ? kTol.fwd : kTol.bwd, what + " " + it.name);
    const double e = testing::rel_err(*it.g, *it.w);
    (it.fwd ? worst.fwd : worst.bwd) = std::max(it.fwd ? worst.fwd : worst.bwd, e);
    char buf[48];
    std::snprintf(buf, sizeof(buf), " %s %.1e", it.name, e);
    line += buf;
  }
  std::printf("[gdr cuda] %-24s%s\n", what.c_str(), line.c_str());
  return worst;
}

class GdrCudaSweep : public GdrCuda, public ::testing::WithParamInterface<std::tuple<int, bool>> {};

TEST_P(GdrCudaSweep, MatchesRef) {
  auto [idx, l2] = GetParam();
  const Spec s = sweep_specs()[static_cast<size_t>(idx)];
  Inputs in = make_inputs(s, l2);
  Result ref = run_ref(in, l2);
  Dev d = to_device(in);
  Result got = run_cuda(in, d, l2);
  compare(got, ref, s.name + (l2 ? " l2" : ""));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GdrCudaSweep,
    ::testing::Combine(::testing::Range(0, static_cast<int>(sweep_specs().size())),
                       ::testing::Bool()),
    [](const auto& info) {
      return sweep_specs()[static_cast<size_t>(std::get<0>(info.param))].name +
             (std::get<1>(info.param) ? "_l2" : "");
    });

// The fast route's shapes through the generic route too: both match ref, and each other within the
// tolerance (they round differently: fp32 cumsum gates and bf16 T^T dT T^T against term-by-term
// gates and tf32).
TEST_F(GdrCuda, FastAndGenericRoutesAgree) {
  for (bool l2 : {false, true}) {
    Spec s{.name = "routes",
           .lens = {130, 1, 64, 20},
           .Hk = 2,
           .r = 2,
           .dk = 128,
           .dv = 64,
           .g_lo = -4,
           .seed = 71};
    Inputs in = make_inputs(s, l2);
    Result ref = run_ref(in, l2);
    Dev d = to_device(in);
    Result fast = run_cuda(in, d, l2);
    compare(fast, ref, std::string("fast route") + (l2 ? " l2" : ""));
    Result generic = [&] {
      Route route(true);
      return run_cuda(in, d, l2);
    }();
    compare(generic, ref, std::string("generic route") + (l2 ? " l2" : ""));
    compare(fast, generic, std::string("fast vs generic") + (l2 ? " l2" : ""));
  }
}

// Empty documents (and a batch with no tokens at all) pass the state through exactly: hT = h0 and
// dh0 = dhT, bit for bit (fp32 in, fp32 out, no arithmetic).
TEST_F(GdrCuda, EmptyDocumentsPassTheStateThroughExactly) {
  for (const std::vector<int32_t>& lens :
       {std::vector<int32_t>{0, 0}, std::vector<int32_t>{0, 70, 0}}) {
    Spec s{.name = "empty", .lens = lens, .Hk = 1, .r = 2, .seed = 44};
    Inputs in = make_inputs(s, true);
    Dev d = to_device(in);
    Result got = run_cuda(in, d, true);
    compare(got, run_ref(in, true), "empty T=" + std::to_string(in.T));
    for (int64_t n = 0; n < in.N; ++n) {
      if (lens[static_cast<size_t>(n)] != 0) continue;
      auto sl = [n](const Tensor& t) { return t.slice0(n, n + 1); };
      EXPECT_EQ(to_f64_vector(sl(got.hT)), to_f64_vector(sl(in.h0))) << "hT of empty doc " << n;
      EXPECT_EQ(to_f64_vector(sl(got.dh0)), to_f64_vector(sl(in.dhT))) << "dh0 of empty doc " << n;
    }
  }
}

TEST_F(GdrCuda, ExplicitScale) {
  Spec s{.name = "scale", .lens = {40, 30}, .Hk = 1, .r = 2, .seed = 61};
  Inputs in = make_inputs(s, true);
  Result ref = run_ref(in, true, 0.3);
  Dev d = to_device(in);
  compare(run_cuda(in, d, true, 0.3), ref, "scale 0.3");
}

// A packed batch equals its documents run one by one: every chunk of a document is computed by the
// same code on the same numbers either way, so only a different state-pass tiling (chosen from the
// batch's block count) could change the last bits.
TEST_F(GdrCuda, PackedBatchEqualsDocumentsOneByOne) {
  for (bool l2 : {false, true}) {
    Spec s{.name = "packed", .lens = {5, 70, 1, 130, 64}, .Hk = 2, .r = 2, .g_lo = -3, .seed = 31};
    Inputs in = make_inputs(s, l2);
    Dev d = to_device(in);
    Result packed = run_cuda(in, d, l2);
    for (int64_t n = 0; n < in.N; ++n) {
      const int64_t bos = in.cu[static_cast<size_t>(n)], eos = in.cu[static_cast<size_t>(n) + 1];
      Inputs one = in;
      one.T = eos - bos;
      one.N = 1;
      one.cu = {0, static_cast<int32_t>(one.T)};
      auto rows = [](const OwnedTensor& t, int64_t b, int64_t e) {
        return t.defined() ? convert(t.view().slice0(b, e), DType::F64) : OwnedTensor();
      };
      one.q = rows(in.q, bos, eos);
      one.k = rows(in.k, bos, eos);
      one.v = rows(in.v, bos, eos);
      one.g = rows(in.g, bos, eos);
      one.beta = rows(in.beta, bos, eos);
      one.dout = rows(in.dout, bos, eos);
      one.h0 = rows(in.h0, n, n + 1);
      one.dhT = rows(in.dhT, n, n + 1);
      Dev od = to_device(one);
      Result r = run_cuda(one, od, l2);
      const std::string w = std::string("doc ") + std::to_string(n) + (l2 ? " l2" : "");
      auto sl = [](const OwnedTensor& t, int64_t b, int64_t e) { return t.view().slice0(b, e); };
      const double tol = 1e-6;
      testing::expect_close(sl(packed.o, bos, eos), r.o, tol, w + " o");
      testing::expect_close(sl(packed.hT, n, n + 1), r.hT, tol, w + " hT");
      testing::expect_close(sl(packed.dh0, n, n + 1), r.dh0, tol, w + " dh0");
      testing::expect_close(sl(packed.dq, bos, eos), r.dq, tol, w + " dq");
      testing::expect_close(sl(packed.dk, bos, eos), r.dk, tol, w + " dk");
      testing::expect_close(sl(packed.dv, bos, eos), r.dv, tol, w + " dv");
      testing::expect_close(sl(packed.dg, bos, eos), r.dg, tol, w + " dg");
      testing::expect_close(sl(packed.dbeta, bos, eos), r.dbeta, tol, w + " dbeta");
    }
  }
}

void expect_bitwise_equal(const Result& a, const Result& b, const std::string& what) {
  const std::pair<const OwnedTensor*, const OwnedTensor*> all[] = {
      {&a.o, &b.o},   {&a.hT, &b.hT}, {&a.dq, &b.dq},       {&a.dk, &b.dk},
      {&a.dv, &b.dv}, {&a.dg, &b.dg}, {&a.dbeta, &b.dbeta}, {&a.dh0, &b.dh0}};
  const char* names[] = {"o", "hT", "dq", "dk", "dv", "dg", "dbeta", "dh0"};
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(to_f64_vector(*all[i].first), to_f64_vector(*all[i].second))
        << what << ": " << names[i] << " differs";
}

// Every dk split of the sequential state passes (1: one warp pair per 32 value columns; 2, 4, 8:
// dk over 2, 4 or 8 warp pairs with a partial exchange per chunk) against ref, forward and every
// gradient: dk = dv = 128 with T not a multiple of 64 (a long document, then one with a 1-token
// document and partial chunks), and dk = 48, dv = 24 where the split leaves warps with no k-block
// and half a column slice empty.
TEST_F(GdrCuda, EveryStateSplitMatchesRef) {
  const Spec specs[] = {
      {.name = "d128_T700_one_doc",
       .lens = {700},
       .Hk = 1,
       .r = 2,
       .dk = 128,
       .dv = 128,
       .g_lo = -0.5,
       .seed = 40},
      {.name = "d128_three_docs",
       .lens = {200, 1, 63},
       .Hk = 2,
       .r = 1,
       .dk = 128,
       .dv = 128,
       .g_lo = -2,
       .seed = 41},
      {.name = "dk48_dv24", .lens = {130, 7}, .r = 2, .dk = 48, .dv = 24, .seed = 42}};
  for (const Spec& s : specs) {
    for (bool l2 : {true, false}) {
      Inputs in = make_inputs(s, l2);
      Result ref = run_ref(in, l2);
      Dev d = to_device(in);
      for (int ks : {1, 2, 4, 8}) {
        StateSplit split(ks);
        ASSERT_EQ(gdr_state_split_for(in.N, in.Hv, in.dv), ks);
        Result got = run_cuda(in, d, l2);
        compare(got, ref, s.name + (l2 ? " l2" : "") + " ks=" + std::to_string(ks));
      }
    }
  }
}

// The two shapes the schedule tests share (each test its own seed): dk = dv = 128 over
// several documents with a 1-token one and partial chunks, r value heads a key head; and dk = 48,
// dv = 24 (the general staging: a half-empty value slice).
Spec d128_docs_spec(int64_t r, uint64_t seed) {
  return {.name = "d128_docs",
          .lens = {300, 1, 63, 130},
          .Hk = 2,
          .r = r,
          .dk = 128,
          .dv = 128,
          .g_lo = -2,
          .seed = seed};
}
Spec dk48_dv24_spec(uint64_t seed) {
  return {.name = "dk48_dv24", .lens = {130, 7}, .r = 2, .dk = 48, .dv = 24, .seed = seed};
}

// The automatic split: 4 while the state passes' grid (documents x value heads x 32-column blocks)
// has no more blocks than the GPU has SMs, else 1. The expectations assume at least 128 SMs (the
// H200 has 132): one document of any length at Hv = 16 or 32 splits, four documents do not. The
// override wins; a split outside {0, 1, 2, 4, 8} is an error.
TEST_F(GdrCuda, StateSplitChoice) {
  EXPECT_EQ(gdr_state_split_for(1, 16, 128), 4) << "64 blocks";
  EXPECT_EQ(gdr_state_split_for(1, 32, 128), 4) << "128 blocks (needs >= 128 SMs)";
  EXPECT_EQ(gdr_state_split_for(4, 16, 128), 1) << "256 blocks";
  EXPECT_EQ(gdr_state_split_for(4, 32, 128), 1) << "512 blocks";
  EXPECT_EQ(gdr_state_split_for(1, 4, 24), 4) << "one 32-column block per head";
  {
    StateSplit split(2);
    EXPECT_EQ(gdr_state_split_for(4, 32, 128), 2);
    EXPECT_EQ(gdr_state_split_for(1, 16, 128), 2);
  }
  EXPECT_EQ(gdr_state_split_for(4, 32, 128), 1) << "the override ends with its scope";
  try {
    gdr_set_state_split(3);
    FAIL() << "a state split of 3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state split 3"), std::string::npos) << e.what();
  }
}

// The dq/dk/dW kernel of the fast backward (16 warps a block, each warp a 16-row slice and a
// quarter of the columns) against ref: dk = dv = 128 over several documents with partial chunks
// and r = 2, dk = 64 (half the key columns: a column quarter of 16), and dk = 48, dv = 24.
TEST_F(GdrCuda, DqkwMatchesRef) {
  const Spec specs[] = {
      d128_docs_spec(2, 45),
      {.name = "d64", .lens = {190, 70}, .Hk = 1, .r = 2, .dk = 64, .dv = 64, .seed = 46},
      dk48_dv24_spec(47)};
  for (const Spec& s : specs) {
    Inputs in = make_inputs(s, true);
    const Result ref = run_ref(in, true);
    Dev d = to_device(in);
    compare(run_cuda(in, d, true), ref, s.name + " dqkw");
  }
}

// The forward's output beside the state pass (cuda_fast.h: fast_state_output) is the automatic
// choice at few documents with a dk split, and its results match ref: one long document (47
// chunks: the output waits on counts published every 4 chunks), several documents with a 1-token
// one and partial chunks (both must take it), and dk = 48, dv = 24. Without a dk split (forced to
// 1) the output runs after the pass, and matches ref too.
TEST_F(GdrCuda, TrailingOutputChoiceAndResults) {
  const Spec specs[] = {{.name = "d128_T3000_one_doc",
                         .lens = {3000},
                         .Hk = 2,
                         .r = 2,
                         .dk = 128,
                         .dv = 128,
                         .g_lo = -0.5,
                         .seed = 48},
                        d128_docs_spec(1, 49),
                        dk48_dv24_spec(50)};
  for (const Spec& s : specs) {
    Inputs in = make_inputs(s, true);
    const bool trails = gdr_trailing_output_for(in.T, in.N, in.Hk, in.Hv, in.dk, in.dv);
    if (s.dk == 128) {
      EXPECT_TRUE(trails) << s.name << ": the output should run beside the pass";
    }
    const Result ref = run_ref(in, true);
    Dev d = to_device(in);
    compare(run_cuda(in, d, true), ref,
            s.name + (trails ? " trailing output" : " output after the pass"));
    StateSplit split(1);
    EXPECT_FALSE(gdr_trailing_output_for(in.T, in.N, in.Hk, in.Hv, in.dk, in.dv))
        << s.name << ": without a dk split the output should follow the pass";
    compare(run_cuda(in, d, true), ref, s.name + " ks=1, output after the pass");
  }
}

TEST_F(GdrCuda, RunsAreBitwiseReproducible) {
  Spec s{.name = "det", .lens = {200, 1, 33}, .Hk = 2, .r = 2, .dk = 128, .dv = 128, .seed = 41};
  Inputs in = make_inputs(s, true);
  Dev d = to_device(in);
  Result first = run_cuda(in, d, true);
  for (int rep = 0; rep < 2; ++rep)
    expect_bitwise_equal(run_cuda(in, d, true), first, "repeat " + std::to_string(rep));
}

TEST_F(GdrCuda, ChunkIndexScopeGivesTheSameResults) {
  Spec s{.name = "scope", .lens = {3, 130, 0, 64}, .Hk = 1, .r = 2, .seed = 42};
  Inputs in = make_inputs(s, true);
  Dev d = to_device(in);
  Result own = run_cuda(in, d, true);
  OwnedTensor ix =
      OwnedTensor::empty(DType::I32, {gdr_chunk_index_numel(in.T, in.N)}, Device::CUDA);
  {
    GdrChunkIndexScope scope(d.cu, in.T, ix.view());
    EXPECT_EQ(GdrChunkIndexScope::find(d.cu, in.T), &scope);
    EXPECT_EQ(GdrChunkIndexScope::find(d.cu, in.T + 1), nullptr) << "T must match";
    expect_bitwise_equal(run_cuda(in, d, true), own, "with a chunk index scope");
  }
  EXPECT_EQ(GdrChunkIndexScope::find(d.cu, in.T), nullptr) << "the scope ended";
  // The index is a pure function of cu_seqlens: a batch's three documents of 3, 130 (3 chunks),
  // 0 and 64 tokens give 5 chunks. Read it back: bos, chunk0, then the table.
  OwnedTensor host = convert(ix, DType::I32);
  const int32_t* p = host.ptr<int32_t>();
  const std::vector<int32_t> bos(p, p + in.N + 1), chunk0(p + in.N + 1, p + 2 * (in.N + 1));
  EXPECT_EQ(bos, (std::vector<int32_t>{0, 3, 133, 133, 197}));
  EXPECT_EQ(chunk0, (std::vector<int32_t>{0, 1, 4, 4, 5}));
}

// cu_seqlens on the device are not checked on the host (that would synchronise): out-of-range and
// decreasing values are clamped into [0, T] and made non-decreasing, so the batch behaves as the
// sanitised one and nothing is read or written out of bounds (compute-sanitizer checks the latter).
TEST_F(GdrCuda, GarbageDeviceCuSeqlensAreSanitised) {
  Spec s{.name = "garbage", .lens = {50, 50, 60}, .Hk = 1, .r = 2, .seed = 43};
  Inputs in = make_inputs(s, true);
  Inputs clean = in;
  clean.cu = {0, 50, 50, 160};  // what {-7, 50, 20, 999} becomes at T = 160
  Inputs bad = in;
  bad.cu = {-7, 50, 20, 999};
  Dev dc = to_device(clean), db = to_device(bad);
  Result want = run_cuda(clean, dc, true), got = run_cuda(bad, db, true);
  expect_bitwise_equal(got, want, "garbage cu_seqlens");
}

// The production class (Qwen3.5: dk = dv = 128, aligned, in-kernel l2norm, no states, `saved`)
// resolves to the fast route, which passes its probe there; a class the fast route does not take
// (dk 192) to the generic one.
OpQuery production_class() {
  return OpQuery{Backend::Cuda,
                 "dk=128,dv=128,vec=1,l2=1,states=0,saved=1",
                 {{"dk", 128}, {"dv", 128}, {"vec", 1}, {"l2", 1}, {"states", 0}, {"saved", 1}}};
}

TEST_F(GdrCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  const Resolution& wide = Registry::global().resolve(
      "gated_delta_rule",
      OpQuery{Backend::Cuda,
              "dk=192,dv=64,vec=1,l2=1,states=1,saved=0",
              {{"dk", 192}, {"dv", 64}, {"vec", 1}, {"l2", 1}, {"states", 1}, {"saved", 0}}});
  ASSERT_NE(wide.impl, nullptr);
  EXPECT_EQ(wide.impl->name, "cuda.chunk64_generic");
  const Resolution& r = Registry::global().resolve("gated_delta_rule", production_class());
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, "cuda.chunk64");
  EXPECT_EQ(r.impl->backend, Backend::Cuda);
  EXPECT_LE(r.error.fwd, kTol.fwd);
  EXPECT_LE(r.error.bwd, kTol.bwd);
  EXPECT_GT(r.error.fwd, 0.0);  // bf16 outputs: exactly 0 would mean nothing was compared
  EXPECT_GT(r.error.bwd, 0.0);
  EXPECT_TRUE(r.rejected.empty()) << r.rejected.front();
  std::printf("[gdr cuda] probe cuda.chunk64: fwd %.2e bwd %.2e\n", r.error.fwd, r.error.bwd);
}

// Deliberately wrong variants built from the real implementation: the probe must reject each.
const GatedDeltaRuleTable* real_table() {
  for (const ImplDesc* i : Registry::global().impls("gated_delta_rule", Backend::Cuda))
    if (i->name == "cuda.chunk64") return static_cast<const GatedDeltaRuleTable*>(i->table);
  return nullptr;
}
void fwd_ok(const GatedDeltaRuleFwd& a) { real_table()->forward(a); }
void bwd_ok(const GatedDeltaRuleBwd& a) { real_table()->backward(a); }
void fwd_no_h0(const GatedDeltaRuleFwd& a) {
  GatedDeltaRuleFwd b = a;
  b.h0 = Tensor();
  real_table()->forward(b);
}
void fwd_no_l2(const GatedDeltaRuleFwd& a) {
  GatedDeltaRuleFwd b = a;
  b.use_qk_l2norm = !a.use_qk_l2norm;
  real_table()->forward(b);
}
void bwd_no_dhT(const GatedDeltaRuleBwd& a) {
  GatedDeltaRuleBwd b = a;
  b.dhT = Tensor();
  real_table()->backward(b);
}
void bwd_zero_dg(const GatedDeltaRuleBwd& a) {
  real_table()->backward(a);
  copy_into(a.dg, OwnedTensor::zeros(DType::F32, {a.dg.size(0), a.dg.size(1)}, Device::CUDA));
}

TEST_F(GdrCuda, ProbeRejectsWrongCudaImplementations) {
  ASSERT_NE(real_table(), nullptr) << "cuda.chunk64 is not registered";
  const OpDesc& op = Registry::global().op("gated_delta_rule");
  struct Wrong {
    const char* what;
    GatedDeltaRuleTable table;
    bool in_production;  // wrong in the production class too (which has no states)
  };
  static const Wrong wrong[] = {{"ignores h0", {fwd_no_h0, bwd_ok}, false},
                                {"flips use_qk_l2norm", {fwd_no_l2, bwd_ok}, true},
                                {"ignores dhT", {fwd_ok, bwd_no_dhT}, false},
                                {"drops dg", {fwd_ok, bwd_zero_dg}, true}};
  for (const Wrong& w : wrong) {
    ImplDesc impl{"gated_delta_rule", "cuda.wrong", Backend::Cuda, 0, nullptr, &w.table};
    const ProbeError e = op.probe(impl, OpQuery{Backend::Cuda, "", {}});
    if (w.in_production) {
      const ProbeError p = op.probe(impl, production_class());
      EXPECT_TRUE(p.fwd > kTol.fwd || p.bwd > kTol.bwd)
          << w.what << " at the production class: probe errors fwd " << p.fwd << " bwd " << p.bwd
          << " pass";
    }
    EXPECT_TRUE(e.fwd > kTol.fwd || e.bwd > kTol.bwd)
        << w.what << ": probe errors fwd " << e.fwd << " bwd " << e.bwd << " pass";
  }
}

TEST_F(GdrCuda, OpsRunOnCudaBackend) {
  Spec s{.name = "file", .lens = {3, 66}, .Hk = 1, .r = 2, .dk = 16, .dv = 8, .seed = 81};
  Inputs in = make_inputs(s, true);
  Result ref = run_ref(in, true);
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("gdn_gdr_cuda_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string inp = (dir / "in.safetensors").string(),
                    out = (dir / "out.safetensors").string();
  OwnedTensor q = convert(in.q, DType::F32), k = convert(in.k, DType::F32),
              v = convert(in.v, DType::F32), g = convert(in.g, DType::F32),
              beta = convert(in.beta, DType::F32), h0 = convert(in.h0, DType::F32),
              dout = convert(in.dout, DType::F32), dhT = convert(in.dhT, DType::F32);
  OwnedTensor cu = testing::i32_tensor(in.cu);
  auto nt = [](const char* name, const Tensor& t) {
    return NamedTensor{name, t, {}, {}, nullptr, 0};
  };
  write_safetensors(inp,
                    {nt("q", q), nt("k", k), nt("v", v), nt("g", g), nt("beta", beta),
                     nt("cu_seqlens", cu), nt("h0", h0), nt("do", dout), nt("dhT", dhT)},
                    {{"use_qk_l2norm", "1"}});
  OpRunResult res = run_op_file("gated_delta_rule", Backend::Cuda, inp, out, true, {});
  // `ops run` resolves the op's default class (no dims): the route that takes any shape.
  EXPECT_EQ(res.impl, "cuda.chunk64_generic");
  SafeTensorsFile f(out);
  auto check = [&](const char* name, const OwnedTensor& want, double tol) {
    testing::expect_close(f.load(name, DType::F64), want, tol, std::string("ops run ") + name);
  };
  check("o", ref.o, kTol.fwd);
  check("hT", ref.hT, kTol.fwd);
  check("dq", ref.dq, kTol.bwd);
  check("dk", ref.dk, kTol.bwd);
  check("dv", ref.dv, kTol.bwd);
  check("dg", ref.dg, kTol.bwd);
  check("dbeta", ref.dbeta, kTol.bwd);
  check("dh0", ref.dh0, kTol.bwd);
  fs::remove_all(dir);
}

using testing::expect_error;

TEST_F(GdrCuda, BadInputIsAClearError) {
  Spec s{.name = "bad", .lens = {4, 6}, .Hk = 2, .r = 2, .dk = 8, .dv = 8, .seed = 91};
  Inputs in = make_inputs(s, true);
  Dev d = to_device(in);
  OwnedTensor o = OwnedTensor::zeros(DType::BF16, {in.T, in.Hv, in.dv}, Device::CUDA);
  GatedDeltaRuleFwd ok{d.q, d.k, d.v, d.g, d.beta, d.cu, d.h0, o, Tensor(), 0.0, true};
  gated_delta_rule_forward(ok);  // valid as given
  OwnedTensor g_bf16 = convert(in.g, DType::BF16, Device::CUDA);
  GatedDeltaRuleFwd a = ok;
  a.g = g_bf16;
  expect_error([&] { gated_delta_rule_forward(a); }, "tensor 'g' has dtype BF16, expected F32");
  OwnedTensor v_host = convert(in.v, DType::BF16);
  a = ok;
  a.v = v_host;
  expect_error([&] { gated_delta_rule_forward(a); }, "tensor 'v' is on cpu, expected cuda");
  OwnedTensor q_f32 = convert(in.q, DType::F32, Device::CUDA);
  OwnedTensor k_f32 = convert(in.k, DType::F32, Device::CUDA);
  OwnedTensor v_f32 = convert(in.v, DType::F32, Device::CUDA);
  OwnedTensor o_f32 = OwnedTensor::zeros(DType::F32, {in.T, in.Hv, in.dv}, Device::CUDA);
  a = {q_f32, k_f32, v_f32, d.g, d.beta, d.cu, d.h0, o_f32, Tensor(), 0.0, true};
  expect_error([&] { gated_delta_rule_forward(a); },
               "gated_delta_rule: tensor 'q' has dtype F32, expected BF16 on cuda");
  OwnedTensor ix = OwnedTensor::empty(DType::I32, {3}, Device::CUDA);
  expect_error([&] { gdr_build_chunk_index(d.cu, in.T, ix.view()); },
               "tensor 'chunk index' has 3 elements, expected at least");
}

}  // namespace
}  // namespace gdn::ops
