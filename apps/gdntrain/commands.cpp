#include "commands.h"

namespace gdn::cli {

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
