// Gated delta rule, fast CUDA path: the forward kernels (also run by the backward to rebuild what
// the forward does not save). cuda_fast.h has the chain and the scratch layouts, cuda_mma.cuh the
// fragment conventions; the maths and notation are cpu.cpp's.
//
//   prep       per (chunk, value head), 8 warps: gamma (sequential fp32 cumsum), K K^T, M, the
//              blocked fp32 inverse T = (I + M)^{-1}, W = T diag(beta G) K, U = T diag(beta) V
//              (fla chunk_scaled_dot_kkt + solve_tril + recompute_w_u).
//   state_fwd  per (document, value head, 16 or 32 value columns), 1 or 2 KS warps (KS = the dk
//              split, cuda_fast.h), sequential over the chunks (fla
//              chunk_gated_delta_rule_fwd_kernel_h): each warp keeps S^T for its 16 columns and dk
//              / KS rows in fp32 mma accumulators; per chunk S^T repacked to bf16 is at once the
//              snapshot written to Ht and the A operand of V'^T = U^T - S^T W^T, and the V'^T
//              accumulators scaled by dec and repacked are the A operand of the update S^T <- G_L
//              S^T + (V' diag(dec))^T K. W, K, U and gamma move through a ring of chunk buffers
//              (cp.async, up to 3 chunks ahead: cuda_state_pipe.cuh).
//   output     per (chunk, value head), 8 warps (fla chunk_fwd_kernel_o): the masked gated scores
//              stay in registers as the A operand of P V'.
// Gates: gamma is the chunk-local inclusive cumsum of g in fp32, summed in order, so it never
// increases along the chunk and every exponent used (gamma_i - gamma_j for j <= i, gamma_i,
// gamma_63 - gamma_i) is <= 0: strong decay underflows to 0, never overflows. At g ~ -20 the
// difference of two cumsums is off by ~1e-4 relative (cpu.cpp sums each exponent in fp64), far
// below the bf16 rounding of the operands it scales.
#include <algorithm>
#include <atomic>
#include <climits>
#include <mutex>
#include <string>
#include <unordered_map>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/core/error.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/cuda_fast.h"
#include "ops/gated_delta_rule/cuda_mma.cuh"
#include "ops/gated_delta_rule/cuda_tril_inverse.cuh"

