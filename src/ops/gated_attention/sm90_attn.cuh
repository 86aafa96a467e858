// Gated attention on Hopper: the three attention kernels of cuda_fwd.cuh and cuda_bwd.cuh with
// their tile products on warpgroup MMAs (wgmma, sm_90a) instead of mma.sync. Same blocks, tiles,
// masking, online softmax, pipelining and outputs; the two warpgroups of a block take 64 rows each
// (warp w still owns rows 16w .. 16w+15, the accumulator layout per warp is mma.sync's), operands
// come straight from shared memory in the chunk-row layout of sm90_wgmma.cuh, and P / dS go to the
// next product from registers. See cuda.cu for the design.
#pragma once

#include "ops/gated_attention/cuda_common.cuh"
#include "ops/gated_attention/sm90_wgmma.cuh"

namespace gdn::ops::attn {

template <int HD>
constexpr size_t fwd_sm90_smem_bytes() {  // Q [BM x HD], K and V [2][BN x HD]
  return sizeof(bf16_t) * HD * (kBigTile + 4 * kFwdKeys);
}
template <int HD>
constexpr size_t dq_sm90_smem_bytes() {  // Q, dA [BM x HD], K and V [2][BN x HD]
  return sizeof(bf16_t) * HD * (2 * kBigTile + 4 * dq_keys<HD>());
}
template <int HD>
constexpr size_t dkdv_sm90_smem_bytes() {  // K, V; Q, dA [2]; Pᵀ, dSᵀ [64 x 64]; lse, D [2][64]
  return sizeof(bf16_t) * (HD * 6 * kSmallTile + 2 * kSmallTile * kSmallTile) +
         sizeof(float) * 4 * kSmallTile;
}
static_assert(fwd_sm90_smem_bytes<256>() <= 227 * 1024 && dq_sm90_smem_bytes<256>() <= 227 * 1024 &&
                  dkdv_sm90_smem_bytes<256>() <= 227 * 1024,
              "a kernel's shared memory exceeds the 227 KiB an sm_90 block may have");

// Forward (cuda_fwd.cuh's attn_fwd_kernel on wgmma). Per key tile and warpgroup:
// S = Q Kᵀ: HD/16 SS steps m64n64k16 (Q, K K-major); O += P V: BN/16 RS steps m64nHDk16 (V
// MN-major).
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_fwd_sm90_kernel(const FwdParams p) {
  constexpr int BM = kBigTile, BN = kFwdKeys;
  constexpr uint32_t ROWB = 16 * HD;                   // bytes per 8 rows of a tile
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem());  // [BM x HD] chunk-row
  bf16_t* sK = sQ + BM * HD;                           // [2][BN x HD]
  bf16_t* sV = sK + 2 * BN * HD;                       // [2][BN x HD]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int h = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hq));
  const int rev = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hq));
  const int total = p.ts[p.N];
  if (rev >= total) return;
  const int tile = total - 1 - rev;
  const int n = find_doc(p.ts, p.N, tile);
  const Doc d = doc_bounds(p.cu, n, p.T);
  const int64_t q0l = d.b + static_cast<int64_t>(tile - p.ts[n]) * BM;
  if (q0l >= d.e) return;
  const int q0 = static_cast<int>(q0l), q_end = imin(q0 + BM, d.e);
  const int j = h / p.group;
  const int nk = (q_end - d.b + BN - 1) / BN;

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const bf16_t* gQ = p.q_hat + static_cast<size_t>(h) * p.hd;
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  load_tile_cr<BM, HD>(sQ, gQ + q0 * ldq, ldq, q_end - q0, p.hd, tid);
  load_tile_cr<BN, HD>(sK, gK + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  load_tile_cr<BN, HD>(sV, gV + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int t0 = q0 + warp * 16 + g, t1 = t0 + 8;
  const unsigned char* qrows =  // this warpgroup's 64 query rows
      reinterpret_cast<const unsigned char*>(sQ) + (warp >> 2) * 8 * ROWB;
  float acc[HD / 2];  // O
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int jt = 0; jt < nk; ++jt) {
    const int buf = jt & 1;
    if (jt > 0) __syncthreads();
    if (jt + 1 < nk) {
      const int k1 = d.b + (jt + 1) * BN;
      const int rows = imin(BN, q_end - k1);
      load_tile_cr<BN, HD>(sK + (buf ^ 1) * BN * HD, gK + k1 * ldkv, ldkv, rows, p.hd, tid);
      load_tile_cr<BN, HD>(sV + (buf ^ 1) * BN * HD, gV + k1 * ldkv, ldkv, rows, p.hd, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();
    const unsigned char* K = reinterpret_cast<const unsigned char*>(sK + buf * BN * HD);
    const unsigned char* V = reinterpret_cast<const unsigned char*>(sV + buf * BN * HD);
    const int k0 = d.b + jt * BN;

    float s[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
    reg_fence(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmma_ss<BN, 0>(s, smem_desc(qrows + kk * 256, 128, ROWB), smem_desc(K + kk * 256, 128, ROWB),
                      1);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);

    const bool diag = k0 + BN - 1 > q0;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * nt + e] * p.scale_log2;
        const int u = k0 + nt * 8 + 2 * c + (e & 1);
        if (diag && u > (e < 2 ? t0 : t1)) x = -INFINITY;
        s[4 * nt + e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m_run[r], quad_max(mx[r]));
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = ex2(m_run[r] - base);
      m_run[r] = m_new;
      mx[r] = base;
    }
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const float pv = ex2(s[i] - mx[(i >> 1) & 1]);
      s[i] = pv;
      sum[(i >> 1) & 1] += pv;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + sum[r];
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) acc[i] *= alpha[(i >> 1) & 1];

    uint32_t pa[BN / 16][4];
    acc_to_a<BN>(s, pa);
    reg_fence_u(pa);
    reg_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks)
      wgmma_rs<HD, 1>(acc, pa[ks], smem_desc(V + ks * 2 * ROWB, ROWB, 128), 1);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(acc);
    reg_fence_u(pa);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r == 0 ? t0 : t1;
    const float l = quad_sum(l_run[r]);
    if (t >= q_end) continue;
    const float inv = 1.0f / l;
    const size_t row = static_cast<size_t>(t) * p.Hq + h;
    const bf16_t* gate = p.qg + row * 2 * p.hd + p.hd;  // [hd]
    bf16_t* at = p.attn + row * p.hd;                   // [hd]
    bf16_t* o = p.o + row * p.hd;                       // [hd]
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      const int col = nt * 8 + 2 * c;
      if (col < p.hd) {
        const float a0 = acc[4 * nt + 2 * r] * inv, a1 = acc[4 * nt + 2 * r + 1] * inv;
        const uint32_t gw = *reinterpret_cast<const uint32_t*>(gate + col);
        *reinterpret_cast<uint32_t*>(at + col) = pack_bf16x2(a0, a1);
        *reinterpret_cast<uint32_t*>(o + col) =
            pack_bf16x2(a0 * sigmoidf_(bf16x2_lo(gw)), a1 * sigmoidf_(bf16x2_hi(gw)));
      }
    }
    if (c == 0) p.lse[row] = (m_run[r] + log2f(l)) * kLn2;
  }
}

