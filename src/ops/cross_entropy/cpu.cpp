// cross_entropy on the CPU: fp32 logits, row statistics and the loss in double, OpenMP over rows
// (each row is one thread's, so the result does not depend on the thread count).
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/cross_entropy/op.h"

namespace gdn::ops {

namespace {
void run(const CrossEntropyArgs& a) {
  const int64_t R = a.logits.size(0), V = a.logits.size(1);
  const float* z = a.logits.ptr<float>();                              // [R, V]
  const int32_t* tg = a.targets.ptr<int32_t>();                        // [R]
  float* loss = a.loss.ptr<float>();                                   // [R]
  float* lse = a.lse.ptr<float>();                                     // [R]
  float* zl = a.z_loss.ptr<float>();                                   // [R]
  float* dz = a.dlogits.defined() ? a.dlogits.ptr<float>() : nullptr;  // [R, V], may alias z
  const double lam = a.z_loss_scale, c = a.grad_scale;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const float* zi = z + i * V;  // [V]
    float m = zi[0];
    for (int64_t j = 1; j < V; ++j) m = std::max(m, zi[j]);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(zi[j]) - m);
    const double l = m + std::log(s);
    const int64_t y = tg[i];
    const bool ok = y != -100;
    lse[i] = static_cast<float>(l);
    zl[i] = ok ? static_cast<float>(lam * l * l) : 0.f;
    loss[i] = ok ? static_cast<float>(l - zi[y] + lam * l * l) : 0.f;
    if (dz == nullptr) continue;
    const double zy = ok ? zi[y] : 0.0;  // read before the row is overwritten
    float* di = dz + i * V;              // [V]
    for (int64_t j = 0; j < V; ++j) {
      if (!ok) {
        di[j] = 0.f;
        continue;
      }
      const double p = std::exp(static_cast<double>(zi[j]) - l);
      const double g = j == y ? std::expm1(zy - l) + 2 * lam * l * p : (1 + 2 * lam * l) * p;
      di[j] = static_cast<float>(c * g);
    }
  }
}
const CrossEntropyTable kTable{run};
}  // namespace

GDN_REGISTER(cross_entropy_cpu) {
  Registry::global().add_impl({"cross_entropy", "cpu.rows", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
