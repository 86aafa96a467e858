// The trainer end to end on CPU: bit-exact resume (also after kill -9 at random points, including
// during checkpoint writes), gradient-accumulation normalisation, gradients in activation memory,
// the non-finite guard, indexed datasets, configuration errors, and the checkpoint's HF layout.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "gdn/core/env.h"
#include "gdn/core/safetensors.h"
#include "model/weights.h"
#include "train/checkpoint_dir.h"
#include "train/indexed_dataset.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / fmt::format("gdn_tr_{}_{}", ::getpid(), tag);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// A small, fast configuration: the tiny model, 4 MQAR examples of 32 tokens per micro-batch.
ConfigTree small_config(const fs::path& run, int64_t steps) {
  ConfigTree c(default_train_config());
  c.set(fmt::format("run.dir=\"{}\"", run.string()));
  c.set(fmt::format("train.steps={}", steps));
  c.set("train.micro_batch_tokens=128");
  c.set("data.mqar.seq_len=32");
  c.set("data.mqar.num_pairs=4");
  c.set("optim.warmup_steps=2");
  c.set("eval.every=0");
  c.set("checkpoint.every=2");
  c.set("checkpoint.keep=2");
  return c;
}

std::vector<double> metric_losses(const fs::path& run) {
  std::ifstream in(run / "metrics.jsonl");
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

// --profile-step: the chosen step's ranges cover the model's ops and the optimizer, their sum
// stays within the step's wall time, and the table is written to the run directory.
void check_profile(const TrainResult& r, const fs::path& run, int64_t step) {
  ASSERT_FALSE(r.profile.empty());
  std::map<std::string, int64_t> calls;
  double sum = 0;
  for (const auto& row : r.profile) {
    calls[row.name] = row.calls;
    EXPECT_GE(row.ms, 0.0) << row.name;
    sum += row.ms;
  }
  for (const char* name :
       {"embedding.fwd", "rmsnorm.fwd", "gdr.fwd", "gdr.bwd", "attn.core.fwd", "attn.core.bwd",
        "lm_head_loss", "swiglu.bwd", "optimizer", "grad_norm", "embedding.bwd"})
    EXPECT_TRUE(calls.count(name)) << name << " missing from the profile";
  EXPECT_GT(r.profile_step_ms, 0.0);
  EXPECT_LE(sum, r.profile_step_ms * 1.001);
  std::ifstream in(run / fmt::format("profile_step{}.json", step));
  ASSERT_TRUE(in.good());
  nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["step"].get<int64_t>(), step);
  EXPECT_EQ(j["ranges"].size(), r.profile.size());
}

TEST(Trainer, ProfileStepTimesEveryOpOfThatStep) {
  fs::path a = temp_dir("profile");
  TrainOptions o;
  o.quiet = true;
  o.profile_step = 2;
  ConfigTree cfg = small_config(a, 3);
  cfg.set("checkpoint.every=0");
  TrainResult r = run_training(cfg, o);
  check_profile(r, a, 2);
  // The tiny model has 3 GDN layers and 1 attention layer; one micro-batch per step.
  for (const auto& row : r.profile) {
    if (row.name == "gdr.fwd") {
      EXPECT_EQ(row.calls, 3);
    }
    if (row.name == "attn.core.bwd") {
      EXPECT_EQ(row.calls, 1);
    }
  }
  o.profile_step = 4;
  EXPECT_THROW(run_training(small_config(temp_dir("profile_bad"), 3), o), Error);
  fs::remove_all(a);
}

