// Launch detection from fake environments (the process environment is never touched): each
// launcher's variables, the precedence between launchers, and every bad launch is an error naming
// the variable before any work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dist/launch.h"
#include "gdn/core/error.h"

namespace gdn::dist {
namespace {

using ::testing::HasSubstr;

std::string error_of(const EnvMap& env, const LaunchOptions& opts = {}) {
  try {
    detect_launch(env, opts);
  } catch (const Error& e) {
    return e.message();
  }
  return "(no error)";
}

const EnvMap kTorchrun = {{"RANK", "5"},
                          {"WORLD_SIZE", "8"},
                          {"LOCAL_RANK", "1"},
                          {"LOCAL_WORLD_SIZE", "4"},
                          {"MASTER_ADDR", "node0"},
                          {"MASTER_PORT", "29500"}};

TEST(Launch, PlainStartIsWorldOne) {
  const LaunchInfo i = detect_launch({{"HOME", "/root"}, {"PATH", "/bin"}});
  EXPECT_EQ(i.launcher, Launcher::None);
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world, 1);
  EXPECT_EQ(i.local_rank, 0);
  EXPECT_EQ(i.local_world, 1);
  EXPECT_FALSE(i.distributed());
}

TEST(Launch, Torchrun) {
  const LaunchInfo i = detect_launch(kTorchrun);
  EXPECT_EQ(i.launcher, Launcher::Torchrun);
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world, 4);
  EXPECT_EQ(i.master_addr, "node0");
  EXPECT_EQ(i.master_port, 29500);
  EXPECT_EQ(describe(i), "rank 5/8 (local 1/4) launched by torchrun, rendezvous node0:29500");
}

