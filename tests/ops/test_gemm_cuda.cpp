// GEMM on CUDA (cuBLASLt; label gpu): cuda vs ref over swept shapes and every transpose (forward
// with beta = 0 over a NaN-filled C and beta = 1, da written, db accumulated), the linear layer
// with dW accumulated in fp32, K = 0 and empty outputs, sliced (unaligned) operands, determinism,
// the resolver's choice and probe, wrong implementations rejected by the probe, `ops run` on the
// cuda backend, and bad input. Tolerances come from src/backend/tolerances.h.
#include <cmath>
#include <limits>

#include "backend/tolerances.h"
#include "ops/dense_test_util.h"
#include "ops/gemm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

constexpr ProbeError kTol = bf16_tolerance("gemm");

class GemmCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

OwnedTensor nan_tensor(DType dt, std::span<const int64_t> shape, Device dev) {
  Tensor probe(nullptr, dt, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()),
                        std::numeric_limits<double>::quiet_NaN());
  return from_f64(v, dt, shape, dev);
}

// F64 host values already rounded to bf16, so ref and cuda multiply the same numbers.
OwnedTensor bf16_randn(std::initializer_list<int64_t> shape, uint64_t seed) {
  return testing::rounded(randn(shape, seed), DType::BF16);
}
OwnedTensor operand(int64_t rows, int64_t cols, bool trans, uint64_t seed) {
  return trans ? bf16_randn({cols, rows}, seed) : bf16_randn({rows, cols}, seed);
}

using Mnk = std::tuple<int, int, int>;
class GemmCudaSweep : public GemmCuda,
                      public ::testing::WithParamInterface<std::tuple<Mnk, bool, bool, double>> {};

TEST_P(GemmCudaSweep, MatchesRef) {
  auto [mnk, ta, tb, beta] = GetParam();
  auto [M, N, K] = mnk;
  const double alpha = 0.75;
  auto a = operand(M, K, ta, 1), b = operand(K, N, tb, 2);
  auto c0 = bf16_randn({M, N}, 3), dc = bf16_randn({M, N}, 4);
  auto db0 = tb ? bf16_randn({N, K}, 5) : bf16_randn({K, N}, 5);
  // ref
  auto rc = convert(c0, DType::F64), rda = OwnedTensor::zeros(DType::F64, a.view().shape());
  auto rdb = convert(db0, DType::F64);
  gemm({a, b, rc, ta, tb, alpha, beta});
  gemm_backward({a, b, dc, rda, rdb, ta, tb, alpha, false, true});
  // cuda: C NaN when beta == 0 (must not be read), da NaN (written, not accumulated)
  auto ga = convert(a, DType::BF16, Device::CUDA), gb = convert(b, DType::BF16, Device::CUDA);
  auto gdc = convert(dc, DType::BF16, Device::CUDA);
  auto gc = beta == 0 ? nan_tensor(DType::BF16, c0.view().shape(), Device::CUDA)
                      : convert(c0, DType::BF16, Device::CUDA);
  auto gda = nan_tensor(DType::BF16, a.view().shape(), Device::CUDA);
  auto gdb = convert(db0, DType::BF16, Device::CUDA);
  gemm({ga, gb, gc, ta, tb, alpha, beta});
  gemm_backward({ga, gb, gdc, gda, gdb, ta, tb, alpha, false, true});
  testing::expect_close(gc, rc, kTol.fwd, "c");
  testing::expect_close(gda, rda, kTol.bwd, "da");
  testing::expect_close(gdb, rdb, kTol.bwd, "db");
}

std::string sweep_name(const ::testing::TestParamInfo<std::tuple<Mnk, bool, bool, double>>& info) {
  const auto& [mnk, ta, tb, beta] = info.param;
  return fmt::format("M{}_N{}_K{}_{}{}_beta{}", std::get<0>(mnk), std::get<1>(mnk),
                     std::get<2>(mnk), ta ? "T" : "N", tb ? "T" : "N", static_cast<int>(beta));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmCudaSweep,
    ::testing::Combine(::testing::Values(Mnk{1, 1, 1}, Mnk{1, 9, 33}, Mnk{7, 1, 5}, Mnk{13, 11, 37},
                                         Mnk{64, 48, 129}, Mnk{128, 256, 512}, Mnk{257, 100, 1031}),
                       ::testing::Bool(), ::testing::Bool(), ::testing::Values(0.0, 1.0)),
    sweep_name);

