// Embedding: cpu vs ref over swept shapes and both id dtypes, bitwise determinism of the backward
// (run to run and across thread counts), finite differences of ref, out-of-range ids and other
// bad input, the probe and `ops run`.
#include <omp.h>

#include <cstring>

#include "ops/dense_test_util.h"
#include "ops/embedding/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

OwnedTensor make_ids(int64_t T, int64_t V, uint64_t seed, DType dt) {
  auto ids = OwnedTensor::empty(dt, {T});
  for (int64_t t = 0; t < T; ++t) {
    const int64_t v = rng::bits(seed, 5, static_cast<uint64_t>(t)) % static_cast<uint64_t>(V);
    if (dt == DType::I32)
      ids.ptr<int32_t>()[t] = static_cast<int32_t>(v);
    else
      ids.ptr<int64_t>()[t] = v;
  }
  return ids;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

struct EmbOut {
  OwnedTensor y, dw;
};

EmbOut run(const Tensor& ids, const Tensor& w64, const Tensor& dy64, const Tensor& dw0, DType dt) {
  OwnedTensor w = convert(w64, dt), dy = convert(dy64, dt);
  EmbOut o{OwnedTensor::zeros(dt, {ids.size(0), w64.size(1)}),
           convert(dw0, embedding_grad_dtype(dt))};
  embedding_forward({ids, w, o.y});
  embedding_backward({ids, dy, o.dw});
  return o;
}

class EmbeddingSweep
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, DType>> {};

TEST_P(EmbeddingSweep, CpuMatchesRef) {
  auto [T, V, D, idt] = GetParam();
  auto ids = make_ids(T, V, 1, idt);
  auto w = testing::rounded(randn({V, D}, 2), DType::F32);
  auto dy = testing::rounded(randn({T, D}, 3), DType::F32);
  auto dw0 = testing::rounded(randn({V, D}, 4), DType::F32);  // dW accumulates onto this
  EmbOut ref = run(ids, w, dy, dw0, DType::F64);
  EmbOut cpu = run(ids, w, dy, dw0, DType::F32);
  EXPECT_EQ(testing::rel_err(cpu.y, ref.y), 0.0) << "the forward is an exact copy";
  testing::expect_close(cpu.dw, ref.dw, 1e-6, "dw");
}

std::string embedding_case_name(
    const ::testing::TestParamInfo<std::tuple<int64_t, int64_t, int64_t, DType>>& info) {
  const auto& p = info.param;
  return fmt::format("T{}_V{}_D{}_{}", std::get<0>(p), std::get<1>(p), std::get<2>(p),
                     dtype_name(std::get<3>(p)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingSweep,
                         ::testing::Combine(::testing::Values(1, 5, 300),
                                            ::testing::Values(1, 7, 1000),
                                            ::testing::Values(1, 17, 67),
                                            ::testing::Values(DType::I32, DType::I64)),
                         embedding_case_name);

TEST(Embedding, BackwardIsBitwiseDeterministicAcrossRunsAndThreadCounts) {
  // Many repeats of a few ids: the case where an atomic or per-thread-partial reduction would
  // change the order of the float sums.
  const int64_t T = 3000, V = 50, D = 83;
  auto ids = make_ids(T, 5, 6, DType::I32);  // ids 0..4 only
  auto dy = convert(randn({T, D}, 7, 10.0), DType::F32);
  auto dw0 = convert(randn({V, D}, 8), DType::F32);
  auto once = [&](int threads) {
    const int keep = omp_get_max_threads();
    omp_set_num_threads(threads);
    auto dw = convert(dw0, DType::F32);
    embedding_backward({ids, dy, dw});
    omp_set_num_threads(keep);
    return dw;
  };
  auto a = once(2), b = once(2), c = once(1), d = once(3);
  EXPECT_TRUE(bitwise_equal(a, b)) << "two runs differ";
  EXPECT_TRUE(bitwise_equal(a, c)) << "2 threads vs 1 thread differ";
  EXPECT_TRUE(bitwise_equal(a, d)) << "2 threads vs 3 threads differ";
  // And equal to the plain serial fp32 loop in token order.
  auto s = convert(dw0, DType::F32);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < D; ++j)
      s.ptr<float>()[embedding_id(ids, t) * D + j] += dy.ptr<float>()[t * D + j];
  EXPECT_TRUE(bitwise_equal(a, s)) << "differs from the serial token-order sum";
}

TEST(Embedding, RefGradientMatchesFiniteDifferences) {
  const int64_t T = 9, V = 6, D = 4;
  auto ids = make_ids(T, V, 9, DType::I64);
  auto w = randn({V, D}, 10), up = randn({T, D}, 11);
  auto dw = OwnedTensor::zeros(DType::F64, {V, D});
  embedding_backward({ids, up, dw});
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {T, D});
    embedding_forward({ids, w, y});
    return testing::dot(y, up);
  };
  EXPECT_LE(testing::fd_check(loss, w, dw), 1e-8);
}

