// Linear cross-entropy reference: fp64, the full N x V logits materialised, plain loops, no
// threading. The oracle for every other implementation (memory O(N V), on purpose).
#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/linear_cross_entropy/op.h"

namespace gdn::ops {

namespace {
void run(const LinearCrossEntropyArgs& a, bool backward) {
  const int64_t N = a.x.size(0), D = a.x.size(1), V = a.w.size(0);
  const double* x = a.x.ptr<double>();  // [N, D]
  const double* w = a.w.ptr<double>();  // [V, D]
  double* loss = a.loss.ptr<double>();  // [1] or [N]
  double* lse = a.lse.ptr<double>();    // [N]
  double* zl = a.z_loss.ptr<double>();  // [1] or [N]
  const bool none = a.reduction == LceReduction::None;
  const double lam = a.z_loss_scale, eps = a.label_smoothing;
  auto target = [&](int64_t i) {
    return a.targets.dtype() == DType::I64 ? a.targets.ptr<int64_t>()[i]
                                           : a.targets.ptr<int32_t>()[i];
  };
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) valid += target(i) != kLceIgnoreIndex;
  const double scale = lce_mean_scale(a, valid);

  std::vector<double> z(static_cast<size_t>(N * V));  // [N, V] logits
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double s = 0;
      for (int64_t k = 0; k < D; ++k) s += x[i * D + k] * w[j * D + k];
      z[i * V + j] = s;
    }
  std::vector<double> g(static_cast<size_t>(N * V), 0.0);  // [N, V] dL/dz (times c_t)
  double loss_sum = 0, z_sum = 0;
  for (int64_t i = 0; i < N; ++i) {
    const double* zi = &z[i * V];  // [V]
    double m = zi[0];
    for (int64_t j = 1; j < V; ++j) m = std::max(m, zi[j]);
    double s = 0, zs = 0;
    for (int64_t j = 0; j < V; ++j) {
      s += std::exp(zi[j] - m);
      zs += zi[j];
    }
    const double l = m + std::log(s);
    lse[i] = l;
    const int64_t y = target(i);
    double li = 0, zli = 0, c = 0;
    if (y != kLceIgnoreIndex) {
      zli = lam * l * l;
      li = l - (1 - eps) * zi[y] - eps / static_cast<double>(V) * zs + zli;
      c = none ? (backward ? a.dloss.ptr<double>()[i] : 0.0) : scale;
    }
    if (none) {
      loss[i] = li;
      zl[i] = zli;
    }
    loss_sum += li;
    z_sum += zli;
    if (backward && c != 0)
      for (int64_t j = 0; j < V; ++j)
        g[i * V + j] = c * ((1 + 2 * lam * l) * std::exp(zi[j] - l) - eps / static_cast<double>(V) -
                            (j == y ? 1 - eps : 0.0));
  }
  if (!none) {
    loss[0] = loss_sum * scale;
    zl[0] = z_sum * scale;
  }
  if (!backward) return;
  const double up = !none && a.dloss.defined() ? a.dloss.ptr<double>()[0] : 1.0;
  double* dx = a.dx.ptr<double>();  // [N, D]
  double* dw = a.dw.ptr<double>();  // [V, D]
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < D; ++k) {
      double s = 0;
      for (int64_t j = 0; j < V; ++j) s += g[i * V + j] * w[j * D + k];
      dx[i * D + k] = up * s;
    }
  for (int64_t j = 0; j < V; ++j)
    for (int64_t k = 0; k < D; ++k) {
      double s = 0;
      for (int64_t i = 0; i < N; ++i) s += g[i * V + j] * x[i * D + k];
      dw[j * D + k] += up * s;
    }
}

void forward(const LinearCrossEntropyArgs& a) { run(a, false); }
void forward_backward(const LinearCrossEntropyArgs& a) { run(a, true); }

const LinearCrossEntropyTable kTable{forward, forward_backward};
}  // namespace

GDN_REGISTER(linear_cross_entropy_ref) {
  Registry::global().add_impl({"linear_cross_entropy", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
