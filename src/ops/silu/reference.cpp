// SiLU reference: fp64, one plain loop per direction. The oracle.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/silu/op.h"

namespace gdn::ops {

namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void forward(const SiluFwd& a) {
  const double* x = a.x.ptr<double>();  // [n]
  double* y = a.y.ptr<double>();        // [n]
  for (int64_t i = 0; i < a.x.numel(); ++i) y[i] = x[i] * sigmoid(x[i]);
}

void backward(const SiluBwd& a) {
  const double* x = a.x.ptr<double>();    // [n]
  const double* dy = a.dy.ptr<double>();  // [n]
  double* dx = a.dx.ptr<double>();        // [n], may alias dy or x
  for (int64_t i = 0; i < a.x.numel(); ++i) {
    const double v = x[i], d = dy[i], s = sigmoid(v);
    dx[i] = d * s * (1.0 + v * (1.0 - s));
  }
}

const SiluTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(silu_ref) {
  Registry::global().add_impl({"silu", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
