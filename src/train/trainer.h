// The trainer: configuration, data, the step loop (micro-batches + gradient accumulation, AdamW on
// fp32 master weights, LR schedule, clipping, z-loss, non-finite guard), metrics, evaluation and
// crash-safe checkpoints with bit-exact resume.
//
// Run directory layout:
//   <run>/config.json          the effective training configuration (written at start)
//   <run>/metrics.jsonl        one record per step ({"step", "loss", ...}) and per eval
//   <run>/checkpoints/step-N/  config.json + model.safetensors (HF format, F32: loadable by
//                              transformers), optimizer.safetensors (Adam m and v), trainer.json
//                              (step, counters, data position), COMPLETE (written last)
// Resume (--resume) continues from the latest complete checkpoint. The data stream is a pure
// function of (data seed, step), the kernels are deterministic for a fixed thread count, and the
// master weights and moments are saved in fp32, so on CPU the continued run's losses equal an
// uninterrupted run's bit for bit.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "gdn/core/arena.h"
#include "gdn/core/profile.h"
#include "model/config.h"
#include "model/weights.h"
#include "train/checkpoint_dir.h"
#include "train/config_tree.h"
#include "train/data_parallel.h"
#include "train/metrics.h"
#include "train/run_config.h"
#include "train/schedule.h"
#include "train/step_stats.h"

namespace gdn::train {

class DataSource;

// The defaults: `gdntrain train` with no arguments trains the tiny Qwen3.5 on MQAR.
nlohmann::json default_train_config();

struct TrainResult {
  int64_t steps_done = 0;      // the last completed step (1-based count)
  double final_loss = 0;       // training loss of the last step
  double eval_loss = 0;        // last evaluation
  double eval_accuracy = -1;   // MQAR recall accuracy of the last evaluation (-1: not MQAR)
  int64_t skipped_steps = 0;   // non-finite steps skipped
  std::vector<double> losses;  // training loss per step run in this process
  // --profile-step: the profiled step's ranges (name, calls, ms) and its wall time.
  std::vector<Profiler::Row> profile;
  double profile_step_ms = 0;
  // cuda: how often the host drained the device's queue (device_drains()) between the start of
  // this process's third step and the start of its last one; -1 when not measured (cpu, or fewer
  // than four steps). The step loop issues no synchronisation, so this is 0.
  int64_t steady_drains = -1;
};

struct TrainOptions {
  bool resume = false;
  bool quiet = false;        // no console progress lines (tests)
  int64_t stop_after = 0;    // > 0: stop after this many steps of this process (the schedule still
                             // runs to train.steps), as a preempted job would; a checkpoint is
                             // written at the stop
  int64_t profile_step = 0;  // > 0: time this step (1-based) op by op: a table in the log and
                             // RUN_DIR/profile_step<N>.json
  // Called with each step's metrics record (the metrics.jsonl line, written first) on the rank
  // that writes RUN_DIR; the Python module's per-step callback (python/src/module.cpp).
  std::function<void(const nlohmann::json&)> on_step;
};

// Where a training step lives. Construction is the start: the configuration checked, the backend,
// the data source, the model, the run directory (fresh, or resumed from its latest checkpoint) and
// the optimizer (optimizer.h: host Adam on cpu/ref, device Adam on cuda). step() runs one optimizer
// step: the micro-batches' forward and backward, the update, and the host side of a step (skip
// accounting, metrics, progress line, evaluation, checkpoint), which on the device is that of the
// previous step (step_stats.h). run() steps until train.steps or --stop-after.
//
// Under a launcher with world size > 1 (data_parallel.h, docs/DISTRIBUTED.md) every rank runs
// this loop on its own slice of each step's micro-batches, and between the backward and the update
// GradSync sums the gradients (dist.shard = replicate) or the sharded optimizer reduce-scatters
// them (optimizer: ZeRO-2, optimizer.h); rank 0 alone prints progress and writes RUN_DIR
// (config.json, metrics.jsonl, checkpoints, profiles), the others wait for it where they read
// RUN_DIR.
class Trainer {
 public:
  Trainer(const ConfigTree& cfg, const TrainOptions& opt);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainResult run();
  // Runs the next step; returns true when the run stops after it (--stop-after).
  bool step();
  struct Evaluation {
    double loss = 0, accuracy = -1;  // accuracy: MQAR recall (-1: not MQAR)
  };
  // The current model on the held-out batches (eval.batches of them).
  Evaluation evaluate();
  // Writes the checkpoint of the state after `steps_done` steps (the last finished step's).
  void checkpoint(int64_t steps_done);

