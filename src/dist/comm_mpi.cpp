// The MPI communicator (cpu backend): Open MPI's non-blocking collectives, each polled with
// MPI_Test until it completes or its deadline passes. The poll loop is the watchdog: it needs no
// second thread (so MPI_THREAD_FUNNELED suffices) and it also answers the "where are you?" pings
// of peers that timed out, which is how a timed-out rank learns *which* rank is missing.
#include "dist/comm_impl.h"

#if defined(GDN_WITH_MPI)

// The C API only: the deprecated C++ bindings that <mpi.h> pulls into C++ code need libmpi_cxx.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include <fmt/ranges.h>

#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::dist {

namespace {

using Clock = std::chrono::steady_clock;

// Exit status of a job aborted by a timed-out or failed collective.
constexpr int kAbortCode = 3;
constexpr int kPingTag = 7001;
constexpr int kPongTag = 7002;

struct Runtime {
  bool owned = false;     // we called MPI_Init
  bool abnormal = false;  // a communicator went away during an exception: never finalise
};
Runtime& runtime() {
  static Runtime r;
  return r;
}

void finalize_at_exit() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (runtime().owned && !runtime().abnormal && initialized && !finalized) MPI_Finalize();
}

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(buf, static_cast<size_t>(len));
}

// A failed or timed-out collective cannot be recovered from (the other ranks are inside it):
// print why, naming this rank (log prefix) and the others involved, and end the whole job.
[[noreturn]] void abort_job(const std::string& message) {
  log::error("{}", message);
  log::error("aborting the job (MPI_Abort, exit status {})", kAbortCode);
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, kAbortCode);
  ::_exit(kAbortCode);  // MPI_Abort does not return; this is in case it does
}

void check_mpi(int rc, std::string_view what) {
  if (rc != MPI_SUCCESS) [[unlikely]]
    abort_job(fmt::format("{} failed: {}", what, mpi_error_string(rc)));
}

// Elements per call are an int in MPI.
int as_count(int64_t n, std::string_view what) {
  GDN_CHECK(n >= 0 && n <= INT_MAX, "{}: {} elements (the MPI communicator takes 0..{} per call)",
            what, n, INT_MAX);
  return static_cast<int>(n);
}

