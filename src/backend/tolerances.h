// The one table of bf16 tolerances (relative L2 error against the fp64 reference, forward and
// backward), used by every op's probe (OpDesc::tolerance) and by the GPU tests, so that the
// resolver and the tests accept exactly the same error.
//
// How the numbers are set: a bf16-storage / fp32-arithmetic kernel fed the same bf16-rounded inputs
// as ref differs from it mainly by the final rounding of its bf16 outputs, ~2^-9 relative per
// element, about 1.5e-3 to 2.5e-3 in relative L2 for well-spread values; fp32 outputs (rstd, dw)
// are far tighter. A limit of 3-4x that leaves room for fp32 reduction order while still rejecting
// any structural mistake (a wrong term, a missing (1 + w), a skipped accumulation), which shows up
// as 1e-2 to 1.
//
// Each limit is about 3x the error measured on the H200 at the op's production class (Qwen3.5-4B's
// shapes, `gdntrain probe --model bench/configs/qwen35_4b.json --backend cuda`, docs/PERF.md run
// 57): the memory-bound ops measured 1.62e-3 to 1.67e-3 (their bf16 output rounding), so 5e-3.
// Add a line per op when its CUDA implementation lands (keep the table sorted by op name).
#pragma once

#include <string_view>

#include "gdn/backend/registry.h"

namespace gdn {

struct OpTolerance {
  std::string_view op;
  double fwd;
  double bwd;
};

inline constexpr OpTolerance kBf16Tolerances[] = {
    // p, m, v fp32 on every backend (the bf16 copy is checked bit for bit by the probe); no
    // backward.
    {"adamw", 1e-5, 0.0},
    // y += alpha x: one bf16 rounding of y (~2e-3); no backward.
    {"axpy", 5e-3, 0.0},
    // y, dx, dinitial_state: bf16 outputs (~2e-3 from their rounding); final_state: exact copies;
    // dweight, dbias: fp32 (fp32 sums over the tokens, ~1e-6). Measured 1.66e-3 / 1.65e-3.
    {"causal_conv1d", 5e-3, 5e-3},
    // loss, lse, z_loss: fp32 row sums over the same bf16 logits as ref (~1e-6); dlogits: bf16
    // outputs (~2e-3 from their rounding).
    {"cross_entropy", 1e-4, 5e-3},
    // y: an exact copy; dW: fp32 sums of bf16 rows (~1e-7).
    {"embedding", 0.0, 1e-5},
    // o, attn, q_hat, k_hat in bf16 (~1.7e-3 from their rounding; o, attn ~2.5e-3 with the bf16
    // P of the P V product); dqg, dk, dv through the bf16 dA, P and dS operands. Measured on the
    // H200 at Qwen3.5's class (hd 256, rot 64, group 4; `gdntrain probe --model
    // bench/configs/qwen35_4b.json`, 2026-12-01): fwd 2.57e-3, bwd 4.14e-3. About 3.6x that.
    {"gated_attention", 1e-2, 1.5e-2},
    // o, dq, dk, dv in bf16; every chunk product takes bf16 operands (normalised q/k, T, W, U, V',
    // the state snapshots, the score matrices: ~2^-9 each, gdn_spec.md §3.7), a few of them in
    // series, so a chain error of a few 1e-3 on o and the gradients; hT, dh0, dg, dbeta are fp32
    // but inherit the operands' rounding. Measured on the H200 at Qwen3.5's class (dk = dv = 128,
    // l2norm, saved; `gdntrain probe --model bench/configs/qwen35_4b.json`, 2026-12-01): fwd
    // 4.22e-3, bwd 3.96e-3: about 3.1x that forward; the backward keeps room for the GPU sweep's
    // worst shape (GdrCuda.TrailingOutputGivesTheSameBits: 1.67e-2 on the H200, same date).
    {"gated_delta_rule", 1.3e-2, 2.5e-2},
    // y, dx, dz: bf16 outputs (~2e-3 from their rounding); rstd, dw: fp32. Measured (D = 128)
    // 1.67e-3 / 1.62e-3.
    {"gated_rmsnorm", 5e-3, 5e-3},
    // g, beta: fp32 (expf / log1pf, ~1e-7); da, db: bf16 outputs (~2e-3); dA_log, ddt_bias: fp32.
    {"gdn_gates", 1e-5, 5e-3},
    // C, dA, dB in bf16 (~2e-3 from their rounding; fp32 accumulation adds ~1e-6 at K ~ 1e3).
    {"gemm", 5e-3, 5e-3},
    // y, dx: bf16 outputs (~2e-3 from their rounding); rstd: fp32.
    {"l2norm", 5e-3, 5e-3},
    // Logits rounded to bf16 before the softmax (~|z| 2^-9 each): loss, lse, z_loss 1e-5..1.3e-3;
    // G and dx in bf16, p_j off by ~|z| 2^-9 relative: dx, dW 2e-3..7e-3 at logit std 2.5-3.7
    // (emulated in fp64 with the kernel's roundings at the probe's and the tests' shapes).
    // Measured at Qwen3.5-4B's class (D 2560, V 248320): 1.46e-3 / 3.50e-3.
    {"linear_cross_entropy", 4.5e-3, 1.2e-2},
    // y = a b: one bf16 rounding (~2e-3); no backward.
    {"mul", 5e-3, 0.0},
    // y, dx: bf16 outputs (~2e-3 from their rounding); rstd, dw: fp32. Measured (D = 2560)
    // 1.67e-3 / 1.67e-3.
    {"rmsnorm", 5e-3, 5e-3},
    // y, dx: bf16 outputs (~2e-3 from their rounding).
    {"silu", 5e-3, 5e-3},
    // y, dgate, dup: bf16 outputs (~2e-3 from their rounding).
    {"swiglu", 5e-3, 5e-3},
};

// The bf16 tolerance of `op`. Evaluate it in a constant expression (constexpr variable) so that an
// op missing from the table is a compile error.
constexpr ProbeError bf16_tolerance(std::string_view op) {
  for (const OpTolerance& t : kBf16Tolerances)
    if (t.op == op) return ProbeError{t.fwd, t.bwd};
  throw "op missing from kBf16Tolerances (src/backend/tolerances.h)";
}

}  // namespace gdn
