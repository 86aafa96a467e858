// GDN gates reference: fp64, plain loops, no threading. The oracle for every other implementation.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/gdn_gates/op.h"

namespace gdn::ops {

namespace {
// softplus with torch's threshold, and the derivative of exactly that function.
double softplus(double x) { return x > kGdnSoftplusThreshold ? x : std::log1p(std::exp(x)); }
double softplus_grad(double x) {
  return x > kGdnSoftplusThreshold ? 1.0 : 1.0 / (1.0 + std::exp(-x));
}
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void forward(const GdnGatesFwd& p) {
  const int64_t T = p.a.size(0), H = p.a.size(1);
  const double* a = p.a.ptr<double>();              // [T, Hv]
  const double* b = p.b.ptr<double>();              // [T, Hv]
  const double* A_log = p.A_log.ptr<double>();      // [Hv]
  const double* dt_bias = p.dt_bias.ptr<double>();  // [Hv]
  double* g = p.g.ptr<double>();                    // [T, Hv]
  double* beta = p.beta.ptr<double>();              // [T, Hv]
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = t * H + h;
      g[i] = -std::exp(A_log[h]) * softplus(a[i] + dt_bias[h]);
      beta[i] = sigmoid(b[i]);
    }
}

void backward(const GdnGatesBwd& p) {
  const int64_t T = p.a.size(0), H = p.a.size(1);
  const double* a = p.a.ptr<double>();              // [T, Hv]
  const double* b = p.b.ptr<double>();              // [T, Hv]
  const double* A_log = p.A_log.ptr<double>();      // [Hv]
  const double* dt_bias = p.dt_bias.ptr<double>();  // [Hv]
  const double* dg = p.dg.ptr<double>();            // [T, Hv]
  const double* dbeta = p.dbeta.ptr<double>();      // [T, Hv]
  double* da = p.da.ptr<double>();                  // [T, Hv]
  double* db = p.db.ptr<double>();                  // [T, Hv]
  double* dA_log = p.dA_log.ptr<double>();          // [Hv]
  double* ddt_bias = p.ddt_bias.ptr<double>();      // [Hv]
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = t * H + h;
      const double x = a[i] + dt_bias[h], e = std::exp(A_log[h]);
      const double g = -e * softplus(x);
      da[i] = -dg[i] * e * softplus_grad(x);
      dA_log[h] += dg[i] * g;
      ddt_bias[h] += da[i];
      const double s = sigmoid(b[i]);
      db[i] = dbeta[i] * s * (1.0 - s);
    }
}

const GdnGatesTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gdn_gates_ref) {
  Registry::global().add_impl({"gdn_gates", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
