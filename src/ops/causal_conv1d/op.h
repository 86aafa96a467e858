// Depthwise causal conv1d over packed documents, with optional bias, SiLU and per-document
// conv state: the GDN short convolution (gdn_spec.md §1.5.2 step 3, §4).
//
// Per document n (tokens s = cu_seqlens[n] .. e = cu_seqlens[n+1], length L = e - s) and channel
// c, define the extended input of length L + W - 1:
//   ext[k] = state[n, c, k]            for k in [0, W-1)       (the W-1 inputs before the document)
//   ext[k] = x[s + k - (W-1), c]       for k in [W-1, L+W-1)
// where state is initial_state when given, else zeros. Then, for t in [0, L):
//   z[t, c] = bias[c] + sum_{j=0}^{W-1} weight[c, j] * ext[t + j]
//   y[s + t, c] = silu(z) = z * sigmoid(z)   (or z when silu is off)
// so tap j = W-1 multiplies the current token and tap 0 the oldest, as in HF's
// conv1d.weight[c, 0, j] (gdn_spec.md §8.1). No output reads an input of another document.
// final_state[n, c, k] = ext[L + k], k in [0, W-1): the last W-1 inputs of the document, oldest
// first; when L < W-1 its first W-1-L columns come from the initial state (or are zeros).
//
// State-length convention: W-1 columns, oldest first, column W-2 = the input just before the
// document (Dao's causal-conv1d `initial_states` / `final_states_out` [B, D, W-1]). HF's cache
// keeps W columns (the last W inputs, torch_causal_conv1d_update) and FLA's triton conv keeps
// [N, D, W]; in both, column 0 is never read by the next output. Mapping:
//   ours = hf_conv_state[:, :, 1:]        hf_conv_state = [any column | ours] (e.g. zeros)
// and the same for FLA. For W = 1 the state has zero columns.
//
// Zero-length documents (cu_seqlens[n] == cu_seqlens[n+1]) are accepted: they produce no
// output, their final state equals their initial state (or zeros), and in backward their
// d(initial_state) equals their d(final_state) (or zeros). Packers pad with such segments, and
// peers have failed on them (gdn_spec.md §6), hence an explicit rule.
//
// Shapes: x, y, dy, dx [T, C] token-major (C = conv_dim channels contiguous per token);
// weight, dweight [C, W] (HF's [C, 1, W] squeezed), W in 1..8; bias, dbias [C];
// cu_seqlens [N+1] I32 (optional: absent = one document of T tokens, N = 1);
// initial_state, final_state, dinitial_state, dfinal_state [N, C, W-1].
// Forward writes y (=) and, when given, final_state (=). Forward saves nothing: backward reads
// x, weight, bias, initial_state and cu_seqlens again and recomputes the pre-activation z in
// registers (as Dao's causal-conv1d does) instead of storing a [T, C] z: one extra W-tap dot
// product per element, no extra activation memory.
// Backward (u = dy * silu'(z), silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))); u = dy
// without SiLU; dext[k] = sum_{j, 0 <= k-j < L} weight[c, j] * u[k-j] + dfinal_state[n, c, k-L]
// (the last term only for k >= L)):
//   dx[s + t, c]            = dext[t + W-1]                          written (=)
//   dinitial_state[n, c, k] = dext[k], k < W-1                       written (=), optional
//   dweight[c, j]          += sum_n sum_t u[t] * ext[t + j]          accumulated (+=)
//   dbias[c]               += sum_n sum_t u[t]                       accumulated (+=), optional
// dfinal_state is an optional input (absent = zero). dinitial_state may be given only with
// initial_state (a zero state is a constant); dbias only with bias.
// Dtypes: ref F64 everywhere. cpu F32 everywhere. cuda: x, weight, bias, the states, y, dy, dx
//   in bf16; dweight and dbias F32 (gradient accumulation, ARCHITECTURE §4). cu_seqlens I32.
// Determinism: yes. cpu sums dweight / dbias per channel in a fixed order (per 256-token chunk,
//   tokens from last to first; then the chunk partials in chunk order), independent of the
//   thread count.
// Bad input (gdn::Error naming the tensor): shapes, dtypes, devices, W outside 1..8, and
//   cu_seqlens not starting at 0, decreasing, or not ending at T (values checked for host
//   cu_seqlens; a device cu_seqlens is the packer's responsibility, since reading it here would
//   synchronise).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gdn/backend/op_workspace.h"
#include "gdn/core/tensor.h"

