// cross_entropy reference: fp64, plain loops per row. The oracle.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/cross_entropy/op.h"

namespace gdn::ops {

namespace {
void run(const CrossEntropyArgs& a) {
  const int64_t R = a.logits.size(0), V = a.logits.size(1);
  const double* z = a.logits.ptr<double>();                              // [R, V]
  const int32_t* tg = a.targets.ptr<int32_t>();                          // [R]
  double* loss = a.loss.ptr<double>();                                   // [R]
  double* lse = a.lse.ptr<double>();                                     // [R]
  double* zl = a.z_loss.ptr<double>();                                   // [R]
  double* dz = a.dlogits.defined() ? a.dlogits.ptr<double>() : nullptr;  // [R, V], may alias z
  const double lam = a.z_loss_scale, c = a.grad_scale;
  for (int64_t i = 0; i < R; ++i) {
    const double* zi = z + i * V;  // [V]
    double m = zi[0];
    for (int64_t j = 1; j < V; ++j) m = std::max(m, zi[j]);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(zi[j] - m);
    const double l = m + std::log(s);
    const int64_t y = tg[i];
    lse[i] = l;
    const bool ok = y != -100;
    zl[i] = ok ? lam * l * l : 0.0;
    loss[i] = ok ? l - zi[y] + lam * l * l : 0.0;
    if (dz == nullptr) continue;
    const double zy = ok ? zi[y] : 0.0;  // read before the row is overwritten
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(zi[j] - l);
      double g = (1 + 2 * lam * l) * p;
      if (j == y) g = std::expm1(zy - l) + 2 * lam * l * p;
      dz[i * V + j] = ok ? c * g : 0.0;
    }
  }
}
const CrossEntropyTable kTable{run};
}  // namespace

GDN_REGISTER(cross_entropy_ref) {
  Registry::global().add_impl({"cross_entropy", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
