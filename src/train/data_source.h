// The trainer's data: the micro-batches of each step and the held-out evaluation batches, from
// the built-in MQAR task or a Megatron .bin/.idx dataset. Both are pure functions of the
// configuration and the (step, micro-batch) indices, which is what makes resume exact.
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
  // Micro-batch `micro` of (0-based) step `step`.
  virtual MicroBatch train_batch(int64_t step, int64_t micro) = 0;
  virtual std::vector<MicroBatch> eval_batches(int64_t count) = 0;
  virtual int64_t max_tokens() const = 0;
  virtual int64_t max_docs() const = 0;
  virtual bool is_mqar() const { return false; }
  virtual std::string describe() const = 0;
};

// MQAR examples packed `micro_tokens / c.seq_len` to a micro-batch; eval examples from another
// seed, so none is a training example.
std::unique_ptr<DataSource> make_mqar_source(MqarConfig c, uint64_t seed, int64_t micro_tokens,
                                             int64_t accum);

// The documents of dataset `prefix`, the last `eval_fraction` held out (at least 1), shuffled per
// epoch from `seed` and packed into micro-batches of `micro_tokens`; an id outside [0, vocab) is
// an error naming the dataset.
std::unique_ptr<DataSource> make_indexed_source(const std::string& prefix, uint64_t seed,
                                                int64_t micro_tokens, int64_t accum,
                                                double eval_fraction, int64_t vocab);

}  // namespace gdn::train
