// Gated delta rule on CUDA, the generic route's forward kernels (head dims up to 256, unaligned
// tensors; cuda_fast_fwd.cu is the fast route), also run by the backward to rebuild what the
// forward does not save: the decomposed chain of fla/ops/gated_delta_rule/chunk.py
// (chunk_gated_delta_rule_fwd): in-kernel l2norm; per chunk the UT transform and the WY factors
// (fla/ops/gated_delta_rule/chunk_fwd.py, wy_fast.py); the sequential state pass
// (fla/ops/common/chunk_delta_h.py, chunk_gated_delta_rule_fwd_kernel_h_blockdim64); the output
// (fla/ops/common/chunk_o.py, chunk_fwd_kernel_o). The maths and notation are cpu.cpp's.
//
// Parallelism: the per-chunk kernels run one block per (chunk slot, value head) over the whole
// packed batch (slots past the real chunk count exit at once). The state pass is the sequential
// part: one block per (document, value head, dv block of VB columns): a state column block evolves
// independently of the others (V' = U - W S and S <- G_L S + Kt^T V' act column by column), so one
// long document still fills 4 (VB = 32) or 8 (VB = 16) blocks per head.
//
// Precision (gdn_spec.md §3.7 for FLA's choices): MMA operands are bf16 (q, k, v as given or
// normalised and rounded once; T, W, U, V', the state snapshot, the score matrix), accumulation is
// fp32; the gates, the UT inverse and the running state S are fp32. Differences from FLA: T is
// inverted in fp32 by plain forward substitution and never stored; the gate factors are sums of
// g's, not differences of cumsums.
#include <algorithm>
#include <climits>

#include "gdn/backend/cuda_check.h"
#include "ops/gated_delta_rule/cuda_kernels.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops::gdr {

namespace {

constexpr int kChunkThreads = 256;  // per-chunk kernels: 8 warps (unit_lower_inverse needs 256)
constexpr int kStateThreads = 128;  // state passes: 4 warps
constexpr int kL2Threads = 256;

using RowM = wmma::row_major;
using ColM = wmma::col_major;

// --- l2norm ------------------------------------------------------------------------------------
// One warp per row of q (rows [0, R)) or k (rows [R, 2R)); dk <= 256 = 8 values per lane.
__global__ void __launch_bounds__(kL2Threads)
    gdr_l2norm_kernel(const bf16_t* __restrict__ q,  // [T, Hk, dk]
                      const bf16_t* __restrict__ k,  // [T, Hk, dk]
                      bf16_t* __restrict__ qn,       // [T, Hk, dk]
                      bf16_t* __restrict__ kn,       // [T, Hk, dk]
                      int64_t rows, int dk) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kL2Threads + threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (w >= 2 * rows) return;  // whole warps
  const bool is_k = w >= rows;
  const int64_t row = is_k ? w - rows : w;
  const bf16_t* x = (is_k ? k : q) + row * dk;  // [dk]
  bf16_t* y = (is_k ? kn : qn) + row * dk;      // [dk]
  float v[8], ss = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = lane + 32 * e;
    v[e] = c < dk ? bf(x[c]) : 0.f;
    ss += v[e] * v[e];
  }
  ss = warp_sum(ss);
  const float rs = 1.f / sqrtf(ss + static_cast<float>(kGdrL2NormEps));
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int c = lane + 32 * e;
    if (c < dk) y[c] = tobf(v[e] * rs);
  }
}

// The same for dk = 128 with 8-byte aligned rows: lane l owns columns 4 l .. 4 l + 3 (8-byte loads
// and stores) of kL2Rows consecutive rows of the warp, all of whose loads are issued before the
// first sum. The one-warp-per-row kernel above loaded 2 bytes a lane at a time, one row in flight
// per warp, measurably slower (docs/PERF.md). rstd is lane4_l2_rstd, which the fast backward's
// reduce kernel also uses when it recomputes rstd from the raw rows: forward and backward see the
// same rstd.
constexpr int kL2Rows = 4;

