// `gdntrain probe --model`: every (op, shape class) one training step of a model resolves, probed
// before the first real step (ARCHITECTURE.md §5), with the decisions as the registry made them.
#pragma once

#include <string>
#include <vector>

#include "gdn/backend/registry.h"
#include "model/config.h"
#include "model/qwen35.h"

namespace gdn::model {

// The model's config: `path` is a checkpoint or config directory holding config.json, or a
// config.json file itself.
Qwen35Config load_model_config(const std::string& path);

// Builds the model on `backend` with random weights (HF's initialisation; the values do not change
// a shape class) and runs one forward and backward of a micro-batch of documents of 1, 511 and 512
// tokens (a one-token document; few enough documents for the gated delta rule's saved states, as
// training plans them), then returns every decision the registry made for it, in order. The
// classes do not depend on the number of tokens, so the step is small; the weights are the
// model's full size.
std::vector<Registry::Decision> probe_model(const Qwen35Config& cfg, Backend backend,
                                            Recompute recompute);

}  // namespace gdn::model
