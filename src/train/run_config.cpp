#include "train/run_config.h"

#include <cmath>
#include <limits>

#include "gdn/core/error.h"
#include "gdn/core/tensor.h"
#include "ops/linear_cross_entropy/op.h"
#include "train/mqar.h"
#include "train/trainer.h"

namespace gdn::train {

namespace {

// Collects every problem, so that one run of the command shows all of them.
class Checker {
 public:
  explicit Checker(const ConfigTree& cfg) : cfg_(cfg) {}

  // A number in [lo, hi] (open ends where lo_open / hi_open), finite.
  bool number(const std::string& key, double lo, double hi, bool lo_open, bool hi_open,
              const char* allowed) {
    const nlohmann::json* v = value(key);
    if (v == nullptr) return false;
    if (!v->is_number()) return bad(key, *v, "a number");
    const double d = v->get<double>();
    const bool ok =
        std::isfinite(d) && (lo_open ? d > lo : d >= lo) && (hi_open ? d < hi : d <= hi);
    return ok || bad(key, *v, allowed);
  }
  bool integer(const std::string& key, int64_t lo, int64_t hi, const char* allowed) {
    const nlohmann::json* v = value(key);
    if (v == nullptr) return false;
    if (!v->is_number_integer()) return bad(key, *v, "an integer");
    const int64_t i = v->get<int64_t>();
    return (i >= lo && i <= hi) || bad(key, *v, allowed);
  }
  // `noun` (optional) words the line as "data.kind 'parquet' is not a data source: ...".
  bool choice(const std::string& key, std::initializer_list<const char*> options,
              const char* noun = nullptr) {
    const nlohmann::json* v = value(key);
    if (v == nullptr) return false;
    std::string list;
    bool found = false;
    for (const char* o : options) {
      list += (list.empty() ? "" : ", ") + std::string(o);
      found = found || (v->is_string() && v->get<std::string>() == o);
    }
    if (found) return true;
    if (noun != nullptr && v->is_string()) {
      add(fmt::format("{} '{}' is not {}: must be one of {}", key, v->get<std::string>(), noun,
                      list));
      return false;
    }
    return bad(key, *v, ("one of " + list).c_str());
  }
  bool string(const std::string& key, bool non_empty) {
    const nlohmann::json* v = value(key);
    if (v == nullptr) return false;
    if (!v->is_string()) return bad(key, *v, "a string");
    return !non_empty || !v->get<std::string>().empty() || bad(key, *v, "a non-empty string");
  }
  bool boolean(const std::string& key) {
    const nlohmann::json* v = value(key);
    if (v == nullptr) return false;
    return v->is_boolean() || bad(key, *v, "true or false");
  }
  void add(std::string line) { problems_.push_back(std::move(line)); }
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  const nlohmann::json* value(const std::string& key) {
    try {
      return &cfg_.at(key);
    } catch (const Error&) {
      add(fmt::format("{} is missing", key));
      return nullptr;
    }
  }
  bool bad(const std::string& key, const nlohmann::json& v, const char* allowed) {
    add(fmt::format("{} = {}: must be {}", key, v.dump(), allowed));
    return false;
  }
  const ConfigTree& cfg_;
  std::vector<std::string> problems_;
};

constexpr int64_t kMaxI64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();

void flatten(const nlohmann::json& j, const std::string& prefix,
             std::map<std::string, std::string>& out) {
  if (!j.is_object()) {
    out[prefix] = j.dump();
    return;
  }
  for (auto it = j.begin(); it != j.end(); ++it)
    flatten(*it, prefix.empty() ? it.key() : prefix + "." + it.key(), out);
}

}  // namespace

void validate_train_config(const ConfigTree& cfg) {
  Checker c(cfg);
  c.string("model.config", true);
  c.string("model.init_from", false);
  c.integer("model.seed", 0, kMaxI64, "a non-negative integer");
  const bool kind_ok = c.choice("data.kind", {"mqar", "indexed"}, "a data source");
  c.integer("data.seed", 0, kMaxI64, "a non-negative integer");
  c.number("data.eval_fraction", 0, 1, false, true, "in [0, 1)");
  if (kind_ok && cfg.get_string("data.kind") == "indexed") c.string("data.path", true);
  const bool vocab_ok = c.integer("data.mqar.vocab_size", 4, kMaxI32, "in [4, 2^31)");
  const bool pairs_ok = c.integer("data.mqar.num_pairs", 1, kMaxI32, "a positive integer");
  const bool len_ok = c.integer("data.mqar.seq_len", 4, kMaxI32, "in [4, 2^31)");
  if (vocab_ok && pairs_ok && len_ok && kind_ok && cfg.get_string("data.kind") == "mqar") {
    try {
      validate(MqarConfig{cfg.get_int("data.mqar.vocab_size"), cfg.get_int("data.mqar.num_pairs"),
                          cfg.get_int("data.mqar.seq_len")});
    } catch (const Error& e) {
      c.add("data.mqar.*: " + e.message());
    }
  }
  c.integer("train.steps", 1, int64_t{1} << 40, "a positive integer");
  c.integer("train.micro_batch_tokens", 1, kMaxI32, "in [1, 2^31)");
  c.integer("train.grad_accum", 1, int64_t{1} << 20, "a positive integer");
  c.number("train.z_loss", 0, kInf, false, true, "a finite number >= 0");
  c.choice("train.device", {"auto", "cpu", "cuda", "ref"}, "a device");
  c.choice("train.recompute", {"none", "selective", "full"});
  c.boolean("train.fail_on_nonfinite");
  for (const char* k : {"kernels.fused_conv", "kernels.fused_qk_l2norm", "kernels.fused_swiglu",
                        "kernels.fused_zc_norm", "kernels.fused_lm_head"})
    c.boolean(k);
  c.boolean("memory.grads_in_activations");
  c.integer("memory.gdr_saved_min_doc_tokens", 0, kMaxI32, "a non-negative integer (0 = none)");
  c.integer("memory.lce_chunk_bytes", ops::kLceMinChunkBytes, kMaxI64,
            "an integer >= 4096 (the LM head's minimum)");

  const bool lr_ok = c.number("optim.lr", 0, kInf, true, true, "a finite number > 0");
  const bool min_ok = c.number("optim.min_lr", 0, kInf, false, true, "a finite number >= 0");
  c.integer("optim.warmup_steps", 0, int64_t{1} << 40, "a non-negative integer");
  const bool decay_ok = c.choice("optim.decay", {"cosine", "linear", "wsd", "constant"});
  if (lr_ok && min_ok && decay_ok && cfg.get_string("optim.decay") != "constant" &&
      cfg.get_double("optim.min_lr") > cfg.get_double("optim.lr"))
    c.add(fmt::format(
        "optim.min_lr = {}: must not exceed optim.lr = {} (the schedule decays from lr to "
        "min_lr; a larger min_lr would raise the rate)",
        cfg.at("optim.min_lr").dump(), cfg.at("optim.lr").dump()));
  c.number("optim.wsd_decay_fraction", 0, 1, true, false, "in (0, 1]");
  c.number("optim.beta1", 0, 1, false, true, "in [0, 1)");
  c.number("optim.beta2", 0, 1, false, true, "in [0, 1)");
  c.number("optim.eps", 0, kInf, true, true, "a finite number > 0");
  c.number("optim.weight_decay", 0, kInf, false, true, "a finite number >= 0");
  c.number("optim.clip", 0, kInf, false, true, "a finite number >= 0 (0 = off)");
  c.boolean("optim.split_master");

  c.integer("eval.every", 0, kMaxI64, "a non-negative integer (0 = off)");
  c.integer("eval.batches", 0, kMaxI32, "a non-negative integer");
  c.integer("log.every", 0, kMaxI64, "a non-negative integer");
  c.integer("checkpoint.every", 0, kMaxI64, "a non-negative integer (0 = only at the end)");
  c.integer("checkpoint.keep", 1, kMaxI32, "a positive integer");
  c.boolean("checkpoint.at_end");
  c.string("run.dir", true);
  c.boolean("resume.allow_changes");
  // Data parallelism (data_parallel.h, docs/DISTRIBUTED.md). optimizer and full are accepted here
  // and refused at start-up when the world size is > 1 (at 1 they run as replicate).
  c.choice("dist.shard", {"replicate", "optimizer", "full"});
  c.number("dist.timeout_s", 0, kInf, true, true, "a finite number of seconds > 0");
  c.choice("dist.numa_bind", {"auto", "off"});
  c.choice("dist.unshard_stream", {"comm", "compute"});

  if (c.problems().empty()) return;
  std::string msg =
      fmt::format("invalid training configuration ({} problem{}):", c.problems().size(),
                  c.problems().size() == 1 ? "" : "s");
  for (const auto& p : c.problems()) msg += "\n  " + p;
  GDN_FAIL_HINT(
      "fix these keys in the --config file or with --set key=value; nothing was run or written",
      "{}", msg);
}

std::vector<ConfigChange> config_changes(const nlohmann::json& saved, const nlohmann::json& now) {
  std::map<std::string, std::string> a, b;
  flatten(saved, "", a);
  flatten(now, "", b);
  std::vector<ConfigChange> out;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end())
      out.push_back({k, v, "(absent)"});
    else if (it->second != v)
      out.push_back({k, v, it->second});
  }
  for (const auto& [k, v] : b)
    if (!a.contains(k)) out.push_back({k, "(absent)", v});
  return out;
}

