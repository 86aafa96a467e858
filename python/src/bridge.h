// The Python extension's link to the caller's CUDA stream (python/src, docs/PYTHON.md).
#pragma once

#include <cstdint>

namespace gdn::python {

// True when this build has the CUDA backend (GDN_CUDA=ON).
bool cuda_built();

// For the lifetime of a StreamOrder, libgdn's CUDA work is ordered after everything issued so far
// on the caller's stream `stream` (a cudaStream_t as an integer; 0 = the legacy default stream),
// and the caller's stream waits, from the destructor on, for everything libgdn issued meanwhile.
// libgdn issues its kernels on its own compute stream (gdn/backend/cuda_context.h); two events
// (no host wait) make that invisible to the caller: its stream sees the op as if it had run on it,
// and PyTorch's caching allocator, which orders memory reuse by the caller's stream, stays right.
// `device` is the caller's CUDA device index and must be the device of libgdn's CUDA context.
// In a build without CUDA the constructor throws gdn::Error. Hold the GIL while one exists (the
// two events are shared).
class StreamOrder {
 public:
  StreamOrder(uintptr_t stream, int device);
  ~StreamOrder();
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

 private:
  uintptr_t stream_ = 0;
};

}  // namespace gdn::python
