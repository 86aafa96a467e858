#include "gdn/backend/op_workspace.h"

#include "gdn/core/error.h"

namespace gdn {

void check_op_workspace(const char* op, size_t want, size_t bound) {
  GDN_CHECK_HINT(want <= bound,
                 "the op's declared <op>_workspace_bytes() must bound every request its kernels "
                 "make; fix the declaration (or the planner's shapes), not the bound region",
                 "op workspace: {} requested {} bytes but the bound (planned) region holds only {} "
                 "bytes",
                 op != nullptr ? op : "(unnamed op)", want, bound);
}

#if !GDN_WITH_CUDA
OpWorkspaceDevice op_workspace_device() {
  GDN_FAIL("op workspace: op_workspace_device needs a CUDA build");
}
OpWorkspaceBinding::OpWorkspaceBinding(void*, size_t) {
  GDN_FAIL("op workspace: binding one needs a CUDA build");
}
OpWorkspaceBinding::~OpWorkspaceBinding() = default;
OpWorkspaceSuspend::OpWorkspaceSuspend() = default;
OpWorkspaceSuspend::~OpWorkspaceSuspend() = default;
#endif  // the CUDA build's definitions: src/backend/cuda/runtime.cu

}  // namespace gdn
