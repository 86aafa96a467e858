// Gated attention on Hopper, "cuda.pipe": the three attention kernels of cuda_fwd.cuh and
// cuda_bwd.cuh on warpgroup MMAs (wgmma, sm_90a), with the tile products of a block overlapped.
// Same block-to-tile maps, masking, online softmax and outputs as the mma.sync kernels; operands
// come straight from shared memory in the 128-byte-swizzled layout of sm90_wgmma.cuh, P and dS go
// to the next product as register A operands. Warp w still owns rows 16w .. 16w+15 of its
// warpgroup's 64-row accumulators (the m64nN accumulator layout per warp is mma.sync's m16n8 one).
//
//   forward: 128 query rows (64 per warpgroup), 64 keys per step, software-pipelined per
//     warpgroup (FlashAttention-3, Shah et al. 2024, §3.2 "intra-warpgroup overlapping"): while
//     O += P_{j-1} V_{j-1} runs on the tensor cores, the warpgroup does the softmax of S_j; one
//     block barrier per key tile (K_{j+1} and V_j are copied during tile j).
//   dq: 128 query rows (64 per warpgroup) and 64 keys per step (the mma.sync kernel: 32), S = Q Kᵀ
//     and dP = dA Vᵀ at m64n64, K and V in three rotating slots so that the next K is copied
//     during a whole step and the next V during the dS / dQ half of it.
//   dk/dv: the warpgroups split the products, not the rows: warpgroup 0 computes Sᵀ = K Qᵀ, Pᵀ and
//     dV += Pᵀ dA, warpgroup 1 dPᵀ = V dAᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ − D) and dK += dSᵀ Q, each with the
//     full 64 x HD accumulator and Pᵀ / dSᵀ as register A operands. Pᵀ goes to warpgroup 1 in fp32
//     through shared memory in the accumulator's own register order (thread t of warpgroup 1
//     reads exactly the elements thread t of warpgroup 0 wrote), handed over by a named barrier.
//     lse and D of the next item travel through registers a whole item ahead. "cuda.pipe_xi"
//     also pipelines across items (XI below); "cuda.pipe" keeps one item at a time. The default,
//     "cuda.tma_all" (sm90_tma.cuh), runs these three kernels' products with a TMA producer warp
//     and mbarriers in place of the cp.async copies and block barriers.
// The per-element arithmetic and the order of every accumulation are the mma.sync kernels', and on
// an H200 the outputs are bit-identical to cuda.flash's (bench/cuda_bench_attn_kernels checks it
// at T = 8192).
//
// Measured (H200, T = 8192, 16 / 4 heads x 256, one document, bench/cuda_bench_attn_kernels
// --iters 10; cuda.flash in brackets): forward 1.25 ms (2.17), dk/dv 2.95 ms with XI, 3.07
// without (5.61), dq 1.36 ms (3.05). With the earlier no-swizzle tiles the forward and dq sat at
// 82-84% of Nsight Compute's L2 throughput at about 2 TB/s (a warp's 16-byte copies touched eight
// L2 lines); swizzled, dk/dv (XI) is at 30% L2 and 39% SM, a third of its stalls at block
// barriers (see cuda.cu for what remains).
#pragma once

#include "ops/gated_attention/cuda_common.cuh"
#include "ops/gated_attention/sm90_wgmma.cuh"

