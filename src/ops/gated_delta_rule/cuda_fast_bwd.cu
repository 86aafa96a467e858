// Gated delta rule, fast CUDA path: the backward kernels. cuda_fast.h has the chain and the scratch
// layouts, cuda_mma.cuh the fragment conventions; the formulas are cpu.cpp's backward (its header
// lists them), split as FLA splits them (fla/ops/gated_delta_rule/chunk.py):
//   dvloc      dV'_loc = s P^T dO, stored transposed (fla chunk_bwd_kernel_dv_local): in
//              cuda_fast_fwd.cu, where it runs in one grid with the backward's prep
//   state_bwd  reverse over chunks, per (document, value head, 16 or 32 value columns), 1 or 2 KS
//              warps (KS = the dk split, cuda_fast.h), dS^T in fp32 mma accumulators (fla
//              chunk_gated_delta_rule_bwd_kernel_dhu): per chunk bf16(dS^T) is the snapshot dH_c
//              (gradient of the chunk's END state) and the A operand of dV'^T = dV'_loc^T + (dS^T
//              K^T) diag(dec); then dS^T <- G_L dS^T + (s dO^T diag(G)) Q - dV'^T W, both A
//              operands from registers or one ldmatrix.trans of dO. Q, K, W, dO, gamma and dV'_loc
//              come through a ring of chunk buffers (cuda_state_pipe.cuh; dV'_loc straight into
//              registers one chunk ahead where the ring has no room for it).
//   dqkw       per chunk (fla chunk_bwd_kernel_dqkwg): E = s dO V'^T, dP = E .* D (j <= i),
//              dQ = dP K + s diag(G) dO H_c^T, dK_a = dP^T Q + diag(dec) V' dH_c^T,
//              dW = -dV' H_c^T, and the gate terms of these paths
//   wy         per chunk (fla prepare_wy_repr_bwd): dT = dV' (beta V)^T + dW (beta G K)^T
//              (strictly lower), dv = beta T^T dV', dK_b = beta G T^T dW, dM = -T^T dT T^T, then
//              dK_c = dKK K + dKK^T K with dKK = beta_i D_ij dM_ij; dbeta and dg completed here
//   l2norm     the l2norm backward of dq and dk.
// dqkw and wy run a block per (chunk, key head) that takes the key head's r value heads in order
// and stages Q and K once: the first head stores dq and dk in fp32 [T, Hk, dk], the others add
// (lines the block has just written, in L2), so the sums over the heads never make a round trip
// through [T, Hv, dk] rows in DRAM (they did up to session 9: a reduce kernel read them back).
// dg is assembled per chunk from the terms that reach each token, as cpu.cpp does: suffix sums of
// the G-type terms (dgam), prefix sums of the dec-type terms (phi), pair terms h_ij over
// j < t <= i, and G_L <H_c, dH_c> for every token; dqkw adds the score / output-state / update
// parts into dgp, wy the WY parts. Never a reverse cumsum of O(1) differences, which would cancel
// to noise when the true dg is ~e^g (strong decay).
// Precision: every product is bf16 x bf16 -> fp32 (T and dT, dT T^T included; the generic path
// keeps T^T dT T^T in tf32); dS and the partial gradients are fp32.
// Determinism: no atomics; every reduction has a fixed order (quad butterflies, then warps in
// order); dq and dk are fp32 sums over the r heads in head order (dk: dqkw's parts, then wy's).
#include <climits>

#include "gdn/backend/cuda_check.h"
#include "gdn/core/error.h"
#include "ops/gated_delta_rule/cuda_fast.h"
#include "ops/gated_delta_rule/cuda_mma.cuh"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops::gdr {

namespace {

using fast::c_col;
using fast::c_row;
using fast::c_to_a;
using fast::hi_f;
using fast::lo_f;
using fast::load_a_km;
using fast::load_a_mk;
using fast::load_b_kn;
using fast::load_b_nk;
using fast::mma;
using fast::mma_tile_16x32;
using fast::pack;
using fast::row_dot_bf16;
using fast::scale2;
using fast::warp_mma;

constexpr int kThreads = 256;
constexpr int kStateThreads = 64;
constexpr int kVB = 32;
constexpr int kLdF = 68;
constexpr int kLdP = kLd64;
constexpr size_t kF32Tile = buf_bytes(kC * kLdF * 4);
constexpr size_t kVec256 = buf_bytes(256 * sizeof(float));

unsigned grid_x(int64_t n, const char* what) {
  GDN_CHECK(n >= 1 && n <= INT_MAX, "gated_delta_rule (cuda): {} needs a grid of {} blocks", what,
            n);
  return static_cast<unsigned>(n);
}

__device__ __forceinline__ void stage_gamma(float* dst, const float* src) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kC / 4) cp_async16(dst + 4 * tid, src + 4 * tid);
}

// pair[t] = sum_{i >= t} sum_{j < t} F[i][j] for t < 64 (0 for t = 0): the pair terms h_ij that
// reach dg_t (j < t <= i). F is fp32 [64, 64] (ld kLdF) with zeros on and above the diagonal; it is
// overwritten by its row prefix sums. Direct sums in a fixed order (quarters of 16, then the
// quarters in order). Threads 0..255 of a block of kT >= 256 compute; barriers inside (every thread
// of the block must call it); qtot and ppart hold 256 floats; pair is complete for the whole
// block on return.
template <int kT = kThreads>
__device__ void pair_sums(float* F, float* qtot, float* ppart, float* pair) {
  const int tid = static_cast<int>(threadIdx.x), i = tid >> 2, q = tid & 3;
  const bool on = kT == 256 || tid < 256;  // threads 256.. of a larger block only join barriers
  float* row = F + i * kLdF + 16 * q;
  if (on) {
    float run = 0.f;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      run += row[jj];
      row[jj] = run;
    }
    qtot[tid] = run;
  }
  __syncthreads();
  if (on && q > 0) {
    float off = 0.f;
    for (int qq = 0; qq < q; ++qq) off += qtot[4 * i + qq];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) row[jj] += off;
  }
  __syncthreads();
  const int t = i;  // now: token t, rows 16 q .. 16 q + 15
  float s = 0.f;
  if (on && t > 0) {
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {  // rows ii = max(16 q, t) .. 16 q + 15, in order
      const int ii = 16 * q + jj;
      const float x = F[ii * kLdF + t - 1];
      if (ii >= t) s += x;
    }
  }
  if (on) ppart[tid] = s;
  __syncthreads();
  if (tid < kC)
    pair[tid] = ((ppart[4 * tid] + ppart[4 * tid + 1]) + ppart[4 * tid + 2]) + ppart[4 * tid + 3];
  __syncthreads();
}

// --- the reverse state pass
// ---------------------------------------------------------------------------
// KS splits dk over KS groups of value warps as in the forward state pass (cuda_fast.h,
// cuda_fast_fwd.cu): warp w owns the value slice w % nvw and the k-blocks [KBW (w / nvw), + KBW)
// of dS^T; the partials of dS^T K^T are summed over the KS warps of a slice in a fixed order. The
// chunk tiles (and with pp.dls dV'_loc^T) come through the ring of cuda_state_pipe.cuh, in reverse
// chunk order; with pp.snap dH_c and dV' leave through shared tiles as the forward's H_c and V' do.
// Every StatePipe gives bitwise the same results for one KS.
constexpr int kLdDl = 72;  // fp32 [32, 64] dV'_loc^T tile: rows 288 B apart
size_t state_bwd_stage_bytes(const Dims& d, bool dls) {
  return 3 * tile_bytes_bf16(kC, d.KP) + tile_bytes_bf16(kC, kVB) + kVecBytes +
         (dls ? buf_bytes(static_cast<size_t>(kVB) * kLdDl * 4) : 0);
}
size_t state_bwd_smem(const Dims& d, int ks, const StatePipe& pp) {
  return static_cast<size_t>(pp.ns) * state_bwd_stage_bytes(d, pp.dls != 0) +
         (ks > 1 ? state_red_bytes(ks) + 2 * kVecBytes : 0) +
         (pp.snap ? tile_bytes_bf16(kVB, d.KP) + tile_bytes_bf16(kVB, kC) : 0);
}

