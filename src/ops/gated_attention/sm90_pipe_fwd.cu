// Gated attention on Hopper: instantiations (head dims 64, 128, 256) and launcher of the
// pipelined forward kernel of sm90_pipe.cuh, in a translation unit of its own (each kernel's three
// instantiations are a slow compile; separate units build in parallel).
#include "gdn/backend/cuda_check.h"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/sm90_pipe.cuh"

namespace gdn::ops::attn {

namespace {

template <int HD>
void launch(const FwdParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr size_t smem = fwd_pipe_smem_bytes<HD>();
  // More than 48 KiB of dynamic shared memory needs an opt-in, once per kernel.
  static const bool opted_in = [] {
    GDN_CUDA_CHECK(cudaFuncSetAttribute(attn_fwd_pipe_kernel<HD>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    return true;
  }();
  (void)opted_in;
  attn_fwd_pipe_kernel<HD><<<blocks, kThreads, smem, stream>>>(p);
  GDN_CUDA_LAUNCH_CHECK("attn_fwd_pipe_kernel");
}

}  // namespace

void launch_fwd_pipe(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  switch (hd_class) {
    case 64:
      launch<64>(p, blocks, stream);
      break;
    case 128:
      launch<128>(p, blocks, stream);
      break;
    case 256:
      launch<256>(p, blocks, stream);
      break;
    default:
      GDN_FAIL(
          "gated_attention (cuda): internal: no pipelined forward kernel for head-dim class {}",
          hd_class);
  }
}

}  // namespace gdn::ops::attn
