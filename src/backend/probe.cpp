#include "gdn/backend/probe.h"

#include "gdn/core/rng.h"

namespace gdn {

ProbeTensors::Pair ProbeTensors::input(std::span<const double> values,
                                       std::span<const int64_t> shape, std::optional<DType> dtype) {
  DType dt = dtype.value_or(backend_dtype(backend_));
  // Round through the candidate dtype so that ref sees the same numbers.
  OwnedTensor rounded = from_f64(values, dt, shape);
  OwnedTensor ref = convert(rounded, DType::F64);
  OwnedTensor cand = convert(rounded, dt, backend_device(backend_));
  Pair p{ref.view(), cand.view()};
  keep_.push_back(std::move(ref));
  keep_.push_back(std::move(cand));
  return p;
}

ProbeTensors::Pair ProbeTensors::uniform(std::initializer_list<int64_t> shape, uint64_t seed,
                                         double lo, double hi, std::optional<DType> dtype) {
  Tensor probe(nullptr, DType::F64, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()));
  uint64_t stream = next_stream_++;
  for (size_t i = 0; i < v.size(); ++i) v[i] = lo + (hi - lo) * rng::uniform(seed, stream, i);
  return input(v, std::span<const int64_t>(shape.begin(), shape.size()), dtype);
}

ProbeTensors::Pair ProbeTensors::normal(std::initializer_list<int64_t> shape, uint64_t seed,
                                        double std, std::optional<DType> dtype) {
  Tensor probe(nullptr, DType::F64, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()));
  uint64_t stream = next_stream_++;
  for (size_t i = 0; i < v.size(); ++i) v[i] = std * rng::normal(seed, stream, i);
  return input(v, std::span<const int64_t>(shape.begin(), shape.size()), dtype);
}

ProbeTensors::Pair ProbeTensors::ints(std::span<const int64_t> values,
                                      std::span<const int64_t> shape, DType dtype) {
  Tensor src(const_cast<int64_t*>(values.data()), DType::I64, shape);
  GDN_CHECK(src.numel() == static_cast<int64_t>(values.size()),
            "ProbeTensors::ints: {} values for {}", values.size(), src.shape_str());
  OwnedTensor ref = convert(src, dtype);
  OwnedTensor cand = convert(src, dtype, backend_device(backend_));
  Pair p{ref.view(), cand.view()};
  keep_.push_back(std::move(ref));
  keep_.push_back(std::move(cand));
  return p;
}

ProbeTensors::Pair ProbeTensors::zeros(std::initializer_list<int64_t> shape,
                                       std::optional<DType> dtype) {
  DType dt = dtype.value_or(backend_dtype(backend_));
  OwnedTensor ref = OwnedTensor::zeros(DType::F64, shape);
  OwnedTensor cand = OwnedTensor::zeros(dt, shape, backend_device(backend_));
  Pair p{ref.view(), cand.view()};
  keep_.push_back(std::move(ref));
  keep_.push_back(std::move(cand));
  return p;
}

}  // namespace gdn
