// L2 normalisation on CUDA: bf16 x/y/dy/dx, fp32 rstd, fp32 arithmetic (op.h has the contract).
//
// Layout (backend/cuda/memory_bound.cuh): a block of kBlock threads holds kBlock / tpr row groups
// of tpr threads, one row per group; each thread keeps its P packs of the row in registers (16-byte
// packs of 8 bf16 when D % 8 == 0 and every pointer is 16-byte aligned, else single elements), so
// a row is read from device memory once. At the GDN shape (D = dk = 128) tpr = 8: 32 rows per
// block, every thread with two independent 16-byte loads in flight per input (the backward; the
// forward at D = 128 takes l2norm_fwd_d128_kernel, half a warp a row).
// Forward: sum of squares, group reduction, rstd = 1 / sqrt(ss + eps), y = x * rstd.
// Backward: dot = <dy, y> over the row, dx = rstd * (dy - y * dot). Rows are independent: no
// cross-row reduction, deterministic.
// Bytes moved (the floor): forward x + y + rstd; backward y + dy + rstd + dx.
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/l2norm/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::Pack;

constexpr int kBlock = 256;

template <int V>
__global__ void __launch_bounds__(kBlock) l2norm_fwd_kernel(const bf16_t* __restrict__ x,  // [R, D]
                                                            bf16_t* __restrict__ y,        // [R, D]
                                                            float* __restrict__ rstd,      // [R]
                                                            int64_t R, int D, int tpr, float eps) {
  constexpr int P = cuda::row_packs_per_thread<V>();
  __shared__ float red[kBlock / 32];
  const int npacks = D / V;
  const int lane = static_cast<int>(threadIdx.x) & (tpr - 1);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / tpr) + threadIdx.x / tpr;
  const bool active = row < R;
  const int64_t off = active ? row * D : 0;

  Pack<V> xc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {  // all loads issued before the first use
    const int c = lane + k * tpr;
    if (active && c < npacks) xc[k] = cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V);
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (active && lane + k * tpr < npacks) {
      float f[V];
      cuda::unpack(xc[k], f);
#pragma unroll
      for (int v = 0; v < V; ++v) ss += f[v] * f[v];
    }
  }
  for (int c = lane + P * tpr; active && c < npacks; c += tpr) {
    float f[V];
    cuda::unpack(cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V), f);
#pragma unroll
    for (int v = 0; v < V; ++v) ss += f[v] * f[v];
  }
  ss = cuda::group_allreduce_sum(ss, tpr, red);
  if (!active) return;  // past the last barrier
  const float r = 1.f / sqrtf(ss + eps);
  if (lane == 0) rstd[row] = r;

  auto emit = [&](int c, const Pack<V>& xp) {
    float f[V];
    cuda::unpack(xp, f);
#pragma unroll
    for (int v = 0; v < V; ++v) f[v] *= r;
    cuda::store_pack<V>(y, off + static_cast<int64_t>(c) * V, cuda::pack(f));
  };
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    if (c < npacks) emit(c, xc[k]);
  }
  for (int c = lane + P * tpr; c < npacks; c += tpr)
    emit(c, cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V));
}

// The forward at D = 128 with 16-byte packs (the GDN shape, dk = 128): half a warp a row, one pack
// a thread, so that every warp instruction covers two whole rows (512 contiguous bytes), 16 rows a
// block. Slightly faster than l2norm_fwd_kernel<8> (tpr 8, two packs a thread) and at the rate of
// a plain copy kernel of the same layout (measured: docs/PERF.md).
__global__ void __launch_bounds__(kBlock)
    l2norm_fwd_d128_kernel(const bf16_t* __restrict__ x, bf16_t* __restrict__ y,
                           float* __restrict__ rstd, int64_t R, float eps) {
  constexpr int kD = 128;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / 16) + threadIdx.x / 16;
  const int col = (static_cast<int>(threadIdx.x) & 15) * 8;
  const bool active = row < R;
  const Pack<8> p = active ? cuda::load_pack<8>(x, row * kD + col) : cuda::zero_pack<8>();
  float f[8];
  cuda::unpack(p, f);
  float ss = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) ss += f[v] * f[v];
#pragma unroll
  for (int m = 8; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);  // the half-warp
  if (!active) return;
  const float r = 1.f / sqrtf(ss + eps);
  if (col == 0) rstd[row] = r;
#pragma unroll
  for (int v = 0; v < 8; ++v) f[v] *= r;
  cuda::store_pack<8>(y, row * kD + col, cuda::pack(f));
}

template <int V>
__global__ void __launch_bounds__(kBlock)
    l2norm_bwd_kernel(const bf16_t* __restrict__ y,    // [R, D]
                      const float* __restrict__ rstd,  // [R]
                      const bf16_t* __restrict__ dy,   // [R, D]
                      bf16_t* __restrict__ dx,         // [R, D]
                      int64_t R, int D, int tpr) {
  constexpr int P = cuda::row_packs_per_thread<V>();
  __shared__ float red[kBlock / 32];
  const int npacks = D / V;
  const int lane = static_cast<int>(threadIdx.x) & (tpr - 1);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / tpr) + threadIdx.x / tpr;
  const bool active = row < R;
  const int64_t off = active ? row * D : 0;
  const float r = active ? rstd[row] : 0.f;

  Pack<V> yc[P], dyc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    if (active && c < npacks) {
      yc[k] = cuda::load_pack<V>(y, off + static_cast<int64_t>(c) * V);
      dyc[k] = cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V);
    }
  }
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (active && lane + k * tpr < npacks) {
      float yf[V], df[V];
      cuda::unpack(yc[k], yf);
      cuda::unpack(dyc[k], df);
#pragma unroll
      for (int v = 0; v < V; ++v) dot += df[v] * yf[v];
    }
  }
  for (int c = lane + P * tpr; active && c < npacks; c += tpr) {
    float yf[V], df[V];
    cuda::unpack(cuda::load_pack<V>(y, off + static_cast<int64_t>(c) * V), yf);
    cuda::unpack(cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V), df);
