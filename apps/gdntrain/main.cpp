// gdntrain: the command-line program. Every subcommand is a thin layer over libgdn; errors are
// caught here, printed with a `hint:` line, and turned into a non-zero exit status.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <unistd.h>

#include "backend/cpu/blas.h"
#include "commands.h"
#include "gdn/core/env.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"

int main(int argc, char** argv) {
  // OpenBLAS on its generic kernels on a CPU it did not recognise: restart once with the kernel
  // set the CPU supports (backend/cpu/blas.h). OPENBLAS_CORETYPE set by the user is kept as is.
  if (const auto core = gdn::cpu::better_openblas_core()) {
    std::fprintf(stderr,
                 "[cpu] OpenBLAS chose its Prescott kernels on a CPU it does not recognise; "
                 "restarting with OPENBLAS_CORETYPE=%s (set OPENBLAS_CORETYPE to choose)\n",
                 core->c_str());
    if (setenv("OPENBLAS_CORETYPE", core->c_str(), 1) == 0) execv("/proc/self/exe", argv);
    // execv returned: carry on with the kernels OpenBLAS chose.
  }
  CLI::App app{"gdntrain: trains Qwen3.5-class hybrid (Gated DeltaNet + gated attention) models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "gdntrain 0.1.0");
  gdn::cli::Commands cmds;
  gdn::cli::add_commands(app, cmds);
  // "gdntrain train --help", or "gdntrain --help" before a subcommand was parsed.
  auto help_line = [&app] {
    for (const CLI::App* sub : app.get_subcommands())
      return fmt::format("run `gdntrain {} --help` for the expected arguments", sub->get_name());
    return std::string("run `gdntrain --help` for the commands");
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help and --version are ParseErrors with status 0
    if (rc != 0) std::fprintf(stderr, "hint: %s\n", help_line().c_str());
    return rc;
  }
  try {
    gdn::env::check_environment();
    std::string level = gdn::env::get_string("GDN_LOG_LEVEL");
    gdn::log::set_min_level(level == "debug"   ? gdn::log::Level::Debug
                            : level == "warn"  ? gdn::log::Level::Warn
                            : level == "error" ? gdn::log::Level::Error
                                               : gdn::log::Level::Info);
    const int rc = cmds.run();
    // What a command printed must have reached its destination (a full disk under a redirected
    // stdout is an error, not a silent success).
    GDN_CHECK_HINT(std::fflush(stdout) == 0 && std::ferror(stdout) == 0,
                   "free space where the output goes, or redirect it elsewhere",
                   "writing the standard output failed: {}", std::strerror(errno));
    return rc;
  } catch (const gdn::Error& e) {
    // In a multi-rank run the error carries the rank ("[rank 1/8] error: ...").
    std::fprintf(stderr, "%serror: %s\n  at %s:%d\n", gdn::log::prefix().c_str(),
                 e.message().c_str(), e.file(), e.line());
    std::fprintf(stderr, "hint: %s\n", e.hint().empty() ? help_line().c_str() : e.hint().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "%serror: %s\nhint: this is unexpected; please report it with the command "
                 "line\n",
                 gdn::log::prefix().c_str(), e.what());
    return 2;
  }
}
