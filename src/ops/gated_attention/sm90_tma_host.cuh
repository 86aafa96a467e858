// Host side of the TMA kernels (sm90_tma.cuh), included by their translation units only:
// tensor maps encoded per call (cuTensorMapEncodeTiled only fills a 128-byte struct: no
// allocation, no device work, no sync) through the driver function that the runtime's
// entry-point query returns, so that the library does not link libcuda itself; and the launcher
// of the head-dim classes with the tensor maps as a second kernel parameter.
#pragma once

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include <type_traits>

#include "gdn/backend/cuda_check.h"
#include "gdn/core/error.h"
#include "ops/gated_attention/launch_hd.cuh"
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
              "gated_attention (cuda.sm90_tma): the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// [T, heads, hd] bf16, head (t, h) at base + (t · heads + h) · stride (stride >= hd elements), as a
// 3-D map {hd, heads, T}, boxes of 64 columns x 1 head x `rows` tokens, 128-byte swizzled (the
// TileL column-block layout).
CUtensorMap head_map(const bf16_t* base, int T, int heads, int hd, int rows, int stride) {
  CUtensorMap m;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(hd), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(T)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(stride) * sizeof(bf16_t),
                                 static_cast<cuuint64_t>(heads) * stride * sizeof(bf16_t)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(
      &m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16_t*>(base), dims, strides, box,
      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  GDN_CHECK(
      r == CUDA_SUCCESS,
      "gated_attention (cuda.sm90_tma): cuTensorMapEncodeTiled failed ({}) for T = {}, {} heads "
      "x {}",
      static_cast<int>(r), T, heads, hd);
  return m;
}

// Launches kernel_of(hd)<<<blocks, kTmaThreads, smem_of(hd)>>>(p, maps) for hd = hd_class
// (launch_hd.cuh).
template <class Params, class Maps, class KernelOf, class SmemOf>
void launch_tma_hd_class(const Params& p, const Maps& maps, int hd_class, unsigned blocks,
                         cudaStream_t stream, const char* what, KernelOf kernel_of,
                         SmemOf smem_of) {
  launch_hd_class_with(hd_class, blocks, kTmaThreads, stream, what, kernel_of, smem_of, p, maps);
}

}  // namespace
}  // namespace gdn::ops::attn