// dq (cuda_bwd.cuh's attn_bwd_dq_kernel on wgmma). Per key tile and warpgroup: S = Q Kᵀ and
// dP = dA Vᵀ (SS, K-major), dQ += dS K (RS, K MN-major).
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_dq_sm90_kernel(const BwdParams p) {
  constexpr int BM = kBigTile, BN = dq_keys<HD>();
  constexpr uint32_t ROWB = 16 * HD;
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem());  // [BM x HD]
  bf16_t* sA = sQ + BM * HD;                           // [BM x HD] dA
  bf16_t* sK = sA + BM * HD;                           // [2][BN x HD]
  bf16_t* sV = sK + 2 * BN * HD;                       // [2][BN x HD]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int h = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hq));
  const int rev = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hq));
  const int total = p.ts[p.N];
  if (rev >= total) return;
  const int tile = total - 1 - rev;
  const int n = find_doc(p.ts, p.N, tile);
  const Doc d = doc_bounds(p.cu, n, p.T);
  const int64_t q0l = d.b + static_cast<int64_t>(tile - p.ts[n]) * BM;
  if (q0l >= d.e) return;
  const int q0 = static_cast<int>(q0l), q_end = imin(q0 + BM, d.e);
  const int j = h / p.group;
  const int nk = (q_end - d.b + BN - 1) / BN;

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const size_t lda = 2 * ldq;
  const bf16_t* gQ = p.q_hat + static_cast<size_t>(h) * p.hd;
  const bf16_t* gA = p.dA + static_cast<size_t>(h) * 2 * p.hd;
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  load_tile_cr<BM, HD>(sQ, gQ + q0 * ldq, ldq, q_end - q0, p.hd, tid);
  load_tile_cr<BM, HD>(sA, gA + q0 * lda, lda, q_end - q0, p.hd, tid);
  load_tile_cr<BN, HD>(sK, gK + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  load_tile_cr<BN, HD>(sV, gV + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int t0 = q0 + warp * 16 + g, t1 = t0 + 8;
  float lse2[2], Dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r == 0 ? t0 : t1;
    const bool ok = t < q_end;
    const size_t row = static_cast<size_t>(ok ? t : q0) * p.Hq + h;
    lse2[r] = ok ? p.lse[row] * kLog2e : INFINITY;
    Dr[r] = ok ? p.D[row] : 0.f;
  }
  const size_t wg_off = static_cast<size_t>(warp >> 2) * 8 * ROWB;  // this warpgroup's 64 rows
  const unsigned char* qrows = reinterpret_cast<const unsigned char*>(sQ) + wg_off;
  const unsigned char* arows = reinterpret_cast<const unsigned char*>(sA) + wg_off;
  float acc[HD / 2];  // dQ
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;

  for (int jt = 0; jt < nk; ++jt) {
    const int buf = jt & 1;
    if (jt > 0) __syncthreads();
    if (jt + 1 < nk) {
      const int k1 = d.b + (jt + 1) * BN;
      const int rows = imin(BN, q_end - k1);
      load_tile_cr<BN, HD>(sK + (buf ^ 1) * BN * HD, gK + k1 * ldkv, ldkv, rows, p.hd, tid);
      load_tile_cr<BN, HD>(sV + (buf ^ 1) * BN * HD, gV + k1 * ldkv, ldkv, rows, p.hd, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();
    const unsigned char* K = reinterpret_cast<const unsigned char*>(sK + buf * BN * HD);
    const unsigned char* V = reinterpret_cast<const unsigned char*>(sV + buf * BN * HD);
    const int k0 = d.b + jt * BN;

    float s[BN / 2], dp[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.f;
    reg_fence(s);
    reg_fence(dp);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      wgmma_ss<BN, 0>(s, smem_desc(qrows + kk * 256, 128, ROWB), smem_desc(K + kk * 256, 128, ROWB),
                      1);
      wgmma_ss<BN, 0>(dp, smem_desc(arows + kk * 256, 128, ROWB),
                      smem_desc(V + kk * 256, 128, ROWB), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);
    reg_fence(dp);

    const bool diag = k0 + BN - 1 > q0;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * nt + e] * p.scale_log2 - lse2[e >> 1];
        const int u = k0 + nt * 8 + 2 * c + (e & 1);
        if (diag && u > (e < 2 ? t0 : t1)) x = -INFINITY;
        s[4 * nt + e] = ex2(x) * (dp[4 * nt + e] - Dr[e >> 1]);
      }

    uint32_t pa[BN / 16][4];
    acc_to_a<BN>(s, pa);
    reg_fence_u(pa);
    reg_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks)
      wgmma_rs<HD, 1>(acc, pa[ks], smem_desc(K + ks * 2 * ROWB, ROWB, 128), 1);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(acc);
    reg_fence_u(pa);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r == 0 ? t0 : t1;
    if (t >= q_end) continue;
    float* out = p.dq_hat + (static_cast<size_t>(t) * p.Hq + h) * p.hd;  // [hd]
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      const int col = nt * 8 + 2 * c;
      if (col < p.hd)
        *reinterpret_cast<float2*>(out + col) =
            make_float2(acc[4 * nt + 2 * r] * p.scale, acc[4 * nt + 2 * r + 1] * p.scale);
    }
  }
}

