// AdamW reference: the update formula of op.h evaluated literally in fp64, tensor by tensor,
// element by element, no threading. The oracle for every other implementation.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/adamw/op.h"

namespace gdn::ops {

namespace {
// fp64 -> bf16 rounded to nearest even in one step. Going through float first can round twice:
// when d rounds to a float that lies exactly halfway between two bf16 values while d itself does
// not, the float tie would go to even although d is nearer one side. That one case is fixed here.
uint16_t f64_to_bf16_bits(double d) {
  const float f = static_cast<float>(d);
  const uint32_t u = f32_bits(f);
  const bool exact_tie = (u & 0xffffu) == 0x8000u;
  if (std::isfinite(f) && exact_tie && static_cast<double>(f) != d) {
    const uint32_t toward_zero = u & 0xffff0000u;  // bf16 neighbour of smaller magnitude
    const bool up = std::abs(d) > std::abs(static_cast<double>(f));
    return static_cast<uint16_t>((up ? toward_zero + 0x10000u : toward_zero) >> 16);
  }
  return float_to_bf16_bits(f);
}

void step(const AdamWStep& s) {
  const AdamWHyper& h = s.hyper;
  const double scale = host_clip_decision(s);
  if (scale < 0) return;  // a non-finite sum or loss: the step is skipped
  const double t = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, t), bc2 = 1.0 - std::pow(h.beta2, t);
  for (const AdamWParam& e : s.params) {
    const int64_t n = e.p.numel();
    double* p = e.p.ptr<double>();        // [n]
    const double* g = e.g.ptr<double>();  // [n]
    double* m = e.m.ptr<double>();        // [n]
    double* v = e.v.ptr<double>();        // [n]
    for (int64_t i = 0; i < n; ++i) {
      const double gi = scale * g[i];
      m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
      v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
      if (e.decay) p[i] -= h.lr * h.weight_decay * p[i];
      p[i] -= h.lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + h.eps);
    }
    if (e.p_bf16.defined()) {
      bf16* out = e.p_bf16.ptr<bf16>();  // [n]
      for (int64_t i = 0; i < n; ++i) out[i].bits = f64_to_bf16_bits(p[i]);
    }
  }
}

double grad_sumsq(std::span<const Tensor> grads) {
  double s = 0;
  for (const Tensor& t : grads) {
    const double* g = t.ptr<double>();  // [n]
    for (int64_t i = 0; i < t.numel(); ++i) s += g[i] * g[i];
  }
  return s;
}

void grad_sumsq_into(std::span<const Tensor> grads, const Tensor& out) {
  out.ptr<double>()[0] = grad_sumsq(grads);
}

void refresh_bf16(std::span<const Bf16Copy> copies) {
  for (const Bf16Copy& c : copies) {
    const double* src = c.master.ptr<double>();  // [n]
    bf16* dst = c.copy.ptr<bf16>();              // [n]
    for (int64_t i = 0; i < c.master.numel(); ++i) dst[i].bits = f64_to_bf16_bits(src[i]);
  }
}

const AdamWTable kTable{step, grad_sumsq, grad_sumsq_into, refresh_bf16};
}  // namespace

GDN_REGISTER(adamw_ref) {
  Registry::global().add_impl({"adamw", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