template <int KS, bool FULL>
__global__ void __launch_bounds__(kStateThreads* KS)
    gdr_fast_state_bwd_kernel(Dims dd, IndexView ix, StatePipe pp,
                              const bf16_t* __restrict__ qn,     // [T, Hk, dk]
                              const bf16_t* __restrict__ kn,     // [T, Hk, dk]
                              const bf16_t* __restrict__ W,      // [T, Hv, dk]
                              const bf16_t* __restrict__ dout,   // [T, Hv, dv]
                              const float* __restrict__ dvlocT,  // [nt_max, Hv, dv, 64]
                              const float* __restrict__ gam,     // [nt_max, Hv, 64]
                              const float* __restrict__ dhT,     // [N, Hv, dk, dv] or null
                              bf16_t* __restrict__ dHt,          // [nt_max, Hv, dv, dk]
                              bf16_t* __restrict__ dVt,          // [nt_max, Hv, dv, 64]
                              float* __restrict__ dh0) {         // [N, Hv, dk, dv] or null
  constexpr int KBW = 8 / KS;                                    // k-blocks of 16 per warp
  // FULL: dk = dv = 128, as constants (no bound checks, no general staging path compiled in).
  Dims d = dd;
  if constexpr (FULL) d.dk = d.dv = d.KP = d.VP = 128;
  const int ns = pp.ns, nvw = pp.nvw, vbw = 16 * nvw;
  const bool dls = pp.dls != 0;
  const int nvb = (d.VP + vbw - 1) / vbw;
  const int n = static_cast<int>(blockIdx.x) / nvb, vb = static_cast<int>(blockIdx.x) % nvb;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int vwarp = warp % nvw, kq = warp / nvw, kb0 = KBW * kq;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int col0 = vb * vbw, cvalid = min(vbw, d.dv - col0);
  const int vw = col0 + 16 * vwarp;
  const int ldk = ld_of(d.KP), ldo = ld_of(kVB), nkb = d.KP / 16;
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  const size_t nsz = static_cast<size_t>(ns);
  const int64_t nk = tile_bytes_bf16(kC, d.KP) / 2, nu = tile_bytes_bf16(kC, kVB) / 2;
  const int64_t ndl = buf_bytes(static_cast<size_t>(kVB) * kLdDl * 4) / 4;
  bf16_t* Qs0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, d.KP));  // ns x [64, KP] Q
  bf16_t* Ks0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, d.KP));  // ns x [64, KP] K
  bf16_t* Ws0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, d.KP));  // ns x [64, KP] W
  bf16_t* dOs0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, kVB));  // ns x [64, 32] dO columns
  float* gm0 = sc.take<float>(nsz * kVecBytes);                    // ns x [64] gamma
  float* dl0 = dls ? sc.take<float>(nsz * static_cast<size_t>(ndl) * 4)
                   : nullptr;                                             // ns x [32, 64] dV'_loc^T
  float4* red = KS > 1 ? sc.take<float4>(state_red_bytes(KS)) : nullptr;  // [KS, 2, 8, 32] partials
  float* decs = KS > 1 ? sc.vec() : nullptr;  // [64] the chunk's dec, once per block
  float* gss = KS > 1 ? sc.vec() : nullptr;   // [64] s e^{gamma_t}, once per block
  bf16_t* Hs = pp.snap ? sc.take<bf16_t>(tile_bytes_bf16(kVB, d.KP)) : nullptr;  // [32, KP] dH_c
  bf16_t* Vs = pp.snap ? sc.take<bf16_t>(tile_bytes_bf16(kVB, kC)) : nullptr;    // [32, 64] dV'^T
  sc.done();

  const int bos = ix.bos[n], eos = ix.bos[n + 1], c0 = ix.chunk0[n], c1 = ix.chunk0[n + 1];
  const int nch = c1 - c0;
  const int64_t ldK = static_cast<int64_t>(d.Hk) * d.dk, ldW = static_cast<int64_t>(d.Hv) * d.dk;
  const int64_t ldV = static_cast<int64_t>(d.Hv) * d.dv;
  const RowPieces pk = row_pieces<bf16_t>(d.KP / 8), pu = row_pieces<bf16_t>(2 * nvw);
  const RowPieces pv = row_pieces<bf16_t>(kC / 8), pl = row_pieces<float>(kC / 4);
  const bool kcol = pk.c < d.dk, ucol = pu.c < cvalid;
  const bool snap = KS > 1 && pp.snap != 0 && (FULL || pk.ok);             // as in the forward pass
  const bf16_t* Qb = qn + (static_cast<int64_t>(bos) * d.Hk + kh) * d.dk;  // row 0 of the document
  const bf16_t* Kb = kn + (static_cast<int64_t>(bos) * d.Hk + kh) * d.dk;
  const bf16_t* Wb = W + (static_cast<int64_t>(bos) * d.Hv + h) * d.dk;
  const bf16_t* Ob = dout + (static_cast<int64_t>(bos) * d.Hv + h) * d.dv + col0;
  // Stages the i-th chunk from the document's end (chunk c1 - 1 - i) into buffer b = i % ns; one
  // cp.async group per call, empty past the first chunk.
  auto stage = [&](int i, int b) {
    if (i < nch) {
      const int ci = nch - 1 - i, L = min(kC, eos - (bos + ci * kC));
      const int64_t r0 = static_cast<int64_t>(ci) * kC;
      if (FULL || pk.ok) {
        stage_rows(Qs0 + b * nk, ldk, Qb + r0 * ldK, ldK, L, kC, kcol, pk);
        stage_rows(Ks0 + b * nk, ldk, Kb + r0 * ldK, ldK, L, kC, kcol, pk);
        stage_rows(Ws0 + b * nk, ldk, Wb + r0 * ldW, ldW, L, kC, kcol, pk);
      } else {
        stage_tile(Qs0 + b * nk, ldk, Qb + r0 * ldK, ldK, L, d.dk, kC, d.KP, true);
        stage_tile(Ks0 + b * nk, ldk, Kb + r0 * ldK, ldK, L, d.dk, kC, d.KP, true);
        stage_tile(Ws0 + b * nk, ldk, Wb + r0 * ldW, ldW, L, d.dk, kC, d.KP, true);
      }
      stage_rows(dOs0 + b * nu, ldo, Ob + r0 * ldV, ldV, L, kC, ucol, pu);
      const int64_t slot = static_cast<int64_t>(c0 + ci) * d.Hv + h;
      stage_gamma(gm0 + b * (kVecBytes / 4), gam + slot * kC);
      if (dls)  // [vbw, 64] rows col0.. of dV'_loc^T (rows past dv zero)
        stage_rows(dl0 + b * ndl, kLdDl,
                   dvlocT + slot * d.dv * kC + static_cast<int64_t>(col0) * kC,
                   static_cast<int64_t>(kC), cvalid, vbw, true, pl);
    }
    cp_async_commit();
  };
  // dV'_loc^T of chunk c at this lane's C positions (v = vw + g8 (+8), tokens 8 nt + 2 t4 (+1)).
  float dl[8][4];
  auto load_dl = [&](int c) {
    const float* src = dvlocT + (static_cast<int64_t>(c) * d.Hv + h) * d.dv * kC;  // [dv, 64]
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int vv = vw + g8 + 8 * hf;
        float2 x = make_float2(0.f, 0.f);
        if (vv < d.dv) x = *reinterpret_cast<const float2*>(src + vv * kC + 8 * nt + 2 * t4);
        dl[nt][2 * hf] = x.x;
        dl[nt][2 * hf + 1] = x.y;
      }
    }
  };

  // dS^T rows vw + (g8, g8 + 8), columns 16 kb0 + 8 j + 2 t4 (+1).
  float S[2 * KBW][4];
  const int64_t sd = static_cast<int64_t>(d.dk) * d.dv;
  const int64_t state_off = (static_cast<int64_t>(n) * d.Hv + h) * sd;
