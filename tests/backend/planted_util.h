// What the fault-injection tests of the shape-class probes share (test_probe_classes_*.cpp): a
// planted implementation is a deliberately wrong CPU implementation registered above the real one,
// wrapping it and corrupting its output in one class only. Implementations cannot be unregistered,
// so each is armed only while a test runs (otherwise its supports() declines), and every test
// starts and ends with clear_resolutions().
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <string_view>

#include "gdn/backend/registry.h"

namespace gdn::testing {

inline std::atomic<bool> g_planted_armed{false};

// The planted implementations' capability check.
inline std::string planted_armed(const OpQuery&) {
  return g_planted_armed ? "" : "planted for a test; not armed";
}

// The real CPU implementation's table (the highest-priority one that is not planted).
template <class Table>
const Table& real_cpu(std::string_view op) {
  for (const ImplDesc* i : Registry::global().impls(op, Backend::Cpu))
    if (!i->name.starts_with("cpu.planted")) return *static_cast<const Table*>(i->table);
  throw std::runtime_error("no cpu implementation of " + std::string(op));
}

// Adds 1 + |x| / 2 to elements [begin, end) of an F32 host tensor (all of them by default).
inline void corrupt(const Tensor& t, int64_t begin = 0, int64_t end = -1) {
  float* p = t.ptr<float>();
  if (end < 0) end = t.numel();
  for (int64_t i = begin; i < end; ++i) p[i] += 1.0f + 0.5f * std::abs(p[i]);
}

inline ShapeClass cpu_class() { return ShapeClass(Backend::Cpu); }

// Arms the planted implementations for the test; `Register` adds them (once per process).
template <void (*Register)()>
class PlantedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("GDN_STRICT_KERNELS");
    Register();
    Registry::global().clear_resolutions();
    g_planted_armed = true;
  }
  void TearDown() override {
    g_planted_armed = false;
    Registry::global().clear_resolutions();
  }

  // `planted` is rejected at class `c` (its probe line names it) and a real implementation chosen.
  static void expect_rejected(std::string_view op, const ShapeClass& c, std::string_view planted) {
    const OpQuery q = c.query();
    const Resolution& r = Registry::global().resolve(op, q);
    SCOPED_TRACE(std::string(op) + "[" + q.shape_class + "]");
    EXPECT_NE(r.impl->name, planted);
    EXPECT_FALSE(r.impl->name.starts_with("cpu.planted")) << r.impl->name;
    bool named = false;
    for (const std::string& line : r.rejected)
      named = named || (line.find(std::string(planted)) != std::string::npos &&
                        line.find("rejecting") != std::string::npos);
    EXPECT_TRUE(named) << "the probe did not reject " << planted;
  }
  // `planted` is chosen at class `c` (where it is correct).
  static void expect_accepted(std::string_view op, const ShapeClass& c, std::string_view planted) {
    const OpQuery q = c.query();
    const Resolution& r = Registry::global().resolve(op, q);
    SCOPED_TRACE(std::string(op) + "[" + q.shape_class + "]");
    EXPECT_EQ(r.impl->name, planted);
  }
};

}  // namespace gdn::testing
