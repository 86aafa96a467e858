// Embedding on CUDA (label gpu), every registered cuda implementation (cuda.sorted_windows and
// cuda.ranked_windows): cuda vs ref over swept shapes, both id dtypes and id
// distributions that exercise every case of the sorted-window backwards (all ids distinct, a few
// ids repeated everywhere, one id over all tokens, runs of lengths around the window sizes, the
// 248320-token vocabulary, sequences past each implementation's single-kernel sort), an exact-copy
// forward, dW accumulated (+=) and bitwise deterministic, out-of-range device ids (NaN rows
// forward, dropped backward, no out-of-bounds access) also at window boundaries, the scalar path,
// each implementation's probe, the resolver's choice, `ops run` on the cuda backend, and bad input.
// Every check also runs the forward with a plan and the backward from it (twice): the same bits.
// Tolerances come from src/backend/tolerances.h.
#include <cmath>
#include <limits>

#include "backend/tolerances.h"
#include "gdn/core/rng.h"
#include "ops/cuda_test_util.h"
#include "ops/embedding/op.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("embedding");

class EmbeddingCuda : public CudaOpTest {};

// Every cuda implementation, called through its table (the sweep checks each one, not only the
// resolver's choice). kChosen is the one the resolver picks.
const std::vector<std::string> kImpls = {"cuda.sorted_windows", "cuda.ranked_windows"};
const std::string kChosen = "cuda.ranked_windows";

const EmbeddingTable& table_of(const std::string& impl) {
  const EmbeddingTable* t = cuda_table<EmbeddingTable>("embedding", impl);
  if (t == nullptr) throw std::runtime_error("embedding implementation " + impl + " is missing");
  return *t;
}

enum class Ids { Uniform, Few, Same, Runs };
const char* ids_name(Ids p) {
  return p == Ids::Uniform ? "uniform" : p == Ids::Few ? "few" : p == Ids::Same ? "same" : "runs";
}

// Host ids of `dt`: Uniform over [0, V); Few: 3 ids in random order; Same: V - 1 everywhere;
// Runs: consecutive runs of lengths 1, 2, ..., 70, 1, ... of random ids (runs of one id may
// repeat later, so segments are split across distant windows too).
OwnedTensor make_ids(int64_t T, int64_t V, Ids pattern, DType dt, uint64_t seed) {
  std::vector<int64_t> v(static_cast<size_t>(T));
  int64_t run_left = 0, run_len = 0, run_id = 0;
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t r = rng::bits(seed, 5, static_cast<uint64_t>(t));
    int64_t id = 0;
    switch (pattern) {
      case Ids::Uniform:
        id = static_cast<int64_t>(r % static_cast<uint64_t>(V));
        break;
      case Ids::Few:
        id = static_cast<int64_t>(r % 3) * (V / 3);
        break;
      case Ids::Same:
        id = V - 1;
        break;
      case Ids::Runs:
        if (run_left == 0) {
          run_len = run_len % 70 + 1;
          run_left = run_len;
          run_id = static_cast<int64_t>(r % static_cast<uint64_t>(std::min<int64_t>(V, 5)));
        }
        --run_left;
        id = run_id;
        break;
    }
    v[static_cast<size_t>(t)] = id;
  }
  OwnedTensor ids = OwnedTensor::empty(dt, {T});
  for (int64_t t = 0; t < T; ++t) {
    if (dt == DType::I32) {
      ids.ptr<int32_t>()[t] = static_cast<int32_t>(v[static_cast<size_t>(t)]);
    } else {
      ids.ptr<int64_t>()[t] = v[static_cast<size_t>(t)];
    }
  }
  return ids;
}

struct Out {
  OwnedTensor y, dw;
};

Out run_ref(const Tensor& ids, const Tensor& w, const Tensor& dy, const Tensor& dw0) {
  Out o{OwnedTensor::zeros(DType::F64, {ids.size(0), w.size(1)}), convert(dw0, DType::F64)};
  embedding_forward({ids, w, o.y});
  embedding_backward({ids, dy, o.dw});
  return o;
}

