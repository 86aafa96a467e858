// Gated RMSNorm on CUDA (label gpu): cuda vs ref over swept shapes (y, rstd; dx, dz, dw), rows of
// very different scales including all-zero rows, gates from deep negative to saturated, the
// 16-byte and scalar paths, rows wider than the register-held part, dw accumulated (+=) and
// bitwise deterministic, the resolver's choice and probe, `ops run` on the cuda backend, and bad
// input. Tolerances come from src/backend/tolerances.h.
#include <algorithm>
#include <cmath>

#include "backend/tolerances.h"
#include "ops/cuda_test_util.h"
#include "ops/gated_rmsnorm/op.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("gated_rmsnorm");

class GatedRmsNormCuda : public CudaOpTest {};

// The implementations under test, each called through its own table (the sweep, the saturated
// gates, the dw accumulation and determinism, the scalar path), and the resolver's choice.
const char* const kImpls[] = {"cuda.rowwise_prefetch"};
const char* const kChosen = "cuda.rowwise_prefetch";

const GatedRmsNormTable& impl_table(const std::string& name) {
  const GatedRmsNormTable* t = cuda_table<GatedRmsNormTable>("gated_rmsnorm", name);
  GDN_CHECK(t != nullptr, "gated_rmsnorm implementation {} is not registered", name);
  return *t;
}

// Host F64 inputs rounded to bf16: x rows of scale 10^((i % 5) - 2) with every 7th row zero,
// gates z in [-12, 12] (both saturated ends of sigmoid and the silu minimum), w around 1.
struct Inputs {
  OwnedTensor x, z, w, dy;
};

Inputs make_inputs(int64_t R, int64_t D, uint64_t seed) {
  auto v = to_f64_vector(randn({R, D}, seed));
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < D; ++j)
      v[static_cast<size_t>(i * D + j)] *=
          i % 7 == 3 ? 0.0 : std::pow(10.0, static_cast<double>(i % 5) - 2.0);
  return {rounded(from_f64(v, DType::F64, {R, D}), DType::BF16),
          randu_as({R, D}, seed + 1, DType::BF16, -12.0, 12.0),
          randu_as({D}, seed + 2, DType::BF16, 0.5, 1.5), randn_as({R, D}, seed + 3, DType::BF16)};
}

struct Out {
  OwnedTensor y, rstd, dx, dz, dw;
};

Out run_ref(const Inputs& in, const Tensor* dw0 = nullptr) {
  const int64_t R = in.x.view().size(0), D = in.x.view().size(1);
  Out o{OwnedTensor::zeros(DType::F64, {R, D}), OwnedTensor::zeros(DType::F64, {R}),
        OwnedTensor::zeros(DType::F64, {R, D}), OwnedTensor::zeros(DType::F64, {R, D}),
        dw0 ? convert(*dw0, DType::F64) : OwnedTensor::zeros(DType::F64, {D})};
  gated_rmsnorm_forward({in.x, in.z, in.w, o.y, o.rstd, 1e-6});
  gated_rmsnorm_backward({in.x, in.z, in.w, o.rstd, in.dy, o.dx, o.dz, o.dw});
  return o;
}

struct Dev {
  OwnedTensor x, z, w, dy;
};
Dev to_device(const Inputs& in) {
  return {to_dev(in.x, DType::BF16), to_dev(in.z, DType::BF16), to_dev(in.w, DType::BF16),
          to_dev(in.dy, DType::BF16)};
}

Out run_cuda(const Dev& d, const std::string& impl, const Tensor* dw0 = nullptr) {
  const int64_t R = d.x.view().size(0), D = d.x.view().size(1);
  Out o{poisoned(DType::BF16, {R, D}), poisoned(DType::F32, {R}), poisoned(DType::BF16, {R, D}),
        poisoned(DType::BF16, {R, D}),
        dw0 ? to_dev(*dw0, DType::F32) : OwnedTensor::zeros(DType::F32, {D}, Device::CUDA)};
  const GatedRmsNormTable& t = impl_table(impl);
  t.forward({d.x, d.z, d.w, o.y, o.rstd, 1e-6});
  t.backward({d.x, d.z, d.w, o.rstd, d.dy, o.dx, o.dz, o.dw});
  return o;
}

// dx = r (g w - xhat m) with g = dy silu(z) cancels to ~0 when D = 1 (xhat = +-1): it is measured
// against the norm of its first term, r g w.
double dx_scale(const Inputs& in, const Out& ref) {
  const int64_t R = in.x.view().size(0), D = in.x.view().size(1);
  auto z = to_f64_vector(in.z), w = to_f64_vector(in.w), dy = to_f64_vector(in.dy),
       r = to_f64_vector(ref.rstd);
  double s = 0;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < D; ++j) {
      const size_t k = static_cast<size_t>(i * D + j);
      const double zz = z[k], t = r[static_cast<size_t>(i)] * dy[k] * zz / (1 + std::exp(-zz)) *
                                  w[static_cast<size_t>(j)];
      s += t * t;
    }
  return std::sqrt(s);
}

