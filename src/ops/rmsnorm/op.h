// RMSNorm, plain and zero-centred (Qwen3.5), over the last dimension.
//
//   r    = 1 / sqrt(mean(x^2) + eps)                    per row, fp32 (fp64 in ref)
//   plain:         y = x * r * w
//   zero-centred:  y = x * r * (1 + w)                  (1 + w) formed in fp32: in bf16,
//                                                       1 + 0.0039 rounds to 1 (ARCHITECTURE §4)
// Shapes: x [R, D] (callers flatten leading dims into R rows), w [D], y [R, D], rstd [R] fp32.
// Forward writes y (=) and rstd (=). rstd is what forward saves for backward (with x and w).
// Backward (dy given):
//   xhat = x * r, gw = w (plain) or 1 + w (zero-centred)
//   dx   = r * (dy*gw - xhat * mean(dy*gw*xhat))          written (=)
//   dw  += sum_rows(dy * xhat)                            accumulated (+=) in fp32: dw may be a
//                                                         gradient-accumulation buffer
// Dtypes: ref F64 everywhere; cpu F32; cuda bf16 x/w/y/dy/dx with F32 rstd and dw.
// Deterministic: yes (dw reduced in a fixed order).
#pragma once

#include "gdn/backend/op_workspace.h"
#include "gdn/core/tensor.h"

namespace gdn::ops {

struct RmsNormFwd {
  Tensor x;     // [R, D]
  Tensor w;     // [D]
  Tensor y;     // [R, D] out
  Tensor rstd;  // [R] out (F64 on ref, F32 otherwise)
  double eps = 1e-6;
  bool zero_centred = false;
};

struct RmsNormBwd {
  Tensor x;     // [R, D]
  Tensor w;     // [D]
  Tensor rstd;  // [R] from forward
  Tensor dy;    // [R, D]
  Tensor dx;    // [R, D] out (=)
  Tensor dw;    // [D] out (+=)
  bool zero_centred = false;
};

struct RmsNormTable {
  void (*forward)(const RmsNormFwd&);
  void (*backward)(const RmsNormBwd&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void rmsnorm_forward(const RmsNormFwd& a);
void rmsnorm_backward(const RmsNormBwd& a);

// The dtype of rstd / dw for a given activation dtype (F64 for ref, F32 otherwise).
inline DType rmsnorm_stat_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

// CUDA workspace (gdn/backend/op_workspace.h). The backward of both CUDA implementations (cuda,
// cuda.sm90_bulk) takes [grid, D] fp32 per-block dw partial sums: rmsnorm_partial_bytes is the
// request for a grid. Their persistent grids are at most min(R, sm_count * occupancy) blocks
// (each block takes at least one row), so rmsnorm_workspace_bytes bounds every request of a call
// of R rows of width D on a device of `sm_count` multiprocessors holding at most
// `max_blocks_per_sm` resident blocks (cudaDeviceProp::multiProcessorCount,
// ::maxBlocksPerMultiProcessor). The forward and the cpu/ref implementations take none.
inline size_t rmsnorm_partial_bytes(int64_t grid, int64_t D) {
  return static_cast<size_t>(grid) * static_cast<size_t>(D) * sizeof(float);
}
inline size_t rmsnorm_workspace_bytes(int64_t R, int64_t D, int sm_count, int max_blocks_per_sm) {
  return rmsnorm_partial_bytes(persistent_grid_bound(R, sm_count, max_blocks_per_sm), D);
}

}  // namespace gdn::ops