#pragma unroll
  for (int j = 0; j < 2 * KBW; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vv = vw + c_row(e), k = 16 * kb0 + 8 * j + c_col(e);
      S[j][e] = dhT != nullptr && vv < d.dv && k < d.dk
                    ? dhT[state_off + static_cast<int64_t>(k) * d.dv + vv]
                    : 0.f;
    }
  }

  for (int i = 0; i + 1 < ns; ++i) stage(i, i);
  if (!dls && nch > 0) load_dl(c1 - 1);
  for (int i = 0, b = 0; i < nch; ++i, b = b + 1 == ns ? 0 : b + 1) {  // b = i % ns
    const int c = c1 - 1 - i;
    const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
    cp_async_wait_pending(ns - 2);
    __syncthreads();  // chunk c staged and visible; every warp is done with the previous chunk's
                      // buffer, red and dV' tile
    stage(i + ns - 1, b == 0 ? ns - 1 : b - 1);  // the buffer chunk i - 1 used
    if (snap && i > 0)  // dV' of the previous (later) chunk, written before the barrier above
      store_rows(dVt + (slot + d.Hv) * d.dv * kC + static_cast<int64_t>(col0) * kC, kC, Vs, kLdP,
                 cvalid, true, pv);
    const bf16_t* Qs = Qs0 + b * nk;
    const bf16_t* Ks = Ks0 + b * nk;
    const bf16_t* Ws = Ws0 + b * nk;
    const bf16_t* dOs = dOs0 + b * nu;
    const float* gm = gm0 + b * (kVecBytes / 4);
    const float glast = gm[kC - 1];
    // dec_t = e^{gamma_63 - gamma_t} and s e^{gamma_t} once per block (the same expressions each
    // warp evaluated: bitwise the same factors); read after the exchange's barrier.
    if constexpr (KS > 1) {
      for (int t = tid; t < 2 * kC; t += static_cast<int>(blockDim.x)) {
        if (t < kC)
          decs[t] = expf(glast - gm[t]);
        else
          gss[t - kC] = d.scale * expf(gm[t - kC]);
      }
    }
    if (dls) {
      const float* dls_b = dl0 + b * ndl;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 x = *reinterpret_cast<const float2*>(
              dls_b + (16 * vwarp + g8 + 8 * hf) * kLdDl + 8 * nt + 2 * t4);
          dl[nt][2 * hf] = x.x;
          dl[nt][2 * hf + 1] = x.y;
        }
      }
    }

    // bf16(dS^T): the snapshot dH_c and the A operand of dS^T K^T.
    uint32_t sa[KBW][4];
    bf16_t* dHc = dHt + slot * sd;  // [dv, dk]
#pragma unroll
    for (int kbl = 0; kbl < KBW; ++kbl) {
      const int kb = kb0 + kbl;
      c_to_a(sa[kbl], S[2 * kbl], S[2 * kbl + 1]);
      if (kb >= nkb) continue;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int vl = 16 * vwarp + g8 + 8 * (q & 1), k = 16 * kb + 2 * t4 + 8 * (q >> 1);
        if (snap)
          *reinterpret_cast<uint32_t*>(Hs + vl * ldk + k) = sa[kbl][q];
        else if (col0 + vl < d.dv && k < d.dk)
          *reinterpret_cast<uint32_t*>(dHc + static_cast<int64_t>(col0 + vl) * d.dk + k) =
              sa[kbl][q];
      }
    }
    // dV'^T = dV'_loc^T + (dS^T K^T) diag(dec) (this warp's k-blocks, then the sum of the KS
    // partials).
    float y[8][4] = {};
#pragma unroll
    for (int kbl = 0; kbl < KBW; ++kbl) {
      const int kb = kb0 + kbl;
      if (kb >= nkb) break;
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bb[4];
        load_b_nk(bb, Ks, ldk, 16 * np, 16 * kb);
        mma(y[2 * np], sa[kbl], bb[0], bb[1]);
        mma(y[2 * np + 1], sa[kbl], bb[2], bb[3]);
      }
    }
    if constexpr (KS > 1) state_exchange_sum<KS>(y, red, kq, vwarp, nvw, lane);
    if (snap)  // dH_c, written before the exchange's barrier
      store_rows(dHc + static_cast<int64_t>(col0) * d.dk, d.dk, Hs, ldk, cvalid, kcol, pk);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int ta = 8 * nt + 2 * t4;
      float d0, d1;
      if constexpr (KS > 1) {
        d0 = decs[ta];
        d1 = decs[ta + 1];
      } else {
        d0 = expf(glast - gm[ta]);
        d1 = expf(glast - gm[ta + 1]);
      }
      y[nt][0] = dl[nt][0] + d0 * y[nt][0];
      y[nt][1] = dl[nt][1] + d1 * y[nt][1];
      y[nt][2] = dl[nt][2] + d0 * y[nt][2];
      y[nt][3] = dl[nt][3] + d1 * y[nt][3];
    }
    if (!dls && c - 1 >= c0) load_dl(c - 1);  // in flight during the rest of this chunk
    bf16_t* Vc = dVt + slot * d.dv * kC;      // [dv, 64]
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt % KS != kq) continue;  // the KS warps of a column slice share the stores
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int vl = 16 * vwarp + g8 + 8 * hf;
        const uint32_t pv2 = pack(y[nt][2 * hf], y[nt][2 * hf + 1]);
        if (snap)
          *reinterpret_cast<uint32_t*>(Vs + vl * kLdP + 8 * nt + 2 * t4) = pv2;
        else if (col0 + vl < d.dv)
          *reinterpret_cast<uint32_t*>(Vc + (col0 + vl) * kC + 8 * nt + 2 * t4) = pv2;
      }
    }
    // A operands: -dV'^T (registers) and s dO^T diag(G) (ldmatrix.trans of the dO columns).
    uint32_t na[4][4], oa[4][4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      na[kb][0] = pack(-y[2 * kb][0], -y[2 * kb][1]);
      na[kb][1] = pack(-y[2 * kb][2], -y[2 * kb][3]);
      na[kb][2] = pack(-y[2 * kb + 1][0], -y[2 * kb + 1][1]);
      na[kb][3] = pack(-y[2 * kb + 1][2], -y[2 * kb + 1][3]);
      load_a_km(oa[kb], dOs, ldo, 16 * vwarp, 16 * kb);
      const int ta = 16 * kb + 2 * t4, tb = ta + 8;
      float f0, f1, f2, f3;
      if constexpr (KS > 1) {
        f0 = gss[ta];
        f1 = gss[ta + 1];
        f2 = gss[tb];
        f3 = gss[tb + 1];
      } else {
        f0 = d.scale * expf(gm[ta]);
        f1 = d.scale * expf(gm[ta + 1]);
        f2 = d.scale * expf(gm[tb]);
        f3 = d.scale * expf(gm[tb + 1]);
      }
      oa[kb][0] = scale2(oa[kb][0], f0, f1);
      oa[kb][1] = scale2(oa[kb][1], f0, f1);
      oa[kb][2] = scale2(oa[kb][2], f2, f3);
      oa[kb][3] = scale2(oa[kb][3], f2, f3);
    }
    // dS^T <- G_L dS^T + (s dO^T diag(G)) Q - dV'^T W (this warp's k-blocks only).
    const float GL = expf(glast);
