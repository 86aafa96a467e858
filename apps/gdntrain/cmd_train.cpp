// gdntrain train | plot: the trainer (src/train/trainer.h) from the command line. With no
// arguments it trains the tiny built-in Qwen3.5 on the MQAR recall task and prints the recall
// accuracy at the end.
#include <cstdio>

#include "commands.h"
#include "gdn/core/log.h"
#include "train/config_tree.h"
#include "train/trainer.h"

namespace gdn::cli {

namespace {

struct TrainCli {
  std::string config, run_dir, device, init_from;
  std::vector<std::string> sets;
  bool resume = false;
  int64_t steps = -1;
  int64_t stop_after = 0;
  int64_t profile_step = 0;
};
}  // namespace

void add_train_command(CLI::App& app, Commands& cmds) {
  auto o = std::make_shared<TrainCli>();
  auto* sub = app.add_subcommand(
      "train", "Train a Qwen3.5-class model (default: a tiny model on the built-in MQAR task)");
  sub->add_option("--config", o->config, "Training configuration file (.json, or TOML-style)");
  sub->add_option("--set", o->sets, "Override one key, e.g. --set optim.lr=1e-3 (repeatable)");
  sub->add_option("--run-dir", o->run_dir, "Run directory (same as --set run.dir=...)");
  sub->add_option("--device", o->device, "auto | cpu | cuda | ref (same as train.device)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda", "ref"}));
  sub->add_option("--init-from", o->init_from, "Start from an HF checkpoint directory");
  sub->add_option("--steps", o->steps, "Number of optimizer steps (same as train.steps)")
      ->check(positive_count());
  sub->add_flag("--resume", o->resume, "Continue from the latest complete checkpoint");
  sub->add_option("--stop-after", o->stop_after,
                  "Stop (with a checkpoint) after this many steps; --resume continues")
      ->check(positive_count());
  sub->add_option("--profile-step", o->profile_step,
                  "Time this step (1-based) op by op (CUDA events on the GPU): a table in the log "
                  "and RUN_DIR/profile_step<N>.json")
      ->check(positive_count());
  sub->callback([&cmds, o] {
    cmds.selected = [o] {
      train::ConfigTree cfg(train::default_train_config());
      if (!o->config.empty()) cfg.merge_file(o->config);
      for (const auto& s : o->sets) cfg.set(s);
      if (!o->run_dir.empty()) cfg.set("run.dir=\"" + o->run_dir + "\"");
      if (!o->device.empty()) cfg.set("train.device=\"" + o->device + "\"");
      if (!o->init_from.empty()) cfg.set("model.init_from=\"" + o->init_from + "\"");
      if (o->steps > 0) cfg.set(fmt::format("train.steps={}", o->steps));
      train::TrainOptions to;
      to.resume = o->resume;
      to.stop_after = o->stop_after;
      to.profile_step = o->profile_step;
      train::run_training(cfg, to);
      return 0;
    };
  });

  auto dir = std::make_shared<std::string>();
  auto* plot = app.add_subcommand("plot", "Write RUN_DIR/loss.svg from RUN_DIR/metrics.jsonl");
  plot->add_option("run_dir", *dir, "Run directory")->required();
  plot->callback([&cmds, dir] {
    cmds.selected = [dir] {
      std::printf("%s\n", train::plot_run(*dir).c_str());
      return 0;
    };
  });
}

}  // namespace gdn::cli
