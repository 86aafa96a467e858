// The MFU numerator (train/flops.h): the matmul term is linear in the tokens, and the attention
// term counts causal (query, key) pairs within documents only.
#include <gtest/gtest.h>

#include "model/config.h"
#include "train/flops.h"

namespace gdn::train {
namespace {

MicroBatch batch(std::vector<int32_t> cu) {
  MicroBatch mb;
  mb.cu_seqlens = cu;
  mb.input_ids.assign(static_cast<size_t>(cu.back()), 1);
  mb.labels.assign(static_cast<size_t>(cu.back()), 1);
  return mb;
}

TEST(Flops, DocumentsChangeOnlyTheAttentionPairs) {
  const model::Qwen35Config c = model::tiny_config();
  const double L = 100;
  const double one = step_flops(c, batch({0, 200}));
  const double two = step_flops(c, batch({0, 100, 200}));
  // One document of 2L tokens has 2L(2L+1)/2 causal pairs, two of L have L(L+1).
  const double pairs = 2 * L * (2 * L + 1) / 2 - L * (L + 1);
  const double per_pair = 3.0 * 4.0 * static_cast<double>(c.num_full_attention_layers()) *
                          static_cast<double>(c.num_attention_heads * c.head_dim);
  EXPECT_NEAR(one - two, per_pair * pairs, 1e-6 * one);
  // Twice the tokens in twice the documents of the same length: twice the FLOPs.
  EXPECT_NEAR(step_flops(c, batch({0, 100, 200, 300, 400})), 2 * two, 1e-9 * two);
  EXPECT_GT(matmul_params(c), 0.0);
  EXPECT_NE(flops_formula(c).find("MFU"), std::string::npos);
}

}  // namespace
}  // namespace gdn::train
