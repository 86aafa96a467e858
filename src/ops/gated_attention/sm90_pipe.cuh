// Gated attention on Hopper: the pieces of the warpgroup-MMA (wgmma, sm_90a) attention kernels of
// "cuda.sm90_tma" (sm90_tma.cuh) that do not depend on how the tiles arrive: the shared-memory
// budgets, the forward's online softmax and tile products, the dq tile update and the dk/dv
// products and epilogue. Same block-to-tile maps, masking, online softmax and outputs as the
// mma.sync kernels of cuda_fwd.cuh / cuda_bwd.cuh; operands come straight from shared memory in
// the 128-byte-swizzled layout of sm90_wgmma.cuh, P and dS go to the next product as register A
// operands. Warp w owns rows 16w .. 16w+15 of its warpgroup's 64-row accumulators (the m64nN
// accumulator layout per warp is mma.sync's m16n8 one).
//
//   forward: 128 query rows (64 per warpgroup), 64 keys per step, software-pipelined per
//     warpgroup (FlashAttention-3, Shah et al. 2024, §3.2 "intra-warpgroup overlapping"): while
//     O += P_{j-1} V_{j-1} runs on the tensor cores, the warpgroup does the softmax of S_j.
//   dq: 128 query rows (64 per warpgroup) and 64 keys per step (the mma.sync kernel: 32), S = Q Kᵀ
//     and dP = dA Vᵀ at m64n64.
//   dk/dv: the warpgroups split the products, not the rows: warpgroup 0 computes Sᵀ = K Qᵀ, Pᵀ and
//     dV += Pᵀ dA, warpgroup 1 dPᵀ = V dAᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − D) and dK += dSᵀ Q, each with the
//     full 64 x HD accumulator and Pᵀ / dSᵀ as register A operands; Pᵀ goes to warpgroup 1 in fp32
//     through shared memory in the accumulator's own register order.
// The per-element arithmetic and the order of every accumulation are the mma.sync kernels', and on
// an H200 the outputs are bit-identical to cuda.flash's (bench/cuda_bench_attn_kernels checks it
// at T = 8192). The earlier cp.async versions of these kernels ("cuda.pipe", "cuda.pipe_xi") were
// slower (measured: docs/PERF.md) and are gone.
#pragma once

#include "ops/gated_attention/cuda_common.cuh"
#include "ops/gated_attention/sm90_wgmma.cuh"

namespace gdn::ops::attn {

constexpr int kPipeDqKeys = 64;  // keys per step of the wgmma dq kernel

// Each adds 1024 bytes: the kernels start their tiles on a 1024-byte boundary (dyn_smem_1k).
template <int HD>
constexpr size_t fwd_pipe_smem_bytes() {  // Q [BM x HD], K and V [2][BN x HD]
  return sizeof(bf16_t) * HD * (kBigTile + 4 * kFwdKeys) + 1024;
}
template <int HD>
constexpr size_t dq_pipe_smem_bytes() {  // Q, dA [BM x HD], three K / V slots [BN x HD]
  return sizeof(bf16_t) * HD * (2 * kBigTile + 3 * kPipeDqKeys) + 1024;
}
static_assert(fwd_pipe_smem_bytes<256>() <= 227 * 1024 && dq_pipe_smem_bytes<256>() <= 227 * 1024,
              "a kernel's shared memory exceeds the 227 KiB an sm_90 block may have");

// One key tile of the forward's online softmax (attn_fwd_tma_kernel):
// x holds this thread's scores of the tile (m64nBN C layout: column k0 + 8 nt + 2c + (e & 1), row
// t0 for e < 2, t1 otherwise); they are scaled into the log2 domain, masked causally when the tile
// reaches past the block's first query (diag), and replaced by P = 2^(x - m); the running maxima m
// and sums l move on, and alpha is each row's rescale factor 2^(m_old - m_new) for O.
template <int BN>
__device__ __forceinline__ void online_softmax_tile(float (&x)[BN / 2], float scale_log2, bool diag,
                                                    int k0, int c, int t0, int t1,
                                                    float (&m_run)[2], float (&l_run)[2],
                                                    float (&alpha)[2]) {
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = x[4 * nt + e] * scale_log2;
      const int u = k0 + nt * 8 + 2 * c + (e & 1);
      if (diag && u > (e < 2 ? t0 : t1)) v = -INFINITY;
      x[4 * nt + e] = v;
      mx[e >> 1] = fmaxf(mx[e >> 1], v);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m_run[r], quad_max(mx[r]));
    // A row with no visible key yet keeps m = −inf; exponentiate against 0 then (all terms 0).
    const float base = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = ex2(m_run[r] - base);
    m_run[r] = m_new;
    mx[r] = base;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const float pv = ex2(x[i] - mx[(i >> 1) & 1]);
    x[i] = pv;
    sum[(i >> 1) & 1] += pv;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + sum[r];
}

