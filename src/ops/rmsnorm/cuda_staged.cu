// RMSNorm on CUDA, "cuda.staged": bf16 x/w/y/dy/dx, fp32 rstd and dw, fp32 arithmetic (op.h has
// the contract). Same maths and outputs as "cuda.rowwise" (cuda.cu); what differs is how the
// bytes reach the multiprocessors: persistent blocks stage the next rows through a cp.async ring
// in shared memory (staged.cuh has the layout, the ring and its invariants).
//
// Covered here: D % 8 == 0, 0 < D <= 8192, x/w/y (forward) and x/w/dy/dx (backward) 16-byte
// aligned. Everything else (odd widths, unaligned views, wider rows) goes to "cuda.rowwise"
// unchanged, through the registry's table of that implementation.
//
// Forward: per batch, each thread reads its packs of x from the ring, the row group sums x^2,
// r = rsqrt(mean(x^2) + eps), y = x * r * gw with gw = w or 1 + w formed in fp32 once per thread
// (a thread's columns are fixed), rstd written by lane 0.
// Backward: x, dy and rstd staged; dot = sum(dy * gw * x) over the row group, dx written with
// 16-byte stores, the thread's dw sums (P * 8 fp32) kept in registers across all its rows. At the
// end each block sums its row groups' registers column by column in group order into one fp32
// partial row (Context scratch), and a second kernel adds the partial rows to dw in a fixed order.
// The grid is one block per multiprocessor (the ring takes ~136-144 KB): 132 partial rows on an
// H200, 2.2 MB at D = 4096, written and read once against 192 MB of activations. Deterministic:
// the result depends only on the shapes and the device's multiprocessor count.
//
// Ring depths: forward S = 6 (P = 1) / 4 (P = 2) slots of 8 / 16 KB per block, several blocks per
// multiprocessor; backward S = 8 (P = 1) / 4 (P = 2) slots of 16 / 32 KB (x and dy), one block
// per multiprocessor: 112 / 96 KB of loads in flight per multiprocessor, against the ~40 KB that
// Little's law asks for at 4.8 TB/s and ~1 us of latency over 132 multiprocessors.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/registry.h"
#include "ops/rmsnorm/op.h"
#include "ops/rmsnorm/staged.cuh"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::staged::kBlock;
using cuda::staged::kWarps;

constexpr int kFwdRingS1 = 6, kFwdRingS2 = 4;  // forward ring slots for P = 1, 2
constexpr int kBwdRingS1 = 8, kBwdRingS2 = 4;  // backward ring slots for P = 1, 2

template <int P>
constexpr int fwd_slots() {
  return P == 1 ? kFwdRingS1 : kFwdRingS2;
}
template <int P>
constexpr int bwd_slots() {
  return P == 1 ? kBwdRingS1 : kBwdRingS2;
}

// gw = shift + w at this thread's columns c = lane + k * tpr (0 outside the row), in fp32.
template <int P>
__device__ __forceinline__ void load_gw(const bf16_t* __restrict__ w, int lane, int tpr, int npacks,
                                        float shift, float (&gw)[P][8]) {
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    float wf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (c < npacks) cuda::unpack(cuda::load_pack<8>(w, static_cast<int64_t>(c) * 8), wf);
#pragma unroll
    for (int v = 0; v < 8; ++v) gw[k][v] = c < npacks ? shift + wf[v] : 0.f;
  }
}

