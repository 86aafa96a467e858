// AdamW on the CPU: fp32, multi-tensor. Every call cuts its whole list of tensors into chunks of
// kChunk elements and runs them all in one OpenMP loop, so a model's ~hundreds of small tensors
// (norm weights, A_log, ...) cost one parallel region, not one each.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "gdn/core/split_f32.h"
#include "ops/adamw/op.h"

namespace gdn::ops {

namespace {
// 64K elements: 256 KB of fp32 per stream, large enough to amortise scheduling and small enough
// to balance across threads. grad_sumsq's result depends on this boundary (fixed, so it is
// deterministic), the step's does not.
constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  int32_t tensor;
  int64_t begin, end;
};

template <class Get>
std::vector<Chunk> chunks_of(size_t count, Get numel) {
  std::vector<Chunk> out;
  for (size_t i = 0; i < count; ++i)
    for (int64_t b = 0; b < numel(i); b += kChunk)
      out.push_back({static_cast<int32_t>(i), b, std::min(numel(i), b + kChunk)});
  return out;
}

void step(const AdamWStep& s) {
  const AdamWHyper& h = s.hyper;
  const double grad_scale = host_clip_decision(s);
  if (grad_scale < 0) return;  // a non-finite sum or loss: the step is skipped
  // Scalars in fp64 on the host, rounded once to fp32 (torch's foreach AdamW does the same).
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, t), bc2 = 1.0 - std::pow(h.beta2, t);
  const float step_size = static_cast<float>(h.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const float b1 = static_cast<float>(h.beta1), omb1 = static_cast<float>(1.0 - h.beta1);
  const float b2 = static_cast<float>(h.beta2), omb2 = static_cast<float>(1.0 - h.beta2);
  const float eps = static_cast<float>(h.eps), scale = static_cast<float>(grad_scale);
  const std::vector<Chunk> work =
      chunks_of(s.params.size(), [&](size_t i) { return s.params[i].p.numel(); });
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < work.size(); ++c) {
    const AdamWParam& e = s.params[static_cast<size_t>(work[c].tensor)];
    const bool split = e.p.dtype() == DType::I16;
    float* p = split ? nullptr : e.p.ptr<float>();                   // [n] F32 master
    int16_t* lo = split ? e.p.ptr<int16_t>() : nullptr;              // [n] or the split's low half
    const float* g = e.g.ptr<float>();                               // [n]
    float* m = e.m.ptr<float>();                                     // [n]
    float* v = e.v.ptr<float>();                                     // [n]
    bf16* pb = e.p_bf16.defined() ? e.p_bf16.ptr<bf16>() : nullptr;  // [n] or none
    const float df = e.decay ? decay_factor : 1.0f;
    for (int64_t i = work[c].begin; i < work[c].end; ++i) {
      const float gi = scale * g[i];
      const float mi = b1 * m[i] + omb1 * gi;
      const float vi = b2 * v[i] + omb2 * gi * gi;
      m[i] = mi;
      v[i] = vi;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      const float p0 = split ? f32_from_bits(split_join(pb[i].bits, lo[i])) : p[i];
      const float pi = p0 * df - step_size * mi / denom;
      if (split) {
        const uint32_t b = f32_bits(pi);
        pb[i].bits = split_hi(b);
        lo[i] = split_lo(b, pb[i].bits);
      } else {
        p[i] = pi;
        if (pb != nullptr) pb[i] = to_bf16(pi);
      }
    }
  }
}

double grad_sumsq(std::span<const Tensor> grads) {
  const std::vector<Chunk> work =
      chunks_of(grads.size(), [&](size_t i) { return grads[i].numel(); });
  std::vector<double> part(work.size());
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < work.size(); ++c) {
    const float* g = grads[static_cast<size_t>(work[c].tensor)].ptr<float>();  // [n]
    double s = 0;
    for (int64_t i = work[c].begin; i < work[c].end; ++i)
      s += static_cast<double>(g[i]) * static_cast<double>(g[i]);
    part[c] = s;
  }
  double total = 0;
  for (double x : part) total += x;  // fixed order: independent of the thread count
  return total;
}

void grad_sumsq_into(std::span<const Tensor> grads, const Tensor& out) {
  out.ptr<double>()[0] = grad_sumsq(grads);
}

void refresh_bf16(std::span<const Bf16Copy> copies) {
  const std::vector<Chunk> work =
      chunks_of(copies.size(), [&](size_t i) { return copies[i].master.numel(); });
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < work.size(); ++c) {
    const Bf16Copy& cp = copies[static_cast<size_t>(work[c].tensor)];
    const float* src = cp.master.ptr<float>();                       // [n]
    bf16* dst = cp.copy.ptr<bf16>();                                 // [n]
    int16_t* lo = cp.lo.defined() ? cp.lo.ptr<int16_t>() : nullptr;  // [n] or none
    if (lo == nullptr) {
      for (int64_t i = work[c].begin; i < work[c].end; ++i) dst[i] = to_bf16(src[i]);
    } else {
      for (int64_t i = work[c].begin; i < work[c].end; ++i) {
        const uint32_t b = f32_bits(src[i]);
        dst[i].bits = split_hi(b);
        lo[i] = split_lo(b, dst[i].bits);
      }
    }
  }
}

const AdamWTable kTable{step, grad_sumsq, grad_sumsq_into, refresh_bf16};
}  // namespace

GDN_REGISTER(adamw_cpu) {
  Registry::global().add_impl({"adamw", "cpu.multi_tensor", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
