// Shared pieces of the memory-bound CUDA kernels (gated_rmsnorm, l2norm, swiglu, axpy, gdn_gates,
// embedding, adamw), on top of vec.cuh: alignment checks, loads that stay correct when an output
// aliases an input, the row layout of the row-wise norms with its group reduction, and the
// deterministic column sum that turns per-block partial rows into one accumulated row.
//
// Everything here is deterministic: every sum adds the same numbers in the same order on every
// run (butterfly shuffles, fixed shared-memory orders, no float atomics).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"

namespace gdn::cuda {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Coherent (plain ld.global) load of a pack: for inputs that the same kernel may overwrite (an
// in-place output aliasing them). __ldg's non-coherent path is only valid for data that is
// read-only for the whole kernel.
template <int V>
__device__ __forceinline__ Pack<V> load_pack_coherent(const bf16_t* p, int64_t i) {
  Pack<V> r;
  if constexpr (V == 8) {
    r.u = *reinterpret_cast<const uint4*>(p + i);
  } else {
    r.u = *reinterpret_cast<const unsigned short*>(p + i);
  }
  return r;
}

// --- row-wise norms ----------------------------------------------------------------------------
// A row of D elements is owned by a "row group" of tpr threads (a power of two in [1, kBlock]),
// groups aligned to tpr inside the block. Thread `lane` of a group owns the packs
// c = lane + k * tpr (k < P) of the row and keeps them in registers between the reduction and the
// output pass; packs past P * tpr (only when tpr = kBlock) are re-read. Consecutive lanes own
// consecutive 16-byte packs, so every load instruction of a warp covers whole 32-byte sectors.

// Packs kept in registers per thread: 16 elements with 16-byte packs, 8 with scalar ones.
template <int V>
constexpr int row_packs_per_thread() {
  return V == 8 ? 2 : 8;
}

struct RowLayout {
  int vec;  // elements per pack: 8 (D % 8 == 0 and every pointer 16-byte aligned) or 1
  int tpr;  // threads per row
  int rpb;  // rows per block = block / tpr
};

// The smallest tpr whose register-held packs cover the row (capped at `block`).
inline RowLayout row_layout(int64_t D, bool vec_ok, int block) {
  RowLayout l;
  l.vec = vec_ok && D % 8 == 0 ? 8 : 1;
  const int64_t per_thread = l.vec == 8 ? row_packs_per_thread<8>() : row_packs_per_thread<1>();
  const int64_t need = (D / l.vec + per_thread - 1) / per_thread;
  l.tpr = 1;
  while (l.tpr < need && l.tpr < block) l.tpr *= 2;
  l.rpb = block / l.tpr;
  return l;
}

// Sum of v over the tpr threads of the caller's row group, in every thread of the group,
// bit-identical across the group (a butterfly adds the same two numbers in both partners).
// tpr must be uniform over the block and every thread of the block must call this (inactive
// rows too): the shuffles use the full warp mask and, for tpr > 32, it holds barriers and goes
// through `red` (blockDim.x / 32 floats of shared memory).
__device__ __forceinline__ float group_allreduce_sum(float v, int tpr, float* red) {
  if (tpr <= 32) {
    for (int m = tpr >> 1; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
  }
  v = warp_allreduce_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  const int wpr = tpr >> 5, first = static_cast<int>(threadIdx.x / tpr) * wpr;
  float s = 0.f;
  for (int i = 0; i < wpr; ++i) s += red[first + i];  // fixed order
  __syncthreads();                                    // red is reused by the next call
  return s;
}

// This thread's part of a row's sum of squares: its P register packs xc (zeros where the row has
// no pack), then the packs c = lane + P * tpr, lane + (P + 1) * tpr, ... < npacks, re-read from
// x + off (only when active). The caller reduces it over the row group.
template <int P, int V>
__device__ __forceinline__ float row_sum_squares(const Pack<V> (&xc)[P], const bf16_t* x,
                                                 int64_t off, int lane, int tpr, int npacks,
                                                 bool active) {
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    float f[V];
    unpack(xc[k], f);
#pragma unroll
    for (int v = 0; v < V; ++v) ss += f[v] * f[v];
  }
  for (int c = lane + P * tpr; active && c < npacks; c += tpr) {
    float f[V];
    unpack(load_pack<V>(x, off + static_cast<int64_t>(c) * V), f);
#pragma unroll
    for (int v = 0; v < V; ++v) ss += f[v] * f[v];
  }
  return ss;
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialisation
// may have its blocks created while the previous kernel in the stream (the primary) still runs;
// pdl_wait (griddepcontrol.wait) returns once the primary grid has completed and its memory is
// visible, and the primary's pdl_launch_dependents lets the dependent's blocks be created early
// (without it they are created as the primary's blocks end). Without the launch attribute the wait
// returns at once. Used by embedding cuda.ranked_windows (the dW kernel after the ranks), by the
// norms' dw sum (launch_column_sum_add_pdl), by the conv backward's dweight sum, and by the gated
// delta rule's trailing output (which waits on the state pass's published chunk counts instead).
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

// out[col] += sum over p < P of partial[p, col], in a fixed order: kSlices slices of p per column
// (each in increasing p), then the slice sums in slice order. Block 32 x kSlices threads = 32
// columns x kSlices slices; grid (ceil(D / 32), planes). Plane 1 (blockIdx.y = 1, when out1 is
// given) sums partial[P + p, col] into out1: two [P, D] partial sets reduced in one launch. kPdl:
// launched as a programmatic dependent of the kernel writing the partials (waits for it first;
// launch_column_sum_add_pdl). Template only so that the header can define it.
template <int kSlices = 8, bool kPdl = false>
__global__ void __launch_bounds__(32 * kSlices)
    column_sum_add_kernel(const float* __restrict__ partial,                   // [planes, P, D]
                          float* __restrict__ out,                             // [D]
                          int P, int D, float* __restrict__ out1 = nullptr) {  // [D]
  __shared__ float s[kSlices][33];
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  const int col = static_cast<int>(blockIdx.x) * 32 + tx;
  if constexpr (kPdl) pdl_wait();  // the partial rows of the primary grid
  // One plane only with kPdl (its launcher's grid).
  const float* src = kPdl ? partial : partial + static_cast<int64_t>(blockIdx.y) * P * D;
  float acc = 0.f;
  if (col < D) {
#pragma unroll 8
    for (int p = ty; p < P; p += kSlices) acc += src[static_cast<int64_t>(p) * D + col];
  }
  s[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < D) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < kSlices; ++j) t += s[j][tx];
    (kPdl || blockIdx.y == 0 ? out : out1)[col] += t;
  }
}

// kernel<<<grid, block, smem, s>>>(args...) as a programmatic dependent of the kernel before it on
// s (its blocks may start while that one finishes; the kernel calls pdl_wait() before reading what
// that one wrote, or synchronises with it another way).
template <class... Params, class... Args>
void launch_pdl_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                     Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  GDN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}
template <class... Params, class... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t s, Args&&... args) {
  launch_pdl_smem(kernel, grid, block, 0, s, std::forward<Args>(args)...);
}

