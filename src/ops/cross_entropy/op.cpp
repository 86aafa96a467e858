// cross_entropy: validation, dispatch and registration (probe, tolerance, file runner).
#include "ops/cross_entropy/op.h"

#include <algorithm>
#include <cmath>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "cross_entropy";

void validate(const CrossEntropyArgs& a) {
  expect_shape(a.logits, kOp, "logits", {-1, -1});
  expect_contiguous(a.logits, kOp, "logits");
  const int64_t R = a.logits.size(0), V = a.logits.size(1);
  const DType st = cross_entropy_stat_dtype(a.logits.dtype());
  const Device dev = a.logits.device();
  GDN_CHECK(V >= 1, "{}: tensor 'logits' has no columns", kOp);
  expect_tensor(a.targets, kOp, "targets", DType::I32, {R});
  expect_tensor(a.loss, kOp, "loss", st, {R});
  expect_tensor(a.lse, kOp, "lse", st, {R});
  expect_tensor(a.z_loss, kOp, "z_loss", st, {R});
  for (auto [t, name] : {std::pair{&a.targets, "targets"}, std::pair{&a.loss, "loss"},
                         std::pair{&a.lse, "lse"}, std::pair{&a.z_loss, "z_loss"}})
    expect_device(*t, kOp, name, dev);
  if (a.dlogits.defined()) {
    expect_tensor(a.dlogits, kOp, "dlogits", a.logits.dtype(), {R, V});
    expect_device(a.dlogits, kOp, "dlogits", dev);
  }
  GDN_CHECK(std::isfinite(a.z_loss_scale) && a.z_loss_scale >= 0,
            "{}: z_loss_scale must be finite and >= 0, got {}", kOp, a.z_loss_scale);
  GDN_CHECK(std::isfinite(a.grad_scale), "{}: grad_scale must be finite, got {}", kOp,
            a.grad_scale);
  if (dev == Device::CPU) {
    const int32_t* y = a.targets.ptr<int32_t>();  // [R]
    for (int64_t i = 0; i < R; ++i)
      GDN_CHECK(y[i] == -100 || (y[i] >= 0 && y[i] < V),
                "{}: targets[{}] = {} is outside [0, {}) and not the ignore index -100", kOp, i,
                y[i], V);
  }
}

// The shape class: whether dlogits is given (the kernels' gradient pass, CUDA pass 3; without it
// the forward only). The row width is not one: every row strides over V whatever it is.
ShapeClass class_of(const CrossEntropyArgs& a) {
  return ShapeClass(infer_backend(a.logits)).flag("grad", a.dlogits.defined());
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: rows of V = 131 and 2053 (below and past one CUDA block's 256 columns), an ignored row,
// targets 0 and V - 1, one confident row (p_y ~ 1: the expm1 path), z-loss and a gradient scale.
// The class with grad runs the gradient out of place and in place over the logits, the class
// without it the forward alone (dlogits not given); the default class runs both.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const CrossEntropyTable*>(impl.table);
  const auto& ref = *static_cast<const CrossEntropyTable*>(Registry::global().ref(kOp).table);
  const int64_t R = 9;
  const DType st = cross_entropy_stat_dtype(backend_dtype(impl.backend));
  std::vector<bool> grads;
  if (query.dims.contains("grad"))
    grads = {query.dim("grad", 1) != 0};
  else
    grads = {false, true};
  ProbeError err;
  for (const int64_t V : {int64_t{131}, int64_t{2053}})
    for (const bool grad : grads) {
      ProbeTensors p(impl.backend);
      auto z = p.normal({R, V}, 61, 3.0);
      std::vector<int64_t> yv = {5, 0, V - 1, -100, 77, 64, 1, V - 2, 33};
      std::vector<double> zv(static_cast<size_t>(R * V));
      {
        OwnedTensor r = convert(z.ref, DType::F64);
        std::copy(r.ptr<double>(), r.ptr<double>() + R * V, zv.begin());
      }
      zv[static_cast<size_t>(4 * V + 77)] = 30.0;  // p_y ~ 1: the expm1 path
      auto logits = p.input(zv, {R, V});
      auto y = p.ints(yv, {R}, DType::I32);
      auto loss = p.zeros({R}, st), lse = p.zeros({R}, st), zl = p.zeros({R}, st);
      auto dz = p.zeros({R, V});
      const double lam = 1e-2, c = 0.37;
      const Tensor rdz = grad ? dz.ref : Tensor(), cdz = grad ? dz.cand : Tensor();
      ref.run({logits.ref, y.ref, loss.ref, lse.ref, zl.ref, rdz, lam, c});
      cand.run({logits.cand, y.cand, loss.cand, lse.cand, zl.cand, cdz, lam, c});
      err.fwd = std::max({err.fwd, rel_l2_error(loss.cand, loss.ref),
                          rel_l2_error(lse.cand, lse.ref), rel_l2_error(zl.cand, zl.ref)});
      if (!grad) continue;
      err.bwd = std::max(err.bwd, rel_l2_error(dz.cand, dz.ref));
      cand.run(
          {logits.cand, y.cand, loss.cand, lse.cand, zl.cand, logits.cand, lam, c});  // in place
      err.bwd = std::max(err.bwd, rel_l2_error(logits.cand, dz.ref));
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
  const auto& t = *static_cast<const CrossEntropyTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const DType st = cross_entropy_stat_dtype(dt);
  const Device dev = backend_device(impl.backend);
  Tensor z = io.input("logits", dt, dev);
  GDN_CHECK(z.ndim() == 2, "{}: tensor 'logits' must be [R, V]", kOp);
  const int64_t R = z.size(0), V = z.size(1);
  CrossEntropyArgs a{z,
                     io.input("targets", DType::I32, dev),
                     io.output("loss", st, dev, {R}),
                     io.output("lse", st, dev, {R}),
                     io.output("z_loss", st, dev, {R}),
                     backward ? io.output("dlogits", dt, dev, {R, V}) : Tensor(),
                     io.attr("z_loss_scale", 0.0),
                     io.attr("grad_scale", 1.0)};
  validate(a);
  t.run(a);
}
}  // namespace

void cross_entropy(const CrossEntropyArgs& a) {
  validate(a);
  dispatch().table<CrossEntropyTable>(class_of(a)).run(a);
}

GDN_REGISTER(cross_entropy_op) {
  OpDesc d;
  d.name = kOp;
  d.summary =
      "per-row softmax cross-entropy + z-loss over materialised logits, gradient in the same pass "
      "(the unfused LM-head route)";
  d.fwd_inputs = {"logits", "targets"};
  d.fwd_outputs = {"loss", "lse", "z_loss"};
  d.bwd_outputs = {"dlogits"};
  d.attrs = {"z_loss_scale=0", "grad_scale=1"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
