// mul reference: fp64 loop.
#include "gdn/backend/registry.h"
#include "ops/mul/op.h"

namespace gdn::ops {
namespace {
void run(const MulArgs& m) {
  const double* a = m.a.ptr<double>();  // [n]
  const double* b = m.b.ptr<double>();  // [n]
  double* y = m.y.ptr<double>();        // [n], may alias a or b
  for (int64_t i = 0; i < m.a.numel(); ++i) y[i] = a[i] * b[i];
}
const MulTable kTable{run};
}  // namespace
GDN_REGISTER(mul_ref) {
  Registry::global().add_impl({"mul", "ref", Backend::Ref, 0, nullptr, &kTable});
}
}  // namespace gdn::ops
