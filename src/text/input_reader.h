// Streams the lines of a text file that may be gzip- or zstd-compressed (detected from the first
// bytes, not the name: 1f 8b is gzip, 28 b5 2f fd is zstd; anything else is read as is). Memory
// stays bounded by the read buffers and the longest line, whatever the file's size; concatenated
// gzip members and zstd frames are read through.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace gdn::text {

enum class Compression { None, Gzip, Zstd };

class LineReader {
 public:
  explicit LineReader(const std::string& path);  // throws naming the file when it cannot open
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // The next line without its '\n' (a '\r' before it is kept); false at the end of the file.
  // A last line without '\n' is still a line. Throws on a read or decompression error.
  bool next_line(std::string& line);
  // Bytes of the file consumed so far (compressed bytes for compressed files), for progress.
  int64_t file_bytes_read() const { return file_bytes_; }
  Compression compression() const { return comp_; }
  const std::string& path() const { return path_; }

 private:
  bool fill();  // appends decompressed bytes to buf_; false at the end
  bool read_raw();
  std::string path_;
  std::FILE* f_ = nullptr;
  Compression comp_ = Compression::None;
  std::vector<char> raw_;  // compressed input
  size_t raw_pos_ = 0, raw_len_ = 0;
  bool raw_eof_ = false;
  std::string buf_;  // decompressed, not yet returned
  size_t buf_pos_ = 0;
  bool eof_ = false;
  int64_t file_bytes_ = 0;
  struct Codec;
  std::unique_ptr<Codec> codec_;
};

// Size of a file in bytes (0 when it cannot be stat'ed).
int64_t file_size(const std::string& path);

}  // namespace gdn::text
