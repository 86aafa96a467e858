// Gated delta rule, the fused CUDA forward (GDN_FUSED_FWD=1, implementation "cuda.fused_fwd"):
// one kernel that walks each document's chunks in order with the running state on chip, instead of
// the decomposed chain prep -> state_fwd -> output (cuda_fast_fwd.cu). It reads q, k, v, g and
// beta once and writes o, hT and, when the op's `saved` is given, the same Ht and Vt the decomposed
// state pass writes (op.h has the layout), so the one backward (cuda.cu) consumes either route's
// `saved` unchanged.
//
// One block of 8 warps per (document, value head, 32 value columns). Per chunk of 64 tokens:
//   gamma   the chunk-local inclusive fp32 cumsum of g (the same sequential sum as prep, so the
//           gates are bitwise those of the decomposed route)
//   M, T    K K^T, M = tril_{-1}(beta_i e^{gamma_i - gamma_j} k_i.k_j), T = (I + M)^{-1} by the
//           shared blocked inverse (cuda_tril_inverse.cuh), in fp32
//   W, U    W = T diag(beta G) K (bf16, shared memory), U = T diag(beta) V (this block's columns,
//           registers, rounded to bf16 as the decomposed route stores it)
//   V'      V' = U - W S_c, S_c the chunk-start state rounded to bf16 (the snapshot H_c)
//   o       s (diag(G) Q S_c + (Q K^T .* D, j <= i) V')
//   S       S <- G_L S + K^T diag(dec) V', in fp32 mma accumulators: warp w owns rows 16 w .. of S
//           ([dk, 32]) for the whole document
// The running state never leaves the block; W and the gated scores never reach device memory. K
// K^T, T and W do not depend on the value columns, so the dv / 32 blocks of a (document, head) each
// compute them (the price of 4x more blocks at dv = 128; a single long document still has only
// Hv * 4 blocks, each walking every chunk in sequence, which the decomposed route's parallel prep
// and output kernels do not).
//
// Rounding: every product is bf16 x bf16 -> fp32 on mma.sync (cuda_mma.cuh), with the operands the
// decomposed fast route rounds (normalised q / k, T diag(.), W, U, the snapshots, V', the scores);
// gamma, T, W and U are bitwise the decomposed route's. V' = U - W S_c sums over dk in one chain
// where the decomposed state pass may split it over warps, so V', o and the state may differ in the
// last bits (the bf16 rounding of V' and of the snapshots absorbs most such differences: at
// dk = dv = 128 the tests saw bitwise equal o, hT and `saved`).
//
// Measured on an H200 (cuda_bench_ops, T = 8192, Hk = 16, dk = dv = 128, l2norm), fused against
// decomposed: 2.07 / 0.84 ms at Hv = 16 and 1 document, 1.03 / 0.54 ms at 4 documents, 1.99 /
// 0.99 ms at Hv = 32 and 1 document, 1.99 / 0.97 ms at 4 documents. The fused kernel is bound by
// the latency of one chunk step (about 15 us: gamma, the inverse, ten block barriers) times the
// chunks each block walks in sequence, with one 172 KiB block per SM and no overlap between the
// per-chunk stages; the decomposed route runs the per-chunk work (prep, output) in parallel over
// all chunks and keeps only the state update sequential. Hence GDN_FUSED_FWD defaults to 0.
#include <climits>

#include "gdn/backend/cuda_check.h"
#include "gdn/core/error.h"
#include "ops/gated_delta_rule/cuda_fast.h"
#include "ops/gated_delta_rule/cuda_mma.cuh"
#include "ops/gated_delta_rule/cuda_tril_inverse.cuh"

