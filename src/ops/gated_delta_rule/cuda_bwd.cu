// Gated delta rule on CUDA, the generic route's backward kernels (cuda_fast_bwd.cu is the fast
// route): fla/ops/gated_delta_rule/chunk.py
// (chunk_gated_delta_rule_bwd) re-derived in cpu.cpp's notation (its header lists every formula):
//   dvloc     dV'_loc = s P^T dO                                  (fla chunk_bwd_kernel_dv_local)
//   state_bwd reverse over chunks, dS in registers: dH_c = dS (the chunk END state's gradient),
//             dV' = dV'_loc + diag(dec) K dS, dS <- G_L dS + s (diag(G) Q)^T dO - W^T dV'
//                                                  (fla chunk_gated_delta_rule_bwd_kernel_dhu)
//   dqk       E = s dO V'^T; dP = E .* D (j <= i); dQ = dP K + s diag(G) dO H_c^T;
//             dK_a = dP^T Q + diag(dec) V' dH_c^T; the gate terms of these paths (fla
//             chunk_bwd_kernel_dqkwg)
//   wy        dW = -dV' H_c^T; dT = dV' (beta V)^T + dW (beta G K)^T; dv = beta T^T dV';
//             dK_b = beta G T^T dW; dM = -T^T tril_{-1}(dT) T^T into beta, K and the gates
//             (fla prepare_wy_repr_bwd); dg and dbeta are completed here
//   reduce    dq, dk summed over the r value heads of each key head, then the l2norm backward.
// dg is assembled per chunk from the terms that reach each token (suffix sums of the G-type terms,
// prefix sums of the dec-type terms, pair terms h_ij over j < t <= i, and G_L <H_c, dH_c> for every
// token), never as a reverse cumsum of differences: cpu.cpp's scheme, split over dqk (score, Q H_c
// and state terms) and wy (W and M terms), which add their parts in a fixed order.
// Determinism: no atomics; every sum has a fixed order; dq/dk partials per value head are fp32.
#include <algorithm>
#include <climits>

#include "gdn/backend/cuda_check.h"
#include "ops/gated_delta_rule/cuda_kernels.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops::gdr {

namespace {

constexpr int kChunkThreads = 256;  // 8 warps; unit_lower_inverse needs exactly 256
constexpr int kStateThreads = 128;
constexpr int kReduceThreads = 256;

using RowM = wmma::row_major;
using ColM = wmma::col_major;

unsigned grid_x(int64_t n, const char* what) {
  GDN_CHECK(n >= 1 && n <= INT_MAX, "gated_delta_rule (cuda): {} needs a grid of {} blocks", what,
            n);
  return static_cast<unsigned>(n);
}

// --- dV'_loc -------------------------------------------------------------------------------------
size_t dvloc_smem(int KP) {
  return 2 * tile_bytes_bf16(kC, KP) + 2 * tile_bytes_bf16(kC, kC) + tile_bytes_f32(kC, kC) +
         5 * kVecBytes;
}

__global__ void __launch_bounds__(kChunkThreads)
    gdr_dvloc_kernel(Dims d, IndexView ix, int nvb,
                     const bf16_t* __restrict__ qn,    // [T, Hk, dk]
                     const bf16_t* __restrict__ kn,    // [T, Hk, dk]
                     const bf16_t* __restrict__ dout,  // [T, Hv, dv]
                     const float* __restrict__ g,      // [T, Hv]
                     float* __restrict__ dvloc) {      // [T, Hv, dv]
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
  bf16_t* dOs = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));   // [64, cw]
  bf16_t* Pb = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));    // [64, 64] bf16(Q K^T .* D), j <= i
  float* F = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64]
  float* gs = sc.vec();
  float* pre = sc.vec();
  float* tot = sc.vec();
  float* G = sc.vec();
  float* dec = sc.vec();
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldv = static_cast<int64_t>(d.Hv) * d.dv;
  stage_tile(Qs, ldk, qn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(dOs, kLd64, dout + (t0 * d.Hv + h) * d.dv + col0, ldv, L, cvalid, kC, cw, d.vec);
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
  mma_bf16<ColM, RowM>(kC, cw, kC, Pb, kLd64, dOs, kLd64, F, kLd64, false);  // P^T dO
  __syncthreads();
  float* out = dvloc + (t0 * d.Hv + h) * d.dv + col0;  // [L, cvalid] at stride ldv
  for (int p = tid; p < L * cvalid; p += kChunkThreads) {
    const int i = p / cvalid, e = p % cvalid;
    out[i * ldv + e] = d.scale * F[i * kLd64 + e];
  }
}

// --- the reverse state pass ------------------------------------------------------------------
template <int VB>
size_t state_bwd_smem(int KP, int nbuf) {
  const size_t per_buf = 3 * tile_bytes_bf16(kC, KP) + tile_bytes_bf16(kC, VB) + kVecBytes;
  return nbuf * per_buf + tile_bytes_f32(std::max(KP, kC), VB) + tile_bytes_bf16(KP, VB) +
         tile_bytes_bf16(kC, VB) + 4 * kVecBytes;
}

