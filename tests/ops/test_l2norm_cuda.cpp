// L2 normalisation on CUDA (label gpu): cuda vs ref over swept shapes (forward, and the backward
// from cuda's own y and rstd), rows of very different scales including all-zero rows, the 16-byte
// and the scalar paths, rows wider than the register-held part, the resolver's choice and probe,
// `ops run` on the cuda backend, and bad input. Tolerances come from src/backend/tolerances.h.
#include <algorithm>
#include <cmath>

#include "backend/tolerances.h"
#include "ops/cuda_test_util.h"
#include "ops/l2norm/op.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("l2norm");

class L2NormCuda : public CudaOpTest {};

// Rows of scale 10^((i % 5) - 2); every 7th row all zero (rstd = 1 / sqrt(eps)); bf16 values.
OwnedTensor scaled_rows(int64_t R, int64_t D, uint64_t seed) {
  auto v = to_f64_vector(randn({R, D}, seed));
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < D; ++j)
      v[static_cast<size_t>(i * D + j)] *=
          i % 7 == 3 ? 0.0 : std::pow(10.0, static_cast<double>(i % 5) - 2.0);
  return rounded(from_f64(v, DType::F64, {R, D}), DType::BF16);
}

struct Out {
  OwnedTensor y, rstd, dx;  // ref: F64 host; cuda: device
};

Out run_ref(const Tensor& x, const Tensor& dy) {
  const int64_t R = x.size(0), D = x.size(1);
  Out o{OwnedTensor::zeros(DType::F64, {R, D}), OwnedTensor::zeros(DType::F64, {R}),
        OwnedTensor::zeros(DType::F64, {R, D})};
  l2norm_forward({x, o.y, o.rstd, 1e-6});
  l2norm_backward({o.y, o.rstd, dy, o.dx});
  return o;
}

Out run_cuda(const Tensor& x, const Tensor& dy) {
  const int64_t R = x.size(0), D = x.size(1);
  Out o{poisoned(DType::BF16, {R, D}), poisoned(DType::F32, {R}), poisoned(DType::BF16, {R, D})};
  l2norm_forward({x, o.y, o.rstd, 1e-6});
  l2norm_backward({o.y, o.rstd, dy, o.dx});
  return o;
}

// The cuda outputs against ref: y and rstd against ref's forward; dx against ref's backward run
// on cuda's own y and rstd (what the cuda backward read), so that dx measures the backward
// kernel alone. (This also keeps D = 1 well conditioned: y rounds to exactly +-1 in bf16, and
// both then give dx = r (dy - dy) = 0 for nonzero rows.)
void compare(const Out& c, const Out& ref, const Tensor& dy64) {
  expect_close(c.y, ref.y, kTol.fwd, "y");
  expect_close(c.rstd, ref.rstd, kTol.fwd, "rstd");
  const int64_t R = dy64.size(0), D = dy64.size(1);
  OwnedTensor y = to_f64(c.y), r = to_f64(c.rstd), dx = OwnedTensor::zeros(DType::F64, {R, D});
  l2norm_backward({y, r, dy64, dx});
  expect_close(c.dx, dx, kTol.bwd, "dx");
}

struct Shape {
  int64_t R, D;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << "[" << s.R << ", " << s.D << "]"; }
// One row; odd and tiny widths (scalar path); D % 8 == 0 from one pack per row (tpr = 1) to the
// register limit (D = 4096: tpr = 256) and past it (12288, re-read); scalar rows past their limit
// (D = 2053, 9001); many rows; the GDN width 128; pack counts that leave some of a row group's
// register-held packs unused (24, 40, 136, 520), 16 and 32 threads a row (256, 512), and row
// counts that are not a multiple of the rows per block, up to more blocks than are resident at
// once (40001).
const Shape kShapes[] = {
    {1, 1},     {1, 7},      {3, 97},     {1, 8},     {5, 16},   {9, 128},     {4099, 128},
    {33, 1000}, {257, 1031}, {5, 4096},   {3, 12288}, {4, 2053}, {2, 9001},    {70000, 64},
    {65, 24},   {1031, 40},  {1031, 256}, {777, 512}, {3, 520},  {40001, 128}, {33, 128 + 8}};

class L2NormCudaSweep : public L2NormCuda, public ::testing::WithParamInterface<Shape> {};

TEST_P(L2NormCudaSweep, MatchesRef) {
  const Shape s = GetParam();
  OwnedTensor x = scaled_rows(s.R, s.D, 100 + static_cast<uint64_t>(s.D));
  OwnedTensor dy = randn_as({s.R, s.D}, 200 + static_cast<uint64_t>(s.D), DType::BF16);
  Out ref = run_ref(x, dy);
  Out c = run_cuda(to_dev(x, DType::BF16), to_dev(dy, DType::BF16));
  compare(c, ref, dy);
}

INSTANTIATE_TEST_SUITE_P(Shapes, L2NormCudaSweep, ::testing::ValuesIn(kShapes),
                         [](const auto& info) {
                           return "R" + std::to_string(info.param.R) + "_D" +
                                  std::to_string(info.param.D);
                         });

