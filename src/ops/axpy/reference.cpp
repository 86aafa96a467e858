// axpy reference: fp64 loop.
#include "gdn/backend/registry.h"
#include "ops/axpy/op.h"

namespace gdn::ops {
namespace {
void run(const AxpyArgs& a) {
  const double* x = a.x.ptr<double>();  // [n]
  double* y = a.y.ptr<double>();        // [n]
  for (int64_t i = 0; i < a.y.numel(); ++i) y[i] += a.alpha * x[i];
}
const AxpyTable kTable{run};
}  // namespace
GDN_REGISTER(axpy_ref) {
  Registry::global().add_impl({"axpy", "ref", Backend::Ref, 0, nullptr, &kTable});
}
}  // namespace gdn::ops
