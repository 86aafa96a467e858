// Helpers for numeric probes and tests: the same values laid out twice, as F64 host tensors for
// `ref` and in the candidate backend's dtype and device. Inputs are rounded to the candidate's
// dtype first so that both implementations see exactly the same numbers and the measured error is
// the kernel's alone.
#pragma once

#include <optional>
#include <vector>

#include "gdn/backend/registry.h"

namespace gdn {

class ProbeTensors {
 public:
  explicit ProbeTensors(Backend candidate) : backend_(candidate) {}
  struct Pair {
    Tensor ref;   // F64 (or integer) on the host
    Tensor cand;  // candidate dtype on the candidate's device
  };
  Backend backend() const { return backend_; }
  // dtype defaults to backend_dtype(candidate); pass F32 for tensors kept in fp32 (states, gates).
  Pair input(std::span<const double> values, std::span<const int64_t> shape,
             std::optional<DType> dtype = std::nullopt);
  Pair input(std::span<const double> values, std::initializer_list<int64_t> shape,
             std::optional<DType> dtype = std::nullopt) {
    return input(values, std::span<const int64_t>(shape.begin(), shape.size()), dtype);
  }
  Pair uniform(std::initializer_list<int64_t> shape, uint64_t seed, double lo, double hi,
               std::optional<DType> dtype = std::nullopt);
  Pair normal(std::initializer_list<int64_t> shape, uint64_t seed, double std,
              std::optional<DType> dtype = std::nullopt);
  // Integer tensors (cu_seqlens, token ids, split-master low halves): identical in both, I16,
  // I32 or I64.
  Pair ints(std::span<const int64_t> values, std::span<const int64_t> shape, DType dtype);
  Pair ints(std::span<const int64_t> values, std::initializer_list<int64_t> shape, DType dtype) {
    return ints(values, std::span<const int64_t>(shape.begin(), shape.size()), dtype);
  }
  // Zero-filled outputs (outputs that ops accumulate into start at zero).
  Pair zeros(std::initializer_list<int64_t> shape, std::optional<DType> dtype = std::nullopt);

 private:
  Backend backend_;
  uint64_t next_stream_ = 1;
  std::vector<OwnedTensor> keep_;
};

}  // namespace gdn
