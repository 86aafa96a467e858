// GEMM on the CPU: a thin wrapper over OpenBLAS cblas_sgemm (row-major, fp32 accumulation).
// The only work here is the edge cases BLAS rejects or leaves undefined: an empty output, and
// K == 0 (lda would be 0, which cblas refuses; the product is then empty and C = beta C).
#include <cblas.h>

#include <algorithm>

#include "gdn/backend/registry.h"
#include "ops/gemm/op.h"

namespace gdn::ops {

namespace {
void gemm(const GemmArgs& g) {
  const int64_t M = g.c.size(0), N = g.c.size(1);
  const int64_t K = g.trans_a ? g.a.size(0) : g.a.size(1);
  const float* a = g.a.ptr<float>();  // [M, K] or [K, M]
  const float* b = g.b.ptr<float>();  // [K, N] or [N, K]
  float* c = g.c.ptr<float>();        // [M, N]
  if (M == 0 || N == 0) return;
  if (K == 0) {
    const float beta = static_cast<float>(g.beta);
    for (int64_t i = 0; i < M * N; ++i) c[i] = g.beta == 0.0 ? 0.0f : beta * c[i];
    return;
  }
  // Row-major leading dimensions are the stored row lengths (validated contiguous 2-D).
  const auto lda = static_cast<blasint>(g.a.size(1));
  const auto ldb = static_cast<blasint>(g.b.size(1));
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
              g.trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(M),
              static_cast<blasint>(N), static_cast<blasint>(K), static_cast<float>(g.alpha), a,
              std::max<blasint>(lda, 1), b, std::max<blasint>(ldb, 1), static_cast<float>(g.beta),
              c, static_cast<blasint>(N));
}

const GemmTable kTable{gemm};
}  // namespace

GDN_REGISTER(gemm_cpu) {
  Registry::global().add_impl({"gemm", "cpu.openblas", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
