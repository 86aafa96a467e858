// Gated full attention core of Qwen3.5 / Qwen3-Next (gdn_spec.md §1.6): everything between the
// q/k/v projections and o_proj. HF: transformers models/qwen3_5/modeling_qwen3_5.py,
// Qwen3_5Attention.forward, apply_rotary_pos_emb, Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding.
//
// Inputs (T tokens packed as documents by cu_seqlens, FlashAttention varlen convention):
//   qg [T, Hq, 2·hd]   q_proj output viewed per head as [query(hd) | gate(hd)]
//   k  [T, Hkv, hd]    k_proj output;  v [T, Hkv, hd] v_proj output
//   q_norm_w, k_norm_w [hd]   zero-centred RMSNorm weights (applied as 1 + w)
//   cu_seqlens [N+1] I32: 0 = c_0 <= c_1 <= ... <= c_N = T; document n is tokens [c_n, c_{n+1}).
//   Empty documents are allowed and contribute nothing.
//
// Maths, per token t of document n (position p = t - c_n), query head h, kv head j = h / (Hq/Hkv):
//   q_hat[t,h] = rope_p( q[t,h] · r_q · (1 + q_norm_w) ),  r_q = 1/sqrt(mean(q[t,h]^2) + eps)
//   k_hat[t,j] = rope_p( k[t,j] · r_k · (1 + k_norm_w) )
//   rope_p: NeoX rotate-half on the first R = rotary_dim dims (R even), dims R..hd-1 untouched:
//     for i < R/2:  θ_i = p · theta^(-2i/R)
//       y[i]     = x[i] cos θ_i − x[i+R/2] sin θ_i
//       y[i+R/2] = x[i+R/2] cos θ_i + x[i] sin θ_i
//   s[t,u]   = hd^(-1/2) · <q_hat[t,h], k_hat[u,j]>   for u in [c_n, t] (causal, same document)
//   lse[t,h] = log Σ_u exp(s[t,u])
//   attn[t,h] = Σ_u exp(s[t,u] − lse[t,h]) · v[u,j]
//   o[t,h]   = attn[t,h] ⊙ sigmoid(gate[t,h])
// Positions restart at 0 in every document; no token attends across a document boundary.
// rotary_dim = int(hd · partial_rotary_factor) (HF; Qwen3.5: 256 · 0.25 = 64); theta = rope_theta
// (Qwen3.5 / Qwen3-Next: 1e7). Text-only interleaved M-RoPE reduces to this 1-D RoPE (§1.6.3).
// inv_freq and the angles are formed in fp64 on ref and cpu (HF forms them in fp32; at position p
// the two differ by about p · 1e-7 rad).
//
// Forward writes (=): o, and the tensors it saves for the backward:
//   q_hat [T, Hq, hd], k_hat [T, Hkv, hd]   normalized + roped q and k (the attention's operands)
//   attn  [T, Hq, hd]                        attention output before the gate (needed for
//                                            D = rowsum(dattn ∘ attn) and for dgate; recovering it
//                                            as o / sigmoid(gate) is unstable for gate << 0)
//   lse   [T, Hq], q_rstd [T, Hq], k_rstd [T, Hkv]   softmax log-sum-exp and the norms' 1/rms
// Backward (given do [T, Hq, hd]) takes the forward inputs, the saved tensors and writes
//   dqg [T, Hq, 2·hd] (=)  query part through attention, RoPE and q_norm; gate part
//                          do ⊙ attn ⊙ σ'(gate)
//   dk  [T, Hkv, hd]  (=)  through attention, RoPE and k_norm;  dv [T, Hkv, hd] (=)
//   dq_norm_w, dk_norm_w [hd] (+=)  fp32 (fp64 on ref): may be gradient-accumulation buffers
// The backward recomputes the attention probabilities blockwise from q_hat, k_hat and lse
// (FlashAttention-2: Dao, "FlashAttention-2", 2023, Algorithm 2), so no implementation holds more
// than O(T · hd) memory per head; `ref` instead recomputes everything from the inputs with the
// plain O(T_n^2) per-document loops and ignores the saved tensors (the oracle shares nothing).
//
// Dtypes: ref F64 everywhere (cu_seqlens I32); cpu F32; cuda: bf16 qg/k/v/weights/o/q_hat/k_hat/
// attn/do/dqg/dk/dv with F32 lse, rstd and weight gradients.
// cu_seqlens values are validated on the host (CPU tensors); device callers validate them when
// they build the batch.
// Determinism: ref and cpu are deterministic for a given thread count (no atomics; the weight
// gradients are reduced per thread and summed in thread order); cuda is bit-identical run to run
// (no atomics: dq has its own pass, the weight gradients are summed in a fixed order).
// cuda limits: hd % 8 == 0 and hd <= 256 (its capability check says so), every bf16 tensor
// 16-byte aligned (checked, clear error otherwise).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct GatedAttentionFwd {
  Tensor qg;          // [T, Hq, 2*hd]
  Tensor k;           // [T, Hkv, hd]
  Tensor v;           // [T, Hkv, hd]
  Tensor q_norm_w;    // [hd]
  Tensor k_norm_w;    // [hd]
  Tensor cu_seqlens;  // [N+1] I32
  Tensor o;           // [T, Hq, hd] out
  Tensor q_hat;       // [T, Hq, hd] out (saved)
  Tensor k_hat;       // [T, Hkv, hd] out (saved)
  Tensor attn;        // [T, Hq, hd] out (saved)
  Tensor lse;         // [T, Hq] out (saved; stat dtype)
  Tensor q_rstd;      // [T, Hq] out (saved; stat dtype)
  Tensor k_rstd;      // [T, Hkv] out (saved; stat dtype)
  int64_t rotary_dim = 0;
  double rope_theta = 1e7;
  double eps = 1e-6;
};

