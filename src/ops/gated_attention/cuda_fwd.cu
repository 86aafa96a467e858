// Gated attention on CUDA: the attention forward's instantiations (head dims 64, 128, 256) and
// launcher. The kernel is in cuda_fwd.cuh, the design in cuda.cu.
#include "ops/gated_attention/cuda_fwd.cuh"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/launch_hd.cuh"

namespace gdn::ops::attn {

void launch_fwd(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  launch_hd_class(
      p, hd_class, blocks, stream, "attn_fwd_kernel",
      [](auto hd) { return &attn_fwd_kernel<decltype(hd)::value>; },
      [](auto hd) { return fwd_smem_bytes<decltype(hd)::value>(); });
}

}  // namespace gdn::ops::attn
