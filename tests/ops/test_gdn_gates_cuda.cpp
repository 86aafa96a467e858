// GDN gates on CUDA (label gpu): cuda vs ref over swept shapes (g, beta; da, db, dA_log,
// ddt_bias), a + dt_bias over a wide range including both sides of the softplus threshold and the
// underflow region, b saturating, dA_log / ddt_bias accumulated (+=) and bitwise deterministic,
// the resolver's choice and probe, `ops run` on the cuda backend, and bad input. Tolerances come
// from src/backend/tolerances.h (the fp32 per-head sums are held to a tighter 1e-4).
#include <cmath>

#include "backend/tolerances.h"
#include "ops/cuda_test_util.h"
#include "ops/gdn_gates/op.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("gdn_gates");
constexpr double kTolSums = 1e-4;  // dA_log, ddt_bias: fp32 sums of fp32 terms over T tokens

class GdnGatesCuda : public CudaOpTest {};

// F64 host values rounded to their device dtypes: a, b bf16; the rest fp32.
struct Inputs {
  OwnedTensor a, b, A_log, dt_bias, dg, dbeta;
};

Inputs make_inputs(int64_t T, int64_t H, uint64_t seed, double a_std = 3.0) {
  return {randn_as({T, H}, seed, DType::BF16, a_std),
          randn_as({T, H}, seed + 1, DType::BF16, 3.0),
          randu_as({H}, seed + 2, DType::F32, std::log(0.5), std::log(16.0)),
          randn_as({H}, seed + 3, DType::F32, 1.0, 1.0),
          randn_as({T, H}, seed + 4, DType::F32),
          randn_as({T, H}, seed + 5, DType::F32)};
}

struct Out {
  OwnedTensor g, beta, da, db, dA_log, ddt_bias;
};

Out run_ref(const Inputs& in, const Tensor* dA0 = nullptr, const Tensor* ddt0 = nullptr) {
  const int64_t T = in.a.view().size(0), H = in.a.view().size(1);
  Out o{OwnedTensor::zeros(DType::F64, {T, H}),
        OwnedTensor::zeros(DType::F64, {T, H}),
        OwnedTensor::zeros(DType::F64, {T, H}),
        OwnedTensor::zeros(DType::F64, {T, H}),
        dA0 ? convert(*dA0, DType::F64) : OwnedTensor::zeros(DType::F64, {H}),
        ddt0 ? convert(*ddt0, DType::F64) : OwnedTensor::zeros(DType::F64, {H})};
  gdn_gates_forward({in.a, in.b, in.A_log, in.dt_bias, o.g, o.beta});
  gdn_gates_backward(
      {in.a, in.b, in.A_log, in.dt_bias, in.dg, in.dbeta, o.da, o.db, o.dA_log, o.ddt_bias});
  return o;
}

struct Dev {
  OwnedTensor a, b, A_log, dt_bias, dg, dbeta;
};
Dev to_device(const Inputs& in) {
  return {to_dev(in.a, DType::BF16),      to_dev(in.b, DType::BF16), to_dev(in.A_log, DType::F32),
          to_dev(in.dt_bias, DType::F32), to_dev(in.dg, DType::F32), to_dev(in.dbeta, DType::F32)};
}

Out run_cuda(const Dev& d, const Tensor* dA0 = nullptr, const Tensor* ddt0 = nullptr) {
  const int64_t T = d.a.view().size(0), H = d.a.view().size(1);
  Out o{poisoned(DType::F32, {T, H}),
        poisoned(DType::F32, {T, H}),
        poisoned(DType::BF16, {T, H}),
        poisoned(DType::BF16, {T, H}),
        dA0 ? to_dev(*dA0, DType::F32) : OwnedTensor::zeros(DType::F32, {H}, Device::CUDA),
        ddt0 ? to_dev(*ddt0, DType::F32) : OwnedTensor::zeros(DType::F32, {H}, Device::CUDA)};
  gdn_gates_forward({d.a, d.b, d.A_log, d.dt_bias, o.g, o.beta});
  gdn_gates_backward(
      {d.a, d.b, d.A_log, d.dt_bias, d.dg, d.dbeta, o.da, o.db, o.dA_log, o.ddt_bias});
  return o;
}

void compare(const Out& c, const Out& ref, const std::string& tag = "") {
  expect_close(c.g, ref.g, kTol.fwd, "g" + tag);
  expect_close(c.beta, ref.beta, kTol.fwd, "beta" + tag);
  expect_close(c.da, ref.da, kTol.bwd, "da" + tag);
  expect_close(c.db, ref.db, kTol.bwd, "db" + tag);
  expect_close(c.dA_log, ref.dA_log, kTolSums, "dA_log" + tag);
  expect_close(c.ddt_bias, ref.ddt_bias, kTolSums, "ddt_bias" + tag);
}

