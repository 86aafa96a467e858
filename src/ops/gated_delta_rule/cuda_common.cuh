// Device building blocks shared by the gated delta rule's CUDA kernels (cuda_*.cu): shared-memory
// tile staging (cp.async or scalar, zero padded), block-wide tensor-core products through WMMA
// (bf16 operands or tf32, fp32 accumulation, fp32 results in shared memory), and the chunk's gate
// factors summed term by term (never as differences of cumsums: op.h, cpu.cpp chunk_prepare).
//
// Conventions (every kernel):
//   - a chunk has kC = 64 rows; rows >= L (a partial chunk) and columns >= d (head dims padded to
//     multiples of 16 for the MMAs) are zero in every staged tile, so padded parts of products are
//     exact zeros and never need masking;
//   - shared tiles are row-major with a leading dimension of (width + 8) elements: a multiple of 8
//     (WMMA's rule for 16-bit and 32-bit elements alike) whose 16-byte skew staggers rows over the
//     banks, and with every buffer 128-byte aligned each 16x16 tile origin is 32-byte aligned
//     (WMMA's pointer rule);
//   - gates: g_s[64] holds g of the chunk's rows (0 beyond L); every exponent is a sum of g's, all
//     <= 0, so factors lie in [0, 1] and strong decay underflows to 0, never to inf or NaN.
// Semantics of the WMMA layouts used below (CUDA C++ programming guide, "Warp Matrix Functions"):
//   matrix_a row_major: A(m, k) = p[m * ld + k]   col_major: A(m, k) = p[k * ld + m]
//   matrix_b row_major: B(k, n) = p[k * ld + n]   col_major: B(k, n) = p[n * ld + k]
#pragma once

#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/cp_async.cuh"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops::gdr {

namespace wmma = nvcuda::wmma;
using bf16_t = __nv_bfloat16;
using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;

constexpr int kC = 64;         // chunk rows (kGdrChunk)
constexpr int kLd64 = kC + 8;  // leading dimension of 64-wide tiles (bf16 and fp32)

// One chunk of a packed batch: tokens [t0, t0 + len) of document doc, its idx-th chunk. len == 0
// marks an unused slot of the chunk table (slots past the batch's real chunk count).
struct ChunkInfo {
  int32_t t0, len, doc, idx;
};

__host__ __device__ constexpr int pad16(int x) { return (x + 15) / 16 * 16; }
// Leading dimension of a shared tile of width w (a multiple of 16).
__host__ __device__ constexpr int ld_of(int w) { return w + 8; }
// Bytes of a shared buffer, rounded up to 128 so that consecutive buffers stay aligned.
__host__ __device__ constexpr size_t buf_bytes(size_t bytes) { return (bytes + 127) / 128 * 128; }
__host__ __device__ constexpr size_t tile_bytes_bf16(int rows, int w) {
  return buf_bytes(static_cast<size_t>(rows) * static_cast<size_t>(ld_of(w)) * 2);
}
__host__ __device__ constexpr size_t tile_bytes_f32(int rows, int w) {
  return buf_bytes(static_cast<size_t>(rows) * static_cast<size_t>(ld_of(w)) * 4);
}

constexpr size_t kVecBytes = buf_bytes(kC * sizeof(float));  // one [64] fp32 vector

// Carves consecutive 128-byte aligned buffers out of the dynamic shared memory. The host sizes the
// launch with the same sequence of buf_bytes; done() traps if the two ever disagree (or if the
// base is misaligned) instead of letting a kernel run past its shared memory.
struct SmemCarver {
  char* base;
  char* p;
  __device__ explicit SmemCarver(char* b) : base(b), p(b) {}
  template <class T>
  __device__ T* take(size_t bytes) {
    T* r = reinterpret_cast<T*>(p);
    p += buf_bytes(bytes);
    return r;
  }
  __device__ float* vec() { return take<float>(kC * sizeof(float)); }
  __device__ void done() const {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (static_cast<size_t>(p - base) > dyn || __cvta_generic_to_shared(base) % 128 != 0) __trap();
  }
};

