// Gated attention on CUDA (label gpu), for each CUDA implementation ("cuda.flash": mma.sync,
// "cuda.sm90_tma": Hopper warpgroup MMAs with TMA producer warps and mbarriers) called directly:
// cuda vs ref over swept shapes (forward, every saved tensor and every gradient, both halves of dqg
// separately): one document, many documents with 1-token and empty ones, T and documents not
// multiples of the 128-query / 64-key tiles, GQA 1/2/4, head dims 8 .. 256 (64, 128, 256 native; 8,
// 16, 96 padded), partial rotary factors 0 .. 1; packed batch == documents run alone (bit for bit,
// the norm-weight gradients to rounding), determinism, `+=` of the norm-weight gradients, 1-token
// documents, inconsistent device cu_seqlens never faulting. Then, through the registry: the
// resolver's choice and both probes, wrong CUDA kernels rejected by the probe, `ops run` on the
// cuda backend, and bad input. Tolerances come from the one table, src/backend/tolerances.h.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "backend/tolerances.h"
#include "gdn/backend/op_run.h"
#include "gdn/core/safetensors.h"
#include "ops/gated_attention/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

constexpr ProbeError kTol = bf16_tolerance("gated_attention");

class GatedAttentionCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

// A device tensor whose every element is NaN: an output element the kernels do not write fails
// the comparison as non-finite.
OwnedTensor poisoned(DType dt, std::initializer_list<int64_t> shape) {
  Tensor probe(nullptr, dt, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()),
                        std::numeric_limits<double>::quiet_NaN());
  return from_f64(v, dt, std::span<const int64_t>(shape.begin(), shape.size()), Device::CUDA);
}

std::vector<int32_t> offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t n : lens) cu.push_back(cu.back() + n);
  return cu;
}

// F64 host inputs rounded through bf16 (ref and cuda see the same numbers); cu on the host.
struct Inputs {
  OwnedTensor qg, k, v, wq, wk, cu, dout;
  int64_t rot = 0;
  double theta = 1e4;
  int64_t T() const { return qg.view().size(0); }
  int64_t Hq() const { return qg.view().size(1); }
  int64_t Hkv() const { return k.view().size(1); }
  int64_t hd() const { return k.view().size(2); }
};

Inputs make_inputs(const std::vector<int32_t>& lens, int64_t Hq, int64_t Hkv, int64_t hd,
                   double factor, double theta, uint64_t seed) {
  const std::vector<int32_t> cu = offsets(lens);
  const int64_t T = cu.back();
  auto r = [](const OwnedTensor& t) { return testing::rounded(t, DType::BF16); };
  return {r(randn({T, Hq, 2 * hd}, seed + 1, 1.5)),  // query | gate: gates over σ's whole range
          r(randn({T, Hkv, hd}, seed + 2)),
          r(randn({T, Hkv, hd}, seed + 3)),
          r(randn({hd}, seed + 4, 0.3)),
          r(randn({hd}, seed + 5, 0.3)),
          testing::i32_tensor(cu),
          r(randn({T, Hq, hd}, seed + 6)),
          gated_attention_rotary_dim(hd, factor),
          theta};
}

struct Result {
  OwnedTensor o, q_hat, k_hat, attn, lse, q_rstd, k_rstd;  // forward
  OwnedTensor dqg, dk, dv, dwq, dwk;                       // backward
};

Result run_ref(const Inputs& in) {
  const int64_t T = in.T(), Hq = in.Hq(), Hkv = in.Hkv(), hd = in.hd();
  auto z = [](std::initializer_list<int64_t> s) { return OwnedTensor::zeros(DType::F64, s); };
  Result r{z({T, Hq, hd}),  z({T, Hq, hd}),  z({T, Hkv, hd}), z({T, Hq, hd}),
           z({T, Hq}),      z({T, Hq}),      z({T, Hkv}),     z({T, Hq, 2 * hd}),
           z({T, Hkv, hd}), z({T, Hkv, hd}), z({hd}),         z({hd})};
  gated_attention_forward({in.qg, in.k, in.v, in.wq, in.wk, in.cu, r.o, r.q_hat, r.k_hat, r.attn,
                           r.lse, r.q_rstd, r.k_rstd, in.rot, in.theta, 1e-6});
  gated_attention_backward({in.qg,   in.k,   in.v,  in.wq,    in.wk,    in.cu,    r.q_hat,
                            r.k_hat, r.attn, r.lse, r.q_rstd, r.k_rstd, in.dout,  r.dqg,
                            r.dk,    r.dv,   r.dwq, r.dwk,    in.rot,   in.theta, 1e-6});
  return r;
}

