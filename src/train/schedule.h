// Learning-rate schedules: linear warmup, then cosine, linear or WSD (warmup-stable-decay) decay
// to min_lr. Pure functions of the step, so a resumed run gets the same rates.
#pragma once

#include <cstdint>
#include <string>

namespace gdn::train {

enum class DecayKind { Cosine, Linear, Wsd, Constant };
DecayKind decay_kind_from_name(const std::string& name);

struct Schedule {
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1000;
  DecayKind decay = DecayKind::Cosine;
  double wsd_decay_fraction = 0.2;  // WSD: the last fraction of steps decays linearly

  // The rate for 0-based `step` (the step about to be taken).
  double at(int64_t step) const;
};

}  // namespace gdn::train
