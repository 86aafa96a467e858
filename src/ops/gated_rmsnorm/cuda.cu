// Gated RMSNorm on CUDA: bf16 x/z/w/y/dy/dx/dz, fp32 rstd and dw, fp32 arithmetic, one rounding
// per output (op.h has the contract; FLA's fused_norm_gate is the peer).
//
// Layout (backend/cuda/memory_bound.cuh): a block of kBlock threads holds kBlock / tpr row groups
// of tpr threads, one row (one token x value head) per group; each thread keeps its P packs of x
// and z (and dy) in registers, so every input is read from device memory once. At the GDN shape
// (D = dv = 128) tpr = 8 and a block covers 32 rows.
//
// Both kernels are persistent (as many blocks as are resident at once, each row group walking
// rows with a grid stride) and load the next row's packs before they work on the current row, so
// that loads stay in flight while a row is reduced and written. The sigmoid uses the fast exp2 and
// reciprocal (sigmoid_fast): the IEEE forms made the elementwise work as long as the memory
// traffic.
//
// Forward: rstd written by lane 0.
// Backward: a thread owns the same columns in every row, so its w packs are loaded once and its dw
// contributions go to fp32 sums in shared memory private to it; the row groups of a block are
// summed in group order, each block writes one fp32 partial row to scratch, and
// column_sum_add_kernel adds the partial rows to dw in a fixed order (as a programmatic dependent,
// launch_column_sum_add_pdl in memory_bound.cuh, when rows are dealt to warps: see the kernel). No
// float atomics: dw depends only on the shapes and the device's multiprocessor count (the grid
// size).
//
// Bytes moved (the floor): forward x, z, w, y, rstd; backward x, z, w, rstd, dy, dx, dz and dw read
// and written; plus the partial rows (grid x D fp32, ~0.1 MB at D = 128).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/gated_rmsnorm/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::Pack;
using cuda::zero_pack;

constexpr int kBlock = 256;

// sigmoid(z) = 1 / (1 + exp(-z)) with the fast exp2 (ex2.approx.ftz, relative error ~2^-22) and
// reciprocal (rcp.approx, ~1 ulp): within a few fp32 ulps of the IEEE form, far below the one bf16
// rounding of every output, and a quarter of its instructions (this kernel's elementwise work
// would otherwise be as long as its memory traffic). Safe at both tails: exp overflows to +inf for
// z < -88.7 and 1 / inf = 0; it underflows to 0 for z > 87.3 and gives exactly 1; never NaN for
// finite z.
__device__ __forceinline__ float sigmoid_fast(float z) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  return __fdividef(1.f, 1.f + e);
}

// Both kernels are persistent (as many blocks as are resident at once): each row group walks rows
// with a grid stride and loads its next row's packs (x, z; dy in backward) before it works on the
// current one, so that row's loads are in flight while the current row is reduced, computed and
// written. A thread owns the same columns in every row, so its w packs are loaded once.
template <int V>
__global__ void __launch_bounds__(kBlock)
    gated_rmsnorm_fwd_kernel(const bf16_t* __restrict__ x,  // [R, D]
                             const bf16_t* __restrict__ z,  // [R, D]
                             const bf16_t* __restrict__ w,  // [D]
                             bf16_t* __restrict__ y,        // [R, D]
                             float* __restrict__ rstd,      // [R]
                             int64_t R, int D, int tpr, float eps) {
  constexpr int P = cuda::row_packs_per_thread<V>();
  __shared__ float red[kBlock / 32];
  const int npacks = D / V;
  const int rpb = kBlock / tpr;
  const int lane = static_cast<int>(threadIdx.x) & (tpr - 1);
  const int g = static_cast<int>(threadIdx.x) / tpr;

  Pack<V> wc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    wc[k] = c < npacks ? cuda::load_pack<V>(w, static_cast<int64_t>(c) * V) : zero_pack<V>();
  }
  // The next row's packs, all loads issued back to back; packs outside the row read as zeros
  // (they add +0 to the sum of squares).
  Pack<V> xn[P], zn[P];
  auto fetch = [&](int64_t row) {
    const bool act = row < R;
    const int64_t off = act ? row * D : 0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      const bool ok = act && c < npacks;
      xn[k] = ok ? cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
      zn[k] = ok ? cuda::load_pack<V>(z, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
    }
  };

  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  fetch(static_cast<int64_t>(blockIdx.x) * rpb + g);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < R; base += stride) {
    // `base` is uniform over the block: every thread meets the barriers of group_allreduce_sum.
    const int64_t row = base + g;
    const bool active = row < R;
    const int64_t off = active ? row * D : 0;
    Pack<V> xc[P], zc[P];
#pragma unroll
    for (int k = 0; k < P; ++k) xc[k] = xn[k], zc[k] = zn[k];
    fetch(row + stride);

    float ss = cuda::row_sum_squares<P, V>(xc, x, off, lane, tpr, npacks, active);
    ss = cuda::group_allreduce_sum(ss, tpr, red);
    if (!active) continue;
    const float r = 1.f / sqrtf(ss / static_cast<float>(D) + eps);
    if (lane == 0) rstd[row] = r;

    auto emit = [&](int c, const Pack<V>& xp, const Pack<V>& zp, const Pack<V>& wp) {
      float xf[V], zf[V], wf[V], out[V];
      cuda::unpack(xp, xf);
      cuda::unpack(zp, zf);
      cuda::unpack(wp, wf);
#pragma unroll
      for (int v = 0; v < V; ++v) out[v] = xf[v] * r * wf[v] * (zf[v] * sigmoid_fast(zf[v]));
      cuda::store_pack<V>(y, off + static_cast<int64_t>(c) * V, cuda::pack(out));
    };
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) emit(c, xc[k], zc[k], wc[k]);
    }
    for (int c = lane + P * tpr; c < npacks; c += tpr)
      emit(c, cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V),
           cuda::load_pack<V>(z, off + static_cast<int64_t>(c) * V),
           cuda::load_pack<V>(w, static_cast<int64_t>(c) * V));
  }
}