namespace gdn::ops::attn {

constexpr int kPipeDqKeys = 64;  // keys per step of the pipelined dq kernel

// Each adds 1024 bytes: the kernels start their tiles on a 1024-byte boundary (dyn_smem_1k).
template <int HD>
constexpr size_t fwd_pipe_smem_bytes() {  // Q [BM x HD], K and V [2][BN x HD]
  return sizeof(bf16_t) * HD * (kBigTile + 4 * kFwdKeys) + 1024;
}
template <int HD>
constexpr size_t dq_pipe_smem_bytes() {  // Q, dA [BM x HD], three K / V slots [BN x HD]
  return sizeof(bf16_t) * HD * (2 * kBigTile + 3 * kPipeDqKeys) + 1024;
}
template <int HD>
constexpr size_t dkdv_pipe_smem_bytes() {  // K, V; Q, dA [2]; Pᵀ fp32 [64 x 64]; lse, D [2][64]
  return sizeof(bf16_t) * HD * 6 * kSmallTile + sizeof(float) * kSmallTile * kSmallTile +
         sizeof(float) * 4 * kSmallTile + 1024;
}
static_assert(fwd_pipe_smem_bytes<256>() <= 227 * 1024 && dq_pipe_smem_bytes<256>() <= 227 * 1024 &&
                  dkdv_pipe_smem_bytes<256>() <= 227 * 1024,
              "a kernel's shared memory exceeds the 227 KiB an sm_90 block may have");

// One key tile of the forward's online softmax (attn_fwd_pipe_kernel and attn_fwd_tma_kernel):
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

// Key tile jt of the forward (attn_fwd_pipe_kernel and attn_fwd_tma_kernel): S_jt = Q K_jtᵀ into
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

// Forward. Iteration j (0 <= j < nk) issues S_j = Q K_jᵀ and then O += P_{j-1} V_{j-1} (j > 0)
// as two wgmma groups, waits for the first, does the softmax of S_j while the second runs,
// waits for it, rescales O to the new running max and keeps P_j (bf16 A fragments) for the next
// iteration; the last P V follows the loop. Shared: K_j in slot j % 2, V_j in slot j % 2; at the
// top of iteration j (after the barrier that ends every warp's iteration j-1) the copies of K_{j+1}
// and V_j start, into the slots of K_{j-1} and V_{j-2}, which no product reads any more.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_fwd_pipe_kernel(const FwdParams p) {
  constexpr int BM = kBigTile, BN = kFwdKeys;
  using LB = TileL<BM, HD>;                               // Q
  using LN = TileL<BN, HD>;                               // K, V
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem_1k());  // [BM x HD] swizzled
  bf16_t* sK = sQ + BM * HD;                              // [2][BN x HD]
  bf16_t* sV = sK + 2 * BN * HD;                          // [2][BN x HD]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  QueryTile qt;  // block -> (query head, tile), longest tiles first
  if (!query_tile<BM, BN>(p, qt)) return;
  const int h = qt.h, j = qt.j, q0 = qt.q0, q_end = qt.q_end, nk = qt.nk;
  const Doc d = qt.d;

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const bf16_t* gQ = p.q_hat + static_cast<size_t>(h) * p.hd;  // row t at + t·ldq
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;  // row u at + u·ldkv
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  load_tile_sw<BM, HD>(sQ, gQ + q0 * ldq, ldq, q_end - q0, p.hd, tid);
  load_tile_sw<BN, HD>(sK, gK + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int t0 = q0 + warp * 16 + g, t1 = t0 + 8;  // this thread's rows (tokens)
  const unsigned char* qrows =                     // this warpgroup's 64 query rows
      reinterpret_cast<const unsigned char*>(sQ) + LB::rows((warp >> 2) * 64);
  float acc[HD / 2];  // O, C layout of m64nHD
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  uint32_t pa[BN / 16][4];  // P_{j-1} as A fragments
#pragma unroll
  for (int i = 0; i < BN / 16; ++i) pa[i][0] = pa[i][1] = pa[i][2] = pa[i][3] = 0u;

  for (int jt = 0; jt < nk; ++jt) {
    cp_async_wait<0>();  // K_jt, V_{jt-1} (this thread's part)
    fence_proxy_async();
    __syncthreads();  // ... everybody's part; every warp is done with K_{jt-1} and V_{jt-2}
    if (jt + 1 < nk) {
      const int k1 = d.b + (jt + 1) * BN;
      load_tile_sw<BN, HD>(sK + ((jt + 1) & 1) * BN * HD, gK + k1 * ldkv, ldkv,
                           imin(BN, q_end - k1), p.hd, tid);
    }
    {
      const int k0 = d.b + jt * BN;
      load_tile_sw<BN, HD>(sV + (jt & 1) * BN * HD, gV + k0 * ldkv, ldkv, imin(BN, q_end - k0),
                           p.hd, tid);
    }
    cp_async_commit();
    const unsigned char* Vp =  // V_{jt-1}
        reinterpret_cast<const unsigned char*>(sV + ((jt + 1) & 1) * BN * HD);
    const unsigned char* K = reinterpret_cast<const unsigned char*>(sK + (jt & 1) * BN * HD);
    const int k0 = d.b + jt * BN;
    float s[BN / 2];
    fwd_tile_products<BN, HD, LB, LN>(s, acc, pa, qrows, K, Vp, jt > 0);
    float x[BN / 2];
    take_acc(s, x);

    // Scale, causal mask (only tiles reaching past the first query), online softmax.
    // The scores live in x, not in s: s are the accumulators of this stage's first wgmma group,
    // and redefining them while the second group runs would serialize the groups (C7513).
    float alpha[2];
    online_softmax_tile<BN>(x, p.scale_log2, k0 + BN - 1 > q0, k0, c, t0, t1, m_run, l_run, alpha);

    // O += P_{jt-1} V_{jt-1} is done: O may be rescaled, pa rewritten. Unconditional (a no-op
    // at jt = 0): behind `if (jt > 0)` ptxas cannot tell that no group is pending on the other
    // path and serializes every wgmma of the kernel (C7513).
    wgmma_wait<0>();
    reg_fence(acc);
    reg_fence_u(pa);
    // Rescale only where a running max moved (alpha = 2^0 = 1 exactly otherwise), skipped by
    // whole warps: past the first key tiles most rows keep their max. Exact either way.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < HD / 2; ++i) acc[i] *= alpha[(i >> 1) & 1];
    }
    acc_to_a<BN>(x, pa);
  }
  {                      // the last O += P V
    cp_async_wait<0>();  // V_{nk-1}
    fence_proxy_async();
    __syncthreads();
    rs_product_wait<BN, HD, LN>(
        acc, pa, reinterpret_cast<const unsigned char*>(sV + ((nk - 1) & 1) * BN * HD));
  }

  // Epilogue: normalise, gate, write the rows inside the document.
  fwd_epilogue<HD>(
      p, [&](int nt, int e) { return acc[4 * nt + e]; }, m_run, l_run, t0, t1, q_end, h, c);
}

