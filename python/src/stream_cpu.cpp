// StreamOrder for CPU-only builds (python/src/bridge.h): CUDA tensors are an error.
#include "bridge.h"
#include "gdn/core/error.h"

namespace gdn::python {

bool cuda_built() { return false; }

StreamOrder::StreamOrder(uintptr_t, int) {
  GDN_CHECK(false,
            "gdntrain: CUDA tensors given, but this gdntrain._C was built without CUDA (build it "
            "with -DGDN_CUDA=ON: pip install . -C cmake.define.GDN_CUDA=ON)");
}

StreamOrder::~StreamOrder() = default;

}  // namespace gdn::python
