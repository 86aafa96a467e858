// Linear cross-entropy on the CPU: fp32 logits chunks from OpenBLAS sgemm, per-row softmax work
// in parallel with OpenMP, per-row statistics and token sums in double. The chunk plan (op.h)
// bounds the extra memory to one logits tile whatever V is; dW is accumulated slab by slab with
// sgemm (beta = 1) straight into the caller's buffer, as in Liger's fused_linear_cross_entropy.py
// after its issue #1323 (never a [V, D] temporary per chunk).
//
// Per row block (R rows):
//   pass 1, per vocabulary slab: tile = x_blk w_slab^T; each row updates a running max m and a
//     sum s = sum exp(z - m) rescaled when m grows (online lse), picks up z_y and sum z.
//     In full-V mode (one slab) the tile keeps exp(z - m) in place for the gradient.
//   finalise: lse = m + log s, the per-token loss, the gradient coefficient c.
//   pass 2, per slab (recomputing the tile in slab mode): G = c((1 + 2 lambda lse) p - eps/V)
//     with the target column set from expm1(z_y - lse) in double, then dx_blk (+)= G w_slab and
//     dw_slab += G^T x_blk.
#include "backend/cpu/blas.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/linear_cross_entropy/op.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "linear_cross_entropy";
// Tiles smaller than this run their row loops on one thread: an OpenMP region costs more than the
// work, and its spinning threads would compete with OpenBLAS's own threads for the cores.
constexpr int64_t kParallelMinElems = int64_t{1} << 15;

// Per-row statistics of the current block (kLceRowStatBytes each). `c` holds sum z until the row
// is finalised, then the gradient coefficient.
struct RowStat {
  double m;   // running max of the row's logits (an fp32 value)
  double s;   // sum_j exp(z_j - m) so far
  double zy;  // the target's fp32 logit (0 for ignored rows)
  double c;   // pass 1: sum_j z_j; after finalise: c_t (0 for ignored rows)
};
static_assert(sizeof(RowStat) == kLceRowStatBytes);

int64_t target_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::I64 ? t.ptr<int64_t>()[i] : t.ptr<int32_t>()[i];
}

// Pass-1 update of one row with one slab of its logits; `keep_exp` overwrites z with exp(z - m)
// (only valid when the slab is the whole row, so that m is final).
void update_row(float* z /* [sb] */, int64_t sb, int64_t y_local, bool keep_exp, RowStat& st) {
  float mx = z[0];
  double zs = 0;
  for (int64_t j = 0; j < sb; ++j) {
    mx = std::max(mx, z[j]);
    zs += z[j];
  }
  if (y_local >= 0) st.zy = z[y_local];
  st.c += zs;
  if (mx > st.m) {
    st.s *= std::exp(st.m - static_cast<double>(mx));
    st.m = mx;
  }
  const float m = static_cast<float>(st.m);
  double acc = 0;
  if (keep_exp) {
    for (int64_t j = 0; j < sb; ++j) {
      z[j] = std::exp(z[j] - m);
      acc += z[j];
    }
  } else {
    for (int64_t j = 0; j < sb; ++j) acc += std::exp(z[j] - m);
  }
  st.s += acc;
}

struct Run {
  const LinearCrossEntropyArgs& a;
  bool backward;
  int64_t N, D, V;
  const float* x;  // [N, D]
  const float* w;  // [V, D]
  float* dx;       // [N, D] (backward)
  float* dw;       // [V, D] (backward)
  double lam, eps;
  double scale;     // mean: 1/den (0 when den == 0); sum, none: 1
  double upstream;  // sum, mean: the dloss scalar (1 when absent)
  LceChunkPlan plan;
  float* tile;     // [R, S] logits tile
  RowStat* stats;  // [R]
  double loss_sum = 0, z_sum = 0;

  void logits(int64_t r0, int64_t rb, int64_t c0, int64_t sb) {
    cpu::gemm(false, true, rb, sb, D, 1.0f, x + r0 * D, D, w + c0 * D, D, 0.0f, tile, sb);
  }

  // Turns the tile rows into G (in place) for the slab [c0, c0 + sb).
  void gradient_tile(int64_t r0, int64_t rb, int64_t c0, int64_t sb, bool have_exp) {
    const double inv_v = 1.0 / static_cast<double>(V);
#pragma omp parallel for schedule(static) if (rb * sb >= kParallelMinElems)
    for (int64_t i = 0; i < rb; ++i) {
      float* g = tile + i * sb;  // [sb]: logits (or exp) in, G out
      const RowStat& st = stats[i];
      if (st.c == 0) {
        std::memset(g, 0, static_cast<size_t>(sb) * sizeof(float));
        continue;
      }
      const double lse = st.m + std::log(st.s);
      const double amp = 1 + 2 * lam * lse;
      const float f = static_cast<float>(st.c * amp / st.s);  // c (1 + 2 lam lse) exp(m - lse)
      const float ce = static_cast<float>(st.c * eps * inv_v);
      const float m = static_cast<float>(st.m);
      if (have_exp) {
        for (int64_t j = 0; j < sb; ++j) g[j] = f * g[j] - ce;
      } else {
        for (int64_t j = 0; j < sb; ++j) g[j] = f * std::exp(g[j] - m) - ce;
      }
      const int64_t y = target_at(a.targets, r0 + i);
      if (y >= c0 && y < c0 + sb) {
        // (1 + 2 lam lse) p_y - 1 = 2 lam lse p_y + (p_y - 1), p_y - 1 = expm1(z_y - lse): no
        // cancellation when p_y ~ 1.
        const double pm1 = std::expm1(st.zy - lse);
        g[y - c0] = static_cast<float>(st.c * ((amp - 1) * (1 + pm1) + pm1 + eps - eps * inv_v));
      }
    }
  }

