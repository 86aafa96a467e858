// Warp-level tensor-core instructions shared by the mma.sync kernels (gated attention's
// cuda_prims.cuh, the gated delta rule's cuda_mma.cuh): ldmatrix (plain and transposed) and
// mma.sync m16n8k16 with bf16 operands and fp32 accumulators (sm_80+, used on sm_90a). Each
// instruction's operand layout is stated where its users describe their fragments (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type").
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gdn::cuda {

// 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices: lanes 8i..8i+7 give the row addresses (16 bytes each) of matrix i; lane
// l receives in r[i] the elements [l/4][2(l%4)..2(l%4)+1] of matrix i (with .trans: [2(l%4)][l/4]
// and [2(l%4)+1][l/4]).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row)));
}

// d += A B for one 16x8x16 tile (A row-major, B k x n "col"), fp32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace gdn::cuda
