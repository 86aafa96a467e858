#include "dist/comm.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "dist/comm_impl.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::dist {

namespace {

std::atomic<int> g_rank{0};

// World size 1: the collectives are copies.
class LocalComm final : public Comm {
 public:
  explicit LocalComm(const LaunchInfo& l) : Comm(0, 1, 0, 1) { (void)l; }
  bool on_device() const override { return false; }
  CommKind kind() const override { return CommKind::Local; }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                  StreamHandle) override {
    check_reducible("all_reduce", dtype, op);
    copy(send, recv, count, dtype);  // sum or average of one value is the value
  }
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op,
                      StreamHandle) override {
    check_reducible("reduce_scatter", dtype, op);
    copy(send, recv, recv_count, dtype);
  }
  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                  StreamHandle) override {
    copy(send, recv, send_count, dtype);
  }
  void broadcast(void*, int64_t count, DType, int root, StreamHandle) override {
    GDN_CHECK(count >= 0 && root == 0, "broadcast: root {} in a world of 1 (count {})", root,
              count);
  }
  void barrier() override {}

 private:
  static void copy(const void* src, void* dst, int64_t count, DType dtype) {
    GDN_CHECK(count >= 0, "collective: negative count {}", count);
    if (src != dst && count > 0)
      std::memmove(dst, src, static_cast<size_t>(count * dtype_size(dtype)));
  }
};

}  // namespace

namespace detail {

std::unique_ptr<Comm> make_local_comm(const LaunchInfo& launch) {
  return std::make_unique<LocalComm>(launch);
}

void fatal(int code, const std::string& message) {
  log::error("{}", message);
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}

}  // namespace detail

std::string_view comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::Auto:
      return "auto";
    case CommKind::Local:
      return "local";
    case CommKind::Mpi:
      return "mpi";
    case CommKind::Nccl:
      return "nccl";
  }
  return "?";
}

CommKind parse_comm_kind(std::string_view t) {
  for (CommKind k : {CommKind::Auto, CommKind::Local, CommKind::Mpi, CommKind::Nccl})
    if (t == comm_kind_name(k)) return k;
  GDN_FAIL("unknown communicator '{}' (expected auto, local, mpi or nccl)", t);
}

NumaBind parse_numa_bind(std::string_view t) {
  if (t == "auto") return NumaBind::Auto;
  if (t == "off") return NumaBind::Off;
  GDN_FAIL("dist.numa_bind = '{}' is not one of: auto, off", t);
}

std::string_view numa_bind_name(NumaBind b) { return b == NumaBind::Auto ? "auto" : "off"; }

bool nccl_compiled() {
#if defined(GDN_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

bool is_logging_rank() { return g_rank.load(std::memory_order_relaxed) == 0; }

void set_process_rank(int rank, int world) {
  g_rank.store(rank, std::memory_order_relaxed);
  log::set_rank(rank, world);
}

void check_reducible(std::string_view collective, DType dtype, ReduceOp op) {
  const bool is_int = dtype == DType::I32 || dtype == DType::I64;
  const bool is_float = dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16;
  GDN_CHECK(is_float || (is_int && op == ReduceOp::Sum),
            "{}: cannot {} {} (reductions take F32, F64, BF16; I32/I64 for sums only)", collective,
            op == ReduceOp::Sum ? "sum" : "average", dtype_name(dtype));
}

std::unique_ptr<Comm> make_comm(const LaunchInfo& launch, CommKind kind, const DistOptions& opts) {
  GDN_CHECK(opts.timeout_s > 0, "dist.timeout_s = {} must be positive", opts.timeout_s);
  if (kind == CommKind::Auto) {
    if (launch.world == 1) {
      kind = CommKind::Local;
    } else {
#if defined(GDN_WITH_CUDA)
      kind = CommKind::Nccl;
#else
      kind = CommKind::Mpi;
#endif
    }
  }
  std::unique_ptr<Comm> comm;
  switch (kind) {
    case CommKind::Local:
      GDN_CHECK_HINT(launch.world == 1,
                     "a multi-rank run needs the mpi (cpu) or nccl (cuda) communicator",
                     "the local communicator serves world size 1 only, but this process is {}",
                     describe(launch));
      comm = detail::make_local_comm(launch);
      break;
    case CommKind::Mpi:
      GDN_CHECK_HINT(mpi_compiled(),
                     "install Open MPI (Debian: libopenmpi-dev openmpi-bin; scripts/setup.sh does) "
                     "and configure again: CMake's FindMPI must find it",
                     "the MPI communicator was asked for, but this gdntrain was built without MPI");
      comm = detail::make_mpi_comm(launch, opts);
      break;
    case CommKind::Nccl:
      GDN_CHECK_HINT(nccl_compiled(), "build the cuda preset on a machine with NCCL",
                     "the NCCL communicator was asked for, but this gdntrain was built without "
                     "{}",
#if defined(GDN_WITH_CUDA)
                     "NCCL"
#else
                     "CUDA"
#endif
      );
      comm = detail::make_nccl_comm(launch, opts);
      break;
    case CommKind::Auto:
      break;
  }
  set_process_rank(comm->rank(), comm->size());
  return comm;
}

#if !defined(GDN_WITH_NCCL)
namespace detail {
std::unique_ptr<Comm> make_nccl_comm(const LaunchInfo&, const DistOptions&) {
  GDN_FAIL("this build has no NCCL");
}
}  // namespace detail
#endif

}  // namespace gdn::dist
