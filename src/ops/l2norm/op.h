// L2 normalisation over the last dimension: q and k of GDN, per token and key head over dk
// (FLA `fla/modules/l2norm.py`, used by chunk_gated_delta_rule with use_qk_l2norm_in_kernel=True;
// gdn_spec.md §3.6, ops_notes.md §4).
//
//   rstd = 1 / sqrt(sum(x^2) + eps)                     per row, fp32 (fp64 in ref)
//   y    = x * rstd
// eps convention (FLA and HF): eps is added to the SUM of squares (not the mean) INSIDE the square
// root, default 1e-6. This is neither F.normalize (x / max(||x||, 1e-12)) nor the eps-outside form
// FLA uses for its norm layers; an all-zero row gives y = 0 and rstd = 1/sqrt(eps) = 1000.
//
// Shapes: x [R, D] (callers flatten [T, H, dk] into R = T*H rows of D = dk), y [R, D], rstd [R].
// Forward writes y (=) and rstd (=); both are outputs so that callers keep them for backward
// (FLA's chunk_gated_delta_rule saves q_hat and q_rstd; GDN needs q_hat, k_hat for its own
// backward anyway, so nothing extra is saved).
// Backward reads y and rstd (not x) and the upstream dy:
//   dx = rstd * (dy - y * <dy, y>)                        written (=), <.,.> over the row
// This is exact with eps (y is not exactly unit-norm): d rstd / dx = -rstd^3 x.
// Dtypes: ref F64 everywhere; cpu F32; cuda bf16 x/y/dy/dx with F32 rstd.
// Deterministic: yes (no cross-row reduction).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct L2NormFwd {
  Tensor x;     // [R, D]
  Tensor y;     // [R, D] out
  Tensor rstd;  // [R] out (F64 on ref, F32 otherwise)
  double eps = 1e-6;
};

struct L2NormBwd {
  Tensor y;     // [R, D] from forward
  Tensor rstd;  // [R] from forward
  Tensor dy;    // [R, D]
  Tensor dx;    // [R, D] out (=)
};

struct L2NormTable {
  void (*forward)(const L2NormFwd&);
  void (*backward)(const L2NormBwd&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void l2norm_forward(const L2NormFwd& a);
void l2norm_backward(const L2NormBwd& a);

// The dtype of rstd for a given activation dtype (F64 for ref, F32 otherwise).
inline DType l2norm_stat_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

}  // namespace gdn::ops