__global__ void __launch_bounds__(kL2Threads)
    gdr_l2norm128_kernel(const bf16_t* __restrict__ q,  // [T, Hk, 128]
                         const bf16_t* __restrict__ k,  // [T, Hk, 128]
                         bf16_t* __restrict__ qn,       // [T, Hk, 128]
                         bf16_t* __restrict__ kn,       // [T, Hk, 128]
                         int64_t rows) {
  constexpr int kD = 128;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kL2Threads + threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t r0 = w * kL2Rows;  // rows [0, rows) are q's, [rows, 2 rows) k's
  if (r0 >= 2 * rows) return;      // whole warps
  uint2 xv[kL2Rows];
#pragma unroll
  for (int i = 0; i < kL2Rows; ++i) {
    const int64_t r = r0 + i;
    xv[i] = make_uint2(0u, 0u);
    if (r < 2 * rows) {
      const bf16_t* x = r < rows ? q + r * kD : k + (r - rows) * kD;
      xv[i] = *reinterpret_cast<const uint2*>(x + 4 * lane);
    }
  }
#pragma unroll
  for (int i = 0; i < kL2Rows; ++i) {
    const int64_t r = r0 + i;
    if (r >= 2 * rows) break;  // uniform over the warp
    const float x[4] = {__uint_as_float(xv[i].x << 16), __uint_as_float(xv[i].x & 0xffff0000u),
                        __uint_as_float(xv[i].y << 16), __uint_as_float(xv[i].y & 0xffff0000u)};
    const float rs = lane4_l2_rstd(x);
    __nv_bfloat162 lo = __floats2bfloat162_rn(x[0] * rs, x[1] * rs);
    __nv_bfloat162 hi = __floats2bfloat162_rn(x[2] * rs, x[3] * rs);
    uint2 out;
    out.x = *reinterpret_cast<uint32_t*>(&lo);
    out.y = *reinterpret_cast<uint32_t*>(&hi);
    bf16_t* y = r < rows ? qn + r * kD : kn + (r - rows) * kD;
    *reinterpret_cast<uint2*>(y + 4 * lane) = out;
  }
}

// --- prep: T, W, U per (chunk, value head) -----------------------------------------------------
size_t prep_smem(int KP, int VP) {
  return tile_bytes_bf16(kC, KP) + tile_bytes_bf16(kC, VP) + 3 * tile_bytes_f32(kC, kC) +
         tile_bytes_bf16(kC, kC) + 6 * kVecBytes;
}

