// Fused LM head + softmax cross-entropy with z-loss and label smoothing (ops_notes.md §1).
//
// Maths, per token t whose target y_t is not ignore_index (-100); z = x W^T are the logits:
//   lse_t  = log sum_j exp(z_tj)                                     (max-shifted)
//   L_t    = (1 - eps)(lse_t - z_ty) + eps lse_t - (eps/V) sum_j z_tj + lambda lse_t^2
//          = lse_t - (1 - eps) z_ty - (eps/V) sum_j z_tj + lambda lse_t^2
//   Z_t    = lambda lse_t^2                 (the z-loss part of L_t, reported on its own)
//   dL_t/dz_tj = (1 + 2 lambda lse_t) p_tj - eps/V - (1 - eps)[j = y_t],   p = softmax(z_t)
// Ignored tokens contribute 0 to the loss and 0 to every gradient (their lse is still reported).
// Reductions: sum: loss = sum_t L_t; mean: loss = sum_t L_t / den, den = the caller's
// `denominator` when >= 0 (gradient accumulation: the non-ignored count of the global batch),
// otherwise the non-ignored count of this call; den = 0 gives loss 0 and zero gradients, never
// NaN; none: loss[t] = L_t. z_loss gets the same reduction. With G_tj = c_t dL_t/dz_tj, where
// c_t = g (sum), g/den (mean), dloss[t] (none), and 0 for ignored rows:
//   dx  = G W          [N, D] written (=)
//   dW += G^T x        [V, D] accumulated (+=) into the caller's one fp32 buffer
// p_y - 1 is formed as expm1(z_ty - lse_t) in double from the fp32 logit and an fp64 lse, so a
// confident row (p_y ~ 1) keeps its gradient (the fp32 cancellation trap of ops_notes §1.1).
//
// Shapes: x [N, D], w [V, D] (the LM-head weight, row j = token j), targets [N] I64 or I32 in
// [0, V) or -100 (anything else: an error naming the index and the value). loss and z_loss are
// [1] for sum/mean and [N] for none; lse [N]; dloss [N] for none (required), [1] for sum/mean
// (optional upstream scalar g, 1 when absent); dx [N, D]; dw [V, D].
// Dtypes: ref: F64 everywhere (it materialises the N x V logits in fp64: the oracle, not bounded).
// cpu: F32 everywhere; sums over tokens in double. cuda: bf16 x, w, dx; F32 loss, lse, z_loss,
// dloss, dw (see "cuda" below). lce_stat_dtype() gives the F64-on-ref / F32-otherwise dtype.
//
// Entry points: linear_cross_entropy_forward_backward computes the loss AND the gradients in one
// pass over the logits (gradient-in-forward, Liger's fused_linear_cross_entropy.py and QuACK's
// linear_cross_entropy.py): the trainer uses it for every training micro-batch (the LM head is the
// last op, so its backward directly follows its forward; the per-token upstream gradient of
// reduction none must then be known up front). linear_cross_entropy_forward computes loss, lse and
// z_loss only (eval); it rejects dx/dw. Nothing is saved for a later backward.
//
// Chunking (cpu; the design a cuda path follows too). Only one chunk of logits exists at a time:
// a block of R rows x a slab of S vocabulary columns, R and S chosen from a byte budget B
// (chunk_bytes, else kLceDefaultChunkBytes; B >= kLceMinChunkBytes):
//   full-V mode  if floor(B / (4V + 32)) >= min(N, kLceMinRows):  S = V, R = min(N, that);
//                per block: logits GEMM, softmax in place, dx GEMM, dW GEMM (beta = 1): 3 GEMMs.
//   slab mode    otherwise: R = min(N, kLceMinRows), S = min(V, floor(B / (4R)) - 8);
//                per block: pass 1 over the slabs computes the logits tile and an online
//                (running max, rescaled sum) lse; pass 2 recomputes each tile, turns it into G
//                and accumulates dx[block] += G W[slab] and dW[slab] += G^T x[block]: 4 GEMMs
//                (one logits recompute, CCE-style), extra memory still one tile.
// dW is accumulated slab by slab straight into the caller's buffer: never a [V, D] temporary.
// Workspace (bytes), allocated once per call or given by the caller (`workspace`, any dtype,
// contiguous, nbytes >= this), reused by every chunk:
//   workspace_bytes = align64(4 R S) + align64(32 R)       (logits tile + 4 doubles per row)
//                   <= B + kLceWorkspaceOverhead (128 bytes of alignment), whatever V and N are.
// Determinism: yes for a fixed budget and thread count (fixed row/slab order; token sums in
// order). Changing the budget changes the summation order of dW and dx (slab mode) slightly.
//
// cuda (cuda.cu; the H200 design, ops_notes §1.2/§1.6): the same budget B and the same workspace
// formula, so one caller-sized workspace serves every backend. The logits tile is bf16 (cuBLASLt,
// fp32 accumulation, rounded once) and a fused row kernel overwrites it in place with G in bf16,
// which is what the dx and dW GEMMs read anyway; at 2 bytes per element a block holds about twice
// the rows of the cpu plan in the same bytes, which halves the number of fp32 dW read-modify-write
// passes (8 GB each at V = 248320, D = 4096) and the row kernel's traffic. Numerics: the loss is
// the exact (fp32/fp64) cross-entropy of the bf16-rounded logits, as in eager bf16 training that
// upcasts its logits; row statistics in fp32: the max m and s = sum exp(z - m) over all logits
// but one maximal one (1 + s is the full sum, so 1 - p_y far below fp32's 6e-8 at 1 survives),
// the loss and the target column of G in double from them, p_y - 1 = expm1((z_y - m) - log1p s)
// (no cancellation); dx is rounded once from fp32; dW accumulates in fp32 (beta = 1) straight
// into the caller's buffer.
// linear_cross_entropy_cuda_plan(N, V, D, B) packs, into W = linear_cross_entropy_workspace_bytes
// (N, V, B), the layout (each region 16-byte aligned, in this order)
//   tile bf16 [R, ld] (ld = S rounded up to 8) | slab mode only: dx accumulator f32 [R, D] |
//   row statistics f32 [R, 8] | a 64-byte header (valid count, scales, the loss accumulators)
//   full-V  if the most rows that fit with S = V is >= min(N, kLceMinRows) (or >= 1 and >= the
//           rows slab mode would get): R = min(N, that), rounded down to a multiple of 1024, else
//           of 128, when that keeps the number of blocks (whole tiles, whole waves of the dx GEMM);
//           per block: logits GEMM, one fused row kernel (max, sum-exp, lse, z-loss, loss, then
//           G in place), dx = G W (bf16 out), dW += G^T x (fp32, beta = 1): 3 GEMMs.
//   slab    otherwise: R = min(N, kLceMinRows, rows that fit with an 8-column tile), S = the
//           widest slab that then fits; pass 1 over the slabs builds the online row statistics,
//           pass 2 recomputes each tile, writes G, dx_acc (+)= G w_slab in fp32 and
//           dw_slab += G^T x; dx = bf16(dx_acc) at the end of the block. A budget too small for
//           one row of this layout at this D is an error naming the workspace it needs.
// No host synchronisation and no allocation inside a call (the workspace is the caller's, or
// Context::scratch sized to plan.workspace_bytes once); the valid count, 1/den, the upstream
// scalar and the reduced loss stay on the device (one small setup kernel, one block-sum kernel per
// row block). Targets are not read by the host: a target outside [0, V) that is not -100 gives its
// row loss NaN (so the reduced loss is NaN and the trainer's non-finite check catches it), its lse
// as usual and a zero gradient row; nothing is read out of bounds. A caller denominator of 0 with
// non-ignored targets gives loss 0 and zero gradients (not an error: the host cannot count).
// Determinism: bitwise for a fixed plan, GPU model and toolkit (no atomics; fixed-order block
// reductions; one cached cuBLASLt plan per GEMM shape).
#pragma once

