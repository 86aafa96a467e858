// axpy: validation, dispatch and registration.
#include "ops/axpy/op.h"

#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "axpy";

void validate(const AxpyArgs& a) {
  expect_defined(a.x, kOp, "x");
  expect_defined(a.y, kOp, "y");
  GDN_CHECK(a.x.numel() == a.y.numel(), "{}: tensor 'x' has {} elements but 'y' has {}", kOp,
            a.x.numel(), a.y.numel());
  expect_dtype(a.x, kOp, "x", a.y.dtype());
  expect_contiguous(a.x, kOp, "x");
  expect_contiguous(a.y, kOp, "y");
  expect_device(a.x, kOp, "x", a.y.device());
}

ProbeError probe(const ImplDesc& impl, const OpQuery&) {
  const auto& cand = *static_cast<const AxpyTable*>(impl.table);
  const auto& ref = *static_cast<const AxpyTable*>(Registry::global().ref(kOp).table);
  ProbeTensors p(impl.backend);
  auto x = p.normal({1031}, 3, 1.0);
  auto y = p.normal({1031}, 4, 1.0);
  cand.run({x.cand, y.cand, -0.75});
  ref.run({x.ref, y.ref, -0.75});
  return {rel_l2_error(y.cand, y.ref), 0.0};  // no backward: the op is linear in x and y
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {1e-6, 1};
}

void run(const ImplDesc& impl, OpIO& io, bool) {
  const auto& t = *static_cast<const AxpyTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const Device dev = backend_device(impl.backend);
  Tensor x = io.input("x", dt, dev);
  Tensor y0 = io.input("y", dt, dev);
  Tensor y = io.output("y", dt, dev, y0.shape());
  copy_into(y, y0);
  AxpyArgs a{x, y, io.attr("alpha", 1.0)};
  validate(a);
  t.run(a);
}
}  // namespace

void axpy(const AxpyArgs& a) {
  validate(a);
  Registry::global().table<AxpyTable>(kOp, OpQuery{infer_backend(a.y), "", {}}).run(a);
}

GDN_REGISTER(axpy_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "y += alpha * x (elementwise; where two gradient paths meet)";
  d.fwd_inputs = {"x", "y"};
  d.fwd_outputs = {"y"};
  d.attrs = {"alpha=1"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
