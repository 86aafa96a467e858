// axpy on CUDA: y += alpha * x for bf16 or fp32 device tensors, fp32 arithmetic, one rounding of
// y (op.h has the contract).
//
// Elementwise over the flattened elements: each thread handles kUnroll 16-byte packs (8 bf16 or 4
// fp32), every load issued before the first use; consecutive threads on consecutive packs. A
// pointer that is not 16-byte aligned sends the call to the single-element instantiation; the
// n % pack tail is done element by element by the last block. x may alias y (y += alpha * y):
// every element is read before it is written by the one thread that owns it, so both are read
// with plain coherent loads and neither pointer is __restrict__.
// Bytes moved (the floor): x read, y read and written: 3 x n x element size.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/axpy/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Loads and stores of V consecutive elements as fp32 registers; plain coherent accesses (x may
// alias y).
template <int V>
__device__ __forceinline__ void load_elems(const float* p, int64_t i, float (&f)[V]) {
  if constexpr (V == 4) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    f[0] = q.x;
    f[1] = q.y;
    f[2] = q.z;
    f[3] = q.w;
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) f[v] = p[i + v];
  }
}
template <int V>
__device__ __forceinline__ void store_elems(float* p, int64_t i, const float (&f)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p + i) = make_float4(f[0], f[1], f[2], f[3]);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) p[i + v] = f[v];
  }
}
template <int V>
__device__ __forceinline__ void load_elems(const bf16_t* p, int64_t i, float (&f)[V]) {
  cuda::unpack(cuda::load_pack_coherent<V>(p, i), f);
}
template <int V>
__device__ __forceinline__ void store_elems(bf16_t* p, int64_t i, const float (&f)[V]) {
  cuda::store_pack<V>(p, i, cuda::pack(f));
}

// T = float (V = 4 or 1) or bf16_t (V = 8 or 1).
template <class T, int V>
__global__ void __launch_bounds__(kThreads) axpy_kernel(const T* x,  // [n], may alias y
                                                        T* y,        // [n]
                                                        float alpha, int64_t n) {
  const int64_t npacks = n / V;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kUnroll * kThreads + threadIdx.x;
  float xf[kUnroll][V], yf[kUnroll][V];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i < npacks) {
      load_elems<V>(x, i * V, xf[k]);
      load_elems<V>(y, i * V, yf[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = first + static_cast<int64_t>(k) * kThreads;
    if (i < npacks) {
#pragma unroll
      for (int v = 0; v < V; ++v) yf[k][v] += alpha * xf[k][v];
      store_elems<V>(y, i * V, yf[k]);
    }
  }
  if (V > 1 && blockIdx.x == gridDim.x - 1) {  // the n % V tail
    const int64_t j = npacks * V + threadIdx.x;
    if (threadIdx.x < V && j < n) {
      float a[1], b[1];
      load_elems<1>(x, j, a);
      load_elems<1>(y, j, b);
      b[0] += alpha * a[0];
      store_elems<1>(y, j, b);
    }
  }
}

template <class T, int V>
void launch(const T* x, T* y, float alpha, int64_t n) {
  const int64_t per_block = static_cast<int64_t>(kUnroll) * kThreads;
  const int64_t blocks = std::max<int64_t>(1, (n / V + per_block - 1) / per_block);
  GDN_CHECK(blocks <= INT_MAX, "axpy (cuda): {} elements is too many", n);
  axpy_kernel<T, V><<<static_cast<unsigned>(blocks), kThreads, 0, cuda::stream()>>>(x, y, alpha, n);
  GDN_CUDA_LAUNCH_CHECK("axpy_kernel");
}

void run(const AxpyArgs& a) {
  const int64_t n = a.y.numel();
  if (n == 0) return;
  const float alpha = static_cast<float>(a.alpha);
  const bool vec = cuda::aligned16(a.x.data()) && cuda::aligned16(a.y.data());
  if (a.y.dtype() == DType::F32) {
    const float* x = a.x.ptr<float>();  // [n]
    float* y = a.y.ptr<float>();        // [n]
    vec ? launch<float, 4>(x, y, alpha, n) : launch<float, 1>(x, y, alpha, n);
    return;
  }
  GDN_CHECK(a.y.dtype() == DType::BF16,
            "axpy (cuda): tensor 'y' has dtype {}, expected BF16 or F32", dtype_name(a.y.dtype()));
  const bf16_t* x = reinterpret_cast<const bf16_t*>(a.x.ptr<bf16>());  // [n]
  bf16_t* y = reinterpret_cast<bf16_t*>(a.y.ptr<bf16>());              // [n]
  vec ? launch<bf16_t, 8>(x, y, alpha, n) : launch<bf16_t, 1>(x, y, alpha, n);
}

const AxpyTable kTable{run};

}  // namespace

GDN_REGISTER(axpy_cuda) {
  Registry::global().add_impl({"axpy", "cuda.elementwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
