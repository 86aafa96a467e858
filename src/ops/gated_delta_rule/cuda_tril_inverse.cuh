// The blocked unit lower triangular inverse of the gated delta rule's fast CUDA kernels (the
// forward's prep in cuda_fast_fwd.cu). Included from .cu files only.
#pragma once

#include "ops/gated_delta_rule/cuda_common.cuh"
#include "ops/gated_delta_rule/cuda_mma.cuh"

namespace gdn::ops::gdr::fast {

constexpr int kInvLd = 68;        // fp32 64 x 64 tiles: rows 272 B apart (16 B mod 128)
constexpr int kInvThreads = 256;  // the block size the inverse is written for: 8 warps

// The M that unit_lower_inverse_blocked inverts, into Mf [64][kInvLd]: M_ij = beta_i
// e^{gamma_i - gamma_j} (k_i . k_j) for j < i, else 0 (0 past the chunk: beta_i = 0, K's rows 0).
// Warp (mt, nh) = (warp & 3, warp >> 2) computes K K^T rows 16 mt.., columns 32 nh.. (4 tiles)
// from Ks [64][ldk] over nkb 16-column blocks, then meets a block barrier (the caller's beta in bs
// and gamma in gm are written before it) and writes its part of Mf. Mf is complete only after
// the caller's next barrier.
__device__ __forceinline__ void decayed_kkt_lower(const bf16_t* Ks, int ldk, int nkb, int mt,
                                                  int nh, const float* bs, const float* gm,
                                                  float* Mf) {
  float kk[4][4] = {};
  mma_tile_16x32<false, false>(kk, Ks, ldk, Ks, ldk, 16 * mt, 32 * nh, 0, nkb);
  __syncthreads();  // gamma, beta G
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = 16 * mt + c_row(2 * hf), j = 32 * nh + 8 * nt + c_col(0);
      const float bi = bs[i], gi = gm[i];
      const float m0 = j < i ? bi * expf(gi - gm[j]) * kk[nt][2 * hf] : 0.f;
      const float m1 = j + 1 < i ? bi * expf(gi - gm[j + 1]) * kk[nt][2 * hf + 1] : 0.f;
      *reinterpret_cast<float2*>(Mf + i * kInvLd + j) = make_float2(m0, m1);
    }
  }
}

// T = (I + M)^{-1} for the strictly lower M
// (fp32 [64, 64], ld kInvLd) into Tm (same layout; every entry written: zeros above the diagonal),
// in fp32 by 16 x 16 blocks (fla solve_tril's blocking): the four diagonal blocks by forward
// substitution, one per warp with its column in registers; then row block a = 1..3: X = M[a, 0:a]
// T[0:a, 0:a], T[a, 0:a] = -T_aa X. X [16, 48] is scratch. 256 threads; barriers inside, every
// thread must call it; M and Tm complete on return. The sums of the off-diagonal products run over
// whole 16-blocks of m (unrolled, with a predicate on the triangular one), so that their shared
// loads issue ahead of the fmaf chain; the chain itself, and so every bit, is that of the plain
// loops over m.
__device__ inline void unit_lower_inverse_blocked(const float* M, float* Tm, float* X) {
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  if (warp < 4) {
    // Column j of the diagonal block a: t[i] = T[16a + i][16a + j], sequential in i.
    const int a = warp, j = lane & 15;
    float t[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float* mrow = M + (16 * a + i) * kInvLd + 16 * a;
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) s = fmaf(mrow[m], t[m], s);
      t[i] = i == j ? 1.f : (i > j ? -s : 0.f);
    }
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) Tm[(16 * a + i) * kInvLd + 16 * a + j] = t[i];
    }
  } else {
    // The blocks above the diagonal are zero.
    for (int p = tid - 128; p < kC * kC; p += 128) {
      const int i = p >> 6, j = p & 63;
      if ((j >> 4) > (i >> 4)) Tm[i * kInvLd + j] = 0.f;
    }
  }
  __syncthreads();
#pragma unroll
  for (int a = 1; a < 4; ++a) {
    // w: columns of the row block's off-diagonal part; its 16 w = 256 a items are exactly a per
    // thread (kInvThreads = 256).
    const int w = 16 * a;
#pragma unroll
    for (int it = 0; it < a; ++it) {
      const int p = tid + kInvThreads * it;
      const int r = p / w, col = p % w;
      const float* mrow = M + (w + r) * kInvLd;
      float s = 0.f;
      for (int mb = col >> 4; mb < a; ++mb) {  // m = 16 mb + mm over col & ~15 .. w - 1
#pragma unroll
        for (int mm = 0; mm < 16; ++mm) {
          const int m = 16 * mb + mm;
          s = fmaf(mrow[m], Tm[m * kInvLd + col], s);
        }
      }
      X[r * kInvLd + col] = s;
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < a; ++it) {
      const int p = tid + kInvThreads * it;
      const int r = p / w, col = p % w;
      const float* trow = Tm + (w + r) * kInvLd + w;  // row r of T_aa (lower, unit diagonal)
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < 16; ++m) {  // m <= r
        const float tv = trow[m], xv = X[m * kInvLd + col];
        if (m <= r) s = fmaf(tv, xv, s);
      }
      Tm[(w + r) * kInvLd + col] = -s;
    }
    __syncthreads();
  }
}

}  // namespace gdn::ops::gdr::fast
