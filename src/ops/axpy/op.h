// axpy: y += alpha · x, elementwise over two tensors of the same shape and dtype. The model uses
// it where two gradient paths meet (the residual stream: d h = d h_out + d(norm input)).
// Shapes: any, same numel, contiguous. y is accumulated (+=). Dtypes: ref F64, cpu F32, cuda bf16
// or F32 (fp32 arithmetic). Deterministic: yes (elementwise).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct AxpyArgs {
  Tensor x;  // [*]
  Tensor y;  // [*] in/out (+=)
  double alpha = 1.0;
};

struct AxpyTable {
  void (*run)(const AxpyArgs&);
};

void axpy(const AxpyArgs& a);

}  // namespace gdn::ops
