#include "train/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "gdn/core/error.h"
#include "gdn/core/safetensors.h"

namespace gdn::train {

namespace {
constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeader = 34;

template <class T>
T load_le(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the project targets little-endian hosts (x86-64, aarch64)
  return v;
}

// Maps a whole file read-only; a zero-length file maps to nullptr.
const unsigned char* map_file(const std::string& path, size_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  GDN_CHECK_HINT(fd >= 0, "give the dataset prefix without .bin/.idx; `gdntrain prepare` makes one",
                 "cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    GDN_FAIL("'{}' is not a regular file", path);
  }
  *size = static_cast<size_t>(st.st_size);
  void* p = nullptr;
  if (*size > 0) {
    p = ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      GDN_FAIL("cannot map '{}': {}", path, std::strerror(errno));
    }
  }
  ::close(fd);
  return static_cast<const unsigned char*>(p);
}
}  // namespace

int64_t token_dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
    case TokenDType::I8:
      return 1;
    case TokenDType::I16:
    case TokenDType::U16:
      return 2;
    case TokenDType::I32:
    case TokenDType::F32:
      return 4;
    case TokenDType::I64:
    case TokenDType::F64:
      return 8;
  }
  return 0;
}

std::string_view token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
      return "uint8";
    case TokenDType::I8:
      return "int8";
    case TokenDType::I16:
      return "int16";
    case TokenDType::I32:
      return "int32";
    case TokenDType::I64:
      return "int64";
    case TokenDType::F64:
      return "float64";
    case TokenDType::F32:
      return "float32";
    case TokenDType::U16:
      return "uint16";
  }
  return "?";
}

TokenDType token_dtype_from_name(std::string_view name) {
  if (name == "uint16") return TokenDType::U16;
  if (name == "int32") return TokenDType::I32;
  GDN_FAIL_HINT("uint16 holds vocabularies below 65,536; int32 anything larger",
                "unknown token dtype '{}' (use uint16 or int32)", name);
}

// --- reader ------------------------------------------------------------------------------------

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  try {
    idx_ = map_file(idx_path, &idx_size_);
    bin_ = map_file(bin_path, &bin_size_);
    const std::string& f = idx_path;
    GDN_CHECK(idx_size_ >= kHeader, "{}: {} bytes, too short for the {}-byte header", f, idx_size_,
              kHeader);
    GDN_CHECK(std::memcmp(idx_, kMagic, sizeof(kMagic)) == 0,
              "{}: bad magic (expected \"MMIDIDX\\0\\0\"): not a Megatron index file", f);
    const uint64_t version = load_le<uint64_t>(idx_ + 9);
    GDN_CHECK(version == 1, "{}: version {} is not supported (expected 1)", f, version);
    const uint8_t code = idx_[17];
    GDN_CHECK(code >= 1 && code <= 8, "{}: unknown dtype code {}", f, code);
    dtype_ = static_cast<TokenDType>(code);
    GDN_CHECK(dtype_ != TokenDType::F32 && dtype_ != TokenDType::F64,
              "{}: dtype code {} ({}) is not a token type", f, code, token_dtype_name(dtype_));
    const uint64_t S = load_le<uint64_t>(idx_ + 18);
    const uint64_t D = load_le<uint64_t>(idx_ + 26);
    const uint64_t room = idx_size_ - kHeader;
    GDN_CHECK(S <= room / 12 && D <= room / 8 && 12 * S + 8 * D <= room,
              "{}: header says {} sequences and {} document indices, which need {} bytes, but the "
              "file has {} (truncated?)",
              f, S, D, S <= room && D <= room ? std::to_string(kHeader + 12 * S + 8 * D) : "more",
              idx_size_);
    const uint64_t body = kHeader + 12 * S + 8 * D;
    GDN_CHECK(idx_size_ == body || idx_size_ == body + S,
              "{}: {} bytes, expected {} (or {} with sequence modes) for {} sequences and {} "
              "document indices",
              f, idx_size_, body, body + S, S, D);
    has_modes_ = idx_size_ == body + S && S > 0;
    GDN_CHECK(D >= 1, "{}: document index count is 0 (it must start with 0)", f);
    num_sequences_ = static_cast<int64_t>(S);
    num_doc_indices_ = static_cast<int64_t>(D);

    const int64_t item = token_dtype_size(dtype_);
    for (int64_t i = 0; i < num_sequences_; ++i) {
      const int64_t len = sequence_length(i);
      const int64_t ptr = sequence_pointer(i);
      GDN_CHECK(len >= 0, "{}: sequence {} has negative length {}", f, i, len);
      GDN_CHECK(ptr >= 0 && ptr % item == 0,
                "{}: sequence {} starts at byte {}, not a multiple of the token size {}", f, i, ptr,
                item);
      GDN_CHECK(
          static_cast<uint64_t>(ptr) <= bin_size_ &&
              static_cast<uint64_t>(len) * static_cast<uint64_t>(item) <=
                  bin_size_ - static_cast<uint64_t>(ptr),
          "{}: sequence {} (bytes {}..{}) runs past the end of {} ({} bytes; truncated?)", f, i,
          ptr,
          // unsigned: ptr + len * item overflows int64 for absurd pointers (fuzz_indexed)
          static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len) * static_cast<uint64_t>(item),
          bin_path, bin_size_);
      total_tokens_ += len;
    }
    GDN_CHECK(doc_index(0) == 0, "{}: document_indices[0] = {}, expected 0", f, doc_index(0));
    for (int64_t k = 1; k < num_doc_indices_; ++k) {
      GDN_CHECK(doc_index(k) >= doc_index(k - 1),
                "{}: document_indices[{}] = {} is smaller than the previous entry {}", f, k,
                doc_index(k), doc_index(k - 1));
    }
    GDN_CHECK(doc_index(num_doc_indices_ - 1) == num_sequences_,
              "{}: the last document index is {} but there are {} sequences", f,
              doc_index(num_doc_indices_ - 1), num_sequences_);
  } catch (...) {
    release();
    throw;
  }
}

