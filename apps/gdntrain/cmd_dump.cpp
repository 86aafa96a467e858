// gdntrain dump: logits, per-document losses and every parameter gradient of an HF checkpoint on
// a set of documents (see src/model/dump.h for the file formats).
#include "commands.h"
#include "gdn/backend/registry.h"
#include "model/dump.h"

namespace gdn::cli {

namespace {
struct DumpOptions {
  std::string model, docs, out, backend = "cpu";
};
}  // namespace

void add_dump_command(CLI::App& app, Commands& cmds) {
  auto o = std::make_shared<DumpOptions>();
  auto* sub = app.add_subcommand(
      "dump", "Pack documents into one batch; write logits, per-document losses and gradients");
  sub->add_option("--model", o->model, "HF checkpoint directory (config.json + safetensors)")
      ->required();
  sub->add_option("--docs", o->docs, "safetensors file with doc{i}.input_ids")->required();
  sub->add_option("--out", o->out, "output safetensors file (written atomically)")->required();
  sub->add_option("--backend", o->backend, "ref | cpu | cuda")
      ->check(CLI::IsMember({"ref", "cpu", "cuda"}));
  sub->callback([&cmds, o] {
    cmds.selected = [o] {
      model::dump_to_file(o->model, o->docs, o->out, backend_from_name(o->backend));
      return 0;
    };
  });
}

}  // namespace gdn::cli
