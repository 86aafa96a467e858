// Op workspace (issue 22): the device memory a CUDA op takes for its temporaries through
// cuda::Context::scratch(). Each op that needs some declares an upper bound in its public op.h
// (`<op>_workspace_bytes(...)`), computed by the same function its kernel sizes the request with.
// A caller that planned the memory binds one region (cuda::Context::bind_workspace); a request
// larger than the bound region is then an error (check_op_workspace), never a grow. Host code:
// the check is testable without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace gdn {

// An upper bound of the blocks of a persistent grid over `work` items (at most one block an item)
// that is capped at the blocks resident at once on a device of `sm_count` multiprocessors: the
// occupancy a kernel reaches is at most `max_blocks_per_sm` (cudaDeviceProp::
// maxBlocksPerMultiProcessor, 32 on Hopper), so min(work, sm_count * max_blocks_per_sm) bounds
// min(work, sm_count * max(occupancy, 1)) whatever the kernel's registers and shared memory.
inline int64_t persistent_grid_bound(int64_t work, int sm_count, int max_blocks_per_sm) {
  return std::min<int64_t>(std::max<int64_t>(work, 0), static_cast<int64_t>(std::max(sm_count, 1)) *
                                                           std::max(max_blocks_per_sm, 1));
}

// Throws gdn::Error naming `op` and both sizes when `want` bytes do not fit a bound region of
// `bound` bytes.
void check_op_workspace(const char* op, size_t want, size_t bound);

// For host code (.cpp files, which cannot include gdn/backend/cuda_context.h). CUDA builds only:
// without CUDA both are an error.
//   op_workspace_device(): the current device's facts that the persistent-grid bounds take.
//   OpWorkspaceBinding: binds [ptr, ptr + bytes) as the op workspace for its lifetime
//   (cuda::ScopedWorkspace: the previous binding, or none, is restored after).
struct OpWorkspaceDevice {
  int sm_count = 0;           // cudaDeviceProp::multiProcessorCount
  int max_blocks_per_sm = 0;  // cudaDeviceProp::maxBlocksPerMultiProcessor
};
OpWorkspaceDevice op_workspace_device();

// While alive, scratch() is unbound again (the grow-only buffer), for work that is not part of the
// planned step: the resolver's probes, which run at the first call of a shape class, inside the
// step, at shapes of their own. On exit the previous binding is restored and, when one was bound,
// the grow-only buffer the suspended work grew is freed (a device synchronisation, once per probe)
// so that the planned region is the step's only op workspace. Nothing to do without CUDA.
class OpWorkspaceSuspend {
 public:
  OpWorkspaceSuspend();
  ~OpWorkspaceSuspend();
  OpWorkspaceSuspend(const OpWorkspaceSuspend&) = delete;
  OpWorkspaceSuspend& operator=(const OpWorkspaceSuspend&) = delete;

 private:
  bool prev_bound_ = false;
  void* prev_ = nullptr;
  size_t prev_bytes_ = 0;
};

class OpWorkspaceBinding {
 public:
  OpWorkspaceBinding(void* ptr, size_t bytes);
  ~OpWorkspaceBinding();
  OpWorkspaceBinding(const OpWorkspaceBinding&) = delete;
  OpWorkspaceBinding& operator=(const OpWorkspaceBinding&) = delete;

 private:
  bool prev_bound_ = false;
  void* prev_ = nullptr;
  size_t prev_bytes_ = 0;
};

}  // namespace gdn
