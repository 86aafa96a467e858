// An fp32 value stored as two 16-bit halves: `hi`, a bf16 close to it, and `lo`, a signed 16-bit
// remainder, with the fp32 bit pattern x = (hi << 16) + lo exactly (modulo 2^32). The cuda trainer
// keeps its fp32 master weights this way: hi is the bf16 compute copy the forward reads, lo the
// extra 2 bytes per parameter, so the master weights cost 4 bytes a parameter instead of 4 + 2
// (fp32 master and a separate bf16 copy) and every update stays exactly the fp32 update.
//
// hi = (x + 0x8000) >> 16 on the bit pattern: round to nearest with ties away from zero (the
// magnitude bits are rounded; a carry moves into the exponent as a bf16 rounding does). That is
// bf16 round-to-nearest-even except at exact ties (1 pattern in 65536), where it rounds up in
// magnitude; the remainder x - (hi << 16) then lies in [-0x8000, 0x7fff] and fits an int16.
// (Ties-to-even would need the remainder +0x8000 as well: 65537 values, one more than 16 bits.)
// Finite values and +-inf round-trip exactly; values above the largest bf16 get hi = inf with the
// exact remainder. NaN keeps a NaN hi (the trainer never updates with a non-finite step).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define GDN_SPLIT_HD __host__ __device__ __forceinline__
#else
#define GDN_SPLIT_HD inline
#endif

namespace gdn {

GDN_SPLIT_HD uint16_t split_hi(uint32_t bits) {
  return static_cast<uint16_t>((bits + 0x8000u) >> 16);
}
GDN_SPLIT_HD int16_t split_lo(uint32_t bits, uint16_t hi) {
  return static_cast<int16_t>(static_cast<uint16_t>(bits - (static_cast<uint32_t>(hi) << 16)));
}
GDN_SPLIT_HD uint32_t split_join(uint16_t hi, int16_t lo) {
  return (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(lo));
}

}  // namespace gdn
