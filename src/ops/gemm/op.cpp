// GEMM: validation, dispatch, the backward and the linear layer composed from gemm calls, and the
// op's registration (probe, tolerance, file runner).
#include "ops/gemm/op.h"

#include <climits>
#include <cmath>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "gemm";

struct Dims {
  int64_t m, n, k;
};

// The dtype C must have for inputs of `ab`: the same, except that bf16 inputs may accumulate
// into an F32 C (dW buffers on cuda).
void expect_c_dtype(const Tensor& c, DType ab, std::string_view name) {
  if (ab == DType::BF16 && c.dtype() == DType::F32) return;
  expect_dtype(c, kOp, name, ab);
}

void expect_same_device(const Tensor& ref, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined())
      GDN_CHECK(t->device() == ref.device(), "{}: all tensors must be on {}", kOp,
                device_name(ref.device()));
}

// Shapes of a and b and the dims they imply; names the tensor whose shape is wrong.
Dims check_ab(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  expect_shape(a, kOp, "a", {-1, -1});
  expect_contiguous(a, kOp, "a");
  const int64_t m = trans_a ? a.size(1) : a.size(0);
  const int64_t k = trans_a ? a.size(0) : a.size(1);
  // b must agree with op(a) on K: say so in b's own terms ([K, *] or [*, K]).
  if (trans_b)
    expect_shape(b, kOp, "b", {-1, k});
  else
    expect_shape(b, kOp, "b", {k, -1});
  expect_contiguous(b, kOp, "b");
  expect_dtype(b, kOp, "b", a.dtype());
  const int64_t n = trans_b ? b.size(0) : b.size(1);
  // cblas takes 32-bit sizes (OpenBLAS without ILP64).
  GDN_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
            "{}: sizes M={}, N={}, K={} exceed the 32-bit BLAS limit", kOp, m, n, k);
  return {m, n, k};
}

Dims validate(const GemmArgs& g) {
  Dims d = check_ab(g.a, g.b, g.trans_a, g.trans_b);
  expect_shape(g.c, kOp, "c", {d.m, d.n});
  expect_contiguous(g.c, kOp, "c");
  expect_c_dtype(g.c, g.a.dtype(), "c");
  expect_same_device(g.a, {&g.b, &g.c});
  GDN_CHECK(std::isfinite(g.alpha) && std::isfinite(g.beta),
            "{}: alpha and beta must be finite, got alpha={} beta={}", kOp, g.alpha, g.beta);
  return d;
}

void validate_bwd(const GemmBwd& g) {
  Dims d = check_ab(g.a, g.b, g.trans_a, g.trans_b);
  expect_tensor(g.dc, kOp, "dc", g.a.dtype(), {d.m, d.n});
  if (g.da.defined()) {
    expect_tensor(g.da, kOp, "da", g.da.dtype(), {g.a.size(0), g.a.size(1)});
    expect_c_dtype(g.da, g.a.dtype(), "da");
  }
  if (g.db.defined()) {
    expect_tensor(g.db, kOp, "db", g.db.dtype(), {g.b.size(0), g.b.size(1)});
    expect_c_dtype(g.db, g.a.dtype(), "db");
  }
  expect_same_device(g.a, {&g.b, &g.dc, &g.da, &g.db});
  GDN_CHECK(std::isfinite(g.alpha), "{}: alpha must be finite, got {}", kOp, g.alpha);
}