TEST_F(GemmCuda, LinearAccumulatesDwInFp32) {
  const int64_t T = 300, in = 256, out = 192;
  auto x = bf16_randn({T, in}, 10), w = bf16_randn({out, in}, 11), dy = bf16_randn({T, out}, 12);
  auto dw0 = randn({out, in}, 13);  // fp32 gradient-accumulation buffer, arbitrary content
  auto ry = OwnedTensor::zeros(DType::F64, {T, out}), rdx = OwnedTensor::zeros(DType::F64, {T, in});
  auto radd = OwnedTensor::zeros(DType::F64, {out, in});
  linear_forward({x, w, ry});
  linear_backward({x, w, dy, rdx, radd, false});

  auto gx = convert(x, DType::BF16, Device::CUDA), gw = convert(w, DType::BF16, Device::CUDA);
  auto gdy = convert(dy, DType::BF16, Device::CUDA);
  const int64_t yshape[] = {T, out}, xshape[] = {T, in};
  auto gy = nan_tensor(DType::BF16, yshape, Device::CUDA);
  auto gdx = nan_tensor(DType::BF16, xshape, Device::CUDA);
  auto gdw = convert(dw0, DType::F32, Device::CUDA);
  linear_forward({gx, gw, gy});
  linear_backward({gx, gw, gdy, gdx, gdw, false});
  testing::expect_close(gy, ry, kTol.fwd, "y");
  testing::expect_close(gdx, rdx, kTol.bwd, "dx");
  // dW - dw0 against the fp64 product: an fp32 C accumulates in fp32 (nothing passes through
  // bf16), so the error is fp32 rounding (~1e-7), far under the bf16 limit.
  auto got = to_f64_vector(gdw), base = to_f64_vector(dw0), add = to_f64_vector(radd);
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - static_cast<double>(static_cast<float>(base[i])) - add[i];
    num += d * d;
    den += add[i] * add[i];
  }
  EXPECT_LE(std::sqrt(num / den), 1e-5) << "dW += dy^T x in fp32";
}

TEST_F(GemmCuda, EmptyProductScalesC) {
  // K == 0: C = beta C; beta == 0 writes zeros without reading the NaNs.
  auto a = OwnedTensor::zeros(DType::BF16, {3, 0}, Device::CUDA);
  auto b = OwnedTensor::zeros(DType::BF16, {0, 5}, Device::CUDA);
  const int64_t shape[] = {3, 5};
  auto c = nan_tensor(DType::BF16, shape, Device::CUDA);
  gemm({a, b, c, false, false, 1.0, 0.0});
  for (double v : to_f64_vector(c)) EXPECT_EQ(v, 0.0);
  auto c32 = from_f64(std::vector<double>(15, 2.0), DType::F32, {3, 5}, Device::CUDA);
  gemm({a, b, c32, false, false, 1.0, 0.5});
  for (double v : to_f64_vector(c32)) EXPECT_EQ(v, 1.0);
  // M == 0: nothing to do, no error.
  auto a0 = OwnedTensor::zeros(DType::BF16, {0, 4}, Device::CUDA);
  auto b0 = OwnedTensor::zeros(DType::BF16, {4, 5}, Device::CUDA);
  auto c0 = OwnedTensor::zeros(DType::BF16, {0, 5}, Device::CUDA);
  gemm({a0, b0, c0, false, false, 1.0, 0.0});
}

// Operands starting `offset` bytes past an aligned address (tensors sliced out of a buffer).
void run_offset_case(size_t offset) {
  const int64_t M = 40, N = 24, K = 72;
  auto a = bf16_randn({M, K}, 20), b = bf16_randn({N, K}, 21);
  auto rc = OwnedTensor::zeros(DType::F64, {M, N});
  gemm({a, b, rc, false, true, 1.0, 0.0});
  std::vector<OwnedTensor> keep;
  auto shifted = [&](const Tensor& src) {
    keep.push_back(OwnedTensor::zeros(DType::BF16, {src.numel() + 128}, Device::CUDA));
    Tensor v(static_cast<char*>(keep.back().view().data()) + offset, DType::BF16, src.shape(),
             Device::CUDA);
    OwnedTensor dev = convert(src, DType::BF16, Device::CUDA);
    copy_into(v, dev);
    return v;
  };
  Tensor ga = shifted(a), gb = shifted(b), gc = shifted(rc);
  gemm({ga, gb, gc, false, true, 1.0, 0.0});
  testing::expect_close(gc, rc, kTol.fwd, fmt::format("c (operands {} bytes off)", offset));
}

TEST_F(GemmCuda, OperandsAlignedTo16Bytes) { run_offset_case(16); }
TEST_F(GemmCuda, OperandsAlignedTo2Bytes) { run_offset_case(2); }

TEST_F(GemmCuda, IsDeterministic) {
  const int64_t M = 512, N = 384, K = 1024;
  auto a = convert(bf16_randn({M, K}, 30), DType::BF16, Device::CUDA);
  auto b = convert(bf16_randn({K, N}, 31), DType::BF16, Device::CUDA);
  auto c1 = OwnedTensor::zeros(DType::F32, {M, N}, Device::CUDA);
  gemm({a, b, c1, false, false, 1.0, 0.0});
  const auto first = to_f64_vector(c1);
  for (int rep = 0; rep < 3; ++rep) {
    auto c = OwnedTensor::zeros(DType::F32, {M, N}, Device::CUDA);
    gemm({a, b, c, false, false, 1.0, 0.0});
    EXPECT_EQ(to_f64_vector(c), first) << "rep " << rep;
  }
}

