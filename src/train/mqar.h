// Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and Improving
// Recall in Efficient Language Models", data in HazyResearch/zoology zoology/data/
// associative_recall.py): the built-in default task, so that `gdntrain train` works without data
// and measures exactly what GDN's delta rule is for (recalling bound key-value pairs).
//
// Exact layout of one example (vocabulary V, P pairs, length L; K = floor(V/2)):
//   token 0            filler (never a target)
//   keys               P distinct ids drawn uniformly from [1, K)
//   values             P distinct ids drawn uniformly from [K, V)
//   positions 0..2P-1  k_0 v_0 k_1 v_1 ... k_{P-1} v_{P-1}            (the context)
//   positions 2P..L-1  the query region, S = floor((L-2P)/2) slots; slot s is positions
//                      (2P+2s, 2P+2s+1) = (query, filler 0). P distinct slots are drawn uniformly;
//                      every key is queried exactly once, in a random order, in increasing slot
//                      order; all other query-region positions (and an odd last position) are 0.
//   labels             at a query position: the value bound to the queried key; -100 everywhere
//                      else. Label semantics as in packing.h: the target of the output at that
//                      position (the model sees key k at t and must emit its value at t).
// As in Zoology, keys and values come from disjoint halves of the vocabulary and the token after
// a query is a filler, not the answer. Unlike Zoology, query slots are uniform, not power-law.
// Requires 1 <= P <= K-1, P <= V-K, L >= 4P.
//
// Determinism: example i is a pure function of (config, seed, i): its draws come from the counter
// RNG with stream rng::stream_id("mqar") + i and a per-example draw counter, so example i is the
// same whichever batch, rank or order produces it. Uniform integers use the multiply-shift map
// (r * n) >> 32, biased by at most n / 2^32.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "train/packing.h"

namespace gdn::train {

struct MqarConfig {
  int64_t vocab_size = 258;  // fits the tiny model config
  int64_t num_pairs = 8;
  int64_t seq_len = 64;
};
void validate(const MqarConfig& c);

struct MqarExample {
  std::vector<int32_t> input_ids;  // [L]
  std::vector<int32_t> labels;     // [L]
};
MqarExample mqar_example(const MqarConfig& c, uint64_t seed, int64_t index);

// Examples [first, first + count) packed as `count` documents of length L: T = count·L tokens,
// cu_seqlens = 0, L, 2L, ..., positions restart per example.
MicroBatch mqar_batch(const MqarConfig& c, uint64_t seed, int64_t first, int64_t count);

struct MqarAccuracy {
  int64_t correct = 0;
  int64_t total = 0;  // answer positions (labels != -100)
  double value() const {
    return total > 0 ? static_cast<double>(correct) / static_cast<double>(total) : 0.0;
  }
};
// Fraction of answer positions whose argmax over the vocabulary equals the label. `logits` is
// row-major [T, vocab_size]; ties go to the lowest id; a row with a NaN counts as wrong.
MqarAccuracy mqar_accuracy(std::span<const float> logits, std::span<const int32_t> labels,
                           int64_t vocab_size);

}  // namespace gdn::train
