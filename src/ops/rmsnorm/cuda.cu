// RMSNorm on CUDA: bf16 x/w/y/dy/dx, fp32 rstd and dw, fp32 arithmetic (op.h has the contract).
//
// Layout: a block of kBlock = 256 threads holds 256 / tpr "row groups" of tpr threads (a power of
// two in [1, 256]: lanes of one warp up to 32, whole warps above); a row group owns one row at a
// time. Thread `lane` of a group owns the packs c = lane + k * tpr (k < P) of the row, a pack
// being 8 bf16 (one 16-byte access) when D % 8 == 0 and every pointer is 16-byte aligned, else 1
// bf16 (the scalar fallback); P = 4 packs of 8 or 16 of 1 per thread. tpr is the smallest that lets
// P packs per thread cover the row, so a row is read from device memory once and kept in registers
// between the reduction and the output pass. Rows wider than that (D > 8192 with packs of 8,
// D > 4096 with packs of 1) still work: the packs past the first P are read again (from L2) in the
// second pass.
//
// Every thread issues all the loads of its row before it uses any of them (a load under the same
// `if` as its use would make the warp wait for each one before issuing the next: the compiler
// does not move loads across such branches), so each thread keeps P (forward) or 2P (backward)
// 16-byte loads in flight.
//
// Forward: one row per row group, one launch; rstd written by lane 0. For 2048 <= D <= 4096
// (16-byte packs) rmsnorm_fwd_fixed_kernel: two packs a thread and the group width a template
// parameter, 32 registers, 8 blocks resident per multiprocessor.
// Backward: a persistent grid (as many blocks as fit on the device at once, at most one per
// row-group batch), each row group walking rows with a grid stride and loading its next row's x
// and dy while it works on the current one. The dw contribution of every row goes to the owning
// thread's fp32 sums in shared memory (a thread owns the same columns in every row; the sums are
// private to it until the end), row groups of a block are summed in a fixed order, each block
// writes one fp32 partial row to scratch, and a second kernel (column_sum_add_kernel,
// memory_bound.cuh) sums the partial rows column by column in a fixed order and adds them to dw.
// No float atomics: the result depends only on the shapes and the device's multiprocessor count.
//
// Bytes moved (the floor): forward reads x, w and writes y, rstd; backward reads x, w, rstd, dy,
// reads and writes dw, writes dx; plus the partial rows (grid x D fp32, written and read once,
// ~4 MB at D = 4096 on an H200 against 192 MB for [8192, 4096]).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/rmsnorm/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::Pack;
using cuda::zero_pack;

constexpr int kBlock = 256;

// Packs kept in registers per thread: 32 elements with 16-byte packs, 16 with scalar ones.
template <int V>
constexpr int packs_per_thread() {
  return V == 8 ? 4 : 16;
}

