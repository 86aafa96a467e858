// mul on CUDA: y = a * b for bf16 device tensors, fp32 arithmetic, one rounding of y, through the
// shared elementwise map (backend/cuda/memory_bound.cuh). An A/B building block, not tuned.
// Bytes moved (the floor): 3 x 2n bytes.
#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/mul/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

struct Product {
  __device__ float operator()(float a, float b) const { return a * b; }
};

void run(const MulArgs& m) {
  GDN_CHECK(m.a.dtype() == DType::BF16, "mul (cuda): tensor 'a' has dtype {}, expected BF16",
            dtype_name(m.a.dtype()));
  cuda::launch_map2(reinterpret_cast<const bf16_t*>(m.a.ptr<bf16>()),
                    reinterpret_cast<const bf16_t*>(m.b.ptr<bf16>()),
                    reinterpret_cast<bf16_t*>(m.y.ptr<bf16>()), m.a.numel(), Product{},
                    cuda::stream());
  GDN_CUDA_LAUNCH_CHECK("map2_kernel (mul)");
}

const MulTable kTable{run};

}  // namespace

GDN_REGISTER(mul_cuda) {
  Registry::global().add_impl({"mul", "cuda.elementwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