// A device plan (op.h) whose every word holds 0x7f7f7f7f: the forward must write what its
// backward reads (the counters too).
OwnedTensor poisoned_plan(int64_t T, int64_t D) {
  const int64_t n = embedding_plan_numel(T, D);
  OwnedTensor h = OwnedTensor::empty(DType::I32, {n});
  for (int64_t i = 0; i < n; ++i) h.ptr<int32_t>()[i] = 0x7f7f7f7f;
  return convert(h, DType::I32, Device::CUDA);
}

// The forward and backward of `impl`, then the same with a plan, which must give the same bits:
// y, dW after one backward, and dW after a second backward from the same plan (so the first left
// the plan's counters as it found them).
Out run_cuda(const std::string& impl, const Tensor& ids, const Tensor& w, const Tensor& dy,
             const Tensor& dw0) {
  Out o{poisoned(DType::BF16, {ids.size(0), w.size(1)}), to_dev(dw0, DType::F32)};
  const EmbeddingTable& t = table_of(impl);
  t.forward({ids, w, o.y});
  t.backward({ids, dy, o.dw});

  const int64_t T = ids.size(0), D = w.size(1);
  OwnedTensor plan = poisoned_plan(T, D);
  OwnedTensor y = poisoned(DType::BF16, {T, D});
  t.forward({ids, w, y, plan});
  expect_bitwise_equal(y, o.y, impl + " y with a plan");
  for (int rep = 0; rep < 2; ++rep) {
    OwnedTensor dw = to_dev(dw0, DType::F32);
    t.backward({ids, dy, dw, plan});
    expect_bitwise_equal(dw, o.dw, impl + " dw from the plan, backward " + std::to_string(rep));
  }
  return o;
}

// ref and every cuda implementation from the same host values (w, dy bf16; dw0 fp32, nonzero: +=
// is checked).
void check_ids(const OwnedTensor& ids, int64_t V, int64_t D, uint64_t seed) {
  const int64_t T = ids.view().size(0);
  OwnedTensor w = randn_as({V, D}, seed + 1, DType::BF16);
  OwnedTensor dy = randn_as({T, D}, seed + 2, DType::BF16);
  OwnedTensor dw0 = randn_as({V, D}, seed + 3, DType::F32);
  Out ref = run_ref(ids, w, dy, dw0);
  OwnedTensor idd = convert(ids, ids.view().dtype(), Device::CUDA);
  OwnedTensor wd = to_dev(w, DType::BF16), dyd = to_dev(dy, DType::BF16);
  for (const std::string& impl : kImpls) {
    SCOPED_TRACE(impl);
    Out c = run_cuda(impl, idd, wd, dyd, dw0);
    expect_close(c.y, ref.y, kTol.fwd, impl + " y");
    expect_close(c.dw, ref.dw, kTol.bwd, impl + " dw");
  }
}

void check(int64_t T, int64_t V, int64_t D, Ids pattern, DType idt, uint64_t seed) {
  check_ids(make_ids(T, V, pattern, idt, seed), V, D, seed);
}

using Param = std::tuple<int64_t, int64_t, int64_t, Ids, DType>;
class EmbeddingCudaSweep : public EmbeddingCuda, public ::testing::WithParamInterface<Param> {};

TEST_P(EmbeddingCudaSweep, MatchesRef) {
  auto [T, V, D, pattern, idt] = GetParam();
  check(T, V, D, pattern, idt, 100 + static_cast<uint64_t>(T * 31 + V * 7 + D));
}

std::string case_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& p = info.param;
  return "T" + std::to_string(std::get<0>(p)) + "_V" + std::to_string(std::get<1>(p)) + "_D" +
         std::to_string(std::get<2>(p)) + "_" + ids_name(std::get<3>(p)) + "_" +
         std::string(dtype_name(std::get<4>(p)));
}

// T: one token, less than / exactly / just over one 32-position window (8- and 16-position windows
// too: 31, 32, 33 cross them), many windows. D: the scalar paths (1, 17) and the vector ones (64).
INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingCudaSweep,
                         ::testing::Combine(::testing::Values(1, 31, 32, 33, 300, 2000),
                                            ::testing::Values(1, 7, 1000),
                                            ::testing::Values(1, 17, 64),
                                            ::testing::Values(Ids::Uniform, Ids::Few, Ids::Runs),
                                            ::testing::Values(DType::I32)),
                         case_name);
