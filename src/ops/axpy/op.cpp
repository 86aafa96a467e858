// axpy: validation, dispatch and registration.
#include "ops/axpy/op.h"

#include <algorithm>
#include <vector>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
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

// The shape class: the dtype of x and y (CUDA: F32 with 4-wide vectors, BF16 with 8-wide; the
// model's accumulations are BF16 activations) and whether both pointers allow 16-byte vectors.
ShapeClass class_of(const AxpyArgs& a) {
  return ShapeClass(infer_backend(a.y))
      .flag("f32", a.y.dtype() == DType::F32)
      .flag("vec", all_aligned16(a.x, a.y));
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: an odd length past the CPU loop's OpenMP threshold (65536) and over several CUDA blocks
// with a tail, in the class's dtype (the backend's activation dtype and F32 where they differ for
// the default class), on tensors one element past a 16-byte boundary for the class without vec
// (both layouts for the default class).
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const AxpyTable*>(impl.table);
  const auto& ref = *static_cast<const AxpyTable*>(Registry::global().ref(kOp).table);
  const int64_t n = 70001;
  std::vector<DType> dtypes;
  if (query.dims.contains("f32"))
    dtypes = {query.dim("f32", 0) != 0 ? DType::F32 : backend_dtype(impl.backend)};
  else if (backend_dtype(impl.backend) == DType::F32)
    dtypes = {DType::F32};
  else
    dtypes = {backend_dtype(impl.backend), DType::F32};
  const std::vector<bool> shifts = probe_misalignments(query);
  ProbeError err;
  for (const DType dt : dtypes)
    for (const bool shift : shifts) {
      ProbeTensors p(impl.backend);
      auto x = misaligned(p, p.normal({n}, 3, 1.0, dt), shift);
      auto y = misaligned(p, p.normal({n}, 4, 1.0, dt), shift);
      cand.run({x.cand, y.cand, -0.75});
      ref.run({x.ref, y.ref, -0.75});
      // No backward: the op is linear in x and y.
      err.fwd = std::max(err.fwd, rel_l2_error(y.cand, y.ref));
    }
  return err;
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
  dispatch().table<AxpyTable>(class_of(a)).run(a);
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
