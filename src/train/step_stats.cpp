#include "train/step_stats.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "model/weights.h"

namespace gdn::train {

namespace {

std::string first_nonfinite(const model::Qwen35Model& m) {
  for (size_t i = 0; i < m.specs().size(); ++i) {
    auto g = to_f64_vector(m.grad(i));
    for (size_t j = 0; j < g.size(); ++j)
      if (!std::isfinite(g[j]))
        return fmt::format("gradient of {} (element {} = {})", m.specs()[i].name, j, g[j]);
  }
  return "the loss (every gradient is finite)";
}

class HostStats final : public StepStatsReader {
 public:
  explicit HostStats(dist::Comm* comm) : comm_(comm) {}
  bool deferred() const override { return false; }
  void add_micro_batch(int64_t, const model::StepStats& s, PendingStep& p) override {
    p.loss += s.loss;
    p.z_loss += s.z_loss;
  }
  GradCheck reduce(const model::Qwen35Model& m, Optimizer& opt, PendingStep& p) override {
    if (comm_ != nullptr) {  // each rank's losses are already over the global denominator
      double sums[2] = {p.loss, p.z_loss};
      comm_->all_reduce(sums, sums, 2, DType::F64, dist::ReduceOp::Sum);
      p.loss = sums[0];
      p.z_loss = sums[1];
    }
    // A sharded optimizer's sum is a collective: every rank computes it, even after a failed
    // forward (the NaN loss then skips the step everywhere).
    double sumsq = 0;
    if (opt.grad_sumsq_into(Tensor(&sumsq, DType::F64, {1}))) {
      p.grad_norm =
          p.nonfinite.empty() ? std::sqrt(sumsq) : std::numeric_limits<double>::quiet_NaN();
    } else if (p.nonfinite.empty()) {
      ProfileRange pr("grad_norm");
      p.grad_norm = ops::grad_global_norm(m.grads());
    } else {
      p.grad_norm = std::numeric_limits<double>::quiet_NaN();
    }
    return GradCheck{p.loss, p.grad_norm, {}, {}};
  }
  void issue(PendingStep&, bool) override {}
  void read(PendingStep&) override {}
  std::string nonfinite_cause(const PendingStep&, const model::Qwen35Model& m) const override {
    return first_nonfinite(m);
  }
  double window_seconds(const PendingStep&) const override { return -1; }