struct Shape {
  int64_t T, H;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << "[" << s.T << ", " << s.H << "]"; }
// One token; partial and whole 64-token tiles; Hv below, at and above one 32-head block; the
// model's [8192, 32].
const Shape kShapes[] = {{1, 1},     {7, 5},    {41, 5},  {64, 32},  {65, 32},
                         {1000, 16}, {129, 48}, {33, 70}, {8192, 32}};

class GdnGatesCudaSweep : public GdnGatesCuda, public ::testing::WithParamInterface<Shape> {};

TEST_P(GdnGatesCudaSweep, MatchesRef) {
  const Shape s = GetParam();
  Inputs in = make_inputs(s.T, s.H, 100 + static_cast<uint64_t>(s.T * 7 + s.H));
  compare(run_cuda(to_device(in)), run_ref(in));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdnGatesCudaSweep, ::testing::ValuesIn(kShapes),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.T) + "_H" +
                                  std::to_string(info.param.H);
                         });

TEST_F(GdnGatesCuda, WideRangeAndTheSoftplusThreshold) {
  // a + dt_bias over ~[-75, 75]; head 2 has dt_bias = 0 and a on both sides of 20 (bf16 spacing
  // there is 0.125) and deep in the underflow region; b saturates on head 1.
  const int64_t T = 300, H = 4;
  Inputs in = make_inputs(T, H, 7, 25.0);
  auto dt = to_f64_vector(in.dt_bias);
  dt[2] = 0.0;
  in.dt_bias = from_f64(dt, DType::F64, {H});
  auto a = to_f64_vector(in.a), b = to_f64_vector(in.b);
  const double special_a[] = {19.75, 19.875, 20.0, 20.125, 20.25, 35.0, -40.0, -120.0, -1e4};
  for (size_t k = 0; k < std::size(special_a); ++k) a[(5 + 3 * k) * H + 2] = special_a[k];
  const double special_b[] = {-30.0, 30.0, -100.0, 100.0, -1e4, 1e4};
  for (size_t k = 0; k < std::size(special_b); ++k) b[(2 + 5 * k) * H + 1] = special_b[k];
  in.a = rounded(from_f64(a, DType::F64, {T, H}), DType::BF16);
  in.b = rounded(from_f64(b, DType::F64, {T, H}), DType::BF16);
  compare(run_cuda(to_device(in)), run_ref(in), " (wide range)");
}

TEST_F(GdnGatesCuda, UnalignedTensorsTakeTheElementwiseForward) {
  // The forward takes 4 elements a thread when a and b are 8-byte and g and beta 16-byte aligned;
  // else one element a thread. Each of the four misaligned in turn, and all aligned, at a width
  // that is no multiple of 4 (the quads cross rows, and the last one is partial).
  const int64_t T = 37, H = 7;
  Inputs in = make_inputs(T, H, 31);
  const Out ref = run_ref(in);
  const Dev d = to_device(in);
  for (int which = 0; which < 5; ++which) {
    std::vector<OwnedTensor> keep;
    Tensor a = which == 0 ? unaligned_copy(d.a, 2, keep) : d.a.view();
    Tensor b = which == 1 ? unaligned_copy(d.b, 2, keep) : d.b.view();
    OwnedTensor g0 = poisoned(DType::F32, {T, H}), beta0 = poisoned(DType::F32, {T, H});
    Tensor g = which == 2 ? unaligned_copy(g0, 4, keep) : g0.view();
    Tensor beta = which == 3 ? unaligned_copy(beta0, 8, keep) : beta0.view();
    gdn_gates_forward({a, b, d.A_log, d.dt_bias, g, beta});
    const std::string tag = " (misaligned: " + std::to_string(which) + ")";
    expect_close(g, ref.g, kTol.fwd, "g" + tag);
    expect_close(beta, ref.beta, kTol.fwd, "beta" + tag);
  }
}