// One element of the backward: given x, z, w, dy of a column and the row's r and
// m = mean(xhat * dy' * w), writes dx, dz and returns dy' * xhat (the dw term).
struct GradOut {
  float dx, dz, dw;
};
__device__ __forceinline__ GradOut grad_elem(float x, float z, float w, float dy, float r,
                                             float m) {
  const float s = sigmoid_fast(z);
  const float xhat = x * r;
  const float dyp = dy * z * s;  // dy * silu(z)
  GradOut o;
  o.dz = dy * xhat * w * s * (1.f + z * (1.f - s));
  o.dx = r * (dyp * w - xhat * m);
  o.dw = dyp * xhat;
  return o;
}

// The dw sums of the register-held packs live in shared memory, private to their thread:
// thread `tid` keeps element v of its k-th pack at acc[(k * V + v) * kBlock + tid] (consecutive
// threads, consecutive words: conflict-free). In registers they would cost P * V registers.
template <int V>
constexpr int acc_floats() {
  return cuda::row_packs_per_thread<V>() * V * kBlock;
}

// Two blocks per multiprocessor at least (<= 128 registers).
// kWarpRows (only for tpr <= 32, where a row group never crosses a warp and the
// group sum holds no block barrier): rows are dealt to warps, not blocks. Warp unit u (the 32 / tpr
// consecutive rows u * 32 / tpr ...) of sweep k goes to warp (u / grid) % 8 of block u % grid, so
// a last partial sweep is spread over the blocks (one warp each) instead of being the whole work
// of its first few blocks (at [262144, 128]: 31 full sweeps of 264 blocks and 256 rows left, which
// the strided walk gives to 8 blocks that run a 32nd iteration while the others idle).
// kPf > 0 (with kWarpRows: 2): each thread also requests the x, z, dy packs of its row kPf
// iterations ahead towards L2 (prefetch.global.L2: no registers), so a multiprocessor keeps more
// bytes in flight than its 2 x 256 threads at ~127 registers can hold. 3 iterations ahead and 3
// blocks per multiprocessor measured slower (docs/PERF.md).
template <int V, bool kWarpRows = false, int kPf = 0>
__global__ void __launch_bounds__(kBlock, 2)
    gated_rmsnorm_bwd_kernel(const bf16_t* __restrict__ x,    // [R, D]
                             const bf16_t* __restrict__ z,    // [R, D]
                             const bf16_t* __restrict__ w,    // [D]
                             const float* __restrict__ rstd,  // [R]
                             const bf16_t* __restrict__ dy,   // [R, D]
                             bf16_t* __restrict__ dx,         // [R, D]
                             bf16_t* __restrict__ dz,         // [R, D]
                             float* __restrict__ partial,     // [gridDim.x, D] dw partial rows
                             int64_t R, int D, int tpr) {
  constexpr int P = cuda::row_packs_per_thread<V>();
  __shared__ float red[kBlock / 32];
  extern __shared__ float acc[];  // [acc_floats<V>()]
  const int npacks = D / V;
  const int rpb = kBlock / tpr;
  const int g = static_cast<int>(threadIdx.x) / tpr;
  const int lane = static_cast<int>(threadIdx.x) & (tpr - 1);
  const int tid = static_cast<int>(threadIdx.x);
  float* mine = partial + static_cast<int64_t>(blockIdx.x) * D;  // [D] this block's partial row

#pragma unroll
  for (int i = 0; i < P * V; ++i) acc[i * kBlock + tid] = 0.f;
  // Columns past the register-held ones exist only when rpb == 1 (tpr == kBlock): their dw goes
  // straight to this block's partial row, which only this thread touches.
  for (int c = lane + P * tpr; c < npacks; c += tpr) {
#pragma unroll
    for (int v = 0; v < V; ++v) mine[c * V + v] = 0.f;
  }

  Pack<V> wc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    wc[k] = c < npacks ? cuda::load_pack<V>(w, static_cast<int64_t>(c) * V) : zero_pack<V>();
  }
  // The next row's packs, all loads issued back to back; packs outside the row read as zeros.
  Pack<V> xn[P], zn[P], dn[P];
  float rn = 0.f;
  auto fetch = [&](int64_t row) {
    const bool act = row < R;
    const int64_t off = act ? row * D : 0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      const bool ok = act && c < npacks;
      xn[k] = ok ? cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
      zn[k] = ok ? cuda::load_pack<V>(z, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
      dn[k] = ok ? cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
    }
    rn = act ? rstd[row] : 0.f;
  };

  // Strided walk: row = base + g, base = blockIdx.x * rpb + k * stride (uniform over the block:
  // every thread meets the barriers of group_allreduce_sum). kWarpRows: row = base + g % rpw,
  // base = (warp * grid + blockIdx.x + k * 8 * grid) * rpw (uniform over the warp; tpr <= 32).
  const int rpw = kWarpRows ? 32 / tpr : 0;  // rows per warp
  const int64_t stride = kWarpRows ? static_cast<int64_t>(gridDim.x) * kBlock / tpr
                                   : static_cast<int64_t>(gridDim.x) * rpb;
  const int64_t base0 = kWarpRows ? (static_cast<int64_t>(tid >> 5) * gridDim.x + blockIdx.x) * rpw
                                  : static_cast<int64_t>(blockIdx.x) * rpb;
  const int gi = kWarpRows ? g % rpw : g;  // the row's index in its base
  // The row `row`'s packs towards L2 (kPf).
  auto prefetch = [&](int64_t row) {
    if (row >= R) return;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        const int64_t o = row * D + static_cast<int64_t>(c) * V;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(x + o));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(z + o));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(dy + o));
      }
    }
  };
  if constexpr (kWarpRows) cuda::pdl_launch_dependents();
  fetch(base0 + gi);
  if constexpr (kPf > 0)
    for (int j = 2; j <= kPf; ++j) prefetch(base0 + gi + (j - 1) * stride);
  for (int64_t base = base0; base < R; base += stride) {
    const int64_t row = base + gi;
    const bool active = row < R;
    const int64_t off = active ? row * D : 0;
    Pack<V> xc[P], zc[P], dyc[P];
#pragma unroll
    for (int k = 0; k < P; ++k) xc[k] = xn[k], zc[k] = zn[k], dyc[k] = dn[k];
    const float r = rn;
    fetch(row + stride);
    if constexpr (kPf > 0) prefetch(row + kPf * stride);

    float dot = 0.f;  // sum(dy' * w * x) over the row
    auto dot_terms = [&](const Pack<V>& xp, const Pack<V>& zp, const Pack<V>& dp,
                         const Pack<V>& wp) {
      float xf[V], zf[V], df[V], wf[V];
      cuda::unpack(xp, xf);
      cuda::unpack(zp, zf);
      cuda::unpack(dp, df);
      cuda::unpack(wp, wf);
#pragma unroll
      for (int v = 0; v < V; ++v) dot += df[v] * zf[v] * sigmoid_fast(zf[v]) * wf[v] * xf[v];
    };
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (active && c < npacks) dot_terms(xc[k], zc[k], dyc[k], wc[k]);
    }
    for (int c = lane + P * tpr; active && c < npacks; c += tpr)
      dot_terms(cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V),
                cuda::load_pack<V>(z, off + static_cast<int64_t>(c) * V),
                cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V),
                cuda::load_pack<V>(w, static_cast<int64_t>(c) * V));
    dot = cuda::group_allreduce_sum(dot, tpr, red);
    if (!active) continue;
    const float m = dot * r / static_cast<float>(D);  // mean(xhat * dy' * w)
    // Unpack and take the sigmoids again below instead of keeping the first pass's 4 * P * V fp32
    // values alive across the reduction: recomputing costs ~5 instructions an element, keeping
    // them a block per multiprocessor.

    // Writes dx, dz of pack c and returns its dw terms in `dwv`.
    auto emit = [&](int c, const Pack<V>& xp, const Pack<V>& zp, const Pack<V>& dp,
                    const Pack<V>& wp, float(&dwv)[V]) {
      float xf[V], zf[V], df[V], wf[V], gx[V], gz[V];
      cuda::unpack(xp, xf);
      cuda::unpack(zp, zf);
      cuda::unpack(dp, df);
      cuda::unpack(wp, wf);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const GradOut o = grad_elem(xf[v], zf[v], wf[v], df[v], r, m);
        gx[v] = o.dx;
        gz[v] = o.dz;
        dwv[v] = o.dw;
      }
      cuda::store_pack<V>(dx, off + static_cast<int64_t>(c) * V, cuda::pack(gx));
      cuda::store_pack<V>(dz, off + static_cast<int64_t>(c) * V, cuda::pack(gz));
    };
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float dwv[V];
        emit(c, xc[k], zc[k], dyc[k], wc[k], dwv);
