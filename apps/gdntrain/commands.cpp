#include "commands.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace gdn::cli {

const CLI::Validator& positive_count() {
  static const CLI::Validator v(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        errno = 0;
        const long long n = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || end == nullptr || *end != '\0' || errno != 0 || n < 1)
          return fmt::format("must be a positive integer, got '{}'", s);
        return {};
      },
      "POSITIVE");
  return v;
}

const CLI::Validator& positive_real() {
  static const CLI::Validator v(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (s.empty() || end == nullptr || *end != '\0' || !std::isfinite(d) || d <= 0)
          return fmt::format("must be a positive number, got '{}'", s);
        return {};
      },
      "POSITIVE");
  return v;
}

void add_commands(CLI::App& app, Commands& cmds) {
  add_env_command(app, cmds);
  add_probe_command(app, cmds);
  add_ops_command(app, cmds);
  add_dump_command(app, cmds);
  add_train_command(app, cmds);
  add_prepare_command(app, cmds);
  add_tokenize_command(app, cmds);
}

}  // namespace gdn::cli
