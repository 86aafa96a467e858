// The world-size-1 communicator (needs neither MPI nor NCCL), the factory's choices and errors,
// and the rank-prefixed logging. The multi-rank collectives run under mpirun (mpi_collectives.cpp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "dist/comm.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"
#include "support/error_of.h"

namespace gdn::dist {
namespace {

using ::testing::HasSubstr;

using gdn::testing::error_of;

TEST(LocalComm, CollectivesOfOneRank) {
  auto comm = make_comm(LaunchInfo{}, CommKind::Auto, {});
  EXPECT_EQ(comm->kind(), CommKind::Local);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_FALSE(comm->on_device());
  std::vector<float> a = {1.5f, -2.f, 3.25f}, b(3);
  comm->all_reduce(a.data(), b.data(), 3, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(b, a);
  comm->all_reduce(a.data(), a.data(), 3, DType::F32, ReduceOp::Avg);
  EXPECT_EQ(a, b);
  std::vector<double> c(2, 0.0), d = {4.0, 5.0};
  comm->reduce_scatter(d.data(), c.data(), 2, DType::F64, ReduceOp::Avg);
  EXPECT_EQ(c, d);
  std::vector<int32_t> e = {7, 8}, f(2);
  comm->all_gather(e.data(), f.data(), 2, DType::I32);
  EXPECT_EQ(f, e);
  comm->broadcast(e.data(), 2, DType::I32, 0);
  comm->barrier();
  EXPECT_THAT(error_of([&] { comm->broadcast(e.data(), 2, DType::I32, 1); }), HasSubstr("root 1"));
  EXPECT_THAT(error_of([&] { comm->all_reduce(e.data(), f.data(), 2, DType::I32, ReduceOp::Avg); }),
              HasSubstr("cannot average I32"));
  EXPECT_TRUE(is_logging_rank());
}

TEST(MakeComm, ChoicesAndErrors) {
  LaunchInfo two;
  two.world = 2;
  two.local_world = 2;
  two.launcher = Launcher::Torchrun;
  EXPECT_THAT(error_of([&] { make_comm(two, CommKind::Local, {}); }),
              HasSubstr("the local communicator serves world size 1 only"));
  EXPECT_THAT(error_of([&] { make_comm(LaunchInfo{}, CommKind::Auto, {.timeout_s = 0}); }),
              HasSubstr("dist.timeout_s = 0 must be positive"));
  if (!nccl_compiled()) {
    EXPECT_THAT(error_of([&] { make_comm(two, CommKind::Nccl, {}); }),
                HasSubstr("the NCCL communicator was asked for, but this gdntrain was built "
                          "without"));
  }
  if (!mpi_compiled()) {
    EXPECT_THAT(error_of([&] { make_comm(two, CommKind::Mpi, {}); }),
                HasSubstr("built without MPI"));
  }
  EXPECT_EQ(parse_comm_kind("mpi"), CommKind::Mpi);
  EXPECT_THAT(error_of([] { parse_comm_kind("gloo"); }), HasSubstr("unknown communicator 'gloo'"));
}

TEST(DistLog, ErrorsCarryTheRankAndOnlyRankZeroLogs) {
  std::vector<std::string> lines;
  log::set_sink([&](log::Level, std::string_view l) { lines.emplace_back(l); });
  set_process_rank(1, 2);
  EXPECT_FALSE(is_logging_rank());
  log::error("collective all_reduce #3 timed out");
  EXPECT_EQ(log::prefix(), "[rank 1/2] ");
  set_process_rank(0, 1);
  EXPECT_TRUE(is_logging_rank());
  EXPECT_EQ(log::prefix(), "");
  log::error("single");
  log::set_sink({});
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "[rank 1/2] error: collective all_reduce #3 timed out");
  EXPECT_EQ(lines[1], "error: single");
}

}  // namespace
}  // namespace gdn::dist