template <int VB>
__global__ void __launch_bounds__(kStateThreads)
    gdr_state_bwd_kernel(Dims d, IndexView ix, int nbuf,
                         const bf16_t* __restrict__ qn,    // [T, Hk, dk]
                         const bf16_t* __restrict__ kn,    // [T, Hk, dk]
                         const bf16_t* __restrict__ W,     // [T, Hv, dk]
                         const bf16_t* __restrict__ dout,  // [T, Hv, dv]
                         const float* __restrict__ dvloc,  // [T, Hv, dv]
                         const float* __restrict__ g,      // [T, Hv]
                         const float* __restrict__ dhT,    // [N, Hv, dk, dv] or null
                         bf16_t* __restrict__ dvp,         // [T, Hv, dv] dV'
                         bf16_t* __restrict__ dH,          // [nt_max, Hv, dk, dv]
                         float* __restrict__ dh0) {        // [N, Hv, dk, dv] or null
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
  // Staged inputs, nbuf copies of each, addressed by offset (no pointer array in local memory).
  const int64_t nk = tile_bytes_bf16(kC, d.KP) / 2, nu = tile_bytes_bf16(kC, VB) / 2;
  bf16_t* Kt0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, d.KP));  // [64, KP] K, then dec K
  bf16_t* Qs0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, d.KP));  // [64, KP] Q, then s G Q
  bf16_t* Ws0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, d.KP));  // [64, KP] W
  bf16_t* dOs0 = sc.take<bf16_t>(nbuf * tile_bytes_bf16(kC, VB));   // [64, VB] dO columns
  float* gs0 = sc.take<float>(nbuf * kVecBytes);                    // [64]
  auto Kt = [&](int b) { return Kt0 + b * nk; };
  auto Qs = [&](int b) { return Qs0 + b * nk; };
  auto Ws = [&](int b) { return Ws0 + b * nk; };
  auto dOs = [&](int b) { return dOs0 + b * nu; };
  auto gs = [&](int b) { return gs0 + b * (kVecBytes / 4); };
  float* Sf = sc.take<float>(tile_bytes_f32(max(d.KP, kC), VB));  // [KP, VB] dS, or [64, VB]
  bf16_t* Sb = sc.take<bf16_t>(tile_bytes_bf16(d.KP, VB));        // [KP, VB] bf16(dS)
  bf16_t* nV = sc.take<bf16_t>(tile_bytes_bf16(kC, VB));          // [64, VB] -dV'
  float* pre = sc.vec();
  float* tot = sc.vec();
  float* G = sc.vec();
  float* dec = sc.vec();
  sc.done();

  const int bos = ix.bos[n], eos = ix.bos[n + 1], c0 = ix.chunk0[n], c1 = ix.chunk0[n + 1];
  const int64_t ldW = static_cast<int64_t>(d.Hv) * d.dk, ldK = static_cast<int64_t>(d.Hk) * d.dk;
  const int64_t ldV = static_cast<int64_t>(d.Hv) * d.dv, sd = static_cast<int64_t>(d.dk) * d.dv;
  auto stage = [&](int c, int b) {
    const int t0 = bos + (c - c0) * kC, L = min(kC, eos - t0);
    const int64_t tk = static_cast<int64_t>(t0) * d.Hk + kh, tv = static_cast<int64_t>(t0) * d.Hv;
    stage_tile(Kt(b), ldk, kn + tk * d.dk, ldK, L, d.dk, kC, d.KP, d.vec);
    stage_tile(Qs(b), ldk, qn + tk * d.dk, ldK, L, d.dk, kC, d.KP, d.vec);
    stage_tile(Ws(b), ldk, W + (tv + h) * d.dk, ldW, L, d.dk, kC, d.KP, d.vec);
    stage_tile(dOs(b), ldb, dout + (tv + h) * d.dv + col0, ldV, L, cvalid, kC, VB, d.vec);
    if (tid < kC) gs(b)[tid] = tid < L ? g[(static_cast<int64_t>(t0) + tid) * d.Hv + h] : 0.f;
    cp_async_commit();
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> S[kNS];  // dS
  const int64_t state_off = (static_cast<int64_t>(n) * d.Hv + h) * sd + col0;
  if (dhT != nullptr) load_tile(Sf, ldb, dhT + state_off, d.dv, d.dk, cvalid, d.KP, VB, d.vec);
#pragma unroll
  for (int s = 0; s < kNS; ++s) {
    const int f = warp + 4 * s;
    if (f >= tiles) continue;
    if (dhT != nullptr)
      wmma::load_matrix_sync(S[s], Sf + (f / kTn) * 16 * ldb + (f % kTn) * 16, ldb,
                             wmma::mem_row_major);
    else
      wmma::fill_fragment(S[s], 0.f);
  }
  __syncthreads();

  if (c0 < c1) stage(c1 - 1, 0);
  for (int c = c1 - 1; c >= c0; --c) {
    const int b = nbuf == 2 ? (c1 - 1 - c) & 1 : 0;
    if (nbuf == 2 && c - 1 >= c0) {
      stage(c - 1, b ^ 1);
      cp_async_wait<1>();
    } else {
      if (nbuf == 1 && c < c1 - 1) stage(c, 0);
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
    for (int p = tid; p < kC * d.KP; p += kStateThreads) {
      const int i = p / d.KP, e = p % d.KP;
      Kt(b)[i * ldk + e] = tobf(dec[i] * bf(Kt(b)[i * ldk + e]));
      Qs(b)[i * ldk + e] = tobf(d.scale * G[i] * bf(Qs(b)[i * ldk + e]));
    }
    bf16_t* dHc = dH + (static_cast<int64_t>(c) * d.Hv + h) * sd + col0;  // [dk, VB] at stride dv
    for (int p = tid; p < d.KP * VB; p += kStateThreads) {
      const int r = p / VB, e = p % VB;
      const bf16_t x = tobf(Sf[r * ldb + e]);
      Sb[r * ldb + e] = x;
      if (r < d.dk && e < cvalid) dHc[static_cast<int64_t>(r) * d.dv + e] = x;
    }
    __syncthreads();
    mma_bf16<RowM, RowM>(kC, VB, d.KP, Kt(b), ldk, Sb, ldb, Sf, ldb, false);  // diag(dec) K dS
    __syncthreads();
    const int64_t row0 = (static_cast<int64_t>(t0) * d.Hv + h) * d.dv + col0;
    for (int p = tid; p < kC * VB; p += kStateThreads) {
      const int i = p / VB, e = p % VB;
      float x = Sf[i * ldb + e];
      if (i < L && e < cvalid) {
        x += dvloc[row0 + i * ldV + e];
        dvp[row0 + i * ldV + e] = tobf(x);
      }
      nV[i * ldb + e] = tobf(-x);
    }
    __syncthreads();
    // dS <- G_L dS + (s diag(G) Q)^T dO - W^T dV'.
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
        wmma::load_matrix_sync(a, Qs(b) + k0 * ldk + m0, ldk);
        wmma::load_matrix_sync(bm, dOs(b) + k0 * ldb + n0, ldb);
        wmma::mma_sync(S[s], a, bm, S[s]);
        wmma::load_matrix_sync(a, Ws(b) + k0 * ldk + m0, ldk);
        wmma::load_matrix_sync(bm, nV + k0 * ldb + n0, ldb);
        wmma::mma_sync(S[s], a, bm, S[s]);
      }
    }
    __syncthreads();
  }
  if (dh0 != nullptr) {
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
      dh0[state_off + static_cast<int64_t>(r) * d.dv + e] = Sf[r * ldb + e];
    }
  }
}

