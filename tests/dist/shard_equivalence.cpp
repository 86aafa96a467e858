// Data parallelism end to end (issue 23; dist.shard = replicate and optimizer): real
// `gdntrain train` processes on the cpu
// backend, under mpirun where a run has more than one rank, each with the same global batch of
// --micro micro-batches a step (train.grad_accum = micro / ranks), compared step by step with a
// reference run and with each other: the training loss to a relative difference <= --rel, the
// tokens exactly. A run
// may stop after K steps (its checkpoint) and be resumed by another world size and shard mode.
//
//   shard_equivalence --gdntrain PATH --mpiexec "mpirun ... -np" --work DIR --steps 12
//                     --micro 2 --ref 1 --cmp 2:optimizer --cmp 2:optimizer>1@6
//                     [--rel 1e-6] [--expect-clip 0.05] [--identical 2:optimizer=2:replicate]
//                     [--set key=value ...]
//
// A run is RANKS[:SHARD] (SHARD defaults to replicate); A>B@K runs A for K steps (--stop-after,
// which writes a checkpoint) and B from that checkpoint (--resume) to the end. --expect-clip C:
// the reference must clip (gradient norm > C) on at least half of its steps, so that the global
// norm's path is exercised. --identical A=B: the final checkpoints of runs A and B (every run
// writes one) hold byte for byte the same model.safetensors and optimizer.safetensors. Prints
// the largest relative differences of every comparison.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;

struct Args {
  std::string gdntrain, mpiexec, work, ref, device = "cpu";
  std::vector<std::string> cmps, sets, identical;
  int steps = 12, micro = 2;
  double rel = 1e-6, expect_clip = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "shard_equivalence: %s\n", why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage("missing value after " + k);
    const std::string v = argv[++i];
    if (k == "--gdntrain")
      a.gdntrain = v;
    else if (k == "--mpiexec")
      a.mpiexec = v;
    else if (k == "--work")
      a.work = v;
    else if (k == "--ref")
      a.ref = v;
    else if (k == "--cmp")
      a.cmps.push_back(v);
    else if (k == "--steps")
      a.steps = std::stoi(v);
    else if (k == "--micro")
      a.micro = std::stoi(v);
    else if (k == "--rel")
      a.rel = std::stod(v);
    else if (k == "--expect-clip")
      a.expect_clip = std::stod(v);
    else if (k == "--set")
      a.sets.push_back(v);
    else if (k == "--identical")
      a.identical.push_back(v);
    else if (k == "--device")
      a.device = v;
    else
      usage("unknown option " + k);
  }
  if (a.gdntrain.empty() || a.mpiexec.empty() || a.work.empty() || a.ref.empty() || a.cmps.empty())
    usage("--gdntrain, --mpiexec, --work, --ref and --cmp are required");
  return a;
}

struct Part {
  int np = 1;
  std::string shard = "replicate";
};

Part parse_part(const std::string& s) {
  Part p;
  const size_t colon = s.find(':');
  p.np = std::stoi(s.substr(0, colon));
  if (colon != std::string::npos) p.shard = s.substr(colon + 1);
  return p;
}

int run(const std::string& cmd) {
  std::printf("$ %s\n", cmd.c_str());
  std::fflush(stdout);
  return std::system(cmd.c_str());
}

// One part of a run: `extra` adds --stop-after or --resume.
bool run_part(const Args& a, const Part& p, const std::string& dir, const std::string& extra) {
  if (a.micro % p.np != 0) usage("--micro must be a multiple of every run's ranks");
  std::string cmd = p.np > 1 ? a.mpiexec + " " + std::to_string(p.np) + " " : std::string();
  cmd += "'" + a.gdntrain + "' train --device " + a.device + " --steps " + std::to_string(a.steps) +
         " --run-dir '" + dir + "' --set train.grad_accum=" + std::to_string(a.micro / p.np) +
         " --set dist.shard=" + p.shard +
         " --set eval.every=0 --set checkpoint.every=0 --set log.every=4" + extra;
  for (const std::string& s : a.sets) cmd += " --set '" + s + "'";
  return run(cmd) == 0;
}

// SPEC = A or A>B@K; returns false when a part fails.
bool run_spec(const Args& a, const std::string& spec, const std::string& dir) {
  fs::remove_all(dir);
  const size_t gt = spec.find('>');
  if (gt == std::string::npos) return run_part(a, parse_part(spec), dir, "");
  const size_t at = spec.find('@');
  if (at == std::string::npos || at < gt) usage("a resumed run is A>B@K: " + spec);
  const std::string k = spec.substr(at + 1);
  return run_part(a, parse_part(spec.substr(0, gt)), dir, " --stop-after " + k) &&
         run_part(a, parse_part(spec.substr(gt + 1, at - gt - 1)), dir, " --resume");
}

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

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