INSTANTIATE_TEST_SUITE_P(IdsI64, EmbeddingCudaSweep,
                         ::testing::Combine(::testing::Values(33, 2000), ::testing::Values(7, 1000),
                                            ::testing::Values(17, 64),
                                            ::testing::Values(Ids::Uniform, Ids::Few, Ids::Runs),
                                            ::testing::Values(DType::I64)),
                         case_name);

TEST_F(EmbeddingCuda, WideRowsSpanSeveralColumnChunks) {
  // A backward block covers 1024 columns with vector accesses, a forward block 4096: D = 4096 + 8
  // gives both a partial last chunk (and cuda.ranked_windows a thread whose second column group is
  // outside).
  check(300, 100, 4104, Ids::Runs, DType::I32, 6);
  check(70, 100, 4104, Ids::Uniform, DType::I64, 5);
  check(40, 100, 1540, Ids::Few, DType::I32, 4);
}

TEST_F(EmbeddingCuda, OneIdOverEveryToken) {
  // One segment over 157 windows of 32 (625 of 8): the combine sums the owner's tail and every
  // later window's head, in window order.
  check(5000, 50, 256, Ids::Same, DType::I32, 7);
  check(33, 50, 8, Ids::Same, DType::I64, 8);
  check(17, 50, 12, Ids::Same, DType::I32, 9);
}

TEST_F(EmbeddingCuda, ModelVocabulary) {
  // V = 248320 needs 18 sorted bits; D small to keep the host reference cheap.
  check(8192, 248320, 8, Ids::Uniform, DType::I32, 9);
  check(8192, 248320, 8, Ids::Runs, DType::I64, 10);
}

TEST_F(EmbeddingCuda, LongSequencesTakeTheDeviceWideSort) {
  // cuda.sorted_windows sorts in one block up to 8192 tokens, cuda.ranked_windows ranks in one
  // kernel up to
  // 16384; past that both take the device-wide radix sort, with the same order (stable, same
  // keys).
  check(8193, 248320, 8, Ids::Uniform, DType::I32, 11);
  check(12000, 1000, 8, Ids::Runs, DType::I64, 12);
  check(9000, 7, 16, Ids::Few, DType::I32, 13);
  check(16384, 248320, 4, Ids::Runs, DType::I32, 14);
  check(16385, 248320, 4, Ids::Uniform, DType::I32, 15);
  check(20000, 3, 8, Ids::Few, DType::I64, 16);
}

TEST_F(EmbeddingCuda, SkewedIdsLikeText) {
  // id = V * u^4 (the benchmark's skewed case): a few ids over hundreds of tokens, spanning many
  // windows, next to ids seen once; the rank kernel's buckets of the small ids are crowded.
  const int64_t T = 4000, V = 248320, D = 8;
  OwnedTensor ids = OwnedTensor::empty(DType::I32, {T});
  for (int64_t t = 0; t < T; ++t) {
    const double u =
        static_cast<double>(rng::bits(31, 5, static_cast<uint64_t>(t)) >> 11) * 0x1p-53;
    ids.ptr<int32_t>()[t] = static_cast<int32_t>(
        std::min<double>(V - 1, std::floor(static_cast<double>(V) * u * u * u * u)));
  }
  check_ids(ids, V, D, 32);
}