// --- dqk: the score, output-state and state-update paths ----------------------------------------
size_t dqk_smem(int KP, int VP) {
  return 2 * tile_bytes_bf16(kC, KP) + 3 * tile_bytes_bf16(kC, VP) + 2 * tile_bytes_f32(kC, kC) +
         tile_bytes_bf16(kC, kC) + 9 * kVecBytes;
}

__global__ void __launch_bounds__(kChunkThreads)
    gdr_bwd_dqk_kernel(Dims d, IndexView ix,
                       const bf16_t* __restrict__ qn,    // [T, Hk, dk]
                       const bf16_t* __restrict__ kn,    // [T, Hk, dk]
                       const bf16_t* __restrict__ vnew,  // [T, Hv, dv] V'
                       const bf16_t* __restrict__ dout,  // [T, Hv, dv]
                       const bf16_t* __restrict__ H,     // [nt_max, Hv, dk, dv] chunk-start states
                       const bf16_t* __restrict__ dH,    // [nt_max, Hv, dk, dv] chunk-end grads
                       const float* __restrict__ g,      // [T, Hv]
                       float* __restrict__ dqh,          // [T, Hv, dk]
                       float* __restrict__ dkh,          // [T, Hv, dk]
                       float* __restrict__ dgp) {        // [T, Hv]
  const int c = static_cast<int>(blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x);
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP);
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Qs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));   // [64, KP]
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));   // [64, KP]
  bf16_t* Vs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));   // [64, VP] V'
  bf16_t* dOs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));  // [64, VP] dO
  bf16_t* Hsl = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));  // [64, VP] 64 rows of H_c or dH_c
  float* F1 = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64] Q K^T, then pair terms
  float* F2 = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64] E, then slab outputs
  bf16_t* Pd = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));     // [64, 64] dP = E .* D, j <= i
  float* gs = sc.vec();
  float* pre = sc.vec();
  float* tot = sc.vec();
  float* G = sc.vec();
  float* dec = sc.vec();
  float* dgam = sc.vec();  // [64] s G_i q_i . (dO H_c^T)_i
  float* phi = sc.vec();   // [64] dec_i k_i . (V' dH_c^T)_i, i < L - 1
  float* pair = sc.vec();  // [64] pair sums of the score terms
  float* red = sc.vec();   // [32] block reduction
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldV = static_cast<int64_t>(d.Hv) * d.dv;
  const int64_t ldh = static_cast<int64_t>(d.Hv) * d.dk, sd = static_cast<int64_t>(d.dk) * d.dv;
  stage_tile(Qs, ldk, qn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(Vs, ldv, vnew + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, d.vec);
  stage_tile(dOs, ldv, dout + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, d.vec);
  if (tid < kC) {
    gs[tid] = tid < L ? g[(t0 + tid) * d.Hv + h] : 0.f;
    dgam[tid] = 0.f;
    phi[tid] = 0.f;
  }
  for (int p = tid; p < kC * kLd64; p += kChunkThreads) Pd[p] = bf16_zero();
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  chunk_gate_sums(gs, L, pre, tot, G, dec);
  mma_bf16<RowM, ColM>(kC, kC, d.KP, Qs, ldk, Ks, ldk, F1, kLd64, false);   // Q K^T
  mma_bf16<RowM, ColM>(kC, kC, d.VP, dOs, ldv, Vs, ldv, F2, kLd64, false);  // dO V'^T
  __syncthreads();
  // dP_ij = s (dO_i . v'_j) D_ij on j <= i; the pair term s (dO_i . v'_j)(q_i . k_j) D_ij for j < i
  // (a factor e^{gamma_i - gamma_j}) goes to F1 in place.
  for_each_gate(gs, pre, tot, L, [&](int i, int j, float dd) {
    const float e = d.scale * F2[i * kLd64 + j];
    Pd[i * kLd64 + j] = tobf(e * dd);
    if (j < i) F1[i * kLd64 + j] = e * F1[i * kLd64 + j] * dd;
  });
  __syncthreads();
  pair_row_prefix(F1, kLd64, L);
  __syncthreads();
  if (tid < kC) pair[tid] = pair_column_sum(F1, kLd64, L, tid);

  const bf16_t* Hc = H + (static_cast<int64_t>(c) * d.Hv + h) * sd;    // [dk, dv]
  const bf16_t* dHc = dH + (static_cast<int64_t>(c) * d.Hv + h) * sd;  // [dk, dv]
  const int qr = tid >> 2, qq = tid & 3;  // row and quarter of the row-wise loops
  float dg_all_part = 0.f;
  // dQ = dP K + s diag(G) dO H_c^T, in slabs of 64 key columns.
  for (int d0 = 0; d0 < d.KP; d0 += kC) {
    const int sw = min(kC, d.KP - d0);
    load_tile(Hsl, ldv, Hc + static_cast<int64_t>(d0) * d.dv, static_cast<int64_t>(d.dv),
              max(0, min(sw, d.dk - d0)), d.dv, sw, d.VP, d.vec);
    mma_bf16<RowM, ColM>(kC, sw, d.VP, dOs, ldv, Hsl, ldv, F2, kLd64, false);  // dO H_c^T
    __syncthreads();
    {
      float part = 0.f;
      const float sg = d.scale * G[qr];
      for (int e = qq * 16; e < qq * 16 + 16 && e < sw; ++e) {
        const float y = F2[qr * kLd64 + e];
        part += bf(Qs[qr * ldk + d0 + e]) * y;
        F2[qr * kLd64 + e] = sg * y;
      }
      part = quad_sum(part);
      if (qq == 0) dgam[qr] += sg * part;
    }
    __syncthreads();
    mma_bf16<RowM, RowM>(kC, sw, kC, Pd, kLd64, Ks + d0, ldk, F2, kLd64, true);  // + dP K
    __syncthreads();
    float* out = dqh + (t0 * d.Hv + h) * d.dk + d0;  // [L, sw] at stride ldh
    for (int p = tid; p < L * sw; p += kChunkThreads) {
      const int i = p / sw, e = p % sw;
      if (d0 + e < d.dk) out[i * ldh + e] = F2[i * kLd64 + e];
    }
    __syncthreads();
  }
  // dK_a = dP^T Q + diag(dec) V' dH_c^T, and <H_c, dH_c> on the way.
  for (int d0 = 0; d0 < d.KP; d0 += kC) {
    const int sw = min(kC, d.KP - d0), rows = max(0, min(sw, d.dk - d0));
    load_tile(Hsl, ldv, dHc + static_cast<int64_t>(d0) * d.dv, static_cast<int64_t>(d.dv), rows,
              d.dv, sw, d.VP, d.vec);
    mma_bf16<RowM, ColM>(kC, sw, d.VP, Vs, ldv, Hsl, ldv, F2, kLd64, false);  // V' dH_c^T
    for (int p = tid; p < rows * d.dv; p += kChunkThreads) {
      const int r = p / d.dv, e = p % d.dv;
      dg_all_part += bf(Hc[static_cast<int64_t>(d0 + r) * d.dv + e]) * bf(Hsl[r * ldv + e]);
    }
    __syncthreads();
    {
      float part = 0.f;
      const float dc = dec[qr];
      for (int e = qq * 16; e < qq * 16 + 16 && e < sw; ++e) {
        const float z = F2[qr * kLd64 + e];
        part += bf(Ks[qr * ldk + d0 + e]) * z;
        F2[qr * kLd64 + e] = dc * z;
      }
      part = quad_sum(part);
      if (qq == 0) phi[qr] += dc * part;
    }
    __syncthreads();
    mma_bf16<ColM, RowM>(kC, sw, kC, Pd, kLd64, Qs + d0, ldk, F2, kLd64, true);  // + dP^T Q
    __syncthreads();
    float* out = dkh + (t0 * d.Hv + h) * d.dk + d0;  // [L, sw] at stride ldh
    for (int p = tid; p < L * sw; p += kChunkThreads) {
      const int i = p / sw, e = p % sw;
      if (d0 + e < d.dk) out[i * ldh + e] = F2[i * kLd64 + e];
    }
    __syncthreads();
  }
  const float dg_all = block_sum_to_0(dg_all_part, red);
  if (tid == 0) red[0] = G[L - 1] * dg_all;
  if (tid == L - 1) phi[tid] = 0.f;  // dec_{L-1} = 1 carries no gate
  __syncthreads();
  if (tid < L)
    dgp[(t0 + tid) * d.Hv + h] = suffix_plus_prefix(dgam, phi, tid, L) + pair[tid] + red[0];
}

