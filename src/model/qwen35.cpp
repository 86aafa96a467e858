// The Qwen3.5 model: its memory plan, and the training step's layer walk (Qwen35Model::run; the
// blocks it calls are in block_*.cpp and lm_head.cpp, step.h).
#include "model/qwen35.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>

#include "gdn/backend/op_workspace.h"
#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "model/step.h"
#include "ops/axpy/op.h"
#include "ops/embedding/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/linear_cross_entropy/op.h"

namespace gdn::model {

using namespace gdn::ops;

DType param_compute_dtype(const ParamSpec& spec, Backend backend) {
  if (backend == Backend::Ref) return DType::F64;
  if (backend == Backend::Cpu) return DType::F32;
  const std::string& n = spec.name;
  if (n.ends_with("linear_attn.A_log") || n.ends_with("linear_attn.dt_bias")) return DType::F32;
  return DType::BF16;
}

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Full:
      return "full";
    case Recompute::Selective:
      return "selective";
  }
  return "?";
}

Recompute recompute_from_name(std::string_view name) {
  for (Recompute r : {Recompute::None, Recompute::Full, Recompute::Selective})
    if (recompute_name(r) == name) return r;
  GDN_FAIL_HINT("use none, full or selective", "recompute policy '{}' is not known", name);
}

std::string FusedRoutes::describe() const {
  return fmt::format(
      "conv {}, q/k l2norm {}, swiglu {}, zero-centred norm {}, LM head {}",
      conv ? "fused (SiLU in the conv)" : "UNFUSED (conv, then silu; kernels.fused_conv false)",
      qk_l2norm ? "fused (in the gated delta rule)"
                : "UNFUSED (l2norm op, then the gated delta rule; kernels.fused_qk_l2norm false)",
      swiglu ? "fused" : "UNFUSED (silu, then mul; kernels.fused_swiglu false)",
      zc_norm ? "fused ((1 + w) in the kernel)"
              : "UNFUSED (1 + w materialised, plain rmsnorm; kernels.fused_zc_norm false)",
      lm_head ? "fused (linear_cross_entropy)"
              : "UNFUSED (logits chunks by gemm, then cross_entropy; kernels.fused_lm_head false)");
}

