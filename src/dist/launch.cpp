#include "dist/launch.h"

#include <fmt/format.h>

#include <charconv>
#include <initializer_list>
#include <optional>
#include <vector>

#include "gdn/core/error.h"

extern char** environ;

namespace gdn::dist {

namespace {

constexpr const char* kHint =
    "docs/DISTRIBUTED.md shows the launch recipes (torchrun --no-python, mpirun, srun)";

std::optional<std::string_view> get(const EnvMap& env, std::string_view name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return std::string_view(it->second);
}

// A decimal integer in [lo, hi]; anything else ("", "2x", "-1", "1e3", overflow) is an error
// naming the variable.
int parse_int(std::string_view name, std::string_view text, int lo, int hi) {
  int v = 0;
  const char* b = text.data();
  const char* e = b + text.size();
  auto [p, ec] = std::from_chars(b, e, v);
  GDN_CHECK_HINT(!text.empty() && ec == std::errc() && p == e && v >= lo && v <= hi, kHint,
                 "bad launch: {}='{}' is not an integer in [{}, {}]", name, text, lo, hi);
  return v;
}

// `trigger` is the variable whose presence selected the launcher; the error names both.
int require_int(const EnvMap& env, std::string_view name, std::string_view trigger, int lo,
                int hi = 1 << 30) {
  auto v = get(env, name);
  GDN_CHECK_HINT(v.has_value(), kHint, "bad launch: {} is set but {} is missing", trigger, name);
  return parse_int(name, *v, lo, hi);
}

std::string_view first_present(const EnvMap& env, std::initializer_list<std::string_view> names) {
  for (std::string_view n : names)
    if (get(env, n)) return n;
  return *names.begin();
}

// SLURM_TASKS_PER_NODE: per-node task counts, compressed: "4(x2),3" means nodes 0-1 run 4 tasks
// and node 2 runs 3.
int slurm_tasks_on_node(std::string_view spec, int node) {
  int first = 0;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string_view::npos) end = spec.size();
    std::string_view item = spec.substr(pos, end - pos);
    int repeat = 1;
    if (size_t paren = item.find("(x"); paren != std::string_view::npos) {
      GDN_CHECK_HINT(item.back() == ')', kHint,
                     "bad launch: SLURM_TASKS_PER_NODE='{}' is malformed", spec);
      repeat = parse_int("SLURM_TASKS_PER_NODE", item.substr(paren + 2, item.size() - paren - 3), 1,
                         1 << 20);
      item = item.substr(0, paren);
    }
    const int tasks = parse_int("SLURM_TASKS_PER_NODE", item, 1, 1 << 20);
    if (node < first + repeat) return tasks;
    first += repeat;
    pos = end + 1;
  }
  GDN_FAIL_HINT(kHint,
                "bad launch: SLURM_TASKS_PER_NODE='{}' lists {} nodes but SLURM_NODEID is {}", spec,
                first, node);
}

void require_rendezvous(const EnvMap& env, LaunchInfo& info, std::string_view why) {
  auto addr = get(env, "MASTER_ADDR");
  GDN_CHECK_HINT(addr.has_value() && !addr->empty(), kHint,
                 "bad launch: {} but MASTER_ADDR is missing (the address of rank 0's host, where "
                 "the ranks meet)",
                 why);
  auto port = get(env, "MASTER_PORT");
  GDN_CHECK_HINT(port.has_value(), kHint,
                 "bad launch: {} but MASTER_PORT is missing (a free TCP port on rank 0's host)",
                 why);
  info.master_addr = std::string(*addr);
  info.master_port = parse_int("MASTER_PORT", *port, 1, 65535);
}

void validate(const LaunchInfo& i, std::string_view rank_var, std::string_view world_var,
              std::string_view local_rank_var, std::string_view local_world_var) {
  GDN_CHECK_HINT(i.rank < i.world, kHint, "bad launch: {}={} is not below {}={}", rank_var, i.rank,
                 world_var, i.world);
  GDN_CHECK_HINT(i.local_world <= i.world, kHint, "bad launch: {}={} is larger than {}={}",
                 local_world_var, i.local_world, world_var, i.world);
  GDN_CHECK_HINT(i.local_rank < i.local_world, kHint, "bad launch: {}={} is not below {}={}",
                 local_rank_var, i.local_rank, local_world_var, i.local_world);
  GDN_CHECK_HINT(i.local_rank <= i.rank, kHint,
                 "bad launch: {}={} is larger than {}={} (a node's local ranks are a subset of the "
                 "global ranks)",
                 local_rank_var, i.local_rank, rank_var, i.rank);
}

LaunchInfo from_torchrun(const EnvMap& env) {
  LaunchInfo i;
  i.launcher = Launcher::Torchrun;
  const std::string_view t = first_present(env, {"WORLD_SIZE", "RANK", "LOCAL_RANK"});
  i.world = require_int(env, "WORLD_SIZE", t, 1);
  i.rank = require_int(env, "RANK", t, 0);
  i.local_rank = require_int(env, "LOCAL_RANK", t, 0);
  // torchrun always sets LOCAL_WORLD_SIZE; a hand-written single-node launch may not.
  auto lw = get(env, "LOCAL_WORLD_SIZE");
  i.local_world = lw ? parse_int("LOCAL_WORLD_SIZE", *lw, 1, 1 << 30) : i.world;
  validate(i, "RANK", "WORLD_SIZE", "LOCAL_RANK", lw ? "LOCAL_WORLD_SIZE" : "WORLD_SIZE");
  if (i.world > 1) require_rendezvous(env, i, fmt::format("WORLD_SIZE={} is set", i.world));
  return i;
}

