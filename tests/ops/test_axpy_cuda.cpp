// axpy on CUDA (label gpu): bf16 and fp32 device tensors against ref over swept sizes (every tail
// of the 16-byte packs) and two alphas, bf16 results within half an ulp of the exact value, x
// aliasing y, the scalar path for unaligned tensors, the resolver's choice and probe, `ops run` on
// the cuda backend, and bad input. The bf16 tolerance comes from src/backend/tolerances.h.
#include <cmath>

#include "backend/tolerances.h"
#include "ops/axpy/op.h"
#include "ops/cuda_test_util.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("axpy");
constexpr double kTolF32 = 1e-6;  // one fp32 rounding of y

class AxpyCuda : public CudaOpTest {};

// y + alpha * x in fp64 on the host.
OwnedTensor expected(const Tensor& x64, const Tensor& y64, double alpha) {
  OwnedTensor y = convert(y64, DType::F64);
  axpy({x64, y, alpha});
  return y;
}

void expect_within_half_ulp(const Tensor& got, const Tensor& want, const std::string& what) {
  auto g = to_f64_vector(got), w = to_f64_vector(want);
  ASSERT_EQ(g.size(), w.size());
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double lim = std::ldexp(std::abs(w[i]), -8) * (1 + 1e-4) + 1e-30;
    if (!(std::abs(g[i] - w[i]) <= lim) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "] = " << g[i] << ", exact " << w[i];
  }
  EXPECT_EQ(bad, 0) << "elements of " << what << " off by more than half a bf16 ulp";
}

class AxpyCudaSweep : public AxpyCuda,
                      public ::testing::WithParamInterface<std::tuple<int64_t, DType, double>> {};

TEST_P(AxpyCudaSweep, MatchesRef) {
  auto [n, dt, alpha] = GetParam();
  OwnedTensor x = randn_as({n}, 1 + static_cast<uint64_t>(n), dt);
  OwnedTensor y0 = randn_as({n}, 2 + static_cast<uint64_t>(n), dt);
  OwnedTensor want = expected(x, y0, alpha);
  OwnedTensor xd = to_dev(x, dt), yd = to_dev(y0, dt);
  axpy({xd, yd, alpha});
  if (dt == DType::BF16) {
    expect_close(yd, want, kTol.fwd, "y");
    expect_within_half_ulp(yd, want, "y");
  } else {
    expect_close(yd, want, kTolF32, "y");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, AxpyCudaSweep,
    ::testing::Combine(::testing::Values(1, 3, 4, 7, 8, 9, 1023, 1031, 12293, (1 << 20) + 3),
                       ::testing::Values(DType::BF16, DType::F32), ::testing::Values(1.0, -0.75)),
    [](const auto& info) {
      return "n" + std::to_string(std::get<0>(info.param)) + "_" +
             std::string(dtype_name(std::get<1>(info.param))) +
             (std::get<2>(info.param) == 1.0 ? "_one" : "_neg");
    });

TEST_F(AxpyCuda, XMayAliasY) {
  for (DType dt : {DType::BF16, DType::F32}) {
    OwnedTensor y0 = randn_as({4103}, 5, dt);
    OwnedTensor want = expected(y0, y0, 0.5);  // y + 0.5 y
    OwnedTensor yd = to_dev(y0, dt);
    axpy({yd, yd, 0.5});
    expect_close(yd, want, dt == DType::BF16 ? kTol.fwd : kTolF32, "y += 0.5 y");
  }
}

TEST_F(AxpyCuda, UnalignedTensorsTakeTheScalarPath) {
  for (DType dt : {DType::BF16, DType::F32}) {
    const int64_t n = 4096;
    OwnedTensor x = randn_as({n}, 7, dt), y0 = randn_as({n}, 8, dt);
    OwnedTensor want = expected(x, y0, -0.75);
    std::vector<OwnedTensor> keep;
    OwnedTensor xd = to_dev(x, dt), yd = to_dev(y0, dt);
    Tensor xu = unaligned_copy(xd, 4, keep), yu = unaligned_copy(yd, 4, keep);
    axpy({xu, yu, -0.75});
    expect_close(yu, want, dt == DType::BF16 ? kTol.fwd : kTolF32,
                 std::string("y (unaligned, ") + std::string(dtype_name(dt)) + ")");
  }
}

TEST_F(AxpyCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("axpy", "cuda.elementwise", kTol, true, false);
}

// A deliberately wrong CUDA implementation built from the real one: alpha negated.
const AxpyTable* real_table() { return cuda_table<AxpyTable>("axpy", "cuda.elementwise"); }
void negated_run(const AxpyArgs& a) {
  AxpyArgs b = a;
  b.alpha = -a.alpha;
  real_table()->run(b);
}
const AxpyTable kWrong{negated_run};

TEST_F(AxpyCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << "cuda.elementwise is not registered";
  expect_probe_rejects("axpy", "cuda.elementwise", {{"cuda.wrong_alpha", &kWrong}});
}

TEST_F(AxpyCuda, OpsRunOnCudaBackend) {
  OwnedTensor x = randn_as({3, 41}, 11, DType::BF16), y0 = randn_as({3, 41}, 12, DType::BF16);
  OwnedTensor want = expected(x, y0, 2.5);
  OwnedTensor xf = convert(x, DType::F32), yf = convert(y0, DType::F32);
  OpsRunOnCuda run("axpy", {{"x", xf}, {"y", yf}}, false, {{"alpha", 2.5}});
  EXPECT_EQ(run.result().impl, "cuda.elementwise");
  expect_close(run.load("y"), want, kTol.fwd, "y (ops run)");
}

TEST_F(AxpyCuda, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::F32, {8}, Device::CUDA);
  auto y = OwnedTensor::zeros(DType::BF16, {8}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              axpy({x, y, 1.0});
            }).find("tensor 'x' has dtype F32, expected BF16"),
            std::string::npos);
  auto x_host = OwnedTensor::zeros(DType::BF16, {8});
  EXPECT_NE(error_of([&] { axpy({x_host, y, 1.0}); }).find("tensor 'x'"), std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
