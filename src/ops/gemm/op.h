// GEMM: C = alpha * op(A) * op(B) + beta * C, op = identity or transpose on each side; and the
// linear layer built on it.
//
// Shapes (row-major, contiguous 2-D):
//   op(A) [M, K]: A is [M, K], or [K, M] with trans_a
//   op(B) [K, N]: B is [K, N], or [N, K] with trans_b
//   C     [M, N]
// C is read only when beta != 0: with beta == 0 it is overwritten (=) and may hold anything, NaN
// included (BLAS semantics); with beta == 1 it accumulates (+=). K == 0 gives C = beta * C.
//
// Backward of C = alpha op(A) op(B) + beta C0, given dC (gemm_backward; every term one gemm):
//   d op(A) = alpha dC op(B)^T   so  dA = alpha dC op(B)^T        [M, K]    (no trans_a)
//                                    dA = alpha op(B) dC^T        [K, M]    (trans_a)
//   d op(B) = alpha op(A)^T dC   so  dB = alpha op(A)^T dC        [K, N]    (no trans_b)
//                                    dB = alpha dC^T op(A)        [N, K]    (trans_b)
//   dC0 = beta dC (not formed: the caller scales its own buffer if it needs it).
// dA and dB are written (=) or accumulated (+=) as the caller asks (accumulate_da/db); either may
// be left undefined to skip it. Nothing is saved by forward beyond A and B.
//
// Linear layer (HF nn.Linear without bias, W [out, in]):
//   linear_forward:  y  = x W^T                   x [T, in], W [out, in], y [T, out]   (=)
//   linear_backward: dx = dy W                    dx [T, in]   (= or += with accumulate_dx)
//                    dW += dy^T x                 dW [out, in] (+=: gradient accumulation buffer;
//                                                 = with overwrite_dw)
// Both are plain gemm calls, so they run on whatever gemm resolves to.
//
// Dtypes: ref F64 for A, B, C (plain fp64 loops); cpu F32 (OpenBLAS cblas_sgemm, fp32
// accumulation); cuda (cuBLASLt, cuda.cu): bf16 A/B, fp32 accumulation, C bf16 or F32 (dW
// accumulates in F32).
// Deterministic: ref yes. cpu: whatever OpenBLAS gives; its reduction order depends on its
// blocking and thread count, so expect bitwise-equal results only for the same thread count (not
// verified here beyond the tests' tolerances). cuda: bitwise for one GPU model and toolkit (one
// cached cuBLASLt plan per shape, split-K reduced in fp32 in a fixed order).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct GemmArgs {
  Tensor a;  // [M, K], or [K, M] with trans_a
  Tensor b;  // [K, N], or [N, K] with trans_b
  Tensor c;  // [M, N] out (= when beta == 0, else C = alpha AB + beta C)
  bool trans_a = false;
  bool trans_b = false;
  double alpha = 1.0;
  double beta = 0.0;
};

struct GemmBwd {
  Tensor a;   // as in forward
  Tensor b;   // as in forward
  Tensor dc;  // [M, N]
  Tensor da;  // shape of a; out (= or +=), undefined: skipped
  Tensor db;  // shape of b; out (= or +=), undefined: skipped
  bool trans_a = false;
  bool trans_b = false;
  double alpha = 1.0;
  bool accumulate_da = false;
  bool accumulate_db = false;
};

struct GemmTable {
  void (*gemm)(const GemmArgs&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void gemm(const GemmArgs& a);
void gemm_backward(const GemmBwd& a);

struct LinearFwd {
  Tensor x;  // [T, in]
  Tensor w;  // [out, in]
  Tensor y;  // [T, out] out (=)
};

struct LinearBwd {
  Tensor x;                    // [T, in] (forward input)
  Tensor w;                    // [out, in]
  Tensor dy;                   // [T, out]
  Tensor dx;                   // [T, in] out (= or += with accumulate_dx); undefined: skipped
  Tensor dw;                   // [out, in] out (+=); undefined: skipped (frozen weight)
  bool accumulate_dx = false;  // x feeds several linears (q/k/v, gate/up): sum their dx
  bool overwrite_dw = false;   // dW = dy^T x (its first write of a step, nothing to accumulate)
};

void linear_forward(const LinearFwd& a);
void linear_backward(const LinearBwd& a);

}  // namespace gdn::ops