Qwen35Model::Qwen35Model(Qwen35Config cfg, Backend backend, int64_t max_tokens, int64_t max_docs,
                         const ModelOptions& options)
    : cfg_(std::move(cfg)),
      backend_(backend),
      max_tokens_(max_tokens),
      max_docs_(max_docs),
      recompute_(options.recompute),
      grad_memory_(options.grad_memory),
      fused_(options.fused),
      lce_chunk_bytes_(options.lce_chunk_bytes) {
  validate(cfg_);
  GDN_CHECK(max_tokens_ >= 1 && max_docs_ >= 1 && max_docs_ <= max_tokens_,
            "model: max_tokens {} and max_docs {} must satisfy 1 <= max_docs <= max_tokens",
            max_tokens_, max_docs_);
  specs_ = param_specs(cfg_);
  ids_ = param_ids(specs_, cfg_);
  const Device dev = backend_device(backend_);
  const DType gdt = backend_ == Backend::Ref ? DType::F64 : DType::F32;
  size_t pbytes = 0, gbytes = 0;
  for (const auto& s : specs_) {
    pbytes += align256(bytes_of(s, param_compute_dtype(s, backend_)));
    gbytes += align256(bytes_of(s, gdt));
  }
  const bool shared = grad_memory_ == GradMemory::InActivations;
  param_arena_ = Arena("parameters", dev, pbytes);
  if (!shared) grad_arena_ = Arena("gradients", dev, gbytes);
  for (const auto& s : specs_) {
    params_.push_back(param_arena_.alloc_tensor(param_compute_dtype(s, backend_), s.shape));
    if (!shared) grads_.push_back(grad_arena_.alloc_tensor(gdt, s.shape));
  }
  zero_grads();
  // The fused kernel routes (qwen35.h): logged once per distinct setting.
  {
    static std::mutex mu;
    static std::string last;
    const std::string d = fused_.describe();
    std::lock_guard lock(mu);
    if (d != last) {
      log::info("kernel routes: {}", d);
      last = d;
    }
  }
  if (!fused_.zc_norm) {
    const std::vector<double> ones(static_cast<size_t>(cfg_.hidden_size), 1.0);
    ones_ = from_f64(ones, backend_dtype(backend_), {cfg_.hidden_size}, dev);
  }
  GDN_CHECK(lce_chunk_bytes_ >= kLceMinChunkBytes,
            "model: lce_chunk_bytes = {} is below the LM head's minimum {}", lce_chunk_bytes_,
            kLceMinChunkBytes);
  if (!fused_.lm_head) {
    const int64_t budget = lce_chunk_bytes_;
    const int64_t row = cfg_.vocab_size * dtype_size(backend_dtype(backend_));
    lm_chunk_rows_ = std::clamp<int64_t>(budget / row, 1, max_tokens_);
  }
  // The gated delta rule's `saved` (run() says why it is bounded): planned for batches of up to
  // max_tokens / gdr_saved_min_doc_tokens documents; 0 plans none.
  const int64_t min_doc = options.gdr_saved_min_doc_tokens;
  GDN_CHECK(min_doc >= 0, "model: gdr_saved_min_doc_tokens = {} must be >= 0 (0: no saved states)",
            min_doc);
  if (recompute_ != Recompute::Full && backend_ == Backend::Cuda &&
      cfg_.num_linear_attention_layers() > 0 && min_doc > 0) {
    gdr_saved_docs_ = std::min(max_docs_, std::max<int64_t>(1, max_tokens_ / min_doc));
    gdr_saved_plan_ = gdr_saved_numel(max_tokens_, gdr_saved_docs_, cfg_.linear_num_value_heads,
                                      cfg_.linear_key_head_dim, cfg_.linear_value_head_dim);
  }
  if (dev == Device::CUDA)
    for (size_t i = 0; i < in_stage_.size(); ++i) {
      in_stage_[i] = HostStaging(static_cast<size_t>(2 * max_tokens_ + max_docs_ + 1) * 4, dev);
      in_fence_[i] = StreamFence(dev);
    }
  // Size the activation arenas by replaying a step of the largest micro-batch in planning mode.
  Arena plan = Arena::planning("activations", dev);
  Arena tmp_plan = Arena::planning("recompute scratch", dev);
  Arena bwd_plan = Arena::planning("loss and backward scratch", dev);
  StepOptions opt;
  run(plan, tmp_plan, bwd_plan, nullptr, opt, nullptr);
  // The recompute scratch lies in the loss and backward scratch, above the backward's temporaries
  // (bwd_plan's peak once the LM head's part was released): the forward uses that arena for
  // nothing else, and the LM head's part (its input and workspace) is dead before the backward
  // recomputes anything. So the two cost max(LM head part, backward part + recompute scratch).
  const size_t tmp_at = align256(bwd_plan.peak());
  bwd_arena_ =
      Arena("loss and backward scratch", dev, std::max(plan_lm_end_, tmp_at + tmp_plan.peak()));
  tmp_arena_ =
      Arena::borrowing("recompute scratch", dev, bwd_arena_.address_at(tmp_at), tmp_plan.peak());
  if (shared) {
    place_grads_in_activations(plan.peak());
  } else {
    act_arena_ = Arena("activations", dev, plan.peak());
  }
  // The op workspace: the kernels' temporaries come from this planned region instead of a
  // grow-only buffer (gdn/backend/op_workspace.h). The gated delta rule's grows with the batch's
  // chunks (one per 64 tokens plus one per document, like `saved` above), so it is planned for
  // the documents `saved` is planned for (max_tokens / 128 with `saved` off): a micro-batch with
  // more documents runs unbound (the grow-only scratch; one log line), so that a rare batch of
  // many short documents neither fails nor makes every step hold the worst case.
  if (dev == Device::CUDA) {
    op_workspace_docs_ = gdr_saved_docs_ > 0
                             ? gdr_saved_docs_
                             : std::min(max_docs_, std::max<int64_t>(1, max_tokens_ / 128));
    // Every backward of these batches is given `saved` when one is planned (make_step).
    const bool backward_saved = gdr_saved_plan_ > 0;
    ws_arena_ = Arena("op workspace", dev, op_workspace_bound(op_workspace_docs_, backward_saved));
  }
}