// dst rows [0, L) x cols [0, ncols) (global, row stride `stride`) = bf16(Tb X[:, 0:P]), computed in
// column slabs of 64 through the fp32 tile Out. Barriers inside; every thread must call it.
__device__ void store_tb_times(const bf16_t* Tb, const bf16_t* X, int ldx, int P, int ncols,
                               float* Out, bf16_t* dst, int64_t stride, int L) {
  for (int c0 = 0; c0 < P; c0 += kC) {
    const int sw = min(kC, P - c0);
    mma_bf16<RowM, RowM>(kC, sw, kC, Tb, kLd64, X + c0, ldx, Out, kLd64, false);
    __syncthreads();
    for (int p = static_cast<int>(threadIdx.x); p < L * sw; p += static_cast<int>(blockDim.x)) {
      const int i = p / sw, e = p % sw;
      if (c0 + e < ncols) dst[i * stride + c0 + e] = tobf(Out[i * kLd64 + e]);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kChunkThreads)
    gdr_prep_kernel(Dims d, IndexView ix,
                    const bf16_t* __restrict__ kn,   // [T, Hk, dk]
                    const bf16_t* __restrict__ v,    // [T, Hv, dv]
                    const float* __restrict__ g,     // [T, Hv]
                    const float* __restrict__ beta,  // [T, Hv]
                    bf16_t* __restrict__ W,          // [T, Hv, dk]
                    bf16_t* __restrict__ U) {        // [T, Hv, dv]
  const ChunkInfo ci = ix.table[blockIdx.x];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x);
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP);
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));  // [64, KP] K
  bf16_t* Vs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));  // [64, VP] V
  float* KK = sc.take<float>(tile_bytes_f32(kC, kC));       // [64, 64] K K^T, then slab output
  float* M = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64] strictly lower M
  float* Tm = sc.take<float>(tile_bytes_f32(kC, kC));       // [64, 64] T = (I + M)^{-1}
  bf16_t* Tb = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));    // [64, 64] T diag(...) in bf16
  float* gs = sc.vec();                                     // [64]
  float* bs = sc.vec();                                     // [64] beta
  float* pre = sc.vec();                                    // [64]
  float* tot = sc.vec();                                    // [4]
  float* G = sc.vec();                                      // [64]
  float* dec = sc.vec();                                    // [64]
  sc.done();

  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, static_cast<int64_t>(d.Hk) * d.dk, L, d.dk, kC,
             d.KP, d.vec);
  stage_tile(Vs, ldv, v + (t0 * d.Hv + h) * d.dv, static_cast<int64_t>(d.Hv) * d.dv, L, d.dv, kC,
             d.VP, d.vec);
  if (tid < kC) {
    gs[tid] = tid < L ? g[(t0 + tid) * d.Hv + h] : 0.f;
    bs[tid] = tid < L ? beta[(t0 + tid) * d.Hv + h] : 0.f;
  }
  for (int p = tid; p < kC * kLd64; p += kChunkThreads) M[p] = 0.f;
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  chunk_gate_sums(gs, L, pre, tot, G, dec);
  mma_bf16<RowM, ColM>(kC, kC, d.KP, Ks, ldk, Ks, ldk, KK, kLd64, false);  // K K^T
  __syncthreads();
  for_each_gate(gs, pre, tot, L, [&](int i, int j, float dd) {
    if (j < i) M[i * kLd64 + j] = bs[i] * dd * KK[i * kLd64 + j];
  });
  __syncthreads();
  unit_lower_inverse(M, Tm);
  __syncthreads();
  // W = T diag(beta G) K: the diagonal scales T's columns (64 x 64) instead of K's rows.
  for (int p = tid; p < kC * kC; p += kChunkThreads) {
    const int i = p / kC, j = p % kC;
    Tb[i * kLd64 + j] = tobf(Tm[i * kLd64 + j] * bs[j] * G[j]);
  }
  __syncthreads();
  const int64_t ldW = static_cast<int64_t>(d.Hv) * d.dk, ldU = static_cast<int64_t>(d.Hv) * d.dv;
  store_tb_times(Tb, Ks, ldk, d.KP, d.dk, KK, W + (t0 * d.Hv + h) * d.dk, ldW, L);
  // U = T diag(beta) V.
  for (int p = tid; p < kC * kC; p += kChunkThreads) {
    const int i = p / kC, j = p % kC;
    Tb[i * kLd64 + j] = tobf(Tm[i * kLd64 + j] * bs[j]);
  }
  __syncthreads();
  store_tb_times(Tb, Vs, ldv, d.VP, d.dv, KK, U + (t0 * d.Hv + h) * d.dv, ldU, L);
}

// --- the state pass -----------------------------------------------------------------------------
template <int VB>
size_t state_fwd_smem(int KP, int nbuf) {
  const size_t per_buf = 2 * tile_bytes_bf16(kC, KP) + tile_bytes_bf16(kC, VB) + kVecBytes;
  return nbuf * per_buf + tile_bytes_f32(std::max(KP, kC), VB) + tile_bytes_bf16(KP, VB) +
         tile_bytes_bf16(kC, VB) + 4 * kVecBytes;
}