TEST_F(EmbeddingCuda, BackwardIsBitwiseDeterministic) {
  // Few ids (long segments over many windows, combined by whichever block arrives last) and
  // uniform ids (mostly single tokens), D = 520 (vector path) and 1037 (scalar path).
  for (auto [pattern, D] :
       {std::pair{Ids::Few, int64_t{520}}, std::pair{Ids::Uniform, int64_t{1037}}}) {
    const int64_t T = 3000, V = pattern == Ids::Few ? 50 : 400;
    OwnedTensor ids = convert(make_ids(T, V, pattern, DType::I32, 11), DType::I32, Device::CUDA);
    OwnedTensor dy = to_dev(randn_as({T, D}, 12, DType::BF16, 10.0), DType::BF16);
    OwnedTensor dw0 = randn_as({V, D}, 13, DType::F32);
    for (const std::string& impl : kImpls) {
      const EmbeddingTable& t = table_of(impl);
      OwnedTensor first = to_dev(dw0, DType::F32);
      t.backward({ids, dy, first});
      for (int rep = 0; rep < 3; ++rep) {
        OwnedTensor dw = to_dev(dw0, DType::F32);
        t.backward({ids, dy, dw});
        expect_bitwise_equal(
            dw, first, impl + " dw (" + ids_name(pattern) + ", rep " + std::to_string(rep) + ")");
      }
    }
  }
}

// Every implementation on host ids that hold out-of-range values: NaN rows forward, no gradient
// for those tokens backward, everything else as ref on the valid tokens.
void check_out_of_range(const OwnedTensor& ids, int64_t V, int64_t D) {
  const int64_t T = ids.view().size(0);
  const DType idt = ids.view().dtype();
  std::vector<int64_t> bad_pos;
  OwnedTensor ids_ok = convert(ids, DType::I64);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = ids_ok.ptr<int64_t>()[t];
    if (id < 0 || id >= V) {
      bad_pos.push_back(t);
      ids_ok.ptr<int64_t>()[t] = 0;
    }
  }
  ASSERT_FALSE(bad_pos.empty());
  OwnedTensor w = randn_as({V, D}, 15, DType::BF16), dy = randn_as({T, D}, 16, DType::BF16);
  OwnedTensor dw0 = randn_as({V, D}, 17, DType::F32);
  // Reference: the valid tokens only (bad ones have zero dy; their y rows are checked apart).
  std::vector<double> dyv = to_f64_vector(dy);
  for (int64_t p : bad_pos)
    for (int64_t j = 0; j < D; ++j) dyv[static_cast<size_t>(p * D + j)] = 0.0;
  Out ref = run_ref(ids_ok, w, from_f64(dyv, DType::F64, {T, D}), dw0);
  auto ry = to_f64_vector(ref.y);
  for (int64_t p : bad_pos)
    for (int64_t j = 0; j < D; ++j) ry[static_cast<size_t>(p * D + j)] = 0.0;
  for (const std::string& impl : kImpls) {
    SCOPED_TRACE(impl);
    Out c = run_cuda(impl, convert(ids, idt, Device::CUDA), to_dev(w, DType::BF16),
                     to_dev(dy, DType::BF16), dw0);
    std::vector<double> yv = to_f64_vector(c.y);
    for (int64_t p : bad_pos) {
      for (int64_t j = 0; j < D; ++j) {
        EXPECT_TRUE(std::isnan(yv[static_cast<size_t>(p * D + j)]))
            << impl << ": y[" << p << ", " << j << "] for an out-of-range id should be NaN";
        yv[static_cast<size_t>(p * D + j)] = 0.0;
      }
    }
    EXPECT_EQ(rel_l2_error(yv, ry), 0.0) << impl << ": rows of valid ids are exact copies";
    expect_close(c.dw, ref.dw, kTol.bwd, impl + " dw with out-of-range ids dropped");
  }
}

TEST_F(EmbeddingCuda, OutOfRangeDeviceIdsGiveNanRowsAndNoGradient) {
  const int64_t T = 70, V = 40, D = 24;
  for (DType idt : {DType::I32, DType::I64}) {
    OwnedTensor ids = make_ids(T, V, Ids::Uniform, idt, 14);
    std::vector<int64_t> bad_pos = {0, 5, 31, 32, 69};
    std::vector<int64_t> bad_val = {-1, V, V + 5, std::numeric_limits<int32_t>::max(),
                                    std::numeric_limits<int32_t>::min()};
    if (idt == DType::I64) bad_val[3] = int64_t{1} << 40;
    for (size_t k = 0; k < bad_pos.size(); ++k) {
      if (idt == DType::I32) {
        ids.ptr<int32_t>()[bad_pos[k]] = static_cast<int32_t>(bad_val[k]);
      } else {
        ids.ptr<int64_t>()[bad_pos[k]] = bad_val[k];
      }
    }
    check_out_of_range(ids, V, D);
  }
}

