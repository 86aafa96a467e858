// Environment knobs (ARCHITECTURE.md §6). Every GDN_* variable the engine reads is declared in one
// table (src/core/env.cpp) with its type, default, help and whether it is read once or live.
// Invalid values are errors; an unknown GDN_* variable gets a warning naming the closest known
// knob.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace gdn::env {

enum class KnobType { Bool, Int, Float, String, Choice };

struct Knob {
  const char* name;  // "GDN_STRICT_KERNELS"; a name ending in '*' declares a family (GDN_OP_*)
  KnobType type;
  const char* dflt;  // default, as text
  const char* help;
  bool live;            // true: re-read at every access; false: read once per process
  const char* choices;  // Choice only: "a|b|c"
};

std::span<const Knob> knobs();

// Typed accessors. The name must be declared in the table (a typo in the engine is a bug and
// throws). Values are validated: "GDN_STRICT_KERNELS=yes please" is an error naming the knob.
bool get_bool(std::string_view name);
int64_t get_int(std::string_view name);
double get_float(std::string_view name);
std::string get_string(std::string_view name);
// For families: get_family("GDN_OP_", "RMSNORM") reads GDN_OP_RMSNORM; empty if unset.
std::optional<std::string> get_family(std::string_view prefix, std::string_view suffix);

// The current textual value (environment or default) of a declared knob.
std::string current_text(const Knob& k);

// Validates every set GDN_* variable: values of known knobs parse, a knob that became a run config
// key is an error naming the key, other unknown names get a warning naming the closest known knob.
// Called once by the CLI at start-up; returns the warnings printed.
int check_environment();

// Forgets cached read-once values (tests only).
void reset_cache_for_testing();

// Edit distance, used for "did you mean" suggestions.
size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace gdn::env
