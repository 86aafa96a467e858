// Gated RMSNorm: cpu vs ref over swept shapes, finite-difference checks of ref, agreement with
// plain rmsnorm times silu(z) (norm before gate), dw accumulation, written dx/dz, bad input.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gmock/gmock.h>

#include "ops/gated_rmsnorm/op.h"
#include "ops/rmsnorm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using ::testing::HasSubstr;
using testing::randn;
using testing::randu;

struct GatedOut {
  OwnedTensor y, rstd, dx, dz, dw;
};

// Runs forward + backward on tensors of `dt` (F64 -> ref, F32 -> cpu).
GatedOut run(const Tensor& x64, const Tensor& z64, const Tensor& w64, const Tensor& dy64,
             DType dt) {
  const int64_t R = x64.size(0), D = x64.size(1);
  OwnedTensor x = convert(x64, dt), z = convert(z64, dt), w = convert(w64, dt),
              dy = convert(dy64, dt);
  const DType st = gated_rmsnorm_stat_dtype(dt);
  GatedOut o{OwnedTensor::zeros(dt, {R, D}), OwnedTensor::zeros(st, {R}),
             OwnedTensor::zeros(dt, {R, D}), OwnedTensor::zeros(dt, {R, D}),
             OwnedTensor::zeros(st, {D})};
  gated_rmsnorm_forward({x, z, w, o.y, o.rstd, 1e-6});
  gated_rmsnorm_backward({x, z, w, o.rstd, dy, o.dx, o.dz, o.dw});
  return o;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// dy * silu(z) * w: the upstream gradient of the inner norm, the natural scale of dx.
OwnedTensor inner_grad(const Tensor& dy, const Tensor& z, const Tensor& w) {
  auto a = to_f64_vector(dy), b = to_f64_vector(z), c = to_f64_vector(w);
  const size_t D = c.size();
  std::vector<double> g(a.size());
  for (size_t i = 0; i < a.size(); ++i) g[i] = a[i] * silu(b[i]) * c[i % D];
  return from_f64(g, DType::F64, {static_cast<int64_t>(a.size())});
}

// ||sum_rows |dy * silu(z) * xhat| ||: the scale of dw's fp32 rounding error. dw is a sum over
// rows with mixed signs; with D = 1 and many rows it cancels, and a relative error against the
// cancelled result would measure the conditioning, not the kernel.
double dw_scale(const Tensor& x, const Tensor& z, const Tensor& dy, const Tensor& rstd) {
  auto xv = to_f64_vector(x), zv = to_f64_vector(z), dv = to_f64_vector(dy);
  auto rv = to_f64_vector(rstd);
  const size_t R = rv.size(), D = xv.size() / R;
  std::vector<double> col(D, 0.0);
  for (size_t i = 0; i < R; ++i)
    for (size_t j = 0; j < D; ++j)
      col[j] += std::abs(dv[i * D + j] * silu(zv[i * D + j]) * xv[i * D + j] * rv[i]);
  return testing::l2(from_f64(col, DType::F64, {static_cast<int64_t>(D)}));
}

class GatedRmsNormSweep : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(GatedRmsNormSweep, CpuMatchesRef) {
  auto [R, D] = GetParam();
  auto x = testing::rounded(randn({R, D}, 1, 3.0), DType::F32);
  auto z = testing::rounded(randn({R, D}, 2, 4.0), DType::F32);  // both sigmoid tails
  auto w = testing::rounded(randn({D}, 3, 0.2, 1.0), DType::F32);
  auto dy = testing::rounded(randn({R, D}, 4), DType::F32);
  GatedOut ref = run(x, z, w, dy, DType::F64);
  GatedOut cpu = run(x, z, w, dy, DType::F32);
  testing::expect_close(cpu.y, ref.y, 2e-6, "y");
  testing::expect_close(cpu.rstd, ref.rstd, 2e-6, "rstd");
  testing::expect_close(cpu.dz, ref.dz, 2e-6, "dz");
  // dx cancels to ~0 when D = 1 (xhat = +-1): measure it against the scale of r * dy*silu(z)*w.
  auto r = to_f64_vector(ref.rstd);
  const double rmax = *std::max_element(r.begin(), r.end());
  testing::expect_close(cpu.dx, ref.dx, 5e-6, "dx", testing::l2(inner_grad(dy, z, w)) * rmax);
  testing::expect_close(cpu.dw, ref.dw, 5e-6, "dw", dw_scale(x, z, dy, ref.rstd));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GatedRmsNormSweep,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257),
                                            ::testing::Values(1, 7, 128, 129)));

