// Device helpers shared by the memory-bound kernels: packs of V bf16 values loaded and stored in
// one access (V = 8: one 16-byte access, the width Hopper's memory system wants per thread; V = 1:
// the scalar fallback for widths or addresses that are not 16-byte aligned), converted to and from
// fp32 registers, and warp reductions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace gdn::cuda {

using bf16_t = __nv_bfloat16;

// Raw storage of V consecutive bf16 values.
template <int V>
struct Pack;
template <>
struct Pack<8> {
  uint4 u;
};
template <>
struct Pack<1> {
  unsigned short u;
};

// A pack of zeros (the value of a pack outside the row).
template <int V>
__device__ __forceinline__ Pack<V> zero_pack() {
  Pack<V> r;
  if constexpr (V == 8) {
    r.u = make_uint4(0u, 0u, 0u, 0u);
  } else {
    r.u = 0;
  }
  return r;
}

// Read-only (non-coherent cache) load of the pack starting at element `i` of `p`; the address must
// be aligned to the pack (checked by the host before picking V = 8).
template <int V>
__device__ __forceinline__ Pack<V> load_pack(const bf16_t* p, int64_t i) {
  Pack<V> r;
  if constexpr (V == 8) {
    r.u = __ldg(reinterpret_cast<const uint4*>(p + i));
  } else {
    r.u = __ldg(reinterpret_cast<const unsigned short*>(p + i));
  }
  return r;
}

template <int V>
__device__ __forceinline__ void store_pack(bf16_t* p, int64_t i, const Pack<V>& v) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(p + i) = v.u;
  } else {
    *reinterpret_cast<unsigned short*>(p + i) = v.u;
  }
}

// bf16 -> fp32 is exact (the bf16 bits are the high half of the fp32 bits).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

template <int V>
__device__ __forceinline__ void unpack(const Pack<V>& p, float (&f)[V]) {
  if constexpr (V == 8) {
    const uint32_t w[4] = {p.u.x, p.u.y, p.u.z, p.u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = bf16_lo(w[k]);
      f[2 * k + 1] = bf16_hi(w[k]);
    }
  } else {
    f[0] = __uint_as_float(static_cast<uint32_t>(p.u) << 16);
  }
}

// fp32 -> bf16 rounds to nearest even (as the host's float_to_bf16_bits).
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half), .y = hi
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int V>
__device__ __forceinline__ Pack<V> pack(const float (&f)[V]) {
  Pack<V> r;
  if constexpr (V == 8) {
    r.u = make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
  } else {
    const bf16_t h = __float2bfloat16_rn(f[0]);
    r.u = *reinterpret_cast<const unsigned short*>(&h);
  }
  return r;
}

// Sum over the 32 lanes, result in every lane. The butterfly adds the same two numbers in every
// pair of partner lanes (a + b == b + a exactly), so all lanes hold bit-identical sums.
__device__ __forceinline__ float warp_allreduce_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

}  // namespace gdn::cuda
