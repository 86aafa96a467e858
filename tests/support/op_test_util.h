// Shared helpers for op tests: random tensors, comparisons and finite-difference gradient checks.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "gdn/backend/registry.h"
#include "gdn/core/error.h"
#include "gdn/core/rng.h"
#include "gdn/core/tensor.h"

namespace gdn::testing {

// Runs `f` and requires a gdn::Error whose text contains `needle`.
template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected a gdn::Error containing \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" does not contain \"" << needle << "\"";
  }
}

// Random F64 host tensors (convert() them to F32 for the cpu path).
inline OwnedTensor randn(std::initializer_list<int64_t> shape, uint64_t seed, double std = 1.0,
                         double mean = 0.0) {
  OwnedTensor t = OwnedTensor::empty(DType::F64, shape);
  rng::fill_normal(t, seed, 17, mean, std);
  return t;
}
inline OwnedTensor randu(std::initializer_list<int64_t> shape, uint64_t seed, double lo,
                         double hi) {
  OwnedTensor t = OwnedTensor::empty(DType::F64, shape);
  rng::fill_uniform(t, seed, 23, lo, hi);
  return t;
}
inline OwnedTensor i32_tensor(const std::vector<int32_t>& v) {
  OwnedTensor t = OwnedTensor::empty(DType::I32, {static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<int32_t>());
  return t;
}
// Rounds an F64 tensor through `dtype` (so ref and a lower-precision path see the same inputs).
inline OwnedTensor rounded(const Tensor& t, DType dtype) {
  return convert(convert(t, dtype), DType::F64);
}

// L2 norm of a tensor (any float dtype/device).
inline double l2(const Tensor& t) {
  double s = 0;
  for (double x : to_f64_vector(t)) s += x * x;
  return std::sqrt(s);
}

// Relative L2 error of `got` against `want` (any float dtypes/devices); with `scale` > 0,
// ||got - want|| / max(||want||, scale) as in expect_close below.
inline double rel_err(const Tensor& got, const Tensor& want, double scale = 0) {
  if (scale <= 0) return rel_l2_error(got, want);
  return rel_l2_error(got, want) * std::max(l2(want), 1e-30) / std::max(l2(want), scale);
}

// Fails the test if ||got - want|| / max(||want||, scale) > tol; `what` names the tensor.
// `scale` guards ill-conditioned outputs whose true value cancels to ~0 (e.g. RMSNorm dx with
// D = 1): pass the norm of what the output is built from.
inline void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what,
                         double scale = 0) {
  auto g = to_f64_vector(got), w = to_f64_vector(want);
  ASSERT_EQ(g.size(), w.size()) << what;
  double num = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_TRUE(std::isfinite(g[i])) << what << "[" << i << "] is not finite";
    num += (g[i] - w[i]) * (g[i] - w[i]);
  }
  double e = std::sqrt(num) / std::max({l2(want), scale, 1e-300});
  EXPECT_LE(e, tol) << what << ": relative L2 error " << e << " exceeds " << tol;
}

// Central finite differences of a scalar function of an F64 host tensor `param`, compared with
// `grad` at up to `max_elems` elements spread over the tensor. Returns the largest error
// |fd - g| / max(1, |fd|, |g|)... scaled by the gradient's norm so tiny entries do not dominate.
inline double fd_check(const std::function<double()>& loss, const Tensor& param, const Tensor& grad,
                       double eps = 1e-6, int64_t max_elems = 48) {
  double* p = param.ptr<double>();
  std::vector<double> g = to_f64_vector(grad);
  const int64_t n = param.numel();
  double gnorm = 0;
  for (double x : g) gnorm = std::max(gnorm, std::abs(x));
  const int64_t step = std::max<int64_t>(1, n / max_elems);
  double worst = 0;
  for (int64_t i = 0; i < n; i += step) {
    double keep = p[i];
    p[i] = keep + eps;
    double lp = loss();
    p[i] = keep - eps;
    double lm = loss();
    p[i] = keep;
    double fd = (lp - lm) / (2 * eps);
    worst = std::max(worst, std::abs(fd - g[static_cast<size_t>(i)]) / std::max(1e-3, gnorm));
  }
  return worst;
}

// Sum of w[i] * y[i] over a tensor: a loss whose upstream gradient is `w`.
inline double dot(const Tensor& y, const Tensor& w) {
  auto a = to_f64_vector(y);
  auto b = to_f64_vector(w);
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace gdn::testing
