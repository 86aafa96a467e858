// Issue 21, "nothing lost, nothing silent": each failure a user hit by trying it is a clear error
// with a non-zero exit, and nothing on disk is lost. A full disk (metrics and checkpoints), NaN
// weights, invalid configuration keys, a rejected start's config.json, resume with another model
// shape or changed keys, and the command line's own errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/tensor.h"
#include "model/config.h"
#include "model/weights.h"
#include "train/checkpoint_dir.h"
#include "train/config_tree.h"
#include "train/metrics.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / fmt::format("gdn_rob_{}_{}", ::getpid(), tag);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ConfigTree small_config(const fs::path& run, int64_t steps) {
  ConfigTree c(default_train_config());
  c.set(fmt::format("run.dir=\"{}\"", run.string()));
  c.set(fmt::format("train.steps={}", steps));
  c.set("train.micro_batch_tokens=128");
  c.set("optim.warmup_steps=2");
  c.set("eval.every=0");
  c.set("checkpoint.every=2");
  return c;
}

TrainOptions quiet() {
  TrainOptions o;
  o.quiet = true;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what() + std::string("\nhint: ") + e.hint();
  }
  return "(no error)";
}

struct Shell {
  int status = -1;
  std::string err;
};

// Runs a shell command line with stderr captured.
Shell shell(const std::string& cmd, const fs::path& dir) {
  const fs::path err = dir / "stderr.txt";
  const std::string full = "bash -c '" + cmd + "' > /dev/null 2> '" + err.string() + "'";
  const int st = std::system(full.c_str());
  Shell r;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.err = read_file(err);
  return r;
}

const std::string kBin = GDN_GDNTRAIN_BIN;
const std::string kSmall =
    " --device cpu --set train.micro_batch_tokens=128 --set eval.every=0 --set log.every=1 "
    "--set optim.warmup_steps=2";

// --- full disk ---------------------------------------------------------------------------------

