// Data parallelism end to end (issue 23): `mpirun -np N gdntrain train` with dist.shard =
// replicate and grad_accum A against ONE process with grad_accum N * A, the same global batch:
// the training losses of every step must agree to fp32 reduction order (relative <= --rel).
//
//   replicate_equivalence --gdntrain PATH --mpiexec "mpirun --oversubscribe -np" --np 2
//                         --accum 1 --steps 20 --work DIR [--rel 1e-6] [--set key=value ...]
//
// Both runs are real `gdntrain train` processes writing RUN_DIR/metrics.jsonl (rank 0's for the
// distributed one); the records are compared step by step (loss, z_loss; tokens exactly), and the
// largest relative differences are printed. Exit status 0 only if every step agrees.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

struct Args {
  std::string gdntrain, mpiexec, work;
  int np = 2, accum = 1, steps = 20;
  double rel = 1e-6;
  std::vector<std::string> sets;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "replicate_equivalence: %s\n", why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + k).c_str());
    const std::string v = argv[++i];
    if (k == "--gdntrain")
      a.gdntrain = v;
    else if (k == "--mpiexec")
      a.mpiexec = v;
    else if (k == "--work")
      a.work = v;
    else if (k == "--np")
      a.np = std::stoi(v);
    else if (k == "--accum")
      a.accum = std::stoi(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--rel")
      a.rel = std::stod(v);
    else if (k == "--set")
      a.sets.push_back(v);
    else
      usage(("unknown option " + k).c_str());
  }
  if (a.gdntrain.empty() || a.mpiexec.empty() || a.work.empty())
    usage("--gdntrain, --mpiexec and --work are required");
  return a;
}

std::string train_command(const Args& a, const std::string& run_dir, int accum) {
  std::string cmd = "'" + a.gdntrain + "' train --device cpu --steps " + std::to_string(a.steps) +
                    " --run-dir '" + run_dir + "' --set train.grad_accum=" + std::to_string(accum) +
                    " --set eval.every=0 --set checkpoint.at_end=false --set log.every=5";
  for (const std::string& s : a.sets) cmd += " --set '" + s + "'";
  return cmd;
}

int run(const std::string& cmd) {
  std::printf("$ %s\n", cmd.c_str());
  std::fflush(stdout);
  const int rc = std::system(cmd.c_str());
  return rc;
}

// step -> record
std::map<int64_t, nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream f(path);
  std::map<int64_t, nlohmann::json> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("step") && j.contains("loss")) out[j["step"].get<int64_t>()] = j;
  }
  return out;
}

double rel_diff(double a, double b) {
  const double scale = std::max(std::fabs(a), std::fabs(b));
  return scale == 0 ? 0 : std::fabs(a - b) / scale;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const std::string dp = a.work + "/dp", single = a.work + "/single";
  fs::remove_all(dp);
  fs::remove_all(single);
  fs::create_directories(a.work);
  if (run(a.mpiexec + " " + std::to_string(a.np) + " " + train_command(a, dp, a.accum)) != 0) {
    std::printf("FAIL: the %d-rank run failed\n", a.np);
    return 1;
  }
  if (run(train_command(a, single, a.accum * a.np)) != 0) {
    std::printf("FAIL: the single-process run failed\n");
    return 1;
  }
  const auto m_dp = read_metrics(dp + "/metrics.jsonl");
  const auto m_one = read_metrics(single + "/metrics.jsonl");
  int failures = 0;
  double max_loss = 0, max_z = 0, max_gnorm = 0;
  for (int64_t s = 1; s <= a.steps; ++s) {
    const auto x = m_dp.find(s), y = m_one.find(s);
    if (x == m_dp.end() || y == m_one.end()) {
      std::printf("FAIL: step %lld missing (%s)\n", static_cast<long long>(s),
                  x == m_dp.end() ? "distributed run" : "single process");
      ++failures;
      continue;
    }
    const double l0 = x->second["loss"].get<double>(), l1 = y->second["loss"].get<double>();
    const double dl = rel_diff(l0, l1);
    const double dz =
        rel_diff(x->second["z_loss"].get<double>(), y->second["z_loss"].get<double>());
    const double dg =
        rel_diff(x->second["grad_norm"].get<double>(), y->second["grad_norm"].get<double>());
    max_loss = std::max(max_loss, dl);
    max_z = std::max(max_z, dz);
    max_gnorm = std::max(max_gnorm, dg);
    const bool tokens_ok = x->second["tokens"] == y->second["tokens"];
    const bool ok = dl <= a.rel && tokens_ok;
    std::printf("step %2lld: loss %.9f vs %.9f (rel %.2e), grad_norm rel %.2e, tokens %s%s\n",
                static_cast<long long>(s), l0, l1, dl, dg, x->second["tokens"].dump().c_str(),
                ok ? "" : "  <-- FAIL");
    if (!ok) ++failures;
  }
  if (m_dp.size() != static_cast<size_t>(a.steps)) {
    std::printf("FAIL: the distributed run wrote %zu records for %d steps\n", m_dp.size(), a.steps);
    ++failures;
  }
  std::printf(
      "%d ranks x grad_accum %d vs 1 process x grad_accum %d, %d steps: max relative difference "
      "loss %.3e, z_loss %.3e, grad_norm %.3e (bound on the loss: %.1e)\n",
      a.np, a.accum, a.np * a.accum, a.steps, max_loss, max_z, max_gnorm, a.rel);
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