// --- wy: the WY factors and the UT inverse ------------------------------------------------------
size_t wy_smem(int KP, int VP) {
  return 2 * tile_bytes_bf16(kC, KP) + 2 * tile_bytes_bf16(kC, VP) + 2 * tile_bytes_bf16(kC, kC) +
         4 * tile_bytes_f32(kC, kC) + 12 * kVecBytes;
}

__global__ void __launch_bounds__(kChunkThreads)
    gdr_bwd_wy_kernel(Dims d, IndexView ix,
                      const bf16_t* __restrict__ kn,   // [T, Hk, dk]
                      const bf16_t* __restrict__ v,    // [T, Hv, dv]
                      const bf16_t* __restrict__ dvp,  // [T, Hv, dv] dV'
                      const bf16_t* __restrict__ H,    // [nt_max, Hv, dk, dv]
                      const float* __restrict__ g,     // [T, Hv]
                      const float* __restrict__ beta,  // [T, Hv]
                      const float* __restrict__ dgp,   // [T, Hv] dg partial of dqk
                      float* __restrict__ dkh,         // [T, Hv, dk] += here
                      bf16_t* __restrict__ dv,         // [T, Hv, dv]
                      float* __restrict__ dg,          // [T, Hv]
                      float* __restrict__ dbeta) {     // [T, Hv]
  const int c = static_cast<int>(blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x);
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP);
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));   // [64, KP] K
  bf16_t* dWb = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));  // [64, KP] dW
  bf16_t* dVs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));  // [64, VP] dV'
  bf16_t* X2 = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));   // [64, VP] H_c rows, then V
  bf16_t* Tb = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));     // [64, 64] bf16(T)
  bf16_t* dKKb = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));   // [64, 64] d(K K^T), strictly lower
  float* KK = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64] K K^T
  float* Tm = sc.take<float>(tile_bytes_f32(kC, kC));        // [64, 64] T
  float* F3 = sc.take<float>(tile_bytes_f32(kC, kC));        // M, slabs, dT, dM, pair terms
  float* F4 = sc.take<float>(tile_bytes_f32(kC, kC));        // slabs, dT parts, (gd KK)
  float* gs = sc.vec();
  float* bs = sc.vec();
  float* pre = sc.vec();
  float* tot = sc.vec();
  float* G = sc.vec();
  float* dec = sc.vec();
  float* db1 = sc.vec();   // [64] v_i . (T^T dV')_i
  float* kt = sc.vec();    // [64] k_i . (T^T dW)_i
  float* dbM = sc.vec();   // [64] sum_j dM_ij D_ij KK_ij
  float* pair = sc.vec();  // [64] pair sums of the M terms
  float* dgB = sc.vec();   // [64] beta_i G_i kt_i
  float* spare = sc.vec();
  (void)spare;
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldV = static_cast<int64_t>(d.Hv) * d.dv;
  const int64_t ldh = static_cast<int64_t>(d.Hv) * d.dk, sd = static_cast<int64_t>(d.dk) * d.dv;
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, d.vec);
  stage_tile(dVs, ldv, dvp + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, d.vec);
  if (tid < kC) {
    gs[tid] = tid < L ? g[(t0 + tid) * d.Hv + h] : 0.f;
    bs[tid] = tid < L ? beta[(t0 + tid) * d.Hv + h] : 0.f;
    db1[tid] = 0.f;
    kt[tid] = 0.f;
  }
  for (int p = tid; p < kC * kLd64; p += kChunkThreads) {
    F3[p] = 0.f;
    dKKb[p] = bf16_zero();
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  chunk_gate_sums(gs, L, pre, tot, G, dec);
  mma_bf16<RowM, ColM>(kC, kC, d.KP, Ks, ldk, Ks, ldk, KK, kLd64, false);  // K K^T
  __syncthreads();
  for_each_gate(gs, pre, tot, L, [&](int i, int j, float dd) {
    if (j < i) F3[i * kLd64 + j] = bs[i] * dd * KK[i * kLd64 + j];
  });
  __syncthreads();
  unit_lower_inverse(F3, Tm);
  __syncthreads();
  for (int p = tid; p < kC * kC; p += kChunkThreads) {
    const int i = p / kC, j = p % kC;
    Tb[i * kLd64 + j] = tobf(Tm[i * kLd64 + j]);
  }
  // dW = -dV' H_c^T, in slabs of 64 key columns.
  const bf16_t* Hc = H + (static_cast<int64_t>(c) * d.Hv + h) * sd;  // [dk, dv]
  for (int d0 = 0; d0 < d.KP; d0 += kC) {
    const int sw = min(kC, d.KP - d0);
    load_tile(X2, ldv, Hc + static_cast<int64_t>(d0) * d.dv, static_cast<int64_t>(d.dv),
              max(0, min(sw, d.dk - d0)), d.dv, sw, d.VP, d.vec);
    mma_bf16<RowM, ColM>(kC, sw, d.VP, dVs, ldv, X2, ldv, F3, kLd64, false);
    __syncthreads();
    for (int p = tid; p < kC * sw; p += kChunkThreads) {
      const int i = p / sw, e = p % sw;
      dWb[i * ldk + d0 + e] = tobf(-F3[i * kLd64 + e]);
    }
    __syncthreads();
  }
  load_tile(X2, ldv, v + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, d.vec);
  // dT = (dV' V^T) diag(beta) + (dW K^T) diag(beta G), kept strictly lower.
  mma_bf16<RowM, ColM>(kC, kC, d.VP, dVs, ldv, X2, ldv, F3, kLd64, false);
  mma_bf16<RowM, ColM>(kC, kC, d.KP, dWb, ldk, Ks, ldk, F4, kLd64, false);
  __syncthreads();
  for (int p = tid; p < kC * kC; p += kChunkThreads) {
    const int i = p / kC, j = p % kC;
    F3[i * kLd64 + j] = j < i ? bs[j] * F3[i * kLd64 + j] + bs[j] * G[j] * F4[i * kLd64 + j] : 0.f;
  }
  __syncthreads();
  const int qr = tid >> 2, qq = tid & 3;
  // dv = diag(beta) T^T dV'; dbeta += v . T^T dV'.
  for (int e0 = 0; e0 < d.VP; e0 += kC) {
    const int sw = min(kC, d.VP - e0);
    mma_bf16<ColM, RowM>(kC, sw, kC, Tb, kLd64, dVs + e0, ldv, F4, kLd64, false);
    __syncthreads();
    float part = 0.f;
    bf16_t* out = dv + (t0 * d.Hv + h) * d.dv + e0;  // [L, sw] at stride ldV
    for (int e = qq * 16; e < qq * 16 + 16 && e < sw; ++e) {
      const float t = F4[qr * kLd64 + e];
      part += bf(X2[qr * ldv + e0 + e]) * t;
      if (qr < L && e0 + e < d.dv) out[qr * ldV + e] = tobf(bs[qr] * t);
    }
    part = quad_sum(part);
    if (qq == 0) db1[qr] += part;
    __syncthreads();
  }
  // dM = -T^T tril_{-1}(dT) T^T (fp32 operands through tf32).
  mma_tf32<RowM, ColM>(kC, kC, kC, F3, kLd64, Tm, kLd64, F4, kLd64);  // dT T^T
  __syncthreads();
  mma_tf32<ColM, RowM>(kC, kC, kC, Tm, kLd64, F4, kLd64, F3, kLd64);  // T^T (dT T^T)
  __syncthreads();
  // M_ij = beta_i D_ij KK_ij (j < i): gd = dM_ij D_ij is the gradient of beta_i KK_ij.
  for_each_gate(gs, pre, tot, L, [&](int i, int j, float dd) {
    if (j >= i) return;
    const float gd = -F3[i * kLd64 + j] * dd, kk = KK[i * kLd64 + j];
    const float x = bs[i] * gd;  // d(K K^T)_ij
    F4[i * kLd64 + j] = gd * kk;
    F3[i * kLd64 + j] = x * kk;  // = dM_ij M_ij, the pair term
    dKKb[i * kLd64 + j] = tobf(x);
  });
  __syncthreads();
  if (tid < L) {
    float s = 0.f;
    for (int j = 0; j < tid; ++j) s += F4[tid * kLd64 + j];
    dbM[tid] = s;
  }
  pair_row_prefix(F3, kLd64, L);
  __syncthreads();
  if (tid < kC) pair[tid] = pair_column_sum(F3, kLd64, L, tid);
  // dK_b + dK_c = diag(beta G) T^T dW + dKK K + dKK^T K, added onto dk_h of dqk.
  for (int d0 = 0; d0 < d.KP; d0 += kC) {
    const int sw = min(kC, d.KP - d0);
    mma_bf16<ColM, RowM>(kC, sw, kC, Tb, kLd64, dWb + d0, ldk, F4, kLd64, false);  // T^T dW
    __syncthreads();
    {
      float part = 0.f;
      const float bg = bs[qr] * G[qr];
      for (int e = qq * 16; e < qq * 16 + 16 && e < sw; ++e) {
        const float t = F4[qr * kLd64 + e];
        part += bf(Ks[qr * ldk + d0 + e]) * t;
        F4[qr * kLd64 + e] = bg * t;
      }
      part = quad_sum(part);
      if (qq == 0) kt[qr] += part;
    }
    __syncthreads();
    mma_bf16<RowM, RowM>(kC, sw, kC, dKKb, kLd64, Ks + d0, ldk, F4, kLd64, true);  // + dKK K
    mma_bf16<ColM, RowM>(kC, sw, kC, dKKb, kLd64, Ks + d0, ldk, F4, kLd64, true);  // + dKK^T K
    __syncthreads();
    float* out = dkh + (t0 * d.Hv + h) * d.dk + d0;  // [L, sw] at stride ldh
    for (int p = tid; p < L * sw; p += kChunkThreads) {
      const int i = p / sw, e = p % sw;
      if (d0 + e < d.dk) out[i * ldh + e] += F4[i * kLd64 + e];
    }
    __syncthreads();
  }
  if (tid < kC) dgB[tid] = bs[tid] * G[tid] * kt[tid];
  __syncthreads();
  if (tid < L) {
    const int64_t o = (t0 + tid) * d.Hv + h;
    dbeta[o] = db1[tid] + G[tid] * kt[tid] + dbM[tid];
    dg[o] = dgp[o] + suffix_plus_prefix(dgB, nullptr, tid, L) + pair[tid];
  }
}