double rel_diff(double a, double b) {
  const double scale = std::max(std::fabs(a), std::fabs(b));
  return scale == 0 ? 0 : std::fabs(a - b) / scale;
}

// The training losses of run `name` against run `other`'s, step by step; returns the failures.
int compare(const Args& a, const std::string& name, const std::map<int64_t, nlohmann::json>& got,
            const std::string& other, const std::map<int64_t, nlohmann::json>& ref) {
  int failures = 0;
  double max_loss = 0, max_gnorm = 0, max_z = 0;
  int bitwise = 0;
  for (int64_t s = 1; s <= a.steps; ++s) {
    const auto x = got.find(s), y = ref.find(s);
    if (x == got.end() || y == ref.end()) {
      std::printf("FAIL: %s: step %lld missing\n", name.c_str(), static_cast<long long>(s));
      ++failures;
      continue;
    }
    const double l0 = x->second["loss"].get<double>(), l1 = y->second["loss"].get<double>();
    const double dl = rel_diff(l0, l1);
    const double dg =
        rel_diff(x->second["grad_norm"].get<double>(), y->second["grad_norm"].get<double>());
    max_loss = std::max(max_loss, dl);
    max_gnorm = std::max(max_gnorm, dg);
    max_z = std::max(
        max_z, rel_diff(x->second["z_loss"].get<double>(), y->second["z_loss"].get<double>()));
    bitwise += l0 == l1;
    if (dl > a.rel || x->second["tokens"] != y->second["tokens"]) {
      std::printf("FAIL: %s vs %s step %lld: loss %.9f vs %.9f (rel %.2e), tokens %s vs %s\n",
                  name.c_str(), other.c_str(), static_cast<long long>(s), l0, l1, dl,
                  x->second["tokens"].dump().c_str(), y->second["tokens"].dump().c_str());
      ++failures;
    }
  }
  std::printf(
      "%s vs %s, %d steps of %d micro-batches: max relative difference loss %.3e (bound %.1e), "
      "z_loss %.3e, grad_norm %.3e; %d of %d losses bitwise equal\n",
      name.c_str(), other.c_str(), a.steps, a.micro, max_loss, a.rel, max_z, max_gnorm, bitwise,
      a.steps);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  fs::create_directories(a.work);
  const std::string ref_dir = a.work + "/ref";
  if (!run_spec(a, a.ref, ref_dir)) {
    std::printf("FAIL: the reference run %s failed\n", a.ref.c_str());
    return 1;
  }
  const auto ref = read_metrics(ref_dir + "/metrics.jsonl");
  int failures = 0;
  if (ref.size() != static_cast<size_t>(a.steps)) {
    std::printf("FAIL: the reference wrote %zu records for %d steps\n", ref.size(), a.steps);
    ++failures;
  }
  if (a.expect_clip > 0) {
    int clipped = 0;
    for (const auto& [s, r] : ref) clipped += r["grad_norm"].get<double>() > a.expect_clip;
    std::printf("the reference clipped %d of %zu steps (gradient norm > %g)\n", clipped, ref.size(),
                a.expect_clip);
    if (2 * clipped < static_cast<int>(ref.size())) {
      std::printf("FAIL: clipping is not active on half of the steps\n");
      ++failures;
    }
  }
  // Every run against every earlier one (the reference first).
  std::vector<std::pair<std::string, std::map<int64_t, nlohmann::json>>> runs = {{a.ref, ref}};
  std::map<std::string, std::string> dirs = {{a.ref, ref_dir}};
  for (size_t c = 0; c < a.cmps.size(); ++c) {
    const std::string& spec = a.cmps[c];
    const std::string dir = a.work + "/cmp" + std::to_string(c);
    if (!run_spec(a, spec, dir)) {
      std::printf("FAIL: run %s failed\n", spec.c_str());
      ++failures;
      continue;
    }
    const auto got = read_metrics(dir + "/metrics.jsonl");
    for (const auto& [other, want] : runs) failures += compare(a, spec, got, other, want);
    runs.emplace_back(spec, got);
    dirs[spec] = dir;
  }
  for (const std::string& pair : a.identical) {
    const size_t eq = pair.find('=');
    if (eq == std::string::npos) usage("--identical A=B: " + pair);
    const std::string x = pair.substr(0, eq), y = pair.substr(eq + 1);
    if (!dirs.contains(x) || !dirs.contains(y)) usage("--identical names a run not given: " + pair);
    const std::string step = "/checkpoints/step-" + std::to_string(a.steps) + "/";
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string fx = read_file(dirs[x] + step + file),
                        fy = read_file(dirs[y] + step + file);
      const bool same = !fx.empty() && fx == fy;
      std::printf("%s: %s (%zu bytes) and %s (%zu bytes) %s\n", file, x.c_str(), fx.size(),
                  y.c_str(), fy.size(), same ? "are byte for byte the same" : "DIFFER");
      if (!same) ++failures;
    }
  }
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