// Device copies of the inputs.
struct DevInputs {
  OwnedTensor qg, k, v, wq, wk, cu, dout;
};
DevInputs to_device(const Inputs& in) {
  auto b = [](const OwnedTensor& t) { return convert(t, DType::BF16, Device::CUDA); };
  return {b(in.qg),  b(in.k), b(in.v), b(in.wq), b(in.wk), convert(in.cu, DType::I32, Device::CUDA),
          b(in.dout)};
}

const char* const kImpls[] = {"cuda.flash", "cuda.sm90_tma"};
// The resolver's choice on Hopper: the highest priority (cuda.sm90_tma 39, cuda.flash 10).
constexpr const char* kPreferred = "cuda.sm90_tma";

// The function table of a registered CUDA implementation.
const GatedAttentionTable& table_of(const std::string& impl) {
  for (const ImplDesc* i : Registry::global().impls("gated_attention", Backend::Cuda))
    if (i->name == impl) return *static_cast<const GatedAttentionTable*>(i->table);
  throw std::runtime_error("gated_attention implementation " + impl + " is not registered");
}

// Forward and backward of implementation `impl` on the device; `=` outputs start poisoned, dw at
// dw0 (zeros by default).
Result run_cuda(const std::string& impl, const Inputs& in, const DevInputs& d,
                const Tensor* dwq0 = nullptr, const Tensor* dwk0 = nullptr) {
  const int64_t T = in.T(), Hq = in.Hq(), Hkv = in.Hkv(), hd = in.hd();
  const DType B = DType::BF16, F = DType::F32;
  Result r{poisoned(B, {T, Hq, hd}),
           poisoned(B, {T, Hq, hd}),
           poisoned(B, {T, Hkv, hd}),
           poisoned(B, {T, Hq, hd}),
           poisoned(F, {T, Hq}),
           poisoned(F, {T, Hq}),
           poisoned(F, {T, Hkv}),
           poisoned(B, {T, Hq, 2 * hd}),
           poisoned(B, {T, Hkv, hd}),
           poisoned(B, {T, Hkv, hd}),
           dwq0 ? convert(*dwq0, F, Device::CUDA) : OwnedTensor::zeros(F, {hd}, Device::CUDA),
           dwk0 ? convert(*dwk0, F, Device::CUDA) : OwnedTensor::zeros(F, {hd}, Device::CUDA)};
  const GatedAttentionTable& t = table_of(impl);
  t.forward({d.qg, d.k, d.v, d.wq, d.wk, d.cu, r.o, r.q_hat, r.k_hat, r.attn, r.lse, r.q_rstd,
             r.k_rstd, in.rot, in.theta, 1e-6});
  t.backward({d.qg,    d.k,    d.v,   d.wq,     d.wk,     d.cu,     r.q_hat,
              r.k_hat, r.attn, r.lse, r.q_rstd, r.k_rstd, d.dout,   r.dqg,
              r.dk,    r.dv,   r.dwq, r.dwk,    in.rot,   in.theta, 1e-6});
  device_synchronize(Device::CUDA);  // a kernel fault is reported here, inside this test
  return r;
}

// The query (part 0) or gate (part 1) half of a [T, H, 2·hd] tensor.
std::vector<double> half(const Tensor& t, int64_t part) {
  const int64_t rows = t.size(0) * t.size(1), hd = t.size(2) / 2;
  auto all = to_f64_vector(t);
  std::vector<double> out;
  out.reserve(static_cast<size_t>(rows * hd));
  for (int64_t i = 0; i < rows; ++i)
    out.insert(out.end(), all.begin() + (2 * i + part) * hd, all.begin() + (2 * i + part + 1) * hd);
  return out;
}