void Qwen35Model::load_params(const ParamStore& master) {
  GDN_CHECK(master.size() == specs_.size(), "model: parameter store has {} tensors, expected {}",
            master.size(), specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    GDN_CHECK(master.spec(i).name == specs_[i].name, "model: parameter {} is '{}', expected '{}'",
              i, master.spec(i).name, specs_[i].name);
    copy_into(params_[i], master.tensor(i));
  }
}

void Qwen35Model::read_grad(size_t i, const Tensor& out) const { copy_into(out, grads_.at(i)); }

void Qwen35Model::zero_grads() {
  if (grad_memory_ == GradMemory::InActivations) return;  // each backward zeroes its groups
  zero_bytes(grad_arena_.capacity() ? grads_.front().data() : nullptr, backend_device(backend_),
             grad_arena_.used());
}

StepStats Qwen35Model::step(const MicroBatch& mb, const StepOptions& opt) {
  GDN_CHECK(mb.num_tokens() >= 1, "model: empty micro-batch");
  GDN_CHECK(mb.num_tokens() <= max_tokens_,
            "model: micro-batch of {} tokens exceeds the planned maximum {}", mb.num_tokens(),
            max_tokens_);
  GDN_CHECK(mb.num_segments() >= 1 && mb.num_segments() <= max_docs_,
            "model: micro-batch of {} documents exceeds the planned maximum {}", mb.num_segments(),
            max_docs_);
  GDN_CHECK(mb.labels.size() == mb.input_ids.size(), "model: {} labels for {} tokens",
            mb.labels.size(), mb.input_ids.size());
  GDN_CHECK(mb.cu_seqlens.front() == 0 && mb.cu_seqlens.back() == mb.num_tokens(),
            "model: cu_seqlens must run from 0 to {} tokens", mb.num_tokens());
  for (int32_t id : mb.input_ids)
    GDN_CHECK(id >= 0 && id < cfg_.vocab_size, "model: token id {} outside the vocabulary [0, {})",
              id, cfg_.vocab_size);
  StepStats stats;
  act_arena_.reset();
  tmp_arena_.reset();
  bwd_arena_.reset();
  run(act_arena_, tmp_arena_, bwd_arena_, &mb, opt, &stats);
  return stats;
}

// ------------------------------------------------------------------------------------------------
// The step: the layer walk. The blocks it calls live in block_gdn.cpp, block_attention.cpp,
// block_mlp.cpp and lm_head.cpp (step.h has their contract and the two modes, planning and live).