__device__ __forceinline__ float bf(bf16_t x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16_t tobf(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ bf16_t bf16_zero() { return __ushort_as_bfloat16(0); }

// --- staging -----------------------------------------------------------------------------------
// dst[r][c] (shared, leading dimension ld) = src[r * stride + c] for r < rows and c < cols, and 0
// for the rest of the [R, Cp] tile (Cp a multiple of 16 / sizeof(T)). vec: 16-byte cp.async pieces,
// which needs src and stride 16-byte aligned and cols a multiple of the piece; the caller commits
// and waits. Otherwise scalar loads (complete on return). Out-of-range rows and columns are never
// read, whatever src holds.
template <class T>
__device__ __forceinline__ void stage_tile(T* dst, int ld, const T* src, int64_t stride, int rows,
                                           int cols, int R, int Cp, bool vec) {
  constexpr int kPiece = 16 / static_cast<int>(sizeof(T));
  if (vec) {
    const int per_row = Cp / kPiece;
    for (int p = static_cast<int>(threadIdx.x); p < R * per_row;
         p += static_cast<int>(blockDim.x)) {
      const int r = p / per_row, c = (p % per_row) * kPiece;
      T* d = dst + r * ld + c;
      if (r < rows && c < cols)
        cp_async16(d, src + static_cast<int64_t>(r) * stride + c);
      else
        *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
    for (int p = static_cast<int>(threadIdx.x); p < R * Cp; p += static_cast<int>(blockDim.x)) {
      const int r = p / Cp, c = p % Cp;
      T v;
      if (r < rows && c < cols) {
        v = src[static_cast<int64_t>(r) * stride + c];
      } else {
        if constexpr (sizeof(T) == 2)
          v = bf16_zero();
        else
          v = T(0);
      }
      dst[r * ld + c] = v;
    }
  }
}

// Stages a tile and waits for it: complete and visible to the whole block on return.
template <class T>
__device__ __forceinline__ void load_tile(T* dst, int ld, const T* src, int64_t stride, int rows,
                                          int cols, int R, int Cp, bool vec) {
  stage_tile(dst, ld, src, stride, rows, cols, R, Cp, vec);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
}

// --- block-wide products ---------------------------------------------------------------------
// C[M, N] (fp32 shared, ldc) = (accumulate ? C : 0) + A[M, K] B[K, N], bf16 shared operands in the
// layouts LA, LB (see the header). M, N, K multiples of 16. The 16x16 output tiles go round-robin
// to the block's warps: the same tile always goes to the same warp for given (M, N), so a product
// accumulating onto the previous one's output reads what that warp itself stored (the __syncwarp
// orders its lanes). No block barrier inside: callers synchronise before reading C.
template <class LA, class LB>
__device__ __forceinline__ void mma_bf16(int M, int N, int K, const bf16_t* A, int lda,
                                         const bf16_t* B, int ldb, float* C, int ldc,
                                         bool accumulate) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, nwarps = static_cast<int>(blockDim.x) >> 5;
  const int tn = N / 16, tiles = (M / 16) * tn;
  for (int t = warp; t < tiles; t += nwarps) {
    const int m0 = (t / tn) * 16, n0 = (t % tn) * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    if (accumulate) {
      __syncwarp();
      wmma::load_matrix_sync(acc, C + m0 * ldc + n0, ldc, wmma::mem_row_major);
    } else {
      wmma::fill_fragment(acc, 0.f);
    }
    for (int k0 = 0; k0 < K; k0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16_t, LA> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16_t, LB> b;
      if constexpr (std::is_same_v<LA, wmma::row_major>)
        wmma::load_matrix_sync(a, A + m0 * lda + k0, lda);
      else
        wmma::load_matrix_sync(a, A + k0 * lda + m0, lda);
      if constexpr (std::is_same_v<LB, wmma::row_major>)
        wmma::load_matrix_sync(b, B + k0 * ldb + n0, ldb);
      else
        wmma::load_matrix_sync(b, B + n0 * ldb + k0, ldb);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(C + m0 * ldc + n0, acc, ldc, wmma::mem_row_major);
  }
}

// As mma_bf16 with fp32 shared operands through tf32 (10-bit mantissa, rounded to nearest): the
// 64x64 products of the triangular inverse's backward, whose inputs are fp32 by nature.
template <class LA, class LB>
__device__ __forceinline__ void mma_tf32(int M, int N, int K, const float* A, int lda,
                                         const float* B, int ldb, float* C, int ldc) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, nwarps = static_cast<int>(blockDim.x) >> 5;
  const int tn = N / 16, tiles = (M / 16) * tn;
  for (int t = warp; t < tiles; t += nwarps) {
    const int m0 = (t / tn) * 16, n0 = (t % tn) * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int k0 = 0; k0 < K; k0 += 8) {
      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LA> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LB> b;
      if constexpr (std::is_same_v<LA, wmma::row_major>)
        wmma::load_matrix_sync(a, A + m0 * lda + k0, lda);
      else
        wmma::load_matrix_sync(a, A + k0 * lda + m0, lda);
      if constexpr (std::is_same_v<LB, wmma::row_major>)
        wmma::load_matrix_sync(b, B + k0 * ldb + n0, ldb);
      else
        wmma::load_matrix_sync(b, B + n0 * ldb + k0, ldb);
#pragma unroll
      for (int e = 0; e < a.num_elements; ++e) a.x[e] = wmma::__float_to_tf32(a.x[e]);
#pragma unroll
      for (int e = 0; e < b.num_elements; ++e) b.x[e] = wmma::__float_to_tf32(b.x[e]);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(C + m0 * ldc + n0, acc, ldc, wmma::mem_row_major);
  }
}

// --- gates ---------------------------------------------------------------------------------------
// Per-row sums of the chunk's g (threads 0..63; the caller synchronises before reading them):
//   pre[i] = sum_{u = 16 floor(i/16)}^{i} g_u     tot[b] = sum over rows 16b .. 16b + 15
//   G[i]   = exp(sum_{u <= i} g_u)                dec[i] = exp(sum_{i < u < L} g_u)
// for i < L (G = dec = 0 beyond). Every exponent is built by additions of g's only.
__device__ __forceinline__ void chunk_gate_sums(const float* g_s, int L, float* pre, float* tot,
                                                float* G, float* dec) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= kC) return;
  const int b = i >> 4;
  float t[4];
#pragma unroll
  for (int bb = 0; bb < 4; ++bb) {
    float s = 0.f;
    for (int u = 16 * bb; u < 16 * bb + 16; ++u) s += g_s[u];
    t[bb] = s;
  }
  float p = 0.f;
  for (int u = 16 * b; u <= i; ++u) p += g_s[u];
  float s = 0.f;
  for (int u = i + 1; u < 16 * b + 16; ++u) s += g_s[u];
  float before = 0.f, after = 0.f;
#pragma unroll
  for (int bb = 0; bb < 4; ++bb) {
    if (bb < b) before += t[bb];
    if (bb > b) after += t[bb];
  }
  pre[i] = p;
  if (i < 4) tot[i] = t[i];
  G[i] = i < L ? expf(before + p) : 0.f;
  dec[i] = i < L ? expf(s + after) : 0.f;
}