TEST(Launch, TorchrunWorldOneNeedsNoRendezvous) {
  const LaunchInfo i = detect_launch({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(i.world, 1);
  EXPECT_EQ(i.local_world, 1);  // LOCAL_WORLD_SIZE absent: the world
  EXPECT_TRUE(i.master_addr.empty());
}

TEST(Launch, OpenMpi) {
  const LaunchInfo i = detect_launch({{"OMPI_COMM_WORLD_RANK", "2"},
                                      {"OMPI_COMM_WORLD_SIZE", "3"},
                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
  EXPECT_EQ(i.launcher, Launcher::OpenMpi);
  EXPECT_EQ(i.rank, 2);
  EXPECT_EQ(i.world, 3);
  EXPECT_EQ(i.local_rank, 2);
  EXPECT_EQ(i.local_world, 3);
  EXPECT_TRUE(i.master_addr.empty());  // the NCCL id goes by MPI broadcast
}

TEST(Launch, SlurmWithNtasksPerNode) {
  const LaunchInfo i = detect_launch({{"SLURM_PROCID", "6"},
                                      {"SLURM_NTASKS", "8"},
                                      {"SLURM_LOCALID", "2"},
                                      {"SLURM_NTASKS_PER_NODE", "4"},
                                      {"MASTER_ADDR", "10.0.0.1"},
                                      {"MASTER_PORT", "29400"}});
  EXPECT_EQ(i.launcher, Launcher::Slurm);
  EXPECT_EQ(i.rank, 6);
  EXPECT_EQ(i.world, 8);
  EXPECT_EQ(i.local_rank, 2);
  EXPECT_EQ(i.local_world, 4);
  EXPECT_EQ(i.master_addr, "10.0.0.1");
}

TEST(Launch, SlurmStepAndCompressedTasksPerNode) {
  // srun's step size wins over the allocation's; "4(x2),3" gives node 2 three tasks.
  const LaunchInfo i = detect_launch({{"SLURM_PROCID", "9"},
                                      {"SLURM_NTASKS", "16"},
                                      {"SLURM_STEP_NUM_TASKS", "11"},
                                      {"SLURM_LOCALID", "1"},
                                      {"SLURM_NODEID", "2"},
                                      {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"},
                                      {"MASTER_ADDR", "n0"},
                                      {"MASTER_PORT", "29400"}});
  EXPECT_EQ(i.world, 11);
  EXPECT_EQ(i.local_world, 3);
  EXPECT_EQ(i.local_rank, 1);
}

TEST(Launch, SlurmUnderMpiNeedsNoMasterAddr) {
  const EnvMap env = {{"SLURM_PROCID", "1"},
                      {"SLURM_NTASKS", "2"},
                      {"SLURM_LOCALID", "1"},
                      {"SLURM_NTASKS_PER_NODE", "2"}};
  EXPECT_THAT(error_of(env), HasSubstr("MASTER_ADDR is missing"));
  const LaunchInfo i = detect_launch(env, {.rendezvous_over_mpi = true});
  EXPECT_EQ(i.rank, 1);
  EXPECT_TRUE(i.master_addr.empty());
}

TEST(Launch, PrecedenceTorchrunThenMpiThenSlurm) {
  // torchrun started by srun: the Slurm variables describe the allocation, not this process.
  EnvMap env = kTorchrun;
  env["SLURM_PROCID"] = "0";
  env["SLURM_NTASKS"] = "2";
  EXPECT_EQ(detect_launch(env).launcher, Launcher::Torchrun);
  // mpirun inside an allocation.
  const LaunchInfo m = detect_launch({{"OMPI_COMM_WORLD_RANK", "1"},
                                      {"OMPI_COMM_WORLD_SIZE", "2"},
                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                      {"SLURM_PROCID", "0"},
                                      {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(m.launcher, Launcher::OpenMpi);
  EXPECT_EQ(m.rank, 1);
}

TEST(Launch, WorldSizeWithoutMasterAddrIsAnError) {
  EnvMap env = kTorchrun;
  env.erase("MASTER_ADDR");
  EXPECT_THAT(error_of(env), HasSubstr("WORLD_SIZE=8 is set but MASTER_ADDR is missing"));
  env = kTorchrun;
  env["MASTER_ADDR"] = "";
  EXPECT_THAT(error_of(env), HasSubstr("MASTER_ADDR is missing"));
  env = kTorchrun;
  env.erase("MASTER_PORT");
  EXPECT_THAT(error_of(env), HasSubstr("MASTER_PORT is missing"));
  env = kTorchrun;
  env["MASTER_PORT"] = "70000";
  EXPECT_THAT(error_of(env), HasSubstr("MASTER_PORT='70000'"));
}

TEST(Launch, RankOutOfRangeIsAnError) {
  EnvMap env = kTorchrun;
  env["RANK"] = "8";
  EXPECT_THAT(error_of(env), HasSubstr("RANK=8 is not below WORLD_SIZE=8"));
  env = kTorchrun;
  env["LOCAL_RANK"] = "4";
  EXPECT_THAT(error_of(env), HasSubstr("LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"));
  env = kTorchrun;
  env["LOCAL_WORLD_SIZE"] = "9";
  EXPECT_THAT(error_of(env), HasSubstr("LOCAL_WORLD_SIZE=9 is larger than WORLD_SIZE=8"));
  env = kTorchrun;
  env["RANK"] = "0";
  EXPECT_THAT(error_of(env), HasSubstr("LOCAL_RANK=1 is larger than RANK=0"));
  EXPECT_THAT(error_of({{"OMPI_COMM_WORLD_RANK", "3"},
                        {"OMPI_COMM_WORLD_SIZE", "3"},
                        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}}),
              HasSubstr("OMPI_COMM_WORLD_RANK=3 is not below OMPI_COMM_WORLD_SIZE=3"));
  EXPECT_THAT(error_of({{"SLURM_PROCID", "4"},
                        {"SLURM_NTASKS", "4"},
                        {"SLURM_LOCALID", "0"},
                        {"SLURM_NTASKS_PER_NODE", "4"},
                        {"MASTER_ADDR", "n0"},
                        {"MASTER_PORT", "1"}}),
              HasSubstr("SLURM_PROCID=4 is not below SLURM_NTASKS=4"));
}

TEST(Launch, MalformedNumbersAreErrorsNamingTheVariable) {
  for (const char* bad : {"", "two", "2x", "-1", "1e3", " 2", "99999999999"}) {
    EnvMap env = kTorchrun;
    env["WORLD_SIZE"] = bad;
    EXPECT_THAT(error_of(env), HasSubstr(fmt::format("WORLD_SIZE='{}'", bad))) << bad;
  }
  EnvMap env = kTorchrun;
  env["WORLD_SIZE"] = "0";
  EXPECT_THAT(error_of(env), HasSubstr("WORLD_SIZE='0' is not an integer in [1,"));
  EXPECT_THAT(error_of({{"SLURM_PROCID", "0"},
                        {"SLURM_NTASKS", "2"},
                        {"SLURM_LOCALID", "0"},
                        {"SLURM_TASKS_PER_NODE", "2(x"}}),
              HasSubstr("SLURM_TASKS_PER_NODE"));
}

TEST(Launch, MissingVariablesAreNamed) {
  EXPECT_THAT(error_of({{"RANK", "0"}}), HasSubstr("RANK is set but WORLD_SIZE is missing"));
  EXPECT_THAT(error_of({{"WORLD_SIZE", "2"}, {"RANK", "0"}}),
              HasSubstr("WORLD_SIZE is set but LOCAL_RANK is missing"));
  EXPECT_THAT(error_of({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}}),
              HasSubstr("OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_LOCAL_RANK is missing"));
  EXPECT_THAT(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}),
              HasSubstr("neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE"));
  EXPECT_THAT(error_of({{"SLURM_PROCID", "0"}}),
              HasSubstr("SLURM_PROCID is set but SLURM_NTASKS is missing"));
}

TEST(Launch, TwoLaunchersDisagreeingIsAnError) {
  EnvMap env = kTorchrun;
  env["OMPI_COMM_WORLD_SIZE"] = "4";
  EXPECT_THAT(error_of(env),
              HasSubstr("inconsistent world sizes: WORLD_SIZE=8 but OMPI_COMM_WORLD_SIZE=4"));
}

TEST(Launch, ProcessEnvSnapshotReadsTheRealEnvironment) {
  const EnvMap env = process_env();
  EXPECT_TRUE(env.count("PATH")) << "PATH is set in any test environment";
}

}  // namespace
}  // namespace gdn::dist