#pragma unroll
        for (int v = 0; v < V; ++v) acc[(k * V + v) * kBlock + tid] += dwv[v];
      }
    }
    for (int c = lane + P * tpr; c < npacks; c += tpr) {
      float dwv[V];
      emit(c, cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V),
           cuda::load_pack<V>(z, off + static_cast<int64_t>(c) * V),
           cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V),
           cuda::load_pack<V>(w, static_cast<int64_t>(c) * V), dwv);
#pragma unroll
      for (int v = 0; v < V; ++v) mine[c * V + v] += dwv[v];
    }
  }

  // The block's partial row: the row groups' sums added in group order (j = 0, 1, ...), column by
  // column, over the register-held columns (all of them unless rpb == 1 and the row is wider,
  // whose further columns are already in `mine`).
  __syncthreads();
  const int held = min(D, P * tpr * V);
  for (int col = tid; col < held; col += kBlock) {
    const int c = col / V, v = col % V, k = c / tpr, ln = c % tpr;
    float sum = 0.f;
    for (int j = 0; j < rpb; ++j) sum += acc[(k * V + v) * kBlock + j * tpr + ln];
    mine[col] = sum;
  }
}

const bf16_t* in(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }

void forward(const GatedRmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  if (R == 0) return;
  GDN_CHECK(D <= INT_MAX / 2, "gated_rmsnorm (cuda): row width {} is too large", D);
  const bf16_t* x = in(a.x);          // [R, D]
  const bf16_t* z = in(a.z);          // [R, D]
  const bf16_t* w = in(a.w);          // [D]
  bf16_t* y = out(a.y);               // [R, D]
  float* rstd = a.rstd.ptr<float>();  // [R]
  const bool vec_ok =
      cuda::aligned16(x) && cuda::aligned16(z) && cuda::aligned16(w) && cuda::aligned16(y);
  const cuda::RowLayout l = cuda::row_layout(D, vec_ok, kBlock);
  // Persistent grid: the blocks resident at once, at most one per row-group batch.
  const void* kernel = l.vec == 8 ? reinterpret_cast<const void*>(&gated_rmsnorm_fwd_kernel<8>)
                                  : reinterpret_cast<const void*>(&gated_rmsnorm_fwd_kernel<1>);
  int per_sm = 0;
  GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, 0));
  const int64_t batches = (R + l.rpb - 1) / l.rpb;
  const auto grid = static_cast<unsigned>(std::min<int64_t>(
      batches, static_cast<int64_t>(cuda::Context::get().sm_count()) * std::max(per_sm, 1)));
  const float eps = static_cast<float>(a.eps);
  cudaStream_t s = cuda::stream();
  if (l.vec == 8) {
    gated_rmsnorm_fwd_kernel<8>
        <<<grid, kBlock, 0, s>>>(x, z, w, y, rstd, R, static_cast<int>(D), l.tpr, eps);
  } else {
    gated_rmsnorm_fwd_kernel<1>
        <<<grid, kBlock, 0, s>>>(x, z, w, y, rstd, R, static_cast<int>(D), l.tpr, eps);
  }
  GDN_CUDA_LAUNCH_CHECK("gated_rmsnorm_fwd_kernel");
}

