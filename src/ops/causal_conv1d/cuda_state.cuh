// Pieces shared by the causal conv1d CUDA implementations (cuda.cu "cuda.tiled" and
// cuda_sliding_window.cu "cuda.sliding_window"): the fp32 sigmoid both use (so their SiLU values
// agree), the small kernels over (document, channel) for the states plus the deterministic second
// pass of the dweight / dbias reduction, and the host-side helpers (tensor pointers, the width
// dispatch, the common shape checks). Included by those two translation units only; each gets its
// own copy (unnamed namespace), so the kernels need no exported symbols.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/memory_bound.cuh"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/error.h"
#include "gdn/core/tensor.h"
#include "ops/causal_conv1d/op.h"

namespace gdn::ops {
namespace {

using cuda::bf16_t;

__device__ __forceinline__ float to_f(bf16_t h) { return __bfloat162float(h); }

// 1 / (1 + exp(-z)) with the fast exp2 and reciprocal (the same values as
// __fdividef(1.f, 1.f + __expf(-z))): ex2.approx.ftz flushes results below 2^-126 to zero where
// __expf's non-ftz form keeps them denormal at three more instructions, and 1 + e rounds to 1 for
// both.
__device__ __forceinline__ float sigmoid(float z) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  return __fdividef(1.f, 1.f + e);
}

// z = bias + sum_j w[j] e[j] over a lane's NC channels, taps in order: every kernel of both
// implementations forms the pre-activation in this one order, so their outputs agree bit for bit.
template <int W, int NC>
__device__ __forceinline__ void preact(const float (&wr)[W][NC], const float (&br)[NC],
                                       const float (&e)[W][NC], float (&z)[NC]) {
#pragma unroll
  for (int v = 0; v < NC; ++v) {
    z[v] = br[v];
#pragma unroll
    for (int j = 0; j < W; ++j) z[v] = fmaf(wr[j][v], e[j][v], z[v]);
  }
}

// final_state[n, c, k] = ext[L + k]: the last W-1 inputs of document n, the initial state (or
// zeros) in front when L < W-1. Copies bits. One thread per (document, channel).
template <int W>
__global__ void __launch_bounds__(256)
    conv_final_state_kernel(const bf16_t* __restrict__ x,     // [T, C]
                            const int32_t* __restrict__ cu,   // [N+1] or null
                            const bf16_t* __restrict__ init,  // [N, C, W-1] or null
                            bf16_t* __restrict__ fin,         // [N, C, W-1]
                            int64_t T, int64_t C, int N) {
  constexpr int S = W - 1;
  const int64_t total = static_cast<int64_t>(N) * C;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int n = static_cast<int>(idx / C);
    const int64_t c = idx % C;
    const int64_t s = cu != nullptr ? __ldg(cu + n) : 0, e = cu != nullptr ? __ldg(cu + n + 1) : T;
    const int64_t L = e > s ? e - s : 0;
#pragma unroll
    for (int k = 0; k < S; ++k) {
      const int64_t m = L + k;  // extended index
      bf16_t v = __float2bfloat16_rn(0.f);
      if (m >= S) {
        const int64_t p = s + m - S;
        if (p >= 0 && p < T) v = x[p * C + c];
      } else if (init != nullptr) {
        v = init[idx * S + m];
      }
      fin[idx * S + k] = v;
    }
  }
}

// dweight[c, j] += sum_b partial[b, j, c] (j < W), dbias[c] += sum_b partial[b, W, c], b in order.
// Launched as a programmatic dependent of the backward kernel that wrote the partials
// (launch_dw_reduce): its blocks wait on the device (pdl_wait) instead of behind a drain and a
// launch. The partials are loaded 8 at a time before they are added (a plain loop over b waited
// for each load in turn); the sum is the same sequence of additions.
__global__ void __launch_bounds__(256)
    conv_dw_reduce_kernel(const float* __restrict__ partial,  // [G, W+1, C]
                          float* __restrict__ dw,             // [C, W]
                          float* __restrict__ db,             // [C] or null
                          int G, int W, int64_t C) {
  cuda::pdl_wait();  // the partials of the kernel before
  const int64_t total = static_cast<int64_t>(W + 1) * C;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(idx / C);
    const int64_t c = idx % C;
    if (j == W && db == nullptr) continue;
    const float* col = partial + static_cast<int64_t>(j) * C + c;
    const int64_t step = static_cast<int64_t>(W + 1) * C;  // one block's row set
    float sum = 0.f;
    int b = 0;
    for (; b + 8 <= G; b += 8) {
      float v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = col[(b + u) * step];
#pragma unroll
      for (int u = 0; u < 8; ++u) sum += v[u];
    }
    for (; b < G; ++b) sum += col[b * step];
    if (j < W)
      dw[c * W + j] += sum;
    else
      db[c] += sum;
  }
}

