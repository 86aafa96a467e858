// The model FLOPs utilisation the trainer reports: training FLOPs of a micro-batch over the step
// time at the GPU's dense bf16 peak (the formula PEERS.md uses for the peers).
#pragma once

#include <string>

#include "model/config.h"
#include "train/packing.h"

namespace gdn::train {

// Dense bf16 peak of an H100/H200 SXM (datasheet, no sparsity), the MFU denominator.
inline constexpr double kPeakFlops = 989.4e12;

// Parameters that take part in a matmul (the LM head included, the embedding lookup not).
double matmul_params(const model::Qwen35Config& c);
// Training FLOPs (forward + backward) of one micro-batch.
double step_flops(const model::Qwen35Config& c, const MicroBatch& mb);
// The formula in words, with this model's matmul parameters (printed at start-up).
std::string flops_formula(const model::Qwen35Config& c);

}  // namespace gdn::train