namespace gdn::ops::gdr {

namespace {

using cuda::pdl_launch_dependents;
using fast::c_col;
using fast::c_row;
using fast::c_to_a;
using fast::decayed_kkt_lower;
using fast::hi_f;
using fast::lo_f;
using fast::load_a_km;
using fast::load_a_mk;
using fast::load_b_kn;
using fast::load_b_nk;
using fast::masked_qk_a;
using fast::mma;
using fast::mma_tile_16x32;
using fast::pack;
using fast::unit_lower_inverse_blocked;

constexpr int kThreads = 256;       // per-chunk kernels: 8 warps
constexpr int kStateThreads = 64;   // state pass: 2 warps
constexpr int kVB = 32;             // value columns per state block (16 per warp)
constexpr int kLdF = fast::kInvLd;  // fp32 64 x 64 tiles: rows 272 B apart (16 B mod 128)
constexpr int kLdP = kLd64;         // bf16 64 x 64 tiles: 72
constexpr size_t kF32Tile = buf_bytes(kC * kLdF * 4);
constexpr size_t kF32Tile16 = buf_bytes(16 * kLdF * 4);

unsigned grid_x(int64_t n, const char* what) {
  GDN_CHECK(n >= 1 && n <= INT_MAX, "gated_delta_rule (cuda): {} needs a grid of {} blocks", what,
            n);
  return static_cast<unsigned>(n);
}

// --- the trailing output (fast_state_output) ---
// The output kernel can run beside the state pass instead of after it: the pass, one block per SM
// at one long document, is bound by the latency of its chunk steps and leaves most of each SM idle,
// while the output is per chunk and needs only that chunk's H and V'. The pass publishes each
// block's count of finished chunks in `prog` (zeroed before it) and lets the output grid start at
// once (programmatic dependent launch); an output block stages Q and K, waits until the counts of
// its document and head pass its chunk, then stages H and V'. The output grid starts only after
// every block of the pass has started (griddepcontrol.launch_dependents), and the pass never waits
// for the output, so the waits always end. Publication: after a block barrier that orders every
// thread's stores of the chunks, one thread stores the count with release semantics at GPU scope
// (the reader's acquire load then sees every store before the barrier: the grid-sync pattern),
// every kPublishEvery chunks so that the release is rare on the pass's critical path.
constexpr int kPublishEvery = 4;

__device__ __forceinline__ void publish_count(int* p, int v) {
  // A release store (cumulative: it also orders the stores the block barrier before it made this
  // thread observe); lighter than __threadfence(), which is a sequentially consistent fence.
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int acquire_count(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The 16-byte pieces of one chunk's gamma record (64 fp32) staged by threads 0..15.
__device__ __forceinline__ void stage_gamma(float* dst, const float* src) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < kC / 4) cp_async16(dst + 4 * tid, src + 4 * tid);
}

// --- prep
// ------------------------------------------------------------------------------------------
// Shared memory: K, V (only with U), M and the inverse's scratch X (dead once T is complete: the
// bf16 factors T diag(beta G) and T diag(beta) reuse them), T, 4 vectors. At dk = dv = 128: 75008
// bytes with V, 57600 without, so 3 blocks share an SM (80 registers at most).
size_t prep_smem(const Dims& d, bool with_u) {
  static_assert(2 * tile_bytes_bf16(kC, kC) <= kF32Tile + kF32Tile16, "Tw, Tu over M and X");
  return tile_bytes_bf16(kC, d.KP) + (with_u ? tile_bytes_bf16(kC, d.VP) : 0) + 2 * kF32Tile +
         kF32Tile16 + 4 * kVecBytes;
}

// gamma_i = ((g_0 + g_1) + ...) + g_i for thread i < 64 of the chunk's g in gr (0 past its end):
// every thread runs the same sequence, so gamma never increases with i; past L the zero g's repeat
// gamma_{L-1} (the padded record). prep and dvloc both take it from here: the same bits.
__device__ __forceinline__ float chunk_gamma(const float* gr, int tid) {
  float s = 0.f, mine = 0.f;
#pragma unroll
  for (int u = 0; u < kC; ++u) {
    s += gr[u];
    if (u == tid) mine = s;
  }
  return mine;
}

// The prep of chunk c, value head h (a block of kThreads; dynamic shared memory prep_smem).
__device__ __forceinline__ void prep_chunk(const Dims& d, const IndexView& ix, int c, int h,
                                           const bf16_t* __restrict__ kn,
                                           const bf16_t* __restrict__ v,
                                           const float* __restrict__ g,
                                           const float* __restrict__ beta, bf16_t* __restrict__ W,
                                           bf16_t* __restrict__ U, float* __restrict__ gam,
                                           bf16_t* __restrict__ Tinv, char* smem) {
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5;
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP), nkb = d.KP / 16;
  SmemCarver sc(smem);
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));  // [64, KP] K
  bf16_t* Vs = U != nullptr ? sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP))
                            : nullptr;            // [64, VP] V (V only feeds U)
  float* Mf = sc.take<float>(kF32Tile);           // [64, 64] strictly lower M
  float* Xf = sc.take<float>(kF32Tile16);         // [16, 48] inverse scratch (right after M)
  float* Tf = sc.take<float>(kF32Tile);           // [64, 64] T
  bf16_t* Tw = reinterpret_cast<bf16_t*>(Mf);     // [64, 64] T diag(beta G), over M and X
  bf16_t* Tu = Tw + tile_bytes_bf16(kC, kC) / 2;  // [64, 64] T diag(beta), over M and X
  float* gr = sc.vec();                           // [64] g (0 past L)
  float* gm = sc.vec();                           // [64] gamma
  float* bs = sc.vec();                           // [64] beta (0 past L)
  float* bG = sc.vec();                           // [64] beta G
  sc.done();

  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, static_cast<int64_t>(d.Hk) * d.dk, L, d.dk, kC,
             d.KP, true);
  if (U != nullptr)  // uniform over the block
    stage_tile(Vs, ldv, v + (t0 * d.Hv + h) * d.dv, static_cast<int64_t>(d.Hv) * d.dv, L, d.dv, kC,
               d.VP, true);
  if (tid < kC) {
    gr[tid] = tid < L ? g[(t0 + tid) * d.Hv + h] : 0.f;
    bs[tid] = tid < L ? beta[(t0 + tid) * d.Hv + h] : 0.f;
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  if (tid < kC) {
    const float mine = chunk_gamma(gr, tid);
    gm[tid] = mine;
    bG[tid] = bs[tid] * expf(mine);
    gam[(static_cast<int64_t>(c) * d.Hv + h) * kC + tid] = mine;
  }
  // M (K K^T, decayed and masked; the barrier inside publishes gamma and beta G).
  const int mt = warp & 3, nh = warp >> 2;
  decayed_kkt_lower(Ks, ldk, nkb, mt, nh, bs, gm, Mf);
  __syncthreads();
  unit_lower_inverse_blocked(Mf, Tf, Xf);  // ends with a barrier: M and X are dead
  for (int p = tid; p < kC * kC; p += kThreads) {
    const int i = p >> 6, j = p & 63;
    const float t = Tf[i * kLdF + j];
    Tw[i * kLdP + j] = tobf(t * bG[j]);
    if (U != nullptr) Tu[i * kLdP + j] = tobf(t * bs[j]);
  }
  if (Tinv != nullptr) {
    // bf16(T), 8 elements per 16-byte store (the rounding wy's tobf(T) did on an fp32 copy).
    bf16_t* Tc = Tinv + (static_cast<int64_t>(c) * d.Hv + h) * kC * kC;  // [64, 64]
    for (int p = tid; p < kC * kC / 8; p += kThreads) {
      const int i = p >> 3, j = (p & 7) * 8;
      const float4 x0 = *reinterpret_cast<const float4*>(Tf + i * kLdF + j);
      const float4 x1 = *reinterpret_cast<const float4*>(Tf + i * kLdF + j + 4);
      *reinterpret_cast<uint4*>(Tc + i * kC + j) =
          make_uint4(pack(x0.x, x0.y), pack(x0.z, x0.w), pack(x1.x, x1.y), pack(x1.z, x1.w));
    }
  }
  __syncthreads();
  // W = (T diag(beta G)) K and U = (T diag(beta)) V: warp (mt, nh) owns rows 16 mt.. and the 64
  // columns from 64 nh; T is lower, so only k-blocks <= mt contribute.
  {
    float acc[8][4] = {};
    for (int kb = 0; kb <= mt; ++kb) {
      uint32_t a[4], b[4];
      load_a_mk(a, Tw, kLdP, 16 * mt, 16 * kb);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (64 * nh + 16 * np >= d.KP) break;
        load_b_kn(b, Ks, ldk, 64 * nh + 16 * np, 16 * kb);
        mma(acc[2 * np], a, b[0], b[1]);
        mma(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    fast::store_acc_bf16(acc, W + (t0 * d.Hv + h) * d.dk, static_cast<int64_t>(d.Hv) * d.dk,
                         16 * mt, 64 * nh, L, d.dk, 1.f);
  }
  if (U != nullptr) {  // the backward given `saved` needs no U (it skips the state pass)
    float acc[8][4] = {};
    for (int kb = 0; kb <= mt; ++kb) {
      uint32_t a[4], b[4];
      load_a_mk(a, Tu, kLdP, 16 * mt, 16 * kb);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (64 * nh + 16 * np >= d.VP) break;
        load_b_kn(b, Vs, ldv, 64 * nh + 16 * np, 16 * kb);
        mma(acc[2 * np], a, b[0], b[1]);
        mma(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    fast::store_acc_bf16(acc, U + (t0 * d.Hv + h) * d.dv, static_cast<int64_t>(d.Hv) * d.dv,
                         16 * mt, 64 * nh, L, d.dv, 1.f);
  }
}

__global__ void __launch_bounds__(kThreads, 3)
    gdr_fast_prep_kernel(Dims d, IndexView ix,
                         const bf16_t* __restrict__ kn,   // [T, Hk, dk]
                         const bf16_t* __restrict__ v,    // [T, Hv, dv]
                         const float* __restrict__ g,     // [T, Hv]
                         const float* __restrict__ beta,  // [T, Hv]
                         bf16_t* __restrict__ W,          // [T, Hv, dk]
                         bf16_t* __restrict__ U,          // [T, Hv, dv] or null (not computed)
                         float* __restrict__ gam,         // [nt_max, Hv, 64]
                         bf16_t* __restrict__ Tinv) {     // [nt_max, Hv, 64, 64] or null
  extern __shared__ __align__(128) char smem[];
  prep_chunk(d, ix, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), kn, v, g, beta, W,
             U, gam, Tinv, smem);
}

// --- dV'_loc (the backward's, beside its prep) ---------------------------------------------------
size_t dvloc_smem(const Dims& d) {
  return 2 * tile_bytes_bf16(kC, d.KP) + tile_bytes_bf16(kC, d.VP) + tile_bytes_bf16(kC, kC) +
         2 * kVecBytes;
}

// dvlocT[c, h] = (s P^T dO)^T for chunk c, value head h (fla chunk_bwd_kernel_dv_local), with gamma
// taken from g here (chunk_gamma: the bits prep writes to gam), so that it does not wait for prep.
__device__ __forceinline__ void dvloc_chunk(const Dims& d, const IndexView& ix, int c, int h,
                                            const bf16_t* __restrict__ qn,
                                            const bf16_t* __restrict__ kn,
                                            const bf16_t* __restrict__ dout,
                                            const float* __restrict__ g, float* __restrict__ dvlocT,
                                            char* smem) {
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5;
  const int ldk = ld_of(d.KP), ldv = ld_of(d.VP), nkb = d.KP / 16;
  SmemCarver sc(smem);
  bf16_t* Qs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));   // [64, KP]
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));   // [64, KP]
  bf16_t* dOs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.VP));  // [64, VP]
  bf16_t* Ps = sc.take<bf16_t>(tile_bytes_bf16(kC, kC));     // [64, 64] P, j <= i
  float* gr = sc.vec();                                      // [64] g (0 past L)
  float* gm = sc.vec();                                      // [64] gamma
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk, ldV = static_cast<int64_t>(d.Hv) * d.dv;
  const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
  stage_tile(Qs, ldk, qn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  stage_tile(dOs, ldv, dout + (t0 * d.Hv + h) * d.dv, ldV, L, d.dv, kC, d.VP, true);
  if (tid < kC) gr[tid] = tid < L ? g[(t0 + tid) * d.Hv + h] : 0.f;
  cp_async_commit();
  __syncthreads();  // g
  if (tid < kC) gm[tid] = chunk_gamma(gr, tid);
  cp_async_wait<0>();
  __syncthreads();
  {
    // P = Q K^T .* D (j <= i): warp (mt, nh) rows 16 mt.., columns 32 nh...
    const int mt = warp & 3, nh = warp >> 2;
    float p[4][4] = {};
    if (32 * nh <= 16 * mt + 15)
      mma_tile_16x32<false, false>(p, Qs, ldk, Ks, ldk, 16 * mt, 32 * nh, 0, nkb);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = 16 * mt + c_row(2 * hf), j = 32 * nh + 8 * nt + c_col(0);
        const float p0 = j <= i ? p[nt][2 * hf] * expf(gm[i] - gm[j]) : 0.f;
        const float p1 = j + 1 <= i ? p[nt][2 * hf + 1] * expf(gm[i] - gm[j + 1]) : 0.f;
        *reinterpret_cast<uint32_t*>(Ps + i * kLdP + j) = pack(p0, p1);
      }
    }
  }
  __syncthreads();
  // dvlocT[v][j] = s sum_i dO[i][v] P[i][j]: warp w owns value rows 16 w...
  if (16 * warp >= d.VP) return;
  float acc[8][4] = {};
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    uint32_t a[4];
    load_a_km(a, dOs, ldv, 16 * warp, 16 * kb);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np > kb) break;  // P[i][j] = 0 for j > i
      uint32_t bb[4];
      load_b_kn(bb, Ps, kLdP, 16 * np, 16 * kb);
      mma(acc[2 * np], a, bb[0], bb[1]);
      mma(acc[2 * np + 1], a, bb[2], bb[3]);
    }
  }
  fast::store_acc_f32(acc, dvlocT + slot * d.dv * kC, kC, 16 * warp, 0, d.dv, kC, d.scale);
}