// dk/dv (cuda_bwd.cuh's attn_bwd_dkdv_kernel on wgmma). Phase 1, warpgroup w = query half w:
// Sᵀ = K Qᵀ and dPᵀ = V dAᵀ for all 64 keys x 32 queries (SS, K-major), Pᵀ and dSᵀ to shared
// chunk-row tiles [keys x queries]; phase 2, warpgroup w = head-dim half w: dV += Pᵀ dA and
// dK += dSᵀ Q (SS; dA, Q MN-major).
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_dkdv_sm90_kernel(const BwdParams p) {
  constexpr int BN = kSmallTile, BM = kSmallTile, HH = HD / 2;
  constexpr uint32_t ROWB = 16 * HD, ROWB_P = 16 * BM;
  bf16_t* sK = reinterpret_cast<bf16_t*>(dyn_smem());  // [BN x HD]
  bf16_t* sV = sK + BN * HD;                           // [BN x HD]
  bf16_t* sQ = sV + BN * HD;                           // [2][BM x HD]
  bf16_t* sA = sQ + 2 * BM * HD;                       // [2][BM x HD] dA
  bf16_t* sP = sA + 2 * BM * HD;                       // [BN x BM] Pᵀ
  bf16_t* sS = sP + BN * BM;                           // [BN x BM] dSᵀ
  float* sL = reinterpret_cast<float*>(sS + BN * BM);  // [2][BM] lse · log2e
  float* sD = sL + 2 * BM;                             // [2][BM] D

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int j = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hkv));
  const int tile = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hkv));
  const int total = p.ts[p.N];
  if (tile >= total) return;
  const int n = find_doc(p.ts, p.N, tile);
  const Doc d = doc_bounds(p.cu, n, p.T);
  const int64_t k0l = d.b + static_cast<int64_t>(tile - p.ts[n]) * BN;
  if (k0l >= d.e) return;
  const int k0 = static_cast<int>(k0l), k_end = imin(k0 + BN, d.e);
  const int m_first = (k0 - d.b) / BM, n_m = (d.e - d.b + BM - 1) / BM - m_first;
  const int n_items = p.group * n_m;

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const size_t lda = 2 * ldq;
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  auto load_item = [&](int it, int b) {
    const int h = j * p.group + it / n_m;
    const int qs = d.b + (m_first + it % n_m) * BM, rows = imin(BM, d.e - qs);
    load_tile_cr<BM, HD>(sQ + b * BM * HD, p.q_hat + static_cast<size_t>(h) * p.hd + qs * ldq, ldq,
                         rows, p.hd, tid);
    load_tile_cr<BM, HD>(sA + b * BM * HD, p.dA + static_cast<size_t>(h) * 2 * p.hd + qs * lda, lda,
                         rows, p.hd, tid);
    if (tid < BM) {
      const bool ok = tid < rows;
      const size_t row = static_cast<size_t>(qs + (ok ? tid : 0)) * p.Hq + h;
      sL[b * BM + tid] = ok ? p.lse[row] * kLog2e : INFINITY;
      sD[b * BM + tid] = ok ? p.D[row] : 0.f;
    }
  };
  load_tile_cr<BN, HD>(sK, gK + k0 * ldkv, ldkv, k_end - k0, p.hd, tid);
  load_tile_cr<BN, HD>(sV, gV + k0 * ldkv, ldkv, k_end - k0, p.hd, tid);
  load_item(0, 0);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int wg = warp >> 2;  // phase 1: queries wg·32 ..; phase 2: head-dim cols wg·HH ..
  const int kr = (warp & 3) * 16 + g;  // this thread's key rows kr, kr + 8 of the tile
  const int u0 = k0 + kr, u1 = u0 + 8;
  const unsigned char* Kt = reinterpret_cast<const unsigned char*>(sK);
  const unsigned char* Vt = reinterpret_cast<const unsigned char*>(sV);
  float dv[HH / 2], dk[HH / 2];
