// Launchers of the gated delta rule's fast CUDA path (cuda_fast_fwd.cu, cuda_fast_bwd.cu), called
// by cuda.cu for head dims dk, dv <= 128 that are multiples of 8 with 16-byte aligned tensors
// (Dims::vec); other shapes take the generic kernels of cuda_kernels.h. Included from .cu files
// only.
//
// The fast path is FLA's decomposed chain (fla/ops/gated_delta_rule/chunk.py) with every product on
// mma.sync tensor cores and the sequential passes keeping their state in registers:
//   forward   prep (per chunk: gamma, T = (I + M)^{-1}, W, U) -> state_fwd (per document, value
//             head, 32 value columns: chunk-start snapshots H, V', hT) -> output (per chunk)
//   backward  prep (+ T kept) and dvloc (per chunk, one grid) -> state_fwd -> state_bwd
//             (reverse: dH, dV', dh0) -> dqkw (per chunk and key head, over its value heads: dq,
//             dk part, dW, dg part) -> wy (the same blocks: dv, dbeta, dg, dk +=) -> the l2norm
//             backward of dq and dk
// Intermediates that only the op's kernels read are stored per chunk slot c in "transposed" layouts
// that the register fragments write with 4-byte stores and the next kernel stages as ldmatrix
// tiles: Ht / dHt [chunks, Hv, dv, dk] (S^T of the chunk-start state / dS^T of the chunk-end
// gradient, bf16), Vt / dVt [chunks, Hv, dv, 64] (V' / dV' transposed, bf16; tokens past a partial
// chunk's end are exact zeros), dvlocT [chunks, Hv, dv, 64] fp32, gam [chunks, Hv, 64] fp32 (the
// chunk-local inclusive cumsum gamma of g, padded past the chunk's end with its last value) and
// Tinv [chunks, Hv, 64, 64] bf16 (the backward's copy of T, rounded as wy's products read it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/gated_delta_rule/cuda_kernels.h"
#include "ops/gated_delta_rule/cuda_state_pipe.cuh"

namespace gdn::ops::gdr {

// Whether the fast path takes these dims (d.vec must be set first).
inline bool fast_path(const Dims& d) { return d.vec && d.KP <= 128 && d.VP <= 128; }

// --- the dk split of the sequential state passes ---
// The state passes (state_fwd, state_bwd) run one block per (document, value head, 32 value
// columns): at one long document that is Hv * 4 blocks at dv = 128 (64 at Hv = 16, 128 at Hv = 32)
// for 132 SMs, each walking all of the document's chunks in sequence, so the pass is bound by the
// latency of one chunk step. Splitting dk over KS warp pairs (KS in {1, 2, 4, 8}: 2 KS warps per
// block) divides each warp's products per step by KS at the price of one shared-memory exchange of
// the 16 x 64 partial of the one product that reduces over dk (X = S^T W^T forward, dS^T K^T
// backward). state_split picks KS for a grid of `blocks` blocks: 4 when the grid has no more
// blocks than the device has SMs (one block per SM: the extra warps and shared memory are free),
// else 1; gdr_set_state_split (cuda.h) overrides it for tests and benchmarks. (The blocks counted
// here are 32-column ones; state_pipe may then halve the columns per block, 1 KS warps each.)
int state_split(int64_t blocks);

// Bytes of the partial-exchange buffer: [KS, 2 column slices, 8 tiles, 32 lanes] float4.
constexpr size_t state_red_bytes(int ks) {
  return buf_bytes(static_cast<size_t>(ks) * 2 * 8 * 32 * 16);
}

// --- the staging pipeline of the state passes (cuda_state_pipe.cuh) ---
// The launch shape of a state pass whose split is ks over a grid of blocks32 blocks of 32 value
// columns: ring depth, value columns per block, snapshot path, partial exchange, and (backward)
// dV'_loc through the ring. smem(pp) is the pass's dynamic shared memory for a candidate; ns_max
// its deepest ring. Automatic: 16 value columns per block when ks > 1 and twice blocks32 still fits
// the SMs (else 32); the deepest ring (ns_max, then fewer) that keeps all of the grid's blocks
// resident at once, then snapshots through shared memory (ks > 1, whole-row pieces: KP / 8 divides
// 32) and dV'_loc through the ring as long as they fit too (every choice gives bitwise the same
// results; the others measured slower: docs/PERF.md). leave: shared memory per SM to keep free for
// a block of another kernel running beside the pass (the trailing output, fast_state_output).
StatePipe state_pipe(const Dims& d, int ks, int64_t blocks32, int ns_max,
                     size_t (*smem)(const Dims&, int, const StatePipe&), size_t leave = 0);

#ifdef __CUDACC__
// x (this warp's partial over its k-blocks, C fragments of 8 token tiles) <- the sum over the KS
// warps of its column slice vwarp (of nvw slices) of their partials, added in the order
// p = 0 .. KS-1 so that the KS warps end bitwise equal. Every thread of the block must call it (a
// block barrier); red is rewritten only after the block's next barrier (the caller's loop head).
// Scattered: warp kq adds those of the tiles kq, kq + KS, .. into slot p = 0 (only it touches
// them), and after a barrier of the slice's KS warps (named barrier 1 + vwarp) every warp reads
// the 8 sums: a quarter of the shared loads and additions at KS = 4 (than every warp adding all KS
// partials of all 8 tiles) for a second, narrower barrier.
template <int KS>
__device__ __forceinline__ void state_exchange_sum(float (&x)[8][4], float4* red, int kq, int vwarp,
                                                   int nvw, int lane) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
    red[((kq * nvw + vwarp) * 8 + i) * 32 + lane] = make_float4(x[i][0], x[i][1], x[i][2], x[i][3]);
  __syncthreads();
  auto sum_tile = [&](int i) {
    float4 a = red[(vwarp * 8 + i) * 32 + lane];
#pragma unroll
    for (int p = 1; p < KS; ++p) {
      const float4 b = red[((p * nvw + vwarp) * 8 + i) * 32 + lane];
      a.x += b.x;
      a.y += b.y;
      a.z += b.z;
      a.w += b.w;
    }
    return a;
  };
#pragma unroll
  for (int j = 0; j < 8 / KS; ++j) {
    const int i = kq + j * KS;
    red[(vwarp * 8 + i) * 32 + lane] = sum_tile(i);
  }
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + vwarp), "r"(32 * KS) : "memory");
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 a = red[(vwarp * 8 + i) * 32 + lane];
    x[i][0] = a.x;
    x[i][1] = a.y;
    x[i][2] = a.z;
    x[i][3] = a.w;
  }
}
#endif