// --- reduce over the value heads of each key head, then the l2norm backward ---------------------
__global__ void __launch_bounds__(kReduceThreads)
    gdr_reduce_qk_kernel(Dims d,
                         const bf16_t* __restrict__ q,   // [T, Hk, dk]
                         const bf16_t* __restrict__ k,   // [T, Hk, dk]
                         const float* __restrict__ dqh,  // [T, Hv, dk]
                         const float* __restrict__ dkh,  // [T, Hv, dk]
                         bf16_t* __restrict__ dq,        // [T, Hk, dk]
                         bf16_t* __restrict__ dk) {      // [T, Hk, dk]
  const int64_t rows = static_cast<int64_t>(d.T) * d.Hk;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kReduceThreads + threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (w >= 2 * rows) return;  // whole warps
  const bool is_k = w >= rows;
  const int64_t row = is_k ? w - rows : w;  // (t, kh) = (row / Hk, row % Hk)
  const int64_t t = row / d.Hk, kh = row % d.Hk;
  const float* src = (is_k ? dkh : dqh) + (t * d.Hv + kh * d.r) * d.dk;  // [r, dk]
  float acc[8], x[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int col = lane + 32 * e;
    acc[e] = 0.f;
    x[e] = 0.f;
    if (col < d.dk) {
      for (int j = 0; j < d.r; ++j) acc[e] += src[static_cast<int64_t>(j) * d.dk + col];
      x[e] = bf((is_k ? k : q)[row * d.dk + col]);
    }
  }
  if (d.l2norm) warp_l2norm_bwd(acc, x);
  bf16_t* out = (is_k ? dk : dq) + row * d.dk;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int col = lane + 32 * e;
    if (col < d.dk) out[col] = tobf(acc[e]);
  }
}