IndexedDataset::~IndexedDataset() { release(); }

void IndexedDataset::release() {
  if (idx_ != nullptr) ::munmap(const_cast<unsigned char*>(idx_), idx_size_);
  if (bin_ != nullptr) ::munmap(const_cast<unsigned char*>(bin_), bin_size_);
  idx_ = bin_ = nullptr;
}

IndexedDataset::IndexedDataset(IndexedDataset&& o) noexcept { *this = std::move(o); }

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& o) noexcept {
  if (this != &o) {
    release();
    prefix_ = std::move(o.prefix_);
    idx_ = std::exchange(o.idx_, nullptr);
    bin_ = std::exchange(o.bin_, nullptr);
    idx_size_ = o.idx_size_;
    bin_size_ = o.bin_size_;
    dtype_ = o.dtype_;
    num_sequences_ = o.num_sequences_;
    num_doc_indices_ = o.num_doc_indices_;
    total_tokens_ = o.total_tokens_;
    has_modes_ = o.has_modes_;
  }
  return *this;
}

int64_t IndexedDataset::sequence_length(int64_t seq) const {
  GDN_CHECK(seq >= 0 && seq < num_sequences_, "{}: sequence {} out of range [0, {})", prefix_, seq,
            num_sequences_);
  return load_le<int32_t>(idx_ + kHeader + 4 * static_cast<size_t>(seq));
}

int64_t IndexedDataset::sequence_pointer(int64_t seq) const {
  GDN_CHECK(seq >= 0 && seq < num_sequences_, "{}: sequence {} out of range [0, {})", prefix_, seq,
            num_sequences_);
  return load_le<int64_t>(idx_ + kHeader + 4 * static_cast<size_t>(num_sequences_) +
                          8 * static_cast<size_t>(seq));
}

int64_t IndexedDataset::doc_index(int64_t k) const {
  return load_le<int64_t>(idx_ + kHeader + 12 * static_cast<size_t>(num_sequences_) +
                          8 * static_cast<size_t>(k));
}

std::pair<int64_t, int64_t> IndexedDataset::document_sequences(int64_t doc) const {
  GDN_CHECK(doc >= 0 && doc < num_documents(), "{}: document {} out of range [0, {})", prefix_, doc,
            num_documents());
  return {doc_index(doc), doc_index(doc + 1)};
}

int64_t IndexedDataset::document_length(int64_t doc) const {
  auto [a, b] = document_sequences(doc);
  int64_t n = 0;
  for (int64_t s = a; s < b; ++s) n += sequence_length(s);
  return n;
}

