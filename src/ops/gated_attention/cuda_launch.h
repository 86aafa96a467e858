// Host launchers of the gated-attention attention kernels, defined in cuda_fwd.cu, cuda_bwd.cu
// (mma.sync) and sm90_tma_{fwd,dq,dkdv}.cu (wgmma with TMA), kept in their own translation units:
// the three head-dim instantiations of each are the slow part of the build. `hd_class` is the
// kernels' padded head dim: 64, 128 or 256.
#pragma once

#include <cuda_runtime.h>

#include <string_view>

#include "ops/gated_attention/cuda_common.cuh"
#include "ops/gated_attention/op.h"

namespace gdn::ops::attn {

void launch_fwd(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);
void launch_bwd_dq(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);
void launch_bwd_dkdv(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);

// The forward with a TMA producer warp and mbarriers (sm90_tma.cuh).
void launch_fwd_tma(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);
// The dk/dv kernel with a TMA producer warp and mbarriers (sm90_tma.cuh).
void launch_bwd_dkdv_tma(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);
// The dq kernel with a TMA producer warp and mbarriers (sm90_tma.cuh).
void launch_bwd_dq_tma(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream);

// The attention kernels of one implementation.
struct AttnKernels {
  void (*fwd)(const FwdParams&, int, unsigned, cudaStream_t);
  void (*dq)(const BwdParams&, int, unsigned, cudaStream_t);
  void (*dkdv)(const BwdParams&, int, unsigned, cudaStream_t);
};

// For kernel benchmarks (bench/cuda_bench_attn_kernels.cu): the forward / backward of CUDA
// implementation `impl` (any registered CUDA one), no validation
// beyond the implementation's own, with an event recorded on the context stream before the first
// launch and after each: forward 4 marks (tile index, prologue, attention), backward 7 (tile index,
// preprocess, dk/dv, dq, epilogue, dw reduce).
constexpr int kFwdMarks = 4, kBwdMarks = 7;
void forward_marked(const GatedAttentionFwd& a, std::string_view impl, cudaEvent_t* marks);
void backward_marked(const GatedAttentionBwd& a, std::string_view impl, cudaEvent_t* marks);

}  // namespace gdn::ops::attn
