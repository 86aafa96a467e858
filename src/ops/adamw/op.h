// AdamW over fp32 master weights (torch.optim.AdamW semantics: amsgrad off, maximize off), global
// gradient-norm clipping, and the bf16 compute-copy refresh. Multi-tensor: one call updates a
// whole list of parameters.
//
// Update, for every element of every parameter tensor, at step t (1-based, one counter for the
// whole call), with s = hyper.grad_scale (the clip scale from clip_scale(), times any other
// factor the caller folds in, e.g. 1 / accumulation steps):
//   g  = s * grad
//   m  = b1 * m + (1 - b1) * g
//   v  = b2 * v + (1 - b2) * g^2
//   p  = p - lr * wd * p                                  only for tensors with decay == true
//   p  = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//   p_bf16 = bf16(p), round to nearest even                only for tensors with a compute copy
// The decay uses p before the Adam term, as torch does (p.mul_(1 - lr * wd) first). Callers set
// decay = false for norm weights, A_log, dt_bias and embeddings. A zero gradient still moves p
// (momentum, decay), as in torch; with m = v = 0 the Adam term is exactly 0.
// cpu evaluates it in fp32 with torch's scalar handling (foreach path): 1 - b1^t, lr / (1 - b1^t),
// sqrt(1 - b2^t) and 1 - lr * wd are formed in fp64 on the host and rounded to fp32 once; then
// m and v as above, denom = sqrt(v) / sqrt(1 - b2^t) + eps, p = p * (1 - lr * wd) - step_size *
// m / denom. (torch forms m with lerp, m + (1 - b1)(g - m): equal in exact arithmetic.)
// ref evaluates the formula above literally in fp64.
//
// Clipping (torch.nn.utils.clip_grad_norm_ with the L2 norm):
//   norm  = sqrt(sum over all tensors and elements of grad^2)      grad_global_norm(), fp64 sums
//   scale = min(1, max_norm / (norm + 1e-6)); 1 when max_norm <= 0 clip_scale()
// The caller passes scale as hyper.grad_scale; gradients are not modified. A non-finite norm is
// an error in clip_scale (the trainer must skip the step, not scale by NaN).
//
// Split masters (cpu and cuda): an entry whose p is I16 keeps its fp32 master weights as two
// halves, p_bf16 (required) the high one and p the low one (gdn/core/split_f32.h: the master's
// bits are split_join(p_bf16, p)). The step joins them, applies the fp32 update above (the same
// bits as with an F32 p holding the joined value, aligned or not: cuda rounds every operation
// of the update explicitly, so no path contracts a multiply-add) and splits the result back: the
// compute copy is then the master rounded to nearest with ties away from zero (split_hi) instead of
// ties to even. 4 bytes a parameter for master and compute copy together instead of 6. One call may
// mix split and F32 entries; g, m and v are F32 in both.
//
// Shapes: p, g, m, v (and p_bf16) of one entry share one shape (any rank); entries may differ.
// Outputs: p, m, v updated in place (=); p_bf16 written (=). g is read only.
// Dtypes: p, g, m, v F32 on cpu and cuda (fp32 masters, fp32 gradient accumulation), F64 on ref;
// p may be I16 on cpu and cuda (split masters, above); p_bf16 always BF16 (the cuda compute copy;
// on cpu the op exists with a host bf16 output).
// Deterministic: yes. The step is elementwise. grad_global_norm sums fixed 64K-element chunks in
// fp64 and adds the chunk sums in order, so the norm is bitwise independent of the thread count.
// cuda: the same in 32768-element units (a fixed order that depends on the tensor sizes only).
//
// cuda launches (src/ops/adamw/cuda.cu): the tensors of one call go to the kernels in lists of up
// to 128 passed as kernel arguments (no device table to build, nothing allocated or copied): a
// call over a whole model (hundreds of tensors) is a handful of launches, balanced over 4096-
// element units whatever the tensor sizes. step and refresh_bf16 never synchronise with the host;
// grad_sumsq synchronises once, to return its host double; grad_sumsq_into and a step with
// clip.sumsq never do (the trainer's path on the device).
// Pointers that are not 16-byte aligned (8-byte for the bf16 copy) are handled, on a slower
// per-element path.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct AdamWParam {
  Tensor p;               // [*] master weights, in/out; I16: the low half of a split master
  Tensor g;               // [*] gradient, read only
  Tensor m;               // [*] first moment, in/out
  Tensor v;               // [*] second moment, in/out
  Tensor p_bf16;          // [*] BF16 compute copy, out (=), in/out with an I16 p; undefined: none
  bool decay = true;      // apply decoupled weight decay to this tensor
  std::string_view name;  // for error messages ("" -> "params[i]")
};

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;         // t, 1-based: the number of updates including this one
  double grad_scale = 1.0;  // multiplies every gradient (clip scale)
};

