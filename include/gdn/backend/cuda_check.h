// CUDA and cuBLAS error checks (ARCHITECTURE.md §8): every runtime and library call is wrapped, and
// every kernel launch is followed by GDN_CUDA_LAUNCH_CHECK. A failure throws gdn::Error carrying
// file:line, the failing expression and CUDA's own error name and string.
//
//   GDN_CUDA_CHECK(cudaMemcpyAsync(...));
//   GDN_CUBLAS_CHECK(cublasLtMatmul(...));
//   my_kernel<<<grid, block, smem, stream>>>(...);
//   GDN_CUDA_LAUNCH_CHECK("my_kernel");
//
// The launch check always reads cudaGetLastError() (bad configuration, too much shared memory,
// a sticky fault from an earlier kernel); in debug builds (NDEBUG not defined) it also synchronises
// the compute stream, so a kernel that faults is named at its own launch instead of at some later
// unrelated call.
//
// CUDA-only: include from .cu files.
#pragma once

#if !defined(__CUDACC__)
#error "gdn/backend/cuda_check.h is for .cu files of CUDA builds only"
#endif

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "gdn/backend/cuda_context.h"
#include "gdn/core/error.h"

namespace gdn::cuda::detail {

// Both clear CUDA's last-error slot first, so that an error caught and handled by a caller does not
// reappear at the next launch check.
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file,
                                     int line);
[[noreturn]] void throw_launch_error(cudaError_t err, const char* kernel, bool while_running,
                                     const char* file, int line);

inline void check_launch(const char* kernel, const char* file, int line) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) [[unlikely]]
    throw_launch_error(err, kernel, false, file, line);
#ifndef NDEBUG
  err = cudaStreamSynchronize(::gdn::cuda::stream());
  if (err != cudaSuccess) [[unlikely]]
    throw_launch_error(err, kernel, true, file, line);
#endif
}

}  // namespace gdn::cuda::detail

#define GDN_CUDA_CHECK(expr)                                                           \
  do {                                                                                 \
    const cudaError_t gdn_cuda_err_ = (expr);                                          \
    if (gdn_cuda_err_ != cudaSuccess) [[unlikely]]                                     \
      ::gdn::cuda::detail::throw_cuda_error(gdn_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define GDN_CUBLAS_CHECK(expr)                                                            \
  do {                                                                                    \
    const cublasStatus_t gdn_cublas_st_ = (expr);                                         \
    if (gdn_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      ::gdn::cuda::detail::throw_cublas_error(gdn_cublas_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch; `kernel` names it in the error.
#define GDN_CUDA_LAUNCH_CHECK(kernel) \
  ::gdn::cuda::detail::check_launch((kernel), __FILE__, __LINE__)
