#include "gdn/core/env.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "gdn/core/error.h"
#include "gdn/core/log.h"

extern char** environ;

namespace gdn::env {

namespace {
// The one table of knobs. Keep it sorted by name.
constexpr Knob kKnobs[] = {
    {"GDN_LOG_LEVEL", KnobType::Choice, "info", "Lowest log level printed.", false,
     "debug|info|warn|error"},
    {"GDN_NUM_THREADS", KnobType::Int, "0",
     "CPU threads for OpenMP kernels; 0 keeps the OpenMP default (OMP_NUM_THREADS or all cores).",
     false, nullptr},
    {"GDN_OP_*", KnobType::String, "",
     "Force an implementation for one op, e.g. GDN_OP_RMSNORM=cpu.rowwise (names: gdntrain ops "
     "list). The forced implementation is still probed; under GDN_STRICT_KERNELS a failed probe or "
     "capability check is an error.",
     false, nullptr},
    {"GDN_STRICT_KERNELS", KnobType::Bool, "0",
     "Turn every skipped implementation or fallback (failed capability check or numeric probe) "
     "into an error naming the op, the implementation and the reason.",
     false, nullptr},
};

// Knobs that became keys of the run config (saved with each run, so a resume keeps them): setting
// one is an error naming its key, since silently ignoring it would change what the user asked for.
struct MovedKnob {
  const char* name;
  const char* key;
};
constexpr MovedKnob kMovedKnobs[] = {
    {"GDN_FAIL_ON_NONFINITE", "train.fail_on_nonfinite"},
    {"GDN_FLCE_CHUNK_BYTES", "memory.lce_chunk_bytes"},
    {"GDN_FUSED_CONV", "kernels.fused_conv"},
    {"GDN_FUSED_LM_HEAD", "kernels.fused_lm_head"},
    {"GDN_FUSED_QK_L2NORM", "kernels.fused_qk_l2norm"},
    {"GDN_FUSED_SWIGLU", "kernels.fused_swiglu"},
    {"GDN_FUSED_ZC_NORM", "kernels.fused_zc_norm"},
    {"GDN_GDR_SAVED_MIN_DOC_TOKENS", "memory.gdr_saved_min_doc_tokens"},
    {"GDN_GRADS_IN_ACTIVATIONS", "memory.grads_in_activations"},
    {"GDN_SPLIT_MASTER", "optim.split_master"},
};

struct Cache {
  std::mutex mu;
  std::map<std::string, std::string, std::less<>> values;  // read-once knobs already read
};
Cache& cache() {
  static Cache c;
  return c;
}

const Knob* find_knob(std::string_view name) {
  for (const Knob& k : kKnobs) {
    std::string_view kn = k.name;
    if (kn == name) return &k;
    if (kn.ends_with('*') && name.starts_with(kn.substr(0, kn.size() - 1)) &&
        name.size() > kn.size() - 1)
      return &k;
  }
  return nullptr;
}

std::string raw_value(const Knob& k, std::string_view name) {
  auto read = [&]() -> std::string {
    const char* v = std::getenv(std::string(name).c_str());
    return v != nullptr ? std::string(v) : std::string(k.dflt);
  };
  if (k.live) return read();
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  auto it = c.values.find(name);
  if (it != c.values.end()) return it->second;
  std::string v = read();
  c.values.emplace(std::string(name), v);
  return v;
}

bool parse_bool(std::string_view name, std::string_view v) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no" || v.empty()) return false;
  GDN_FAIL_HINT("use 1/0, true/false, on/off or yes/no",
                "environment variable {}='{}' is not a boolean", name, v);
}

int64_t parse_int(std::string_view name, std::string_view v) {
  std::string s(v);
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(s.c_str(), &end, 10);
  GDN_CHECK_HINT(!s.empty() && end != nullptr && *end == '\0' && errno == 0, "give a whole number",
                 "environment variable {}='{}' is not an integer", name, v);
  return x;
}

double parse_float(std::string_view name, std::string_view v) {
  std::string s(v);
  char* end = nullptr;
  double x = std::strtod(s.c_str(), &end);
  GDN_CHECK_HINT(!s.empty() && end != nullptr && *end == '\0', "give a number such as 0.5",
                 "environment variable {}='{}' is not a number", name, v);
  return x;
}

void validate(const Knob& k, std::string_view name, std::string_view v) {
  switch (k.type) {
    case KnobType::Bool:
      parse_bool(name, v);
      break;
    case KnobType::Int:
      parse_int(name, v);
      break;
    case KnobType::Float:
      parse_float(name, v);
      break;
    case KnobType::String:
      break;
    case KnobType::Choice: {
      std::string_view choices = k.choices;
      size_t pos = 0;
      while (pos <= choices.size()) {
        size_t bar = choices.find('|', pos);
        if (bar == std::string_view::npos) bar = choices.size();
        if (choices.substr(pos, bar - pos) == v) return;
        pos = bar + 1;
      }
      GDN_FAIL_HINT(fmt::format("choose one of {}", k.choices),
                    "environment variable {}='{}' is not a valid choice", name, v);
    }
  }
}

const Knob& require_knob(std::string_view name, KnobType type) {
  const Knob* k = find_knob(name);
  GDN_CHECK(k != nullptr, "internal: environment knob {} is not declared in the knob table", name);
  GDN_CHECK(k->type == type, "internal: environment knob {} read with the wrong type", name);
  return *k;
}
}  // namespace

