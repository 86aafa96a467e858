// Helpers for the ops' shape classes (registry.h: ShapeClass, OpDispatch) and their probes.
#pragma once

#include <cstdint>

#include "gdn/core/tensor.h"

namespace gdn {

// Whether a tensor's data may be read as 16-byte vectors (an undefined tensor does not object).
inline bool aligned16(const Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.data()) % 16 == 0;
}
template <class... Ts>
bool all_aligned16(const Ts&... ts) {
  return (aligned16(ts) && ...);
}

// The width a probe uses for a class of rows of width D whose kernels take `multiple`-wide vectors
// when vec is set: D itself; or, in the scalar class, D + 1 when D is a multiple (the call's
// pointers were not 16-byte aligned; probe tensors always are), which the same scalar code runs;
// and 17 for scalar rows narrower than 16 (the same scalar code over a partial pack per thread: at
// a width of 1 a norm's input gradient is identically 0, so no relative error can be measured).
inline int64_t probe_width(int64_t D, bool vec, int64_t multiple) {
  if (vec) return D;
  if (D < 16) return 17;
  return D % multiple == 0 ? D + 1 : D;
}

}  // namespace gdn