TEST_F(EmbeddingCuda, OutOfRangeIdsFillWholeWindows) {
  // Sorted last, invalid ids fill the last windows and share windows with valid segments that
  // span window boundaries: 40 of 100 tokens invalid, the valid ones 3 ids (long segments).
  const int64_t T = 100, V = 3, D = 8;
  OwnedTensor ids = make_ids(T, V, Ids::Few, DType::I32, 19);
  for (int64_t t = 0; t < T; t += 5) ids.ptr<int32_t>()[t] = t % 2 ? -7 : 3;
  for (int64_t t = 1; t < T; t += 5) ids.ptr<int32_t>()[t] = 1000;
  check_out_of_range(ids, V, D);
}

TEST_F(EmbeddingCuda, UnalignedTensorsTakeTheScalarPath) {
  const int64_t T = 100, V = 30, D = 64;
  OwnedTensor ids = make_ids(T, V, Ids::Runs, DType::I32, 18);
  OwnedTensor w = randn_as({V, D}, 19, DType::BF16), dy = randn_as({T, D}, 20, DType::BF16);
  OwnedTensor dw0 = randn_as({V, D}, 21, DType::F32);
  Out ref = run_ref(ids, w, dy, dw0);
  std::vector<OwnedTensor> keep;
  OwnedTensor wd = to_dev(w, DType::BF16), dyd = to_dev(dy, DType::BF16),
              dwd = to_dev(dw0, DType::F32);
  Tensor wu = unaligned_copy(wd, 2, keep), dyu = unaligned_copy(dyd, 2, keep),
         dwu = unaligned_copy(dwd, 4, keep);
  Tensor yu = unaligned_copy(poisoned(DType::BF16, {T, D}), 2, keep);
  OwnedTensor idd = convert(ids, DType::I32, Device::CUDA);
  for (const std::string& impl : kImpls) {
    copy_into(dwu, dw0);
    const EmbeddingTable& t = table_of(impl);
    t.forward({idd, wu, yu});
    t.backward({idd, dyu, dwu});
    expect_close(yu, ref.y, kTol.fwd, impl + " y (unaligned)");
    expect_close(dwu, ref.dw, kTol.bwd, impl + " dw (unaligned)");
  }
}

TEST_F(EmbeddingCuda, OddWidthAlignedTakesTheScalarPath) {
  // D % 4 != 0 with aligned pointers: cuda.ranked_windows' scalar path over several column chunks
  // (256 columns each) with a partial last one.
  check(77, 20, 601, Ids::Runs, DType::I32, 23);
}

TEST_F(EmbeddingCuda, EveryImplementationPassesItsProbe) {
  const OpDesc& op = Registry::global().op("embedding");
  for (const std::string& impl : kImpls) {
    const ImplDesc* desc = nullptr;
    for (const ImplDesc* i : Registry::global().impls("embedding", Backend::Cuda))
      if (i->name == impl) desc = i;
    ASSERT_NE(desc, nullptr) << impl;
    const ProbeError e = op.probe(*desc, OpQuery{Backend::Cuda, "", {}});
    EXPECT_LE(e.fwd, kTol.fwd) << impl << " probe forward error";
    EXPECT_LE(e.bwd, kTol.bwd) << impl << " probe backward error";
  }
}

TEST_F(EmbeddingCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  // The forward is an exact copy (error 0); dW is fp32 (its error may be 0 too).
  expect_resolves_to_cuda("embedding", kChosen, kTol, false, false);
}

