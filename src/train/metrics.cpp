#include "train/metrics.h"

#include <unistd.h>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

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

void write_profile(const std::string& run_dir, int64_t step, const std::vector<Profiler::Row>& rows,
                   double wall_ms, int64_t tokens) {
  nlohmann::json r = nlohmann::json::array();
  double sum = 0;
  for (const auto& row : rows) {
    r.push_back({{"name", row.name}, {"calls", row.calls}, {"ms", row.ms}});
    sum += row.ms;
  }
  nlohmann::json j = {{"step", step},
                      {"tokens", tokens},
                      {"step_wall_ms", wall_ms},
                      {"ranges_ms", sum},
                      {"ranges", r}};
  write_file_atomic(fmt::format("{}/profile_step{}.json", run_dir, step), j.dump(2) + "\n");
}

double seconds_since_process_start() {
  std::ifstream st("/proc/self/stat"), up("/proc/uptime");
  std::string stat;
  double uptime = 0;
  if (!std::getline(st, stat) || !(up >> uptime)) return -1;
  // Field 22 (starttime, clock ticks after boot) follows the ')' closing the command name.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i)
    if (!(rest >> field)) return -1;
  const long ticks = sysconf(_SC_CLK_TCK);
  if (ticks <= 0) return -1;
  return uptime - std::stod(field) / static_cast<double>(ticks);
}

}  // namespace gdn::train
