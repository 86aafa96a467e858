// Subcommand registration for the gdntrain CLI.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace gdn::cli {

struct Commands {
  std::function<int()> selected;  // set by the parsed subcommand's callback
  int run() const { return selected ? selected() : 0; }
};

void add_commands(CLI::App& app, Commands& cmds);

// Counts given on the command line: positive integers, with a short message (CLI::PositiveNumber
// prints the range of a double, hundreds of digits).
const CLI::Validator& positive_count();
// Positive finite numbers, likewise.
const CLI::Validator& positive_real();

// One function per command family, each in its own file.
void add_env_command(CLI::App& app, Commands& cmds);
void add_probe_command(CLI::App& app, Commands& cmds);
void add_ops_command(CLI::App& app, Commands& cmds);
void add_dump_command(CLI::App& app, Commands& cmds);
void add_train_command(CLI::App& app, Commands& cmds);
void add_prepare_command(CLI::App& app, Commands& cmds);
void add_tokenize_command(CLI::App& app, Commands& cmds);

}  // namespace gdn::cli
