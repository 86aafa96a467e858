// Probe helpers for the shape classes of vectorised kernels (shape_class.h): probe tensors are
// always 16-byte aligned, so a probe of a class whose pointers are not (the kernels' scalar path)
// moves its candidate tensors to copies that start one element past the boundary.
#pragma once

#include "gdn/backend/probe.h"

namespace gdn {

// `x` with its candidate tensor copied to a view one element past a 16-byte boundary when
// `misalign` is set (the ref tensor is unchanged); `x` itself otherwise.
inline ProbeTensors::Pair misaligned(ProbeTensors& p, const ProbeTensors::Pair& x, bool misalign) {
  if (!misalign) return x;
  const int64_t n = x.cand.numel();
  const ProbeTensors::Pair buf = p.zeros({n + 1}, x.cand.dtype());
  const Tensor view = buf.cand.slice0(1, n + 1).reshape(x.cand.shape());
  copy_into(view, x.cand);
  return {x.ref, view};
}

}  // namespace gdn