#pragma unroll
  for (int i = 0; i < HH / 2; ++i) dv[i] = dk[i] = 0.f;

  for (int it = 0; it < n_items; ++it) {
    const int buf = it & 1;
    if (it > 0) __syncthreads();
    if (it + 1 < n_items) {
      load_item(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();
    const unsigned char* Q = reinterpret_cast<const unsigned char*>(sQ + buf * BM * HD);
    const unsigned char* A = reinterpret_cast<const unsigned char*>(sA + buf * BM * HD);
    const float* L = sL + buf * BM;
    const float* Dv = sD + buf * BM;
    const int qs = d.b + (m_first + it % n_m) * BM;

    // Phase 1: Sᵀ, dPᵀ for 64 keys x queries wg·32 .. wg·32+31.
    float st[16], dpt[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) st[i] = dpt[i] = 0.f;
    reg_fence(st);
    reg_fence(dpt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      wgmma_ss<32, 0>(st, smem_desc(Kt + kk * 256, 128, ROWB),
                      smem_desc(Q + wg * 4 * ROWB + kk * 256, 128, ROWB), 1);
      wgmma_ss<32, 0>(dpt, smem_desc(Vt + kk * 256, 128, ROWB),
                      smem_desc(A + wg * 4 * ROWB + kk * 256, 128, ROWB), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(st);
    reg_fence(dpt);
    const bool diag = k0 + BN - 1 > qs;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int qc = wg * 32 + nt * 8 + 2 * c;  // query column of e = 0, 2 (e = 1, 3: +1)
      float pv[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = qc + (e & 1);
        float x = st[4 * nt + e] * p.scale_log2 - L[q];
        if (diag && (e < 2 ? u0 : u1) > qs + q) x = -INFINITY;
        pv[e] = ex2(x);
        ds[e] = pv[e] * (dpt[4 * nt + e] - Dv[q]);
      }
      unsigned char* P = reinterpret_cast<unsigned char*>(sP);
      unsigned char* S = reinterpret_cast<unsigned char*>(sS);
      const uint32_t o0 = cr_off<BM>(kr, qc >> 3) + (qc & 7) * 2;
      const uint32_t o1 = cr_off<BM>(kr + 8, qc >> 3) + (qc & 7) * 2;
      *reinterpret_cast<uint32_t*>(P + o0) = pack_bf16x2(pv[0], pv[1]);
      *reinterpret_cast<uint32_t*>(P + o1) = pack_bf16x2(pv[2], pv[3]);
      *reinterpret_cast<uint32_t*>(S + o0) = pack_bf16x2(ds[0], ds[1]);
      *reinterpret_cast<uint32_t*>(S + o1) = pack_bf16x2(ds[2], ds[3]);
    }
    fence_proxy_async();
    __syncthreads();

    // Phase 2: dV += Pᵀ dA, dK += dSᵀ Q over the tile's BM queries, head-dim half wg.
    const unsigned char* P = reinterpret_cast<const unsigned char*>(sP);
    const unsigned char* S = reinterpret_cast<const unsigned char*>(sS);
    reg_fence(dv);
    reg_fence(dk);
    wgmma_fence();
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      const uint32_t boff = kq * 2 * ROWB + wg * (HH / 8) * 128;
      wgmma_ss<HH, 1>(dv, smem_desc(P + kq * 256, 128, ROWB_P), smem_desc(A + boff, ROWB, 128), 1);
      wgmma_ss<HH, 1>(dk, smem_desc(S + kq * 256, 128, ROWB_P), smem_desc(Q + boff, ROWB, 128), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(dv);
    reg_fence(dk);
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
      const int col = wg * HH + nt * 8 + 2 * c;
      if (col < p.hd) {
        *reinterpret_cast<uint32_t*>(dvr + col) =
            pack_bf16x2(dv[4 * nt + 2 * r], dv[4 * nt + 2 * r + 1]);
        *reinterpret_cast<float2*>(dkr + col) =
            make_float2(dk[4 * nt + 2 * r] * p.scale, dk[4 * nt + 2 * r + 1] * p.scale);
      }
    }
  }
}

}  // namespace gdn::ops::attn
