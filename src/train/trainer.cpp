#include "train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>

#include "gdn/core/env.h"
#include "gdn/core/log.h"
#include "gdn/core/safetensors.h"
#include "gdn/core/split_f32.h"
#include "model/qwen35.h"
#include "model/weights.h"
#include "ops/adamw/op.h"
#include "train/checkpoint_dir.h"
#include "train/data_source.h"
#include "train/flops.h"
#include "train/metrics.h"
#include "train/mqar.h"
#include "train/packing.h"
#include "train/run_config.h"
#include "train/schedule.h"

namespace gdn::train {

namespace fs = std::filesystem;

nlohmann::json default_train_config() {
  return nlohmann::json::parse(R"({
    "model": {"config": "tiny", "init_from": "", "seed": 1234},
    "data": {"kind": "mqar", "path": "", "seed": 7, "eval_fraction": 0.01,
             "mqar": {"vocab_size": 64, "num_pairs": 4, "seq_len": 32}},
    "train": {"steps": 600, "micro_batch_tokens": 2048, "grad_accum": 1, "z_loss": 0.0001,
              "device": "auto", "recompute": "none", "fail_on_nonfinite": false},
    "optim": {"lr": 0.003, "min_lr": 0.0003, "warmup_steps": 40, "decay": "cosine",
              "wsd_decay_fraction": 0.2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
              "weight_decay": 0.1, "clip": 1.0, "split_master": true},
    "kernels": {"fused_conv": true, "fused_qk_l2norm": true, "fused_swiglu": true,
                "fused_zc_norm": true, "fused_lm_head": true},
    "memory": {"grads_in_activations": true, "gdr_saved_min_doc_tokens": 128,
               "lce_chunk_bytes": 268435456},
    "eval": {"every": 100, "batches": 4},
    "log": {"every": 10},
    "checkpoint": {"every": 200, "keep": 2, "at_end": true},
    "run": {"dir": "runs/default"},
    "resume": {"allow_changes": false}
  })");
}

