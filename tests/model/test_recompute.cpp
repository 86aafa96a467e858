// Activation recompute (issue 8): `full` and `selective` give bitwise the same loss and gradients
// as `none` (the recomputed activations are the forward's, the ops being deterministic) on the
// tiny model over packed documents, with less activation memory planned; bad policy names are
// rejected by name. Gradients placed in the activation memory give bitwise the same gradients.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include <fmt/format.h>

#include "gdn/core/error.h"
#include "model/config.h"
#include "model/qwen35.h"
#include "model/weights.h"

namespace gdn::model {
namespace {

MicroBatch packed_batch(int64_t vocab) {
  MicroBatch mb;
  const std::vector<int32_t> lens = {37, 1, 70, 20};  // 128 tokens, a 1-token document
  mb.cu_seqlens = {0};
  uint32_t x = 12345;
  for (int32_t n : lens) {
    for (int32_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      mb.input_ids.push_back(static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab)));
      mb.positions.push_back(i);
    }
    mb.cu_seqlens.push_back(mb.cu_seqlens.back() + n);
  }
  mb.labels.assign(mb.input_ids.begin() + 1, mb.input_ids.end());
  mb.labels.push_back(-100);
  for (size_t d = 1; d < mb.cu_seqlens.size(); ++d) mb.labels[mb.cu_seqlens[d] - 1] = -100;
  return mb;
}

struct Result {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  size_t activation_bytes = 0;
};

std::vector<std::vector<float>> read_grads(const Qwen35Model& m) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < m.specs().size(); ++i) {
    OwnedTensor g = OwnedTensor::zeros(DType::F32, m.specs()[i].shape, Device::CPU);
    m.read_grad(i, g.view());
    out.emplace_back(g.ptr<float>(), g.ptr<float>() + g.numel());
  }
  return out;
}

Result run_policy(Recompute r) {
  Qwen35Config c = tiny_config();
  ParamStore master(param_specs(c));
  init_params(master, c, 99);
  MicroBatch mb = packed_batch(c.vocab_size);
  Qwen35Model m(c, Backend::Cpu, mb.num_tokens(), mb.num_segments(), {.recompute = r});
  m.load_params(master);
  StepOptions so;
  so.z_loss = 1e-4;
  Result out;
  out.loss = m.step(mb, so).loss;
  out.loss += m.step(mb, so).loss;  // a second step: gradients accumulate (+=)
  out.grads = read_grads(m);
  out.activation_bytes = m.activation_bytes();
  return out;
}

// One backward step of `mb` (after a first step on `warm`, to show the gradients are written,
// not accumulated, with GradMemory::InActivations; zeroed in between with Separate).
struct OneStep {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  size_t grad_bytes = 0, activation_bytes = 0;
};
OneStep one_step(const Qwen35Config& c, Recompute r, GradMemory gm, const MicroBatch& warm,
                 const MicroBatch& mb) {
  ParamStore master(param_specs(c));
  init_params(master, c, 7);
  Qwen35Model m(c, Backend::Cpu, mb.num_tokens(), mb.num_segments(),
                {.recompute = r, .grad_memory = gm});
  m.load_params(master);
  StepOptions so;
  so.z_loss = 1e-4;
  m.zero_grads();
  m.step(warm, so);
  m.zero_grads();
  OneStep out;
  out.loss = m.step(mb, so).loss;
  out.grads = read_grads(m);
  out.grad_bytes = m.grad_bytes();
  out.activation_bytes = m.activation_bytes();
  return out;
}

TEST(Recompute, FullAndSelectiveAreBitwiseTheSameAsNone) {
  const Result none = run_policy(Recompute::None);
  for (Recompute r : {Recompute::Selective, Recompute::Full}) {
    const Result got = run_policy(r);
    EXPECT_EQ(std::memcmp(&got.loss, &none.loss, sizeof(double)), 0)
        << recompute_name(r) << ": loss " << got.loss << " vs " << none.loss;
    ASSERT_EQ(got.grads.size(), none.grads.size());
    for (size_t i = 0; i < got.grads.size(); ++i)
      EXPECT_EQ(std::memcmp(got.grads[i].data(), none.grads[i].data(),
                            got.grads[i].size() * sizeof(float)),
                0)
          << recompute_name(r) << ": gradient of parameter " << i << " differs";
  }
}

TEST(Recompute, PoliciesPlanLessActivationMemory) {
  const size_t none = run_policy(Recompute::None).activation_bytes;
  const size_t sel = run_policy(Recompute::Selective).activation_bytes;
  const size_t full = run_policy(Recompute::Full).activation_bytes;
  EXPECT_LT(sel, none);
  EXPECT_LT(full, sel);
  std::printf("activation bytes: none %zu, selective %zu, full %zu\n", none, sel, full);
}

// Gradients placed in activation memory the backward has consumed (GradMemory::InActivations)
// come out bitwise the same as in their own arena, under each recompute policy, with the
// embedding tied (the LM head's gradient group is the embedding's) and untied (the embedding's
// gradient is written last, below the layers'); and the plan needs less memory in all.
TEST(GradMemory, InActivationsGivesBitwiseTheSameGradientsInLessMemory) {
  for (bool tied : {true, false}) {
    Qwen35Config c = tiny_config();
    c.tie_word_embeddings = tied;
    const MicroBatch mb = packed_batch(c.vocab_size);
    MicroBatch warm = mb;  // another batch of the same shape: different ids and labels
    for (int32_t& id : warm.input_ids) id = (id * 7 + 3) % static_cast<int32_t>(c.vocab_size);
    // Each policy once (tied: none and full; untied: selective) keeps the test short.
    const std::vector<Recompute> policies =
        tied ? std::vector<Recompute>{Recompute::None, Recompute::Full}
             : std::vector<Recompute>{Recompute::Selective};
    for (Recompute r : policies) {
      const OneStep sep = one_step(c, r, GradMemory::Separate, warm, mb);
      const OneStep in = one_step(c, r, GradMemory::InActivations, warm, mb);
      const std::string what =
          fmt::format("{}, {}", recompute_name(r), tied ? "tied embedding" : "untied embedding");
      EXPECT_EQ(std::memcmp(&in.loss, &sep.loss, sizeof(double)), 0)
          << what << ": loss " << in.loss << " vs " << sep.loss;
      ASSERT_EQ(in.grads.size(), sep.grads.size());
      for (size_t i = 0; i < in.grads.size(); ++i) {
        bool nonzero = false;
        for (float v : sep.grads[i]) nonzero |= v != 0.0f;
        EXPECT_TRUE(nonzero) << what << ": parameter " << i << " has an all-zero gradient";
        EXPECT_EQ(std::memcmp(in.grads[i].data(), sep.grads[i].data(),
                              in.grads[i].size() * sizeof(float)),
                  0)
            << what << ": gradient of parameter " << i << " differs";
      }
      EXPECT_EQ(in.grad_bytes, 0u) << what;
      EXPECT_GT(sep.grad_bytes, 0u) << what;
      EXPECT_LT(in.activation_bytes, sep.activation_bytes + sep.grad_bytes) << what;
    }
  }
}

TEST(Recompute, NamesRoundTripAndBadNamesAreRejected) {
  for (Recompute r : {Recompute::None, Recompute::Full, Recompute::Selective})
    EXPECT_EQ(recompute_from_name(recompute_name(r)), r);
  try {
    recompute_from_name("partial");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'partial'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gdn::model
