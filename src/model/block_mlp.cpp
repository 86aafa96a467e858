// The MLP block (gdn_spec.md §1.7): h_out = h_mid + W_down · swiglu(W_gate x, W_up x),
// x = rmsnorm1p(h_mid; post_attention_layernorm).
#include "gdn/core/profile.h"
#include "model/step.h"
#include "ops/gemm/op.h"
#include "ops/mul/op.h"
#include "ops/silu/op.h"
#include "ops/swiglu/op.h"

namespace gdn::model {

using namespace gdn::ops;

void mlp_forward(Step& st, const LayerParamIds& w, LayerActs& s, const Tensor& h_out, bool again) {
  const int64_t T = st.T, I = st.cfg.intermediate_size;
  MlpActs& m = s.mlp;
  norm_forward(st, s.h_mid, w.post_norm, s.post_norm, again);
  st.place(m.gate, st.act, st.full, again, {T, I});
  st.place(m.up, st.act, st.full, again, {T, I});
  st.place(m.act, st.act, st.cheap, again, {T, I});
  const Tensor& x = s.post_norm.y;
  if (st.run_op(again, st.full)) {
    ProfileRange pr("mlp.gate_up.fwd");
    linear_forward({.x = x, .w = st.P(w.mlp_gate), .y = m.gate});
    linear_forward({.x = x, .w = st.P(w.mlp_up), .y = m.up});
  }
  if (st.run_op(again, st.cheap)) {
    ProfileRange pr("swiglu.fwd");
    if (st.fused.swiglu) {
      swiglu_forward({.gate = m.gate, .up = m.up, .y = m.act});
    } else {  // kernels.fused_swiglu false: act = silu(gate), then act *= up, as two passes
      silu_forward({.x = m.gate, .y = m.act});
      pr.next("swiglu.mul.fwd");
      mul({.a = m.act, .b = m.up, .y = m.act});
    }
  }
  if (!again && st.live) {
    ProfileRange pr("mlp.down.fwd");
    residual_linear(s.h_mid, m.act, st.P(w.mlp_down), h_out);
  }
}

void mlp_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                  const Tensor& dtmp) {
  const int64_t T = st.T, I = st.cfg.intermediate_size, D = st.cfg.hidden_size;
  const MlpActs& m = s.mlp;
  const Tensor& x = s.post_norm.y;
  Tensor dact = st.balloc_act({T, I}), dgate = st.balloc_act({T, I}), dup = st.balloc_act({T, I});
  Tensor dx = st.balloc_act({T, D});
  if (!st.live) return;
  {
    ProfileRange pr("mlp.down.bwd");
    linear_backward({.x = m.act,
                     .w = st.P(w.mlp_down),
                     .dy = dh,
                     .dx = dact,
                     .dw = st.G(w.mlp_down),
                     .accumulate_dx = false,
                     .overwrite_dw = st.overwrite_dw(w.mlp_down)});
  }
  {
    ProfileRange pr("swiglu.bwd");
    if (st.fused.swiglu) {
      swiglu_backward({.gate = m.gate, .up = m.up, .dy = dact, .dgate = dgate, .dup = dup});
    } else {
      // kernels.fused_swiglu false: sg = silu(gate) recomputed into dgate's buffer; dup =
      // dact * sg; d sg = dact * up over sg; dgate = d sg * silu'(gate) in place.
      silu_forward({.x = m.gate, .y = dgate});
      pr.next("swiglu.mul.bwd");
      mul({.a = dact, .b = dgate, .y = dup});
      mul({.a = dact, .b = m.up, .y = dgate});
      pr.next("swiglu.silu.bwd");
      silu_backward({.x = m.gate, .dy = dgate, .dx = dgate});
    }
  }
  {
    ProfileRange pr("mlp.gate_up.bwd");
    linear_backward({.x = x,
                     .w = st.P(w.mlp_gate),
                     .dy = dgate,
                     .dx = dx,
                     .dw = st.G(w.mlp_gate),
                     .accumulate_dx = false,
                     .overwrite_dw = st.overwrite_dw(w.mlp_gate)});
    linear_backward({.x = x,
                     .w = st.P(w.mlp_up),
                     .dy = dup,
                     .dx = dx,
                     .dw = st.G(w.mlp_up),
                     .accumulate_dx = true,
                     .overwrite_dw = st.overwrite_dw(w.mlp_up)});
  }
  norm_backward(st, s.h_mid, w.post_norm, s.post_norm, dx, dtmp, dh);  // dh = d h_mid
}

}  // namespace gdn::model
