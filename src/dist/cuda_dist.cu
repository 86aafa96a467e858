// The CUDA side of src/dist: the GPU's PCI bus id (NUMA binding) and the NCCL communicator.
//
// NCCL communicator: one rank per GPU (LOCAL_RANK picks the device). The ncclUniqueId goes from
// rank 0 to the others by MPI broadcast under mpirun, else over TCP at MASTER_ADDR:MASTER_PORT
// (dist/tcp_bootstrap.h) -- the two ways llm.c's multi-GPU bootstrap (llmc/zero.cuh) offers besides
// a shared file.
//
// Failure handling follows the NCCL user guide's fault-tolerance pattern (and what PyTorch's
// ProcessGroupNCCL watchdog does): the communicator is non-blocking (config.blocking = 0) so no
// NCCL call can block forever; each collective records a CUDA event after it on its stream, and a
// watchdog thread polls ncclCommGetAsyncError and the oldest outstanding event. An asynchronous
// NCCL error, or a collective still not complete dist.timeout_s after it was enqueued (a peer died
// or hangs), prints an error naming this rank and the collective, aborts the communicator
// (ncclCommAbort, which also unblocks kernels stuck waiting for the peer) and exits non-zero. NCCL
// cannot tell which peer is missing; the peers' own messages (each names itself) and the launcher
// (torchrun/srun/mpirun end the job when one rank exits) do.
//
// Compiled only in CUDA builds; the NCCL part only when CMake found NCCL (GDN_WITH_NCCL). This
// file is compile-checked on the CPU build machine; it has not run on GPUs yet.
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>

#include "dist/numa.h"

namespace gdn::dist {

std::optional<std::string> cuda_pci_bus_id(int device) {
  char buf[64] = {};
  if (cudaDeviceGetPCIBusId(buf, sizeof(buf), device) != cudaSuccess) {
    (void)cudaGetLastError();
    return std::nullopt;
  }
  return normalize_pci_bus_id(buf);
}

}  // namespace gdn::dist

#if defined(GDN_WITH_NCCL)

#include <nccl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "dist/comm_impl.h"
#include "dist/tcp_bootstrap.h"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::dist {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kAbortCode = 3;

[[noreturn]] void throw_nccl(ncclResult_t r, const char* expr, const char* file, int line) {
  ::gdn::detail::throw_error(
      file, line,
      fmt::format("{} failed: {} ({})", expr, ncclGetErrorString(r), ncclGetLastError(nullptr)));
}

// For calls that return before the communicator exists (ncclGetUniqueId).
#define GDN_NCCL_CHECK(expr)                                           \
  do {                                                                 \
    const ncclResult_t gdn_nccl_r_ = (expr);                           \
    if (gdn_nccl_r_ != ncclSuccess) [[unlikely]]                       \
      ::gdn::dist::throw_nccl(gdn_nccl_r_, #expr, __FILE__, __LINE__); \
  } while (0)

ncclDataType_t nccl_reduce_type(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::BF16:
      return ncclBfloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    default:
      GDN_FAIL("NCCL reduction of {}", dtype_name(t));
  }
}

