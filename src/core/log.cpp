#include "gdn/core/log.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace gdn::log {

namespace {
struct State {
  std::mutex mu;
  int rank = 0;
  int world = 1;
  Level min_level = Level::Info;
  std::function<void(Level, std::string_view)> sink;
  std::set<std::string, std::less<>> once_keys;
};
State& state() {
  static State s;
  return s;
}
const char* level_tag(Level l) {
  switch (l) {
    case Level::Debug:
      return "debug: ";
    case Level::Info:
      return "";
    case Level::Warn:
      return "warning: ";
    case Level::Error:
      return "error: ";
  }
  return "";
}
void emit_locked(State& s, Level level, std::string_view message) {
  if (level < s.min_level) return;
  std::string line;
  if (s.world > 1) line = fmt::format("[rank {}/{}] ", s.rank, s.world);
  line += level_tag(level);
  line += message;
  if (s.sink) {
    s.sink(level, line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
}
}  // namespace

void set_rank(int rank, int world) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.rank = rank;
  s.world = world;
}

std::string prefix() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.world > 1 ? fmt::format("[rank {}/{}] ", s.rank, s.world) : std::string();
}

void set_sink(std::function<void(Level, std::string_view)> sink) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.sink = std::move(sink);
}

void set_min_level(Level level) {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.min_level = level;
}

void write(Level level, std::string_view message) {
  State& s = state();
  std::lock_guard lock(s.mu);
  emit_locked(s, level, message);
}

bool write_once(std::string_view key, Level level, std::string_view message) {
  State& s = state();
  std::lock_guard lock(s.mu);
  if (!s.once_keys.emplace(key).second) return false;
  emit_locked(s, level, message);
  return true;
}

void reset_once_keys_for_testing() {
  State& s = state();
  std::lock_guard lock(s.mu);
  s.once_keys.clear();
}

}  // namespace gdn::log