TEST(Trainer, ResumeIsBitExact) {
  fs::path a = temp_dir("full"), b = temp_dir("resumed");
  TrainOptions quiet;
  quiet.quiet = true;
  TrainResult full = run_training(small_config(a, 7), quiet);
  ASSERT_EQ(full.losses.size(), 7u);
  EXPECT_LT(full.losses.back(), full.losses.front());
  TrainOptions stop = quiet;
  stop.stop_after = 3;  // preempted after step 3 (not a checkpoint multiple)
  TrainResult first = run_training(small_config(b, 7), stop);
  ASSERT_EQ(first.losses.size(), 3u);
  TrainOptions resume = quiet;
  resume.resume = true;
  TrainResult rest = run_training(small_config(b, 7), resume);
  ASSERT_EQ(rest.losses.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(first.losses[i], full.losses[i]) << "step " << i + 1;
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(rest.losses[i], full.losses[i + 3]) << "step " << i + 4 << " after resume";
  // metrics.jsonl of the resumed run holds each step once, with the same losses.
  EXPECT_EQ(metric_losses(b), metric_losses(a));
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Trainer, KillDashNineAtRandomPointsThenResumeMatchesAnUninterruptedRun) {
  fs::path a = temp_dir("ref"), b = temp_dir("killed");
  TrainOptions quiet;
  quiet.quiet = true;
  auto cfg_a = small_config(a, 10);
  cfg_a.set("checkpoint.every=1");
  TrainResult full = run_training(cfg_a, quiet);
  auto cfg_b = small_config(b, 10);
  cfg_b.set("checkpoint.every=1");  // a checkpoint write every step: kills often land inside one
  std::mt19937 rng(12345);
  int kills = 0;
  for (int attempt = 0; attempt < 6; ++attempt) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      TrainOptions o;
      o.quiet = true;
      o.resume =
          fs::exists(b / "checkpoints") && CheckpointDir((b / "checkpoints").string(), 2).latest();
      try {
        run_training(cfg_b, o);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(30, 250)(rng)));
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ++kills;
    } else {
      ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child failed";
    }
  }
  // Whatever the kills left, the latest complete checkpoint loads and training finishes exactly
  // as the uninterrupted run did.
  TrainOptions o = quiet;
  o.resume = CheckpointDir((b / "checkpoints").string(), 2).latest().has_value();
  run_training(cfg_b, o);
  EXPECT_EQ(metric_losses(b), metric_losses(a)) << kills << " kills";
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Trainer, GradientAccumulationNormalisesOverTheGlobalBatch) {
  fs::path a = temp_dir("acc1"), b = temp_dir("acc2");
  TrainOptions quiet;
  quiet.quiet = true;
  auto one = small_config(a, 3);
  one.set("train.micro_batch_tokens=256");  // 8 examples in one micro-batch
  auto two = small_config(b, 3);
  two.set("train.micro_batch_tokens=128");  // the same 8 examples in two micro-batches
  two.set("train.grad_accum=2");
  TrainResult r1 = run_training(one, quiet), r2 = run_training(two, quiet);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(r2.losses[i], r1.losses[i], 1e-5 * std::abs(r1.losses[i])) << "step " << i + 1;
  fs::remove_all(a);
  fs::remove_all(b);
}

// memory.grads_in_activations (one micro-batch a step: the gradients in activation memory the
// backward has consumed) is scheduling-only: the losses of every step, evaluations between the
// steps included (a forward-only pass overwrites that memory after the optimizer has used it),
// are bitwise those with the gradients in an arena of their own.
TEST(Trainer, GradientsInActivationMemoryLeaveTheLossesBitwiseUnchanged) {
  TrainOptions quiet;
  quiet.quiet = true;
  std::vector<TrainResult> runs;
  for (const char* knob : {"true", "false"}) {
    fs::path d = temp_dir(fmt::format("gia{}", knob));
    auto c = small_config(d, 4);
    c.set("eval.every=2");
    c.set(fmt::format("memory.grads_in_activations={}", knob));
    runs.push_back(run_training(c, quiet));
    fs::remove_all(d);
  }
  ASSERT_EQ(runs[0].losses.size(), 4u);
  ASSERT_EQ(runs[1].losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(runs[0].losses[i], runs[1].losses[i]) << "step " << i + 1;
  EXPECT_EQ(runs[0].eval_loss, runs[1].eval_loss);
  EXPECT_LT(runs[0].losses.back(), runs[0].losses.front());
}

TEST(Trainer, NonFiniteStepsAreSkippedOrStopTheRunNamingTheTensor) {
  fs::path a = temp_dir("nan");
  TrainOptions quiet;
  quiet.quiet = true;
  auto cfg = small_config(a, 4);
  cfg.set("optim.lr=1e30");  // the first update sends the weights to inf/NaN
  cfg.set("optim.warmup_steps=0");
  cfg.set("optim.clip=0.0");
  cfg.set("optim.weight_decay=0.0");
  TrainResult r = run_training(cfg, quiet);
  EXPECT_GE(r.skipped_steps, 1);
  cfg.set("train.fail_on_nonfinite=true");
  cfg.set(fmt::format("run.dir=\"{}\"", (a / "strict").string()));
  try {
    run_training(cfg, quiet);
    FAIL() << "a non-finite step did not stop the run";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("train.fail_on_nonfinite: step 2"), std::string::npos) << m;
    // The first non-finite value is named with its layer and tensor.
    EXPECT_NE(m.find("first non-finite: layer 0 (GDN, forward): gated_delta_rule: tensor 'g' has a "
                     "non-finite value"),
              std::string::npos)
        << m;
  }
  fs::remove_all(a);
}

