// Gated delta rule (the Gated DeltaNet core), varlen, grouped heads, forward and backward.
//
// Maths (gdn_spec.md §2; FLA fla/ops/gated_delta_rule/naive.py and fused_recurrent.py). For each
// document n = [cu[n], cu[n+1]) and value head h (key head kappa = h / r, r = Hv / Hk), with
// S_0 = h0[n, h] (or 0), per token t of the document:
//   qh_t, kh_t = q[t, kappa], k[t, kappa], or with use_qk_l2norm x / sqrt(sum(x^2) + 1e-6)
//   St  = exp(g_t) * S_{t-1}                 decay FIRST              S: [dk, dv], key-major
//   p_t = St^T kh_t                          prediction of v_t        [dv]
//   d_t = beta_t * (v_t - p_t)               delta                    [dv]
//   S_t = St + kh_t d_t^T                    delta update
//   o_t = S_t^T (scale * qh_t)               reads the UPDATED state  [dv]
//   hT[n, h] = S_L (the state after the document's last token)
// scale = 0 selects the default dk^{-1/2}; otherwise it must be finite and > 0.
//
// Shapes (T tokens, N documents, Hv = r * Hk, 1 <= dk, dv <= 256, dk and dv independent):
//   q, k [T, Hk, dk]   v [T, Hv, dv]   g, beta [T, Hv]   cu_seqlens [N+1] I32
//   h0, hT, dh0, dhT [N, Hv, dk, dv]    o, do [T, Hv, dv]
// Dtypes: "activation" q k v o do dq dk dv; "state" g beta h0 hT dg dbeta dh0 dhT.
//   ref:  activations F64, state F64        cpu:  activations F32, state F32
//   cuda: activations BF16, state F32       (gdr_state_dtype below)
// g is a log-decay and must be <= 0 (g = -exp(A_log) * softplus(a + dt_bias) always is); g and
// beta must be finite. Both are checked on host tensors (an error names the tensor and [t, h]).
//
// Varlen: cu_seqlens (FlashAttention convention) starts at 0, never decreases and ends at T; no
// state crosses a document boundary. Zero-length documents are ACCEPTED (FA tolerates them and
// packers emit them as tail padding, gdn_spec.md §6): they produce no tokens, hT[n] = h0[n] (or 0)
// and dh0[n] = dhT[n] (or 0).
//
// Forward writes (=): o, hT when hT is given and saved when saved is given (below). h0 is optional
// (absent = zero state).
// Backward (do given, dhT optional = zero) writes (=): dq, dk, dv, dg, dbeta, and dh0 when given
// (the gradient w.r.t. the initial state, h0 or zero). Nothing is accumulated: q, k, v, g, beta are
// activations produced fresh every step. dq and dk are sums over the r value heads that read each
// key head (FLA reshapes [.., Hk, r, dk] and sums), then go through the l2norm backward when
// use_qk_l2norm is set: dx = rstd * (dy - <dy, y> y).
//
// What forward saves for backward: by default NOTHING beyond its own inputs. Backward takes q, k,
// v, g, beta, cu_seqlens, h0 again and recomputes the l2norm, the chunk-local cumsum of g, the UT
// inverse T = (I + M)^{-1}, W, U, the chunk-start states and V'. FLA saves T ([T, Hv, 64], 256 B
// per token per value head in fp32: more than q+k+v at dk = dv = 64) and recomputes the rest
// (fla/ops/gated_delta_rule/chunk.py); on the CPU rebuilding T is ~15% of the forward FLOPs
// (K K^T + the triangular solve), so memory wins.
//
// Optional `saved` (both structs; absent = the recomputation above, unchanged): the output of the
// sequential forward state pass, which the backward otherwise re-runs (on cuda a latency-bound
// pass over each document's chunks, about a quarter of the backward at one long document), and
// the chunk factors T, W and gamma, which it would rebuild (on cuda the triangular inverse is the
// shared-memory-bound part of a per-chunk kernel, about a tenth of the backward at one long
// document). fla saves its T (A) and rebuilds W and the states (fla/ops/gated_delta_rule/
// chunk.py). The forward writes it (=) when given; the backward reads it when given and then skips
// its own state pass, and on the fast route (below) also its T, W and gamma (it still rebuilds the
// l2norm).
//   Shape [gdr_saved_numel(T, N, Hv, dk, dv)], the activation dtype, contiguous, on q's device
//   (16-byte aligned on cuda). With nt = gdr_saved_chunks(T, N) chunk slots, numbered as the
//   chunks of the batch (document n's chunks are consecutive, its first slot is the number of
//   chunks of documents 0..n-1; a chunk is 64 tokens, a document's last one may be partial):
//     Ht [nt, Hv, dv, dk]  at element 0:             Ht[c, h] = S_c^T, the state at the START of
//                                                   chunk c (h0 or 0 for a document's first)
//     Vt [nt, Hv, dv, 64]  at element nt Hv dv dk:  Vt[c, h, :, i] = v'_{t0+i} for i < len(c),
//                                                   V' = U - W S_c (the chunked algorithm's
//                                                   pseudo-values, gdn_spec.md §3.1), exact 0 for i
//                                                   >= len(c)
//     W [nt 64, Hv, dk]    at element nt Hv dv (dk + 64): W[t, h] = the row of W = T diag(beta
//                                                   e^gamma) K for token t (rows t >= T unused)
//     T [nt, Hv, 64, 64]   next:                    T[c, h] = (I + M)^{-1} of chunk c (its rows
//                                                   and columns past len(c): those of the padded
//                                                   chunk, beta = 0 and k = 0 there)
//     gamma [nt, Hv, 64]   next, fp32 (2 elements each): the chunk-local cumsums of g (0 past
//                                                   len(c))
//   W, T and gamma are written only where the fast backward could read them: by every cuda forward
//   whose dk and dv are at most 128 and multiples of 8 and whose k is 16-byte aligned (the fast
//   backward's own conditions include those); the fast backward reads them, the generic one
//   rebuilds its own. On both fast and generic forwards they come from the fast route's prep
//   kernel, bitwise what the fast backward would rebuild.
//   Values but gamma are rounded to the activation dtype (bf16 on cuda: the operands the
//   backward's kernels read). Slots past the batch's chunk count are neither written nor read. Both
//   CUDA routes (fast and generic) write and read this one layout, with the same meaning, so a
//   backward may take either route whatever route wrote `saved` (e.g. a different tensor alignment
//   sends it elsewhere); the two routes' values differ in the last bits (they round differently,
//   see below), each within the op's tolerance. A backward given `saved` that the forward of the
//   SAME route wrote returns bitwise the gradients it returns without it: the forward's state pass
//   is the very computation the backward would repeat, on the same inputs (and with the same dk
//   split of the fast route's state passes, cuda.h, which follows from the shapes unless forced).
//   `saved` must come from a forward with the same q, k, v, g, beta, cu_seqlens, h0, scale and
//   use_qk_l2norm; nothing checks that. ref and cpu.chunk64 ignore `saved` (they neither write nor
//   read it: the backward recomputes); the op wrapper still validates its shape, dtype and device
//   on every backend.
//
// Implementations:
//   ref: the token-by-token recurrence above and its exact reverse-time backward (gdn_spec.md §2),
//     fp64, no threading. The oracle.
//   cpu.chunk64: the chunked WY/UT algorithm with C = 64 (gdn_spec.md §3.1, §3.5). Per chunk: the
//     local cumsum gamma, M = tril_{-1}(beta_i e^{gamma_i - gamma_j} k_i.k_j), T = (I+M)^{-1}
//     (unit lower triangular solve), W = T diag(beta e^gamma) K, U = T diag(beta) V, V' = U - W S,
//     O and the next state; the backward runs the chunk chain in reverse. fp32 intermediates,
//     OpenBLAS sgemm/strsm, OpenMP over (document, value head). Every gate exponent
//     (gamma_i - gamma_j with i >= j, gamma_last - gamma_i, gamma_i) is <= 0, so strong decay
//     underflows to 0 and never overflows; each is summed over its own g's in fp64 before the fp32
//     exp (a difference of two fp32 cumsums loses 1e-4 relative at g ~ -20). dg is assembled from
//     the terms that reach each token, not as a reverse cumsum of O(1) differences, which would
//     cancel to noise when the true dg is ~e^g (strong decay).
//   cuda.chunk64 (cuda*.cu): the same chunked algorithm as a decomposed kernel chain (FLA's
//     structure: per-chunk kernels for T, W, U and the output around a sequential state pass per
//     (document, value head, block of value columns), which keeps S in fp32 registers; the
//     backward rebuilds the forward chain (all but its state pass when given `saved`, which both
//     routes write in the layout above), then a reverse state pass and per-chunk gradient
//     kernels; on the fast route the state passes split dk over 2, 4 or 8 groups of one or two
//     warps (16 or 32 value columns a block) when their grid has no more blocks than SMs, one long
//     document, and stage up to 3 chunks ahead, cuda_fast.h). Two implementations with the same
//     contract (cuda.cu), ordinary registry candidates resolved per shape class: cuda.chunk64, the
//     fast route (classes with dk, dv <= 128, multiples of 8, 16-byte aligned tensors; mma.sync
//     with operands kept in registers, gates from fp32 chunk-local cumsums of g, every product
//     bf16 x bf16 -> fp32), and cuda.chunk64_generic (any dims; WMMA, gates summed term by term
//     as on the cpu, the inverse's backward in tf32), which the resolver takes for the other
//     classes or when the fast route fails its probe. On both, T = (I + M)^{-1} is inverted in
//     fp32, the running state and dS are fp32, and the operands are rounded to bf16: normalised
//     q/k, T, W, U, V', the chunk-boundary state snapshots and the score matrices (gdn_spec.md
//     §3.7). dg is assembled as on the cpu. Device cu_seqlens are never read on the host: the
//     kernels clamp them into [0, T] and make them non-decreasing (cuda.h, which also exposes the
//     chunk index so that a micro-batch builds it once for all its layers).
// Determinism: cpu is bitwise deterministic and independent of the thread count (each (document,
// head) pair is computed by one thread in a fixed order; the sums over the r value heads of a key
// head run afterwards in head order; BLAS runs single-threaded inside the op). cuda is bitwise
// reproducible run to run: no atomics, every reduction in a fixed order (dq/dk per value head in
// fp32, summed over the r heads in head order).
#pragma once

