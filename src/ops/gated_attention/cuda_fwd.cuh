// Gated attention on CUDA, the attention forward: FlashAttention-2 (Dao, 2023, Algorithm 1) with
// tensor-core MMAs, one block per (document, kBigTile query rows, query head), the sigmoid gate
// fused into the epilogue. See cuda.cu for the design.
#pragma once

#include "ops/gated_attention/cuda_common.cuh"

namespace gdn::ops::attn {

// Block layout: 8 warps, warp w owns query rows 16w .. 16w+15 of the tile (all HD columns of its
// output accumulator). Shared memory: Q [BM][LD] once, K and V [2][BN][LD] double-buffered: the
// copy of key tile j+1 runs while tile j is computed.
//
// Per key tile j (keys [k0, k0 + BN) of the document, j = 0 .. up to the tile's last query):
//   S = Q Kᵀ (fp32 accumulators, 16 x BN per warp), scaled to base-2 units, causally masked on
//   the tiles that reach past the first query; online softmax with a running max m and running
//   per-thread partial sums l (the quad's partials are added once at the end); P rounded to bf16
//   and fed straight from the S accumulators as the A operand of O += P V (the m16n8k16 C layout
//   of two adjacent 8-key tiles is the A layout of one 16-key slice).
// Epilogue: attn = O / l, o = attn ⊙ σ(gate) (from the fp32 attn), lse = (m + log2 l) · ln 2;
// rows past the document's end are neither computed into anything visible nor written.
//
// Every row of the block sees its document's first key in key tile 0, so m is finite from the
// first tile on and l >= 1 at the end for every row (also the rows past the document's end, whose
// results are dropped).
template <int HD>
__global__ void __launch_bounds__(kThreads, 1) attn_fwd_kernel(const FwdParams p) {
  constexpr int BM = kBigTile, BN = kFwdKeys, LD = ld_of<HD>();
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem());  // [BM][LD]
  bf16_t* sK = sQ + BM * LD;                           // [2][BN][LD]
  bf16_t* sV = sK + 2 * BN * LD;                       // [2][BN][LD]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  // Block -> (query head, tile): heads fastest (the heads of a kv group run side by side and share
  // K/V through L2); tiles in reverse order, so the last (longest) tiles start first.
  const int h = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hq));
  const int rev = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hq));
  const int total = p.ts[p.N];
  if (rev >= total) return;
  const int tile = total - 1 - rev;
  const int n = find_doc(p.ts, p.N, tile);
  const Doc d = doc_bounds(p.cu, n, p.T);
  const int64_t q0l = d.b + static_cast<int64_t>(tile - p.ts[n]) * BM;
  if (q0l >= d.e) return;  // only for inconsistent cu_seqlens
  const int q0 = static_cast<int>(q0l), q_end = imin(q0 + BM, d.e);
  const int j = h / p.group;
  const int nk = (q_end - d.b + BN - 1) / BN;  // key tiles [d.b, q_end)

  const size_t ldq = static_cast<size_t>(p.Hq) * p.hd, ldkv = static_cast<size_t>(p.Hkv) * p.hd;
  const bf16_t* gQ = p.q_hat + static_cast<size_t>(h) * p.hd;  // row t at + t·ldq
  const bf16_t* gK = p.k_hat + static_cast<size_t>(j) * p.hd;  // row u at + u·ldkv
  const bf16_t* gV = p.v + static_cast<size_t>(j) * p.hd;

  load_tile_async<BM, HD>(sQ, gQ + q0 * ldq, ldq, q_end - q0, p.hd, tid);
  load_tile_async<BN, HD>(sK, gK + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  load_tile_async<BN, HD>(sV, gV + d.b * ldkv, ldkv, imin(BN, q_end - d.b), p.hd, tid);
  cp_async_commit();

  const int g = lane >> 2, c = lane & 3;
  const int r0 = warp * 16 + g;         // this thread's rows r0 and r0 + 8 of the tile
  const int t0 = q0 + r0, t1 = t0 + 8;  // their tokens
  float acc[HD / 8][4];                 // O: [16 rows][HD] per warp in the C layout
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int jt = 0; jt < nk; ++jt) {
    const int buf = jt & 1;
    if (jt > 0) __syncthreads();  // every warp is done with tile jt-1, whose buffers come next
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
    __syncthreads();  // tile jt (and Q) visible to every warp
    const bf16_t* K = sK + buf * BN * LD;
    const bf16_t* V = sV + buf * BN * LD;
    const int k0 = d.b + jt * BN;

    // S = Q Kᵀ
    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(a, sQ + (warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        ldsm_x4(b, K + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                       ((lane >> 3) & 1) * 8);
        mma_bf16(s[2 * np], a, b[0], b[1]);
        mma_bf16(s[2 * np + 1], a, b[2], b[3]);
      }
    }

    // Scale, causal mask (only tiles reaching past the first query), online softmax.
    const bool diag = k0 + BN - 1 > q0;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * p.scale_log2;
        const int u = k0 + nt * 8 + 2 * c + (e & 1);
        if (diag && u > (e < 2 ? t0 : t1)) x = -INFINITY;
        s[nt][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float alpha[2];
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
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = ex2(s[nt][e] - mx[e >> 1]);
        s[nt][e] = pv;
        sum[e >> 1] += pv;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + sum[r];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[0];
      acc[i][2] *= alpha[1];
      acc[i][3] *= alpha[1];
    }

    // O += P V
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
            b, V + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + np * 16 + (lane >> 4) * 8);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }

  // Epilogue: normalise, gate, write the rows inside the document.
  fwd_epilogue<HD>(
      p, [&](int nt, int e) { return acc[nt][e]; }, m_run, l_run, t0, t1, q_end, h, c);
}

}  // namespace gdn::ops::attn
