// Counter-based random numbers (Philox-4x32-10, Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11). A value is a pure function of (seed, stream, index), so every tensor's
// initial values are reproducible from the seed alone, in any order, on any number of threads,
// and identical on CPU and GPU. `stream` is usually stream_id(tensor name).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "gdn/core/tensor.h"

namespace gdn::rng {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// 64-bit FNV-1a of a name: a stable stream id for a tensor.
uint64_t stream_id(std::string_view name);

// Uniform in [0, 1) with 24 random bits (exactly representable in float).
float uniform(uint64_t seed, uint64_t stream, uint64_t index);
// Standard normal (Box-Muller on two uniforms of the same counter).
float normal(uint64_t seed, uint64_t stream, uint64_t index);
// Uniform in [0, 2^32).
uint32_t bits(uint64_t seed, uint64_t stream, uint64_t index);

// Fill a contiguous host float tensor (F64/F32/BF16/F16).
void fill_uniform(const Tensor& t, uint64_t seed, uint64_t stream, double lo, double hi);
void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std);

// Device fills, installed by the CUDA runtime (src/backend/cuda/rng_init.cu) so that a model's
// parameters can be initialised where they live (launch-to-first-step time, issue 8). The Philox
// draws are the host's bit for bit; the Box-Muller and log transforms run in double on both sides,
// where the GPU's log/cos may differ from the host libm in the last bit of a double, so a value
// can (rarely) differ by one float ulp from the host fill. Each writes F32:
//   normal:      p[i] = float(scale * double(normal(seed, stream, i)))
//   log_uniform: p[i] = float(log(lo + (hi - lo) * double(uniform(seed, stream, i))))
//   constant:    p[i] = value
struct DeviceFillHooks {
  void (*normal)(float* p, int64_t n, uint64_t seed, uint64_t stream, double scale) = nullptr;
  void (*log_uniform)(float* p, int64_t n, uint64_t seed, uint64_t stream, double lo,
                      double hi) = nullptr;
  void (*constant)(float* p, int64_t n, float value) = nullptr;
};
void set_device_fill_hooks(const DeviceFillHooks& hooks);
// The installed hooks; throws when there are none (no CUDA runtime or no GPU).
const DeviceFillHooks& device_fill_hooks();

}  // namespace gdn::rng
