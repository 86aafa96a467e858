// Tensor views and owned tensors.
//
// Tensor is a non-owning view: pointer, dtype, shape, strides (in elements), device. Ops take
// views. OwnedTensor owns its storage (host memory, or device memory through the device hooks) and
// hands out views. Shapes are row-major ("C order"); the default strides are contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gdn/core/dtype.h"
#include "gdn/core/error.h"

namespace gdn {

enum class Device : uint8_t { CPU, CUDA };
std::string_view device_name(Device d);

constexpr int kMaxDims = 6;

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, std::span<const int64_t> shape, Device device = Device::CPU);
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::CPU)
      : Tensor(data, dtype, std::span<const int64_t>(shape.begin(), shape.size()), device) {}

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int ndim() const { return ndim_; }
  // size(d) accepts negative d (counted from the back), like PyTorch.
  int64_t size(int d) const;
  int64_t stride(int d) const;
  std::span<const int64_t> shape() const { return {shape_.data(), static_cast<size_t>(ndim_)}; }
  std::vector<int64_t> shape_vec() const { return {shape_.begin(), shape_.begin() + ndim_}; }
  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype_); }
  // False only for a default-constructed view (an optional tensor that was not given).
  bool defined() const { return defined_; }
  bool is_contiguous() const;
  std::string shape_str() const;  // "[4, 8]"
  std::string describe() const;   // "F32[4, 8] cpu"

  // Typed pointer; throws if the tensor's dtype is not T.
  template <class T>
  T* ptr() const {
    GDN_CHECK(dtype_of<T>() == dtype_, "tensor of dtype {} accessed as {}", dtype_name(dtype_),
              dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }
  // A view with a new shape over the same contiguous storage (numel must match).
  Tensor reshape(std::initializer_list<int64_t> shape) const;
  Tensor reshape(std::span<const int64_t> shape) const;
  // A view of rows [begin, end) of dimension 0.
  Tensor slice0(int64_t begin, int64_t end) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Device device_ = Device::CPU;
  int ndim_ = 0;
  bool defined_ = false;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

// Expectations used by op entry points. `op` and `name` make the message say which tensor of which
// op is wrong: "rmsnorm: tensor 'w' has shape [5], expected [4]". -1 in `shape` matches any size.
void expect_shape(const Tensor& t, std::string_view op, std::string_view name,
                  std::initializer_list<int64_t> shape);
void expect_dtype(const Tensor& t, std::string_view op, std::string_view name, DType dtype);
void expect_contiguous(const Tensor& t, std::string_view op, std::string_view name);
void expect_device(const Tensor& t, std::string_view op, std::string_view name, Device device);
void expect_defined(const Tensor& t, std::string_view op, std::string_view name);
// Same device, dtype in `allowed`, contiguous, shape: the common combination.
void expect_tensor(const Tensor& t, std::string_view op, std::string_view name, DType dtype,
                   std::initializer_list<int64_t> shape);

// --- device memory hooks ---------------------------------------------------------------------
// The core library knows nothing about CUDA; the CUDA runtime (src/backend/cuda) installs these
// hooks at start-up when it is compiled in and a device is present.
struct DeviceHooks {
  void* (*alloc)(size_t bytes) = nullptr;
  void (*free)(void* p) = nullptr;
  // Copies n bytes; kinds are inferred by the runtime (unified addressing). Synchronous.
  void (*copy)(void* dst, const void* src, size_t n) = nullptr;
  void (*memset_zero)(void* p, size_t n) = nullptr;
  void (*synchronize)() = nullptr;
  // Device-to-device copy ordered on the compute stream, without waiting for it (used inside a
  // training step, which must not synchronise the host). Optional: without it, `copy` is used.
  void (*copy_d2d)(void* dst, const void* src, size_t n) = nullptr;
  // Strided 2-D device copy (cudaMemcpy2D semantics), also asynchronous on the compute stream:
  // `height` rows of `width` bytes. Optional: without it copy_2d copies row by row.
  void (*copy2d)(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                 size_t height) = nullptr;
  // Bytes of device memory in use (total - free), for the memory report. Optional.
  size_t (*memory_used)() = nullptr;
  // Stream-ordered copy in any direction without waiting (host memory from host_alloc_pinned).
  void (*copy_async)(void* dst, const void* src, size_t n) = nullptr;
  // Page-locked host memory (cudaMallocHost), which copy_async reads and writes directly.
  void* (*host_alloc_pinned)(size_t bytes) = nullptr;
  void (*host_free_pinned)(void* p) = nullptr;
  // Events on the compute stream: record marks the work issued so far, synchronize waits for it.
  void* (*event_create)() = nullptr;
  void (*event_destroy)(void* e) = nullptr;
  void (*event_record)(void* e) = nullptr;
  void (*event_synchronize)(void* e) = nullptr;
  float (*event_elapsed_ms)(void* start, void* end) = nullptr;  // both recorded and complete
  // How many times the host has waited for all the device work issued so far (device or stream
  // synchronisation, synchronous copies; not event waits, which wait for an earlier mark).
  uint64_t (*drains)() = nullptr;
};
void set_cuda_hooks(const DeviceHooks& hooks);
bool cuda_available();
void* device_alloc(Device d, size_t bytes);
void device_free(Device d, void* p);
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n);
void zero_bytes(void* p, Device d, size_t n);
// Copies `rows` rows of `width` bytes between two buffers on the same device with the given row
// pitches (used to split packed projections into contiguous per-part tensors and back).
void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
             size_t rows, Device device);
