// The gated full-attention mixer block (gdn_spec.md §1.6): h_mid = h_in + W_o · y, with x =
// rmsnorm1p(h_in; input_layernorm), qg = x·Wqᵀ (queries and their output gate), k = x·Wkᵀ,
// v = x·Wvᵀ and y = gated_attention(qg, k, v) (q/k norms, partial RoPE, varlen causal GQA,
// sigmoid output gate).
#include <utility>

#include "gdn/core/profile.h"
#include "model/step.h"
#include "ops/gated_attention/op.h"
#include "ops/gemm/op.h"

namespace gdn::model {

using namespace gdn::ops;

void attention_forward(Step& st, const LayerParamIds& w, LayerActs& s, bool again) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const bool full = st.full;
  AttentionActs& a = s.attn;
  norm_forward(st, s.h_in, w.input_norm, s.in_norm, again);
  st.place(a.qg, st.act, full, again, {T, Hq, 2 * hd});
  st.place(a.k, st.act, full, again, {T, Hkv, hd});
  st.place(a.v, st.act, full, again, {T, Hkv, hd});
  st.place(s.y, st.act, full, again, {T, Hq, hd});
  st.place(a.q_hat, st.act, full, again, {T, Hq, hd});
  st.place(a.k_hat, st.act, full, again, {T, Hkv, hd});
  st.place(a.attn, st.act, full, again, {T, Hq, hd});
  st.place(a.lse, st.stat, full, again, {T, Hq});
  st.place(a.q_rstd, st.stat, full, again, {T, Hq});
  st.place(a.k_rstd, st.stat, full, again, {T, Hkv});
  st.place(s.h_mid, st.act, full, again, {T, c.hidden_size});
  if (!st.run_op(again, full)) return;
  const Tensor& x = s.in_norm.y;
  ProfileRange pr("attn.in_proj.fwd");
  linear_forward({.x = x, .w = st.P(w.q_proj), .y = a.qg.reshape({T, Hq * 2 * hd})});
  linear_forward({.x = x, .w = st.P(w.k_proj), .y = a.k.reshape({T, Hkv * hd})});
  linear_forward({.x = x, .w = st.P(w.v_proj), .y = a.v.reshape({T, Hkv * hd})});
  pr.next("attn.core.fwd");
  gated_attention_forward({.qg = a.qg,
                           .k = a.k,
                           .v = a.v,
                           .q_norm_w = st.P(w.q_norm),
                           .k_norm_w = st.P(w.k_norm),
                           .cu_seqlens = st.cu,
                           .o = s.y,
                           .q_hat = a.q_hat,
                           .k_hat = a.k_hat,
                           .attn = a.attn,
                           .lse = a.lse,
                           .q_rstd = a.q_rstd,
                           .k_rstd = a.k_rstd,
                           .rotary_dim = c.rotary_dim(),
                           .rope_theta = c.rope_theta,
                           .eps = c.rms_norm_eps});
  pr.next("out_proj.fwd");
  residual_linear(s.h_in, s.y.reshape({T, Hq * hd}), st.P(w.o_proj), s.h_mid);
}

void attention_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                        const Tensor& dtmp) {
  const Qwen35Config& c = st.cfg;
  const int64_t T = st.T, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const AttentionActs& a = s.attn;
  Tensor dx = st.balloc_act({T, c.hidden_size}), dy = st.balloc_act({T, Hq * hd});
  Tensor dqg = st.balloc_act({T, Hq, 2 * hd}), dk = st.balloc_act({T, Hkv, hd}),
         dv = st.balloc_act({T, Hkv, hd});
  if (!st.live) return;
  const Tensor& x = s.in_norm.y;
  {
    ProfileRange pr("out_proj.bwd");
    linear_backward({.x = s.y.reshape({T, Hq * hd}),
                     .w = st.P(w.o_proj),
                     .dy = dh,
                     .dx = dy,
                     .dw = st.G(w.o_proj),
                     .accumulate_dx = false,
                     .overwrite_dw = st.overwrite_dw(w.o_proj)});
    pr.next("attn.core.bwd");
    gated_attention_backward({.qg = a.qg,
                              .k = a.k,
                              .v = a.v,
                              .q_norm_w = st.P(w.q_norm),
                              .k_norm_w = st.P(w.k_norm),
                              .cu_seqlens = st.cu,
                              .q_hat = a.q_hat,
                              .k_hat = a.k_hat,
                              .attn = a.attn,
                              .lse = a.lse,
                              .q_rstd = a.q_rstd,
                              .k_rstd = a.k_rstd,
                              .d_o = dy.reshape({T, Hq, hd}),
                              .dqg = dqg,
                              .dk = dk,
                              .dv = dv,
                              .dq_norm_w = st.G(w.q_norm),
                              .dk_norm_w = st.G(w.k_norm),
                              .rotary_dim = c.rotary_dim(),
                              .rope_theta = c.rope_theta,
                              .eps = c.rms_norm_eps});
    pr.next("attn.in_proj.bwd");
    const std::pair<int64_t, Tensor> proj[3] = {{w.q_proj, dqg.reshape({T, Hq * 2 * hd})},
                                                {w.k_proj, dk.reshape({T, Hkv * hd})},
                                                {w.v_proj, dv.reshape({T, Hkv * hd})}};
    for (int i = 0; i < 3; ++i) {
      const auto& [id, dproj] = proj[i];
      linear_backward({.x = x,
                       .w = st.P(id),
                       .dy = dproj,
                       .dx = dx,
                       .dw = st.G(id),
                       .accumulate_dx = i > 0,
                       .overwrite_dw = st.overwrite_dw(id)});
    }
  }
  norm_backward(st, s.h_in, w.input_norm, s.in_norm, dx, dtmp, dh);  // dh = d h_in
}

}  // namespace gdn::model