void compare(const Out& c, const Out& ref, const Inputs& in, const std::string& tag = "") {
  expect_close(c.y, ref.y, kTol.fwd, "y" + tag);
  expect_close(c.rstd, ref.rstd, kTol.fwd, "rstd" + tag);
  expect_close(c.dx, ref.dx, kTol.bwd, "dx" + tag, dx_scale(in, ref));
  expect_close(c.dz, ref.dz, kTol.bwd, "dz" + tag);
  expect_close(c.dw, ref.dw, kTol.bwd, "dw" + tag);
}

struct Shape {
  int64_t R, D;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << "[" << s.R << ", " << s.D << "]"; }
// One row; odd and tiny widths (scalar path); D % 8 == 0 from one pack per row to the register
// limit (4096) and past it (12288: re-read columns, dw straight into the partial row); scalar rows
// past their limit (2053, 9001); many rows (several grid-stride turns of the persistent
// backward); the GDN width 128.
const Shape kShapes[] = {{1, 1},     {1, 7},      {3, 97},    {1, 8},      {5, 16},
                         {9, 128},   {4099, 128}, {33, 1000}, {257, 1031}, {5, 4096},
                         {3, 12288}, {4, 2053},   {2, 9001},  {70000, 64}};

class GatedRmsNormCudaSweep : public GatedRmsNormCuda,
                              public ::testing::WithParamInterface<Shape> {};

TEST_P(GatedRmsNormCudaSweep, MatchesRef) {
  const Shape s = GetParam();
  Inputs in = make_inputs(s.R, s.D, 100 + static_cast<uint64_t>(s.D));
  Out ref = run_ref(in);
  for (const std::string impl : kImpls) {
    SCOPED_TRACE(impl);
    compare(run_cuda(to_device(in), impl), ref, in, " (" + impl + ")");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GatedRmsNormCudaSweep, ::testing::ValuesIn(kShapes),
                         [](const auto& info) {
                           return "R" + std::to_string(info.param.R) + "_D" +
                                  std::to_string(info.param.D);
                         });

TEST_F(GatedRmsNormCuda, SaturatedGatesStayFinite) {
  // z = +-100: sigmoid saturates to exactly 1 or 0 in fp32; y, dx, dz must stay finite and match.
  const int64_t R = 4, D = 128;
  Inputs in = make_inputs(R, D, 7);
  auto zv = to_f64_vector(in.z);
  for (size_t i = 0; i < zv.size(); ++i) zv[i] = i % 3 == 0 ? 100.0 : i % 3 == 1 ? -100.0 : zv[i];
  in.z = from_f64(zv, DType::F64, {R, D});
  Out ref = run_ref(in);
  for (const std::string impl : kImpls)
    compare(run_cuda(to_device(in), impl), ref, in, " (saturated gates, " + impl + ")");
}

TEST_F(GatedRmsNormCuda, BackwardAccumulatesDwAndIsDeterministic) {
  const int64_t R = 3000, D = 128;
  Inputs in = make_inputs(R, D, 21);
  OwnedTensor dw0 = rounded(randn({D}, 24, 5.0), DType::F32);
  Out ref = run_ref(in, &dw0.view());
  Dev d = to_device(in);
  for (const std::string impl : kImpls) {
    SCOPED_TRACE(impl);
    Out c = run_cuda(d, impl, &dw0.view());
    // dw = dw0 + sum: the error is measured against the added part.
    auto got = to_f64_vector(c.dw), base = to_f64_vector(dw0), want = to_f64_vector(ref.dw);
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      num += (got[i] - want[i]) * (got[i] - want[i]);
      den += (want[i] - base[i]) * (want[i] - base[i]);
    }
    EXPECT_LE(std::sqrt(num / den), kTol.bwd) << "dw after += (error relative to the added part)";
    for (int rep = 0; rep < 3; ++rep) {
      Out again = run_cuda(d, impl, &dw0.view());
      expect_bitwise_equal(again.dx, c.dx, "dx (rep " + std::to_string(rep) + ")");
      expect_bitwise_equal(again.dz, c.dz, "dz (rep " + std::to_string(rep) + ")");
      expect_bitwise_equal(again.dw, c.dw, "dw (rep " + std::to_string(rep) + ")");
    }
  }
}

