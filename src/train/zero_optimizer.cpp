// dist.shard = optimizer: the ZeRO-2 / Megatron distributed optimizer (shard_layout.h for the
// layout and the papers). One class for the host (cpu, ref: MPI, host buffers) and the device
// (cuda: NCCL, device buffers, every copy and collective in the compute stream's order).
//
// A step on every rank: after the last micro-batch's backward, reduce_grads() reduce-scatters the
// fp32 gradients bucket by bucket into this rank's shard (nothing is sent for earlier micro-
// batches); grad_sumsq_into() sums the squares of the shard's pieces and reduces those sums over
// the ranks, so that every rank clips by the same global norm and skips the same steps; step()
// runs AdamW over the shard's pieces (each piece carries its parameter's weight-decay flag, so a
// parameter that straddles two shards is updated exactly as a whole one) and all-gathers the
// updated compute copy (fp32 on the host, bf16 on the device) into every rank's model.
//
// Parameters whose compute copy is fp32 on cuda (A_log, dt_bias: a few floats per GDN layer) are
// kept whole on every rank: their gradients are all-reduced and every rank updates them, in the
// same fused update. The host keeps the same set whole, so that the cpu tests run the device's
// path. Their squares count once: rank 0 adds them to its partial sum.
#include <cmath>
#include <cstring>

#include "dist/comm.h"
#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "gdn/core/split_f32.h"
#include "train/optimizer.h"
#include "train/shard_layout.h"

namespace gdn::train {

namespace {

// Elements [begin, begin + len) of a contiguous tensor, as a 1-D view.
Tensor flat(const Tensor& t, int64_t begin, int64_t len) {
  const auto bytes = static_cast<size_t>(begin) * static_cast<size_t>(dtype_size(t.dtype()));
  return Tensor(static_cast<char*>(t.data()) + bytes, t.dtype(), {len}, t.device());
}

// Every parameter and shard boundary on 64 elements (256 bytes of fp32), so that the device
// update's vector path applies to every piece. The host needs no alignment but uses the same
// layout, so that the cpu tests run the device's gaps and padding.
constexpr int64_t kAlign = 64;
// All ranks' part of one collective: 2^26 elements (256 MiB of fp32) at most.
constexpr int64_t kBucketElems = int64_t{1} << 26;

class ShardedOptimizer final : public Optimizer {
 public:
  ShardedOptimizer(model::Qwen35Model& model, const std::vector<model::ParamSpec>& specs,
                   OptimizerState state, const OptimizerConfig& oc, dist::Comm& comm,
                   int64_t bucket)
      : model_(model),
        specs_(specs),
        oc_(oc),
        comm_(comm),
        dev_(model.backend() == Backend::Cuda ? Device::CUDA : Device::CPU) {
    GDN_CHECK(comm_.on_device() == (dev_ == Device::CUDA),
              "dist.shard = optimizer: the {} backend needs a {} communicator",
              backend_name(model.backend()), dev_ == Device::CUDA ? "device (NCCL)" : "host (MPI)");
    split_ = dev_ == Device::CUDA && oc_.split_master;
    std::vector<ShardLayout::Param> sharded;
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (model::param_compute_dtype(specs_[i], Backend::Cuda) == DType::BF16)
        sharded.push_back({i, specs_[i].numel()});
      else
        whole_.push_back(i);
    }
    const int world = comm_.size();
    layout_ = ShardLayout(std::move(sharded), world, kAlign,
                          bucket > 0 ? bucket : (kBucketElems + world - 1) / world);
    own_ = layout_.shard_pieces(comm_.rank());
    for (int64_t k = 0; k < layout_.buckets(); ++k)
      bucket_pieces_.push_back(layout_.bucket_pieces(k));
    allocate();
    load(std::move(state));
  }

