// Data parallelism's single-process parts (data_parallel.h): each rank's slice of a step's
// micro-batches (their union is one process's step with grad_accum * world), the dist.* keys and
// their validation, the not-yet-supported shard modes, and world size 1 left as it was. The
// multi-rank runs themselves are tests/dist's dist_replicate_* (mpirun).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gdn/core/error.h"
#include "train/data_parallel.h"
#include "train/data_source.h"
#include "train/indexed_dataset.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

bool same(const MicroBatch& a, const MicroBatch& b) {
  return a.input_ids == b.input_ids && a.labels == b.labels && a.cu_seqlens == b.cu_seqlens;
}

// Rank r's micro-batch k of a step is micro-batch k * world + r of one process with
// grad_accum * world, for every step: disjoint slices whose union is that process's step.
void expect_sharded_like_one_process(
    const std::function<std::unique_ptr<DataSource>(int64_t accum, DataShard)>& make) {
  for (int64_t world : {2, 3}) {
    for (int64_t accum : {1, 2}) {
      auto one = make(accum * world, DataShard{});
      for (int64_t rank = 0; rank < world; ++rank) {
        auto mine = make(accum, DataShard{rank, world});
        for (int64_t step : {0, 1, 5, 2}) {  // 2 after 5: a source may be read out of order
          for (int64_t k = 0; k < accum; ++k) {
            EXPECT_TRUE(same(mine->train_batch(step, k), one->train_batch(step, k * world + rank)))
                << "world " << world << " accum " << accum << " rank " << rank << " step " << step
                << " micro " << k;
          }
        }
      }
    }
  }
  // At world 1 the numbering is the single-process one.
  auto a = make(2, DataShard{}), b = make(2, DataShard{0, 1});
  EXPECT_TRUE(same(a->train_batch(3, 1), b->train_batch(3, 1)));
  // Slices of different ranks differ.
  auto r0 = make(1, DataShard{0, 2}), r1 = make(1, DataShard{1, 2});
  EXPECT_FALSE(same(r0->train_batch(0, 0), r1->train_batch(0, 0)));
}

TEST(DataParallel, MqarRanksReadDisjointSlicesOfOneProcessStep) {
  const MqarConfig c{64, 4, 32};
  expect_sharded_like_one_process(
      [&](int64_t accum, DataShard sh) { return make_mqar_source(c, 7, 128, accum, sh); });
}

TEST(DataParallel, IndexedRanksReadDisjointSlicesOfOneProcessStep) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("gdn_dp_idx_{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    IndexedDatasetWriter w((dir / "data").string(), TokenDType::U16);
    for (int d = 0; d < 60; ++d) {
      std::vector<int32_t> doc;
      for (int t = 0; t < 10 + (d * 7) % 50; ++t) doc.push_back(2 + (d * 31 + t * 7) % 200);
      doc.push_back(1);
      w.add_document(doc);
    }
    w.finish();
  }
  // Small micro-batches: the steps read cross several epochs.
  expect_sharded_like_one_process([&](int64_t accum, DataShard sh) {
    return make_indexed_source((dir / "data").string(), 3, 64, accum, 0.1, 256, sh);
  });
  fs::remove_all(dir);
}

TEST(DataParallel, BadShardIsAnError) {
  EXPECT_THROW(make_mqar_source(MqarConfig{64, 4, 32}, 7, 128, 1, DataShard{2, 2}), Error);
  EXPECT_THROW(make_mqar_source(MqarConfig{64, 4, 32}, 7, 128, 1, DataShard{0, 0}), Error);
}

