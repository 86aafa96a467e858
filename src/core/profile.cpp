#include "gdn/core/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "gdn/core/error.h"

namespace gdn {

namespace {
ProfileHooks g_hooks;
thread_local Profiler* g_active = nullptr;
}  // namespace

void set_profile_hooks(const ProfileHooks& hooks) { g_hooks = hooks; }

Profiler* active_profiler() { return g_active; }
void set_active_profiler(Profiler* p) { g_active = p; }

Profiler::Profiler(Device device) : device_(device) {
  GDN_CHECK(device_ == Device::CPU || g_hooks.event_create != nullptr,
            "profiler: no CUDA event hooks (this build has no CUDA runtime or no GPU)");
  ranges_.reserve(1024);
}

Profiler::~Profiler() {
  if (g_active == this) g_active = nullptr;
  for (Range& r : ranges_) {
    if (r.ev0 != nullptr) g_hooks.event_destroy(r.ev0);
    if (r.ev1 != nullptr) g_hooks.event_destroy(r.ev1);
  }
}

void Profiler::begin(const char* name) {
  GDN_CHECK(!open_, "profiler: range '{}' begins inside range '{}' (ranges are flat)", name,
            ranges_.empty() ? "" : ranges_.back().name);
  Range r;
  r.name = name;
  if (device_ == Device::CUDA) {
    r.ev0 = g_hooks.event_create();
    r.ev1 = g_hooks.event_create();
    g_hooks.event_record(r.ev0);
  } else {
    r.t0 = std::chrono::steady_clock::now();
  }
  ranges_.push_back(r);
  open_ = true;
}

void Profiler::end() {
  GDN_CHECK(open_, "profiler: end() without begin()");
  Range& r = ranges_.back();
  if (device_ == Device::CUDA)
    g_hooks.event_record(r.ev1);
  else
    r.t1 = std::chrono::steady_clock::now();
  open_ = false;
}

std::vector<Profiler::Row> Profiler::rows() {
  GDN_CHECK(!open_, "profiler: range '{}' still open", ranges_.back().name);
  if (device_ == Device::CUDA && !ranges_.empty()) g_hooks.event_synchronize(ranges_.back().ev1);
  std::vector<Row> out;
  std::map<std::string, size_t> at;
  for (const Range& r : ranges_) {
    const double ms = device_ == Device::CUDA
                          ? static_cast<double>(g_hooks.elapsed_ms(r.ev0, r.ev1))
                          : std::chrono::duration<double, std::milli>(r.t1 - r.t0).count();
    auto [it, fresh] = at.try_emplace(r.name, out.size());
    if (fresh) out.push_back({r.name, 0, 0});
    out[it->second].calls += 1;
    out[it->second].ms += ms;
  }
  return out;
}

std::string format_profile(const std::vector<Profiler::Row>& rows, double step_ms) {
  std::vector<Profiler::Row> sorted = rows;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Profiler::Row& a, const Profiler::Row& b) { return a.ms > b.ms; });
  double sum = 0;
  std::string s = fmt::format("{:<22} {:>6} {:>10} {:>7}\n", "range", "calls", "ms", "share");
  const double denom = step_ms > 0 ? step_ms : 1;
  for (const auto& r : sorted) {
    s += fmt::format("{:<22} {:>6} {:>10.3f} {:>6.1f}%\n", r.name, r.calls, r.ms,
                     100.0 * r.ms / denom);
    sum += r.ms;
  }
  s += fmt::format("{:<22} {:>6} {:>10.3f} {:>6.1f}%\n", "other (outside ranges)", "",
                   std::max(0.0, step_ms - sum), 100.0 * std::max(0.0, step_ms - sum) / denom);
  s += fmt::format("{:<22} {:>6} {:>10.3f} {:>6.1f}%", "step (wall)", "", step_ms, 100.0);
  return s;
}

}  // namespace gdn
