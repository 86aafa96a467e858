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

// Only the well-conditioned fixture: the others (initializer_range 0.2) amplify rounding through
// the layers ~10^3-fold, so bf16 cannot match them (their fp32 errors are already ~1e-4; seen on
// the H200, 2026-11-29: r2_untied layer-0 gradients off by 30x in bf16 while the loss agreed to
// 4e-4).
// prod_dims has Qwen3.5's head dims (attention hd 256, GDN dk = dv = 128): the kernels production
// shapes run.
INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenCuda, ::testing::Values("r2_std_init", "prod_dims"));

}  // namespace
}  // namespace gdn::model