// Every output of `got` against ref; prints the worst errors.
void compare(const Result& got, const Result& want, const std::string& label) {
  struct Cmp {
    const OwnedTensor *g, *w;
    const char* what;
    bool bwd;
  };
  const Cmp cmps[] = {{&got.o, &want.o, "o", false},
                      {&got.q_hat, &want.q_hat, "q_hat", false},
                      {&got.k_hat, &want.k_hat, "k_hat", false},
                      {&got.attn, &want.attn, "attn", false},
                      {&got.lse, &want.lse, "lse", false},
                      {&got.q_rstd, &want.q_rstd, "q_rstd", false},
                      {&got.k_rstd, &want.k_rstd, "k_rstd", false},
                      {&got.dk, &want.dk, "dk", true},
                      {&got.dv, &want.dv, "dv", true},
                      {&got.dwq, &want.dwq, "dq_norm_w", true},
                      {&got.dwk, &want.dwk, "dk_norm_w", true}};
  double worst[2] = {0, 0};
  for (const Cmp& c : cmps) {
    testing::expect_close(*c.g, *c.w, c.bwd ? kTol.bwd : kTol.fwd, label + ": " + c.what);
    worst[c.bwd] = std::max(worst[c.bwd], testing::rel_err(*c.g, *c.w));
  }
  for (int64_t part : {0, 1}) {
    const double e = rel_l2_error(half(got.dqg, part), half(want.dqg, part));
    EXPECT_LE(e, kTol.bwd) << label << ": dqg " << (part ? "gate" : "query") << " half";
    worst[1] = std::max(worst[1], e);
  }
  std::printf("%s: worst relative L2 error cuda vs ref: forward %.3g, backward %.3g\n",
              label.c_str(), worst[0], worst[1]);
}

struct SweepCase {
  const char* name;
  std::vector<int32_t> lens;
  int64_t Hq, Hkv, hd;
  double factor, theta;
};
void PrintTo(const SweepCase& c, std::ostream* os) { *os << c.name; }

class GatedAttentionCudaSweep
    : public GatedAttentionCuda,
      public ::testing::WithParamInterface<std::tuple<const char*, SweepCase>> {};

TEST_P(GatedAttentionCudaSweep, MatchesRef) {
  const auto& [impl, c] = GetParam();
  Inputs in = make_inputs(c.lens, c.Hq, c.Hkv, c.hd, c.factor, c.theta, 11 * c.hd + c.Hq);
  Result ref = run_ref(in);
  Result got = run_cuda(impl, in, to_device(in));
  compare(got, ref, std::string(impl) + " " + c.name);
}

// "cuda.flash" -> "flash" (test names are identifiers).
std::string short_name(const char* impl) { return std::string(impl).substr(5); }

// Tiles: 128 queries (forward, dq), 64 keys / queries (dk/dv), 64 keys per forward step and per
// dq step (cuda.flash: 32 per dq step at hd 256).
const SweepCase kCases[] = {
    // One document, several query tiles, one partial; Qwen3.5's head dim, rotary factor, base.
    SweepCase{"OneDocHd256Gqa4", {300}, 4, 1, 256, 0.25, 1e7},
    // A longer document: 6 query tiles, up to 11 key steps (the pipelines' slots turn over).
    SweepCase{"LongDocHd256Gqa2", {700}, 2, 1, 256, 0.25, 1e7},
    // Two longer documents, a partial tile each, four query heads per kv head: dk/dv blocks walk
    // up to 4 x 18 items (lse / D fetched two items ahead, the Q / dA slots turn over often).
    SweepCase{"LongDocsHd256Gqa4", {1100, 333}, 4, 1, 256, 0.25, 1e7},
    // Documents of exactly one and two tiles, one past a tile boundary, grouped heads.
    SweepCase{"TileEdgesHd256Gqa2", {128, 129, 63}, 2, 1, 256, 0.25, 1e7},
    SweepCase{"ManyDocsHd256Gqa1", {65, 191, 2}, 2, 2, 256, 0.5, 1e4},
    // Many documents with 1-token ones between them.
    SweepCase{"ManyDocsHd128Gqa2", {1, 130, 64, 1, 7, 129}, 4, 2, 128, 0.5, 1e4},
    SweepCase{"Hd64Gqa1FullRope", {200, 1, 1, 70}, 2, 2, 64, 1.0, 1e4},
    SweepCase{"Hd64Gqa4", {1, 65, 3, 1, 130}, 4, 1, 64, 0.25, 1e4},
    // Padded head dims (96 -> 128, 16 and 8 -> 64), no RoPE, empty documents.
    SweepCase{"Hd96NoRopeEmptyDocs", {5, 0, 70, 0}, 2, 1, 96, 0.0, 1e4},
    SweepCase{"Hd16ProbeLike", {1, 70, 5, 1}, 4, 2, 16, 0.25, 1e4},
    SweepCase{"Hd8FullRope", {9, 3}, 2, 2, 8, 1.0, 1e4}};