// Sum of v over the tpr threads of the caller's row group, in every thread of the group. tpr is a
// power of two, uniform over the block; every thread of the block must call this (it may hold
// barriers, and the shuffles name the whole warp). Groups of up to 32 threads are aligned lane
// ranges of one warp, so the xor butterfly over offsets < tpr stays inside the group; every lane
// adds the same two numbers in the same order at each step, so all hold bit-identical sums.
__device__ __forceinline__ float group_sum(float v, int tpr, float* red /* [kBlock / 32] */) {
  const int width = tpr < 32 ? tpr : 32;
  for (int m = width >> 1; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (tpr <= 32) return v;
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  const int wpr = tpr >> 5, first = static_cast<int>(threadIdx.x / tpr) * wpr;
  float s = 0.f;
  for (int i = 0; i < wpr; ++i) s += red[first + i];  // fixed order: deterministic
  __syncthreads();                                    // red is reused by the next call
  return s;
}

template <int V>
__global__ void __launch_bounds__(kBlock)
    rmsnorm_fwd_kernel(const bf16_t* __restrict__ x,  // [R, D]
                       const bf16_t* __restrict__ w,  // [D]
                       bf16_t* __restrict__ y,        // [R, D]
                       float* __restrict__ rstd,      // [R]
                       int64_t R, int D, int tpr, float eps, float shift) {
  constexpr int P = packs_per_thread<V>();
  __shared__ float red[kBlock / 32];
  const int npacks = D / V;  // D % V == 0 (V = 8 only when D % 8 == 0)
  const int lane = static_cast<int>(threadIdx.x) % tpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / tpr) + threadIdx.x / tpr;
  const bool active = row < R;
  const int64_t off = active ? row * D : 0;  // element offset of the row

  // Every load of the row first, then the first use: P independent 16-byte loads in flight per
  // thread (a load under the same `if` as its use would wait for each before issuing the next).
  // Packs outside the row read as zeros and add nothing to the sum.
  Pack<V> xc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    xc[k] = active && c < npacks ? cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V)
                                 : zero_pack<V>();
  }
  float ss = cuda::row_sum_squares<P, V>(xc, x, off, lane, tpr, npacks, active);
  ss = group_sum(ss, tpr, red);
  if (!active) return;  // past the last barrier
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
  if (lane == 0) rstd[row] = r;

  // The w packs (L1 / L2 hits) likewise all in flight before the first use (issued after the
  // reduction: live across it they would cost a block per multiprocessor).
  Pack<V> wc[P];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    wc[k] = c < npacks ? cuda::load_pack<V>(w, static_cast<int64_t>(c) * V) : zero_pack<V>();
  }
  auto emit = [&](int c, const Pack<V>& xp, const Pack<V>& wp) {
    float xf[V], wf[V], out[V];
    cuda::unpack(xp, xf);
    cuda::unpack(wp, wf);
#pragma unroll
    for (int v = 0; v < V; ++v) out[v] = xf[v] * r * (shift + wf[v]);  // (1 + w) in fp32
    cuda::store_pack<V>(y, off + static_cast<int64_t>(c) * V, cuda::pack(out));
  };
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int c = lane + k * tpr;
    if (c < npacks) emit(c, xc[k], wc[k]);
  }
  for (int c = lane + P * tpr; c < npacks; c += tpr)
    emit(c, cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V),
         cuda::load_pack<V>(w, static_cast<int64_t>(c) * V));
}

// Forward for 2048 <= D <= 4096 (D % 8 == 0, x, w, y 16-byte aligned): two 16-byte packs a
// thread (kTpr = 128 or 256 threads a row, the smallest that holds the row; 2 or 1 rows a block)
// and the row group's width fixed at compile time, so the index arithmetic folds into constants,
// the loads are unconditional (a pack past the row reads pack 0 and is not used) and the kernel
// fits in 32 registers: 8 blocks of 256 threads resident per multiprocessor, against 5 for
// rmsnorm_fwd_kernel (48 registers, 4 packs a thread). Faster at [8192, 2048] and [8192, 4096],
// slower with whole-warp rows at [65536, 128] (measured: docs/PERF.md), so narrower rows keep
// rmsnorm_fwd_kernel. The sums are added in
// rmsnorm_fwd_kernel's order (each thread's packs in order, the warp butterfly from offset 16
// down, then the row's warps in order), so at the same tpr and packs a thread the bits agree.
template <int kTpr>
__global__ void __launch_bounds__(kBlock, 8)
    rmsnorm_fwd_fixed_kernel(const bf16_t* __restrict__ x,  // [R, D]
                             const bf16_t* __restrict__ w,  // [D]
                             bf16_t* __restrict__ y,        // [R, D]
                             float* __restrict__ rstd,      // [R]
                             int64_t R, int D, float eps, float shift) {
  static_assert(kTpr >= 32 && kTpr <= kBlock && (kTpr & (kTpr - 1)) == 0, "whole warps");
  constexpr int kP = 2;            // packs a thread
  constexpr int kWpr = kTpr / 32;  // warps per row
  __shared__ float red[kBlock / 32];
  const int npacks = D / 8;
  const int lane = static_cast<int>(threadIdx.x) % kTpr;
  const int g = static_cast<int>(threadIdx.x) / kTpr;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / kTpr) + g;
  const bool active = row < R;
  const bf16_t* xr = x + (active ? row : 0) * D;
  Pack<8> xc[kP];