Clock::duration to_duration(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

class NcclComm final : public Comm {
 public:
  NcclComm(const LaunchInfo& l, const DistOptions& opts, bool mpi_bootstrap)
      : Comm(l.rank, l.world, l.local_rank, l.local_world),
        timeout_s_(opts.timeout_s),
        mpi_bootstrap_(mpi_bootstrap) {
    int devices = 0;
    GDN_CUDA_CHECK(cudaGetDeviceCount(&devices));
    GDN_CHECK_HINT(l.local_rank < devices,
                   "start one rank per GPU on each node (torchrun --nproc-per-node, srun "
                   "--ntasks-per-node, mpirun -npernode), or check CUDA_VISIBLE_DEVICES",
                   "local rank {} needs GPU {}, but this node shows {} GPU(s)", l.local_rank,
                   l.local_rank, devices);
    // Before the CUDA context (gdn::cuda::Context) is created on the current device.
    GDN_CUDA_CHECK(cudaSetDevice(l.local_rank));

    ncclUniqueId id{};
    if (l.rank == 0) GDN_NCCL_CHECK(ncclGetUniqueId(&id));
    auto bytes = std::as_writable_bytes(std::span<ncclUniqueId, 1>(&id, 1));
    if (mpi_bootstrap_) {
      detail::mpi_broadcast_bytes(bytes, opts.timeout_s);
    } else if (l.world > 1) {
      GDN_CHECK_HINT(!l.master_addr.empty(), "docs/DISTRIBUTED.md shows the launch recipes",
                     "the NCCL rendezvous needs MASTER_ADDR and MASTER_PORT (this process is {})",
                     describe(l));
      tcp_broadcast({l.master_addr, l.master_port,
                     std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::duration<double>(opts.timeout_s))},
                    l.rank, l.world, bytes);
    }

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns; completion is polled against the deadline
    ncclResult_t r = ncclCommInitRankConfig(&comm_, l.world, id, l.rank, &config);
    wait_ready(r, "ncclCommInitRankConfig");
    GDN_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)));
    GDN_CUDA_CHECK(cudaMemset(barrier_buf_, 0, sizeof(float)));
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclComm() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (std::uncaught_exceptions() > 0) {
      ncclCommAbort(comm_);  // leaving on an error: do not wait for the peers
    } else {
      ncclResult_t r = ncclCommFinalize(comm_);
      const auto deadline = Clock::now() + to_duration(timeout_s_);
      while (r == ncclInProgress && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ncclCommGetAsyncError(comm_, &r);
      }
      if (r == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (auto& p : pending_) cudaEventDestroy(p.event);
    cudaFree(barrier_buf_);
    if (mpi_bootstrap_) detail::mpi_comm_released();
  }

  bool on_device() const override { return true; }
  CommKind kind() const override { return CommKind::Nccl; }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                  StreamHandle stream) override {
    check_reducible("all_reduce", dtype, op);
    cudaStream_t s = pick(stream);
    call(ncclAllReduce(send, recv, static_cast<size_t>(count), nccl_reduce_type(dtype),
                       op == ReduceOp::Sum ? ncclSum : ncclAvg, comm_, s),
         "all_reduce", s);
  }
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op,
                      StreamHandle stream) override {
    check_reducible("reduce_scatter", dtype, op);
    cudaStream_t s = pick(stream);
    call(ncclReduceScatter(send, recv, static_cast<size_t>(recv_count), nccl_reduce_type(dtype),
                           op == ReduceOp::Sum ? ncclSum : ncclAvg, comm_, s),
         "reduce_scatter", s);
  }
  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                  StreamHandle stream) override {
    cudaStream_t s = pick(stream);
    call(ncclAllGather(send, recv, static_cast<size_t>(send_count * dtype_size(dtype)), ncclUint8,
                       comm_, s),
         "all_gather", s);
  }
  void broadcast(void* buf, int64_t count, DType dtype, int root, StreamHandle stream) override {
    GDN_CHECK(root >= 0 && root < size(), "broadcast: root {} is not a rank of {}", root, size());
    cudaStream_t s = pick(stream);
    call(ncclBroadcast(buf, buf, static_cast<size_t>(count * dtype_size(dtype)), ncclUint8, root,
                       comm_, s),
         "broadcast", s);
  }
  // NCCL has no barrier: a one-element all-reduce, then wait for it. A peer that never comes is
  // caught by the watchdog, which ends the process.
  void barrier() override {
    cudaStream_t s = cuda::stream();
    call(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, s), "barrier",
         s);
    GDN_CUDA_CHECK(cudaStreamSynchronize(s));
  }

 private:
  struct Pending {
    cudaEvent_t event;
    Clock::time_point deadline;
    uint64_t seq;
    const char* what;
  };

  static cudaStream_t pick(StreamHandle s) {
    return s ? static_cast<cudaStream_t>(s) : cuda::stream();
  }

  [[noreturn]] void abort_job(const std::string& message) {
    log::error("{}", message);
    log::error("aborting the NCCL communicator and exiting with status {}", kAbortCode);
    std::fflush(stdout);
    std::fflush(stderr);
    ncclCommAbort(comm_);
    ::_exit(kAbortCode);
  }

  // A non-blocking call may answer ncclInProgress: poll until it settles, bounded.
  void wait_ready(ncclResult_t r, const char* what) {
    const auto deadline = Clock::now() + to_duration(timeout_s_);
    while (r == ncclInProgress) {
      if (Clock::now() >= deadline)
        abort_job(
            fmt::format("{} did not complete within {} s (dist.timeout_s): a rank did not "
                        "join",
                        what, timeout_s_));
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ncclCommGetAsyncError(comm_, &r);
    }
    if (r != ncclSuccess)
      abort_job(
          fmt::format("{} failed: {} ({})", what, ncclGetErrorString(r), ncclGetLastError(comm_)));
  }

  // After enqueueing a collective: settle the call, then hand its completion to the watchdog.
  void call(ncclResult_t r, const char* what, cudaStream_t s) {
    ++seq_;
    wait_ready(r, what);
    cudaEvent_t ev;
    {
      std::lock_guard lock(mu_);
      if (free_events_.empty()) {
        GDN_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      } else {
        ev = free_events_.back();
        free_events_.pop_back();
      }
    }
    GDN_CUDA_CHECK(cudaEventRecord(ev, s));
    {
      std::lock_guard lock(mu_);
      pending_.push_back({ev, Clock::now() + to_duration(timeout_s_), seq_, what});
    }
    cv_.notify_all();
  }

  void watch() {
    // The watchdog uses the communicator's device for its event queries.
    cudaSetDevice(local_rank());
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_) break;
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        abort_job(fmt::format("NCCL reported an asynchronous error: {} ({})",
                              ncclGetErrorString(async), ncclGetLastError(comm_)));
      while (!pending_.empty()) {
        Pending& p = pending_.front();
        const cudaError_t q = cudaEventQuery(p.event);
        if (q == cudaSuccess) {
          free_events_.push_back(p.event);
          pending_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady)
          abort_job(fmt::format("CUDA error while waiting for {} #{}: {}", p.what, p.seq,
                                cudaGetErrorString(q)));
        if (Clock::now() >= p.deadline)
          abort_job(
              fmt::format("{} #{} did not complete within {} s (dist.timeout_s): a peer "
                          "died or hangs (its own log names it)",
                          p.what, p.seq, timeout_s_));
        break;
      }
    }
  }

  ncclComm_t comm_ = nullptr;
  double timeout_s_;
  bool mpi_bootstrap_;
  float* barrier_buf_ = nullptr;
  uint64_t seq_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::thread watchdog_;
};

}  // namespace

namespace detail {

std::unique_ptr<Comm> make_nccl_comm(const LaunchInfo& launch, const DistOptions& opts) {
  // Under mpirun the id goes by MPI broadcast (no MASTER_ADDR needed); otherwise over TCP.
  const bool mpi_bootstrap = launch.launcher == Launcher::OpenMpi && mpi_compiled();
  return std::make_unique<NcclComm>(launch, opts, mpi_bootstrap);
}

}  // namespace detail
}  // namespace gdn::dist

#endif  // GDN_WITH_NCCL
