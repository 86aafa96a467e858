#include "train/data_source.h"

#include <algorithm>
#include <cmath>

#include "gdn/core/error.h"
#include "train/indexed_dataset.h"

namespace gdn::train {

namespace {

// The global index of this rank's micro-batch `micro` of `step` (data_source.h).
int64_t global_micro_batch(int64_t step, int64_t micro, int64_t accum, const DataShard& sh) {
  GDN_CHECK(micro >= 0 && micro < accum, "micro-batch {} of a step of {}", micro, accum);
  return (step * accum + micro) * sh.world + sh.rank;
}

void check_shard(const DataShard& sh) {
  GDN_CHECK(sh.world >= 1 && sh.rank >= 0 && sh.rank < sh.world, "data shard: rank {} of {}",
            sh.rank, sh.world);
}

class MqarSource final : public DataSource {
 public:
  MqarSource(MqarConfig c, uint64_t seed, int64_t micro_tokens, int64_t accum, DataShard shard)
      : c_(c), seed_(seed), accum_(accum), shard_(shard) {
    validate(c_);
    check_shard(shard_);
    per_batch_ = micro_tokens / c_.seq_len;
    GDN_CHECK_HINT(per_batch_ >= 1, "raise train.micro_batch_tokens or lower data.mqar.seq_len",
                   "train.micro_batch_tokens {} is smaller than one MQAR example ({} tokens)",
                   micro_tokens, c_.seq_len);
  }
  MicroBatch train_batch(int64_t step, int64_t micro) override {
    return mqar_batch(c_, seed_, global_micro_batch(step, micro, accum_, shard_) * per_batch_,
                      per_batch_);
  }
  std::vector<MicroBatch> eval_batches(int64_t count) override {
    std::vector<MicroBatch> out;
    // Held-out examples: a different seed, so no eval example is ever a training example.
    for (int64_t i = 0; i < count; ++i)
      out.push_back(mqar_batch(c_, seed_ ^ 0x9e3779b97f4a7c15ull, i * per_batch_, per_batch_));
    return out;
  }
  int64_t max_tokens() const override { return per_batch_ * c_.seq_len; }
  int64_t max_docs() const override { return per_batch_; }
  bool is_mqar() const override { return true; }
  std::string describe() const override {
    return fmt::format(
        "MQAR: {} key-value pairs, sequences of {}, vocabulary {}, {} examples per "
        "micro-batch",
        c_.num_pairs, c_.seq_len, c_.vocab_size, per_batch_);
  }
  const MqarConfig& config() const { return c_; }

 private:
  MqarConfig c_;
  uint64_t seed_;
  int64_t accum_;
  DataShard shard_;
  int64_t per_batch_ = 1;
};

class IndexedSource final : public DataSource {
 public:
  IndexedSource(const std::string& prefix, uint64_t seed, int64_t micro_tokens, int64_t accum,
                double eval_fraction, int64_t vocab, DataShard shard)
      : ds_(prefix),
        seed_(seed),
        micro_tokens_(micro_tokens),
        accum_(accum),
        vocab_(vocab),
        shard_(shard) {
    check_shard(shard_);
    auto lengths = ds_.document_lengths();
    const int64_t n = static_cast<int64_t>(lengths.size());
    GDN_CHECK(n >= 2, "dataset '{}' has {} documents; at least 2 are needed (train + eval)", prefix,
              n);
    n_eval_ = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(n * eval_fraction)), 1, n - 1);
    train_lengths_.assign(lengths.begin(), lengths.end() - n_eval_);
    eval_lengths_.assign(lengths.end() - n_eval_, lengths.end());
  }
  MicroBatch train_batch(int64_t step, int64_t micro) override {
    const int64_t g = global_micro_batch(step, micro, accum_, shard_);
    for (;;) {
      if (!plan_ || g - epoch_first_ < plan_->num_batches()) {
        if (!plan_) build_epoch(0, 0);
        if (g >= epoch_first_ && g - epoch_first_ < plan_->num_batches()) break;
      }
      if (g < epoch_first_)
        build_epoch(0, 0);  // went backwards (a fresh process): restart
      else
        build_epoch(epoch_ + 1, epoch_first_ + plan_->num_batches());
    }
    MicroBatch mb = build_micro_batch(
        *plan_, g - epoch_first_,
        [&](int64_t d, int64_t b, int64_t e, int32_t* out) { ds_.read_document(d, b, e, out); });
    check_vocab(mb);
    return mb;
  }
  std::vector<MicroBatch> eval_batches(int64_t count) override {
    PackPlan p = plan_packing(eval_lengths_, identity_order(n_eval_), micro_tokens_);
    std::vector<MicroBatch> out;
    const int64_t first = static_cast<int64_t>(train_lengths_.size());
    for (int64_t b = 0; b < std::min(count, p.num_batches()); ++b) {
      out.push_back(build_micro_batch(p, b, [&](int64_t d, int64_t s, int64_t e, int32_t* o) {
        ds_.read_document(first + d, s, e, o);
      }));
      check_vocab(out.back());
    }
    return out;
  }
  int64_t max_tokens() const override { return micro_tokens_; }
  int64_t max_docs() const override { return micro_tokens_; }
  std::string describe() const override {
    return fmt::format("indexed dataset {}: {} documents ({} held out for eval), {} tokens",
                       ds_.prefix(), ds_.num_documents(), n_eval_, ds_.total_tokens());
  }

 private:
  void build_epoch(int64_t epoch, int64_t first) {
    auto order = shuffled_order(static_cast<int64_t>(train_lengths_.size()), seed_,
                                static_cast<uint64_t>(epoch));
    plan_ = std::make_unique<PackPlan>(plan_packing(train_lengths_, order, micro_tokens_));
    GDN_CHECK(plan_->num_batches() > 0, "dataset '{}' produced no micro-batch", ds_.prefix());
    epoch_ = epoch;
    epoch_first_ = first;
  }
  void check_vocab(const MicroBatch& mb) const {
    for (size_t t = 0; t < mb.input_ids.size(); ++t)
      GDN_CHECK(mb.input_ids[t] >= 0 && mb.input_ids[t] < vocab_,
                "dataset '{}': token {} is outside the model vocabulary [0, {})", ds_.prefix(),
                mb.input_ids[t], vocab_);
  }
  IndexedDataset ds_;
  uint64_t seed_;
  int64_t micro_tokens_, accum_, vocab_;
  DataShard shard_;
  int64_t n_eval_ = 1;
  std::vector<int64_t> train_lengths_, eval_lengths_;
  std::unique_ptr<PackPlan> plan_;
  int64_t epoch_ = 0, epoch_first_ = 0;
};

}  // namespace

std::unique_ptr<DataSource> make_mqar_source(MqarConfig c, uint64_t seed, int64_t micro_tokens,
                                             int64_t accum, DataShard shard) {
  return std::make_unique<MqarSource>(c, seed, micro_tokens, accum, shard);
}

std::unique_ptr<DataSource> make_indexed_source(const std::string& prefix, uint64_t seed,
                                                int64_t micro_tokens, int64_t accum,
                                                double eval_fraction, int64_t vocab,
                                                DataShard shard) {
  return std::make_unique<IndexedSource>(prefix, seed, micro_tokens, accum, eval_fraction, vocab,
                                         shard);
}

}  // namespace gdn::train
