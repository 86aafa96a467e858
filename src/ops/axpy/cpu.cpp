// axpy on the CPU: fp32, OpenMP over elements.
#include "gdn/backend/registry.h"
#include "ops/axpy/op.h"

namespace gdn::ops {
namespace {
void run(const AxpyArgs& a) {
  const float* x = a.x.ptr<float>();  // [n]
  float* y = a.y.ptr<float>();        // [n]
  const float alpha = static_cast<float>(a.alpha);
  const int64_t n = a.y.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
const AxpyTable kTable{run};
}  // namespace
GDN_REGISTER(axpy_cpu) {
  Registry::global().add_impl({"axpy", "cpu.loop", Backend::Cpu, 10, nullptr, &kTable});
}
}  // namespace gdn::ops
