// Row-major GEMM through cuBLASLt with cached plans, shared by every CUDA op that multiplies
// matrices (the gemm op, the fused linear cross-entropy): bf16 A and B, fp32 accumulation
// (CUBLAS_COMPUTE_32F, fp32 alpha and beta), C bf16 or fp32, explicit leading dimensions so that
// operands may be row blocks or column slabs of larger buffers.
//
//   C = alpha op(A) op(B) + beta C       C [m, n] (ldc >= n), op(A) [m, k], op(B) [k, n]
//   A: [m, k] (lda >= k), or [k, m] (lda >= m) when trans_a
//   B: [k, n] (ldb >= n), or [n, k] (ldb >= k) when trans_b
// beta == 0 leaves C unread (BLAS semantics: C may hold NaN). m, n, k >= 1 (callers handle empty
// products). Enqueued on Context::stream(); no allocation, no synchronisation (except in debug
// builds, which synchronise after the call so that a fault is reported at its own call).
//
// Plans (descriptors + the heuristic's algorithm) are made once per (shape, leading dimensions,
// transposes, C dtype, pointer alignments) and kept for the process; the alignments are part of
// the key because the heuristic otherwise assumes 256-byte aligned pointers and may pick an
// algorithm that faults on a sliced operand. Split-K reductions are restricted to schemes that
// reduce in fp32 (in place only when C itself is fp32), never in bf16. For a fixed plan cuBLASLt
// is bitwise reproducible on one GPU model and toolkit (cuBLAS documentation, "Results
// reproducibility"), and the plan is a pure function of the key.
//
// Include from .cu files of CUDA builds only (the implementation is src/backend/cuda/cublaslt.cu).
#pragma once

#include <cstdint>

namespace gdn::cuda {

struct LtMatmul {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // bf16, see above
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;  // bf16
  int64_t ldb = 0;
  bool trans_b = false;
  void* c = nullptr;  // bf16, or fp32 when c_f32
  int64_t ldc = 0;
  bool c_f32 = false;
  float alpha = 1.f;
  float beta = 0.f;
  const char* what = "gemm (cuda)";  // names the caller in error messages
};

void lt_matmul(const LtMatmul& g);

}  // namespace gdn::cuda
