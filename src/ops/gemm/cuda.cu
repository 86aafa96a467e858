// GEMM on CUDA through cuBLASLt: bf16 A and B, fp32 accumulation (CUBLAS_COMPUTE_32F, fp32 alpha
// and beta), C bf16 or fp32 (the fp32 case is dW accumulation with beta = 1). op.h has the
// contract.
//
// Row-major to cuBLASLt's column-major: a row-major [R, C] buffer is the column-major [C, R] matrix
// with the same leading dimension, so C = op(A) op(B) (row-major, [M, N]) is computed as the
// column-major product C^T [N, M] = op(B)^T op(A)^T, with our B as cuBLASLt's first operand:
//   cuBLASLt A := b, stored col-major [N, K] (ld N) when !trans_b (op N), [K, N] (ld K) if trans_b
//   (op T) cuBLASLt B := a, stored col-major [K, M] (ld K) when !trans_a (op N), [M, K] (ld M) if
//   trans_a (op T) cuBLASLt C = D := c, col-major [N, M] (ld N)
// beta == 0 leaves C unread (BLAS semantics; the op's probe checks it with a NaN-filled C).
//
// Plans: the descriptors and the heuristic's algorithm are made once per (shape, transposes, C
// dtype, pointer alignments) and kept for the process (the heuristic query costs tens of
// microseconds; a training step repeats the same few shapes). Alignments are part of the key
// because the heuristic otherwise assumes 256-byte aligned pointers and may pick an algorithm that
// faults on a sliced tensor.
//
// Precision and determinism: split-K reductions are restricted to schemes that reduce in fp32
// (compute type; in place only when C itself is fp32), never in bf16. For a fixed plan cuBLASLt is
// bitwise reproducible on one GPU model and toolkit version (cuBLAS documentation, "Results
// reproducibility"); the plan is a pure function of the key.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/gemm/op.h"

namespace gdn::ops {

namespace {

struct PlanKey {
  int64_t m, n, k;
  bool ta, tb;
  bool c_f32;
  uint32_t align_a, align_b, align_c;
  auto tie() const { return std::tie(m, n, k, ta, tb, c_f32, align_a, align_b, align_c); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t lb = nullptr;  // cuBLASLt's A: our b
  cublasLtMatrixLayout_t la = nullptr;  // cuBLASLt's B: our a
  cublasLtMatrixLayout_t lc = nullptr;  // C and D
  cublasLtMatmulAlgo_t algo{};
};

// The largest power of two <= 256 that divides the address (cuBLASLt's alignment preferences).
uint32_t alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

Plan make_plan(const PlanKey& key) {
  cuda::Context& ctx = cuda::Context::get();
  Plan p;
  GDN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;   // on our b
  const cublasOperation_t op_second = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // on our a
  GDN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                                  sizeof(op_first)));
  GDN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                                  sizeof(op_second)));
  const uint64_t M = static_cast<uint64_t>(key.m), N = static_cast<uint64_t>(key.n),
                 K = static_cast<uint64_t>(key.k);
  // Stored (pre-op) column-major shapes; the leading dimension is the stored row count.
  const uint64_t b_rows = key.tb ? K : N, b_cols = key.tb ? N : K;
  const uint64_t a_rows = key.ta ? M : K, a_cols = key.ta ? K : M;
  GDN_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, b_rows, b_cols, static_cast<int64_t>(b_rows)));
  GDN_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, a_rows, a_cols, static_cast<int64_t>(a_rows)));
  GDN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lc, key.c_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M,
                                              static_cast<int64_t>(N)));

  cublasLtMatmulPreference_t pref = nullptr;
  GDN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    GDN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  };
  const size_t ws = ctx.workspace_bytes();
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
  const uint32_t schemes =
      CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | (key.c_f32 ? CUBLASLT_REDUCTION_SCHEME_INPLACE : 0u);
  set_pref(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), p.op, p.lb, p.la, p.lc,
                                                           p.lc, pref, 1, &heur, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  GDN_CHECK_HINT(st == CUBLAS_STATUS_SUCCESS && found > 0 && heur.state == CUBLAS_STATUS_SUCCESS,
                 "the shapes, transposes and pointer alignments above are what cuBLASLt was asked",
                 "gemm (cuda): cuBLASLt has no algorithm for M={} N={} K={} trans_a={} "
                 "trans_b={} C={} (alignments a {} b {} c {} bytes): {}",
                 key.m, key.n, key.k, key.ta, key.tb, key.c_f32 ? "F32" : "BF16", key.align_a,
                 key.align_b, key.align_c, cublasGetStatusString(st));
  p.algo = heur.algo;
  return p;
}

const Plan& plan_for(const PlanKey& key) {
  static std::mutex mu;
  // Leaked on purpose: descriptors must not be destroyed after the CUDA runtime unloads.
  static auto* plans = new std::map<PlanKey, Plan>();
  std::lock_guard lock(mu);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, make_plan(key)).first;
  return it->second;
}

// C = beta * C (K == 0: the product is empty; beta == 0 writes zeros without reading C).
template <class T>
__global__ void scale_kernel(T* c, int64_t n, float beta) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, float>) {
      c[i] = beta == 0.f ? 0.f : beta * c[i];
    } else {
      c[i] = __float2bfloat16_rn(beta == 0.f ? 0.f : beta * __bfloat162float(c[i]));
    }
  }
}

void gemm(const GemmArgs& g) {
  GDN_CHECK(g.a.dtype() == DType::BF16, "gemm (cuda): a and b must be BF16, got {}",
            dtype_name(g.a.dtype()));
  const int64_t M = g.c.size(0), N = g.c.size(1);
  const int64_t K = g.trans_a ? g.a.size(0) : g.a.size(1);
  if (M == 0 || N == 0) return;
  const bool c_f32 = g.c.dtype() == DType::F32;
  const void* a = g.a.data();  // [M, K] or [K, M] bf16
  const void* b = g.b.data();  // [K, N] or [N, K] bf16
  void* c = g.c.data();        // [M, N] bf16 or f32
  cuda::Context& ctx = cuda::Context::get();
  const float alpha = static_cast<float>(g.alpha), beta = static_cast<float>(g.beta);
  if (K == 0) {
    const int64_t n = M * N;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096));
    if (c_f32) {
      scale_kernel<float><<<blocks, 256, 0, ctx.stream()>>>(static_cast<float*>(c), n, beta);
    } else {
      scale_kernel<__nv_bfloat16>
          <<<blocks, 256, 0, ctx.stream()>>>(static_cast<__nv_bfloat16*>(c), n, beta);
    }
    GDN_CUDA_LAUNCH_CHECK("gemm scale_kernel");
    return;
  }
  const PlanKey key{M, N, K, g.trans_a, g.trans_b, c_f32, alignment(a), alignment(b), alignment(c)};
  const Plan& p = plan_for(key);
  GDN_CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt(), p.op, &alpha, b, p.lb, a, p.la, &beta, c, p.lc, c,
                                  p.lc, &p.algo, ctx.workspace(), ctx.workspace_bytes(),
                                  ctx.stream()));
#ifndef NDEBUG
  GDN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // fault at its own call in debug builds
#endif
}

const GemmTable kTable{gemm};

}  // namespace

GDN_REGISTER(gemm_cuda) {
  Registry::global().add_impl({"gemm", "cuda.cublaslt", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