// The state S [KP, VB] of one column block lives in WMMA accumulators: 16x16 tile f = warp + 4 s
// (row tile f / (VB/16), column tile f % (VB/16)), s < kNS.
template <int VB>
__global__ void __launch_bounds__(kStateThreads)
    gdr_state_fwd_kernel(Dims d, IndexView ix, int nbuf,
                         const bf16_t* __restrict__ W,   // [T, Hv, dk]
                         const bf16_t* __restrict__ kn,  // [T, Hk, dk]
                         const float* __restrict__ g,    // [T, Hv]
                         const float* __restrict__ h0,   // [N, Hv, dk, dv] or null
                         bf16_t* U,                      // [T, Hv, dv] U in, V' out (in place)
                         bf16_t* __restrict__ H,         // [nt_max, Hv, dk, dv] chunk-start states
                         float* __restrict__ hT) {       // [N, Hv, dk, dv] or null
  constexpr int kTn = VB / 16;
  constexpr int kNS = ((static_cast<int>(kGdrMaxHeadDim) / 16) * kTn + 3) / 4;
  const int nvb = (d.VP + VB - 1) / VB;
  const int n = static_cast<int>(blockIdx.x) / nvb, vb = static_cast<int>(blockIdx.x) % nvb;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r;
  const int col0 = vb * VB, cvalid = min(VB, d.dv - col0);
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5;
  const int tiles = (d.KP / 16) * kTn;
  const int ldk = ld_of(d.KP), ldb = ld_of(VB);
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  // Staged inputs, nbuf copies of each (b = 0, 1 alternate between chunks when double-buffered);
  // addressed by offset so that no pointer array lands in local memory.
  const int64_t nk = tile_bytes_bf16(kC, d.KP) / 2, nu = tile_bytes_bf16(kC, VB) / 2;
  bf16_t* Ws0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, d.KP));  // nbuf x [64, KP]
  bf16_t* Ks0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, d.KP));  // nbuf x [64, KP]
  bf16_t* Us0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, VB));    // nbuf x [64, VB]
  float* gs0 = sc.take<float>(nbuf * kVecBytes);                    // nbuf x [64]
  auto Ws = [&](int b) { return Ws0 + b * nk; };
  auto Ks = [&](int b) { return Ks0 + b * nk; };
  auto Us = [&](int b) { return Us0 + b * nu; };
  auto gs = [&](int b) { return gs0 + b * (kVecBytes / 4); };
  float* Sf = sc.take<float>(tile_bytes_f32(max(d.KP, kC), VB));  // [KP, VB] S, or [64, VB] W S
  bf16_t* Sb = sc.take<bf16_t>(tile_bytes_bf16(d.KP, VB));        // [KP, VB] bf16(S)
  bf16_t* Vd = sc.take<bf16_t>(tile_bytes_bf16(kC, VB));          // [64, VB] diag(dec) V'
  float* pre = sc.vec();
  float* tot = sc.vec();
  float* G = sc.vec();
  float* dec = sc.vec();
  sc.done();

  const int bos = ix.bos[n], eos = ix.bos[n + 1], c0 = ix.chunk0[n], c1 = ix.chunk0[n + 1];
  const int64_t ldW = static_cast<int64_t>(d.Hv) * d.dk, ldK = static_cast<int64_t>(d.Hk) * d.dk;
  const int64_t ldU = static_cast<int64_t>(d.Hv) * d.dv, sd = static_cast<int64_t>(d.dk) * d.dv;
  auto stage = [&](int c, int b) {
    const int t0 = bos + (c - c0) * kC, L = min(kC, eos - t0);
    stage_tile(Ws(b), ldk, W + (static_cast<int64_t>(t0) * d.Hv + h) * d.dk, ldW, L, d.dk, kC, d.KP,
               d.vec);
    stage_tile(Ks(b), ldk, kn + (static_cast<int64_t>(t0) * d.Hk + kh) * d.dk, ldK, L, d.dk, kC,
               d.KP, d.vec);
    stage_tile(Us(b), ldb, U + (static_cast<int64_t>(t0) * d.Hv + h) * d.dv + col0, ldU, L, cvalid,
               kC, VB, d.vec);
    if (tid < kC) gs(b)[tid] = tid < L ? g[(static_cast<int64_t>(t0) + tid) * d.Hv + h] : 0.f;
    cp_async_commit();
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> S[kNS];
  const int64_t state_off = (static_cast<int64_t>(n) * d.Hv + h) * sd + col0;
  if (h0 != nullptr) load_tile(Sf, ldb, h0 + state_off, d.dv, d.dk, cvalid, d.KP, VB, d.vec);
#pragma unroll
  for (int s = 0; s < kNS; ++s) {
    const int f = warp + 4 * s;
    if (f >= tiles) continue;
    if (h0 != nullptr)
      wmma::load_matrix_sync(S[s], Sf + (f / kTn) * 16 * ldb + (f % kTn) * 16, ldb,
                             wmma::mem_row_major);
    else
      wmma::fill_fragment(S[s], 0.f);
  }
  __syncthreads();

  if (c0 < c1) stage(c0, 0);
  for (int c = c0; c < c1; ++c) {
    const int b = nbuf == 2 ? (c - c0) & 1 : 0;
    if (nbuf == 2 && c + 1 < c1) {
      stage(c + 1, b ^ 1);
      cp_async_wait<1>();
    } else {
      if (nbuf == 1 && c > c0) stage(c, 0);
      cp_async_wait<0>();
    }
    __syncthreads();
    const int t0 = bos + (c - c0) * kC, L = min(kC, eos - t0);
    chunk_gate_sums(gs(b), L, pre, tot, G, dec);
#pragma unroll
    for (int s = 0; s < kNS; ++s) {
      const int f = warp + 4 * s;
      if (f < tiles)
        wmma::store_matrix_sync(Sf + (f / kTn) * 16 * ldb + (f % kTn) * 16, S[s], ldb,
                                wmma::mem_row_major);
    }
    __syncthreads();
    const float GL = G[L - 1];
    // The chunk-start snapshot (bf16), also the MMA operand of W S.
    bf16_t* Hc = H + (static_cast<int64_t>(c) * d.Hv + h) * sd + col0;  // [dk, VB] at stride dv
    for (int p = tid; p < d.KP * VB; p += kStateThreads) {
      const int r = p / VB, e = p % VB;
      const bf16_t x = tobf(Sf[r * ldb + e]);
      Sb[r * ldb + e] = x;
      if (r < d.dk && e < cvalid) Hc[static_cast<int64_t>(r) * d.dv + e] = x;
    }
    __syncthreads();
    mma_bf16<RowM, RowM>(kC, VB, d.KP, Ws(b), ldk, Sb, ldb, Sf, ldb, false);  // W S
    __syncthreads();
    bf16_t* Vc = U + (static_cast<int64_t>(t0) * d.Hv + h) * d.dv + col0;  // [L, VB] at stride ldU
    for (int p = tid; p < kC * VB; p += kStateThreads) {
      const int i = p / VB, e = p % VB;
      const float vp = bf(Us(b)[i * ldb + e]) - Sf[i * ldb + e];
      if (i < L && e < cvalid) Vc[static_cast<int64_t>(i) * ldU + e] = tobf(vp);
      Vd[i * ldb + e] = tobf(dec[i] * vp);
    }
    __syncthreads();
    // S <- G_L S + K^T diag(dec) V'.
#pragma unroll
    for (int s = 0; s < kNS; ++s) {
      const int f = warp + 4 * s;
      if (f >= tiles) continue;
      const int m0 = (f / kTn) * 16, n0 = (f % kTn) * 16;
#pragma unroll
      for (int e = 0; e < S[s].num_elements; ++e) S[s].x[e] *= GL;
      for (int k0 = 0; k0 < kC; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16_t, ColM> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16_t, RowM> bm;
        wmma::load_matrix_sync(a, Ks(b) + k0 * ldk + m0, ldk);
        wmma::load_matrix_sync(bm, Vd + k0 * ldb + n0, ldb);
        wmma::mma_sync(S[s], a, bm, S[s]);
      }
    }
    __syncthreads();
  }
  if (hT != nullptr) {
#pragma unroll
    for (int s = 0; s < kNS; ++s) {
      const int f = warp + 4 * s;
      if (f < tiles)
        wmma::store_matrix_sync(Sf + (f / kTn) * 16 * ldb + (f % kTn) * 16, S[s], ldb,
                                wmma::mem_row_major);
    }
    __syncthreads();
    for (int p = tid; p < d.dk * cvalid; p += kStateThreads) {
      const int r = p / cvalid, e = p % cvalid;
      hT[state_off + static_cast<int64_t>(r) * d.dv + e] = Sf[r * ldb + e];
    }
  }
}