namespace {

// Weight decay applies to matrices only: not to norms, A_log, dt_bias or embeddings.
bool decays(const std::string& name) {
  return !(name.ends_with("norm.weight") || name.ends_with("layernorm.weight") ||
           name.ends_with("A_log") || name.ends_with("dt_bias") ||
           name.find("embed_tokens") != std::string::npos);
}

std::string first_nonfinite(const model::Qwen35Model& m) {
  for (size_t i = 0; i < m.specs().size(); ++i) {
    auto g = to_f64_vector(m.grad(i));
    for (size_t j = 0; j < g.size(); ++j)
      if (!std::isfinite(g[j]))
        return fmt::format("gradient of {} (element {} = {})", m.specs()[i].name, j, g[j]);
  }
  return "the loss (every gradient is finite)";
}

struct Evaluation {
  double loss = 0, accuracy = -1;
};

Evaluation evaluate(model::Qwen35Model& m, DataSource& data, int64_t batches) {
  Evaluation e;
  auto evals = data.eval_batches(batches);
  if (evals.empty()) return e;
  const int64_t V = m.config().vocab_size;
  double loss_sum = 0;
  int64_t targets = 0;
  MqarAccuracy acc;
  for (const MicroBatch& mb : evals) {
    model::StepOptions o;
    o.backward = false;
    OwnedTensor logits;
    OwnedTensor dev_logits;
    if (data.is_mqar()) {
      dev_logits = OwnedTensor::zeros(backend_dtype(m.backend()), {mb.num_tokens(), V},
                                      backend_device(m.backend()));
      o.logits = dev_logits;
    }
    model::StepStats s = m.step(mb, o);
    loss_sum += s.loss * static_cast<double>(s.targets);
    targets += s.targets;
    if (data.is_mqar()) {
      logits = convert(dev_logits, DType::F32);
      MqarAccuracy a = mqar_accuracy(
          std::span<const float>(logits.ptr<float>(), static_cast<size_t>(logits.numel())),
          mb.labels, V);
      acc.correct += a.correct;
      acc.total += a.total;
    }
  }
  e.loss = targets > 0 ? loss_sum / static_cast<double>(targets) : 0.0;
  if (data.is_mqar()) e.accuracy = acc.value();
  return e;
}

// Adam moments in the same layout as the parameters.
struct Optimizer {
  model::ParamStore m, v;
};

// fp32 master weights and Adam moments on the device, in one arena, laid out like the host stores.
// A parameter whose compute copy is bf16 keeps its master split (ops/adamw/op.h, split masters;
// optim.split_master, default on): the model's bf16 compute copy is the high half and `master`
// holds the I16 low half, so master and copy cost 4 bytes a parameter instead of 6 (7.8 GiB less at
// 4B).
struct DeviceOptimizer {
  Arena arena;
  std::vector<Tensor> master, m, v;  // master: F32, or I16 (split: the low half)
  std::vector<Tensor> hi;            // split masters: the compute copy (high half); else undefined
  DeviceOptimizer() = default;
  // Allocates master, m and v for `specs`; m and v start at zero (a fresh run). split_hi[i], when
  // defined, is parameter i's bf16 compute copy and makes its master a split one.
  DeviceOptimizer(const std::vector<model::ParamSpec>& specs, std::vector<Tensor> split_hi)
      : hi(std::move(split_hi)) {
    auto padded = [](int64_t numel, int64_t bytes) {
      return (static_cast<size_t>(numel) * static_cast<size_t>(bytes) + 255) / 256 * 256;
    };
    size_t bytes = 0;
    for (size_t i = 0; i < specs.size(); ++i)
      bytes += padded(specs[i].numel(), split(i) ? 2 : 4) + 2 * padded(specs[i].numel(), 4);
    arena = Arena("optimizer", Device::CUDA, bytes);
    for (size_t i = 0; i < specs.size(); ++i) {
      master.push_back(arena.alloc_tensor(split(i) ? DType::I16 : DType::F32, specs[i].shape));
      m.push_back(arena.alloc_tensor(DType::F32, specs[i].shape));
      v.push_back(arena.alloc_tensor(DType::F32, specs[i].shape));
      zero_bytes(m.back().data(), Device::CUDA, static_cast<size_t>(m.back().nbytes()));
      zero_bytes(v.back().data(), Device::CUDA, static_cast<size_t>(v.back().nbytes()));
    }
  }
  bool split(size_t i) const { return i < hi.size() && hi[i].defined(); }
  size_t num_split() const {
    size_t n = 0;
    for (size_t i = 0; i < hi.size(); ++i) n += split(i) ? 1 : 0;
    return n;
  }
  // Host stores to the device: the master weights (split ones into both halves), and the moments
  // when `moments` is given.
  void upload(const model::ParamStore& host_master, const Optimizer* moments) {
    for (size_t i = 0; i < master.size(); ++i) {
      if (split(i)) {
        const Tensor src = host_master.tensor(i);
        OwnedTensor h = OwnedTensor::empty(DType::BF16, src.shape_vec()),
                    l = OwnedTensor::empty(DType::I16, src.shape_vec());
        const float* x = src.ptr<float>();  // [n]
        uint16_t* hp = static_cast<uint16_t*>(h.view().data());
        int16_t* lp = l.view().ptr<int16_t>();
        const int64_t n = src.numel();
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 18))
        for (int64_t j = 0; j < n; ++j) {
          const uint32_t b = f32_bits(x[j]);
          hp[j] = split_hi(b);
          lp[j] = split_lo(b, hp[j]);
        }
        copy_into(hi[i], h.view());
        copy_into(master[i], l.view());
      } else {
        copy_into(master[i], host_master.tensor(i));
      }
      if (moments != nullptr) {
        copy_into(m[i], moments->m.tensor(i));
        copy_into(v[i], moments->v.tensor(i));
      }
    }
  }
  // Device to host stores (to write a checkpoint): split masters are joined on the host, exactly.
  void download(model::ParamStore& host_master, Optimizer& host_opt) const {
    for (size_t i = 0; i < master.size(); ++i) {
      if (split(i)) {
        const Tensor dst = host_master.tensor(i);
        OwnedTensor h = OwnedTensor::empty(DType::BF16, dst.shape_vec()),
                    l = OwnedTensor::empty(DType::I16, dst.shape_vec());
        copy_into(h.view(), hi[i]);
        copy_into(l.view(), master[i]);
        float* x = dst.ptr<float>();  // [n]
        const uint16_t* hp = static_cast<const uint16_t*>(h.view().data());
        const int16_t* lp = l.view().ptr<int16_t>();
        const int64_t n = dst.numel();
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 18))
        for (int64_t j = 0; j < n; ++j) x[j] = f32_from_bits(split_join(hp[j], lp[j]));
      } else {
        copy_into(host_master.tensor(i), master[i]);
      }
      copy_into(host_opt.m.tensor(i), m[i]);
      copy_into(host_opt.v.tensor(i), v[i]);
    }
  }
};

// --profile-step: RUN_DIR/profile_step<N>.json, the ranges of one step summed by name.
void write_profile(const std::string& run_dir, int64_t step, const std::vector<Profiler::Row>& rows,
                   double wall_ms, int64_t tokens) {
  nlohmann::json r = nlohmann::json::array();
  double sum = 0;
  for (const auto& row : rows) {
    r.push_back({{"name", row.name}, {"calls", row.calls}, {"ms", row.ms}});
    sum += row.ms;
  }
  nlohmann::json j = {{"step", step},
                      {"tokens", tokens},
                      {"step_wall_ms", wall_ms},
                      {"ranges_ms", sum},
                      {"ranges", r}};
  write_file_atomic(fmt::format("{}/profile_step{}.json", run_dir, step), j.dump(2) + "\n");
}

void write_checkpoint_files(const std::string& dir, const model::Qwen35Config& cfg,
                            const model::ParamStore& master,
                            const std::vector<model::RawTensor>& untouched, const Optimizer& opt,
                            const nlohmann::json& state, const nlohmann::json& train_config);

