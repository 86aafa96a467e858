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
    {"axpy", 8e-3, 0.0},
    // y: an exact copy; dW: fp32 sums of bf16 rows (~1e-7).
    {"embedding", 0.0, 1e-5},
    // y, dx, dz: bf16 outputs (~2e-3 from their rounding); rstd, dw: fp32.
    {"gated_rmsnorm", 8e-3, 8e-3},
    // g, beta: fp32 (expf / log1pf, ~1e-7); da, db: bf16 outputs (~2e-3); dA_log, ddt_bias: fp32.
    {"gdn_gates", 1e-5, 8e-3},
    // C, dA, dB in bf16 (~2e-3 from their rounding; fp32 accumulation adds ~1e-6 at K ~ 1e3).
    {"gemm", 8e-3, 8e-3},
    // y, dx: bf16 outputs (~2e-3 from their rounding); rstd: fp32.
    {"l2norm", 8e-3, 8e-3},
    // y, dx: bf16 outputs (~2e-3 from their rounding); rstd, dw: fp32.
    {"rmsnorm", 8e-3, 8e-3},
    // y, dgate, dup: bf16 outputs (~2e-3 from their rounding).
    {"swiglu", 8e-3, 8e-3},
};

// The bf16 tolerance of `op`. Evaluate it in a constant expression (constexpr variable) so that an
// op missing from the table is a compile error.
constexpr ProbeError bf16_tolerance(std::string_view op) {
  for (const OpTolerance& t : kBf16Tolerances)
    if (t.op == op) return ProbeError{t.fwd, t.bwd};
  throw "op missing from kBf16Tolerances (src/backend/tolerances.h)";
}

}  // namespace gdn