  void block(int64_t r0, int64_t rb) {
    const int64_t S = plan.cols;
    const bool one_slab = S >= V;
    for (int64_t i = 0; i < rb; ++i)
      stats[i] = RowStat{-std::numeric_limits<double>::infinity(), 0.0, 0.0, 0.0};
    for (int64_t c0 = 0; c0 < V; c0 += S) {
      const int64_t sb = std::min(S, V - c0);
      logits(r0, rb, c0, sb);
#pragma omp parallel for schedule(static) if (rb * sb >= kParallelMinElems)
      for (int64_t i = 0; i < rb; ++i) {
        const int64_t y = target_at(a.targets, r0 + i);
        const int64_t yl = y >= c0 && y < c0 + sb ? y - c0 : -1;
        update_row(tile + i * sb, sb, yl, one_slab && backward, stats[i]);
      }
    }
    // Finalise in row order (deterministic token sums).
    const bool none = a.reduction == LceReduction::None;
    const double inv_v = 1.0 / static_cast<double>(V);
    bool any = false;
    for (int64_t i = 0; i < rb; ++i) {
      RowStat& st = stats[i];
      const int64_t t = r0 + i;
      const double lse = st.m + std::log(st.s);
      a.lse.ptr<float>()[t] = static_cast<float>(lse);
      const int64_t y = target_at(a.targets, t);
      double li = 0, zli = 0, c = 0;
      if (y != kLceIgnoreIndex) {
        zli = lam * lse * lse;
        li = lse - (1 - eps) * st.zy - eps * inv_v * st.c + zli;
        if (backward) c = none ? static_cast<double>(a.dloss.ptr<float>()[t]) : upstream * scale;
      }
      if (none) {
        a.loss.ptr<float>()[t] = static_cast<float>(li);
        a.z_loss.ptr<float>()[t] = static_cast<float>(zli);
      }
      loss_sum += li;
      z_sum += zli;
      st.c = c;
      any = any || c != 0;
    }
    if (!backward) return;
    if (!any) {  // nothing flows back from this block: dx rows are 0, dw unchanged
      std::memset(dx + r0 * D, 0, static_cast<size_t>(rb * D) * sizeof(float));
      return;
    }
    for (int64_t c0 = 0; c0 < V; c0 += S) {
      const int64_t sb = std::min(S, V - c0);
      if (!one_slab) logits(r0, rb, c0, sb);
      gradient_tile(r0, rb, c0, sb, one_slab);
      cpu::gemm(false, false, rb, D, sb, 1.0f, tile, sb, w + c0 * D, D, c0 == 0 ? 0.0f : 1.0f,
                dx + r0 * D, D);
      cpu::gemm(true, false, sb, D, rb, 1.0f, tile, sb, x + r0 * D, D, 1.0f, dw + c0 * D, D);
    }
  }
};

void run(const LinearCrossEntropyArgs& a, bool backward) {
  const int64_t N = a.x.size(0), D = a.x.size(1), V = a.w.size(0);
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) valid += target_at(a.targets, i) != kLceIgnoreIndex;
  Run r{a,
        backward,
        N,
        D,
        V,
        a.x.ptr<float>(),
        a.w.ptr<float>(),
        backward ? a.dx.ptr<float>() : nullptr,
        backward ? a.dw.ptr<float>() : nullptr,
        a.z_loss_scale,
        a.label_smoothing,
        lce_mean_scale(a, valid),
        backward && a.reduction != LceReduction::None && a.dloss.defined()
            ? static_cast<double>(a.dloss.ptr<float>()[0])
            : 1.0,
        linear_cross_entropy_plan(N, V, a.chunk_bytes),
        nullptr,
        nullptr};
  // Scratch: the caller's workspace or one allocation for the whole call, reused by every chunk.
  std::vector<float> own;  // [workspace_bytes / 4]
  char* base = nullptr;    // [workspace_bytes]: tile [R, S] f32, then stats [R]
  if (a.workspace.defined()) {
    GDN_CHECK(a.workspace.nbytes() >= r.plan.workspace_bytes,
              "{}: tensor 'workspace' has {} bytes, needs {} (linear_cross_entropy_workspace_bytes "
              "for N = {}, V = {}, budget {})",
              kOp, a.workspace.nbytes(), r.plan.workspace_bytes, N, V, r.plan.budget);
    base = static_cast<char*>(a.workspace.data());
    GDN_CHECK(reinterpret_cast<uintptr_t>(base) % alignof(double) == 0,
              "{}: tensor 'workspace' must be 8-byte aligned", kOp);
  } else if (r.plan.workspace_bytes > 0) {
    own.resize(static_cast<size_t>(r.plan.workspace_bytes) / sizeof(float));
    base = reinterpret_cast<char*>(own.data());
  }
  r.tile = reinterpret_cast<float*>(base);
  r.stats = reinterpret_cast<RowStat*>(base + (4 * r.plan.rows * r.plan.cols + 63) / 64 * 64);
  for (int64_t r0 = 0; r0 < N; r0 += r.plan.rows) r.block(r0, std::min(r.plan.rows, N - r0));
  if (a.reduction != LceReduction::None) {
    a.loss.ptr<float>()[0] = static_cast<float>(r.loss_sum * r.scale);
    a.z_loss.ptr<float>()[0] = static_cast<float>(r.z_sum * r.scale);
  }
}

void forward(const LinearCrossEntropyArgs& a) { run(a, false); }
void forward_backward(const LinearCrossEntropyArgs& a) { run(a, true); }

const LinearCrossEntropyTable kTable{forward, forward_backward};
}  // namespace

GDN_REGISTER(linear_cross_entropy_cpu) {
  Registry::global().add_impl(
      {"linear_cross_entropy", "cpu.chunked", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
