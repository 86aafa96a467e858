// Gated attention on CUDA: the attention backward's instantiations (head dims 64, 128, 256) and
// launchers. The kernels are in cuda_bwd.cuh, the design in cuda.cu.
#include "gdn/backend/cuda_check.h"
#include "ops/gated_attention/cuda_bwd.cuh"
#include "ops/gated_attention/cuda_launch.h"

namespace gdn::ops::attn {

namespace {

// More than 48 KiB of dynamic shared memory needs an opt-in, once per kernel.
template <class Kernel>
void opt_in(Kernel kernel, size_t smem) {
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
}

template <int HD>
void launch_dq(const BwdParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr size_t smem = dq_smem_bytes<HD>();
  static const bool opted_in = (opt_in(attn_bwd_dq_kernel<HD>, smem), true);
  (void)opted_in;
  attn_bwd_dq_kernel<HD><<<blocks, kThreads, smem, stream>>>(p);
  GDN_CUDA_LAUNCH_CHECK("attn_bwd_dq_kernel");
}

template <int HD>
void launch_dkdv(const BwdParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr size_t smem = dkdv_smem_bytes<HD>();
  static const bool opted_in = (opt_in(attn_bwd_dkdv_kernel<HD>, smem), true);
  (void)opted_in;
  attn_bwd_dkdv_kernel<HD><<<blocks, kThreads, smem, stream>>>(p);
  GDN_CUDA_LAUNCH_CHECK("attn_bwd_dkdv_kernel");
}

}  // namespace

void launch_bwd_dq(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  switch (hd_class) {
    case 64:
      launch_dq<64>(p, blocks, stream);
      break;
    case 128:
      launch_dq<128>(p, blocks, stream);
      break;
    case 256:
      launch_dq<256>(p, blocks, stream);
      break;
    default:
      GDN_FAIL("gated_attention (cuda): internal: no dq kernel for head-dim class {}", hd_class);
  }
}

void launch_bwd_dkdv(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  switch (hd_class) {
    case 64:
      launch_dkdv<64>(p, blocks, stream);
      break;
    case 128:
      launch_dkdv<128>(p, blocks, stream);
      break;
    case 256:
      launch_dkdv<256>(p, blocks, stream);
      break;
    default:
      GDN_FAIL("gated_attention (cuda): internal: no dk/dv kernel for head-dim class {}", hd_class);
  }
}

}  // namespace gdn::ops::attn
