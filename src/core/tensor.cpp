#include "gdn/core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace gdn {

std::string_view device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

Tensor::Tensor(void* data, DType dtype, std::span<const int64_t> shape, Device device)
    : data_(data),
      dtype_(dtype),
      device_(device),
      ndim_(static_cast<int>(shape.size())),
      defined_(true) {
  GDN_CHECK(shape.size() <= static_cast<size_t>(kMaxDims), "tensor rank {} exceeds the maximum {}",
            shape.size(), kMaxDims);
  int64_t stride = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    GDN_CHECK(shape[d] >= 0, "tensor dimension {} is negative ({})", d, shape[d]);
    shape_[d] = shape[d];
    strides_[d] = stride;
    stride *= shape[d];
  }
}

int64_t Tensor::size(int d) const {
  int dd = d < 0 ? d + ndim_ : d;
  GDN_CHECK(dd >= 0 && dd < ndim_, "dimension {} out of range for a tensor of rank {}", d, ndim_);
  return shape_[dd];
}

int64_t Tensor::stride(int d) const {
  int dd = d < 0 ? d + ndim_ : d;
  GDN_CHECK(dd >= 0 && dd < ndim_, "dimension {} out of range for a tensor of rank {}", d, ndim_);
  return strides_[dd];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= shape_[d];
  return n;
}

bool Tensor::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != stride) return false;
    stride *= shape_[d];
  }
  return true;
}

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (int d = 0; d < ndim_; ++d) s += fmt::format("{}{}", d ? ", " : "", shape_[d]);
  return s + "]";
}

std::string Tensor::describe() const {
  return fmt::format("{}{} {}", dtype_name(dtype_), shape_str(), device_name(device_));
}

Tensor Tensor::reshape(std::initializer_list<int64_t> shape) const {
  return reshape(std::span<const int64_t>(shape.begin(), shape.size()));
}

Tensor Tensor::reshape(std::span<const int64_t> shape) const {
  GDN_CHECK(is_contiguous(), "reshape of a non-contiguous tensor {}", describe());
  Tensor t(data_, dtype_, shape, device_);
  GDN_CHECK(t.numel() == numel(), "reshape of {} to {} changes the element count", shape_str(),
            t.shape_str());
  return t;
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  GDN_CHECK(ndim_ >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
            "slice [{}, {}) out of range for {}", begin, end, shape_str());
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.data_ = static_cast<char*>(data_) + begin * strides_[0] * dtype_size(dtype_);
  return t;
}

void expect_defined(const Tensor& t, std::string_view op, std::string_view name) {
  GDN_CHECK(t.defined(), "{}: tensor '{}' is required but was not given", op, name);
}

void expect_shape(const Tensor& t, std::string_view op, std::string_view name,
                  std::initializer_list<int64_t> shape) {
  expect_defined(t, op, name);
  bool ok = t.ndim() == static_cast<int>(shape.size());
  if (ok) {
    int d = 0;
    for (int64_t s : shape) {
      if (s >= 0 && t.size(d) != s) ok = false;
      ++d;
    }
  }
  if (!ok) {
    std::string want = "[";
    int d = 0;
    for (int64_t s : shape)
      want += fmt::format("{}{}", d++ ? ", " : "", s < 0 ? "*" : std::to_string(s));
    GDN_FAIL("{}: tensor '{}' has shape {}, expected {}]", op, name, t.shape_str(), want);
  }
}

void expect_dtype(const Tensor& t, std::string_view op, std::string_view name, DType dtype) {
  expect_defined(t, op, name);
  GDN_CHECK(t.dtype() == dtype, "{}: tensor '{}' has dtype {}, expected {}", op, name,
            dtype_name(t.dtype()), dtype_name(dtype));
}

void expect_contiguous(const Tensor& t, std::string_view op, std::string_view name) {
  GDN_CHECK(t.is_contiguous(), "{}: tensor '{}' ({}) must be contiguous", op, name, t.describe());
}