template <int P, int S>
__global__ void __launch_bounds__(kBlock, 2)
    rmsnorm_staged_fwd_kernel(const bf16_t* __restrict__ x,  // [R, D]
                              const bf16_t* __restrict__ w,  // [D]
                              bf16_t* __restrict__ y,        // [R, D]
                              float* __restrict__ rstd,      // [R]
                              int64_t R, int D, int tpr, float eps, float shift) {
  extern __shared__ uint4 ring[];  // [S][1][P][kBlock]
  __shared__ __align__(16) float red[2][kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const int g = tid / tpr, lane = tid & (tpr - 1);
  const int rpb = kBlock / tpr, npacks = D / 8;
  const int64_t nbatch = (R + rpb - 1) / rpb;
  const int64_t G = gridDim.x, niter = cuda::staged::iterations(nbatch);
  float gw[P][8];
  load_gw<P>(w, lane, tpr, npacks, shift, gw);

  // Copies of this thread's packs of iteration j's row into slot j % S; one commit group per call
  // (empty past the last iteration or the last row) so that group j is always the j-th committed.
  auto issue = [&](int64_t j) {
    const int64_t row = (blockIdx.x + j * G) * rpb + g;
    if (j < niter && row < R) {
      const int slot = static_cast<int>(j % S);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const int c = lane + k * tpr;
        if (c < npacks)
          cuda::staged::cp_async16(cuda::staged::ring_at<1, P>(ring, slot, 0, k),
                                   x + row * D + static_cast<int64_t>(c) * 8);
      }
    }
    cuda::staged::cp_async_commit();
  };

#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  for (int64_t j = 0; j < niter; ++j) {
    issue(j + S - 1);  // into the slot read at iteration j - 1 (its values are used by now)
    cuda::staged::cp_async_wait<S - 1>();  // groups 0..j complete: iteration j's row has landed
    const int slot = static_cast<int>(j % S);
    const int64_t row = (blockIdx.x + j * G) * rpb + g;
    const bool active = row < R;
    uint4 xp[P];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const bool ok = active && lane + k * tpr < npacks;
      xp[k] = ok ? *cuda::staged::ring_at<1, P>(ring, slot, 0, k) : make_uint4(0u, 0u, 0u, 0u);
      float f[8];
      cuda::unpack(cuda::Pack<8>{xp[k]}, f);
#pragma unroll
      for (int v = 0; v < 8; ++v) ss += f[v] * f[v];
    }
    ss = cuda::staged::group_sum(ss, tpr, red, static_cast<int>(j & 1));
    if (!active) continue;  // the group's barrier is behind us; the next iteration's is uniform
    const float r = rsqrtf(ss / static_cast<float>(D) + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float f[8], out[8];
        cuda::unpack(cuda::Pack<8>{xp[k]}, f);
#pragma unroll
        for (int v = 0; v < 8; ++v) out[v] = f[v] * r * gw[k][v];
        cuda::store_pack<8>(y, row * D + static_cast<int64_t>(c) * 8, cuda::pack(out));
      }
    }
  }
  cuda::staged::cp_async_wait<0>();  // only empty groups remain; leave none behind
}

template <int P, int S>
__global__ void __launch_bounds__(kBlock, 1)
    rmsnorm_staged_bwd_kernel(const bf16_t* __restrict__ x,    // [R, D]
                              const bf16_t* __restrict__ w,    // [D]
                              const float* __restrict__ rstd,  // [R]
                              const bf16_t* __restrict__ dy,   // [R, D]
                              bf16_t* __restrict__ dx,         // [R, D]
                              float* __restrict__ partial,     // [gridDim.x, D] dw partial rows
                              int64_t R, int D, int tpr, float shift) {
  extern __shared__ uint4 ring[];  // [S][2][P][kBlock] packs (x, dy), then [S][kBlock] fp32 rstd
  float* rs = reinterpret_cast<float*>(ring + S * 2 * P * kBlock);  // [S][kBlock]
  __shared__ __align__(16) float red[2][kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const int g = tid / tpr, lane = tid & (tpr - 1);
  const int rpb = kBlock / tpr, npacks = D / 8;
  const int64_t nbatch = (R + rpb - 1) / rpb;
  const int64_t G = gridDim.x, niter = cuda::staged::iterations(nbatch);
  float gw[P][8];
  load_gw<P>(w, lane, tpr, npacks, shift, gw);
  float acc[P][8];  // this thread's dw sums over its rows, columns (lane + k * tpr) * 8 + v
#pragma unroll
  for (int k = 0; k < P; ++k)
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[k][v] = 0.f;

  // As in the forward: iteration j's x and dy packs and rstd into slot j % S, one group per call.
  auto issue = [&](int64_t j) {
    const int64_t row = (blockIdx.x + j * G) * rpb + g;
    if (j < niter && row < R) {
      const int slot = static_cast<int>(j % S);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const int c = lane + k * tpr;
        if (c < npacks) {
          const int64_t off = row * D + static_cast<int64_t>(c) * 8;
          cuda::staged::cp_async16(cuda::staged::ring_at<2, P>(ring, slot, 0, k), x + off);
          cuda::staged::cp_async16(cuda::staged::ring_at<2, P>(ring, slot, 1, k), dy + off);
        }
      }
      cuda::staged::cp_async4(rs + slot * kBlock + tid, rstd + row);
    }
    cuda::staged::cp_async_commit();
  };

#pragma unroll
  for (int j = 0; j < S - 1; ++j) issue(j);
  for (int64_t j = 0; j < niter; ++j) {
    issue(j + S - 1);
    cuda::staged::cp_async_wait<S - 1>();
    const int slot = static_cast<int>(j % S);
    const int64_t row = (blockIdx.x + j * G) * rpb + g;
    const bool active = row < R;
    uint4 xp[P], dp[P];
    float dot = 0.f;  // sum(dy * gw * x) over the row
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const bool ok = active && lane + k * tpr < npacks;
      xp[k] = ok ? *cuda::staged::ring_at<2, P>(ring, slot, 0, k) : make_uint4(0u, 0u, 0u, 0u);
      dp[k] = ok ? *cuda::staged::ring_at<2, P>(ring, slot, 1, k) : make_uint4(0u, 0u, 0u, 0u);
      float xf[8], df[8];
      cuda::unpack(cuda::Pack<8>{xp[k]}, xf);
      cuda::unpack(cuda::Pack<8>{dp[k]}, df);
#pragma unroll
      for (int v = 0; v < 8; ++v) dot += df[v] * gw[k][v] * xf[v];
    }
    const float r = active ? rs[slot * kBlock + tid] : 0.f;
    dot = cuda::staged::group_sum(dot, tpr, red, static_cast<int>(j & 1));
    if (!active) continue;
    const float m = dot * r / static_cast<float>(D);  // mean(dy * gw * xhat)
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float xf[8], df[8], out[8];
        cuda::unpack(cuda::Pack<8>{xp[k]}, xf);
        cuda::unpack(cuda::Pack<8>{dp[k]}, df);
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          const float xhat = xf[v] * r;
          out[v] = r * (df[v] * gw[k][v] - xhat * m);
          acc[k][v] += df[v] * xhat;
        }
        cuda::store_pack<8>(dx, row * D + static_cast<int64_t>(c) * 8, cuda::pack(out));
      }
    }
  }

  // The block's partial row. The ring is free once every thread's copies have landed and every
  // thread is past its last read (the barrier); thread t's sum for (k, v) then goes to
  // sums[(k * 8 + v) * kBlock + t] (a warp's stores are contiguous), and after a second barrier
  // each column is summed over the row groups in group order.
  cuda::staged::cp_async_wait<0>();
  __syncthreads();
  float* sums = reinterpret_cast<float*>(ring);  // [P * 8][kBlock] (within the ring's bytes)