namespace {

// Adds the layer to a non-finite finding, so the trainer's guard can name where it happened.
[[noreturn]] void rethrow_in_layer(const NonFiniteError& e, int64_t layer, const char* pass,
                                   const Qwen35Config& c) {
  throw NonFiniteError(
      fmt::format("layer {} ({}, {}): {}", layer, c.is_full_attention(layer) ? "attention" : "GDN",
                  pass, e.message()),
      e.hint(), e.file(), e.line());
}

// Layer l: h_out = h_in + mixer(...) + mlp(...) into `s`. With `again` (the backward's
// recompute) only the dropped activations are made again, and h_out is left alone.
void layer_forward(Step& st, const LayerParamIds& w, LayerActs& s, const Tensor& h_in,
                   const Tensor& h_out, bool again) {
  st.tmp.reset();
  s.h_in = h_in;
  if (w.type == LayerType::Linear) {
    gdn_forward(st, w, s, again);
  } else {
    attention_forward(st, w, s, again);
  }
  mlp_forward(st, w, s, h_out, again);
}

// dh: d h_out on entry, d h_in on return.
void layer_backward(Step& st, const LayerParamIds& w, const LayerActs& s, const Tensor& dh,
                    const Tensor& dtmp) {
  mlp_backward(st, w, s, dh, dtmp);
  if (w.type == LayerType::Linear) {
    gdn_backward(st, w, s, dh, dtmp);
  } else {
    attention_backward(st, w, s, dh, dtmp);
  }
}

// The zero-centred norms' weights. Fused (default): the rmsnorm kernel forms (1 + w) in fp32.
// kernels.fused_zc_norm false: 1 + w is materialised once per step (a copy of w, then axpy of the
// ones vector: fp32 arithmetic, rounded to the parameter dtype) and the plain rmsnorm runs on it;
// its dw = sum(dy * xhat) is also d loss / dw (d(1 + w)/dw = 1), so it accumulates into w's
// gradient.
void materialise_norm_weights(Step& st, const Tensor& ones) {
  if (st.zc()) return;
  std::vector<int64_t> norm_ids{st.ids.final_norm};
  for (const LayerParamIds& w : st.ids.layers) {
    norm_ids.push_back(w.input_norm);
    norm_ids.push_back(w.post_norm);
  }
  for (int64_t id : norm_ids) st.zc_w[id] = st.alloc_act({st.cfg.hidden_size});
  if (!st.live) return;
  ProfileRange pr("zc_norm.materialise");
  for (const auto& [id, w1] : st.zc_w) {
    copy_tensor(w1, st.P(id));
    axpy({.x = ones, .y = w1, .alpha = 1.0});
  }
}

}  // namespace

Step Qwen35Model::make_step(Arena& arena, Arena& tmp, Arena& bwd, const MicroBatch* mb,
                            bool backward) {
  const bool live = !arena.is_planning();
  const int64_t T = live ? mb->num_tokens() : max_tokens_;
  const int64_t N = live ? mb->num_segments() : max_docs_;
  const bool full = recompute_ == Recompute::Full;
  // The gated delta rule's optional `saved` (op.h: the forward's chunk-start states and V', which
  // the backward otherwise recomputes in a sequential pass, and its chunk factors T, W, gamma):
  // kept per GDN layer with Recompute::None and Selective (which keeps the GDR's outputs) when a
  // backward follows, on cuda only (ref and cpu ignore it). Full keeps memory down instead: its
  // backward passes no `saved` and recomputes it. Its size grows with the documents of the batch
  // (one chunk slot per 64 tokens plus one per document), and the plan's worst case (max_docs, up
  // to one token per document) would be 64 times the one-document size, so the constructor plans
  // it for batches of up to max_tokens / memory.gdr_saved_min_doc_tokens documents (128 by
  // default: about 1.5x the one-document size); a batch with more documents passes no `saved` and
  // its backward recomputes, with bitwise the same gradients (op.h), only slower.
  const bool keep_gdr_saved = !full && backward && gdr_saved_plan_ > 0;
  const int64_t gdr_saved_size =
      !keep_gdr_saved ? 0
      : live          ? gdr_saved_numel(T, N, cfg_.linear_num_value_heads, cfg_.linear_key_head_dim,
                                        cfg_.linear_value_head_dim)
                      : gdr_saved_plan_;
  return Step{.cfg = cfg_,
              .ids = ids_,
              .fused = fused_,
              .live = live,
              .T = T,
              .N = N,
              .max_tokens = max_tokens_,
              .act = backend_dtype(backend_),
              .stat = backend_ == Backend::Ref ? DType::F64 : DType::F32,
              .dev = backend_device(backend_),
              .backward = backward,
              .full = full,
              .cheap = full || recompute_ == Recompute::Selective,
              .gdr_saved_size = gdr_saved_size,
              .use_gdr_saved = keep_gdr_saved && gdr_saved_size <= gdr_saved_plan_,
              .lce_chunk_bytes = lce_chunk_bytes_,
              .lm_chunk_rows = lm_chunk_rows_,
              .arena = arena,
              .tmp = tmp,
              .bwd = bwd,
              .mb = mb,
              .ids_dev = Tensor(),
              .labels = Tensor(),
              .cu = Tensor(),
              .params = params_,
              .grads = grads_,
              .grad_written = grad_written_,
              .grad_groups = grad_group_,
              .zc_w = {}};
}

