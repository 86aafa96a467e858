// Gated attention on Hopper, "cuda.sm90_tma": the three attention kernels (forward, dk/dv, dq) on
// the wgmma products of sm90_pipe.cuh, with their tiles brought in by a producer warp
// through TMA (cp.async.bulk.tensor) into slots guarded by mbarriers, FlashAttention-3's warp
// specialization (Shah et al. 2024, §3.1; the roles and the full / empty barrier pairs follow
// CUTLASS's PipelineTmaAsync, include/cutlass/pipeline/sm90_pipeline.hpp, read, not copied). The
// two consumer warpgroups never meet at a block barrier: each waits on the "full" mbarrier of the
// tile it needs and signals the "empty" one of a tile it has finished reading, so they drift
// freely, and no consumer thread spends issue slots or registers on copies. The products, masking,
// order of accumulation and epilogues are sm90_pipe.cuh's.
//
// TMA and the wgmma tiles: a tensor map over [T, H, hd] (dims {hd, H, T}, box {64, 1, R},
// CU_TENSOR_MAP_SWIZZLE_128B) writes R rows of 128 bytes with the 16-byte chunk j of row r at
// r · 128 + ((j ^ (r % 8)) · 16) from a 1024-byte-aligned destination: exactly one column block of
// TileL<R, HD> (sm90_wgmma.cuh), so one copy per 64 columns fills a tile the descriptors read
// unchanged. Columns hd .. HD-1 (padded head dims) and rows past T lie outside the tensor and are
// zero-filled by the TMA unit; rows past a document's end but inside T are the next document's
// (a tensor map cannot end at a document): keys there are masked by the causal mask (key > every
// query of the document), so their P is exactly 0 and P·V adds exact zeros, and query rows there
// are computed but never written. Every output row is therefore bit-identical to cuda.flash's
// (same products in the same order; the tests and bench/cuda_bench_attn_kernels check it).
#pragma once

#include <cuda.h>  // CUtensorMap (the type only: the tensor maps are encoded through the runtime)

#include "ops/gated_attention/sm90_pipe.cuh"