bool resume_blocks_change(const std::string& key) {
  const size_t dot = key.rfind('.');
  const std::string leaf = dot == std::string::npos ? key : key.substr(dot + 1);
  return key.starts_with("model.") || key.starts_with("data.") || key.starts_with("kernels.") ||
         leaf.find("seed") != std::string::npos || key == "train.micro_batch_tokens" ||
         key == "train.grad_accum";
}

model::ModelOptions model_options(const ConfigTree& cfg, int64_t grad_accum) {
  model::ModelOptions o;
  o.recompute = model::recompute_from_name(cfg.get_string("train.recompute"));
  // One micro-batch per step: its gradients can live in activation memory the backward has
  // consumed (qwen35.h, GradMemory); with several they must accumulate in an arena of their own.
  o.grad_memory = grad_accum == 1 && cfg.get_bool("memory.grads_in_activations")
                      ? model::GradMemory::InActivations
                      : model::GradMemory::Separate;
  o.fused = {.conv = cfg.get_bool("kernels.fused_conv"),
             .qk_l2norm = cfg.get_bool("kernels.fused_qk_l2norm"),
             .swiglu = cfg.get_bool("kernels.fused_swiglu"),
             .zc_norm = cfg.get_bool("kernels.fused_zc_norm"),
             .lm_head = cfg.get_bool("kernels.fused_lm_head")};
  o.lce_chunk_bytes = cfg.get_int("memory.lce_chunk_bytes");
  o.gdr_saved_min_doc_tokens = cfg.get_int("memory.gdr_saved_min_doc_tokens");
  return o;
}

