// Logging: plain lines on stderr, prefixed with the rank in multi-rank runs, and log-once: a keyed
// message printed once per process however many layers, steps or threads reach it.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <string>
#include <string_view>

namespace gdn::log {

enum class Level { Debug, Info, Warn, Error };

// Sets the rank prefix ("[rank 3/8] ") used when world > 1.
void set_rank(int rank, int world);
// The current prefix ("" at world 1), for text printed outside these functions (the CLI's error).
std::string prefix();
// Redirects output (tests capture lines through this); an empty function restores stderr.
void set_sink(std::function<void(Level, std::string_view)> sink);
void set_min_level(Level level);

void write(Level level, std::string_view message);
// Prints `message` the first time `key` is seen in this process; returns true if it printed.
bool write_once(std::string_view key, Level level, std::string_view message);
// Forgets the keys seen so far (tests only).
void reset_once_keys_for_testing();

template <class... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Info, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Warn, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Error, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Debug, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
bool info_once(std::string_view key, fmt::format_string<Args...> f, Args&&... args) {
  return write_once(key, Level::Info, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
bool warn_once(std::string_view key, fmt::format_string<Args...> f, Args&&... args) {
  return write_once(key, Level::Warn, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace gdn::log