// `untouched`: the tensors of the checkpoint the run started from that it does not train (a
// Qwen3.5 release's model.visual.* and mtp.*), written back byte for byte so that every checkpoint
// of the run is a whole model.
void save_checkpoint(CheckpointDir& cd, int64_t step, const model::Qwen35Config& cfg,
                     const model::ParamStore& master,
                     const std::vector<model::RawTensor>& untouched, const Optimizer& opt,
                     const nlohmann::json& state, const nlohmann::json& train_config) {
  std::string dir = cd.begin(step);
  try {
    write_checkpoint_files(dir, cfg, master, untouched, opt, state, train_config);
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

void write_checkpoint_files(const std::string& dir, const model::Qwen35Config& cfg,
                            const model::ParamStore& master,
                            const std::vector<model::RawTensor>& untouched, const Optimizer& opt,
                            const nlohmann::json& state, const nlohmann::json& train_config) {
  model::SaveOptions so;
  so.dtype = DType::F32;  // fp32 master weights: exact resume, and transformers loads F32
  so.prefix = model::prefix_for(cfg);
  so.f32_suffixes.clear();
  model::save_hf_checkpoint(dir, cfg, master, so, untouched);
  std::vector<NamedTensor> moments;
  for (size_t i = 0; i < master.size(); ++i) {
    moments.push_back({"m." + master.spec(i).name, opt.m.tensor(i), {}, {}, nullptr, 0});
    moments.push_back({"v." + master.spec(i).name, opt.v.tensor(i), {}, {}, nullptr, 0});
  }
  write_safetensors(dir + "/optimizer.safetensors", moments);
  write_file_atomic(dir + "/trainer.json", state.dump(2) + "\n");
  // The training configuration the checkpoint was made with: resume compares it with its own.
  write_file_atomic(dir + "/" + kTrainConfigFile, train_config.dump(2) + "\n");
}

void load_moments(const std::string& path, Optimizer& opt) {
  SafeTensorsFile f(path);
  for (size_t i = 0; i < opt.m.size(); ++i) {
    const std::string& n = opt.m.spec(i).name;
    for (auto [prefix, store] : {std::pair{"m.", &opt.m}, std::pair{"v.", &opt.v}}) {
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
// run directory's config.json, which this start has not rewritten yet) against this one.
void check_resume_against(const std::string& ckpt, const std::string& run_dir,
                          const ConfigTree& cfg) {
  std::string saved_path = ckpt + "/" + kTrainConfigFile;
  if (!fs::exists(saved_path)) saved_path = run_dir + "/config.json";
  if (!fs::exists(saved_path)) {
    log::warn("--resume: {} has no saved training configuration to compare with", ckpt);
    return;
  }
  const nlohmann::json text = nlohmann::json::parse(read_text_file(saved_path), nullptr, false);
  GDN_CHECK(!text.is_discarded() && text.is_object(), "{} is not a JSON object", saved_path);
  // Keys added since that run was written count with their defaults (which it ran with).
  nlohmann::json saved = default_train_config();
  saved.merge_patch(text);
  const bool allow = cfg.get_bool("resume.allow_changes");
  for (const ConfigChange& ch : check_resume_config(saved, cfg.json(), allow, saved_path)) {
    if (ch.key.starts_with("resume.")) continue;
    if (resume_blocks_change(ch.key))
      log::warn("--resume with resume.allow_changes: {} changed from {} to {}", ch.key, ch.saved,
                ch.now);
    else
      log::info("--resume: {} changed from {} to {}", ch.key, ch.saved, ch.now);
  }
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

// Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime,
// 10 ms resolution), so "launch" includes everything before run_training: the dynamic loader, the
// CUDA runtime's start-up, the command line. -1 where /proc cannot tell.
double seconds_since_process_start() {
  std::ifstream st("/proc/self/stat"), up("/proc/uptime");
  std::string stat;
  double uptime = 0;
  if (!std::getline(st, stat) || !(up >> uptime)) return -1;
  // Field 22 (starttime, clock ticks after boot) follows the ')' closing the command name.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22; ++i)
    if (!(rest >> field)) return -1;
  const long ticks = sysconf(_SC_CLK_TCK);
  if (ticks <= 0) return -1;
  return uptime - std::stod(field) / static_cast<double>(ticks);
}

}  // namespace

TrainResult run_training(const ConfigTree& cfg, const TrainOptions& topt) {
  const auto t_launch = std::chrono::steady_clock::now();
  // Launch = process start when /proc tells it, else the start of run_training.
  const double before_run = std::max(0.0, seconds_since_process_start());
  // Every key is checked before any work; RUN_DIR/config.json is written (atomically) only once
  // the start has passed every check, so a rejected start leaves the directory as it was.
  validate_train_config(cfg);
  const std::string run_dir = cfg.get_string("run.dir");
  if (!topt.quiet) log::info("effective configuration:\n{}", cfg.json().dump(2));

  // Backend.
  std::string device = cfg.get_string("train.device");
  GDN_CHECK_HINT(device == "auto" || device == "cpu" || device == "cuda" || device == "ref",
                 "use auto, cpu, cuda or ref", "train.device '{}' is not a device", device);
  Backend backend = device == "ref" ? Backend::Ref : Backend::Cpu;
  if (device == "cuda" || (device == "auto" && cuda_available())) backend = Backend::Cuda;
  GDN_CHECK_HINT(backend != Backend::Cuda || cuda_available(),
                 "build the cuda preset and run on a machine with a GPU, or use --device cpu",
                 "train.device is cuda but no CUDA device is available");

  // Model config and initial weights.
  const std::string init_from = cfg.get_string("model.init_from");
  // On cuda a fresh run initialises the fp32 master weights on the device (the same Philox draws,
  // rng.h); the host stores (master, m, v) are then made only when a checkpoint is written.
  const bool on_device = backend == Backend::Cuda;
  const bool device_init = on_device && init_from.empty() && !topt.resume;
  const uint64_t init_seed = static_cast<uint64_t>(cfg.get_int("model.seed"));
  model::Qwen35Config mcfg;
  model::ParamStore master;  // host fp32 master weights (cpu: the live ones)
  std::vector<model::RawTensor> untouched;
  if (!init_from.empty()) {
    model::HfCheckpoint ck = model::load_hf_checkpoint(init_from);
    mcfg = ck.config;
    master = std::move(ck.params);
    untouched = std::move(ck.extras.untouched);
  } else {
    const std::string mc = cfg.get_string("model.config");
    mcfg = mc == "tiny" ? model::tiny_config() : model::load_config(mc);
    if (!device_init) {
      master = model::ParamStore(model::param_specs(mcfg));
      model::init_params(master, mcfg, init_seed);
    }
  }
  const std::vector<model::ParamSpec> specs =
      master.size() > 0 ? master.specs() : model::param_specs(mcfg);
  int64_t num_params = 0;
  for (const auto& s : specs) num_params += s.numel();
  // Start-up phases, logged once the model is built (the launch-to-first-step budget is issue 8's).
  auto since_launch = [&t_launch, before_run] {
    return before_run +
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t_launch).count();
  };
  const double t_params = since_launch();

  // Data.
  const int64_t steps = cfg.get_int("train.steps"), accum = cfg.get_int("train.grad_accum");
  const int64_t micro_tokens = cfg.get_int("train.micro_batch_tokens");
  GDN_CHECK(steps >= 1 && accum >= 1 && micro_tokens >= 1,
            "train.steps, train.grad_accum and train.micro_batch_tokens must be positive");
  std::unique_ptr<DataSource> data;
  const std::string kind = cfg.get_string("data.kind");
  const uint64_t data_seed = static_cast<uint64_t>(cfg.get_int("data.seed"));
  if (kind == "mqar") {
    MqarConfig mq{cfg.get_int("data.mqar.vocab_size"), cfg.get_int("data.mqar.num_pairs"),
                  cfg.get_int("data.mqar.seq_len")};
    GDN_CHECK(mq.vocab_size <= mcfg.vocab_size,
              "data.mqar.vocab_size {} exceeds the model vocabulary {}", mq.vocab_size,
              mcfg.vocab_size);
    data = make_mqar_source(mq, data_seed, micro_tokens, accum);
  } else if (kind == "indexed") {
    data = make_indexed_source(cfg.get_string("data.path"), data_seed, micro_tokens, accum,
                               cfg.get_double("data.eval_fraction"), mcfg.vocab_size);
  } else {
    GDN_FAIL_HINT("use mqar (built-in task) or indexed (a `gdntrain prepare` dataset)",
                  "data.kind '{}' is not a data source", kind);
  }

  // One micro-batch per step: its gradients can live in activation memory the backward has
  // consumed (qwen35.h, GradMemory); with several they must accumulate in an arena of their own.
  model::Qwen35Model m(mcfg, backend, data->max_tokens(), data->max_docs(),
                       model_options(cfg, accum));
  const double t_model = since_launch();
  Optimizer opt;  // host Adam moments (cpu: the live ones; cuda: staging for checkpoints)
  // The host stores, made on first use (a device run needs them only to write a checkpoint).
  auto ensure_host_stores = [&] {
    if (master.size() == 0) master = model::ParamStore(specs);
    if (opt.m.size() == 0) opt = Optimizer{model::ParamStore(specs), model::ParamStore(specs)};
  };
  if (!on_device) ensure_host_stores();

  Schedule sched;
  sched.lr = cfg.get_double("optim.lr");
  sched.min_lr = cfg.get_double("optim.min_lr");
  sched.warmup_steps = cfg.get_int("optim.warmup_steps");
  sched.total_steps = steps;
  sched.decay = decay_kind_from_name(cfg.get_string("optim.decay"));
  sched.wsd_decay_fraction = cfg.get_double("optim.wsd_decay_fraction");
  ops::AdamWHyper hyper;
  hyper.beta1 = cfg.get_double("optim.beta1");
  hyper.beta2 = cfg.get_double("optim.beta2");
  hyper.eps = cfg.get_double("optim.eps");
  hyper.weight_decay = cfg.get_double("optim.weight_decay");
  const double clip = cfg.get_double("optim.clip");
  const double z_loss = cfg.get_double("train.z_loss");
  const int64_t log_every = std::max<int64_t>(1, cfg.get_int("log.every"));
  const int64_t eval_every = cfg.get_int("eval.every"), eval_batches = cfg.get_int("eval.batches");
  const int64_t ckpt_every = cfg.get_int("checkpoint.every");
  const bool fail_on_nonfinite = cfg.get_bool("train.fail_on_nonfinite");

  CheckpointDir cd(run_dir + "/checkpoints", static_cast<int>(cfg.get_int("checkpoint.keep")));
  cd.clean_temporaries();
  int64_t start_step = 0, skipped = 0;
  double resumed_tokens = 0;  // tokens trained on before the resumed checkpoint
  if (topt.resume) {
    auto latest = cd.latest();
    GDN_CHECK_HINT(latest.has_value(), "run without --resume to start a new run",
                   "--resume: no complete checkpoint in {}/checkpoints", run_dir);
    check_resume_against(*latest, run_dir, cfg);
    ensure_host_stores();
    model::HfCheckpoint ck = model::load_hf_checkpoint(*latest);
    check_same_tensors(*latest, ck.params.specs(), master.specs());
    for (size_t i = 0; i < master.size(); ++i) copy_into(master.tensor(i), ck.params.tensor(i));
    untouched = std::move(ck.extras.untouched);  // carried by every checkpoint of the run
    load_moments(*latest + "/optimizer.safetensors", opt);
    const TrainerState st =
        parse_trainer_state(read_text_file(*latest + "/trainer.json"), *latest + "/trainer.json");
    start_step = st.step;
    skipped = st.skipped_steps;
    resumed_tokens = st.tokens_seen;
    truncate_metrics(run_dir + "/metrics.jsonl", start_step);
    log::info("resuming from {} (step {})", *latest, start_step);
  } else {
    // Never mix two runs in one directory (nor delete what an earlier run left there).
    GDN_CHECK_HINT(cd.list().empty(), "pass --resume to continue it, or choose another --run-dir",
                   "run directory '{}' already holds checkpoints of an earlier run", run_dir);
    std::error_code ec;
    fs::remove(run_dir + "/metrics.jsonl", ec);
  }
  write_file_atomic(run_dir + "/config.json", cfg.json().dump(2) + "\n");
  if (!topt.quiet) log::info("effective configuration saved to {}/config.json", run_dir);
  // The optimizer works where the gradients are. On cuda the fp32 master weights and moments live
  // in one device arena (the host stores are refreshed only to write checkpoints) and the step
  // writes the bf16 compute copy in the same pass; on cpu it updates the host stores directly.
  DeviceOptimizer dev;
  if (on_device) {
    const bool split_master = cfg.get_bool("optim.split_master");
    std::vector<Tensor> split_hi(specs.size());
    for (size_t i = 0; i < specs.size(); ++i)
      if (split_master && m.param(i).dtype() == DType::BF16) split_hi[i] = m.param(i);
    dev = DeviceOptimizer(specs, std::move(split_hi));
    // The compute copy from the device master weights: bf16 in one refresh pass, fp32 copied.
    // A fresh split master is drawn in fp32 into its gradient buffer and split from there (the
    // buffer is free: every step zeroes the gradients before its backward); an uploaded one
    // arrives split.
    std::vector<ops::Bf16Copy> copies;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (device_init)
        model::init_param(specs[i], dev.split(i) ? m.grad(i) : dev.master[i], mcfg, init_seed);
      if (dev.split(i)) {
        if (device_init) copies.push_back({m.grad(i), m.param(i), dev.master[i]});
      } else if (m.param(i).dtype() == DType::BF16) {
        copies.push_back({dev.master[i], m.param(i)});
      }
    }
    if (!device_init) dev.upload(master, topt.resume ? &opt : nullptr);
    for (size_t i = 0; i < specs.size(); ++i)
      if (m.param(i).dtype() != DType::BF16) copy_into(m.param(i), dev.master[i]);
    ops::adamw_refresh_bf16(copies);
  } else {
    m.load_params(master);
  }
  MetricsWriter metrics(run_dir + "/metrics.jsonl");

  if (!topt.quiet) {
    log::info("model: {} layers ({} GDN, {} attention), D={}, vocab {}, {} parameters",
              mcfg.num_hidden_layers, mcfg.num_linear_attention_layers(),
              mcfg.num_full_attention_layers(), mcfg.hidden_size, mcfg.vocab_size, num_params);
    log::info("data: {}", data->describe());
    log::info("{}", m.memory_plan());
    log::info("threads: {} (OpenMP)", omp_get_max_threads());
  }

  if (!topt.quiet)
    log::info(
        "start-up: parameters ready {:.2f} s after launch, model arenas planned {:.2f} s, "
        "weights and optimizer state in place {:.2f} s",
        t_params, t_model, since_launch());
  std::vector<ops::AdamWParam> params;
  std::vector<size_t> f32_compute;  // cuda: parameters whose compute copy is fp32 (A_log, dt_bias)
  for (size_t i = 0; i < specs.size(); ++i) {
    const bool bf16 = m.param(i).dtype() == DType::BF16;
    if (on_device && !bf16) f32_compute.push_back(i);
    params.push_back(
        {on_device ? dev.master[i] : master.tensor(i), m.grad(i),
         on_device ? dev.m[i] : opt.m.tensor(i), on_device ? dev.v[i] : opt.v.tensor(i),
         on_device && bf16 ? m.param(i) : Tensor(), decays(specs[i].name), specs[i].name});
  }
  if (!topt.quiet) {
    log::info("{}", flops_formula(mcfg));
    if (on_device)
      log::info(
          "optimizer state on the device: {} (fp32 master weights, {} of {} tensors split as the "
          "bf16 compute copy + an I16 low half; Adam m and v)",
          format_bytes(static_cast<double>(dev.arena.capacity())), dev.num_split(), specs.size());
  }

  TrainResult res;
  res.skipped_steps = skipped;
  double tokens_total = resumed_tokens;
  auto t0 = std::chrono::steady_clock::now();
  double window_tokens = 0, window_flops = 0;
  auto window_t0 = t0;
  auto trainer_state = [&](int64_t step) {
    return nlohmann::json{{"step", step},
                          {"skipped_steps", res.skipped_steps},
                          {"tokens_seen", tokens_total},
                          {"data", {{"kind", kind}, {"seed", data_seed}, {"next_step", step}}}};
  };
  GDN_CHECK(topt.profile_step <= 0 || topt.profile_step > start_step,
            "--profile-step {}: the run starts at step {} (resumed)", topt.profile_step,
            start_step + 1);
  GDN_CHECK(topt.profile_step <= steps, "--profile-step {} is past the last step {}",
            topt.profile_step, steps);
  const Device step_device = backend_device(backend);
  // On the device the step loop never drains the device's queue (issue 8): the losses, the
  // gradients' sum of squares and the clip-or-skip decision stay on the device (adamw's
  // clip_sumsq), and their host copies arrive through page-locked staging, read one step late
  // (while the device runs the next step's forward and backward); the next optimizer step is
  // issued only after that read, so its Adam step count knows every earlier skip. Steps that
  // evaluate, checkpoint, profile, stop or end are finalised at once. The CPU runs each op to
  // completion and keeps the direct path.
  const bool deferred = on_device;
  OwnedTensor ctl_loss, ctl_z, ctl_sumsq;  // device: [accum] F32, [accum] F32, [1] F64
  struct Staged {
    HostStaging host;  // sumsq (double), then accum losses and accum z-losses (float)
    StreamFence fence;
  };
  std::array<Staged, 2> staged;
  const size_t loss_bytes = static_cast<size_t>(accum) * sizeof(float);
  if (deferred) {
    ctl_loss = OwnedTensor::empty(DType::F32, {accum}, Device::CUDA);
    ctl_z = OwnedTensor::empty(DType::F32, {accum}, Device::CUDA);
    ctl_sumsq = OwnedTensor::empty(DType::F64, {1}, Device::CUDA);
    for (Staged& st : staged) {
      st.host = HostStaging(sizeof(double) + 2 * loss_bytes, Device::CUDA);
      st.fence = StreamFence(Device::CUDA);
    }
  }
  const ops::AdamWClip device_clip{ctl_sumsq, ctl_loss, clip};
  // What happens after a step (0-based `step`): an evaluation, a progress line (which ends a
  // tokens/s window), a stop (--stop-after), a checkpoint.
  auto evals_at = [&](int64_t step) {
    return eval_every > 0 && ((step + 1) % eval_every == 0 || step + 1 == steps);
  };
  auto logs_at = [&](int64_t step) {
    return (step + 1) % log_every == 0 || step + 1 == steps || evals_at(step);
  };
  auto stops_at = [&](int64_t step) {
    return topt.stop_after > 0 && step + 1 - start_step >= topt.stop_after;
  };
  const bool ckpt_at_end = cfg.get_bool("checkpoint.at_end");
  auto checkpoints_at = [&](int64_t step) {
    return (ckpt_every > 0 && (step + 1) % ckpt_every == 0) || (step + 1 == steps && ckpt_at_end) ||
           stops_at(step);
  };
  // Deferred: a tokens/s window is timed on the device, from the event that ended the previous
  // window to the one recorded behind its last step (the host only learns of a step's end some
  // time later, so its clock would stretch one window and shrink the next). A ring of four: a
  // window's two events are read at most one step after the later one is recorded.
  std::array<StreamFence, 4> win_ev;
  int64_t win_recorded = 0;  // windows whose end event has been recorded
  if (deferred) {
    for (StreamFence& e : win_ev) e = StreamFence(Device::CUDA);
    win_ev[0].record();
  }
  // A step whose optimizer has been issued and whose host side (skip accounting, metrics, logs,
  // evaluation, checkpoint) is still to be done.
  struct Pending {
    int64_t step = -1;
    double lr = 0, flops = 0;
    int64_t tokens = 0;
    size_t slot = 0;
    int64_t win = 0;  // deferred logging step: its window's end event (win_ev[win % 4])
    // Known at once on the CPU; read from the staging slot on the device.
    double loss = 0, zl = 0, gnorm = 0;
    std::string nonfinite;
  };
  std::optional<Pending> pending;
  bool stop = false;
  // Finishes step q.step; returns true when the run stops there.
  auto finalise = [&](Pending& q) -> bool {
    const int64_t step = q.step;
    if (deferred) {
      Staged& st = staged[q.slot];
      st.fence.wait();  // this step's copies only: later work stays queued on the device
      const char* h = static_cast<const char*>(st.host.data());
      double ss = 0;
      std::memcpy(&ss, h, sizeof(double));
      q.loss = q.zl = 0;
      for (int64_t k = 0; k < accum; ++k) {
        float l = 0, z = 0;
        std::memcpy(&l, h + sizeof(double) + static_cast<size_t>(k) * sizeof(float), sizeof(float));
        std::memcpy(&z, h + sizeof(double) + loss_bytes + static_cast<size_t>(k) * sizeof(float),
                    sizeof(float));
        q.loss += l;
        q.zl += z;
      }
      q.gnorm = std::sqrt(ss);
    }
    const double loss = q.loss, zl = q.zl, gnorm = q.gnorm, lr = q.lr;
    const bool finite = std::isfinite(loss) && std::isfinite(gnorm);
    if (!finite) {
      std::string nonfinite = q.nonfinite;
      if (nonfinite.empty())
        nonfinite = deferred ? fmt::format(
                                   "loss {}, gradient norm {} (the device skipped the "
                                   "update)",
                                   loss, gnorm)
                             : first_nonfinite(m);
      GDN_CHECK_HINT(!fail_on_nonfinite,
                     "set train.fail_on_nonfinite=false to skip such steps, or lower optim.lr",
                     "train.fail_on_nonfinite: step {} has a non-finite loss or gradient; first "
                     "non-finite: {}",
                     step + 1, nonfinite);
      ++res.skipped_steps;
      log::warn("step {}: non-finite loss or gradient ({}); step skipped ({} so far)", step + 1,
                nonfinite, res.skipped_steps);
    }
    const int64_t tokens = q.tokens;
    window_flops += q.flops;
    if (step == start_step && !topt.quiet) {
      log::info("first step finished {:.2f} s after launch", since_launch());
      if (on_device)
        log::info(
            "device memory in use after the first step: {} (planned arenas: model {}, "
            "optimizer {})",
            format_bytes(static_cast<double>(device_memory_used())),
            format_bytes(
                static_cast<double>(m.param_bytes() + m.grad_bytes() + m.activation_bytes())),
            format_bytes(static_cast<double>(dev.arena.capacity())));
    }
    tokens_total += static_cast<double>(tokens);
    window_tokens += static_cast<double>(tokens);
    auto now = std::chrono::steady_clock::now();
    const double elapsed = std::chrono::duration<double>(now - t0).count();
    res.losses.push_back(loss);
    res.final_loss = loss;
    res.steps_done = step + 1;
    nlohmann::json rec = {{"step", step + 1},
                          {"loss", loss},
                          {"z_loss", zl},
                          {"grad_norm", gnorm},
                          {"lr", lr},
                          {"tokens", tokens},
                          {"tokens_seen", tokens_total},
                          {"skipped", !finite},
                          {"elapsed_s", elapsed}};
    const bool do_eval = evals_at(step);
    if (do_eval) {
      Evaluation e = evaluate(m, *data, eval_batches);
      rec["eval_loss"] = e.loss;
      if (e.accuracy >= 0) rec["eval_accuracy"] = e.accuracy;
      res.eval_loss = e.loss;
      res.eval_accuracy = e.accuracy;
    }
    if (logs_at(step)) {
      const double device_ms = deferred ? win_ev[static_cast<size_t>(q.win % 4)].ms_since(
                                              win_ev[static_cast<size_t>((q.win - 1) % 4)])
                                        : -1.0;
      const double window =
          device_ms > 0 ? device_ms / 1e3 : std::chrono::duration<double>(now - window_t0).count();
      const double tps = window > 0 ? window_tokens / window : 0;
      rec["tokens_per_s"] = tps;
      if (on_device) rec["mfu"] = window > 0 ? window_flops / window / kPeakFlops : 0.0;
      if (!topt.quiet) {
        const double eta = (step + 1 > start_step)
                               ? elapsed / static_cast<double>(step + 1 - start_step) *
                                     static_cast<double>(steps - step - 1)
                               : 0;
        std::string ev = do_eval ? fmt::format(" | eval loss {:.4f}{}", res.eval_loss,
                                               res.eval_accuracy >= 0
                                                   ? fmt::format(" acc {:.3f}", res.eval_accuracy)
                                                   : "")
                                 : "";
        const std::string mfu =
            on_device ? fmt::format(" | MFU {:.1f}%", 100.0 * rec["mfu"].get<double>()) : "";
        log::info(
            "step {:>5}/{} | loss {:.4f} | z {:.2e} | gnorm {:.3f} | lr {:.2e} | {:.0f} tok/s"
            "{} | {} elapsed, ETA {}{}",
            step + 1, steps, loss, zl, gnorm, lr, tps, mfu, format_duration(elapsed),
            format_duration(eta), ev);
      }
      window_tokens = 0;
      window_flops = 0;
      window_t0 = now;
    }
    metrics.write(rec);
    if (checkpoints_at(step)) {
      if (on_device) {
        ensure_host_stores();
        dev.download(master, opt);
      }
      save_checkpoint(cd, step + 1, mcfg, master, untouched, opt, trainer_state(step + 1),
                      cfg.json());
    }
    return stops_at(step);
  };
  uint64_t drains0 = 0;
  for (int64_t step = start_step; step < steps && !stop; ++step) {
    if (on_device && steps - start_step >= 4) {
      if (step == start_step + 2) drains0 = device_drains();
      if (step == steps - 1) res.steady_drains = static_cast<int64_t>(device_drains() - drains0);
    }
    // --profile-step: the step runs alone on the device (synchronised before and after) with its
    // ranges timed by CUDA events (ProfileRange in the model and here).
    std::unique_ptr<Profiler> prof;
    std::chrono::steady_clock::time_point prof_t0;
    if (step + 1 == topt.profile_step) {
      if (pending) {
        stop = finalise(*pending);
        pending.reset();
        if (stop) break;
      }
      device_synchronize(step_device);
      prof = std::make_unique<Profiler>(step_device);
      set_active_profiler(prof.get());
      prof_t0 = std::chrono::steady_clock::now();
    }
    m.zero_grads();
    std::vector<MicroBatch> mbs;
    int64_t denom = 0, tokens = 0;
    for (int64_t k = 0; k < accum; ++k) {
      mbs.push_back(data->train_batch(step, k));
      denom += mbs.back().num_targets();
      tokens += mbs.back().num_tokens();
    }
    Pending cur;
    cur.step = step;
    cur.lr = sched.at(step);
    cur.tokens = tokens;
    cur.slot = static_cast<size_t>(step & 1);
    for (const MicroBatch& mb : mbs) cur.flops += step_flops(mcfg, mb);
    try {
      for (size_t k = 0; k < mbs.size(); ++k) {
        model::StepOptions so;
        so.backward = true;
        so.z_loss = z_loss;
        so.loss_denominator = static_cast<double>(std::max<int64_t>(denom, 1));
        so.host_stats = !deferred;
        model::StepStats s = m.step(mbs[k], so);
        if (deferred) {
          copy_bytes_async(ctl_loss.ptr<float>() + k, Device::CUDA, s.loss_dev.data(), Device::CUDA,
                           sizeof(float));
          copy_bytes_async(ctl_z.ptr<float>() + k, Device::CUDA, s.z_loss_dev.data(), Device::CUDA,
                           sizeof(float));
        } else {
          cur.loss += s.loss;
          cur.zl += s.z_loss;
        }
      }
    } catch (const NonFiniteError& e) {
      // An op's input check found NaN/inf inside the step (the cpu path checks gates and states).
      cur.nonfinite = e.message();
      cur.loss = std::numeric_limits<double>::quiet_NaN();
    }
    if (deferred) {
      if (!cur.nonfinite.empty()) {  // a host-side check threw: make the device skip the update
        const float nan = std::numeric_limits<float>::quiet_NaN();
        copy_bytes(ctl_loss.ptr<float>(), Device::CUDA, &nan, Device::CPU, sizeof(float));
      }
      {
        ProfileRange pr("grad_norm");
        ops::grad_sumsq_into(m.grads(), ctl_sumsq);
      }
      // The previous step's host side, while the device works on this one.
      if (pending) {
        stop = finalise(*pending);
        pending.reset();
        if (stop) break;
      }
      hyper.lr = cur.lr;
      hyper.step = step + 1 - res.skipped_steps;
      hyper.grad_scale = 1.0;
      {
        ProfileRange pr("optimizer");
        ops::adamw_step(params, hyper, device_clip);  // skips itself on a non-finite sum or loss
        for (size_t i : f32_compute)
          copy_bytes_async(m.param(i).data(), Device::CUDA, dev.master[i].data(), Device::CUDA,
                           static_cast<size_t>(dev.master[i].nbytes()));
      }
      if (logs_at(step)) {
        cur.win = ++win_recorded;
        win_ev[static_cast<size_t>(cur.win % 4)].record();  // before the staging fence below
      }
      Staged& st = staged[cur.slot];
      char* h = static_cast<char*>(st.host.data());
      copy_bytes_async(h, Device::CPU, ctl_sumsq.ptr<double>(), Device::CUDA, sizeof(double));
      copy_bytes_async(h + sizeof(double), Device::CPU, ctl_loss.ptr<float>(), Device::CUDA,
                       loss_bytes);
      copy_bytes_async(h + sizeof(double) + loss_bytes, Device::CPU, ctl_z.ptr<float>(),
                       Device::CUDA, loss_bytes);
      st.fence.record();
    } else {
      if (cur.nonfinite.empty()) {
        ProfileRange pr("grad_norm");
        cur.gnorm = ops::grad_global_norm(m.grads());
      } else {
        cur.gnorm = std::numeric_limits<double>::quiet_NaN();
      }
      if (std::isfinite(cur.loss) && std::isfinite(cur.gnorm)) {
        hyper.lr = cur.lr;
        hyper.step = step + 1 - res.skipped_steps;
        hyper.grad_scale = ops::clip_scale(cur.gnorm, clip);
        ProfileRange pr("optimizer");
        ops::adamw_step(params, hyper);
        m.load_params(master);
      }
    }
    if (prof) {
      device_synchronize(step_device);
      const double wall_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - prof_t0)
              .count();
      set_active_profiler(nullptr);
      res.profile = prof->rows();
      res.profile_step_ms = wall_ms;
      prof.reset();
      write_profile(run_dir, step + 1, res.profile, wall_ms, tokens);
      if (!topt.quiet)
        log::info(
            "profile of step {} ({} tokens, {} backend; {}, synchronised "
            "step):\n{}",
            step + 1, tokens, backend_name(backend),
            on_device ? "CUDA-event times" : "wall-clock times",
            format_profile(res.profile, wall_ms));
    }
    // Finalised at once: the CPU, and device steps whose host side needs this step's state.
    const bool now_steps = !deferred || step + 1 == steps || step + 1 == topt.profile_step ||
                           evals_at(step) || checkpoints_at(step);
    if (now_steps) {
      stop = finalise(cur);
    } else {
      pending = std::move(cur);
    }
  }
  if (pending && !stop) finalise(*pending);
  metrics.close();
  if (!topt.quiet) {
    if (res.eval_accuracy >= 0)
      log::info(
          "final: loss {:.4f}, eval loss {:.4f}, MQAR recall accuracy {:.3f} ({} steps, {} "
          "skipped)",
          res.final_loss, res.eval_loss, res.eval_accuracy, res.steps_done, res.skipped_steps);
    else
      log::info("final: loss {:.4f}, eval loss {:.4f} ({} steps, {} skipped)", res.final_loss,
                res.eval_loss, res.steps_done, res.skipped_steps);
  }
  return res;
}

}  // namespace gdn::train