TEST(Trainer, TrainsOnAnIndexedDatasetAndWritesAnHfCheckpoint) {
  fs::path a = temp_dir("idx");
  {
    IndexedDatasetWriter w((a / "data").string(), TokenDType::U16);
    for (int d = 0; d < 40; ++d) {
      std::vector<int32_t> doc;
      for (int t = 0; t < 10 + (d * 7) % 50; ++t) doc.push_back(2 + (d * 31 + t * 7) % 200);
      doc.push_back(1);
      w.add_document(doc);
    }
    w.finish();
  }
  auto cfg = small_config(a / "run", 4);
  cfg.set("data.kind=\"indexed\"");
  cfg.set(fmt::format("data.path=\"{}\"", (a / "data").string()));
  cfg.set("data.eval_fraction=0.1");
  cfg.set("eval.every=2");
  TrainOptions quiet;
  quiet.quiet = true;
  TrainResult r = run_training(cfg, quiet);
  EXPECT_EQ(r.steps_done, 4);
  EXPECT_GT(r.eval_loss, 0.0);
  EXPECT_EQ(r.eval_accuracy, -1.0);
  auto latest = CheckpointDir((a / "run" / "checkpoints").string(), 2).latest();
  ASSERT_TRUE(latest.has_value());
  model::HfCheckpoint ck = model::load_hf_checkpoint(*latest);  // config.json + model.safetensors
  EXPECT_EQ(ck.config.vocab_size, 258);
  EXPECT_TRUE(fs::exists(fs::path(*latest) / "optimizer.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(*latest) / "COMPLETE"));
  EXPECT_TRUE(fs::exists(a / "run" / "config.json"));
  EXPECT_EQ(fs::path(plot_run((a / "run").string())).filename(), "loss.svg");
  fs::remove_all(a);
}

TEST(Trainer, ConfigurationErrorsAreClear) {
  fs::path a = temp_dir("cfg");
  TrainOptions quiet;
  quiet.quiet = true;
  auto cfg = small_config(a, 2);
  cfg.set("data.kind=\"parquet\"");
  try {
    run_training(cfg, quiet);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.kind 'parquet' is not a data source"),
              std::string::npos);
  }
  // A second fresh run into a directory that holds checkpoints is refused (nothing is deleted).
  run_training(small_config(a / "once", 2), quiet);
  try {
    run_training(small_config(a / "once", 2), quiet);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already holds checkpoints of an earlier run"),
              std::string::npos);
  }
  auto cfg2 = small_config(a / "empty", 2);
  TrainOptions resume = quiet;
  resume.resume = true;
  EXPECT_THROW(run_training(cfg2, resume), Error);  // nothing to resume from
  fs::remove_all(a);
}

