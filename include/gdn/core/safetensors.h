// safetensors reader (memory-mapped, fully validated) and writer (atomic: temporary file, fsync,
// rename). Format: engine_notes.md §A.7.1. A malformed file gives a gdn::Error naming the file
// and what is wrong, never a crash.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gdn/core/tensor.h"

namespace gdn {

struct SafeTensorInfo {
  std::string name;
  std::string dtype_name;  // as in the header ("BF16", "F8_E4M3", ...)
  bool known_dtype = false;
  DType dtype = DType::F32;  // valid when known_dtype
  std::vector<int64_t> shape;
  size_t begin = 0, end = 0;  // offsets in the data buffer
};

class SafeTensorsFile {
 public:
  // Maps and validates the file; throws gdn::Error on any malformation.
  explicit SafeTensorsFile(const std::string& path);
  // Validates an in-memory image (used by the fuzzer and tests); the bytes must outlive the object.
  static SafeTensorsFile from_bytes(const void* data, size_t size, std::string label);
  ~SafeTensorsFile();
  SafeTensorsFile(SafeTensorsFile&&) noexcept;
  SafeTensorsFile& operator=(SafeTensorsFile&&) = delete;
  SafeTensorsFile(const SafeTensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<SafeTensorInfo>& tensors() const { return tensors_; }  // header order
  bool contains(const std::string& name) const { return index_.contains(name); }
  const SafeTensorInfo& info(const std::string& name) const;
  // A read-only view of the mapped bytes (valid while this object lives).
  Tensor view(const std::string& name) const;
  const void* raw(const SafeTensorInfo& t) const { return data_ + t.begin; }
  // The tensor converted to `dtype` on the host (or device).
  OwnedTensor load(const std::string& name, DType dtype, Device device = Device::CPU) const;

 private:
  SafeTensorsFile() = default;
  void parse(const char* bytes, size_t size);
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const char* data_ = nullptr;  // start of the data buffer
  std::map<std::string, std::string> metadata_;
  std::vector<SafeTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

// One tensor to write: a name, a (contiguous, any device) view and optionally raw bytes of a dtype
// gdntrain does not compute in (kept untouched, e.g. F8 tensors of parts it does not train).
struct NamedTensor {
  std::string name;
  Tensor tensor;
  std::string raw_dtype;  // non-empty: write `raw` bytes under this dtype name
  std::vector<int64_t> raw_shape;
  const void* raw = nullptr;
  size_t raw_bytes = 0;
};

// Writes a safetensors file atomically: PATH.tmp.<pid>, fsync, rename, fsync of the directory.
// Tensors are written in name order with a header padded to a multiple of 8 bytes.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Atomically replaces `path` with `contents` (temporary file, fsync, rename, directory fsync).
void write_file_atomic(const std::string& path, const std::string& contents);
void fsync_directory(const std::string& dir);

}  // namespace gdn