// The backward's prep (W, gam, T; U when asked) and dV'_loc in one grid whose blocks alternate
// between the two (x even: prep of chunk x / 2, odd: dV'_loc of it), so that prep's shared-memory-
// bound blocks and dV'_loc's memory-bound ones share the SMs instead of running one after the
// other; neither reads what the other writes.
__global__ void __launch_bounds__(kThreads, 3)
    gdr_fast_prep_dvloc_kernel(Dims d, IndexView ix, const bf16_t* __restrict__ qn,
                               const bf16_t* __restrict__ kn, const bf16_t* __restrict__ v,
                               const float* __restrict__ g, const float* __restrict__ beta,
                               const bf16_t* __restrict__ dout, bf16_t* __restrict__ W,
                               bf16_t* __restrict__ U, float* __restrict__ gam,
                               bf16_t* __restrict__ Tinv, float* __restrict__ dvlocT,
                               int dvloc_only) {
  extern __shared__ __align__(128) char smem[];
  // dvloc_only (fast_dvloc): every block a dV'_loc one, chunk x.
  const int c = static_cast<int>(dvloc_only != 0 ? blockIdx.x : blockIdx.x >> 1);
  const int h = static_cast<int>(blockIdx.y);
  if (dvloc_only == 0 && (blockIdx.x & 1u) == 0u)
    prep_chunk(d, ix, c, h, kn, v, g, beta, W, U, gam, Tinv, smem);
  else
    dvloc_chunk(d, ix, c, h, qn, kn, dout, g, dvlocT, smem);
}

// --- the state pass
// ----------------------------------------------------------------------------------
// KS splits dk over KS groups of value warps (kSplitWarps): a block has pp.nvw 16-column value
// slices (16 or 32 value columns), warp w owns slice w % nvw and the k-blocks [KBW (w / nvw),
// + KBW) of the state, KBW = 8 / KS. The only product that reduces over dk, X = S^T W^T, then needs
// a sum of KS partials per chunk: each warp writes its partial to shared memory, and after a
// barrier every warp of a column slice adds the KS partials in the same order (p = 0 .. KS-1), so
// that all of them hold bitwise the same V'. KS = 1 is the plain kernel (no exchange). A larger KS
// cuts the sequential work of each warp per chunk by KS (the pass is latency-bound when the grid
// has fewer blocks than SMs). The chunk tiles come through the ring of cuda_state_pipe.cuh (pp.ns
// deep); with pp.snap the snapshots H_c (written before the exchange barrier, copied out after it)
// and V' (written after it, copied out after the next chunk's first barrier) leave through shared
// tiles. None of this changes the arithmetic: every StatePipe gives bitwise the same results for
// one KS.
size_t state_fwd_stage_bytes(const Dims& d) {
  return 2 * tile_bytes_bf16(kC, d.KP) + tile_bytes_bf16(kC, kVB) + kVecBytes;
}
size_t state_fwd_smem(const Dims& d, int ks, const StatePipe& pp) {
  return static_cast<size_t>(pp.ns) * state_fwd_stage_bytes(d) +
         (ks > 1 ? state_red_bytes(ks) + kVecBytes : 0) +
         (pp.snap ? tile_bytes_bf16(kVB, d.KP) + tile_bytes_bf16(kVB, kC) : 0);
}

