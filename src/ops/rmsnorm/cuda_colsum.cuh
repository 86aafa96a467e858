// The dw partial-row sum of the norm backwards (rmsnorm cuda.bulkp2, gated_rmsnorm
// cuda.rowwise_pf) launched as a programmatic dependent of the kernel that writes the partials.
//
// Why: the plain second launch (column_sum_add_kernel, memory_bound.cuh) starts only after the
// main kernel has drained, then pays its own launch and a chain of dependent loads (8 slices of
// P = 132 rows: 17 loads a thread in two unrolled batches). Launched with programmatic stream
// serialisation, its blocks are created while the main kernel still runs, sit on the
// multiprocessors that the main kernel's blocks have left (griddepcontrol.wait) and start the
// moment the last main block has ended and its stores are visible. 32 slices a column (1024
// threads a block) leave about 4 loads a thread at P = 132, all issued before their first use.
// Deterministic: each column is summed in a fixed order (slice ty adds rows ty, ty + 32, ... in
// order, then the slices in slice order), which depends only on P and D.
//
// The main kernel should call pdl_launch_dependents() early (any point; without it the dependent
// grid is launched when the main kernel's blocks end). griddepcontrol.wait waits for the whole
// primary grid and the visibility of its memory operations, so no other synchronisation is needed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gdn/backend/cuda_check.h"

namespace gdn::ops::norm_pdl {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

constexpr int kSlices = 32;

// out[col] += sum over p < P of partial[p, col]; grid ceil(D / 32), 32 * kSlices threads. A
// template only so that the header may define it in several translation units.
template <int S = kSlices>
__global__ void __launch_bounds__(32 * S)
    column_sum_add_pdl_kernel(const float* __restrict__ partial,  // [P, D]
                              float* __restrict__ out,            // [D]
                              int P, int D) {
  __shared__ float s[S][33];
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  const int col = static_cast<int>(blockIdx.x) * 32 + tx;
  pdl_wait();  // the partial rows of the primary grid
  float acc = 0.f;
  if (col < D) {
#pragma unroll 8
    for (int p = ty; p < P; p += S) acc += partial[static_cast<int64_t>(p) * D + col];
  }
  s[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < D) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < S; ++j) t += s[j][tx];  // fixed order
    out[col] += t;
  }
}

// Launches column_sum_add_pdl_kernel on `s` as a programmatic dependent of the previous launch.
inline void launch_column_sum_add_pdl(const float* partial, float* out, int P, int D,
                                      cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>((D + 31) / 32));
  cfg.blockDim = dim3(32 * kSlices);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  GDN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, column_sum_add_pdl_kernel<kSlices>, partial, out, P, D));
  GDN_CUDA_LAUNCH_CHECK("column_sum_add_pdl_kernel");
}

}  // namespace gdn::ops::norm_pdl
