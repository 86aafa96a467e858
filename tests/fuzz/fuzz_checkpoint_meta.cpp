// libFuzzer target for a checkpoint's metadata (debug preset; replayed by the cpu preset, see
// tests/fuzz/replay_main.cpp):
//   mkdir -p /tmp/corpus && build/debug/tests/fuzz_checkpoint_meta /tmp/corpus
//   tests/data/fuzz/fuzz_checkpoint_meta
// The input is read as trainer.json (step, skipped steps, tokens seen) and as the saved training
// configuration a resume compares with its own (train_config.json). Any input must either load or
// throw gdn::Error; any other exception, a crash or a sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "gdn/core/error.h"
#include "train/run_config.h"
#include "train/trainer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  static const nlohmann::json defaults = gdn::train::default_train_config();
  try {
    (void)gdn::train::parse_trainer_state(text, "trainer.json");
  } catch (const gdn::Error&) {
  }
  const nlohmann::json saved = nlohmann::json::parse(text, nullptr, false);
  if (saved.is_discarded()) return 0;
  for (bool allow : {false, true}) {
    try {
      (void)gdn::train::check_resume_config(saved, defaults, allow, "train_config.json");
    } catch (const gdn::Error&) {
    }
  }
  return 0;
}