  void reduce_grads() override {
    ProfileRange pr("grad_reduce_scatter");
    // The whole parameters' gradients summed in place (as replicate does), the rest scattered.
    for (size_t w = 0; w < whole_.size(); ++w) {
      const Tensor& g = model_.grad(whole_[w]);
      comm_.all_reduce(g.data(), g.data(), g.numel(), g.dtype(), dist::ReduceOp::Sum);
      if (grad32_[w].defined()) copy_into(grad32_[w], g);
    }
    for (int64_t k = 0; k < layout_.buckets(); ++k) {
      const int64_t len = layout_.bucket_len(k);
      for (const ShardPiece& p : bucket_pieces_[static_cast<size_t>(k)])
        put(flat(bucket_, p.flat_begin, p.len), flat(model_.grad(p.param), p.param_begin, p.len));
      comm_.reduce_scatter(bucket_.view().data(), flat(g_, layout_.bucket_begin(k), len).data(),
                           len, DType::F32, dist::ReduceOp::Sum);
    }
  }

  bool grad_sumsq_into(const Tensor& out) override {
    ProfileRange pr("grad_norm");
    std::vector<Tensor> mine;
    for (const ShardPiece& p : own_) mine.push_back(flat(g_, p.flat_begin - own_begin(), p.len));
    if (comm_.rank() == 0)
      for (size_t w = 0; w < whole_.size(); ++w) mine.push_back(whole_grad(w));
    if (dev_ == Device::CUDA) {
      // NCCL's all-reduce hands every rank the same bits (each chunk is reduced once, then
      // copied), so every rank's clip-or-skip decision on the device is the same.
      ops::grad_sumsq_into(mine, out);
      comm_.all_reduce(out.data(), out.data(), 1, DType::F64, dist::ReduceOp::Sum);
      return true;
    }
    // The host sums the ranks' partial sums itself, in rank order: the same bits everywhere.
    OwnedTensor part = OwnedTensor::empty(DType::F64, {1});
    std::vector<double> parts(static_cast<size_t>(comm_.size()));
    ops::grad_sumsq_into(mine, part);
    comm_.all_gather(part.view().data(), parts.data(), 1, DType::F64);
    double sum = 0;
    for (double x : parts) sum += x;
    out.ptr<double>()[0] = sum;
    return true;
  }

  void step(double lr, int64_t t, const GradCheck& check) override {
    ProfileRange pr("optimizer");
    ops::AdamWHyper h = oc_.hyper;
    h.lr = lr;
    h.step = t;
    if (dev_ == Device::CUDA) {
      // Clips and skips itself on the device from the reduced sum (the same on every rank).
      ops::adamw_step(params_, h, ops::AdamWClip{check.sumsq, check.losses, oc_.clip});
    } else {
      // The loss and the norm are the global ones on every rank: all skip the same steps.
      if (!std::isfinite(check.loss) || !std::isfinite(check.grad_norm)) return;
      h.grad_scale = ops::clip_scale(check.grad_norm, oc_.clip);
      ops::adamw_step(params_, h);
    }
    for (size_t w = 0; w < whole_.size(); ++w) put(model_.param(whole_[w]), wmaster_[w]);
    // The updated compute copy of every shard into every rank's model (a skipped device step
    // gathers the unchanged values).
    ProfileRange pg("param_all_gather");
    const Tensor& src = dev_ == Device::CUDA ? hi_.view() : master_.view();
    for (int64_t k = 0; k < layout_.buckets(); ++k) {
      const int64_t len = layout_.bucket_len(k);
      const Tensor recv(bucket_.view().data(), src.dtype(), {len * comm_.size()}, dev_);
      comm_.all_gather(flat(src, layout_.bucket_begin(k), len).data(), recv.data(), len,
                       src.dtype());
      for (const ShardPiece& p : bucket_pieces_[static_cast<size_t>(k)])
        put(flat(model_.param(p.param), p.param_begin, p.len), flat(recv, p.flat_begin, p.len));
    }
  }

  // A collective: every rank sends its shards, rank 0 alone assembles the whole state.
  const OptimizerState& host_state() override {
    const bool root = comm_.rank() == 0;
    if (root) state_.ensure(specs_);
    if (split_) {
      gather_master_split(root);
    } else {
      gather_into(master_.view(), root ? &state_.master : nullptr);
    }
    gather_into(m_.view(), root ? &state_.m : nullptr);
    gather_into(v_.view(), root ? &state_.v : nullptr);
    if (root)
      for (size_t w = 0; w < whole_.size(); ++w) {
        copy_into(state_.master.tensor(whole_[w]), wmaster_[w]);
        copy_into(state_.m.tensor(whole_[w]), wm_[w]);
        copy_into(state_.v.tensor(whole_[w]), wv_[w]);
      }
    return state_;
  }

