// The collective interface (issue 23): one small class over existing engines, no home-made
// transport. Three implementations:
//   Local: world size 1; every collective is a copy (or nothing). Needs neither MPI nor NCCL.
//   MPI:   Open MPI, for the cpu backend (host memory); built when CMake's FindMPI finds it.
//   NCCL:  the cuda backend (device memory, ordered on a CUDA stream); built with GDN_CUDA when
//          NCCL is found.
//
// Semantics shared by all (counts are elements, never bytes):
//   all_reduce(send, recv, n)             recv[i] = op over ranks of send[i]; send == recv is fine
//   reduce_scatter(send, recv, n)         send holds size()*n elements; rank r gets
//                                         recv[i] = op over ranks of send[r*n + i]
//   all_gather(send, recv, n)             recv[r*n + i] = rank r's send[i]; send may be recv +
//   rank*n broadcast(buf, n, root)               every rank's buf becomes root's barrier()
// ReduceOp::Avg is the sum divided by size(). Reductions take F32, F64 and BF16 (and I32/I64 for
// Sum); the MPI implementation reduces BF16 in fp32 and rounds once at the end, so its result does
// not depend on the order the ranks' values arrive in beyond fp32 rounding. all_gather and
// broadcast move bytes of any dtype.
//
// Ordering: the MPI and Local collectives are complete when the call returns. The NCCL ones are
// enqueued on `stream` (nullptr: the compute stream of gdn/backend/cuda_context.h) and complete in
// stream order, like a kernel; barrier() synchronises that stream.
//
// Failure: every collective has a deadline (DistOptions::timeout_s, config key dist.timeout_s,
// default 300 s). When a peer dies or hangs the waiting ranks do not hang: they print an error
// naming their rank, the collective and (MPI) the rank(s) that did not arrive, and the job is
// aborted with a non-zero exit status (MPI_Abort / ncclCommAbort + exit). See docs/DISTRIBUTED.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "dist/launch.h"
#include "gdn/core/dtype.h"

namespace gdn::dist {

enum class ReduceOp { Sum, Avg };
enum class CommKind { Auto, Local, Mpi, Nccl };
std::string_view comm_kind_name(CommKind k);
// "auto" | "local" | "mpi" | "nccl"; anything else is an error naming the text.
CommKind parse_comm_kind(std::string_view text);

// dist.numa_bind: auto binds the process to the CPUs of its GPU's NUMA node when that node is
// known (dist/numa.h); off leaves the affinity the launcher gave.
enum class NumaBind { Auto, Off };
NumaBind parse_numa_bind(std::string_view text);  // "auto" | "off"
std::string_view numa_bind_name(NumaBind b);

// The process-level settings of a distributed run (config keys dist.*; the trainer maps them).
struct DistOptions {
  double timeout_s = 300;  // dist.timeout_s: a collective not done by then fails the job
  NumaBind numa_bind = NumaBind::Auto;
};

// An opaque stream handle: a cudaStream_t on NCCL communicators, ignored by the others.
using StreamHandle = void*;

class Comm {
 public:
  virtual ~Comm() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // True when buffers are device memory (NCCL).
  virtual bool on_device() const = 0;
  virtual CommKind kind() const = 0;

  virtual void all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                          StreamHandle stream = nullptr) = 0;
  virtual void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype,
                              ReduceOp op, StreamHandle stream = nullptr) = 0;
  virtual void all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                          StreamHandle stream = nullptr) = 0;
  virtual void broadcast(void* buf, int64_t count, DType dtype, int root,
                         StreamHandle stream = nullptr) = 0;
  virtual void barrier() = 0;

  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

 protected:
  Comm(int rank, int size, int local_rank, int local_size)
      : rank_(rank), size_(size), local_rank_(local_rank), local_size_(local_size) {}

 private:
  int rank_, size_, local_rank_, local_size_;
};

// Creates the communicator for this process. Auto picks Local at world size 1, else NCCL on a
// CUDA build and MPI on a CPU build. Asking for an implementation this build lacks (MPI without
// libopenmpi-dev at configure time, NCCL on a CPU build) is a gdn::Error saying so; so is MPI
// started outside mpirun/srun with world > 1 (MPI needs its launcher), and Local with world > 1.
// Also sets the log prefix ("[rank r/N] ") and is_logging_rank().
std::unique_ptr<Comm> make_comm(const LaunchInfo& launch, CommKind kind, const DistOptions& opts);

// Which implementations this build has.
bool mpi_compiled();
bool nccl_compiled();

// Only rank 0 prints progress and writes metrics; every rank prints its errors (prefixed).
bool is_logging_rank();
// Sets the rank used by is_logging_rank() and the log prefix (make_comm calls it).
void set_process_rank(int rank, int world);

// The element type's checks shared by the implementations: reductions need a float or I32/I64
// (Avg: float only); throws naming the collective.
void check_reducible(std::string_view collective, DType dtype, ReduceOp op);

}  // namespace gdn::dist