LaunchInfo from_openmpi(const EnvMap& env) {
  LaunchInfo i;
  i.launcher = Launcher::OpenMpi;
  const std::string_view t = first_present(env, {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"});
  i.world = require_int(env, "OMPI_COMM_WORLD_SIZE", t, 1);
  i.rank = require_int(env, "OMPI_COMM_WORLD_RANK", t, 0);
  i.local_rank = require_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", t, 0);
  i.local_world = require_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", t, 1);
  validate(i, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE");
  // The NCCL id goes by MPI broadcast; MASTER_* are kept when given (informational).
  if (auto a = get(env, "MASTER_ADDR")) i.master_addr = std::string(*a);
  if (auto p = get(env, "MASTER_PORT")) i.master_port = parse_int("MASTER_PORT", *p, 1, 65535);
  return i;
}

LaunchInfo from_slurm(const EnvMap& env, const LaunchOptions& opts) {
  LaunchInfo i;
  i.launcher = Launcher::Slurm;
  // Inside an srun step SLURM_STEP_NUM_TASKS is the step's size; SLURM_NTASKS is the
  // allocation's, which is what a batch script sees.
  const bool step = get(env, "SLURM_STEP_NUM_TASKS").has_value();
  const char* world_var = step ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  i.world = require_int(env, world_var, "SLURM_PROCID", 1);
  i.rank = require_int(env, "SLURM_PROCID", "SLURM_PROCID", 0);
  i.local_rank = require_int(env, "SLURM_LOCALID", "SLURM_PROCID", 0);
  std::string_view local_world_var = "SLURM_NTASKS_PER_NODE";
  if (auto n = get(env, "SLURM_NTASKS_PER_NODE")) {
    i.local_world = parse_int("SLURM_NTASKS_PER_NODE", *n, 1, 1 << 30);
  } else if (auto t = get(env, step ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE")) {
    local_world_var = step ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
    auto node = get(env, "SLURM_NODEID");
    i.local_world =
        slurm_tasks_on_node(*t, node ? parse_int("SLURM_NODEID", *node, 0, 1 << 20) : 0);
  } else {
    GDN_FAIL_HINT(kHint,
                  "bad launch: SLURM_PROCID is set (Slurm launch) but neither "
                  "SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is (run the ranks with srun)");
  }
  validate(i, "SLURM_PROCID", world_var, "SLURM_LOCALID", local_world_var);
  if (i.world > 1 && !opts.rendezvous_over_mpi)
    require_rendezvous(env, i, fmt::format("{}={} is set (Slurm launch)", world_var, i.world));
  return i;
}

// Two launchers' variables present (the one that wins by precedence plus another) must agree on
// the world size, or the run would wait for ranks that never come.
void check_agreement(const EnvMap& env, const LaunchInfo& i, std::string_view own_var) {
  for (std::string_view other : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"}) {
    if (other == own_var) continue;
    auto v = get(env, other);
    if (!v) continue;
    const int w = parse_int(other, *v, 1, 1 << 30);
    GDN_CHECK_HINT(w == i.world, kHint,
                   "bad launch: inconsistent world sizes: {}={} but {}={} (two launchers, or a "
                   "stale variable left in the environment?)",
                   own_var, i.world, other, w);
  }
}

}  // namespace

std::string_view launcher_name(Launcher l) {
  switch (l) {
    case Launcher::None:
      return "none";
    case Launcher::Torchrun:
      return "torchrun";
    case Launcher::OpenMpi:
      return "mpirun";
    case Launcher::Slurm:
      return "srun";
  }
  return "?";
}

EnvMap process_env() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

LaunchInfo detect_launch(const EnvMap& env, const LaunchOptions& opts) {
  const bool torchrun = get(env, "WORLD_SIZE") || get(env, "RANK") || get(env, "LOCAL_RANK");
  if (torchrun) {
    LaunchInfo i = from_torchrun(env);
    check_agreement(env, i, "WORLD_SIZE");
    return i;
  }
  if (get(env, "OMPI_COMM_WORLD_SIZE") || get(env, "OMPI_COMM_WORLD_RANK")) {
    LaunchInfo i = from_openmpi(env);
    check_agreement(env, i, "OMPI_COMM_WORLD_SIZE");
    return i;
  }
  if (get(env, "SLURM_PROCID")) return from_slurm(env, opts);
  return LaunchInfo{};
}

std::string describe(const LaunchInfo& i) {
  std::string s =
      fmt::format("rank {}/{} (local {}/{})", i.rank, i.world, i.local_rank, i.local_world);
  if (i.launcher != Launcher::None) s += fmt::format(" launched by {}", launcher_name(i.launcher));
  if (!i.master_addr.empty()) s += fmt::format(", rendezvous {}:{}", i.master_addr, i.master_port);
  return s;
}

}  // namespace gdn::dist
