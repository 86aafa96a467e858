// SwiGLU reference: fp64, one plain loop per direction. The oracle for every other implementation.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/swiglu/op.h"

namespace gdn::ops {

namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void forward(const SwigluFwd& a) {
  const int64_t n = a.gate.numel();
  const double* gate = a.gate.ptr<double>();  // [R, I]
  const double* up = a.up.ptr<double>();      // [R, I]
  double* y = a.y.ptr<double>();              // [R, I]
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

void backward(const SwigluBwd& a) {
  const int64_t n = a.gate.numel();
  const double* gate = a.gate.ptr<double>();  // [R, I]
  const double* up = a.up.ptr<double>();      // [R, I]
  const double* dy = a.dy.ptr<double>();      // [R, I]
  double* dgate = a.dgate.ptr<double>();      // [R, I], may alias gate
  double* dup = a.dup.ptr<double>();          // [R, I], may alias up
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], u = up[i], d = dy[i];  // read all before writing (aliasing)
    const double s = sigmoid(g);
    dup[i] = d * g * s;
    dgate[i] = d * u * s * (1.0 + g * (1.0 - s));
  }
}

const SwigluTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(swiglu_ref) {
  Registry::global().add_impl({"swiglu", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