std::vector<int64_t> IndexedDataset::document_lengths() const {
  std::vector<int64_t> v(static_cast<size_t>(num_documents()));
  for (int64_t d = 0; d < num_documents(); ++d) v[static_cast<size_t>(d)] = document_length(d);
  return v;
}

void IndexedDataset::read_sequence(int64_t seq, int64_t begin, int64_t end, int32_t* out) const {
  const int64_t len = sequence_length(seq);
  GDN_CHECK(0 <= begin && begin <= end && end <= len,
            "{}: tokens [{}, {}) of sequence {} requested, it has {}", prefix_, begin, end, seq,
            len);
  const int64_t item = token_dtype_size(dtype_);
  const unsigned char* p = bin_ + sequence_pointer(seq) + begin * item;
  const int64_t n = end - begin;
  switch (dtype_) {
    case TokenDType::U8:
      for (int64_t i = 0; i < n; ++i) out[i] = p[i];
      break;
    case TokenDType::I8:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int8_t>(p[i]);
      break;
    case TokenDType::I16:
      for (int64_t i = 0; i < n; ++i) out[i] = load_le<int16_t>(p + 2 * i);
      break;
    case TokenDType::U16:
      for (int64_t i = 0; i < n; ++i) out[i] = load_le<uint16_t>(p + 2 * i);
      break;
    case TokenDType::I32:
      if (n > 0) std::memcpy(out, p, static_cast<size_t>(n) * 4);
      break;
    case TokenDType::I64:
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = load_le<int64_t>(p + 8 * i);
        GDN_CHECK(
            v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
            "{}: token {} at position {} of sequence {} does not fit in int32", prefix_, v,
            begin + i, seq);
        out[i] = static_cast<int32_t>(v);
      }
      break;
    default:
      GDN_FAIL("{}: dtype {} is not a token type", prefix_, token_dtype_name(dtype_));
  }
}

void IndexedDataset::read_document(int64_t doc, int64_t begin, int64_t end, int32_t* out) const {
  auto [a, b] = document_sequences(doc);
  GDN_CHECK(0 <= begin && begin <= end, "{}: tokens [{}, {}) of document {} requested", prefix_,
            begin, end, doc);
  int64_t pos = 0;  // document offset of sequence s
  for (int64_t s = a; s < b && begin < end; ++s) {
    const int64_t len = sequence_length(s);
    if (begin < pos + len) {
      const int64_t lo = begin - pos, hi = std::min(end - pos, len);
      read_sequence(s, lo, hi, out);
      out += hi - lo;
      begin = pos + hi;
    }
    pos += len;
  }
  GDN_CHECK(begin == end, "{}: tokens up to {} of document {} requested, it has {}", prefix_, end,
            doc, pos);
}

std::vector<int32_t> IndexedDataset::sequence(int64_t seq) const {
  std::vector<int32_t> v(static_cast<size_t>(sequence_length(seq)));
  read_sequence(seq, 0, static_cast<int64_t>(v.size()), v.data());
  return v;
}

std::vector<int32_t> IndexedDataset::document(int64_t doc) const {
  std::vector<int32_t> v(static_cast<size_t>(document_length(doc)));
  read_document(doc, 0, static_cast<int64_t>(v.size()), v.data());
  return v;
}

// --- writer ------------------------------------------------------------------------------------

namespace {
constexpr size_t kBufferBytes = size_t{1} << 20;

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    GDN_CHECK(w > 0, "writing '{}' failed: {}", path, std::strerror(errno));
    c += w;
    n -= static_cast<size_t>(w);
  }
}

template <class T>
void put_le(std::vector<unsigned char>& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}
}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  GDN_CHECK(dtype_ == TokenDType::U16 || dtype_ == TokenDType::I32,
            "IndexedDatasetWriter: token dtype {} is not writable (use uint16 or int32)",
            token_dtype_name(dtype_));
  const std::string pid = std::to_string(::getpid());
  bin_tmp_ = prefix_ + ".bin.tmp." + pid;
  idx_tmp_ = prefix_ + ".idx.tmp." + pid;
  fd_ = ::open(bin_tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  GDN_CHECK_HINT(fd_ >= 0, "check that the output directory exists and is writable",
                 "cannot create '{}': {}", bin_tmp_, std::strerror(errno));
  buffer_.reserve(kBufferBytes);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) {
    ::unlink(bin_tmp_.c_str());
    ::unlink(idx_tmp_.c_str());
  }
}

