// SiLU on CUDA: bf16 x/y/dy/dx, fp32 arithmetic, one rounding per output (op.h has the
// contract), through the shared elementwise map (backend/cuda/memory_bound.cuh) with swiglu's
// expressions (silu = x * s, silu' = s + silu * (1 - s)). An A/B building block, not tuned.
// Bytes moved (the floor): forward 2 x 2n bytes, backward 3 x 2n bytes.
#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/silu/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

struct SiluY {
  __device__ float operator()(float x, float) const { return x * cuda::sigmoidf_safe(x); }
};
struct SiluDx {  // (x, dy) -> dx
  __device__ float operator()(float x, float d) const {
    const float s = cuda::sigmoidf_safe(x);
    return d * (s + x * s * (1.f - s));
  }
};

const bf16_t* in(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }

void forward(const SiluFwd& a) {
  cuda::launch_map2(in(a.x), in(a.x), out(a.y), a.x.numel(), SiluY{}, cuda::stream());
  GDN_CUDA_LAUNCH_CHECK("map2_kernel (silu forward)");
}

void backward(const SiluBwd& a) {
  cuda::launch_map2(in(a.x), in(a.dy), out(a.dx), a.x.numel(), SiluDx{}, cuda::stream());
  GDN_CUDA_LAUNCH_CHECK("map2_kernel (silu backward)");
}

const SiluTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(silu_cuda) {
  Registry::global().add_impl({"silu", "cuda.elementwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