// Deliberately wrong CUDA implementations built from the chosen one: every id shifted by one
// row, and a backward that overwrites dW with the sums instead of accumulating into it.
const EmbeddingTable* real_table() { return cuda_table<EmbeddingTable>("embedding", kChosen); }
void real_forward(const EmbeddingFwd& a) { real_table()->forward(a); }
void real_backward(const EmbeddingBwd& a) { real_table()->backward(a); }
void shifted_forward(const EmbeddingFwd& a) {
  OwnedTensor host = convert(a.ids, DType::I64);
  const int64_t V = a.w.size(0);
  for (int64_t t = 0; t < host.numel(); ++t)
    host.ptr<int64_t>()[t] = (host.ptr<int64_t>()[t] + 1) % V;
  OwnedTensor ids = convert(host, a.ids.dtype(), Device::CUDA);
  EmbeddingFwd b = a;
  b.ids = ids;
  real_table()->forward(b);
  device_synchronize(Device::CUDA);  // ids is freed on return
}
void overwriting_backward(const EmbeddingBwd& a) {
  OwnedTensor sums = OwnedTensor::zeros(DType::F32, a.dw.shape(), Device::CUDA);
  EmbeddingBwd b = a;
  b.dw = sums;
  real_table()->backward(b);
  copy_into(a.dw, sums);
}
const EmbeddingTable kWrongFwd{shifted_forward, real_backward};
const EmbeddingTable kWrongBwd{real_forward, overwriting_backward};

TEST_F(EmbeddingCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << kChosen << " is not registered";
  expect_probe_rejects("embedding", kChosen,
                       {{"cuda.wrong_rows", &kWrongFwd}, {"cuda.wrong_dw", &kWrongBwd}});
}

TEST_F(EmbeddingCuda, OpsRunOnCudaBackend) {
  const int64_t T = 45, V = 9, D = 16;
  OwnedTensor ids = make_ids(T, V, Ids::Few, DType::I64, 22);
  OwnedTensor w = randn_as({V, D}, 23, DType::BF16), dy = randn_as({T, D}, 24, DType::BF16);
  Out ref = run_ref(ids, w, dy, OwnedTensor::zeros(DType::F64, {V, D}));
  OwnedTensor wf = convert(w, DType::F32), dyf = convert(dy, DType::F32);
  OpsRunOnCuda run("embedding", {{"ids", ids}, {"w", wf}, {"dy", dyf}}, true);
  EXPECT_EQ(run.result().impl, kChosen);
  expect_close(run.load("y"), ref.y, kTol.fwd, "y (ops run)");
  expect_close(run.load("dw"), ref.dw, kTol.bwd, "dw (ops run)");
}

TEST_F(EmbeddingCuda, BadInputIsAClearError) {
  auto ids = OwnedTensor::zeros(DType::I32, {3}, Device::CUDA);
  auto dy = OwnedTensor::zeros(DType::BF16, {3, 4}, Device::CUDA);
  auto dw16 = OwnedTensor::zeros(DType::BF16, {10, 4}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              embedding_backward({ids, dy, dw16});
            }).find("embedding: tensor 'dw' has dtype BF16, expected F32"),
            std::string::npos);
  auto w = OwnedTensor::zeros(DType::BF16, {10, 4}, Device::CUDA);
  auto y = OwnedTensor::zeros(DType::BF16, {3, 4}, Device::CUDA);
  auto ids_host = OwnedTensor::zeros(DType::I32, {3});
  EXPECT_NE(error_of([&] {
              embedding_forward({ids_host, w, y});
            }).find("embedding: all tensors must be on cuda"),
            std::string::npos);
  // A plan of the wrong size, dtype or device.
  auto plan_short = OwnedTensor::zeros(DType::I32, {embedding_plan_numel(3, 4) - 1}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              embedding_forward({ids, w, y, plan_short});
            }).find("embedding: tensor 'plan' has shape"),
            std::string::npos);
  auto plan_f32 = OwnedTensor::zeros(DType::F32, {embedding_plan_numel(3, 4)}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              embedding_backward(
                  {ids, dy, OwnedTensor::zeros(DType::F32, {10, 4}, Device::CUDA), plan_f32});
            }).find("embedding: tensor 'plan' has dtype F32, expected I32"),
            std::string::npos);
  auto plan_host = OwnedTensor::zeros(DType::I32, {embedding_plan_numel(3, 4)});
  EXPECT_NE(error_of([&] {
              embedding_forward({ids, w, y, plan_host});
            }).find("embedding: tensor 'plan'"),
            std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
