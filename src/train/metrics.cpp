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
  if (f_ != nullptr) std::fclose(f_);
}

void MetricsWriter::write(const nlohmann::json& record) {
  std::string line = record.dump() + "\n";
  GDN_CHECK(std::fwrite(line.data(), 1, line.size(), f_) == line.size(),
            "writing metrics to '{}' failed", path_);
  std::fflush(f_);
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
