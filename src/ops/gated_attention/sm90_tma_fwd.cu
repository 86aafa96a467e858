// Gated attention on Hopper: instantiations (head dims 64, 128, 256) and launcher of the
// warp-specialized TMA forward of sm90_tma.cuh, with its tensor maps encoded on the host per call
// (cuTensorMapEncodeTiled only fills a 128-byte struct: no allocation, no device work, no sync).
// The driver function comes through the runtime's entry-point query, so the library does not link
// libcuda itself.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include <type_traits>

#include "gdn/backend/cuda_check.h"
#include "gdn/core/error.h"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/sm90_tma.cuh"

namespace gdn::ops::attn {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
    GDN_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                    cudaEnableDefault, &status));
    GDN_CHECK(status == cudaDriverEntryPointSuccess && f != nullptr,
              "gated_attention (cuda.tma): the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// [T, heads, hd] bf16 (rows of heads · hd elements) as a 3-D map {hd, heads, T}, boxes of 64
// columns x 1 head x `rows` tokens, 128-byte swizzled (the TileL column-block layout).
CUtensorMap head_map(const bf16_t* base, int T, int heads, int hd, int rows) {
  CUtensorMap m;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(hd), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(T)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(hd) * sizeof(bf16_t),
                                 static_cast<cuuint64_t>(heads) * hd * sizeof(bf16_t)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(
      &m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16_t*>(base), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  GDN_CHECK(r == CUDA_SUCCESS,
            "gated_attention (cuda.tma): cuTensorMapEncodeTiled failed ({}) for T = {}, {} heads "
            "x {}",
            static_cast<int>(r), T, heads, hd);
  return m;
}

}  // namespace

void launch_fwd_tma(const FwdParams& p, int hd_class, unsigned blocks, cudaStream_t stream) {
  const FwdMaps maps{head_map(p.q_hat, p.T, p.Hq, p.hd, kBigTile),
                     head_map(p.k_hat, p.T, p.Hkv, p.hd, kFwdKeys),
                     head_map(p.v, p.T, p.Hkv, p.hd, kFwdKeys)};
  auto go = [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const auto kernel = &attn_fwd_tma_kernel<HD>;
    constexpr size_t smem = fwd_tma_smem_bytes<HD>();
    static const bool opted_in = [&] {
      GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
      return true;
    }();
    (void)opted_in;
    kernel<<<blocks, kTmaThreads, smem, stream>>>(p, maps);
    GDN_CUDA_LAUNCH_CHECK("attn_fwd_tma_kernel");
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
      GDN_FAIL("gated_attention (cuda.tma): internal: no forward for head-dim class {}", hd_class);
  }
}

}  // namespace gdn::ops::attn