void expect_device(const Tensor& t, std::string_view op, std::string_view name, Device device) {
  GDN_CHECK(t.device() == device, "{}: tensor '{}' is on {}, expected {}", op, name,
            device_name(t.device()), device_name(device));
}

void expect_tensor(const Tensor& t, std::string_view op, std::string_view name, DType dtype,
                   std::initializer_list<int64_t> shape) {
  expect_shape(t, op, name, shape);
  expect_dtype(t, op, name, dtype);
  expect_contiguous(t, op, name);
}

// --- device hooks ----------------------------------------------------------------------------
namespace {
DeviceHooks g_cuda_hooks;
bool g_cuda_installed = false;
}  // namespace

void set_cuda_hooks(const DeviceHooks& hooks) {
  g_cuda_hooks = hooks;
  g_cuda_installed = true;
}
bool cuda_available() { return g_cuda_installed; }

void* device_alloc(Device d, size_t bytes) {
  if (d == Device::CPU) {
    // 256-byte alignment on the host too, so arena offsets are aligned the same on every device.
    size_t n = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n == 0 ? 256 : n);
    GDN_CHECK(p != nullptr, "host allocation of {} bytes failed", bytes);
    return p;
  }
  GDN_CHECK_HINT(g_cuda_installed, "build with the cuda preset and run on a machine with a GPU",
                 "CUDA device memory requested but no CUDA device is available");
  return g_cuda_hooks.alloc(bytes);
}

void device_free(Device d, void* p) {
  if (p == nullptr) return;
  if (d == Device::CPU) {
    std::free(p);
  } else if (g_cuda_installed) {
    g_cuda_hooks.free(p);
  }
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) {
  if (n == 0) return;
  if (dst_dev == Device::CPU && src_dev == Device::CPU) {
    std::memcpy(dst, src, n);
    return;
  }
  GDN_CHECK(g_cuda_installed, "device copy requested but no CUDA device is available");
  if (dst_dev == Device::CUDA && src_dev == Device::CUDA && g_cuda_hooks.copy_d2d != nullptr) {
    g_cuda_hooks.copy_d2d(dst, src, n);
    return;
  }
  g_cuda_hooks.copy(dst, src, n);
}

void zero_bytes(void* p, Device d, size_t n) {
  if (n == 0) return;
  if (d == Device::CPU) {
    std::memset(p, 0, n);
    return;
  }
  GDN_CHECK(g_cuda_installed, "device memset requested but no CUDA device is available");
  g_cuda_hooks.memset_zero(p, n);
}

void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
             size_t rows, Device device) {
  if (width == 0 || rows == 0) return;
  if (device == Device::CUDA && g_cuda_installed && g_cuda_hooks.copy2d != nullptr) {
    g_cuda_hooks.copy2d(dst, dst_pitch, src, src_pitch, width, rows);
    return;
  }
  for (size_t r = 0; r < rows; ++r)
    copy_bytes(static_cast<char*>(dst) + r * dst_pitch, device,
               static_cast<const char*>(src) + r * src_pitch, device, width);
}

size_t device_memory_used() {
  return g_cuda_installed && g_cuda_hooks.memory_used != nullptr ? g_cuda_hooks.memory_used() : 0;
}

void device_synchronize(Device d) {
  if (d == Device::CUDA && g_cuda_installed) g_cuda_hooks.synchronize();
}

// --- transfers that do not wait ----------------------------------------------------------------
HostStaging::HostStaging(size_t bytes, Device device) : n_(bytes) {
  if (bytes == 0) return;
  if (device == Device::CUDA) {
    GDN_CHECK(g_cuda_installed && g_cuda_hooks.host_alloc_pinned != nullptr,
              "page-locked host memory requested but no CUDA device is available");
    void* p = g_cuda_hooks.host_alloc_pinned(bytes);
    std::memset(p, 0, bytes);
    p_ = std::shared_ptr<void>(p, [](void* q) { g_cuda_hooks.host_free_pinned(q); });
  } else {
    p_ = std::shared_ptr<void>(std::calloc(bytes, 1), [](void* q) { std::free(q); });
    GDN_CHECK(p_ != nullptr, "out of host memory ({} bytes of staging)", bytes);
  }
}

