// Training metrics: one JSON object per step appended to metrics.jsonl (flushed each line so a
// crash loses at most the line being written), the console progress line's pieces, a profiled
// step's record and the launch clock.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gdn/core/profile.h"

namespace gdn::train {

class MetricsWriter {
 public:
  // Opens (appending) `path`; on resume the caller first truncates lines past the resumed step.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  // Appends one line and flushes it; a failed write or flush (a full disk) throws gdn::Error.
  void write(const nlohmann::json& record);
  // Closes the file, checking for errors (the destructor closes silently, on error paths only).
  void close();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// Keeps only the records of metrics.jsonl with "step" <= `last_step` (used when resuming, so the
// file never holds two records of the same step). Rewritten atomically.
void truncate_metrics(const std::string& path, int64_t last_step);

// "1h02m", "3m05s", "12.3s".
std::string format_duration(double seconds);

// --profile-step: RUN_DIR/profile_step<N>.json, the ranges of one step summed by name.
void write_profile(const std::string& run_dir, int64_t step, const std::vector<Profiler::Row>& rows,
                   double wall_ms, int64_t tokens);

// Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime,
// 10 ms resolution), so "launch" includes everything before the trainer: the dynamic loader, the
// CUDA runtime's start-up, the command line. -1 where /proc cannot tell.
double seconds_since_process_start();

}  // namespace gdn::train
