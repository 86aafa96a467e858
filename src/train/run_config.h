// The training configuration as a whole: validation of every key before any work (ARCHITECTURE
// §6), the comparison a resume makes between the configuration a checkpoint was written with and
// the new one, and the checkpoint's trainer state (trainer.json), parsed and checked.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/qwen35.h"
#include "train/config_tree.h"
#include "train/data_source.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace gdn::train {

// Each checkpoint holds the training configuration it was written with under this name.
inline constexpr const char* kTrainConfigFile = "train_config.json";

// Checks every key of the effective configuration (types, ranges, choices, and the relations
// between keys such as optim.min_lr <= optim.lr). Throws one gdn::Error that lists every bad key
// with its value and what is allowed.
void validate_train_config(const ConfigTree& cfg);

struct ConfigChange {
  std::string key, saved, now;  // values as JSON text; "(absent)" where a side lacks the key
};

// Every leaf key whose value differs between `saved` and `now`.
std::vector<ConfigChange> config_changes(const nlohmann::json& saved, const nlohmann::json& now);

// The model's policy from the (validated) run config: train.recompute, the kernels.fused_* routes
// and the memory.* keys; the gradients go into activation memory only with one micro-batch per
// step (grad_accum 1).
model::ModelOptions model_options(const ConfigTree& cfg, int64_t grad_accum);

// Keys a resume refuses to change unless resume.allow_changes is true: the model (model.*), the
// data (data.*), every seed, the micro-batch layout (train.micro_batch_tokens, train.grad_accum),
// which decides the examples each step sees, and the kernel routes (kernels.*), which change the
// numerics.
bool resume_blocks_change(const std::string& key);

// The resume check: with changed blocking keys and !allow, throws an error listing them (saved
// and new values); otherwise returns every change (the caller logs them).
std::vector<ConfigChange> check_resume_config(const nlohmann::json& saved,
                                              const nlohmann::json& now, bool allow,
                                              const std::string& label);

// trainer.json of a checkpoint.
struct TrainerState {
  int64_t step = 0;
  int64_t skipped_steps = 0;
  double tokens_seen = 0;
  // Ranks of the data-parallel run that wrote it (absent in older checkpoints: 1). The step's
  // batch is grad_accum x world_size micro-batches, so a resume at another world size is refused
  // like a changed train.grad_accum (unless resume.allow_changes).
  int64_t world_size = 1;
};
// Parses and checks trainer.json's text; `label` names the file in errors.
TrainerState parse_trainer_state(const std::string& text, const std::string& label);

// The pieces of the configuration the Trainer is built from (the keys validated above).
// train.device: auto (cuda when a device is present), cpu, cuda or ref; throws naming the key.
Backend choose_backend(const std::string& device);
// data.kind mqar or indexed, read as this rank's `shard` of every step's micro-batches.
std::unique_ptr<DataSource> make_data(const ConfigTree& cfg, const model::Qwen35Config& mcfg,
                                      int64_t micro_tokens, int64_t accum, DataShard shard);
Schedule schedule_from(const ConfigTree& cfg, int64_t steps);  // optim.lr, min_lr, warmup, decay
OptimizerConfig optimizer_config_from(const ConfigTree& cfg);  // optim.beta*, eps, decay, clip

}  // namespace gdn::train