// Key tile jt of the forward (attn_fwd_tma_kernel): S_jt = Q K_jtᵀ into
// s, then (after the first tile, `pv`) O += P_{jt-1} V_{jt-1} from the A fragments pa, as two
// wgmma groups; returns once S_jt is done, the second group possibly still running.
template <int BN, int HD, class LB, class LN>
__device__ __forceinline__ void fwd_tile_products(float (&s)[BN / 2], float (&acc)[HD / 2],
                                                  uint32_t (&pa)[BN / 16][4],
                                                  const unsigned char* qrows,
                                                  const unsigned char* K, const unsigned char* Vp,
                                                  bool pv) {
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
  uint64_t vdesc[BN / 16];  // formed before the first wgmma of the stage (C7513)
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) vdesc[ks] = LN::desc_mn(Vp) + LN::mn_step(ks);
  reg_fence(s);
  reg_fence_u(pa);
  reg_fence(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    wgmma_ss<BN, 0>(s, LB::desc_k(qrows) + LB::k_step(kk), LN::desc_k(K) + LN::k_step(kk), 1);
  wgmma_commit();
  if (pv) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) wgmma_rs<HD, 1>(acc, pa[ks], vdesc[ks], 1);
    wgmma_commit();
    wgmma_wait<1>();  // S_jt is done; P_{jt-1} V_{jt-1} may still run
  } else {
    wgmma_wait<0>();
  }
}

// acc += P B, P from the A fragments pa (BN columns), B the BN x HD tile at Bp (MN-major), waited
// for before returning: the forwards' last O += P V, the dq kernels' dQ += dS K.
template <int BN, int HD, class LN>
__device__ __forceinline__ void rs_product_wait(float (&acc)[HD / 2], uint32_t (&pa)[BN / 16][4],
                                                const unsigned char* Bp) {
  reg_fence_u(pa);
  reg_fence(acc);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks)
    wgmma_rs<HD, 1>(acc, pa[ks], LN::desc_mn(Bp) + LN::mn_step(ks), 1);
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(acc);
  reg_fence_u(pa);
}

// One key tile of the dq kernel (attn_bwd_dq_tma_kernel), after
// S = Q Kᵀ (s) and dP = dA Vᵀ (dp) are done: P = 2^(S·scale·log2e − lse·log2e) (masked causally
// when the tile reaches past the first query, diag) and dS = P ⊙ (dP − D), in place of s; then
// dQ += dS K into acc, waited for. lse2, Dr: this thread's two rows' lse·log2e and D.
template <int BN, int HD, class LN>
__device__ __forceinline__ void dq_tile_update(float (&s)[BN / 2], const float (&dp)[BN / 2],
                                               float (&acc)[HD / 2], const unsigned char* K,
                                               const float (&lse2)[2], const float (&Dr)[2],
                                               float scale_log2, bool diag, int k0, int c, int t0,
                                               int t1) {
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * nt + e] * scale_log2 - lse2[e >> 1];
      const int u = k0 + nt * 8 + 2 * c + (e & 1);
      if (diag && u > (e < 2 ? t0 : t1)) x = -INFINITY;
      s[4 * nt + e] = ex2(x) * (dp[4 * nt + e] - Dr[e >> 1]);
    }
  uint32_t pa[BN / 16][4];
  acc_to_a<BN>(s, pa);
  rs_product_wait<BN, HD, LN>(acc, pa, K);
}

