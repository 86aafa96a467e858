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

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gdn/core/profile.h"
#include "train/config_tree.h"

namespace gdn::train {

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
};

TrainResult run_training(const ConfigTree& cfg, const TrainOptions& opt);

// `gdntrain plot RUN_DIR`: writes RUN_DIR/loss.svg (training loss, eval loss and accuracy).
std::string plot_run(const std::string& run_dir);

}  // namespace gdn::train
