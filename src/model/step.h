// The training step's blocks and the context they share (private to src/model).
//
// Qwen35Model::run (qwen35.cpp) walks the layers; each layer is two residual blocks, the mixer
// (block_gdn.cpp or block_attention.cpp) and the MLP (block_mlp.cpp), each "x + f(norm(x))":
//   h_mid = h_in  + W_out · mixer(rmsnorm1p(h_in))
//   h_out = h_mid + W_down · swiglu(rmsnorm1p(h_mid))
// and the final norm with the LM-head loss (lm_head.cpp) ends the forward. Every block has a
// forward and a backward, and every one runs in one of two modes (Step::live):
//   planning: no op runs, every tensor is allocated with the largest sizes (max_tokens,
//             max_docs): this is how the constructor sizes the arenas;
//   live:     the same allocations in the same order with the micro-batch's sizes, and the ops.
// So a block allocates all of its tensors whether or not it runs its ops, and always in the same
// order.
//
// Recompute (qwen35.h): a layer's forward places each activation with Step::place, kept in the
// activation arena or dropped into the per-layer scratch; the backward's recompute calls the same
// forward with `again`, which re-creates and re-computes only the dropped ones (Step::run_op).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <vector>

#include "gdn/core/arena.h"
#include "gdn/core/tensor.h"
#include "model/config.h"
#include "model/micro_batch.h"
#include "model/qwen35.h"
#include "model/weights.h"

namespace gdn::model {

// Bytes of parameter `s` in dtype dt, and n rounded up to the arenas' 256-byte alignment.
inline size_t bytes_of(const ParamSpec& s, DType dt) {
  return static_cast<size_t>(s.numel() * dtype_size(dt));
}
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Everything a block reads besides its layer's activations: the policy, the sizes, the arenas,
// the micro-batch's inputs on the device, the parameters and gradients.
struct Step {
  const Qwen35Config& cfg;
  const ModelParamIds& ids;
  const FusedRoutes& fused;
  bool live;     // false: planning (no op runs)
  int64_t T, N;  // tokens and documents (planning: max_tokens, max_docs)
  int64_t max_tokens;
  DType act, stat;  // activation dtype; statistics, gates and gradient dtype (F64 ref, else F32)
  Device dev;
  bool backward;  // StepOptions::backward
  // What the forward drops for the backward to recompute: `full` (Recompute::Full) every
  // activation but the residual stream; `cheap` (Full or Selective) the memory-bound ops' outputs.
  bool full, cheap;
  // The gated delta rule's `saved` per GDN layer (qwen35.cpp says when): its size, and whether
  // it is kept (the batch fits the plan).
  int64_t gdr_saved_size;
  bool use_gdr_saved;
  int64_t lce_chunk_bytes;  // the LM head's logits budget (ModelOptions)
  int64_t lm_chunk_rows;    // the unfused LM head's rows per logits chunk
  Arena& arena;             // the forward's activations (and GradMemory::InActivations' gradients)
  Arena& tmp;               // the per-layer recompute scratch, reset at every layer
  Arena& bwd;  // what is made after the forward: loss, LM head workspace, backward temporaries
  const MicroBatch* mb;        // the host micro-batch (null when planning)
  Tensor ids_dev, labels, cu;  // [T], [T], [N+1] I32 on the device
  const std::vector<Tensor>& params;
  const std::vector<Tensor>& grads;
  // GradMemory::InActivations: per parameter whether its GEMM writes (=) its gradient, and each
  // gradient group's memory to zero before its first write (qwen35.h); both empty with Separate.
  const std::vector<bool>& grad_written;
  const std::vector<Tensor>& grad_groups;
  // kernels.fused_zc_norm false: parameter id -> its materialised 1 + w [D].
  std::map<int64_t, Tensor> zc_w;

  Tensor P(int64_t id) const { return params.at(static_cast<size_t>(id)); }
  Tensor G(int64_t id) const { return grads.at(static_cast<size_t>(id)); }
  // Whether the GEMM of weight `id` writes its gradient (=) rather than adding to it.
  bool overwrite_dw(int64_t id) const {
    return !grad_written.empty() && grad_written.at(static_cast<size_t>(id));
  }
  // The weight a zero-centred norm passes to rmsnorm: w (fused: the kernel forms 1 + w) or 1 + w.
  bool zc() const { return fused.zc_norm; }
  Tensor norm_w(int64_t id) const { return zc() ? P(id) : zc_w.at(id); }
  // GradMemory::InActivations: zeroes gradient group g before its first write (live only).
  void zero_group(size_t g) const;