// The norm backwards' dw sum (rmsnorm cuda.sm90_bulk, gated_rmsnorm cuda.rowwise_prefetch) as a
// programmatic dependent of the kernel that wrote the partials, on `s`: its blocks sit on the
// multiprocessors the main kernel's blocks have left and start the moment the last one ends,
// instead of after a drain and a launch (measured: docs/PERF.md). 32 slices a column (1024 threads
// a block): about 4 loads a thread at P = 132, all issued before their first use. The main kernel
// should call pdl_launch_dependents() early. (A template only so that a unit instantiates the
// kernel when it calls this.)
template <int kSlices = 32>
void launch_column_sum_add_pdl(const float* partial, float* out, int P, int D, cudaStream_t s) {
  float* no_second_plane = nullptr;
  launch_pdl(column_sum_add_kernel<kSlices, true>, dim3(static_cast<unsigned>((D + 31) / 32)),
             dim3(32 * kSlices), s, partial, out, P, D, no_second_plane);
  GDN_CUDA_LAUNCH_CHECK("column_sum_add_kernel (programmatic dependent)");
}

// --- elementwise -------------------------------------------------------------------------------
// fp32 sigmoid, safe at both tails: expf(-x) overflows to +inf for x < -88.7, giving exactly 0,
// and underflows to 0 for large x, giving exactly 1; never NaN for finite x.
__device__ __forceinline__ float sigmoidf_safe(float x) { return 1.f / (1.f + expf(-x)); }

// y[i] = f(a[i], b[i]) over n bf16 elements, fp32 arithmetic, one rounding of y: the plain
// two-input maps of the unfused A/B routes (silu, mul). Grid-stride over packs of V (8: 16-byte
// accesses, when every pointer is aligned; else 1); the n % V tail element by element by block 0.
// y may alias a or b (each element is read before the one thread that owns it writes it), hence
// coherent loads and no __restrict__.
template <int V, class F>
__global__ void __launch_bounds__(256)
    map2_kernel(const bf16_t* a, const bf16_t* b, bf16_t* y, int64_t n, F f) {
  const int64_t npacks = n / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < npacks;
       i += stride) {
    float x[V], z[V], o[V];
    unpack(load_pack_coherent<V>(a, i * V), x);
    unpack(load_pack_coherent<V>(b, i * V), z);
#pragma unroll
    for (int v = 0; v < V; ++v) o[v] = f(x[v], z[v]);
    store_pack<V>(y, i * V, pack(o));
  }
  if (V > 1 && blockIdx.x == 0) {
    const int64_t j = npacks * V + threadIdx.x;
    if (threadIdx.x < V && j < n) {
      float x[1], z[1], o[1];
      unpack(load_pack_coherent<1>(a, j), x);
      unpack(load_pack_coherent<1>(b, j), z);
      o[0] = f(x[0], z[0]);
      store_pack<1>(y, j, pack(o));
    }
  }
}

// Launches map2_kernel on `s` (at most 8 blocks per SM's worth of a 132-SM device: the loop
// covers the rest).
template <class F>
void launch_map2(const bf16_t* a, const bf16_t* b, bf16_t* y, int64_t n, F f, cudaStream_t s) {
  if (n == 0) return;
  const bool vec = aligned16(a) && aligned16(b) && aligned16(y);
  const int64_t packs = vec ? n / 8 : n;
  const int64_t blocks = std::min<int64_t>(std::max<int64_t>(1, (packs + 255) / 256), 132 * 8);
  if (vec)
    map2_kernel<8><<<static_cast<unsigned>(blocks), 256, 0, s>>>(a, b, y, n, f);
  else
    map2_kernel<1><<<static_cast<unsigned>(blocks), 256, 0, s>>>(a, b, y, n, f);
}

}  // namespace gdn::cuda