std::vector<ConfigChange> check_resume_config(const nlohmann::json& saved,
                                              const nlohmann::json& now, bool allow,
                                              const std::string& label) {
  GDN_CHECK(saved.is_object(), "{}: the saved training configuration is not a JSON object", label);
  std::vector<ConfigChange> all = config_changes(saved, now);
  if (allow) return all;
  std::string blocked;
  size_t n = 0;
  for (const auto& ch : all) {
    if (!resume_blocks_change(ch.key)) continue;
    ++n;
    blocked += fmt::format("\n  {}: {} in the checkpoint, {} now", ch.key, ch.saved, ch.now);
  }
  GDN_CHECK_HINT(n == 0,
                 "restore these keys to continue the same run, or pass --set "
                 "resume.allow_changes=true to resume with them changed (the changes are logged)",
                 "--resume: {} key{} that define the run changed since {} was written:{}", n,
                 n == 1 ? "" : "s", label, blocked);
  return all;
}

TrainerState parse_trainer_state(const std::string& text, const std::string& label) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  GDN_CHECK(!j.is_discarded() && j.is_object(), "{} is not a JSON object", label);
  TrainerState s;
  GDN_CHECK(j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() >= 0,
            "{}: \"step\" must be a non-negative integer", label);
  s.step = j["step"].get<int64_t>();
  if (j.contains("skipped_steps")) {
    const auto& v = j["skipped_steps"];
    GDN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= s.step,
              "{}: \"skipped_steps\" must be an integer in [0, step = {}], got {}", label, s.step,
              v.dump());
    s.skipped_steps = v.get<int64_t>();
  }
  if (j.contains("tokens_seen")) {
    const auto& v = j["tokens_seen"];
    GDN_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
              "{}: \"tokens_seen\" must be a finite number >= 0, got {}", label, v.dump());
    s.tokens_seen = v.get<double>();
  }
  if (j.contains("world_size")) {
    const auto& v = j["world_size"];
    GDN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1,
              "{}: \"world_size\" must be a positive integer, got {}", label, v.dump());
    s.world_size = v.get<int64_t>();
  }
  return s;
}

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
    "resume": {"allow_changes": false},
    "dist": {"shard": "replicate", "timeout_s": 300.0, "numa_bind": "auto",
             "unshard_stream": "comm"}
  })");
}

