// Packing: no label crosses a document, cu_seqlens valid, every token used exactly once, the
// budget respected, long documents split into pieces, deterministic order.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "gdn/core/error.h"
#include "gdn/core/rng.h"
#include "support/error_of.h"
#include "train/indexed_dataset.h"
#include "train/packing.h"

namespace gdn::train {
namespace {

using ::testing::HasSubstr;

using gdn::testing::error_of;

// Token j of document d is a unique value, so every token can be traced back to its source.
int32_t token_of(int64_t d, int64_t j) { return static_cast<int32_t>(d * 1000 + j); }

TokenReader synthetic_reader(const std::vector<int64_t>& lengths) {
  return [&lengths](int64_t doc, int64_t begin, int64_t end, int32_t* out) {
    ASSERT_LE(end, lengths[static_cast<size_t>(doc)]);
    for (int64_t j = begin; j < end; ++j) out[j - begin] = token_of(doc, j);
  };
}

// Checks every invariant of a whole plan against the source documents.
void check_plan(const std::vector<int64_t>& lengths, const std::vector<int64_t>& order,
                int64_t max_tokens) {
  PackPlan plan = plan_packing(lengths, order, max_tokens);
  TokenReader read = synthetic_reader(lengths);
  std::map<int64_t, std::vector<int>> used;  // doc -> times each token was used
  for (size_t d = 0; d < lengths.size(); ++d) {
    used[static_cast<int64_t>(d)].assign(static_cast<size_t>(lengths[d]), 0);
  }
  std::map<int64_t, int64_t> pieces;
  std::vector<int64_t> first_seen_order;
  for (int64_t b = 0; b < plan.num_batches(); ++b) {
    MicroBatch mb = build_micro_batch(plan, b, read);
    validate_micro_batch(mb, max_tokens, 1 << 30);
    const int64_t T = mb.num_tokens();
    ASSERT_GE(T, 1);
    ASSERT_LE(T, max_tokens);  // the budget
    ASSERT_EQ(mb.cu_seqlens.front(), 0);
    ASSERT_EQ(mb.cu_seqlens.back(), T);
    EXPECT_EQ(mb.num_targets(), T - mb.num_segments());
    auto segs = plan.batch(b);
    ASSERT_EQ(static_cast<int64_t>(segs.size()), mb.num_segments());
    for (size_t s = 0; s < segs.size(); ++s) {
      const Segment& g = segs[s];
      const int32_t a = mb.cu_seqlens[s], e = mb.cu_seqlens[s + 1];
      ASSERT_GT(e, a);  // no empty segment
      ASSERT_EQ(e - a, g.size());
      ASSERT_LE(g.size(), max_tokens);
      ++pieces[g.doc];
      if (first_seen_order.empty() || first_seen_order.back() != g.doc)
        first_seen_order.push_back(g.doc);
      for (int32_t t = a; t < e; ++t) {
        const int64_t j = g.begin + (t - a);
        EXPECT_EQ(mb.input_ids[static_cast<size_t>(t)], token_of(g.doc, j));
        EXPECT_EQ(mb.positions[static_cast<size_t>(t)], t - a);
        ++used[g.doc][static_cast<size_t>(j)];
        const int32_t l = mb.labels[static_cast<size_t>(t)];
        if (t == e - 1) {
          EXPECT_EQ(l, kIgnoreIndex) << "label crosses the segment end";
        } else {
          EXPECT_EQ(l, token_of(g.doc, j + 1));  // the next token of the same document
        }
      }
    }
    // A micro-batch is closed only when the next piece did not fit.
    if (b + 1 < plan.num_batches()) {
      EXPECT_GT(T + plan.batch(b + 1).front().size(), max_tokens);
    }
  }
  for (const auto& [d, u] : used) {
    for (size_t j = 0; j < u.size(); ++j) ASSERT_EQ(u[j], 1) << "doc " << d << " token " << j;
    const int64_t len = lengths[static_cast<size_t>(d)];
    // Documents within the budget are never split; longer ones become ceil(len / max) pieces.
    EXPECT_EQ(pieces[d], (len + max_tokens - 1) / max_tokens) << "doc " << d;
  }
  // Documents appear in the given order (skipping empty ones).
  std::vector<int64_t> want;
  for (int64_t d : order) {
    if (lengths[static_cast<size_t>(d)] > 0) want.push_back(d);
  }
  EXPECT_EQ(first_seen_order, want);
}

TEST(Packing, InvariantsOverRandomDocuments) {
  for (int64_t max_tokens : {1, 7, 64, 100}) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      std::vector<int64_t> lengths;
      for (uint64_t i = 0; i < 40; ++i) {
        lengths.push_back(static_cast<int64_t>(rng::bits(seed, 9, i) %
                                               static_cast<uint32_t>(2 * max_tokens + 3)));
      }
      // The edges: empty, single token, exactly the budget, one over, several times over.
      lengths.insert(lengths.end(), {0, 1, max_tokens, max_tokens + 1, 3 * max_tokens + 2});
      SCOPED_TRACE(::testing::Message() << "max_tokens " << max_tokens << " seed " << seed);
      check_plan(lengths, identity_order(static_cast<int64_t>(lengths.size())), max_tokens);
      check_plan(lengths, shuffled_order(static_cast<int64_t>(lengths.size()), seed, 0),
                 max_tokens);
    }
  }
}

