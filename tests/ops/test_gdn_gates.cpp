// GDN gates: cpu vs ref over swept shapes (forward and every gradient), finite-difference checks
// of ref, the softplus threshold against a direct formula, extreme finite inputs, accumulation,
// determinism across thread counts, bad input, and `ops run` through run_op_file.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "gdn/backend/op_run.h"
#include "gdn/core/safetensors.h"
#include "ops/gdn_gates/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;
using testing::randu;

struct Inputs {
  OwnedTensor a, b, A_log, dt_bias, dg, dbeta;  // F64: [T, Hv] x2, [Hv] x2, [T, Hv] x2
};

struct Outputs {
  OwnedTensor g, beta, da, db, dA_log, ddt_bias;
};

// Inputs rounded to fp32 so that ref and cpu see the same numbers.
Inputs make_inputs(int64_t T, int64_t H, uint64_t seed, double a_std = 3.0) {
  auto r = [](const OwnedTensor& t) { return testing::rounded(t, DType::F32); };
  return {r(randn({T, H}, seed, a_std)),
          r(randn({T, H}, seed + 1, 3.0)),
          r(randu({H}, seed + 2, std::log(0.5), std::log(16.0))),
          r(randn({H}, seed + 3, 1.0, 1.0)),
          r(randn({T, H}, seed + 4)),
          r(randn({T, H}, seed + 5))};
}

// Forward + backward on tensors of `dt` (F64 -> ref, F32 -> cpu); gradients start at zero.
Outputs run(const Inputs& in, DType dt) {
  const int64_t T = in.a.view().size(0), H = in.a.view().size(1);
  const DType gt = gdn_gates_dtype(dt);
  OwnedTensor a = convert(in.a, dt), b = convert(in.b, dt), A = convert(in.A_log, gt),
              dtb = convert(in.dt_bias, gt), dg = convert(in.dg, gt), dbeta = convert(in.dbeta, gt);
  Outputs o{OwnedTensor::zeros(gt, {T, H}), OwnedTensor::zeros(gt, {T, H}),
            OwnedTensor::zeros(dt, {T, H}), OwnedTensor::zeros(dt, {T, H}),
            OwnedTensor::zeros(gt, {H}),    OwnedTensor::zeros(gt, {H})};
  gdn_gates_forward({a, b, A, dtb, o.g, o.beta});
  gdn_gates_backward({a, b, A, dtb, dg, dbeta, o.da, o.db, o.dA_log, o.ddt_bias});
  return o;
}

void expect_all_close(const Outputs& cpu, const Outputs& ref, double tol_elem, double tol_red) {
  testing::expect_close(cpu.g, ref.g, tol_elem, "g");
  testing::expect_close(cpu.beta, ref.beta, tol_elem, "beta");
  testing::expect_close(cpu.da, ref.da, tol_elem, "da");
  testing::expect_close(cpu.db, ref.db, tol_elem, "db");
  testing::expect_close(cpu.dA_log, ref.dA_log, tol_red, "dA_log");
  testing::expect_close(cpu.ddt_bias, ref.ddt_bias, tol_red, "ddt_bias");
}

class GdnGatesSweep : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(GdnGatesSweep, CpuMatchesRef) {
  auto [T, H] = GetParam();
  Inputs in = make_inputs(T, H, 100 + T * 7 + H);
  expect_all_close(run(in, DType::F32), run(in, DType::F64), 1e-6, 2e-6);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdnGatesSweep,
                         ::testing::Combine(::testing::Values(1, 7, 128, 129, 1000),
                                            ::testing::Values(1, 5, 16, 48)));

// a + dt_bias spread over [-60, 60]: both softplus branches and the underflow region.
TEST(GdnGates, CpuMatchesRefOverWideRange) {
  Inputs in = make_inputs(300, 16, 7, 25.0);
  expect_all_close(run(in, DType::F32), run(in, DType::F64), 1e-6, 2e-6);
}

