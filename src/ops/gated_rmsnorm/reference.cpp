// Gated RMSNorm reference: fp64, plain loops, no threading. The oracle for every other
// implementation.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/gated_rmsnorm/op.h"

namespace gdn::ops {

namespace {
double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

void forward(const GatedRmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const double* x = a.x.ptr<double>();  // [R, D]
  const double* z = a.z.ptr<double>();  // [R, D]
  const double* w = a.w.ptr<double>();  // [D]
  double* y = a.y.ptr<double>();        // [R, D]
  double* rstd = a.rstd.ptr<double>();  // [R]
  for (int64_t i = 0; i < R; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[i * D + j] * x[i * D + j];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(D) + a.eps);
    rstd[i] = r;
    for (int64_t j = 0; j < D; ++j) {
      const double zz = z[i * D + j];
      y[i * D + j] = x[i * D + j] * r * w[j] * (zz * sigmoid(zz));
    }
  }
}

void backward(const GatedRmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const double* x = a.x.ptr<double>();        // [R, D]
  const double* z = a.z.ptr<double>();        // [R, D]
  const double* w = a.w.ptr<double>();        // [D]
  const double* rstd = a.rstd.ptr<double>();  // [R]
  const double* dy = a.dy.ptr<double>();      // [R, D]
  double* dx = a.dx.ptr<double>();            // [R, D]
  double* dz = a.dz.ptr<double>();            // [R, D]
  double* dw = a.dw.ptr<double>();            // [D]
  for (int64_t i = 0; i < R; ++i) {
    const double r = rstd[i];
    // g = dy * silu(z) is the upstream gradient of the plain norm y0 = xhat * w.
    double dot = 0;
    for (int64_t j = 0; j < D; ++j) {
      const double zz = z[i * D + j];
      const double g = dy[i * D + j] * zz * sigmoid(zz);
      dot += g * w[j] * x[i * D + j] * r;
    }
    dot /= static_cast<double>(D);
    for (int64_t j = 0; j < D; ++j) {
      const double zz = z[i * D + j], s = sigmoid(zz);
      const double xhat = x[i * D + j] * r;
      const double g = dy[i * D + j] * zz * s;
      dz[i * D + j] = dy[i * D + j] * xhat * w[j] * s * (1.0 + zz * (1.0 - s));
      dx[i * D + j] = r * (g * w[j] - xhat * dot);
      dw[j] += g * xhat;
    }
  }
}

const GatedRmsNormTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gated_rmsnorm_ref) {
  Registry::global().add_impl({"gated_rmsnorm", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