// --- output ------------------------------------------------------------------------------------
size_t output_smem(int KP) {
  return 2 * tile_bytes_bf16(kC, KP) + tile_bytes_bf16(kC, kC) + tile_bytes_bf16(KP, kC) +
         tile_bytes_bf16(kC, kC) + tile_bytes_f32(kC, kC) + 5 * kVecBytes;
}

// One block per (chunk slot, value head, 64 columns of dv).
__global__ void __launch_bounds__(kChunkThreads)
    gdr_output_kernel(Dims d, IndexView ix, int nvb,
                      const bf16_t* __restrict__ qn,    // [T, Hk, dk]
                      const bf16_t* __restrict__ kn,    // [T, Hk, dk]
                      const bf16_t* __restrict__ vnew,  // [T, Hv, dv] V'
                      const bf16_t* __restrict__ H,     // [nt_max, Hv, dk, dv]
                      const float* __restrict__ g,      // [T, Hv]
                      bf16_t* __restrict__ o) {         // [T, Hv, dv]
  const int c = static_cast<int>(blockIdx.x) / nvb, vb = static_cast<int>(blockIdx.x) % nvb;
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int col0 = vb * kC, cw = min(kC, d.VP - col0), cvalid = min(kC, d.dv - col0);
  const int tid = static_cast<int>(threadIdx.x);
  const int ldk = ld_of(d.KP);
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Qs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));  // [64, KP]
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));  // [64, KP]
  bf16_t* Vs = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));    // [64, cw] V' columns
  bf16_t* Hs = sc.take<bf16_t>(tile_bytes_bf16(d.KP, kC));  // [KP, cw] state columns
  bf16_t* Pb = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));    // [64, 64] bf16(Q K^T .* D), j <= i
  float* F = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64] fp32 products
  float* gs = sc.vec();
  float* pre = sc.vec();
  float* tot = sc.vec();
  float* G = sc.vec();
  float* dec = sc.vec();
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldv = static_cast<int64_t>(d.Hv) * d.dv;
  stage_tile(Qs, ldk, qn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(Vs, kLd64, vnew + (t0 * d.Hv + h) * d.dv + col0, ldv, L, cvalid, kC, cw, d.vec);
  stage_tile(Hs, kLd64, H + (static_cast<int64_t>(c) * d.Hv + h) * d.dk * d.dv + col0,
             static_cast<int64_t>(d.dv), d.dk, cvalid, d.KP, cw, d.vec);
  if (tid < kC) gs[tid] = tid < L ? g[(t0 + tid) * d.Hv + h] : 0.f;
  for (int p = tid; p < kC * kLd64; p += kChunkThreads) Pb[p] = bf16_zero();
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  chunk_gate_sums(gs, L, pre, tot, G, dec);
  mma_bf16<RowM, ColM>(kC, kC, d.KP, Qs, ldk, Ks, ldk, F, kLd64, false);  // Q K^T
  __syncthreads();
  for_each_gate(gs, pre, tot, L,
                [&](int i, int j, float dd) { Pb[i * kLd64 + j] = tobf(F[i * kLd64 + j] * dd); });
  __syncthreads();
  mma_bf16<RowM, RowM>(kC, cw, d.KP, Qs, ldk, Hs, kLd64, F, kLd64, false);  // Q H_c
  __syncthreads();
  for (int p = tid; p < kC * cw; p += kChunkThreads) {
    const int i = p / cw, e = p % cw;
    F[i * kLd64 + e] *= G[i];
  }
  __syncthreads();
  mma_bf16<RowM, RowM>(kC, cw, kC, Pb, kLd64, Vs, kLd64, F, kLd64, true);  // + P V'
  __syncthreads();
  bf16_t* oc = o + (t0 * d.Hv + h) * d.dv + col0;  // [L, cvalid] at stride ldv
  for (int p = tid; p < L * cvalid; p += kChunkThreads) {
    const int i = p / cvalid, e = p % cvalid;
    oc[i * ldv + e] = tobf(d.scale * F[i * kLd64 + e]);
  }
}