// Calls f(i, j, d) with d = exp(sum_{j < u <= i} g_u) = e^{gamma_i - gamma_j} exactly once for
// every 0 <= j <= i < L, spread over the block (thread (i, 16-column block jb) owns row i's columns
// 16 jb .. 16 jb + 15, so f may write element (i, j) of a row-major tile without a race). Reads
// pre and tot of chunk_gate_sums (after a barrier). Each d is a sum of g's: no cancellation.
template <class F>
__device__ __forceinline__ void for_each_gate(const float* g_s, const float* pre, const float* tot,
                                              int L, F&& f) {
  for (int w = static_cast<int>(threadIdx.x); w < 4 * kC; w += static_cast<int>(blockDim.x)) {
    const int i = w >> 2, jb = w & 3, ib = i >> 4;
    if (i >= L || jb > ib) continue;
    int j = jb == ib ? i : 16 * jb + 15;
    float acc = 0.f;  // sum_{j < u <= i} g_u for the current j
    if (jb < ib) {
      acc = pre[i];
      for (int bb = ib - 1; bb > jb; --bb) acc += tot[bb];
    }
    for (; j >= 16 * jb; --j) {
      f(i, j, expf(acc));
      acc += g_s[j];
    }
  }
}

// out[t] = sum_{i >= t, i < L} in_suffix[i] + sum_{i < t} in_prefix[i] for t < L (threads 0..63,
// direct sums: no differences). Either input may be null; both hold kC floats (L <= kC). The
// additions run in the order i = L-1 .. t, then 0 .. t-1; the loops over all kC entries with a
// predicate let the (broadcast) shared loads issue ahead of the dependent additions.
__device__ __forceinline__ float suffix_plus_prefix(const float* in_suffix, const float* in_prefix,
                                                    int t, int L) {
  float s = 0.f;
  if (in_suffix != nullptr) {
#pragma unroll
    for (int i = kC - 1; i >= 0; --i) {
      const float x = in_suffix[i];
      if (i < L && i >= t) s += x;
    }
  }
  if (in_prefix != nullptr) {
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      const float x = in_prefix[i];
      if (i < t) s += x;
    }
  }
  return s;
}