namespace gdn::ops {

inline constexpr int64_t kConvMaxWidth = 8;

struct CausalConv1dFwd {
  Tensor x;                // [T, C]
  Tensor weight;           // [C, W]
  Tensor bias{};           // [C] optional
  Tensor cu_seqlens;       // [N+1] I32, optional (one document)
  Tensor initial_state{};  // [N, C, W-1] optional (zeros)
  Tensor y;                // [T, C] out (=)
  Tensor final_state{};    // [N, C, W-1] optional out (=)
  bool silu = true;
};

struct CausalConv1dBwd {
  Tensor x;                 // [T, C]
  Tensor weight;            // [C, W]
  Tensor bias{};            // [C] optional (needed to recompute z under SiLU)
  Tensor cu_seqlens;        // [N+1] I32, optional
  Tensor initial_state{};   // [N, C, W-1] optional
  Tensor dy;                // [T, C]
  Tensor dfinal_state{};    // [N, C, W-1] optional (zero)
  Tensor dx;                // [T, C] out (=)
  Tensor dweight;           // [C, W] out (+=), grad dtype
  Tensor dbias{};           // [C] optional out (+=), grad dtype; only with bias
  Tensor dinitial_state{};  // [N, C, W-1] optional out (=); only with initial_state
  bool silu = true;
};

struct CausalConv1dTable {
  void (*forward)(const CausalConv1dFwd&);
  void (*backward)(const CausalConv1dBwd&);
};

// Validate, resolve the implementation for the tensors' backend, run.
void causal_conv1d_forward(const CausalConv1dFwd& args);
void causal_conv1d_backward(const CausalConv1dBwd& args);

// The dtype of dweight / dbias for a given activation dtype (F64 for ref, F32 otherwise).
inline DType causal_conv1d_grad_dtype(DType act) {
  return act == DType::F64 ? DType::F64 : DType::F32;
}

// Number of documents: cu_seqlens.numel() - 1, or 1 when cu_seqlens is absent.
inline int64_t causal_conv1d_num_docs(const Tensor& cu_seqlens) {
  return cu_seqlens.defined() ? cu_seqlens.numel() - 1 : 1;
}

// Document boundaries [N+1] from a (validated, host) cu_seqlens, or {0, T} when it is absent.
inline std::vector<int64_t> causal_conv1d_bounds(const Tensor& cu_seqlens, int64_t T) {
  if (!cu_seqlens.defined()) return {0, T};
  const int32_t* cu = cu_seqlens.ptr<int32_t>();  // [N+1]
  return std::vector<int64_t>(cu, cu + cu_seqlens.numel());
}

// CUDA workspace (gdn/backend/op_workspace.h). The backward of both CUDA implementations (cuda,
// cuda.sliding_window) takes [G, W+1, C] fp32 partial sums of dweight and dbias, G = the blocks
// per channel column (causal_conv1d_partial_bytes: the request for a G), and only when T > 0. G is
// at most max(1, resident / ncb) with resident <= sm_count * max_blocks_per_sm and ncb =
// ceil(C / column) >= ceil(C / kCausalConv1dMaxColumn) (each implementation static_asserts its
// column width against it), and at most T (G <= its token tiles or segments). So
// causal_conv1d_workspace_bytes bounds every request of a call of T tokens, width W and C channels
// on a device of `sm_count` multiprocessors holding at most `max_blocks_per_sm` resident blocks
// (cudaDeviceProp::multiProcessorCount, ::maxBlocksPerMultiProcessor). The forward takes none.
inline constexpr int64_t kCausalConv1dMaxColumn = 256;  // channels per column, widest CUDA impl
inline size_t causal_conv1d_partial_bytes(int64_t G, int64_t W, int64_t C) {
  return static_cast<size_t>(G) * static_cast<size_t>(W + 1) * static_cast<size_t>(C) *
         sizeof(float);
}
inline size_t causal_conv1d_workspace_bytes(int64_t T, int64_t W, int64_t C, int sm_count,
                                            int max_blocks_per_sm) {
  if (T <= 0 || C <= 0 || W < 0) return 0;
  const int64_t ncb_min = (C + kCausalConv1dMaxColumn - 1) / kCausalConv1dMaxColumn;
  const int64_t resident = persistent_grid_bound(INT64_MAX, sm_count, max_blocks_per_sm);
  const int64_t G = std::min<int64_t>(std::max<int64_t>(resident / ncb_min, 1), T);
  return causal_conv1d_partial_bytes(G, W, C);
}

}  // namespace gdn::ops