TEST(Embedding, OutOfRangeIdsNameThePositionAndValue) {
  auto w = OwnedTensor::zeros(DType::F32, {250, 4});
  auto y = OwnedTensor::zeros(DType::F32, {4, 4});
  auto ids = testing::i32_tensor({3, 5, 300, 7});
  testing::expect_error(
      [&] {
        embedding_forward({ids, w, y});
      },
      "embedding: ids[2] = 300 is out of range [0, 250)");
  auto neg = testing::i32_tensor({0, -1, 2, 3});
  testing::expect_error(
      [&] {
        embedding_forward({neg, w, y});
      },
      "embedding: ids[1] = -1 is out of range [0, 250)");
  auto big = OwnedTensor::zeros(DType::I64, {4});
  big.ptr<int64_t>()[3] = int64_t{1} << 40;
  testing::expect_error(
      [&] {
        embedding_forward({big, w, y});
      },
      "embedding: ids[3] = 1099511627776 is out of range [0, 250)");
  auto dy = OwnedTensor::zeros(DType::F32, {4, 4});
  auto dw = OwnedTensor::zeros(DType::F32, {250, 4});
  testing::expect_error(
      [&] {
        embedding_backward({ids, dy, dw});
      },
      "embedding: ids[2] = 300 is out of range [0, 250)");
  // Nothing was written before the error.
  for (double v : to_f64_vector(dw)) EXPECT_EQ(v, 0.0);
}

TEST(Embedding, BadInputIsAClearError) {
  auto w = OwnedTensor::zeros(DType::F32, {10, 4});
  auto ids = testing::i32_tensor({1, 2, 3});
  auto y_bad = OwnedTensor::zeros(DType::F32, {3, 5});
  testing::expect_error(
      [&] {
        embedding_forward({ids, w, y_bad});
      },
      "embedding: tensor 'y' has shape [3, 5], expected [3, 4]");
  auto fids = OwnedTensor::zeros(DType::F32, {3});
  auto y = OwnedTensor::zeros(DType::F32, {3, 4});
  testing::expect_error(
      [&] {
        embedding_forward({fids, w, y});
      },
      "embedding: tensor 'ids' has dtype F32, expected I32 or I64");
  auto ids2 = OwnedTensor::zeros(DType::I32, {1, 3});
  testing::expect_error(
      [&] {
        embedding_forward({ids2, w, y});
      },
      "embedding: tensor 'ids' has shape [1, 3], expected [*]");
  auto dy = OwnedTensor::zeros(DType::F32, {3, 4});
  auto dw_bad = OwnedTensor::zeros(DType::F32, {10, 5});
  testing::expect_error(
      [&] {
        embedding_backward({ids, dy, dw_bad});
      },
      "embedding: tensor 'dw' has shape [10, 5], expected [*, 4]");
  auto dy_bad = OwnedTensor::zeros(DType::F32, {2, 4});
  auto dw = OwnedTensor::zeros(DType::F32, {10, 4});
  testing::expect_error(
      [&] {
        embedding_backward({ids, dy_bad, dw});
      },
      "embedding: tensor 'dy' has shape [2, 4], expected [3, *]");
  auto dw64 = OwnedTensor::zeros(DType::F64, {10, 4});
  testing::expect_error(
      [&] {
        embedding_backward({ids, dy, dw64});
      },
      "embedding: tensor 'dw' has dtype F64, expected F32");
  auto plan_short = OwnedTensor::zeros(DType::I32, {embedding_plan_numel(3, 4) - 1});
  testing::expect_error(
      [&] {
        embedding_forward({ids, w, y, plan_short});
      },
      fmt::format("embedding: tensor 'plan' has shape [{}], expected [{}] "
                  "(embedding_plan_numel(T=3, D=4))",
                  embedding_plan_numel(3, 4) - 1, embedding_plan_numel(3, 4)));
  auto plan_i64 = OwnedTensor::zeros(DType::I64, {embedding_plan_numel(3, 4)});
  testing::expect_error(
      [&] {
        embedding_backward({ids, dy, dw, plan_i64});
      },
      "embedding: tensor 'plan' has dtype I64, expected I32");
  testing::expect_error([] { (void)embedding_plan_numel(-1, 4); },
                        "embedding: embedding_plan_numel needs T >= 0 and D >= 0, got T = -1");
}

