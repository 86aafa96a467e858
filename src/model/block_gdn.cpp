// The Gated DeltaNet mixer block (gdn_spec.md §1.5): h_mid = h_in + W_out · y, with x =
// rmsnorm1p(h_in; input_layernorm) and
//   qkv = x·Wqkvᵀ, z = x·Wzᵀ, b = x·Wbᵀ, a = x·Waᵀ
//   q, k, v = silu(causal_conv1d(qkv, conv1d)) ; g, β = gates(a, b, A_log, dt_bias)
//   o = gated_delta_rule(q, k, v, g, β; l2norm(q, k) in the kernel, scale dk^-1/2)
//   y = gated_rmsnorm(o, z, norm)
#include <array>
#include <utility>

#include "gdn/core/profile.h"
#include "model/step.h"
#include "ops/causal_conv1d/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/gemm/op.h"
#include "ops/l2norm/op.h"
#include "ops/silu/op.h"

namespace gdn::model {

using namespace gdn::ops;

namespace {

// The GDN in-projection's output and its gradient are kept planar: [q block | k block | v block],
// each block [T, w] contiguous (w = KD, KD, VD), rather than token-major [T, C]. The q/k/v GEMMs
// write their blocks through the matching row slices of in_proj_qkv, the conv runs once per block
// (it is depthwise: channels are independent) and writes q, k and v straight into the tensors the
// gated delta rule reads, so no column split is copied in either direction (it cost 2 x 2.3 ms a
// step at 0.8B: PERF.md run 15).
struct QkvBlock {
  int64_t col, width;  // the block's channels [col, col + width) of the C = 2 KD + VD
};

std::array<QkvBlock, 3> qkv_blocks(const Qwen35Config& c) {  // q, k, v channels of the conv
  return {{{0, c.key_dim()}, {c.key_dim(), c.key_dim()}, {2 * c.key_dim(), c.value_dim()}}};
}

Tensor block_of(const Tensor& planar, const QkvBlock& b) {  // planar [T, C] -> [T, width]
  const int64_t T = planar.size(0);
  return planar.reshape({planar.numel()})
      .slice0(T * b.col, T * (b.col + b.width))
      .reshape({T, b.width});
}

Tensor rows(const Tensor& w, const QkvBlock& b) { return w.slice0(b.col, b.col + b.width); }

// The forward's allocations (Step::place), in their fixed order.
void place_gdn(Step& st, LayerActs& s, bool again) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads,
                dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const bool full = st.full, cheap = st.cheap;
  GdnActs& a = s.gdn;
  st.place(a.qkv, st.act, full, again, {T, c.conv_dim()});  // planar (block_of)
  st.place(a.z, st.act, full, again, {T, c.value_dim()});
  st.place(a.b, st.act, full, again, {T, Hv});
  st.place(a.a, st.act, full, again, {T, Hv});
  // kernels.fused_qk_l2norm false: the backward reads the normalised q, k (and their rstd)
  // instead, so q and k themselves live in the scratch.
  const bool qk_fused = st.fused.qk_l2norm;
  st.place(a.q, st.act, cheap || !qk_fused, again, {T, Hk, dk});
  st.place(a.k, st.act, cheap || !qk_fused, again, {T, Hk, dk});
  if (!qk_fused) {
    st.place(a.qn, st.act, cheap, again, {T, Hk, dk});
    st.place(a.kn, st.act, cheap, again, {T, Hk, dk});
    st.place(a.qn_rstd, st.stat, cheap, again, {T * Hk});
    st.place(a.kn_rstd, st.stat, cheap, again, {T * Hk});
  }
  st.place(a.v, st.act, cheap, again, {T, Hv, dv});
  st.place(a.g, st.stat, full, again, {T, Hv});
  st.place(a.beta, st.stat, full, again, {T, Hv});
  st.place(a.o, st.act, full, again, {T, Hv, dv});
  st.place(a.nrstd, st.stat, full, again, {T * Hv});
  st.place(s.y, st.act, cheap, again, {T, c.value_dim()});
  if (st.use_gdr_saved) st.place(a.saved, st.act, false, again, {st.gdr_saved_size});
}

// q, k, v = silu(causal_conv1d(qkv)) per planar block, and (kernels.fused_qk_l2norm false) the
// l2norm of q and k.
void conv_forward(Step& st, const LayerParamIds& w, GdnActs& a) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  ProfileRange pr("conv.fwd");
  const Tensor outs[3] = {a.q, a.k, a.v};
  const Tensor conv_w = st.P(w.conv1d).reshape({c.conv_dim(), c.linear_conv_kernel_dim});
  const auto blocks = qkv_blocks(c);
  for (int i = 0; i < 3; ++i) {
    const QkvBlock& b = blocks[i];
    const Tensor out = outs[i].reshape({T, b.width});
    causal_conv1d_forward({.x = block_of(a.qkv, b),
                           .weight = rows(conv_w, b),
                           .cu_seqlens = st.cu,
                           .y = out,
                           .silu = st.fused.conv});
    if (!st.fused.conv) {  // kernels.fused_conv false: the SiLU as its own pass, in place
      pr.next("conv.silu.fwd");
      silu_forward({.x = out, .y = out});
      pr.next("conv.fwd");
    }
  }
  if (!st.fused.qk_l2norm) {  // the l2norm op, then the gated delta rule without its own
    pr.next("gdn.l2norm.fwd");
    l2norm_forward({.x = a.q.reshape({T * Hk, dk}),
                    .y = a.qn.reshape({T * Hk, dk}),
                    .rstd = a.qn_rstd,
                    .eps = kGdrL2NormEps});
    l2norm_forward({.x = a.k.reshape({T * Hk, dk}),
                    .y = a.kn.reshape({T * Hk, dk}),
                    .rstd = a.kn_rstd,
                    .eps = kGdrL2NormEps});
  }
}

}  // namespace

