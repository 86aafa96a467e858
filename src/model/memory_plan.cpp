// The memory plan's parts that are not the step's allocation sequence: where the gradients go
// under GradMemory::InActivations, and the summary printed at start-up.
#include <algorithm>
#include <utility>

#include "gdn/backend/op_workspace.h"
#include "model/step.h"
#include "ops/causal_conv1d/op.h"
#include "ops/embedding/op.h"
#include "ops/gated_attention/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn::model {

// The layout of GradMemory::InActivations (qwen35.h): the groups go down from the arena's top in
// the order the backward first writes them: the head (written by the LM head loss, right after the
// forward), layers L-1 ... 0, an untied embedding (written last). A group first written while the
// activations below byte E are still live must start at or above E: the head above the whole
// forward, layer l above layer l's forward (plan_layer_end_[l]), the embedding above the inputs
// (the embedding backward reads the token ids). The capacity is the smallest that satisfies every
// group, and at least the forward's peak.
void Qwen35Model::place_grads_in_activations(size_t forward_peak) {
  const int64_t L = cfg_.num_hidden_layers;
  const DType gdt = backend_ == Backend::Ref ? DType::F64 : DType::F32;
  std::vector<int64_t> group_of(specs_.size(), -1);
  for (int64_t l = 0; l < L; ++l) {
    const LayerParamIds& w = ids_.layers[static_cast<size_t>(l)];
    for (int64_t id :
         {w.input_norm, w.post_norm, w.mlp_gate, w.mlp_up,  w.mlp_down, w.in_proj_qkv, w.in_proj_z,
          w.in_proj_b,  w.in_proj_a, w.conv1d,   w.dt_bias, w.a_log,    w.gated_norm,  w.out_proj,
          w.q_proj,     w.k_proj,    w.v_proj,   w.o_proj,  w.q_norm,   w.k_norm})
      if (id >= 0) group_of[static_cast<size_t>(id)] = l;
  }
  group_of[static_cast<size_t>(ids_.final_norm)] = L;
  group_of[static_cast<size_t>(ids_.embed)] = ids_.lm_head >= 0 ? L + 1 : L;
  if (ids_.lm_head >= 0) group_of[static_cast<size_t>(ids_.lm_head)] = L;
  // The layer GEMMs' weights, whose gradients the backward writes (=): run() passes
  // overwrite_dw to exactly these (grad_written_ decides both); the others (norm weights, conv,
  // gates, embedding, LM head) accumulate and are zeroed first.
  grad_written_.assign(specs_.size(), false);
  for (const LayerParamIds& w : ids_.layers)
    for (int64_t id : {w.mlp_gate, w.mlp_up, w.mlp_down, w.in_proj_qkv, w.in_proj_z, w.in_proj_b,
                       w.in_proj_a, w.out_proj, w.q_proj, w.k_proj, w.v_proj, w.o_proj})
      if (id >= 0) grad_written_[static_cast<size_t>(id)] = true;
  std::vector<size_t> bytes(static_cast<size_t>(L + 2), 0), zeroed(bytes.size(), 0);
  for (size_t i = 0; i < specs_.size(); ++i) {
    GDN_CHECK(group_of[i] >= 0, "model: parameter '{}' belongs to no gradient group",
              specs_[i].name);
    const size_t b = align256(bytes_of(specs_[i], gdt));
    bytes[static_cast<size_t>(group_of[i])] += b;
    if (!grad_written_[i]) zeroed[static_cast<size_t>(group_of[i])] += b;
  }
  // Top-down order and each group's live-activation floor.
  std::vector<std::pair<int64_t, size_t>> order{{L, forward_peak}};
  for (int64_t l = L - 1; l >= 0; --l)
    order.push_back({l, plan_layer_end_[static_cast<size_t>(l)]});
  order.push_back({L + 1, plan_inputs_end_});
  size_t above = 0, capacity = forward_peak;
  for (const auto& [g, floor] : order) {
    above += bytes[static_cast<size_t>(g)];
    capacity = std::max(capacity, align256(floor) + above);
  }
  act_arena_ = Arena("activations and gradients", backend_device(backend_), capacity);
  grad_group_.assign(static_cast<size_t>(L + 2), Tensor());
  // Within a group: the zeroed gradients first (one memset covers them), then the written ones.
  std::vector<size_t> next_zeroed(grad_group_.size()), next_written(grad_group_.size());
  size_t top = capacity;
  for (const auto& [g, floor] : order) {
    const size_t gi = static_cast<size_t>(g), z = zeroed[gi];
    top -= bytes[gi];
    next_zeroed[gi] = top;
    next_written[gi] = top + z;
    if (z > 0)
      grad_group_[gi] =
          act_arena_.view_at(top, DType::I32, std::array<int64_t, 1>{static_cast<int64_t>(z / 4)});
  }
  for (size_t i = 0; i < specs_.size(); ++i) {
    const size_t gi = static_cast<size_t>(group_of[i]);
    size_t& at = grad_written_[i] ? next_written[gi] : next_zeroed[gi];
    grads_.push_back(act_arena_.view_at(at, gdt, specs_[i].shape));
    at += align256(bytes_of(specs_[i], gdt));
  }
}