TEST(Embedding, PlanLayoutAndTheCpuIgnoresAPlan) {
  // The model's shape: keys and toks [8192] each, win_info [4 * 512], counters [512 windows * 16
  // chunks of 256 columns], each part a multiple of 64 words.
  const EmbeddingPlanLayout l(8192, 4096);
  EXPECT_EQ(l.toks, 8192);
  EXPECT_EQ(l.win_info, 16384);
  EXPECT_EQ(l.counters, 16384 + 2048);
  EXPECT_EQ(l.numel, 16384 + 2048 + 8192);
  EXPECT_EQ(embedding_plan_numel(8192, 4096), l.numel);
  EXPECT_EQ(embedding_plan_numel(1, 1), 4 * 64);
  EXPECT_EQ(embedding_plan_numel(0, 0), 0);
  // cpu neither writes nor reads a plan: same y and dW with one, the plan untouched.
  const int64_t T = 40, V = 9, D = 5;
  OwnedTensor ids = make_ids(T, V, 6, DType::I32);
  OwnedTensor w = convert(randn({V, D}, 3), DType::F32), dy = convert(randn({T, D}, 4), DType::F32);
  auto y0 = OwnedTensor::zeros(DType::F32, {T, D}), y1 = OwnedTensor::zeros(DType::F32, {T, D});
  auto dw0 = OwnedTensor::zeros(DType::F32, {V, D}), dw1 = OwnedTensor::zeros(DType::F32, {V, D});
  auto plan = OwnedTensor::empty(DType::I32, {embedding_plan_numel(T, D)});
  for (int64_t i = 0; i < plan.numel(); ++i) plan.ptr<int32_t>()[i] = static_cast<int32_t>(i);
  embedding_forward({ids, w, y0});
  embedding_forward({ids, w, y1, plan});
  embedding_backward({ids, dy, dw0});
  embedding_backward({ids, dy, dw1, plan});
  EXPECT_TRUE(bitwise_equal(y0, y1));
  EXPECT_TRUE(bitwise_equal(dw0, dw1));
  for (int64_t i = 0; i < plan.numel(); ++i)
    ASSERT_EQ(plan.ptr<int32_t>()[i], static_cast<int32_t>(i)) << "plan word " << i;
}

// A backward that writes dW[id] = dy[t] (losing repeated ids) must be rejected by the probe.
void cpu_forward(const EmbeddingFwd& a) {
  Registry::global().table<EmbeddingTable>("embedding", OpQuery{Backend::Cpu, "", {}}).forward(a);
}
void overwriting_backward(const EmbeddingBwd& a) {
  const int64_t T = a.ids.size(0), D = a.dy.size(1);
  const float* dy = a.dy.ptr<float>();  // [T, D]
  float* dw = a.dw.ptr<float>();        // [V, D]
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(dw + embedding_id(a.ids, t) * D, dy + t * D, static_cast<size_t>(D) * 4);
}
const EmbeddingTable kWrong{cpu_forward, overwriting_backward};

TEST(Embedding, ProbeAcceptsCpuAndRejectsAnOverwritingBackward) {
  const Resolution& r = Registry::global().resolve("embedding", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.column_blocks");
  EXPECT_EQ(r.error.fwd, 0.0);
  EXPECT_LE(r.error.bwd, 1e-6);
  const OpDesc& op = Registry::global().op("embedding");
  ProbeError e = op.probe({"embedding", "cpu.wrong", Backend::Cpu, 0, nullptr, &kWrong},
                          OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(e.fwd, 0.0);
  EXPECT_GT(e.bwd, op.tolerance(DType::F32).bwd);
}

TEST(Embedding, OpsRunFromFile) {
  auto ids = testing::i32_tensor({4, 0, 4, 2, 9});
  auto w = testing::rounded(randn({10, 6}, 12), DType::F32);
  auto dy = testing::rounded(randn({5, 6}, 13), DType::F32);
  auto out = testing::run_op_via_file("embedding", Backend::Cpu,
                                      {{"ids", ids}, {"w", w}, {"dy", dy}}, true, {});
  EmbOut ref = run(ids, w, dy, OwnedTensor::zeros(DType::F64, {10, 6}), DType::F64);
  EXPECT_EQ(testing::rel_err(out.at("y"), ref.y), 0.0);
  testing::expect_close(out.at("dw"), ref.dw, 1e-6, "dw");
}

}  // namespace
}  // namespace gdn::ops