#include <cstddef>

#include "gdn/core/tensor.h"

namespace gdn::ops {

constexpr int64_t kGdrChunk = 64;        // C: chunk length of the chunked algorithm
constexpr int64_t kGdrMaxHeadDim = 256;  // dk, dv limit (FLA asserts K <= 256 in its state kernels)
constexpr double kGdrL2NormEps = 1e-6;   // inside the sqrt of the SUM of squares, as FLA and HF

struct GatedDeltaRuleFwd {
  Tensor q;           // [T, Hk, dk]
  Tensor k;           // [T, Hk, dk]
  Tensor v;           // [T, Hv, dv]
  Tensor g;           // [T, Hv] state dtype, log-decay <= 0
  Tensor beta;        // [T, Hv] state dtype
  Tensor cu_seqlens;  // [N+1] I32
  Tensor h0{};        // [N, Hv, dk, dv] state dtype; optional (absent = zero initial state)
  Tensor o;           // [T, Hv, dv] out (=)
  Tensor hT{};        // [N, Hv, dk, dv] state dtype; optional out (=)
  double scale = 0;   // 0 selects dk^{-1/2}
  bool use_qk_l2norm = false;
  Tensor saved{};  // [gdr_saved_numel(..)] activation dtype; optional out (=), see above
};

struct GatedDeltaRuleBwd {
  // The forward's inputs (backward recomputes everything else, see above).
  Tensor q;           // [T, Hk, dk]
  Tensor k;           // [T, Hk, dk]
  Tensor v;           // [T, Hv, dv]
  Tensor g;           // [T, Hv] state dtype
  Tensor beta;        // [T, Hv] state dtype
  Tensor cu_seqlens;  // [N+1] I32
  Tensor h0{};        // [N, Hv, dk, dv] state dtype; optional
  // Upstream gradients.
  Tensor dout;   // [T, Hv, dv] gradient of o ("do" in files)
  Tensor dhT{};  // [N, Hv, dk, dv] state dtype; optional (absent = 0)
  // Gradients, all written (=).
  Tensor dq;     // [T, Hk, dk]
  Tensor dk;     // [T, Hk, dk]
  Tensor dv;     // [T, Hv, dv]
  Tensor dg;     // [T, Hv] state dtype
  Tensor dbeta;  // [T, Hv] state dtype
  Tensor dh0{};  // [N, Hv, dk, dv] state dtype; optional out
  double scale = 0;
  bool use_qk_l2norm = false;
  Tensor saved{};  // [gdr_saved_numel(..)] activation dtype; optional in: the forward's `saved`
};

struct GatedDeltaRuleTable {
  void (*forward)(const GatedDeltaRuleFwd&);
  void (*backward)(const GatedDeltaRuleBwd&);
};

// Validate (shapes, dtypes, devices, cu_seqlens, finite g <= 0 and beta), resolve the
// implementation for the tensors' backend, run.
void gated_delta_rule_forward(const GatedDeltaRuleFwd& a);
void gated_delta_rule_backward(const GatedDeltaRuleBwd& a);

// dtype of g, beta, the states and their gradients for an activation dtype (F64 on ref, else F32).
inline DType gdr_state_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }
// The scale the op uses: `scale`, or dk^{-1/2} when it is 0.
double gdr_effective_scale(double scale, int64_t dk);
// Chunk slots of `saved` for T tokens in N documents: (T + 63 N) / 64, an upper bound on the
// batch's chunk count (each document adds at most one partial chunk) that needs no cu_seqlens
// values, so a caller sizes `saved` for its largest batch once (the CUDA chunk index uses the same
// bound). Non-decreasing in T and in N.
int64_t gdr_saved_chunks(int64_t T, int64_t N);
// Elements of `saved` (activation dtype): gdr_saved_chunks(T, N) * Hv * (dv dk + 64 dv + 64 dk +
// 64 * 64 + 128). At T = 8192, one document, Hv = 32, dk = dv = 128: 128 slots, 151.5 M elements,
// 289 MiB in bf16.
int64_t gdr_saved_numel(int64_t T, int64_t N, int64_t Hv, int64_t dk, int64_t dv);