namespace gdn::ops::gdr {

namespace {

using fast::c_col;
using fast::c_row;
using fast::c_to_a;
using fast::decayed_kkt_lower;
using fast::load_a_km;
using fast::load_a_mk;
using fast::load_b_kn;
using fast::load_b_nk;
using fast::masked_qk_a;
using fast::mma;
using fast::pack;
using fast::unit_lower_inverse_blocked;

constexpr int kThreads = fast::kInvThreads;  // 8 warps
constexpr int kVB = 32;                      // value columns per block
constexpr int kLdV = ld_of(kVB);             // 40: bf16 [rows, 32] tiles
constexpr int kLdF = fast::kInvLd;           // fp32 64 x 64 tiles
constexpr int kLdP = kLd64;                  // bf16 64 x 64 tiles: 72
constexpr size_t kF32Tile = buf_bytes(kC * kLdF * 4);
constexpr size_t kF32Tile16 = buf_bytes(16 * kLdF * 4);

// Shared memory of the kernel for a padded key dim KP (every buffer 128-byte aligned, in the
// kernel's carving order).
constexpr size_t fused_smem_bytes(int KP) {
  return 2 * tile_bytes_bf16(kC, KP)     // K, double-buffered
         + 2 * tile_bytes_bf16(kC, KP)   // Q, double-buffered
         + 2 * tile_bytes_bf16(kC, kVB)  // V columns, double-buffered
         + 2 * kF32Tile + kF32Tile16     // M, T, the inverse's scratch
         + 2 * tile_bytes_bf16(kC, kC)   // T diag(beta G), T diag(beta)
         + tile_bytes_bf16(kC, KP)       // W
         + tile_bytes_bf16(KP, kVB)      // S_c (bf16)
         + 2 * tile_bytes_bf16(kC, kVB)  // V', V' diag(dec)
         + 4 * kVecBytes;                // g, beta, gamma, beta G
}

__global__ void __launch_bounds__(kThreads, 1)
    gdr_fused_fwd_kernel(Dims d, IndexView ix,
                         const bf16_t* __restrict__ qn,   // [T, Hk, dk]
                         const bf16_t* __restrict__ kn,   // [T, Hk, dk]
                         const bf16_t* __restrict__ v,    // [T, Hv, dv]
                         const float* __restrict__ g,     // [T, Hv]
                         const float* __restrict__ beta,  // [T, Hv]
                         const float* __restrict__ h0,    // [N, Hv, dk, dv] or null
                         bf16_t* __restrict__ o,          // [T, Hv, dv]
                         float* __restrict__ hT,          // [N, Hv, dk, dv] or null
                         bf16_t* __restrict__ Ht,         // [nt_max, Hv, dv, dk] or null
                         bf16_t* __restrict__ Vt) {       // [nt_max, Hv, dv, 64] or null
  const int nvb = (d.VP + kVB - 1) / kVB;
  const int n = static_cast<int>(blockIdx.x) / nvb, vb = static_cast<int>(blockIdx.x) % nvb;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int mt = warp & 3, nh = warp >> 2;  // per-chunk products: rows 16 mt.., columns by nh
  const int col0 = vb * kVB, cvalid = min(kVB, d.dv - col0);
  const int ldk = ld_of(d.KP), nkb = d.KP / 16;
  const bool owns_rows = 16 * warp < d.KP;  // warp owns state rows 16 warp .. 16 warp + 15
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  const int64_t nk = tile_bytes_bf16(kC, d.KP) / 2, nv = tile_bytes_bf16(kC, kVB) / 2;
  bf16_t* Ks0 = sc.take<bf16_t>(2 * tile_bytes_bf16(kC, d.KP));  // 2 x [64, KP] K
  bf16_t* Qs0 = sc.take<bf16_t>(2 * tile_bytes_bf16(kC, d.KP));  // 2 x [64, KP] Q
  bf16_t* Vs0 = sc.take<bf16_t>(2 * tile_bytes_bf16(kC, kVB));   // 2 x [64, 32] V columns
  float* Mf = sc.take<float>(kF32Tile);                          // [64, 64] strictly lower M
  float* Tf = sc.take<float>(kF32Tile);                          // [64, 64] T
  float* Xf = sc.take<float>(kF32Tile16);                        // [16, 48] inverse scratch
  bf16_t* Tw = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));         // [64, 64] T diag(beta G)
  bf16_t* Tu = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));         // [64, 64] T diag(beta)
  bf16_t* Ws = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));       // [64, KP] W
  bf16_t* Sb = sc.take<bf16_t>(tile_bytes_bf16(d.KP, kVB));      // [KP, 32] bf16(S_c)
  bf16_t* Vn = sc.take<bf16_t>(tile_bytes_bf16(kC, kVB));        // [64, 32] V'
  bf16_t* Vd = sc.take<bf16_t>(tile_bytes_bf16(kC, kVB));        // [64, 32] diag(dec) V'
  float* gr = sc.vec();                                          // [64] g (0 past L)
  float* br = sc.vec();                                          // [64] beta (0 past L)
  float* gm = sc.vec();                                          // [64] gamma
  float* bG = sc.vec();                                          // [64] beta G
  sc.done();

  const int bos = ix.bos[n], eos = ix.bos[n + 1], c0 = ix.chunk0[n], c1 = ix.chunk0[n + 1];
  const int64_t ldK = static_cast<int64_t>(d.Hk) * d.dk, ldV = static_cast<int64_t>(d.Hv) * d.dv;
  auto chunk_len = [&](int c) { return min(kC, eos - (bos + (c - c0) * kC)); };
  auto stage = [&](int c, int b) {
    const int t0 = bos + (c - c0) * kC, L = chunk_len(c);
    stage_tile(Ks0 + b * nk, ldk, kn + (static_cast<int64_t>(t0) * d.Hk + kh) * d.dk, ldK, L, d.dk,
               kC, d.KP, true);
    stage_tile(Qs0 + b * nk, ldk, qn + (static_cast<int64_t>(t0) * d.Hk + kh) * d.dk, ldK, L, d.dk,
               kC, d.KP, true);
    stage_tile(Vs0 + b * nv, kLdV, v + (static_cast<int64_t>(t0) * d.Hv + h) * d.dv + col0, ldV, L,
               cvalid, kC, kVB, true);
    cp_async_commit();
  };
  // g and beta of chunk c for thread tid < 64 (0 past the chunk's end), read into registers one
  // chunk ahead and stored to gr / br at the end of the previous chunk.
  auto gate_of = [&](int c, float& gv, float& bv) {
    const int t0 = bos + (c - c0) * kC;
    const bool in = tid < chunk_len(c);
    gv = in ? g[(static_cast<int64_t>(t0) + tid) * d.Hv + h] : 0.f;
    bv = in ? beta[(static_cast<int64_t>(t0) + tid) * d.Hv + h] : 0.f;
  };

  // S rows 16 warp + (g8, g8 + 8), columns 8 j + 2 t4 (+1) of the block: S[j][e] (C layout).
  float S[4][4];
  const int64_t sd = static_cast<int64_t>(d.dk) * d.dv;
  const int64_t state_off = (static_cast<int64_t>(n) * d.Hv + h) * sd;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = 16 * warp + c_row(e), vv = 8 * j + c_col(e);
      S[j][e] = h0 != nullptr && k < d.dk && vv < cvalid
                    ? h0[state_off + static_cast<int64_t>(k) * d.dv + col0 + vv]
                    : 0.f;
    }
  }
  // bf16(S) into Sb (the snapshot of the next chunk's start); rows past KP are never read.
  auto store_state_bf16 = [&]() {
    if (!owns_rows) return;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int k = 16 * warp + g8 + 8 * hf;
        *reinterpret_cast<uint32_t*>(Sb + k * kLdV + 8 * j + 2 * t4) =
            pack(S[j][2 * hf], S[j][2 * hf + 1]);
      }
    }
  };
  store_state_bf16();
  if (c0 < c1) {
    stage(c0, 0);
    if (tid < kC) gate_of(c0, gr[tid], br[tid]);
  }

  for (int c = c0; c < c1; ++c) {
    const int b = (c - c0) & 1, L = chunk_len(c);
    const int64_t t0 = bos + static_cast<int64_t>(c - c0) * kC;
    cp_async_wait<0>();
    __syncthreads();  // chunk c, its gates and Sb visible; every warp is done with buffer b ^ 1
    float g_next = 0.f, b_next = 0.f;
    if (c + 1 < c1) {
      stage(c + 1, b ^ 1);
      if (tid < kC) gate_of(c + 1, g_next, b_next);
    }
    const bf16_t* Ks = Ks0 + b * nk;
    const bf16_t* Qs = Qs0 + b * nk;
    const bf16_t* Vs = Vs0 + b * nv;
    const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;

    // The snapshot H_c = S_c^T into Ht (saved only): pairs of keys per 4-byte store.
    if (Ht != nullptr) {
      bf16_t* Hc = Ht + slot * sd;  // [dv, dk]
      const int kp = d.dk / 2;
      for (int p = tid; p < cvalid * kp; p += kThreads) {
        const int vv = p / kp, k = 2 * (p % kp);
        __nv_bfloat162 w;
        w.x = Sb[k * kLdV + vv];
        w.y = Sb[(k + 1) * kLdV + vv];
        *reinterpret_cast<__nv_bfloat162*>(Hc + static_cast<int64_t>(col0 + vv) * d.dk + k) = w;
      }
    }
    if (tid < kC) {
      // gamma_i = ((g_0 + g_1) + ...) + g_i, as in prep: past L the zero g's repeat gamma_{L-1}.
      float s = 0.f, mine = 0.f;
#pragma unroll
      for (int u = 0; u < kC; ++u) {
        s += gr[u];
        if (u == tid) mine = s;
      }
      gm[tid] = mine;
      bG[tid] = br[tid] * expf(mine);
    }
    // M as prep computes it (the barrier inside publishes gamma and beta G).
    decayed_kkt_lower(Ks, ldk, nkb, mt, nh, br, gm, Mf);
    __syncthreads();
    unit_lower_inverse_blocked(Mf, Tf, Xf);
    for (int p = tid; p < kC * kC; p += kThreads) {
      const int i = p >> 6, j = p & 63;
      const float t = Tf[i * kLdF + j];
      Tw[i * kLdP + j] = tobf(t * bG[j]);
      Tu[i * kLdP + j] = tobf(t * br[j]);
    }
    __syncthreads();
    // W = (T diag(beta G)) K into Ws: warp (mt, nh) owns rows 16 mt.., columns 64 nh.. (prep's
    // products); T is lower, so only k-blocks <= mt contribute.
    {
      float acc[8][4] = {};
      for (int kb = 0; kb <= mt; ++kb) {
        uint32_t a[4], bb[4];
        load_a_mk(a, Tw, kLdP, 16 * mt, 16 * kb);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (64 * nh + 16 * np >= d.KP) break;
          load_b_kn(bb, Ks, ldk, 64 * nh + 16 * np, 16 * kb);
          mma(acc[2 * np], a, bb[0], bb[1]);
          mma(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
      fast::store_acc_bf16(acc, Ws, ldk, 16 * mt, 64 * nh, kC, d.KP, 1.f);
    }
    // U = (T diag(beta)) V for rows 16 mt.., this block's columns 16 nh.. (registers), rounded to
    // bf16 as the decomposed route stores it.
    float u[2][4] = {};
    for (int kb = 0; kb <= mt; ++kb) {
      uint32_t a[4], bb[4];
      load_a_mk(a, Tu, kLdP, 16 * mt, 16 * kb);
      load_b_kn(bb, Vs, kLdV, 16 * nh, 16 * kb);
      mma(u[0], a, bb[0], bb[1]);
      mma(u[1], a, bb[2], bb[3]);
    }
    __syncthreads();  // Ws complete
    // V' = U - W S_c (rows 16 mt.., columns 16 nh..): exact zeros past L, where W and U are.
    const float glast = gm[kC - 1];
    {
      float x[2][4] = {};
      for (int kb = 0; kb < nkb; ++kb) {
        uint32_t a[4], bb[4];
        load_a_mk(a, Ws, ldk, 16 * mt, 16 * kb);
        load_b_kn(bb, Sb, kLdV, 16 * nh, 16 * kb);
        mma(x[0], a, bb[0], bb[1]);
        mma(x[1], a, bb[2], bb[3]);
      }
      const int i0 = 16 * mt + g8, i1 = i0 + 8;
      const float dec0 = expf(glast - gm[i0]), dec1 = expf(glast - gm[i1]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float vp[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) vp[e] = __bfloat162float(tobf(u[nt][e])) - x[nt][e];
        const int col = 16 * nh + 8 * nt + 2 * t4;
        *reinterpret_cast<uint32_t*>(Vn + i0 * kLdV + col) = pack(vp[0], vp[1]);
        *reinterpret_cast<uint32_t*>(Vn + i1 * kLdV + col) = pack(vp[2], vp[3]);
        *reinterpret_cast<uint32_t*>(Vd + i0 * kLdV + col) = pack(vp[0] * dec0, vp[1] * dec0);
        *reinterpret_cast<uint32_t*>(Vd + i1 * kLdV + col) = pack(vp[2] * dec1, vp[3] * dec1);
      }
    }
    __syncthreads();  // Vn, Vd complete
    // V' to Vt[c] (saved only): all 64 tokens, pairs of tokens per 4-byte store.
    if (Vt != nullptr) {
      bf16_t* Vc = Vt + slot * d.dv * kC;  // [dv, 64]
      for (int p = tid; p < cvalid * (kC / 2); p += kThreads) {
        const int vv = p / (kC / 2), i = 2 * (p % (kC / 2));
        __nv_bfloat162 w;
        w.x = Vn[i * kLdV + vv];
        w.y = Vn[(i + 1) * kLdV + vv];
        *reinterpret_cast<__nv_bfloat162*>(Vc + static_cast<int64_t>(col0 + vv) * kC + i) = w;
      }
    }
    // o = s (diag(G) Q S_c + P V') for rows 16 mt.., columns 16 nh.., with P = Q K^T .* D (j <= i)
    // in registers as the A operand (the output kernel's scheme).
    {
      uint32_t qa[8][4];
#pragma unroll
      for (int kb = 0; kb < 8; ++kb)
        if (kb < nkb) load_a_mk(qa[kb], Qs, ldk, 16 * mt, 16 * kb);
      uint32_t pa[4][4];
      masked_qk_a(pa, qa, Ks, ldk, gm, mt, nkb);
      float acc[2][4] = {};
#pragma unroll
      for (int kb = 0; kb < 8; ++kb) {
        if (kb >= nkb) break;
        uint32_t bb[4];
        load_b_kn(bb, Sb, kLdV, 16 * nh, 16 * kb);
        mma(acc[0], qa[kb], bb[0], bb[1]);
        mma(acc[1], qa[kb], bb[2], bb[3]);
      }
      const float G0 = expf(gm[16 * mt + g8]), G1 = expf(gm[16 * mt + g8 + 8]);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        acc[nt][0] *= G0;
        acc[nt][1] *= G0;
        acc[nt][2] *= G1;
        acc[nt][3] *= G1;
      }
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        if (kb > mt) break;
        uint32_t bb[4];
        load_b_kn(bb, Vn, kLdV, 16 * nh, 16 * kb);
        mma(acc[0], pa[kb], bb[0], bb[1]);
        mma(acc[1], pa[kb], bb[2], bb[3]);
      }
      fast::store_acc_bf16(acc, o + (t0 * d.Hv + h) * d.dv + col0, ldV, 16 * mt, 16 * nh, L, cvalid,
                           d.scale);
    }
    // S <- G_L S + K^T diag(dec) V' (warp w: rows 16 w.., all 32 columns; no reduction over dk).
    if (owns_rows) {
      const float GL = expf(glast);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) S[j][e] *= GL;
      }
