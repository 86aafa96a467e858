// The decoder on the cuda backend against Hugging Face transformers' Qwen3.5 (the same golden
// fixtures as test_golden.cpp): bf16 activations and weights, fp32 gates, states and gradients.
#include "support/golden_util.h"

namespace gdn::model {
namespace {

class GoldenCuda : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenCuda, CudaMatchesHuggingFaceToBf16Precision) {
  testing::Errors e = testing::compare(GetParam(), Backend::Cuda);
  std::printf("%s cuda: logits %.2e loss %.2e grad %.2e (%s)\n", GetParam().c_str(), e.logits,
              e.loss, e.grad, e.worst_grad.c_str());
  // bf16 weights (2^-9 relative each) and bf16 activations between ops, through 4 layers and back.
  EXPECT_LE(e.logits, 3e-2);
  EXPECT_LE(e.loss, 1e-2);
  EXPECT_LE(e.grad, 1.5e-1) << e.worst_grad;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenCuda,
                         ::testing::Values("r2_untied", "r1_tied", "nested_vl"));

}  // namespace
}  // namespace gdn::model
