// gdntrain env: every environment knob with its current value and help.
#include <cstdio>

#include "commands.h"
#include "gdn/core/env.h"

namespace gdn::cli {

void add_env_command(CLI::App& app, Commands& cmds) {
  auto* sub = app.add_subcommand("env", "Print every GDN_* environment knob, its value and help");
  sub->callback([&cmds] {
    cmds.selected = [] {
      for (const env::Knob& k : env::knobs()) {
        const char* type = k.type == env::KnobType::Bool     ? "bool"
                           : k.type == env::KnobType::Int    ? "int"
                           : k.type == env::KnobType::Float  ? "float"
                           : k.type == env::KnobType::Choice ? "choice"
                                                             : "string";
        std::printf("%-24s %-6s %-9s = %s\n", k.name, type, k.live ? "live" : "read-once",
                    env::current_text(k).c_str());
        std::printf("    %s%s%s\n", k.help, k.choices ? " Choices: " : "",
                    k.choices ? k.choices : "");
      }
      return 0;
    };
  });
}

}  // namespace gdn::cli
