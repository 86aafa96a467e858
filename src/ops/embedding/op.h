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
// Forward saves nothing: backward needs only ids.
// Dtypes: ref F64 W/y/dy/dW; cpu F32; cuda bf16 W/y/dy with an F32 dW, ids I32 or I64 on the
// device.
// Deterministic: yes, bitwise, and independent of the thread count: the cpu backward gives each
// thread a block of the D columns; a thread walks the tokens in order t = 0..T-1, so every dW
// element receives its terms in ascending t, exactly as the serial loop does. No atomics.
// cuda: a stable radix sort of (id, t) pairs, then fixed windows of the sorted positions summed in
// t order, windows combined in window order (src/ops/embedding/cuda.cu): the order depends on the
// ids alone, bitwise reproducible, no float atomics; it may differ from the ascending-t serial
// order in rounding. cuda.v2 and cuda.v2r (src/ops/embedding/cuda_v2.cu; bitwise equal to each
// other: the ranks are exact either way) have the same order semantics with
// 16-position windows: the sorted positions come from exact
// ranks, and a spanning segment is combined by whichever of its windows' blocks finishes last,
// still in window order.
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct EmbeddingFwd {
  Tensor ids;  // [T] I32 or I64
  Tensor w;    // [V, D]
  Tensor y;    // [T, D] out (=)
};

struct EmbeddingBwd {
  Tensor ids;  // [T] I32 or I64
  Tensor dy;   // [T, D]
  Tensor dw;   // [V, D] out (+=), F32 (F64 on ref)
};

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

}  // namespace gdn::ops