#pragma unroll
    for (int j = 0; j < 2 * KBW; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) S[j][e] *= GL;
    }
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
#pragma unroll
      for (int kbl = 0; kbl < KBW; ++kbl) {
        const int np = kb0 + kbl;
        if (np >= nkb) break;
        uint32_t bq[4], bw[4];
        load_b_kn(bq, Qs, ldk, 16 * np, 16 * kb);
        load_b_kn(bw, Ws, ldk, 16 * np, 16 * kb);
        mma(S[2 * kbl], oa[kb], bq[0], bq[1]);
        mma(S[2 * kbl + 1], oa[kb], bq[2], bq[3]);
        mma(S[2 * kbl], na[kb], bw[0], bw[1]);
        mma(S[2 * kbl + 1], na[kb], bw[2], bw[3]);
      }
    }
  }
  if (snap && nch > 0) {  // the first chunk's dV'
    __syncthreads();
    store_rows(
        dVt + (static_cast<int64_t>(c0) * d.Hv + h) * d.dv * kC + static_cast<int64_t>(col0) * kC,
        kC, Vs, kLdP, cvalid, true, pv);
  }
  if (dh0 != nullptr) {
#pragma unroll
    for (int j = 0; j < 2 * KBW; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int vv = vw + c_row(e), k = 16 * kb0 + 8 * j + c_col(e);
        if (vv < d.dv && k < d.dk) dh0[state_off + static_cast<int64_t>(k) * d.dv + vv] = S[j][e];
      }
    }
  }
}

// --- dqkw
// ------------------------------------------------------------------------------------------
// NW = kDqkwWarps = 16 warps a block: warp (mt, nh) = (warp & 3, warp >> 2) owns rows 16 mt.. of
// the chunk and the nh-th of NW / 4 column slices: 64 / (NW / 4) score columns, 128 / (NW / 4) key
// columns. The shared memory (about 170 KB at dk = dv = 128) allows one block a multiprocessor, so
// 8 warps left the SM two warps a scheduler, mostly waiting on fixed-latency dependencies
// (measured: docs/PERF.md); 16 warps give it four. Every dq, dk and dW element is the same sum in
// the same order for any NW; the dg part's rounding depends on NW (its per-warp row dots and warp
// sums are grouped by NW).
constexpr int kDqkwWarps = 16;
size_t dqkw_smem(const Dims& d, int nw) {
  return 2 * tile_bytes_bf16(kC, d.KP) + tile_bytes_bf16(kC, d.VP) + 2 * tile_bytes_bf16(d.VP, kC) +
         2 * tile_bytes_bf16(d.VP, d.KP) + tile_bytes_bf16(kC, kC) + kF32Tile + 2 * kVec256 +
         (4 + 2 * (nw / 4)) * kVecBytes;
}

