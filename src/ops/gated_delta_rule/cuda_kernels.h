// Launchers of the gated delta rule's generic CUDA kernels (cuda_index.cu, cuda_fwd.cu,
// cuda_bwd.cu, cuda_saved.cu: WMMA, any head dims up to 256, unaligned tensors) and what the fast
// path (cuda_fast.h) shares with them (the index, Dims, the l2norm), called by the orchestration in
// cuda.cu. Included from .cu files only.
//
// Every launcher checks on the host what its kernel assumes (shared memory fits, sizes fit the
// grid) and launches on `s`. Kernels take the index and never trust a token offset they did not
// derive from it, so out-of-range cu_seqlens values cannot make them read or write out of bounds.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/gated_delta_rule/cuda_common.cuh"

namespace gdn::ops::gdr {

// Views into a built chunk index (cuda.h describes it).
struct IndexView {
  const int32_t* bos;      // [N+1] sanitised document starts (bos[n+1] = end of document n)
  const int32_t* chunk0;   // [N+1] first global chunk of each document; chunk0[N] = chunk count
  const ChunkInfo* table;  // [nt_max] per global chunk; len = 0 past the real chunk count
};
// The index's layout inside its I32 buffer: bos, chunk0, then the table at a 16-byte boundary.
int64_t index_table_offset(int64_t N);  // in I32 elements
IndexView index_view(const int32_t* base, int64_t N);

struct Dims {
  int T, N, Hk, Hv, r, dk, dv;
  int KP, VP;      // dk, dv rounded up to 16 (the MMA tile)
  int64_t nt_max;  // chunk slots (gdr_max_chunks)
  float scale;
  bool l2norm;
  bool vec;  // every staged tensor allows 16-byte cp.async (dk, dv % 8 == 0, aligned pointers)
};

void launch_build_index(const int32_t* cu, int64_t N, int64_t T, int64_t nt_max, int32_t* index,
                        cudaStream_t s);

// --- forward (and the backward's recomputation) ---
// qn, kn = q, k / sqrt(sum^2 + eps) rounded to bf16 ([T, Hk, dk] each).
void launch_l2norm(const Dims& d, const bf16_t* q, const bf16_t* k, bf16_t* qn, bf16_t* kn,
                   cudaStream_t s);
// Per (chunk, value head): T = (I + M)^{-1}, W = T diag(beta G) K, U = T diag(beta) V.
void launch_prep(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
                 const float* g, const float* beta, bf16_t* W, bf16_t* U, cudaStream_t s);
// Per (document, value head, dv block), sequential over chunks: chunk-start snapshots H, V' = U - W
// S (over U, in place), the final state.
void launch_state_fwd(const Dims& d, const IndexView& ix, const bf16_t* W, const bf16_t* kn,
                      const float* g, const float* h0, bf16_t* U_vnew, bf16_t* H, float* hT,
                      cudaStream_t s);
// Per (chunk, value head, 64 dv columns): O = s (diag(G) Q H_c + (Q K^T .* D, j <= i) V').
void launch_output(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                   const bf16_t* vnew, const bf16_t* H, const float* g, bf16_t* o, cudaStream_t s);

// --- backward ---
// dVloc = s P^T dO (fp32), the intra-chunk part of dV'.
void launch_dvloc(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                  const bf16_t* dout, const float* g, float* dvloc, cudaStream_t s);
// Reverse over chunks: dH (gradient of each chunk's end state), dV' = dVloc + diag(dec) K dS, dh0.
void launch_state_bwd(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                      const bf16_t* W, const bf16_t* dout, const float* dvloc, const float* g,
                      const float* dhT, bf16_t* dvp, bf16_t* dH, float* dh0, cudaStream_t s);
// Score and state-read paths: dq_h (complete), dk_h (first part), dg partial.
void launch_bwd_dqk(const Dims& d, const IndexView& ix, const bf16_t* qn, const bf16_t* kn,
                    const bf16_t* vnew, const bf16_t* dout, const bf16_t* H, const bf16_t* dH,
                    const float* g, float* dqh, float* dkh, float* dgp, cudaStream_t s);
// WY path: dv, dbeta, dg (final), dk_h (+= the rest).
void launch_bwd_wy(const Dims& d, const IndexView& ix, const bf16_t* kn, const bf16_t* v,
                   const bf16_t* dvp, const bf16_t* H, const float* g, const float* beta,
                   const float* dgp, float* dkh, bf16_t* dv, float* dg, float* dbeta,
                   cudaStream_t s);
// dq, dk = sum over the r value heads of dq_h, dk_h (in head order), then the l2norm backward.
void launch_reduce_qk(const Dims& d, const bf16_t* q, const bf16_t* k, const float* dqh,
                      const float* dkh, bf16_t* dq, bf16_t* dk, cudaStream_t s);

// --- the op's `saved` tensor (op.h), generic route (cuda_saved.cu) ---
// Ht [nt_max, Hv, dv, dk], Vt [nt_max, Hv, dv, 64] (saved's layout) <- the state pass's H and V'
// transposed, per chunk of the batch; Vt is zero past a partial chunk's end.
void launch_save_states(const Dims& d, const IndexView& ix, const bf16_t* H, const bf16_t* vnew,
                        bf16_t* Ht, bf16_t* Vt, cudaStream_t s);
// The reverse: H and V' (the tokens of every chunk of the batch) from Ht and Vt.
void launch_load_states(const Dims& d, const IndexView& ix, const bf16_t* Ht, const bf16_t* Vt,
                        bf16_t* H, bf16_t* vnew, cudaStream_t s);

// Sets the kernel's dynamic shared-memory limit (once per kernel and size) after checking the
// device allows it, and prefers the whole shared-memory carveout for it; `what` names the kernel
// and the dims in the error.
void allow_smem(const void* kernel, size_t bytes, const char* what, int dk, int dv);

}  // namespace gdn::ops::gdr
