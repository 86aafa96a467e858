#include "train/checkpointing.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/log.h"
#include "gdn/core/safetensors.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace gdn::train {

namespace fs = std::filesystem;

namespace {

void write_checkpoint_files(const std::string& dir, const model::Qwen35Config& cfg,
                            const OptimizerState& state,
                            const std::vector<model::RawTensor>& untouched,
                            const nlohmann::json& trainer_state,
                            const nlohmann::json& train_config) {
  model::SaveOptions so;
  so.dtype = DType::F32;  // fp32 master weights: exact resume, and transformers loads F32
  so.prefix = model::prefix_for(cfg);
  so.f32_suffixes.clear();
  model::save_hf_checkpoint(dir, cfg, state.master, so, untouched);
  std::vector<NamedTensor> moments;
  for (size_t i = 0; i < state.master.size(); ++i) {
    moments.push_back({"m." + state.master.spec(i).name, state.m.tensor(i), {}, {}, nullptr, 0});
    moments.push_back({"v." + state.master.spec(i).name, state.v.tensor(i), {}, {}, nullptr, 0});
  }
  write_safetensors(dir + "/optimizer.safetensors", moments);
  write_file_atomic(dir + "/trainer.json", trainer_state.dump(2) + "\n");
  // The training configuration the checkpoint was made with: resume compares it with its own.
  write_file_atomic(dir + "/" + kTrainConfigFile, train_config.dump(2) + "\n");
}

void load_moments(const std::string& path, OptimizerState& state) {
  SafeTensorsFile f(path);
  for (size_t i = 0; i < state.m.size(); ++i) {
    const std::string& n = state.m.spec(i).name;
    for (auto [prefix, store] : {std::pair{"m.", &state.m}, std::pair{"v.", &state.v}}) {
      std::string name = prefix + n;
      GDN_CHECK(f.contains(name), "{}: optimizer state has no tensor '{}'", path, name);
      Tensor dst = store->tensor(i);
      OwnedTensor src = f.load(name, DType::F32);
      GDN_CHECK(src.view().shape_vec() == dst.shape_vec(), "{}: '{}' has shape [{}], expected [{}]",
                path, name, fmt::join(src.view().shape_vec(), ", "),
                fmt::join(dst.shape_vec(), ", "));
      model::check_finite(src.view(), name, path);
      copy_into(dst, src);
    }
  }
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  GDN_CHECK(in.good(), "cannot read '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  GDN_CHECK(!in.bad(), "reading '{}' failed", path);
  return ss.str();
}

// --resume: the training configuration the checkpoint was written with (its own copy, else the
// run directory's config.json, which this start has not rewritten yet) against this one. Returns
// the saved train.grad_accum (this run's when nothing was saved). A changed train.grad_accum is
// not a change of the run when the world size changed with it so that the step's micro-batches
// (grad_accum x ranks) stay the same: they are then the same batches in the same order
// (data_source.h numbers them over the whole step), and the ranks' sum is the same sum.
int64_t check_resume_against(const std::string& ckpt, const std::string& run_dir,
                             const ConfigTree& cfg, int64_t saved_world, int64_t world) {
  const int64_t accum = cfg.get_int("train.grad_accum");
  std::string saved_path = ckpt + "/" + kTrainConfigFile;
  if (!fs::exists(saved_path)) saved_path = run_dir + "/config.json";
  if (!fs::exists(saved_path)) {
    log::warn("--resume: {} has no saved training configuration to compare with", ckpt);
    return accum;
  }
  const nlohmann::json text = nlohmann::json::parse(read_text_file(saved_path), nullptr, false);
  GDN_CHECK(!text.is_discarded() && text.is_object(), "{} is not a JSON object", saved_path);
  // Keys added since that run was written count with their defaults (which it ran with).
  nlohmann::json saved = default_train_config();
  saved.merge_patch(text);
  const nlohmann::json& sa = saved["train"]["grad_accum"];
  GDN_CHECK(sa.is_number_integer() && sa.get<int64_t>() >= 1,
            "{}: train.grad_accum must be a positive integer, got {}", saved_path, sa.dump());
  const int64_t saved_accum = sa.get<int64_t>();
  if (saved_world != world && saved_accum != accum && saved_world * saved_accum == world * accum) {
    log::info(
        "--resume: {} rank(s) x train.grad_accum {} now, {} x {} in {}: the same {} micro-batches "
        "a step, in the same order",
        world, accum, saved_world, saved_accum, ckpt, world * accum);
    saved["train"]["grad_accum"] = accum;
  }
  const bool allow = cfg.get_bool("resume.allow_changes");
  for (const ConfigChange& ch : check_resume_config(saved, cfg.json(), allow, saved_path)) {
    if (ch.key.starts_with("resume.")) continue;
    if (resume_blocks_change(ch.key))
      log::warn("--resume with resume.allow_changes: {} changed from {} to {}", ch.key, ch.saved,
                ch.now);
    else
      log::info("--resume: {} changed from {} to {}", ch.key, ch.saved, ch.now);
  }
  return saved_accum;
}

// --resume: the checkpoint's tensors must be the configured model's, name for name and shape for
// shape (a changed model shape is named here, not as a bare element count).
void check_same_tensors(const std::string& ckpt, const std::vector<model::ParamSpec>& saved,
                        const std::vector<model::ParamSpec>& want) {
  auto shape = [](const std::vector<int64_t>& s) {
    return fmt::format("[{}]", fmt::join(s, ", "));
  };
  const std::string hint =
      "resume with the model configuration the checkpoint was written with (its config.json), "
      "or start a new run in another --run-dir";
  for (size_t i = 0; i < std::min(saved.size(), want.size()); ++i) {
    GDN_CHECK_HINT(saved[i].name == want[i].name, hint,
                   "--resume: checkpoint {} holds tensor '{}' where the configured model has '{}'",
                   ckpt, saved[i].name, want[i].name);
    GDN_CHECK_HINT(saved[i].shape == want[i].shape, hint,
                   "--resume: tensor '{}' has shape {} in checkpoint {} but shape {} in the "
                   "configured model",
                   want[i].name, shape(saved[i].shape), ckpt, shape(want[i].shape));
  }
  GDN_CHECK_HINT(saved.size() == want.size(), hint,
                 "--resume: checkpoint {} holds {} parameter tensors, the configured model {}",
                 ckpt, saved.size(), want.size());
}

}  // namespace

nlohmann::json trainer_state_json(const TrainerState& st, const std::string& data_kind,
                                  uint64_t data_seed) {
  return nlohmann::json{
      {"step", st.step},
      {"skipped_steps", st.skipped_steps},
      {"tokens_seen", st.tokens_seen},
      {"world_size", st.world_size},
      {"data", {{"kind", data_kind}, {"seed", data_seed}, {"next_step", st.step}}}};
}

void save_checkpoint(CheckpointDir& cd, int64_t step, const model::Qwen35Config& cfg,
                     const OptimizerState& state, const std::vector<model::RawTensor>& untouched,
                     const nlohmann::json& trainer_state, const nlohmann::json& train_config) {
  std::string dir = cd.begin(step);
  try {
    write_checkpoint_files(dir, cfg, state, untouched, trainer_state, train_config);
  } catch (const Error& e) {
    // A full disk (or any failed write, fsync or rename) stops the run with an error; the
    // partial temporary directory is removed so that it does not hold the space, and the
    // previous complete checkpoints are untouched (they were never opened for writing).
    cd.abandon(step);
    const auto latest = cd.latest();
    GDN_FAIL_HINT(
        "free space on the file system holding the run directory, then continue with --resume",
        "writing checkpoint step {} failed: {}; {}", step, e.what(),
        latest ? fmt::format("the last complete checkpoint is {}", *latest)
               : std::string("there is no complete checkpoint yet"));
  }
  cd.commit(step, fmt::format("step {}", step));
}

TrainerState open_run(CheckpointDir& cd, const std::string& run_dir, const ConfigTree& cfg,
                      bool resume, const std::vector<model::ParamSpec>& specs,
                      OptimizerState& state, std::vector<model::RawTensor>& untouched,
                      int64_t world, bool writes) {
  if (!resume) {
    if (!writes) return TrainerState{};
    // Never mix two runs in one directory (nor delete what an earlier run left there).
    GDN_CHECK_HINT(cd.list().empty(), "pass --resume to continue it, or choose another --run-dir",
                   "run directory '{}' already holds checkpoints of an earlier run", run_dir);
    std::error_code ec;
    fs::remove(run_dir + "/metrics.jsonl", ec);
    return TrainerState{};
  }
  auto latest = cd.latest();
  GDN_CHECK_HINT(latest.has_value(), "run without --resume to start a new run",
                 "--resume: no complete checkpoint in {}/checkpoints", run_dir);
  const TrainerState st =
      parse_trainer_state(read_text_file(*latest + "/trainer.json"), *latest + "/trainer.json");
  const int64_t saved_accum = check_resume_against(*latest, run_dir, cfg, st.world_size, world);
  state.ensure(specs);
  model::HfCheckpoint ck = model::load_hf_checkpoint(*latest);
  check_same_tensors(*latest, ck.params.specs(), state.master.specs());
  for (size_t i = 0; i < state.master.size(); ++i)
    copy_into(state.master.tensor(i), ck.params.tensor(i));
  untouched = std::move(ck.extras.untouched);  // carried by every checkpoint of the run
  load_moments(*latest + "/optimizer.safetensors", state);
  // Another world size resumes when train.grad_accum changed with it (check_resume_against).
  const int64_t micro = st.world_size * saved_accum;
  if (st.world_size != world && micro != world * cfg.get_int("train.grad_accum")) {
    GDN_CHECK_HINT(
        cfg.get_bool("resume.allow_changes"),
        micro % world == 0
            ? fmt::format(
                  "start it with {} rank(s), or with {} rank(s) and --set "
                  "train.grad_accum={} (the same {} micro-batches a step), or pass --set "
                  "resume.allow_changes=true to continue with a global batch of another size",
                  st.world_size, world, micro / world, micro)
            : fmt::format("start it with a number of ranks that divides {} and train.grad_accum = "
                          "{} / ranks, or pass --set resume.allow_changes=true to continue with a "
                          "global batch of another size",
                          micro, micro),
        "--resume: {} was written by a run of {} rank(s), this one has {}: the step's batch "
        "(train.grad_accum x ranks) would change from {} to {} micro-batches",
        *latest, st.world_size, world, micro, world * cfg.get_int("train.grad_accum"));
    log::warn("--resume: {} was written by {} rank(s), continuing with {} (resume.allow_changes)",
              *latest, st.world_size, world);
  }
  if (writes) truncate_metrics(run_dir + "/metrics.jsonl", st.step);
  log::info("resuming from {} (step {})", *latest, st.step);
  return st;
}

}  // namespace gdn::train
