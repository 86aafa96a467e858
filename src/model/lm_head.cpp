// The final norm and the LM-head loss (gdn_spec.md §1.3): hn = rmsnorm1p(h; model.norm),
// loss = mean cross-entropy (+ z-loss) of hn · W_headᵀ (the tied embedding or lm_head), never
// materialising the [T, V] logits but in chunks.
#include <algorithm>
#include <limits>
#include <vector>

#include "gdn/core/profile.h"
#include "model/step.h"
#include "ops/cross_entropy/op.h"
#include "ops/gemm/op.h"
#include "ops/linear_cross_entropy/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn::model {

using namespace gdn::ops;

namespace {

// The loss's tensors (Step::bwd): those that live to the end of the step, then the head's own.
struct HeadTensors {
  Tensor rstd, row_loss, row_z, loss, lse, zl, dhn, tl_lse, tl_z;
  size_t mark = 0;
  Tensor hn, ws, logits_chunk;
};

HeadTensors alloc_head(Step& st) {
  const int64_t T = st.T, D = st.cfg.hidden_size, V = st.cfg.vocab_size;
  const bool fused = st.fused.lm_head;
  HeadTensors h;
  h.rstd = st.balloc(st.stat, {T});
  h.row_loss = fused ? Tensor() : st.balloc(st.stat, {T});
  h.row_z = fused ? Tensor() : st.balloc(st.stat, {T});
  h.loss = st.balloc(st.stat, {1});
  h.lse = st.balloc(st.stat, {T});
  h.zl = st.balloc(st.stat, {1});
  h.dhn = st.balloc_act({T, D});
  h.tl_lse = st.balloc(st.stat, {T});  // per-token lse / z-loss when token_loss is asked for
  h.tl_z = st.balloc(st.stat, {T});
  h.mark = st.bwd.used();
  h.hn = st.balloc_act({T, D});
  // The fused route's workspace, or (kernels.fused_lm_head false) the unfused route's logits
  // chunk [lm_chunk_rows, V].
  const int64_t ws_bytes =
      fused ? linear_cross_entropy_workspace_bytes(st.max_tokens, V, st.lce_chunk_bytes) : 0;
  h.ws = fused ? st.balloc(DType::F32, {(ws_bytes + 3) / 4}) : Tensor();
  h.logits_chunk = fused ? Tensor() : st.balloc_act({st.lm_chunk_rows, V});
  return h;
}

// linear_cross_entropy over hn: the loss (and its gradients dhn, dW with a backward).
void fused_loss(Step& st, const HeadTensors& h, const Tensor& W, const Tensor& dW,
                const StepOptions& opt, int64_t targets, StepStats* stats) {
  ProfileRange pr("lm_head_loss");
  // The inputs both calls share; each sets its own outputs and reduction.
  LinearCrossEntropyArgs common;
  common.x = h.hn;
  common.w = W;
  common.targets = st.labels;
  common.workspace = h.ws;
  common.chunk_bytes = st.lce_chunk_bytes;
  if (opt.token_loss.defined()) {
    LinearCrossEntropyArgs la = common;
    la.loss = opt.token_loss;
    la.lse = h.tl_lse;
    la.z_loss = h.tl_z;
    la.reduction = LceReduction::None;
    linear_cross_entropy_forward(la);
  }
  LinearCrossEntropyArgs la = common;
  la.loss = h.loss;
  la.lse = h.lse;
  la.z_loss = h.zl;
  la.reduction = LceReduction::Mean;
  la.z_loss_scale = opt.z_loss;
  la.denominator = opt.loss_denominator;
  if (st.backward) {
    la.dx = h.dhn;
    la.dw = dW;
    linear_cross_entropy_forward_backward(la);
  } else {
    linear_cross_entropy_forward(la);
  }
  stats->loss_dev = h.loss;
  stats->z_loss_dev = h.zl;
  if (opt.host_stats) {
    stats->loss = to_f64_vector(h.loss)[0];
    stats->z_loss = to_f64_vector(h.zl)[0];
  } else {
    stats->loss = stats->z_loss = std::numeric_limits<double>::quiet_NaN();
  }
  stats->targets = targets;
}

// kernels.fused_lm_head false: per chunk of rows, the logits by gemm, the cross_entropy pass
// (loss, lse, z-loss and, for the backward, c dL/dz over the logits), then dx = G W (=) and dW
// += G^T x by gemm. The mean over the denominator (as linear_cross_entropy's: the caller's, else
// this batch's targets; 0 gives loss 0 and zero gradients) is c = 1 / den; the rows are summed on
// the host in double.
void unfused_loss(Step& st, const HeadTensors& h, const Tensor& W, const Tensor& dW,
                  const StepOptions& opt, int64_t targets, StepStats* stats) {
  const int64_t T = st.T;
  const double den =
      opt.loss_denominator >= 0 ? opt.loss_denominator : static_cast<double>(targets);
  const double c = den > 0 ? 1.0 / den : 0.0;
  for (int64_t r0 = 0; r0 < T; r0 += st.lm_chunk_rows) {
    const int64_t r1 = std::min(T, r0 + st.lm_chunk_rows);
    const Tensor z = h.logits_chunk.slice0(0, r1 - r0), hc = h.hn.slice0(r0, r1);
    const Tensor lab = st.labels.slice0(r0, r1);
    ProfileRange pr("lm_head.logits");
    linear_forward({.x = hc, .w = W, .y = z});
    pr.next("lm_head.ce");
    if (opt.token_loss.defined())
      cross_entropy({.logits = z,
                     .targets = lab,
                     .loss = opt.token_loss.slice0(r0, r1),
                     .lse = h.tl_lse.slice0(r0, r1),
                     .z_loss = h.tl_z.slice0(r0, r1),
                     .z_loss_scale = 0.0,
                     .grad_scale = 1.0});
    cross_entropy({.logits = z,
                   .targets = lab,
                   .loss = h.row_loss.slice0(r0, r1),
                   .lse = h.lse.slice0(r0, r1),
                   .z_loss = h.row_z.slice0(r0, r1),
                   .dlogits = st.backward ? z : Tensor(),
                   .z_loss_scale = opt.z_loss,
                   .grad_scale = c});
    if (st.backward) {
      pr.next("lm_head.grad");
      linear_backward(
          {.x = hc, .w = W, .dy = z, .dx = h.dhn.slice0(r0, r1), .dw = dW, .accumulate_dx = false});
    }
  }
  double lsum = 0, zsum = 0;
  for (double v : to_f64_vector(h.row_loss)) lsum += v;
  for (double v : to_f64_vector(h.row_z)) zsum += v;
  stats->loss = den > 0 ? lsum / den : 0.0;
  stats->z_loss = den > 0 ? zsum / den : 0.0;
  stats->targets = targets;
  // The device copies a deferred trainer reads (this A/B route reads its row losses on the host,
  // so unlike the fused route it waits for the device once per micro-batch).
  copy_into(h.loss, from_f64(std::vector<double>{stats->loss}, h.loss.dtype(), {1}));
  copy_into(h.zl, from_f64(std::vector<double>{stats->z_loss}, h.zl.dtype(), {1}));
  stats->loss_dev = h.loss;
  stats->z_loss_dev = h.zl;
}

}  // namespace

