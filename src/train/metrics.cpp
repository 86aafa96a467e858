#include "train/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/safetensors.h"

namespace gdn::train {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  f_ = std::fopen(path.c_str(), "a");
  GDN_CHECK(f_ != nullptr, "cannot open metrics file '{}': {}", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (f_ != nullptr) std::fclose(f_);  // an error path: the error already being reported wins
}

namespace {
constexpr const char* kSpaceHint =
    "free space on the file system holding the run directory (or raise its size limit), then "
    "continue with --resume: the last complete checkpoint is untouched";
}  // namespace

void MetricsWriter::write(const nlohmann::json& record) {
  GDN_CHECK(f_ != nullptr, "metrics file '{}' is already closed", path_);
  const std::string line = record.dump() + "\n";
  // A full disk shows up at the flush (stdio buffers the line): both are checked, so a cut
  // metrics.jsonl is never a silent success. A torn last line is dropped on resume.
  const bool wrote = std::fwrite(line.data(), 1, line.size(), f_) == line.size();
  const int err = errno;
  GDN_CHECK_HINT(wrote, kSpaceHint, "writing metrics to '{}' failed: {}", path_,
                 std::strerror(err));
  GDN_CHECK_HINT(std::fflush(f_) == 0, kSpaceHint, "writing metrics to '{}' failed: {}", path_,
                 std::strerror(errno));
}

void MetricsWriter::close() {
  if (f_ == nullptr) return;
  const bool ok = std::ferror(f_) == 0;
  const int rc = std::fclose(f_);
  const int err = errno;
  f_ = nullptr;
  GDN_CHECK_HINT(ok && rc == 0, kSpaceHint, "closing metrics file '{}' failed: {}", path_,
                 std::strerror(err));
}

void truncate_metrics(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in.good()) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) continue;  // a torn last line from a crash
    if (j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() > last_step)
      continue;
    kept += line + "\n";
  }
  write_file_atomic(path, kept);
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) return fmt::format("{:.1f}s", s);
  auto total = static_cast<int64_t>(s);
  if (total < 3600) return fmt::format("{}m{:02d}s", total / 60, total % 60);
  return fmt::format("{}h{:02d}m", total / 3600, (total % 3600) / 60);
}

}  // namespace gdn::train