// The two products of one dk/dv item of attn_bwd_dkdv_tma_kernel (sm90_tma.cuh); BM = BN =
// kSmallTile, LN their tile layout. First: Sᵀ = K Qᵀ (warpgroup 0) or dPᵀ = V dAᵀ (warpgroup 1), 64
// keys x 64 queries, of the item whose Q / dA tiles are Qi / Ai, into st as one wgmma group.
// Descriptors advance by adding to their address field (bytes / 16): no carry can leave it, shared
// addresses are below 2^18.
template <int BM, int HD, class LN>
__device__ __forceinline__ void dkdv_first_product(float (&st)[BM / 2], int wg,
                                                   const unsigned char* Kt, const unsigned char* Vt,
                                                   const bf16_t* Qi, const bf16_t* Ai) {
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) st[i] = 0.f;
  reg_fence(st);
  wgmma_fence();
  const uint64_t da = LN::desc_k(wg == 0 ? Kt : Vt);
  const uint64_t db = LN::desc_k(wg == 0 ? reinterpret_cast<const unsigned char*>(Qi)
                                         : reinterpret_cast<const unsigned char*>(Ai));
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    wgmma_ss<BM, 0>(st, da + LN::k_step(kk), db + LN::k_step(kk), 1);
  wgmma_commit();
}

// Second: from st, Pᵀ (warpgroup 0, handed to warpgroup 1 through P [BN·BM / 128][128] in
// register order, on named barrier `bar`) or dSᵀ = Pᵀ ⊙ (dPᵀ − D) (warpgroup 1), as bf16 A
// fragments pa; then dV += Pᵀ dA or dK += dSᵀ Q into acc, issued as one wgmma group (not waited
// for). L, Dv: the item's lse·log2e and D; qs its first query; u0, u1 this thread's key rows.
template <int BM, int BN, int HD, class LN>
__device__ __forceinline__ void dkdv_second_product(float (&st)[BM / 2], float (&acc)[HD / 2],
                                                    uint32_t (&pa)[BM / 16][4], int wg, int c,
                                                    int wtid, int k0, int u0, int u1, int qs,
                                                    float scale_log2, const bf16_t* Qi,
                                                    const bf16_t* Ai, const float* L,
                                                    const float* Dv, float* P, int bar) {
  const unsigned char* Q = reinterpret_cast<const unsigned char*>(Qi);
  const unsigned char* A = reinterpret_cast<const unsigned char*>(Ai);
  const bool diag = k0 + BN - 1 > qs;  // some key of the tile lies after some query
  if (wg == 0) {
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
      const int q = (i >> 2) * 8 + 2 * c + (i & 1);  // query column in the item
      float x = st[i] * scale_log2 - L[q];
      if (diag && ((i & 2) ? u1 : u0) > qs + q) x = -INFINITY;
      st[i] = ex2(x);
      P[i * 128 + wtid] = st[i];
    }
    named_bar_arrive(bar, kThreads);
  } else {
    named_bar_sync(bar, kThreads);
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
      const int q = (i >> 2) * 8 + 2 * c + (i & 1);
      st[i] = P[i * 128 + wtid] * (st[i] - Dv[q]);
    }
  }
  acc_to_a<BM>(st, pa);
  const uint64_t db2 = LN::desc_mn(wg == 0 ? A : Q);
  reg_fence_u(pa);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < BM / 16; ++ks) wgmma_rs<HD, 1>(acc, pa[ks], db2 + LN::mn_step(ks), 1);
  wgmma_commit();
}

// The wgmma / TMA dk/dv kernels' epilogue: warpgroup 0 writes dv (bf16) from its dV accumulator,
// warpgroup 1 dk_hat = scale · dK (fp32 scratch), for this thread's key rows u0, u1 inside the
// document (u < k_end) of kv head j.
template <int HD>
__device__ __forceinline__ void dkdv_epilogue(const BwdParams& p, const float (&acc)[HD / 2],
                                              int wg, int u0, int u1, int k_end, int j, int c) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int u = r == 0 ? u0 : u1;
    if (u >= k_end) continue;
    const size_t row = static_cast<size_t>(u) * p.Hkv + j;
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      const int col = nt * 8 + 2 * c;
      if (col < p.hd) {
        if (wg == 0) {
          *reinterpret_cast<uint32_t*>(p.dv + row * p.hd + col) =
              pack_bf16x2(acc[4 * nt + 2 * r], acc[4 * nt + 2 * r + 1]);
        } else {
          *reinterpret_cast<float2*>(p.dk_hat + row * p.hd + col) =
              make_float2(acc[4 * nt + 2 * r] * p.scale, acc[4 * nt + 2 * r + 1] * p.scale);
        }
      }
    }
  }
}

}  // namespace gdn::ops::attn
