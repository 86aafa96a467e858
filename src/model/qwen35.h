// The Qwen3.5 decoder: explicit forward and backward through every layer on one backend (ref:
// fp64, cpu: fp32, cuda: bf16 with fp32 gates/states/gradients), built only from the registered
// ops. gdn_spec.md §1.3-§1.7 is the maths; the layer walk is:
//
//   h0 = embed(ids)
//   per layer l:  xn = rmsnorm1p(h, input_layernorm)
//     GDN:        qkv = xn·Wqkvᵀ, z = xn·Wzᵀ, b = xn·Wbᵀ, a = xn·Waᵀ
//                 c = silu(causal_conv1d(qkv, conv1d)) split into q [T,Hk,dk], k, v [T,Hv,dv]
//                 g, β = gates(a, b, A_log, dt_bias)
//                 o = gated_delta_rule(q, k, v, g, β, l2norm(q, k) in kernel, scale dk^-1/2)
//                 y = gated_rmsnorm(o, z, norm) ; mix = y·Woutᵀ
//     attention:  qg = xn·Wqᵀ, k = xn·Wkᵀ, v = xn·Wvᵀ ; y = gated_attention(...) ; mix = y·Woᵀ
//                 h' = h + mix                     (copy, then the GEMM accumulates with β = 1)
//                 x2 = rmsnorm1p(h', post_attention_layernorm)
//                 h'' = h' + down(swiglu(x2·Wgᵀ, x2·Wuᵀ))
//   hn = rmsnorm1p(h, model.norm) ; loss = linear_cross_entropy(hn, lm_head or embed, labels)
//
// Where it lives (docs/MODEL.md): Qwen35Model::run in qwen35.cpp walks the layers, forward then
// backward, with the recompute; each layer is two residual blocks, the mixer (block_gdn.cpp or
// block_attention.cpp: its input norm, the mixer, the out projection with the residual add) and
// the MLP (block_mlp.cpp: the post norm, SwiGLU, the down projection with the residual add); the
// final norm and the loss are lm_head.cpp. Every block has a forward and a backward and takes the
// step's context (step.h, private: the arenas, live or planning, the batch's device inputs, the
// options). memory_plan.cpp places the gradients in activation memory and prints the plan.
//
// Packed documents: every op receives cu_seqlens, so no recurrent state, conv window, RoPE
// position or attention crosses a document boundary.
//
// Memory (ARCHITECTURE.md §7): the compute copy of the parameters, the gradients (+=, fp32 or
// fp64) and every activation live in arenas sized once at construction from (config,
// max_tokens, max_docs, options); nothing is allocated per step. The activation arenas are sized
// by running the same allocation sequence as a step in planning mode (step.h).
//
// Policy (ModelOptions below) comes from the caller (the trainer, from the saved run config); the
// model reads no environment variable.
#pragma once

#include <array>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gdn/backend/registry.h"
#include "gdn/core/arena.h"
#include "model/config.h"
#include "model/micro_batch.h"
#include "model/weights.h"

