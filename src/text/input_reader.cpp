#include "text/input_reader.h"

#include <sys/stat.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstring>

#include "gdn/core/error.h"

namespace gdn::text {

namespace {
constexpr size_t kRawChunk = size_t{1} << 20;
}

struct LineReader::Codec {
  z_stream z{};
  bool z_init = false;
  bool in_frame = false;  // inside a gzip member / zstd frame: the file must not end here
  ZSTD_DCtx* zstd = nullptr;
  ~Codec() {
    if (z_init) inflateEnd(&z);
    if (zstd != nullptr) ZSTD_freeDCtx(zstd);
  }
};

int64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

LineReader::LineReader(const std::string& path) : path_(path), codec_(std::make_unique<Codec>()) {
  f_ = std::fopen(path.c_str(), "rb");
  GDN_CHECK_HINT(f_ != nullptr, "check the --input paths", "cannot open input '{}': {}", path,
                 std::strerror(errno));
  raw_.resize(kRawChunk);
  read_raw();
  const auto* b = reinterpret_cast<const unsigned char*>(raw_.data());
  if (raw_len_ >= 2 && b[0] == 0x1f && b[1] == 0x8b) {
    comp_ = Compression::Gzip;
    GDN_CHECK(inflateInit2(&codec_->z, 15 + 32) == Z_OK, "{}: zlib initialisation failed", path);
    codec_->z_init = true;
  } else if (raw_len_ >= 4 && b[0] == 0x28 && b[1] == 0xb5 && b[2] == 0x2f && b[3] == 0xfd) {
    comp_ = Compression::Zstd;
    codec_->zstd = ZSTD_createDCtx();
    GDN_CHECK(codec_->zstd != nullptr, "{}: zstd initialisation failed", path);
  }
}

LineReader::~LineReader() {
  if (f_ != nullptr) std::fclose(f_);
}

bool LineReader::read_raw() {
  if (raw_eof_) return false;
  raw_len_ = std::fread(raw_.data(), 1, raw_.size(), f_);
  raw_pos_ = 0;
  GDN_CHECK(!std::ferror(f_), "reading '{}' failed: {}", path_, std::strerror(errno));
  file_bytes_ += static_cast<int64_t>(raw_len_);
  if (raw_len_ == 0) raw_eof_ = true;
  return raw_len_ > 0;
}

bool LineReader::fill() {
  if (eof_) return false;
  // Drop what was returned already, so the buffer holds at most one partial line plus a chunk.
  if (buf_pos_ > 0) {
    buf_.erase(0, buf_pos_);
    buf_pos_ = 0;
  }
  const size_t before = buf_.size();
  while (buf_.size() == before) {
    if (raw_pos_ == raw_len_ && !read_raw()) {
      GDN_CHECK_HINT(!codec_->in_frame, "the file was cut short (an interrupted download?)",
                     "{}: the {} stream ends in the middle of a frame (truncated)", path_,
                     comp_ == Compression::Gzip ? "gzip" : "zstd");
      eof_ = true;
      return buf_.size() > before;
    }
    const size_t in_len = raw_len_ - raw_pos_;
    char* in = raw_.data() + raw_pos_;
    if (comp_ == Compression::None) {
      buf_.append(in, in_len);
      raw_pos_ = raw_len_;
    } else if (comp_ == Compression::Gzip) {
      z_stream& z = codec_->z;
      z.next_in = reinterpret_cast<Bytef*>(in);
      z.avail_in = static_cast<uInt>(in_len);
      char out[1 << 16];
      while (z.avail_in > 0) {
        z.next_out = reinterpret_cast<Bytef*>(out);
        z.avail_out = sizeof(out);
        const int rc = inflate(&z, Z_NO_FLUSH);
        GDN_CHECK_HINT(rc == Z_OK || rc == Z_STREAM_END || rc == Z_BUF_ERROR,
                       "the file may be truncated or not gzip", "{}: gzip data is corrupt ({})",
                       path_, z.msg != nullptr ? z.msg : "inflate error");
        buf_.append(out, sizeof(out) - z.avail_out);
        codec_->in_frame = rc != Z_STREAM_END;
        if (rc == Z_STREAM_END) {
          GDN_CHECK(inflateReset(&z) == Z_OK, "{}: zlib reset failed", path_);  // next member
        } else if (rc == Z_BUF_ERROR && z.avail_out != 0) {
          break;
        }
      }
      raw_pos_ = raw_len_ - z.avail_in;
    } else {
      ZSTD_inBuffer zin{in, in_len, 0};
      char out[1 << 16];
      while (zin.pos < zin.size) {
        ZSTD_outBuffer zout{out, sizeof(out), 0};
        const size_t rc = ZSTD_decompressStream(codec_->zstd, &zout, &zin);
        GDN_CHECK_HINT(!ZSTD_isError(rc), "the file may be truncated or not zstd",
                       "{}: zstd data is corrupt ({})", path_, ZSTD_getErrorName(rc));
        buf_.append(out, zout.pos);
        codec_->in_frame = rc != 0;
      }
      raw_pos_ = raw_len_;
    }
  }
  return true;
}

bool LineReader::next_line(std::string& line) {
  for (;;) {
    const size_t nl = buf_.find('\n', buf_pos_);
    if (nl != std::string::npos) {
      line.assign(buf_, buf_pos_, nl - buf_pos_);
      buf_pos_ = nl + 1;
      return true;
    }
    if (!fill()) {
      if (buf_pos_ < buf_.size()) {
        line.assign(buf_, buf_pos_, std::string::npos);
        buf_pos_ = buf_.size();
        return true;
      }
      return false;
    }
  }
}

}  // namespace gdn::text