template <int VB>
void launch_state_bwd_vb(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                         const bf16_t* W, const bf16_t* dout, const float* dvloc, const float* g,
                         const float* dhT, bf16_t* dvp, bf16_t* dH, float* dh0, cudaStream_t s) {
  const auto* kernel = reinterpret_cast<const void*>(&gdr_state_bwd_kernel<VB>);
  const size_t optin = cuda::Context::get().props().sharedMemPerBlockOptin;
  const int nbuf = state_bwd_smem<VB>(d.KP, 2) <= optin ? 2 : 1;
  const size_t smem = state_bwd_smem<VB>(d.KP, nbuf);
  allow_smem(kernel, smem, "gdr_state_bwd_kernel", d.dk, d.dv);
  const int nvb = (d.VP + VB - 1) / VB;
  const dim3 grid(grid_x(static_cast<int64_t>(d.N) * nvb, "gdr_state_bwd_kernel"),
                  static_cast<unsigned>(d.Hv));
  gdr_state_bwd_kernel<VB>
      <<<grid, kStateThreads, smem, s>>>(d, ix, nbuf, qn, kn, W, dout, dvloc, g, dhT, dvp, dH, dh0);
  GDN_CUDA_LAUNCH_CHECK("gdr_state_bwd_kernel");
}

}  // namespace

