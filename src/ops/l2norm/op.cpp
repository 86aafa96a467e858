// L2 normalisation: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/l2norm/op.h"

#include <vector>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "gdn/core/rng.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "l2norm";

void validate_fwd(const L2NormFwd& a) {
  expect_shape(a.x, kOp, "x", {-1, -1});
  expect_contiguous(a.x, kOp, "x");
  const int64_t r = a.x.size(0), d = a.x.size(1);
  expect_tensor(a.y, kOp, "y", a.x.dtype(), {r, d});
  expect_tensor(a.rstd, kOp, "rstd", l2norm_stat_dtype(a.x.dtype()), {r});
  GDN_CHECK(a.eps > 0, "{}: eps must be positive, got {}", kOp, a.eps);
  for (const Tensor* t : {&a.y, &a.rstd})
    GDN_CHECK(t->device() == a.x.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.x.device()));
}

void validate_bwd(const L2NormBwd& a) {
  expect_shape(a.y, kOp, "y", {-1, -1});
  expect_contiguous(a.y, kOp, "y");
  const int64_t r = a.y.size(0), d = a.y.size(1);
  expect_tensor(a.rstd, kOp, "rstd", l2norm_stat_dtype(a.y.dtype()), {r});
  expect_tensor(a.dy, kOp, "dy", a.y.dtype(), {r, d});
  expect_tensor(a.dx, kOp, "dx", a.y.dtype(), {r, d});
  for (const Tensor* t : {&a.rstd, &a.dy, &a.dx})
    GDN_CHECK(t->device() == a.y.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.y.device()));
}

// The shape class: the row width and whether every row is whole 16-byte vectors (the CUDA
// kernels' 8-wide path, and a D = 128 forward of its own).
ShapeClass class_of(const Tensor& x, bool vec) {
  return ShapeClass(infer_backend(x)).dim("D", x.size(1)).flag("vec", vec && x.size(1) % 8 == 0);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: odd width; one row 100x larger, one all-zero row (rstd = 1/sqrt(eps)) and one row so
// small that sum(x^2) ~ eps, where the eps convention decides the result.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const L2NormTable*>(impl.table);
  const auto& ref = *static_cast<const L2NormTable*>(Registry::global().ref(kOp).table);
  // The class's width (97 without one) over 67 rows: several blocks' row groups.
  const int64_t R = 67, D = probe_width(query.dim("D", 97), query.dim("vec", 0) != 0, 8);
  std::vector<double> xv(static_cast<size_t>(R * D));
  for (size_t i = 0; i < xv.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i) / D;
    const double scale = row == 1 ? 100.0 : row == 4 ? 0.0 : row == 6 ? 1e-4 : 1.0;
    xv[i] = scale * rng::normal(41, 1, i);
  }
  ProbeTensors p(impl.backend);
  auto x = p.input(xv, {R, D});
  auto dy = p.normal({R, D}, 42, 1.0);
  auto y = p.zeros({R, D});
  auto rstd = p.zeros({R}, l2norm_stat_dtype(backend_dtype(impl.backend)));
  auto dx = p.zeros({R, D});
  ref.forward({x.ref, y.ref, rstd.ref, 1e-6});
  ref.backward({y.ref, rstd.ref, dy.ref, dx.ref});
  cand.forward({x.cand, y.cand, rstd.cand, 1e-6});
  cand.backward({y.cand, rstd.cand, dy.cand, dx.cand});
  ProbeError err;
  err.fwd = std::max(rel_l2_error(y.cand, y.ref), rel_l2_error(rstd.cand, rstd.ref));
  err.bwd = rel_l2_error(dx.cand, dx.ref);
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
  const auto& t = *static_cast<const L2NormTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), st = l2norm_stat_dtype(dt);
  const Device dev = backend_device(impl.backend);
  // x may come as [T, H, dk] (or any leading dims): rows are everything but the last dim.
  Tensor x = io.input("x", dt, dev);
  GDN_CHECK(x.ndim() >= 1, "{}: tensor 'x' must have at least one dimension", kOp);
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  x = x.reshape({R, D});
  Tensor y = io.output("y", dt, dev, {R, D});
  Tensor rstd = io.output("rstd", st, dev, {R});
  // Validate here too: file tensors are untrusted, and `impl` is the one run_op_file resolved.
  const L2NormFwd f{x, y, rstd, io.attr("eps", 1e-6)};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  Tensor dy = io.input("dy", dt, dev);
  GDN_CHECK(dy.ndim() >= 1 && dy.size(-1) == D && dy.numel() == R * D,
            "{}: tensor 'dy' has shape {}, expected {} rows of {} like 'x'", kOp, dy.shape_str(), R,
            D);
  Tensor dx = io.output("dx", dt, dev, {R, D});
  const L2NormBwd b{y, rstd, dy.reshape({R, D}), dx};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

void l2norm_forward(const L2NormFwd& a) {
  validate_fwd(a);
  dispatch().table<L2NormTable>(class_of(a.x, all_aligned16(a.x, a.y))).forward(a);
}

void l2norm_backward(const L2NormBwd& a) {
  validate_bwd(a);
  dispatch().table<L2NormTable>(class_of(a.y, all_aligned16(a.y, a.dy, a.dx))).backward(a);
}

GDN_REGISTER(l2norm_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "L2 normalisation over the last dim, y = x / sqrt(sum(x^2) + eps) (GDN q, k)";
  d.fwd_inputs = {"x"};
  d.fwd_outputs = {"y", "rstd"};
  d.bwd_inputs = {"x", "dy"};
  d.bwd_outputs = {"dx"};
  d.attrs = {"eps=1e-6"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
