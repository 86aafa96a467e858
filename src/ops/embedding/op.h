// Token embedding lookup: y[t] = W[ids[t]].
//
// Shapes: ids [T] (I32 or I64), W [V, D], y [T, D], dy [T, D], dW [V, D].
//   forward:  y[t, :]   = W[ids[t], :]                 written (=); an exact copy
//   backward: dW[v, :] += sum over t with ids[t] == v of dy[t, :]
//             accumulated (+=) in fp32 (fp64 on ref): dW is a gradient-accumulation buffer, and
//             with tied embeddings it also receives the LM head's gradient.
// Every id must lie in [0, V); for host ids the entry points check this before any work and
// name the first bad position and its value ("embedding: ids[5] = 300 is out of range [0, 250)").
// Device ids are not read back (that would synchronise): the cuda kernels never access memory out
// of bounds whatever the ids hold; forward writes a row of NaN for an id outside [0, V) (the loss
// turns NaN and the trainer stops there) and backward drops that token's gradient.
// Forward saves nothing the backward needs besides ids. Optionally (`plan`, cuda.ranked_windows
// only) the
// forward also ranks the ids for the backward, concurrently with its gather (a side stream joined
// before it returns), so that the backward's sort of the ids is off the backward's critical path:
//   plan: I32 [embedding_plan_numel(T, D)] on the ids' device: the (id, t) pairs in stable sorted
//         order, each 16-position window's segment bounds and zeroed combine counters (layout:
//         EmbeddingPlanLayout). Written (=) by the forward of cuda.ranked_windows; read by its
//         backward (which leaves the counters zeroed again, so a plan
//         serves any number of backwards), which then runs no sort. The backward's result is
//         bitwise the same with or without a plan. Other implementations (ref, cpu,
//         cuda.sorted_windows) neither write nor read it. A plan is valid for the ids and the D
//         of the forward that wrote it, with the same implementation: pass it to the backward of
//         those ids only (like gated_delta_rule's `saved`, the device contents are not checked).
// Dtypes: ref F64 W/y/dy/dW; cpu F32; cuda bf16 W/y/dy with an F32 dW, ids I32 or I64 on the
// device.
// Deterministic: yes, bitwise, and independent of the thread count: the cpu backward gives each
// thread a block of the D columns; a thread walks the tokens in order t = 0..T-1, so every dW
// element receives its terms in ascending t, exactly as the serial loop does. No atomics.
// cuda: a stable radix sort of (id, t) pairs, then fixed windows of the sorted positions summed in
// t order, windows combined in window order (src/ops/embedding/cuda.cu): the order depends on the
// ids alone, bitwise reproducible, no float atomics; it may differ from the ascending-t serial
// order in rounding. cuda.ranked_windows (src/ops/embedding/cuda_ranked_windows.cu) has the same
// order semantics with 16-position windows: the sorted positions come from exact
// ranks, and a spanning segment is combined by whichever of its windows' blocks finishes last,
// still in window order.
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct EmbeddingFwd {
  Tensor ids;        // [T] I32 or I64
  Tensor w;          // [V, D]
  Tensor y;          // [T, D] out (=)
  Tensor plan = {};  // optional, I32 [embedding_plan_numel(T, D)] out (=): see above
};

struct EmbeddingBwd {
  Tensor ids;        // [T] I32 or I64
  Tensor dy;         // [T, D]
  Tensor dw;         // [V, D] out (+=), F32 (F64 on ref)
  Tensor plan = {};  // optional: the plan the forward of these ids wrote
};

// Where the parts of a plan lie, in 4-byte words from its start (every part 256-byte aligned):
// keys [T] (sorted ids; V for an invalid id), toks [T] (the token at each sorted position),
// win_info [4 nwin] (per window of kWin sorted positions: the first position of the segment that
// holds its first position, one past the end of the segment that holds its last one, two unused
// words), counters [nwin * chunks] (per window and column chunk of kChunkCols columns or fewer).
struct EmbeddingPlanLayout {
  static constexpr int64_t kWin = 16;         // sorted positions per window
  static constexpr int64_t kChunkCols = 256;  // the fewest columns a backward block covers
  int64_t keys = 0, toks = 0, win_info = 0, counters = 0, numel = 0;
  int64_t nwin = 0, chunks = 0;
  EmbeddingPlanLayout(int64_t T, int64_t D) {
    auto up = [](int64_t n) { return (n + 63) / 64 * 64; };  // 64 words: 256 bytes
    nwin = (T + kWin - 1) / kWin;
    chunks = (D + kChunkCols - 1) / kChunkCols;
    toks = up(T);
    win_info = toks + up(T);
    counters = win_info + up(4 * nwin);
    numel = counters + up(nwin * chunks);
  }
};

// The number of I32 elements of an embedding plan for T ids and rows of D (T, D >= 0).
int64_t embedding_plan_numel(int64_t T, int64_t D);

struct EmbeddingTable {
  void (*forward)(const EmbeddingFwd&);
  void (*backward)(const EmbeddingBwd&);
};

void embedding_forward(const EmbeddingFwd& a);
void embedding_backward(const EmbeddingBwd& a);

// Throws gdn::Error naming the first position whose id is outside [0, vocab). Host ids only.
void embedding_check_ids(const Tensor& ids, int64_t vocab);

// The id at position t of an I32 or I64 host tensor (implementations share this).
inline int64_t embedding_id(const Tensor& ids, int64_t t) {
  return ids.dtype() == DType::I32 ? static_cast<const int32_t*>(ids.data())[t]
                                   : static_cast<const int64_t*>(ids.data())[t];
}

// The dtype of dW for an activation dtype (F64 for ref, F32 otherwise).
inline DType embedding_grad_dtype(DType act) { return act == DType::F64 ? DType::F64 : DType::F32; }

// CUDA workspace (gdn/backend/op_workspace.h): the backward of both CUDA implementations takes
// its sort buffers (cub's temporaries for long batches) and the windows' [nwin, 2, D] fp32
// partials in one scratch request; cuda.ranked_windows also the plan's parts when the caller gives
// no plan, and its forward (given a plan) the sort's buffers. embedding_workspace_bytes is the
// largest request of a call of T tokens into a [vocab, D] table, which bounds every call of at
// most T tokens (the requests are non-decreasing in T). 0 in builds without CUDA.
size_t embedding_workspace_bytes(int64_t T, int64_t vocab, int64_t D);

}  // namespace gdn::ops