INSTANTIATE_TEST_SUITE_P(Shapes, GatedAttentionCudaSweep,
                         ::testing::Combine(::testing::ValuesIn(kImpls),
                                            ::testing::ValuesIn(kCases)),
                         [](const auto& i) {
                           return short_name(std::get<0>(i.param)) + "_" +
                                  std::get<1>(i.param).name;
                         });

// Tests run once per implementation.
class GatedAttentionCudaImpl : public GatedAttentionCuda,
                               public ::testing::WithParamInterface<const char*> {};
INSTANTIATE_TEST_SUITE_P(Impls, GatedAttentionCudaImpl, ::testing::ValuesIn(kImpls),
                         [](const auto& i) { return short_name(i.param); });

// Rows [b, e) of a [T, ...] tensor as doubles.
std::vector<double> rows(const Tensor& t, int64_t b, int64_t e) {
  auto all = to_f64_vector(t);
  const int64_t per = t.numel() / std::max<int64_t>(t.size(0), 1);
  return {all.begin() + b * per, all.begin() + e * per};
}

// Document [b, e) of `in` as a batch of its own.
Inputs slice_doc(const Inputs& in, int64_t b, int64_t e) {
  auto cut = [&](const OwnedTensor& t) {
    std::vector<int64_t> shape = t.view().shape_vec();
    shape[0] = e - b;
    return from_f64(rows(t, b, e), DType::F64, shape);
  };
  return {cut(in.qg),
          cut(in.k),
          cut(in.v),
          convert(in.wq, DType::F64),
          convert(in.wk, DType::F64),
          testing::i32_tensor({0, static_cast<int32_t>(e - b)}),
          cut(in.dout),
          in.rot,
          in.theta};
}

// Tiles are aligned to each document's start and every row's arithmetic depends only on its own
// document, so a document gives the same bits packed or alone; only the norm-weight gradients are
// summed over a different partition of the tokens.
TEST_P(GatedAttentionCudaImpl, PackedBatchEqualsDocumentsRunAlone) {
  const char* impl = GetParam();
  const std::vector<int32_t> lens{140, 1, 70, 3, 64};
  const std::vector<int32_t> cu = offsets(lens);
  Inputs in = make_inputs(lens, 4, 2, 256, 0.25, 1e4, 21);
  Result packed = run_cuda(impl, in, to_device(in));
  std::vector<double> dwq(256, 0.0), dwk(256, 0.0);
  for (size_t n = 0; n < lens.size(); ++n) {
    Inputs one = slice_doc(in, cu[n], cu[n + 1]);
    Result alone = run_cuda(impl, one, to_device(one));
    const std::string doc = " of document " + std::to_string(n);
    for (auto [p, a, what] : {std::tuple{&packed.o, &alone.o, "o"},
                              {&packed.attn, &alone.attn, "attn"},
                              {&packed.lse, &alone.lse, "lse"},
                              {&packed.q_hat, &alone.q_hat, "q_hat"},
                              {&packed.k_hat, &alone.k_hat, "k_hat"},
                              {&packed.q_rstd, &alone.q_rstd, "q_rstd"},
                              {&packed.k_rstd, &alone.k_rstd, "k_rstd"},
                              {&packed.dqg, &alone.dqg, "dqg"},
                              {&packed.dk, &alone.dk, "dk"},
                              {&packed.dv, &alone.dv, "dv"}})
      EXPECT_EQ(rows(*p, cu[n], cu[n + 1]), to_f64_vector(*a)) << what << doc;
    auto aq = to_f64_vector(alone.dwq), ak = to_f64_vector(alone.dwk);
    for (int i = 0; i < 256; ++i) dwq[i] += aq[i], dwk[i] += ak[i];
  }
  EXPECT_LE(rel_l2_error(to_f64_vector(packed.dwq), dwq), 1e-5) << "dq_norm_w";
  EXPECT_LE(rel_l2_error(to_f64_vector(packed.dwk), dwk), 1e-5) << "dk_norm_w";
}