#pragma unroll
  for (int k = 0; k < kP; ++k) {
    const int c = lane + k * kTpr;
    xc[k] = cuda::load_pack<8>(xr, static_cast<int64_t>(c < npacks ? c : 0) * 8);
  }
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kP; ++k) {
    if (lane + k * kTpr < npacks) {
      float f[8];
      cuda::unpack(xc[k], f);
#pragma unroll
      for (int v = 0; v < 8; ++v) ss += f[v] * f[v];
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  if constexpr (kWpr > 1) {
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int i = 0; i < kWpr; ++i) ss += red[g * kWpr + i];  // fixed order
  }
  if (!active) return;
  const float r = rsqrtf(ss / static_cast<float>(D) + eps);
  if (lane == 0) rstd[row] = r;
  Pack<8> wc[kP];
#pragma unroll
  for (int k = 0; k < kP; ++k) {
    const int c = lane + k * kTpr;
    wc[k] = cuda::load_pack<8>(w, static_cast<int64_t>(c < npacks ? c : 0) * 8);
  }
  bf16_t* yr = y + row * D;
#pragma unroll
  for (int k = 0; k < kP; ++k) {
    const int c = lane + k * kTpr;
    if (c < npacks) {
      float xf[8], wf[8], out[8];
      cuda::unpack(xc[k], xf);
      cuda::unpack(wc[k], wf);
#pragma unroll
      for (int v = 0; v < 8; ++v) out[v] = xf[v] * r * (shift + wf[v]);  // (1 + w) in fp32
      cuda::store_pack<8>(yr, static_cast<int64_t>(c) * 8, cuda::pack(out));
    }
  }
}

// The dw accumulators of the register-held packs live in shared memory, thread-private: thread
// `tid` keeps the P * V fp32 sums of its columns at acc[(k * (V / 4) + h) * kBlock + tid] (float4,
// V = 8) or acc[k * kBlock + tid] (V = 1), so each access of a warp is one contiguous,
// conflict-free line. In registers they would cost 32 registers a thread, and the registers are
// better spent on the next row's loads.
template <int V>
__device__ __forceinline__ void acc_add(float* acc, int k, const float (&d)[V]) {
  if constexpr (V == 8) {
    float4* a = reinterpret_cast<float4*>(acc) + (2 * k) * kBlock + threadIdx.x;  // [2] x kBlock
    float4 lo = a[0], hi = a[kBlock];
    lo.x += d[0], lo.y += d[1], lo.z += d[2], lo.w += d[3];
    hi.x += d[4], hi.y += d[5], hi.z += d[6], hi.w += d[7];
    a[0] = lo, a[kBlock] = hi;
  } else {
    acc[k * kBlock + threadIdx.x] += d[0];
  }
}

// Thread `t`'s sum for element v of its k-th register-held pack.
template <int V>
__device__ __forceinline__ float acc_at(const float* acc, int t, int k, int v) {
  if constexpr (V == 8) {
    return acc[((2 * k + v / 4) * kBlock + t) * 4 + v % 4];
  } else {
    return acc[k * kBlock + t];
  }
}

// Floats of shared memory for the accumulators: P * V per thread.
template <int V>
constexpr int acc_floats() {
  return packs_per_thread<V>() * V * kBlock;
}

