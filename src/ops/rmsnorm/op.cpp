// RMSNorm: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/rmsnorm/op.h"

#include <algorithm>
#include <utility>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "rmsnorm";

void validate_fwd(const RmsNormFwd& a) {
  expect_shape(a.x, kOp, "x", {-1, -1});
  expect_contiguous(a.x, kOp, "x");
  const int64_t r = a.x.size(0), d = a.x.size(1);
  expect_tensor(a.w, kOp, "w", a.x.dtype(), {d});
  expect_tensor(a.y, kOp, "y", a.x.dtype(), {r, d});
  expect_tensor(a.rstd, kOp, "rstd", rmsnorm_stat_dtype(a.x.dtype()), {r});
  GDN_CHECK(a.eps > 0, "{}: eps must be positive, got {}", kOp, a.eps);
  for (const Tensor* t : {&a.w, &a.y, &a.rstd})
    GDN_CHECK(t->device() == a.x.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.x.device()));
}

void validate_bwd(const RmsNormBwd& a) {
  expect_shape(a.x, kOp, "x", {-1, -1});
  expect_contiguous(a.x, kOp, "x");
  const int64_t r = a.x.size(0), d = a.x.size(1);
  expect_tensor(a.w, kOp, "w", a.x.dtype(), {d});
  expect_tensor(a.rstd, kOp, "rstd", rmsnorm_stat_dtype(a.x.dtype()), {r});
  expect_tensor(a.dy, kOp, "dy", a.x.dtype(), {r, d});
  expect_tensor(a.dx, kOp, "dx", a.x.dtype(), {r, d});
  for (const Tensor* t : {&a.w, &a.rstd, &a.dy, &a.dx, &a.dw})
    GDN_CHECK(t->device() == a.x.device(), "{}: all tensors must be on {}", kOp,
              device_name(a.x.device()));
  expect_tensor(a.dw, kOp, "dw", rmsnorm_stat_dtype(a.x.dtype()), {d});
}

// The shape class: the row width (the CUDA forward has fixed-width kernels at 2048 and up to 4096,
// the bulk backward covers 1024..8192) and whether every row is whole 16-byte vectors.
ShapeClass class_of(const Tensor& x, bool vec) {
  return ShapeClass(infer_backend(x)).dim("D", x.size(1)).flag("vec", vec && x.size(1) % 8 == 0);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe, at the class's width (97, vector rows of 1024, when the query has none): 2 and 67 rows
// (part of one block's row group, and several blocks), weights around 0 (zero-centred) and 1.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const RmsNormTable*>(impl.table);
  const auto& ref = *static_cast<const RmsNormTable*>(Registry::global().ref(kOp).table);
  std::vector<int64_t> widths;
  if (query.dims.contains("D"))
    widths = {probe_width(query.dim("D", 0), query.dim("vec", 0) != 0, 8)};
  else
    widths = {97, 1024};
  ProbeError err;
  for (const int64_t D : widths)
    for (const auto& [R, zc] : {std::pair<int64_t, bool>{2, false}, {67, true}}) {
      ProbeTensors p(impl.backend);
      auto x = p.normal({R, D}, 11, 2.0);
      auto w = p.normal({D}, 12, 0.1);
      auto dy = p.normal({R, D}, 13, 1.0);
      auto y = p.zeros({R, D});
      auto rstd = p.zeros({R}, rmsnorm_stat_dtype(backend_dtype(impl.backend)));
      auto dx = p.zeros({R, D});
      auto dw = p.zeros({D}, rmsnorm_stat_dtype(backend_dtype(impl.backend)));
      // Tell the two flavours apart even with w ~ 0: shift w for the plain norm.
      if (!zc) {
        auto w1 = p.uniform({D}, 14, 0.5, 1.5);
        w = w1;
      }
      auto ry = OwnedTensor::zeros(DType::F64, {R, D});
      auto rr = OwnedTensor::zeros(DType::F64, {R});
      auto rdx = OwnedTensor::zeros(DType::F64, {R, D});
      auto rdw = OwnedTensor::zeros(DType::F64, {D});
      ref.forward({x.ref, w.ref, ry, rr, 1e-6, zc});
      ref.backward({x.ref, w.ref, rr, dy.ref, rdx, rdw, zc});
      cand.forward({x.cand, w.cand, y.cand, rstd.cand, 1e-6, zc});
      cand.backward({x.cand, w.cand, rstd.cand, dy.cand, dx.cand, dw.cand, zc});
      err.fwd = std::max({err.fwd, rel_l2_error(y.cand, ry), rel_l2_error(rstd.cand, rr)});
      err.bwd = std::max({err.bwd, rel_l2_error(dx.cand, rdx), rel_l2_error(dw.cand, rdw)});
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
  const auto& t = *static_cast<const RmsNormTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), st = rmsnorm_stat_dtype(dt);
  const Device dev = backend_device(impl.backend);
  Tensor x = io.input("x", dt, dev);
  const int64_t D = x.size(-1), R = x.numel() / std::max<int64_t>(D, 1);
  x = x.reshape({R, D});
  Tensor w = io.input("w", dt, dev);
  const bool zc = io.attr("zero_centred", 0) != 0;
  Tensor y = io.output("y", dt, dev, {R, D});
  Tensor rstd = io.output("rstd", st, dev, {R});
  const RmsNormFwd fwd{x, w, y, rstd, io.attr("eps", 1e-6), zc};
  validate_fwd(fwd);
  t.forward(fwd);
  if (!backward) return;
  Tensor dy = io.input("dy", dt, dev).reshape({R, D});
  Tensor dx = io.output("dx", dt, dev, {R, D});
  Tensor dw = io.output("dw", st, dev, {D});
  const RmsNormBwd bwd{x, w, rstd, dy, dx, dw, zc};
  validate_bwd(bwd);
  t.backward(bwd);
}
}  // namespace

void rmsnorm_forward(const RmsNormFwd& a) {
  validate_fwd(a);
  dispatch().table<RmsNormTable>(class_of(a.x, all_aligned16(a.x, a.w, a.y))).forward(a);
}

void rmsnorm_backward(const RmsNormBwd& a) {
  validate_bwd(a);
  dispatch().table<RmsNormTable>(class_of(a.x, all_aligned16(a.x, a.w, a.dy, a.dx))).backward(a);
}

GDN_REGISTER(rmsnorm_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "RMSNorm over the last dim, plain (x*r*w) or zero-centred (x*r*(1+w))";
  d.fwd_inputs = {"x", "w"};
  d.fwd_outputs = {"y", "rstd"};
  d.bwd_inputs = {"x", "w", "dy"};
  d.bwd_outputs = {"dx", "dw"};
  d.attrs = {"eps=1e-6", "zero_centred=0"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