template <int NW>
__global__ void __launch_bounds__(NW * 32, 1)
    gdr_fast_dqkw_kernel(Dims d, IndexView ix,
                         const bf16_t* __restrict__ qn,    // [T, Hk, dk]
                         const bf16_t* __restrict__ kn,    // [T, Hk, dk]
                         const bf16_t* __restrict__ dout,  // [T, Hv, dv]
                         const bf16_t* __restrict__ Vt,    // [nt_max, Hv, dv, 64] V'^T
                         const bf16_t* __restrict__ dVt,   // [nt_max, Hv, dv, 64] dV'^T
                         const bf16_t* __restrict__ Ht,    // [nt_max, Hv, dv, dk] chunk-start S^T
                         const bf16_t* __restrict__ dHt,   // [nt_max, Hv, dv, dk] chunk-end dS^T
                         const float* __restrict__ gam,    // [nt_max, Hv, 64]
                         float* __restrict__ dqk,          // [T, Hk, dk]
                         float* __restrict__ dkk,          // [T, Hk, dk]
                         bf16_t* __restrict__ dW,          // [T, Hv, dk]
                         float* __restrict__ dgp) {        // [T, Hv]
  const int c = static_cast<int>(blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int kh = static_cast<int>(blockIdx.y), L = ci.len;
  const int64_t t0 = ci.t0;
  constexpr int kT = NW * 32, NQ = NW / 4;
  constexpr int SC = 64 / NQ;    // score columns a warp: 32 or 16
  constexpr int KCW = 128 / NQ;  // key columns a warp: 64 or 32
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP), nkb = d.KP / 16, nvk = d.VP / 16;
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Qs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));      // [64, KP] Q
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));      // [64, KP] K
  bf16_t* dOs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));     // [64, VP] dO
  bf16_t* Vts = sc.take<bf16_t>(tile_bytes_bf16(d.VP, kC));     // [VP, 64] V'^T
  bf16_t* dVts = sc.take<bf16_t>(tile_bytes_bf16(d.VP, kC));    // [VP, 64] dV'^T
  bf16_t* Hts = sc.take<bf16_t>(tile_bytes_bf16(d.VP, d.KP));   // [VP, KP] H_c^T
  bf16_t* dHts = sc.take<bf16_t>(tile_bytes_bf16(d.VP, d.KP));  // [VP, KP] dH_c^T
  bf16_t* dPs = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));       // [64, 64] dP = E .* D, j <= i
  float* Ff = sc.take<float>(kF32Tile);                         // [64, 64] pair terms, j < i
  float* qtot = sc.take<float>(kVec256);                        // [256]
  float* ppart = sc.take<float>(kVec256);                       // [256]
  float* gm = sc.vec();                                         // [64] gamma
  float* rq = sc.take<float>(NQ * kVecBytes);  // [NQ, 64] q . (dO H^T) over column slice nh
  float* rk = sc.take<float>(NQ * kVecBytes);  // [NQ, 64] k . (V' dH^T) over column slice nh
  float* dgam = sc.vec();                      // [64]
  float* phi = sc.vec();                       // [64]
  float* pair = sc.vec();                      // [64] pair sums
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldV = static_cast<int64_t>(d.Hv) * d.dv;
  const int64_t ldh = static_cast<int64_t>(d.Hv) * d.dk;
  const int64_t sd = static_cast<int64_t>(d.dk) * d.dv;
  float* const dq_c = dqk + (t0 * d.Hk + kh) * d.dk;  // this chunk's rows of the key head
  float* const dk_c = dkk + (t0 * d.Hk + kh) * d.dk;
  // Q and K once (they join the first head's first group); then, for each of the key head's value
  // heads, three groups: what the score phase needs, then what the dq / dW phase adds (in flight
  // during the score phase), then dH (in flight until the dk phase).
  stage_tile(Qs, ldk, qn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  for (int hh = 0; hh < d.r; ++hh) {
    const int h = kh * d.r + hh;
    const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
    if (hh > 0) __syncthreads();  // every thread is done with the previous head's tiles and vectors
    stage_tile(dOs, ldv, dout + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, true);
    stage_tile(Vts, kLdP, Vt + slot * d.dv * kC, static_cast<int64_t>(kC), d.dv, kC, d.VP, kC,
               true);
    stage_gamma(gm, gam + slot * kC);
    cp_async_commit();
    stage_tile(dVts, kLdP, dVt + slot * d.dv * kC, static_cast<int64_t>(kC), d.dv, kC, d.VP, kC,
               true);
    stage_tile(Hts, ldk, Ht + slot * sd, static_cast<int64_t>(d.dk), d.dv, d.dk, d.VP, d.KP, true);
    cp_async_commit();
    stage_tile(dHts, ldk, dHt + slot * sd, static_cast<int64_t>(d.dk), d.dv, d.dk, d.VP, d.KP,
               true);
    cp_async_commit();
    cp_async_wait<2>();
    __syncthreads();

    const int mt = warp & 3, nh = warp >> 2;
    {
      // E = s dO V'^T and Q K^T for rows 16 mt.., columns SC nh..; dP and the pair terms
      // h_ij = E_ij (q_i . k_j) D_ij (j < i).
      float e[SC / 8][4] = {}, qk[SC / 8][4] = {};
      if (SC * nh <= 16 * mt + 15) {
        for (int kb = 0; kb < nvk; ++kb) {
          uint32_t a[4], bb[4];
          load_a_mk(a, dOs, ldv, 16 * mt, 16 * kb);
#pragma unroll
          for (int np = 0; np < SC / 16; ++np) {
            load_b_kn(bb, Vts, kLdP, SC * nh + 16 * np, 16 * kb);
            mma(e[2 * np], a, bb[0], bb[1]);
            mma(e[2 * np + 1], a, bb[2], bb[3]);
          }
        }
        for (int kb = 0; kb < nkb; ++kb) {
          uint32_t a[4], bb[4];
          load_a_mk(a, Qs, ldk, 16 * mt, 16 * kb);
#pragma unroll
          for (int np = 0; np < SC / 16; ++np) {
            load_b_nk(bb, Ks, ldk, SC * nh + 16 * np, 16 * kb);
            mma(qk[2 * np], a, bb[0], bb[1]);
            mma(qk[2 * np + 1], a, bb[2], bb[3]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < SC / 8; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g8 + 8 * hf, j = SC * nh + 8 * nt + 2 * t4;
          float dp[2], f[2];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const float dd = j + u <= i ? expf(gm[i] - gm[j + u]) : 0.f;
            const float ev = d.scale * e[nt][2 * hf + u];
            dp[u] = ev * dd;
            f[u] = j + u < i ? dp[u] * qk[nt][2 * hf + u] : 0.f;
          }
          *reinterpret_cast<uint32_t*>(dPs + i * kLdP + j) = pack(dp[0], dp[1]);
          *reinterpret_cast<float2*>(Ff + i * kLdF + j) = make_float2(f[0], f[1]);
        }
      }
    }
    cp_async_wait<1>();
    __syncthreads();  // dP, the pair terms and the second group
    // Warp (mt, nh): rows 16 mt.., key columns KCW nh...
    const int col0 = KCW * nh;
    {
      // Y = dO H_c^T and dW = -dV' H_c^T share their B fragments.
      float y[KCW / 8][4] = {}, w[KCW / 8][4] = {};
      for (int kb = 0; kb < nvk; ++kb) {
        uint32_t ao[4], av[4];
        load_a_mk(ao, dOs, ldv, 16 * mt, 16 * kb);
        load_a_km(av, dVts, kLdP, 16 * mt, 16 * kb);
#pragma unroll
        for (int np = 0; np < KCW / 16; ++np) {
          if (col0 + 16 * np >= d.KP) break;
          uint32_t bb[4];
          load_b_kn(bb, Hts, ldk, col0 + 16 * np, 16 * kb);
          mma(y[2 * np], ao, bb[0], bb[1]);
          mma(y[2 * np + 1], ao, bb[2], bb[3]);
          mma(w[2 * np], av, bb[0], bb[1]);
          mma(w[2 * np + 1], av, bb[2], bb[3]);
        }
      }
      fast::store_acc_bf16(w, dW + (t0 * d.Hv + h) * d.dk, ldh, 16 * mt, col0, L, d.dk, -1.f);
      float rd[2];
      row_dot_bf16(y, Qs, ldk, 16 * mt, col0, d.dk, rd);
      if (t4 == 0) {
        rq[kC * nh + 16 * mt + g8] = rd[0];
        rq[kC * nh + 16 * mt + g8 + 8] = rd[1];
      }
      // dQ = s diag(G) Y + dP K (dP is lower: k-blocks <= mt).
      const float s0 = d.scale * expf(gm[16 * mt + g8]), s1 = d.scale * expf(gm[16 * mt + g8 + 8]);
#pragma unroll
      for (int nt = 0; nt < KCW / 8; ++nt) {
        y[nt][0] *= s0;
        y[nt][1] *= s0;
        y[nt][2] *= s1;
        y[nt][3] *= s1;
      }
      for (int kb = 0; kb <= mt; ++kb) {
        uint32_t a[4];
        load_a_mk(a, dPs, kLdP, 16 * mt, 16 * kb);
#pragma unroll
        for (int np = 0; np < KCW / 16; ++np) {
          if (col0 + 16 * np >= d.KP) break;
          uint32_t bb[4];
          load_b_kn(bb, Ks, ldk, col0 + 16 * np, 16 * kb);
          mma(y[2 * np], a, bb[0], bb[1]);
          mma(y[2 * np + 1], a, bb[2], bb[3]);
        }
      }
      // The first value head stores, the others add (lines this thread wrote, still in L2): the
      // sum over the heads in head order, as a separate reduce over [T, Hv, dk] rows would take it.
      if (hh == 0)
        fast::store_acc_f32(y, dq_c, ldq, 16 * mt, col0, L, d.dk, 1.f);
      else
        fast::add_acc_f32(y, dq_c, ldq, 16 * mt, col0, L, d.dk);
    }
    cp_async_wait<0>();
    __syncthreads();  // the third group (dH)
    {
      // Z = V' dH_c^T; dK_a = diag(dec) Z + dP^T Q (dP^T is upper: k-blocks >= mt).
      float z[KCW / 8][4] = {};
      for (int kb = 0; kb < nvk; ++kb) {
        uint32_t av[4];
        load_a_km(av, Vts, kLdP, 16 * mt, 16 * kb);
#pragma unroll
        for (int np = 0; np < KCW / 16; ++np) {
          if (col0 + 16 * np >= d.KP) break;
          uint32_t bb[4];
          load_b_kn(bb, dHts, ldk, col0 + 16 * np, 16 * kb);
          mma(z[2 * np], av, bb[0], bb[1]);
          mma(z[2 * np + 1], av, bb[2], bb[3]);
        }
      }
      float rd[2];
      row_dot_bf16(z, Ks, ldk, 16 * mt, col0, d.dk, rd);
      if (t4 == 0) {
        rk[kC * nh + 16 * mt + g8] = rd[0];
        rk[kC * nh + 16 * mt + g8 + 8] = rd[1];
      }
      const float glast = gm[kC - 1];
      const float e0 = expf(glast - gm[16 * mt + g8]), e1 = expf(glast - gm[16 * mt + g8 + 8]);
#pragma unroll
      for (int nt = 0; nt < KCW / 8; ++nt) {
        z[nt][0] *= e0;
        z[nt][1] *= e0;
        z[nt][2] *= e1;
        z[nt][3] *= e1;
      }
      warp_mma<KCW / 16>(
          z, mt, 4, col0, d.KP,
          [&](uint32_t(&a)[4], int k) { load_a_km(a, dPs, kLdP, 16 * mt, k); },
          [&](uint32_t(&b)[4], int n, int k) { load_b_kn(b, Qs, ldk, n, k); });
      if (hh == 0)
        fast::store_acc_f32(z, dk_c, ldq, 16 * mt, col0, L, d.dk, 1.f);
      else
        fast::add_acc_f32(z, dk_c, ldq, 16 * mt, col0, L, d.dk);
    }
    // <H_c, dH_c> (zero padding included), per warp, then in warp order below.
    {
      float part = 0.f;
      const int half = d.KP / 2;
      for (int p = tid; p < d.VP * half; p += kT) {
        const int vv = p / half, k = 2 * (p % half);
        const uint32_t a = *reinterpret_cast<const uint32_t*>(Hts + vv * ldk + k);
        const uint32_t bq = *reinterpret_cast<const uint32_t*>(dHts + vv * ldk + k);
        part += lo_f(a) * lo_f(bq) + hi_f(a) * hi_f(bq);
      }
      part = warp_sum(part);
      if (lane == 0) qtot[warp] = part;  // qtot is free until pair_sums
    }
    __syncthreads();
    float dg_all = 0.f;
    for (int w8 = 0; w8 < NW; ++w8) dg_all += qtot[w8];
    dg_all *= expf(gm[kC - 1]);
    if (tid < kC) {
      const float gi = gm[tid];
      float sq = rq[tid], sk = rk[tid];
#pragma unroll
      for (int i = 1; i < NQ; ++i) {
        sq += rq[kC * i + tid];
        sk += rk[kC * i + tid];
      }
      dgam[tid] = d.scale * expf(gi) * sq;
      phi[tid] = tid < L - 1 ? expf(gm[kC - 1] - gi) * sk : 0.f;
    }
    __syncthreads();  // every thread has read qtot
    pair_sums<kT>(Ff, qtot, ppart, pair);
    if (tid < L)
      dgp[(t0 + tid) * d.Hv + h] = suffix_plus_prefix(dgam, phi, tid, L) + pair[tid] + dg_all;
  }
}

// --- wy
// ----------------------------------------------------------------------------------------------
// Shared memory: K, dW, V, dV'^T, bf16 T, dT, X, two vectors of 256 and 10 of 64; the fp32 pair
// terms reuse V's tile (dv > 112; else a tile of their own) and dKK dT's, both dead by then, and
// K K^T stays in registers. At dk = dv = 128: 102912 bytes, so 2 blocks share an SM (with fp32
// copies of T, K K^T and the pair terms it was 164352: 1 block).
__host__ __device__ bool wy_pair_over_v(const Dims& d) {
  return tile_bytes_bf16(kC, d.VP) >= kF32Tile;
}
size_t wy_smem(const Dims& d) {
  return 2 * tile_bytes_bf16(kC, d.KP) + tile_bytes_bf16(kC, d.VP) + tile_bytes_bf16(d.VP, kC) +
         3 * tile_bytes_bf16(kC, kC) + 2 * kVec256 + 10 * kVecBytes +
         (wy_pair_over_v(d) ? 0 : kF32Tile);
}

__global__ void __launch_bounds__(kThreads, 2)
    gdr_fast_wy_kernel(Dims d, IndexView ix,
                       const bf16_t* __restrict__ kn,    // [T, Hk, dk]
                       const bf16_t* __restrict__ v,     // [T, Hv, dv]
                       const bf16_t* __restrict__ dVt,   // [nt_max, Hv, dv, 64] dV'^T
                       const bf16_t* __restrict__ dW,    // [T, Hv, dk]
                       const bf16_t* __restrict__ Tinv,  // [nt_max, Hv, 64, 64]
                       const float* __restrict__ gam,    // [nt_max, Hv, 64]
                       const float* __restrict__ beta,   // [T, Hv]
                       const float* __restrict__ dgp,    // [T, Hv]
                       float* __restrict__ dkk,          // [T, Hk, dk] (+=)
                       bf16_t* __restrict__ dv,          // [T, Hv, dv]
                       float* __restrict__ dg,           // [T, Hv]
                       float* __restrict__ dbeta) {      // [T, Hv]
  const int c = static_cast<int>(blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int kh = static_cast<int>(blockIdx.y), L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP), nkb = d.KP / 16, nvk = d.VP / 16;
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));    // [64, KP] K
  bf16_t* dWs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));   // [64, KP] dW
  bf16_t* Vs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));    // [64, VP] V
  bf16_t* dVts = sc.take<bf16_t>(tile_bytes_bf16(d.VP, kC));  // [VP, 64] dV'^T
  bf16_t* Tb = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));      // [64, 64] bf16(T)
  bf16_t* dTs = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));     // [64, 64] dT, strictly lower
  bf16_t* Xs = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));      // [64, 64] dT T^T
  // After the barrier that completes X, V and dT are dead: the pair terms take V's tile when it is
  // large enough (wy_pair_over_v; else a tile of their own after the vectors), dKK takes dT's.
  bf16_t* dKKs = dTs;  // [64, 64] d(K K^T), strictly lower
  float* qtot = sc.take<float>(kVec256);
  float* ppart = sc.take<float>(kVec256);
  float* gm = sc.vec();    // [64] gamma
  float* bs = sc.vec();    // [64] beta (0 past L)
  float* rb0 = sc.vec();   // [64] v . (T^T dV'), value columns 0..63
  float* rb1 = sc.vec();   // [64] same, columns 64..
  float* rt0 = sc.vec();   // [64] k . (T^T dW), key columns 0..63
  float* rt1 = sc.vec();   // [64] same, columns 64..
  float* rm0 = sc.vec();   // [64] sum_j gd_ij KK_ij, columns 0..31
  float* rm1 = sc.vec();   // [64] same, columns 32..63
  float* dgB = sc.vec();   // [64] beta_i G_i kt_i
  float* pair = sc.vec();  // [64]
  float* Ff = wy_pair_over_v(d) ? reinterpret_cast<float*>(Vs)
                                : sc.take<float>(kF32Tile);  // [64, 64] pair terms dM .* M
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldV = static_cast<int64_t>(d.Hv) * d.dv;
  const int64_t ldh = static_cast<int64_t>(d.Hv) * d.dk;
  float* const dk_c = dkk + (t0 * d.Hk + kh) * d.dk;  // this chunk's rows of the key head
  // K once (it joins the first head's group); then each of the key head's value heads in turn,
  // each adding its dk part to dk_c.
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  for (int hh = 0; hh < d.r; ++hh) {
    const int h = kh * d.r + hh;
    const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
    if (hh > 0) __syncthreads();  // every thread is done with the previous head's tiles and vectors
    stage_tile(dWs, ldk, dW + (t0 * d.Hv + h) * d.dk, ldh, L, d.dk, kC, d.KP, true);
    stage_tile(Vs, ldv, v + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, true);
    stage_tile(dVts, kLdP, dVt + slot * d.dv * kC, static_cast<int64_t>(kC), d.dv, kC, d.VP, kC,
               true);
    stage_tile(Tb, kLdP, Tinv + slot * kC * kC, static_cast<int64_t>(kC), kC, kC, kC, kC, true);
    stage_gamma(gm, gam + slot * kC);
    if (tid < kC) bs[tid] = tid < L ? beta[(t0 + tid) * d.Hv + h] : 0.f;
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    const int mt = warp & 3, nh = warp >> 2;
    // K K^T at this warp's C positions of rows 16 mt.., columns 32 nh.. (0 where the warp computes
    // nothing: those positions all lie above the diagonal), kept for the dM phase, which reads
    // exactly these positions.
    float kk[4][4] = {};
    {
      // dT = (dV' V^T) diag(beta) + (dW K^T) diag(beta G) on j < i, and K K^T: rows 16 mt..,
      // columns 32 nh...
      float a1[4][4] = {}, a2[4][4] = {};
      if (32 * nh <= 16 * mt + 15) {
        mma_tile_16x32<true, false>(a1, dVts, kLdP, Vs, ldv, 16 * mt, 32 * nh, 0, nvk);
        for (int kb = 0; kb < nkb; ++kb) {
          uint32_t aw[4], ak[4], bb[4];
          load_a_mk(aw, dWs, ldk, 16 * mt, 16 * kb);
          load_a_mk(ak, Ks, ldk, 16 * mt, 16 * kb);
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            load_b_nk(bb, Ks, ldk, 32 * nh + 16 * np, 16 * kb);
            mma(a2[2 * np], aw, bb[0], bb[1]);
            mma(a2[2 * np + 1], aw, bb[2], bb[3]);
            mma(kk[2 * np], ak, bb[0], bb[1]);
            mma(kk[2 * np + 1], ak, bb[2], bb[3]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g8 + 8 * hf, j = 32 * nh + 8 * nt + 2 * t4;
          float x[2];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const float bj = bs[j + u];
            x[u] = j + u < i ? bj * a1[nt][2 * hf + u] + bj * expf(gm[j + u]) * a2[nt][2 * hf + u]
                             : 0.f;
          }
          *reinterpret_cast<uint32_t*>(dTs + i * kLdP + j) = pack(x[0], x[1]);
        }
      }
    }
    __syncthreads();
    {
      // X = dT T^T: B[m][j] = T[j][m] (NK on bf16(T)); dT is strictly lower, so k-blocks <= mt.
      float xm[4][4] = {};
      mma_tile_16x32<false, false>(xm, dTs, kLdP, Tb, kLdP, 16 * mt, 32 * nh, 0, mt + 1);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g8 + 8 * hf, j = 32 * nh + 8 * nt + 2 * t4;
          *reinterpret_cast<uint32_t*>(Xs + i * kLdP + j) =
              pack(xm[nt][2 * hf], xm[nt][2 * hf + 1]);
        }
      }
    }
    const int col0 = 64 * nh;
    {
      // tv = T^T dV' (T^T is upper: k-blocks >= mt); dv = diag(beta) tv; dbeta gets v . tv.
      float tv[8][4] = {};
      warp_mma<4>(
          tv, mt, 4, col0, d.VP,
          [&](uint32_t(&a)[4], int k) { load_a_km(a, Tb, kLdP, 16 * mt, k); },
          [&](uint32_t(&b)[4], int n, int k) { load_b_nk(b, dVts, kLdP, n, k); });
      float rd[2];
      row_dot_bf16(tv, Vs, ldv, 16 * mt, col0, d.dv, rd);
      if (t4 == 0) {
        float* rb = nh == 0 ? rb0 : rb1;
        rb[16 * mt + g8] = rd[0];
        rb[16 * mt + g8 + 8] = rd[1];
      }
      const float b0 = bs[16 * mt + g8], b1 = bs[16 * mt + g8 + 8];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        tv[nt][0] *= b0;
        tv[nt][1] *= b0;
        tv[nt][2] *= b1;
        tv[nt][3] *= b1;
      }
      fast::store_acc_bf16(tv, dv + (t0 * d.Hv + h) * d.dv, ldV, 16 * mt, col0, L, d.dv, 1.f);
    }
    // dK accumulator of this warp (rows 16 mt.., key columns 64 nh..): beta G T^T dW, then the
    // d(K K^T) terms after the next barrier.
    float dk[8][4] = {};
    warp_mma<4>(
        dk, mt, 4, col0, d.KP, [&](uint32_t(&a)[4], int k) { load_a_km(a, Tb, kLdP, 16 * mt, k); },
        [&](uint32_t(&b)[4], int n, int k) { load_b_kn(b, dWs, ldk, n, k); });
    {
      float rd[2];
      row_dot_bf16(dk, Ks, ldk, 16 * mt, col0, d.dk, rd);
      if (t4 == 0) {
        float* rt = nh == 0 ? rt0 : rt1;
        rt[16 * mt + g8] = rd[0];
        rt[16 * mt + g8 + 8] = rd[1];
      }
      const int i0 = 16 * mt + g8, i1 = i0 + 8;
      const float s0 = bs[i0] * expf(gm[i0]), s1 = bs[i1] * expf(gm[i1]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        dk[nt][0] *= s0;
        dk[nt][1] *= s0;
        dk[nt][2] *= s1;
        dk[nt][3] *= s1;
      }
    }
    // The dk lines this warp adds to at the end (add_acc_f32), towards L2 now, a few products
    // ahead: within the register budget the compiler issues those loads one at a time between the
    // stores, each waiting for its line (ncu at T 32768: long scoreboard, the largest stall of this
    // kernel; docs/PERF.md). One line a lane: rows g8 and g8 + 8, the two 32-column halves.
    // Only the first head: later heads add to lines the block has just written.
    if (hh == 0) {
      const int r = 16 * mt + g8 + 8 * (t4 >> 1), cc = col0 + 32 * (t4 & 1);
      if (r < L && cc < d.dk) cuda::prefetch_l2(dk_c + r * ldq + cc);
    }
    __syncthreads();  // Xs complete
    {
      // dM' = T^T X (dM = -dM'); for j < i: gd = dM_ij D_ij, dKK_ij = beta_i gd, pair term
      // dKK_ij KK_ij, dbeta part gd KK_ij.
      float dm[4][4] = {};
      mma_tile_16x32<true, true>(dm, Tb, kLdP, Xs, kLdP, 16 * mt, 32 * nh, mt, 4);
      float rsum[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i = 16 * mt + g8 + 8 * hf, j = 32 * nh + 8 * nt + 2 * t4;
          float x[2], f[2];
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            x[u] = 0.f;
            f[u] = 0.f;
            if (j + u < i) {
              const float gd = -dm[nt][2 * hf + u] * expf(gm[i] - gm[j + u]);
              const float kkv = kk[nt][2 * hf + u];
              rsum[hf] += gd * kkv;
              x[u] = bs[i] * gd;
              f[u] = x[u] * kkv;
            }
          }
          *reinterpret_cast<uint32_t*>(dKKs + i * kLdP + j) = pack(x[0], x[1]);
          *reinterpret_cast<float2*>(Ff + i * kLdF + j) = make_float2(f[0], f[1]);
        }
      }
      rsum[0] = fast::quad_sum4(rsum[0]);
      rsum[1] = fast::quad_sum4(rsum[1]);
      if (t4 == 0) {
        float* rm = nh == 0 ? rm0 : rm1;
        rm[16 * mt + g8] = rsum[0];
        rm[16 * mt + g8 + 8] = rsum[1];
      }
    }
    __syncthreads();  // dKKs complete
    // dK += dKK K (dKK lower: k-blocks <= mt) + dKK^T K (upper: k-blocks >= mt).
    for (int kb = 0; kb < 4; ++kb) {
      uint32_t a1[4], a2[4];
      const bool lo = kb <= mt, up = kb >= mt;
      if (lo) load_a_mk(a1, dKKs, kLdP, 16 * mt, 16 * kb);
      if (up) load_a_km(a2, dKKs, kLdP, 16 * mt, 16 * kb);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (col0 + 16 * np >= d.KP) break;
        uint32_t bb[4];
        load_b_kn(bb, Ks, ldk, col0 + 16 * np, 16 * kb);
        if (lo) {
          mma(dk[2 * np], a1, bb[0], bb[1]);
          mma(dk[2 * np + 1], a1, bb[2], bb[3]);
        }
        if (up) {
          mma(dk[2 * np], a2, bb[0], bb[1]);
          mma(dk[2 * np + 1], a2, bb[2], bb[3]);
        }
      }
    }
    fast::add_acc_f32(dk, dk_c, ldq, 16 * mt, col0, L, d.dk);
    if (tid < kC) dgB[tid] = bs[tid] * expf(gm[tid]) * (rt0[tid] + rt1[tid]);
    pair_sums(Ff, qtot, ppart, pair);  // its barriers also publish dgB
    if (tid < L) {
      const int64_t o = (t0 + tid) * d.Hv + h;
      const float kt = rt0[tid] + rt1[tid];
      dbeta[o] = (rb0[tid] + rb1[tid]) + expf(gm[tid]) * kt + (rm0[tid] + rm1[tid]);
      dg[o] = dgp[o] + suffix_plus_prefix(dgB, nullptr, tid, L) + pair[tid];
    }
  }
}

