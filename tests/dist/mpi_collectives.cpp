// Run under mpirun (ctest: -np 2 and -np 3): every collective of the MPI communicator against
// values computed here independently, for each reducible dtype and several sizes (0, 1, odd,
// larger than one message), in place and out of place. Exit status 0 only if every check passed
// on every rank (the failure count is itself all-reduced).
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "dist/launch.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace {

using namespace gdn;
using namespace gdn::dist;

int g_checks = 0;
int g_failures = 0;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    log::error("FAIL: {}", what);
  }
}

// Small integers: exact in every dtype (bf16 up to 256), so sums are exact in any order.
double value(int rank, int64_t i, int salt) {
  return static_cast<double>(((rank + 1) * 7 + i * 3 + salt) % 41 - 20);
}

template <class T>
T cast_to(double v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return to_bf16(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}
template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return to_float(v);
  } else {
    return static_cast<double>(v);
  }
}
// Average: the sum (exact) divided by the world size in the dtype's precision: fp32 for F32 and
// BF16 (reduced in fp32 then rounded), fp64 for F64.
template <class T>
double expected_avg(double sum, int size) {
  if constexpr (std::is_same_v<T, double>) {
    return sum * (1.0 / size);
  } else if constexpr (std::is_same_v<T, bf16>) {
    return to_float(to_bf16(static_cast<float>(sum) * (1.0f / static_cast<float>(size))));
  } else {
    return static_cast<float>(sum) * (1.0f / static_cast<float>(size));
  }
}

template <class T>
void test_dtype(Comm& comm, DType dtype, const char* name) {
  const int r = comm.rank(), p = comm.size();
  const bool is_float = dtype_is_float(dtype);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100003}}) {
    const std::string tag = fmt::format("{} n={}", name, n);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
      if (op == ReduceOp::Avg && !is_float) continue;
      const char* opn = op == ReduceOp::Sum ? "sum" : "avg";
      // all_reduce, out of place then in place.
      for (bool in_place : {false, true}) {
        std::vector<T> send(n), recv(n);
        for (int64_t i = 0; i < n; ++i) send[i] = cast_to<T>(value(r, i, 1));
        T* out = in_place ? send.data() : recv.data();
        comm.all_reduce(send.data(), out, n, dtype, op);
        int bad = 0;
        for (int64_t i = 0; i < n; ++i) {
          double sum = 0;
          for (int q = 0; q < p; ++q) sum += value(q, i, 1);
          const double want = op == ReduceOp::Sum ? sum : expected_avg<T>(sum, p);
          bad += to_double(out[i]) != want;
        }
        check(bad == 0, fmt::format("all_reduce {} {}{}: {} wrong elements", opn, tag,
                                    in_place ? " in place" : "", bad));
      }
      // reduce_scatter: rank r gets block r of the reduced size*n input.
      std::vector<T> in(n * p), out(n);
      for (int64_t j = 0; j < n * p; ++j) in[j] = cast_to<T>(value(r, j, 2));
      comm.reduce_scatter(in.data(), out.data(), n, dtype, op);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        double sum = 0;
        for (int q = 0; q < p; ++q) sum += value(q, r * n + i, 2);
        bad += to_double(out[i]) != (op == ReduceOp::Sum ? sum : expected_avg<T>(sum, p));
      }
      check(bad == 0, fmt::format("reduce_scatter {} {}: {} wrong elements", opn, tag, bad));
    }
    // all_gather, out of place and in place (this rank's block already in the output).
    for (bool in_place : {false, true}) {
      std::vector<T> recv(n * p, cast_to<T>(99)), send(n);
      for (int64_t i = 0; i < n; ++i) send[i] = cast_to<T>(value(r, i, 3));
      const T* src = send.data();
      if (in_place) {
        for (int64_t i = 0; i < n; ++i) recv[r * n + i] = send[i];
        src = recv.data() + r * n;
      }
      comm.all_gather(src, recv.data(), n, dtype);
      int bad = 0;
      for (int q = 0; q < p; ++q)
        for (int64_t i = 0; i < n; ++i) bad += to_double(recv[q * n + i]) != value(q, i, 3);
      check(bad == 0, fmt::format("all_gather {}{}: {} wrong elements", tag,
                                  in_place ? " in place" : "", bad));
    }
    // broadcast from every root.
    for (int root = 0; root < p; ++root) {
      std::vector<T> buf(n);
      for (int64_t i = 0; i < n; ++i) buf[i] = cast_to<T>(value(r, i, 4));
      comm.broadcast(buf.data(), n, dtype, root);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += to_double(buf[i]) != value(root, i, 4);
      check(bad == 0, fmt::format("broadcast {} root {}: {} wrong elements", tag, root, bad));
    }
  }
}

// bf16 reductions accumulate in fp32 and round once: 256 + 1 + 1 (+ 1) is 258 (259 -> 260 in
// bf16), where adding in bf16 step by step would stay at 256.
void test_bf16_accumulates_in_fp32(Comm& comm) {
  std::vector<bf16> v = {to_bf16(comm.rank() == 0 ? 256.f : 1.f)};
  comm.all_reduce(v.data(), v.data(), 1, DType::BF16, ReduceOp::Sum);
  const float want = to_float(to_bf16(256.f + static_cast<float>(comm.size() - 1)));
  check(to_float(v[0]) == want,
        fmt::format("bf16 sum in fp32: got {} want {}", to_float(v[0]), want));
}

}  // namespace

int main() {
  try {
    const LaunchInfo launch = detect_launch(process_env(), {.rendezvous_over_mpi = true});
    auto comm = make_comm(launch, CommKind::Mpi, {.timeout_s = 60});
    check(comm->kind() == CommKind::Mpi, "kind is mpi");
    check(launch.launcher == Launcher::OpenMpi, "launched by mpirun: " + describe(launch));
    check(comm->rank() == launch.rank && comm->size() == launch.world,
          fmt::format("MPI rank/size {}/{} vs {}", comm->rank(), comm->size(), describe(launch)));
    check(comm->local_rank() == launch.local_rank && comm->local_size() == launch.local_world,
          "local rank/size agree with OMPI_COMM_WORLD_LOCAL_*");
    check(is_logging_rank() == (comm->rank() == 0), "only rank 0 logs");
    check(log::prefix() == fmt::format("[rank {}/{}] ", comm->rank(), comm->size()),
          "log prefix " + log::prefix());
    test_dtype<float>(*comm, DType::F32, "F32");
    test_dtype<double>(*comm, DType::F64, "F64");
    test_dtype<bf16>(*comm, DType::BF16, "BF16");
    test_dtype<int32_t>(*comm, DType::I32, "I32");
    test_dtype<int64_t>(*comm, DType::I64, "I64");
    test_bf16_accumulates_in_fp32(*comm);
    comm->barrier();
    // Every rank's verdict, so that a failure anywhere fails every rank.
    int64_t failures = g_failures;
    comm->all_reduce(&failures, &failures, 1, DType::I64, ReduceOp::Sum);
    if (is_logging_rank())
      log::info("mpi_collectives: {} checks per rank on {} ranks, {} failures in total", g_checks,
                comm->size(), failures);
    return failures == 0 ? 0 : 1;
  } catch (const Error& e) {
    log::error("{}", e.message());
    return 1;
  }
}
