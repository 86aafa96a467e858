// SiLU, elementwise: y = silu(x) = x * sigmoid(x). A building block of the unfused A/B routes
// (kernels.fused_conv false: the conv without its SiLU, then this pass; kernels.fused_swiglu false:
// this pass, then the mul op), which exist to be compared against the fused kernels
// (docs/TRAINING.md).
//
//   s = sigmoid(x)
//   forward:  y  = x * s                                     written (=)
//   backward: dx = dy * (s + x * s * (1 - s))                written (=)
// Forward saves nothing: backward reads x again. Backward reads each element of x and dy before
// writing that element of dx, so dx may alias dy (or x).
// Shapes: any, same numel, contiguous. Dtypes: ref F64; cpu F32; cuda bf16 storage, fp32
// arithmetic, one rounding per output. Deterministic: yes (elementwise).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct SiluFwd {
  Tensor x;  // [*]
  Tensor y;  // [*] out (=)
};

struct SiluBwd {
  Tensor x;   // [*] (forward input)
  Tensor dy;  // [*]
  Tensor dx;  // [*] out (=); may alias dy or x
};

struct SiluTable {
  void (*forward)(const SiluFwd&);
  void (*backward)(const SiluBwd&);
};

void silu_forward(const SiluFwd& a);
void silu_backward(const SiluBwd& a);

}  // namespace gdn::ops
