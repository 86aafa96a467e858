// Philox-4x32-10 and the counter layout of gdn::rng (rng.h), written once for the host (rng.cpp)
// and the CUDA device fills (src/backend/cuda/rng_init.cu), so that both draw the same bits.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GDN_PHILOX_HD __host__ __device__ __forceinline__
#else
#define GDN_PHILOX_HD inline
#endif

namespace gdn::rng::detail {

struct Philox4 {
  uint32_t v[4];
};

// Ten rounds on counter c with key (k0, k1) (Salmon et al., SC'11; Random123's constants).
GDN_PHILOX_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c.v[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c.v[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = Philox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// The draw for (seed, stream, index): counter (index lo, index hi, stream lo, stream hi), key
// (seed lo, seed hi).
GDN_PHILOX_HD Philox4 draw(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32_10(
      Philox4{{static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
               static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

}  // namespace gdn::rng::detail

#undef GDN_PHILOX_HD
