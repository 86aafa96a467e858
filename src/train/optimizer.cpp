#include "train/optimizer.h"

#include <cmath>

#include "gdn/core/arena.h"
#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "gdn/core/split_f32.h"

namespace gdn::train {

void OptimizerState::ensure(const std::vector<model::ParamSpec>& specs) {
  if (master.size() == 0) master = model::ParamStore(specs);
  if (m.size() == 0) {
    m = model::ParamStore(specs);
    v = model::ParamStore(specs);
  }
}

bool weight_decay_applies(std::string_view name) {
  return !(name.ends_with("norm.weight") || name.ends_with("layernorm.weight") ||
           name.ends_with("A_log") || name.ends_with("dt_bias") ||
           name.find("embed_tokens") != std::string::npos);
}

namespace {

ops::AdamWHyper hyper_at(const OptimizerConfig& oc, double lr, int64_t t, double grad_scale) {
  ops::AdamWHyper h = oc.hyper;
  h.lr = lr;
  h.step = t;
  h.grad_scale = grad_scale;
  return h;
}

// The host stores are the live state: the update writes them and the compute copy is reloaded.
class HostOptimizer final : public Optimizer {
 public:
  HostOptimizer(model::Qwen35Model& model, const std::vector<model::ParamSpec>& specs,
                OptimizerState state, const OptimizerConfig& oc)
      : model_(model), specs_(specs), state_(std::move(state)), oc_(oc) {
    state_.ensure(specs_);
    model_.load_params(state_.master);
    // The fp64 reference backend's gradients are F64; the fp32 update reads an F32 copy of them.
    const bool f64_grads = model_.backend() == Backend::Ref;
    if (f64_grads) grad32_ = model::ParamStore(specs_);
    for (size_t i = 0; i < specs_.size(); ++i)
      params_.push_back({state_.master.tensor(i), f64_grads ? grad32_.tensor(i) : model_.grad(i),
                         state_.m.tensor(i), state_.v.tensor(i), Tensor(),
                         weight_decay_applies(specs_[i].name), specs_[i].name});
  }

  void step(double lr, int64_t t, const GradCheck& check) override {
    if (!std::isfinite(check.loss) || !std::isfinite(check.grad_norm)) return;  // skipped
    const ops::AdamWHyper h = hyper_at(oc_, lr, t, ops::clip_scale(check.grad_norm, oc_.clip));
    ProfileRange pr("optimizer");
    if (grad32_.size() != 0)
      for (size_t i = 0; i < specs_.size(); ++i) model_.read_grad(i, grad32_.tensor(i));
    ops::adamw_step(params_, h);
    model_.load_params(state_.master);
  }
  const OptimizerState& host_state() override { return state_; }
  size_t device_bytes() const override { return 0; }
  std::string describe() const override { return ""; }

 private:
  model::Qwen35Model& model_;
  const std::vector<model::ParamSpec> specs_;  // params_ names point into it
  OptimizerState state_;
  const OptimizerConfig oc_;
  model::ParamStore grad32_;  // Backend::Ref only: the gradients rounded to F32 for the update
  std::vector<ops::AdamWParam> params_;
};

// fp32 master weights and Adam moments on the device, in one arena, laid out like the host stores.
// A parameter whose compute copy is bf16 keeps its master split (ops/adamw/op.h, split masters;
// optim.split_master, default on): the model's bf16 compute copy is the high half and `master_`
// holds the I16 low half, so master and copy cost 4 bytes a parameter instead of 6 (7.8 GiB less
// at 4B).
class DeviceOptimizer final : public Optimizer {
 public:
  DeviceOptimizer(model::Qwen35Model& model, const std::vector<model::ParamSpec>& specs,
                  OptimizerState state, bool with_moments, const OptimizerConfig& oc,
                  const DeviceInit* init)
      : model_(model), specs_(specs), state_(std::move(state)), oc_(oc) {
    allocate();
    place_initial_weights(with_moments, init);
    for (size_t i = 0; i < specs_.size(); ++i) {
      const bool bf16 = model_.param(i).dtype() == DType::BF16;
      if (!bf16) f32_compute_.push_back(i);
      params_.push_back({master_[i], model_.grad(i), m_[i], v_[i],
                         bf16 ? model_.param(i) : Tensor(), weight_decay_applies(specs_[i].name),
                         specs_[i].name});
    }
  }

