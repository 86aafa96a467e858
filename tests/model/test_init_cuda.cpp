// Parameter initialisation on the device (issue 8, launch to first step): every kind of initial
// value drawn on the GPU equals the host's (the same Philox counters; Box-Muller and log in double
// on both sides, so a value may differ by at most one float ulp where the GPU's libm rounds a
// double differently).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "gdn/core/tensor.h"
#include "model/config.h"
#include "model/weights.h"

namespace gdn::model {
namespace {

int64_t ulp_distance(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if ((ia < 0) != (ib < 0)) return a == b ? 0 : INT64_MAX;  // +0 / -0
  return std::abs(static_cast<int64_t>(ia) - static_cast<int64_t>(ib));
}

TEST(InitCuda, DeviceInitialisationMatchesTheHostDrawForDraw) {
  ASSERT_TRUE(cuda_available());
  Qwen35Config c = tiny_config();
  c.pad_token_id = 3;
  const auto specs = param_specs(c);
  int64_t total = 0, differing = 0, worst = 0;
  bool saw_alog = false, saw_ones = false, saw_embed = false;
  for (const auto& s : specs) {
    OwnedTensor host = OwnedTensor::zeros(DType::F32, s.shape, Device::CPU);
    OwnedTensor dev = OwnedTensor::zeros(DType::F32, s.shape, Device::CUDA);
    init_param(s, host.view(), c, 1234);
    init_param(s, dev.view(), c, 1234);
    OwnedTensor back = convert(dev.view(), DType::F32, Device::CPU);
    const float* h = host.ptr<float>();
    const float* d = back.ptr<float>();
    for (int64_t i = 0; i < s.numel(); ++i) {
      ASSERT_TRUE(std::isfinite(d[i])) << s.name << "[" << i << "]";
      const int64_t u = ulp_distance(h[i], d[i]);
      worst = std::max(worst, u);
      differing += u != 0;
    }
    total += s.numel();
    saw_alog |= s.init == InitKind::ALog;
    saw_ones |= s.init == InitKind::Ones;
    saw_embed |= s.init == InitKind::Embedding;
  }
  EXPECT_TRUE(saw_alog && saw_ones && saw_embed);
  EXPECT_LE(worst, 1) << "a device value is more than one float ulp from the host's";
  EXPECT_LE(differing, total / 10000) << differing << " of " << total << " values differ";
  std::printf("%lld values, %lld differ by one ulp\n", static_cast<long long>(total),
              static_cast<long long>(differing));
}

TEST(InitCuda, DeviceInitialisationRejectsBf16Tensors) {
  Qwen35Config c = tiny_config();
  const auto specs = param_specs(c);
  OwnedTensor t = OwnedTensor::zeros(DType::BF16, specs[0].shape, Device::CUDA);
  EXPECT_THROW(init_param(specs[0], t.view(), c, 1), Error);
}

}  // namespace
}  // namespace gdn::model
