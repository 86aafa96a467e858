#include "train/data_parallel.h"

#include "dist/numa.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"
#include "gdn/core/profile.h"
#include "gdn/core/tensor.h"
#include "model/qwen35.h"

namespace gdn::train {

ShardMode parse_shard_mode(std::string_view text) {
  for (ShardMode m : {ShardMode::Replicate, ShardMode::Optimizer, ShardMode::Full})
    if (text == shard_mode_name(m)) return m;
  GDN_FAIL("dist.shard = '{}' is not one of: replicate, optimizer, full", text);
}

std::string_view shard_mode_name(ShardMode m) {
  switch (m) {
    case ShardMode::Replicate:
      return "replicate";
    case ShardMode::Optimizer:
      return "optimizer";
    case ShardMode::Full:
      return "full";
  }
  return "?";
}

DistConfig dist_config_from(const ConfigTree& cfg) {
  DistConfig dc;
  dc.shard = parse_shard_mode(cfg.get_string("dist.shard"));
  dc.options.timeout_s = cfg.get_double("dist.timeout_s");
  dc.options.numa_bind = dist::parse_numa_bind(cfg.get_string("dist.numa_bind"));
  dc.unshard_stream = cfg.get_string("dist.unshard_stream");
  return dc;
}

void check_shard_supported(ShardMode shard, int world) {
  GDN_CHECK_HINT(shard != ShardMode::Full || world == 1,
                 "use --set dist.shard=\"optimizer\" (ZeRO-2: sharded master weights and Adam "
                 "state) or \"replicate\"; at world size 1 full runs as replicate",
                 "dist.shard = '{}' (ZeRO-3) is not yet implemented with {} ranks: replicate "
                 "and optimizer are (docs/DISTRIBUTED.md)",
                 shard_mode_name(shard), world);
}

DistContext start_distributed(const DistConfig& dc, bool host_buffers) {
  DistContext ctx;
  // MPI bootstraps itself (no MASTER_ADDR needed under srun --mpi=pmix); NCCL under srun or
  // torchrun meets at MASTER_ADDR:MASTER_PORT.
  ctx.launch = dist::detect_launch(dist::process_env(), {.rendezvous_over_mpi = host_buffers});
  // The prefix before anything can fail, so that every rank's error names it.
  if (ctx.launch.launcher != dist::Launcher::None)
    dist::set_process_rank(ctx.launch.rank, ctx.launch.world);
  if (!ctx.launch.distributed()) return ctx;
  check_shard_supported(dc.shard, ctx.launch.world);
  ctx.comm = dist::make_comm(ctx.launch, host_buffers ? dist::CommKind::Mpi : dist::CommKind::Nccl,
                             dc.options);
  // A host rank keeps the launcher's binding (numa.h); a GPU rank moves to its GPU's node.
  dist::bind_to_device_numa_node(dc.options.numa_bind, host_buffers ? -1 : ctx.comm->local_rank());
  return ctx;
}

void GradSync::all_reduce_grads(const model::Qwen35Model& m) {
  if (comm_ == nullptr || !reduce_grads_) return;
  ProfileRange pr("grad_all_reduce");
  // One collective per tensor, in the model's order (the same on every rank). The NCCL ones are
  // enqueued on the compute stream behind the backward and ahead of the norm and the update.
  for (const Tensor& g : m.grads())
    comm_->all_reduce(g.data(), g.data(), g.numel(), g.dtype(), dist::ReduceOp::Sum);
}

void GradSync::sum_host(std::span<double> values) {
  if (comm_ == nullptr || values.empty()) return;
  const auto n = static_cast<int64_t>(values.size());
  if (!comm_->on_device()) {
    comm_->all_reduce(values.data(), values.data(), n, DType::F64, dist::ReduceOp::Sum);
    return;
  }
  // NCCL reduces device memory only: up, reduce on the compute stream, down (the copy back waits).
  OwnedTensor buf = OwnedTensor::empty(DType::F64, {n}, Device::CUDA);
  const size_t bytes = values.size() * sizeof(double);
  copy_bytes(buf.view().data(), Device::CUDA, values.data(), Device::CPU, bytes);
  comm_->all_reduce(buf.view().data(), buf.view().data(), n, DType::F64, dist::ReduceOp::Sum);
  copy_bytes(values.data(), Device::CPU, buf.view().data(), Device::CUDA, bytes);
}

}  // namespace gdn::train
