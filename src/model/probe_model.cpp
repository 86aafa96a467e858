#include "model/probe_model.h"

#include <filesystem>

#include "gdn/core/error.h"
#include "model/weights.h"
#include "train/packing.h"

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
  const std::vector<int64_t> lengths = {1, 511, 512};
  int64_t T = 0;
  for (int64_t l : lengths) T += l;
  const train::PackPlan plan =
      train::plan_packing(lengths, train::identity_order(static_cast<int64_t>(lengths.size())), T);
  GDN_CHECK(plan.num_batches() == 1, "probe_model: packing produced {} micro-batches",
            plan.num_batches());
  const MicroBatch mb =
      train::build_micro_batch(plan, 0, [&](int64_t doc, int64_t b, int64_t e, int32_t* out) {
        for (int64_t t = b; t < e; ++t)  // any ids in the vocabulary
          out[t - b] = static_cast<int32_t>((doc * 7919 + t * 104729) % cfg.vocab_size);
      });
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