  void step(double lr, int64_t t, const GradCheck& check) override {
    ProfileRange pr("optimizer");
    // Skips itself on a non-finite sum or loss.
    ops::adamw_step(params_, hyper_at(oc_, lr, t, 1.0),
                    ops::AdamWClip{check.sumsq, check.losses, oc_.clip});
    // The fp32 compute copies (A_log, dt_bias) follow their masters.
    for (size_t i : f32_compute_)
      copy_bytes_async(model_.param(i).data(), Device::CUDA, master_[i].data(), Device::CUDA,
                       static_cast<size_t>(master_[i].nbytes()));
  }
  const OptimizerState& host_state() override {
    state_.ensure(specs_);
    download();
    return state_;
  }
  size_t device_bytes() const override { return arena_.capacity(); }
  std::string describe() const override {
    size_t n = 0;
    for (size_t i = 0; i < specs_.size(); ++i) n += split(i) ? 1 : 0;
    return fmt::format(
        "optimizer state on the device: {} (fp32 master weights, {} of {} tensors split as the "
        "bf16 compute copy + an I16 low half; Adam m and v)",
        format_bytes(static_cast<double>(arena_.capacity())), n, specs_.size());
  }

 private:
  bool split(size_t i) const { return i < hi_.size() && hi_[i].defined(); }

  // master, m and v for every parameter; m and v start at zero (a fresh run).
  void allocate() {
    for (size_t i = 0; i < specs_.size(); ++i) {
      const bool s = oc_.split_master && model_.param(i).dtype() == DType::BF16;
      hi_.push_back(s ? model_.param(i) : Tensor());
    }
    auto padded = [](int64_t numel, int64_t bytes) {
      return (static_cast<size_t>(numel) * static_cast<size_t>(bytes) + 255) / 256 * 256;
    };
    size_t bytes = 0;
    for (size_t i = 0; i < specs_.size(); ++i)
      bytes += padded(specs_[i].numel(), split(i) ? 2 : 4) + 2 * padded(specs_[i].numel(), 4);
    arena_ = Arena("optimizer", Device::CUDA, bytes);
    for (size_t i = 0; i < specs_.size(); ++i) {
      master_.push_back(arena_.alloc_tensor(split(i) ? DType::I16 : DType::F32, specs_[i].shape));
      m_.push_back(arena_.alloc_tensor(DType::F32, specs_[i].shape));
      v_.push_back(arena_.alloc_tensor(DType::F32, specs_[i].shape));
      zero_bytes(m_.back().data(), Device::CUDA, static_cast<size_t>(m_.back().nbytes()));
      zero_bytes(v_.back().data(), Device::CUDA, static_cast<size_t>(v_.back().nbytes()));
    }
  }

  // The compute copy from the device master weights: bf16 in one refresh pass, fp32 copied. A
  // fresh split master is drawn in fp32 into its gradient buffer and split from there (the buffer
  // is free: every step zeroes the gradients before its backward); an uploaded one arrives split.
  void place_initial_weights(bool with_moments, const DeviceInit* init) {
    std::vector<ops::Bf16Copy> copies;
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (init != nullptr)
        model::init_param(specs_[i], split(i) ? model_.grad(i) : master_[i], *init->config,
                          init->seed);
      if (split(i)) {
        if (init != nullptr) copies.push_back({model_.grad(i), model_.param(i), master_[i]});
      } else if (model_.param(i).dtype() == DType::BF16) {
        copies.push_back({master_[i], model_.param(i)});
      }
    }
    if (init == nullptr) upload(with_moments);
    for (size_t i = 0; i < specs_.size(); ++i)
      if (model_.param(i).dtype() != DType::BF16) copy_into(model_.param(i), master_[i]);
    ops::adamw_refresh_bf16(copies);
  }

