// Gated attention on Hopper: instantiations (head dims 64, 128, 256) and launcher of the
// pipelined dq kernel of sm90_pipe.cuh, in a translation unit of its own (each kernel's three
// instantiations are a slow compile; separate units build in parallel).
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/launch_hd.cuh"
#include "ops/gated_attention/sm90_pipe.cuh"

namespace gdn::ops::attn {

void launch_bwd_dq_pipe(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  launch_hd_class(
      p, hd_class, blocks, stream, "attn_bwd_dq_pipe_kernel",
      [](auto hd) { return &attn_bwd_dq_pipe_kernel<decltype(hd)::value>; },
      [](auto hd) { return dq_pipe_smem_bytes<decltype(hd)::value>(); });
}

}  // namespace gdn::ops::attn
