// RMSNorm reference: fp64, plain loops, no threading. The oracle for every other implementation.
#include "gdn/backend/registry.h"
#include "ops/rmsnorm/op.h"

#include <cmath>

namespace gdn::ops {

namespace {
void forward(const RmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const double* x = a.x.ptr<double>();  // [R, D]
  const double* w = a.w.ptr<double>();  // [D]
  double* y = a.y.ptr<double>();        // [R, D]
  double* rstd = a.rstd.ptr<double>();  // [R]
  for (int64_t i = 0; i < R; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[i * D + j] * x[i * D + j];
    double r = 1.0 / std::sqrt(ss / static_cast<double>(D) + a.eps);
    rstd[i] = r;
    for (int64_t j = 0; j < D; ++j)
      y[i * D + j] = x[i * D + j] * r * (a.zero_centred ? 1.0 + w[j] : w[j]);
  }
}

void backward(const RmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const double* x = a.x.ptr<double>();        // [R, D]
  const double* w = a.w.ptr<double>();        // [D]
  const double* rstd = a.rstd.ptr<double>();  // [R]
  const double* dy = a.dy.ptr<double>();      // [R, D]
  double* dx = a.dx.ptr<double>();            // [R, D]
  double* dw = a.dw.ptr<double>();            // [D]
  for (int64_t i = 0; i < R; ++i) {
    const double r = rstd[i];
    double dot = 0;
    for (int64_t j = 0; j < D; ++j) {
      double g = a.zero_centred ? 1.0 + w[j] : w[j];
      dot += dy[i * D + j] * g * x[i * D + j] * r;
    }
    dot /= static_cast<double>(D);
    for (int64_t j = 0; j < D; ++j) {
      double g = a.zero_centred ? 1.0 + w[j] : w[j];
      double xhat = x[i * D + j] * r;
      dx[i * D + j] = r * (dy[i * D + j] * g - xhat * dot);
      dw[j] += dy[i * D + j] * xhat;
    }
  }
}

const RmsNormTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(rmsnorm_ref) {
  Registry::global().add_impl({"rmsnorm", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
