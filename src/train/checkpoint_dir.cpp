#include "train/checkpoint_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "gdn/core/error.h"
#include "gdn/core/log.h"
#include "gdn/core/safetensors.h"

namespace gdn::train {

namespace fs = std::filesystem;

void fsync_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  GDN_CHECK(fd >= 0, "cannot open '{}' to fsync: {}", path, std::strerror(errno));
  int rc = ::fsync(fd);
  ::close(fd);
  GDN_CHECK(rc == 0, "fsync of '{}' failed: {}", path, std::strerror(errno));
}

CheckpointDir::CheckpointDir(std::string root, int keep) : root_(std::move(root)), keep_(keep) {
  GDN_CHECK(keep_ >= 1, "checkpoint keep must be at least 1, got {}", keep_);
  std::error_code ec;
  fs::create_directories(root_, ec);
  GDN_CHECK(!ec, "cannot create checkpoint directory '{}': {}", root_, ec.message());
}

std::string CheckpointDir::begin(int64_t step) {
  fs::path tmp = fs::path(root_) / fmt::format(".tmp-step-{}", step);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  GDN_CHECK(!ec, "cannot create '{}': {}", tmp.string(), ec.message());
  return tmp.string();
}

std::string CheckpointDir::commit(int64_t step, const std::string& summary) {
  fs::path tmp = fs::path(root_) / fmt::format(".tmp-step-{}", step);
  fs::path dst = fs::path(root_) / fmt::format("step-{}", step);
  for (const auto& e : fs::directory_iterator(tmp))
    if (e.is_regular_file()) fsync_file(e.path().string());
  write_file_atomic((tmp / kMarker).string(), summary + "\n");
  fsync_directory(tmp.string());
  std::error_code ec;
  if (fs::exists(dst)) {
    // Re-saving the same step (e.g. the final save right after a periodic one): replace it by
    // moving the old one aside first so that a complete copy exists at every instant.
    fs::path old = fs::path(root_) / fmt::format(".old-step-{}", step);
    fs::remove_all(old, ec);
    fs::rename(dst, old, ec);
    GDN_CHECK(!ec, "cannot move '{}' aside: {}", dst.string(), ec.message());
    fs::rename(tmp, dst, ec);
    GDN_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), dst.string(), ec.message());
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp, dst, ec);
    GDN_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), dst.string(), ec.message());
  }
  fsync_directory(root_);
  auto all = list();
  while (static_cast<int>(all.size()) > keep_) {
    // Rename first (atomic), then delete: a kill half-way through a recursive delete must never
    // leave a directory that still carries its COMPLETE marker but lost its files.
    fs::path doomed = fs::path(root_) / fmt::format(".del-step-{}", all.front().first);
    fs::rename(all.front().second, doomed, ec);
    if (!ec) fs::remove_all(doomed, ec);
    all.erase(all.begin());
  }
  return dst.string();
}

void CheckpointDir::abandon(int64_t step) noexcept {
  std::error_code ec;
  fs::remove_all(fs::path(root_) / fmt::format(".tmp-step-{}", step), ec);
}

std::vector<std::pair<int64_t, std::string>> CheckpointDir::list() const {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::exists(root_, ec)) return out;
  for (const auto& e : fs::directory_iterator(root_)) {
    std::string name = e.path().filename().string();
    if (!e.is_directory() || !name.starts_with("step-")) continue;
    char* end = nullptr;
    long long step = std::strtoll(name.c_str() + 5, &end, 10);
    if (end == nullptr || *end != '\0') continue;
    if (!fs::exists(e.path() / kMarker)) continue;  // incomplete: never used
    out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> CheckpointDir::latest() const {
  auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back().second;
}

void CheckpointDir::clean_temporaries() const {
  std::error_code ec;
  if (!fs::exists(root_, ec)) return;
  std::vector<fs::directory_entry> entries(fs::directory_iterator(root_), {});
  for (const auto& e : entries) {
    std::string name = e.path().filename().string();
    if (name.starts_with(".old-step-")) {
      // Killed between moving a complete step-N aside and renaming its replacement in: the old
      // copy is the complete one, so put it back.
      fs::path dst = fs::path(root_) / name.substr(5);
      if (!fs::exists(dst) && fs::exists(e.path() / kMarker)) {
        fs::rename(e.path(), dst, ec);
        continue;
      }
    }
    if (name.starts_with(".tmp-step-") || name.starts_with(".old-step-") ||
        name.starts_with(".del-step-")) {
      log::info("removing the interrupted checkpoint write {}", e.path().string());
      fs::remove_all(e.path(), ec);
    }
  }
}

}  // namespace gdn::train