namespace gdn::model {

struct Step;  // a training step's context (step.h, private)

struct StepOptions {
  bool backward = true;          // accumulate parameter gradients (+=)
  double z_loss = 0.0;           // λ of the z-loss λ·lse²
  double loss_denominator = -1;  // mean over this many targets (< 0: this micro-batch's count)
  Tensor logits;                 // optional out [T, V] (forward only diagnostics and `dump`)
  Tensor token_loss;             // optional out [T] per-token cross-entropy (forward)
  // Read the loss to the host (StepStats::loss, z_loss). false: the step never waits for the
  // device; the values stay on it (StepStats::loss_dev, z_loss_dev) and the host fields are NaN.
  bool host_stats = true;
};

struct StepStats {
  double loss = 0;      // mean cross-entropy (+ z-loss) over the denominator
  double z_loss = 0;    // the z-loss part, same normalisation
  int64_t targets = 0;  // non-ignored labels in this micro-batch
  // The same two values where the step computed them ([1] each, F32 on cpu and cuda, F64 on ref):
  // views into the model's activation memory, valid until the next step() call.
  Tensor loss_dev, z_loss_dev;
};

// Activation recompute (issue 8): what the forward keeps for the backward.
//   none:      every layer activation (fastest, most memory);
//   selective: the GEMM, GDR (with its saved states on cuda) and attention outputs; the
//              memory-bound ops' outputs (input and post norms, conv + q/k/v split, gated norm,
//              SwiGLU) are recomputed per layer;
//   full:      only the residual stream (each layer's input); the backward re-runs the layer's
//              forward (all but its last GEMM) just before the layer's backward.
// Recomputed values are bitwise the forward's (the ops are deterministic), so the policy changes
// memory and time, never the numbers.
enum class Recompute : uint8_t { None, Full, Selective };
std::string_view recompute_name(Recompute r);
Recompute recompute_from_name(std::string_view name);  // throws naming the bad value

// Where the parameter gradients live (issue 8).
//   separate:        an arena of their own; backward steps accumulate (+=) into them until
//                    zero_grads(), so several micro-batches can make one optimizer step.
//   in_activations:  the top of the activation arena, over activations the backward has already
//                    consumed. The backward walks the layers down, so layer l's gradients are
//                    placed above the last byte of layer l's forward activations: they overwrite
//                    only activations of layers > l, dead once those layers' backward has run. The
//                    LM head's (and final norm's) gradients sit above all activations and an untied
//                    embedding's, written last, below the layers'. The arena then needs about one
//                    layer's and the head's gradients more than the activations instead of all of
//                    them (4B: about 13 GiB less). The layer GEMMs' weight gradients are
//                    written (=, their one linear_backward of the step); the others of a group
//                    are zeroed just before its first write. So every backward step writes its
//                    own micro-batch's gradients, valid until the next step() (a step without
//                    backward overwrites them); zero_grads() does nothing. One micro-batch per
//                    optimizer step.
// Both give bitwise the same gradients for one micro-batch (the same ops in the same order; a GEMM
// writing dy^T x equals one adding it to zeros, up to the sign of an exact zero).
enum class GradMemory : uint8_t { Separate, InActivations };

// Fused kernel routes and their unfused A/B counterparts (issue 8), default all fused; the run
// config's kernels.fused_* keys (train/run_config.h, saved with the run) set them:
//   conv:    causal_conv1d with SiLU fused | conv without SiLU, then the silu op (the backward
//            recomputes the pre-activation with a conv pass, as the fused kernel does in registers)
//   qk_l2norm: the gated delta rule normalising q, k itself (use_qk_l2norm) | the l2norm op into
//            kept activations, the gated delta rule without it, then the l2norm backward
//   swiglu:  the swiglu op | silu(gate), then mul(., up); backward mul twice, then silu backward
//   zc_norm: rmsnorm forming (1 + w) in fp32 | 1 + w materialised per step (a copy of w, axpy of a
//            ones vector) and the plain rmsnorm; dw is the same sum, accumulated into w's gradient
//   lm_head: linear_cross_entropy | per row chunk: logits by gemm, the cross_entropy op (loss,
//            lse, z-loss and the gradient in place), dx and dW by gemm; rows summed on the host
// The unfused routes round their intermediates to the activation dtype (bf16 on cuda), so none of
// these switches is scheduling-only: they agree with the fused routes to that precision.
struct FusedRoutes {
  bool conv = true, qk_l2norm = true, swiglu = true, zc_norm = true, lm_head = true;
  std::string describe() const;  // "conv fused, swiglu unfused (silu + mul), ..."
};

// Everything about a model instance that is policy rather than shape: set by the trainer from the
// run config (saved with the run, so a resume keeps it); the defaults are the production choices.
struct ModelOptions {
  Recompute recompute = Recompute::None;
  GradMemory grad_memory = GradMemory::Separate;
  FusedRoutes fused{};
  // The LM head's logits budget in bytes (linear_cross_entropy's chunk_bytes; the unfused route's
  // logits chunk of rows).
  int64_t lce_chunk_bytes = int64_t{256} << 20;
  // cuda, recompute none or selective: the gated delta rule's states are kept for the backward,
  // planned for batches of up to max_tokens / this many documents (0: none are kept).
  int64_t gdr_saved_min_doc_tokens = 128;
};

class Qwen35Model {
 public:
  Qwen35Model(Qwen35Config cfg, Backend backend, int64_t max_tokens, int64_t max_docs,
              const ModelOptions& options = {});

