// Linear cross-entropy: validation, the chunk plan, dispatch and the op's registration (probe,
// tolerance, file runner).
#include "ops/linear_cross_entropy/op.h"

#include <algorithm>
#include <cmath>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "gdn/core/env.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "linear_cross_entropy";

int64_t align64(int64_t b) { return (b + 63) / 64 * 64; }

int64_t target_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::I64 ? t.ptr<int64_t>()[i] : t.ptr<int32_t>()[i];
}

// Checks shapes, dtypes, attributes and (on the host) every target; returns the number of
// non-ignored targets (-1 when the targets live on a device and are checked by the kernel).
int64_t validate(const LinearCrossEntropyArgs& a, bool backward) {
  expect_shape(a.x, kOp, "x", {-1, -1});
  expect_contiguous(a.x, kOp, "x");
  const DType act = a.x.dtype(), st = lce_stat_dtype(act);
  const int64_t n = a.x.size(0), d = a.x.size(1);
  GDN_CHECK(d >= 1, "{}: tensor 'x' has hidden size 0 (shape {})", kOp, a.x.shape_str());
  expect_shape(a.w, kOp, "w", {-1, d});
  const int64_t v = a.w.size(0);
  GDN_CHECK(v >= 1, "{}: tensor 'w' has an empty vocabulary (shape {})", kOp, a.w.shape_str());
  expect_tensor(a.w, kOp, "w", act, {v, d});
  expect_defined(a.targets, kOp, "targets");
  GDN_CHECK(a.targets.dtype() == DType::I64 || a.targets.dtype() == DType::I32,
            "{}: tensor 'targets' has dtype {}, expected I64 or I32", kOp,
            dtype_name(a.targets.dtype()));
  expect_shape(a.targets, kOp, "targets", {n});
  expect_contiguous(a.targets, kOp, "targets");
  const bool none = a.reduction == LceReduction::None;
  GDN_CHECK(a.reduction == LceReduction::Mean || a.reduction == LceReduction::Sum || none,
            "{}: unknown reduction {}", kOp, static_cast<int>(a.reduction));
  const int64_t ln = none ? n : 1;
  expect_tensor(a.loss, kOp, "loss", st, {ln});
  expect_tensor(a.lse, kOp, "lse", st, {n});
  expect_tensor(a.z_loss, kOp, "z_loss", st, {ln});
  GDN_CHECK(std::isfinite(a.z_loss_scale) && a.z_loss_scale >= 0,
            "{}: z_loss_scale must be finite and >= 0, got {}", kOp, a.z_loss_scale);
  GDN_CHECK(a.label_smoothing >= 0 && a.label_smoothing < 1,
            "{}: label_smoothing must be in [0, 1), got {}", kOp, a.label_smoothing);
  GDN_CHECK(std::isfinite(a.denominator), "{}: denominator must be finite, got {}", kOp,
            a.denominator);
  GDN_CHECK(a.chunk_bytes == 0 || a.chunk_bytes >= kLceMinChunkBytes,
            "{}: chunk_bytes = {} is below the minimum {} (0: the default {})", kOp, a.chunk_bytes,
            kLceMinChunkBytes, kLceDefaultChunkBytes);
  std::vector<const Tensor*> all = {&a.w, &a.targets, &a.loss, &a.lse, &a.z_loss};
  if (backward) {
    if (none) {
      GDN_CHECK(a.dloss.defined(),
                "{}: reduction none needs tensor 'dloss' [{}], the per-token upstream gradient",
                kOp, n);
      expect_tensor(a.dloss, kOp, "dloss", st, {n});
    } else if (a.dloss.defined()) {
      expect_tensor(a.dloss, kOp, "dloss", st, {1});
    }
    expect_tensor(a.dx, kOp, "dx", act, {n, d});
    expect_tensor(a.dw, kOp, "dw", st, {v, d});
    for (const Tensor* t : {&a.dloss, &a.dx, &a.dw})
      if (t->defined()) all.push_back(t);
  } else {
    GDN_CHECK(!a.dx.defined() && !a.dw.defined() && !a.dloss.defined(),
              "{}: linear_cross_entropy_forward computes no gradients (dx/dw/dloss given); use "
              "linear_cross_entropy_forward_backward",
              kOp);
  }
  if (a.workspace.defined()) {
    expect_contiguous(a.workspace, kOp, "workspace");
    all.push_back(&a.workspace);
  }
  for (const Tensor* t : all)
    GDN_CHECK(t->device() == a.x.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.x.device()));
  if (a.x.device() != Device::CPU) return -1;
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = target_at(a.targets, i);
    if (y == kLceIgnoreIndex) continue;
    GDN_CHECK(y >= 0 && y < v,
              "{}: targets[{}] = {} is out of range: a target must be in [0, {}) (the vocabulary "
              "of 'w') or the ignore_index {}",
              kOp, i, y, v, kLceIgnoreIndex);
    ++valid;
  }
  GDN_CHECK(!(a.reduction == LceReduction::Mean && a.denominator == 0 && valid > 0),
            "{}: the caller's mean denominator is 0 but {} targets are not ignored", kOp, valid);
  return valid;
}

