// Gated RMSNorm: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/gated_rmsnorm/op.h"

#include <vector>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "gdn/core/rng.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "gated_rmsnorm";

void validate_fwd(const GatedRmsNormFwd& a) {
  expect_shape(a.x, kOp, "x", {-1, -1});
  expect_contiguous(a.x, kOp, "x");
  const int64_t r = a.x.size(0), d = a.x.size(1);
  expect_tensor(a.z, kOp, "z", a.x.dtype(), {r, d});
  expect_tensor(a.w, kOp, "w", a.x.dtype(), {d});
  expect_tensor(a.y, kOp, "y", a.x.dtype(), {r, d});
  expect_tensor(a.rstd, kOp, "rstd", gated_rmsnorm_stat_dtype(a.x.dtype()), {r});
  GDN_CHECK(a.eps > 0, "{}: eps must be positive, got {}", kOp, a.eps);
  for (const Tensor* t : {&a.z, &a.w, &a.y, &a.rstd})
    GDN_CHECK(t->device() == a.x.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.x.device()));
}

void validate_bwd(const GatedRmsNormBwd& a) {
  expect_shape(a.x, kOp, "x", {-1, -1});
  expect_contiguous(a.x, kOp, "x");
  const int64_t r = a.x.size(0), d = a.x.size(1);
  const DType st = gated_rmsnorm_stat_dtype(a.x.dtype());
  expect_tensor(a.z, kOp, "z", a.x.dtype(), {r, d});
  expect_tensor(a.w, kOp, "w", a.x.dtype(), {d});
  expect_tensor(a.rstd, kOp, "rstd", st, {r});
  expect_tensor(a.dy, kOp, "dy", a.x.dtype(), {r, d});
  expect_tensor(a.dx, kOp, "dx", a.x.dtype(), {r, d});
  expect_tensor(a.dz, kOp, "dz", a.x.dtype(), {r, d});
  expect_tensor(a.dw, kOp, "dw", st, {d});
  for (const Tensor* t : {&a.z, &a.w, &a.rstd, &a.dy, &a.dx, &a.dz, &a.dw})
    GDN_CHECK(t->device() == a.x.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.x.device()));
}

// The shape class: the row width and whether every row is whole 16-byte vectors (the CUDA
// kernels' 8-wide path: the Qwen3.5 rows are one value head, D = 128).
ShapeClass class_of(const Tensor& x, bool vec) {
  return ShapeClass(infer_backend(x)).dim("D", x.size(1)).flag("vec", vec && x.size(1) % 8 == 0);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: odd width, one row 100x larger and one all-zero row (rstd = 1/sqrt(eps)), gates spread
// over [-12, 12] so that both saturated ends of sigmoid and the silu minimum near z = -1.28 are
// exercised, weights around 1 (the HF initialisation).
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const GatedRmsNormTable*>(impl.table);
  const auto& ref = *static_cast<const GatedRmsNormTable*>(Registry::global().ref(kOp).table);
  // The class's width (97 without one) over 67 rows: several blocks' row groups.
  const int64_t R = 67, D = probe_width(query.dim("D", 97), query.dim("vec", 0) != 0, 8);
  const DType st = gated_rmsnorm_stat_dtype(backend_dtype(impl.backend));
  std::vector<double> xv(static_cast<size_t>(R * D));
  for (size_t i = 0; i < xv.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / D;
    const double scale = row == 2 ? 100.0 : row == 5 ? 0.0 : 2.0;
    xv[i] = scale * rng::normal(31, 1, i);
  }
  ProbeTensors p(impl.backend);
  auto x = p.input(xv, {R, D});
  auto z = p.uniform({R, D}, 32, -12.0, 12.0);
  auto w = p.uniform({D}, 33, 0.5, 1.5);
  auto dy = p.normal({R, D}, 34, 1.0);
  auto y = p.zeros({R, D});
  auto rstd = p.zeros({R}, st);
  auto dx = p.zeros({R, D});
  auto dz = p.zeros({R, D});
  auto dw = p.zeros({D}, st);
  ref.forward({x.ref, z.ref, w.ref, y.ref, rstd.ref, 1e-6});
  ref.backward({x.ref, z.ref, w.ref, rstd.ref, dy.ref, dx.ref, dz.ref, dw.ref});
  cand.forward({x.cand, z.cand, w.cand, y.cand, rstd.cand, 1e-6});
  cand.backward({x.cand, z.cand, w.cand, rstd.cand, dy.cand, dx.cand, dz.cand, dw.cand});
  ProbeError err;
  err.fwd = std::max(rel_l2_error(y.cand, y.ref), rel_l2_error(rstd.cand, rstd.ref));
  err.bwd = std::max({rel_l2_error(dx.cand, dx.ref), rel_l2_error(dz.cand, dz.ref),
                      rel_l2_error(dw.cand, dw.ref)});
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {1e-5, 1e-5};
}

// A file tensor with the rows of `x` ([R, D], any leading dims), viewed as [R, D]; the error names
// it (a bare reshape would not).
Tensor as_rows(const Tensor& t, const char* name, int64_t R, int64_t D) {
  GDN_CHECK(t.ndim() >= 1 && t.size(-1) == D && t.numel() == R * D,
            "{}: tensor '{}' has shape {}, expected {} rows of {} like 'x'", kOp, name,
            t.shape_str(), R, D);
  return t.reshape({R, D});
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const GatedRmsNormTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), st = gated_rmsnorm_stat_dtype(dt);
  const Device dev = backend_device(impl.backend);
  // x and z may come as [T, Hv, dv] (or any leading dims): rows are everything but the last dim.
  Tensor x = io.input("x", dt, dev);
  GDN_CHECK(x.ndim() >= 1, "{}: tensor 'x' must have at least one dimension", kOp);
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  x = x.reshape({R, D});
  Tensor z = as_rows(io.input("z", dt, dev), "z", R, D);
  Tensor w = io.input("w", dt, dev);
  Tensor y = io.output("y", dt, dev, {R, D});
  Tensor rstd = io.output("rstd", st, dev, {R});
  // Validate here too: file tensors are untrusted, and `impl` is the one run_op_file resolved.
  const GatedRmsNormFwd f{x, z, w, y, rstd, io.attr("eps", 1e-6)};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  Tensor dy = as_rows(io.input("dy", dt, dev), "dy", R, D);
  Tensor dx = io.output("dx", dt, dev, {R, D});
  Tensor dz = io.output("dz", dt, dev, {R, D});
  Tensor dw = io.output("dw", st, dev, {D});
  const GatedRmsNormBwd b{x, z, w, rstd, dy, dx, dz, dw};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

void gated_rmsnorm_forward(const GatedRmsNormFwd& a) {
  validate_fwd(a);
  dispatch().table<GatedRmsNormTable>(class_of(a.x, all_aligned16(a.x, a.z, a.w, a.y))).forward(a);
}

void gated_rmsnorm_backward(const GatedRmsNormBwd& a) {
  validate_bwd(a);
  dispatch()
      .table<GatedRmsNormTable>(class_of(a.x, all_aligned16(a.x, a.z, a.w, a.dy, a.dx, a.dz)))
      .backward(a);
}

GDN_REGISTER(gated_rmsnorm_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "Gated RMSNorm of the GDN output, per token and value head: y = x*r*w*silu(z)";
  d.fwd_inputs = {"x", "z", "w"};
  d.fwd_outputs = {"y", "rstd"};
  d.bwd_inputs = {"x", "z", "w", "dy"};
  d.bwd_outputs = {"dx", "dz", "dw"};
  d.attrs = {"eps=1e-6"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
