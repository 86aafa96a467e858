// gdntrain probe: resolves every registered op (capability check + numeric probe against ref)
// and prints one line per op and backend; with --model, every (op, shape class) a training step
// of that model resolves, one line each.
#include <cstdio>

#include "commands.h"
#include "gdn/backend/registry.h"
#include "gdn/core/error.h"
#include "gdn/core/tensor.h"
#include "model/probe_model.h"

namespace gdn::cli {

namespace {
struct ProbeOptions {
  std::vector<std::string> backends;
  std::string op;
  std::string model;
  std::string recompute = "none";
};

// --model: the decisions of one step of the model on each backend.
int run_probe_model(const ProbeOptions& o, const std::vector<Backend>& backends) {
  const model::Qwen35Config cfg = model::load_model_config(o.model);
  const model::Recompute rc = model::recompute_from_name(o.recompute);
  std::printf("%-22s %-5s %-44s %-22s %9s %9s %8s\n", "op", "back", "shape class", "implementation",
              "fwd err", "bwd err", "probe ms");
  for (Backend b : backends) {
    for (const Registry::Decision& d : model::probe_model(cfg, b, rc)) {
      if (!o.op.empty() && d.op != o.op) continue;
      std::printf("%-22s %-5s %-44s %-22s %9.2e %9.2e %8.1f\n", d.op.c_str(),
                  std::string(backend_name(b)).c_str(), d.query.shape_class.c_str(),
                  d.result.impl->name.c_str(), d.result.error.fwd, d.result.error.bwd,
                  d.result.probe_ms);
    }
  }
  return 0;
}

int run_probe(const ProbeOptions& o) {
  Registry& reg = Registry::global();
  std::vector<Backend> backends;
  if (o.backends.empty()) {
    backends.push_back(Backend::Cpu);
    if (cuda_available()) backends.push_back(Backend::Cuda);
  } else {
    for (const auto& b : o.backends) backends.push_back(backend_from_name(b));
  }
  for (Backend b : backends)
    GDN_CHECK_HINT(b != Backend::Cuda || cuda_available(),
                   "build the cuda preset and run on a machine with a GPU, or probe --backend cpu",
                   "probe --backend cuda: no CUDA device is available to this build");
  if (!o.op.empty()) {
    std::string names;
    bool known = false;
    for (const OpDesc* op : reg.ops()) {
      known = known || op->name == o.op;
      names += (names.empty() ? "" : ", ") + op->name;
    }
    GDN_CHECK_HINT(known, "`gdntrain ops list` lists the ops", "probe --op '{}': no such op ({})",
                   o.op, names);
  }
  if (!o.model.empty()) return run_probe_model(o, backends);
  int failures = 0;
  std::printf("%-22s %-5s %-26s %10s %10s %9s\n", "op", "back", "implementation", "fwd err",
              "bwd err", "probe ms");
  for (Backend b : backends) {
    for (const OpDesc* op : reg.ops()) {
      if (!o.op.empty() && op->name != o.op) continue;
      if (reg.impls(op->name, b).empty()) {
        std::printf("%-22s %-5s %-26s\n", op->name.c_str(), std::string(backend_name(b)).c_str(),
                    "(no implementation)");
        continue;
      }
      try {
        const Resolution& r = reg.resolve(op->name, OpQuery{b, "", {}});
        std::printf("%-22s %-5s %-26s %10.2e %10.2e %9.1f\n", op->name.c_str(),
                    std::string(backend_name(b)).c_str(), r.impl->name.c_str(), r.error.fwd,
                    r.error.bwd, r.probe_ms);
      } catch (const Error& e) {
        ++failures;
        std::printf("%-22s %-5s FAILED: %s\n", op->name.c_str(),
                    std::string(backend_name(b)).c_str(), e.message().c_str());
      }
    }
  }
  GDN_CHECK_HINT(failures == 0, "the lines above say which implementation failed and why",
                 "{} op(s) have no implementation that passes its probe", failures);
  return 0;
}
}  // namespace

void add_probe_command(CLI::App& app, Commands& cmds) {
  auto opts = std::make_shared<ProbeOptions>();
  auto* sub = app.add_subcommand(
      "probe", "Resolve every op: capability check and numeric probe against the fp64 reference");
  sub->add_option("--backend", opts->backends,
                  "Backends to probe (default: cpu, and cuda if present)")
      ->check(CLI::IsMember({"ref", "cpu", "cuda"}));
  sub->add_option("--op", opts->op, "Probe only this op");
  sub->add_option("--model", opts->model,
                  "Probe every (op, shape class) one training step of this model uses (a "
                  "checkpoint or config directory with config.json, or the file); builds the "
                  "model at full size with random weights");
  sub->add_option("--recompute", opts->recompute, "With --model: the recompute policy")
      ->check(CLI::IsMember({"none", "selective", "full"}))
      ->capture_default_str();
  sub->callback([&cmds, opts] { cmds.selected = [opts] { return run_probe(*opts); }; });
}

}  // namespace gdn::cli
