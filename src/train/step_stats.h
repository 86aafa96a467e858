// How the host learns a step's loss, z-loss and gradient norm, and how long a logging window
// took. The cpu runs each op to completion: the numbers are known when the step's update is
// issued. On the device the step loop never drains the device's queue (issue 8): the losses, the
// gradients' sum of squares and the clip-or-skip decision stay on the device (ops::AdamWClip), and
// their host copies arrive through page-locked staging, read one step late (while the device runs
// the next step's forward and backward). The trainer issues the next update only after that read,
// so its Adam step count knows every earlier skip.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "dist/comm.h"
#include "gdn/core/tensor.h"
#include "model/qwen35.h"
#include "train/optimizer.h"

namespace gdn::train {

// A step whose update has been issued and whose host side (skip accounting, metrics, logs,
// evaluation, checkpoint) is still to be done.
struct PendingStep {
  int64_t step = -1;  // 0-based
  double lr = 0, flops = 0;
  int64_t tokens = 0;
  size_t slot = 0;  // device: the staging slot of its numbers
  int64_t win = 0;  // device, a logging step: its timing window's end event
  double loss = 0, z_loss = 0, grad_norm = 0;  // host: known at once; device: after read()
  std::string nonfinite;  // an op's input check found NaN/inf inside the step (its message)
};

class StepStatsReader {
 public:
  virtual ~StepStatsReader() = default;
  // True when a step's numbers reach the host a step late (the device): the trainer then
  // finishes step N while the device runs step N + 1.
  virtual bool deferred() const = 0;
  // Micro-batch k's statistics from the model's step (which computed them on the host when
  // !deferred(): model::StepOptions::host_stats).
  virtual void add_micro_batch(int64_t k, const model::StepStats& s, PendingStep& p) = 0;
  // After the micro-batches (and the gradients' sum over the ranks): the gradient norm (host) or
  // its sum of squares (device), and what the update needs to clip or skip. With a communicator
  // the step's losses are summed over the ranks first: every rank then sees the global loss, and
  // all skip a step that is not finite on any of them. The sum of squares is the optimizer's when
  // it holds the reduced gradients (dist.shard = optimizer), else that of the model's gradients.
  virtual GradCheck reduce(const model::Qwen35Model& m, Optimizer& opt, PendingStep& p) = 0;
  // After the update: the step's numbers on their way to the host; `ends_window`: it is a logging
  // step, whose progress line ends a tokens/s window.
  virtual void issue(PendingStep& p, bool ends_window) = 0;
  // Before the step's host side: its numbers (the device: waits for this step's copies only).
  virtual void read(PendingStep& p) = 0;
  // What was not finite in a step whose loss or gradient norm is not.
  virtual std::string nonfinite_cause(const PendingStep& p, const model::Qwen35Model& m) const = 0;
  // Device time of the window that logging step p ended, in s; -1: time it with the host clock.
  virtual double window_seconds(const PendingStep& p) const = 0;
};

// The cpu and ref backends. `comm`: null at world size 1, else the ranks of a replicated run
// (host buffers).
std::unique_ptr<StepStatsReader> make_host_stats(dist::Comm* comm = nullptr);
// cuda: two staging slots for `accum` micro-batches per step, and the timing ring. `comm`: as
// above (device buffers, NCCL on the compute stream).
std::unique_ptr<StepStatsReader> make_device_stats(int64_t accum, dist::Comm* comm = nullptr);

}  // namespace gdn::train