MPI_Datatype reduce_type(DType t) {
  switch (t) {
    case DType::F32:
      return MPI_FLOAT;
    case DType::F64:
      return MPI_DOUBLE;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

// Moving elements (gather, broadcast) needs only their width.
MPI_Datatype move_type(DType t) {
  switch (dtype_size(t)) {
    case 1:
      return MPI_UINT8_T;
    case 2:
      return MPI_UINT16_T;
    case 4:
      return MPI_UINT32_T;
    default:
      return MPI_UINT64_T;
  }
}

// Collective names for messages and for the liveness protocol (sent as their index).
enum class Op : uint64_t { None, AllReduce, ReduceScatter, AllGather, Broadcast, Barrier, Bytes };
constexpr std::array<const char*, 7> kOpNames = {
    "nothing",   "all_reduce", "reduce_scatter",     "all_gather",
    "broadcast", "barrier",    "bootstrap broadcast"};
const char* op_name(uint64_t op) { return op < kOpNames.size() ? kOpNames[op] : "?"; }

void backoff(int spins) {
  // Spin first (a collective among ranks that arrived together completes in microseconds), then
  // yield, then sleep, so that oversubscribed ranks leave the cores to the ones with work.
  if (spins < 64) return;
  if (spins < 512) {
    sched_yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 50 : 500));
}

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, MPI_Comm ctl, int rank, int size, int local_rank, int local_size,
          double timeout_s)
      : Comm(rank, size, local_rank, local_size),
        comm_(comm),
        ctl_(ctl),
        timeout_(
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))),
        timeout_s_(timeout_s) {}

  ~MpiComm() override {
    MPI_Comm_free(&ctl_);
    MPI_Comm_free(&comm_);
    detail::mpi_comm_released();
  }

  bool on_device() const override { return false; }
  CommKind kind() const override { return CommKind::Mpi; }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op,
                  StreamHandle) override {
    check_reducible("all_reduce", dtype, op);
    const int n = as_count(count, "all_reduce");
    begin(Op::AllReduce);
    if (dtype == DType::BF16) {
      // Reduced in fp32, rounded once.
      std::vector<float> tmp = widen(send, count);
      run(MPI_Iallreduce(MPI_IN_PLACE, tmp.data(), n, MPI_FLOAT, MPI_SUM, comm_, &req_),
          "MPI_Iallreduce");
      if (op == ReduceOp::Avg) scale(tmp.data(), tmp.size());
      narrow(tmp, recv);
      return;
    }
    run(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, n, reduce_type(dtype), MPI_SUM,
                       comm_, &req_),
        "MPI_Iallreduce");
    if (op == ReduceOp::Avg) scale(recv, count, dtype);
  }

  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op,
                      StreamHandle) override {
    check_reducible("reduce_scatter", dtype, op);
    const int n = as_count(recv_count, "reduce_scatter");
    as_count(recv_count * size(), "reduce_scatter (input)");
    const auto* s = static_cast<const char*>(send);
    const auto* r = static_cast<const char*>(recv);
    const int64_t in_bytes = recv_count * size() * dtype_size(dtype);
    GDN_CHECK(r + recv_count * dtype_size(dtype) <= s || r >= s + in_bytes || recv_count == 0,
              "reduce_scatter: the output overlaps the input");
    begin(Op::ReduceScatter);
    if (dtype == DType::BF16) {
      std::vector<float> in = widen(send, recv_count * size());
      std::vector<float> out(static_cast<size_t>(recv_count));
      run(MPI_Ireduce_scatter_block(in.data(), out.data(), n, MPI_FLOAT, MPI_SUM, comm_, &req_),
          "MPI_Ireduce_scatter_block");
      if (op == ReduceOp::Avg) scale(out.data(), out.size());
      narrow(out, recv);
      return;
    }
    run(MPI_Ireduce_scatter_block(send, recv, n, reduce_type(dtype), MPI_SUM, comm_, &req_),
        "MPI_Ireduce_scatter_block");
    if (op == ReduceOp::Avg) scale(recv, recv_count, dtype);
  }

  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype,
                  StreamHandle) override {
    const int n = as_count(send_count, "all_gather");
    as_count(send_count * size(), "all_gather (output)");
    const bool in_place =
        send == static_cast<const char*>(recv) + rank() * send_count * dtype_size(dtype);
    begin(Op::AllGather);
    run(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, n, move_type(dtype), recv, n,
                       move_type(dtype), comm_, &req_),
        "MPI_Iallgather");
  }

  void broadcast(void* buf, int64_t count, DType dtype, int root, StreamHandle) override {
    GDN_CHECK(root >= 0 && root < size(), "broadcast: root {} is not a rank of {}", root, size());
    const int n = as_count(count, "broadcast");
    begin(Op::Broadcast);
    run(MPI_Ibcast(buf, n, move_type(dtype), root, comm_, &req_), "MPI_Ibcast");
  }

  void barrier() override {
    begin(Op::Barrier);
    run(MPI_Ibarrier(comm_, &req_), "MPI_Ibarrier");
  }

 private:
  void begin(Op op) {
    ++seq_;
    op_ = op;
  }

  // Starts (rc of the MPI_I* call) and waits for req_, answering peers' pings meanwhile.
  void run(int rc, std::string_view call) {
    check_mpi(rc, fmt::format("{} ({} #{})", call, op_name(static_cast<uint64_t>(op_)), seq_));
    const auto deadline = Clock::now() + timeout_;
    int done = 0;
    for (int spins = 0;; ++spins) {
      check_mpi(MPI_Test(&req_, &done, MPI_STATUS_IGNORE), call);
      if (done) return;
      answer_pings();
      if (Clock::now() >= deadline) diagnose_and_abort();
      backoff(spins);
    }
  }

  // A peer that timed out asks where we are: answer with our collective count and kind.
  void answer_pings() {
    for (;;) {
      int flag = 0;
      MPI_Status st;
      check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, kPingTag, ctl_, &flag, &st), "MPI_Iprobe");
      if (!flag) return;
      uint64_t their_seq = 0;
      check_mpi(
          MPI_Recv(&their_seq, 1, MPI_UINT64_T, st.MPI_SOURCE, kPingTag, ctl_, MPI_STATUS_IGNORE),
          "MPI_Recv (ping)");
      const std::array<uint64_t, 2> pong = {seq_, static_cast<uint64_t>(op_)};
      check_mpi(MPI_Send(pong.data(), 2, MPI_UINT64_T, st.MPI_SOURCE, kPongTag, ctl_),
                "MPI_Send (pong)");
    }
  }

  // The collective missed its deadline. Ask every other rank where it is, for a short grace
  // period: ranks waiting in the same collective answer (their poll loop serves pings); a rank
  // that is dead, or stuck in computation or I/O, does not. Name them, then end the job.
  [[noreturn]] void diagnose_and_abort() {
    const int n = size();
    std::vector<std::array<uint64_t, 2>> pong(static_cast<size_t>(n));
    std::vector<MPI_Request> rreq(static_cast<size_t>(n), MPI_REQUEST_NULL);
    std::vector<MPI_Request> sreq(static_cast<size_t>(n), MPI_REQUEST_NULL);
    std::vector<char> answered(static_cast<size_t>(n), 0);  // 1: answered; 2: transport error
    for (int r = 0; r < n; ++r) {
      if (r == rank()) continue;
      // Errors here (a dead peer's transport) only mean "no answer": the diagnosis goes on.
      if (MPI_Irecv(pong[r].data(), 2, MPI_UINT64_T, r, kPongTag, ctl_, &rreq[r]) != MPI_SUCCESS ||
          MPI_Isend(&seq_, 1, MPI_UINT64_T, r, kPingTag, ctl_, &sreq[r]) != MPI_SUCCESS)
        answered[r] = 2;  // failed: reported as silent
    }
    const double grace_s = std::clamp(timeout_s_ * 0.1, 0.5, 5.0);
    const auto grace_end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(grace_s));
    int pending = 0;
    for (int r = 0; r < n; ++r) pending += r != rank() && !answered[r];
    for (int spins = 0; pending > 0 && Clock::now() < grace_end; ++spins) {
      for (int r = 0; r < n; ++r) {
        if (r == rank() || answered[r]) continue;
        int done = 0;
        const int rc = MPI_Test(&rreq[r], &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS || done) {
          answered[r] = rc == MPI_SUCCESS ? 1 : 2;
          --pending;
        }
      }
      answer_pings();
      backoff(spins);
    }
    std::vector<int> silent;
    std::string elsewhere;
    for (int r = 0; r < n; ++r) {
      if (r == rank()) continue;
      if (answered[r] != 1) {
        silent.push_back(r);
      } else if (pong[r][0] != seq_ || pong[r][1] != static_cast<uint64_t>(op_)) {
        elsewhere += fmt::format("; rank {} is in {} #{} (the ranks issue different collectives)",
                                 r, op_name(pong[r][1]), pong[r][0]);
      }
    }
    std::string who;
    if (!silent.empty()) {
      who = fmt::format(
          "; rank{} {} did not answer within {} s (dead, or hung outside "
          "communication)",
          silent.size() > 1 ? "s" : "", fmt::join(silent, ", "), grace_s);
    } else if (elsewhere.empty()) {
      who = "; every rank answered from the same collective (the transport itself is stuck)";
    }
    abort_job(fmt::format("{} #{} did not complete within {} s (dist.timeout_s){}{}",
                          op_name(static_cast<uint64_t>(op_)), seq_, timeout_s_, who, elsewhere));
  }

  static std::vector<float> widen(const void* src, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    const auto* b = static_cast<const bf16*>(src);
    for (int64_t i = 0; i < n; ++i) out[i] = to_float(b[i]);
    return out;
  }
  static void narrow(const std::vector<float>& src, void* dst) {
    auto* b = static_cast<bf16*>(dst);
    for (size_t i = 0; i < src.size(); ++i) b[i] = to_bf16(src[i]);
  }
  void scale(float* p, size_t n) const {
    const float inv = 1.0f / static_cast<float>(size());
    for (size_t i = 0; i < n; ++i) p[i] *= inv;
  }
  void scale(void* p, int64_t n, DType dtype) const {
    if (dtype == DType::F32) {
      scale(static_cast<float*>(p), static_cast<size_t>(n));
    } else {
      const double inv = 1.0 / size();
      auto* d = static_cast<double*>(p);
      for (int64_t i = 0; i < n; ++i) d[i] *= inv;
    }
  }

  MPI_Comm comm_;  // the collectives
  MPI_Comm ctl_;   // liveness pings only, so they never match a collective's traffic
  MPI_Request req_ = MPI_REQUEST_NULL;
  Clock::duration timeout_;
  double timeout_s_;
  uint64_t seq_ = 0;
  Op op_ = Op::None;
};

}  // namespace