// Backward. Persistent: each row group walks rows with a grid stride and loads the x and dy packs
// (and rstd) of its next row before it works on the current one, so a row's loads are in flight
// while the previous row is reduced and written (16-byte loads, 8 per thread at D = 4096). Two
// blocks per multiprocessor at least (<= 128 registers).
template <int V>
__global__ void __launch_bounds__(kBlock, 2)
    rmsnorm_bwd_kernel(const bf16_t* __restrict__ x,    // [R, D]
                       const bf16_t* __restrict__ w,    // [D]
                       const float* __restrict__ rstd,  // [R]
                       const bf16_t* __restrict__ dy,   // [R, D]
                       bf16_t* __restrict__ dx,         // [R, D]
                       float* __restrict__ partial,     // [gridDim.x, D] dw partial rows
                       int64_t R, int D, int tpr, float shift) {
  constexpr int P = packs_per_thread<V>();
  __shared__ float red[kBlock / 32];
  extern __shared__ float4 acc_smem[];              // [acc_floats<V>() / 4]
  float* acc = reinterpret_cast<float*>(acc_smem);  // [P * V, kBlock] (see acc_add)
  const int npacks = D / V;
  const int rpb = kBlock / tpr;
  const int g = static_cast<int>(threadIdx.x) / tpr;
  const int lane = static_cast<int>(threadIdx.x) % tpr;
  float* mine = partial + static_cast<int64_t>(blockIdx.x) * D;  // [D] this block's partial row

  // This thread owns the same columns in every row; it zeroes its own sums (no barrier needed:
  // nobody else touches them before the final sum).
  constexpr int kSlots = V == 8 ? 2 * P : P;  // float4 (V = 8) or float (V = 1) slots
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if constexpr (V == 8) {
      reinterpret_cast<float4*>(acc)[i * kBlock + threadIdx.x] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
      acc[i * kBlock + threadIdx.x] = 0.f;
    }
  }
  // Columns past the register-held ones exist only when rpb == 1 (tpr == kBlock): their dw goes
  // straight to this block's partial row, which only this thread touches.
  for (int c = lane + P * tpr; c < npacks; c += tpr) {
#pragma unroll
    for (int v = 0; v < V; ++v) mine[c * V + v] = 0.f;
  }

  // The next row's packs: all loads issued back to back; packs outside the row read as zeros.
  Pack<V> xn[P], dn[P];
  float rn = 0.f;
  auto fetch = [&](int64_t row) {
    const bool act = row < R;
    const int64_t off = act ? row * D : 0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      const bool ok = act && c < npacks;
      xn[k] = ok ? cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
      dn[k] = ok ? cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V) : zero_pack<V>();
    }
    rn = act ? rstd[row] : 0.f;
  };

  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  fetch(static_cast<int64_t>(blockIdx.x) * rpb + g);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < R; base += stride) {
    // `base` is uniform over the block, so every thread runs the same number of iterations and
    // meets the barriers in group_sum.
    const int64_t row = base + g;
    const bool active = row < R;
    const int64_t off = active ? row * D : 0;
    Pack<V> xc[P], dyc[P];
#pragma unroll
    for (int k = 0; k < P; ++k) xc[k] = xn[k], dyc[k] = dn[k];
    const float r = rn;
    fetch(row + stride);
    // w: L1 / L2 hits, all in flight before the first use.
    Pack<V> wc[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      wc[k] = c < npacks ? cuda::load_pack<V>(w, static_cast<int64_t>(c) * V) : zero_pack<V>();
    }
    float dot = 0.f;  // sum(dy * gw * x) over the row, gw = w or 1 + w (formed in fp32)
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float xf[V], df[V], wf[V];
        cuda::unpack(xc[k], xf);
        cuda::unpack(dyc[k], df);
        cuda::unpack(wc[k], wf);
#pragma unroll
        for (int v = 0; v < V; ++v) dot += df[v] * (shift + wf[v]) * xf[v];
      }
    }
    for (int c = lane + P * tpr; active && c < npacks; c += tpr) {
      float xf[V], df[V], wf[V];
      cuda::unpack(cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V), xf);
      cuda::unpack(cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V), df);
      cuda::unpack(cuda::load_pack<V>(w, static_cast<int64_t>(c) * V), wf);
