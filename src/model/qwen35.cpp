// The Qwen3.5 decoder forward and backward (see qwen35.h for the layer walk).
#include "model/qwen35.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "gdn/core/env.h"
#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "ops/axpy/op.h"
#include "ops/causal_conv1d/op.h"
#include "ops/cross_entropy/op.h"
#include "ops/embedding/op.h"
#include "ops/gated_attention/op.h"
#include "ops/gated_delta_rule/op.h"
#if GDN_WITH_CUDA
#include "ops/gated_delta_rule/cuda.h"
#endif
#include "ops/gated_rmsnorm/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/gemm/op.h"
#include "ops/l2norm/op.h"
#include "ops/linear_cross_entropy/op.h"
#include "ops/mul/op.h"
#include "ops/rmsnorm/op.h"
#include "ops/silu/op.h"
#include "ops/swiglu/op.h"

namespace gdn::model {

using namespace gdn::ops;

DType param_compute_dtype(const ParamSpec& spec, Backend backend) {
  if (backend == Backend::Ref) return DType::F64;
  if (backend == Backend::Cpu) return DType::F32;
  const std::string& n = spec.name;
  if (n.ends_with("linear_attn.A_log") || n.ends_with("linear_attn.dt_bias")) return DType::F32;
  return DType::BF16;
}

namespace {
size_t bytes_of(const ParamSpec& s, DType dt) {
  return static_cast<size_t>(s.numel() * dtype_size(dt));
}
size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

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
}

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

std::string Qwen35Model::memory_plan() const {
  const bool all_fused =
      fused_.conv && fused_.qk_l2norm && fused_.swiglu && fused_.zc_norm && fused_.lm_head;
  size_t grad_total = 0;
  for (const Tensor& g : grads_) grad_total += static_cast<size_t>(g.nbytes());
  const bool shared = grad_memory_ == GradMemory::InActivations;
  return fmt::format(
             "memory plan ({} backend, micro-batch up to {} tokens / {} documents, recompute {}): "
             "parameters {}, gradients {}{}, activations {}{} (+ {} loss and backward scratch, "
             "{} of it the per-layer recompute scratch); total {}",
             backend_name(backend_), max_tokens_, max_docs_, recompute_name(recompute_),
             format_bytes(static_cast<double>(param_bytes())),
             format_bytes(static_cast<double>(grad_total)),
             shared ? " (in activation memory the backward has consumed)" : "",
             format_bytes(static_cast<double>(act_arena_.capacity())),
             shared ? " with the gradients" : "",
             format_bytes(static_cast<double>(bwd_arena_.capacity())),
             format_bytes(static_cast<double>(tmp_arena_.capacity())),
             format_bytes(static_cast<double>(param_bytes() + grad_bytes() + activation_bytes()))) +
         (gdr_saved_plan_ == 0
              ? std::string()
              : fmt::format("; the activations include GDR saved states of {} per GDN layer "
                            "(batches of up to {} documents)",
                            format_bytes(static_cast<double>(gdr_saved_plan_) * 2),
                            gdr_saved_docs_)) +
         (all_fused ? std::string()
                    : fmt::format("; unfused A/B routes in use ({})", fused_.describe()));
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
// The step itself. With a planning arena (mb == nullptr) every allocation happens with the
// largest sizes and no op runs, which is how the activation arena is sized.
namespace {

struct LayerActs {
  Tensor h_in, rstd_in, xn;                         // [T, D], [T], [T, D]
  Tensor qkv, q, k, v, z, a, b, g, beta, o, nrstd;  // GDN
  Tensor qn, kn, qn_rstd,
      kn_rstd;  // GDN, kernels.fused_qk_l2norm false: l2norm(q), l2norm(k), their rstd
  Tensor qg, ak, av, q_hat, k_hat, attn, lse, q_rstd, k_rstd;  // attention
  Tensor y;                                     // mixer output before the out projection
  Tensor h_mid, rstd_post, xn2, gate, up, act;  // MLP
  // [gdr_saved_numel(T, N, Hv, dk, dv)]: the GDR forward's state pass for its backward, or none.
  Tensor gdr_saved;
};

void copy_tensor(const Tensor& dst, const Tensor& src) {
  copy_bytes(dst.data(), dst.device(), src.data(), src.device(), static_cast<size_t>(src.nbytes()));
}

// The GDN in-projection's output and its gradient are kept planar: [q block | k block | v block],
// each block [T, w] contiguous (w = KD, KD, VD), rather than token-major [T, C]. The q/k/v GEMMs
// write their blocks through the matching row slices of in_proj_qkv, the conv runs once per block
// (it is depthwise: channels are independent) and writes q, k and v straight into the tensors the
// gated delta rule reads, so no column split is copied in either direction (it cost 2 x 2.3 ms a
// step at 0.8B: PERF.md run 15).
struct QkvBlock {
  int64_t col, width;  // the block's channels [col, col + width) of the C = 2 KD + VD
};

Tensor block_of(const Tensor& planar, const QkvBlock& b) {  // planar [T, C] -> [T, width]
  const int64_t T = planar.size(0);
  return planar.reshape({planar.numel()})
      .slice0(T * b.col, T * (b.col + b.width))
      .reshape({T, b.width});
}

}  // namespace

// Adds the layer to a non-finite finding, so the trainer's guard can name where it happened.
[[noreturn]] void rethrow_in_layer(const NonFiniteError& e, int64_t layer, const char* pass,
                                   const Qwen35Config& c) {
  throw NonFiniteError(
      fmt::format("layer {} ({}, {}): {}", layer, c.is_full_attention(layer) ? "attention" : "GDN",
                  pass, e.message()),
      e.hint(), e.file(), e.line());
}

struct Qwen35Model::Pass {
  const Qwen35Model& m;
  Arena& A;  // the forward's activations
  Arena& B;  // what is made after the forward: loss, LM head workspace, backward temporaries
  bool live;
  int64_t T, N;
  DType act, stat;
  Device dev;
  Tensor P(int64_t id) const { return m.params_.at(static_cast<size_t>(id)); }
  Tensor G(int64_t id) const { return m.grads_.at(static_cast<size_t>(id)); }
  Tensor alloc(DType dt, std::initializer_list<int64_t> shape) { return A.alloc_tensor(dt, shape); }
  Tensor alloc_act(std::initializer_list<int64_t> shape) { return A.alloc_tensor(act, shape); }
  Tensor balloc(DType dt, std::initializer_list<int64_t> shape) {
    return B.alloc_tensor(dt, shape);
  }
  Tensor balloc_act(std::initializer_list<int64_t> shape) { return B.alloc_tensor(act, shape); }
  // GradMemory::InActivations: zeroes gradient group g (qwen35.h) before its first write.
  void zero_group(size_t g) const {
    if (!live || m.grad_memory_ != GradMemory::InActivations) return;
    const Tensor& t = m.grad_group_.at(g);
    if (t.defined()) zero_bytes(t.data(), dev, static_cast<size_t>(t.nbytes()));
  }
};

void Qwen35Model::run(Arena& arena, Arena& tmp, Arena& bwd, const MicroBatch* mb,
                      const StepOptions& opt, StepStats* stats) {
  const Qwen35Config& c = cfg_;
  const bool live = !arena.is_planning();
  Pass p{*this,
         arena,
         bwd,
         live,
         live ? mb->num_tokens() : max_tokens_,
         live ? mb->num_segments() : max_docs_,
         backend_dtype(backend_),
         backend_ == Backend::Ref ? DType::F64 : DType::F32,
         backend_device(backend_)};
  auto P = [&p](int64_t id) { return p.P(id); };
  auto G = [&p](int64_t id) { return p.G(id); };
  const int64_t T = p.T, N = p.N, D = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads,
                dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, C = c.conv_dim(),
                W = c.linear_conv_kernel_dim, KD = c.key_dim(), VD = c.value_dim();
  const QkvBlock blocks[3] = {{0, KD}, {KD, KD}, {2 * KD, VD}};  // q, k, v channels of the conv
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const double eps = c.rms_norm_eps;
  const int64_t L = c.num_hidden_layers;
  const bool backward = opt.backward;

  // Inputs.
  Tensor ids = p.alloc(DType::I32, {T});     // [T]
  Tensor labels = p.alloc(DType::I32, {T});  // [T]
  Tensor cu = p.alloc(DType::I32, {N + 1});  // [N+1]
  // The embedding's plan (ops/embedding/op.h): its forward ranks the ids for its backward at the
  // same time as the gather, so that the backward sorts nothing. Kept with the ids to the end.
  Tensor emb_plan = backward && backend_ == Backend::Cuda
                        ? p.alloc(DType::I32, {embedding_plan_numel(T, D)})
                        : Tensor();
  if (live) {
    ProfileRange pr("inputs");
    const size_t tb = static_cast<size_t>(T) * 4, cb = static_cast<size_t>(N + 1) * 4;
    if (p.dev == Device::CUDA) {
      // Through this step's staging slot, without waiting for the device (see in_stage_).
      const size_t s = static_cast<size_t>(in_slot_);
      in_slot_ ^= 1;
      in_fence_[s].wait();
      char* st = static_cast<char*>(in_stage_[s].data());
      std::memcpy(st, mb->input_ids.data(), tb);
      std::memcpy(st + tb, mb->labels.data(), tb);
      std::memcpy(st + 2 * tb, mb->cu_seqlens.data(), cb);
      copy_bytes_async(ids.data(), p.dev, st, Device::CPU, tb);
      copy_bytes_async(labels.data(), p.dev, st + tb, Device::CPU, tb);
      copy_bytes_async(cu.data(), p.dev, st + 2 * tb, Device::CPU, cb);
      in_fence_[s].record();
    } else {
      copy_bytes(ids.data(), p.dev, mb->input_ids.data(), Device::CPU, tb);
      copy_bytes(labels.data(), p.dev, mb->labels.data(), Device::CPU, tb);
      copy_bytes(cu.data(), p.dev, mb->cu_seqlens.data(), Device::CPU, cb);
    }
  }
#if GDN_WITH_CUDA
  // The gated delta rule's chunk index of this micro-batch: built once on the device and shared by
  // every GDN layer's forward and backward (otherwise each call builds its own).
  std::optional<GdrChunkIndexScope> gdr_index;
  if (backend_ == Backend::Cuda && c.num_linear_attention_layers() > 0) {
    Tensor ix = p.alloc(DType::I32, {gdr_chunk_index_numel(T, N)});
    if (live) {
      ProfileRange pr("gdr.chunk_index");
      gdr_index.emplace(cu, T, ix);
    }
  }
#endif

  // The zero-centred norms' weights. Fused (default): the rmsnorm kernel forms (1 + w) in fp32.
  // kernels.fused_zc_norm false: 1 + w is materialised once per step (a copy of w, then axpy of the
  // ones vector: fp32 arithmetic, rounded to the parameter dtype) and the plain rmsnorm runs on it;
  // its dw = sum(dy * xhat) is also d loss / dw (d(1 + w)/dw = 1), so it accumulates into w's
  // gradient.
  const bool zc = fused_.zc_norm;
  std::map<int64_t, Tensor> zc_w;  // param id -> [D] 1 + w (unfused route only)
  if (!zc) {
    std::vector<int64_t> norm_ids{ids_.final_norm};
    for (const LayerParamIds& w : ids_.layers) {
      norm_ids.push_back(w.input_norm);
      norm_ids.push_back(w.post_norm);
    }
    for (int64_t id : norm_ids) zc_w[id] = p.alloc_act({D});
    if (live) {
      ProfileRange pr("zc_norm.materialise");
      for (const auto& [id, w1] : zc_w) {
        copy_tensor(w1, P(id));
        axpy({ones_, w1, 1.0});
      }
    }
  }
  auto NW = [&](int64_t id) { return zc ? P(id) : zc_w.at(id); };

  if (!live) plan_inputs_end_ = arena.used();  // the embedding backward reads ids (above)

  // Residual stream: H[l] is the input of layer l, H[L] the input of the final norm.
  std::vector<Tensor> H(static_cast<size_t>(L + 1));
  H[0] = p.alloc_act({T, D});
  if (live) {
    ProfileRange pr("embedding.fwd");
    embedding_forward({ids, P(ids_.embed), H[0], emb_plan});
  }

  // Where each layer activation lives. Kept ones stay in `arena` for the backward; dropped ones go
  // to `tmp`, the per-layer scratch (reset at every layer), and the backward recomputes them from
  // the kept ones just before the layer's backward. Recompute::None keeps everything; Full keeps
  // only the residual stream H[l]; Selective keeps the GEMM, GDR and attention outputs and
  // recomputes the memory-bound ops' outputs (norms, conv, gated norm, SwiGLU).
  const bool full = recompute_ == Recompute::Full;
  const bool cheap = full || recompute_ == Recompute::Selective;
  // The gated delta rule's optional `saved` (op.h: the forward's chunk-start states and V', which
  // the backward otherwise recomputes in a sequential pass, and its chunk factors T, W, gamma):
  // kept per GDN layer with Recompute::None and Selective (which keeps the GDR's outputs) when a
  // backward follows, on cuda only (ref and cpu ignore it). Full keeps memory down instead: its
  // backward passes no `saved` and recomputes it. Its size grows with the documents of the batch
  // (one chunk slot per 64 tokens plus one per document), and the plan's worst case (max_docs, up
  // to one token per document) would be 64 times the one-document size, so the constructor plans it
  // for batches of up to max_tokens / memory.gdr_saved_min_doc_tokens documents (128 by default:
  // about 1.5x the one-document size); a batch with more documents passes no `saved` and its
  // backward recomputes, with bitwise the same gradients (op.h), only slower.
  const bool keep_gdr_saved = !full && backward && gdr_saved_plan_ > 0;
  const int64_t gdr_saved_size = !keep_gdr_saved ? 0
                                 : live          ? gdr_saved_numel(T, N, Hv, dk, dv)
                                                 : gdr_saved_plan_;
  const bool use_gdr_saved = keep_gdr_saved && gdr_saved_size <= gdr_saved_plan_;
  // Sets `field` to a new activation: in the scratch when dropped, otherwise in the arena. The
  // backward's recompute (`again`) re-creates only the dropped ones; kept ones stay as they are.
  auto place = [&](Tensor& field, DType dt, bool drop, bool again,
                   std::initializer_list<int64_t> shape) {
    if (again && !drop) return;
    field = (drop ? tmp : arena).alloc_tensor(dt, shape);
  };
  std::vector<LayerActs> acts(static_cast<size_t>(L));
  // The forward of layer l into acts[l]; with `again` (the backward's recompute) only the ops whose
  // outputs were dropped run, and h_out is left alone.
  auto layer_forward = [&](int64_t l, bool again) {
    const LayerParamIds& w = ids_.layers[static_cast<size_t>(l)];
    LayerActs& s = acts[static_cast<size_t>(l)];
    tmp.reset();
    auto run_op = [&](bool output_dropped) { return live && (!again || output_dropped); };
    s.h_in = H[static_cast<size_t>(l)];
    place(s.rstd_in, p.stat, full, again, {T});
    place(s.xn, p.act, cheap, again, {T, D});
    if (run_op(cheap)) {
      ProfileRange pr("rmsnorm.fwd");
      rmsnorm_forward({s.h_in, NW(w.input_norm), s.xn, s.rstd_in, eps, zc});
    }
    Tensor y_out_w;  // the out projection weight of the mixer
    if (w.type == LayerType::Linear) {
      place(s.qkv, p.act, full, again, {T, C});  // planar (block_of)
      place(s.z, p.act, full, again, {T, VD});
      place(s.b, p.act, full, again, {T, Hv});
      place(s.a, p.act, full, again, {T, Hv});
      // kernels.fused_qk_l2norm false: the backward reads the normalised q, k (and their rstd)
      // instead, so q and k themselves live in the scratch.
      const bool qk_fused = fused_.qk_l2norm;
      place(s.q, p.act, cheap || !qk_fused, again, {T, Hk, dk});
      place(s.k, p.act, cheap || !qk_fused, again, {T, Hk, dk});
      if (!qk_fused) {
        place(s.qn, p.act, cheap, again, {T, Hk, dk});
        place(s.kn, p.act, cheap, again, {T, Hk, dk});
        place(s.qn_rstd, p.stat, cheap, again, {T * Hk});
        place(s.kn_rstd, p.stat, cheap, again, {T * Hk});
      }
      place(s.v, p.act, cheap, again, {T, Hv, dv});
      place(s.g, p.stat, full, again, {T, Hv});
      place(s.beta, p.stat, full, again, {T, Hv});
      place(s.o, p.act, full, again, {T, Hv, dv});
      place(s.nrstd, p.stat, full, again, {T * Hv});
      place(s.y, p.act, cheap, again, {T, VD});
      if (use_gdr_saved) place(s.gdr_saved, p.act, false, again, {gdr_saved_size});
      if (run_op(full)) {
        ProfileRange pr("gdn.in_proj.fwd");
        for (const QkvBlock& b : blocks)
          linear_forward(
              {s.xn, P(w.in_proj_qkv).slice0(b.col, b.col + b.width), block_of(s.qkv, b)});
        linear_forward({s.xn, P(w.in_proj_z), s.z});
        linear_forward({s.xn, P(w.in_proj_b), s.b});
        linear_forward({s.xn, P(w.in_proj_a), s.a});
      }
      if (run_op(cheap)) {
        ProfileRange pr("conv.fwd");
        const Tensor outs[3] = {s.q, s.k, s.v}, conv_w = P(w.conv1d).reshape({C, W});
        for (int i = 0; i < 3; ++i) {
          const QkvBlock& b = blocks[i];
          const Tensor out = outs[i].reshape({T, b.width});
          causal_conv1d_forward({block_of(s.qkv, b), conv_w.slice0(b.col, b.col + b.width),
                                 Tensor(), cu, Tensor(), out, Tensor(), fused_.conv});
          if (!fused_.conv) {  // kernels.fused_conv false: the SiLU as its own pass, in place
            pr.next("conv.silu.fwd");
            silu_forward({out, out});
            pr.next("conv.fwd");
          }
        }
        if (!qk_fused) {  // the l2norm op, then the gated delta rule without its own
          pr.next("gdn.l2norm.fwd");
          l2norm_forward(
              {s.q.reshape({T * Hk, dk}), s.qn.reshape({T * Hk, dk}), s.qn_rstd, kGdrL2NormEps});
          l2norm_forward(
              {s.k.reshape({T * Hk, dk}), s.kn.reshape({T * Hk, dk}), s.kn_rstd, kGdrL2NormEps});
        }
      }
      if (run_op(full)) {
        ProfileRange pr("gdn_gates.fwd");
        gdn_gates_forward({s.a, s.b, P(w.a_log), P(w.dt_bias), s.g, s.beta});
        pr.next("gdr.fwd");
        gated_delta_rule_forward({qk_fused ? s.q : s.qn, qk_fused ? s.k : s.kn, s.v, s.g, s.beta,
                                  cu, Tensor(), s.o, Tensor(), 0.0, qk_fused, s.gdr_saved});
      }
      if (run_op(cheap)) {
        ProfileRange pr("gated_rmsnorm.fwd");
        gated_rmsnorm_forward({s.o.reshape({T * Hv, dv}), s.z.reshape({T * Hv, dv}),
                               P(w.gated_norm), s.y.reshape({T * Hv, dv}), s.nrstd, eps});
      }
      y_out_w = P(w.out_proj);
    } else {
      place(s.qg, p.act, full, again, {T, Hq, 2 * hd});
      place(s.ak, p.act, full, again, {T, Hkv, hd});
      place(s.av, p.act, full, again, {T, Hkv, hd});
      place(s.y, p.act, full, again, {T, Hq, hd});
      place(s.q_hat, p.act, full, again, {T, Hq, hd});
      place(s.k_hat, p.act, full, again, {T, Hkv, hd});
      place(s.attn, p.act, full, again, {T, Hq, hd});
      place(s.lse, p.stat, full, again, {T, Hq});
      place(s.q_rstd, p.stat, full, again, {T, Hq});
      place(s.k_rstd, p.stat, full, again, {T, Hkv});
      if (run_op(full)) {
        ProfileRange pr("attn.in_proj.fwd");
        linear_forward({s.xn, P(w.q_proj), s.qg.reshape({T, Hq * 2 * hd})});
        linear_forward({s.xn, P(w.k_proj), s.ak.reshape({T, Hkv * hd})});
        linear_forward({s.xn, P(w.v_proj), s.av.reshape({T, Hkv * hd})});
        pr.next("attn.core.fwd");
        gated_attention_forward({s.qg, s.ak, s.av, P(w.q_norm), P(w.k_norm), cu, s.y, s.q_hat,
                                 s.k_hat, s.attn, s.lse, s.q_rstd, s.k_rstd, c.rotary_dim(),
                                 c.rope_theta, eps});
      }
      y_out_w = P(w.o_proj);
    }
    // h_mid = h_in + y·W_outᵀ: copy, then the GEMM accumulates (β = 1).
    place(s.h_mid, p.act, full, again, {T, D});
    place(s.rstd_post, p.stat, full, again, {T});
    place(s.xn2, p.act, cheap, again, {T, D});
    place(s.gate, p.act, full, again, {T, I});
    place(s.up, p.act, full, again, {T, I});
    place(s.act, p.act, cheap, again, {T, I});
    if (run_op(full)) {
      ProfileRange pr("out_proj.fwd");
      copy_tensor(s.h_mid, s.h_in);
      Tensor y2 = s.y.reshape({T, s.y.numel() / T});
      gemm({y2, y_out_w, s.h_mid, false, true, 1.0, 1.0});
    }
    if (run_op(cheap)) {
      ProfileRange pr("rmsnorm.fwd");
      rmsnorm_forward({s.h_mid, NW(w.post_norm), s.xn2, s.rstd_post, eps, zc});
    }
    if (run_op(full)) {
      ProfileRange pr("mlp.gate_up.fwd");
      linear_forward({s.xn2, P(w.mlp_gate), s.gate});
      linear_forward({s.xn2, P(w.mlp_up), s.up});
    }
    if (run_op(cheap)) {
      ProfileRange pr("swiglu.fwd");
      if (fused_.swiglu) {
        swiglu_forward({s.gate, s.up, s.act});
      } else {  // kernels.fused_swiglu false: act = silu(gate), then act *= up, as two passes
        silu_forward({s.gate, s.act});
        pr.next("swiglu.mul.fwd");
        mul({s.act, s.up, s.act});
      }
    }
    if (!again && live) {
      ProfileRange pr("mlp.down.fwd");
      const Tensor& h_out = H[static_cast<size_t>(l + 1)];
      copy_tensor(h_out, s.h_mid);
      gemm({s.act, P(w.mlp_down), h_out, false, true, 1.0, 1.0});
    }
  };
  if (!live) plan_layer_end_.assign(static_cast<size_t>(L), 0);
  for (int64_t l = 0; l < L; ++l) try {
      H[static_cast<size_t>(l + 1)] = p.alloc_act({T, D});
      layer_forward(l, false);
      // GradMemory::InActivations places layer l's gradients above this planned end: a live step
      // must stay below it (its sizes are at most the plan's, so it does).
      if (!live) {
        plan_layer_end_[static_cast<size_t>(l)] = arena.used();
      } else {
        GDN_CHECK(grad_memory_ != GradMemory::InActivations ||
                      arena.used() <= plan_layer_end_[static_cast<size_t>(l)],
                  "model: layer {}'s activations end at byte {}, past the planned {}", l,
                  arena.used(), plan_layer_end_[static_cast<size_t>(l)]);
      }
    } catch (const NonFiniteError& e) {
      rethrow_in_layer(e, l, "forward", c);
    }

  // Final norm and the LM head loss.
  // From here on everything is made in `bwd` (Pass::B): first what lives to the end of the step
  // (the loss, its statistics, dhn for the final norm's backward), then, up to lm_mark, what only
  // the LM head uses (its input, workspace or logits chunk), released before the layers' backward.
  const int64_t head = ids_.lm_head >= 0 ? ids_.lm_head : ids_.embed;
  const bool lm_fused = fused_.lm_head;
  Tensor hn_rstd = p.balloc(p.stat, {T});
  Tensor row_loss = lm_fused ? Tensor() : p.balloc(p.stat, {T});
  Tensor row_z = lm_fused ? Tensor() : p.balloc(p.stat, {T});
  Tensor loss = p.balloc(p.stat, {1});
  Tensor lse = p.balloc(p.stat, {T});
  Tensor zl = p.balloc(p.stat, {1});
  Tensor dhn = p.balloc_act({T, D});
  Tensor tl_lse = p.balloc(p.stat, {T});  // per-token lse / z-loss when token_loss is asked for
  Tensor tl_z = p.balloc(p.stat, {T});
  const size_t lm_mark = bwd.used();
  Tensor hn = p.balloc_act({T, D});
  // The fused route's workspace, or (kernels.fused_lm_head false) the unfused route's logits chunk
  // [lm_chunk_rows_, V].
  const int64_t ws_bytes =
      lm_fused ? linear_cross_entropy_workspace_bytes(max_tokens_, V, lce_chunk_bytes_) : 0;
  Tensor ws = lm_fused ? p.balloc(DType::F32, {(ws_bytes + 3) / 4}) : Tensor();
  Tensor logits_chunk = lm_fused ? Tensor() : p.balloc_act({lm_chunk_rows_, V});
  if (backward) p.zero_group(static_cast<size_t>(L));  // the head's gradients
  int64_t targets = 0;
  if (live) {
    for (int32_t lab : mb->labels) targets += lab != -100;
    {
      ProfileRange pr("rmsnorm.fwd");
      rmsnorm_forward({H[static_cast<size_t>(L)], NW(ids_.final_norm), hn, hn_rstd, eps, zc});
    }
    if (opt.logits.defined()) {
      ProfileRange pr("lm_head_loss");
      linear_forward({hn, P(head), opt.logits});
    }
  }
  if (live && lm_fused) {
    ProfileRange pr("lm_head_loss");
    if (opt.token_loss.defined()) {
      LinearCrossEntropyArgs la;
      la.x = hn;
      la.w = P(head);
      la.targets = labels;
      la.loss = opt.token_loss;
      la.lse = tl_lse;
      la.z_loss = tl_z;
      la.workspace = ws;
      la.chunk_bytes = lce_chunk_bytes_;
      la.reduction = LceReduction::None;
      linear_cross_entropy_forward(la);
    }
    LinearCrossEntropyArgs la;
    la.x = hn;
    la.w = P(head);
    la.targets = labels;
    la.loss = loss;
    la.lse = lse;
    la.z_loss = zl;
    la.workspace = ws;
    la.chunk_bytes = lce_chunk_bytes_;
    la.reduction = LceReduction::Mean;
    la.z_loss_scale = opt.z_loss;
    la.denominator = opt.loss_denominator;
    if (backward) {
      la.dx = dhn;
      la.dw = G(head);
      linear_cross_entropy_forward_backward(la);
    } else {
      linear_cross_entropy_forward(la);
    }
    stats->loss_dev = loss;
    stats->z_loss_dev = zl;
    if (opt.host_stats) {
      stats->loss = to_f64_vector(loss)[0];
      stats->z_loss = to_f64_vector(zl)[0];
    } else {
      stats->loss = stats->z_loss = std::numeric_limits<double>::quiet_NaN();
    }
    stats->targets = targets;
  } else if (live) {
    // kernels.fused_lm_head false: per chunk of rows, the logits by gemm, the cross_entropy pass
    // (loss, lse, z-loss and, for the backward, c dL/dz over the logits), then dx = G W (=) and dW
    // += G^T x by gemm. The mean over the denominator (as linear_cross_entropy's: the caller's,
    // else this batch's targets; 0 gives loss 0 and zero gradients) is c = 1 / den; the rows are
    // summed on the host in double.
    const double den =
        opt.loss_denominator >= 0 ? opt.loss_denominator : static_cast<double>(targets);
    const double c = den > 0 ? 1.0 / den : 0.0;
    for (int64_t r0 = 0; r0 < T; r0 += lm_chunk_rows_) {
      const int64_t r1 = std::min(T, r0 + lm_chunk_rows_);
      const Tensor z = logits_chunk.slice0(0, r1 - r0), hc = hn.slice0(r0, r1);
      const Tensor lab = labels.slice0(r0, r1);
      ProfileRange pr("lm_head.logits");
      linear_forward({hc, P(head), z});
      pr.next("lm_head.ce");
      if (opt.token_loss.defined())
        cross_entropy({z, lab, opt.token_loss.slice0(r0, r1), tl_lse.slice0(r0, r1),
                       tl_z.slice0(r0, r1), Tensor(), 0.0, 1.0});
      cross_entropy({z, lab, row_loss.slice0(r0, r1), lse.slice0(r0, r1), row_z.slice0(r0, r1),
                     backward ? z : Tensor(), opt.z_loss, c});
      if (backward) {
        pr.next("lm_head.grad");
        linear_backward({hc, P(head), z, dhn.slice0(r0, r1), G(head), false});
      }
    }
    double lsum = 0, zsum = 0;
    for (double v : to_f64_vector(row_loss)) lsum += v;
    for (double v : to_f64_vector(row_z)) zsum += v;
    stats->loss = den > 0 ? lsum / den : 0.0;
    stats->z_loss = den > 0 ? zsum / den : 0.0;
    stats->targets = targets;
    // The device copies a deferred trainer reads (this A/B route reads its row losses on the host,
    // so unlike the fused route it waits for the device once per micro-batch).
    copy_into(loss, from_f64(std::vector<double>{stats->loss}, loss.dtype(), {1}));
    copy_into(zl, from_f64(std::vector<double>{stats->z_loss}, zl.dtype(), {1}));
    stats->loss_dev = loss;
    stats->z_loss_dev = zl;
  }
  if (!backward && live) return;
  if (!live) plan_lm_end_ = bwd.peak();  // the LM head's part; the backward's peak from here
  bwd.release_to(lm_mark);
  bwd.reset_peak();

  // ---------------------------------------------------------------- backward
  // GradMemory::InActivations: every layer GEMM's weight gradient is written (=) by its one
  // linear_backward of the step (the q/k/v blocks of in_proj_qkv are disjoint rows), so those
  // gradients need no zeroing; the group memset covers the others (place_grads_in_activations).
  // ow(id): whether the GEMM of weight id writes its gradient, from the same grad_written_ that
  // placed it among the unzeroed ones (empty with GradMemory::Separate: every GEMM accumulates).
  auto ow = [&](int64_t id) {
    return !grad_written_.empty() && grad_written_.at(static_cast<size_t>(id));
  };
  Tensor dh = p.balloc_act({T, D});  // gradient of the residual stream, carried down the layers
  Tensor dtmp = p.balloc_act({T, D});
  if (live) {
    ProfileRange pr("rmsnorm.bwd");
    rmsnorm_backward(
        {H[static_cast<size_t>(L)], NW(ids_.final_norm), hn_rstd, dhn, dh, G(ids_.final_norm), zc});
  }
  for (int64_t l = L - 1; l >= 0; --l) try {
      const LayerParamIds& w = ids_.layers[static_cast<size_t>(l)];
      const LayerActs& s = acts[static_cast<size_t>(l)];
      const size_t mark = bwd.used();
      p.zero_group(static_cast<size_t>(l));
      if (recompute_ != Recompute::None) layer_forward(l, true);
      // MLP: h_out = h_mid + act·W_downᵀ.
      Tensor dact = p.balloc_act({T, I}), dgate = p.balloc_act({T, I}), dup = p.balloc_act({T, I});
      Tensor dxn2 = p.balloc_act({T, D});
      if (live) {
        {
          ProfileRange pr("mlp.down.bwd");
          linear_backward({s.act, P(w.mlp_down), dh, dact, G(w.mlp_down), false, ow(w.mlp_down)});
        }
        {
          ProfileRange pr("swiglu.bwd");
          if (fused_.swiglu) {
            swiglu_backward({s.gate, s.up, dact, dgate, dup});
          } else {
            // kernels.fused_swiglu false: sg = silu(gate) recomputed into dgate's buffer; dup =
            // dact * sg; d sg = dact * up over sg; dgate = d sg * silu'(gate) in place.
            silu_forward({s.gate, dgate});
            pr.next("swiglu.mul.bwd");
            mul({dact, dgate, dup});
            mul({dact, s.up, dgate});
            pr.next("swiglu.silu.bwd");
            silu_backward({s.gate, dgate, dgate});
          }
        }
        {
          ProfileRange pr("mlp.gate_up.bwd");
          linear_backward(
              {s.xn2, P(w.mlp_gate), dgate, dxn2, G(w.mlp_gate), false, ow(w.mlp_gate)});
          linear_backward({s.xn2, P(w.mlp_up), dup, dxn2, G(w.mlp_up), true, ow(w.mlp_up)});
        }
        ProfileRange pr("rmsnorm.bwd");
        rmsnorm_backward({s.h_mid, NW(w.post_norm), s.rstd_post, dxn2, dtmp, G(w.post_norm), zc});
        axpy({dtmp, dh, 1.0});  // dh = d h_mid
      }
      Tensor dxn = p.balloc_act({T, D});
      Tensor dy = p.balloc_act({T, s.y.numel() / std::max<int64_t>(p.T, 1)});
      if (w.type == LayerType::Linear) {
        Tensor dz = p.balloc_act({T, VD}), d_o = p.balloc_act({T, Hv, dv});
        Tensor dq = p.balloc_act({T, Hk, dk}), dkk = p.balloc_act({T, Hk, dk}),
               dvv = p.balloc_act({T, Hv, dv});
        Tensor dg = p.balloc(p.stat, {T, Hv}), dbeta = p.balloc(p.stat, {T, Hv});
        Tensor da = p.balloc_act({T, Hv}), db = p.balloc_act({T, Hv});
        Tensor dqkv = p.balloc_act({T, C});  // planar (block_of)
        const bool qk_fused = fused_.qk_l2norm;
        // kernels.fused_qk_l2norm false: the gated delta rule's gradients of the normalised q, k.
        Tensor dqn = qk_fused ? Tensor() : p.balloc_act({T, Hk, dk});
        Tensor dkn = qk_fused ? Tensor() : p.balloc_act({T, Hk, dk});
        if (live) {
          {
            ProfileRange pr("out_proj.bwd");
            linear_backward({s.y, P(w.out_proj), dh, dy, G(w.out_proj), false, ow(w.out_proj)});
          }
          ProfileRange pr_n("gated_rmsnorm.bwd");
          gated_rmsnorm_backward({s.o.reshape({T * Hv, dv}), s.z.reshape({T * Hv, dv}),
                                  P(w.gated_norm), s.nrstd, dy.reshape({T * Hv, dv}),
                                  d_o.reshape({T * Hv, dv}), dz.reshape({T * Hv, dv}),
                                  G(w.gated_norm)});
          pr_n.next("gdr.bwd");
          gated_delta_rule_backward({qk_fused ? s.q : s.qn, qk_fused ? s.k : s.kn, s.v, s.g, s.beta,
                                     cu, Tensor(), d_o, Tensor(), qk_fused ? dq : dqn,
                                     qk_fused ? dkk : dkn, dvv, dg, dbeta, Tensor(), 0.0, qk_fused,
                                     s.gdr_saved});
          if (!qk_fused) {
            pr_n.next("gdn.l2norm.bwd");
            l2norm_backward({s.qn.reshape({T * Hk, dk}), s.qn_rstd, dqn.reshape({T * Hk, dk}),
                             dq.reshape({T * Hk, dk})});
            l2norm_backward({s.kn.reshape({T * Hk, dk}), s.kn_rstd, dkn.reshape({T * Hk, dk}),
                             dkk.reshape({T * Hk, dk})});
          }
          pr_n.next("gdn_gates.bwd");
          gdn_gates_backward(
              {s.a, s.b, P(w.a_log), P(w.dt_bias), dg, dbeta, da, db, G(w.a_log), G(w.dt_bias)});
          const Tensor dout[3] = {dq, dkk, dvv}, conv_w = P(w.conv1d).reshape({C, W});
          for (int i = 0; i < 3; ++i) {
            const QkvBlock& b = blocks[i];
            const Tensor x_b = block_of(s.qkv, b), dx_b = block_of(dqkv, b);
            const Tensor dy_b = dout[i].reshape({T, b.width});
            const Tensor w_b = conv_w.slice0(b.col, b.col + b.width);
            if (!fused_.conv) {
              // kernels.fused_conv false: recompute the conv's pre-activation with a conv pass (the
              // fused backward does it in registers) into dx_b, which the conv backward writes only
              // after the silu backward has read it; then dy_b = dy_b * silu'(pre) in place.
              pr_n.next("conv.silu.bwd");
              causal_conv1d_forward({x_b, w_b, Tensor(), cu, Tensor(), dx_b, Tensor(), false});
              silu_backward({dx_b, dy_b, dy_b});
            }
            pr_n.next("conv.bwd");
            causal_conv1d_backward({x_b, w_b, Tensor(), cu, Tensor(), dy_b, Tensor(), dx_b,
                                    G(w.conv1d).reshape({C, W}).slice0(b.col, b.col + b.width),
                                    Tensor(), Tensor(), fused_.conv});
          }
          pr_n.next("gdn.in_proj.bwd");
          for (int i = 0; i < 3; ++i) {
            const QkvBlock& b = blocks[i];
            linear_backward(
                {s.xn, P(w.in_proj_qkv).slice0(b.col, b.col + b.width), block_of(dqkv, b), dxn,
                 G(w.in_proj_qkv).slice0(b.col, b.col + b.width), i > 0, ow(w.in_proj_qkv)});
          }
          linear_backward({s.xn, P(w.in_proj_z), dz, dxn, G(w.in_proj_z), true, ow(w.in_proj_z)});
          linear_backward({s.xn, P(w.in_proj_b), db, dxn, G(w.in_proj_b), true, ow(w.in_proj_b)});
          linear_backward({s.xn, P(w.in_proj_a), da, dxn, G(w.in_proj_a), true, ow(w.in_proj_a)});
        }
      } else {
        Tensor dqg = p.balloc_act({T, Hq, 2 * hd}), dk = p.balloc_act({T, Hkv, hd}),
               dv2 = p.balloc_act({T, Hkv, hd});
        if (live) {
          Tensor y2 = s.y.reshape({T, Hq * hd});
          ProfileRange pr("out_proj.bwd");
          linear_backward({y2, P(w.o_proj), dh, dy, G(w.o_proj), false, ow(w.o_proj)});
          pr.next("attn.core.bwd");
          gated_attention_backward({s.qg,
                                    s.ak,
                                    s.av,
                                    P(w.q_norm),
                                    P(w.k_norm),
                                    cu,
                                    s.q_hat,
                                    s.k_hat,
                                    s.attn,
                                    s.lse,
                                    s.q_rstd,
                                    s.k_rstd,
                                    dy.reshape({T, Hq, hd}),
                                    dqg,
                                    dk,
                                    dv2,
                                    G(w.q_norm),
                                    G(w.k_norm),
                                    c.rotary_dim(),
                                    c.rope_theta,
                                    eps});
          pr.next("attn.in_proj.bwd");
          linear_backward({s.xn, P(w.q_proj), dqg.reshape({T, Hq * 2 * hd}), dxn, G(w.q_proj),
                           false, ow(w.q_proj)});
          linear_backward(
              {s.xn, P(w.k_proj), dk.reshape({T, Hkv * hd}), dxn, G(w.k_proj), true, ow(w.k_proj)});
          linear_backward({s.xn, P(w.v_proj), dv2.reshape({T, Hkv * hd}), dxn, G(w.v_proj), true,
                           ow(w.v_proj)});
        }
      }
      if (live) {
        ProfileRange pr("rmsnorm.bwd");
        rmsnorm_backward({s.h_in, NW(w.input_norm), s.rstd_in, dxn, dtmp, G(w.input_norm), zc});
        axpy({dtmp, dh, 1.0});  // dh = d h_in
      }
      bwd.release_to(mark);
    } catch (const NonFiniteError& e) {
      rethrow_in_layer(e, l, "backward", c);
    }
  p.zero_group(static_cast<size_t>(L + 1));  // an untied embedding's gradient
  if (live) {
    ProfileRange pr("embedding.bwd");
    embedding_backward({ids, dh, G(ids_.embed), emb_plan});
  }
  (void)N;
}

}  // namespace gdn::model