// /dev/full fails every write with ENOSPC; stdio reports it at the flush, which was unchecked.
TEST(Robustness, MetricsWriteToAFullDiskIsAnError) {
  MetricsWriter w("/dev/full");
  const std::string e = error_of([&] { w.write({{"step", 1}, {"loss", 2.5}}); });
  EXPECT_NE(e.find("writing metrics to '/dev/full' failed: No space left on device"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("--resume"), std::string::npos) << e;  // the hint says how to continue
}

// The whole CLI under a file-size limit (bash `ulimit -f`, SIGXFSZ ignored: every write past the
// limit fails with EFBIG, as on a full disk). The metrics stream stops with an error and a
// non-zero exit, and the checkpoint written before stays loadable: a resume without the limit
// finishes the run.
TEST(Robustness, FullDiskStopsTheRunAndTheLastCheckpointStaysLoadable) {
  fs::path a = temp_dir("full");
  const std::string run = (a / "run").string();
  Shell first = shell(kBin + " train" + kSmall + " --steps 2 --run-dir " + run, a);
  ASSERT_EQ(first.status, 0) << first.err;
  ASSERT_TRUE(fs::exists(a / "run/checkpoints/step-2/COMPLETE"));
  const std::string limited = "trap \"\" XFSZ; ulimit -f 8; exec " + kBin + " train" + kSmall +
                              " --set checkpoint.every=0 --steps 300 --resume --run-dir " + run;
  Shell cut = shell(limited, a);
  EXPECT_NE(cut.status, 0) << cut.err;
  EXPECT_NE(cut.err.find("error: writing metrics to"), std::string::npos) << cut.err;
  EXPECT_NE(cut.err.find("File too large"), std::string::npos) << cut.err;
  EXPECT_NE(cut.err.find("hint: "), std::string::npos) << cut.err;
  // The checkpoint is complete and loads; the resumed run continues from it to the end.
  model::HfCheckpoint ck = model::load_hf_checkpoint((a / "run/checkpoints/step-2").string());
  EXPECT_EQ(ck.config.hidden_size, 64);
  Shell rest = shell(kBin + " train" + kSmall + " --steps 6 --resume --run-dir " + run, a);
  EXPECT_EQ(rest.status, 0) << rest.err;
  EXPECT_TRUE(fs::exists(a / "run/checkpoints/step-6/COMPLETE"));
  fs::remove_all(a);
}

// A checkpoint that does not fit: the error names the step and the last complete checkpoint, and
// no partial directory is left behind.
TEST(Robustness, ACheckpointThatDoesNotFitIsAnErrorAndLeavesNoPartialDirectory) {
  fs::path a = temp_dir("ckfull");
  const std::string run = (a / "run").string();
  Shell r = shell("trap \"\" XFSZ; ulimit -f 16; exec " + kBin + " train" + kSmall +
                      " --steps 2 --run-dir " + run,
                  a);
  EXPECT_NE(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("writing checkpoint step 2 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("there is no complete checkpoint yet"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("hint: "), std::string::npos) << r.err;
  for (const auto& e : fs::directory_iterator(a / "run/checkpoints"))
    ADD_FAILURE() << "left behind: " << e.path();
  fs::remove_all(a);
}

// --- NaN weights -------------------------------------------------------------------------------

TEST(Robustness, NonFiniteWeightsAreRefusedNamingTheTensor) {
  fs::path a = temp_dir("nanw");
  const model::Qwen35Config c = model::tiny_config();
  model::ParamStore p(model::param_specs(c));
  model::init_params(p, c, 5);
  const std::string bad = "model.layers.2.mlp.up_proj.weight";
  Tensor t = p.tensor(bad);
  std::memset(t.data(), 0xFF, static_cast<size_t>(t.nbytes()));  // every float is a NaN
  model::SaveOptions so;
  so.dtype = DType::F32;
  model::save_hf_checkpoint(a.string(), c, p, so);
  const std::string e = error_of([&] { model::load_hf_checkpoint(a.string()); });
  EXPECT_NE(e.find("tensor '" + bad + "' holds a non-finite value"), std::string::npos) << e;
  EXPECT_NE(e.find("nan at [0, 0] (element 0;"), std::string::npos) << e;
  EXPECT_NE(e.find("8192 of its 8192 values are not finite"), std::string::npos) << e;
  // `gdntrain dump` on it (which printed `mean loss -nan` and exited 0) fails naming the tensor.
  Shell r = shell(kBin + " dump --model " + a.string() + " --docs " + GDN_TEST_DATA_DIR +
                      "/golden/r1_tied/docs.safetensors --out " + (a / "out.st").string(),
                  a);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find(bad), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(a / "out.st"));
  fs::remove_all(a);
}

// --- configuration -----------------------------------------------------------------------------

// Each bad key fails before any work, naming the key, and RUN_DIR/config.json (a previous run's)
// is left as it was.
TEST(Robustness, EveryBadConfigKeyIsRefusedBeforeAnyStepNamingTheKey) {
  fs::path a = temp_dir("badkeys");
  const std::string sentinel = "{\"an earlier run\": true}\n";
  struct Case {
    const char* set;
    const char* expect;
  };
  const Case cases[] = {
      {"optim.lr=-1e-3", "optim.lr = -0.001: must be a finite number > 0"},
      {"optim.min_lr=-1", "optim.min_lr = -1: must be a finite number >= 0"},
      {"optim.min_lr=0.1", "optim.min_lr = 0.1: must not exceed optim.lr = 0.003"},
      {"optim.beta1=1.0", "optim.beta1 = 1.0: must be in [0, 1)"},
      {"optim.beta2=-0.5", "optim.beta2 = -0.5: must be in [0, 1)"},
      {"optim.eps=0", "optim.eps = 0: must be a finite number > 0"},
      {"optim.weight_decay=-0.1", "optim.weight_decay = -0.1: must be a finite number >= 0"},
      {"optim.clip=-1", "optim.clip = -1: must be a finite number >= 0"},
      {"optim.warmup_steps=-5", "optim.warmup_steps = -5: must be a non-negative integer"},
      {"optim.decay=\"cosin\"", "optim.decay = \"cosin\": must be one of cosine, linear, wsd"},
      {"optim.wsd_decay_fraction=0", "optim.wsd_decay_fraction = 0: must be in (0, 1]"},
      {"train.z_loss=-1", "train.z_loss = -1: must be a finite number >= 0"},
      {"train.steps=0", "train.steps = 0: must be a positive integer"},
      {"train.grad_accum=0", "train.grad_accum = 0: must be a positive integer"},
      {"train.micro_batch_tokens=-1", "train.micro_batch_tokens = -1: must be in [1, 2^31)"},
      {"train.recompute=\"most\"", "train.recompute = \"most\": must be one of none"},
      {"train.device=\"tpu\"",
       "train.device 'tpu' is not a device: must be one of auto, cpu, cuda, ref"},
      {"data.eval_fraction=1.5", "data.eval_fraction = 1.5: must be in [0, 1)"},
      {"data.kind=\"indexed\"", "data.path = \"\": must be a non-empty string"},
      {"data.mqar.num_pairs=0", "data.mqar.num_pairs = 0: must be a positive integer"},
      {"data.mqar.seq_len=8", "data.mqar.*: mqar: seq_len 8 must be at least 4 * num_pairs"},
      {"checkpoint.keep=0", "checkpoint.keep = 0: must be a positive integer"},
      {"eval.every=-1", "eval.every = -1: must be a non-negative integer"},
      {"run.dir=\"\"", "run.dir = \"\": must be a non-empty string"},
  };
  for (const Case& k : cases) {
    const fs::path run = a / "run";
    fs::create_directories(run);
    { std::ofstream(run / "config.json") << sentinel; }
    ConfigTree cfg = small_config(run, 4);
    cfg.set(k.set);
    const std::string e = error_of([&] { run_training(cfg, quiet()); });
    EXPECT_NE(e.find("invalid training configuration"), std::string::npos) << k.set << ": " << e;
    EXPECT_NE(e.find(k.expect), std::string::npos) << k.set << ": " << e;
    EXPECT_EQ(read_file(run / "config.json"), sentinel) << k.set;
    EXPECT_FALSE(fs::exists(run / "metrics.jsonl")) << k.set;
    EXPECT_FALSE(fs::exists(run / "checkpoints")) << k.set;
  }
  // Several bad keys: one error lists them all.
  ConfigTree two = small_config(a / "two", 4);
  two.set("optim.lr=-1");
  two.set("checkpoint.keep=0");
  const std::string e = error_of([&] { run_training(two, quiet()); });
  EXPECT_NE(e.find("(2 problems)"), std::string::npos) << e;
  // The defaults and what the other tests set pass.
  EXPECT_NO_THROW(validate_train_config(ConfigTree(default_train_config())));
  fs::remove_all(a);
}

// A start refused for another reason (a fresh run into a directory holding checkpoints) leaves
// the earlier run's config.json alone.
TEST(Robustness, ARejectedStartLeavesConfigJsonUnchanged) {
  fs::path a = temp_dir("rejected");
  run_training(small_config(a, 2), quiet());
  const std::string before = read_file(a / "config.json");
  ConfigTree other = small_config(a, 2);
  other.set("optim.lr=0.001");
  const std::string e = error_of([&] { run_training(other, quiet()); });
  EXPECT_NE(e.find("already holds checkpoints of an earlier run"), std::string::npos) << e;
  EXPECT_EQ(read_file(a / "config.json"), before);
  // The checkpoint carries the training configuration it was written with.
  EXPECT_TRUE(fs::exists(a / "checkpoints/step-2" / kTrainConfigFile));
  fs::remove_all(a);
}

// --- resume ------------------------------------------------------------------------------------

TEST(Robustness, ResumeRefusesChangedRunKeysListingThemUnlessAllowed) {
  fs::path a = temp_dir("keys");
  run_training(small_config(a, 2), quiet());
  const std::string before = read_file(a / "config.json");
  TrainOptions resume = quiet();
  resume.resume = true;
  ConfigTree changed = small_config(a, 4);  // train.steps may change freely
  changed.set("data.seed=8");
  changed.set("model.seed=99");
  changed.set("optim.lr=0.002");  // not a run-defining key: logged, never refused
  const std::string e = error_of([&] { run_training(changed, resume); });
  EXPECT_NE(e.find("--resume: 2 keys that define the run changed"), std::string::npos) << e;
  EXPECT_NE(e.find("data.seed: 7 in the checkpoint, 8 now"), std::string::npos) << e;
  EXPECT_NE(e.find("model.seed: 1234 in the checkpoint, 99 now"), std::string::npos) << e;
  EXPECT_EQ(e.find("optim.lr:"), std::string::npos) << e;
  EXPECT_NE(e.find("resume.allow_changes=true"), std::string::npos) << e;
  EXPECT_EQ(read_file(a / "config.json"), before);
  // Said explicitly, the resume goes ahead.
  changed.set("resume.allow_changes=true");
  TrainResult r = run_training(changed, resume);
  EXPECT_EQ(r.steps_done, 4);
  EXPECT_EQ(r.losses.size(), 2u);
  // Unchanged keys (and a longer schedule) resume without the flag.
  ConfigTree same = small_config(a, 6);
  same.set("data.seed=8");
  same.set("model.seed=99");
  same.set("optim.lr=0.002");
  EXPECT_EQ(run_training(same, resume).steps_done, 6);
  fs::remove_all(a);
}

TEST(Robustness, ResumeWithAnotherModelShapeNamesTheTensorAndBothShapes) {
  fs::path a = temp_dir("shape");
  run_training(small_config(a / "run", 2), quiet());
  model::Qwen35Config wide = model::tiny_config();
  wide.intermediate_size = 256;
  model::save_config(wide, (a / "wide.json").string());
  TrainOptions resume = quiet();
  resume.resume = true;
  ConfigTree cfg = small_config(a / "run", 4);
  cfg.set(fmt::format("model.config=\"{}\"", (a / "wide.json").string()));
  std::string e = error_of([&] { run_training(cfg, resume); });
  EXPECT_NE(e.find("model.config: \"tiny\" in the checkpoint"), std::string::npos) << e;
  cfg.set("resume.allow_changes=true");
  e = error_of([&] { run_training(cfg, resume); });
  EXPECT_NE(e.find("--resume: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] in "
                   "checkpoint"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("but shape [256, 64] in the configured model"), std::string::npos) << e;
  fs::remove_all(a);
}

TEST(Robustness, TrainerStateIsChecked) {
  EXPECT_EQ(parse_trainer_state(R"({"step": 4, "skipped_steps": 1, "tokens_seen": 512})", "t")
                .skipped_steps,
            1);
  EXPECT_EQ(parse_trainer_state(R"({"step": 4})", "t").world_size, 1);  // older checkpoints
  EXPECT_EQ(parse_trainer_state(R"({"step": 4, "world_size": 8})", "t").world_size, 8);
  for (const char* bad :
       {"", "[]", R"({"step": "4"})", R"({"step": -1})", R"({"step": 2, "skipped_steps": 3})",
        R"({"step": 2, "tokens_seen": "x"})", R"({"step": 2, "skipped_steps": 1.5})",
        R"({"step": 2, "world_size": 0})", R"({"step": 2, "world_size": "2"})"}) {
    const std::string e = error_of([&] { parse_trainer_state(bad, "trainer.json"); });
    EXPECT_NE(e.find("trainer.json"), std::string::npos) << bad << ": " << e;
  }
}

// --- the command line --------------------------------------------------------------------------

TEST(Robustness, CliErrorsExitNonZeroWithAHintLine) {
  fs::path a = temp_dir("cli");
  struct Case {
    std::string args, expect;
  };
  const Case cases[] = {
      {"train --steps 0", "--steps: must be a positive integer, got '0'"},
      {"train --no-such-flag", "hint: run `gdntrain train --help`"},
      {"no-such-command", "hint: run `gdntrain --help`"},
      {"probe --op nosuchop", "probe --op 'nosuchop': no such op"},
      {"dump --model /nonexistent --docs x --out y", "/nonexistent"},
      {"train --device cpu --set optim.lr=-1e-3 --run-dir " + (a / "r").string(), "optim.lr"},
  };
  for (const Case& c : cases) {
    Shell r = shell(kBin + " " + c.args, a);
    EXPECT_NE(r.status, 0) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find("\nhint: "), std::string::npos) << c.args << ": " << r.err;
    EXPECT_EQ(r.err.find("<command>"), std::string::npos) << c.args << ": " << r.err;
    EXPECT_LT(r.err.size(), 2000u) << c.args << ": " << r.err;
  }
  // --help is not an error.
  EXPECT_EQ(shell(kBin + " train --help", a).status, 0);
  // probe --backend cuda: an error on a build or machine without CUDA, never a silent 0.
  Shell cuda = shell(kBin + " probe --backend cuda --op rmsnorm", a);
  if (!cuda_available()) {
    EXPECT_NE(cuda.status, 0) << cuda.err;
    EXPECT_NE(cuda.err.find("no CUDA device"), std::string::npos) << cuda.err;
  } else {
    EXPECT_EQ(cuda.status, 0) << cuda.err;
  }
  fs::remove_all(a);
}

}  // namespace
}  // namespace gdn::train
