// SwiGLU on the CPU: fp32, one OpenMP pass over the flattened elements per direction.
// sigmoid(x) = 1 / (1 + exp(-x)) is safe at both tails in fp32: exp(-x) overflows to +inf for
// x < -88.7, giving s = 0 (and silu = x * 0 = -0), never NaN.
#include <omp.h>

#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/swiglu/op.h"

namespace gdn::ops {

namespace {
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void forward(const SwigluFwd& a) {
  const int64_t n = a.gate.numel();
  const float* gate = a.gate.ptr<float>();  // [R, I]
  const float* up = a.up.ptr<float>();      // [R, I]
  float* y = a.y.ptr<float>();              // [R, I]
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

void backward(const SwigluBwd& a) {
  const int64_t n = a.gate.numel();
  const float* gate = a.gate.ptr<float>();  // [R, I]
  const float* up = a.up.ptr<float>();      // [R, I]
  const float* dy = a.dy.ptr<float>();      // [R, I]
  float* dgate = a.dgate.ptr<float>();      // [R, I], may alias gate
  float* dup = a.dup.ptr<float>();          // [R, I], may alias up
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], u = up[i], d = dy[i];  // read all before writing (aliasing)
    const float s = sigmoid(g);
    const float silu = g * s;
    dup[i] = d * silu;
    dgate[i] = d * u * (s + silu * (1.0f - s));
  }
}

const SwigluTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(swiglu_cpu) {
  Registry::global().add_impl({"swiglu", "cpu.elementwise", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
