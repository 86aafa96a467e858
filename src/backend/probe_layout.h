// Probe helpers for the shape classes of vectorised kernels (shape_class.h): probe tensors are
// always 16-byte aligned, so a probe of a class whose pointers are not (the kernels' scalar path)
// moves its candidate tensors to copies that start one element past the boundary.
#pragma once

#include <vector>

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

// The layouts a probe runs for a query with a "vec" dim: misaligned copies (true) for the class
// without vec, aligned tensors (false) for the class with it, both for the default class.
inline std::vector<bool> probe_misalignments(const OpQuery& q) {
  if (q.dims.contains("vec")) return {q.dim("vec", 1) == 0};
  return {false, true};
}

// An element count past one pass of cuda::launch_map2's capped grid (1056 blocks of 256 threads:
// 2 grid-stride passes of 8-element packs, 9 of single elements) on CUDA; a few thousand (past the
// CPU loops' OpenMP threshold) on the CPU.
inline int64_t map2_probe_length(Backend b) {
  return b == Backend::Cuda ? 1056 * 256 * 8 + 8 * 1000 + 3 : 26063;
}

}  // namespace gdn