void launch_dvloc(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                  const bf16_t* dout, const float* g, float* dvloc, cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = dvloc_smem(d.KP);
  allow_smem(reinterpret_cast<const void*>(&gdr_dvloc_kernel), smem, "gdr_dvloc_kernel", d.dk,
             d.dv);
  const int nvb = (d.VP + kC - 1) / kC;
  const dim3 grid(grid_x(d.nt_max * nvb, "gdr_dvloc_kernel"), static_cast<unsigned>(d.Hv));
  gdr_dvloc_kernel<<<grid, kChunkThreads, smem, s>>>(d, ix, nvb, qn, kn, dout, g, dvloc);
  GDN_CUDA_LAUNCH_CHECK("gdr_dvloc_kernel");
}

void launch_state_bwd(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                      const bf16_t* W, const bf16_t* dout, const float* dvloc, const float* g,
                      const float* dhT, bf16_t* dvp, bf16_t* dH, float* dh0, cudaStream_t s) {
  const int64_t blocks32 = static_cast<int64_t>(d.N) * d.Hv * ((d.VP + 31) / 32);
  if (blocks32 < 2 * cuda::Context::get().sm_count())
    launch_state_bwd_vb<16>(d, ix, qn, kn, W, dout, dvloc, g, dhT, dvp, dH, dh0, s);
  else
    launch_state_bwd_vb<32>(d, ix, qn, kn, W, dout, dvloc, g, dhT, dvp, dH, dh0, s);
}

