// Activation recompute (issue 8): `full` and `selective` give bitwise the same loss and gradients
// as `none` (the recomputed activations are the forward's, the ops being deterministic) on the
// tiny model over packed documents, with less activation memory planned; bad policy names are
// rejected by name.
#include <gtest/gtest.h>

#include <cstring>

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

Result run_policy(Recompute r) {
  Qwen35Config c = tiny_config();
  ParamStore master(param_specs(c));
  init_params(master, c, 99);
  MicroBatch mb = packed_batch(c.vocab_size);
  Qwen35Model m(c, Backend::Cpu, mb.num_tokens(), mb.num_segments(), r);
  m.load_params(master);
  StepOptions so;
  so.z_loss = 1e-4;
  Result out;
  out.loss = m.step(mb, so).loss;
  out.loss += m.step(mb, so).loss;  // a second step: gradients accumulate (+=)
  for (size_t i = 0; i < m.specs().size(); ++i) {
    OwnedTensor g = OwnedTensor::zeros(DType::F32, m.specs()[i].shape, Device::CPU);
    m.read_grad(i, g.view());
    out.grads.emplace_back(g.ptr<float>(), g.ptr<float>() + g.numel());
  }
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