TEST(GdnGates, RefGradientsMatchFiniteDifferences) {
  const int64_t T = 6, H = 3;
  Inputs in = make_inputs(T, H, 21);
  Outputs g = run(in, DType::F64);
  auto loss = [&] {
    auto gg = OwnedTensor::zeros(DType::F64, {T, H}), bb = OwnedTensor::zeros(DType::F64, {T, H});
    gdn_gates_forward({in.a, in.b, in.A_log, in.dt_bias, gg, bb});
    return testing::dot(gg, in.dg) + testing::dot(bb, in.dbeta);
  };
  EXPECT_LE(testing::fd_check(loss, in.a, g.da), 1e-7) << "da";
  EXPECT_LE(testing::fd_check(loss, in.b, g.db), 1e-7) << "db";
  EXPECT_LE(testing::fd_check(loss, in.A_log, g.dA_log), 1e-7) << "dA_log";
  EXPECT_LE(testing::fd_check(loss, in.dt_bias, g.ddt_bias), 1e-7) << "ddt_bias";
}

// softplus(x) is x for x > 20 and log1p(exp(x)) otherwise (torch); its derivative is 1 above the
// threshold and sigmoid(x) below. Checked on both backends against the formula written directly.
TEST(GdnGates, SoftplusThreshold) {
  const std::vector<double> xs = {19.0, 19.999, 20.0, 20.001, 21.0, 1e4, -200.0};
  const int64_t T = static_cast<int64_t>(xs.size()), H = 1;
  const double A = std::log(3.0);  // exp(A_log) = 3 (up to rounding)
  Inputs in{from_f64(xs, DType::F64, {T, H}),
            OwnedTensor::zeros(DType::F64, {T, H}),
            from_f64(std::vector<double>{A}, DType::F64, {H}),
            OwnedTensor::zeros(DType::F64, {H}),
            from_f64(std::vector<double>(xs.size(), 1.0), DType::F64, {T, H}),
            OwnedTensor::zeros(DType::F64, {T, H})};
  for (DType dt : {DType::F64, DType::F32}) {
    SCOPED_TRACE(dtype_name(dt));
    Inputs r = in;
    r.a = testing::rounded(in.a, dt);
    r.A_log = testing::rounded(in.A_log, dt);
    const double e = std::exp(to_f64_vector(r.A_log)[0]);
    Outputs o = run(r, dt);
    const auto av = to_f64_vector(r.a), g = to_f64_vector(o.g), da = to_f64_vector(o.da);
    // Relative tolerance, with an absolute floor for the fp32 underflow at x = -200.
    const double tol = dt == DType::F64 ? 1e-15 : 3e-7, floor = dt == DType::F64 ? 1e-300 : 1e-30;
    for (size_t i = 0; i < av.size(); ++i) {
      const double x = av[i];
      const bool lin = x > 20.0;
      const double sp = lin ? x : std::log1p(std::exp(x));
      const double dsp = lin ? 1.0 : 1.0 / (1.0 + std::exp(-x));
      EXPECT_NEAR(g[i], -e * sp, tol * std::max(floor, e * sp)) << "g at x = " << x;
      EXPECT_NEAR(da[i], -e * dsp, tol * std::max(floor, e * dsp)) << "da at x = " << x;
    }
    if (dt == DType::F64) {
      // Just below the threshold the log1p branch is taken: it differs from x by
      // log1p(exp(-x)) ~ 2e-9, far above fp64 rounding. Just above, g is exactly -e * x.
      EXPECT_GT(std::abs(g[1] - (-e * av[1])), 1e-9) << "x = 19.999 must use log1p(exp(x))";
      EXPECT_GT(std::abs(g[2] - (-e * av[2])), 1e-9) << "x = 20 must use log1p(exp(x))";
      EXPECT_EQ(g[3], -e * av[3]) << "x = 20.001 must return x";
      EXPECT_EQ(da[3], -e) << "the derivative above the threshold is exactly 1";
      EXPECT_GT(da[2], -e * (1 - 1e-9)) << "the derivative at 20 is sigmoid(20) < 1";
      EXPECT_LT(g[6], 0.0);  // exp(-200) ~ 1e-87: tiny but not flushed in fp64
    }
    EXPECT_TRUE(std::isfinite(g[5])) << "softplus(1e4) must not overflow";
  }
}

