// SiLU on the CPU: fp32, one OpenMP pass per direction, the same expressions as swiglu's cpu
// kernel (silu = x * s; silu' = s + silu * (1 - s)). exp(-x) overflowing to +inf for x < -88.7
// gives s = 0, never NaN.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/silu/op.h"

namespace gdn::ops {

namespace {
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void forward(const SiluFwd& a) {
  const int64_t n = a.x.numel();
  const float* x = a.x.ptr<float>();  // [n]
  float* y = a.y.ptr<float>();        // [n]
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * sigmoid(x[i]);
}

void backward(const SiluBwd& a) {
  const int64_t n = a.x.numel();
  const float* x = a.x.ptr<float>();    // [n]
  const float* dy = a.dy.ptr<float>();  // [n]
  float* dx = a.dx.ptr<float>();        // [n], may alias dy or x
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i], d = dy[i];  // both read before dx is written (aliasing)
    const float s = sigmoid(v);
    const float silu = v * s;
    dx[i] = d * (s + silu * (1.0f - s));
  }
}

const SiluTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(silu_cpu) {
  Registry::global().add_impl({"silu", "cpu.elementwise", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
