// Host launchers of the gated-attention attention kernels, defined in cuda_fwd.cu and cuda_bwd.cu
// (kept in their own translation units: the three head-dim instantiations of each are the slow
// part of the build). `hd_class` is the kernels' padded head dim: 64, 128 or 256.
#pragma once

#include <cuda_runtime.h>

#include "ops/gated_attention/cuda_common.cuh"

namespace gdn::ops::attn {

void launch_fwd(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);
void launch_bwd_dq(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);
void launch_bwd_dkdv(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);

}  // namespace gdn::ops::attn
