// Trainer utilities: LR schedules, crash-safe checkpoint directories (including kill -9 during a
// write), the configuration tree (file + --set, typos), metrics truncation on resume.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "gdn/core/safetensors.h"
#include "train/checkpoint_dir.h"
#include "train/config_tree.h"
#include "train/metrics.h"
#include "train/schedule.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& tag) {
  fs::path d = fs::temp_directory_path() / fmt::format("gdn_tu_{}_{}", ::getpid(), tag);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(Schedule, WarmupThenEachDecay) {
  Schedule s{1.0, 0.1, 10, 110, DecayKind::Cosine, 0.2};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // half-way through the cosine
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(500), 0.1, 1e-12);  // clamps after the end
  s.decay = DecayKind::Linear;
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);
  EXPECT_NEAR(s.at(35), 1.0 - 0.9 * 0.25, 1e-12);
  s.decay = DecayKind::Wsd;
  EXPECT_DOUBLE_EQ(s.at(80), 1.0);                 // stable phase (t = 0.7 < 0.8)
  EXPECT_NEAR(s.at(100), 0.1 + 0.9 * 0.5, 1e-12);  // half-way through the decay phase
  s.decay = DecayKind::Constant;
  EXPECT_DOUBLE_EQ(s.at(100), 1.0);
  EXPECT_THROW(decay_kind_from_name("cosine2"), Error);
}

void write_payload(const std::string& dir, int64_t step, int64_t n) {
  OwnedTensor t = OwnedTensor::empty(DType::I64, {n});
  for (int64_t i = 0; i < n; ++i) t.ptr<int64_t>()[i] = step * 1000003 + i;
  write_safetensors(dir + "/state.safetensors", {{"x", t, {}, {}, nullptr, 0}});
}

bool payload_ok(const std::string& dir, int64_t step) {
  SafeTensorsFile f(dir + "/state.safetensors");
  Tensor v = f.view("x");
  for (int64_t i = 0; i < v.numel(); ++i)
    if (v.ptr<int64_t>()[i] != step * 1000003 + i) return false;
  return true;
}

TEST(CheckpointDir, KeepsTheLastKAndIgnoresIncompleteOnes) {
  fs::path root = temp_dir("keep");
  CheckpointDir cd(root.string(), 2);
  for (int64_t step : {10, 20, 30}) {
    std::string tmp = cd.begin(step);
    write_payload(tmp, step, 100);
    cd.commit(step, fmt::format("step {}", step));
  }
  auto all = cd.list();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 20);
  EXPECT_EQ(all[1].first, 30);
  // An interrupted write (no marker) is never returned, and is cleaned up.
  std::string tmp = cd.begin(40);
  write_payload(tmp, 40, 100);
  fs::create_directories(root / "step-50");  // a directory without COMPLETE
  EXPECT_EQ(*cd.latest(), (root / "step-30").string());
  cd.clean_temporaries();
  EXPECT_FALSE(fs::exists(tmp));
  // Saving the same step again replaces it completely.
  std::string again = cd.begin(30);
  write_payload(again, 31, 10);
  cd.commit(30, "again");
  EXPECT_TRUE(payload_ok(*cd.latest(), 31));
  fs::remove_all(root);
}

TEST(CheckpointDir, KillDashNineDuringWritesNeverLosesTheLastCompleteCheckpoint) {
  fs::path root = temp_dir("kill");
  for (int trial = 0; trial < 6; ++trial) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      CheckpointDir cd(root.string(), 2);
      for (int64_t step = 1;; ++step) {
        std::string tmp = cd.begin(step);
        write_payload(tmp, step, 200000);  // 1.6 MB per checkpoint
        cd.commit(step, "ok");
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(40 + 37 * trial));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    CheckpointDir cd(root.string(), 2);
    cd.clean_temporaries();
    auto latest = cd.latest();
    if (!latest) continue;  // killed before the first commit
    auto all = cd.list();
    for (const auto& [step, dir] : all) EXPECT_TRUE(payload_ok(dir, step)) << dir;
  }
  fs::remove_all(root);
}

TEST(ConfigTree, FileThenSetWithTypeChecksAndTypoSuggestions) {
  nlohmann::json d = {{"optim", {{"lr", 3e-4}, {"steps", 100}, {"decay", "cosine"}}},
                      {"seed", 1},
                      {"log", {{"every", 10}, {"plot", true}}}};
  fs::path dir = temp_dir("cfg");
  {
    std::ofstream f(dir / "a.json");
    f << R"({"optim": {"lr": 1e-3}, "seed": 7})";
  }
  {
    std::ofstream f(dir / "b.toml");
    f << "# comment\nseed = 9\n[optim]\nsteps = 50 # trailing\ndecay = 'wsd'\n[log]\nplot = "
         "false\n";
  }
  ConfigTree t(d);
  t.merge_file((dir / "a.json").string());
  EXPECT_DOUBLE_EQ(t.get_double("optim.lr"), 1e-3);
  EXPECT_EQ(t.get_int("seed"), 7);
  t.merge_file((dir / "b.toml").string());
  EXPECT_EQ(t.get_int("seed"), 9);
  EXPECT_EQ(t.get_int("optim.steps"), 50);
  EXPECT_EQ(t.get_string("optim.decay"), "wsd");
  EXPECT_FALSE(t.get_bool("log.plot"));
  t.set("optim.lr=2e-3");
  t.set("optim.steps=200");
  EXPECT_DOUBLE_EQ(t.get_double("optim.lr"), 2e-3);
  EXPECT_EQ(t.get_int("optim.steps"), 200);
  try {
    t.set("optim.lrr=1");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown configuration key 'optim.lrr'"),
              std::string::npos);
    EXPECT_NE(e.hint().find("did you mean 'optim.lr'"), std::string::npos) << e.hint();
  }
  EXPECT_THROW(t.set("optim.steps=1.5"), Error);   // integer expected
  EXPECT_THROW(t.set("log.plot=\"yes\""), Error);  // bool expected
  EXPECT_THROW(t.set("optim=1"), Error);           // a section
  EXPECT_THROW(t.set("noequals"), Error);
  EXPECT_THROW(t.merge_file((dir / "missing.json").string()), Error);
  fs::remove_all(dir);
}

TEST(Metrics, TruncationOnResumeDropsLaterStepsAndTornLines) {
  fs::path dir = temp_dir("metrics");
  std::string path = (dir / "metrics.jsonl").string();
  {
    MetricsWriter w(path);
    for (int s = 1; s <= 5; ++s) w.write({{"step", s}, {"loss", 1.0 / s}});
  }
  {
    std::ofstream f(path, std::ios::app);
    f << "{\"step\": 6, \"lo";  // torn by a crash
  }
  truncate_metrics(path, 3);
  std::ifstream in(path);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_LE(j["step"].get<int>(), 3);
    ++n;
  }
  EXPECT_EQ(n, 3);
  EXPECT_EQ(format_duration(12.34), "12.3s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(3720), "1h02m");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace gdn::train
