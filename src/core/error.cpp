#include "gdn/core/error.h"

#include <cstring>

namespace gdn {

namespace {
const char* short_path(const char* file) {
  // Print paths relative to the source tree: "src/ops/rmsnorm/cpu.cpp:42".
  const char* p = std::strstr(file, "/src/");
  if (p == nullptr) p = std::strstr(file, "/include/");
  if (p == nullptr) p = std::strstr(file, "/apps/");
  if (p == nullptr) p = std::strstr(file, "/tests/");
  return p != nullptr ? p + 1 : file;
}
}  // namespace

Error::Error(std::string message, std::string hint, const char* file, int line)
    : std::runtime_error(fmt::format("{} ({}:{})", message, short_path(file), line)),
      message_(std::move(message)),
      hint_(std::move(hint)),
      file_(short_path(file)),
      line_(line) {}

namespace detail {
void throw_error(const char* file, int line, std::string message, std::string hint) {
  throw Error(std::move(message), std::move(hint), file, line);
}
void throw_nonfinite(const char* file, int line, std::string message) {
  throw NonFiniteError(std::move(message), "", file, line);
}
}  // namespace detail

}  // namespace gdn
