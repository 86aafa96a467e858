// Warp-level tensor-core building blocks of the gated delta rule's fast CUDA path (cuda_fast_*.cu):
// mma.sync m16n8k16 (bf16 operands, fp32 accumulators) fed by ldmatrix from padded row-major
// shared tiles, with the operands kept in registers between products wherever the layouts allow.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16", bf16), lane = 4 g + t:
//   A (16 x 16, row): a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]
//                     a[2] = A[g][2t+8, 2t+9] a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, col):  b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   C (16 x 8, f32):  c[0], c[1] = C[g][2t, 2t+1]   c[2], c[3] = C[g+8][2t, 2t+1]
// (each 32-bit register holds two bf16, the lower column in the low half). Hence two adjacent C
// tiles (columns 16 kb .. 16 kb + 15) repacked to bf16 are exactly the A fragment of k-block kb
// (FlashAttention-2's P reuse): a product whose left operand was just computed never goes through
// shared memory.
//
// Shared tiles are row-major with a leading dimension of (width + 8) bf16 (cuda_common.cuh): rows
// start 16 bytes apart modulo 128, so the 8 row addresses of every ldmatrix 8x8 matrix hit 8
// different 16-byte bank groups (no conflicts), and every row start is 16-byte aligned as ldmatrix
// requires. Operand naming: an A operand is stored "MK" (row-major A[m][k]) or "KM" (A is the
// transpose of a stored row-major [K][M] tile); a B operand is stored "NK" (B[k][n] = s[n][k], as
// K for Q K^T) or "KN" (B[k][n] = s[k][n], as V for P V). The KM and KN loads use ldmatrix.trans.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/mma_sync.cuh"

namespace gdn::ops::gdr::fast {

using bf16_t = __nv_bfloat16;

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }

// ldmatrix and mma.sync: backend/cuda/mma_sync.cuh (shared with the gated attention kernels).
using cuda::ldsm_x4;
using cuda::smem_u32;
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16_t* p) {
  cuda::ldsm_x4_trans(r, p);
}
// d += A B for one 16 x 8 tile (k = 16).
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  cuda::mma_bf16(d, a, b0, b1);
}

// Two bf16 (round to nearest) in one register, `lo` in the low half.
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
// Scales both halves of a bf16 pair (result rounded to bf16 again).
__device__ __forceinline__ uint32_t scale2(uint32_t w, float s_lo, float s_hi) {
  return pack(lo_f(w) * s_lo, hi_f(w) * s_hi);
}

// --- fragment loads
// ------------------------------------------------------------------------------- A fragment of the
// 16 x 16 block at (m0, k0). MK: A[m][k] = s[m * ld + k].
__device__ __forceinline__ void load_a_mk(uint32_t (&a)[4], const bf16_t* s, int ld, int m0,
                                          int k0) {
  const int l = lane_id();
  ldsm_x4(a, s + (m0 + (l & 15)) * ld + k0 + (l >> 4) * 8);
}
// KM: A[m][k] = s[k * ld + m] (A is the transpose of the stored tile).
__device__ __forceinline__ void load_a_km(uint32_t (&a)[4], const bf16_t* s, int ld, int m0,
                                          int k0) {
  const int l = lane_id(), mat = l >> 3, r = l & 7;
  ldsm_x4_t(a, s + (k0 + r + (mat >> 1) * 8) * ld + m0 + (mat & 1) * 8);
}
// B fragments of the two 8-column tiles n0 and n0 + 8 for the k-block at k0: b[0], b[1] for n0,
// b[2], b[3] for n0 + 8. NK: B[k][n] = s[n * ld + k].
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16_t* s, int ld, int n0,
                                          int k0) {
  const int l = lane_id(), mat = l >> 3, r = l & 7;
  ldsm_x4(b, s + (n0 + r + (mat >> 1) * 8) * ld + k0 + (mat & 1) * 8);
}
// KN: B[k][n] = s[k * ld + n].
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16_t* s, int ld, int n0,
                                          int k0) {
  const int l = lane_id(), mat = l >> 3, r = l & 7;
  ldsm_x4_t(b, s + (k0 + r + (mat & 1) * 8) * ld + n0 + (mat >> 1) * 8);
}

