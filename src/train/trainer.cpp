#include "train/trainer.h"

#include <omp.h>

#include <cmath>
#include <limits>

#include "gdn/backend/op_workspace.h"
#include "gdn/core/log.h"
#include "gdn/core/safetensors.h"
#include "model/qwen35.h"
#include "ops/adamw/op.h"
#include "train/checkpointing.h"
#include "train/data_source.h"
#include "train/flops.h"
#include "train/mqar.h"
#include "train/run_config.h"

namespace gdn::train {

Trainer::Trainer(const ConfigTree& cfg, const TrainOptions& opt)
    : cfg_(cfg),
      opts_(opt),
      t_launch_(Clock::now()),
      // Launch = process start when /proc tells it, else the start of the trainer.
      before_run_(std::max(0.0, seconds_since_process_start())) {
  // Every key is checked before any work; RUN_DIR/config.json is written (atomically) only once
  // the start has passed every check, so a rejected start leaves the directory as it was.
  validate_train_config(cfg_);
  s_.run_dir = cfg_.get_string("run.dir");
  s_.backend = choose_backend(cfg_.get_string("train.device"));
  s_.on_device = s_.backend == Backend::Cuda;
  // Before any other work: the rank prefix, dist.shard checked against the world size, the
  // communicator (NCCL picks this rank's GPU before the model touches it). Rank 0 alone talks.
  dist_ = start_distributed(dist_config_from(cfg_), !s_.on_device);
  // ZeRO-2 across ranks; at world size 1 there is nothing to shard (today's optimizer).
  s_.sharded = dist_.distributed() && dist_config_from(cfg_).shard == ShardMode::Optimizer;
  sync_ = std::make_unique<GradSync>(dist_.comm.get(), /*reduce_grads=*/!s_.sharded);
  if (dist_.rank() != 0) opts_.quiet = true;
  if (!opts_.quiet) log::info("effective configuration:\n{}", cfg_.json().dump(2));
  if (!opts_.quiet && dist_.distributed())
    log::info("data parallel: {}, dist.shard = {}, {} ranks x {} micro-batches of {} tokens a step",
              dist::describe(dist_.launch), cfg_.get_string("dist.shard"), dist_.world(),
              cfg_.get_int("train.grad_accum"), cfg_.get_int("train.micro_batch_tokens"));
  OptimizerState state;  // host stores (cpu: the live ones; cuda: made only where needed)
  // On cuda a fresh run initialises the fp32 master weights on the device (the same Philox
  // draws, rng.h); the host stores are then made only when a checkpoint is written. A sharded
  // optimizer takes its slice of host stores drawn on every rank.
  const bool device_init =
      s_.on_device && !s_.sharded && cfg_.get_string("model.init_from").empty() && !opts_.resume;
  init_weights(state, device_init);
  const double t_params = since_launch();
  init_model();
  const double t_model = since_launch();

  const TrainerState resumed = open_run_dir(state);
  start_step_ = next_step_ = resumed.step;
  // The optimizer works where the gradients are (optimizer.h).
  const OptimizerConfig oc = optimizer_config_from(cfg_);
  if (s_.sharded) {
    opt_ = make_sharded_optimizer(*model_, specs_, std::move(state), oc, *dist_.comm);
  } else if (s_.on_device) {
    const DeviceInit init{&mcfg_, static_cast<uint64_t>(cfg_.get_int("model.seed"))};
    opt_ = make_device_optimizer(*model_, specs_, std::move(state), opts_.resume, oc,
                                 device_init ? &init : nullptr);
  } else {
    opt_ = make_host_optimizer(*model_, specs_, std::move(state), oc);
  }
  // The op workspace of the update (gdn/backend/op_workspace.h): the gradient norm's partial sums
  // and the clip control, bound around them in step() like the model's around its step.
  if (s_.on_device) {
    std::vector<int64_t> numels;
    for (const model::ParamSpec& p : specs_) numels.push_back(p.numel());
    opt_ws_ = Arena("optimizer workspace", Device::CUDA, ops::adamw_workspace_bytes(numels));
  }
  if (writes_run_dir()) metrics_.emplace(s_.run_dir + "/metrics.jsonl");
  log_start(t_params, t_model);

  res_.skipped_steps = resumed.skipped_steps;
  tokens_total_ = resumed.tokens_seen;
  t0_ = window_t0_ = Clock::now();
  GDN_CHECK(opts_.profile_step <= 0 || opts_.profile_step > start_step_,
            "--profile-step {}: the run starts at step {} (resumed)", opts_.profile_step,
            start_step_ + 1);
  GDN_CHECK(opts_.profile_step <= s_.steps, "--profile-step {} is past the last step {}",
            opts_.profile_step, s_.steps);
  stats_ = s_.on_device ? make_device_stats(s_.accum, dist_.comm.get())
                        : make_host_stats(dist_.comm.get());
}

// Fresh or resumed (checkpointing.h); RUN_DIR/config.json is written once the start has passed
// every check. In a data-parallel run rank 0 alone writes; the others read (a resume's
// checkpoint) only after it is done.
TrainerState Trainer::open_run_dir(OptimizerState& state) {
  cd_.emplace(s_.run_dir + "/checkpoints", static_cast<int>(cfg_.get_int("checkpoint.keep")));
  TrainerState resumed;
  if (writes_run_dir()) {
    cd_->clean_temporaries();
    resumed =
        open_run(*cd_, s_.run_dir, cfg_, opts_.resume, specs_, state, untouched_, dist_.world());
    write_file_atomic(s_.run_dir + "/config.json", cfg_.json().dump(2) + "\n");
    if (!opts_.quiet) log::info("effective configuration saved to {}/config.json", s_.run_dir);
  }
  if (dist_.distributed()) dist_.comm->barrier();
  if (!writes_run_dir())
    resumed = open_run(*cd_, s_.run_dir, cfg_, opts_.resume, specs_, state, untouched_,
                       dist_.world(), /*writes=*/false);
  return resumed;
}

Trainer::~Trainer() {
  if (prof_) set_active_profiler(nullptr);  // a profiled step threw: no dangling profiler
}

// Model config and initial weights: model.init_from, else drawn from model.seed (on the device
// by the optimizer when `device_init`).
void Trainer::init_weights(OptimizerState& state, bool device_init) {
  const std::string init_from = cfg_.get_string("model.init_from");
  if (!init_from.empty()) {
    model::HfCheckpoint ck = model::load_hf_checkpoint(init_from);
    mcfg_ = ck.config;
    state.master = std::move(ck.params);
    untouched_ = std::move(ck.extras.untouched);
  } else {
    const std::string mc = cfg_.get_string("model.config");
    mcfg_ = mc == "tiny" ? model::tiny_config() : model::load_config(mc);
    if (!device_init) {
      state.master = model::ParamStore(model::param_specs(mcfg_));
      model::init_params(state.master, mcfg_, static_cast<uint64_t>(cfg_.get_int("model.seed")));
    }
  }
  specs_ = state.master.size() > 0 ? state.master.specs() : model::param_specs(mcfg_);
}

// The data source, the model sized for its micro-batches, and the settings of the loop.
void Trainer::init_model() {
  s_.steps = cfg_.get_int("train.steps");
  s_.accum = cfg_.get_int("train.grad_accum");
  s_.micro_tokens = cfg_.get_int("train.micro_batch_tokens");
  GDN_CHECK(s_.steps >= 1 && s_.accum >= 1 && s_.micro_tokens >= 1,
            "train.steps, train.grad_accum and train.micro_batch_tokens must be positive");
  s_.data_kind = cfg_.get_string("data.kind");
  s_.data_seed = static_cast<uint64_t>(cfg_.get_int("data.seed"));
  data_ = make_data(cfg_, mcfg_, s_.micro_tokens, s_.accum, DataShard{dist_.rank(), dist_.world()});
  // One micro-batch per step: its gradients can live in activation memory the backward has
  // consumed (qwen35.h, GradMemory); with several they must accumulate in an arena of their own.
  model_ = std::make_unique<model::Qwen35Model>(mcfg_, s_.backend, data_->max_tokens(),
                                                data_->max_docs(), model_options(cfg_, s_.accum));
  sched_ = schedule_from(cfg_, s_.steps);
  s_.z_loss = cfg_.get_double("train.z_loss");
  s_.log_every = std::max<int64_t>(1, cfg_.get_int("log.every"));
  s_.eval_every = cfg_.get_int("eval.every");
  s_.eval_batches = cfg_.get_int("eval.batches");
  s_.ckpt_every = cfg_.get_int("checkpoint.every");
  s_.ckpt_at_end = cfg_.get_bool("checkpoint.at_end");
  s_.fail_on_nonfinite = cfg_.get_bool("train.fail_on_nonfinite");
}

void Trainer::log_start(double t_params, double t_model) const {
  if (opts_.quiet) return;
  int64_t num_params = 0;
  for (const auto& s : specs_) num_params += s.numel();
  log::info("model: {} layers ({} GDN, {} attention), D={}, vocab {}, {} parameters",
            mcfg_.num_hidden_layers, mcfg_.num_linear_attention_layers(),
            mcfg_.num_full_attention_layers(), mcfg_.hidden_size, mcfg_.vocab_size, num_params);
  log::info("data: {}", data_->describe());
  log::info("{}", model_->memory_plan());
  log::info("threads: {} (OpenMP)", omp_get_max_threads());
  // Start-up phases (the launch-to-first-step budget is issue 8's).
  log::info(
      "start-up: parameters ready {:.2f} s after launch, model arenas planned {:.2f} s, "
      "weights and optimizer state in place {:.2f} s",
      t_params, t_model, since_launch());
  log::info("{}", flops_formula(mcfg_));
  if (const std::string d = opt_->describe(); !d.empty()) log::info("{}", d);
}

// What happens after a step (0-based `step`): an evaluation, a progress line (which ends a
// tokens/s window), a stop (--stop-after), a checkpoint.
bool Trainer::evals_at(int64_t step) const {
  return s_.eval_every > 0 && ((step + 1) % s_.eval_every == 0 || step + 1 == s_.steps);
}
bool Trainer::logs_at(int64_t step) const {
  return (step + 1) % s_.log_every == 0 || step + 1 == s_.steps || evals_at(step);
}
bool Trainer::stops_at(int64_t step) const {
  return opts_.stop_after > 0 && step + 1 - start_step_ >= opts_.stop_after;
}
bool Trainer::checkpoints_at(int64_t step) const {
  return (s_.ckpt_every > 0 && (step + 1) % s_.ckpt_every == 0) ||
         (step + 1 == s_.steps && s_.ckpt_at_end) || stops_at(step);
}

double Trainer::since_launch() const {
  return before_run_ + std::chrono::duration<double>(Clock::now() - t_launch_).count();
}

// The loop's shape (batches, forward/backward, update, then the step's numbers and logs) follows
// llm.c's train_gpt2.cu main loop; the host side of a device step runs one step late.
TrainResult Trainer::run() {
  while (next_step_ < s_.steps && !stopped_) step();
  if (!stopped_) finish_pending();
  if (metrics_) metrics_->close();
  log_final();
  return res_;
}

bool Trainer::step() {
  const int64_t step = next_step_++;
  count_drains(step);
  if (step + 1 == opts_.profile_step) {
    if (finish_pending()) return stopped_ = true;
    begin_profile();
  }
  PendingStep cur = forward_backward(step);
  // Data parallel: the gradients summed over the ranks (nothing at world size 1); every rank
  // then computes the same norm and makes the same update.
  sync_->all_reduce_grads(*model_);
  opt_->reduce_grads();  // dist.shard = optimizer: the reduce-scatter into this rank's shard
  std::optional<OpWorkspaceBinding> workspace;
  if (s_.on_device) workspace.emplace(opt_ws_.address_at(0), opt_ws_.capacity());
  const GradCheck check = stats_->reduce(*model_, *opt_, cur);
  // The previous step's host side, while the device works on this one; before the update, so
  // that its Adam step count knows whether that step was skipped.
  if (finish_pending()) return stopped_ = true;
  opt_->step(cur.lr, step + 1 - res_.skipped_steps, check);
  stats_->issue(cur, logs_at(step));
  if (prof_) end_profile(step, cur.tokens);
  // Finished at once: the cpu, and device steps whose host side needs this step's state.
  if (!stats_->deferred() || step + 1 == s_.steps || step + 1 == opts_.profile_step ||
      evals_at(step) || checkpoints_at(step)) {
    stopped_ = finish(cur);
  } else {
    pending_ = std::move(cur);
  }
  return stopped_;
}

// The micro-batches' forward and backward, the gradients accumulating over them.
PendingStep Trainer::forward_backward(int64_t step) {
  model_->zero_grads();
  std::vector<MicroBatch> mbs;
  int64_t denom = 0;
  PendingStep cur;
  cur.step = step;
  cur.lr = sched_.at(step);
  for (int64_t k = 0; k < s_.accum; ++k) {
    mbs.push_back(data_->train_batch(step, k));
    denom += mbs.back().num_targets();
    cur.tokens += mbs.back().num_tokens();
  }
  for (const MicroBatch& mb : mbs) cur.flops += step_flops(mcfg_, mb);
  if (sync_->active()) {
    // The loss is a mean over the global step's targets: every rank divides by the same count,
    // and the step's tokens and FLOPs are the whole job's. Exact in doubles below 2^53.
    double sums[3] = {static_cast<double>(denom), static_cast<double>(cur.tokens), cur.flops};
    sync_->sum_host(sums);
    denom = static_cast<int64_t>(sums[0]);
    cur.tokens = static_cast<int64_t>(sums[1]);
    cur.flops = sums[2];
  }
  try {
    for (size_t k = 0; k < mbs.size(); ++k) {
      model::StepOptions so;
      so.backward = true;
      so.z_loss = s_.z_loss;
      so.loss_denominator = static_cast<double>(std::max<int64_t>(denom, 1));
      so.host_stats = !stats_->deferred();
      stats_->add_micro_batch(static_cast<int64_t>(k), model_->step(mbs[k], so), cur);
    }
  } catch (const NonFiniteError& e) {
    // An op's input check found NaN/inf inside the step (the cpu path checks gates and states).
    cur.nonfinite = e.message();
    cur.loss = std::numeric_limits<double>::quiet_NaN();
  }
  return cur;
}

bool Trainer::finish_pending() {
  if (!pending_) return false;
  PendingStep q = std::move(*pending_);
  pending_.reset();
  return finish(q);
}

// The host side of step q.step: skip accounting, the metrics record, evaluation, the progress
// line, a checkpoint. Returns true when the run stops there.
bool Trainer::finish(PendingStep& q) {
  stats_->read(q);
  const bool finite = std::isfinite(q.loss) && std::isfinite(q.grad_norm);
  if (!finite) account_skip(q);
  window_flops_ += q.flops;
  if (q.step == start_step_ && !opts_.quiet) log_first_step();
  tokens_total_ += static_cast<double>(q.tokens);
  window_tokens_ += static_cast<double>(q.tokens);
  const Clock::time_point now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - t0_).count();
  res_.losses.push_back(q.loss);
  res_.final_loss = q.loss;
  res_.steps_done = q.step + 1;
  nlohmann::json rec = {
      {"step", q.step + 1},           {"loss", q.loss},     {"z_loss", q.z_loss},
      {"grad_norm", q.grad_norm},     {"lr", q.lr},         {"tokens", q.tokens},
      {"tokens_seen", tokens_total_}, {"skipped", !finite}, {"elapsed_s", elapsed}};
  // The replicas are identical: rank 0 alone evaluates (and records it).
  const bool do_eval = evals_at(q.step) && writes_run_dir();
  if (do_eval) {
    const Evaluation e = evaluate();
    rec["eval_loss"] = e.loss;
    if (e.accuracy >= 0) rec["eval_accuracy"] = e.accuracy;
    res_.eval_loss = e.loss;
    res_.eval_accuracy = e.accuracy;
  }
  if (logs_at(q.step)) log_progress(q, rec, now, do_eval);
  if (metrics_) metrics_->write(rec);
  if (opts_.on_step && writes_run_dir()) opts_.on_step(rec);
  if (checkpoints_at(q.step)) checkpoint(q.step + 1);
  return stops_at(q.step);
}

