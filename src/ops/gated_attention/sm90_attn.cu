// Gated attention on Hopper: instantiations (head dims 64, 128, 256) and launchers of the wgmma
// attention kernels of sm90_attn.cuh. The design is in cuda.cu.
#include "gdn/backend/cuda_check.h"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/sm90_attn.cuh"

namespace gdn::ops::attn {

namespace {

// More than 48 KiB of dynamic shared memory needs an opt-in, once per kernel.
template <class Kernel>
void opt_in(Kernel kernel, size_t smem) {
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(smem)));
}

template <int HD>
void fwd(const FwdParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr size_t smem = fwd_sm90_smem_bytes<HD>();
  static const bool opted_in = (opt_in(attn_fwd_sm90_kernel<HD>, smem), true);
  (void)opted_in;
  attn_fwd_sm90_kernel<HD><<<blocks, kThreads, smem, stream>>>(p);
  GDN_CUDA_LAUNCH_CHECK("attn_fwd_sm90_kernel");
}

template <int HD>
void dq(const BwdParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr size_t smem = dq_sm90_smem_bytes<HD>();
  static const bool opted_in = (opt_in(attn_bwd_dq_sm90_kernel<HD>, smem), true);
  (void)opted_in;
  attn_bwd_dq_sm90_kernel<HD><<<blocks, kThreads, smem, stream>>>(p);
  GDN_CUDA_LAUNCH_CHECK("attn_bwd_dq_sm90_kernel");
}

template <int HD>
void dkdv(const BwdParams& p, unsigned blocks, cudaStream_t stream) {
  constexpr size_t smem = dkdv_sm90_smem_bytes<HD>();
  static const bool opted_in = (opt_in(attn_bwd_dkdv_sm90_kernel<HD>, smem), true);
  (void)opted_in;
  attn_bwd_dkdv_sm90_kernel<HD><<<blocks, kThreads, smem, stream>>>(p);
  GDN_CUDA_LAUNCH_CHECK("attn_bwd_dkdv_sm90_kernel");
}

// Runs f<HD> for the head-dim class.
template <template <int> class F, class... Args>
void dispatch(int hd_class, const char* what, Args&&... args) {
  switch (hd_class) {
    case 64:
      F<64>::run(args...);
      break;
    case 128:
      F<128>::run(args...);
      break;
    case 256:
      F<256>::run(args...);
      break;
    default:
      GDN_FAIL("gated_attention (cuda): internal: no {} kernel for head-dim class {}", what,
               hd_class);
  }
}
template <int HD>
struct Fwd {
  static void run(const FwdParams& p, unsigned b, cudaStream_t s) { fwd<HD>(p, b, s); }
};
template <int HD>
struct Dq {
  static void run(const BwdParams& p, unsigned b, cudaStream_t s) { dq<HD>(p, b, s); }
};
template <int HD>
struct Dkdv {
  static void run(const BwdParams& p, unsigned b, cudaStream_t s) { dkdv<HD>(p, b, s); }
};

}  // namespace

void launch_fwd_sm90(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  dispatch<Fwd>(hd_class, "sm90 forward", p, blocks, stream);
}
void launch_bwd_dq_sm90(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  dispatch<Dq>(hd_class, "sm90 dq", p, blocks, stream);
}
void launch_bwd_dkdv_sm90(const BwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  dispatch<Dkdv>(hd_class, "sm90 dk/dv", p, blocks, stream);
}

}  // namespace gdn::ops::attn
