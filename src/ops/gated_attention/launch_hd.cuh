// The launcher shared by the attention kernels' translation units (cuda_fwd.cu, cuda_bwd.cu, and
// sm90_tma_{fwd,dq,dkdv}.cu through sm90_tma_host.cuh): instantiate
// a kernel template for the head-dim classes 64, 128 and 256 and launch the instantiation asked
// for. Included by those units only.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "gdn/backend/cuda_check.h"
#include "gdn/core/error.h"
#include "ops/gated_attention/cuda_common.cuh"

namespace gdn::ops::attn {
namespace {

// Launches kernel_of(hd)(args...) for hd = hd_class (64, 128 or 256) on `blocks` blocks of
// `threads` threads with smem_of(hd) bytes of dynamic shared memory; `hd` is a
// std::integral_constant, so kernel_of / smem_of are generic lambdas naming the instantiation,
// e.g. [](auto hd) { return &attn_fwd_kernel<decltype(hd)::value>; }
// More than 48 KiB of dynamic shared memory needs an opt-in, made once per instantiation (the
// static below is one per (caller, hd)). `what` names the kernel in errors. The TMA kernels
// (sm90_tma_host.cuh) pass their tensor maps as a second argument and their own thread count.
template <class KernelOf, class SmemOf, class... Args>
void launch_hd_class_with(int hd_class, unsigned blocks, unsigned threads, cudaStream_t stream,
                          const char* what, KernelOf kernel_of, SmemOf smem_of,
                          const Args&... args) {
  auto go = [&](auto hd) {
    const auto kernel = kernel_of(hd);
    const size_t smem = smem_of(hd);
    static const bool opted_in = [&] {
      GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
      return true;
    }();
    (void)opted_in;
    kernel<<<blocks, threads, smem, stream>>>(args...);
    GDN_CUDA_LAUNCH_CHECK(what);
  };
  switch (hd_class) {
    case 64:
      go(std::integral_constant<int, 64>{});
      break;
    case 128:
      go(std::integral_constant<int, 128>{});
      break;
    case 256:
      go(std::integral_constant<int, 256>{});
      break;
    default:
      GDN_FAIL("gated_attention (cuda): internal: no {} for head-dim class {}", what, hd_class);
  }
}

// The kernels of kThreads threads that take their parameters only.
template <class Params, class KernelOf, class SmemOf>
void launch_hd_class(const Params& p, int hd_class, unsigned blocks, cudaStream_t stream,
                     const char* what, KernelOf kernel_of, SmemOf smem_of) {
  launch_hd_class_with(hd_class, blocks, kThreads, stream, what, kernel_of, smem_of, p);
}

}  // namespace
}  // namespace gdn::ops::attn