#pragma unroll
      for (int kb = 0; kb < 4; ++kb) {
        uint32_t a[4];
        load_a_km(a, Ks, ldk, 16 * warp, 16 * kb);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bb[4];
          load_b_kn(bb, Vd, kLdV, 16 * np, 16 * kb);
          mma(S[2 * np], a, bb[0], bb[1]);
          mma(S[2 * np + 1], a, bb[2], bb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done reading Sb, gr, br of chunk c
    store_state_bf16();
    if (tid < kC) {
      gr[tid] = g_next;
      br[tid] = b_next;
    }
  }
  if (hT != nullptr && owns_rows) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 16 * warp + c_row(e), vv = 8 * j + c_col(e);
        if (k < d.dk && vv < cvalid)
          hT[state_off + static_cast<int64_t>(k) * d.dv + col0 + vv] = S[j][e];
      }
    }
  }
}

}  // namespace

size_t fused_fwd_smem(const Dims& d) { return fused_smem_bytes(d.KP); }

void fused_fwd(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
               const bf16_t* v, const float* g, const float* beta, const float* h0, bf16_t* o,
               float* hT, bf16_t* Ht, bf16_t* Vt, cudaStream_t s) {
  GDN_CHECK(fused_path(d),
            "gated_delta_rule (cuda): the fused forward cannot take dk = {}, dv = {}", d.dk, d.dv);
  const int nvb = (d.VP + kVB - 1) / kVB;
  const int64_t blocks = static_cast<int64_t>(d.N) * nvb;
  GDN_CHECK(blocks >= 1 && blocks <= INT_MAX,
            "gated_delta_rule (cuda): gdr_fused_fwd_kernel needs a grid of {} blocks", blocks);
  const size_t smem = fused_fwd_smem(d);
  allow_smem(reinterpret_cast<const void*>(&gdr_fused_fwd_kernel), smem, "gdr_fused_fwd_kernel",
             d.dk, d.dv);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(d.Hv));
  gdr_fused_fwd_kernel<<<grid, kThreads, smem, s>>>(d, ix, qn, kn, v, g, beta, h0, o, hT, Ht, Vt);
  GDN_CUDA_LAUNCH_CHECK("gdr_fused_fwd_kernel");
}

}  // namespace gdn::ops::gdr