  bool sharded() const override { return true; }
  size_t device_bytes() const override { return dev_ == Device::CUDA ? bytes_ : 0; }
  std::string describe() const override {
    int64_t whole = 0;
    for (size_t i : whole_) whole += specs_[i].numel();
    const auto S = static_cast<double>(layout_.shard_numel());
    const double master = split_ ? 2.0 : 4.0;  // bytes an element (the split's low half: 2)
    // Master weights and Adam moments: this rank's shard and the whole tensors, against one
    // process's (every element, no padding).
    const double state = S * (master + 8.0) + 12.0 * static_cast<double>(whole);
    const double single =
        static_cast<double>(layout_.numel()) * (master + 8.0) + 12.0 * static_cast<double>(whole);
    const double bf16 = dev_ == Device::CUDA ? 2.0 * S : 0.0;
    return fmt::format(
        "optimizer state (dist.shard = optimizer, rank {} of {}, {} memory): {} in all: master "
        "weights ({}) and Adam m and v {} (a shard of {} of the {} sharded elements, {} with "
        "alignment and padding, and {} elements of {} fp32-compute tensors kept whole; one "
        "process holds {}), reduced fp32 gradients {}{}, one collective's bucket {}",
        comm_.rank(), comm_.size(), dev_ == Device::CUDA ? "device" : "host",
        format_bytes(static_cast<double>(bytes_)), split_ ? "split: I16 low half" : "fp32",
        format_bytes(state), layout_.shard_numel(), layout_.numel(), layout_.padded_numel(), whole,
        whole_.size(), format_bytes(single), format_bytes(4.0 * S),
        bf16 > 0 ? fmt::format(", bf16 values of the shard {}", format_bytes(bf16)) : "",
        format_bytes(4.0 * static_cast<double>(bucket_.numel())));
  }

 private:
  int64_t own_begin() const { return layout_.shard_begin(comm_.rank()); }
  const Tensor& whole_grad(size_t w) const {
    return grad32_[w].defined() ? grad32_[w] : model_.grad(whole_[w]);
  }

  // dst = src, in the compute stream's order on the device (both there); converting on the host.
  void put(const Tensor& dst, const Tensor& src) const {
    if (dev_ == Device::CUDA)
      copy_bytes_async(dst.data(), Device::CUDA, src.data(), Device::CUDA,
                       static_cast<size_t>(src.nbytes()));
    else
      copy_into(dst, src);
  }

  OwnedTensor make(DType dt, int64_t n) {
    bytes_ += static_cast<size_t>(n) * static_cast<size_t>(dtype_size(dt));
    return OwnedTensor::zeros(dt, {n}, dev_);
  }
  // A whole parameter's buffer, owned here, in its shape.
  Tensor make_whole(size_t i) {
    owned_.push_back(make(DType::F32, specs_[i].numel()));
    return owned_.back().view().reshape(specs_[i].shape);
  }

  void allocate() {
    const int64_t S = layout_.shard_numel();
    master_ = make(split_ ? DType::I16 : DType::F32, S);
    if (dev_ == Device::CUDA) hi_ = make(DType::BF16, S);
    m_ = make(DType::F32, S);
    v_ = make(DType::F32, S);
    g_ = make(DType::F32, S);
    bucket_ = make(DType::F32, layout_.bucket_len(0) * comm_.size());
    for (size_t i : whole_) {
      wmaster_.push_back(make_whole(i));
      wm_.push_back(make_whole(i));
      wv_.push_back(make_whole(i));
      // The fp64 reference backend's gradients: an fp32 copy for the update.
      grad32_.push_back(model_.grad(i).dtype() != DType::F32 ? make_whole(i) : Tensor());
    }
    for (const ShardPiece& p : own_) {
      const int64_t at = p.flat_begin - own_begin();
      params_.push_back({flat(master_, at, p.len), flat(g_, at, p.len), flat(m_, at, p.len),
                         flat(v_, at, p.len),
                         dev_ == Device::CUDA ? flat(hi_, at, p.len) : Tensor(),
                         weight_decay_applies(specs_[p.param].name), specs_[p.param].name});
    }
    for (size_t w = 0; w < whole_.size(); ++w) {
      const size_t i = whole_[w];
      params_.push_back({wmaster_[w], whole_grad(w), wm_[w], wv_[w], Tensor(),
                         weight_decay_applies(specs_[i].name), specs_[i].name});
    }
  }