namespace gdn::ops::attn {

// --- mbarrier and TMA (PTX ISA, "Parallel Synchronization and Communication Instructions:
// mbarrier" and "cp.async.bulk.tensor") ---------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
// Makes the initialized barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Arrives and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` has completed (phases alternate 0, 1, 0, ... from 0).
// try_wait suspends the thread for a while in hardware before it answers false. A wait that is
// still not over after 2^30 tries (many seconds) is a protocol bug: trap instead of hanging. (The
// loop is PTX: written as a C++ loop around try_wait it made ptxas spill the HD = 256 consumers.)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .u32 n;\n"
      "mov.u32 n, 0;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra DONE;\n"
      "add.u32 n, n, 1;\n"
      "setp.eq.u32 p, n, 1073741824;\n"
      "@p trap;\n"
      "bra WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Box {c0, c1, c2} of the 3-D tensor map `map` (a __grid_constant__ kernel parameter) into shared
// `dst`; completion is counted in bytes on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}

// Rows row0 .. row0+ROWS-1 of head `head` as a TileL<ROWS, HD> tile at dst: arrives on `bar`
// expecting the whole tile (out-of-tensor elements count too) and issues one copy per 64 columns.
template <int ROWS, int HD>
__device__ __forceinline__ void tma_tile(bf16_t* dst, const CUtensorMap* map, uint64_t* bar,
                                         int head, int row0) {
  mbar_arrive_expect_tx(bar, static_cast<uint32_t>(ROWS * HD * sizeof(bf16_t)));
#pragma unroll
  for (int b = 0; b < HD / 64; ++b) tma_load_3d(dst + b * ROWS * 64, map, bar, b * 64, head, row0);
}

// The forward's tensor maps: q_hat [T, Hq, hd] in boxes of kBigTile rows, k_hat and v
// [T, Hkv, hd] in boxes of kFwdKeys rows, 64 columns each.
struct FwdMaps {
  CUtensorMap q, k, v;
};

// Two consumer warpgroups (warps 0-7) and a producer warpgroup (warps 8-11, one lane of which
// issues the copies). A whole producer warpgroup, not one warp: an SM sub-partition holds 16K
// registers and takes every fourth warp, so with 9 warps one of them holds 3 and ptxas caps every
// thread at 168 registers (the consumers need ~216 at HD = 256: 168 spills). With 12 warps the
// producer warpgroup gives its registers up (setmaxnreg.dec to 24) and the consumers take them
// (setmaxnreg.inc to 240): 32 · (240 + 240 + 24) = 16128 <= 16384 per sub-partition.
constexpr int kTmaThreads = kThreads + 128;
constexpr int kTmaProducerRegs = 24, kTmaConsumerRegs = 240;

// setmaxnreg: every warp of the warpgroup executes it (.sync.aligned), with a constant count.
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

template <int HD>
constexpr size_t fwd_tma_smem_bytes() {  // the sm90_pipe.cuh tiles + 9 mbarriers
  return fwd_pipe_smem_bytes<HD>() + 9 * sizeof(uint64_t);
}
static_assert(fwd_tma_smem_bytes<256>() <= 227 * 1024, "forward (TMA) shared memory");

// Forward, warp-specialized. Block-to-tile map, products (fwd_tile_products, online_softmax_tile),
// order of accumulation, masking and epilogue as the mma.sync forward's (cuda_fwd.cuh); what
// differs is who loads and how the tiles are handed over:
//   producer (warp 8, one lane; warps 9-11 only give their registers up): Q, K_0, then per step i:
//   K_{i+1} into slot (i+1) % 2 once the
//     consumers released K_{i-1}, V_i into slot i % 2 once they released V_{i-2};
//   consumers (warps 0-7, warpgroup w = rows 64w .. 64w+63): step jt waits for K_jt and V_{jt-1}
//     ("full" barriers, one producer arrival + the bytes), releases K_jt once S_jt = Q K_jtᵀ is
//     done and V_{jt-1} once O += P_{jt-1} V_{jt-1} is ("empty" barriers, one arrival per warp).
// Slot s of K (or V) holds tiles s, s + 2, ...: tile i is the (i / 2)-th fill of its slot, so the
// consumers wait for parity (i / 2) % 2 of its full barrier and the producer, before refilling the
// slot with tile i >= 2, for parity (i / 2 - 1) % 2 of its empty barrier (tile i - 2 released).
template <int HD>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attn_fwd_tma_kernel(const FwdParams p, const __grid_constant__ FwdMaps maps) {
  constexpr int BM = kBigTile, BN = kFwdKeys;
  using LB = TileL<BM, HD>;                               // Q
  using LN = TileL<BN, HD>;                               // K, V
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem_1k());  // [BM x HD] swizzled
  bf16_t* sK = sQ + BM * HD;                              // [2][BN x HD]
  bf16_t* sV = sK + 2 * BN * HD;                          // [2][BN x HD]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * BN * HD);
  uint64_t* full_q = bars;       // Q loaded
  uint64_t* full_k = bars + 1;   // [2] K slot loaded
  uint64_t* full_v = bars + 3;   // [2] V slot loaded
  uint64_t* empty_k = bars + 5;  // [2] K slot read by every consumer warp
  uint64_t* empty_v = bars + 7;  // [2] V slot read by every consumer warp

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  QueryTile qt;  // block -> (query head, tile), longest tiles first
  if (!query_tile<BM, BN>(p, qt)) return;
  const int h = qt.h, j = qt.j, q0 = qt.q0, q_end = qt.q_end, nk = qt.nk;
  const Doc d = qt.d;