void Qwen35Model::upload_inputs(const Step& st) {
  ProfileRange pr("inputs");
  const MicroBatch& mb = *st.mb;
  const size_t tb = static_cast<size_t>(st.T) * 4, cb = static_cast<size_t>(st.N + 1) * 4;
  if (st.dev == Device::CUDA) {
    // Through this step's staging slot, without waiting for the device (see in_stage_).
    const size_t s = static_cast<size_t>(in_slot_);
    in_slot_ ^= 1;
    in_fence_[s].wait();
    char* stage = static_cast<char*>(in_stage_[s].data());
    std::memcpy(stage, mb.input_ids.data(), tb);
    std::memcpy(stage + tb, mb.labels.data(), tb);
    std::memcpy(stage + 2 * tb, mb.cu_seqlens.data(), cb);
    copy_bytes_async(st.ids_dev.data(), st.dev, stage, Device::CPU, tb);
    copy_bytes_async(st.labels.data(), st.dev, stage + tb, Device::CPU, tb);
    copy_bytes_async(st.cu.data(), st.dev, stage + 2 * tb, Device::CPU, cb);
    in_fence_[s].record();
  } else {
    copy_bytes(st.ids_dev.data(), st.dev, mb.input_ids.data(), Device::CPU, tb);
    copy_bytes(st.labels.data(), st.dev, mb.labels.data(), Device::CPU, tb);
    copy_bytes(st.cu.data(), st.dev, mb.cu_seqlens.data(), Device::CPU, cb);
  }
}