bool mpi_compiled() { return true; }

namespace detail {

void mpi_init_once() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  GDN_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed: {}", mpi_error_string(rc));
  runtime().owned = true;
  std::atexit(finalize_at_exit);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

void mpi_comm_released() {
  if (std::uncaught_exceptions() > 0) runtime().abnormal = true;
}

void mpi_broadcast_bytes(std::span<std::byte> data, double timeout_s) {
  mpi_init_once();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int n = as_count(static_cast<int64_t>(data.size()), "bootstrap broadcast");
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(data.data(), n, MPI_BYTE, 0, MPI_COMM_WORLD, &req), "MPI_Ibcast");
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  int done = 0;
  for (int spins = 0;; ++spins) {
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test (bootstrap broadcast)");
    if (done) return;
    if (Clock::now() >= deadline)
      abort_job(
          fmt::format("the bootstrap broadcast from rank 0 did not complete within {} s "
                      "(dist.timeout_s): a rank did not start or did not reach it",
                      timeout_s));
    backoff(spins);
  }
}

std::unique_ptr<Comm> make_mpi_comm(const LaunchInfo& launch, const DistOptions& opts) {
  mpi_init_once();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  GDN_CHECK_HINT(size == launch.world,
                 "start the ranks with mpirun -np N (or srun --mpi=pmix): MPI needs its own "
                 "launcher; torchrun-style ranks on the cpu backend are not supported",
                 "the MPI communicator sees a world of {} but this process is {}", size,
                 describe(launch));
  GDN_CHECK(launch.launcher == Launcher::None || rank == launch.rank,
            "MPI says this process is rank {} but the launcher says {}", rank, describe(launch));
  MPI_Comm comm = MPI_COMM_NULL, ctl = MPI_COMM_NULL, node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &ctl), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(ctl, MPI_ERRORS_RETURN);
  // The node-local rank from MPI itself (shared-memory domain), not from the environment.
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  return std::make_unique<MpiComm>(comm, ctl, rank, size, local_rank, local_size, opts.timeout_s);
}

}  // namespace detail
}  // namespace gdn::dist

#else  // !GDN_WITH_MPI

#include "gdn/core/error.h"

namespace gdn::dist {

bool mpi_compiled() { return false; }

namespace detail {

constexpr const char* kNoMpi =
    "this gdntrain was built without MPI (CMake's FindMPI found no Open MPI at configure time)";
constexpr const char* kNoMpiHint =
    "install libopenmpi-dev and openmpi-bin (scripts/setup.sh does) and configure again";

void mpi_init_once() { GDN_FAIL_HINT(kNoMpiHint, "{}", kNoMpi); }
void mpi_comm_released() {}
void mpi_broadcast_bytes(std::span<std::byte>, double) { GDN_FAIL_HINT(kNoMpiHint, "{}", kNoMpi); }
std::unique_ptr<Comm> make_mpi_comm(const LaunchInfo&, const DistOptions&) {
  GDN_FAIL_HINT(kNoMpiHint, "{}", kNoMpi);
}

}  // namespace detail
}  // namespace gdn::dist

#endif