// A fragment of k-block kb from the fp32 C tiles 2 kb and 2 kb + 1 of a 16-row accumulator.
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                       const float (&c1)[4]) {
  a[0] = pack(c0[0], c0[1]);
  a[1] = pack(c0[2], c0[3]);
  a[2] = pack(c1[0], c1[1]);
  a[3] = pack(c1[2], c1[3]);
}

// acc (a warp's 16 x 16 NP tile) += A B over the k-blocks kb in [kb0, kb1): load_a(a, k) fills the
// A fragment of the k-block starting at k = 16 kb, load_b(b, n, k) the B fragment (two n8 tiles)
// of columns n .. n + 15 of that k-block. Column blocks n0 + 16 np at or past n_end are skipped
// (the tile's columns past the padded width).
template <int NP, class LoadA, class LoadB>
__device__ __forceinline__ void warp_mma(float (&acc)[2 * NP][4], int kb0, int kb1, int n0,
                                         int n_end, LoadA&& load_a, LoadB&& load_b) {
  for (int kb = kb0; kb < kb1; ++kb) {
    uint32_t a[4];
    load_a(a, 16 * kb);
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      if (n0 + 16 * np >= n_end) break;
      uint32_t bb[4];
      load_b(bb, n0 + 16 * np, 16 * kb);
      mma(acc[2 * np], a, bb[0], bb[1]);
      mma(acc[2 * np + 1], a, bb[2], bb[3]);
    }
  }
}

// acc += A B for a warp's 16 x 32 tile (four n8 C tiles, column order) over the k-blocks kb in
// [kb0, kb1): A is the 16 x 16 block at (m0, 16 kb) of As (stored MK, or KM when kAT), B the
// 16 x 32 block at (16 kb, n0) of Bs as two 16-column halves (stored NK, or KN when kBT).
template <bool kAT, bool kBT>
__device__ __forceinline__ void mma_tile_16x32(float (&acc)[4][4], const bf16_t* As, int lda,
                                               const bf16_t* Bs, int ldb, int m0, int n0, int kb0,
                                               int kb1) {
  for (int kb = kb0; kb < kb1; ++kb) {
    uint32_t a[4], bb[4];
    if constexpr (kAT) {
      load_a_km(a, As, lda, m0, 16 * kb);
    } else {
      load_a_mk(a, As, lda, m0, 16 * kb);
    }
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      if constexpr (kBT) {
        load_b_kn(bb, Bs, ldb, n0 + 16 * np, 16 * kb);
      } else {
        load_b_nk(bb, Bs, ldb, n0 + 16 * np, 16 * kb);
      }
      mma(acc[2 * np], a, bb[0], bb[1]);
      mma(acc[2 * np + 1], a, bb[2], bb[3]);
    }
  }
}

