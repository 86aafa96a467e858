// L2 normalisation on CUDA, "cuda.staged": bf16 x/y/dy/dx, fp32 rstd, fp32 arithmetic (op.h has
// the contract). Same maths and outputs as "cuda.rowwise" (cuda.cu); persistent blocks stage the
// next rows through a cp.async ring in shared memory (ops/rmsnorm/staged.cuh has the layout, the
// ring and its invariants), so the bytes in flight do not depend on registers or on blocks being
// retired and launched.
//
// Covered here: D % 8 == 0, 0 < D <= 8192, every pointer 16-byte aligned. Everything else goes to
// "cuda.rowwise" unchanged, through the registry's table of that implementation.
//
// Forward: x staged; ss = sum(x^2) over the row group, rstd = 1 / sqrt(ss + eps), y = x * rstd.
// Backward: y, dy and rstd staged; dot = <dy, y>, dx = rstd * (dy - y * dot). At the GDN width
// (D = 128): tpr = 16, 32 rows per batch; ring of 6 (forward) / 8 (backward) slots of 8 / 16 KB.
// Rows are independent: deterministic.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/registry.h"
#include "ops/l2norm/op.h"
#include "ops/rmsnorm/staged.cuh"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::staged::kBlock;
using cuda::staged::kWarps;

template <int P>
constexpr int fwd_slots() {
  return P == 1 ? 6 : 4;
}
template <int P>
constexpr int bwd_slots() {
  return P == 1 ? 8 : 4;
}

template <int P, int S>
__global__ void __launch_bounds__(kBlock, 2)
    l2norm_staged_fwd_kernel(const bf16_t* __restrict__ x,  // [R, D]
                             bf16_t* __restrict__ y,        // [R, D]
                             float* __restrict__ rstd,      // [R]
                             int64_t R, int D, int tpr, float eps) {
  extern __shared__ uint4 ring[];  // [S][1][P][kBlock]
  __shared__ __align__(16) float red[2][kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const int g = tid / tpr, lane = tid & (tpr - 1);
  const int rpb = kBlock / tpr, npacks = D / 8;
  const int64_t nbatch = (R + rpb - 1) / rpb;
  const int64_t G = gridDim.x, niter = cuda::staged::iterations(nbatch);

  // Iteration j's packs into slot j % S; one commit group per call (empty past the end).
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
    issue(j + S - 1);                      // into the slot consumed at iteration j - 1
    cuda::staged::cp_async_wait<S - 1>();  // iteration j's group has landed
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
    if (!active) continue;
    const float r = 1.f / sqrtf(ss + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float f[8];
        cuda::unpack(cuda::Pack<8>{xp[k]}, f);
#pragma unroll
        for (int v = 0; v < 8; ++v) f[v] *= r;
        cuda::store_pack<8>(y, row * D + static_cast<int64_t>(c) * 8, cuda::pack(f));
      }
    }
  }
  cuda::staged::cp_async_wait<0>();
}

template <int P, int S>
__global__ void __launch_bounds__(kBlock, 2)
    l2norm_staged_bwd_kernel(const bf16_t* __restrict__ y,    // [R, D]
                             const float* __restrict__ rstd,  // [R]
                             const bf16_t* __restrict__ dy,   // [R, D]
                             bf16_t* __restrict__ dx,         // [R, D]
                             int64_t R, int D, int tpr) {
  extern __shared__ uint4 ring[];  // [S][2][P][kBlock] packs (y, dy), then [S][kBlock] fp32 rstd
  float* rs = reinterpret_cast<float*>(ring + S * 2 * P * kBlock);  // [S][kBlock]
  __shared__ __align__(16) float red[2][kWarps];
  const int tid = static_cast<int>(threadIdx.x);
  const int g = tid / tpr, lane = tid & (tpr - 1);
  const int rpb = kBlock / tpr, npacks = D / 8;
  const int64_t nbatch = (R + rpb - 1) / rpb;
  const int64_t G = gridDim.x, niter = cuda::staged::iterations(nbatch);

  auto issue = [&](int64_t j) {
    const int64_t row = (blockIdx.x + j * G) * rpb + g;
    if (j < niter && row < R) {
      const int slot = static_cast<int>(j % S);
#pragma unroll
      for (int k = 0; k < P; ++k) {
        const int c = lane + k * tpr;
        if (c < npacks) {
          const int64_t off = row * D + static_cast<int64_t>(c) * 8;
          cuda::staged::cp_async16(cuda::staged::ring_at<2, P>(ring, slot, 0, k), y + off);
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
    uint4 yp[P], dp[P];
    float dot = 0.f;  // <dy, y> over the row
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const bool ok = active && lane + k * tpr < npacks;
      yp[k] = ok ? *cuda::staged::ring_at<2, P>(ring, slot, 0, k) : make_uint4(0u, 0u, 0u, 0u);
      dp[k] = ok ? *cuda::staged::ring_at<2, P>(ring, slot, 1, k) : make_uint4(0u, 0u, 0u, 0u);
      float yf[8], df[8];
      cuda::unpack(cuda::Pack<8>{yp[k]}, yf);
      cuda::unpack(cuda::Pack<8>{dp[k]}, df);
#pragma unroll
      for (int v = 0; v < 8; ++v) dot += df[v] * yf[v];
    }
    const float r = active ? rs[slot * kBlock + tid] : 0.f;
    dot = cuda::staged::group_sum(dot, tpr, red, static_cast<int>(j & 1));
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float yf[8], df[8], out[8];
        cuda::unpack(cuda::Pack<8>{yp[k]}, yf);
        cuda::unpack(cuda::Pack<8>{dp[k]}, df);
#pragma unroll
        for (int v = 0; v < 8; ++v) out[v] = r * (df[v] - yf[v] * dot);
        cuda::store_pack<8>(dx, row * D + static_cast<int64_t>(c) * 8, cuda::pack(out));
      }
    }
  }
  cuda::staged::cp_async_wait<0>();
}