// A non-finite loss or gradient: the update skipped itself (optimizer.h); an error under
// train.fail_on_nonfinite.
void Trainer::account_skip(const PendingStep& q) {
  const std::string cause = q.nonfinite.empty() ? stats_->nonfinite_cause(q, *model_) : q.nonfinite;
  GDN_CHECK_HINT(!s_.fail_on_nonfinite,
                 "set train.fail_on_nonfinite=false to skip such steps, or lower optim.lr",
                 "train.fail_on_nonfinite: step {} has a non-finite loss or gradient; first "
                 "non-finite: {}",
                 q.step + 1, cause);
  ++res_.skipped_steps;
  log::warn("step {}: non-finite loss or gradient ({}); step skipped ({} so far)", q.step + 1,
            cause, res_.skipped_steps);
}

void Trainer::log_first_step() const {
  log::info("first step finished {:.2f} s after launch", since_launch());
  if (s_.on_device)
    log::info(
        "device memory in use after the first step: {} (planned arenas: model {}, optimizer {})",
        format_bytes(static_cast<double>(device_memory_used())),
        format_bytes(static_cast<double>(model_->param_bytes() + model_->grad_bytes() +
                                         model_->activation_bytes() +
                                         model_->op_workspace_bytes())),
        format_bytes(static_cast<double>(opt_->device_bytes() + opt_ws_.capacity())));
}