 private:
  using Clock = std::chrono::steady_clock;
  struct Settings {  // from the (validated) configuration
    std::string run_dir, data_kind;
    uint64_t data_seed = 0;
    int64_t steps = 0, accum = 1, micro_tokens = 0, log_every = 1;
    int64_t eval_every = 0, eval_batches = 0, ckpt_every = 0;
    bool ckpt_at_end = true, fail_on_nonfinite = false;
    double z_loss = 0;
    Backend backend = Backend::Cpu;
    bool on_device = false;  // cuda: the optimizer state and the step's statistics on the device
    bool sharded = false;    // dist.shard = optimizer at world size > 1 (ZeRO-2)
  };
  void init_weights(OptimizerState& state, bool device_init);
  void init_model();
  TrainerState open_run_dir(OptimizerState& state);
  bool writes_run_dir() const { return dist_.rank() == 0; }
  void log_start(double t_params, double t_model) const;
  PendingStep forward_backward(int64_t step);
  bool finish_pending();
  bool finish(PendingStep& q);
  void account_skip(const PendingStep& q);
  void log_first_step() const;
  void log_progress(const PendingStep& q, nlohmann::json& rec, Clock::time_point now,
                    bool evaluated);
  void log_final() const;
  void count_drains(int64_t step);
  void begin_profile();
  void end_profile(int64_t step, int64_t tokens);
  double since_launch() const;
  bool evals_at(int64_t step) const;
  bool logs_at(int64_t step) const;
  bool stops_at(int64_t step) const;
  bool checkpoints_at(int64_t step) const;

  const ConfigTree cfg_;
  TrainOptions opts_;  // quiet on every rank but 0
  Settings s_;
  DistContext dist_;  // world size 1 without a launcher: no communicator
  std::unique_ptr<GradSync> sync_;
  Clock::time_point t_launch_;
  double before_run_ = 0;  // seconds from the process start to the trainer's
  model::Qwen35Config mcfg_;
  std::vector<model::ParamSpec> specs_;
  std::vector<model::RawTensor> untouched_;  // carried into every checkpoint (checkpointing.h)
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<model::Qwen35Model> model_;
  Schedule sched_;
  std::optional<CheckpointDir> cd_;
  std::unique_ptr<Optimizer> opt_;
  Arena opt_ws_;  // cuda: the update's op workspace (the constructor)
  std::optional<MetricsWriter> metrics_;
  std::unique_ptr<StepStatsReader> stats_;
  int64_t start_step_ = 0, next_step_ = 0;
  TrainResult res_;
  double tokens_total_ = 0;                      // tokens trained on, the resumed ones included
  double window_tokens_ = 0, window_flops_ = 0;  // since the last progress line
  Clock::time_point t0_, window_t0_;
  std::optional<PendingStep> pending_;  // device: issued, its host side still to do
  bool stopped_ = false;
  uint64_t drains0_ = 0;
  std::unique_ptr<Profiler> prof_;  // --profile-step, while that step runs
  Clock::time_point prof_t0_;
};

// Trainer(cfg, opt).run().
TrainResult run_training(const ConfigTree& cfg, const TrainOptions& opt);

// `gdntrain plot RUN_DIR`: writes RUN_DIR/loss.svg (training loss, eval loss and accuracy).
std::string plot_run(const std::string& run_dir);

}  // namespace gdn::train
