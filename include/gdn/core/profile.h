// Per-op timing of one training step (`gdntrain train --profile-step N`, issue 8).
//
// A Profiler collects named ranges: ProfileRange("gdr.fwd") marks the work issued inside its scope.
// On the GPU each range is a pair of CUDA events recorded on the compute stream (the step still
// issues its kernels without waiting; the events are read once, after the step); on the CPU, where
// every op runs to completion before it returns, a steady clock. Ranges are flat: the model marks
// disjoint pieces of work, and whatever lies outside every range is reported as "other" against
// the step's wall time.
//
// Profiling is off unless a Profiler is active (set_active_profiler); a ProfileRange then costs one
// pointer test. The profiled step creates CUDA events (the only allocations it makes that an
// ordinary step does not), so its own wall time is a little longer than a steady step's.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "gdn/core/tensor.h"

namespace gdn {

// Event hooks installed by the CUDA runtime (like DeviceHooks); absent in CPU-only builds.
struct ProfileHooks {
  void* (*event_create)() = nullptr;
  void (*event_destroy)(void* e) = nullptr;
  void (*event_record)(void* e) = nullptr;  // on the compute stream
  void (*event_synchronize)(void* e) = nullptr;
  float (*elapsed_ms)(void* start, void* end) = nullptr;
};
void set_profile_hooks(const ProfileHooks& hooks);

class Profiler {
 public:
  struct Row {
    std::string name;
    int64_t calls = 0;
    double ms = 0;  // summed over calls
  };

  explicit Profiler(Device device);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  void begin(const char* name);
  void end();
  // Waits for the last range to finish, then returns the ranges summed by name, in the order each
  // name was first seen.
  std::vector<Row> rows();
  Device device() const { return device_; }

 private:
  struct Range {
    const char* name;
    void* ev0 = nullptr;
    void* ev1 = nullptr;
    std::chrono::steady_clock::time_point t0, t1;
  };
  Device device_;
  std::vector<Range> ranges_;
  bool open_ = false;
};

// The profiler the current thread's model code reports to (nullptr: profiling off).
Profiler* active_profiler();
void set_active_profiler(Profiler* p);

class ProfileRange {
 public:
  explicit ProfileRange(const char* name) : p_(active_profiler()) {
    if (p_ != nullptr) p_->begin(name);
  }
  ~ProfileRange() {
    if (p_ != nullptr) p_->end();
  }
  // Ends this range and begins the next one (a chain of ops in one scope).
  void next(const char* name) {
    if (p_ != nullptr) {
      p_->end();
      p_->begin(name);
    }
  }
  ProfileRange(const ProfileRange&) = delete;
  ProfileRange& operator=(const ProfileRange&) = delete;

 private:
  Profiler* p_;
};

// The table printed by --profile-step: one row per name (calls, ms, share of `step_ms`), the rows
// by decreasing time, then "other" (step time outside every range) and the total.
std::string format_profile(const std::vector<Profiler::Row>& rows, double step_ms);

}  // namespace gdn
