// Warp-level building blocks of the gated-attention CUDA kernels (sm_80+ instructions, used on
// sm_90a): tensor-core MMA m16n8k16 (bf16 inputs, fp32 accumulation), ldmatrix, cp.async with
// zero fill, the fast base-2 exponential, and the dynamic shared-memory base. Everything the
// kernels need from the hardware beyond plain loads, stores and arithmetic goes through this
// header, so each instruction's operand layout is stated once.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), for
// lane l of the warp, g = l / 4 (group), c = l % 4 (thread in group):
//   A (16x16, row-major), 4 regs of 2 bf16:  a0 = A[g][2c..2c+1],   a1 = A[g+8][2c..2c+1],
//                                            a2 = A[g][2c+8..2c+9], a3 = A[g+8][2c+8..2c+9]
//   B (16x8, k x n), 2 regs of 2 bf16:       b0 = B[2c..2c+1][g],   b1 = B[2c+8..2c+9][g]
//   C, D (16x8, fp32), 4 floats:             d0, d1 = D[g][2c..2c+1], d2, d3 = D[g+8][2c..2c+1]
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses (16 bytes each) of 8x8 matrix i; lane l
// receives in reg i the elements [l/4][2(l%4)..2(l%4)+1] of matrix i, or with .trans the elements
// [2(l%4)][l/4] and [2(l%4)+1][l/4].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/mma_sync.cuh"

namespace gdn::ops::attn {

using bf16_t = __nv_bfloat16;

// ldmatrix and mma.sync (backend/cuda/mma_sync.cuh, shared with the gated delta rule's kernels).
using cuda::ldsm_x4;
using cuda::ldsm_x4_trans;
using cuda::mma_bf16;
using cuda::smem_u32;

// 16-byte asynchronous global -> shared copy; when !valid nothing is read and the 16 bytes are
// zero-filled (src-size 0), so `src` only has to be some valid address.
__device__ __forceinline__ void cp_async_16(bf16_t* dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most `N` of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x (ex2.approx: ~2 ulp; 2^-inf = 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The dynamic shared memory of the launch (16-byte aligned).
__device__ __forceinline__ unsigned char* dyn_smem() {
  extern __shared__ __align__(16) unsigned char gdn_attn_smem[];
  return gdn_attn_smem;
}

// bf16 <-> fp32: exact widening, round-to-nearest-even narrowing (as the host's conversion).
__device__ __forceinline__ float bf16_bits_to_f(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}
__device__ __forceinline__ float bf16x2_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half), .y = hi
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Sum over the 32 lanes, the result in every lane (bit-identical in every lane).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
// Max / sum over the 4 lanes of a quad (the lanes holding one row of an MMA accumulator).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace gdn::ops::attn
