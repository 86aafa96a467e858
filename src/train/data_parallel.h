// Data parallelism in the trainer (issue 23, docs/DISTRIBUTED.md): the dist.* keys, the start of a
// multi-rank run (launch detection, the communicator, NUMA binding), and the one thing a replicated
// step adds to the single-process loop: GradSync, between the backward and the optimizer.
//
// dist.shard = replicate (DDP): every rank holds the whole model and optimizer state; each reads
// its own slice of the step's micro-batches (data_source.h), the loss denominator is the global
// step's target count, and on the last micro-batch every parameter gradient is summed over the
// ranks, so that each rank's update is the one a single process with grad_accum * world would make
// and the replicas stay identical. Nothing is sent for the earlier micro-batches. The all-reduce
// runs after the whole backward (no overlap with it yet).
// dist.shard = optimizer (ZeRO-2): the gradients are reduce-scattered instead, by the sharded
// optimizer (optimizer.h, zero_optimizer.cpp); GradSync then only sums the step's counts and
// losses. full (ZeRO-3) is not implemented: at world size > 1 it is an error. At world size 1
// there is nothing to shard and both run as replicate.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "dist/comm.h"
#include "dist/launch.h"
#include "train/config_tree.h"

namespace gdn::model {
class Qwen35Model;
}

namespace gdn::train {

enum class ShardMode { Replicate, Optimizer, Full };
// "replicate" | "optimizer" | "full"; anything else is an error naming dist.shard.
ShardMode parse_shard_mode(std::string_view text);
std::string_view shard_mode_name(ShardMode m);

// The dist.* keys of a (validated) configuration.
struct DistConfig {
  ShardMode shard = ShardMode::Replicate;
  dist::DistOptions options;            // dist.timeout_s, dist.numa_bind
  std::string unshard_stream = "comm";  // dist.unshard_stream: saved; used by shard=full (to come)
};
DistConfig dist_config_from(const ConfigTree& cfg);

// Throws when `shard` cannot run at `world` ranks: full at world > 1 (not yet implemented; the
// error names dist.shard and says that replicate and optimizer work).
void check_shard_supported(ShardMode shard, int world);

// The process's place in the run, and its communicator (null at world size 1: the single-process
// path, nothing sent). `host_buffers`: the backend computes on the host (cpu, ref: MPI), else on
// the GPU (NCCL, which also picks the GPU from the local rank).
struct DistContext {
  dist::LaunchInfo launch;
  std::unique_ptr<dist::Comm> comm;
  int rank() const { return launch.rank; }
  int world() const { return launch.world; }
  bool distributed() const { return comm != nullptr; }
};

// Detects the launcher from the environment; with a launcher, sets the log's rank prefix. At
// world size > 1 checks dist.shard, creates the communicator (MPI for a host backend, NCCL for the
// GPU) and binds the process's threads (dist.numa_bind). Every error is raised before any work.
DistContext start_distributed(const DistConfig& dc, bool host_buffers);

// The cross-rank sums of a replicated step. Without a communicator every call is a no-op, so the
// single-process path is bitwise unchanged.
class GradSync {
 public:
  // `reduce_grads` false: the optimizer reduces the gradients (dist.shard = optimizer).
  explicit GradSync(dist::Comm* comm, bool reduce_grads = true)
      : comm_(comm), reduce_grads_(reduce_grads) {}
  bool active() const { return comm_ != nullptr; }
  // Sums every parameter gradient of `m` over the ranks, in place (host F32 tensors under MPI,
  // device buffers on the compute stream under NCCL). Call once per step, after the last
  // micro-batch's backward and before the gradient norm and the update.
  void all_reduce_grads(const model::Qwen35Model& m);
  // Sums host numbers over the ranks, in place (the step's target and token counts, its losses).
  // Under NCCL they go through a small device buffer and the call waits for the device.
  void sum_host(std::span<double> values);

 private:
  dist::Comm* comm_;
  bool reduce_grads_;
};

}  // namespace gdn::train