#pragma unroll
      for (int v = 0; v < V; ++v) dot += df[v] * (shift + wf[v]) * xf[v];
    }
    dot = group_sum(dot, tpr, red);
    if (!active) continue;
    const float m = dot * r / static_cast<float>(D);  // mean(dy * gw * xhat)
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float xf[V], df[V], wf[V], out[V], dwv[V];
        cuda::unpack(xc[k], xf);
        cuda::unpack(dyc[k], df);
        cuda::unpack(wc[k], wf);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float xhat = xf[v] * r;
          out[v] = r * (df[v] * (shift + wf[v]) - xhat * m);
          dwv[v] = df[v] * xhat;
        }
        cuda::store_pack<V>(dx, off + static_cast<int64_t>(c) * V, cuda::pack(out));
        acc_add<V>(acc, k, dwv);
      }
    }
    for (int c = lane + P * tpr; c < npacks; c += tpr) {
      float xf[V], df[V], wf[V], out[V];
      cuda::unpack(cuda::load_pack<V>(x, off + static_cast<int64_t>(c) * V), xf);
      cuda::unpack(cuda::load_pack<V>(dy, off + static_cast<int64_t>(c) * V), df);
      cuda::unpack(cuda::load_pack<V>(w, static_cast<int64_t>(c) * V), wf);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float xhat = xf[v] * r;
        out[v] = r * (df[v] * (shift + wf[v]) - xhat * m);
        mine[c * V + v] += df[v] * xhat;
      }
      cuda::store_pack<V>(dx, off + static_cast<int64_t>(c) * V, cuda::pack(out));
    }
  }

  // The block's partial row: the row groups' sums added in group order (j = 0, 1, ...), column by
  // column, over the register-held columns (all of them unless rpb == 1 and D > P * tpr * V, whose
  // further columns are already in `mine`).
  __syncthreads();
  const int held = min(D, P * tpr * V);
  for (int col = static_cast<int>(threadIdx.x); col < held; col += kBlock) {
    const int c = col / V, v = col % V, k = c / tpr, ln = c % tpr;
    float sum = 0.f;
    for (int j = 0; j < rpb; ++j) sum += acc_at<V>(acc, j * tpr + ln, k, v);
    mine[col] = sum;
  }
}