// The shape class: whether C is fp32 under bf16 operands (every weight gradient in production;
// cuBLASLt's fp32-C plans, the only ones that may split K, reduced in place) and whether beta is
// nonzero (C read and accumulated into; beta == 0 leaves C unread). The trans flags and sizes pick
// cuBLASLt plans inside one class: the probe covers every trans pair of its class.
ShapeClass class_of(const Tensor& a, const Tensor& c, double beta) {
  return ShapeClass(infer_backend(a))
      .flag("c_f32", c.dtype() == DType::F32 && a.dtype() != DType::F32)
      .flag("beta", beta != 0);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// The backward as gemm calls through `fn` (the resolved implementation, or a probe candidate).
void backward_with(void (*fn)(const GemmArgs&), const GemmBwd& g) {
  if (g.da.defined()) {
    const double beta = g.accumulate_da ? 1.0 : 0.0;
    if (!g.trans_a)  // dA = alpha dC op(B)^T
      fn({g.dc, g.b, g.da, false, !g.trans_b, g.alpha, beta});
    else  // dA = alpha op(B) dC^T
      fn({g.b, g.dc, g.da, g.trans_b, true, g.alpha, beta});
  }
  if (g.db.defined()) {
    const double beta = g.accumulate_db ? 1.0 : 0.0;
    if (!g.trans_b)  // dB = alpha op(A)^T dC
      fn({g.a, g.dc, g.db, !g.trans_a, false, g.alpha, beta});
    else  // dB = alpha dC^T op(A)
      fn({g.dc, g.a, g.db, true, g.trans_a, g.alpha, beta});
  }
}

// Probe: M = 67, N = 45, K = 300 (moderate: several K steps of a plan), every trans pair, in the
// class's C dtype (BF16 or FP32 under BF16 operands) and beta: beta = 0 into a NaN-filled C (C
// must stay unread), or alpha = 0.5, beta = 1 onto a random C; then the backward's gemms (dA, dB
// accumulated when the class's beta is). The default class runs every C dtype and both betas.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const GemmTable*>(impl.table);
  const auto& ref = *static_cast<const GemmTable*>(Registry::global().ref(kOp).table);
  const int64_t M = 67, N = 45, K = 300;
  const DType act = backend_dtype(impl.backend);
  std::vector<DType> cdts;
  if (query.dims.contains("c_f32"))
    cdts = {query.dim("c_f32", 0) != 0 ? DType::F32 : act};
  else if (act == DType::F32)
    cdts = {act};
  else
    cdts = {act, DType::F32};
  std::vector<bool> betas;
  if (query.dims.contains("beta"))
    betas = {query.dim("beta", 0) != 0};
  else
    betas = {false, true};
  ProbeError err;
  uint64_t seed = 100;
  for (const DType cdt : cdts)
    for (const bool acc : betas)
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          ProbeTensors p(impl.backend);
          auto a = ta ? p.normal({K, M}, ++seed, 1.0) : p.normal({M, K}, ++seed, 1.0);
          auto b = tb ? p.normal({N, K}, ++seed, 1.0) : p.normal({K, N}, ++seed, 1.0);
          std::vector<double> nans(static_cast<size_t>(M * N), std::nan(""));
          auto c = acc ? p.normal({M, N}, ++seed, 1.0, cdt) : p.input(nans, {M, N}, cdt);
          const double alpha = acc ? 0.5 : 1.0, beta = acc ? 1.0 : 0.0;
          ref.gemm({a.ref, b.ref, c.ref, ta, tb, alpha, beta});
          cand.gemm({a.cand, b.cand, c.cand, ta, tb, alpha, beta});
          err.fwd = std::max(err.fwd, rel_l2_error(c.cand, c.ref));

          auto dc = p.normal({M, N}, ++seed, 1.0);
          auto da = acc ? p.normal({a.ref.size(0), a.ref.size(1)}, ++seed, 1.0, cdt)
                        : p.zeros({a.ref.size(0), a.ref.size(1)}, cdt);
          auto db = acc ? p.normal({b.ref.size(0), b.ref.size(1)}, ++seed, 1.0, cdt)
                        : p.zeros({b.ref.size(0), b.ref.size(1)}, cdt);
          backward_with(ref.gemm, {a.ref, b.ref, dc.ref, da.ref, db.ref, ta, tb, 0.75, acc, acc});
          backward_with(cand.gemm,
                        {a.cand, b.cand, dc.cand, da.cand, db.cand, ta, tb, 0.75, acc, acc});
          err.bwd =
              std::max({err.bwd, rel_l2_error(da.cand, da.ref), rel_l2_error(db.cand, db.ref)});
        }
      }
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {1e-5, 1e-5};
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const GemmTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const Device dev = backend_device(impl.backend);
  Tensor a = io.input("a", dt, dev);
  Tensor b = io.input("b", dt, dev);
  const bool ta = io.attr("trans_a", 0) != 0, tb = io.attr("trans_b", 0) != 0;
  const double alpha = io.attr("alpha", 1.0), beta = io.attr("beta", 0.0);
  Dims d = check_ab(a, b, ta, tb);
  Tensor c = io.output("c", dt, dev, {d.m, d.n});
  if (io.has_input("c")) copy_into(c, io.input("c", dt, dev));
  GemmArgs g{a, b, c, ta, tb, alpha, beta};
  validate(g);
  t.gemm(g);
  if (!backward) return;
  Tensor dc = io.input("dc", dt, dev);
  Tensor da = io.output("da", dt, dev, a.shape());
  Tensor db = io.output("db", dt, dev, b.shape());
  GemmBwd gb{a, b, dc, da, db, ta, tb, alpha, false, false};
  validate_bwd(gb);
  backward_with(t.gemm, gb);
}
}  // namespace