  const Qwen35Config& config() const { return cfg_; }
  Backend backend() const { return backend_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  // Compute copy of parameter i (HF shape; backend dtype and device).
  const Tensor& param(size_t i) const { return params_.at(i); }
  // Gradient of parameter i (HF shape; F64 on ref, F32 otherwise; backend device).
  const Tensor& grad(size_t i) const { return grads_.at(i); }
  const std::vector<Tensor>& grads() const { return grads_; }

  // Copies the fp32 master weights (host) into the compute copy (converting the dtype).
  void load_params(const ParamStore& master);
  // Copies gradient i into an F32 host tensor of the same shape.
  void read_grad(size_t i, const Tensor& out_f32_host) const;
  // Zeroes the gradients (GradMemory::Separate; InActivations: nothing to do, see there).
  void zero_grads();

  // Forward (and backward) of one micro-batch. Throws if it exceeds the planned sizes.
  StepStats step(const MicroBatch& mb, const StepOptions& opt);

  // Bytes planned per arena, as printed at start-up.
  size_t param_bytes() const { return param_arena_.capacity(); }
  // The separate gradient arena (0 with GradMemory::InActivations: they are in the activations').
  size_t grad_bytes() const { return grad_arena_.capacity(); }
  // Activations kept across the step (with GradMemory::InActivations, the gradients on top) and
  // the loss and backward scratch (which holds the per-layer recompute scratch: the constructor).
  size_t activation_bytes() const { return act_arena_.capacity() + bwd_arena_.capacity(); }
  // The planned op workspace (cuda; 0 elsewhere): the ops' temporaries (gdn/backend/
  // op_workspace.h), bound for the steps of micro-batches of up to op_workspace_docs() documents.
  size_t op_workspace_bytes() const { return ws_arena_.capacity(); }
  int64_t op_workspace_docs() const { return op_workspace_docs_; }
  Recompute recompute() const { return recompute_; }
  GradMemory grad_memory() const { return grad_memory_; }
  const FusedRoutes& fused() const { return fused_; }
  size_t activation_peak() const { return act_arena_.peak(); }
  std::string memory_plan() const;

 private:
  // `arena`: the forward's activations (and gradients placed there); `tmp`: the per-layer
  // recompute scratch; `bwd`: everything made after the forward (loss, LM head workspace, the
  // backward's per-layer temporaries), kept apart so the activation arena's top is free for
  // gradients.
  void run(Arena& arena, Arena& tmp, Arena& bwd, const MicroBatch* mb, const StepOptions& opt,
           StepStats* stats);
  // The step context over these arenas (live, or planning when mb is null) and the inputs' copy
  // to the device (live).
  Step make_step(Arena& arena, Arena& tmp, Arena& bwd, const MicroBatch* mb, bool backward);
  void upload_inputs(const Step& st);
  // GradMemory::InActivations: places the gradients in act_arena_ from the planned ends.
  void place_grads_in_activations(size_t forward_peak);
  // The op workspace that bounds every scratch request of a step of up to max_tokens tokens in
  // `docs` documents (memory_plan.cpp; cuda), when every GDR backward is given `saved` or not.
  size_t op_workspace_bound(int64_t docs, bool backward_saved) const;

  Qwen35Config cfg_;
  Backend backend_;
  int64_t max_tokens_, max_docs_;
  std::vector<ParamSpec> specs_;
  ModelParamIds ids_;
  Recompute recompute_ = Recompute::None;
  GradMemory grad_memory_ = GradMemory::Separate;
  // Recorded by the planning run: act_arena_'s used() after the inputs and after each layer's
  // forward (a live step never goes past them: its sizes are at most the planned ones).
  size_t plan_inputs_end_ = 0;
  size_t plan_lm_end_ = 0;  // bwd's peak through the LM head loss (the planning run)
  std::vector<size_t> plan_layer_end_;
  // GradMemory::InActivations: each gradient group's bytes in act_arena_ (an I32 view), zeroed
  // before its first write: [0, L) the layers, [L] the head (final norm and LM head, or the tied
  // embedding), [L + 1] an untied embedding (undefined when tied).
  std::vector<Tensor> grad_group_;
  // GradMemory::InActivations: per parameter, whether its gradient is written (=) by a layer GEMM
  // rather than accumulated. It decides both where the gradient lies (outside its group's memset)
  // and the GEMM's overwrite_dw in run(); empty with GradMemory::Separate.
  std::vector<bool> grad_written_;
  // The gated delta rule's optional `saved` per GDN layer (None or Selective on cuda, run() has the
  // policy): elements planned for each layer (0: none) and the documents per batch that fit them.
  int64_t gdr_saved_plan_ = 0, gdr_saved_docs_ = 0;
  // Rows of the logits chunk of the unfused LM head (fused.lm_head false): lce_chunk_bytes over
  // one row of logits, clamped to [1, max_tokens].
  int64_t lm_chunk_rows_ = 0;
  FusedRoutes fused_;
  int64_t lce_chunk_bytes_;  // ModelOptions::lce_chunk_bytes: the LM head's logits budget
  OwnedTensor ones_;         // [D] compute dtype: the 1 of the unfused zero-centred norms' 1 + w
  // bwd_arena_ before tmp_arena_, which borrows from it. ws_arena_: the op workspace (cuda),
  // planned for micro-batches of up to op_workspace_docs_ documents (the constructor says why).
  Arena param_arena_, grad_arena_, act_arena_, bwd_arena_, tmp_arena_, ws_arena_;
  int64_t op_workspace_docs_ = 0;
  std::vector<Tensor> params_, grads_;
  // A micro-batch's inputs (ids, labels, cu_seqlens) go to the device through page-locked
  // staging, two slots in turn: the copy out of a slot is issued without waiting, and the slot is
  // refilled only after the fence recorded behind that copy (two steps earlier) has passed.
  std::array<HostStaging, 2> in_stage_;
  std::array<StreamFence, 2> in_fence_;
  int in_slot_ = 0;
};

// The compute dtype of parameter `spec` on `backend`: F64 on ref, F32 on cpu; on cuda bf16, but
// fp32 for A_log and dt_bias (gates are fp32, ARCHITECTURE.md §4).
DType param_compute_dtype(const ParamSpec& spec, Backend backend);

}  // namespace gdn::model