// No float atomics: the backward gives the same bits every time; dq_norm_w, dk_norm_w accumulate.
TEST_P(GatedAttentionCudaImpl, BackwardIsDeterministicAndAccumulatesNormWeightGrads) {
  const char* impl = GetParam();
  Inputs in = make_inputs({400, 37}, 4, 1, 256, 0.25, 1e7, 31);
  Result ref = run_ref(in);
  DevInputs d = to_device(in);
  OwnedTensor dwq0 = randn({256}, 35, 3.0), dwk0 = randn({256}, 36, 3.0);
  Result first = run_cuda(impl, in, d, &dwq0.view(), &dwk0.view());
  for (auto [got, base, add, what] : {std::tuple{&first.dwq, &dwq0, &ref.dwq, "dq_norm_w"},
                                      {&first.dwk, &dwk0, &ref.dwk, "dk_norm_w"}}) {
    auto g = to_f64_vector(*got), b = to_f64_vector(*base), a = to_f64_vector(*add);
    double num = 0, den = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const double want = static_cast<double>(static_cast<float>(b[i])) + a[i];
      num += (g[i] - want) * (g[i] - want);
      den += a[i] * a[i];
    }
    EXPECT_LE(std::sqrt(num / den), kTol.bwd) << what << " after += (relative to the added part)";
  }
  for (int rep = 0; rep < 2; ++rep) {
    Result again = run_cuda(impl, in, d, &dwq0.view(), &dwk0.view());
    for (auto [a, b, what] : {std::tuple{&again.o, &first.o, "o"},
                              {&again.lse, &first.lse, "lse"},
                              {&again.dqg, &first.dqg, "dqg"},
                              {&again.dk, &first.dk, "dk"},
                              {&again.dv, &first.dv, "dv"},
                              {&again.dwq, &first.dwq, "dq_norm_w"},
                              {&again.dwk, &first.dwk, "dk_norm_w"}})
      EXPECT_EQ(to_f64_vector(*a), to_f64_vector(*b)) << what << " differs between runs";
  }
}

// The TMA kernels' (cuda.sm90_tma: producer warpgroup, mbarriers) tiles past a document's end
// hold the next document's rows instead of zeros (a tensor map ends at T, not at the document),
// which the causal mask (keys) and lse = +inf (queries) must turn into exact zeros: every output,
// forward and backward, against ref, over documents that end inside a key tile, inside and at the
// end of a query tile, 1-token and empty ones, padded head dims (columns past hd zero-filled by
// the TMA unit) and the last rows of T. (The cp.async kernels they were checked against bit for
// bit, cuda.pipe_xi, are gone.)
TEST_F(GatedAttentionCuda, TmaTilesPastADocumentEndMatchRef) {
  struct Case {
    std::vector<int32_t> lens;
    int64_t Hq, Hkv, hd;
  };
  for (const Case& c :
       {Case{{1100, 333}, 4, 1, 256}, Case{{1, 130, 64, 1, 7, 129}, 4, 2, 128},
        Case{{65, 191, 2}, 2, 2, 256}, Case{{5, 0, 70, 0}, 2, 1, 96}, Case{{9, 3}, 2, 2, 8}}) {
    Inputs in = make_inputs(c.lens, c.Hq, c.Hkv, c.hd, 0.25, 1e4, 71 + c.hd);
    DevInputs d = to_device(in);
    const Result ref = run_ref(in);
    const Result a = run_cuda("cuda.sm90_tma", in, d);
    compare(a, ref, "cuda.sm90_tma, hd " + std::to_string(c.hd) + ", T " + std::to_string(in.T()));
  }
}