namespace {
// One gemm through the implementation resolved for its class.
void dispatched(const GemmArgs& a) {
  dispatch().table<GemmTable>(class_of(a.a, a.c, a.beta)).gemm(a);
}
}  // namespace

void gemm(const GemmArgs& a) {
  validate(a);
  dispatched(a);
}

void gemm_backward(const GemmBwd& a) {
  validate_bwd(a);
  backward_with(dispatched, a);  // dA and dB each in its own class (C dtype, accumulate)
}

// The linear layer names its own tensors in errors (x, w, y, dy, dx, dw), then runs gemm.
void linear_forward(const LinearFwd& a) {
  constexpr const char* op = "linear";
  expect_shape(a.x, op, "x", {-1, -1});
  const int64_t T = a.x.size(0), in = a.x.size(1);
  expect_shape(a.w, op, "w", {-1, in});
  const int64_t out = a.w.size(0);
  expect_shape(a.y, op, "y", {T, out});
  expect_dtype(a.w, op, "w", a.x.dtype());
  expect_dtype(a.y, op, "y", a.x.dtype());
  gemm({a.x, a.w, a.y, false, true, 1.0, 0.0});
}

void linear_backward(const LinearBwd& a) {
  constexpr const char* op = "linear";
  expect_shape(a.x, op, "x", {-1, -1});
  const int64_t T = a.x.size(0), in = a.x.size(1);
  expect_shape(a.w, op, "w", {-1, in});
  const int64_t out = a.w.size(0);
  expect_shape(a.dy, op, "dy", {T, out});
  expect_dtype(a.w, op, "w", a.x.dtype());
  expect_dtype(a.dy, op, "dy", a.x.dtype());
  if (a.dx.defined()) {
    expect_shape(a.dx, op, "dx", {T, in});
    expect_dtype(a.dx, op, "dx", a.x.dtype());
    gemm({a.dy, a.w, a.dx, false, false, 1.0, a.accumulate_dx ? 1.0 : 0.0});  // dx = dy W
  }
  if (a.dw.defined()) {
    expect_shape(a.dw, op, "dw", {out, in});
    if (!(a.x.dtype() == DType::BF16 && a.dw.dtype() == DType::F32))
      expect_dtype(a.dw, op, "dw", a.x.dtype());
    gemm({a.dy, a.x, a.dw, true, false, 1.0, a.overwrite_dw ? 0.0 : 1.0});  // dW (+)= dy^T x
  }
}

GDN_REGISTER(gemm_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "C = alpha op(A) op(B) + beta C (op = identity or transpose); linear = gemm";
  d.fwd_inputs = {"a", "b", "c (optional, read when beta != 0)"};
  d.fwd_outputs = {"c"};
  d.bwd_inputs = {"a", "b", "dc"};
  d.bwd_outputs = {"da", "db"};
  d.attrs = {"trans_a=0", "trans_b=0", "alpha=1", "beta=0"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
