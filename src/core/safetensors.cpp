#include "gdn/core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace gdn {

namespace {
constexpr uint64_t kMaxHeader = 100'000'000;

int dtype_bits(const std::string& name) {
  static const std::map<std::string, int> bits = {
      {"BOOL", 8},    {"U8", 8},          {"I8", 8},          {"I16", 16},    {"U16", 16},
      {"F16", 16},    {"BF16", 16},       {"I32", 32},        {"U32", 32},    {"F32", 32},
      {"F64", 64},    {"I64", 64},        {"U64", 64},        {"F8_E5M2", 8}, {"F8_E4M3", 8},
      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"C64", 64},    {"F4", 4},
      {"F6_E2M3", 6}, {"F6_E3M2", 6}};
  auto it = bits.find(name);
  return it == bits.end() ? -1 : it->second;
}

// JSON parse errors from nlohmann throw exceptions; rethrow as gdn::Error with the file name.
nlohmann::json parse_header(const char* p, size_t n, const std::string& label) {
  try {
    return nlohmann::json::parse(p, p + n);
  } catch (const nlohmann::json::exception& e) {
    GDN_FAIL("{}: safetensors header is not valid JSON: {}", label, e.what());
  }
}
}  // namespace

SafeTensorsFile::SafeTensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  GDN_CHECK_HINT(fd >= 0, "check the path", "cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    GDN_FAIL("'{}' is not a regular file", path);
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ > 0) {
    map_ = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      ::close(fd);
      GDN_FAIL("cannot map '{}': {}", path, std::strerror(errno));
    }
  }
  ::close(fd);
  try {
    parse(static_cast<const char*>(map_), map_size_);
  } catch (...) {
    if (map_ != nullptr) ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

SafeTensorsFile SafeTensorsFile::from_bytes(const void* data, size_t size, std::string label) {
  SafeTensorsFile f;
  f.path_ = std::move(label);
  f.parse(static_cast<const char*>(data), size);
  return f;
}

SafeTensorsFile::~SafeTensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

SafeTensorsFile::SafeTensorsFile(SafeTensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      map_size_(std::exchange(o.map_size_, 0)),
      data_(o.data_),
      metadata_(std::move(o.metadata_)),
      tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)) {}

void SafeTensorsFile::parse(const char* bytes, size_t size) {
  const std::string& label = path_;
  GDN_CHECK(size >= 8, "{}: file is {} bytes, too short for a safetensors header length", label,
            size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  GDN_CHECK(n <= kMaxHeader, "{}: header length {} exceeds the limit {}", label, n, kMaxHeader);
  GDN_CHECK(n <= size - 8, "{}: header length {} runs past the end of the file ({} bytes)", label,
            n, size);
  nlohmann::json h = parse_header(bytes + 8, n, label);
  GDN_CHECK(h.is_object(), "{}: safetensors header is not a JSON object", label);
  data_ = bytes + 8 + n;
  const size_t data_size = size - 8 - n;

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      GDN_CHECK(v.is_object(), "{}: __metadata__ is not an object", label);
      for (auto m = v.begin(); m != v.end(); ++m) {
        GDN_CHECK(m.value().is_string(), "{}: __metadata__ value of '{}' is not a string", label,
                  m.key());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    GDN_CHECK(v.is_object(), "{}: entry '{}' is not an object", label, name);
    GDN_CHECK(v.contains("dtype") && v["dtype"].is_string(), "{}: tensor '{}' has no dtype string",
              label, name);
    GDN_CHECK(v.contains("shape") && v["shape"].is_array(), "{}: tensor '{}' has no shape array",
              label, name);
    GDN_CHECK(
        v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
        "{}: tensor '{}' has no data_offsets [begin, end]", label, name);
    SafeTensorInfo t;
    t.name = name;
    t.dtype_name = v["dtype"].get<std::string>();
    int bits = dtype_bits(t.dtype_name);
    GDN_CHECK(bits > 0, "{}: tensor '{}' has unknown dtype '{}'", label, name, t.dtype_name);
    t.known_dtype = dtype_try_from_name(t.dtype_name, &t.dtype);
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : v["shape"]) {
      GDN_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                "{}: tensor '{}' has a shape entry that is not a non-negative integer", label,
                name);
      uint64_t s = d.get<uint64_t>();
      GDN_CHECK(s < (1ull << 48), "{}: tensor '{}' has an absurd dimension {}", label, name, s);
      if (s != 0 && numel > UINT64_MAX / s) overflow = true;
      numel *= s;
      t.shape.push_back(static_cast<int64_t>(s));
    }
    GDN_CHECK(!overflow && t.shape.size() <= static_cast<size_t>(kMaxDims),
              "{}: tensor '{}' has an unsupported shape (rank {} or size overflow)", label, name,
              t.shape.size());
    const auto& off = v["data_offsets"];
    GDN_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
              "{}: tensor '{}' data_offsets are not non-negative integers", label, name);
    uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    GDN_CHECK(b <= e, "{}: tensor '{}' data_offsets [{}, {}] are reversed", label, name, b, e);
    GDN_CHECK(e <= data_size, "{}: tensor '{}' data_offsets [{}, {}] run past the data ({} bytes)",
              label, name, b, e, data_size);
    GDN_CHECK(numel <= UINT64_MAX / static_cast<uint64_t>(bits) &&
                  numel * static_cast<uint64_t>(bits) % 8 == 0 &&
                  e - b == numel * static_cast<uint64_t>(bits) / 8,
              "{}: tensor '{}' of dtype {} and shape has {} elements but {} bytes", label, name,
              t.dtype_name, numel, e - b);
    t.begin = static_cast<size_t>(b);
    t.end = static_cast<size_t>(e);
    GDN_CHECK(!index_.contains(name), "{}: tensor '{}' appears twice", label, name);
    index_[name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }
  // Tensors must tile the data buffer from 0 with no gap or overlap, and end at the file's end.
  std::vector<const SafeTensorInfo*> by_off;
  for (const auto& t : tensors_) by_off.push_back(&t);
  std::sort(by_off.begin(), by_off.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  size_t pos = 0;
  for (const auto* t : by_off) {
    GDN_CHECK(t->begin == pos,
              "{}: tensor '{}' starts at byte {} of the data but the previous tensor ends at {} "
              "(overlap or gap)",
              label, t->name, t->begin, pos);
    pos = t->end;
  }
  GDN_CHECK(pos == data_size,
            "{}: tensors cover {} bytes but the data buffer has {} (truncated "
            "or trailing bytes)",
            label, pos, data_size);
}