template <int KS, bool FULL>
__global__ void __launch_bounds__(kStateThreads* KS)
    gdr_fast_state_fwd_kernel(Dims dd, IndexView ix, StatePipe pp,
                              const bf16_t* __restrict__ W,   // [T, Hv, dk]
                              const bf16_t* __restrict__ kn,  // [T, Hk, dk]
                              const bf16_t* __restrict__ U,   // [T, Hv, dv]
                              const float* __restrict__ gam,  // [nt_max, Hv, 64]
                              const float* __restrict__ h0,   // [N, Hv, dk, dv] or null
                              bf16_t* __restrict__ Ht,        // [nt_max, Hv, dv, dk]
                              bf16_t* __restrict__ Vt,        // [nt_max, Hv, dv, 64]
                              float* __restrict__ hT,         // [N, Hv, dk, dv] or null
                              int* __restrict__ prog) {       // [N, Hv, nvb] or null: trailing
  constexpr int KBW = 8 / KS;                                 // k-blocks of 16 per warp
  // FULL: dk = dv = 128, as constants (no bound checks, no general staging path compiled in).
  Dims d = dd;
  if constexpr (FULL) d.dk = d.dv = d.KP = d.VP = 128;
  const int ns = pp.ns, nvw = pp.nvw, vbw = 16 * nvw;
  const int nvb = (d.VP + vbw - 1) / vbw;
  const int n = static_cast<int>(blockIdx.x) / nvb, vb = static_cast<int>(blockIdx.x) % nvb;
  const int h = static_cast<int>(blockIdx.y), kh = h / d.r;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int vwarp = warp % nvw, kq = warp / nvw, kb0 = KBW * kq;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int col0 = vb * vbw, cvalid = min(vbw, d.dv - col0);
  const int vw = col0 + 16 * vwarp;  // the warp's first value column (row of S^T)
  const int ldk = ld_of(d.KP), ldu = ld_of(kVB), nkb = d.KP / 16;
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  const size_t nsz = static_cast<size_t>(ns);
  const int64_t nk = tile_bytes_bf16(kC, d.KP) / 2, nu = tile_bytes_bf16(kC, kVB) / 2;
  bf16_t* Ws0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, d.KP));         // ns x [64, KP] W
  bf16_t* Ks0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, d.KP));         // ns x [64, KP] K
  bf16_t* Us0 = sc.take<bf16_t>(nsz * tile_bytes_bf16(kC, kVB));          // ns x [64, 32] U columns
  float* gm0 = sc.take<float>(nsz * kVecBytes);                           // ns x [64] gamma
  float4* red = KS > 1 ? sc.take<float4>(state_red_bytes(KS)) : nullptr;  // [KS, 2, 8, 32] partials
  float* decs = KS > 1 ? sc.vec() : nullptr;  // [64] the chunk's dec, once per block
  bf16_t* Hs = pp.snap ? sc.take<bf16_t>(tile_bytes_bf16(kVB, d.KP)) : nullptr;  // [32, KP] H_c
  bf16_t* Vs = pp.snap ? sc.take<bf16_t>(tile_bytes_bf16(kVB, kC)) : nullptr;    // [32, 64] V'^T
  sc.done();

  const int bos = ix.bos[n], eos = ix.bos[n + 1], c0 = ix.chunk0[n], c1 = ix.chunk0[n + 1];
  const int nch = c1 - c0;
  // Trailing output (fast_state_output): this block's count of finished chunks, and the output
  // kernel may start now (it waits for each chunk's count, never for the grid).
  int* const myprog =
      prog != nullptr ? prog + (static_cast<int64_t>(n) * d.Hv + h) * nvb + vb : nullptr;
  if (myprog != nullptr) pdl_launch_dependents();
  const int64_t ldW = static_cast<int64_t>(d.Hv) * d.dk, ldK = static_cast<int64_t>(d.Hk) * d.dk;
  const int64_t ldU = static_cast<int64_t>(d.Hv) * d.dv;
  // This thread's staging pieces, fixed for the pass (no division per chunk).
  const RowPieces pk = row_pieces<bf16_t>(d.KP / 8), pu = row_pieces<bf16_t>(2 * nvw);
  const RowPieces pv = row_pieces<bf16_t>(kC / 8);
  const bool kcol = pk.c < d.dk, ucol = pu.c < cvalid;
  // The copy-out needs the exchange's barrier (KS > 1) and whole-row pieces (the host checks both).
  const bool snap = KS > 1 && pp.snap != 0 && (FULL || pk.ok);
  const bf16_t* Wb = W + (static_cast<int64_t>(bos) * d.Hv + h) * d.dk;  // row 0 of the document
  const bf16_t* Kb = kn + (static_cast<int64_t>(bos) * d.Hk + kh) * d.dk;
  const bf16_t* Ub = U + (static_cast<int64_t>(bos) * d.Hv + h) * d.dv + col0;
  // Stages the document's i-th chunk into buffer b = i % ns; one cp.async group per call, empty
  // past the last chunk (cuda_state_pipe.cuh: the group accounting).
  auto stage = [&](int i, int b) {
    if (i < nch) {
      const int L = min(kC, eos - (bos + i * kC));
      const int64_t r0 = static_cast<int64_t>(i) * kC;
      if (FULL || pk.ok) {
        stage_rows(Ws0 + b * nk, ldk, Wb + r0 * ldW, ldW, L, kC, kcol, pk);
        stage_rows(Ks0 + b * nk, ldk, Kb + r0 * ldK, ldK, L, kC, kcol, pk);
      } else {
        stage_tile(Ws0 + b * nk, ldk, Wb + r0 * ldW, ldW, L, d.dk, kC, d.KP, true);
        stage_tile(Ks0 + b * nk, ldk, Kb + r0 * ldK, ldK, L, d.dk, kC, d.KP, true);
      }
      stage_rows(Us0 + b * nu, ldu, Ub + r0 * ldU, ldU, L, kC, ucol, pu);
      stage_gamma(gm0 + b * (kVecBytes / 4), gam + (static_cast<int64_t>(c0 + i) * d.Hv + h) * kC);
    }
    cp_async_commit();
  };

  // S^T rows vw + (g8, g8 + 8), columns 16 kb0 + 8 j + 2 t4 (+1): S[j][e] (cuda_mma.cuh's C
  // layout).
  float S[2 * KBW][4];
  const int64_t sd = static_cast<int64_t>(d.dk) * d.dv;
  const int64_t state_off = (static_cast<int64_t>(n) * d.Hv + h) * sd;
