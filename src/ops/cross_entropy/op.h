// Softmax cross-entropy with z-loss over materialised logits, per row, with the gradient formed in
// the same pass. The separate CE pass of the unfused LM-head route (kernels.fused_lm_head false:
// logits chunk = x W^T by gemm, then this op, then dx and dW by gemm), which exists to be compared
// against the fused linear_cross_entropy (docs/TRAINING.md). No label smoothing (the model uses
// none).
//
// Per row t with target y_t != -100, z = logits[t]:
//   lse_t = log sum_j exp(z_j)                        (max-shifted)
//   L_t   = lse_t - z_{y_t} + lambda lse_t^2           loss[t]   (=)
//   Z_t   = lambda lse_t^2                             z_loss[t] (=)
//   dlogits[t, j] = c ((1 + 2 lambda lse_t) p_j - [j = y_t]),  p = softmax(z), c = grad_scale
// p_y - 1 is formed as expm1(z_y - lse) (no cancellation when p_y ~ 1). Ignored rows (-100): loss
// and z_loss 0, a zero gradient row, their lse still written. The caller reduces the rows (the
// model sums loss[] over the micro-batch and divides by its denominator, which is also c).
// Shapes: logits, dlogits [R, V]; targets [R] I32 in [0, V) or -100 (host targets are checked and
// an error names the row; device targets are not read by the host: an out-of-range one gives its
// row loss NaN and a zero gradient row); loss, lse, z_loss [R].
// dlogits is optional (absent: forward only) and may alias logits (each row is read completely
// before it is overwritten).
// Dtypes: ref F64 everywhere; cpu F32 (row sums in double); cuda bf16 logits and dlogits, F32
// loss, lse, z_loss, fp32 arithmetic. Deterministic: yes (fixed-order row reductions).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct CrossEntropyArgs {
  Tensor logits;            // [R, V]
  Tensor targets;           // [R] I32
  Tensor loss;              // [R] out (=), stat dtype
  Tensor lse;               // [R] out (=), stat dtype
  Tensor z_loss;            // [R] out (=), stat dtype
  Tensor dlogits{};         // [R, V] optional out (=); may alias logits
  double z_loss_scale = 0;  // lambda >= 0
  double grad_scale = 1;    // c
};

struct CrossEntropyTable {
  void (*run)(const CrossEntropyArgs&);
};

void cross_entropy(const CrossEntropyArgs& a);

// F64 on ref, F32 otherwise.
inline DType cross_entropy_stat_dtype(DType act) {
  return act == DType::F64 ? DType::F64 : DType::F32;
}

}  // namespace gdn::ops