std::span<const Knob> knobs() { return kKnobs; }

bool get_bool(std::string_view name) {
  const Knob& k = require_knob(name, KnobType::Bool);
  return parse_bool(name, raw_value(k, name));
}

int64_t get_int(std::string_view name) {
  const Knob& k = require_knob(name, KnobType::Int);
  return parse_int(name, raw_value(k, name));
}

double get_float(std::string_view name) {
  const Knob& k = require_knob(name, KnobType::Float);
  return parse_float(name, raw_value(k, name));
}

std::string get_string(std::string_view name) {
  const Knob* k = find_knob(name);
  GDN_CHECK(k != nullptr, "internal: environment knob {} is not declared in the knob table", name);
  std::string v = raw_value(*k, name);
  validate(*k, name, v);
  return v;
}

std::optional<std::string> get_family(std::string_view prefix, std::string_view suffix) {
  std::string name = std::string(prefix) + std::string(suffix);
  const Knob* k = find_knob(name);
  GDN_CHECK(k != nullptr, "internal: knob family {}* is not declared", prefix);
  std::string v = raw_value(*k, name);
  if (v.empty()) return std::nullopt;
  return v;
}

std::string current_text(const Knob& k) {
  std::string_view n = k.name;
  if (n.ends_with('*')) {
    std::string out;
    std::string prefix(n.substr(0, n.size() - 1));
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      std::string_view kv = *e;
      if (kv.starts_with(prefix)) out += (out.empty() ? "" : " ") + std::string(kv);
    }
    return out.empty() ? "(none set)" : out;
  }
  const char* v = std::getenv(k.name);
  return v != nullptr ? std::string(v) : std::string(k.dflt) + " (default)";
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

int check_environment() {
  int warnings = 0;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string_view kv = *e;
    if (!kv.starts_with("GDN_")) continue;
    size_t eq = kv.find('=');
    std::string_view name = kv.substr(0, eq);
    std::string_view value = eq == std::string_view::npos ? "" : kv.substr(eq + 1);
    const Knob* k = find_knob(name);
    if (k != nullptr) {
      validate(*k, name, value);
      continue;
    }
    for (const MovedKnob& m : kMovedKnobs)
      if (name == m.name)
        GDN_FAIL_HINT(fmt::format("unset it and pass --set {}=... (or set the key in the --config "
                                  "file; gdntrain train --help)",
                                  m.key),
                      "environment variable {} is no longer read: it is the run config key {}",
                      name, m.key);
    const Knob* best = nullptr;
    size_t best_d = SIZE_MAX;
    for (const Knob& c : kKnobs) {
      size_t d = edit_distance(name, c.name);
      if (d < best_d) {
        best_d = d;
        best = &c;
      }
    }
    log::warn(
        "unknown environment variable {} is ignored; did you mean {}? (gdntrain env lists "
        "every knob)",
        name, best != nullptr ? best->name : "?");
    ++warnings;
  }
  return warnings;
}

void reset_cache_for_testing() {
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.values.clear();
}

}  // namespace gdn::env
