// cross_entropy on CUDA: bf16 logits / dlogits, fp32 loss, lse, z_loss (op.h has the contract).
// One block of 256 threads per row: pass 1 the row max, pass 2 the sum of exp(z - max) (each
// thread strides the row, then a fixed-order block reduction: deterministic), then loss, lse and
// z-loss by thread 0 and, with dlogits, pass 3 writes c ((1 + 2 lambda lse) p_j - [j = y]) with
// p_y - 1 as expm1f(z_y - lse). z_y is read before the block's first barrier, so an in-place
// dlogits (over logits) only overwrites elements after every read of them. An A/B building block
// (the unfused LM-head route), not tuned: the fused linear_cross_entropy is the fast path.
#include <cfloat>
#include <climits>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/cross_entropy/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

constexpr int kThreads = 256;

__device__ __forceinline__ float ld(const bf16_t* p, int64_t i) {
  float f[1];
  cuda::unpack(cuda::load_pack_coherent<1>(p, i), f);
  return f[0];
}

// Block-wide reduction of v (op: max or sum) in a fixed order; every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float v, float* red) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, m);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kThreads / 32; ++w) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is reused by the next reduction
  return r;
}

__global__ void __launch_bounds__(kThreads)
    cross_entropy_rows_kernel(const bf16_t* z,                 // [R, V], may alias dz
                              const int32_t* __restrict__ tg,  // [R]
                              float* __restrict__ loss,        // [R]
                              float* __restrict__ lse_out,     // [R]
                              float* __restrict__ zl,          // [R]
                              bf16_t* dz,                      // [R, V] or null
                              int64_t V, float lam, float c) {
  __shared__ float red[kThreads / 32];
  const int64_t row = blockIdx.x;
  const bf16_t* zr = z + row * V;
  const int32_t y = tg[row];
  const bool ok = y >= 0 && y < V;
  const bool ignored = y == -100;
  const float zy = ok ? ld(zr, y) : 0.f;  // every thread, before any write
  float m = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) m = fmaxf(m, ld(zr, j));
  m = block_reduce<true>(m, red);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) s += expf(ld(zr, j) - m);
  s = block_reduce<false>(s, red);
  const float l = m + logf(s);
  if (threadIdx.x == 0) {
    lse_out[row] = l;
    zl[row] = ok ? lam * l * l : 0.f;
    loss[row] = ok ? l - zy + lam * l * l : (ignored ? 0.f : __int_as_float(0x7fc00000));
  }
  if (dz == nullptr) return;
  bf16_t* dr = dz + row * V;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    float g = 0.f;
    if (ok) {
      const float p = expf(ld(zr, j) - l);
      g = j == y ? expm1f(zy - l) + 2.f * lam * l * p : (1.f + 2.f * lam * l) * p;
    }
    float o[1] = {c * g};
    cuda::store_pack<1>(dr, j, cuda::pack(o));
  }
}

void run(const CrossEntropyArgs& a) {
  const int64_t R = a.logits.size(0), V = a.logits.size(1);
  if (R == 0) return;
  GDN_CHECK(a.logits.dtype() == DType::BF16 && R <= INT_MAX,
            "cross_entropy (cuda): tensor 'logits' must be BF16 with at most {} rows", INT_MAX);
  const bf16_t* z = reinterpret_cast<const bf16_t*>(a.logits.ptr<bf16>());
  bf16_t* dz = a.dlogits.defined() ? reinterpret_cast<bf16_t*>(a.dlogits.ptr<bf16>()) : nullptr;
  cross_entropy_rows_kernel<<<static_cast<unsigned>(R), kThreads, 0, cuda::stream()>>>(
      z, a.targets.ptr<int32_t>(), a.loss.ptr<float>(), a.lse.ptr<float>(), a.z_loss.ptr<float>(),
      dz, V, static_cast<float>(a.z_loss_scale), static_cast<float>(a.grad_scale));
  GDN_CUDA_LAUNCH_CHECK("cross_entropy_rows_kernel");
}

const CrossEntropyTable kTable{run};

}  // namespace

GDN_REGISTER(cross_entropy_cuda) {
  Registry::global().add_impl({"cross_entropy", "cuda.rows", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