// A logging step: tokens/s (and MFU on the device) over the window it ends, and the progress line.
void Trainer::log_progress(const PendingStep& q, nlohmann::json& rec, Clock::time_point now,
                           bool evaluated) {
  const double elapsed = std::chrono::duration<double>(now - t0_).count();
  const double device_s = stats_->window_seconds(q);
  const double window =
      device_s > 0 ? device_s : std::chrono::duration<double>(now - window_t0_).count();
  const double tps = window > 0 ? window_tokens_ / window : 0;
  rec["tokens_per_s"] = tps;
  // MFU per GPU: the window's FLOPs are the whole job's.
  if (s_.on_device)
    rec["mfu"] = window > 0 ? window_flops_ / dist_.world() / window / kPeakFlops : 0.0;
  if (!opts_.quiet) {
    const int64_t step = q.step;
    const double eta = (step + 1 > start_step_)
                           ? elapsed / static_cast<double>(step + 1 - start_step_) *
                                 static_cast<double>(s_.steps - step - 1)
                           : 0;
    const std::string ev =
        evaluated
            ? fmt::format(
                  " | eval loss {:.4f}{}", res_.eval_loss,
                  res_.eval_accuracy >= 0 ? fmt::format(" acc {:.3f}", res_.eval_accuracy) : "")
            : "";
    const std::string mfu =
        s_.on_device ? fmt::format(" | MFU {:.1f}%", 100.0 * rec["mfu"].get<double>()) : "";
    log::info(
        "step {:>5}/{} | loss {:.4f} | z {:.2e} | gnorm {:.3f} | lr {:.2e} | {:.0f} tok/s"
        "{} | {} elapsed, ETA {}{}",
        step + 1, s_.steps, q.loss, q.z_loss, q.grad_norm, q.lr, tps, mfu, format_duration(elapsed),
        format_duration(eta), ev);
  }
  window_tokens_ = 0;
  window_flops_ = 0;
  window_t0_ = now;
}

