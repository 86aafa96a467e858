// The model's planned op workspace on the GPU (issue 22, gdn/backend/op_workspace.h): the model
// plans one region for the kernels' temporaries, shows it in the memory plan, and binds it for the
// steps of batches of up to the documents it is planned for (a request beyond it would then be an
// error, not a grow); a batch of more documents runs on the grow-only scratch. The loss and every
// gradient are bitwise the same either way.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gdn/core/tensor.h"
#include "model/config.h"
#include "model/micro_batch.h"
#include "model/qwen35.h"
#include "model/weights.h"

namespace gdn::model {
namespace {

// `docs` documents of `len` tokens each, pseudo-random ids.
MicroBatch batch(int64_t vocab, int docs, int len) {
  std::vector<std::vector<int32_t>> d(static_cast<size_t>(docs));
  uint32_t x = 777;
  for (auto& doc : d)
    for (int i = 0; i < len; ++i) {
      x = x * 1664525u + 1013904223u;
      doc.push_back(static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab)));
    }
  return micro_batch_of_documents(d);
}

struct Result {
  double loss = 0;
  std::vector<std::vector<float>> grads;
};

Result step(Qwen35Model& m, const ParamStore& master, const MicroBatch& mb) {
  m.load_params(master);
  m.zero_grads();
  StepOptions so;
  Result r;
  r.loss = m.step(mb, so).loss;
  for (size_t i = 0; i < m.specs().size(); ++i) {
    OwnedTensor g = OwnedTensor::zeros(DType::F32, m.specs()[i].shape, Device::CPU);
    m.read_grad(i, g.view());
    r.grads.emplace_back(g.ptr<float>(), g.ptr<float>() + g.numel());
  }
  return r;
}

TEST(OpWorkspaceModelCuda, PlannedRegionIsBoundAndGivesTheUnboundBits) {
  ASSERT_TRUE(cuda_available());
  const Qwen35Config c = tiny_config();
  ParamStore master(param_specs(c));
  init_params(master, c, 5);
  const MicroBatch mb = batch(c.vocab_size, 4, 64);  // 256 tokens in 4 documents

  // Planned for 1024 / 128 = 8 documents: the 4-document batch's step binds the region.
  Qwen35Model planned(c, Backend::Cuda, 1024, 1024, {.recompute = Recompute::None});
  EXPECT_EQ(planned.op_workspace_docs(), 8);
  EXPECT_GT(planned.op_workspace_bytes(), 0u);
  const std::string plan = planned.memory_plan();
  EXPECT_NE(plan.find("op workspace"), std::string::npos) << plan;
  std::printf("%s\n", plan.c_str());
  // Planned for 256 / 128 = 2 documents: the same batch runs unbound (and, past the GDR `saved`
  // plan of 2 documents too, recomputes its states: bitwise the same, op.h).
  Qwen35Model unbound(c, Backend::Cuda, 256, 256, {.recompute = Recompute::None});
  EXPECT_EQ(unbound.op_workspace_docs(), 2);

  const Result a = step(planned, master, mb), b = step(unbound, master, mb);
  ASSERT_TRUE(std::isfinite(a.loss));
  EXPECT_EQ(a.loss, b.loss);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_EQ(a.grads[i], b.grads[i]) << "gradient of " << planned.specs()[i].name;

  // The planned model also takes a batch of more documents than it is planned for (unbound).
  const Result many = step(planned, master, batch(c.vocab_size, 32, 32));
  EXPECT_TRUE(std::isfinite(many.loss));
}

TEST(OpWorkspaceModelCuda, HostModelsPlanNoWorkspace) {
  const Qwen35Config c = tiny_config();
  Qwen35Model m(c, Backend::Cpu, 256, 256, {});
  EXPECT_EQ(m.op_workspace_bytes(), 0u);
  EXPECT_EQ(m.memory_plan().find("op workspace"), std::string::npos);
}

}  // namespace
}  // namespace gdn::model