// Clipping and skipping decided where the tensors live, without a host round trip (a training
// step never waits for the device, issue 8). When sumsq is defined (F64 [1] on the parameters'
// device, written by grad_sumsq_into), the step computes there, in fp64,
//   scale = hyper.grad_scale * clip_scale(sqrt(sumsq), max_norm)
// (bitwise what the host would pass as grad_scale) and, when the sum or any of `losses`
// (optional, F32 or F64 [n] on the same device: the step's losses) is not finite, leaves every
// tensor unchanged (p, m, v and the bf16 copy): the step is skipped.
struct AdamWClip {
  Tensor sumsq;
  Tensor losses;
  double max_norm = 0;  // <= 0: no clipping (non-finite values still skip)
};

struct AdamWStep {
  std::span<const AdamWParam> params;
  AdamWHyper hyper;
  AdamWClip clip;  // undefined sumsq: hyper.grad_scale as given
};

// A master tensor and the BF16 copy refreshed from it (rounded to nearest even), or, with lo
// defined, split into copy = split_hi and lo = split_lo (the halves of a split master, above).
struct Bf16Copy {
  Tensor master;  // [*] F32 (F64 on ref)
  Tensor copy;    // [*] BF16 out (=)
  Tensor lo{};    // [*] I16 out (=), optional (cpu and cuda): the split's low half
};

struct AdamWTable {
  void (*step)(const AdamWStep&);
  double (*grad_sumsq)(std::span<const Tensor> grads);  // sum of squares, fp64 accumulation
  // The same sum written to `out` (one double on the gradients' device), without waiting.
  void (*grad_sumsq_into)(std::span<const Tensor> grads, const Tensor& out);
  void (*refresh_bf16)(std::span<const Bf16Copy> copies);
};

// Validate, resolve the implementation for the tensors' backend, run. An empty list is a no-op.
void adamw_step(std::span<const AdamWParam> params, const AdamWHyper& hyper,
                const AdamWClip& clip = {});
double grad_global_norm(std::span<const Tensor> grads);
// The sum of squares of grad_global_norm (the same bits), into out: F64 [1] on the gradients'
// device; on cuda it is issued on the compute stream and does not wait.
void grad_sumsq_into(std::span<const Tensor> grads, const Tensor& out);
double clip_scale(double norm, double max_norm);
// For host implementations of the step: the gradient scale of `s` (hyper.grad_scale, or with
// clip.sumsq defined grad_scale * clip_scale(sqrt(sumsq), max_norm) read from host memory), or -1
// when the step must be skipped (a non-finite sum or loss).
double host_clip_decision(const AdamWStep& s);
void adamw_refresh_bf16(std::span<const Bf16Copy> copies);

// The dtype of p, g, m, v for a backend's activation dtype (F64 for ref, F32 otherwise).
inline DType adamw_state_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

// CUDA workspace (gdn/backend/op_workspace.h). A step with a clip takes kAdamWClipBytes (its
// control: 2 fp32); grad_sumsq / grad_sumsq_into take one fp64 partial sum per kAdamWSumUnit
// elements of each gradient plus one for the result (adamw_sumsq_bytes of the gradients' units).
// adamw_workspace_bytes bounds every request of the optimizer's calls over gradients of the given
// element counts. The optimizer runs outside the model's planned step: the trainer binds a region
// of this size around the update (src/train/trainer.cpp); other callers take the unbound,
// grow-only scratch.
inline constexpr int64_t kAdamWSumUnit = 32768;
inline constexpr size_t kAdamWClipBytes = 2 * sizeof(float);
inline int64_t adamw_sumsq_units(int64_t numel) {
  return (std::max<int64_t>(numel, 0) + kAdamWSumUnit - 1) / kAdamWSumUnit;
}
inline size_t adamw_sumsq_bytes(int64_t units) {
  return static_cast<size_t>(units + 1) * sizeof(double);
}
inline size_t adamw_workspace_bytes(std::span<const int64_t> grad_numels) {
  int64_t units = 0;
  for (const int64_t n : grad_numels) units += adamw_sumsq_units(n);
  return std::max(kAdamWClipBytes, adamw_sumsq_bytes(units));
}

}  // namespace gdn::ops