// Any finite a and b is accepted: outputs stay finite (sigmoid saturates, softplus is linear
// above the threshold and 0 far below) and cpu still matches ref.
TEST(GdnGates, ExtremeFiniteInputs) {
  const std::vector<double> big = {1e30, -1e30, 3e38, -3e38, 88.0, -88.0, 0.0, 1e-30};
  const int64_t T = static_cast<int64_t>(big.size()), H = 1;
  Inputs in{from_f64(big, DType::F64, {T, H}),
            from_f64(big, DType::F64, {T, H}),
            from_f64(std::vector<double>{-3.0}, DType::F64, {H}),  // exp(A_log) = 0.05
            OwnedTensor::zeros(DType::F64, {H}),
            from_f64(std::vector<double>(big.size(), 1e-3), DType::F64, {T, H}),
            from_f64(std::vector<double>(big.size(), 1.0), DType::F64, {T, H})};
  for (auto* t : {&in.a, &in.b, &in.A_log, &in.dg, &in.dbeta})
    *t = testing::rounded(*t, DType::F32);
  Outputs cpu = run(in, DType::F32), ref = run(in, DType::F64);
  for (const auto* t : {&cpu.g, &cpu.beta, &cpu.da, &cpu.db, &cpu.dA_log, &cpu.ddt_bias})
    for (double v : to_f64_vector(*t)) EXPECT_TRUE(std::isfinite(v));
  expect_all_close(cpu, ref, 1e-6, 1e-6);
  auto beta = to_f64_vector(cpu.beta);
  EXPECT_EQ(beta[0], 1.0);
  EXPECT_EQ(beta[1], 0.0);
}

TEST(GdnGates, BackwardAccumulatesParameterGradients) {
  Inputs in = make_inputs(40, 4, 31);
  Outputs once = run(in, DType::F32);
  const DType gt = DType::F32;
  auto a = convert(in.a, DType::F32), b = convert(in.b, DType::F32), A = convert(in.A_log, gt),
       dtb = convert(in.dt_bias, gt), dg = convert(in.dg, gt), dbeta = convert(in.dbeta, gt);
  auto dA = convert(once.dA_log, gt), ddt = convert(once.ddt_bias, gt);
  auto da = OwnedTensor::zeros(DType::F32, {40, 4}), db = OwnedTensor::zeros(DType::F32, {40, 4});
  gdn_gates_backward({a, b, A, dtb, dg, dbeta, da, db, dA, ddt});
  auto x = to_f64_vector(dA), x1 = to_f64_vector(once.dA_log);
  auto y = to_f64_vector(ddt), y1 = to_f64_vector(once.ddt_bias);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i], 2 * x1[i]);  // x1 + x1 is exact in binary floating point
    EXPECT_EQ(y[i], 2 * y1[i]);
  }
  // da and db are written, not accumulated.
  EXPECT_EQ(to_f64_vector(da), to_f64_vector(once.da));
  EXPECT_EQ(to_f64_vector(db), to_f64_vector(once.db));
}

TEST(GdnGates, CpuBackwardIsDeterministicAcrossThreadCounts) {
  Inputs in = make_inputs(1000, 5, 41);
  const int keep = omp_get_max_threads();
  omp_set_num_threads(1);
  Outputs one = run(in, DType::F32);
  omp_set_num_threads(3);
  Outputs three = run(in, DType::F32);
  omp_set_num_threads(keep);
  EXPECT_EQ(to_f64_vector(one.dA_log), to_f64_vector(three.dA_log));
  EXPECT_EQ(to_f64_vector(one.ddt_bias), to_f64_vector(three.ddt_bias));
}

using testing::expect_error;

