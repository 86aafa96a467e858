// SwiGLU on CUDA (label gpu): cuda vs ref over swept sizes (every n % 8 tail, one element, widths
// of the MLP), gates from saturated negative to saturated positive, y within half a bf16 ulp of the
// fp64 value, the in-place backward (dgate over gate, dup over up) bitwise equal to the
// out-of-place one, the scalar path for unaligned tensors, the resolver's choice and probe,
// `ops run` on the cuda backend, and bad input. Tolerances come from src/backend/tolerances.h.
#include <cmath>

#include "backend/tolerances.h"
#include "ops/cuda_test_util.h"
#include "ops/swiglu/op.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("swiglu");

class SwigluCuda : public CudaOpTest {};

struct Inputs {
  OwnedTensor gate, up, dy;  // F64 host, bf16 values
};

// Gates mostly in [-6, 6] with every 11th element at a saturating +-30 / +-100.
Inputs make_inputs(int64_t R, int64_t I, uint64_t seed) {
  auto g = to_f64_vector(randn({R, I}, seed, 3.0));
  for (size_t i = 0; i < g.size(); i += 11)
    g[i] = (i / 11) % 4 == 0   ? 30.0
           : (i / 11) % 4 == 1 ? -30.0
           : (i / 11) % 4 == 2 ? 100.0
                               : -100.0;
  return {rounded(from_f64(g, DType::F64, {R, I}), DType::BF16),
          randn_as({R, I}, seed + 1, DType::BF16, 1.5), randn_as({R, I}, seed + 2, DType::BF16)};
}

struct Out {
  OwnedTensor y, dgate, dup;
};

Out run_ref(const Inputs& in) {
  const int64_t R = in.gate.view().size(0), I = in.gate.view().size(1);
  Out o{OwnedTensor::zeros(DType::F64, {R, I}), OwnedTensor::zeros(DType::F64, {R, I}),
        OwnedTensor::zeros(DType::F64, {R, I})};
  swiglu_forward({in.gate, in.up, o.y});
  swiglu_backward({in.gate, in.up, in.dy, o.dgate, o.dup});
  return o;
}

Out run_cuda(const Tensor& gate, const Tensor& up, const Tensor& dy) {
  const int64_t R = gate.size(0), I = gate.size(1);
  Out o{poisoned(DType::BF16, {R, I}), poisoned(DType::BF16, {R, I}),
        poisoned(DType::BF16, {R, I})};
  swiglu_forward({gate, up, o.y});
  swiglu_backward({gate, up, dy, o.dgate, o.dup});
  return o;
}

// y is computed in fp32 and rounded once: within half a bf16 ulp of the fp64 value (plus fp32
// noise), element by element.
void expect_within_half_ulp(const Tensor& got, const Tensor& want, const std::string& what) {
  auto g = to_f64_vector(got), w = to_f64_vector(want);
  ASSERT_EQ(g.size(), w.size());
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double lim = std::ldexp(std::abs(w[i]), -8) * (1 + 1e-4) + 1e-30;
    if (!(std::abs(g[i] - w[i]) <= lim) && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "] = " << g[i] << ", ref " << w[i];
  }
  EXPECT_EQ(bad, 0) << "elements of " << what << " off by more than half a bf16 ulp";
}

struct Shape {
  int64_t R, I;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << "[" << s.R << ", " << s.I << "]"; }
// n = R * I covering every n % 8 tail, one element, one block, several blocks, and MLP widths.
const Shape kShapes[] = {{1, 1},     {1, 7},     {1, 8},    {1, 9},    {3, 5},
                         {2, 13},    {5, 97},    {1, 1024}, {3, 1025}, {7, 4099},
                         {4, 12288}, {33, 1031}, {64, 4096}};

class SwigluCudaSweep : public SwigluCuda, public ::testing::WithParamInterface<Shape> {};

TEST_P(SwigluCudaSweep, MatchesRef) {
  const Shape s = GetParam();
  Inputs in = make_inputs(s.R, s.I, 100 + static_cast<uint64_t>(s.R * s.I));
  Out ref = run_ref(in);
  Out c = run_cuda(to_dev(in.gate, DType::BF16), to_dev(in.up, DType::BF16),
                   to_dev(in.dy, DType::BF16));
  expect_close(c.y, ref.y, kTol.fwd, "y");
  expect_within_half_ulp(c.y, ref.y, "y");
  expect_close(c.dgate, ref.dgate, kTol.bwd, "dgate");
  expect_close(c.dup, ref.dup, kTol.bwd, "dup");
}

INSTANTIATE_TEST_SUITE_P(Shapes, SwigluCudaSweep, ::testing::ValuesIn(kShapes),
                         [](const auto& info) {
                           return "R" + std::to_string(info.param.R) + "_I" +
                                  std::to_string(info.param.I);
                         });

