// Gated attention on CUDA, the attention backward (FlashAttention-2, Dao 2023, Algorithm 2, split
// in two kernels so that every output row is written by exactly one block and no float atomics
// are needed): the dk/dv kernel walks the query tiles of every query head of its kv group for one
// key tile, the dq kernel walks the key tiles for one query tile. Both recompute the probabilities
// P = exp(s − lse) from q_hat, k_hat and the saved lse. See cuda.cu for the design.
#pragma once

#include "ops/gated_attention/cuda_common.cuh"

namespace gdn::ops::attn {

// dq kernel: one block per (document, kBigTile query rows, query head); warp w owns query rows
// 16w .. 16w+15 and the fp32 dQ accumulator of those rows. Shared memory: Q, dA [BM][LD] once,
// K and V [2][BN][LD] double-buffered. Per key tile:
//   S = Q Kᵀ, P = 2^(S·scale·log2e − lse·log2e) (masked), dP = dA Vᵀ, dS = P ⊙ (dP − D),
//   dQ += dS K (dS rounded to bf16 and fed from the accumulators as the A operand, as P in the
//   forward). dq_hat = scale · dQ goes to the fp32 scratch for the epilogue.
// Rows past the document's end have lse = +inf and D = 0 (so P = dS = 0) and are not written.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_dq_kernel(const BwdParams p) {
  constexpr int BM = kBigTile, BN = dq_keys<HD>(), LD = ld_of<HD>();
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem());  // [BM][LD]
  bf16_t* sA = sQ + BM * LD;                           // [BM][LD] dA
  bf16_t* sK = sA + BM * LD;                           // [2][BN][LD]
  bf16_t* sV = sK + 2 * BN * LD;                       // [2][BN][LD]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  QueryTile qt;  // block -> (query head, tile), longest tiles first
  if (!query_tile<BM, BN>(p, qt)) return;
  const int h = qt.h, j = qt.j, q0 = qt.q0, q_end = qt.q_end, nk = qt.nk;
  const Doc d = qt.d;

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const size_t lda = static_cast<size_t>(p.Hq) * p.a_stride;      // row stride of dA
  const bf16_t* gQ = p.q_hat + static_cast<size_t>(h) * p.hd;     // row t at + t·ldq
  const bf16_t* gA = p.dA + static_cast<size_t>(h) * p.a_stride;  // row t at + t·lda
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  load_tile_async<BM, HD>(sQ, gQ + q0 * ldq, ldq, q_end - q0, p.hd, tid);
  load_tile_async<BM, HD>(sA, gA + q0 * lda, lda, q_end - q0, p.hd, tid);
  load_tile_async<BN, HD>(sK, gK + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  load_tile_async<BN, HD>(sV, gV + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int t0 = q0 + warp * 16 + g, t1 = t0 + 8;
  float lse2[2], Dr[2];  // lse in base-2 units and D of rows t0, t1
  dq_row_stats(p, t0, t1, q0, q_end, h, lse2, Dr);
  float acc[HD / 8][4];  // dQ
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  for (int jt = 0; jt < nk; ++jt) {
    const int buf = jt & 1;
    if (jt > 0) __syncthreads();
    if (jt + 1 < nk) {
      const int k1 = d.b + (jt + 1) * BN;
      const int rows = imin(BN, q_end - k1);
      load_tile_async<BN, HD>(sK + (buf ^ 1) * BN * LD, gK + k1 * ldkv, ldkv, rows, p.hd, tid);
      load_tile_async<BN, HD>(sV + (buf ^ 1) * BN * LD, gV + k1 * ldkv, ldkv, rows, p.hd, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* K = sK + buf * BN * LD;
    const bf16_t* V = sV + buf * BN * LD;
    const int k0 = d.b + jt * BN;

    // S = Q Kᵀ and dP = dA Vᵀ
    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t aq[4], aa[4];
      ldsm_x4(aq, sQ + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      ldsm_x4(aa, sA + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        const int off =
            (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t bk[4], bv[4];
        ldsm_x4(bk, K + off);
        mma_bf16(s[2 * np], aq, bk[0], bk[1]);
        mma_bf16(s[2 * np + 1], aq, bk[2], bk[3]);
        ldsm_x4(bv, V + off);
        mma_bf16(dp[2 * np], aa, bv[0], bv[1]);
        mma_bf16(dp[2 * np + 1], aa, bv[2], bv[3]);
      }
    }

    // P and dS = P ⊙ (dP − D), in place of s.
    const bool diag = k0 + BN - 1 > q0;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * p.scale_log2 - lse2[e >> 1];
        const int u = k0 + nt * 8 + 2 * c + (e & 1);
        if (diag && u > (e < 2 ? t0 : t1)) x = -INFINITY;
        s[nt][e] = ex2(x) * (dp[nt][e] - Dr[e >> 1]);
      }

      // dQ += dS K
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      const uint32_t a[4] = {pack_bf16x2(s[2 * ks][0], s[2 * ks][1]),
                             pack_bf16x2(s[2 * ks][2], s[2 * ks][3]),
                             pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        uint32_t b[4];
        ldsm_x4_trans(
            b, K + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + np * 16 + (lane >> 4) * 8);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }

  dq_epilogue<HD>(
      p, [&](int nt, int e) { return acc[nt][e]; }, t0, t1, q_end, h, c);
}

// dk/dv kernel: one block per (document, kSmallTile keys, kv head). It walks items (query head h
// of the group, query tile m) for every m whose queries can see the key tile, double-buffering
// Q, dA, lse and D of the next item. Per item, in two phases (FlashAttention-2 stages P and dS
// through shared memory the same way: flash-attention csrc/flash_attn/src/flash_bwd_kernel.h):
//   phase 1, warp w = (key slab w % 4 of 16 keys) x (query half w / 4 of 32 queries):
//     Sᵀ = K Qᵀ, dPᵀ = V dAᵀ; Pᵀ = 2^(Sᵀ·scale·log2e − lse·log2e) (masked), dSᵀ = Pᵀ ⊙ (dPᵀ − D);
//     both rounded to bf16 into shared sP, sdS [keys][queries];
//   phase 2, warp w = (key slab w % 4) x (head-dim half w / 4):
//     dV += Pᵀ dA, dK += dSᵀ Q (fp32 accumulators: 16 keys x HD/2 each per warp).
// Epilogue: dv (bf16) and dk_hat = scale · dK (fp32 scratch) for the keys inside the document.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_dkdv_kernel(const BwdParams p) {
  constexpr int BN = kSmallTile, BM = kSmallTile, LD = ld_of<HD>(), HH = HD / 2;
  bf16_t* sK = reinterpret_cast<bf16_t*>(dyn_smem());    // [BN][LD]
  bf16_t* sV = sK + BN * LD;                             // [BN][LD]
  bf16_t* sQ = sV + BN * LD;                             // [2][BM][LD]
  bf16_t* sA = sQ + 2 * BM * LD;                         // [2][BM][LD] dA
  bf16_t* sP = sA + 2 * BM * LD;                         // [BN][kLdP] Pᵀ
  bf16_t* sS = sP + BN * kLdP;                           // [BN][kLdP] dSᵀ
  float* sL = reinterpret_cast<float*>(sS + BN * kLdP);  // [2][BM] lse · log2e
  float* sD = sL + 2 * BM;                               // [2][BM] D

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  KeyTile kt;  // block -> (kv head, key tile)
  if (!key_tile<BM, BN>(p, kt)) return;
  const int j = kt.j, k0 = kt.k0, k_end = kt.k_end, m_first = kt.m_first, n_m = kt.n_m,
            n_items = kt.n_items;
  const Doc d = kt.d;

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const size_t lda = static_cast<size_t>(p.Hq) * p.a_stride;
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  // Item it: query head h = j·group + it / n_m, query tile m = m_first + it % n_m.
  auto load_item = [&](int it, int b) {
    const int h = j * p.group + it / n_m;
    const int qs = d.b + (m_first + it % n_m) * BM, rows = imin(BM, d.e - qs);
    load_tile_async<BM, HD>(sQ + b * BM * LD, p.q_hat + static_cast<size_t>(h) * p.hd + qs * ldq,
                            ldq, rows, p.hd, tid);
    load_tile_async<BM, HD>(sA + b * BM * LD, p.dA + static_cast<size_t>(h) * p.a_stride + qs * lda,
                            lda, rows, p.hd, tid);
    if (tid < BM) {
      const bool ok = tid < rows;
      const size_t row = static_cast<size_t>(qs + (ok ? tid : 0)) * p.Hq + h;
      sL[b * BM + tid] = ok ? p.lse[row] * kLog2e : INFINITY;
      sD[b * BM + tid] = ok ? p.D[row] : 0.f;
    }
  };
  load_tile_async<BN, HD>(sK, gK + k0 * ldkv, ldkv, k_end - k0, p.hd, tid);
  load_tile_async<BN, HD>(sV, gV + k0 * ldkv, ldkv, k_end - k0, p.hd, tid);
  load_item(0, 0);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int slab = warp & 3;    // 16 keys: rows slab·16 .. of the key tile (both phases)
  const int qhalf = warp >> 2;  // phase 1: queries qhalf·32 .. of the query tile
  const int dhalf = warp >> 2;  // phase 2: head-dim columns dhalf·HH ..
  const int u0 = k0 + slab * 16 + g, u1 = u0 + 8;  // this thread's keys (C-layout rows)
  float dv[HH / 8][4], dk[HH / 8][4];
#pragma unroll
  for (int i = 0; i < HH / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.f;

  for (int it = 0; it < n_items; ++it) {
    const int buf = it & 1;
    if (it > 0) __syncthreads();  // every warp is done with item it-1 (buffers, sP, sdS)
    if (it + 1 < n_items) {
      load_item(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* Q = sQ + buf * BM * LD;
    const bf16_t* A = sA + buf * BM * LD;
    const float* L = sL + buf * BM;
    const float* Dv = sD + buf * BM;
    const int qs = d.b + (m_first + it % n_m) * BM;

    // Phase 1: Sᵀ = K Qᵀ, dPᵀ = V dAᵀ for 16 keys x 32 queries.
    float st[4][4], dpt[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t ak[4], av[4];
      ldsm_x4(ak, sK + (slab * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      ldsm_x4(av, sV + (slab * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int off = (qhalf * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                        ((lane >> 3) & 1) * 8;
        uint32_t bq[4], ba[4];
        ldsm_x4(bq, Q + off);
        mma_bf16(st[2 * np], ak, bq[0], bq[1]);
        mma_bf16(st[2 * np + 1], ak, bq[2], bq[3]);
        ldsm_x4(ba, A + off);
        mma_bf16(dpt[2 * np], av, ba[0], ba[1]);
        mma_bf16(dpt[2 * np + 1], av, ba[2], ba[3]);
      }
    }
    const bool diag = k0 + BN - 1 > qs;  // some key of the tile lies after some query
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int qc = qhalf * 32 + nt * 8 + 2 * c;  // query column of e = 0, 2 (e = 1, 3: +1)
      float pv[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = qc + (e & 1);
        float x = st[nt][e] * p.scale_log2 - L[q];
        if (diag && (e < 2 ? u0 : u1) > qs + q) x = -INFINITY;
        pv[e] = ex2(x);
        ds[e] = pv[e] * (dpt[nt][e] - Dv[q]);
      }
      const int rk = slab * 16 + g;  // key row in the tile
      *reinterpret_cast<uint32_t*>(sP + rk * kLdP + qc) = pack_bf16x2(pv[0], pv[1]);
      *reinterpret_cast<uint32_t*>(sP + (rk + 8) * kLdP + qc) = pack_bf16x2(pv[2], pv[3]);
      *reinterpret_cast<uint32_t*>(sS + rk * kLdP + qc) = pack_bf16x2(ds[0], ds[1]);
      *reinterpret_cast<uint32_t*>(sS + (rk + 8) * kLdP + qc) = pack_bf16x2(ds[2], ds[3]);
    }
    __syncthreads();

    // Phase 2: dV += Pᵀ dA, dK += dSᵀ Q over the tile's BM queries, head-dim half dhalf.
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      uint32_t ap[4], as[4];
      ldsm_x4(ap, sP + (slab * 16 + (lane & 15)) * kLdP + kq * 16 + (lane >> 4) * 8);
      ldsm_x4(as, sS + (slab * 16 + (lane & 15)) * kLdP + kq * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < HH / 16; ++np) {
        const int off = (kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dhalf * HH + np * 16 +
                        (lane >> 4) * 8;
        uint32_t ba[4], bq[4];
        ldsm_x4_trans(ba, A + off);
        mma_bf16(dv[2 * np], ap, ba[0], ba[1]);
        mma_bf16(dv[2 * np + 1], ap, ba[2], ba[3]);
        ldsm_x4_trans(bq, Q + off);
        mma_bf16(dk[2 * np], as, bq[0], bq[1]);
        mma_bf16(dk[2 * np + 1], as, bq[2], bq[3]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int u = r == 0 ? u0 : u1;
    if (u >= k_end) continue;
    const size_t row = static_cast<size_t>(u) * p.Hkv + j;
    bf16_t* dvr = p.dv + row * p.hd;     // [hd]
    float* dkr = p.dk_hat + row * p.hd;  // [hd]
#pragma unroll
    for (int nt = 0; nt < HH / 8; ++nt) {
      const int col = dhalf * HH + nt * 8 + 2 * c;
      if (col < p.hd) {
        *reinterpret_cast<uint32_t*>(dvr + col) = pack_bf16x2(dv[nt][2 * r], dv[nt][2 * r + 1]);
        *reinterpret_cast<float2*>(dkr + col) =
            make_float2(dk[nt][2 * r] * p.scale, dk[nt][2 * r + 1] * p.scale);
      }
    }
  }
}

}  // namespace gdn::ops::attn
