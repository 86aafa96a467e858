// A run started from a checkpoint of the official Qwen3.5 layout (model.language_model.*, with a
// vision tower gdntrain does not train: issue 22) saves checkpoints that carry those untouched
// tensors (model.visual.*, mtp.*) byte for byte, and so does a run resumed from such a checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "model/weights.h"
#include "train/checkpoint_dir.h"
#include "train/trainer.h"

namespace gdn::train {
namespace {

namespace fs = std::filesystem;

void expect_same_untouched(const std::vector<model::RawTensor>& got,
                           const std::vector<model::RawTensor>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(what + ": " + want[i].name);
    EXPECT_EQ(got[i].name, want[i].name);
    EXPECT_EQ(got[i].dtype, want[i].dtype);
    EXPECT_EQ(got[i].shape, want[i].shape);
    EXPECT_TRUE(got[i].bytes == want[i].bytes) << "bytes differ";
  }
}

TEST(UntouchedTensors, CheckpointsOfARunFromAnOfficialLayoutKeepThem) {
  const std::string src = std::string(GDN_TEST_DATA_DIR) + "/golden/nested_vl";
  const model::HfCheckpoint source = model::load_hf_checkpoint(src);
  ASSERT_FALSE(source.extras.untouched.empty()) << "the fixture has no vision tower";
  const fs::path run = fs::temp_directory_path() / fmt::format("gdn_untouched_{}", ::getpid());
  fs::remove_all(run);
  auto config = [&](int steps) {
    ConfigTree c(default_train_config());
    c.set(fmt::format("run.dir=\"{}\"", run.string()));
    c.set(fmt::format("model.init_from=\"{}\"", src));
    c.set(fmt::format("train.steps={}", steps));
    c.set("train.micro_batch_tokens=128");
    c.set("data.mqar.seq_len=32");
    c.set("data.mqar.vocab_size=32");
    c.set("eval.every=0");
    c.set("checkpoint.every=1");
    return c;
  };
  TrainOptions o;
  o.quiet = true;
  run_training(config(2), o);
  const auto latest = [&] {
    const auto l = CheckpointDir((run / "checkpoints").string(), 3).latest();
    EXPECT_TRUE(l.has_value());
    return l.value_or("");
  };
  const model::HfCheckpoint saved = model::load_hf_checkpoint(latest());
  EXPECT_EQ(saved.extras.prefix, source.extras.prefix);
  expect_same_untouched(saved.extras.untouched, source.extras.untouched, "after 2 steps");
  // Resumed: the checkpoint it loads carries them, and so does the one it writes.
  o.resume = true;
  run_training(config(3), o);
  const model::HfCheckpoint resumed = model::load_hf_checkpoint(latest());
  expect_same_untouched(resumed.extras.untouched, source.extras.untouched, "after resume");
  fs::remove_all(run);
}

}  // namespace
}  // namespace gdn::train
