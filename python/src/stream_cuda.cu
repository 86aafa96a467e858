// use_cuda_stream for CUDA builds (python/src/bridge.h).
#include "bridge.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/error.h"

namespace gdn::python {

bool cuda_built() { return true; }

void use_cuda_stream(uintptr_t stream, int device) {
  cuda::Context& ctx = cuda::Context::get();
  GDN_CHECK(device == ctx.device(),
            "gdntrain: CUDA tensors on device {}, but gdntrain's CUDA context is on device {} (the "
            "current device when it was first used); use one device per process",
            device, ctx.device());
  ctx.use_stream(reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace gdn::python
