// gdntrain ops list | ops run: the op stack on named tensors in safetensors files, so that a user
// can compare gdntrain with any other framework op by op.
#include <cstdio>

#include "commands.h"
#include "gdn/backend/op_run.h"
#include "gdn/backend/registry.h"
#include "gdn/core/error.h"

namespace gdn::cli {

namespace {
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "-" : s;
}

int run_list() {
  Registry& reg = Registry::global();
  for (const OpDesc* op : reg.ops()) {
    std::printf("%s: %s\n", op->name.c_str(), op->summary.c_str());
    std::printf("  forward  reads:  %s\n", join(op->fwd_inputs).c_str());
    std::printf("  forward  writes: %s\n", join(op->fwd_outputs).c_str());
    std::printf("  backward reads:  %s\n", join(op->bwd_inputs).c_str());
    std::printf("  backward writes: %s\n", join(op->bwd_outputs).c_str());
    if (!op->attrs.empty()) std::printf("  attributes:      %s\n", join(op->attrs).c_str());
    std::string impls;
    for (Backend b : {Backend::Ref, Backend::Cpu, Backend::Cuda})
      for (const ImplDesc* i : reg.impls(op->name, b))
        impls +=
            (impls.empty() ? "" : ", ") + i->name + " (prio " + std::to_string(i->priority) + ")";
    std::printf("  implementations: %s\n", impls.c_str());
  }
  return 0;
}

struct RunOptions {
  std::string op, in, out, backend = "cpu";
  bool backward = false;
  std::vector<std::string> attrs;
};

int run_run(const RunOptions& o) {
  std::map<std::string, double> attrs;
  for (const auto& a : o.attrs) {
    auto eq = a.find('=');
    GDN_CHECK_HINT(eq != std::string::npos, "write attributes as name=value, e.g. --attr eps=1e-6",
                   "attribute '{}' has no '='", a);
    std::string v = a.substr(eq + 1);
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    GDN_CHECK(end != v.c_str() && *end == '\0', "attribute '{}' value '{}' is not a number",
              a.substr(0, eq), v);
    attrs[a.substr(0, eq)] = x;
  }
  OpRunResult r = run_op_file(o.op, backend_from_name(o.backend), o.in, o.out, o.backward, attrs);
  std::printf("%s: ran %s, wrote %s to %s\n", o.op.c_str(), r.impl.c_str(), join(r.written).c_str(),
              o.out.c_str());
  return 0;
}
}  // namespace

void add_ops_command(CLI::App& app, Commands& cmds) {
  auto* ops = app.add_subcommand("ops", "List the ops, or run one on tensors from a file");
  ops->require_subcommand(1);
  auto* list = ops->add_subcommand("list", "Every op with the tensor names it reads and writes");
  list->callback([&cmds] { cmds.selected = [] { return run_list(); }; });

  auto opts = std::make_shared<RunOptions>();
  auto* run = ops->add_subcommand("run", "Run an op's forward (and backward) on named tensors");
  run->add_option("op", opts->op, "Op name (see `gdntrain ops list`)")->required();
  run->add_option("--in", opts->in, "Input safetensors file")->required();
  run->add_option("--out", opts->out, "Output safetensors file (written atomically)")->required();
  run->add_flag("--backward", opts->backward, "Also run the backward (needs upstream gradients)");
  run->add_option("--backend", opts->backend, "ref | cpu | cuda")
      ->check(CLI::IsMember({"ref", "cpu", "cuda"}));
  run->add_option("--attr", opts->attrs, "Scalar attribute name=value (overrides file metadata)");
  run->callback([&cmds, opts] { cmds.selected = [opts] { return run_run(*opts); }; });
}

}  // namespace gdn::cli