TEST(GdnGates, BadInputIsAClearError) {
  const int64_t T = 4, H = 3;
  auto z = [](std::initializer_list<int64_t> s, DType dt = DType::F32) {
    return OwnedTensor::zeros(dt, s);
  };
  auto a = z({T, H}), b = z({T, H}), A = z({H}), dtb = z({H}), g = z({T, H}), beta = z({T, H});
  expect_error(
      [&] {
        gdn_gates_forward({a, z({T, 2}), A, dtb, g, beta});
      },
      "gdn_gates: tensor 'b' has shape [4, 2], expected [4, 3]");
  expect_error(
      [&] {
        gdn_gates_forward({a, b, z({4}), dtb, g, beta});
      },
      "tensor 'A_log' has shape [4], expected [3]");
  expect_error(
      [&] {
        gdn_gates_forward({a, b, A, z({H}, DType::F64), g, beta});
      },
      "tensor 'dt_bias' has dtype");
  expect_error(
      [&] {
        gdn_gates_forward({a, b, A, dtb, z({T + 1, H}), beta});
      },
      "tensor 'g' has shape [5, 3], expected [4, 3]");
  expect_error(
      [&] {
        gdn_gates_forward({a, b, A, dtb, g, Tensor()});
      },
      "tensor 'beta' is required");
  auto nan_A = from_f64(std::vector<double>{0.0, 1.0, std::nan("")}, DType::F32, {H});
  expect_error(
      [&] {
        gdn_gates_forward({a, b, nan_A, dtb, g, beta});
      },
      "gdn_gates: tensor 'A_log' has a non-finite value nan at index 2");
  auto inf_dt = from_f64(std::vector<double>{INFINITY, 0.0, 0.0}, DType::F32, {H});
  expect_error(
      [&] {
        gdn_gates_forward({a, b, A, inf_dt, g, beta});
      },
      "tensor 'dt_bias' has a non-finite value inf at index 0");
  auto da = z({T, H}), db = z({T, H});
  expect_error(
      [&] {
        gdn_gates_backward({a, b, A, dtb, g, beta, da, db, z({H + 1}), z({H})});
      },
      "tensor 'dA_log' has shape [4], expected [3]");
  expect_error(
      [&] {
        gdn_gates_backward({a, b, nan_A, dtb, g, beta, da, db, z({H}), z({H})});
      },
      "tensor 'A_log' has a non-finite value");
  expect_error(
      [&] {
        gdn_gates_backward({a, b, A, dtb, g, beta, z({T}), db, z({H}), z({H})});
      },
      "tensor 'da' has shape [4], expected [4, 3]");
}

// `gdntrain ops run gdn_gates`: the file runner gives the same numbers as a direct call, on the
// cpu and ref backends, forward and backward.
TEST(GdnGates, OpsRunMatchesDirectCall) {
  const int64_t T = 9, H = 4;
  Inputs in = make_inputs(T, H, 51);
  auto a32 = convert(in.a, DType::F32), b32 = convert(in.b, DType::F32),
       A32 = convert(in.A_log, DType::F32), dt32 = convert(in.dt_bias, DType::F32),
       dg32 = convert(in.dg, DType::F32), dbeta32 = convert(in.dbeta, DType::F32);
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/gdn_gates_in.safetensors";
  const std::string out_path = dir + "/gdn_gates_out.safetensors";
  write_safetensors(in_path, {{"a", a32, {}, {}, nullptr, 0},
                              {"b", b32, {}, {}, nullptr, 0},
                              {"A_log", A32, {}, {}, nullptr, 0},
                              {"dt_bias", dt32, {}, {}, nullptr, 0},
                              {"dg", dg32, {}, {}, nullptr, 0},
                              {"dbeta", dbeta32, {}, {}, nullptr, 0}});
  for (Backend be : {Backend::Cpu, Backend::Ref}) {
    SCOPED_TRACE(std::string(backend_name(be)));
    OpRunResult r = run_op_file("gdn_gates", be, in_path, out_path, true, {});
    EXPECT_EQ(r.written.size(), 6u);
    const DType dt = be == Backend::Ref ? DType::F64 : DType::F32;
    Outputs want = run(in, dt);
    SafeTensorsFile out(out_path);
    const std::pair<const char*, const OwnedTensor*> names[] = {
        {"g", &want.g},   {"beta", &want.beta},     {"da", &want.da},
        {"db", &want.db}, {"dA_log", &want.dA_log}, {"ddt_bias", &want.ddt_bias}};
    for (const auto& [name, t] : names)
      EXPECT_EQ(to_f64_vector(out.load(name, DType::F64)), to_f64_vector(*t)) << name;
  }
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
}

}  // namespace
}  // namespace gdn::ops