  if (tid == 0) {
    mbar_init(full_q, 1);
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_k + s, 1);
      mbar_init(full_v + s, 1);
      mbar_init(empty_k + s, kWarps);
      mbar_init(empty_v + s, kWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the last block barrier: from here on the roles only meet at mbarriers

  if (warp >= kWarps) {  // producer warpgroup
    setmaxnreg_dec<kTmaProducerRegs>();
    if (warp == kWarps && lane == 0) {
      tma_tile<BM, HD>(sQ, &maps.q, full_q, h, q0);
      tma_tile<BN, HD>(sK, &maps.k, full_k, j, d.b);
      for (int i = 0; i < nk; ++i) {
        if (i + 1 < nk) {
          const int s = (i + 1) & 1;
          if (i + 1 >= 2) mbar_wait(empty_k + s, static_cast<uint32_t>(((i + 1) >> 1) - 1) & 1u);
          tma_tile<BN, HD>(sK + s * BN * HD, &maps.k, full_k + s, j, d.b + (i + 1) * BN);
        }
        const int s = i & 1;
        if (i >= 2) mbar_wait(empty_v + s, static_cast<uint32_t>((i >> 1) - 1) & 1u);
        tma_tile<BN, HD>(sV + s * BN * HD, &maps.v, full_v + s, j, d.b + i * BN);
      }
    }
    return;  // the consumers wait for every copy, so the block outlives them
  }

  setmaxnreg_inc<kTmaConsumerRegs>();
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
  mbar_wait(full_q, 0);

  for (int jt = 0; jt < nk; ++jt) {
    mbar_wait(full_k + (jt & 1), static_cast<uint32_t>(jt >> 1) & 1u);  // K_jt
    if (jt > 0) mbar_wait(full_v + ((jt + 1) & 1), static_cast<uint32_t>((jt - 1) >> 1) & 1u);
    const unsigned char* Vp =  // V_{jt-1}
        reinterpret_cast<const unsigned char*>(sV + ((jt + 1) & 1) * BN * HD);
    const unsigned char* K = reinterpret_cast<const unsigned char*>(sK + (jt & 1) * BN * HD);
    const int k0 = d.b + jt * BN;
    float s[BN / 2];
    fwd_tile_products<BN, HD, LB, LN>(s, acc, pa, qrows, K, Vp, jt > 0);
    float x[BN / 2];
    take_acc(s, x);
    if (lane == 0) mbar_arrive(empty_k + (jt & 1));  // this warp is done with K_jt

    // Scale, causal mask (only tiles reaching past the first query), online softmax.
    float alpha[2];
    online_softmax_tile<BN>(x, p.scale_log2, k0 + BN - 1 > q0, k0, c, t0, t1, m_run, l_run, alpha);

    // O += P_{jt-1} V_{jt-1} is done. Unconditional (a no-op at jt = 0): behind `if (jt > 0)`
    // ptxas cannot tell that no group is pending on the other path and serializes every wgmma of
    // the kernel (C7513).
    wgmma_wait<0>();
    reg_fence(acc);
    reg_fence_u(pa);
    if (jt > 0 && lane == 0) mbar_arrive(empty_v + ((jt + 1) & 1));  // done with V_{jt-1}
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < HD / 2; ++i) acc[i] *= alpha[(i >> 1) & 1];
    }
    acc_to_a<BN>(x, pa);
  }
  {  // the last O += P V
    mbar_wait(full_v + ((nk - 1) & 1), static_cast<uint32_t>((nk - 1) >> 1) & 1u);
    rs_product_wait<BN, HD, LN>(
        acc, pa, reinterpret_cast<const unsigned char*>(sV + ((nk - 1) & 1) * BN * HD));
  }

  // Epilogue: normalise, gate, write the rows inside the document.
  fwd_epilogue<HD>(
      p, [&](int nt, int e) { return acc[4 * nt + e]; }, m_run, l_run, t0, t1, q_end, h, c);
}

// The dk/dv kernel's tensor maps, boxes of kSmallTile rows: q_hat and dA [T, Hq, ·] (the items),
// k_hat and v [T, Hkv, hd] (the block's key tile).
struct DkdvMaps {
  CUtensorMap q, a, k, v;
};

template <int HD>
constexpr size_t dkdv_tma_smem_bytes() {  // K, V; Q, dA [2]; Pᵀ fp32 [2][64 x 64]; lse, D [2][64]
  return sizeof(bf16_t) * HD * 6 * kSmallTile + sizeof(float) * 2 * kSmallTile * kSmallTile +
         sizeof(float) * 4 * kSmallTile + 5 * sizeof(uint64_t) + 1024;
}
static_assert(dkdv_tma_smem_bytes<256>() <= 227 * 1024, "dk/dv (TMA) shared memory");