const bf16_t* in(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }

// The "cuda.rowwise" implementation (cuda.cu): what this one defers to outside its coverage.
const L2NormTable& rowwise() {
  static const L2NormTable* t = [] {
    for (const ImplDesc* i : Registry::global().impls("l2norm", Backend::Cuda))
      if (i->name == "cuda.rowwise") return static_cast<const L2NormTable*>(i->table);
    return static_cast<const L2NormTable*>(nullptr);
  }();
  GDN_CHECK(t != nullptr,
            "l2norm (cuda.staged): the cuda.rowwise implementation is not "
            "registered (it handles the shapes this one does not stage)");
  return *t;
}

// Persistent grid for `nbatch` batches: the blocks of `kernel` that fit on the device at once
// (dynamic shared-memory limit raised and the largest carveout asked for on every call, as in
// ops/rmsnorm/cuda_staged.cu), at most one per batch.
int grid_for(const void* kernel, size_t smem, int64_t nbatch) {
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  int per_sm = 0;
  GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlock, smem));
  GDN_CHECK(per_sm >= 1,
            "l2norm (cuda.staged): the kernel does not fit on a multiprocessor "
            "({} bytes of shared memory)",
            smem);
  const int64_t fit = static_cast<int64_t>(cuda::Context::get().sm_count()) * per_sm;
  return static_cast<int>(std::min<int64_t>(nbatch, fit));
}

template <int P>
void launch_fwd(const bf16_t* x, bf16_t* y, float* rstd, int64_t R, int D,
                const cuda::staged::Layout& l, float eps) {
  constexpr int S = fwd_slots<P>();
  const size_t smem = cuda::staged::ring_bytes(S, 1, P, 0);
  const auto kernel = &l2norm_staged_fwd_kernel<P, S>;
  const int grid = grid_for(reinterpret_cast<const void*>(kernel), smem, (R + l.rpb - 1) / l.rpb);
  kernel<<<grid, kBlock, smem, cuda::stream()>>>(x, y, rstd, R, D, l.tpr, eps);
  GDN_CUDA_LAUNCH_CHECK("l2norm_staged_fwd_kernel");
}

template <int P>
void launch_bwd(const bf16_t* y, const float* rstd, const bf16_t* dy, bf16_t* dx, int64_t R, int D,
                const cuda::staged::Layout& l) {
  constexpr int S = bwd_slots<P>();
  const size_t smem = cuda::staged::ring_bytes(S, 2, P, 1);
  const auto kernel = &l2norm_staged_bwd_kernel<P, S>;
  const int grid = grid_for(reinterpret_cast<const void*>(kernel), smem, (R + l.rpb - 1) / l.rpb);
  kernel<<<grid, kBlock, smem, cuda::stream()>>>(y, rstd, dy, dx, R, D, l.tpr);
  GDN_CUDA_LAUNCH_CHECK("l2norm_staged_bwd_kernel");
}

void forward(const L2NormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const bf16_t* x = in(a.x);          // [R, D]
  bf16_t* y = out(a.y);               // [R, D]
  float* rstd = a.rstd.ptr<float>();  // [R]
  const cuda::staged::Layout l = cuda::staged::layout_for(D);
  if (R == 0 || l.P == 0 || !cuda::aligned16(x) || !cuda::aligned16(y)) {
    rowwise().forward(a);  // also D = 0 (rstd = 1 / sqrt(eps))
    return;
  }
  const float eps = static_cast<float>(a.eps);
  if (l.P == 1) {
    launch_fwd<1>(x, y, rstd, R, static_cast<int>(D), l, eps);
  } else {
    launch_fwd<2>(x, y, rstd, R, static_cast<int>(D), l, eps);
  }
}

void backward(const L2NormBwd& a) {
  const int64_t R = a.y.size(0), D = a.y.size(1);
  const bf16_t* y = in(a.y);                // [R, D]
  const float* rstd = a.rstd.ptr<float>();  // [R]
  const bf16_t* dy = in(a.dy);              // [R, D]
  bf16_t* dx = out(a.dx);                   // [R, D]
  const cuda::staged::Layout l = cuda::staged::layout_for(D);
  if (R == 0 || l.P == 0 || !cuda::aligned16(y) || !cuda::aligned16(dy) || !cuda::aligned16(dx)) {
    rowwise().backward(a);
    return;
  }
  if (l.P == 1) {
    launch_bwd<1>(y, rstd, dy, dx, R, static_cast<int>(D), l);
  } else {
    launch_bwd<2>(y, rstd, dy, dx, R, static_cast<int>(D), l);
  }
}

const L2NormTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(l2norm_cuda_staged) {
  Registry::global().add_impl({"l2norm", "cuda.staged", Backend::Cuda, 20, nullptr, &kTable});
}

}  // namespace gdn::ops
