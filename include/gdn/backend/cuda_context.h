// The per-process CUDA context (ARCHITECTURE.md §5, §7): the device, its properties, the one
// compute stream every kernel and library call is issued on, a cuBLASLt handle and its workspace,
// and the scratch() of kernels' temporaries (a bound, planned op workspace, or else a grow-only
// buffer). Created on first use (the first device
// allocation, copy or kernel) and deliberately never destroyed: tearing down a stream or a cuBLASLt
// handle from a static destructor after the CUDA runtime has unloaded crashes, and the driver frees
// everything at exit anyway.
//
// Ordering: the compute stream is a *blocking* stream, so it is ordered with the legacy default
// stream (plain cudaMemcpy, cudaMemset) as well; the device hooks of gdn/core/tensor.h issue their
// copies and memsets on the compute stream itself, and copies synchronise it before returning.
//
// CUDA-only: include from .cu files (the CPU build never sees the CUDA headers).
#pragma once

#if !defined(__CUDACC__)
#error "gdn/backend/cuda_context.h is for .cu files of CUDA builds only"
#endif

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

#include "gdn/backend/op_workspace.h"

namespace gdn::cuda {

class Context {
 public:
  // The context of the current device, created on first call (thread-safe). Throws gdn::Error
  // with a hint when no CUDA device is usable.
  static Context& get();

  int device() const { return device_; }
  const cudaDeviceProp& props() const { return props_; }
  int sm_count() const { return props_.multiProcessorCount; }
  cudaStream_t stream() const { return stream_; }
  cublasLtHandle_t cublaslt() const { return cublaslt_; }
  // cuBLASLt workspace (32 MiB, NVIDIA's recommendation for Hopper), allocated once.
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // At least `bytes` of device memory for one op's temporaries (e.g. per-block partial sums);
  // `op` names the requesting op in errors. Stream-ordered: valid for work enqueued on stream()
  // until the next scratch() call.
  //  - While a workspace is bound (bind_workspace; the model binds its planned "op workspace"
  //    region for a step, ARCHITECTURE.md §7) it returns that region, and a request larger than it
  //    throws gdn::Error naming `op` and both sizes (check_op_workspace of
  //    gdn/backend/op_workspace.h): never a grow.
  //  - While nothing is bound (unit tests, `ops run`, probes, benchmarks, and for now the
  //    optimizer) it keeps the grow-only behaviour: grows (synchronising the stream first) and
  //    never shrinks, so a training step allocates nothing once its first step has run.
  void* scratch(size_t bytes, const char* op = nullptr);

  // Binds [ptr, ptr + bytes) as the op workspace that scratch() hands out, until unbound. The
  // region is the caller's (nothing is freed); binding replaces an earlier binding (use
  // ScopedWorkspace to restore it). A 0-byte region (ptr may then be null) is a binding too: every
  // non-zero request is then an error.
  void bind_workspace(void* ptr, size_t bytes);
  // Frees the grow-only buffer (waits for the compute stream first); the next unbound request
  // allocates again.
  void release_scratch();
  void unbind_workspace();
  bool workspace_bound() const { return bound_; }
  void* bound_workspace() const { return bound_ptr_; }
  size_t bound_workspace_bytes() const { return bound_bytes_; }

  // Test hook: the largest `bytes` any scratch() call asked for since the last reset (bound or
  // not), so that GPU tests can check an op's requests against its declared bound.
  size_t peak_scratch_request() const { return peak_request_; }
  void reset_peak_scratch_request() { peak_request_ = 0; }

  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

 private:
  Context();
  int device_ = 0;
  cudaDeviceProp props_{};
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::mutex scratch_mu_;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  bool bound_ = false;
  void* bound_ptr_ = nullptr;
  size_t bound_bytes_ = 0;
  size_t peak_request_ = 0;
};

// Binds a planned op workspace for a scope and restores the previous binding (or none) on exit
// (the class host code uses too, gdn/backend/op_workspace.h).
using ScopedWorkspace = ::gdn::OpWorkspaceBinding;

// Shorthand for the compute stream.
inline cudaStream_t stream() { return Context::get().stream(); }

// True when the CUDA runtime found at least one device at start-up (the device hooks are then
// installed and cuda_available() of gdn/core/tensor.h is true as well).
bool device_present();

// Counts one drain (device_drains() of gdn/core/tensor.h): every cudaStreamSynchronize and
// cudaDeviceSynchronize the library issues, synchronous copies included, calls it first.
void note_drain();

}  // namespace gdn::cuda
