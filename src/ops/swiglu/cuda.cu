// SwiGLU on CUDA: bf16 gate/up/y/dy/dgate/dup, fp32 arithmetic, one rounding per output (op.h has
// the contract; Liger's swiglu.py is the peer).
//
// Elementwise over the flattened R x I elements: each thread handles kUnroll packs of 8 bf16
// (16-byte accesses; consecutive threads on consecutive packs), issuing every load before the
// first use so that 2 x kUnroll (forward) or 3 x kUnroll (backward) 16-byte loads are in flight per
// thread. When a pointer is not 16-byte aligned the same kernel runs on single elements; when n is
// not a multiple of 8 the last block also does the n % 8 tail element by element.
// In-place backward (dgate over gate, dup over up): each thread reads all of its elements of gate,
// up and dy before writing any element of dgate or dup, and no other thread touches those
// elements; gate and up are therefore read with plain coherent loads (not the read-only path) and
// carry no __restrict__.
// Bytes moved (the floor): forward 3 x 2n bytes, backward 5 x 2n bytes.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/swiglu/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::Pack;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

__device__ __forceinline__ float swiglu_y(float g, float u) {
  return g * cuda::sigmoidf_safe(g) * u;
}

// dgate and dup of one element.
__device__ __forceinline__ void swiglu_grads(float g, float u, float d, float& dg, float& du) {
  const float s = cuda::sigmoidf_safe(g);
  const float silu = g * s;
  du = d * silu;
  dg = d * u * (s + silu * (1.f - s));
}

template <int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(const bf16_t* __restrict__ gate,  // [n]
                      const bf16_t* __restrict__ up,    // [n]
                      bf16_t* __restrict__ y,           // [n]
                      int64_t n) {
  const int64_t npacks = n / V;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kUnroll * kThreads + threadIdx.x;
  Pack<V> gp[kUnroll], upk[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i < npacks) {
      gp[k] = cuda::load_pack<V>(gate, i * V);
      upk[k] = cuda::load_pack<V>(up, i * V);
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i < npacks) {
      float g[V], u[V], o[V];
      cuda::unpack(gp[k], g);
      cuda::unpack(upk[k], u);
#pragma unroll
      for (int v = 0; v < V; ++v) o[v] = swiglu_y(g[v], u[v]);
      cuda::store_pack<V>(y, i * V, cuda::pack(o));
    }
  }
  if (V > 1 && blockIdx.x == gridDim.x - 1) {  // the n % V tail, element by element
    const int64_t j = npacks * V + threadIdx.x;
    if (threadIdx.x < V && j < n) {
      float g[1], u[1], o[1];
      cuda::unpack(cuda::load_pack<1>(gate, j), g);
      cuda::unpack(cuda::load_pack<1>(up, j), u);
      o[0] = swiglu_y(g[0], u[0]);
      cuda::store_pack<1>(y, j, cuda::pack(o));
    }
  }
}

// No __restrict__ on gate/up/dgate/dup: dgate may alias gate and dup may alias up.
template <int V>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(const bf16_t* gate,             // [n]
                      const bf16_t* up,               // [n]
                      const bf16_t* __restrict__ dy,  // [n], never aliased
                      bf16_t* dgate,                  // [n], may alias gate
                      bf16_t* dup,                    // [n], may alias up
                      int64_t n) {
  const int64_t npacks = n / V;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kUnroll * kThreads + threadIdx.x;
  Pack<V> gp[kUnroll], upk[kUnroll], dp[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i < npacks) {
      gp[k] = cuda::load_pack_coherent<V>(gate, i * V);
      upk[k] = cuda::load_pack_coherent<V>(up, i * V);
      dp[k] = cuda::load_pack<V>(dy, i * V);
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i < npacks) {
      float g[V], u[V], d[V], dg[V], du[V];
      cuda::unpack(gp[k], g);
      cuda::unpack(upk[k], u);
      cuda::unpack(dp[k], d);
#pragma unroll
      for (int v = 0; v < V; ++v) swiglu_grads(g[v], u[v], d[v], dg[v], du[v]);
      cuda::store_pack<V>(dgate, i * V, cuda::pack(dg));
      cuda::store_pack<V>(dup, i * V, cuda::pack(du));
    }
  }
  if (V > 1 && blockIdx.x == gridDim.x - 1) {
    const int64_t j = npacks * V + threadIdx.x;
    if (threadIdx.x < V && j < n) {
      float g[1], u[1], d[1], dg[1], du[1];
      cuda::unpack(cuda::load_pack_coherent<1>(gate, j), g);
      cuda::unpack(cuda::load_pack_coherent<1>(up, j), u);
      cuda::unpack(cuda::load_pack<1>(dy, j), d);
      swiglu_grads(g[0], u[0], d[0], dg[0], du[0]);
      cuda::store_pack<1>(dgate, j, cuda::pack(dg));
      cuda::store_pack<1>(dup, j, cuda::pack(du));
    }
  }
}

const bf16_t* in(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }

// Blocks for n elements in packs of v (at least one when there is a tail).
unsigned blocks_for(int64_t n, int v) {
  const int64_t per_block = static_cast<int64_t>(kUnroll) * kThreads;
  const int64_t blocks = std::max<int64_t>(1, (n / v + per_block - 1) / per_block);
  GDN_CHECK(blocks <= INT_MAX, "swiglu (cuda): {} elements is too many", n);
  return static_cast<unsigned>(blocks);
}

void forward(const SwigluFwd& a) {
  const int64_t n = a.gate.numel();
  if (n == 0) return;
  const bf16_t* gate = in(a.gate);  // [R, I]
  const bf16_t* up = in(a.up);      // [R, I]
  bf16_t* y = out(a.y);             // [R, I]
  cudaStream_t s = cuda::stream();
  if (cuda::aligned16(gate) && cuda::aligned16(up) && cuda::aligned16(y)) {
    swiglu_fwd_kernel<8><<<blocks_for(n, 8), kThreads, 0, s>>>(gate, up, y, n);
  } else {
    swiglu_fwd_kernel<1><<<blocks_for(n, 1), kThreads, 0, s>>>(gate, up, y, n);
  }
  GDN_CUDA_LAUNCH_CHECK("swiglu_fwd_kernel");
}

void backward(const SwigluBwd& a) {
  const int64_t n = a.gate.numel();
  if (n == 0) return;
  const bf16_t* gate = in(a.gate);  // [R, I]
  const bf16_t* up = in(a.up);      // [R, I]
  const bf16_t* dy = in(a.dy);      // [R, I]
  bf16_t* dgate = out(a.dgate);     // [R, I], may alias gate
  bf16_t* dup = out(a.dup);         // [R, I], may alias up
  cudaStream_t s = cuda::stream();
  if (cuda::aligned16(gate) && cuda::aligned16(up) && cuda::aligned16(dy) &&
      cuda::aligned16(dgate) && cuda::aligned16(dup)) {
    swiglu_bwd_kernel<8><<<blocks_for(n, 8), kThreads, 0, s>>>(gate, up, dy, dgate, dup, n);
  } else {
    swiglu_bwd_kernel<1><<<blocks_for(n, 1), kThreads, 0, s>>>(gate, up, dy, dgate, dup, n);
  }
  GDN_CUDA_LAUNCH_CHECK("swiglu_bwd_kernel");
}

const SwigluTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(swiglu_cuda) {
  Registry::global().add_impl({"swiglu", "cuda.elementwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
