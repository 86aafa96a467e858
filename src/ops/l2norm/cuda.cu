// L2 normalisation on CUDA: bf16 x/y/dy/dx, fp32 rstd, fp32 arithmetic (op.h has the contract).
//
// Layout (backend/cuda/memory_bound.cuh): a block of kBlock threads holds kBlock / tpr row groups
// of tpr threads, one row per group; each thread keeps its P packs of the row in registers (16-byte
// packs of 8 bf16 when D % 8 == 0 and every pointer is 16-byte aligned, else single elements), so
// a row is read from device memory once. At the GDN shape (D = dk = 128) tpr = 8: 32 rows per
// block, every thread with two independent 16-byte loads in flight per input.
// Forward: sum of squares, group reduction, rstd = 1 / sqrt(ss + eps), y = x * rstd.
// Backward: dot = <dy, y> over the row, dx = rstd * (dy - y * dot). Rows are independent: no
// cross-row reduction, deterministic.
// D = 128 (the GDN key head) forward: a warp per 4 rows (l2norm128_fwd_kernel).
// Every kernel is launched as a programmatic dependent of the kernel before it on the stream
// (memory_bound.cuh: launch_pdl): its blocks are placed while that one drains and wait for it
// (griddepcontrol.wait) before their first load, and each lets its own successor do the same.
// Bytes moved (the floor): forward x + y + rstd; backward y + dy + rstd + dx.
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "backend/cuda/vec.cuh"
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
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();  // launched as a programmatic dependent (launch_pdl below)
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

// D = 128 (the GDN key head dim): a warp per kRows128 rows, 8 bytes (4 bf16) per lane, every row's
// load issued before the first sum, so that a warp has 1 KB in flight instead of the generic
// layout's 512 bytes a row group (the idea of gated_delta_rule/cuda_fwd.cu's in-op l2norm, which
// reaches the copy rate this way). Same formula; the sum of squares is grouped by the warp's
// butterfly instead of tpr = 8 groups (rounding only).
constexpr int kRows128 = 4;
__global__ void __launch_bounds__(kBlock)
    l2norm128_fwd_kernel(const bf16_t* __restrict__ x,  // [R, 128]
                         bf16_t* __restrict__ y,        // [R, 128]
                         float* __restrict__ rstd,      // [R]
                         int64_t R, float eps) {
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();  // launched as a programmatic dependent (launch_pdl below)
  constexpr int kD = 128;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t r0 = w * kRows128;
  if (r0 >= R) return;  // whole warps
  uint2 xv[kRows128];
#pragma unroll
  for (int i = 0; i < kRows128; ++i) {
    xv[i] = make_uint2(0u, 0u);
    if (r0 + i < R) xv[i] = *reinterpret_cast<const uint2*>(x + (r0 + i) * kD + 4 * lane);
  }
#pragma unroll
  for (int i = 0; i < kRows128; ++i) {
    const int64_t r = r0 + i;
    if (r >= R) break;  // uniform over the warp
    const float f[4] = {__uint_as_float(xv[i].x << 16), __uint_as_float(xv[i].x & 0xffff0000u),
                        __uint_as_float(xv[i].y << 16), __uint_as_float(xv[i].y & 0xffff0000u)};
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) ss += f[e] * f[e];
    const float rs = 1.f / sqrtf(cuda::warp_allreduce_sum(ss) + eps);
    if (lane == 0) rstd[r] = rs;
    const __nv_bfloat162 lo = __floats2bfloat162_rn(f[0] * rs, f[1] * rs);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(f[2] * rs, f[3] * rs);
    *reinterpret_cast<uint2*>(y + r * kD + 4 * lane) = make_uint2(
        *reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }
}

template <int V>
__global__ void __launch_bounds__(kBlock)
    l2norm_bwd_kernel(const bf16_t* __restrict__ y,    // [R, D]
                      const float* __restrict__ rstd,  // [R]
                      const bf16_t* __restrict__ dy,   // [R, D]
                      bf16_t* __restrict__ dx,         // [R, D]
                      int64_t R, int D, int tpr) {
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();  // launched as a programmatic dependent (launch_pdl below)
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
    cuda::launch_pdl(l2norm_fwd_kernel<1>, dim3(grid_for(R, D, l)), dim3(kBlock), cuda::stream(), x,
                     y, rstd, R, 0, 1, static_cast<float>(a.eps));
    GDN_CUDA_LAUNCH_CHECK("l2norm_fwd_kernel");
    return;
  }
  const float eps = static_cast<float>(a.eps);
  auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  if (D == 128 && aligned8(x) && aligned8(y)) {
    const int64_t blocks = ((R + kRows128 - 1) / kRows128 * 32 + kBlock - 1) / kBlock;
    GDN_CHECK(blocks <= INT_MAX, "l2norm (cuda): {} rows is too many", R);
    cuda::launch_pdl(l2norm128_fwd_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kBlock),
                     cuda::stream(), x, y, rstd, R, eps);
    GDN_CUDA_LAUNCH_CHECK("l2norm128_fwd_kernel");
    return;
  }
  const cuda::RowLayout l = cuda::row_layout(D, cuda::aligned16(x) && cuda::aligned16(y), kBlock);
  const unsigned grid = grid_for(R, D, l);
  if (l.vec == 8) {
    cuda::launch_pdl(l2norm_fwd_kernel<8>, dim3(grid), dim3(kBlock), cuda::stream(), x, y, rstd, R,
                     static_cast<int>(D), l.tpr, eps);
  } else {
    cuda::launch_pdl(l2norm_fwd_kernel<1>, dim3(grid), dim3(kBlock), cuda::stream(), x, y, rstd, R,
                     static_cast<int>(D), l.tpr, eps);
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
    cuda::launch_pdl(l2norm_bwd_kernel<8>, dim3(grid), dim3(kBlock), cuda::stream(), y, rstd, dy,
                     dx, R, static_cast<int>(D), l.tpr);
  } else {
    cuda::launch_pdl(l2norm_bwd_kernel<1>, dim3(grid), dim3(kBlock), cuda::stream(), y, rstd, dy,
                     dx, R, static_cast<int>(D), l.tpr);
  }
  GDN_CUDA_LAUNCH_CHECK("l2norm_bwd_kernel");
}

const L2NormTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(l2norm_cuda) {
  Registry::global().add_impl({"l2norm", "cuda.rowwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