void launch_bwd_dqk(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                    const bf16_t* vnew, const bf16_t* dout, const bf16_t* H, const bf16_t* dH,
                    const float* g, float* dqh, float* dkh, float* dgp, cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = dqk_smem(d.KP, d.VP);
  allow_smem(reinterpret_cast<const void*>(&gdr_bwd_dqk_kernel), smem, "gdr_bwd_dqk_kernel", d.dk,
             d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_bwd_dqk_kernel"), static_cast<unsigned>(d.Hv));
  gdr_bwd_dqk_kernel<<<grid, kChunkThreads, smem, s>>>(d, ix, qn, kn, vnew, dout, H, dH, g, dqh,
                                                       dkh, dgp);
  GDN_CUDA_LAUNCH_CHECK("gdr_bwd_dqk_kernel");
}

void launch_bwd_wy(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
                   const bf16_t* dvp, const bf16_t* H, const float* g, const float* beta,
                   const float* dgp, float* dkh, bf16_t* dv, float* dg, float* dbeta,
                   cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = wy_smem(d.KP, d.VP);
  allow_smem(reinterpret_cast<const void*>(&gdr_bwd_wy_kernel), smem, "gdr_bwd_wy_kernel", d.dk,
             d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_bwd_wy_kernel"), static_cast<unsigned>(d.Hv));
  gdr_bwd_wy_kernel<<<grid, kChunkThreads, smem, s>>>(d, ix, kn, v, dvp, H, g, beta, dgp, dkh, dv,
                                                      dg, dbeta);
  GDN_CUDA_LAUNCH_CHECK("gdr_bwd_wy_kernel");
}

void launch_reduce_qk(const Dims& d, const bf16_t* q, const bf16_t* k, const float* dqh,
                      const float* dkh, bf16_t* dq, bf16_t* dk, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(d.T) * d.Hk;
  if (rows == 0) return;
  const int64_t blocks = (2 * rows * 32 + kReduceThreads - 1) / kReduceThreads;
  gdr_reduce_qk_kernel<<<grid_x(blocks, "gdr_reduce_qk_kernel"), kReduceThreads, 0, s>>>(
      d, q, k, dqh, dkh, dq, dk);
  GDN_CUDA_LAUNCH_CHECK("gdr_reduce_qk_kernel");
}

}  // namespace gdn::ops::gdr