void gdn_forward(Step& st, const LayerParamIds& w, LayerActs& s, bool again) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const bool full = st.full, cheap = st.cheap, qk_fused = st.fused.qk_l2norm;
  GdnActs& a = s.gdn;
  norm_forward(st, s.h_in, w.input_norm, s.in_norm, again);
  place_gdn(st, s, again);
  st.place(s.h_mid, st.act, full, again, {T, c.hidden_size});
  const Tensor& x = s.in_norm.y;
  if (st.run_op(again, full)) {
    ProfileRange pr("gdn.in_proj.fwd");
    for (const QkvBlock& b : qkv_blocks(c))
      linear_forward({.x = x, .w = rows(st.P(w.in_proj_qkv), b), .y = block_of(a.qkv, b)});
    linear_forward({.x = x, .w = st.P(w.in_proj_z), .y = a.z});
    linear_forward({.x = x, .w = st.P(w.in_proj_b), .y = a.b});
    linear_forward({.x = x, .w = st.P(w.in_proj_a), .y = a.a});
  }
  if (st.run_op(again, cheap)) conv_forward(st, w, a);
  if (st.run_op(again, full)) {
    ProfileRange pr("gdn_gates.fwd");
    gdn_gates_forward({.a = a.a,
                       .b = a.b,
                       .A_log = st.P(w.a_log),
                       .dt_bias = st.P(w.dt_bias),
                       .g = a.g,
                       .beta = a.beta});
    pr.next("gdr.fwd");
    gated_delta_rule_forward({.q = qk_fused ? a.q : a.qn,
                              .k = qk_fused ? a.k : a.kn,
                              .v = a.v,
                              .g = a.g,
                              .beta = a.beta,
                              .cu_seqlens = st.cu,
                              .o = a.o,
                              .scale = 0.0,
                              .use_qk_l2norm = qk_fused,
                              .saved = a.saved});
  }
  if (st.run_op(again, cheap)) {
    ProfileRange pr("gated_rmsnorm.fwd");
    gated_rmsnorm_forward({.x = a.o.reshape({T * Hv, dv}),
                           .z = a.z.reshape({T * Hv, dv}),
                           .w = st.P(w.gated_norm),
                           .y = s.y.reshape({T * Hv, dv}),
                           .rstd = a.nrstd,
                           .eps = c.rms_norm_eps});
  }
  if (st.run_op(again, full)) {
    ProfileRange pr("out_proj.fwd");
    residual_linear(s.h_in, s.y, st.P(w.out_proj), s.h_mid);
  }
}