TEST_F(SwigluCuda, InPlaceBackwardEqualsOutOfPlace) {
  for (const Shape s : {Shape{3, 1025}, Shape{16, 4096}}) {
    Inputs in = make_inputs(s.R, s.I, 7);
    OwnedTensor gate = to_dev(in.gate, DType::BF16), up = to_dev(in.up, DType::BF16),
                dy = to_dev(in.dy, DType::BF16);
    Out c = run_cuda(gate, up, dy);
    swiglu_backward({gate, up, dy, gate, up});  // dgate over gate, dup over up
    expect_bitwise_equal(gate, c.dgate, "in-place dgate");
    expect_bitwise_equal(up, c.dup, "in-place dup");
  }
}

TEST_F(SwigluCuda, UnalignedTensorsTakeTheScalarPath) {
  const int64_t R = 5, I = 1024;
  Inputs in = make_inputs(R, I, 31);
  Out ref = run_ref(in);
  std::vector<OwnedTensor> keep;
  OwnedTensor g = to_dev(in.gate, DType::BF16), u = to_dev(in.up, DType::BF16),
              d = to_dev(in.dy, DType::BF16);
  Tensor gu = unaligned_copy(g, 2, keep), uu = unaligned_copy(u, 2, keep),
         du = unaligned_copy(d, 2, keep);
  Tensor y = unaligned_copy(poisoned(DType::BF16, {R, I}), 2, keep),
         dg = unaligned_copy(poisoned(DType::BF16, {R, I}), 2, keep),
         dp = unaligned_copy(poisoned(DType::BF16, {R, I}), 2, keep);
  swiglu_forward({gu, uu, y});
  swiglu_backward({gu, uu, du, dg, dp});
  expect_close(y, ref.y, kTol.fwd, "y (unaligned)");
  expect_close(dg, ref.dgate, kTol.bwd, "dgate (unaligned)");
  expect_close(dp, ref.dup, kTol.bwd, "dup (unaligned)");
  // And in place on the unaligned buffers.
  swiglu_backward({gu, uu, du, gu, uu});
  expect_bitwise_equal(gu, dg, "in-place dgate (unaligned)");
  expect_bitwise_equal(uu, dp, "in-place dup (unaligned)");
}

TEST_F(SwigluCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("swiglu", "cuda.elementwise", kTol, true, true);
}

// Deliberately wrong CUDA implementations built from the real one: gate and up swapped, and
// dgate / dup written to each other's place.
const SwigluTable* real_table() { return cuda_table<SwigluTable>("swiglu", "cuda.elementwise"); }
void real_forward(const SwigluFwd& a) { real_table()->forward(a); }
void real_backward(const SwigluBwd& a) { real_table()->backward(a); }
void swapped_forward(const SwigluFwd& a) {
  SwigluFwd b = a;
  std::swap(b.gate, b.up);
  real_table()->forward(b);
}
void swapped_backward(const SwigluBwd& a) {
  SwigluBwd b = a;
  std::swap(b.dgate, b.dup);
  real_table()->backward(b);
}
const SwigluTable kWrongFwd{swapped_forward, real_backward};
const SwigluTable kWrongBwd{real_forward, swapped_backward};

TEST_F(SwigluCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << "cuda.elementwise is not registered";
  expect_probe_rejects("swiglu", "cuda.elementwise",
                       {{"cuda.wrong_y", &kWrongFwd}, {"cuda.wrong_grads", &kWrongBwd}});
}

TEST_F(SwigluCuda, OpsRunOnCudaBackend) {
  const int64_t R = 6, I = 37;
  Inputs in = make_inputs(R, I, 41);
  Out ref = run_ref(in);
  OwnedTensor g = convert(in.gate, DType::F32), u = convert(in.up, DType::F32),
              d = convert(in.dy, DType::F32);
  OpsRunOnCuda run("swiglu", {{"gate", g}, {"up", u}, {"dy", d}}, true);
  EXPECT_EQ(run.result().impl, "cuda.elementwise");
  expect_close(run.load("y"), ref.y, kTol.fwd, "y (ops run)");
  expect_close(run.load("dgate"), ref.dgate, kTol.bwd, "dgate (ops run)");
  expect_close(run.load("dup"), ref.dup, kTol.bwd, "dup (ops run)");
}

TEST_F(SwigluCuda, BadInputIsAClearError) {
  auto g = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto u = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto y32 = OwnedTensor::zeros(DType::F32, {4, 8}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              swiglu_forward({g, u, y32});
            }).find("tensor 'y' has dtype F32, expected BF16"),
            std::string::npos);
  auto dy = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto out = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              swiglu_backward({g, u, dy, u, out});
            }).find("tensor 'dgate' may alias only 'gate', not 'up'"),
            std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
