// L2 normalisation reference: fp64, plain loops, no threading. The oracle for every other
// implementation.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/l2norm/op.h"

namespace gdn::ops {

namespace {
void forward(const L2NormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const double* x = a.x.ptr<double>();  // [R, D]
  double* y = a.y.ptr<double>();        // [R, D]
  double* rstd = a.rstd.ptr<double>();  // [R]
  for (int64_t i = 0; i < R; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[i * D + j] * x[i * D + j];
    const double r = 1.0 / std::sqrt(ss + a.eps);
    rstd[i] = r;
    for (int64_t j = 0; j < D; ++j) y[i * D + j] = x[i * D + j] * r;
  }
}

void backward(const L2NormBwd& a) {
  const int64_t R = a.y.size(0), D = a.y.size(1);
  const double* y = a.y.ptr<double>();        // [R, D]
  const double* rstd = a.rstd.ptr<double>();  // [R]
  const double* dy = a.dy.ptr<double>();      // [R, D]
  double* dx = a.dx.ptr<double>();            // [R, D]
  for (int64_t i = 0; i < R; ++i) {
    double dot = 0;
    for (int64_t j = 0; j < D; ++j) dot += dy[i * D + j] * y[i * D + j];
    for (int64_t j = 0; j < D; ++j) dx[i * D + j] = rstd[i] * (dy[i * D + j] - y[i * D + j] * dot);
  }
}

const L2NormTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(l2norm_ref) {
  Registry::global().add_impl({"l2norm", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