void Trainer::log_final() const {
  if (opts_.quiet) return;
  if (res_.eval_accuracy >= 0)
    log::info(
        "final: loss {:.4f}, eval loss {:.4f}, MQAR recall accuracy {:.3f} ({} steps, {} "
        "skipped)",
        res_.final_loss, res_.eval_loss, res_.eval_accuracy, res_.steps_done, res_.skipped_steps);
  else
    log::info("final: loss {:.4f}, eval loss {:.4f} ({} steps, {} skipped)", res_.final_loss,
              res_.eval_loss, res_.steps_done, res_.skipped_steps);
}

Trainer::Evaluation Trainer::evaluate() {
  Evaluation e;
  auto evals = data_->eval_batches(s_.eval_batches);
  if (evals.empty()) return e;
  const int64_t V = mcfg_.vocab_size;
  const bool mqar = data_->is_mqar();
  double loss_sum = 0;
  int64_t targets = 0;
  MqarAccuracy acc;
  for (const MicroBatch& mb : evals) {
    model::StepOptions o;
    o.backward = false;
    OwnedTensor dev_logits;
    if (mqar) {
      dev_logits = OwnedTensor::zeros(backend_dtype(s_.backend), {mb.num_tokens(), V},
                                      backend_device(s_.backend));
      o.logits = dev_logits;
    }
    model::StepStats s = model_->step(mb, o);
    loss_sum += s.loss * static_cast<double>(s.targets);
    targets += s.targets;
    if (mqar) {
      const OwnedTensor logits = convert(dev_logits, DType::F32);
      MqarAccuracy a = mqar_accuracy(
          std::span<const float>(logits.ptr<float>(), static_cast<size_t>(logits.numel())),
          mb.labels, V);
      acc.correct += a.correct;
      acc.total += a.total;
    }
  }
  e.loss = targets > 0 ? loss_sum / static_cast<double>(targets) : 0.0;
  if (mqar) e.accuracy = acc.value();
  return e;
}