// Pair terms h_ij (j < i < L, in F[i * ld + j]) reach dg_t for j < t <= i. Turns each row into its
// prefix sums in place (threads 0..63 own a row each), then, after a barrier, out[t] =
// sum_{i = t}^{L-1} F[i][t-1] (0 for t = 0). Only entries j < i < L are read.
__device__ __forceinline__ void pair_row_prefix(float* F, int ld, int L) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= L) return;
  float run = 0.f;
  for (int j = 0; j < i; ++j) {
    run += F[i * ld + j];
    F[i * ld + j] = run;
  }
}
__device__ __forceinline__ float pair_column_sum(const float* F, int ld, int L, int t) {
  if (t == 0 || t >= L) return 0.f;
  float s = 0.f;
  for (int i = t; i < L; ++i) s += F[i * ld + t - 1];
  return s;
}

// Sum over the warp, in every lane (a butterfly: bit-identical in all lanes).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// rstd = 1 / sqrt(sum of squares + eps) of one row spread over a warp, each lane holding E of its
// columns in x (zeros past the row). The q/k l2norm at dk = 128 (cuda_fwd.cu, E = 4) and both
// backward reduce kernels (recomputing it from the raw rows) take it from here, so that they see
// the same rstd bitwise. Every lane of the warp must call it.
template <int E>
__device__ __forceinline__ float warp_l2_rstd(const float (&x)[E]) {
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) ss += x[e] * x[e];
  return 1.f / sqrtf(warp_sum(ss) + static_cast<float>(kGdrL2NormEps));
}
__device__ __forceinline__ float lane4_l2_rstd(const float (&x)[4]) { return warp_l2_rstd<4>(x); }

// The l2norm backward of one row spread over a warp as in warp_l2_rstd: acc (the gradient w.r.t.
// the normalised row y = x rstd) becomes dx = rstd (acc - <acc, y> y), in fp32. The fast route's
// reduce (E = 4, cuda_fast_bwd.cu) and the generic one's (E = 8, cuda_bwd.cu) share it.
template <int E>
__device__ __forceinline__ void warp_l2norm_bwd(float (&acc)[E], const float (&x)[E]) {
  const float rs = warp_l2_rstd<E>(x);
  float dot = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) dot += acc[e] * x[e] * rs;
  dot = warp_sum(dot);
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = rs * (acc[e] - dot * x[e] * rs);
}

// Block-wide sum of one value per thread, in a fixed order (warp butterflies, then the warp sums in
// warp order by thread 0): deterministic. red holds >= 32 floats; every thread must call it; the
// result is returned to thread 0 only.
__device__ __forceinline__ float block_sum_to_0(float v, float* red) {
  v = warp_sum(v);
  const int warp = static_cast<int>(threadIdx.x) >> 5, nw = static_cast<int>(blockDim.x) >> 5;
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  float s = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < nw; ++w) s += red[w];
  __syncthreads();
  return s;
}

// Sum over the 4 consecutive lanes (lane & ~3 .. lane | 3) of a quad, in every lane of it.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// T = (I + M)^{-1} for the strictly lower M (fp32 [64, 64], ld kLd64) into Tm (same layout), by
// forward substitution down each column: T[i][j] = -sum_{m < i} M[i][m] T[m][j] for i > j (T is
// lower, so the terms m < j vanish), T[j][j] = 1. 256 threads: column j = tid / 4 is split over the
// 4 lanes of a quad (m = lane % 4 mod 4), summed by shuffles, written by the quad's first lane; a
// column's 4 lanes sit in one warp, so __syncwarp orders each new T[i][j] before the next row.
// Requires blockDim.x == 256 (a warp-synchronous loop: every lane runs every iteration).
__device__ __forceinline__ void unit_lower_inverse(const float* M, float* Tm) {
  const int tid = static_cast<int>(threadIdx.x);
  const int j = tid >> 2, part = tid & 3;
  for (int i = 0; i < kC; ++i) {
    float s = 0.f;
    for (int m = part; m < i; m += 4) s += M[i * kLd64 + m] * Tm[m * kLd64 + j];
    s = quad_sum(s);
    if (part == 0) Tm[i * kLd64 + j] = i == j ? 1.f : (i > j ? -s : 0.f);
    __syncwarp();
  }
}

}  // namespace gdn::ops::gdr