// The op workspace (gdn/backend/op_workspace.h): the largest declared bound of the step's op
// calls that take CUDA scratch, at T = max_tokens and N = `docs` documents. The calls and their
// shapes: the RMSNorms [T, D] (input, post-attention and final norm; plain with the materialised
// 1 + w when kernels.fused_zc_norm is off, the same rows), the gated RMSNorm [T Hv, dv], the GDN
// gates [T, Hv], the conv over each of the q, k, v channel blocks (the fused and unfused routes
// make the same conv calls), the gated delta rule (with the in-kernel l2norm when
// kernels.fused_qk_l2norm; `backward_saved`: every backward of these batches is given `saved`),
// the gated attention, the embedding. The LM head's
// linear_cross_entropy takes the workspace it is given (lm_head.cpp); the GEMMs take cuBLASLt's.
size_t Qwen35Model::op_workspace_bound(int64_t docs, bool backward_saved) const {
  const Qwen35Config& c = cfg_;
  const int64_t T = max_tokens_, D = c.hidden_size;
  const OpWorkspaceDevice dev = op_workspace_device();
  const int sm = dev.sm_count, mb = dev.max_blocks_per_sm;
  size_t bound = std::max(ops::rmsnorm_workspace_bytes(T, D, sm, mb),
                          ops::embedding_workspace_bytes(T, c.vocab_size, D));
  if (c.num_linear_attention_layers() > 0) {
    const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads,
                  dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
    bound = std::max({bound, ops::gated_rmsnorm_workspace_bytes(T * Hv, dv, sm, mb),
                      ops::gdn_gates_workspace_bytes(T, Hv),
                      ops::gated_delta_rule_workspace_bytes(T, docs, Hk, Hv, dk, dv,
                                                            fused_.qk_l2norm, backward_saved)});
    for (int64_t width : {c.key_dim(), c.value_dim()})
      bound = std::max(
          bound, ops::causal_conv1d_workspace_bytes(T, c.linear_conv_kernel_dim, width, sm, mb));
  }
  if (c.num_full_attention_layers() > 0)
    bound = std::max(bound, ops::gated_attention_workspace_bytes(
                                T, docs, c.num_attention_heads, c.num_key_value_heads, c.head_dim));
  return bound;
}

std::string Qwen35Model::memory_plan() const {
  const bool all_fused =
      fused_.conv && fused_.qk_l2norm && fused_.swiglu && fused_.zc_norm && fused_.lm_head;
  size_t grad_total = 0;
  for (const Tensor& g : grads_) grad_total += static_cast<size_t>(g.nbytes());
  const bool shared = grad_memory_ == GradMemory::InActivations;
  return fmt::format(
             "memory plan ({} backend, micro-batch up to {} tokens / {} documents, recompute {}): "
             "parameters {}, gradients {}{}, activations {}{} (+ {} loss and backward scratch, "
             "{} of it the per-layer recompute scratch){}; total {}",
             backend_name(backend_), max_tokens_, max_docs_, recompute_name(recompute_),
             format_bytes(static_cast<double>(param_bytes())),
             format_bytes(static_cast<double>(grad_total)),
             shared ? " (in activation memory the backward has consumed)" : "",
             format_bytes(static_cast<double>(act_arena_.capacity())),
             shared ? " with the gradients" : "",
             format_bytes(static_cast<double>(bwd_arena_.capacity())),
             format_bytes(static_cast<double>(tmp_arena_.capacity())),
             backend_ != Backend::Cuda
                 ? std::string()
                 : fmt::format(", op workspace {} (batches of up to {} documents)",
                               format_bytes(static_cast<double>(op_workspace_bytes())),
                               op_workspace_docs_),
             format_bytes(static_cast<double>(param_bytes() + grad_bytes() + activation_bytes() +
                                              op_workspace_bytes()))) +
         (gdr_saved_plan_ == 0
              ? std::string()
              : fmt::format("; the activations include GDR saved states of {} per GDN layer "
                            "(batches of up to {} documents)",
                            format_bytes(static_cast<double>(gdr_saved_plan_) * 2),
                            gdr_saved_docs_)) +
         (all_fused ? std::string()
                    : fmt::format("; unfused A/B routes in use ({})", fused_.describe()));
}

}  // namespace gdn::model
