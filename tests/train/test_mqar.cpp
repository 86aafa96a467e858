// MQAR: the documented layout (context pairs, query slots, labels only at answers), determinism
// from (seed, example index), batches as packed documents, and the accuracy function.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "gdn/core/error.h"
#include "support/error_of.h"
#include "train/mqar.h"

namespace gdn::train {
namespace {

using ::testing::HasSubstr;

using gdn::testing::error_of;

void check_layout(const MqarConfig& c, const MqarExample& ex) {
  const int64_t P = c.num_pairs, L = c.seq_len, K = c.vocab_size / 2;
  ASSERT_EQ(static_cast<int64_t>(ex.input_ids.size()), L);
  ASSERT_EQ(static_cast<int64_t>(ex.labels.size()), L);
  std::map<int32_t, int32_t> bound;  // key -> value from the context
  std::set<int32_t> values;
  for (int64_t i = 0; i < P; ++i) {
    const int32_t k = ex.input_ids[static_cast<size_t>(2 * i)];
    const int32_t v = ex.input_ids[static_cast<size_t>(2 * i + 1)];
    EXPECT_GE(k, 1);
    EXPECT_LT(k, K);
    EXPECT_GE(v, K);
    EXPECT_LT(v, c.vocab_size);
    EXPECT_TRUE(bound.emplace(k, v).second) << "key " << k << " repeated";
    EXPECT_TRUE(values.insert(v).second) << "value " << v << " repeated";
    EXPECT_EQ(ex.labels[static_cast<size_t>(2 * i)], kIgnoreIndex);
    EXPECT_EQ(ex.labels[static_cast<size_t>(2 * i + 1)], kIgnoreIndex);
  }
  std::set<int32_t> queried;
  int64_t answers = 0;
  for (int64_t t = 2 * P; t < L; ++t) {
    const int32_t x = ex.input_ids[static_cast<size_t>(t)];
    const int32_t l = ex.labels[static_cast<size_t>(t)];
    const bool query_slot = (t - 2 * P) % 2 == 0 && t + 1 < L;
    if (x == 0) {
      EXPECT_EQ(l, kIgnoreIndex) << "filler at " << t << " has a target";
      continue;
    }
    EXPECT_TRUE(query_slot) << "a non-filler token at " << t << " outside a query slot";
    ASSERT_TRUE(bound.contains(x)) << "query " << x << " at " << t << " is not a key";
    EXPECT_EQ(l, bound[x]) << "the label at a query is the bound value";
    EXPECT_EQ(ex.input_ids[static_cast<size_t>(t + 1)], 0) << "the token after a query is a filler";
    EXPECT_TRUE(queried.insert(x).second) << "key " << x << " queried twice";
    ++answers;
  }
  EXPECT_EQ(answers, P);
  EXPECT_EQ(static_cast<int64_t>(queried.size()), P);
}

TEST(Mqar, LayoutMatchesTheDocumentation) {
  for (MqarConfig c :
       {MqarConfig{}, MqarConfig{258, 1, 4}, MqarConfig{258, 16, 64}, MqarConfig{258, 16, 65},
        MqarConfig{8, 3, 12}, MqarConfig{248320, 32, 512}}) {
    SCOPED_TRACE(::testing::Message()
                 << "V " << c.vocab_size << " P " << c.num_pairs << " L " << c.seq_len);
    for (int64_t i = 0; i < 20; ++i) check_layout(c, mqar_example(c, 17, i));
  }
}

TEST(Mqar, DeterministicFromSeedAndIndex) {
  MqarConfig c;
  MqarExample a = mqar_example(c, 5, 3);
  MqarExample b = mqar_example(c, 5, 3);
  EXPECT_EQ(a.input_ids, b.input_ids);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_NE(a.input_ids, mqar_example(c, 5, 4).input_ids);
  EXPECT_NE(a.input_ids, mqar_example(c, 6, 3).input_ids);
  // Query positions vary between examples (not a fixed template).
  std::set<std::vector<int32_t>> label_patterns;
  for (int64_t i = 0; i < 10; ++i) {
    auto l = mqar_example(c, 5, i).labels;
    std::vector<int32_t> where;
    for (size_t t = 0; t < l.size(); ++t) {
      if (l[t] != kIgnoreIndex) where.push_back(static_cast<int32_t>(t));
    }
    label_patterns.insert(where);
  }
  EXPECT_GT(label_patterns.size(), 5u);

  // A batch is the concatenation of its examples, whatever batch they come in.
  MicroBatch mb = mqar_batch(c, 5, 2, 3);
  ASSERT_EQ(mb.num_tokens(), 3 * c.seq_len);
  EXPECT_EQ(mb.cu_seqlens, (std::vector<int32_t>{0, 64, 128, 192}));
  for (int64_t e = 0; e < 3; ++e) {
    MqarExample ex = mqar_example(c, 5, 2 + e);
    for (int64_t t = 0; t < c.seq_len; ++t) {
      const auto i = static_cast<size_t>(e * c.seq_len + t);
      EXPECT_EQ(mb.input_ids[i], ex.input_ids[static_cast<size_t>(t)]);
      EXPECT_EQ(mb.labels[i], ex.labels[static_cast<size_t>(t)]);
      EXPECT_EQ(mb.positions[i], t);
    }
  }
  EXPECT_EQ(mb.num_targets(), 3 * c.num_pairs);
  validate_micro_batch(mb, 3 * c.seq_len, c.vocab_size, /*next_token_labels=*/false);
  MicroBatch other = mqar_batch(c, 5, 3, 1);
  EXPECT_EQ(std::vector<int32_t>(mb.input_ids.begin() + 64, mb.input_ids.begin() + 128),
            other.input_ids);
}

TEST(Mqar, AccuracyCountsArgmaxAtAnswerPositions) {
  const int64_t V = 6;
  std::vector<int32_t> labels = {kIgnoreIndex, 3, kIgnoreIndex, 5, 2};
  std::vector<float> logits(labels.size() * V, 0.0f);
  auto row = [&](size_t t) { return logits.data() + t * V; };
  row(0)[1] = 9;  // ignored position: does not count
  row(1)[3] = 1;  // correct
  row(3)[4] = 2;  // wrong (4 beats 5)
  row(3)[5] = 1;
  row(4)[2] = 1;  // tie between 2 and 0? no: 2 is the only max -> correct
  MqarAccuracy a = mqar_accuracy(logits, labels, V);
  EXPECT_EQ(a.total, 3);
  EXPECT_EQ(a.correct, 2);
  EXPECT_DOUBLE_EQ(a.value(), 2.0 / 3.0);
  // Ties go to the lowest id.
  row(4)[1] = 1;
  EXPECT_EQ(mqar_accuracy(logits, labels, V).correct, 1);
  // A NaN row is wrong even if the label's logit is the largest finite value.
  row(1)[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(mqar_accuracy(logits, labels, V).correct, 0);
  // Perfect logits on a real MQAR batch give accuracy 1.
  MqarConfig c{32, 4, 20};
  MicroBatch mb = mqar_batch(c, 1, 0, 2);
  std::vector<float> perfect(mb.labels.size() * static_cast<size_t>(c.vocab_size), -1.0f);
  for (size_t t = 0; t < mb.labels.size(); ++t) {
    if (mb.labels[t] != kIgnoreIndex)
      perfect[t * static_cast<size_t>(c.vocab_size) + static_cast<size_t>(mb.labels[t])] = 3.0f;
  }
  MqarAccuracy p = mqar_accuracy(perfect, mb.labels, c.vocab_size);
  EXPECT_EQ(p.total, 8);
  EXPECT_DOUBLE_EQ(p.value(), 1.0);
  EXPECT_DOUBLE_EQ(MqarAccuracy{}.value(), 0.0);
  EXPECT_THAT(error_of([&] { mqar_accuracy(logits, labels, V + 1); }), HasSubstr("expected T * V"));
  std::vector<int32_t> bad = {7};
  std::vector<float> one(V, 0.0f);
  EXPECT_THAT(error_of([&] { mqar_accuracy(one, bad, V); }),
              HasSubstr("label 7 at position 0 is outside"));
}

TEST(Mqar, ConfigErrors) {
  EXPECT_THAT(error_of([] {
                validate(MqarConfig{258, 8, 31});
              }),
              HasSubstr("seq_len 31 must be at least 4 * num_pairs = 32"));
  EXPECT_THAT(error_of([] {
                validate(MqarConfig{16, 8, 64});
              }),
              HasSubstr("num_pairs 8 needs that many distinct keys in [1, 8)"));
  EXPECT_THAT(error_of([] {
                validate(MqarConfig{3, 1, 8});
              }),
              HasSubstr("vocab_size 3 must be in [4"));
  EXPECT_THAT(error_of([] {
                validate(MqarConfig{258, 0, 8});
              }),
              HasSubstr("num_pairs 0 must be at least 1"));
  EXPECT_THAT(error_of([] { mqar_batch(MqarConfig{}, 1, 0, 0); }),
              HasSubstr("at least one example"));
  EXPECT_THAT(error_of([] { mqar_example(MqarConfig{}, 1, -1); }),
              HasSubstr("example index -1 is negative"));
}

}  // namespace
}  // namespace gdn::train