const SafeTensorInfo& SafeTensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  GDN_CHECK(it != index_.end(), "{}: no tensor named '{}'", path_, name);
  return tensors_[it->second];
}

Tensor SafeTensorsFile::view(const std::string& name) const {
  const SafeTensorInfo& t = info(name);
  GDN_CHECK(t.known_dtype, "{}: tensor '{}' has dtype {} which gdntrain does not compute with",
            path_, name, t.dtype_name);
  return Tensor(const_cast<char*>(data_ + t.begin), t.dtype, t.shape);
}

OwnedTensor SafeTensorsFile::load(const std::string& name, DType dtype, Device device) const {
  Tensor v = view(name);
  // The mapped bytes may be unaligned for the element type; copy to an aligned buffer first.
  OwnedTensor aligned = OwnedTensor::empty(v.dtype(), v.shape());
  std::memcpy(aligned.view().data(), v.data(), static_cast<size_t>(v.nbytes()));
  if (dtype == v.dtype() && device == Device::CPU) return aligned;
  return convert(aligned, dtype, device);
}

void fsync_directory(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

namespace {
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path)
      : path_(path), tmp_(fmt::format("{}.tmp.{}", path, ::getpid())) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    GDN_CHECK(fd_ >= 0, "cannot create '{}': {}", tmp_, std::strerror(errno));
  }
  ~AtomicFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  void write(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd_, c, n);
      if (w < 0 && errno == EINTR) continue;
      GDN_CHECK(w > 0, "writing '{}' failed: {}", tmp_, std::strerror(errno));
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    GDN_CHECK(::fsync(fd_) == 0, "fsync of '{}' failed: {}", tmp_, std::strerror(errno));
    GDN_CHECK(::close(fd_) == 0, "close of '{}' failed: {}", tmp_, std::strerror(errno));
    fd_ = -1;
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp_.c_str());
      GDN_FAIL("renaming '{}' to '{}' failed: {}", tmp_, path_, std::strerror(err));
    }
    fsync_directory(std::filesystem::path(path_).parent_path().string());
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};
}  // namespace

void write_file_atomic(const std::string& path, const std::string& contents) {
  AtomicFile f(path);
  f.write(contents.data(), contents.size());
  f.commit();
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const NamedTensor*> sorted;
  for (const auto& t : tensors) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  nlohmann::ordered_json h;
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  size_t off = 0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const NamedTensor& t = *sorted[i];
    GDN_CHECK(i == 0 || sorted[i - 1]->name != t.name, "write_safetensors: tensor '{}' given twice",
              t.name);
    nlohmann::ordered_json e;
    size_t bytes;
    if (!t.raw_dtype.empty()) {
      e["dtype"] = t.raw_dtype;
      e["shape"] = t.raw_shape;
      bytes = t.raw_bytes;
    } else {
      GDN_CHECK(t.tensor.is_contiguous(), "write_safetensors: tensor '{}' is not contiguous",
                t.name);
      e["dtype"] = std::string(dtype_name(t.tensor.dtype()));
      e["shape"] = t.tensor.shape_vec();
      bytes = static_cast<size_t>(t.tensor.nbytes());
    }
    e["data_offsets"] = {off, off + bytes};
    off += bytes;
    h[t.name] = e;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  AtomicFile f(path);
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  f.write(len, 8);
  f.write(header.data(), header.size());
  std::vector<char> staging;
  for (const NamedTensor* t : sorted) {
    if (!t->raw_dtype.empty()) {
      f.write(t->raw, t->raw_bytes);
    } else if (t->tensor.device() == Device::CPU) {
      f.write(t->tensor.data(), static_cast<size_t>(t->tensor.nbytes()));
    } else {
      staging.resize(static_cast<size_t>(t->tensor.nbytes()));
      copy_bytes(staging.data(), Device::CPU, t->tensor.data(), t->tensor.device(), staging.size());
      f.write(staging.data(), staging.size());
    }
  }
  f.commit();
}

}  // namespace gdn
