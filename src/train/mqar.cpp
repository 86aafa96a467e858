#include "train/mqar.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "gdn/core/error.h"
#include "gdn/core/rng.h"

namespace gdn::train {

void validate(const MqarConfig& c) {
  GDN_CHECK(c.vocab_size >= 4 && c.vocab_size <= std::numeric_limits<int32_t>::max(),
            "mqar: vocab_size {} must be in [4, 2^31)", c.vocab_size);
  const int64_t K = c.vocab_size / 2;
  GDN_CHECK(c.num_pairs >= 1, "mqar: num_pairs {} must be at least 1", c.num_pairs);
  GDN_CHECK(c.num_pairs <= K - 1 && c.num_pairs <= c.vocab_size - K,
            "mqar: num_pairs {} needs that many distinct keys in [1, {}) and values in [{}, {})",
            c.num_pairs, K, K, c.vocab_size);
  GDN_CHECK(c.seq_len >= 4 * c.num_pairs && c.seq_len <= std::numeric_limits<int32_t>::max(),
            "mqar: seq_len {} must be at least 4 * num_pairs = {} (context + a query slot per key)",
            c.seq_len, 4 * c.num_pairs);
}

namespace {
// Draws from one example's stream: uniform integers in [0, n).
class Draws {
 public:
  Draws(uint64_t seed, int64_t index)
      : seed_(seed), stream_(rng::stream_id("mqar") + static_cast<uint64_t>(index)) {}
  int64_t below(int64_t n) {
    const uint64_t r = rng::bits(seed_, stream_, counter_++);
    return static_cast<int64_t>((r * static_cast<uint64_t>(n)) >> 32);
  }
  // `count` distinct integers from [lo, hi), in draw order.
  std::vector<int64_t> distinct(int64_t count, int64_t lo, int64_t hi) {
    std::vector<int64_t> out;
    std::unordered_set<int64_t> seen;
    while (static_cast<int64_t>(out.size()) < count) {
      const int64_t v = lo + below(hi - lo);
      if (seen.insert(v).second) out.push_back(v);
    }
    return out;
  }

 private:
  uint64_t seed_, stream_;
  uint64_t counter_ = 0;
};
}  // namespace

MqarExample mqar_example(const MqarConfig& c, uint64_t seed, int64_t index) {
  validate(c);
  GDN_CHECK(index >= 0, "mqar: example index {} is negative", index);
  const int64_t P = c.num_pairs, L = c.seq_len, K = c.vocab_size / 2;
  Draws draws(seed, index);
  const std::vector<int64_t> keys = draws.distinct(P, 1, K);
  const std::vector<int64_t> vals = draws.distinct(P, K, c.vocab_size);
  const int64_t slots = (L - 2 * P) / 2;
  std::vector<int64_t> chosen = draws.distinct(P, 0, slots);   // slots, in draw order
  std::vector<int64_t> query_order = draws.distinct(P, 0, P);  // a permutation of the pairs
  std::sort(chosen.begin(), chosen.end());

  MqarExample ex;
  ex.input_ids.assign(static_cast<size_t>(L), 0);
  ex.labels.assign(static_cast<size_t>(L), kIgnoreIndex);
  for (int64_t i = 0; i < P; ++i) {
    ex.input_ids[static_cast<size_t>(2 * i)] = static_cast<int32_t>(keys[static_cast<size_t>(i)]);
    ex.input_ids[static_cast<size_t>(2 * i + 1)] =
        static_cast<int32_t>(vals[static_cast<size_t>(i)]);
  }
  for (int64_t q = 0; q < P; ++q) {
    const auto pos = static_cast<size_t>(2 * P + 2 * chosen[static_cast<size_t>(q)]);
    const auto pair = static_cast<size_t>(query_order[static_cast<size_t>(q)]);
    ex.input_ids[pos] = static_cast<int32_t>(keys[pair]);
    ex.labels[pos] = static_cast<int32_t>(vals[pair]);
  }
  return ex;
}

MicroBatch mqar_batch(const MqarConfig& c, uint64_t seed, int64_t first, int64_t count) {
  validate(c);
  GDN_CHECK(count >= 1, "mqar: a batch needs at least one example, got {}", count);
  GDN_CHECK(count * c.seq_len <= std::numeric_limits<int32_t>::max(),
            "mqar: {} examples of {} tokens overflow int32 cu_seqlens", count, c.seq_len);
  MicroBatch mb;
  const auto T = static_cast<size_t>(count * c.seq_len);
  mb.input_ids.reserve(T);
  mb.labels.reserve(T);
  mb.positions.reserve(T);
  mb.cu_seqlens.push_back(0);
  for (int64_t e = 0; e < count; ++e) {
    MqarExample ex = mqar_example(c, seed, first + e);
    mb.input_ids.insert(mb.input_ids.end(), ex.input_ids.begin(), ex.input_ids.end());
    mb.labels.insert(mb.labels.end(), ex.labels.begin(), ex.labels.end());
    for (int64_t t = 0; t < c.seq_len; ++t) mb.positions.push_back(static_cast<int32_t>(t));
    mb.cu_seqlens.push_back(static_cast<int32_t>((e + 1) * c.seq_len));
  }
  return mb;
}

MqarAccuracy mqar_accuracy(std::span<const float> logits, std::span<const int32_t> labels,
                           int64_t vocab_size) {
  GDN_CHECK(vocab_size >= 1, "mqar_accuracy: vocab_size {} must be positive", vocab_size);
  GDN_CHECK(static_cast<int64_t>(logits.size()) == static_cast<int64_t>(labels.size()) * vocab_size,
            "mqar_accuracy: logits have {} values, expected T * V = {} * {}", logits.size(),
            labels.size(), vocab_size);
  MqarAccuracy acc;
  for (size_t t = 0; t < labels.size(); ++t) {
    const int32_t l = labels[t];
    if (l == kIgnoreIndex) continue;
    GDN_CHECK(l >= 0 && l < vocab_size, "mqar_accuracy: label {} at position {} is outside [0, {})",
              l, t, vocab_size);
    ++acc.total;
    const float* row = logits.data() + t * static_cast<size_t>(vocab_size);  // [V]
    int64_t best = 0;
    bool nan = false;
    for (int64_t v = 0; v < vocab_size; ++v) {
      if (std::isnan(row[v])) nan = true;
      if (row[v] > row[best]) best = v;
    }
    if (!nan && best == l) ++acc.correct;
  }
  return acc;
}

}  // namespace gdn::train
