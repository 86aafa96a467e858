// SiLU: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/silu/op.h"

#include <algorithm>

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

OpQuery query_for(const Tensor& t) { return OpQuery{infer_backend(t), "", {}}; }

// Probe: an odd length, x from -30 to 30 (both saturated tails and the region around 0); the
// backward out of place, then in place over dy.
ProbeError probe(const ImplDesc& impl, const OpQuery&) {
  const auto& cand = *static_cast<const SiluTable*>(impl.table);
  const auto& ref = *static_cast<const SiluTable*>(Registry::global().ref(kOp).table);
  const int64_t n = 1031;
  ProbeTensors p(impl.backend);
  std::vector<double> xv(static_cast<size_t>(n));
  for (size_t j = 0; j < xv.size(); ++j)
    xv[j] = -30.0 + 60.0 * static_cast<double>((j * 37) % xv.size()) / static_cast<double>(n);
  auto x = p.input(xv, {n});
  auto dy = p.normal({n}, 41, 1.0);
  auto y = p.zeros({n}), dx = p.zeros({n});
  ref.forward({x.ref, y.ref});
  cand.forward({x.cand, y.cand});
  ref.backward({x.ref, dy.ref, dx.ref});
  cand.backward({x.cand, dy.cand, dx.cand});
  ProbeError err{rel_l2_error(y.cand, y.ref), rel_l2_error(dx.cand, dx.ref)};
  cand.backward({x.cand, dy.cand, dy.cand});  // in place over dy
  err.bwd = std::max(err.bwd, rel_l2_error(dy.cand, dx.ref));
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
  Registry::global().table<SiluTable>(kOp, query_for(a.x)).forward(a);
}

void silu_backward(const SiluBwd& a) {
  validate_bwd(a);
  Registry::global().table<SiluTable>(kOp, query_for(a.x)).backward(a);
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