#pragma unroll
  for (int k = 0; k < P; ++k)
#pragma unroll
    for (int v = 0; v < 8; ++v) sums[(k * 8 + v) * kBlock + tid] = acc[k][v];
  __syncthreads();
  float* mine = partial + static_cast<int64_t>(blockIdx.x) * D;  // [D]
  for (int col = tid; col < D; col += kBlock) {
    const int c = col / 8, v = col % 8, k = c / tpr, ln = c % tpr;  // k < P: npacks <= P * tpr
    const float* s = sums + (k * 8 + v) * kBlock + ln;
    float t = 0.f;
    for (int j = 0; j < rpb; ++j) t += s[j * tpr];
    mine[col] = t;
  }
}

// The dw partial rows are summed by 32 slices per column (1024-thread blocks).
constexpr int kReduceSlices = 32;

template <class T>
const bf16_t* dev(const Tensor& t) {
  return reinterpret_cast<const bf16_t*>(t.ptr<T>());
}

// The "cuda.rowwise" implementation (cuda.cu): what this one defers to outside its coverage.
const RmsNormTable& rowwise() {
  static const RmsNormTable* t = [] {
    for (const ImplDesc* i : Registry::global().impls("rmsnorm", Backend::Cuda))
      if (i->name == "cuda.rowwise") return static_cast<const RmsNormTable*>(i->table);
    return static_cast<const RmsNormTable*>(nullptr);
  }();
  GDN_CHECK(t != nullptr,
            "rmsnorm (cuda.staged): the cuda.rowwise implementation is not "
            "registered (it handles the shapes this one does not stage)");
  return *t;
}

// Blocks of `kernel` (kBlock threads, `smem` bytes of dynamic shared memory) that fit on the
// device at once, after raising the kernel's dynamic shared-memory limit (a host-side attribute of
// the current device, no synchronisation; set on every call so that each device gets it) and
// asking for the largest carveout (the grid assumes the residency the occupancy query reports).
int resident_blocks(const void* kernel, size_t smem) {
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  int per_sm = 0;
  GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem));
  GDN_CHECK(per_sm >= 1,
            "rmsnorm (cuda.staged): the kernel does not fit on a multiprocessor "
            "({} bytes of shared memory)",
            smem);
  return cuda::Context::get().sm_count() * per_sm;
}

