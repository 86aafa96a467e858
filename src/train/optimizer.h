// The trainer's optimizer: AdamW (ops/adamw/op.h) over fp32 master weights, with global-norm
// clipping and the skip of a non-finite step, behind one interface so that the step loop has one
// path. The update runs where the gradients are:
//   cpu, ref  the host stores (master weights, Adam m and v) are the live state; after an update
//             the model's compute copy is reloaded from the masters.
//   cuda      master weights and moments live in one device arena; the update writes the bf16
//             compute copy in the same pass and clips and skips on the device (ops::AdamWClip), so
//             the step never waits for the device. The host stores are filled only to write a
//             checkpoint.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gdn/core/tensor.h"
#include "model/qwen35.h"
#include "model/weights.h"
#include "ops/adamw/op.h"

namespace gdn::dist {
class Comm;
}

namespace gdn::train {

// Weight decay applies to matrices only: not to norms, A_log, dt_bias or embeddings.
bool weight_decay_applies(std::string_view name);

// Master weights and Adam moments in host stores laid out like the parameters: what a checkpoint
// holds and a resume loads.
struct OptimizerState {
  model::ParamStore master, m, v;
  // Makes the stores that are still empty, zero-filled (a store read from a checkpoint or an
  // init_from directory is kept).
  void ensure(const std::vector<model::ParamSpec>& specs);
};

// What the update needs to clip the gradients or skip the step, from step_stats.h.
struct GradCheck {
  // Host path: the step's loss and gradient norm, known before the update (non-finite: skip).
  double loss = 0, grad_norm = 0;
  // Device path: the sum of squares of the gradients (F64 [1]) and the micro-batches' losses
  // (F32 [accum]) on the device; the update reads them there.
  Tensor sumsq, losses;
};

struct OptimizerConfig {
  ops::AdamWHyper hyper;  // beta1, beta2, eps, weight_decay (lr and step are set per step)
  double clip = 0;        // max gradient norm (<= 0: no clipping)
  bool split_master = true;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Issues the update at learning rate `lr` as Adam step `t` (1-based; skipped steps do not
  // count), clipping by the gradient norm and skipping a non-finite step as `check` says.
  virtual void step(double lr, int64_t t, const GradCheck& check) = 0;
  // The state in host stores, for a checkpoint (cuda: copied from the device first, which waits
  // for it).
  // A sharded optimizer gathers it: a collective that every rank calls, and only rank 0's result
  // holds the state (the other ranks' is empty).
  virtual const OptimizerState& host_state() = 0;
  // True when the state is sharded over the ranks (host_state is then a collective).
  virtual bool sharded() const { return false; }
  // Once a step, after the last micro-batch's backward and before the gradient norm: a sharded
  // optimizer reduce-scatters the gradients into its shard (nothing otherwise).
  virtual void reduce_grads() {}
  // The sum of squares of the step's whole (reduced) gradient, the same bits on every rank, into
  // `out` (F64 [1] on the gradients' device), or false when this optimizer does not hold the
  // reduced gradients: the caller then sums the model's.
  virtual bool grad_sumsq_into(const Tensor& out) { return false; }
  // Bytes of optimizer state held on the device (0 for the host optimizer), and a log line that
  // describes it ("" for the host optimizer).
  virtual size_t device_bytes() const = 0;
  virtual std::string describe() const = 0;
};

// `specs` are the parameters' (names and shapes, in the model's order).
// cpu and ref: the update on `state` (master weights, and the moments when resuming; missing
// stores start at zero); the model's compute copy is loaded from the masters now.
std::unique_ptr<Optimizer> make_host_optimizer(model::Qwen35Model& model,
                                               const std::vector<model::ParamSpec>& specs,
                                               OptimizerState state, const OptimizerConfig& oc);

// cuda: `state` is uploaded (the master weights; the moments when `with_moments`), unless
// `init` is given: then the master weights are drawn on the device (model::init_param, the same
// Philox draws as on the host) and the moments start at zero. The compute copy is refreshed.
struct DeviceInit {
  const model::Qwen35Config* config = nullptr;
  uint64_t seed = 0;
};
std::unique_ptr<Optimizer> make_device_optimizer(model::Qwen35Model& model,
                                                 const std::vector<model::ParamSpec>& specs,
                                                 OptimizerState state, bool with_moments,
                                                 const OptimizerConfig& oc, const DeviceInit* init);

// dist.shard = optimizer (zero_optimizer.cpp, docs/DISTRIBUTED.md): ZeRO-2 over `comm` (MPI for
// cpu and ref, NCCL for cuda). Every rank passes the whole `state` (master weights, and the
// moments when resuming) and keeps its 1/N slice of a flat layout (shard_layout.h) of the master
// weights and Adam moments; the model's compute copy is filled from the masters. `bucket`:
// elements per rank of one collective (0: 2^26 / world).
std::unique_ptr<Optimizer> make_sharded_optimizer(model::Qwen35Model& model,
                                                  const std::vector<model::ParamSpec>& specs,
                                                  OptimizerState state, const OptimizerConfig& oc,
                                                  dist::Comm& comm, int64_t bucket = 0);

}  // namespace gdn::train
