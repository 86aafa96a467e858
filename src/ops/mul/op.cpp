// mul: validation, dispatch and registration.
#include "ops/mul/op.h"

#include <algorithm>
#include <vector>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
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

// The shape class: whether every pointer allows 16-byte vectors (cuda::launch_map2's 8-wide packs;
// else one element a thread). The CPU loop has no branch; production calls are all vec.
ShapeClass class_of(const MulArgs& a) {
  return ShapeClass(infer_backend(a.a)).flag("vec", all_aligned16(a.a, a.b, a.y));
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: an odd length, then in place over a. The length is map2_probe_length's (past
// one pass of launch_map2's capped grid on CUDA: probe_layout.h). The class without vec (and only
// it) runs on tensors one element past a 16-byte boundary; the default class runs both.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const MulTable*>(impl.table);
  const auto& ref = *static_cast<const MulTable*>(Registry::global().ref(kOp).table);
  const int64_t n = map2_probe_length(impl.backend);
  const std::vector<bool> shifts = probe_misalignments(query);
  ProbeError err;
  for (const bool shift : shifts) {
    ProbeTensors p(impl.backend);
    auto a = misaligned(p, p.normal({n}, 51, 2.0), shift);
    auto b = misaligned(p, p.normal({n}, 52, 1.0), shift);
    auto y = misaligned(p, p.zeros({n}), shift);
    ref.run({a.ref, b.ref, y.ref});
    cand.run({a.cand, b.cand, y.cand});
    err.fwd = std::max(err.fwd, rel_l2_error(y.cand, y.ref));  // no backward (see op.h)
    cand.run({a.cand, b.cand, a.cand});
    err.fwd = std::max(err.fwd, rel_l2_error(a.cand, y.ref));
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
  dispatch().table<MulTable>(class_of(a)).run(a);
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