// The shape class: the hidden size D (the CUDA kernels' tiles and the slab layout's dx
// accumulator), whether the targets are I32 (the model's labels) or I64, whether the caller gives
// the workspace and whether it gives the mean's denominator (the model: both). V and N only change
// the plan's row blocks, which every probe covers.
ShapeClass class_of(const LinearCrossEntropyArgs& a) {
  return ShapeClass(infer_backend(a.x))
      .dim("D", a.x.size(1))
      .flag("t32", a.targets.dtype() == DType::I32)
      .flag("ws", a.workspace.defined())
      .flag("den", a.reduction == LceReduction::Mean && a.denominator >= 0);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// One probe case: forward_backward, then forward alone into fresh outputs; both against ref.
struct LceCase {
  int64_t N, D, V;
  LceReduction reduction;
  double smoothing;
  int64_t chunk_bytes;
  DType tdt;
  bool workspace;
  double denominator;
};
void probe_case(const LinearCrossEntropyTable& cand, const LinearCrossEntropyTable& ref,
                Backend backend, const LceCase& k, ProbeError& err) {
  const int64_t N = k.N, D = k.D, V = k.V;
  const bool none = k.reduction == LceReduction::None;
  const DType st = lce_stat_dtype(backend_dtype(backend));
  ProbeTensors p(backend);
  auto x = p.normal({N, D}, 21, 1.0);
  auto w = p.normal({V, D}, 22, 0.5 / std::sqrt(static_cast<double>(D) / 24.0));
  std::vector<int64_t> ty(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) ty[static_cast<size_t>(i)] = (i * 97 + 13) % V;
  ty[3] = ty[20] = kLceIgnoreIndex;
  ty[5] = 0;
  ty[static_cast<size_t>(N - 1)] = V - 1;
  auto t = p.ints(ty, {N}, k.tdt);
  const int64_t ln = none ? N : 1;
  auto dloss = p.normal({N}, 23, 1.0, st);
  const int64_t ws_bytes = linear_cross_entropy_workspace_bytes(N, V, k.chunk_bytes);
  auto ws = p.zeros({(ws_bytes + 3) / 4}, DType::F32);
  for (const bool backward : {true, false}) {
    auto loss = p.zeros({ln}, st), z = p.zeros({ln}, st), lse = p.zeros({N}, st);
    auto dx = p.zeros({N, D}), dw = p.zeros({V, D}, st);
    LinearCrossEntropyArgs a;
    a.reduction = k.reduction;
    a.z_loss_scale = 1e-3;
    a.label_smoothing = k.smoothing;
    a.chunk_bytes = k.chunk_bytes;
    a.denominator = k.denominator;
    auto fill = [&](LinearCrossEntropyArgs& b, bool is_ref) {
      auto pick = [is_ref](const ProbeTensors::Pair& q) { return is_ref ? q.ref : q.cand; };
      b.x = pick(x), b.w = pick(w), b.targets = pick(t), b.loss = pick(loss), b.lse = pick(lse);
      b.z_loss = pick(z);
      if (k.workspace && !is_ref) b.workspace = ws.cand;
      if (!backward) return;
      b.dx = pick(dx), b.dw = pick(dw);
      b.dloss = none ? pick(dloss) : Tensor();
    };
    LinearCrossEntropyArgs ra = a, ca = a;
    fill(ra, true);
    fill(ca, false);
    if (backward) {
      ref.forward_backward(ra);
      cand.forward_backward(ca);
      err.bwd = std::max({err.bwd, rel_l2_error(ca.dx, ra.dx), rel_l2_error(ca.dw, ra.dw)});
    } else {
      ref.forward(ra);
      cand.forward(ca);
    }
    err.fwd = std::max({err.fwd, rel_l2_error(ca.loss, ra.loss), rel_l2_error(ca.lse, ra.lse),
                        rel_l2_error(ca.z_loss, ra.z_loss)});
  }
}

// Probe, given a class: its D, target dtype, workspace and denominator, ignored rows, targets 0
// and V - 1, z-loss on, V = 257 (padded on cuda); the model's route: reduction mean over N = 72
// rows in full-V row blocks (a budget for 32 rows: 3 blocks on the CPU, 2 of 60 rows in the CUDA
// layout), and reduction none with a per-token upstream gradient over 36 rows; forward_backward
// and forward alone. The ref's cost grows with D (~1 s at D = 2560 on one core). The default
// class (no D): odd small sizes (D = 24, V = 301, N = 37), I64 targets, one pass in slab mode (a
// 4 KiB budget: several row blocks and vocabulary slabs) with reduction mean and label smoothing,
// one in full-V mode with reduction none.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const LinearCrossEntropyTable*>(impl.table);
  const auto& ref = *static_cast<const LinearCrossEntropyTable*>(Registry::global().ref(kOp).table);
  ProbeError err;
  if (!query.dims.contains("D")) {
    probe_case(cand, ref, impl.backend,
               {37, 24, 301, LceReduction::Mean, 0.1, kLceMinChunkBytes, DType::I64, false, -1},
               err);
    probe_case(cand, ref, impl.backend,
               {37, 24, 301, LceReduction::None, 0.0, 0, DType::I64, false, -1}, err);
    return err;
  }
  const int64_t D = query.dim("D", 24), V = 257;
  const DType tdt = query.dim("t32", 0) != 0 ? DType::I32 : DType::I64;
  const bool ws = query.dim("ws", 0) != 0;
  const double den = query.dim("den", 0) != 0 ? 131.0 : -1.0;
  const int64_t budget = kLceMinRows * (4 * V + kLceRowStatBytes);
  probe_case(cand, ref, impl.backend, {72, D, V, LceReduction::Mean, 0.0, budget, tdt, ws, den},
             err);
  probe_case(cand, ref, impl.backend, {36, D, V, LceReduction::None, 0.0, budget, tdt, ws, -1},
             err);
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) return bf16_tolerance("linear_cross_entropy");
  return {1e-5, 1e-5};
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const LinearCrossEntropyTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), st = lce_stat_dtype(dt);
  const Device dev = backend_device(impl.backend);
  LinearCrossEntropyArgs a;
  a.x = io.input("x", dt, dev);
  const int64_t D = a.x.size(-1), N = a.x.numel() / std::max<int64_t>(D, 1);
  a.x = a.x.reshape({N, D});
  a.w = io.input("w", dt, dev);
  a.targets = io.input("targets", DType::I64, dev).reshape({N});
  const int r = static_cast<int>(io.attr("reduction", 0));
  GDN_CHECK(r >= 0 && r <= 2, "{}: attribute reduction = {} (0 mean, 1 sum, 2 none)", kOp, r);
  a.reduction = static_cast<LceReduction>(r);
  a.z_loss_scale = io.attr("z_loss", 0);
  a.label_smoothing = io.attr("label_smoothing", 0);
  a.denominator = io.attr("denominator", -1);
  a.chunk_bytes = static_cast<int64_t>(io.attr("chunk_bytes", 0));
  const int64_t ln = a.reduction == LceReduction::None ? N : 1;
  a.loss = io.output("loss", st, dev, {ln});
  a.lse = io.output("lse", st, dev, {N});
  a.z_loss = io.output("z_loss", st, dev, {ln});
  if (!backward) {
    validate(a, false);
    t.forward(a);
    return;
  }
  if (io.has_input("dloss")) a.dloss = io.input("dloss", st, dev).reshape({ln});
  a.dx = io.output("dx", dt, dev, {N, D});
  a.dw = io.output("dw", st, dev, {a.w.size(0), D});
  validate(a, true);
  t.forward_backward(a);
}
}  // namespace