#pragma unroll
  for (int j = 0; j < 2 * KBW; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vv = vw + c_row(e), k = 16 * kb0 + 8 * j + c_col(e);
      S[j][e] = h0 != nullptr && vv < d.dv && k < d.dk
                    ? h0[state_off + static_cast<int64_t>(k) * d.dv + vv]
                    : 0.f;
    }
  }

  for (int i = 0; i + 1 < ns; ++i) stage(i, i);
  for (int i = 0, b = 0; i < nch; ++i, b = b + 1 == ns ? 0 : b + 1) {  // b = i % ns
    const int c = c0 + i;
    const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
    cp_async_wait_pending(ns - 2);
    __syncthreads();  // chunk i staged and visible; every warp is done with chunk i - 1's buffer,
                      // red and the previous V' tile
    // Chunks 0 .. i - 2 are in Ht and Vt (V' of chunk i - 1 may still be in Vs): published every
    // kPublishEvery chunks, by one thread after the barrier that ordered every thread's stores.
    if (myprog != nullptr && tid == 0 && i >= 2 && i % kPublishEvery == 0)
      publish_count(myprog, i - 1);
    stage(i + ns - 1, b == 0 ? ns - 1 : b - 1);  // the buffer chunk i - 1 used
    if (snap && i > 0)  // V' of the previous chunk, written before the barrier above
      store_rows(Vt + (slot - d.Hv) * d.dv * kC + static_cast<int64_t>(col0) * kC, kC, Vs, kLdP,
                 cvalid, true, pv);
    const bf16_t* Ws = Ws0 + b * nk;
    const bf16_t* Ks = Ks0 + b * nk;
    const bf16_t* Us = Us0 + b * nu;
    const float* gm = gm0 + b * (kVecBytes / 4);
    const float glast = gm[kC - 1];
    // dec_t = e^{gamma_63 - gamma_t} once per block instead of once per warp (the same expf of the
    // same argument: bitwise what every warp computed); read after the exchange's barrier, and
    // rewritten only after the next loop-head barrier.
    if (KS > 1 && tid < kC) decs[tid] = expf(glast - gm[tid]);

    // bf16(S^T): the snapshot H_c and the A operand of S^T W^T.
    uint32_t sa[KBW][4];
    bf16_t* Hc = Ht + slot * sd;  // [dv, dk]
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
          *reinterpret_cast<uint32_t*>(Hc + static_cast<int64_t>(col0 + vl) * d.dk + k) =
              sa[kbl][q];
      }
    }
    // X = S^T W^T [16, 64 tokens] (this warp's k-blocks, then the sum of the KS partials).
    float x[8][4] = {};
#pragma unroll
    for (int kbl = 0; kbl < KBW; ++kbl) {
      const int kb = kb0 + kbl;
      if (kb >= nkb) break;
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bb[4];
        load_b_nk(bb, Ws, ldk, 16 * np, 16 * kb);
        mma(x[2 * np], sa[kbl], bb[0], bb[1]);
        mma(x[2 * np + 1], sa[kbl], bb[2], bb[3]);
      }
    }
    if constexpr (KS > 1) state_exchange_sum<KS>(x, red, kq, vwarp, nvw, lane);
    if (snap)  // H_c, written before the exchange's barrier
      store_rows(Hc + static_cast<int64_t>(col0) * d.dk, d.dk, Hs, ldk, cvalid, kcol, pk);
      // V'^T = U^T - X (U^T's A fragments are exactly the positions of x's C fragments).
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      uint32_t u[4];
      load_a_km(u, Us, ldu, 16 * vwarp, 16 * kb);
      x[2 * kb][0] = lo_f(u[0]) - x[2 * kb][0];
      x[2 * kb][1] = hi_f(u[0]) - x[2 * kb][1];
      x[2 * kb][2] = lo_f(u[1]) - x[2 * kb][2];
      x[2 * kb][3] = hi_f(u[1]) - x[2 * kb][3];
      x[2 * kb + 1][0] = lo_f(u[2]) - x[2 * kb + 1][0];
      x[2 * kb + 1][1] = hi_f(u[2]) - x[2 * kb + 1][1];
      x[2 * kb + 1][2] = lo_f(u[3]) - x[2 * kb + 1][2];
      x[2 * kb + 1][3] = hi_f(u[3]) - x[2 * kb + 1][3];
    }
    // V' to Vt[c] (all 64 tokens: exact zeros past the chunk's end); the KS warps of a column slice
    // hold the same V' and write token tiles nt = kq (mod KS).
    bf16_t* Vc = Vt + slot * d.dv * kC;  // [dv, 64]
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt % KS != kq) continue;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int vl = 16 * vwarp + g8 + 8 * hf;
        const uint32_t pv2 = pack(x[nt][2 * hf], x[nt][2 * hf + 1]);
        if (snap)
          *reinterpret_cast<uint32_t*>(Vs + vl * kLdP + 8 * nt + 2 * t4) = pv2;
        else if (col0 + vl < d.dv)
          *reinterpret_cast<uint32_t*>(Vc + (col0 + vl) * kC + 8 * nt + 2 * t4) = pv2;
      }
    }
    // A operand of the update: (V' diag(dec))^T, dec_i = e^{gamma_63 - gamma_i}.
    uint32_t va[4][4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      const int ta = 16 * kb + 2 * t4, tb = ta + 8;
      float d0, d1, d2, d3;
      if constexpr (KS > 1) {
        d0 = decs[ta];
        d1 = decs[ta + 1];
        d2 = decs[tb];
        d3 = decs[tb + 1];
      } else {
        d0 = expf(glast - gm[ta]);
        d1 = expf(glast - gm[ta + 1]);
        d2 = expf(glast - gm[tb]);
        d3 = expf(glast - gm[tb + 1]);
      }
      va[kb][0] = pack(x[2 * kb][0] * d0, x[2 * kb][1] * d1);
      va[kb][1] = pack(x[2 * kb][2] * d0, x[2 * kb][3] * d1);
      va[kb][2] = pack(x[2 * kb + 1][0] * d2, x[2 * kb + 1][1] * d3);
      va[kb][3] = pack(x[2 * kb + 1][2] * d2, x[2 * kb + 1][3] * d3);
    }
    // S^T <- G_L S^T + (V' diag(dec))^T K (this warp's k-blocks only: no reduction over dk).
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
        uint32_t bb[4];
        load_b_kn(bb, Ks, ldk, 16 * np, 16 * kb);
        mma(S[2 * kbl], va[kb], bb[0], bb[1]);
        mma(S[2 * kbl + 1], va[kb], bb[2], bb[3]);
      }
    }
  }
  if (snap && nch > 0) {  // the last chunk's V'
    __syncthreads();
    store_rows(Vt + (static_cast<int64_t>(c1 - 1) * d.Hv + h) * d.dv * kC +
                   static_cast<int64_t>(col0) * kC,
               kC, Vs, kLdP, cvalid, true, pv);
  }
  if (hT != nullptr) {
#pragma unroll
    for (int j = 0; j < 2 * KBW; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int vv = vw + c_row(e), k = 16 * kb0 + 8 * j + c_col(e);
        if (vv < d.dv && k < d.dk) hT[state_off + static_cast<int64_t>(k) * d.dv + vv] = S[j][e];
      }
    }
  }
  if (myprog != nullptr) {  // every chunk and hT: the trailing output's last wait ends here
    __syncthreads();
    if (tid == 0) publish_count(myprog, nch);
  }
}

