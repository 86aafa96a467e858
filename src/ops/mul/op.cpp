// mul: validation, dispatch and registration.
#include "ops/mul/op.h"

#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "mul";

void validate(const MulArgs& a) {
  expect_defined(a.a, kOp, "a");
  expect_contiguous(a.a, kOp, "a");
  for (auto [t, name] : {std::pair{&a.b, "b"}, std::pair{&a.y, "y"}}) {
    expect_defined(*t, kOp, name);
    GDN_CHECK(t->numel() == a.a.numel(), "{}: tensor '{}' has {} elements but 'a' has {}", kOp,
              name, t->numel(), a.a.numel());
    expect_dtype(*t, kOp, name, a.a.dtype());
    expect_contiguous(*t, kOp, name);
    expect_device(*t, kOp, name, a.a.device());
  }
}

// Probe: an odd length, then in place over a.
ProbeError probe(const ImplDesc& impl, const OpQuery&) {
  const auto& cand = *static_cast<const MulTable*>(impl.table);
  const auto& ref = *static_cast<const MulTable*>(Registry::global().ref(kOp).table);
  ProbeTensors p(impl.backend);
  auto a = p.normal({1031}, 51, 2.0);
  auto b = p.normal({1031}, 52, 1.0);
  auto y = p.zeros({1031});
  ref.run({a.ref, b.ref, y.ref});
  cand.run({a.cand, b.cand, y.cand});
  ProbeError err{rel_l2_error(y.cand, y.ref), 0.0};  // no backward (see op.h)
  cand.run({a.cand, b.cand, a.cand});
  err.fwd = std::max(err.fwd, rel_l2_error(a.cand, y.ref));
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
  const auto& t = *static_cast<const MulTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const Device dev = backend_device(impl.backend);
  Tensor a = io.input("a", dt, dev);
  MulArgs m{a, io.input("b", dt, dev), io.output("y", dt, dev, a.shape())};
  validate(m);
  t.run(m);
}
}  // namespace

void mul(const MulArgs& a) {
  validate(a);
  Registry::global().table<MulTable>(kOp, OpQuery{infer_backend(a.a), "", {}}).run(a);
}

GDN_REGISTER(mul_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "y = a * b (elementwise; the unfused SwiGLU route's multiply pass)";
  d.fwd_inputs = {"a", "b"};
  d.fwd_outputs = {"y"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
