// Memory arenas (ARCHITECTURE.md §7, the llm.c single-allocation plan): one allocation made up
// front, sub-allocated by bumping an offset, reset between uses, with the peak reported.
//
// An arena can also run in planning mode (capacity unknown, no memory): the same sequence of
// allocations is replayed to learn the size, then a real arena of exactly that size is made.
#pragma once

#include <cstddef>
#include <string>

#include "gdn/core/tensor.h"

namespace gdn {

class Arena {
 public:
  Arena() = default;
  // Allocates `capacity` bytes on `device` once.
  Arena(std::string name, Device device, size_t capacity);
  // A planning arena: records sizes only; alloc() returns nullptr-backed views.
  static Arena planning(std::string name, Device device);
  // An arena over `capacity` bytes of memory another arena owns (from its address_at); it never
  // frees them. The owner's plan keeps the two apart in time or in space.
  static Arena borrowing(std::string name, Device device, void* base, size_t capacity);
  ~Arena();
  Arena(Arena&& o) noexcept;
  Arena& operator=(Arena&& o) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Returns `bytes` bytes aligned to `align`; throws a clear error when the arena is full.
  void* alloc(size_t bytes, size_t align = 256);
  Tensor alloc_tensor(DType dtype, std::initializer_list<int64_t> shape);
  Tensor alloc_tensor(DType dtype, std::span<const int64_t> shape);
  // A view at a fixed byte `offset` (a layout planned apart from the bump order, e.g. gradients
  // placed at the top of an activation arena); throws when it does not fit the capacity. It does
  // not move used(): the caller's plan keeps bump allocations and such views apart.
  Tensor view_at(size_t offset, DType dtype, std::span<const int64_t> shape) const;
  // The address of byte `offset` (<= capacity), for borrowing().
  void* address_at(size_t offset) const;
  // Frees everything allocated since `mark` (a value returned by used()).
  void release_to(size_t mark);
  void reset() { release_to(0); }
  // Restarts the peak from the current use (a planner measuring one phase of a step).
  void reset_peak() { peak_ = used_; }

  const std::string& name() const { return name_; }
  Device device() const { return device_; }
  size_t used() const { return used_; }
  size_t peak() const { return peak_; }
  size_t capacity() const { return capacity_; }
  bool is_planning() const { return planning_; }

 private:
  std::string name_;
  Device device_ = Device::CPU;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t peak_ = 0;
  bool planning_ = false;
  bool owned_ = true;
};

// "1.50 GiB", "312.0 MiB", "12 B".
std::string format_bytes(double bytes);

}  // namespace gdn
