// libFuzzer target for configuration files (built by the debug preset with GDN_FUZZ=ON, and into
// a replay test by the cpu preset: tests/fuzz/replay_main.cpp):
//   mkdir -p /tmp/corpus && build/debug/tests/fuzz_config /tmp/corpus tests/data/fuzz/fuzz_config
// The input is read three ways: as a training configuration in JSON and in the TOML-like form
// (merged into the defaults, then validated whole), and as a Hugging Face config.json. Any input
// must either load or throw gdn::Error; any other exception, a crash or a sanitizer report is a
// bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "gdn/core/error.h"
#include "model/config.h"
#include "train/config_tree.h"
#include "train/run_config.h"
#include "train/trainer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  static const nlohmann::json defaults = gdn::train::default_train_config();
  for (bool json : {true, false}) {
    try {
      gdn::train::ConfigTree cfg(defaults);
      cfg.merge_text(text, json, "fuzz");
      gdn::train::validate_train_config(cfg);
      (void)gdn::train::config_changes(defaults, cfg.json());
    } catch (const gdn::Error&) {
    }
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_discarded()) {
      const gdn::model::Qwen35Config c = gdn::model::parse_config(j, "fuzz");
      (void)gdn::model::to_json(c).dump();
    }
  } catch (const gdn::Error&) {
  }
  return 0;
}