void copy_bytes_async(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) {
  if (n == 0) return;
  if (dst_dev == Device::CPU && src_dev == Device::CPU) {
    std::memcpy(dst, src, n);
    return;
  }
  GDN_CHECK(g_cuda_installed && g_cuda_hooks.copy_async != nullptr,
            "device copy requested but no CUDA device is available");
  g_cuda_hooks.copy_async(dst, src, n);
}

StreamFence::StreamFence(Device device) : device_(device) {
  if (device_ == Device::CUDA) {
    GDN_CHECK(g_cuda_installed && g_cuda_hooks.event_create != nullptr,
              "a device fence requested but no CUDA device is available");
    event_ = g_cuda_hooks.event_create();
  }
}
StreamFence::~StreamFence() {
  if (event_ != nullptr) g_cuda_hooks.event_destroy(event_);
}
StreamFence::StreamFence(StreamFence&& o) noexcept : device_(o.device_), event_(o.event_) {
  o.event_ = nullptr;
}
StreamFence& StreamFence::operator=(StreamFence&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) g_cuda_hooks.event_destroy(event_);
    device_ = o.device_;
    event_ = o.event_;
    o.event_ = nullptr;
  }
  return *this;
}
void StreamFence::record() {
  if (event_ != nullptr) g_cuda_hooks.event_record(event_);
}
void StreamFence::wait() {
  if (event_ != nullptr) g_cuda_hooks.event_synchronize(event_);
}
double StreamFence::ms_since(const StreamFence& start) const {
  if (event_ == nullptr || start.event_ == nullptr || g_cuda_hooks.event_elapsed_ms == nullptr)
    return -1.0;
  try {
    return static_cast<double>(g_cuda_hooks.event_elapsed_ms(start.event_, event_));
  } catch (const Error&) {
    return -1.0;  // e.g. an event not complete yet: the caller times with the host clock
  }
}

uint64_t device_drains() {
  return g_cuda_installed && g_cuda_hooks.drains != nullptr ? g_cuda_hooks.drains() : 0;
}

// --- owned tensors -----------------------------------------------------------------------------
OwnedTensor OwnedTensor::empty(DType dtype, std::span<const int64_t> shape, Device d) {
  OwnedTensor t;
  Tensor probe(nullptr, dtype, shape, d);
  void* p = device_alloc(d, static_cast<size_t>(probe.nbytes()));
  t.storage_ = std::shared_ptr<void>(p, [d](void* q) { device_free(d, q); });
  t.view_ = Tensor(p, dtype, shape, d);
  return t;
}

OwnedTensor OwnedTensor::zeros(DType dtype, std::span<const int64_t> shape, Device d) {
  OwnedTensor t = empty(dtype, shape, d);
  zero_bytes(t.view_.data(), d, static_cast<size_t>(t.view_.nbytes()));
  return t;
}

