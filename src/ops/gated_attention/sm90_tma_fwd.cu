// Gated attention on Hopper: instantiations (head dims 64, 128, 256) and launcher of the
// warp-specialized TMA forward of sm90_tma.cuh, in a translation unit of its own.
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/sm90_tma_host.cuh"

namespace gdn::ops::attn {

void launch_fwd_tma(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  const FwdMaps maps{head_map(p.q_hat, p.T, p.Hq, p.hd, kBigTile, p.hd),
                     head_map(p.k_hat, p.T, p.Hkv, p.hd, kFwdKeys, p.hd),
                     head_map(p.v, p.T, p.Hkv, p.hd, kFwdKeys, p.hd)};
  launch_tma_hd_class(
      p, maps, hd_class, blocks, stream, "attn_fwd_tma_kernel",
      [](auto hd) { return &attn_fwd_tma_kernel<decltype(hd)::value>; },
      [](auto hd) { return fwd_tma_smem_bytes<decltype(hd)::value>(); });
}

}  // namespace gdn::ops::attn