// --- the l2norm backward of dq and dk
// ------------------------------------------------------------------------------------------------
// dqkw and wy leave dq and dk summed over each key head's value heads, in fp32 [T, Hk, dk]. One
// warp per row of dq (rows [0, R)) or dk (rows [R, 2R)); lane l owns columns 4 l .. 4 l + 3 (dk <=
// 128, a multiple of 8). The fp32 rows are read once (evict-first loads).
__global__ void __launch_bounds__(kThreads)
    gdr_fast_l2norm_bwd_qk_kernel(Dims d,
                                  const bf16_t* __restrict__ q,   // [T, Hk, dk]
                                  const bf16_t* __restrict__ k,   // [T, Hk, dk]
                                  const float* __restrict__ dqk,  // [T, Hk, dk]
                                  const float* __restrict__ dkk,  // [T, Hk, dk]
                                  bf16_t* __restrict__ dq,        // [T, Hk, dk]
                                  bf16_t* __restrict__ dk) {      // [T, Hk, dk]
  const int64_t rows = static_cast<int64_t>(d.T) * d.Hk;
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (w >= 2 * rows) return;  // whole warps
  const bool is_k = w >= rows;
  const int64_t row = is_k ? w - rows : w;  // (t, kh) = (row / Hk, row % Hk)
  const int col = 4 * lane;
  const bool on = col < d.dk;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, x[4] = {0.f, 0.f, 0.f, 0.f};
  if (on) {
    const float4 p = __ldcs(reinterpret_cast<const float4*>((is_k ? dkk : dqk) + row * d.dk + col));
    const uint2 xv = *reinterpret_cast<const uint2*>((is_k ? k : q) + row * d.dk + col);
    acc[0] = p.x;
    acc[1] = p.y;
    acc[2] = p.z;
    acc[3] = p.w;
    x[0] = lo_f(xv.x);
    x[1] = hi_f(xv.x);
    x[2] = lo_f(xv.y);
    x[3] = hi_f(xv.y);
  }
  if (d.l2norm) warp_l2norm_bwd(acc, x);
  if (on) {
    uint2 out;
    out.x = pack(acc[0], acc[1]);
    out.y = pack(acc[2], acc[3]);
    *reinterpret_cast<uint2*>((is_k ? dk : dq) + row * d.dk + col) = out;
  }
}

}  // namespace