struct GatedAttentionBwd {
  Tensor qg;          // [T, Hq, 2*hd]
  Tensor k;           // [T, Hkv, hd]
  Tensor v;           // [T, Hkv, hd]
  Tensor q_norm_w;    // [hd]
  Tensor k_norm_w;    // [hd]
  Tensor cu_seqlens;  // [N+1] I32
  Tensor q_hat;       // [T, Hq, hd] from forward
  Tensor k_hat;       // [T, Hkv, hd] from forward
  Tensor attn;        // [T, Hq, hd] from forward
  Tensor lse;         // [T, Hq] from forward
  Tensor q_rstd;      // [T, Hq] from forward
  Tensor k_rstd;      // [T, Hkv] from forward
  Tensor d_o;         // [T, Hq, hd] upstream gradient of o
  Tensor dqg;         // [T, Hq, 2*hd] out (=)
  Tensor dk;          // [T, Hkv, hd] out (=)
  Tensor dv;          // [T, Hkv, hd] out (=)
  Tensor dq_norm_w;   // [hd] out (+=, stat dtype)
  Tensor dk_norm_w;   // [hd] out (+=, stat dtype)
  int64_t rotary_dim = 0;
  double rope_theta = 1e7;
  double eps = 1e-6;
};

struct GatedAttentionTable {
  void (*forward)(const GatedAttentionFwd&);
  void (*backward)(const GatedAttentionBwd&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void gated_attention_forward(const GatedAttentionFwd& a);
void gated_attention_backward(const GatedAttentionBwd& a);

// The dtype of lse / rstd / norm-weight gradients for an activation dtype (F64 for ref, else F32).
inline DType gated_attention_stat_dtype(DType act) {
  return act == DType::F64 ? DType::F64 : DType::F32;
}
// HF's rotary width: int(hd · partial_rotary_factor), truncated; the factor must be in [0, 1].
int64_t gated_attention_rotary_dim(int64_t hd, double partial_rotary_factor);

// CUDA workspace (gdn/backend/op_workspace.h): both CUDA implementations take, in one scratch
// request per call, the tile index ([N+1] twice) and, in the backward, D [T, Hq], dA [T, Hq, hd]
// bf16, dq_hat [T, Hq, hd] and dk_hat [T, Hkv, hd] fp32 and the norm weights' per-block partials
// (cuda.cu carves them). gated_attention_workspace_bytes is the larger of the forward's and the
// backward's request for T tokens in N documents, which bounds every call of at most T tokens and
// N documents with these heads. 0 in builds without CUDA.
size_t gated_attention_workspace_bytes(int64_t T, int64_t N, int64_t Hq, int64_t Hkv, int64_t hd);

}  // namespace gdn::ops
