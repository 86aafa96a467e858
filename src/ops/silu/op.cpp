// SiLU: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/silu/op.h"

#include <algorithm>
#include <vector>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "silu";

void same(const Tensor& x, const Tensor& t, const char* name) {
  expect_defined(t, kOp, name);
  GDN_CHECK(t.numel() == x.numel(), "{}: tensor '{}' has {} elements but 'x' has {}", kOp, name,
            t.numel(), x.numel());
  expect_dtype(t, kOp, name, x.dtype());
  expect_contiguous(t, kOp, name);
  expect_device(t, kOp, name, x.device());
}

void validate_fwd(const SiluFwd& a) {
  expect_defined(a.x, kOp, "x");
  expect_contiguous(a.x, kOp, "x");
  same(a.x, a.y, "y");
}

void validate_bwd(const SiluBwd& a) {
  expect_defined(a.x, kOp, "x");
  expect_contiguous(a.x, kOp, "x");
  same(a.x, a.dy, "dy");
  same(a.x, a.dx, "dx");
}

// The shape class: whether every pointer allows 16-byte vectors (cuda::launch_map2's 8-wide packs;
// else one element a thread). The CPU loop has no branch; production calls are all vec.
ShapeClass class_of(const Tensor& x, bool vec) {
  return ShapeClass(infer_backend(x)).flag("vec", vec);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: an odd length, x from -30 to 30 (both saturated tails and the region around 0); the
// backward out of place, then in place over dy. The length is map2_probe_length's (past
// one pass of launch_map2's capped grid on CUDA: probe_layout.h). The class without vec (and only
// it) runs on tensors one element past a 16-byte boundary; the default class runs both.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const SiluTable*>(impl.table);
  const auto& ref = *static_cast<const SiluTable*>(Registry::global().ref(kOp).table);
  const int64_t n = map2_probe_length(impl.backend);
  const std::vector<bool> shifts = probe_misalignments(query);
  ProbeError err;
  for (const bool shift : shifts) {
    ProbeTensors p(impl.backend);
    std::vector<double> xv(static_cast<size_t>(n));
    for (size_t j = 0; j < xv.size(); ++j)
      xv[j] = -30.0 + 60.0 * static_cast<double>((j * 37) % xv.size()) / static_cast<double>(n);
    auto x = misaligned(p, p.input(xv, {n}), shift);
    auto dy = misaligned(p, p.normal({n}, 41, 1.0), shift);
    auto y = misaligned(p, p.zeros({n}), shift), dx = misaligned(p, p.zeros({n}), shift);
    ref.forward({x.ref, y.ref});
    cand.forward({x.cand, y.cand});
    ref.backward({x.ref, dy.ref, dx.ref});
    cand.backward({x.cand, dy.cand, dx.cand});
    err.fwd = std::max(err.fwd, rel_l2_error(y.cand, y.ref));
    err.bwd = std::max(err.bwd, rel_l2_error(dx.cand, dx.ref));
    cand.backward({x.cand, dy.cand, dy.cand});  // in place over dy
    err.bwd = std::max(err.bwd, rel_l2_error(dy.cand, dx.ref));
  }
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {2e-6, 2e-6};
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const SiluTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const Device dev = backend_device(impl.backend);
  Tensor x = io.input("x", dt, dev);
  SiluFwd f{x, io.output("y", dt, dev, x.shape())};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  SiluBwd b{x, io.input("dy", dt, dev), io.output("dx", dt, dev, x.shape())};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

void silu_forward(const SiluFwd& a) {
  validate_fwd(a);
  dispatch().table<SiluTable>(class_of(a.x, all_aligned16(a.x, a.y))).forward(a);
}

void silu_backward(const SiluBwd& a) {
  validate_bwd(a);
  dispatch().table<SiluTable>(class_of(a.x, all_aligned16(a.x, a.dy, a.dx))).backward(a);
}

GDN_REGISTER(silu_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "y = silu(x) = x * sigmoid(x) (elementwise; the unfused routes' SiLU pass)";
  d.fwd_inputs = {"x"};
  d.fwd_outputs = {"y"};
  d.bwd_inputs = {"x", "dy"};
  d.bwd_outputs = {"dx"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
