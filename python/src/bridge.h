// The Python extension's view of caller memory (python/src, docs/PYTHON.md): gdn::Tensor views of
// buffers owned by the caller (PyTorch), and the CUDA stream the caller's work is ordered on.
#pragma once

#include <cstdint>

namespace gdn::python {

// True when this build has the CUDA backend (GDN_CUDA=ON).
bool cuda_built();
// Makes later CUDA ops of libgdn issue on `stream` (a cudaStream_t as an integer; 0 = the legacy
// default stream), ordered after the work they issued before (Context::use_stream). `device` is
// the caller's CUDA device index, which must be the device of libgdn's CUDA context. Throws
// gdn::Error in a build without CUDA.
void use_cuda_stream(uintptr_t stream, int device);

}  // namespace gdn::python