// --- output
// ------------------------------------------------------------------------------------------
size_t output_smem(const Dims& d) {
  return 2 * tile_bytes_bf16(kC, d.KP) + tile_bytes_bf16(d.VP, d.KP) + tile_bytes_bf16(d.VP, kC) +
         kVecBytes;
}

// kTrail: beside the state pass (fast_state_output): grid (Hv, chunks), so that the blocks start
// chunk by chunk in the order the pass finishes them, and H, V' staged once `prog` (the pass's
// pvb blocks of this document and head) has passed the chunk. Otherwise grid (chunks, Hv).
template <bool kTrail>
__global__ void __launch_bounds__(kThreads, 2)
    gdr_fast_output_kernel(Dims d, IndexView ix,
                           const bf16_t* __restrict__ qn,            // [T, Hk, dk]
                           const bf16_t* __restrict__ kn,            // [T, Hk, dk]
                           const bf16_t* __restrict__ Ht,            // [nt_max, Hv, dv, dk]
                           const bf16_t* __restrict__ Vt,            // [nt_max, Hv, dv, 64]
                           const float* __restrict__ gam,            // [nt_max, Hv, 64]
                           bf16_t* __restrict__ o,                   // [T, Hv, dv]
                           const int* __restrict__ prog, int pvb) {  // kTrail: [N, Hv, pvb]
  const int c = static_cast<int>(kTrail ? blockIdx.y : blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(kTrail ? blockIdx.x : blockIdx.y), kh = h / d.r, L = ci.len;
  const int64_t t0 = ci.t0;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g8 = lane >> 2;
  const int ldk = ld_of(d.KP), nkb = d.KP / 16;
  extern __shared__ __align__(128) char smem[];
  SmemCarver sc(smem);
  bf16_t* Qs = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));    // [64, KP] Q
  bf16_t* Ks = sc.take<bf16_t>(tile_bytes_bf16(kC, d.KP));    // [64, KP] K
  bf16_t* Hs = sc.take<bf16_t>(tile_bytes_bf16(d.VP, d.KP));  // [VP, KP] H_c^T
  bf16_t* Vs = sc.take<bf16_t>(tile_bytes_bf16(d.VP, kC));    // [VP, 64] V'^T
  float* gm = sc.vec();                                       // [64] gamma
  sc.done();

  const int64_t ldq = static_cast<int64_t>(d.Hk) * d.dk;
  const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
  stage_tile(Qs, ldk, qn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  stage_tile(Ks, ldk, kn + (t0 * d.Hk + kh) * d.dk, ldq, L, d.dk, kC, d.KP, true);
  stage_gamma(gm, gam + slot * kC);
  if constexpr (kTrail) {  // Q, K and gamma are in flight; H and V' once the pass is past c
    cp_async_commit();
    if (tid < pvb) {
      const int* p = prog + (static_cast<int64_t>(ci.doc) * d.Hv + h) * pvb + tid;
      while (acquire_count(p) <= ci.idx) __nanosleep(200);
    }
    __syncthreads();
  }
  stage_tile(Hs, ldk, Ht + slot * d.dv * d.dk, static_cast<int64_t>(d.dk), d.dv, d.dk, d.VP, d.KP,
             true);
  stage_tile(Vs, kLdP, Vt + slot * d.dv * kC, static_cast<int64_t>(kC), d.dv, kC, d.VP, kC, true);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // Warp (mt, nh): rows 16 mt.., value columns 64 nh.. (no barrier below: idle warps may leave).
  const int mt = warp & 3, nh = warp >> 2;
  if (64 * nh >= d.VP) return;
  uint32_t qa[8][4];
#pragma unroll
  for (int kb = 0; kb < 8; ++kb)
    if (kb < nkb) load_a_mk(qa[kb], Qs, ldk, 16 * mt, 16 * kb);
  // P = Q K^T .* D on j <= i: column blocks past mt are masked out entirely.
  uint32_t pa[4][4];
  masked_qk_a(pa, qa, Ks, ldk, gm, mt, nkb);
  // O = diag(G) Q H_c + P V'.
  float acc[8][4] = {};
#pragma unroll
  for (int kb = 0; kb < 8; ++kb) {
    if (kb >= nkb) break;
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (64 * nh + 16 * np >= d.VP) break;
      uint32_t bb[4];
      load_b_nk(bb, Hs, ldk, 64 * nh + 16 * np, 16 * kb);
      mma(acc[2 * np], qa[kb], bb[0], bb[1]);
      mma(acc[2 * np + 1], qa[kb], bb[2], bb[3]);
    }
  }
  const float G0 = expf(gm[16 * mt + g8]), G1 = expf(gm[16 * mt + g8 + 8]);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    acc[nt][0] *= G0;
    acc[nt][1] *= G0;
    acc[nt][2] *= G1;
    acc[nt][3] *= G1;
  }
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    if (kb > mt) break;
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (64 * nh + 16 * np >= d.VP) break;
      uint32_t bb[4];
      load_b_nk(bb, Vs, kLdP, 64 * nh + 16 * np, 16 * kb);
      mma(acc[2 * np], pa[kb], bb[0], bb[1]);
      mma(acc[2 * np + 1], pa[kb], bb[2], bb[3]);
    }
  }
  fast::store_acc_bf16(acc, o + (t0 * d.Hv + h) * d.dv, static_cast<int64_t>(d.Hv) * d.dv, 16 * mt,
                       64 * nh, L, d.dv, d.scale);
}

std::atomic<int> g_state_split{0};  // gdr_set_state_split's override; 0 = automatic

}  // namespace

int state_split(int64_t blocks) {
  const int forced = g_state_split.load(std::memory_order_relaxed);
  if (forced != 0) return forced;
  return blocks <= cuda::Context::get().sm_count() ? 4 : 1;
}