 private:
  dist::Comm* comm_;
};

// The device keeps the step's losses and sum of squares in small tensors (the update reads them
// there); each step copies them into one of two page-locked slots behind a fence, and the host
// reads slot s one step later, when the next step's copies go to the other slot.
class DeviceStats final : public StepStatsReader {
 public:
  DeviceStats(int64_t accum, dist::Comm* comm)
      : accum_(accum), comm_(comm), loss_bytes_(static_cast<size_t>(accum) * sizeof(float)) {
    loss_ = OwnedTensor::empty(DType::F32, {accum}, Device::CUDA);
    z_ = OwnedTensor::empty(DType::F32, {accum}, Device::CUDA);
    sumsq_ = OwnedTensor::empty(DType::F64, {1}, Device::CUDA);
    for (Staged& st : staged_) {
      st.host = HostStaging(sizeof(double) + 2 * loss_bytes_, Device::CUDA);
      st.fence = StreamFence(Device::CUDA);
    }
    for (StreamFence& e : win_ev_) e = StreamFence(Device::CUDA);
    win_ev_[0].record();
  }
  bool deferred() const override { return true; }
  void add_micro_batch(int64_t k, const model::StepStats& s, PendingStep&) override {
    copy_bytes_async(loss_.ptr<float>() + k, Device::CUDA, s.loss_dev.data(), Device::CUDA,
                     sizeof(float));
    copy_bytes_async(z_.ptr<float>() + k, Device::CUDA, s.z_loss_dev.data(), Device::CUDA,
                     sizeof(float));
  }
  GradCheck reduce(const model::Qwen35Model& m, Optimizer& opt, PendingStep& p) override {
    if (!p.nonfinite.empty()) {  // a host-side check threw: make the device skip the update
      const float nan = std::numeric_limits<float>::quiet_NaN();
      copy_bytes(loss_.ptr<float>(), Device::CUDA, &nan, Device::CPU, sizeof(float));
    }
    if (comm_ != nullptr) {  // micro-batch k's losses summed over the ranks, in stream order
      comm_->all_reduce(loss_.ptr<float>(), loss_.ptr<float>(), accum_, DType::F32,
                        dist::ReduceOp::Sum);
      comm_->all_reduce(z_.ptr<float>(), z_.ptr<float>(), accum_, DType::F32, dist::ReduceOp::Sum);
    }
    {
      ProfileRange pr("grad_norm");
      if (!opt.grad_sumsq_into(sumsq_)) ops::grad_sumsq_into(m.grads(), sumsq_);
    }
    return GradCheck{0, 0, sumsq_, loss_};
  }
  void issue(PendingStep& p, bool ends_window) override {
    p.slot = static_cast<size_t>(p.step & 1);
    if (ends_window) {
      p.win = ++win_recorded_;
      win_ev_[static_cast<size_t>(p.win % 4)].record();  // before the staging fence below
    }
    Staged& st = staged_[p.slot];
    char* h = static_cast<char*>(st.host.data());
    copy_bytes_async(h, Device::CPU, sumsq_.ptr<double>(), Device::CUDA, sizeof(double));
    copy_bytes_async(h + sizeof(double), Device::CPU, loss_.ptr<float>(), Device::CUDA,
                     loss_bytes_);
    copy_bytes_async(h + sizeof(double) + loss_bytes_, Device::CPU, z_.ptr<float>(), Device::CUDA,
                     loss_bytes_);
    st.fence.record();
  }
  void read(PendingStep& p) override {
    Staged& st = staged_[p.slot];
    st.fence.wait();  // this step's copies only: later work stays queued on the device
    const char* h = static_cast<const char*>(st.host.data());
    double ss = 0;
    std::memcpy(&ss, h, sizeof(double));
    p.loss = p.z_loss = 0;
    for (int64_t k = 0; k < accum_; ++k) {
      float l = 0, z = 0;
      const size_t at = sizeof(double) + static_cast<size_t>(k) * sizeof(float);
      std::memcpy(&l, h + at, sizeof(float));
      std::memcpy(&z, h + at + loss_bytes_, sizeof(float));
      p.loss += l;
      p.z_loss += z;
    }
    p.grad_norm = std::sqrt(ss);
  }
  std::string nonfinite_cause(const PendingStep& p, const model::Qwen35Model&) const override {
    return fmt::format("loss {}, gradient norm {} (the device skipped the update)", p.loss,
                       p.grad_norm);
  }
  // A tokens/s window is timed on the device, from the event that ended the previous window to
  // the one recorded behind its last step (the host only learns of a step's end some time later,
  // so its clock would stretch one window and shrink the next). A ring of four: a window's two
  // events are read at most one step after the later one is recorded.
  double window_seconds(const PendingStep& p) const override {
    const double ms = win_ev_[static_cast<size_t>(p.win % 4)].ms_since(
        win_ev_[static_cast<size_t>((p.win - 1) % 4)]);
    return ms > 0 ? ms / 1e3 : -1;
  }

 private:
  struct Staged {
    HostStaging host;  // sumsq (double), then accum losses and accum z-losses (float)
    StreamFence fence;
  };
  const int64_t accum_;
  dist::Comm* const comm_;
  const size_t loss_bytes_;
  OwnedTensor loss_, z_, sumsq_;  // device: [accum] F32, [accum] F32, [1] F64
  std::array<Staged, 2> staged_;
  std::array<StreamFence, 4> win_ev_;
  int64_t win_recorded_ = 0;  // windows whose end event has been recorded
};

}  // namespace

std::unique_ptr<StepStatsReader> make_host_stats(dist::Comm* comm) {
  return std::make_unique<HostStats>(comm);
}

std::unique_ptr<StepStatsReader> make_device_stats(int64_t accum, dist::Comm* comm) {
  return std::make_unique<DeviceStats>(accum, comm);
}

}  // namespace gdn::train
