// The clip-on-the-device path of AdamW (op.h, AdamWClip) checked on one device, shared by the cpu
// test (test_adamw.cpp) and the cuda one (test_adamw_cuda.cpp): grad_sumsq_into writes the bits of
// grad_global_norm's sum; a step that reads that sum (and the step's losses) updates p, m, v and
// the bf16 copy bit for bit as the step given the host's clip_scale does, with clipping active and
// inactive; a non-finite sum or loss leaves every tensor unchanged; neither call drains the device.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gdn/core/rng.h"
#include "ops/adamw/op.h"

namespace gdn::ops::testing_adamw {

// p, g, m, v and a bf16 copy per tensor, F32 on `device`.
struct ClipSet {
  std::vector<OwnedTensor> t;  // 5 per parameter
  std::vector<AdamWParam> params;
  std::vector<Tensor> grads;

  ClipSet(const std::vector<int64_t>& sizes, Device device) {
    for (size_t k = 0; k < sizes.size(); ++k)
      for (int j = 0; j < 5; ++j) {
        std::vector<double> x(static_cast<size_t>(sizes[k]));
        for (size_t i = 0; i < x.size(); ++i) {
          const double r = rng::normal(40 + 5 * k + static_cast<uint64_t>(j), 2, i);
          x[i] = j == 3 ? 0.01 * r * r : (j == 1 ? 3.0 : 1.0) * r;  // v >= 0, large gradients
        }
        t.push_back(from_f64(x, j == 4 ? DType::BF16 : DType::F32, {sizes[k]}, device));
      }
    for (size_t k = 0; k < sizes.size(); ++k) {
      params.push_back(
          {t[5 * k], t[5 * k + 1], t[5 * k + 2], t[5 * k + 3], t[5 * k + 4], k != 1, {}});
      grads.push_back(t[5 * k + 1]);
    }
  }
  std::vector<std::vector<uint8_t>> bytes() const {
    std::vector<std::vector<uint8_t>> out;
    for (const OwnedTensor& x : t) {
      const Tensor& v = x.view();
      std::vector<uint8_t> b(static_cast<size_t>(v.nbytes()));
      copy_bytes(b.data(), Device::CPU, v.data(), v.device(), b.size());
      out.push_back(std::move(b));
    }
    return out;
  }
};

inline OwnedTensor scalars_f32(std::vector<double> x, Device device) {
  return from_f64(x, DType::F32, {static_cast<int64_t>(x.size())}, device);
}

inline void check_clip_on_device(Device device) {
  const std::vector<int64_t> sizes = {5, 70001, 1, 4100};
  ClipSet host(sizes, device), dev(sizes, device);
  auto sumsq = OwnedTensor::zeros(DType::F64, {1}, device);
  auto losses = scalars_f32({2.5, 3.0}, device);
  {
    // The first call of a shape class resolves it, and its probe waits for the device: resolve
    // the device path's classes on a throwaway copy before counting the step's own drains.
    ClipSet warm(sizes, device);
    auto warm_sumsq = OwnedTensor::zeros(DType::F64, {1}, device);
    grad_sumsq_into(warm.grads, warm_sumsq);
    AdamWHyper h;
    h.step = 1;
    adamw_step(warm.params, h, AdamWClip{warm_sumsq, losses, 1.0});
  }
  double norm = 0;
  for (int64_t t = 1; t <= 3; ++t) {
    norm = grad_global_norm(host.grads);
    const double max_norm = t == 2 ? 1e9 : 0.25 * norm;  // step 2 does not clip
    AdamWHyper h;
    h.lr = 2e-2;
    h.step = t;
    h.weight_decay = 0.1;
    h.grad_scale = clip_scale(norm, max_norm);
    adamw_step(host.params, h);
    const uint64_t before = device_drains();
    grad_sumsq_into(dev.grads, sumsq);
    h.grad_scale = 1.0;
    adamw_step(dev.params, h, AdamWClip{sumsq, losses, max_norm});
    EXPECT_EQ(device_drains(), before) << "the device path waited for the device, step " << t;
    double ss = 0;
    copy_bytes(&ss, Device::CPU, sumsq.view().data(), device, sizeof(double));
    EXPECT_EQ(std::sqrt(ss), norm) << "step " << t;
    const auto a = host.bytes(), b = dev.bytes();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(a[i], b[i]) << "tensor " << i / 5 << " field " << i % 5 << " step " << t;
  }
  // Non-finite sum or loss: nothing changes.
  const auto before = dev.bytes();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  AdamWHyper h;
  h.step = 4;
  auto bad_losses = scalars_f32({2.5, nan}, device);
  grad_sumsq_into(dev.grads, sumsq);
  adamw_step(dev.params, h, AdamWClip{sumsq, bad_losses, 1.0});
  EXPECT_EQ(dev.bytes(), before) << "a NaN loss must skip the step";
  const double inf = std::numeric_limits<double>::infinity();
  copy_bytes(sumsq.view().data(), device, &inf, Device::CPU, sizeof(double));
  adamw_step(dev.params, h, AdamWClip{sumsq, losses, 0.0});
  EXPECT_EQ(dev.bytes(), before) << "an infinite sum of squares must skip the step";
  copy_bytes(sumsq.view().data(), device, &nan, Device::CPU, sizeof(double));
  adamw_step(dev.params, h, AdamWClip{sumsq, Tensor(), 1.0});
  EXPECT_EQ(dev.bytes(), before) << "a NaN sum of squares must skip the step";
}

}  // namespace gdn::ops::testing_adamw
