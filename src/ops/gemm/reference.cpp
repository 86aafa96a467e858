// GEMM reference: fp64, the triple loop, no threading. The oracle for every other implementation.
#include "gdn/backend/registry.h"
#include "ops/gemm/op.h"

namespace gdn::ops {

namespace {
void gemm(const GemmArgs& g) {
  const int64_t M = g.c.size(0), N = g.c.size(1);
  const int64_t K = g.trans_a ? g.a.size(0) : g.a.size(1);
  const double* a = g.a.ptr<double>();  // [M, K] or [K, M]
  const double* b = g.b.ptr<double>();  // [K, N] or [N, K]
  double* c = g.c.ptr<double>();        // [M, N]
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t p = 0; p < K; ++p) {
        const double av = g.trans_a ? a[p * M + i] : a[i * K + p];
        const double bv = g.trans_b ? b[j * K + p] : b[p * N + j];
        s += av * bv;
      }
      // beta == 0: C is not read (it may hold NaN), as in BLAS.
      c[i * N + j] = g.alpha * s + (g.beta == 0.0 ? 0.0 : g.beta * c[i * N + j]);
    }
  }
}

const GemmTable kTable{gemm};
}  // namespace

GDN_REGISTER(gemm_ref) {
  Registry::global().add_impl({"gemm", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
