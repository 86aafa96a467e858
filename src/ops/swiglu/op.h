// SwiGLU activation of the dense MLP: y = silu(gate) * up, elementwise.
//
// Layout choice: gate and up are two separate [R, I] tensors, the outputs of HF Qwen3.5's separate
// mlp.gate_proj and mlp.up_proj (two [I, D] weights). Two linear calls write them; nothing has to
// be split or interleaved. R = rows (tokens, callers flatten leading dims), I = MLP width.
//
//   s = sigmoid(gate), silu = gate * s
//   forward:  y     = gate * s * up                                        written (=)
//   backward: dup   = dy * gate * s                                        written (=)
//             dgate = dy * up * s * (1 + gate * (1 - s))                   written (=)
//                   = dy * up * (s + silu * (1 - s))
// Forward saves nothing: backward recomputes s from gate (ops_notes.md §2; Liger's swiglu.py
// does the same). Backward reads each element of gate, up and dy before writing that element of
// dgate and dup, so dgate may alias gate and dup may alias up (in-place backward, which frees the
// saved activations' memory for the gradients).
// Dtypes: ref F64; cpu F32 (fp32 arithmetic); cuda bf16 storage, fp32 arithmetic.
// Deterministic: yes (elementwise).
#pragma once

#include "gdn/core/tensor.h"

namespace gdn::ops {

struct SwigluFwd {
  Tensor gate;  // [R, I]
  Tensor up;    // [R, I]
  Tensor y;     // [R, I] out (=)
};

struct SwigluBwd {
  Tensor gate;   // [R, I] (forward input)
  Tensor up;     // [R, I] (forward input)
  Tensor dy;     // [R, I]
  Tensor dgate;  // [R, I] out (=); may alias gate
  Tensor dup;    // [R, I] out (=); may alias up
};

struct SwigluTable {
  void (*forward)(const SwigluFwd&);
  void (*backward)(const SwigluBwd&);
};

void swiglu_forward(const SwigluFwd& a);
void swiglu_backward(const SwigluBwd& a);

}  // namespace gdn::ops