// dinitial_state[n, c, k] = dext[k] = sum_{j <= k, k-j < L} w[j] u[k-j] + dfinal_state[n, c, k-L]
// (the last term for k >= L): u of the document's first min(L, W-1) tokens, recomputed. Zero-length
// documents get dfinal_state (or zeros). One thread per (document, channel).
template <int W>
__global__ void __launch_bounds__(256)
    conv_dinit_kernel(const bf16_t* __restrict__ x,     // [T, C]
                      const bf16_t* __restrict__ w,     // [C, W]
                      const bf16_t* __restrict__ bias,  // [C] or null
                      const int32_t* __restrict__ cu,   // [N+1] or null
                      const bf16_t* __restrict__ init,  // [N, C, W-1]
                      const bf16_t* __restrict__ dy,    // [T, C]
                      const bf16_t* __restrict__ dfin,  // [N, C, W-1] or null
                      bf16_t* __restrict__ dinit,       // [N, C, W-1]
                      int64_t T, int64_t C, int N, bool silu) {
  constexpr int S = W - 1;
  const int64_t total = static_cast<int64_t>(N) * C;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = idx % C;
    const int64_t s = cu != nullptr ? __ldg(cu + idx / C) : 0;
    const int64_t e = cu != nullptr ? __ldg(cu + idx / C + 1) : T;
    const int64_t L = e > s ? e - s : 0;
    float wr[W], b = bias != nullptr ? to_f(bias[c]) : 0.f;
#pragma unroll
    for (int j = 0; j < W; ++j) wr[j] = to_f(w[c * W + j]);
    float u[S];
#pragma unroll
    for (int q = 0; q < S; ++q) {
      u[q] = 0.f;
      if (q < L) {
        float z = b;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const int m = q + j;  // extended index
          float v = 0.f;
          if (m < S) {
            if (init != nullptr) v = to_f(init[idx * S + m]);
          } else {
            const int64_t p = s + m - S;
            if (p >= 0 && p < T) v = to_f(x[p * C + c]);
          }
          z = fmaf(wr[j], v, z);
        }
        const int64_t p = s + q;
        float g = p >= 0 && p < T ? to_f(dy[p * C + c]) : 0.f;
        if (silu) {
          const float sg = sigmoid(z);
          g *= sg * (1.f + z * (1.f - sg));
        }
        u[q] = g;
      }
    }
#pragma unroll
    for (int k = 0; k < S; ++k) {
      float v = 0.f;
#pragma unroll
      for (int j = 0; j <= k; ++j) v = fmaf(wr[j], u[k - j], v);
      if (dfin != nullptr && k >= L) v += to_f(dfin[idx * S + (k - L)]);
      dinit[idx * S + k] = __float2bfloat16_rn(v);
    }
  }
}

// --- host side ---------------------------------------------------------------------------------

// A bf16 tensor's device pointer, or null when the tensor is absent.
inline const bf16_t* dev_in(const Tensor& t) {
  return t.defined() ? reinterpret_cast<const bf16_t*>(t.ptr<bf16>()) : nullptr;
}
inline bf16_t* dev_out(const Tensor& t) { return const_cast<bf16_t*>(dev_in(t)); }

// Calls f(std::integral_constant<int, W>) for the run-time width W in 1..MaxW (op.cpp validates
// W <= 8; an implementation covering fewer widths passes its own MaxW). `impl` names it in the
// error.
template <int MaxW, int W = 1, class F>
void with_width(int64_t w, const char* impl, F&& f) {
  if constexpr (W > MaxW) {
    GDN_FAIL("causal_conv1d ({}): width W = {} is outside 1..{}", impl, w, MaxW);
  } else if (w == W) {
    f(std::integral_constant<int, W>{});
  } else {
    with_width<MaxW, W + 1>(w, impl, std::forward<F>(f));
  }
}

// Grid of a one-thread-per-item kernel (grid-stride beyond 65536 blocks).
inline unsigned small_grid(int64_t items) {
  return static_cast<unsigned>(std::clamp<int64_t>((items + 255) / 256, 1, 65536));
}

// The sizes every implementation reads off its arguments, checked the same way.
struct ConvDims {
  int64_t T, C, W, N;
  const int32_t* cu;  // [N+1] or null
};