StatePipe state_pipe(const Dims& d, int ks, int64_t blocks32, int ns_max,
                     size_t (*smem)(const Dims&, int, const StatePipe&), size_t leave) {
  const int per_row = d.KP / 8;  // 16-byte pieces of a dk row: whole-row pieces need per_row | 32
  const bool rows_ok = 32 % per_row == 0;
  const cudaDeviceProp& props = cuda::Context::get().props();
  // 16-column blocks (twice the blocks, half the warps each) when the doubled grid still fits the
  // SMs with a dk split: one document at Hv = 16 (64 -> 128 blocks on 132 SMs) ran 8% faster
  // forward and backward on an H200; past one wave they cost a second one.
  const bool cols16 = ks > 1 && 2 * blocks32 <= static_cast<int64_t>(props.multiProcessorCount);
  StatePipe pp{2, cols16 ? 1 : 2, 0, 1};
  pp.snap = ks > 1 && rows_ok ? 1 : 0;
  // Shared memory per block: the opt-in cap, and the share of an SM that lets all of the grid's
  // blocks be resident at once (ceil(blocks / SMs) per SM), so that a deeper
  // ring never costs a second wave; the old shape (2 buffers, direct snapshots, dV'_loc in
  // registers) is the floor.
  const int nvb32 = (d.VP + 31) / 32, nvbw = (d.VP + 16 * pp.nvw - 1) / (16 * pp.nvw);
  const int64_t blocks = blocks32 / nvb32 * nvbw;
  const int64_t per_sm = std::max<int64_t>(
      1, (blocks + props.multiProcessorCount - 1) / std::max(1, props.multiProcessorCount));
  const size_t sm = static_cast<size_t>(props.sharedMemPerMultiprocessor);
  const size_t cap = std::min(static_cast<size_t>(props.sharedMemPerBlockOptin),
                              (sm > leave ? sm - leave : 0) / static_cast<size_t>(per_sm) -
                                  static_cast<size_t>(props.reservedSharedMemPerBlock));
  for (int ns = ns_max;; --ns) {
    pp.ns = ns;
    if (ns <= 2 || smem(d, ks, pp) <= cap) break;
  }
  if (smem(d, ks, pp) > cap) pp.snap = 0;
  if (smem(d, ks, pp) > cap) pp.dls = 0;
  return pp;
}

// --- launchers ----------------------------------------------------------------------------------
void fast_prep(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
               const float* g, const float* beta, bf16_t* W, bf16_t* U, float* gam, bf16_t* Tinv,
               cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = prep_smem(d, U != nullptr);
  allow_smem(reinterpret_cast<const void*>(&gdr_fast_prep_kernel), smem, "gdr_fast_prep_kernel",
             d.dk, d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_fast_prep_kernel"), static_cast<unsigned>(d.Hv));
  gdr_fast_prep_kernel<<<grid, kThreads, smem, s>>>(d, ix, kn, v, g, beta, W, U, gam, Tinv);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_prep_kernel");
}

void fast_prep_dvloc(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                     const bf16_t* v, const float* g, const float* beta, const bf16_t* dout,
                     bf16_t* W, bf16_t* U, float* gam, bf16_t* Tinv, float* dvlocT,
                     cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = std::max(prep_smem(d, U != nullptr), dvloc_smem(d));
  allow_smem(reinterpret_cast<const void*>(&gdr_fast_prep_dvloc_kernel), smem,
             "gdr_fast_prep_dvloc_kernel", d.dk, d.dv);
  const dim3 grid(grid_x(2 * d.nt_max, "gdr_fast_prep_dvloc_kernel"), static_cast<unsigned>(d.Hv));
  gdr_fast_prep_dvloc_kernel<<<grid, kThreads, smem, s>>>(d, ix, qn, kn, v, g, beta, dout, W, U,
                                                          gam, Tinv, dvlocT, 0);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_prep_dvloc_kernel");
}

void fast_dvloc(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                const float* g, const bf16_t* dout, float* dvlocT, cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = dvloc_smem(d);
  allow_smem(reinterpret_cast<const void*>(&gdr_fast_prep_dvloc_kernel), smem,
             "gdr_fast_prep_dvloc_kernel", d.dk, d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_fast_prep_dvloc_kernel"), static_cast<unsigned>(d.Hv));
  gdr_fast_prep_dvloc_kernel<<<grid, kThreads, smem, s>>>(
      d, ix, qn, kn, nullptr, g, nullptr, dout, nullptr, nullptr, nullptr, nullptr, dvlocT, 1);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_prep_dvloc_kernel");
}

namespace {

using StateFwdKernel = void (*)(Dims, IndexView, StatePipe, const bf16_t*, const bf16_t*,
                                const bf16_t*, const float*, const float*, bf16_t*, bf16_t*, float*,
                                int*);

// The state pass's kernel for a split: the constant-shape ones at dk = dv = 128 (ks 1, 4, 8).
StateFwdKernel state_fwd_kernel(int ks, bool full) {
  if (ks == 8)
    return full ? &gdr_fast_state_fwd_kernel<8, true> : &gdr_fast_state_fwd_kernel<8, false>;
  if (ks == 4)
    return full ? &gdr_fast_state_fwd_kernel<4, true> : &gdr_fast_state_fwd_kernel<4, false>;
  if (ks == 2) return &gdr_fast_state_fwd_kernel<2, false>;
  return full ? &gdr_fast_state_fwd_kernel<1, true> : &gdr_fast_state_fwd_kernel<1, false>;
}

// A state pass launch: its split, pipeline, grid and value-column blocks per (document, head).
struct StateFwdPlan {
  int ks, nvb;
  StatePipe pp;
  dim3 grid;
  unsigned threads;
  size_t smem;
  StateFwdKernel kernel;
};
StateFwdPlan plan_state_fwd(const Dims& d, size_t leave) {
  StateFwdPlan p{};
  const int64_t blocks32 = static_cast<int64_t>(d.N) * ((d.VP + kVB - 1) / kVB);
  p.ks = state_split(blocks32 * d.Hv);
  p.pp = state_pipe(d, p.ks, blocks32 * d.Hv, 4, &state_fwd_smem, leave);
  const int vbw = 16 * p.pp.nvw;
  p.nvb = (d.VP + vbw - 1) / vbw;
  p.smem = state_fwd_smem(d, p.ks, p.pp);
  p.grid = dim3(grid_x(static_cast<int64_t>(d.N) * p.nvb, "gdr_fast_state_fwd_kernel"),
                static_cast<unsigned>(d.Hv));
  p.threads = static_cast<unsigned>(32 * p.pp.nvw * p.ks);
  p.kernel = state_fwd_kernel(p.ks, d.dk == 128 && d.dv == 128);
  return p;
}
void launch_state_fwd(const StateFwdPlan& p, const Dims& d, const IndexView& ix, const bf16_t* W,
                      const bf16_t* kn, const bf16_t* U, const float* gam, const float* h0,
                      bf16_t* Ht, bf16_t* Vt, float* hT, int* prog, cudaStream_t s) {
  allow_smem(reinterpret_cast<const void*>(p.kernel), p.smem, "gdr_fast_state_fwd_kernel", d.dk,
             d.dv);
  p.kernel<<<p.grid, p.threads, p.smem, s>>>(d, ix, p.pp, W, kn, U, gam, h0, Ht, Vt, hT, prog);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_state_fwd_kernel");
}

// Registers a block of `threads` threads of this kernel takes on an SM (allocated per warp in
// units of 256: the per-thread count rounded up to 8). The count is read once per kernel and
// process: every forward asks.
int64_t block_regs(const void* kernel, unsigned threads) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> per_thread;
  int regs = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = per_thread.find(kernel);
    if (it == per_thread.end()) {
      cudaFuncAttributes fa{};
      GDN_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
      it = per_thread.emplace(kernel, fa.numRegs).first;
    }
    regs = it->second;
  }
  return static_cast<int64_t>((regs + 7) / 8 * 8) * 32 * ((threads + 31) / 32);
}

}  // namespace