// The Trainer driven by hand: step() by step(), then evaluate() and checkpoint(), is run_training:
// the same evaluation after the same steps, and a checkpoint() taken between steps resumes into
// the uninterrupted run's losses bit for bit.
TEST(Trainer, StepEvaluateCheckpointByHandMatchRunTraining) {
  fs::path a = temp_dir("api_run"), b = temp_dir("api_hand");
  TrainOptions quiet;
  quiet.quiet = true;
  ConfigTree cfg_a = small_config(a, 6);
  cfg_a.set("eval.every=3");
  cfg_a.set("eval.batches=2");
  const TrainResult full = run_training(cfg_a, quiet);
  ConfigTree cfg_b = small_config(b, 6);
  cfg_b.set("eval.batches=2");  // eval.every 0: evaluate() by hand
  cfg_b.set("checkpoint.every=0");
  cfg_b.set("checkpoint.at_end=false");
  {
    Trainer t(cfg_b, quiet);
    for (int i = 0; i < 3; ++i) EXPECT_FALSE(t.step());
    const Trainer::Evaluation e = t.evaluate();
    EXPECT_GT(e.accuracy, -1.0);  // MQAR: a recall accuracy
    t.checkpoint(3);
    EXPECT_FALSE(fs::exists(b / "checkpoints" / "step-6"));
    ASSERT_TRUE(fs::exists(b / "checkpoints" / "step-3"));
    // run_training evaluated after step 3 too (eval.every 3): the same numbers.
    std::ifstream in(a / "metrics.jsonl");
    std::string line;
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(std::getline(in, line));
    const nlohmann::json rec = nlohmann::json::parse(line);
    EXPECT_EQ(rec["eval_loss"].get<double>(), e.loss);
    EXPECT_EQ(rec["eval_accuracy"].get<double>(), e.accuracy);
  }
  TrainOptions resume = quiet;
  resume.resume = true;
  const TrainResult rest = run_training(cfg_b, resume);
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(rest.losses[i], full.losses[i + 3]) << "step " << i + 4 << " after resume";
  EXPECT_EQ(rest.eval_loss, 0.0);  // eval.every 0 in cfg_b
  fs::remove_all(a);
  fs::remove_all(b);
}

// step() says when the run stops (--stop-after), and run() on a stopped trainer does no more.
TEST(Trainer, StepReportsTheStop) {
  fs::path a = temp_dir("api_stop");
  TrainOptions o;
  o.quiet = true;
  o.stop_after = 2;
  Trainer t(small_config(a, 5), o);
  EXPECT_FALSE(t.step());
  EXPECT_TRUE(t.step());
  const TrainResult r = t.run();
  EXPECT_EQ(r.steps_done, 2);
  EXPECT_EQ(r.losses.size(), 2u);
  EXPECT_TRUE(fs::exists(a / "checkpoints" / "step-2"));  // written at the stop
  fs::remove_all(a);
}

// Counts on the command line must be positive: `--steps 0` once meant "the configured default"
// (600 steps) without a word. CLI11 now refuses it, naming the option, and no run starts.
TEST(Trainer, CliRefusesNonPositiveCounts) {
  fs::path a = temp_dir("cli_counts");
  for (const char* opt : {"--steps 0", "--stop-after 0", "--steps -3", "--profile-step 0"}) {
    const fs::path err = a / "stderr";
    const std::string cmd = std::string(GDN_GDNTRAIN_BIN) + " train --device cpu " + opt +
                            " --run-dir " + (a / "run").string() + " > /dev/null 2> " +
                            err.string();
    const int st = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(st)) << opt;
    EXPECT_NE(WEXITSTATUS(st), 0) << opt;
    std::ifstream in(err);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string name = std::string(opt).substr(0, std::string(opt).find(' '));
    EXPECT_NE(text.find(name), std::string::npos) << opt << ": " << text;
    EXPECT_FALSE(fs::exists(a / "run" / "metrics.jsonl")) << opt;
  }
  fs::remove_all(a);
}

// train.device = ref (fp64 model, the check backend) trains: its F64 gradients reach the fp32
// update through an F32 copy, and its losses follow the cpu backend's (fp32) to fp32 precision.
TEST(Trainer, TrainsOnTheRefBackendLikeTheCpuOne) {
  TrainOptions quiet;
  quiet.quiet = true;
  std::vector<TrainResult> runs;
  for (const char* dev : {"ref", "cpu"}) {
    fs::path d = temp_dir(fmt::format("dev_{}", dev));
    auto c = small_config(d, 4);
    c.set(fmt::format("train.device=\"{}\"", dev));
    c.set("checkpoint.at_end=false");
    runs.push_back(run_training(c, quiet));
    fs::remove_all(d);
  }
  ASSERT_EQ(runs[0].losses.size(), 4u);
  ASSERT_EQ(runs[1].losses.size(), 4u);
  EXPECT_EQ(runs[0].skipped_steps, 0);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(runs[0].losses[i], runs[1].losses[i], 1e-4 * runs[1].losses[i]) << "step " << i + 1;
}

}  // namespace
}  // namespace gdn::train