// Norm before gate (gdn_spec §5): y = rmsnorm_plain(x; w) * silu(z), and the backward is the
// plain rmsnorm backward fed with dy * silu(z) plus the gate's own dz. Checked against the
// independent rmsnorm op.
TEST(GatedRmsNorm, EqualsPlainRmsNormTimesSiluGate) {
  const int64_t R = 5, D = 16;
  auto x = randn({R, D}, 20, 2.0);
  auto z = randn({R, D}, 21, 3.0);
  auto w = randn({D}, 22, 0.3, 1.0);
  auto dy = randn({R, D}, 23);
  GatedOut g = run(x, z, w, dy, DType::F64);

  auto y0 = OwnedTensor::zeros(DType::F64, {R, D});
  auto r0 = OwnedTensor::zeros(DType::F64, {R});
  rmsnorm_forward({x, w, y0, r0, 1e-6, false});
  auto zv = to_f64_vector(z), y0v = to_f64_vector(y0), dyv = to_f64_vector(dy);
  std::vector<double> want_y(zv.size()), dyp(zv.size()), want_dz(zv.size());
  for (size_t i = 0; i < zv.size(); ++i) {
    const double s = 1.0 / (1.0 + std::exp(-zv[i]));
    want_y[i] = y0v[i] * zv[i] * s;
    dyp[i] = dyv[i] * zv[i] * s;
    want_dz[i] = dyv[i] * y0v[i] * (s + zv[i] * s * (1.0 - s));  // d silu / dz, product form
  }
  auto dyp_t = from_f64(dyp, DType::F64, {R, D});
  auto dx0 = OwnedTensor::zeros(DType::F64, {R, D});
  auto dw0 = OwnedTensor::zeros(DType::F64, {D});
  rmsnorm_backward({x, w, r0, dyp_t, dx0, dw0, false});

  testing::expect_close(g.y, from_f64(want_y, DType::F64, {R, D}), 1e-14, "y");
  testing::expect_close(g.rstd, r0, 1e-15, "rstd");  // z does not enter the statistic
  testing::expect_close(g.dz, from_f64(want_dz, DType::F64, {R, D}), 1e-13, "dz");
  testing::expect_close(g.dx, dx0, 1e-13, "dx");
  testing::expect_close(g.dw, dw0, 1e-13, "dw");
}

TEST(GatedRmsNorm, RefGradientsMatchFiniteDifferences) {
  const int64_t R = 3, D = 9;
  auto x = randn({R, D}, 30);
  auto z = randn({R, D}, 31, 2.0);
  auto w = randn({D}, 32, 0.3, 1.0);
  auto up = randn({R, D}, 33);  // loss = sum(up * y)
  GatedOut g = run(x, z, w, up, DType::F64);
  auto loss = [&] {
    auto y = OwnedTensor::zeros(DType::F64, {R, D});
    auto r = OwnedTensor::zeros(DType::F64, {R});
    gated_rmsnorm_forward({x, z, w, y, r, 1e-6});
    return testing::dot(y, up);
  };
  EXPECT_LE(testing::fd_check(loss, x, g.dx), 1e-7) << "dx";
  EXPECT_LE(testing::fd_check(loss, z, g.dz), 1e-7) << "dz";
  EXPECT_LE(testing::fd_check(loss, w, g.dw), 1e-7) << "dw";
}

// dw is accumulated (+=), dx and dz are written (=): a second backward into the same buffers,
// with dx/dz pre-filled with garbage, must give 2*dw and the same dx/dz.
TEST(GatedRmsNorm, BackwardAccumulatesDwAndWritesDxDz) {
  for (DType dt : {DType::F32, DType::F64}) {
    auto x = randn({5, 8}, 40);
    auto z = randn({5, 8}, 41);
    auto w = randn({8}, 42, 0.2, 1.0);
    auto dy = randn({5, 8}, 43);
    GatedOut once = run(x, z, w, dy, dt);
    auto dw = convert(once.dw, gated_rmsnorm_stat_dtype(dt));
    auto dx = convert(from_f64(std::vector<double>(40, 7.0), DType::F64, {5, 8}), dt);
    auto dz = convert(from_f64(std::vector<double>(40, -3.0), DType::F64, {5, 8}), dt);
    auto xd = convert(x, dt), zd = convert(z, dt), wd = convert(w, dt), dyd = convert(dy, dt);
    gated_rmsnorm_backward({xd, zd, wd, once.rstd, dyd, dx, dz, dw});
    auto a = to_f64_vector(dw), b = to_f64_vector(once.dw);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(a[i], 2 * b[i], 1e-5 * (1 + std::abs(b[i])))
          << dtype_name(dt) << " dw[" << i << "]";
    testing::expect_close(dx, once.dx, 0.0, "dx written, not accumulated");
    testing::expect_close(dz, once.dz, 0.0, "dz written, not accumulated");
  }
}