LceChunkPlan linear_cross_entropy_plan(int64_t n, int64_t v, int64_t chunk_bytes) {
  LceChunkPlan p;
  p.budget = chunk_bytes != 0 ? chunk_bytes : kLceDefaultChunkBytes;
  GDN_CHECK(p.budget >= kLceMinChunkBytes,
            "{}: logits budget {} bytes is below the minimum {} (chunk_bytes)", kOp, p.budget,
            kLceMinChunkBytes);
  GDN_CHECK(n >= 0 && v >= 1, "{}: plan for N = {}, V = {}", kOp, n, v);
  if (n == 0) return p;
  const int64_t r_min = std::min(n, kLceMinRows);
  const int64_t full_rows = p.budget / (4 * v + kLceRowStatBytes);
  if (full_rows >= r_min) {
    p.rows = std::min(n, full_rows);
    p.cols = v;
  } else {
    p.rows = r_min;
    p.cols = std::min(v, p.budget / (4 * p.rows) - kLceRowStatBytes / 4);
  }
  p.workspace_bytes = align64(4 * p.rows * p.cols) + align64(kLceRowStatBytes * p.rows);
  return p;
}

namespace {
int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }
}  // namespace

int64_t lce_cuda_layout_bytes(int64_t rows, int64_t ld, int64_t d, bool slab) {
  return align16(2 * rows * ld) + (slab ? align16(4 * rows * d) : 0) + kLceCudaRowStatBytes * rows +
         kLceCudaHeaderBytes;
}