void Qwen35Model::run(Arena& arena, Arena& tmp, Arena& bwd, const MicroBatch* mb,
                      const StepOptions& opt, StepStats* stats) {
  Step st = make_step(arena, tmp, bwd, mb, opt.backward);
  const int64_t L = cfg_.num_hidden_layers, T = st.T, D = cfg_.hidden_size;
  // The planned op workspace, for the batches it is planned for (the constructor).
  std::optional<OpWorkspaceBinding> workspace;
  if (st.live && backend_ == Backend::Cuda) {
    if (st.N <= op_workspace_docs_) {
      workspace.emplace(ws_arena_.capacity() > 0 ? ws_arena_.address_at(0) : nullptr,
                        ws_arena_.capacity());
    } else {
      static std::once_flag once;
      std::call_once(once, [&] {
        log::info(
            "model: a micro-batch of {} documents exceeds the {} the op workspace is "
            "planned for; such batches take the grow-only scratch",
            st.N, op_workspace_docs_);
      });
    }
  }
  const auto layer = [&](int64_t l) -> const LayerParamIds& {
    return ids_.layers[static_cast<size_t>(l)];
  };
  // Inputs, and the embedding's plan (ops/embedding/op.h): its forward ranks the ids for its
  // backward at the same time as the gather, so that the backward sorts nothing. Kept to the end.
  st.ids_dev = st.alloc(DType::I32, {T});
  st.labels = st.alloc(DType::I32, {T});
  st.cu = st.alloc(DType::I32, {st.N + 1});
  const Tensor emb_plan = opt.backward && backend_ == Backend::Cuda
                              ? st.alloc(DType::I32, {embedding_plan_numel(T, D)})
                              : Tensor();
  if (st.live) upload_inputs(st);
  // The gated delta rule's chunk index of this micro-batch (cuda): built once on the device and
  // shared by every GDN layer's forward and backward (otherwise each call builds its own).
  const int64_t ix_numel =
      cfg_.num_linear_attention_layers() > 0 ? gdr_batch_index_numel(st.dev, T, st.N) : 0;
  const Tensor ix = ix_numel > 0 ? st.alloc(DType::I32, {ix_numel}) : Tensor();
  std::optional<GdrBatchIndex> gdr_index;
  if (st.live && ix.defined()) {
    ProfileRange pr("gdr.chunk_index");
    gdr_index.emplace(st.cu, T, ix);
  }
  materialise_norm_weights(st, ones_);
  if (!st.live) plan_inputs_end_ = arena.used();  // the embedding backward reads ids (above)

  // Forward. The residual stream: H[l] is the input of layer l, H[L] the final norm's.
  std::vector<Tensor> H(static_cast<size_t>(L + 1));
  std::vector<LayerActs> acts(static_cast<size_t>(L));
  H[0] = st.alloc_act({T, D});
  if (st.live) {
    ProfileRange pr("embedding.fwd");
    embedding_forward({.ids = st.ids_dev, .w = st.P(ids_.embed), .y = H[0], .plan = emb_plan});
  }
  if (!st.live) plan_layer_end_.assign(static_cast<size_t>(L), 0);
  for (int64_t l = 0; l < L; ++l) try {
      const size_t i = static_cast<size_t>(l);
      H[i + 1] = st.alloc_act({T, D});
      layer_forward(st, layer(l), acts[i], H[i], H[i + 1], false);
      // GradMemory::InActivations places layer l's gradients above this planned end: a live step
      // must stay below it (its sizes are at most the plan's, so it does).
      if (!st.live) {
        plan_layer_end_[i] = arena.used();
      } else {
        GDN_CHECK(grad_memory_ != GradMemory::InActivations || arena.used() <= plan_layer_end_[i],
                  "model: layer {}'s activations end at byte {}, past the planned {}", l,
                  arena.used(), plan_layer_end_[i]);
      }
    } catch (const NonFiniteError& e) {
      rethrow_in_layer(e, l, "forward", cfg_);
    }
  const LossHead head = lm_head_forward(st, H[static_cast<size_t>(L)], opt, stats);
  if (!opt.backward && st.live) return;
  if (!st.live) plan_lm_end_ = bwd.peak();  // the LM head's part; the backward's peak from here
  bwd.release_to(head.mark);
  bwd.reset_peak();

  // Backward. dh: the gradient of the residual stream, carried down the layers.
  Tensor dh = st.balloc_act({T, D}), dtmp = st.balloc_act({T, D});
  lm_head_backward(st, H[static_cast<size_t>(L)], head, dh);
  for (int64_t l = L - 1; l >= 0; --l) try {
      const size_t i = static_cast<size_t>(l), mark = bwd.used();
      st.zero_group(i);
      if (recompute_ != Recompute::None) layer_forward(st, layer(l), acts[i], H[i], H[i + 1], true);
      layer_backward(st, layer(l), acts[i], dh, dtmp);
      bwd.release_to(mark);
    } catch (const NonFiniteError& e) {
      rethrow_in_layer(e, l, "backward", cfg_);
    }
  st.zero_group(static_cast<size_t>(L + 1));  // an untied embedding's gradient
  if (st.live) {
    ProfileRange pr("embedding.bwd");
    embedding_backward({.ids = st.ids_dev, .dy = dh, .dw = st.G(ids_.embed), .plan = emb_plan});
  }
}

}  // namespace gdn::model
