#include "train/schedule.h"

#include <algorithm>
#include <cmath>

#include "gdn/core/error.h"

namespace gdn::train {

DecayKind decay_kind_from_name(const std::string& name) {
  if (name == "cosine") return DecayKind::Cosine;
  if (name == "linear") return DecayKind::Linear;
  if (name == "wsd") return DecayKind::Wsd;
  if (name == "constant") return DecayKind::Constant;
  GDN_FAIL_HINT("choose cosine, linear, wsd or constant", "unknown lr decay '{}'", name);
}

double Schedule::at(int64_t step) const {
  GDN_CHECK(total_steps > 0 && warmup_steps >= 0, "schedule: total_steps {} and warmup_steps {}",
            total_steps, warmup_steps);
  if (step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  if (decay == DecayKind::Constant) return lr;
  const int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  const double t =
      std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(span), 0.0, 1.0);
  switch (decay) {
    case DecayKind::Cosine:
      return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * t));
    case DecayKind::Linear:
      return lr + (min_lr - lr) * t;
    case DecayKind::Wsd: {
      const double start = 1.0 - wsd_decay_fraction;
      if (t <= start) return lr;
      return lr + (min_lr - lr) * (t - start) / std::max(1e-12, wsd_decay_fraction);
    }
    case DecayKind::Constant:
      return lr;
  }
  return lr;
}

}  // namespace gdn::train