TEST_F(L2NormCuda, ZeroRowGivesZeroAndTheEpsRstd) {
  OwnedTensor x = OwnedTensor::zeros(DType::BF16, {2, 128}, Device::CUDA);
  OwnedTensor y = poisoned(DType::BF16, {2, 128}), r = poisoned(DType::F32, {2});
  l2norm_forward({x, y, r, 1e-6});
  for (double v : to_f64_vector(y)) ASSERT_EQ(v, 0.0);
  for (double v : to_f64_vector(r)) EXPECT_NEAR(v, 1000.0, 1000.0 * 1e-6);  // 1 / sqrt(1e-6)
}

TEST_F(L2NormCuda, UnalignedTensorsTakeTheScalarPath) {
  const int64_t R = 9, D = 256;  // D % 8 == 0: only the 2-byte offset forces the scalar path
  OwnedTensor x = scaled_rows(R, D, 31), dy = randn_as({R, D}, 32, DType::BF16);
  Out ref = run_ref(x, dy);
  std::vector<OwnedTensor> keep;
  OwnedTensor xd = to_dev(x, DType::BF16), dyd = to_dev(dy, DType::BF16);
  Tensor xu = unaligned_copy(xd, 2, keep), dyu = unaligned_copy(dyd, 2, keep);
  Tensor yu = unaligned_copy(poisoned(DType::BF16, {R, D}), 2, keep);
  Tensor dxu = unaligned_copy(poisoned(DType::BF16, {R, D}), 2, keep);
  Out c{OwnedTensor(), poisoned(DType::F32, {R}), OwnedTensor()};
  l2norm_forward({xu, yu, c.rstd, 1e-6});
  l2norm_backward({yu, c.rstd, dyu, dxu});
  expect_close(yu, ref.y, kTol.fwd, "y (unaligned)");
  expect_close(c.rstd, ref.rstd, kTol.fwd, "rstd (unaligned)");
  OwnedTensor y64 = to_f64(yu), r64 = to_f64(c.rstd), dx = OwnedTensor::zeros(DType::F64, {R, D});
  l2norm_backward({y64, r64, dy, dx});
  expect_close(dxu, dx, kTol.bwd, "dx (unaligned)");
}

TEST_F(L2NormCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("l2norm", "cuda.rowwise", kTol, true, true);
}

// Deliberately wrong CUDA implementations built from the real one: eps 1e4 times too large
// (visible on the probe's all-zero and tiny rows), and a backward with y and dy swapped.
const L2NormTable* real_table() { return cuda_table<L2NormTable>("l2norm", "cuda.rowwise"); }
void real_forward(const L2NormFwd& a) { real_table()->forward(a); }
void real_backward(const L2NormBwd& a) { real_table()->backward(a); }
void wrong_eps_forward(const L2NormFwd& a) {
  L2NormFwd b = a;
  b.eps = a.eps * 1e4;
  real_table()->forward(b);
}
void swapped_backward(const L2NormBwd& a) {
  L2NormBwd b = a;
  std::swap(b.y, b.dy);
  real_table()->backward(b);
}
const L2NormTable kWrongFwd{wrong_eps_forward, real_backward};
const L2NormTable kWrongBwd{real_forward, swapped_backward};

TEST_F(L2NormCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << "cuda.rowwise is not registered";
  expect_probe_rejects("l2norm", "cuda.rowwise",
                       {{"cuda.wrong_eps", &kWrongFwd}, {"cuda.wrong_dx", &kWrongBwd}});
}

TEST_F(L2NormCuda, OpsRunOnCudaBackend) {
  const int64_t R = 6, D = 40;
  OwnedTensor x = scaled_rows(R, D, 41), dy = randn_as({R, D}, 42, DType::BF16);
  Out ref = run_ref(x, dy);
  OwnedTensor xf = convert(x, DType::F32), dyf = convert(dy, DType::F32);
  OpsRunOnCuda run("l2norm", {{"x", xf}, {"dy", dyf}}, true);
  EXPECT_EQ(run.result().impl, "cuda.rowwise");
  expect_close(run.load("y"), ref.y, kTol.fwd, "y (ops run)");
  expect_close(run.load("rstd"), ref.rstd, kTol.fwd, "rstd (ops run)");
  expect_close(run.load("dx"), ref.dx, kTol.bwd, "dx (ops run)");
}

TEST_F(L2NormCuda, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto y = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto r16 = OwnedTensor::zeros(DType::BF16, {4}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              l2norm_forward({x, y, r16, 1e-6});
            }).find("tensor 'rstd' has dtype BF16, expected F32"),
            std::string::npos);
  auto r = OwnedTensor::zeros(DType::F32, {4}, Device::CUDA);
  auto y_host = OwnedTensor::zeros(DType::BF16, {4, 8});
  EXPECT_NE(error_of([&] {
              l2norm_forward({x, y_host, r, 1e-6});
            }).find("l2norm: all tensors must be on cuda"),
            std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