// CUDA workspace (gdn/backend/op_workspace.h): both CUDA implementations take their temporaries
// (the chunk index unless a GdrBatchIndex provides it, l2-normalised q and k, the chunk factors and
// states, the backward's gradient buffers; cuda.cu lists them) in one scratch request per call,
// laid out by a plan function of the call's dims. gated_delta_rule_workspace_bytes is the largest
// of those plans (forward and backward, both routes, with and without `saved`) for T tokens in N
// documents, which bounds every call of at most T tokens and N documents with these heads (the
// plans are non-decreasing in T and N). With `backward_saved`, only backward calls given `saved`
// are bounded (the forward's with and without it still are): a caller that always passes `saved`
// to the backward plans less. 0 in builds without CUDA: the host backends take none.
size_t gated_delta_rule_workspace_bytes(int64_t T, int64_t N, int64_t Hk, int64_t Hv, int64_t dk,
                                        int64_t dv, bool use_qk_l2norm,
                                        bool backward_saved = false);

// A micro-batch's chunk index, shared by its calls. Every call derives from cu_seqlens which
// chunks of 64 tokens each document has; on cuda that index is built on the device per call
// unless a scope provides it (cuda.h: GdrChunkIndexScope), so a caller that runs many layers on
// one batch builds it once:
//   Tensor ix = <I32 [gdr_batch_index_numel(device, T, N)], when > 0>;
//   GdrBatchIndex scope(cu_seqlens, T, ix);  // builds it; the calls within the scope reuse it
// ref and cpu have no such index: the numel is 0 on the host and the scope does nothing.
class GdrChunkIndexScope;  // cuda.h
// I32 elements of the index of T tokens in N documents on `device` (0 on the host).
int64_t gdr_batch_index_numel(Device device, int64_t T, int64_t N);
class GdrBatchIndex {
 public:
  // cu_seqlens: I32 [N+1]; index: I32 [gdr_batch_index_numel(cu_seqlens' device, T, N)] on the
  // same device, 16-byte aligned (unused on the host). While alive, gated_delta_rule calls on this
  // thread with this cu_seqlens tensor and T reuse it; cu_seqlens must not change meanwhile.
  GdrBatchIndex(const Tensor& cu_seqlens, int64_t T, const Tensor& index);
  ~GdrBatchIndex();
  GdrBatchIndex(const GdrBatchIndex&) = delete;
  GdrBatchIndex& operator=(const GdrBatchIndex&) = delete;

 private:
  // The cuda scope, constructed in place (a step allocates nothing on the host heap for it; op.cpp
  // checks that it fits); null on the host.
  static constexpr size_t kScopeBytes = 1024;
  alignas(std::max_align_t) unsigned char storage_[kScopeBytes];
  GdrChunkIndexScope* scope_ = nullptr;
};

}  // namespace gdn::ops
