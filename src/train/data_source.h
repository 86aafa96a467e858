// The trainer's data: the micro-batches of each step and the held-out evaluation batches, from
// the built-in MQAR task or a Megatron .bin/.idx dataset. Both are pure functions of the
// configuration and the (step, micro-batch) indices, which is what makes resume exact.
//
// Data parallelism (docs/DISTRIBUTED.md): a step's global batch is `accum * world` micro-batches,
// numbered g = step * accum * world + j. Rank r of `world` reads j = r, r + world, r + 2 world, ...
// (its local micro-batch k is j = k * world + r), so the ranks' slices are disjoint and their union
// is exactly the step's micro-batches of one process with grad_accum = accum * world. At world 1
// this is the single-process numbering.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "train/mqar.h"
#include "train/packing.h"

namespace gdn::train {

class DataSource {
 public:
  virtual ~DataSource() = default;
  // This rank's micro-batch `micro` (in [0, accum)) of (0-based) step `step`.
  virtual MicroBatch train_batch(int64_t step, int64_t micro) = 0;
  virtual std::vector<MicroBatch> eval_batches(int64_t count) = 0;
  virtual int64_t max_tokens() const = 0;
  virtual int64_t max_docs() const = 0;
  virtual bool is_mqar() const { return false; }
  virtual std::string describe() const = 0;
};

// This rank's share of the data (above).
struct DataShard {
  int64_t rank = 0, world = 1;
};

// MQAR examples packed `micro_tokens / c.seq_len` to a micro-batch; eval examples from another
// seed, so none is a training example.
std::unique_ptr<DataSource> make_mqar_source(MqarConfig c, uint64_t seed, int64_t micro_tokens,
                                             int64_t accum, DataShard shard = {});

// The documents of dataset `prefix`, the last `eval_fraction` held out (at least 1), shuffled per
// epoch from `seed` and packed into micro-batches of `micro_tokens`; an id outside [0, vocab) is
// an error naming the dataset.
std::unique_ptr<DataSource> make_indexed_source(const std::string& prefix, uint64_t seed,
                                                int64_t micro_tokens, int64_t accum,
                                                double eval_fraction, int64_t vocab,
                                                DataShard shard = {});

}  // namespace gdn::train