TEST(DataParallel, DistKeysHaveDefaultsAndAreValidated) {
  ConfigTree c(default_train_config());
  const DistConfig dc = dist_config_from(c);
  EXPECT_EQ(dc.shard, ShardMode::Replicate);
  EXPECT_EQ(dc.options.timeout_s, 300);
  EXPECT_EQ(dc.options.numa_bind, dist::NumaBind::Auto);
  EXPECT_EQ(dc.unshard_stream, "comm");
  EXPECT_NO_THROW(validate_train_config(c));
  for (const char* ok : {"dist.shard=optimizer", "dist.shard=full", "dist.numa_bind=off",
                         "dist.unshard_stream=compute", "dist.timeout_s=2.5"}) {
    ConfigTree t(default_train_config());
    t.set(ok);
    EXPECT_NO_THROW(validate_train_config(t)) << ok;
  }
  for (const auto& [bad, key] : std::vector<std::pair<const char*, const char*>>{
           {"dist.shard=zero3", "dist.shard"},
           {"dist.timeout_s=0", "dist.timeout_s"},
           {"dist.timeout_s=-1", "dist.timeout_s"},
           {"dist.numa_bind=on", "dist.numa_bind"},
           {"dist.unshard_stream=side", "dist.unshard_stream"}}) {
    ConfigTree t(default_train_config());
    t.set(bad);
    try {
      validate_train_config(t);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(key), std::string::npos) << e.message();
    }
  }
}

TEST(DataParallel, FullShardingIsNotYetSupportedAcrossRanks) {
  EXPECT_NO_THROW(check_shard_supported(ShardMode::Replicate, 8));
  EXPECT_NO_THROW(check_shard_supported(ShardMode::Optimizer, 8));
  EXPECT_NO_THROW(check_shard_supported(ShardMode::Full, 1));  // nothing to shard: replicate
  try {
    check_shard_supported(ShardMode::Full, 2);
    ADD_FAILURE() << "full accepted at 2 ranks";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("dist.shard"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("not yet implemented"), std::string::npos) << e.message();
    EXPECT_NE(e.hint().find("optimizer"), std::string::npos) << e.hint();
  }
  EXPECT_THROW(parse_shard_mode("zero"), Error);
}

TEST(DataParallel, WithoutACommunicatorGradSyncDoesNothing) {
  GradSync s(nullptr);
  EXPECT_FALSE(s.active());
  double v[2] = {1.5, 2.0};
  s.sum_host(v);
  EXPECT_EQ(v[0], 1.5);
  EXPECT_EQ(v[1], 2.0);
}

// Unsets the launchers' variables (src/dist/launch.cpp reads these) for its lifetime and restores
// them after, so that a test of the single-process path runs as one even when the test binary was
// itself started by torchrun, mpirun or srun.
class NoLauncherEnv {
 public:
  NoLauncherEnv() {
    for (const char* k :
         {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
          "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
          "SLURM_NODEID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
          "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (const char* v = std::getenv(k)) saved_.emplace_back(k, v);
      ::unsetenv(k);
    }
  }
  ~NoLauncherEnv() {
    for (const auto& [k, v] : saved_) ::setenv(k.c_str(), v.c_str(), 1);
  }
  NoLauncherEnv(const NoLauncherEnv&) = delete;
  NoLauncherEnv& operator=(const NoLauncherEnv&) = delete;

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
};

// At world size 1 the shard modes are the same run (bitwise), and the keys are saved with it.
TEST(DataParallel, AtWorldSizeOneEveryShardModeIsTheSingleProcessRun) {
  const NoLauncherEnv single_process;
  ASSERT_EQ(dist::detect_launch(dist::process_env()).launcher, dist::Launcher::None);
  const fs::path dir = fs::temp_directory_path() / fmt::format("gdn_dp_w1_{}", ::getpid());
  fs::remove_all(dir);
  std::vector<std::vector<double>> losses;
  for (const char* mode : {"replicate", "optimizer", "full"}) {
    ConfigTree c(default_train_config());
    c.set(fmt::format("run.dir=\"{}\"", (dir / mode).string()));
    c.set("train.steps=3");
    c.set("train.micro_batch_tokens=128");
    c.set("train.device=\"cpu\"");
    c.set("eval.every=0");
    c.set("checkpoint.at_end=false");
    c.set(fmt::format("dist.shard=\"{}\"", mode));
    TrainOptions quiet;
    quiet.quiet = true;
    losses.push_back(run_training(c, quiet).losses);
    std::ifstream in(dir / mode / "config.json");
    const nlohmann::json saved = nlohmann::json::parse(in);
    EXPECT_EQ(saved["dist"]["shard"], mode);
    EXPECT_EQ(saved["dist"]["timeout_s"], 300);
  }
  ASSERT_EQ(losses[0].size(), 3u);
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gdn::train