  Tensor alloc(DType dt, std::initializer_list<int64_t> shape) {
    return arena.alloc_tensor(dt, shape);
  }
  Tensor alloc_act(std::initializer_list<int64_t> shape) { return arena.alloc_tensor(act, shape); }
  Tensor balloc(DType dt, std::initializer_list<int64_t> shape) {
    return bwd.alloc_tensor(dt, shape);
  }
  Tensor balloc_act(std::initializer_list<int64_t> shape) { return bwd.alloc_tensor(act, shape); }
  // Sets `field` to a new activation: in the scratch when dropped, otherwise in the arena. The
  // backward's recompute (`again`) re-creates only the dropped ones; kept ones stay as they are.
  void place(Tensor& field, DType dt, bool drop, bool again, std::initializer_list<int64_t> shape) {
    if (again && !drop) return;
    field = (drop ? tmp : arena).alloc_tensor(dt, shape);
  }
  // Whether a forward op whose output is (`dropped`) runs: live, and on the recompute only if its
  // output was dropped.
  bool run_op(bool again, bool dropped) const { return live && (!again || dropped); }
};

// rmsnorm1p(x): its per-row rstd [T] and output [T, D].
struct NormActs {
  Tensor rstd, y;
};

// A layer's activations. The mixer's output before its out projection is y; h_mid the residual
// stream between the two blocks.
struct GdnActs {
  Tensor qkv, z, b, a;              // in-projections; qkv planar [q | k | v] (block_gdn.cpp)
  Tensor q, k, v;                   // conv + SiLU outputs [T, Hk, dk], [T, Hk, dk], [T, Hv, dv]
  Tensor qn, kn, qn_rstd, kn_rstd;  // kernels.fused_qk_l2norm false: l2norm(q), l2norm(k), rstd
  Tensor g, beta, o, nrstd;         // gates, the delta rule's output, the gated norm's rstd
  // [gdr_saved_numel(T, N, Hv, dk, dv)]: the delta rule forward's state pass for its backward,
  // or none.
  Tensor saved;
};
struct AttentionActs {
  Tensor qg, k, v;                                 // in-projections
  Tensor q_hat, k_hat, attn, lse, q_rstd, k_rstd;  // what the attention forward saves
};
struct MlpActs {
  Tensor gate, up, act;  // [T, I]
};
struct LayerActs {
  Tensor h_in;  // [T, D] the layer's input (the residual stream: always kept)
  NormActs in_norm;
  GdnActs gdn;
  AttentionActs attn;
  Tensor y;      // the mixer's output before its out projection
  Tensor h_mid;  // [T, D]
  NormActs post_norm;
  MlpActs mlp;
};

// The blocks. Forward: with `again` (the backward's recompute) only the dropped activations are
// re-created and re-computed. Backward: dh is the gradient of the block's output on entry and of
// its input on return; dtmp is [T, D] scratch; the parameter gradients are accumulated (or
// written, Step::overwrite_dw).
//   mixer (GDN or attention): s.h_in -> s.h_mid
void gdn_forward(Step& st, const LayerParamIds& w, LayerActs& s, bool again);
void gdn_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                  const Tensor& dtmp);
void attention_forward(Step& st, const LayerParamIds& w, LayerActs& s, bool again);
void attention_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                        const Tensor& dtmp);
//   MLP: s.h_mid -> h_out (not written by the recompute: the next layer's input is kept)
void mlp_forward(Step& st, const LayerParamIds& w, LayerActs& s, const Tensor& h_out, bool again);
void mlp_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                  const Tensor& dtmp);

// The final norm and the LM-head loss, made in Step::bwd: the forward, and with Step::backward
// the head's gradients and dhn. Everything above `mark` (the head's input and workspace) is dead
// once it returns; the rest (the loss, rstd, dhn) lives to the end of the step.
struct LossHead {
  Tensor rstd;  // [T] the final norm's
  Tensor dhn;   // [T, D] the loss's gradient with respect to the final norm's output
  size_t mark;  // Step::bwd's used() before the head's temporaries
};
LossHead lm_head_forward(Step& st, const Tensor& h, const StepOptions& opt, StepStats* stats);
// dh = d loss / d h through the final norm (=).
void lm_head_backward(Step& st, const Tensor& h, const LossHead& head, const Tensor& dh);

// Helpers the blocks share (blocks.cpp).
// n = rmsnorm1p(x; w): placed and run as a block's first op (rstd dropped under `full`, y under
// `cheap`).
void norm_forward(Step& st, const Tensor& x, int64_t w, NormActs& n, bool again);
// dh += d rmsnorm1p(x; w) / dx · dy (through dtmp), and w's gradient.
void norm_backward(Step& st, const Tensor& x, int64_t w, const NormActs& n, const Tensor& dy,
                   const Tensor& dtmp, const Tensor& dh);
// out = res + x · Wᵀ: a copy, then the GEMM accumulates (β = 1).
void residual_linear(const Tensor& res, const Tensor& x, const Tensor& W, const Tensor& out);
void copy_tensor(const Tensor& dst, const Tensor& src);

}  // namespace gdn::model