// Row and column of element e (0..3) of this lane's C fragment, relative to the tile origin.
__device__ __forceinline__ int c_row(int e) { return (lane_id() >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int c_col(int e) { return 2 * (lane_id() & 3) + (e & 1); }

// Sum over the 4 lanes of a quad (the lanes that share a C-fragment row), in every lane.
__device__ __forceinline__ float quad_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// --- accumulator stores
// --------------------------------------------------------------------------- A 16-row accumulator
// of NT 8-column tiles: tile nt covers columns col0 + 8 nt .. + 7 of rows row0 .. row0 + 15. The
// stores below write element (r, c) to dst[r * ld + c] for r < rows and c < cols only (cols even: a
// pair never straddles the bound; dst, ld and col0 even so that every pair is 4- or 8-byte
// aligned).
// Calls f(r, c, v0, v1) for every in-bounds element pair (r, c), (r, c + 1) of this lane.
template <int NT, class F>
__device__ __forceinline__ void for_each_acc_pair(const float (&acc)[NT][4], int row0, int col0,
                                                  int rows, int cols, F&& f) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int c = col0 + 8 * nt + 2 * t;
    if (c >= cols) continue;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = row0 + g + 8 * hf;
      if (r < rows) f(r, c, acc[nt][2 * hf], acc[nt][2 * hf + 1]);
    }
  }
}
template <int NT>
__device__ __forceinline__ void store_acc_bf16(const float (&acc)[NT][4], bf16_t* dst, int64_t ld,
                                               int row0, int col0, int rows, int cols,
                                               float scale) {
  for_each_acc_pair(acc, row0, col0, rows, cols, [&](int r, int c, float v0, float v1) {
    *reinterpret_cast<uint32_t*>(dst + r * ld + c) = pack(scale * v0, scale * v1);
  });
}
template <int NT>
__device__ __forceinline__ void store_acc_f32(const float (&acc)[NT][4], float* dst, int64_t ld,
                                              int row0, int col0, int rows, int cols, float scale) {
  for_each_acc_pair(acc, row0, col0, rows, cols, [&](int r, int c, float v0, float v1) {
    *reinterpret_cast<float2*>(dst + r * ld + c) = make_float2(scale * v0, scale * v1);
  });
}
// dst += acc (each element has one owner: no race, a fixed order).
template <int NT>
__device__ __forceinline__ void add_acc_f32(const float (&acc)[NT][4], float* dst, int64_t ld,
                                            int row0, int col0, int rows, int cols) {
  for_each_acc_pair(acc, row0, col0, rows, cols, [&](int r, int c, float v0, float v1) {
    float2* p = reinterpret_cast<float2*>(dst + r * ld + c);
    float2 x = *p;
    x.x += v0;
    x.y += v1;
    *p = x;
  });
}

// Row dots of the accumulator with a bf16 shared tile over the accumulator's columns:
// out[hf] = sum over this warp's columns c (< cols) of s[(row0 + g + 8 hf) * ld + c] * acc(.., c),
// complete in every lane of the quad (a fixed order: the lane's own terms in tile order, then the
// quad butterfly).
template <int NT>
__device__ __forceinline__ void row_dot_bf16(const float (&acc)[NT][4], const bf16_t* s, int ld,
                                             int row0, int col0, int cols, float (&out)[2]) {
  const int g = lane_id() >> 2, t = lane_id() & 3;
  out[0] = 0.f;
  out[1] = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int c = col0 + 8 * nt + 2 * t;
    if (c >= cols) continue;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(s + (row0 + g + 8 * hf) * ld + c);
      out[hf] += lo_f(w) * acc[nt][2 * hf] + hi_f(w) * acc[nt][2 * hf + 1];
    }
  }
  out[0] = quad_sum4(out[0]);
  out[1] = quad_sum4(out[1]);
}

// The intra-chunk product P = (Q K^T) .* D in A-operand registers for this warp's 16 rows 16 mt..:
// D[i][j] = exp(gamma_i - gamma_j) on j <= i, 0 above (gamma = gm, the chunk-local cumsum of g);
// column blocks past mt are masked out entirely, so their products are skipped. qa holds this
// warp's Q rows as A fragments over the nkb k-blocks; Ks is the chunk's K tile (row-major, ld ldk).
// Used by the decomposed route's output kernel.
__device__ __forceinline__ void masked_qk_a(uint32_t (&pa)[4][4], const uint32_t (&qa)[8][4],
                                            const bf16_t* Ks, int ldk, const float* gm, int mt,
                                            int nkb) {
  float p[8][4] = {};
#pragma unroll
  for (int kb = 0; kb < 8; ++kb) {
    if (kb >= nkb) break;
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np > mt) break;
      uint32_t bb[4];
      load_b_nk(bb, Ks, ldk, 16 * np, 16 * kb);
      mma(p[2 * np], qa[kb], bb[0], bb[1]);
      mma(p[2 * np + 1], qa[kb], bb[2], bb[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * mt + c_row(e), j = 8 * nt + c_col(e);
      p[nt][e] = j <= i ? p[nt][e] * expf(gm[i] - gm[j]) : 0.f;
    }
  }
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) c_to_a(pa[kb], p[2 * kb], p[2 * kb + 1]);
}

}  // namespace gdn::ops::gdr::fast
