// Gated attention on CUDA: the attention backward's instantiations (head dims 64, 128, 256) and
// launchers. The kernels are in cuda_bwd.cuh, the design in cuda.cu.
#include "ops/gated_attention/cuda_bwd.cuh"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/launch_hd.cuh"

namespace gdn::ops::attn {

void launch_bwd_dq(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  launch_hd_class(
      p, hd_class, blocks, stream, "attn_bwd_dq_kernel",
      [](auto hd) { return &attn_bwd_dq_kernel<decltype(hd)::value>; },
      [](auto hd) { return dq_smem_bytes<decltype(hd)::value>(); });
}

void launch_bwd_dkdv(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  launch_hd_class(
      p, hd_class, blocks, stream, "attn_bwd_dkdv_kernel",
      [](auto hd) { return &attn_bwd_dkdv_kernel<decltype(hd)::value>; },
      [](auto hd) { return dkdv_smem_bytes<decltype(hd)::value>(); });
}

}  // namespace gdn::ops::attn