TEST(Packing, LabelsStopAtDocumentBoundaries) {
  std::vector<int64_t> lengths = {3, 2, 1, 4};
  PackPlan plan = plan_packing(lengths, identity_order(4), 6);
  ASSERT_EQ(plan.num_batches(), 2);  // [3 2 1] [4]
  MicroBatch mb = build_micro_batch(plan, 0, synthetic_reader(lengths));
  EXPECT_EQ(mb.input_ids, (std::vector<int32_t>{0, 1, 2, 1000, 1001, 2000}));
  EXPECT_EQ(mb.labels, (std::vector<int32_t>{1, 2, -100, 1001, -100, -100}));
  EXPECT_EQ(mb.cu_seqlens, (std::vector<int32_t>{0, 3, 5, 6}));
  EXPECT_EQ(mb.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 0}));
  EXPECT_EQ(mb.num_targets(), 3);
  EXPECT_EQ(mb.max_seqlen(), 3);
  // A document longer than the budget: pieces of exactly max_tokens, each its own document.
  std::vector<int64_t> longdoc = {2, 11, 1};
  PackPlan p2 = plan_packing(longdoc, identity_order(3), 4);
  std::vector<std::vector<int32_t>> cus;
  for (int64_t b = 0; b < p2.num_batches(); ++b)
    cus.push_back(build_micro_batch(p2, b, synthetic_reader(longdoc)).cu_seqlens);
  // [doc0(2)] [doc1 0..4] [doc1 4..8] [doc1 8..11, doc2(1)]
  EXPECT_EQ(cus, (std::vector<std::vector<int32_t>>{{0, 2}, {0, 4}, {0, 4}, {0, 3, 4}}));
  MicroBatch last = build_micro_batch(p2, 3, synthetic_reader(longdoc));
  EXPECT_EQ(last.input_ids, (std::vector<int32_t>{1008, 1009, 1010, 2000}));
  EXPECT_EQ(last.labels, (std::vector<int32_t>{1009, 1010, -100, -100}));
  MicroBatch second = build_micro_batch(p2, 1, synthetic_reader(longdoc));
  EXPECT_EQ(second.labels.back(), kIgnoreIndex);  // the piece end has no target
  EXPECT_EQ(second.positions, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(Packing, OrderIsDeterministicPerSeedAndEpoch) {
  auto a = shuffled_order(1000, 42, 0);
  EXPECT_EQ(a, shuffled_order(1000, 42, 0));
  EXPECT_NE(a, shuffled_order(1000, 43, 0));
  EXPECT_NE(a, shuffled_order(1000, 42, 1));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, identity_order(1000));
  EXPECT_NE(a, identity_order(1000));
  std::vector<int64_t> lengths(1000);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = static_cast<int64_t>(i % 37);
  PackPlan p = plan_packing(lengths, a, 128), q = plan_packing(lengths, a, 128);
  ASSERT_EQ(p.segments.size(), q.segments.size());
  for (size_t i = 0; i < p.segments.size(); ++i) {
    EXPECT_EQ(p.segments[i].doc, q.segments[i].doc);
    EXPECT_EQ(p.segments[i].begin, q.segments[i].begin);
  }
  EXPECT_EQ(p.batch_offsets, q.batch_offsets);
  EXPECT_TRUE(shuffled_order(0, 1, 0).empty());
  EXPECT_EQ(shuffled_order(1, 1, 0), std::vector<int64_t>{0});
}