  // Host stores to the device: the master weights (split ones into both halves), and the moments
  // when `with_moments`.
  void upload(bool with_moments) {
    for (size_t i = 0; i < master_.size(); ++i) {
      if (split(i)) {
        const Tensor src = state_.master.tensor(i);
        OwnedTensor h = OwnedTensor::empty(DType::BF16, src.shape_vec()),
                    l = OwnedTensor::empty(DType::I16, src.shape_vec());
        const float* x = src.ptr<float>();  // [n]
        uint16_t* hp = static_cast<uint16_t*>(h.view().data());
        int16_t* lp = l.view().ptr<int16_t>();
        const int64_t n = src.numel();
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 18))
        for (int64_t j = 0; j < n; ++j) {
          const uint32_t b = f32_bits(x[j]);
          hp[j] = split_hi(b);
          lp[j] = split_lo(b, hp[j]);
        }
        copy_into(hi_[i], h.view());
        copy_into(master_[i], l.view());
      } else {
        copy_into(master_[i], state_.master.tensor(i));
      }
      if (with_moments) {
        copy_into(m_[i], state_.m.tensor(i));
        copy_into(v_[i], state_.v.tensor(i));
      }
    }
  }

  // Device to host stores (to write a checkpoint): split masters are joined on the host, exactly.
  void download() {
    for (size_t i = 0; i < master_.size(); ++i) {
      if (split(i)) {
        const Tensor dst = state_.master.tensor(i);
        OwnedTensor h = OwnedTensor::empty(DType::BF16, dst.shape_vec()),
                    l = OwnedTensor::empty(DType::I16, dst.shape_vec());
        copy_into(h.view(), hi_[i]);
        copy_into(l.view(), master_[i]);
        float* x = dst.ptr<float>();  // [n]
        const uint16_t* hp = static_cast<const uint16_t*>(h.view().data());
        const int16_t* lp = l.view().ptr<int16_t>();
        const int64_t n = dst.numel();
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 18))
        for (int64_t j = 0; j < n; ++j) x[j] = f32_from_bits(split_join(hp[j], lp[j]));
      } else {
        copy_into(state_.master.tensor(i), master_[i]);
      }
      copy_into(state_.m.tensor(i), m_[i]);
      copy_into(state_.v.tensor(i), v_[i]);
    }
  }

  model::Qwen35Model& model_;
  const std::vector<model::ParamSpec> specs_;  // params_ names point into it
  OptimizerState state_;                       // host staging for checkpoints
  const OptimizerConfig oc_;
  Arena arena_;
  std::vector<Tensor> master_, m_, v_;  // master_: F32, or I16 (split: the low half)
  std::vector<Tensor> hi_;           // split masters: the compute copy (high half); else undefined
  std::vector<size_t> f32_compute_;  // parameters whose compute copy is fp32 (A_log, dt_bias)
  std::vector<ops::AdamWParam> params_;
};

}  // namespace

std::unique_ptr<Optimizer> make_host_optimizer(model::Qwen35Model& model,
                                               const std::vector<model::ParamSpec>& specs,
                                               OptimizerState state, const OptimizerConfig& oc) {
  return std::make_unique<HostOptimizer>(model, specs, std::move(state), oc);
}

std::unique_ptr<Optimizer> make_device_optimizer(model::Qwen35Model& model,
                                                 const std::vector<model::ParamSpec>& specs,
                                                 OptimizerState state, bool with_moments,
                                                 const OptimizerConfig& oc,
                                                 const DeviceInit* init) {
  return std::make_unique<DeviceOptimizer>(model, specs, std::move(state), with_moments, oc, init);
}

}  // namespace gdn::train