// dk/dv, warp-specialized: the items of cuda_bwd.cuh's dk/dv kernel, with sm90_pipe.cuh's products
// (dkdv_first/second_product), Pᵀ hand-over and epilogue, each warpgroup issuing the first product
// of item it+1 before it waits for the second of item it (FlashAttention-3's intra-warpgroup
// overlap, Shah et al. 2024, §3.2, across items), with the producer warp loading
// K and V once and, per item, Q and dA (TMA) and lse · log2e and D (all 32 lanes, plain loads) into
// slot it % 2, and mbarriers in place of block barriers: each consumer warp waits for
// the "full" barrier of item it+1 before its first product and arrives on the "empty" barrier of
// item it's slot once its second product of item it is done. The slot turns over only when all
// eight warps are past item it, which also orders the Pᵀ hand-over: Pᵀ is double-buffered by item
// parity (sP[it % 2], named barrier 1 + it % 2), and warpgroup 0 rewrites sP[it % 2] for item it+2
// only after that item's tiles arrived, i.e. after warpgroup 1 released item it, whose Pᵀ it read
// before its second product.
template <int HD>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attn_bwd_dkdv_tma_kernel(const BwdParams p, const __grid_constant__ DkdvMaps maps) {
  constexpr int BN = kSmallTile, BM = kSmallTile;
  using LN = TileL<BN, HD>;                                      // K, V, Q, dA
  bf16_t* sK = reinterpret_cast<bf16_t*>(dyn_smem_1k());         // [BN x HD]
  bf16_t* sV = sK + BN * HD;                                     // [BN x HD]
  bf16_t* sQ = sV + BN * HD;                                     // [2][BM x HD]
  bf16_t* sA = sQ + 2 * BM * HD;                                 // [2][BM x HD] dA
  float* sP = reinterpret_cast<float*>(sA + 2 * BM * HD);        // [2][BN·BM / 128][128] Pᵀ
  float* sL = sP + 2 * BN * BM;                                  // [2][BM] lse · log2e
  float* sD = sL + 2 * BM;                                       // [2][BM] D
  uint64_t* full_kv = reinterpret_cast<uint64_t*>(sD + 2 * BM);  // K, V loaded
  uint64_t* full = full_kv + 1;                                  // [2] item slot loaded
  uint64_t* empty = full_kv + 3;                                 // [2] item slot released

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  KeyTile kt;  // block -> (kv head, key tile)
  if (!key_tile<BM, BN>(p, kt)) return;
  const int j = kt.j, k0 = kt.k0, k_end = kt.k_end, m_first = kt.m_first, n_m = kt.n_m,
            n_items = kt.n_items;
  const Doc d = kt.d;

  if (tid == 0) {
    mbar_init(full_kv, 1);
    for (int s = 0; s < 2; ++s) {
      mbar_init(full + s, 32);       // the producer warp's lanes (lse, D; lane 0 also the tiles)
      mbar_init(empty + s, kWarps);  // one arrival per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();  // the last block barrier

  if (warp >= kWarps) {  // producer warpgroup
    setmaxnreg_dec<kTmaProducerRegs>();
    if (warp == kWarps) {
      if (lane == 0) {
        mbar_arrive_expect_tx(full_kv, static_cast<uint32_t>(2 * BN * HD * sizeof(bf16_t)));
#pragma unroll
        for (int b = 0; b < HD / 64; ++b) {
          tma_load_3d(sK + b * BN * 64, &maps.k, full_kv, b * 64, j, k0);
          tma_load_3d(sV + b * BN * 64, &maps.v, full_kv, b * 64, j, k0);
        }
      }
      for (int it = 0; it < n_items; ++it) {
        const int s = it & 1;
        if (it >= 2) mbar_wait(empty + s, static_cast<uint32_t>((it >> 1) - 1) & 1u);
        const int h = j * p.group + it / n_m;
        const int qs = d.b + (m_first + it % n_m) * BM;
#pragma unroll
        for (int r = lane; r < BM; r += 32) {
          const bool ok = r < d.e - qs;
          const size_t row = static_cast<size_t>(qs + (ok ? r : 0)) * p.Hq + h;
          sL[s * BM + r] = ok ? p.lse[row] * kLog2e : INFINITY;
          sD[s * BM + r] = ok ? p.D[row] : 0.f;
        }
        if (lane == 0) {
          mbar_arrive_expect_tx(full + s, static_cast<uint32_t>(2 * BM * HD * sizeof(bf16_t)));
#pragma unroll
          for (int b = 0; b < HD / 64; ++b) {
            tma_load_3d(sQ + s * BM * HD + b * BM * 64, &maps.q, full + s, b * 64, h, qs);
            tma_load_3d(sA + s * BM * HD + b * BM * 64, &maps.a, full + s, b * 64, h, qs);
          }
        } else {
          mbar_arrive(full + s);
        }
      }
    }
    return;  // the consumers wait for every copy, so the block outlives them
  }

  setmaxnreg_inc<kTmaConsumerRegs>();
  const int g = lane >> 2, c = lane & 3;
  const int wg = warp >> 2, wtid = tid & 127;  // warpgroup, thread in the warpgroup
  const int kr = (warp & 3) * 16 + g;          // this thread's key rows kr, kr + 8 of the tile
  const int u0 = k0 + kr, u1 = u0 + 8;
  const unsigned char* Kt = reinterpret_cast<const unsigned char*>(sK);
  const unsigned char* Vt = reinterpret_cast<const unsigned char*>(sV);
  float acc[HD / 2];  // warpgroup 0: dV; warpgroup 1: dK (64 keys x HD)
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;

  // The item in slot sb (dkdv_first/second_product, sm90_pipe.cuh); Pᵀ in slot sb's own buffer
  // and named barrier 1 + sb, so item it+1's hand-over never waits for item it's readers.
  float st[BM / 2];
  auto issue_first = [&](int sb) {
    dkdv_first_product<BM, HD, LN>(st, wg, Kt, Vt, sQ + sb * BM * HD, sA + sb * BM * HD);
  };
  auto issue_second = [&](int sb, int it, uint32_t(&pa)[BM / 16][4]) {
    dkdv_second_product<BM, BN, HD, LN>(st, acc, pa, wg, c, wtid, k0, u0, u1,
                                        d.b + (m_first + it % n_m) * BM, p.scale_log2,
                                        sQ + sb * BM * HD, sA + sb * BM * HD, sL + sb * BM,
                                        sD + sb * BM, sP + sb * BN * BM, 1 + sb);
  };

  mbar_wait(full_kv, 0);
  mbar_wait(full, 0);
  reg_fence(acc);
  issue_first(0);
  wgmma_wait<0>();
  reg_fence(st);
  for (int it = 0; it < n_items; ++it) {
    const int buf = it & 1;
    uint32_t pa[BM / 16][4];
    issue_second(buf, it, pa);
    if (it + 1 < n_items) {
      mbar_wait(full + (buf ^ 1), static_cast<uint32_t>((it + 1) >> 1) & 1u);  // item it+1
      issue_first(buf ^ 1);
      wgmma_wait<1>();  // this warpgroup's dV / dK product of item it is done
      reg_fence(acc);
      reg_fence_u(pa);
      if (lane == 0) mbar_arrive(empty + buf);  // this warp is done with item it's slot
      wgmma_wait<0>();
      reg_fence(st);
    } else {
      wgmma_wait<0>();
      reg_fence(acc);
      reg_fence_u(pa);
    }
  }

  dkdv_epilogue<HD>(p, acc, wg, u0, u1, k_end, j, c);
}

// The dq kernel's tensor maps: q_hat and dA [T, Hq, ·] in boxes of kBigTile rows, k_hat and v
// [T, Hkv, hd] in boxes of kPipeDqKeys rows.
struct DqMaps {
  CUtensorMap q, a, k, v;
};

template <int HD>
constexpr size_t dq_tma_smem_bytes() {  // the sm90_pipe.cuh tiles + 7 mbarriers
  return dq_pipe_smem_bytes<HD>() + 7 * sizeof(uint64_t);
}
static_assert(dq_tma_smem_bytes<256>() <= 227 * 1024, "dq (TMA) shared memory");

// dq, warp-specialized: cuda_bwd.cuh's dq kernel on sm90_pipe.cuh's products (dq_tile_update;
// masking, order of accumulation, epilogue unchanged) at 64 keys a step, with the producer warp
// loading Q and dA once, K_j into slot j % 2 and V_j into the one V slot, and mbarriers in place of
// the block barriers:
//   producer (warp 8, one lane): Q, dA, K_0, V_0, then per step i: K_{i+1} once the consumers
//     released K_{i-1}, V_{i+1} once they released V_i;
//   consumers, step jt: wait K_jt, S = Q K_jtᵀ; wait V_jt, dP = dA V_jtᵀ; both done: release V_jt;
//     dS; dQ += dS K_jt done: release K_jt.
// V_j is the j-th fill of its slot (parity j % 2 of full_v, and the producer waits for parity
// i % 2 of empty_v, V_i released, before loading V_{i+1}); K as in the forward.
template <int HD>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attn_bwd_dq_tma_kernel(const BwdParams p, const __grid_constant__ DqMaps maps) {
  constexpr int BM = kBigTile, BN = kPipeDqKeys;
  using LB = TileL<BM, HD>;                                       // Q, dA
  using LN = TileL<BN, HD>;                                       // K, V
  bf16_t* sQ = reinterpret_cast<bf16_t*>(dyn_smem_1k());          // [BM x HD]
  bf16_t* sA = sQ + BM * HD;                                      // [BM x HD] dA
  bf16_t* sK = sA + BM * HD;                                      // [2][BN x HD]
  bf16_t* sV = sK + 2 * BN * HD;                                  // [BN x HD]
  uint64_t* full_qa = reinterpret_cast<uint64_t*>(sV + BN * HD);  // Q, dA loaded
  uint64_t* full_k = full_qa + 1;                                 // [2]
  uint64_t* empty_k = full_qa + 3;                                // [2]
  uint64_t* full_v = full_qa + 5;
  uint64_t* empty_v = full_qa + 6;

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  QueryTile qt;  // block -> (query head, tile), longest tiles first
  if (!query_tile<BM, BN>(p, qt)) return;
  const int h = qt.h, j = qt.j, q0 = qt.q0, q_end = qt.q_end, nk = qt.nk;
  const Doc d = qt.d;

  if (tid == 0) {
    mbar_init(full_qa, 1);
    mbar_init(full_v, 1);
    mbar_init(empty_v, kWarps);
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_k + s, 1);
      mbar_init(empty_k + s, kWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the last block barrier

  if (warp >= kWarps) {  // producer warpgroup
    setmaxnreg_dec<kTmaProducerRegs>();
    if (warp == kWarps && lane == 0) {
      mbar_arrive_expect_tx(full_qa, static_cast<uint32_t>(2 * BM * HD * sizeof(bf16_t)));
#pragma unroll
      for (int b = 0; b < HD / 64; ++b) {
        tma_load_3d(sQ + b * BM * 64, &maps.q, full_qa, b * 64, h, q0);
        tma_load_3d(sA + b * BM * 64, &maps.a, full_qa, b * 64, h, q0);
      }
      tma_tile<BN, HD>(sK, &maps.k, full_k, j, d.b);
      tma_tile<BN, HD>(sV, &maps.v, full_v, j, d.b);
      for (int i = 0; i + 1 < nk; ++i) {
        const int s = (i + 1) & 1;
        if (i + 1 >= 2) mbar_wait(empty_k + s, static_cast<uint32_t>(((i + 1) >> 1) - 1) & 1u);
        tma_tile<BN, HD>(sK + s * BN * HD, &maps.k, full_k + s, j, d.b + (i + 1) * BN);
        mbar_wait(empty_v, static_cast<uint32_t>(i) & 1u);
        tma_tile<BN, HD>(sV, &maps.v, full_v, j, d.b + (i + 1) * BN);
      }
    }
    return;  // the consumers wait for every copy, so the block outlives them
  }

  setmaxnreg_inc<kTmaConsumerRegs>();
  const int g = lane >> 2, c = lane & 3;
  const int t0 = q0 + warp * 16 + g, t1 = t0 + 8;
  float lse2[2], Dr[2];  // lse in base-2 units and D of rows t0, t1
  dq_row_stats(p, t0, t1, q0, q_end, h, lse2, Dr);
  const size_t wg_off = LB::rows((warp >> 2) * 64);  // this warpgroup's 64 rows
  const unsigned char* qrows = reinterpret_cast<const unsigned char*>(sQ) + wg_off;
  const unsigned char* arows = reinterpret_cast<const unsigned char*>(sA) + wg_off;
  const unsigned char* V = reinterpret_cast<const unsigned char*>(sV);
  float acc[HD / 2];  // dQ
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) acc[i] = 0.f;
  mbar_wait(full_qa, 0);

  for (int jt = 0; jt < nk; ++jt) {
    mbar_wait(full_k + (jt & 1), static_cast<uint32_t>(jt >> 1) & 1u);  // K_jt
    const unsigned char* K = reinterpret_cast<const unsigned char*>(sK + (jt & 1) * BN * HD);
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
    mbar_wait(full_v, static_cast<uint32_t>(jt) & 1u);  // V_jt
    // After the wait's loop ptxas no longer sees dp as fenced and would insert this itself (C7519).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      wgmma_ss<BN, 0>(dp, LB::desc_k(arows) + LB::k_step(kk), LN::desc_k(V) + LN::k_step(kk), 1);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);
    reg_fence(dp);
    if (lane == 0) mbar_arrive(empty_v);  // this warp is done with V_jt

    dq_tile_update<BN, HD, LN>(s, dp, acc, K, lse2, Dr, p.scale_log2, k0 + BN - 1 > q0, k0, c, t0,
                               t1);
    if (lane == 0) mbar_arrive(empty_k + (jt & 1));  // this warp is done with K_jt
  }

  dq_epilogue<HD>(
      p, [&](int nt, int e) { return acc[4 * nt + e]; }, t0, t1, q_end, h, c);
}

}  // namespace gdn::ops::attn
