// GEMM on CUDA through cuBLASLt: bf16 A and B, fp32 accumulation (CUBLAS_COMPUTE_32F, fp32 alpha
// and beta), C bf16 or fp32 (the fp32 case is dW accumulation with beta = 1). op.h has the
// contract.
//
// The cuBLASLt call itself (row-major mapping, cached plans keyed by shape, leading dimensions,
// transposes, C dtype and pointer alignments, fp32-only split-K) is the shared helper
// src/backend/cuda/cublaslt.h, also used by the fused linear cross-entropy; this file adds the
// K == 0 case and the registration.
//
// beta == 0 leaves C unread (BLAS semantics; the op's probe checks it with a NaN-filled C).
// Determinism: bitwise for one GPU model and toolkit (one cached plan per key, split-K reduced in
// fp32 in a fixed order).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/cublaslt.h"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/gemm/op.h"

namespace gdn::ops {

namespace {

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
  const int64_t lda = g.trans_a ? M : K, ldb = g.trans_b ? K : N;  // contiguous operands
  cuda::lt_matmul(
      {M, N, K, a, lda, g.trans_a, b, ldb, g.trans_b, c, N, c_f32, alpha, beta, "gemm (cuda)"});
}

const GemmTable kTable{gemm};

}  // namespace

GDN_REGISTER(gemm_cuda) {
  Registry::global().add_impl({"gemm", "cuda.cublaslt", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