namespace {

// Gradients of the GDN block's intermediates (Step::bwd), in their fixed allocation order.
struct GdnGrads {
  Tensor dx, dy, dz, d_o, dq, dk, dv, dg, dbeta, da, db;
  Tensor dqkv;      // planar (block_of)
  Tensor dqn, dkn;  // kernels.fused_qk_l2norm false: the delta rule's gradients of l2norm(q, k)
};

GdnGrads alloc_gdn_grads(Step& st) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads,
                dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  GdnGrads g;
  g.dx = st.balloc_act({T, c.hidden_size});
  g.dy = st.balloc_act({T, c.value_dim()});
  g.dz = st.balloc_act({T, c.value_dim()});
  g.d_o = st.balloc_act({T, Hv, dv});
  g.dq = st.balloc_act({T, Hk, dk});
  g.dk = st.balloc_act({T, Hk, dk});
  g.dv = st.balloc_act({T, Hv, dv});
  g.dg = st.balloc(st.stat, {T, Hv});
  g.dbeta = st.balloc(st.stat, {T, Hv});
  g.da = st.balloc_act({T, Hv});
  g.db = st.balloc_act({T, Hv});
  g.dqkv = st.balloc_act({T, c.conv_dim()});
  if (!st.fused.qk_l2norm) {
    g.dqn = st.balloc_act({T, Hk, dk});
    g.dkn = st.balloc_act({T, Hk, dk});
  }
  return g;
}

// dqkv from dq, dk, dv through the conv (+ SiLU) per planar block, and the conv weight's gradient.
void conv_backward(Step& st, const LayerParamIds& w, const GdnActs& a, const GdnGrads& g,
                   ProfileRange& pr) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, C = c.conv_dim(), W = c.linear_conv_kernel_dim;
  const Tensor dout[3] = {g.dq, g.dk, g.dv}, conv_w = st.P(w.conv1d).reshape({C, W});
  const auto blocks = qkv_blocks(c);
  for (int i = 0; i < 3; ++i) {
    const QkvBlock& b = blocks[i];
    const Tensor x_b = block_of(a.qkv, b), dx_b = block_of(g.dqkv, b);
    const Tensor dy_b = dout[i].reshape({T, b.width});
    const Tensor w_b = rows(conv_w, b);
    if (!st.fused.conv) {
      // kernels.fused_conv false: recompute the conv's pre-activation with a conv pass (the
      // fused backward does it in registers) into dx_b, which the conv backward writes only
      // after the silu backward has read it; then dy_b = dy_b * silu'(pre) in place.
      pr.next("conv.silu.bwd");
      causal_conv1d_forward(
          {.x = x_b, .weight = w_b, .cu_seqlens = st.cu, .y = dx_b, .silu = false});
      silu_backward({.x = dx_b, .dy = dy_b, .dx = dy_b});
    }
    pr.next("conv.bwd");
    causal_conv1d_backward({.x = x_b,
                            .weight = w_b,
                            .cu_seqlens = st.cu,
                            .dy = dy_b,
                            .dx = dx_b,
                            .dweight = rows(st.G(w.conv1d).reshape({C, W}), b),
                            .silu = st.fused.conv});
  }
}

