// Elementwise product: y = a * b. A building block of the unfused A/B route of the SwiGLU
// (kernels.fused_swiglu false: silu(gate), then this pass with up), which exists to be compared
// against the fused kernel (docs/TRAINING.md). There is no separate backward: the gradients of a
// product are products (da = dy * b, db = dy * a), which callers form with this op. Shapes: any,
// same numel, contiguous; y may alias a or b. Dtypes: ref F64; cpu F32; cuda bf16 storage, fp32
// arithmetic, one rounding of y. Deterministic: yes (elementwise).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct MulArgs {
  Tensor a;  // [*]
  Tensor b;  // [*]
  Tensor y;  // [*] out (=); may alias a or b
};

struct MulTable {
  void (*run)(const MulArgs&);
};

void mul(const MulArgs& a);

}  // namespace gdn::ops