TEST_F(GdnGatesCuda, BackwardAccumulatesAndIsDeterministic) {
  const int64_t T = 8192, H = 32;
  Inputs in = make_inputs(T, H, 21);
  OwnedTensor dA0 = randn_as({H}, 22, DType::F32, 50.0), ddt0 = randn_as({H}, 23, DType::F32, 50.0);
  Out ref = run_ref(in, &dA0.view(), &ddt0.view());
  Dev d = to_device(in);
  Out c = run_cuda(d, &dA0.view(), &ddt0.view());
  compare(c, ref, " (accumulated)");
  for (int rep = 0; rep < 3; ++rep) {
    Out again = run_cuda(d, &dA0.view(), &ddt0.view());
    const std::string r = " (rep " + std::to_string(rep) + ")";
    expect_bitwise_equal(again.da, c.da, "da" + r);
    expect_bitwise_equal(again.dA_log, c.dA_log, "dA_log" + r);
    expect_bitwise_equal(again.ddt_bias, c.ddt_bias, "ddt_bias" + r);
  }
}

TEST_F(GdnGatesCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("gdn_gates", "cuda.elementwise", kTol, true, true);
}

// Deliberately wrong CUDA implementations built from the real one: a and b swapped, and a backward
// that forgets to accumulate dA_log.
const GdnGatesTable* real_table() {
  return cuda_table<GdnGatesTable>("gdn_gates", "cuda.elementwise");
}
void real_forward(const GdnGatesFwd& a) { real_table()->forward(a); }
void real_backward(const GdnGatesBwd& a) { real_table()->backward(a); }
void swapped_forward(const GdnGatesFwd& a) {
  GdnGatesFwd b = a;
  std::swap(b.a, b.b);
  real_table()->forward(b);
}
void lost_dA_backward(const GdnGatesBwd& a) {
  OwnedTensor junk = OwnedTensor::zeros(DType::F32, {a.dA_log.size(0)}, Device::CUDA);
  GdnGatesBwd b = a;
  b.dA_log = junk;
  real_table()->backward(b);
  device_synchronize(Device::CUDA);  // junk is freed on return
}
const GdnGatesTable kWrongFwd{swapped_forward, real_backward};
const GdnGatesTable kWrongBwd{real_forward, lost_dA_backward};

TEST_F(GdnGatesCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << "cuda.elementwise is not registered";
  expect_probe_rejects("gdn_gates", "cuda.elementwise",
                       {{"cuda.wrong_ab", &kWrongFwd}, {"cuda.wrong_dA_log", &kWrongBwd}});
}

TEST_F(GdnGatesCuda, OpsRunOnCudaBackend) {
  const int64_t T = 9, H = 3;
  Inputs in = make_inputs(T, H, 41);
  Out ref = run_ref(in);
  std::vector<OwnedTensor> f32;
  for (const OwnedTensor* t : {&in.a, &in.b, &in.A_log, &in.dt_bias, &in.dg, &in.dbeta})
    f32.push_back(convert(*t, DType::F32));
  OpsRunOnCuda run("gdn_gates",
                   {{"a", f32[0]},
                    {"b", f32[1]},
                    {"A_log", f32[2]},
                    {"dt_bias", f32[3]},
                    {"dg", f32[4]},
                    {"dbeta", f32[5]}},
                   true);
  EXPECT_EQ(run.result().impl, "cuda.elementwise");
  expect_close(run.load("g"), ref.g, kTol.fwd, "g (ops run)");
  expect_close(run.load("beta"), ref.beta, kTol.fwd, "beta (ops run)");
  expect_close(run.load("da"), ref.da, kTol.bwd, "da (ops run)");
  expect_close(run.load("db"), ref.db, kTol.bwd, "db (ops run)");
  expect_close(run.load("dA_log"), ref.dA_log, kTolSums, "dA_log (ops run)");
  expect_close(run.load("ddt_bias"), ref.ddt_bias, kTolSums, "ddt_bias (ops run)");
}

TEST_F(GdnGatesCuda, BadInputIsAClearError) {
  auto a = OwnedTensor::zeros(DType::BF16, {4, 2}, Device::CUDA);
  auto b = OwnedTensor::zeros(DType::BF16, {4, 2}, Device::CUDA);
  auto A16 = OwnedTensor::zeros(DType::BF16, {2}, Device::CUDA);
  auto dtb = OwnedTensor::zeros(DType::F32, {2}, Device::CUDA);
  auto g = OwnedTensor::zeros(DType::F32, {4, 2}, Device::CUDA);
  auto beta = OwnedTensor::zeros(DType::F32, {4, 2}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              gdn_gates_forward({a, b, A16, dtb, g, beta});
            }).find("tensor 'A_log' has dtype BF16, expected F32"),
            std::string::npos);
  auto A = OwnedTensor::zeros(DType::F32, {2}, Device::CUDA);
  auto g16 = OwnedTensor::zeros(DType::BF16, {4, 2}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              gdn_gates_forward({a, b, A, dtb, g16, beta});
            }).find("tensor 'g' has dtype BF16, expected F32"),
            std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
