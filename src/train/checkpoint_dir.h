// Crash-safe checkpoint directories. A checkpoint is written into `<root>/.tmp-step-N`, every file
// fsynced, a COMPLETE marker written last, then the directory is renamed to `<root>/step-N` and the
// root fsynced. A kill at any instant leaves either the previous complete checkpoints untouched or
// the new one complete; leftover temporary directories are ignored and cleaned up. The last `keep`
// complete checkpoints are kept.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace gdn::train {

class CheckpointDir {
 public:
  CheckpointDir(std::string root, int keep);

  // Starts a checkpoint for `step`: returns the temporary directory to write files into.
  std::string begin(int64_t step);
  // Finishes it: writes the COMPLETE marker (with `summary`), renames into place, prunes old ones.
  std::string commit(int64_t step, const std::string& summary);

  // Removes the temporary directory of a checkpoint whose write failed (never throws).
  void abandon(int64_t step) noexcept;

  // Complete checkpoints, oldest first.
  std::vector<std::pair<int64_t, std::string>> list() const;
  std::optional<std::string> latest() const;
  // Removes temporary directories left by an interrupted write.
  void clean_temporaries() const;

  static constexpr const char* kMarker = "COMPLETE";

 private:
  std::string root_;
  int keep_;
};

// fsyncs a regular file (by path).
void fsync_file(const std::string& path);

}  // namespace gdn::train