Backend choose_backend(const std::string& device) {
  GDN_CHECK_HINT(device == "auto" || device == "cpu" || device == "cuda" || device == "ref",
                 "use auto, cpu, cuda or ref", "train.device '{}' is not a device", device);
  Backend backend = device == "ref" ? Backend::Ref : Backend::Cpu;
  if (device == "cuda" || (device == "auto" && cuda_available())) backend = Backend::Cuda;
  GDN_CHECK_HINT(backend != Backend::Cuda || cuda_available(),
                 "build the cuda preset and run on a machine with a GPU, or use --device cpu",
                 "train.device is cuda but no CUDA device is available");
  return backend;
}

std::unique_ptr<DataSource> make_data(const ConfigTree& cfg, const model::Qwen35Config& mcfg,
                                      int64_t micro_tokens, int64_t accum, DataShard shard) {
  const std::string kind = cfg.get_string("data.kind");
  const uint64_t seed = static_cast<uint64_t>(cfg.get_int("data.seed"));
  if (kind == "mqar") {
    MqarConfig mq{cfg.get_int("data.mqar.vocab_size"), cfg.get_int("data.mqar.num_pairs"),
                  cfg.get_int("data.mqar.seq_len")};
    GDN_CHECK(mq.vocab_size <= mcfg.vocab_size,
              "data.mqar.vocab_size {} exceeds the model vocabulary {}", mq.vocab_size,
              mcfg.vocab_size);
    return make_mqar_source(mq, seed, micro_tokens, accum, shard);
  }
  if (kind == "indexed")
    return make_indexed_source(cfg.get_string("data.path"), seed, micro_tokens, accum,
                               cfg.get_double("data.eval_fraction"), mcfg.vocab_size, shard);
  GDN_FAIL_HINT("use mqar (built-in task) or indexed (a `gdntrain prepare` dataset)",
                "data.kind '{}' is not a data source", kind);
}

Schedule schedule_from(const ConfigTree& cfg, int64_t steps) {
  Schedule sched;
  sched.lr = cfg.get_double("optim.lr");
  sched.min_lr = cfg.get_double("optim.min_lr");
  sched.warmup_steps = cfg.get_int("optim.warmup_steps");
  sched.total_steps = steps;
  sched.decay = decay_kind_from_name(cfg.get_string("optim.decay"));
  sched.wsd_decay_fraction = cfg.get_double("optim.wsd_decay_fraction");
  return sched;
}

OptimizerConfig optimizer_config_from(const ConfigTree& cfg) {
  OptimizerConfig oc;
  oc.hyper.beta1 = cfg.get_double("optim.beta1");
  oc.hyper.beta2 = cfg.get_double("optim.beta2");
  oc.hyper.eps = cfg.get_double("optim.eps");
  oc.hyper.weight_decay = cfg.get_double("optim.weight_decay");
  oc.clip = cfg.get_double("optim.clip");
  oc.split_master = cfg.get_bool("optim.split_master");
  return oc;
}

}  // namespace gdn::train
