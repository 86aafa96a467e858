// The staged row pipeline shared by the "cuda.staged" row-wise norms (rmsnorm, l2norm): persistent
// blocks that walk batches of rows while cp.async copies of the next rows are in flight.
//
// Why: the register-held kernels ("cuda.rowwise") can only keep as many bytes in flight per
// multiprocessor as their registers hold (a row group's packs, at most the next row's), so at the
// bench shapes they stop at 0.57-0.75 of the copy bandwidth. Here the bytes in flight live in
// shared memory: a ring of S slots, each slot holding one batch of rows, S - 1 batches always
// requested ahead of the one being computed (48-112 KB per multiprocessor, independent of
// registers).
//
// Layout: a block of kBlock = 512 threads holds kBlock / tpr "row groups" of tpr threads (a power
// of two), one row per group per batch. Thread `lane` of a group owns the 16-byte packs
// c = lane + k * tpr (k < P, c < D / 8) of its row: the SAME columns in every row, so per-column
// values (weights, dw sums) stay in registers for the whole kernel. P = 1 while D <= 8 * kBlock
// (4096), else 2 (D <= 8192); wider rows, D % 8 != 0 and unaligned pointers are not staged (the
// ops defer those to their "cuda.rowwise" kernels).
//
// Thread-private staging: every thread copies exactly the packs it later reads (and nothing
// else), so the ring needs no block barrier: cp.async.wait_group orders a thread's own copies
// before its own reads. The slot layout [S][NT][P][kBlock] x 16 bytes puts a warp's 32 packs in
// 512 contiguous bytes (conflict-free copies and reads). A slot is refilled only after the thread
// has consumed (used in arithmetic) every value it read from it one iteration earlier.
//
// Iterations: block b takes batches b, b + G, b + 2G, ... (G = gridDim.x <= number of batches);
// every thread of a block runs the same number of iterations (the count depends on b only), so the
// block-wide reductions below meet their barriers in step. Row j of a batch is row batch * rpb + j.
//
// Everything is deterministic: fixed shuffle butterflies and fixed shared-memory sum orders.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/vec.cuh"

namespace gdn::cuda::staged {

constexpr int kBlock = 512;  // threads per block
constexpr int kWarps = kBlock / 32;

// --- cp.async ----------------------------------------------------------------------------------
// 16 bytes, cached in L2 only (.cg): both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// 4 bytes (.ca: .cg takes 16 only): both addresses 4-byte aligned.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// --- layout ------------------------------------------------------------------------------------
struct Layout {
  int P = 0;    // 16-byte packs per thread (1 or 2)
  int tpr = 0;  // threads per row (power of two, <= kBlock)
  int rpb = 0;  // rows per batch = kBlock / tpr
};

// The staged layout for rows of D bf16 elements, or P = 0 when the rows cannot be staged (D not a
// positive multiple of 8, or wider than 2 * 8 * kBlock). The caller checks 16-byte alignment.
inline Layout layout_for(int64_t D) {
  Layout l;
  if (D <= 0 || D % 8 != 0 || D / 8 > 2 * kBlock) return l;
  const int npacks = static_cast<int>(D / 8);
  l.P = npacks <= kBlock ? 1 : 2;
  const int need = (npacks + l.P - 1) / l.P;
  l.tpr = 1;
  while (l.tpr < need) l.tpr *= 2;  // need <= kBlock, so tpr <= kBlock
  l.rpb = kBlock / l.tpr;
  return l;
}

// Bytes of dynamic shared memory for a ring of S slots of NT staged tensors with P packs per
// thread, plus `extra_floats` fp32 per thread and slot (e.g. a staged per-row statistic).
constexpr size_t ring_bytes(int S, int NT, int P, int extra_floats) {
  return static_cast<size_t>(S) * kBlock * (static_cast<size_t>(NT) * P * 16 + extra_floats * 4);
}

// This thread's pack k of staged tensor t in slot `slot` (ring [S][NT][P][kBlock] of uint4).
template <int NT, int P>
__device__ __forceinline__ uint4* ring_at(uint4* ring, int slot, int t, int k) {
  return ring + ((slot * NT + t) * P + k) * kBlock + threadIdx.x;
}

// Number of batches block blockIdx.x takes: ceil((nbatch - b) / G); >= 1 when G <= nbatch.
__device__ __forceinline__ int64_t iterations(int64_t nbatch) {
  const int64_t G = gridDim.x, b = blockIdx.x;
  return b < nbatch ? (nbatch - b + G - 1) / G : 0;
}

// Sum of v over the tpr threads of the caller's row group, bit-identical in every thread of the
// group. Every thread of the block calls it once per iteration (tpr uniform over the block): the
// shuffles use the full warp mask, and for tpr > 32 it holds one barrier. red[parity] is written
// at iteration i and read after that barrier; it is written again only at iteration i + 2, after
// the barrier of iteration i + 1 that every thread reaches only once done reading it at i: two
// buffers, one barrier per call. red must be 16-byte aligned (declare it __align__(16)).
__device__ __forceinline__ float group_sum(float v, int tpr, float (*red)[kWarps], int parity) {
  const int width = tpr < 32 ? tpr : 32;
  for (int m = width >> 1; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (tpr <= 32) return v;
  float* r = red[parity];
  if ((threadIdx.x & 31) == 0) r[threadIdx.x >> 5] = v;
  __syncthreads();
  // The group's wpr warp sums in warp order, read as float2 / float4 (wpr = 2 or a multiple of 4,
  // `first` a multiple of wpr, red 16-byte aligned): one to four shared loads instead of 16 on the
  // critical path of every row.
  const int wpr = tpr >> 5, first = static_cast<int>(threadIdx.x / tpr) * wpr;
  float s = 0.f;
  if (wpr == 2) {
    const float2 q = *reinterpret_cast<const float2*>(r + first);
    s += q.x;
    s += q.y;
    return s;
  }
#pragma unroll 4
  for (int i = 0; i < wpr; i += 4) {  // fixed order
    const float4 q = *reinterpret_cast<const float4*>(r + first + i);
    s += q.x;
    s += q.y;
    s += q.z;
    s += q.w;
  }
  return s;
}

// out[col] += sum over p < P of partial[p, col]: kSlices slices of p per column (each summed in
// increasing p, loads unrolled so that several are in flight), then the slice sums in slice
// order. Block 32 * kSlices threads = 32 columns x kSlices slices; grid ceil(D / 32).
template <int kSlices>
__global__ void __launch_bounds__(32 * kSlices)
    column_sum_add_kernel(const float* __restrict__ partial,  // [P, D]
                          float* __restrict__ out,            // [D]
                          int P, int D) {
  __shared__ float s[kSlices][33];
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  const int col = static_cast<int>(blockIdx.x) * 32 + tx;
  float acc = 0.f;
  if (col < D) {
#pragma unroll 4
    for (int p = ty; p < P; p += kSlices) acc += partial[static_cast<int64_t>(p) * D + col];
  }
  s[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < D) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < kSlices; ++j) t += s[j][tx];
    out[col] += t;
  }
}

}  // namespace gdn::cuda::staged