void device_synchronize(Device d);
// Device memory in use by this process and others (cudaMemGetInfo total - free); 0 without CUDA.
size_t device_memory_used();

// --- transfers that do not wait (a training step never synchronises the host, issue 8) ---------
// Host memory that the device copies to and from without staging: page-locked when `device` is
// CUDA, ordinary memory for the CPU. Owned, freed on destruction; zero-initialised.
class HostStaging {
 public:
  HostStaging() = default;
  HostStaging(size_t bytes, Device device);
  void* data() const { return p_.get(); }
  size_t size() const { return n_; }

 private:
  std::shared_ptr<void> p_;
  size_t n_ = 0;
};
// Copies n bytes in the compute stream's order without waiting for it: device to device, or
// between device memory and a HostStaging buffer of that device (host to host: memcpy). The host
// side must not be touched until a StreamFence recorded after the copy has been waited on.
void copy_bytes_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n);
// A mark in the compute stream: record() covers the work issued so far, wait() blocks the host
// until it is done. For the CPU both are no-ops (every CPU op completes before it returns).
class StreamFence {
 public:
  explicit StreamFence(Device device = Device::CPU);
  ~StreamFence();
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;
  StreamFence(StreamFence&& o) noexcept;
  StreamFence& operator=(StreamFence&& o) noexcept;
  void record();
  void wait();
  // Device time from `start`'s mark to this one's, in ms (both recorded; this one waited on);
  // -1 for the CPU or when the device cannot tell (the caller then times with the host clock).
  double ms_since(const StreamFence& start) const;

 private:
  Device device_ = Device::CPU;
  void* event_ = nullptr;
};
// How many times this process has drained the device's queue: waited for all the work issued so
// far (device or stream synchronisation, synchronous copies), leaving the device idle until the
// host issues more. 0 without CUDA. A training step must not add any (tests check the difference);
// StreamFence::wait waits for an earlier mark and is not counted.
uint64_t device_drains();

// --- owned tensors ---------------------------------------------------------------------------
class OwnedTensor {
 public:
  OwnedTensor() = default;
  static OwnedTensor empty(DType dtype, std::span<const int64_t> shape, Device d = Device::CPU);
  static OwnedTensor empty(DType dtype, std::initializer_list<int64_t> shape,
                           Device d = Device::CPU) {
    return empty(dtype, std::span<const int64_t>(shape.begin(), shape.size()), d);
  }
  static OwnedTensor zeros(DType dtype, std::span<const int64_t> shape, Device d = Device::CPU);
  static OwnedTensor zeros(DType dtype, std::initializer_list<int64_t> shape,
                           Device d = Device::CPU) {
    return zeros(dtype, std::span<const int64_t>(shape.begin(), shape.size()), d);
  }
  const Tensor& view() const { return view_; }
  operator const Tensor&() const { return view_; }  // NOLINT: views flow into ops implicitly
  template <class T>
  T* ptr() const {
    return view_.ptr<T>();
  }
  int64_t numel() const { return view_.numel(); }
  bool defined() const { return view_.defined(); }

 private:
  std::shared_ptr<void> storage_;
  Tensor view_;
};

// Converts (and moves) a contiguous tensor to another dtype and device. Float to float conversions
// round to nearest even; int to int conversions check the range.
OwnedTensor convert(const Tensor& src, DType dtype, Device device = Device::CPU);
// Copies src into dst (same shape and numel; dtype converted on the host if they differ).
void copy_into(const Tensor& dst, const Tensor& src);
// Reads a float tensor (any float dtype, any device) into host doubles.
std::vector<double> to_f64_vector(const Tensor& t);
// An owned host tensor filled from doubles, converted to `dtype`.
OwnedTensor from_f64(std::span<const double> values, DType dtype,
                     std::initializer_list<int64_t> shape, Device device = Device::CPU);
OwnedTensor from_f64(std::span<const double> values, DType dtype, std::span<const int64_t> shape,
                     Device device = Device::CPU);

}  // namespace gdn
