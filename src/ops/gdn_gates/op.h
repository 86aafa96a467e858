// GDN gates (gdn_spec.md §1.5.2 step 5, §3.5 rows 8 and 10): the log-decay g and the write
// strength beta of every (token, value head), from the a/b projections and two per-head
// parameters.
//
//   x        = a[t,h] + dt_bias[h]
//   g[t,h]   = -exp(A_log[h]) * softplus(x)        softplus(x) = x              if x > 20
//                                                               = log1p(exp(x)) otherwise
//   beta[t,h] = sigmoid(b[t,h])
//
// The softplus threshold is torch's (beta = 1, threshold = 20), which HF uses; FLA's kernel
// softplus uses the same threshold. g <= 0, so the decay alpha = exp(g) lies in (0, 1].
// Shapes: a, b, g, beta [T, Hv] (callers flatten leading dims into T); A_log, dt_bias [Hv].
// Forward writes g (=) and beta (=). Forward saves nothing: backward recomputes softplus, exp and
// sigmoid from a, b, A_log and dt_bias (a few flops per element; reading g and beta back would
// cost the same bytes as reading a and b).
// Backward (dg, dbeta given; sp' = derivative of the softplus actually computed: sigmoid(x) for
// x <= 20, exactly 1 above, as torch's softplus backward):
//   da[t,h]       = -dg[t,h] * exp(A_log[h]) * sp'(x)                  written (=)
//   db[t,h]       =  dbeta[t,h] * beta[t,h] * (1 - beta[t,h])           written (=)
//   dA_log[h]    +=  sum_t dg[t,h] * g[t,h]                            accumulated (+=)
//   ddt_bias[h]  +=  sum_t da[t,h]                                     accumulated (+=)
// dA_log and ddt_bias may be gradient-accumulation buffers (hence +=).
// Dtypes: ref F64 everywhere. cpu: F32 everywhere. cuda: a, b, da, db in bf16 (the activation
//   dtype), A_log, dt_bias, g, beta, dg, dbeta, dA_log, ddt_bias in F32 (ARCHITECTURE §4: gates
//   are fp32; A_log is stored F32 in the official checkpoints).
// Determinism: yes. cpu reduces dA_log / ddt_bias over fixed blocks of 128 tokens and then sums
//   the block partials in block order, so the result does not depend on the thread count. cuda
//   does the same with tiles of 64 tokens (fixed lane and tile orders, no float atomics).
// Bad input: A_log and dt_bias must be finite (checked for host tensors, error names the tensor
//   and the index). a and b may hold any finite value. Overflow behaviour (fp32; fp64 analogous):
//   - exp(A_log) overflows to +inf for A_log > 88.7; then g = -inf (or NaN where softplus
//     underflows to 0, i.e. a + dt_bias < -103). Trained A_log stays near log(1..16).
//   - softplus(x) = x for large x, so g = -exp(A_log) * x is finite unless |x| * exp(A_log)
//     exceeds 3.4e38; a g of -inf means alpha = exp(g) = 0 (full decay), which downstream ops
//     handle, but dA_log then becomes inf/NaN.
//   - softplus(x) underflows to 0 for x < -103: g = -0, alpha = 1 (no decay); gradients stay
//     finite (da -> 0).
//   - sigmoid saturates to exactly 1 for b > ~17 and to 0 for b < -88.7 (fp32): db = 0 there,
//     never NaN.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct GdnGatesFwd {
  Tensor a;        // [T, Hv] activation dtype
  Tensor b;        // [T, Hv] activation dtype
  Tensor A_log;    // [Hv] gate dtype
  Tensor dt_bias;  // [Hv] gate dtype
  Tensor g;        // [T, Hv] gate dtype, out (=)
  Tensor beta;     // [T, Hv] gate dtype, out (=)
};

struct GdnGatesBwd {
  Tensor a;         // [T, Hv] activation dtype
  Tensor b;         // [T, Hv] activation dtype
  Tensor A_log;     // [Hv] gate dtype
  Tensor dt_bias;   // [Hv] gate dtype
  Tensor dg;        // [T, Hv] gate dtype
  Tensor dbeta;     // [T, Hv] gate dtype
  Tensor da;        // [T, Hv] activation dtype, out (=)
  Tensor db;        // [T, Hv] activation dtype, out (=)
  Tensor dA_log;    // [Hv] gate dtype, out (+=)
  Tensor ddt_bias;  // [Hv] gate dtype, out (+=)
};

struct GdnGatesTable {
  void (*forward)(const GdnGatesFwd&);
  void (*backward)(const GdnGatesBwd&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void gdn_gates_forward(const GdnGatesFwd& args);
void gdn_gates_backward(const GdnGatesBwd& args);

// The dtype of A_log, dt_bias, g, beta and their gradients for a given activation dtype (F64 for
// ref, F32 otherwise).
inline DType gdn_gates_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

// torch's softplus threshold: softplus(x) returns x for x > kSoftplusThreshold.
inline constexpr double kGdnSoftplusThreshold = 20.0;

// CUDA workspace (gdn/backend/op_workspace.h): the CUDA backward takes the per-tile partial sums
// of dA_log and ddt_bias, [2, ceil(T / kGdnGatesTileT), Hv] fp32; exact for a call of T tokens and
// Hv heads (the forward takes none).
inline constexpr int64_t kGdnGatesTileT = 64;  // tokens per backward block
inline size_t gdn_gates_workspace_bytes(int64_t T, int64_t Hv) {
  const int64_t ntiles = (std::max<int64_t>(T, 0) + kGdnGatesTileT - 1) / kGdnGatesTileT;
  return 2 * static_cast<size_t>(ntiles) * static_cast<size_t>(std::max<int64_t>(Hv, 0)) *
         sizeof(float);
}

}  // namespace gdn::ops
