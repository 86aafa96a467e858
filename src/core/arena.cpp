#include "gdn/core/arena.h"

#include <algorithm>
#include <utility>

namespace gdn {

Arena::Arena(std::string name, Device device, size_t capacity)
    : name_(std::move(name)), device_(device), capacity_(capacity) {
  if (capacity_ > 0) base_ = static_cast<char*>(device_alloc(device_, capacity_));
}

Arena Arena::planning(std::string name, Device device) {
  Arena a;
  a.name_ = std::move(name);
  a.device_ = device;
  a.planning_ = true;
  return a;
}

Arena Arena::borrowing(std::string name, Device device, void* base, size_t capacity) {
  Arena a;
  a.name_ = std::move(name);
  a.device_ = device;
  a.base_ = static_cast<char*>(base);
  a.capacity_ = capacity;
  a.owned_ = false;
  return a;
}

Arena::~Arena() {
  if (owned_) device_free(device_, base_);
}

Arena::Arena(Arena&& o) noexcept { *this = std::move(o); }

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    if (owned_) device_free(device_, base_);
    name_ = std::move(o.name_);
    device_ = o.device_;
    base_ = std::exchange(o.base_, nullptr);
    capacity_ = std::exchange(o.capacity_, 0);
    used_ = std::exchange(o.used_, 0);
    peak_ = std::exchange(o.peak_, 0);
    planning_ = o.planning_;
    owned_ = std::exchange(o.owned_, true);
  }
  return *this;
}

void* Arena::alloc(size_t bytes, size_t align) {
  GDN_CHECK(align > 0 && (align & (align - 1)) == 0, "arena '{}': alignment {} is not a power of 2",
            name_, align);
  size_t start = (used_ + align - 1) / align * align;
  size_t end = start + bytes;
  if (!planning_) {
    GDN_CHECK_HINT(end <= capacity_,
                   "the memory plan is sized at start-up from the largest micro-batch; a larger "
                   "input than planned was given",
                   "arena '{}' is full: {} requested with {} of {} in use", name_,
                   format_bytes(static_cast<double>(bytes)),
                   format_bytes(static_cast<double>(used_)),
                   format_bytes(static_cast<double>(capacity_)));
  }
  used_ = end;
  peak_ = std::max(peak_, used_);
  return planning_ ? nullptr : base_ + start;
}

Tensor Arena::alloc_tensor(DType dtype, std::initializer_list<int64_t> shape) {
  return alloc_tensor(dtype, std::span<const int64_t>(shape.begin(), shape.size()));
}

Tensor Arena::alloc_tensor(DType dtype, std::span<const int64_t> shape) {
  Tensor probe(nullptr, dtype, shape, device_);
  void* p = alloc(static_cast<size_t>(probe.nbytes()));
  return Tensor(p, dtype, shape, device_);
}

Tensor Arena::view_at(size_t offset, DType dtype, std::span<const int64_t> shape) const {
  Tensor probe(nullptr, dtype, shape, device_);
  const size_t bytes = static_cast<size_t>(probe.nbytes());
  GDN_CHECK(!planning_, "arena '{}': view_at on a planning arena", name_);
  GDN_CHECK(offset % 256 == 0 && offset <= capacity_ && bytes <= capacity_ - offset,
            "arena '{}': a view of {} at offset {} does not fit its capacity {}", name_,
            format_bytes(static_cast<double>(bytes)), offset,
            format_bytes(static_cast<double>(capacity_)));
  return Tensor(base_ + offset, dtype, shape, device_);
}

void* Arena::address_at(size_t offset) const {
  GDN_CHECK(!planning_ && offset <= capacity_, "arena '{}': offset {} beyond its capacity {}",
            name_, offset, capacity_);
  return base_ + offset;
}

void Arena::release_to(size_t mark) {
  GDN_CHECK(mark <= used_, "arena '{}': release to {} beyond the used {}", name_, mark, used_);
  used_ = mark;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, units[u]);
}

}  // namespace gdn
