#include "model/probe_model.h"

#include <filesystem>

#include "gdn/core/error.h"
#include "model/micro_batch.h"
#include "model/weights.h"

namespace gdn::model {

Qwen35Config load_model_config(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p = fs::is_directory(path) ? fs::path(path) / "config.json" : fs::path(path);
  GDN_CHECK_HINT(fs::is_regular_file(p),
                 "pass a checkpoint or config directory with config.json, or a config.json file",
                 "probe --model: no config at '{}'", p.string());
  return load_config(p.string());
}

std::vector<Registry::Decision> probe_model(const Qwen35Config& cfg, Backend backend,
                                            Recompute recompute) {
  // Three documents, a 1-token one among them; any ids in the vocabulary.
  std::vector<std::vector<int32_t>> docs;
  for (int64_t len : {1, 511, 512}) {
    const int64_t doc = static_cast<int64_t>(docs.size());
    std::vector<int32_t>& d = docs.emplace_back();
    for (int64_t t = 0; t < len; ++t)
      d.push_back(static_cast<int32_t>((doc * 7919 + t * 104729) % cfg.vocab_size));
  }
  const MicroBatch mb = micro_batch_of_documents(docs);
  const int64_t T = mb.num_tokens();
  const size_t before = Registry::global().decisions().size();
  Qwen35Model m(cfg, backend, T, mb.num_segments(), {.recompute = recompute});
  {
    ParamStore store(m.specs());
    init_params(store, cfg, 1);
    m.load_params(store);
  }
  StepOptions opt;
  opt.backward = true;
  m.step(mb, opt);
  std::vector<Registry::Decision> all = Registry::global().decisions();
  all.erase(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(before));
  return all;
}

}  // namespace gdn::model