// --- launchers ----------------------------------------------------------------------------------
void fast_state_bwd(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                    const bf16_t* W, const bf16_t* dout, const float* dvlocT, const float* gam,
                    const float* dhT, bf16_t* dHt, bf16_t* dVt, float* dh0, cudaStream_t s) {
  const int64_t blocks32 = static_cast<int64_t>(d.N) * ((d.VP + kVB - 1) / kVB);
  const int ks = state_split(blocks32 * d.Hv);
  // ks = 1: 2 x 113 KB per SM at dk = dv = 128 (two blocks per SM)
  const StatePipe pp = state_pipe(d, ks, blocks32 * d.Hv, 4, &state_bwd_smem);
  const int vbw = 16 * pp.nvw;
  const int64_t blocks = static_cast<int64_t>(d.N) * ((d.VP + vbw - 1) / vbw);
  const size_t smem = state_bwd_smem(d, ks, pp);
  const dim3 grid(grid_x(blocks, "gdr_fast_state_bwd_kernel"), static_cast<unsigned>(d.Hv));
  const unsigned threads = static_cast<unsigned>(32 * pp.nvw * ks);
  auto launch = [&](auto kernel) {
    allow_smem(reinterpret_cast<const void*>(kernel), smem, "gdr_fast_state_bwd_kernel", d.dk,
               d.dv);
    kernel<<<grid, threads, smem, s>>>(d, ix, pp, qn, kn, W, dout, dvlocT, gam, dhT, dHt, dVt, dh0);
  };
  const bool full = d.dk == 128 && d.dv == 128;  // the constant-shape kernels (ks 1, 4, 8)
  if (ks == 8 && full)
    launch(&gdr_fast_state_bwd_kernel<8, true>);
  else if (ks == 8)
    launch(&gdr_fast_state_bwd_kernel<8, false>);
  else if (ks == 4 && full)
    launch(&gdr_fast_state_bwd_kernel<4, true>);
  else if (ks == 4)
    launch(&gdr_fast_state_bwd_kernel<4, false>);
  else if (ks == 2)
    launch(&gdr_fast_state_bwd_kernel<2, false>);
  else if (full)
    launch(&gdr_fast_state_bwd_kernel<1, true>);
  else
    launch(&gdr_fast_state_bwd_kernel<1, false>);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_state_bwd_kernel");
}

