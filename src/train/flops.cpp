#include "train/flops.h"

#include <fmt/format.h>

namespace gdn::train {

// Training FLOPs of one micro-batch (forward + backward), the numerator of MFU. Matmuls: 6 FLOPs
// per matmul parameter per token (the LM head included, the embedding lookup not). Attention core:
// QK^T and PV, 4*hd FLOPs per (query, key) pair and query head in the forward, over the causal
// pairs of each document, times 3 for forward + backward. GDN core: the chunked algorithm's
// forward, 2*(3*C*dk + 2*C*dv + 3*dk*dv) FLOPs per token and value head (C = 64), times 3.
double matmul_params(const model::Qwen35Config& c) {
  const double D = static_cast<double>(c.hidden_size), I = static_cast<double>(c.intermediate_size);
  const double hd = static_cast<double>(c.head_dim),
               Hq = static_cast<double>(c.num_attention_heads),
               Hkv = static_cast<double>(c.num_key_value_heads);
  const double mlp = 3 * D * I;
  const double attn = D * 2 * Hq * hd + 2 * D * Hkv * hd + Hq * hd * D;
  const double gdn = D * static_cast<double>(c.conv_dim()) +
                     D * static_cast<double>(c.value_dim()) +
                     2 * D * static_cast<double>(c.linear_num_value_heads) +
                     static_cast<double>(c.value_dim()) * D;
  return static_cast<double>(c.num_hidden_layers) * mlp +
         static_cast<double>(c.num_full_attention_layers()) * attn +
         static_cast<double>(c.num_linear_attention_layers()) * gdn +
         static_cast<double>(c.vocab_size) * D;
}

double step_flops(const model::Qwen35Config& c, const MicroBatch& mb) {
  const double T = static_cast<double>(mb.num_tokens());
  double pairs = 0;  // causal (query, key) pairs within documents
  for (size_t i = 0; i + 1 < mb.cu_seqlens.size(); ++i) {
    const double L = mb.cu_seqlens[i + 1] - mb.cu_seqlens[i];
    pairs += L * (L + 1) / 2;
  }
  const double attn = static_cast<double>(c.num_full_attention_layers()) * 4.0 *
                      static_cast<double>(c.num_attention_heads * c.head_dim) * pairs;
  const double dk = static_cast<double>(c.linear_key_head_dim),
               dv = static_cast<double>(c.linear_value_head_dim);
  const double gdn = static_cast<double>(c.num_linear_attention_layers()) *
                     static_cast<double>(c.linear_num_value_heads) * T * 2.0 *
                     (3 * 64 * dk + 2 * 64 * dv + 3 * dk * dv);
  return 6.0 * matmul_params(c) * T + 3.0 * (attn + gdn);
}

std::string flops_formula(const model::Qwen35Config& c) {
  return fmt::format(
      "MFU = FLOPs / (step time x {:.1f} TFLOP/s, dense bf16 H100/H200 SXM); FLOPs per micro-batch "
      "= 6 x {:.4g} matmul parameters x T + 3 x (attention 4*Hq*hd*(causal pairs) + GDN "
      "2*(3*64*dk + 2*64*dv + 3*dk*dv)*Hv*T per layer)",
      kPeakFlops / 1e12, matmul_params(c));
}

}  // namespace gdn::train
