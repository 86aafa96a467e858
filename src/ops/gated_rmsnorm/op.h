// Gated RMSNorm of the GDN output (`linear_attn.norm`; HF Qwen3_5RMSNormGated, FLA
// FusedRMSNormGated / rms_norm_gated), per row = one token x one value head, over dv.
// gdn_spec.md §5, ops_notes.md §3.
//
//   r    = 1 / sqrt(mean(x^2) + eps)                    per row, fp32 (fp64 in ref)
//   xhat = x * r
//   y    = (xhat * w) * silu(z),  silu(z) = z * sigmoid(z)
// Norm before gate: the statistic is taken over x alone, z only scales the normalised row. w is a
// plain weight (HF initialises it to ones), NOT zero-centred: no (1 + w) here, unlike rmsnorm.
// Precision follows FLA: everything in fp32 and one rounding of y to the output dtype. HF rounds
// xhat and xhat*w to bf16 on the way (two extra roundings, same function); we do not.
//
// Shapes: x, z [R, D] (callers flatten [T, Hv, dv] into R = T*Hv rows of D = dv), w [D] shared
// by every head, y [R, D], rstd [R].
// Forward writes y (=) and rstd (=). rstd is what forward saves for backward (with x, z and w);
// xhat and silu(z) are recomputed (FLA does the same).
// Backward (dy given), with s = sigmoid(z), y0 = xhat * w, dy' = dy * silu(z):
//   dz   = dy * y0 * s * (1 + z * (1 - s))                 written (=)
//   dx   = r * (dy'*w - xhat * mean(xhat * dy' * w))       written (=)
//   dw  += sum_rows(dy' * xhat)                            accumulated (+=) in fp32: dw may be a
//                                                          gradient-accumulation buffer
// Dtypes: ref F64 everywhere; cpu F32; cuda bf16 x/z/w/y/dy/dx/dz with F32 rstd and dw.
// Deterministic: yes (dw reduced in a fixed order: for a given thread count on cpu, for a given
// device on cuda, whose per-block partial rows follow the resident grid size).
#pragma once

#include "gdn/backend/op_workspace.h"
#include "gdn/core/tensor.h"

namespace gdn::ops {

struct GatedRmsNormFwd {
  Tensor x;     // [R, D]
  Tensor z;     // [R, D] gate (pre-silu)
  Tensor w;     // [D]
  Tensor y;     // [R, D] out
  Tensor rstd;  // [R] out (F64 on ref, F32 otherwise)
  double eps = 1e-6;
};

struct GatedRmsNormBwd {
  Tensor x;     // [R, D]
  Tensor z;     // [R, D]
  Tensor w;     // [D]
  Tensor rstd;  // [R] from forward
  Tensor dy;    // [R, D]
  Tensor dx;    // [R, D] out (=)
  Tensor dz;    // [R, D] out (=)
  Tensor dw;    // [D] out (+=)
};

struct GatedRmsNormTable {
  void (*forward)(const GatedRmsNormFwd&);
  void (*backward)(const GatedRmsNormBwd&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void gated_rmsnorm_forward(const GatedRmsNormFwd& a);
void gated_rmsnorm_backward(const GatedRmsNormBwd& a);

// The dtype of rstd / dw for a given activation dtype (F64 for ref, F32 otherwise).
inline DType gated_rmsnorm_stat_dtype(DType act) {
  return act == DType::F64 ? DType::F64 : DType::F32;
}

// CUDA workspace (gdn/backend/op_workspace.h). The CUDA backward takes [grid, D] fp32 per-block
// dw partial sums (gated_rmsnorm_partial_bytes: the request for a grid); its persistent grid is at
// most min(R, sm_count * occupancy) blocks (each block takes at least one row), so
// gated_rmsnorm_workspace_bytes bounds every request of a call of R rows of width D on a device of
// `sm_count` multiprocessors holding at most `max_blocks_per_sm` resident blocks
// (cudaDeviceProp::multiProcessorCount, ::maxBlocksPerMultiProcessor). The forward takes none.
inline size_t gated_rmsnorm_partial_bytes(int64_t grid, int64_t D) {
  return static_cast<size_t>(grid) * static_cast<size_t>(D) * sizeof(float);
}
inline size_t gated_rmsnorm_workspace_bytes(int64_t R, int64_t D, int sm_count,
                                            int max_blocks_per_sm) {
  return gated_rmsnorm_partial_bytes(persistent_grid_bound(R, sm_count, max_blocks_per_sm), D);
}

}  // namespace gdn::ops
