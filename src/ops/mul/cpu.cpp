// mul on the CPU: fp32, OpenMP over elements.
#include "gdn/backend/registry.h"
#include "ops/mul/op.h"

namespace gdn::ops {
namespace {
void run(const MulArgs& m) {
  const float* a = m.a.ptr<float>();  // [n]
  const float* b = m.b.ptr<float>();  // [n]
  float* y = m.y.ptr<float>();        // [n], may alias a or b
  const int64_t n = m.a.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] * b[i];
}
const MulTable kTable{run};
}  // namespace
GDN_REGISTER(mul_cpu) {
  Registry::global().add_impl({"mul", "cpu.loop", Backend::Cpu, 10, nullptr, &kTable});
}
}  // namespace gdn::ops