// Saturated gates: silu(z) -> 0 for z -> -inf and -> z for z -> +inf; fp32 exp overflows at
// z < -88.7 and must still give finite zeros, not NaN.
TEST(GatedRmsNorm, ExtremeGatesStayFinite) {
  const int64_t R = 2, D = 4;
  std::vector<double> zv{-200, -90, -30, 0, 30, 90, 200, -1.2784645};
  auto z = from_f64(zv, DType::F64, {R, D});
  auto x = randn({R, D}, 50);
  auto w = randu({D}, 51, 0.5, 1.5);
  auto dy = randn({R, D}, 52);
  GatedOut ref = run(x, z, w, dy, DType::F64);
  GatedOut cpu = run(x, z, w, dy, DType::F32);
  testing::expect_close(cpu.y, ref.y, 2e-6, "y");  // also asserts every value is finite
  testing::expect_close(cpu.dz, ref.dz, 2e-6, "dz");
  testing::expect_close(cpu.dx, ref.dx, 5e-6, "dx");
  testing::expect_close(cpu.dw, ref.dw, 5e-6, "dw");
  auto dz = to_f64_vector(cpu.dz);
  EXPECT_EQ(dz[0], 0.0);        // z = -200: sigmoid is exactly 0 in fp32
  EXPECT_NEAR(dz[7], 0, 1e-5);  // silu'(z) = 0 at its minimum z = -1.2785
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(GatedRmsNorm, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::F32, {4, 8});
  auto z = OwnedTensor::zeros(DType::F32, {4, 8});
  auto w = OwnedTensor::zeros(DType::F32, {8});
  auto y = OwnedTensor::zeros(DType::F32, {4, 8});
  auto r = OwnedTensor::zeros(DType::F32, {4});
  auto zbad = OwnedTensor::zeros(DType::F32, {4, 7});
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_forward({x, zbad, w, y, r, 1e-6});
              }),
              HasSubstr("gated_rmsnorm: tensor 'z' has shape [4, 7], expected [4, 8]"));
  auto w64 = OwnedTensor::zeros(DType::F64, {8});
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_forward({x, z, w64, y, r, 1e-6});
              }),
              HasSubstr("tensor 'w' has dtype F64, expected F32"));
  auto rbad = OwnedTensor::zeros(DType::F32, {3});
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_forward({x, z, w, y, rbad, 1e-6});
              }),
              HasSubstr("tensor 'rstd' has shape [3], expected [4]"));
  EXPECT_THAT(error_of([&] { gated_rmsnorm_forward({x, z, w, y, r, 0.0}); }), HasSubstr("eps"));
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_forward({x, Tensor(), w, y, r, 1e-6});
              }),
              HasSubstr("tensor 'z' is required"));

  auto dx = OwnedTensor::zeros(DType::F32, {4, 8});
  auto dz = OwnedTensor::zeros(DType::F32, {4, 8});
  auto dw = OwnedTensor::zeros(DType::F32, {8});
  auto dw_bf16 = OwnedTensor::zeros(DType::BF16, {8});
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_backward({x, z, w, r, y, dx, dz, dw_bf16});
              }),
              HasSubstr("tensor 'dw' has dtype BF16, expected F32"));
  auto dzbad = OwnedTensor::zeros(DType::F32, {8, 4});
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_backward({x, z, w, r, y, dx, dzbad, dw});
              }),
              HasSubstr("tensor 'dz' has shape [8, 4], expected [4, 8]"));
  auto dy64 = OwnedTensor::zeros(DType::F64, {4, 8});
  EXPECT_THAT(error_of([&] {
                gated_rmsnorm_backward({x, z, w, r, dy64, dx, dz, dw});
              }),
              HasSubstr("tensor 'dy' has dtype F64, expected F32"));
}

}  // namespace
}  // namespace gdn::ops
