// The trainer's checkpoints: writing one (model.safetensors, optimizer.safetensors, trainer.json
// and the training configuration, through CheckpointDir's crash-safe protocol), and the start of
// a run directory: a fresh run (which must not mix with an earlier one) or a resume from the
// latest complete checkpoint, checked against the configuration and the model.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "train/checkpoint_dir.h"
#include "train/config_tree.h"
#include "train/optimizer.h"
#include "train/run_config.h"

namespace gdn::train {

// trainer.json of a checkpoint after `st.step` steps; the data position is a pure function of
// (kind, seed, step).
nlohmann::json trainer_state_json(const TrainerState& st, const std::string& data_kind,
                                  uint64_t data_seed);

// Writes checkpoint `step` of `state` into `cd`. `untouched`: the tensors of the checkpoint the run
// started from that it does not train (a Qwen3.5 release's model.visual.* and mtp.*), written back
// byte for byte so that every checkpoint of the run is a whole model. A failed write stops the run
// with an error that names the last complete checkpoint.
void save_checkpoint(CheckpointDir& cd, int64_t step, const model::Qwen35Config& cfg,
                     const OptimizerState& state, const std::vector<model::RawTensor>& untouched,
                     const nlohmann::json& trainer_state, const nlohmann::json& train_config);

// The run directory at the start. With `resume`: loads the latest complete checkpoint into
// `state` (made for `specs` where empty) and `untouched`, after checking its saved configuration
// against `cfg` and its tensors against `specs`; truncates metrics.jsonl past its step; returns
// its counters. Without: checks that `cd` holds no checkpoint of an earlier run, removes an old
// metrics.jsonl and returns zero counters. `world`: this run's ranks. A checkpoint of another
// world size resumes when the step's micro-batches stay the same (train.grad_accum x ranks: the
// same batches in the same order), whatever either run's dist.shard; otherwise it is refused
// unless resume.allow_changes. Every rank loads the whole state (a sharded optimizer keeps its
// slice). `writes` false (ranks > 0 of a data-parallel run, which come after rank 0 has opened the
// directory): reads only; no removal or truncation.
TrainerState open_run(CheckpointDir& cd, const std::string& run_dir, const ConfigTree& cfg,
                      bool resume, const std::vector<model::ParamSpec>& specs,
                      OptimizerState& state, std::vector<model::RawTensor>& untouched,
                      int64_t world = 1, bool writes = true);

}  // namespace gdn::train