// Documents of one token: softmax over one key, so attn = v, o = v ⊙ σ(gate), and q and k get no
// gradient (ref: exactly 0; cuda: rounding noise of dP − D, tiny against the other gradients).
TEST_P(GatedAttentionCudaImpl, OneTokenDocuments) {
  const char* impl = GetParam();
  Inputs in = make_inputs({1, 1, 1}, 4, 2, 128, 0.25, 1e4, 41);
  Result ref = run_ref(in);
  Result got = run_cuda(impl, in, to_device(in));
  for (auto [g, w, what] : {std::tuple{&got.o, &ref.o, "o"},
                            {&got.attn, &ref.attn, "attn"},
                            {&got.lse, &ref.lse, "lse"},
                            {&got.q_hat, &ref.q_hat, "q_hat"},
                            {&got.k_hat, &ref.k_hat, "k_hat"},
                            {&got.dv, &ref.dv, "dv"}})
    testing::expect_close(*g, *w, kTol.fwd, what);
  EXPECT_LE(rel_l2_error(half(got.dqg, 1), half(ref.dqg, 1)), kTol.bwd) << "dqg gate half";
  const double scale = testing::l2(ref.dv);  // what dq, dk would be built from
  auto l2v = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x * x;
    return std::sqrt(s);
  };
  EXPECT_LE(l2v(half(got.dqg, 0)), 1e-3 * scale) << "dqg query half of 1-token documents";
  EXPECT_LE(testing::l2(got.dk), 1e-3 * scale) << "dk of 1-token documents";
  EXPECT_LE(testing::l2(got.dwq) + testing::l2(got.dwk), 1e-3 * scale) << "norm-weight grads";
}

// cu_seqlens on the device is not validated (op.h): inconsistent offsets give unspecified values
// but must never make a kernel fault (every document is clamped into [0, T]).
TEST_P(GatedAttentionCudaImpl, InconsistentDeviceOffsetsDoNotFault) {
  const char* impl = GetParam();
  Inputs in = make_inputs({150, 50}, 2, 1, 64, 0.25, 1e4, 51);
  DevInputs d = to_device(in);
  for (const std::vector<int32_t>& bad :
       {std::vector<int32_t>{0, 300, 120, 200}, {-50, 30, 9999}, {5, 3, 180, 2}, {0, 0, 0, 0}}) {
    d.cu = convert(testing::i32_tensor(bad), DType::I32, Device::CUDA);
    Result r;
    EXPECT_NO_THROW({
      r = run_cuda(impl, in, d);
      device_synchronize(Device::CUDA);
    });
  }
}