#pragma unroll
    for (int v = 0; v < V; ++v) dot += df[v] * yf[v];
  }
  dot = cuda::group_allreduce_sum(dot, tpr, red);
  if (!active) return;

  auto emit = [&](int c, const Pack<V>& yp, const Pack<V>& dp) {
    float yf[V], df[V], out[V];
    cuda::unpack(yp, yf);
    cuda::unpack(dp, df);
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = r * (df[v] - yf[v] * dot);
    cuda::store_pack<V>(dx, off + static_cast<int64_t>(c) * V, cuda::pack(out));
  };
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    if (c < npacks) emit(c, yc[k], dyc[k]);
  }
  for (int c = lane + P * tpr; c < npacks; c += tpr)
    emit(c, cuda::load_pack<V>(y, off + static_cast<int64_t>(c) * V),
         cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V));
}

const bf16_t* in(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }

// Grid for R rows of layout l; checks the sizes the kernels keep in int.
unsigned grid_for(int64_t R, int64_t D, const cuda::RowLayout& l) {
  GDN_CHECK(D <= INT_MAX / 2, "l2norm (cuda): row width {} is too large", D);
  const int64_t grid = (R + l.rpb - 1) / l.rpb;
  GDN_CHECK(grid <= INT_MAX, "l2norm (cuda): {} rows is too many", R);
  return static_cast<unsigned>(grid);
}

void forward(const L2NormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  if (R == 0) return;
  const bf16_t* x = in(a.x);          // [R, D]
  bf16_t* y = out(a.y);               // [R, D]
  float* rstd = a.rstd.ptr<float>();  // [R]
  if (D == 0) {                       // y is empty; rstd = 1 / sqrt(0 + eps)
    const cuda::RowLayout l{1, 1, kBlock};
    l2norm_fwd_kernel<1><<<grid_for(R, D, l), kBlock, 0, cuda::stream()>>>(
        x, y, rstd, R, 0, 1, static_cast<float>(a.eps));
    GDN_CUDA_LAUNCH_CHECK("l2norm_fwd_kernel");
    return;
  }
  const cuda::RowLayout l = cuda::row_layout(D, cuda::aligned16(x) && cuda::aligned16(y), kBlock);
  const unsigned grid = grid_for(R, D, l);
  const float eps = static_cast<float>(a.eps);
  if (l.vec == 8 && D == 128) {
    const int64_t blocks = (R + kBlock / 16 - 1) / (kBlock / 16);
    GDN_CHECK(blocks <= INT_MAX, "l2norm (cuda): {} rows is too many", R);
    l2norm_fwd_d128_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, cuda::stream()>>>(x, y, rstd,
                                                                                         R, eps);
    GDN_CUDA_LAUNCH_CHECK("l2norm_fwd_d128_kernel");
    return;
  }
  if (l.vec == 8) {
    l2norm_fwd_kernel<8>
        <<<grid, kBlock, 0, cuda::stream()>>>(x, y, rstd, R, static_cast<int>(D), l.tpr, eps);
  } else {
    l2norm_fwd_kernel<1>
        <<<grid, kBlock, 0, cuda::stream()>>>(x, y, rstd, R, static_cast<int>(D), l.tpr, eps);
  }
  GDN_CUDA_LAUNCH_CHECK("l2norm_fwd_kernel");
}

void backward(const L2NormBwd& a) {
  const int64_t R = a.y.size(0), D = a.y.size(1);
  if (R == 0 || D == 0) return;             // dx is empty
  const bf16_t* y = in(a.y);                // [R, D]
  const float* rstd = a.rstd.ptr<float>();  // [R]
  const bf16_t* dy = in(a.dy);              // [R, D]
  bf16_t* dx = out(a.dx);                   // [R, D]
  const cuda::RowLayout l =
      cuda::row_layout(D, cuda::aligned16(y) && cuda::aligned16(dy) && cuda::aligned16(dx), kBlock);
  const unsigned grid = grid_for(R, D, l);
  if (l.vec == 8) {
    l2norm_bwd_kernel<8>
        <<<grid, kBlock, 0, cuda::stream()>>>(y, rstd, dy, dx, R, static_cast<int>(D), l.tpr);
  } else {
    l2norm_bwd_kernel<1>
        <<<grid, kBlock, 0, cuda::stream()>>>(y, rstd, dy, dx, R, static_cast<int>(D), l.tpr);
  }
  GDN_CUDA_LAUNCH_CHECK("l2norm_bwd_kernel");
}

const L2NormTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(l2norm_cuda) {
  Registry::global().add_impl({"l2norm", "cuda.rowwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