#include <cstdint>

#include "gdn/core/tensor.h"

namespace gdn::ops {

enum class LceReduction : uint8_t { Mean = 0, Sum = 1, None = 2 };

constexpr int64_t kLceIgnoreIndex = -100;
constexpr int64_t kLceMinRows = 32;          // rows per block below which slabs are used
constexpr int64_t kLceMinChunkBytes = 4096;  // smallest accepted budget
constexpr int64_t kLceDefaultChunkBytes = int64_t{256} << 20;  // 256 MiB
constexpr int64_t kLceWorkspaceOverhead = 128;  // alignment padding beyond the budget
constexpr int64_t kLceRowStatBytes = 32;        // per-row fp64 stats (max, sum, z_y, sum z)

struct LinearCrossEntropyArgs {
  Tensor x;          // [N, D]
  Tensor w;          // [V, D]
  Tensor targets;    // [N] I64 or I32, in [0, V) or -100
  Tensor loss;       // [1] (sum, mean) or [N] (none) out (=), includes the z-loss
  Tensor lse;        // [N] out (=), every row (ignored ones too)
  Tensor z_loss;     // like loss, out (=): the lambda lse^2 part, for logging
  Tensor dloss;      // forward_backward: [N] (none, required) or [1] (sum, mean; optional: 1)
  Tensor dx;         // forward_backward: [N, D] out (=)
  Tensor dw;         // forward_backward: [V, D] out (+=)
  Tensor workspace;  // optional scratch, nbytes >= linear_cross_entropy_workspace_bytes(N, V, B)
  LceReduction reduction = LceReduction::Mean;
  double z_loss_scale = 0;     // lambda >= 0; 0 adds nothing (z_loss reported as 0)
  double label_smoothing = 0;  // eps in [0, 1)
  double denominator = -1;     // mean only: < 0 counts this call's non-ignored targets
  int64_t chunk_bytes = 0;     // logits budget B; 0: kLceDefaultChunkBytes
};

struct LinearCrossEntropyTable {
  void (*forward)(const LinearCrossEntropyArgs&);
  void (*forward_backward)(const LinearCrossEntropyArgs&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void linear_cross_entropy_forward(const LinearCrossEntropyArgs& a);
void linear_cross_entropy_forward_backward(const LinearCrossEntropyArgs& a);

// The chunk plan of the cpu path (see the header comment). chunk_bytes = 0: kLceDefaultChunkBytes.
struct LceChunkPlan {
  int64_t rows = 0;             // R
  int64_t cols = 0;             // S (== V: full-V mode, one slab)
  int64_t budget = 0;           // B actually used
  int64_t workspace_bytes = 0;  // align64(4 R S) + align64(32 R)
};
LceChunkPlan linear_cross_entropy_plan(int64_t n, int64_t v, int64_t chunk_bytes);
inline int64_t linear_cross_entropy_workspace_bytes(int64_t n, int64_t v, int64_t chunk_bytes) {
  return linear_cross_entropy_plan(n, v, chunk_bytes).workspace_bytes;
}

// The plan of the cuda path (see "cuda" above): rows R, cols S (== V: full-V), the budget, and
// workspace_bytes = the bytes its layout uses, <= linear_cross_entropy_workspace_bytes(n, v, B).
// Throws when the budget cannot hold one row of the slab layout at this d.
LceChunkPlan linear_cross_entropy_cuda_plan(int64_t n, int64_t v, int64_t d, int64_t chunk_bytes);
// Bytes of the cuda layout for R rows, a tile leading dimension ld and hidden size d.
int64_t lce_cuda_layout_bytes(int64_t rows, int64_t ld, int64_t d, bool slab);
constexpr int64_t kLceCudaHeaderBytes = 64;
constexpr int64_t kLceCudaRowStatBytes = 32;  // 8 floats per row

// The loss scale shared by the implementations: 1 (sum, none), 1/den (mean; 0 when den == 0).
// `valid` is the number of non-ignored targets of this call.
double lce_mean_scale(const LinearCrossEntropyArgs& a, int64_t valid);

// lse / loss / z_loss / dloss / dw dtype for an activation dtype (F64 on ref, F32 otherwise).
inline DType lce_stat_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

}  // namespace gdn::ops