TEST_F(GatedRmsNormCuda, UnalignedTensorsTakeTheScalarPath) {
  const int64_t R = 9, D = 256;  // D % 8 == 0: only the 2-byte offset forces the scalar path
  Inputs in = make_inputs(R, D, 31);
  Out ref = run_ref(in);
  Dev d = to_device(in);
  std::vector<OwnedTensor> keep;
  Tensor x = unaligned_copy(d.x, 2, keep), z = unaligned_copy(d.z, 2, keep),
         dy = unaligned_copy(d.dy, 2, keep);
  for (const std::string impl : kImpls) {
    SCOPED_TRACE(impl);
    Tensor y = unaligned_copy(poisoned(DType::BF16, {R, D}), 2, keep),
           dx = unaligned_copy(poisoned(DType::BF16, {R, D}), 2, keep),
           dz = unaligned_copy(poisoned(DType::BF16, {R, D}), 2, keep);
    OwnedTensor rstd = poisoned(DType::F32, {R}),
                dw = OwnedTensor::zeros(DType::F32, {D}, Device::CUDA);
    const GatedRmsNormTable& t = impl_table(impl);
    t.forward({x, z, d.w, y, rstd, 1e-6});
    t.backward({x, z, d.w, rstd, dy, dx, dz, dw});
    expect_close(y, ref.y, kTol.fwd, "y (unaligned)");
    expect_close(rstd, ref.rstd, kTol.fwd, "rstd (unaligned)");
    expect_close(dx, ref.dx, kTol.bwd, "dx (unaligned)", dx_scale(in, ref));
    expect_close(dz, ref.dz, kTol.bwd, "dz (unaligned)");
    expect_close(dw, ref.dw, kTol.bwd, "dw (unaligned)");
  }
}

TEST_F(GatedRmsNormCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("gated_rmsnorm", kChosen, kTol, true, true);
}

// Deliberately wrong CUDA implementations built from the real one: x and z swapped (normalising
// the gate), and a backward that forgets to accumulate dw.
const GatedRmsNormTable* real_table() {
  return cuda_table<GatedRmsNormTable>("gated_rmsnorm", kChosen);
}
void real_forward(const GatedRmsNormFwd& a) { real_table()->forward(a); }
void real_backward(const GatedRmsNormBwd& a) { real_table()->backward(a); }
void swapped_forward(const GatedRmsNormFwd& a) {
  GatedRmsNormFwd b = a;
  std::swap(b.x, b.z);
  real_table()->forward(b);
}
void lost_dw_backward(const GatedRmsNormBwd& a) {
  OwnedTensor junk = OwnedTensor::zeros(DType::F32, {a.dw.size(0)}, Device::CUDA);
  GatedRmsNormBwd b = a;
  b.dw = junk;
  real_table()->backward(b);
  device_synchronize(Device::CUDA);  // junk is freed on return
}
const GatedRmsNormTable kWrongFwd{swapped_forward, real_backward};
const GatedRmsNormTable kWrongBwd{real_forward, lost_dw_backward};

TEST_F(GatedRmsNormCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << kChosen << " is not registered";
  expect_probe_rejects("gated_rmsnorm", kChosen,
                       {{"cuda.wrong_xz", &kWrongFwd}, {"cuda.wrong_dw", &kWrongBwd}});
}

TEST_F(GatedRmsNormCuda, OpsRunOnCudaBackend) {
  const int64_t T = 3, H = 2, D = 40;  // [T, Hv, dv] in the file, rows = T * Hv
  Inputs in = make_inputs(T * H, D, 41);
  Out ref = run_ref(in);
  OwnedTensor x = convert(in.x, DType::F32), z = convert(in.z, DType::F32),
              w = convert(in.w, DType::F32), dy = convert(in.dy, DType::F32);
  OpsRunOnCuda run("gated_rmsnorm",
                   {{"x", x.view().reshape({T, H, D})},
                    {"z", z.view().reshape({T, H, D})},
                    {"w", w},
                    {"dy", dy.view().reshape({T, H, D})}},
                   true);
  EXPECT_EQ(run.result().impl, kChosen);
  expect_close(run.load("y"), ref.y, kTol.fwd, "y (ops run)");
  expect_close(run.load("rstd"), ref.rstd, kTol.fwd, "rstd (ops run)");
  expect_close(run.load("dx"), ref.dx, kTol.bwd, "dx (ops run)", dx_scale(in, ref));
  expect_close(run.load("dz"), ref.dz, kTol.bwd, "dz (ops run)");
  expect_close(run.load("dw"), ref.dw, kTol.bwd, "dw (ops run)");
}

TEST_F(GatedRmsNormCuda, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto z = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto w = OwnedTensor::zeros(DType::BF16, {8}, Device::CUDA);
  auto y = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto r16 = OwnedTensor::zeros(DType::BF16, {4}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              gated_rmsnorm_forward({x, z, w, y, r16, 1e-6});
            }).find("tensor 'rstd' has dtype BF16, expected F32"),
            std::string::npos);
  auto r = OwnedTensor::zeros(DType::F32, {4}, Device::CUDA);
  auto z_short = OwnedTensor::zeros(DType::BF16, {3, 8}, Device::CUDA);
  EXPECT_NE(error_of([&] {
              gated_rmsnorm_forward({x, z_short, w, y, r, 1e-6});
            }).find("tensor 'z' has shape [3, 8], expected [4, 8]"),
            std::string::npos);
  auto w_host = OwnedTensor::zeros(DType::BF16, {8});
  EXPECT_NE(error_of([&] {
              gated_rmsnorm_forward({x, z, w_host, y, r, 1e-6});
            }).find("gated_rmsnorm: all tensors must be on cuda"),
            std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
