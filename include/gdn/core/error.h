// Errors: one exception type and one check-macro family (ARCHITECTURE.md §8).
// A failed check throws gdn::Error carrying file:line, a message that names the tensor, what was
// expected and what was found, and an optional hint the CLI prints on its own `hint:` line.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace gdn {

class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string hint, const char* file, int line);
  const std::string& message() const { return message_; }
  const std::string& hint() const { return hint_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  std::string message_;
  std::string hint_;
  const char* file_;
  int line_;
};

// A check found a non-finite value (NaN or inf) in a tensor. The trainer's non-finite guard
// catches this kind (skip the step, or stop naming the step, layer and tensor); everything else
// is a plain Error.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, std::string message,
                              std::string hint = {});
[[noreturn]] void throw_nonfinite(const char* file, int line, std::string message);
}  // namespace detail

}  // namespace gdn

// GDN_CHECK(cond, "fmt", args...): always on; throws gdn::Error with the formatted message.
#define GDN_CHECK(cond, ...)                                                      \
  do {                                                                            \
    if (!(cond)) [[unlikely]]                                                     \
      ::gdn::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (0)

// GDN_CHECK_HINT(cond, hint, "fmt", args...): as GDN_CHECK with a hint for the user.
#define GDN_CHECK_HINT(cond, hint, ...)                                                   \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::gdn::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__), (hint)); \
  } while (0)

// GDN_CHECK_FINITE(cond, "fmt", args...): as GDN_CHECK, throwing gdn::NonFiniteError.
#define GDN_CHECK_FINITE(cond, ...)                                                   \
  do {                                                                                \
    if (!(cond)) [[unlikely]]                                                         \
      ::gdn::detail::throw_nonfinite(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (0)

#define GDN_FAIL(...) ::gdn::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))
#define GDN_FAIL_HINT(hint, ...) \
  ::gdn::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__), (hint))

#ifndef NDEBUG
#define GDN_DCHECK(cond, ...) GDN_CHECK(cond, __VA_ARGS__)
#else
#define GDN_DCHECK(cond, ...) \
  do {                        \
  } while (0)
#endif