LceChunkPlan linear_cross_entropy_cuda_plan(int64_t n, int64_t v, int64_t d, int64_t chunk_bytes) {
  LceChunkPlan p;
  const LceChunkPlan cpu = linear_cross_entropy_plan(n, v, chunk_bytes);
  p.budget = cpu.budget;
  GDN_CHECK(d >= 1, "{}: cuda plan for D = {}", kOp, d);
  if (n == 0) return p;
  const int64_t w = cpu.workspace_bytes;  // what a caller sized by the contract formula has
  const int64_t ld_v = (v + 7) / 8 * 8;
  // Full-V: 2 R ld_v is a multiple of 16, so the layout is exactly linear in R.
  const int64_t full_fit =
      std::max<int64_t>(0, (w - kLceCudaHeaderBytes) / (2 * ld_v + kLceCudaRowStatBytes));
  // Slab mode: as many rows (<= kLceMinRows) as fit beside an 8-column tile.
  int64_t slab_rows = std::min(n, kLceMinRows);
  while (slab_rows >= 1 && lce_cuda_layout_bytes(slab_rows, 8, d, true) > w) --slab_rows;
  if (full_fit >= std::min(n, kLceMinRows) || (full_fit >= 1 && full_fit >= slab_rows)) {
    p.rows = std::min(n, full_fit);
    // Whole GEMM tiles and fewer partial waves of the dx GEMM ([R, D], 128-row tiles): round R
    // down to a multiple of 1024, else of 128, when that keeps the number of blocks.
    if (p.rows < n) {
      const int64_t blocks = (n + p.rows - 1) / p.rows;
      for (int64_t step : {int64_t{1024}, int64_t{128}}) {
        const int64_t r = p.rows / step * step;
        if (r >= 1 && (n + r - 1) / r == blocks) {
          p.rows = r;
          break;
        }
      }
    }
    p.cols = v;
    p.workspace_bytes = lce_cuda_layout_bytes(p.rows, ld_v, d, false);
    return p;
  }
  GDN_CHECK_HINT(slab_rows >= 1, "raise chunk_bytes (the run config's memory.lce_chunk_bytes)",
                 "{} (cuda): a logits budget of {} bytes (workspace {} bytes) cannot hold one row "
                 "of the slab layout at D = {}: it needs a workspace of at least {} bytes (an "
                 "8-column bf16 tile, an fp32 dx accumulator of D, row statistics, header)",
                 kOp, p.budget, w, d, lce_cuda_layout_bytes(1, 8, d, true));
  // The widest slab that fits beside the rows' fixed parts.
  const int64_t fixed = lce_cuda_layout_bytes(slab_rows, 0, d, true);
  int64_t ld = (w - fixed) / (2 * slab_rows) / 8 * 8;  // >= 8 by the loop above
  p.rows = slab_rows;
  p.cols = std::min(v, ld);
  ld = (p.cols + 7) / 8 * 8;
  p.workspace_bytes = lce_cuda_layout_bytes(p.rows, ld, d, true);
  return p;
}

double lce_mean_scale(const LinearCrossEntropyArgs& a, int64_t valid) {
  if (a.reduction != LceReduction::Mean) return 1.0;
  const double den = a.denominator >= 0 ? a.denominator : static_cast<double>(valid);
  return den > 0 ? 1.0 / den : 0.0;
}

void linear_cross_entropy_forward(const LinearCrossEntropyArgs& a) {
  validate(a, false);
  dispatch().table<LinearCrossEntropyTable>(class_of(a)).forward(a);
}

void linear_cross_entropy_forward_backward(const LinearCrossEntropyArgs& a) {
  validate(a, true);
  dispatch().table<LinearCrossEntropyTable>(class_of(a)).forward_backward(a);
}

GDN_REGISTER(linear_cross_entropy_op) {
  OpDesc d;
  d.name = kOp;
  d.summary =
      "LM head + softmax cross-entropy (z-loss, label smoothing, ignore_index -100), chunked so "
      "the N x V logits never exist; loss and gradients in one pass";
  d.fwd_inputs = {"x", "w", "targets"};
  d.fwd_outputs = {"loss", "lse", "z_loss"};
  d.bwd_inputs = {"x", "w", "targets", "dloss"};
  d.bwd_outputs = {"dx", "dw"};
  d.attrs = {"reduction=0 (0 mean, 1 sum, 2 none)", "z_loss=0", "label_smoothing=0",
             "denominator=-1", "chunk_bytes=0"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