unsigned grid_x(int64_t n, const char* what) {
  GDN_CHECK(n >= 1 && n <= INT_MAX, "gated_delta_rule (cuda): {} needs a grid of {} blocks", what,
            n);
  return static_cast<unsigned>(n);
}

}  // namespace

// --- launchers -----------------------------------------------------------------------------------
void launch_l2norm(const Dims& d, const bf16_t* q, const bf16_t* k, bf16_t* qn, bf16_t* kn,
                   cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(d.T) * d.Hk;
  if (rows == 0) return;
  auto aligned8 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 8 == 0; };
  if (d.dk == 128 && aligned8(q) && aligned8(k) && aligned8(qn) && aligned8(kn)) {
    const int64_t warps = (2 * rows + kL2Rows - 1) / kL2Rows;
    const int64_t blocks = (warps * 32 + kL2Threads - 1) / kL2Threads;
    gdr_l2norm128_kernel<<<grid_x(blocks, "gdr_l2norm128_kernel"), kL2Threads, 0, s>>>(q, k, qn, kn,
                                                                                       rows);
    GDN_CUDA_LAUNCH_CHECK("gdr_l2norm128_kernel");
    return;
  }
  const int64_t blocks = (2 * rows * 32 + kL2Threads - 1) / kL2Threads;
  gdr_l2norm_kernel<<<grid_x(blocks, "gdr_l2norm_kernel"), kL2Threads, 0, s>>>(q, k, qn, kn, rows,
                                                                               d.dk);
  GDN_CUDA_LAUNCH_CHECK("gdr_l2norm_kernel");
}