LossHead lm_head_forward(Step& st, const Tensor& h, const StepOptions& opt, StepStats* stats) {
  const int64_t head = st.ids.lm_head >= 0 ? st.ids.lm_head : st.ids.embed;
  const HeadTensors t = alloc_head(st);
  if (st.backward) st.zero_group(static_cast<size_t>(st.cfg.num_hidden_layers));  // the head's
  if (st.live) {
    const int64_t targets = st.mb->num_targets();
    {
      ProfileRange pr("rmsnorm.fwd");
      rmsnorm_forward({.x = h,
                       .w = st.norm_w(st.ids.final_norm),
                       .y = t.hn,
                       .rstd = t.rstd,
                       .eps = st.cfg.rms_norm_eps,
                       .zero_centred = st.zc()});
    }
    if (opt.logits.defined()) {
      ProfileRange pr("lm_head_loss");
      linear_forward({.x = t.hn, .w = st.P(head), .y = opt.logits});
    }
    if (st.fused.lm_head)
      fused_loss(st, t, st.P(head), st.G(head), opt, targets, stats);
    else
      unfused_loss(st, t, st.P(head), st.G(head), opt, targets, stats);
  }
  return {t.rstd, t.dhn, t.mark};
}

void lm_head_backward(Step& st, const Tensor& h, const LossHead& head, const Tensor& dh) {
  if (!st.live) return;
  ProfileRange pr("rmsnorm.bwd");
  rmsnorm_backward({.x = h,
                    .w = st.norm_w(st.ids.final_norm),
                    .rstd = head.rstd,
                    .dy = head.dhn,
                    .dx = dh,
                    .dw = st.G(st.ids.final_norm),
                    .zero_centred = st.zc()});
}

}  // namespace gdn::model