// --- forward (and the backward's recomputation) ---
// Per chunk and value head: gam, W = T diag(beta G) K, U = T diag(beta) V (when U is not null: the
// backward given `saved` skips it), and bf16(T) when Tinv is not null (wy only ever uses T as a
// bf16 mma operand). W and gam do not depend on which of U and Tinv are asked for.
void fast_prep(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
               const float* g, const float* beta, bf16_t* W, bf16_t* U, float* gam, bf16_t* Tinv,
               cudaStream_t s);
// The backward's prep (as fast_prep) and dvlocT = (s P^T dO)^T per chunk (the intra-chunk part of
// dV') in one grid, the two kinds of block interleaved (neither reads what the other writes).
void fast_prep_dvloc(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                     const bf16_t* v, const float* g, const float* beta, const bf16_t* dout,
                     bf16_t* W, bf16_t* U, float* gam, bf16_t* Tinv, float* dvlocT, cudaStream_t s);
// dvlocT alone (the backward given `saved`, whose W, T and gam the forward's prep wrote).
void fast_dvloc(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                const float* g, const bf16_t* dout, float* dvlocT, cudaStream_t s);
// Sequential over each document's chunks: Ht, Vt and (when not null) hT.
void fast_state_fwd(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* kn,
                    const bf16_t* U, const float* gam, const float* h0, bf16_t* Ht, bf16_t* Vt,
                    float* hT, cudaStream_t s);
// O = s (diag(G) Q H_c + (Q K^T .* D, j <= i) V'), per chunk and value head.
void fast_output(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                 const bf16_t* Ht, const bf16_t* Vt, const float* gam, bf16_t* o, cudaStream_t s);
// The forward's state pass and output: fast_state_fwd then fast_output, or, when the pass has no
// more blocks than the GPU has SMs and a block of each fits an SM together (registers, shared
// memory), the output beside the pass, each chunk's output as soon as the pass has published that
// chunk (cuda_fast_fwd.cu: the trailing output).
// Bitwise the same o, Ht, Vt and hT either way. prog: fast_trail_prog_bytes of scratch.
void fast_state_output(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* qn,
                       const bf16_t* kn, const bf16_t* U, const float* gam, const float* h0,
                       bf16_t* Ht, bf16_t* Vt, float* hT, bf16_t* o, int* prog, cudaStream_t s);
size_t fast_trail_prog_bytes(const Dims& d);

// --- backward ---
// Reverse over each document's chunks: dHt (chunk-end state gradients), dVt (dV') and dh0.
void fast_state_bwd(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                    const bf16_t* W, const bf16_t* dout, const float* dvlocT, const float* gam,
                    const float* dhT, bf16_t* dHt, bf16_t* dVt, float* dh0, cudaStream_t s);
// Per (chunk, key head), over its value heads in order: dq (complete) and dk (score and
// state-update paths), each summed over those heads in fp32 [T, Hk, dk]; dW = -dV' H^T ([T, Hv, dk]
// bf16) and the dg part of those paths.
void fast_dqkw(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
               const bf16_t* dout, const bf16_t* Vt, const bf16_t* dVt, const bf16_t* Ht,
               const bf16_t* dHt, const float* gam, float* dqk, float* dkk, bf16_t* dW, float* dgp,
               cudaStream_t s);
// Per (chunk, key head), through the WY factors and T of each of its value heads: dv, dbeta, dg
// (= dgp + the rest), dk +=.
void fast_wy(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
             const bf16_t* dVt, const bf16_t* dW, const bf16_t* Tinv, const float* gam,
             const float* beta, const float* dgp, float* dkk, bf16_t* dv, float* dg, float* dbeta,
             cudaStream_t s);
// dq, dk from the fp32 [T, Hk, dk] sums: the l2norm backward (a conversion to bf16 without it).
void fast_l2norm_bwd_qk(const Dims& d, const bf16_t* q, const bf16_t* k, const float* dqk,
                        const float* dkk, bf16_t* dq, bf16_t* dk, cudaStream_t s);

}  // namespace gdn::ops::gdr