namespace {
double load_as_f64(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F64:
      return static_cast<const double*>(base)[i];
    case DType::F32:
      return static_cast<const float*>(base)[i];
    case DType::BF16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::F16:
      return f16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::I32:
      return static_cast<const int32_t*>(base)[i];
    case DType::I64:
      return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::I16:
      return static_cast<const int16_t*>(base)[i];
  }
  return 0;
}
void store_from_f64(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::F64:
      static_cast<double*>(base)[i] = v;
      break;
    case DType::F32:
      static_cast<float*>(base)[i] = static_cast<float>(v);
      break;
    case DType::BF16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(static_cast<float>(v));
      break;
    case DType::F16:
      static_cast<uint16_t*>(base)[i] = float_to_f16_bits(static_cast<float>(v));
      break;
    case DType::I32:
      static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v);
      break;
    case DType::I64:
      static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v);
      break;
    case DType::I16:
      static_cast<int16_t*>(base)[i] = static_cast<int16_t>(v);
      break;
  }
}
void convert_host(void* dst, DType dt, const void* src, DType st, int64_t n) {
  if (dt == st) {
    std::memcpy(dst, src, static_cast<size_t>(n * dtype_size(dt)));
    return;
  }
  bool int_to_int = !dtype_is_float(dt) && !dtype_is_float(st);
  if (int_to_int) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = st == DType::I32   ? static_cast<const int32_t*>(src)[i]
                        : st == DType::I16 ? static_cast<const int16_t*>(src)[i]
                                           : static_cast<const int64_t*>(src)[i];
      if (dt == DType::I32) {
        GDN_CHECK(v >= INT32_MIN && v <= INT32_MAX, "value {} at index {} does not fit in I32", v,
                  i);
        static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
      } else if (dt == DType::I16) {
        GDN_CHECK(v >= INT16_MIN && v <= INT16_MAX, "value {} at index {} does not fit in I16", v,
                  i);
        static_cast<int16_t*>(dst)[i] = static_cast<int16_t>(v);
      } else {
        static_cast<int64_t*>(dst)[i] = v;
      }
    }
    return;
  }
  GDN_CHECK(dtype_is_float(dt) == dtype_is_float(st), "cannot convert {} to {}", dtype_name(st),
            dtype_name(dt));
  // Parallel for large tensors: loading a checkpoint or a model's compute copy converts
  // billions of elements at start-up.
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 18))
  for (int64_t i = 0; i < n; ++i) store_from_f64(dst, dt, i, load_as_f64(src, st, i));
}
}  // namespace

OwnedTensor convert(const Tensor& src, DType dtype, Device device) {
  GDN_CHECK(src.is_contiguous(), "convert: source {} must be contiguous", src.describe());
  auto shape = src.shape_vec();
  OwnedTensor host_src;
  const void* s = src.data();
  if (src.device() != Device::CPU) {
    host_src = OwnedTensor::empty(src.dtype(), shape);
    copy_bytes(host_src.view().data(), Device::CPU, src.data(), src.device(),
               static_cast<size_t>(src.nbytes()));
    s = host_src.view().data();
  }
  OwnedTensor host_dst = OwnedTensor::empty(dtype, shape);
  convert_host(host_dst.view().data(), dtype, s, src.dtype(), src.numel());
  if (device == Device::CPU) return host_dst;
  OwnedTensor out = OwnedTensor::empty(dtype, shape, device);
  copy_bytes(out.view().data(), device, host_dst.view().data(), Device::CPU,
             static_cast<size_t>(out.view().nbytes()));
  return out;
}

void copy_into(const Tensor& dst, const Tensor& src) {
  GDN_CHECK(dst.numel() == src.numel(), "copy_into: {} elements into {}", src.numel(), dst.numel());
  GDN_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_into: tensors must be contiguous");
  if (dst.dtype() == src.dtype()) {
    copy_bytes(dst.data(), dst.device(), src.data(), src.device(),
               static_cast<size_t>(src.nbytes()));
    return;
  }
  OwnedTensor c = convert(src, dst.dtype(), Device::CPU);
  copy_bytes(dst.data(), dst.device(), c.view().data(), Device::CPU,
             static_cast<size_t>(dst.nbytes()));
}

std::vector<double> to_f64_vector(const Tensor& t) {
  OwnedTensor c = convert(t, DType::F64, Device::CPU);
  const double* p = c.ptr<double>();
  return std::vector<double>(p, p + t.numel());
}

OwnedTensor from_f64(std::span<const double> values, DType dtype,
                     std::initializer_list<int64_t> shape, Device device) {
  return from_f64(values, dtype, std::span<const int64_t>(shape.begin(), shape.size()), device);
}

OwnedTensor from_f64(std::span<const double> values, DType dtype, std::span<const int64_t> shape,
                     Device device) {
  Tensor src(const_cast<double*>(values.data()), DType::F64, shape);
  GDN_CHECK(src.numel() == static_cast<int64_t>(values.size()), "from_f64: {} values for shape {}",
            values.size(), src.shape_str());
  return convert(src, dtype, device);
}

}  // namespace gdn