struct Layout {
  int vec;  // elements per pack: 8 or 1
  int tpr;  // threads per row
  int rpb;  // rows per block
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

Layout layout_for(int D, bool vec_ok) {
  Layout l;
  l.vec = vec_ok && D % 8 == 0 ? 8 : 1;
  const int per_thread = l.vec == 8 ? packs_per_thread<8>() : packs_per_thread<1>();
  const int npacks = D / l.vec;
  const int need = (npacks + per_thread - 1) / per_thread;
  // Small rows get small groups (down to one thread per row): a whole warp on a 128-wide row would
  // leave half its lanes idle and too few bytes in flight.
  l.tpr = 1;
  while (l.tpr < need && l.tpr < kBlock) l.tpr *= 2;
  l.rpb = kBlock / l.tpr;
  return l;
}

template <class T>
const bf16_t* dev(const Tensor& t) {
  return reinterpret_cast<const bf16_t*>(t.ptr<T>());
}

void forward(const RmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  if (R == 0) return;
  GDN_CHECK(D <= INT_MAX / 2, "rmsnorm (cuda): row width {} is too large", D);
  const bf16_t* x = dev<bf16>(a.x);                 // [R, D]
  const bf16_t* w = dev<bf16>(a.w);                 // [D]
  bf16_t* y = const_cast<bf16_t*>(dev<bf16>(a.y));  // [R, D]
  float* rstd = a.rstd.ptr<float>();                // [R]
  const Layout l = layout_for(static_cast<int>(D), aligned16(x) && aligned16(w) && aligned16(y));
  const int64_t grid = (R + l.rpb - 1) / l.rpb;
  GDN_CHECK(grid <= INT_MAX, "rmsnorm (cuda): {} rows is too many", R);
  const float shift = a.zero_centred ? 1.f : 0.f;
  cudaStream_t s = cuda::stream();
  if (l.vec == 8 && D >= 2048 && D <= 4096) {
    const int tpr = D / 8 <= 2 * 128 ? 128 : 256;  // two packs a thread hold the row
    const int64_t blocks = (R + kBlock / tpr - 1) / (kBlock / tpr);
    auto kernel = tpr == 128 ? rmsnorm_fwd_fixed_kernel<128> : rmsnorm_fwd_fixed_kernel<256>;
    kernel<<<static_cast<unsigned>(blocks), kBlock, 0, s>>>(x, w, y, rstd, R, static_cast<int>(D),
                                                            static_cast<float>(a.eps), shift);
    GDN_CUDA_LAUNCH_CHECK("rmsnorm_fwd_fixed_kernel");
    return;
  }
  if (l.vec == 8) {
    rmsnorm_fwd_kernel<8><<<static_cast<unsigned>(grid), kBlock, 0, s>>>(
        x, w, y, rstd, R, static_cast<int>(D), l.tpr, static_cast<float>(a.eps), shift);
  } else {
    rmsnorm_fwd_kernel<1><<<static_cast<unsigned>(grid), kBlock, 0, s>>>(
        x, w, y, rstd, R, static_cast<int>(D), l.tpr, static_cast<float>(a.eps), shift);
  }
  GDN_CUDA_LAUNCH_CHECK("rmsnorm_fwd_kernel");
}

void backward(const RmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  if (R == 0 || D == 0) return;  // dw += 0
  GDN_CHECK(D <= INT_MAX / 2, "rmsnorm (cuda): row width {} is too large", D);
  const bf16_t* x = dev<bf16>(a.x);                   // [R, D]
  const bf16_t* w = dev<bf16>(a.w);                   // [D]
  const float* rstd = a.rstd.ptr<float>();            // [R]
  const bf16_t* dy = dev<bf16>(a.dy);                 // [R, D]
  bf16_t* dx = const_cast<bf16_t*>(dev<bf16>(a.dx));  // [R, D]
  float* dw = a.dw.ptr<float>();                      // [D]
  const Layout l = layout_for(static_cast<int>(D),
                              aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx));
  // The dw accumulators: P * V fp32 per thread (32 KB at most, within the default 48 KB).
  const size_t smem =
      static_cast<size_t>(l.vec == 8 ? acc_floats<8>() : acc_floats<1>()) * sizeof(float);
  const void* kernel = l.vec == 8 ? reinterpret_cast<const void*>(&rmsnorm_bwd_kernel<8>)
                                  : reinterpret_cast<const void*>(&rmsnorm_bwd_kernel<1>);
  cuda::Context& ctx = cuda::Context::get();
  int per_sm = 0;
  GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem));
  const int64_t batches = (R + l.rpb - 1) / l.rpb;
  const int grid = static_cast<int>(
      std::min<int64_t>(batches, static_cast<int64_t>(ctx.sm_count()) * std::max(per_sm, 1)));
  float* partial = static_cast<float*>(  // [grid, D]
      ctx.scratch(rmsnorm_partial_bytes(grid, D), "rmsnorm"));
  const float shift = a.zero_centred ? 1.f : 0.f;
  cudaStream_t s = ctx.stream();
  if (l.vec == 8) {
    rmsnorm_bwd_kernel<8><<<grid, kBlock, smem, s>>>(x, w, rstd, dy, dx, partial, R,
                                                     static_cast<int>(D), l.tpr, shift);
  } else {
    rmsnorm_bwd_kernel<1><<<grid, kBlock, smem, s>>>(x, w, rstd, dy, dx, partial, R,
                                                     static_cast<int>(D), l.tpr, shift);
  }
  GDN_CUDA_LAUNCH_CHECK("rmsnorm_bwd_kernel");
  cuda::column_sum_add_kernel<>
      <<<static_cast<unsigned>((D + 31) / 32), 256, 0, s>>>(partial, dw, grid, static_cast<int>(D));
  GDN_CUDA_LAUNCH_CHECK("column_sum_add_kernel");
}

const RmsNormTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(rmsnorm_cuda) {
  Registry::global().add_impl({"rmsnorm", "cuda.rowwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