// The resolver prefers the highest priority (kPreferred); every implementation passes the probe.
TEST_F(GatedAttentionCuda, ResolverChoosesSm90TmaAndAllPassTheProbe) {
  const OpQuery q{Backend::Cuda, "", {{"hd", 256}, {"Hq", 16}, {"Hkv", 4}}};
  const Resolution& r = Registry::global().resolve("gated_attention", q);
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, kPreferred) << (r.rejected.empty() ? "" : r.rejected.front());
  EXPECT_EQ(r.impl->backend, Backend::Cuda);
  EXPECT_TRUE(r.rejected.empty()) << r.rejected.front();
  const OpDesc& op = Registry::global().op("gated_attention");
  for (const char* name : kImpls) {
    const ImplDesc* impl = nullptr;
    for (const ImplDesc* i : Registry::global().impls("gated_attention", Backend::Cuda))
      if (i->name == name) impl = i;
    ASSERT_NE(impl, nullptr) << name << " is not registered";
    ASSERT_TRUE(impl->supports);
    EXPECT_EQ(impl->supports(q), "") << name;
    EXPECT_EQ(impl->supports(OpQuery{Backend::Cuda, "", {{"hd", 96}}}), "") << name;
    EXPECT_NE(impl->supports(OpQuery{Backend::Cuda, "", {{"hd", 12}}}).find("head dim 12"),
              std::string::npos)
        << name;
    EXPECT_NE(impl->supports(OpQuery{Backend::Cuda, "", {{"hd", 512}}}), "") << name;
    const ProbeError e = op.probe(*impl, q);
    std::printf("gated_attention probe (%s): fwd %.3g, bwd %.3g\n", name, e.fwd, e.bwd);
    EXPECT_LE(e.fwd, kTol.fwd) << name;
    EXPECT_LE(e.bwd, kTol.bwd) << name;
    EXPECT_GT(e.fwd, 0.0) << name;  // bf16 outputs: a zero error would mean nothing was compared
    EXPECT_GT(e.bwd, 0.0) << name;
  }
}

// Deliberately wrong CUDA implementations, built from the real one.
const GatedAttentionTable* real_table() {
  for (const ImplDesc* i : Registry::global().impls("gated_attention", Backend::Cuda))
    if (i->name == "cuda.flash") return static_cast<const GatedAttentionTable*>(i->table);
  return nullptr;
}
void real_forward(const GatedAttentionFwd& a) { real_table()->forward(a); }
void real_backward(const GatedAttentionBwd& a) { real_table()->backward(a); }
// Forward forgets the output gate (o = attn).
void ungated_forward(const GatedAttentionFwd& a) {
  real_table()->forward(a);
  copy_into(a.o, a.attn);
}
// Backward drops the key gradient's path through the attention (dk = 0).
void no_dk_backward(const GatedAttentionBwd& a) {
  real_table()->backward(a);
  OwnedTensor zero = OwnedTensor::zeros(DType::BF16, a.dk.shape(), Device::CUDA);
  copy_into(a.dk, zero);
  device_synchronize(Device::CUDA);  // zero is freed on return
}
const GatedAttentionTable kUngated{ungated_forward, real_backward};
const GatedAttentionTable kNoDk{real_forward, no_dk_backward};

TEST_F(GatedAttentionCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << "cuda.flash is not registered";
  Registry reg;  // private: the global registry is untouched
  reg.add_op(Registry::global().op("gated_attention"));
  reg.add_impl(Registry::global().ref("gated_attention"));
  for (const ImplDesc* i : Registry::global().impls("gated_attention", Backend::Cuda))
    reg.add_impl(*i);
  reg.add_impl({"gated_attention", "cuda.ungated", Backend::Cuda, 40, nullptr, &kUngated});
  reg.add_impl({"gated_attention", "cuda.no_dk", Backend::Cuda, 50, nullptr, &kNoDk});
  const Resolution& r = reg.resolve("gated_attention", OpQuery{Backend::Cuda, "", {}});
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, kPreferred);
  ASSERT_EQ(r.rejected.size(), 2u);
  EXPECT_NE(r.rejected[0].find("rejecting cuda.no_dk: probe error"), std::string::npos)
      << r.rejected[0];
  EXPECT_NE(r.rejected[1].find("rejecting cuda.ungated: probe error"), std::string::npos)
      << r.rejected[1];
}