// dx from the in-projections' output gradients, and their weights' gradients.
void in_proj_backward(Step& st, const LayerParamIds& w, const Tensor& x, const GdnGrads& g) {
  const auto blocks = qkv_blocks(st.cfg);
  for (int i = 0; i < 3; ++i) {
    const QkvBlock& b = blocks[i];
    linear_backward({.x = x,
                     .w = rows(st.P(w.in_proj_qkv), b),
                     .dy = block_of(g.dqkv, b),
                     .dx = g.dx,
                     .dw = rows(st.G(w.in_proj_qkv), b),
                     .accumulate_dx = i > 0,
                     .overwrite_dw = st.overwrite_dw(w.in_proj_qkv)});
  }
  const std::pair<int64_t, Tensor> rest[3] = {
      {w.in_proj_z, g.dz}, {w.in_proj_b, g.db}, {w.in_proj_a, g.da}};
  for (const auto& [id, dy] : rest)
    linear_backward({.x = x,
                     .w = st.P(id),
                     .dy = dy,
                     .dx = g.dx,
                     .dw = st.G(id),
                     .accumulate_dx = true,
                     .overwrite_dw = st.overwrite_dw(id)});
}

}  // namespace

void gdn_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                  const Tensor& dtmp) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads,
                dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const bool qk_fused = st.fused.qk_l2norm;
  const GdnActs& a = s.gdn;
  const GdnGrads g = alloc_gdn_grads(st);
  if (!st.live) return;
  {
    ProfileRange pr("out_proj.bwd");
    linear_backward({.x = s.y,
                     .w = st.P(w.out_proj),
                     .dy = dh,
                     .dx = g.dy,
                     .dw = st.G(w.out_proj),
                     .accumulate_dx = false,
                     .overwrite_dw = st.overwrite_dw(w.out_proj)});
  }
  {
    ProfileRange pr("gated_rmsnorm.bwd");
    gated_rmsnorm_backward({.x = a.o.reshape({T * Hv, dv}),
                            .z = a.z.reshape({T * Hv, dv}),
                            .w = st.P(w.gated_norm),
                            .rstd = a.nrstd,
                            .dy = g.dy.reshape({T * Hv, dv}),
                            .dx = g.d_o.reshape({T * Hv, dv}),
                            .dz = g.dz.reshape({T * Hv, dv}),
                            .dw = st.G(w.gated_norm)});
    pr.next("gdr.bwd");
    gated_delta_rule_backward({.q = qk_fused ? a.q : a.qn,
                               .k = qk_fused ? a.k : a.kn,
                               .v = a.v,
                               .g = a.g,
                               .beta = a.beta,
                               .cu_seqlens = st.cu,
                               .dout = g.d_o,
                               .dq = qk_fused ? g.dq : g.dqn,
                               .dk = qk_fused ? g.dk : g.dkn,
                               .dv = g.dv,
                               .dg = g.dg,
                               .dbeta = g.dbeta,
                               .scale = 0.0,
                               .use_qk_l2norm = qk_fused,
                               .saved = a.saved});
    if (!qk_fused) {
      pr.next("gdn.l2norm.bwd");
      l2norm_backward({.y = a.qn.reshape({T * Hk, dk}),
                       .rstd = a.qn_rstd,
                       .dy = g.dqn.reshape({T * Hk, dk}),
                       .dx = g.dq.reshape({T * Hk, dk})});
      l2norm_backward({.y = a.kn.reshape({T * Hk, dk}),
                       .rstd = a.kn_rstd,
                       .dy = g.dkn.reshape({T * Hk, dk}),
                       .dx = g.dk.reshape({T * Hk, dk})});
    }
    pr.next("gdn_gates.bwd");
    gdn_gates_backward({.a = a.a,
                        .b = a.b,
                        .A_log = st.P(w.a_log),
                        .dt_bias = st.P(w.dt_bias),
                        .dg = g.dg,
                        .dbeta = g.dbeta,
                        .da = g.da,
                        .db = g.db,
                        .dA_log = st.G(w.a_log),
                        .ddt_bias = st.G(w.dt_bias)});
    conv_backward(st, w, a, g, pr);
    pr.next("gdn.in_proj.bwd");
    in_proj_backward(st, w, s.in_norm.y, g);
  }
  norm_backward(st, s.h_in, w.input_norm, s.in_norm, g.dx, dtmp, dh);  // dh = d h_in
}

}  // namespace gdn::model