void launch_prep(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
                 const float* g, const float* beta, bf16_t* W, bf16_t* U, cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = prep_smem(d.KP, d.VP);
  allow_smem(reinterpret_cast<const void*>(&gdr_prep_kernel), smem, "gdr_prep_kernel", d.dk, d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_prep_kernel"), static_cast<unsigned>(d.Hv));
  gdr_prep_kernel<<<grid, kChunkThreads, smem, s>>>(d, ix, kn, v, g, beta, W, U);
  GDN_CUDA_LAUNCH_CHECK("gdr_prep_kernel");
}

namespace {
template <int VB>
void launch_state_fwd_vb(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* kn,
                         const float* g, const float* h0, bf16_t* U, bf16_t* H, float* hT,
                         cudaStream_t s) {
  const auto* kernel = reinterpret_cast<const void*>(&gdr_state_fwd_kernel<VB>);
  const size_t optin = cuda::Context::get().props().sharedMemPerBlockOptin;
  const int nbuf = state_fwd_smem<VB>(d.KP, 2) <= optin ? 2 : 1;
  const size_t smem = state_fwd_smem<VB>(d.KP, nbuf);
  allow_smem(kernel, smem, "gdr_state_fwd_kernel", d.dk, d.dv);
  const int nvb = (d.VP + VB - 1) / VB;
  const dim3 grid(grid_x(static_cast<int64_t>(d.N) * nvb, "gdr_state_fwd_kernel"),
                  static_cast<unsigned>(d.Hv));
  gdr_state_fwd_kernel<VB><<<grid, kStateThreads, smem, s>>>(d, ix, nbuf, W, kn, g, h0, U, H, hT);
  GDN_CUDA_LAUNCH_CHECK("gdr_state_fwd_kernel");
}
}  // namespace

void launch_state_fwd(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* kn,
                      const float* g, const float* h0, bf16_t* U_vnew, bf16_t* H, float* hT,
                      cudaStream_t s) {
  // Few (document, head) pairs (long documents): narrower column blocks, twice the blocks.
  const int64_t blocks32 = static_cast<int64_t>(d.N) * d.Hv * ((d.VP + 31) / 32);
  if (blocks32 < 2 * cuda::Context::get().sm_count())
    launch_state_fwd_vb<16>(d, ix, W, kn, g, h0, U_vnew, H, hT, s);
  else
    launch_state_fwd_vb<32>(d, ix, W, kn, g, h0, U_vnew, H, hT, s);
}

void launch_output(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                   const bf16_t* vnew, const bf16_t* H, const float* g, bf16_t* o, cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = output_smem(d.KP);
  allow_smem(reinterpret_cast<const void*>(&gdr_output_kernel), smem, "gdr_output_kernel", d.dk,
             d.dv);
  const int nvb = (d.VP + kC - 1) / kC;
  const dim3 grid(grid_x(d.nt_max * nvb, "gdr_output_kernel"), static_cast<unsigned>(d.Hv));
  gdr_output_kernel<<<grid, kChunkThreads, smem, s>>>(d, ix, nvb, qn, kn, vnew, H, g, o);
  GDN_CUDA_LAUNCH_CHECK("gdr_output_kernel");
}

}  // namespace gdn::ops::gdr