inline ConvDims conv_dims(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens,
                          const char* impl) {
  ConvDims k;
  k.T = x.size(0);
  k.C = x.size(1);
  k.W = weight.size(1);
  k.N = causal_conv1d_num_docs(cu_seqlens);
  k.cu = cu_seqlens.defined() ? cu_seqlens.ptr<int32_t>() : nullptr;
  // A host cu_seqlens was validated by op.cpp; a device one with no document cannot end at T > 0.
  GDN_CHECK(k.T == 0 || k.N >= 1,
            "causal_conv1d: tensor 'cu_seqlens' has no document but 'x' has {} rows", k.T);
  GDN_CHECK(k.N <= INT_MAX, "causal_conv1d ({}): {} documents is too many", impl, k.N);
  return k;
}

// The blocks of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) that fit on
// the device at once: the size of a persistent grid. Raises the kernel's dynamic shared-memory
// limit to `smem` and asks for the largest carveout first (host-side attributes of the current
// device, no synchronisation; set on every call so that each device a process uses gets them):
// the grid assumes the residency the occupancy query reports.
inline int64_t resident_blocks(const void* kernel, int threads, size_t smem) {
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  int per_sm = 0;
  GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return static_cast<int64_t>(cuda::Context::get().sm_count()) * std::max(per_sm, 1);
}

// The forward's tensors as device pointers (null where absent).
struct ConvFwdPtrs {
  const bf16_t* x;     // [T, C]
  const bf16_t* w;     // [C, W]
  const bf16_t* bias;  // [C] or null
  const bf16_t* init;  // [N, C, W-1] or null
  bf16_t* y;           // [T, C]
  bf16_t* fin;         // [N, C, W-1] or null
};

inline ConvFwdPtrs conv_fwd_ptrs(const CausalConv1dFwd& a) {
  return {dev_in(a.x),  dev_in(a.weight),      dev_in(a.bias), dev_in(a.initial_state),
          dev_out(a.y), dev_out(a.final_state)};
}

// The final states after a forward's main kernel (width W > 1, N documents), on `s`.
template <int W>
void launch_final_state(const ConvFwdPtrs& p, const ConvDims& k, cudaStream_t s) {
  const int N = static_cast<int>(k.N);
  if (p.fin == nullptr || W <= 1 || N <= 0) return;
  conv_final_state_kernel<W>
      <<<small_grid(k.N * k.C), 256, 0, s>>>(p.x, k.cu, p.init, p.fin, k.T, k.C, N);
  GDN_CUDA_LAUNCH_CHECK("conv_final_state_kernel");
}

// The backward's tensors as device pointers (null where absent).
struct ConvBwdPtrs {
  const bf16_t* x;     // [T, C]
  const bf16_t* w;     // [C, W]
  const bf16_t* bias;  // [C] or null
  const bf16_t* init;  // [N, C, W-1] or null
  const bf16_t* dy;    // [T, C]
  const bf16_t* dfin;  // [N, C, W-1] or null
  bf16_t* dx;          // [T, C]
  bf16_t* dinit;       // [N, C, W-1] or null
  float* dw;           // [C, W]
  float* db;           // [C] or null
};

inline ConvBwdPtrs conv_bwd_ptrs(const CausalConv1dBwd& a) {
  return {dev_in(a.x),
          dev_in(a.weight),
          dev_in(a.bias),
          dev_in(a.initial_state),
          dev_in(a.dy),
          dev_in(a.dfinal_state),
          dev_out(a.dx),
          dev_out(a.dinitial_state),
          a.dweight.ptr<float>(),
          a.dbias.defined() ? a.dbias.ptr<float>() : nullptr};
}

// dweight / dbias += the sum of a backward kernel's G partial row sets, in block order.
template <int W>
void launch_dw_reduce(const ConvBwdPtrs& p, const ConvDims& k, const float* partial, int64_t G,
                      cudaStream_t s) {
  cuda::launch_pdl(conv_dw_reduce_kernel, dim3(small_grid((W + 1) * k.C)), dim3(256), s, partial,
                   p.dw, p.db, static_cast<int>(G), static_cast<int>(W), k.C);
  GDN_CUDA_LAUNCH_CHECK("conv_dw_reduce_kernel (programmatic dependent)");
}

// dinitial_state, when asked for (W = 1: the state has no columns).
template <int W>
void launch_dinit(const ConvBwdPtrs& p, const ConvDims& k, bool silu, cudaStream_t s) {
  if constexpr (W > 1) {
    if (p.dinit == nullptr || k.N == 0) return;
    conv_dinit_kernel<W><<<small_grid(k.N * k.C), 256, 0, s>>>(p.x, p.w, p.bias, k.cu, p.init, p.dy,
                                                               p.dfin, p.dinit, k.T, k.C,
                                                               static_cast<int>(k.N), silu);
    GDN_CUDA_LAUNCH_CHECK("conv_dinit_kernel");
  }
}

}  // namespace
}  // namespace gdn::ops
