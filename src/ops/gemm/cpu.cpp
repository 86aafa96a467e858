// GEMM on the CPU: OpenBLAS through cpu::gemm (row-major, fp32 accumulation; the empty-output and
// K == 0 cases and the split over the OpenMP threads are there: backend/cpu/blas.h).
#include "backend/cpu/blas.h"
#include "gdn/backend/registry.h"
#include "ops/gemm/op.h"

namespace gdn::ops {

namespace {
void gemm(const GemmArgs& g) {
  const int64_t M = g.c.size(0), N = g.c.size(1);
  const int64_t K = g.trans_a ? g.a.size(0) : g.a.size(1);
  // Row-major leading dimensions are the stored row lengths (validated contiguous 2-D).
  cpu::gemm(g.trans_a, g.trans_b, M, N, K, static_cast<float>(g.alpha), g.a.ptr<float>(),
            g.a.size(1), g.b.ptr<float>(), g.b.size(1), static_cast<float>(g.beta),
            g.c.ptr<float>(), N);
}

const GemmTable kTable{gemm};
}  // namespace

GDN_REGISTER(gemm_cpu) {
  Registry::global().add_impl({"gemm", "cpu.openblas", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
