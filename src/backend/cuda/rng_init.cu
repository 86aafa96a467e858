// Device fills for parameter initialisation (include/gdn/core/rng.h, DeviceFillHooks): the host's
// Philox-4x32-10 counter draws (include/gdn/core/philox.h, shared with src/core/rng.cpp) on the
// GPU, so a model's fp32 master weights are initialised where they live instead of on the host and
// copied (issue 8: launch to first step). Hand-written: cuRAND's Philox uses its own counter layout
// and transforms, which would not reproduce the host's values.
#include <cuda_runtime.h>

#include <cstdint>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/philox.h"
#include "gdn/core/rng.h"

namespace gdn::cuda {
namespace {

__device__ __forceinline__ uint4 philox(uint64_t seed, uint64_t stream, uint64_t index) {
  const rng::detail::Philox4 r = rng::detail::draw(seed, stream, index);
  return make_uint4(r.v[0], r.v[1], r.v[2], r.v[3]);
}

__global__ void normal_kernel(float* __restrict__ p, int64_t n, uint64_t seed, uint64_t stream,
                              double scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 r = philox(seed, stream, static_cast<uint64_t>(i));
    const double u1 = (static_cast<double>(r.x >> 8) + 1.0) * (1.0 / 16777216.0);
    const double u2 = static_cast<double>(r.y >> 8) * (1.0 / 16777216.0);
    // As on the host: the standard normal rounded to float, then scaled in double.
    const float z = static_cast<float>(
        __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(6.283185307179586, u2))));
    p[i] = static_cast<float>(__dmul_rn(scale, static_cast<double>(z)));
  }
}

__global__ void log_uniform_kernel(float* __restrict__ p, int64_t n, uint64_t seed, uint64_t stream,
                                   double lo, double hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 r = philox(seed, stream, static_cast<uint64_t>(i));
    const float u = static_cast<float>(r.x >> 8) * (1.0f / 16777216.0f);
    p[i] = static_cast<float>(log(__dadd_rn(lo, __dmul_rn(hi - lo, static_cast<double>(u)))));
  }
}

__global__ void constant_kernel(float* __restrict__ p, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

constexpr int kThreads = 256;
unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 8192 ? (b > 0 ? b : 1) : 8192);
}

void fill_normal(float* p, int64_t n, uint64_t seed, uint64_t stream, double scale) {
  if (n <= 0) return;
  normal_kernel<<<blocks_for(n), kThreads, 0, cuda::stream()>>>(p, n, seed, stream, scale);
  GDN_CUDA_CHECK(cudaGetLastError());
}
void fill_log_uniform(float* p, int64_t n, uint64_t seed, uint64_t stream, double lo, double hi) {
  if (n <= 0) return;
  log_uniform_kernel<<<blocks_for(n), kThreads, 0, cuda::stream()>>>(p, n, seed, stream, lo, hi);
  GDN_CUDA_CHECK(cudaGetLastError());
}
void fill_constant(float* p, int64_t n, float value) {
  if (n <= 0) return;
  constant_kernel<<<blocks_for(n), kThreads, 0, cuda::stream()>>>(p, n, value);
  GDN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

// Called by the runtime's hook installation (runtime.cu) once a device is known to be present:
// static initialisers of different files run in no fixed order.
void install_device_fill_hooks() {
  rng::DeviceFillHooks h;
  h.normal = fill_normal;
  h.log_uniform = fill_log_uniform;
  h.constant = fill_constant;
  rng::set_device_fill_hooks(h);
}

}  // namespace gdn::cuda