template <int P>
void launch_fwd(const bf16_t* x, const bf16_t* w, bf16_t* y, float* rstd, int64_t R, int D,
                const cuda::staged::Layout& l, float eps, float shift) {
  constexpr int S = fwd_slots<P>();
  const size_t smem = cuda::staged::ring_bytes(S, 1, P, 0);
  const auto kernel = &rmsnorm_staged_fwd_kernel<P, S>;
  const int64_t nbatch = (R + l.rpb - 1) / l.rpb;
  const int grid = static_cast<int>(
      std::min<int64_t>(nbatch, resident_blocks(reinterpret_cast<const void*>(kernel), smem)));
  kernel<<<grid, kBlock, smem, cuda::stream()>>>(x, w, y, rstd, R, D, l.tpr, eps, shift);
  GDN_CUDA_LAUNCH_CHECK("rmsnorm_staged_fwd_kernel");
}

template <int P>
void launch_bwd(const bf16_t* x, const bf16_t* w, const float* rstd, const bf16_t* dy, bf16_t* dx,
                float* dw, int64_t R, int D, const cuda::staged::Layout& l, float shift) {
  constexpr int S = bwd_slots<P>();
  const size_t smem = cuda::staged::ring_bytes(S, 2, P, 1);
  const auto kernel = &rmsnorm_staged_bwd_kernel<P, S>;
  const int64_t nbatch = (R + l.rpb - 1) / l.rpb;
  const int grid = static_cast<int>(
      std::min<int64_t>(nbatch, resident_blocks(reinterpret_cast<const void*>(kernel), smem)));
  cuda::Context& ctx = cuda::Context::get();
  float* partial = static_cast<float*>(  // [grid, D]
      ctx.scratch(static_cast<size_t>(grid) * static_cast<size_t>(D) * sizeof(float)));
  cudaStream_t s = ctx.stream();
  kernel<<<grid, kBlock, smem, s>>>(x, w, rstd, dy, dx, partial, R, D, l.tpr, shift);
  GDN_CUDA_LAUNCH_CHECK("rmsnorm_staged_bwd_kernel");
  cuda::staged::column_sum_add_kernel<kReduceSlices>
      <<<static_cast<unsigned>((D + 31) / 32), 32 * kReduceSlices, 0, s>>>(partial, dw, grid, D);
  GDN_CUDA_LAUNCH_CHECK("column_sum_add_kernel");
}

void forward(const RmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const bf16_t* x = dev<bf16>(a.x);                 // [R, D]
  const bf16_t* w = dev<bf16>(a.w);                 // [D]
  bf16_t* y = const_cast<bf16_t*>(dev<bf16>(a.y));  // [R, D]
  float* rstd = a.rstd.ptr<float>();                // [R]
  const cuda::staged::Layout l = cuda::staged::layout_for(D);
  if (R == 0 || l.P == 0 || !cuda::aligned16(x) || !cuda::aligned16(w) || !cuda::aligned16(y)) {
    rowwise().forward(a);
    return;
  }
  const float eps = static_cast<float>(a.eps), shift = a.zero_centred ? 1.f : 0.f;
  if (l.P == 1) {
    launch_fwd<1>(x, w, y, rstd, R, static_cast<int>(D), l, eps, shift);
  } else {
    launch_fwd<2>(x, w, y, rstd, R, static_cast<int>(D), l, eps, shift);
  }
}

void backward(const RmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const bf16_t* x = dev<bf16>(a.x);                   // [R, D]
  const bf16_t* w = dev<bf16>(a.w);                   // [D]
  const float* rstd = a.rstd.ptr<float>();            // [R]
  const bf16_t* dy = dev<bf16>(a.dy);                 // [R, D]
  bf16_t* dx = const_cast<bf16_t*>(dev<bf16>(a.dx));  // [R, D]
  float* dw = a.dw.ptr<float>();                      // [D]
  const cuda::staged::Layout l = cuda::staged::layout_for(D);
  if (R == 0 || l.P == 0 || !cuda::aligned16(x) || !cuda::aligned16(w) || !cuda::aligned16(dy) ||
      !cuda::aligned16(dx)) {
    rowwise().backward(a);
    return;
  }
  const float shift = a.zero_centred ? 1.f : 0.f;
  if (l.P == 1) {
    launch_bwd<1>(x, w, rstd, dy, dx, dw, R, static_cast<int>(D), l, shift);
  } else {
    launch_bwd<2>(x, w, rstd, dy, dx, dw, R, static_cast<int>(D), l, shift);
  }
}

const RmsNormTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(rmsnorm_cuda_staged) {
  Registry::global().add_impl({"rmsnorm", "cuda.staged", Backend::Cuda, 20, nullptr, &kTable});
}

}  // namespace gdn::ops
