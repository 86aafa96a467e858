// gdntrain probe: resolves every registered op (capability check + numeric probe against ref)
// and prints one line per op and backend.
#include <cstdio>

#include "commands.h"
#include "gdn/backend/registry.h"
#include "gdn/core/error.h"
#include "gdn/core/tensor.h"

namespace gdn::cli {

namespace {
struct ProbeOptions {
  std::vector<std::string> backends;
  std::string op;
};

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
  sub->callback([&cmds, opts] { cmds.selected = [opts] { return run_probe(*opts); }; });
}

}  // namespace gdn::cli
