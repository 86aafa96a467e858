// The gated delta rule's swept test shapes, shared by the cpu test (test_gated_delta_rule.cpp) and
// the CUDA ones (gdr_cuda_test_util.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gdn/core/rng.h"

namespace gdn::ops::gdr_test {

struct Spec {
  std::string name;
  std::vector<int32_t> lens;
  int64_t Hk = 1, r = 1, dk = 16, dv = 24;
  double g_lo = -1.0, g_hi = 0.0;  // g ~ U(g_lo, g_hi)
  double b_lo = 0.0, b_hi = 1.0;   // beta ~ U(b_lo, b_hi)
  bool init = true;                // h0 given
  bool dhT = true;                 // dhT given
  uint64_t seed = 1;
};

inline std::vector<int32_t> random_lens(int n, int lo, int hi, uint64_t seed) {
  std::vector<int32_t> l;
  for (int i = 0; i < n; ++i)
    l.push_back(lo + static_cast<int32_t>(rng::bits(seed, 5, static_cast<uint64_t>(i)) %
                                          static_cast<uint32_t>(hi - lo + 1)));
  return l;
}

// The shapes both backends sweep: partial chunks, 1-token and many documents, r in {1, 2, 3},
// strong and no decay, beta near 0 and 1, no initial state, dk != dv. fifty_docs_max_len bounds
// the lengths of the 50-document case (the cpu test keeps its fp64 reference short).
inline std::vector<Spec> common_sweep_specs(int fifty_docs_max_len) {
  std::vector<Spec> s;
  s.push_back({.name = "T37_lt_chunk", .lens = {37}, .Hk = 2, .r = 1});
  s.push_back({.name = "T64_one_chunk", .lens = {64}, .Hk = 1, .r = 2, .seed = 2});
  s.push_back({.name = "T150_partial_r3", .lens = {150}, .Hk = 1, .r = 3, .seed = 3});
  s.push_back({.name = "one_token_docs", .lens = {1, 1, 5, 1, 1}, .Hk = 2, .r = 2, .seed = 4});
  s.push_back({.name = "fifty_docs",
               .lens = random_lens(50, 1, fifty_docs_max_len, 9),
               .Hk = 1,
               .r = 2,
               .seed = 5});
  s.push_back({.name = "strong_decay",
               .lens = {100},
               .Hk = 1,
               .r = 2,
               .g_lo = -21,
               .g_hi = -19,
               .seed = 6});
  s.push_back(
      {.name = "no_decay", .lens = {100}, .Hk = 2, .r = 1, .g_lo = 0, .g_hi = 0, .seed = 7});
  s.push_back({.name = "beta_near_0", .lens = {90}, .r = 2, .b_lo = 0, .b_hi = 1e-3, .seed = 8});
  s.push_back({.name = "beta_near_1", .lens = {90}, .r = 2, .b_lo = 0.999, .b_hi = 1.0, .seed = 9});
  s.push_back({.name = "no_initial_state",
               .lens = {70, 3},
               .r = 2,
               .init = false,
               .dhT = false,
               .seed = 10});
  s.push_back(
      {.name = "dk24_dv16_r3", .lens = {80, 17}, .Hk = 2, .r = 3, .dk = 24, .dv = 16, .seed = 11});
  return s;
}

}  // namespace gdn::ops::gdr_test