void fast_dqkw(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
               const bf16_t* dout, const bf16_t* Vt, const bf16_t* dVt, const bf16_t* Ht,
               const bf16_t* dHt, const float* gam, float* dqk, float* dkk, bf16_t* dW, float* dgp,
               cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = dqkw_smem(d, kDqkwWarps);
  const dim3 grid(grid_x(d.nt_max, "gdr_fast_dqkw_kernel"), static_cast<unsigned>(d.Hk));
  const auto kernel = &gdr_fast_dqkw_kernel<kDqkwWarps>;
  allow_smem(reinterpret_cast<const void*>(kernel), smem, "gdr_fast_dqkw_kernel", d.dk, d.dv);
  kernel<<<grid, kDqkwWarps * 32, smem, s>>>(d, ix, qn, kn, dout, Vt, dVt, Ht, dHt, gam, dqk, dkk,
                                             dW, dgp);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_dqkw_kernel");
}

void fast_wy(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
             const bf16_t* dVt, const bf16_t* dW, const bf16_t* Tinv, const float* gam,
             const float* beta, const float* dgp, float* dkk, bf16_t* dv, float* dg, float* dbeta,
             cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = wy_smem(d);
  allow_smem(reinterpret_cast<const void*>(&gdr_fast_wy_kernel), smem, "gdr_fast_wy_kernel", d.dk,
             d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_fast_wy_kernel"), static_cast<unsigned>(d.Hk));
  gdr_fast_wy_kernel<<<grid, kThreads, smem, s>>>(d, ix, kn, v, dVt, dW, Tinv, gam, beta, dgp, dkk,
                                                  dv, dg, dbeta);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_wy_kernel");
}

void fast_l2norm_bwd_qk(const Dims& d, const bf16_t* q, const bf16_t* k, const float* dqk,
                        const float* dkk, bf16_t* dq, bf16_t* dk, cudaStream_t s) {
  const int64_t rows = static_cast<int64_t>(d.T) * d.Hk;
  if (rows == 0) return;
  const int64_t blocks = (2 * rows * 32 + kThreads - 1) / kThreads;
  gdr_fast_l2norm_bwd_qk_kernel<<<grid_x(blocks, "gdr_fast_l2norm_bwd_qk_kernel"), kThreads, 0,
                                  s>>>(d, q, k, dqk, dkk, dq, dk);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_l2norm_bwd_qk_kernel");
}

}  // namespace gdn::ops::gdr