void Trainer::checkpoint(int64_t steps_done) {
  // Rank 0 writes the checkpoint a single process writes: the (identical) replica's, or the
  // state a sharded optimizer gathers from every rank (a collective).
  if (!writes_run_dir() && !opt_->sharded()) return;
  const OptimizerState& state = opt_->host_state();
  if (!writes_run_dir()) return;
  const TrainerState st{steps_done, res_.skipped_steps, tokens_total_, dist_.world()};
  save_checkpoint(*cd_, steps_done, mcfg_, state, untouched_,
                  trainer_state_json(st, s_.data_kind, s_.data_seed), cfg_.json());
}

// cuda: how often the host drained the device's queue in the steady state (TrainResult).
void Trainer::count_drains(int64_t step) {
  if (!s_.on_device || s_.steps - start_step_ < 4) return;
  if (step == start_step_ + 2) drains0_ = device_drains();
  if (step == s_.steps - 1) res_.steady_drains = static_cast<int64_t>(device_drains() - drains0_);
}

// --profile-step: the step runs alone on the device (synchronised before and after) with its
// ranges timed by CUDA events (ProfileRange in the model, the optimizer and step_stats.cpp).
void Trainer::begin_profile() {
  device_synchronize(backend_device(s_.backend));
  prof_ = std::make_unique<Profiler>(backend_device(s_.backend));
  set_active_profiler(prof_.get());
  prof_t0_ = Clock::now();
}

void Trainer::end_profile(int64_t step, int64_t tokens) {
  device_synchronize(backend_device(s_.backend));
  const double wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - prof_t0_).count();
  set_active_profiler(nullptr);
  res_.profile = prof_->rows();
  res_.profile_step_ms = wall_ms;
  prof_.reset();
  if (writes_run_dir()) write_profile(s_.run_dir, step + 1, res_.profile, wall_ms, tokens);
  if (!opts_.quiet)
    log::info("profile of step {} ({} tokens, {} backend; {}, synchronised step):\n{}", step + 1,
              tokens, backend_name(s_.backend),
              s_.on_device ? "CUDA-event times" : "wall-clock times",
              format_profile(res_.profile, wall_ms));
}

TrainResult run_training(const ConfigTree& cfg, const TrainOptions& opt) {
  return Trainer(cfg, opt).run();
}

}  // namespace gdn::train
