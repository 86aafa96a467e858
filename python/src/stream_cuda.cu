// StreamOrder for CUDA builds (python/src/bridge.h).
#include "bridge.h"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/error.h"

namespace gdn::python {

namespace {
// Created once, never destroyed (as the Context's own resources, cuda_context.h).
cudaEvent_t order_event() {
  static cudaEvent_t e = [] {
    cudaEvent_t ev = nullptr;
    GDN_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    return ev;
  }();
  return e;
}
}  // namespace

bool cuda_built() { return true; }

StreamOrder::StreamOrder(uintptr_t stream, int device) : stream_(stream) {
  cuda::Context& ctx = cuda::Context::get();
  GDN_CHECK(device == ctx.device(),
            "gdntrain: CUDA tensors on device {}, but gdntrain's CUDA context is on device {} (the "
            "current device when it was first used); use one device per process",
            device, ctx.device());
  const auto caller = reinterpret_cast<cudaStream_t>(stream);
  GDN_CUDA_CHECK(cudaEventRecord(order_event(), caller));
  GDN_CUDA_CHECK(cudaStreamWaitEvent(ctx.stream(), order_event(), 0));
}

StreamOrder::~StreamOrder() {
  // Not GDN_CUDA_CHECK: a destructor must not throw. A failure here is a broken context, which
  // the next CUDA call reports.
  const auto caller = reinterpret_cast<cudaStream_t>(stream_);
  if (cudaEventRecord(order_event(), cuda::stream()) == cudaSuccess)
    (void)cudaStreamWaitEvent(caller, order_event(), 0);
}

}  // namespace gdn::python