  // Every rank holds the whole state (a fresh initialisation or a checkpoint): it keeps its
  // slice, fills its whole compute copy, and lets the rest go.
  void load(OptimizerState state) {
    GDN_CHECK(state.master.size() == specs_.size(), "dist.shard = optimizer: no master weights");
    // A fresh run has no moments: the shard's are zero already (no whole zero stores on the host).
    const bool moments = state.m.size() != 0;
    const int64_t S = layout_.shard_numel();
    std::vector<float> master(static_cast<size_t>(S)), m(master.size()), v(master.size());
    for (const ShardPiece& p : own_) {
      const int64_t at = p.flat_begin - own_begin();
      const auto bytes = static_cast<size_t>(p.len) * sizeof(float);
      std::memcpy(&master[at], state.master.tensor(p.param).ptr<float>() + p.param_begin, bytes);
      if (!moments) continue;
      std::memcpy(&m[at], state.m.tensor(p.param).ptr<float>() + p.param_begin, bytes);
      std::memcpy(&v[at], state.v.tensor(p.param).ptr<float>() + p.param_begin, bytes);
    }
    const size_t fbytes = master.size() * sizeof(float);
    copy_bytes(m_.view().data(), dev_, m.data(), Device::CPU, fbytes);
    copy_bytes(v_.view().data(), dev_, v.data(), Device::CPU, fbytes);
    if (dev_ == Device::CPU) {
      copy_bytes(master_.view().data(), dev_, master.data(), Device::CPU, fbytes);
      model_.load_params(state.master);
    } else {
      // The shard's bf16 values: the split's high half, else rounded to nearest even (as the
      // update writes them); the compute copy of every parameter the same way.
      std::vector<uint16_t> hi(master.size());
      std::vector<int16_t> lo(split_ ? master.size() : 0);
      const auto n = static_cast<int64_t>(master.size());
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 18))
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t b = f32_bits(master[j]);
        hi[j] = split_ ? split_hi(b) : float_to_bf16_bits(master[j]);
        if (split_) lo[j] = split_lo(b, hi[j]);
      }
      copy_bytes(hi_.view().data(), dev_, hi.data(), Device::CPU, hi.size() * 2);
      if (split_)
        copy_bytes(master_.view().data(), dev_, lo.data(), Device::CPU, lo.size() * 2);
      else
        copy_bytes(master_.view().data(), dev_, master.data(), Device::CPU, fbytes);
      for (size_t i = 0; i < specs_.size(); ++i) {
        const Tensor src = state.master.tensor(i);
        if (model_.param(i).dtype() != DType::BF16) continue;  // kept whole: below
        std::vector<uint16_t> c(static_cast<size_t>(src.numel()));
        const float* x = src.ptr<float>();  // [n]
        const auto nc = static_cast<int64_t>(c.size());
#pragma omp parallel for schedule(static) if (nc > (int64_t{1} << 18))
        for (int64_t j = 0; j < nc; ++j)
          c[j] = split_ ? split_hi(f32_bits(x[j])) : float_to_bf16_bits(x[j]);
        copy_bytes(model_.param(i).data(), dev_, c.data(), Device::CPU, c.size() * 2);
      }
    }
    for (size_t w = 0; w < whole_.size(); ++w) {
      copy_into(wmaster_[w], state.master.tensor(whole_[w]));
      if (moments) {
        copy_into(wm_[w], state.m.tensor(whole_[w]));
        copy_into(wv_[w], state.v.tensor(whole_[w]));
      }
      copy_into(model_.param(whole_[w]), state.master.tensor(whole_[w]));
    }
  }

  // All-gathers `shard` (S elements of any dtype) bucket by bucket; on `root` calls
  // unpack(k, bytes) with bucket k of every rank in host memory.
  template <class F>
  void gather_buckets(const Tensor& shard, bool root, F&& unpack) {
    std::vector<char> host;
    for (int64_t k = 0; k < layout_.buckets(); ++k) {
      const int64_t len = layout_.bucket_len(k);
      const int64_t n = len * comm_.size();
      const Tensor recv(bucket_.view().data(), shard.dtype(), {n}, dev_);
      comm_.all_gather(flat(shard, layout_.bucket_begin(k), len).data(), recv.data(), len,
                       shard.dtype());
      if (!root) continue;
      host.resize(static_cast<size_t>(recv.nbytes()));
      copy_bytes(host.data(), Device::CPU, recv.data(), dev_, host.size());  // waits
      unpack(k, host.data());
    }
  }

  void gather_into(const Tensor& shard, model::ParamStore* store) {
    gather_buckets(shard, store != nullptr, [&](int64_t k, const char* host) {
      const auto* x = reinterpret_cast<const float*>(host);
      for (const ShardPiece& p : bucket_pieces_[static_cast<size_t>(k)])
        std::memcpy(store->tensor(p.param).ptr<float>() + p.param_begin, x + p.flat_begin,
                    static_cast<size_t>(p.len) * sizeof(float));
    });
  }

  // Split masters: the two halves gathered one after the other, joined exactly on rank 0.
  void gather_master_split(bool root) {
    std::vector<std::vector<uint16_t>> hi;
    gather_buckets(hi_.view(), root, [&](int64_t, const char* host) {
      const auto* x = reinterpret_cast<const uint16_t*>(host);
      hi.emplace_back(x, x + layout_.bucket_len(static_cast<int64_t>(hi.size())) * comm_.size());
    });
    size_t k = 0;
    gather_buckets(master_.view(), root, [&](int64_t, const char* host) {
      const auto* lo = reinterpret_cast<const int16_t*>(host);
      for (const ShardPiece& p : bucket_pieces_[k]) {
        float* dst = state_.master.tensor(p.param).ptr<float>() + p.param_begin;  // [len]
        for (int64_t j = 0; j < p.len; ++j)
          dst[j] = f32_from_bits(split_join(hi[k][p.flat_begin + j], lo[p.flat_begin + j]));
      }
      ++k;
    });
  }

  model::Qwen35Model& model_;
  const std::vector<model::ParamSpec> specs_;  // params_ names point into it
  const OptimizerConfig oc_;
  dist::Comm& comm_;
  const Device dev_;
  bool split_ = false;
  ShardLayout layout_;
  std::vector<ShardPiece> own_;                         // this rank's pieces, flat order
  std::vector<std::vector<ShardPiece>> bucket_pieces_;  // per bucket: every rank's pieces
  std::vector<size_t> whole_;                           // parameters kept whole
  size_t bytes_ = 0;
  // This rank's shard [S]: master (F32, or the split's I16 low half), the bf16 compute values
  // (device: the split's high half, the gather's source), m, v, the reduced gradients.
  OwnedTensor master_, hi_, m_, v_, g_;
  OwnedTensor bucket_;  // [world * bucket] F32: one collective's buffer (bf16 and I16 use part)
  std::vector<OwnedTensor> owned_;                  // the whole parameters' buffers
  std::vector<Tensor> wmaster_, wm_, wv_, grad32_;  // the whole parameters' state
  std::vector<ops::AdamWParam> params_;
  OptimizerState state_;  // rank 0: the gathered state, for a checkpoint
};

}  // namespace

std::unique_ptr<Optimizer> make_sharded_optimizer(model::Qwen35Model& model,
                                                  const std::vector<model::ParamSpec>& specs,
                                                  OptimizerState state, const OptimizerConfig& oc,
                                                  dist::Comm& comm, int64_t bucket) {
  return std::make_unique<ShardedOptimizer>(model, specs, std::move(state), oc, comm, bucket);
}

}  // namespace gdn::train