TEST_F(GatedAttentionCuda, OpsRunOnCudaBackend) {
  Inputs in = make_inputs({5, 1, 40}, 2, 1, 64, 0.5, 500.0, 61);
  Result ref = run_ref(in);
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("gdn_gated_attention_cuda_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string inp = (dir / "in.safetensors").string(),
                    out = (dir / "out.safetensors").string();
  auto f32 = [](const OwnedTensor& t) { return convert(t, DType::F32); };
  OwnedTensor qg = f32(in.qg), k = f32(in.k), v = f32(in.v), wq = f32(in.wq), wk = f32(in.wk),
              dout = f32(in.dout);
  write_safetensors(inp, {{"qg", qg.view(), {}, {}, nullptr, 0},
                          {"k", k.view(), {}, {}, nullptr, 0},
                          {"v", v.view(), {}, {}, nullptr, 0},
                          {"q_norm_w", wq.view(), {}, {}, nullptr, 0},
                          {"k_norm_w", wk.view(), {}, {}, nullptr, 0},
                          {"cu_seqlens", in.cu.view(), {}, {}, nullptr, 0},
                          {"do", dout.view(), {}, {}, nullptr, 0}});
  OpRunResult res = run_op_file("gated_attention", Backend::Cuda, inp, out, true,
                                {{"partial_rotary_factor", 0.5}, {"rope_theta", 500.0}});
  EXPECT_EQ(res.impl, kPreferred);
  SafeTensorsFile f(out);
  for (auto [name, want, tol] : {std::tuple{"o", &ref.o, kTol.fwd},
                                 {"lse", &ref.lse, kTol.fwd},
                                 {"dqg", &ref.dqg, kTol.bwd},
                                 {"dk", &ref.dk, kTol.bwd},
                                 {"dv", &ref.dv, kTol.bwd},
                                 {"dq_norm_w", &ref.dwq, kTol.bwd},
                                 {"dk_norm_w", &ref.dwk, kTol.bwd}})
    testing::expect_close(f.load(name, DType::F64), *want, tol, std::string(name) + " (ops run)");
  fs::remove_all(dir);
}

using testing::expect_error;

TEST_F(GatedAttentionCuda, BadInputIsAClearError) {
  // Resolve for a supported head dim first, so the calls below reach the cuda implementation.
  Registry::global().resolve("gated_attention", OpQuery{Backend::Cuda, "", {{"hd", 64}}});
  const int64_t T = 6, Hq = 2, Hkv = 1;
  auto z = [](std::initializer_list<int64_t> s, DType dt = DType::BF16) {
    return OwnedTensor::zeros(dt, s, Device::CUDA);
  };
  OwnedTensor cu = convert(testing::i32_tensor({0, 4, 6}), DType::I32, Device::CUDA);
  {  // hd = 12: even (the op's rule) but not a multiple of 8 (the kernels' rows are 16-byte)
    const int64_t hd = 12;
    OwnedTensor qg = z({T, Hq, 2 * hd}), k = z({T, Hkv, hd}), v = z({T, Hkv, hd}), wq = z({hd}),
                wk = z({hd}), o = z({T, Hq, hd}), qh = z({T, Hq, hd}), kh = z({T, Hkv, hd}),
                at = z({T, Hq, hd}), lse = z({T, Hq}, DType::F32), qr = z({T, Hq}, DType::F32),
                kr = z({T, Hkv}, DType::F32);
    expect_error(
        [&] {
          gated_attention_forward({qg, k, v, wq, wk, cu, o, qh, kh, at, lse, qr, kr, 4, 1e4, 1e-6});
        },
        "head dim 12 is not a multiple of 8 in [8, 256]");
  }
  {  // k starting 2 bytes past a 16-byte boundary
    const int64_t hd = 64;
    OwnedTensor qg = z({T, Hq, 2 * hd}), kbuf = z({T * Hkv * hd + 8}), v = z({T, Hkv, hd}),
                wq = z({hd}), wk = z({hd}), o = z({T, Hq, hd}), qh = z({T, Hq, hd}),
                kh = z({T, Hkv, hd}), at = z({T, Hq, hd}), lse = z({T, Hq}, DType::F32),
                qr = z({T, Hq}, DType::F32), kr = z({T, Hkv}, DType::F32);
    Tensor k(static_cast<char*>(kbuf.view().data()) + 2, DType::BF16, {T, Hkv, hd}, Device::CUDA);
    expect_error(
        [&] {
          gated_attention_forward(
              {qg, k, v, wq, wk, cu, o, qh, kh, at, lse, qr, kr, 16, 1e4, 1e-6});
        },
        "gated_attention (cuda): tensor 'k' must start on a 16-byte boundary");
  }
}

}  // namespace
}  // namespace gdn::ops