TEST(Packing, BadInputIsAnError) {
  std::vector<int64_t> lengths = {3, 4};
  EXPECT_THAT(error_of([&] { plan_packing(lengths, identity_order(2), 0); }),
              HasSubstr("max_tokens 0 must be in [1, 2^31)"));
  EXPECT_THAT(error_of([&] {
                plan_packing(lengths, std::vector<int64_t>{1, 1}, 8);
              }),
              HasSubstr("order entry 1 = 1 is not a permutation"));
  EXPECT_THAT(error_of([&] { plan_packing(lengths, std::vector<int64_t>{0}, 8); }),
              HasSubstr("the order has 1 entries for 2 documents"));
  std::vector<int64_t> neg = {3, -1};
  EXPECT_THAT(error_of([&] { plan_packing(neg, identity_order(2), 8); }),
              HasSubstr("document 1 has negative length -1"));
  PackPlan empty = plan_packing(std::vector<int64_t>{0, 0}, identity_order(2), 8);
  EXPECT_EQ(empty.num_batches(), 0);
  EXPECT_THAT(error_of([&] { empty.batch(0); }), HasSubstr("micro-batch 0 out of range"));

  // validate_micro_batch catches broken batches.
  PackPlan p = plan_packing(lengths, identity_order(2), 8);
  MicroBatch good = build_micro_batch(p, 0, synthetic_reader(lengths));
  validate_micro_batch(good, 8, 5000);
  {
    MicroBatch m = good;
    m.labels[2] = 1000;  // last token of document 0 labelled with document 1's first token
    EXPECT_THAT(
        error_of([&] { validate_micro_batch(m, 8, 5000); }),
        HasSubstr("the last token of segment 0 (position 2) has label 1000, expected -100"));
  }
  {
    MicroBatch m = good;
    m.positions[4] = 4;
    EXPECT_THAT(error_of([&] { validate_micro_batch(m, 8, 5000); }),
                HasSubstr("position[4] = 4, expected 1"));
  }
  {
    MicroBatch m = good;
    m.cu_seqlens = {0, 3, 3, 7};
    EXPECT_THAT(error_of([&] { validate_micro_batch(m, 8, 5000); }),
                HasSubstr("segment 1 is empty"));
  }
  {
    MicroBatch m = good;
    m.labels[0] = 7;
    EXPECT_THAT(error_of([&] { validate_micro_batch(m, 8, 5000); }),
                HasSubstr("is not the next input token"));
    validate_micro_batch(m, 8, 5000, /*next_token_labels=*/false);
  }
  EXPECT_THAT(error_of([&] { validate_micro_batch(good, 6, 5000); }),
              HasSubstr("7 tokens, expected 1..6"));
  EXPECT_THAT(error_of([&] { validate_micro_batch(good, 8, 1000); }),
              HasSubstr("outside the vocabulary"));
}

TEST(Packing, PacksAnIndexedDataset) {
  namespace fs = std::filesystem;
  auto dir = fs::temp_directory_path() / ("gdn_test_packing_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string prefix = (dir / "d").string();
  std::vector<std::vector<int32_t>> docs = {{5, 6, 7, 1}, {8, 1}, {9, 9, 9, 9, 9, 9, 9, 1}, {1}};
  {
    IndexedDatasetWriter w(prefix, TokenDType::U16);
    for (const auto& d : docs) w.add_document(d);
    w.finish();
  }
  IndexedDataset ds(prefix);
  PackPlan plan = plan_packing(ds.document_lengths(), shuffled_order(ds.num_documents(), 7, 0), 5);
  TokenReader read = [&ds](int64_t doc, int64_t b, int64_t e, int32_t* out) {
    ds.read_document(doc, b, e, out);
  };
  int64_t tokens = 0;
  for (int64_t b = 0; b < plan.num_batches(); ++b) {
    MicroBatch mb = build_micro_batch(plan, b, read);
    validate_micro_batch(mb, 5, 258);
    int64_t off = 0;
    for (const Segment& s : plan.batch(b)) {
      for (int64_t j = s.begin; j < s.end; ++j) {
        EXPECT_EQ(mb.input_ids[static_cast<size_t>(off++)],
                  docs[static_cast<size_t>(s.doc)][static_cast<size_t>(j)]);
      }
    }
    tokens += mb.num_tokens();
  }
  EXPECT_EQ(tokens, ds.total_tokens());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gdn::train