// Rows dealt to warps when tpr <= 32 (see the kernel), with their packs prefetched 2 iterations
// ahead (kPrefetchAhead), and then the dw sum as a programmatic dependent
// (launch_column_sum_add_pdl, memory_bound.cuh).
constexpr int kPrefetchAhead = 2;
void backward(const GatedRmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  if (R == 0 || D == 0) return;  // dw += 0
  GDN_CHECK(D <= INT_MAX / 2, "gated_rmsnorm (cuda): row width {} is too large", D);
  const bf16_t* x = in(a.x);                // [R, D]
  const bf16_t* z = in(a.z);                // [R, D]
  const bf16_t* w = in(a.w);                // [D]
  const float* rstd = a.rstd.ptr<float>();  // [R]
  const bf16_t* dy = in(a.dy);              // [R, D]
  bf16_t* dx = out(a.dx);                   // [R, D]
  bf16_t* dz = out(a.dz);                   // [R, D]
  float* dw = a.dw.ptr<float>();            // [D]
  const bool vec_ok = cuda::aligned16(x) && cuda::aligned16(z) && cuda::aligned16(w) &&
                      cuda::aligned16(dy) && cuda::aligned16(dx) && cuda::aligned16(dz);
  const cuda::RowLayout l = cuda::row_layout(D, vec_ok, kBlock);
  // The dw sums: P * V fp32 per thread, 16 KB (8 KB with scalar packs).
  const size_t smem =
      static_cast<size_t>(l.vec == 8 ? acc_floats<8>() : acc_floats<1>()) * sizeof(float);
  const bool warp_rows = l.tpr <= 32;
  using Kernel = void (*)(const bf16_t*, const bf16_t*, const bf16_t*, const float*, const bf16_t*,
                          bf16_t*, bf16_t*, float*, int64_t, int, int);
  const Kernel kernel = l.vec == 8 ? (warp_rows ? gated_rmsnorm_bwd_kernel<8, true, kPrefetchAhead>
                                                : gated_rmsnorm_bwd_kernel<8, false>)
                                   : (warp_rows ? gated_rmsnorm_bwd_kernel<1, true, kPrefetchAhead>
                                                : gated_rmsnorm_bwd_kernel<1, false>);
  cuda::Context& ctx = cuda::Context::get();
  int per_sm = 0;
  GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem));
  const int64_t batches = (R + l.rpb - 1) / l.rpb;
  const int grid = static_cast<int>(
      std::min<int64_t>(batches, static_cast<int64_t>(ctx.sm_count()) * std::max(per_sm, 1)));
  float* partial = static_cast<float*>(  // [grid, D]
      ctx.scratch(gated_rmsnorm_partial_bytes(grid, D), "gated_rmsnorm"));
  cudaStream_t s = ctx.stream();
  kernel<<<grid, kBlock, smem, s>>>(x, z, w, rstd, dy, dx, dz, partial, R, static_cast<int>(D),
                                    l.tpr);
  GDN_CUDA_LAUNCH_CHECK("gated_rmsnorm_bwd_kernel");
  if (warp_rows) {
    cuda::launch_column_sum_add_pdl(partial, dw, grid, static_cast<int>(D), s);
  } else {
    cuda::column_sum_add_kernel<><<<static_cast<unsigned>((D + 31) / 32), 256, 0, s>>>(
        partial, dw, grid, static_cast<int>(D));
    GDN_CUDA_LAUNCH_CHECK("column_sum_add_kernel");
  }
}

const GatedRmsNormTable kTable{forward, backward};

}  // namespace

// Every shape (formerly "cuda.rowwise_pf"; the rows dealt to blocks without prefetch, the former
// "cuda.rowwise", measured slower: docs/PERF.md).
GDN_REGISTER(gated_rmsnorm_cuda) {
  Registry::global().add_impl(
      {"gated_rmsnorm", "cuda.rowwise_prefetch", Backend::Cuda, 12, nullptr, &kTable});
}

}  // namespace gdn::ops