void IndexedDatasetWriter::flush() {
  if (buffer_.empty()) return;
  write_all(fd_, buffer_.data(), buffer_.size(), bin_tmp_);
  buffer_.clear();
}

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) {
  GDN_CHECK(!finished_, "IndexedDatasetWriter '{}': add after finish()", prefix_);
  GDN_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
            "IndexedDatasetWriter '{}': a sequence of {} tokens exceeds the int32 length field",
            prefix_, tokens.size());
  const int64_t doc = num_documents();
  // Validate everything first: a rejected sequence leaves no bytes behind.
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    GDN_CHECK(t >= 0 && (dtype_ != TokenDType::U16 || t <= 65535),
              "IndexedDatasetWriter '{}': token {} at position {} of document {} is out of range "
              "for {}",
              prefix_, t, i, doc, token_dtype_name(dtype_));
  }
  for (const int32_t t : tokens) {
    if (dtype_ == TokenDType::U16) {
      put_le<uint16_t>(buffer_, static_cast<uint16_t>(t));
    } else {
      put_le<int32_t>(buffer_, t);
    }
    if (buffer_.size() >= kBufferBytes) flush();
  }
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  pointers_.push_back(bin_bytes_);
  bin_bytes_ += static_cast<int64_t>(tokens.size()) * token_dtype_size(dtype_);
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::end_document() {
  GDN_CHECK(!finished_, "IndexedDatasetWriter '{}': end_document after finish()", prefix_);
  doc_indices_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  add_sequence(tokens);
  end_document();
}

void IndexedDatasetWriter::finish() {
  GDN_CHECK(!finished_, "IndexedDatasetWriter '{}': finish() called twice", prefix_);
  if (doc_indices_.back() != static_cast<int64_t>(lengths_.size())) end_document();
  flush();
  GDN_CHECK(::fsync(fd_) == 0, "fsync of '{}' failed: {}", bin_tmp_, std::strerror(errno));
  GDN_CHECK(::close(fd_) == 0, "close of '{}' failed: {}", bin_tmp_, std::strerror(errno));
  fd_ = -1;

  std::vector<unsigned char> idx;
  idx.reserve(kHeader + 12 * lengths_.size() + 8 * doc_indices_.size());
  idx.insert(idx.end(), kMagic, kMagic + sizeof(kMagic));
  put_le<uint64_t>(idx, 1);
  idx.push_back(static_cast<unsigned char>(dtype_));
  put_le<uint64_t>(idx, lengths_.size());
  put_le<uint64_t>(idx, doc_indices_.size());
  for (int32_t l : lengths_) put_le<int32_t>(idx, l);
  for (int64_t p : pointers_) put_le<int64_t>(idx, p);
  for (int64_t d : doc_indices_) put_le<int64_t>(idx, d);
  int fd = ::open(idx_tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  GDN_CHECK(fd >= 0, "cannot create '{}': {}", idx_tmp_, std::strerror(errno));
  try {
    write_all(fd, idx.data(), idx.size(), idx_tmp_);
    GDN_CHECK(::fsync(fd) == 0, "fsync of '{}' failed: {}", idx_tmp_, std::strerror(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  GDN_CHECK(::close(fd) == 0, "close of '{}' failed: {}", idx_tmp_, std::strerror(errno));
  // .bin first: an .idx that exists always describes a complete .bin.
  const std::string bin = prefix_ + ".bin", idxp = prefix_ + ".idx";
  GDN_CHECK(::rename(bin_tmp_.c_str(), bin.c_str()) == 0, "renaming '{}' to '{}' failed: {}",
            bin_tmp_, bin, std::strerror(errno));
  GDN_CHECK(::rename(idx_tmp_.c_str(), idxp.c_str()) == 0, "renaming '{}' to '{}' failed: {}",
            idx_tmp_, idxp, std::strerror(errno));
  finished_ = true;
  fsync_directory(std::filesystem::path(bin).parent_path().string());
}

}  // namespace gdn::train