TEST_F(GemmCuda, ResolverChoosesCublasLtAndItPassesItsProbe) {
  const Resolution& r = Registry::global().resolve("gemm", OpQuery{Backend::Cuda, "", {}});
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, "cuda.cublaslt");
  EXPECT_LE(r.error.fwd, kTol.fwd);
  EXPECT_LE(r.error.bwd, kTol.bwd);
  EXPECT_GT(r.error.fwd, 0.0);  // bf16 outputs cannot equal fp64: zero means nothing was compared
  EXPECT_GT(r.error.bwd, 0.0);
}

const GemmTable* real_cuda_table() {
  for (const ImplDesc* i : Registry::global().impls("gemm", Backend::Cuda))
    if (i->name == "cuda.cublaslt") return static_cast<const GemmTable*>(i->table);
  return nullptr;
}
void gemm_ignoring_beta(const GemmArgs& g) {  // overwrites instead of accumulating
  GemmArgs h = g;
  h.beta = 0;
  real_cuda_table()->gemm(h);
}
void gemm_ignoring_alpha(const GemmArgs& g) {
  GemmArgs h = g;
  h.alpha = 1;
  real_cuda_table()->gemm(h);
}
const GemmTable kIgnoresBeta{gemm_ignoring_beta};
const GemmTable kIgnoresAlpha{gemm_ignoring_alpha};

TEST_F(GemmCuda, ProbeRejectsWrongCudaImplementations) {
  ASSERT_NE(real_cuda_table(), nullptr) << "cuda.cublaslt is not registered";
  Registry reg;
  reg.add_op(Registry::global().op("gemm"));
  reg.add_impl(Registry::global().ref("gemm"));
  for (const ImplDesc* i : Registry::global().impls("gemm", Backend::Cuda)) reg.add_impl(*i);
  reg.add_impl({"gemm", "cuda.ignores_beta", Backend::Cuda, 30, nullptr, &kIgnoresBeta});
  reg.add_impl({"gemm", "cuda.ignores_alpha", Backend::Cuda, 20, nullptr, &kIgnoresAlpha});
  const Resolution& r = reg.resolve("gemm", OpQuery{Backend::Cuda, "", {}});
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, "cuda.cublaslt");
  ASSERT_EQ(r.rejected.size(), 2u);
  EXPECT_NE(r.rejected[0].find("rejecting cuda.ignores_beta: probe error"), std::string::npos)
      << r.rejected[0];
  EXPECT_NE(r.rejected[1].find("rejecting cuda.ignores_alpha: probe error"), std::string::npos)
      << r.rejected[1];
}

TEST_F(GemmCuda, OpsRunOnCudaBackend) {
  auto a = bf16_randn({6, 10}, 40), b = bf16_randn({10, 4}, 41), dc = bf16_randn({6, 4}, 42);
  auto rc = OwnedTensor::zeros(DType::F64, {6, 4});
  auto rda = OwnedTensor::zeros(DType::F64, {6, 10}), rdb = OwnedTensor::zeros(DType::F64, {10, 4});
  gemm({a, b, rc, false, false, 0.5, 0.0});
  gemm_backward({a, b, dc, rda, rdb, false, false, 0.5, false, false});
  auto out = testing::run_op_via_file("gemm", Backend::Cuda, {{"a", a}, {"b", b}, {"dc", dc}}, true,
                                      {{"alpha", 0.5}});
  testing::expect_close(out.at("c"), rc, kTol.fwd, "c (ops run)");
  testing::expect_close(out.at("da"), rda, kTol.bwd, "da (ops run)");
  testing::expect_close(out.at("db"), rdb, kTol.bwd, "db (ops run)");
}

TEST_F(GemmCuda, BadInputIsAClearError) {
  auto a32 = OwnedTensor::zeros(DType::F32, {4, 8}, Device::CUDA);
  auto b32 = OwnedTensor::zeros(DType::F32, {8, 3}, Device::CUDA);
  auto c32 = OwnedTensor::zeros(DType::F32, {4, 3}, Device::CUDA);
  testing::expect_error(
      [&] {
        gemm({a32, b32, c32, false, false, 1.0, 0.0});
      },
      "gemm (cuda): a and b must be BF16, got F32");
  auto a = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto b_host = OwnedTensor::zeros(DType::BF16, {8, 3});
  auto c = OwnedTensor::zeros(DType::BF16, {4, 3}, Device::CUDA);
  testing::expect_error(
      [&] {
        gemm({a, b_host, c, false, false, 1.0, 0.0});
      },
      "gemm: all tensors must be on cuda");
}

}  // namespace
}  // namespace gdn::ops