void fast_state_fwd(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* kn,
                    const bf16_t* U, const float* gam, const float* h0, bf16_t* Ht, bf16_t* Vt,
                    float* hT, cudaStream_t s) {
  launch_state_fwd(plan_state_fwd(d, 0), d, ix, W, kn, U, gam, h0, Ht, Vt, hT, nullptr, s);
}

void fast_output(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                 const bf16_t* Ht, const bf16_t* Vt, const float* gam, bf16_t* o, cudaStream_t s) {
  if (d.nt_max == 0) return;
  const size_t smem = output_smem(d);
  allow_smem(reinterpret_cast<const void*>(&gdr_fast_output_kernel<false>), smem,
             "gdr_fast_output_kernel", d.dk, d.dv);
  const dim3 grid(grid_x(d.nt_max, "gdr_fast_output_kernel"), static_cast<unsigned>(d.Hv));
  gdr_fast_output_kernel<false>
      <<<grid, kThreads, smem, s>>>(d, ix, qn, kn, Ht, Vt, gam, o, nullptr, 0);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_output_kernel");
}

size_t fast_trail_prog_bytes(const Dims& d) {
  return static_cast<size_t>(d.N) * static_cast<size_t>(d.Hv) * static_cast<size_t>(d.VP / 16) *
         sizeof(int);
}

namespace {

// The state pass's plan for fast_state_output, and whether the output runs beside it.
bool plan_trail(const Dims& d, bool have_prog, StateFwdPlan* plan) {
  const cudaDeviceProp& props = cuda::Context::get().props();
  const size_t out_smem = output_smem(d);
  const size_t reserved = static_cast<size_t>(props.reservedSharedMemPerBlock);
  // Only while the pass's blocks (one per SM: ks > 1) leave SMs idle, the output grid's
  // (Hv, chunks) shape fits, and a block of each fits an SM together.
  bool trail = have_prog && d.nt_max > 0 && d.nt_max <= 65535 &&
               state_split(static_cast<int64_t>(d.N) * ((d.VP + kVB - 1) / kVB) * d.Hv) > 1;
  *plan = plan_state_fwd(d, trail ? out_smem + reserved : 0);
  if (trail) {
    const int64_t regs =
        block_regs(reinterpret_cast<const void*>(plan->kernel), plan->threads) +
        block_regs(reinterpret_cast<const void*>(&gdr_fast_output_kernel<true>), kThreads);
    trail = plan->smem + out_smem + 2 * reserved <=
                static_cast<size_t>(props.sharedMemPerMultiprocessor) &&
            regs <= props.regsPerMultiprocessor &&
            static_cast<int>(plan->threads) + kThreads <= props.maxThreadsPerMultiProcessor;
    if (!trail) *plan = plan_state_fwd(d, 0);
  }
  return trail;
}

}  // namespace

void fast_state_output(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* qn,
                       const bf16_t* kn, const bf16_t* U, const float* gam, const float* h0,
                       bf16_t* Ht, bf16_t* Vt, float* hT, bf16_t* o, int* prog, cudaStream_t s) {
  StateFwdPlan p{};
  if (!plan_trail(d, prog != nullptr, &p)) {
    launch_state_fwd(p, d, ix, W, kn, U, gam, h0, Ht, Vt, hT, nullptr, s);
    fast_output(d, ix, qn, kn, Ht, Vt, gam, o, s);
    return;
  }
  GDN_CUDA_CHECK(cudaMemsetAsync(prog, 0, fast_trail_prog_bytes(d), s));
  launch_state_fwd(p, d, ix, W, kn, U, gam, h0, Ht, Vt, hT, prog, s);
  void (*const out_kernel)(Dims, IndexView, const bf16_t*, const bf16_t*, const bf16_t*,
                           const bf16_t*, const float*, bf16_t*, const int*, int) =
      &gdr_fast_output_kernel<true>;
  const size_t out_smem = output_smem(d);
  allow_smem(reinterpret_cast<const void*>(out_kernel), out_smem, "gdr_fast_output_kernel", d.dk,
             d.dv);
  cuda::launch_pdl_smem(
      out_kernel, dim3(static_cast<unsigned>(d.Hv), static_cast<unsigned>(d.nt_max)),
      dim3(kThreads), out_smem, s, d, ix, qn, kn, static_cast<const bf16_t*>(Ht),
      static_cast<const bf16_t*>(Vt), gam, o, static_cast<const int*>(prog), p.nvb);
  GDN_CUDA_LAUNCH_CHECK("gdr_fast_output_kernel (trailing)");
}

}  // namespace gdn::ops::gdr

namespace gdn::ops {

void gdr_set_state_split(int ks) {
  GDN_CHECK(ks == 0 || ks == 1 || ks == 2 || ks == 4 || ks == 8,
            "gated_delta_rule (cuda): state split {} is not one of 0 (automatic), 1, 2, 4, 8", ks);
  gdr::g_state_split.store(ks, std::memory_order_relaxed);
}

bool gdr_trailing_output_for(int64_t T, int64_t N, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv) {
  GDN_CHECK(T >= 0 && N >= 1 && Hk >= 1 && Hv >= Hk && Hv % Hk == 0 && dk % 8 == 0 && dv % 8 == 0 &&
                dk >= 8 && dk <= 128 && dv >= 8 && dv <= 128,
            "gdr_trailing_output_for: no fast-route batch of T {} N {} Hk {} Hv {} dk {} dv {}", T,
            N, Hk, Hv, dk, dv);
  gdr::Dims d{};
  d.T = static_cast<int>(T);
  d.N = static_cast<int>(N);
  d.Hk = static_cast<int>(Hk);
  d.Hv = static_cast<int>(Hv);
  d.r = d.Hv / d.Hk;
  d.dk = static_cast<int>(dk);
  d.dv = static_cast<int>(dv);
  d.KP = gdr::pad16(d.dk);
  d.VP = gdr::pad16(d.dv);
  d.nt_max = gdr_max_chunks(T, N);
  d.vec = true;
  gdr::StateFwdPlan p{};
  return gdr::plan_trail(d, true, &p);
}

int gdr_state_split_for(int64_t N, int64_t Hv, int64_t dv) {
  const int64_t nvb = (gdr::pad16(static_cast<int>(dv)) + gdr::kVB - 1) / gdr::kVB;
  return gdr::state_split(N * nvb * Hv);
}

}  // namespace gdn::ops