// One key tile of the dq kernels (attn_bwd_dq_pipe_kernel and attn_bwd_dq_tma_kernel), after
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

// dq. One block per (document, kBigTile query rows, query head), warpgroup w owning rows
// 64w .. 64w+63 and their dQ accumulator. Per key step j (64 keys): S = Q Kᵀ (wgmma group 1),
// [barrier: V_j visible] dP = dA Vᵀ (group 2), dS = P ⊙ (dP − D) in registers,
// [barrier: V_j read by all] dQ += dS K (RS). Slots: K_j in slot j % 2, every V_j in slot 2.
// cp.async groups, in commit order: {Q, dA, K_0}, {V_0}, then per step {K_{j+1}} at its top and
// {V_{j+1}} after its second barrier (empty groups where there is nothing left to copy), so that
// "all but the newest group" is K_j at the top of step j and V_j after its first wgmma group.
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_dq_pipe_kernel(const BwdParams p) {
  constexpr int BM = kBigTile, BN = kPipeDqKeys;
  using LB = TileL<BM, HD>;                               // Q, dA
  using LN = TileL<BN, HD>;                               // K, V
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem_1k());  // [BM x HD]
  bf16_t* sA = sQ + BM * HD;                              // [BM x HD] dA
  bf16_t* sKV = sA + BM * HD;                             // [3][BN x HD]: K, K, V

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
  bf16_t* const sVs = sKV + 2 * BN * HD;  // the V slot

  load_tile_sw<BM, HD>(sQ, gQ + q0 * ldq, ldq, q_end - q0, p.hd, tid);
  load_tile_sw<BM, HD>(sA, gA + q0 * lda, lda, q_end - q0, p.hd, tid);
  load_tile_sw<BN, HD>(sKV, gK + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();
  load_tile_sw<BN, HD>(sVs, gV + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int t0 = q0 + warp * 16 + g, t1 = t0 + 8;
  float lse2[2], Dr[2];  // lse in base-2 units and D of rows t0, t1
  dq_row_stats(p, t0, t1, q0, q_end, h, lse2, Dr);
  const size_t wg_off = LB::rows((warp >> 2) * 64);  // this warpgroup's 64 rows
  const unsigned char* qrows = reinterpret_cast<const unsigned char*>(sQ) + wg_off;
  const unsigned char* arows = reinterpret_cast<const unsigned char*>(sA) + wg_off;
  const unsigned char* V = reinterpret_cast<const unsigned char*>(sVs);
  float acc[HD / 2];  // dQ
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;

  for (int jt = 0; jt < nk; ++jt) {
    cp_async_wait<1>();  // K_jt (and Q, dA): all but the newest group (V_jt)
    fence_proxy_async();
    __syncthreads();  // K_jt visible; every warp is done with step jt-1 (the slot of K_{jt-1})
    if (jt + 1 < nk) {
      const int k1 = d.b + (jt + 1) * BN;
      load_tile_sw<BN, HD>(sKV + ((jt + 1) & 1) * BN * HD, gK + k1 * ldkv, ldkv,
                           imin(BN, q_end - k1), p.hd, tid);
    }
    cp_async_commit();  // {K_{jt+1}}
    const unsigned char* K = reinterpret_cast<const unsigned char*>(sKV + (jt & 1) * BN * HD);
    const int k0 = d.b + jt * BN;

    float s[BN / 2], dp[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.f;
    reg_fence(s);
    reg_fence(dp);
    reg_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmma_ss<BN, 0>(s, LB::desc_k(qrows) + LB::k_step(kk), LN::desc_k(K) + LN::k_step(kk), 1);
    wgmma_commit();
    cp_async_wait<1>();  // V_jt: all but {K_{jt+1}}
    fence_proxy_async();
    __syncthreads();  // V_jt visible
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmma_ss<BN, 0>(dp, LB::desc_k(arows) + LB::k_step(kk), LN::desc_k(V) + LN::k_step(kk), 1);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);
    reg_fence(dp);
    __syncthreads();  // every warp is done with V_jt
    if (jt + 1 < nk) {
      const int k1 = d.b + (jt + 1) * BN;
      load_tile_sw<BN, HD>(sVs, gV + k1 * ldkv, ldkv, imin(BN, q_end - k1), p.hd, tid);
    }
    cp_async_commit();  // {V_{jt+1}}

    dq_tile_update<BN, HD, LN>(s, dp, acc, K, lse2, Dr, p.scale_log2, k0 + BN - 1 > q0, k0, c, t0,
                               t1);
  }
  cp_async_wait<0>();  // no copy may outlive the block (the last groups are empty)

  dq_epilogue<HD>(
      p, [&](int nt, int e) { return acc[4 * nt + e]; }, t0, t1, q_end, h, c);
}

// The two products of one dk/dv item, shared by attn_bwd_dkdv_pipe_kernel and
// attn_bwd_dkdv_tma_kernel (sm90_tma.cuh); BM = BN = kSmallTile, LN their tile layout.
// First: Sᵀ = K Qᵀ (warpgroup 0) or dPᵀ = V dAᵀ (warpgroup 1), 64 keys x 64 queries, of the item
// whose Q / dA tiles are Qi / Ai, into st as one wgmma group. Descriptors advance by adding to
// their address field (bytes / 16): no carry can leave it, shared addresses are below 2^18.
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

// dk/dv. One block per (document, kSmallTile keys, kv head), walking the items (query head of the
// group, 64-query tile) as cuda_bwd.cuh's kernel does, with Q, dA, lse and D of the next item
// copied during the current one. Per item:
//   warpgroup 0: Sᵀ = K Qᵀ (m64n64, SS), Pᵀ = 2^(Sᵀ·scale·log2e − lse·log2e) (masked) → fp32 to
//     sP [arrive on barrier 1] → bf16 A fragments, dV += Pᵀ dA (m64nHD, RS; dA MN-major);
//   warpgroup 1: dPᵀ = V dAᵀ (m64n64, SS) [sync on barrier 1] Pᵀ from sP,
//     dSᵀ = Pᵀ ⊙ (dPᵀ − D) → bf16 A fragments, dK += dSᵀ Q (m64nHD, RS; Q MN-major).
// sP is rewritten for the next item only after the block barrier that starts it, which warpgroup
// 1 reaches after its reads. Epilogue: warpgroup 0 writes dv (bf16), warpgroup 1 dk_hat =
// scale · dK (fp32 scratch), for the keys inside the document.
//
// XI (cross-item pipelining, FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024, §3.2,
// across items): each warpgroup issues the first product of item it+1 before it waits for the
// second of item it, so the tensor cores run through the block barrier between items. Two block
// barriers per item: B1 (item it+1's tiles visible) before the first product of it+1, B2 (both
// warpgroups' second products of item it done) before item it+2 is copied into item it's slot.
template <int HD, bool XI>
__global__ void __launch_bounds__(kThreads, 1) attn_bwd_dkdv_pipe_kernel(const BwdParams p) {
  constexpr int BN = kSmallTile, BM = kSmallTile;
  using LN = TileL<BN, HD>;                               // K, V, Q, dA
  constexpr int kBarP = 1;                                // named barrier: Pᵀ written
  bf16_t* sK = reinterpret_cast<bf16_t*>(dyn_smem_1k());  // [BN x HD]
  bf16_t* sV = sK + BN * HD;                              // [BN x HD]
  bf16_t* sQ = sV + BN * HD;                              // [2][BM x HD]
  bf16_t* sA = sQ + 2 * BM * HD;                          // [2][BM x HD] dA
  float* sP = reinterpret_cast<float*>(sA + 2 * BM * HD);  // [BN·BM / 128][128] Pᵀ, register order
  float* sL = sP + BN * BM;                                // [2][BM] lse · log2e
  float* sD = sL + 2 * BM;                                 // [2][BM] D

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
    load_tile_sw<BM, HD>(sQ + b * BM * HD, p.q_hat + static_cast<size_t>(h) * p.hd + qs * ldq, ldq,
                         rows, p.hd, tid);
    load_tile_sw<BM, HD>(sA + b * BM * HD, p.dA + static_cast<size_t>(h) * p.a_stride + qs * lda,
                         lda, rows, p.hd, tid);
  };
  // lse and D of an item's rows (threads tid < BM, one row each) travel through registers one
  // item ahead: fetched at the top of item it - 1, stored to sL / sD at the top of item it, so
  // that no warp waits for the load (a plain load and store at the top of the item would stall
  // warps 0-1, and with them warpgroup 0's first product, for a whole L2 round trip).
  float nl = 0.f, nd = 0.f;  // raw lse, D of the next item's row tid
  bool nok = false;          // that row lies inside the document
  auto fetch_ld = [&](int it) {
    const int h = j * p.group + it / n_m;
    const int qs = d.b + (m_first + it % n_m) * BM;
    nok = tid < d.e - qs;
    const size_t row = static_cast<size_t>(qs + (nok ? tid : 0)) * p.Hq + h;
    nl = p.lse[row];
    nd = p.D[row];
  };
  auto store_ld = [&](int b) {
    sL[b * BM + tid] = nok ? nl * kLog2e : INFINITY;
    sD[b * BM + tid] = nok ? nd : 0.f;
  };
  load_tile_sw<BN, HD>(sK, gK + k0 * ldkv, ldkv, k_end - k0, p.hd, tid);
  load_tile_sw<BN, HD>(sV, gV + k0 * ldkv, ldkv, k_end - k0, p.hd, tid);
  load_item(0, 0);
  cp_async_commit();
  if (tid < BM) {
    fetch_ld(0);
    store_ld(0);
    if (n_items > 1) fetch_ld(1);
  }

  const int g = lane >> 2, c = lane & 3;
  const int wg = warp >> 2, wtid = tid & 127;  // warpgroup, thread in the warpgroup
  const int kr = (warp & 3) * 16 + g;          // this thread's key rows kr, kr + 8 of the tile
  const int u0 = k0 + kr, u1 = u0 + 8;
  const unsigned char* Kt = reinterpret_cast<const unsigned char*>(sK);
  const unsigned char* Vt = reinterpret_cast<const unsigned char*>(sV);
  float acc[HD / 2];  // warpgroup 0: dV; warpgroup 1: dK (64 keys x HD)
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;

  // The item in slot sb: its first product, then its second (dkdv_first/second_product).
  float st[BM / 2];
  auto issue_first = [&](int sb) {
    dkdv_first_product<BM, HD, LN>(st, wg, Kt, Vt, sQ + sb * BM * HD, sA + sb * BM * HD);
  };
  auto issue_second = [&](int sb, int it, uint32_t(&pa)[BM / 16][4]) {
    dkdv_second_product<BM, BN, HD, LN>(
        st, acc, pa, wg, c, wtid, k0, u0, u1, d.b + (m_first + it % n_m) * BM, p.scale_log2,
        sQ + sb * BM * HD, sA + sb * BM * HD, sL + sb * BM, sD + sb * BM, sP, kBarP);
  };

  if constexpr (XI) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // item 0 visible
    if (n_items > 1) {
      load_item(1, 1);
      cp_async_commit();
      if (tid < BM) {
        store_ld(1);
        if (n_items > 2) fetch_ld(2);
      }
    }
    reg_fence(acc);
    issue_first(0);
    wgmma_wait<0>();
    reg_fence(st);
    for (int it = 0; it < n_items; ++it) {
      const int buf = it & 1;
      uint32_t pa[BM / 16][4];
      issue_second(buf, it, pa);
      if (it + 1 < n_items) {
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();  // B1: item it+1 visible; every warp is past its reads of sP (item it)
        issue_first(buf ^ 1);
        wgmma_wait<1>();  // this warpgroup's dV / dK product of item it is done
        reg_fence(acc);
        reg_fence_u(pa);
        __syncthreads();  // B2: both warpgroups' are: slot buf is free
        if (it + 2 < n_items) {
          load_item(it + 2, buf);
          cp_async_commit();
          if (tid < BM) {
            store_ld(buf);                           // item it + 2
            if (it + 3 < n_items) fetch_ld(it + 3);  // stored in iteration it + 1
          }
        }
        wgmma_wait<0>();
        reg_fence(st);
      } else {
        wgmma_wait<0>();
        reg_fence(acc);
        reg_fence_u(pa);
      }
    }
  } else {
    for (int it = 0; it < n_items; ++it) {
      const int buf = it & 1;
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();  // item it visible (tiles, lse, D); every warp is done with item it-1
      if (it + 1 < n_items) {
        load_item(it + 1, buf ^ 1);
        cp_async_commit();
        if (tid < BM) {
          store_ld(buf ^ 1);  // item it + 1 (fetched at the top of item it - 1)
          if (it + 2 < n_items) fetch_ld(it + 2);  // stored at the top of item it + 1
        }
      }
      reg_fence(acc);
      issue_first(buf);
      wgmma_wait<0>();
      reg_fence(st);
      uint32_t pa[BM / 16][4];
      issue_second(buf, it, pa);
      wgmma_wait<0>();
      reg_fence(acc);
      reg_fence_u(pa);
    }
  }

  dkdv_epilogue<HD>(p, acc, wg, u0, u1, k_end, j, c);
}

}  // namespace gdn::ops::attn
