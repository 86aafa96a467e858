// SwiGLU: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/swiglu/op.h"

#include <algorithm>
#include <vector>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "swiglu";

void same_device(const Tensor& ref, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    GDN_CHECK(t->device() == ref.device(), "{}: all tensors must be on {}", kOp,
              device_name(ref.device()));
}

void validate_fwd(const SwigluFwd& a) {
  expect_shape(a.gate, kOp, "gate", {-1, -1});
  expect_contiguous(a.gate, kOp, "gate");
  const int64_t r = a.gate.size(0), i = a.gate.size(1);
  expect_tensor(a.up, kOp, "up", a.gate.dtype(), {r, i});
  expect_tensor(a.y, kOp, "y", a.gate.dtype(), {r, i});
  same_device(a.gate, {&a.up, &a.y});
}

void validate_bwd(const SwigluBwd& a) {
  expect_shape(a.gate, kOp, "gate", {-1, -1});
  expect_contiguous(a.gate, kOp, "gate");
  const int64_t r = a.gate.size(0), i = a.gate.size(1);
  expect_tensor(a.up, kOp, "up", a.gate.dtype(), {r, i});
  expect_tensor(a.dy, kOp, "dy", a.gate.dtype(), {r, i});
  expect_tensor(a.dgate, kOp, "dgate", a.gate.dtype(), {r, i});
  expect_tensor(a.dup, kOp, "dup", a.gate.dtype(), {r, i});
  same_device(a.gate, {&a.up, &a.dy, &a.dgate, &a.dup});
  // Only the documented in-place pairs are allowed: any other overlap would be read after write.
  const void* outs[] = {a.dgate.data(), a.dup.data()};
  const void* ins[] = {a.gate.data(), a.up.data(), a.dy.data()};
  GDN_CHECK(a.gate.numel() == 0 || a.dgate.data() != a.dup.data(),
            "{}: tensors 'dgate' and 'dup' must not share memory", kOp);
  for (int o = 0; o < 2; ++o)
    for (int k = 0; k < 3; ++k)
      GDN_CHECK(a.gate.numel() == 0 || outs[o] != ins[k] || o == k,
                "{}: tensor '{}' may alias only '{}', not '{}'", kOp, o ? "dup" : "dgate",
                o ? "up" : "gate",
                k == 0   ? "gate"
                : k == 1 ? "up"
                         : "dy");
}

// The shape class: whether every pointer allows 16-byte vectors (the CUDA kernels' 8-wide packs;
// else one element a thread). The CPU loop has no branch; production calls are all vec.
ShapeClass class_of(const Tensor& gate, bool vec) {
  return ShapeClass(infer_backend(gate)).flag("vec", vec);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: 67 x 389 elements (several CUDA blocks of 8192 packed / 1024 single elements, and a tail
// of n % 8), gates from -30 to 30 (both saturated tails of the sigmoid and the region around 0),
// run out of place and then in place (dgate over gate, dup over up). The class without vec (and
// only it) runs on tensors one element past a 16-byte boundary; the default class runs both.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const SwigluTable*>(impl.table);
  const auto& ref = *static_cast<const SwigluTable*>(Registry::global().ref(kOp).table);
  const int64_t R = 67, I = 389;
  const std::vector<bool> shifts = probe_misalignments(query);
  ProbeError err;
  for (const bool shift : shifts) {
    ProbeTensors p(impl.backend);
    std::vector<double> g(static_cast<size_t>(R * I));
    for (size_t j = 0; j < g.size(); ++j)
      g[j] =
          -30.0 + 60.0 * static_cast<double>((j * 37) % g.size()) / static_cast<double>(g.size());
    auto gate = misaligned(p, p.input(g, {R, I}), shift);
    auto up = misaligned(p, p.normal({R, I}, 31, 1.5), shift);
    auto dy = misaligned(p, p.normal({R, I}, 32, 1.0), shift);
    auto y = misaligned(p, p.zeros({R, I}), shift);
    auto dgate = misaligned(p, p.zeros({R, I}), shift);
    auto dup = misaligned(p, p.zeros({R, I}), shift);
    ref.forward({gate.ref, up.ref, y.ref});
    cand.forward({gate.cand, up.cand, y.cand});
    ref.backward({gate.ref, up.ref, dy.ref, dgate.ref, dup.ref});
    cand.backward({gate.cand, up.cand, dy.cand, dgate.cand, dup.cand});
    err.fwd = std::max(err.fwd, rel_l2_error(y.cand, y.ref));
    err.bwd =
        std::max({err.bwd, rel_l2_error(dgate.cand, dgate.ref), rel_l2_error(dup.cand, dup.ref)});
    // In place: the candidate overwrites its own gate and up with the gradients.
    cand.backward({gate.cand, up.cand, dy.cand, gate.cand, up.cand});
    err.bwd =
        std::max({err.bwd, rel_l2_error(gate.cand, dgate.ref), rel_l2_error(up.cand, dup.ref)});
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
  const auto& t = *static_cast<const SwigluTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const Device dev = backend_device(impl.backend);
  Tensor gate = io.input("gate", dt, dev);
  const int64_t I = gate.ndim() == 0 ? 1 : gate.size(-1);
  const int64_t R = I == 0 ? 0 : gate.numel() / I;
  gate = gate.reshape({R, I});
  Tensor up = io.input("up", dt, dev);
  GDN_CHECK(up.numel() == gate.numel(), "{}: tensor 'up' has shape {}, expected {}", kOp,
            up.shape_str(), gate.shape_str());
  up = up.reshape({R, I});
  Tensor y = io.output("y", dt, dev, {R, I});
  SwigluFwd f{gate, up, y};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  Tensor dy = io.input("dy", dt, dev);
  GDN_CHECK(dy.numel() == gate.numel(), "{}: tensor 'dy' has shape {}, expected {}", kOp,
            dy.shape_str(), gate.shape_str());
  SwigluBwd b{gate, up, dy.reshape({R, I}), io.output("dgate", dt, dev, {R, I}),
              io.output("dup", dt, dev, {R, I})};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

void swiglu_forward(const SwigluFwd& a) {
  validate_fwd(a);
  dispatch().table<SwigluTable>(class_of(a.gate, all_aligned16(a.gate, a.up, a.y))).forward(a);
}

void swiglu_backward(const SwigluBwd& a) {
  validate_bwd(a);
  dispatch()
      .table<SwigluTable>(class_of(a.gate, all_aligned16(a.gate, a.up, a.dy, a.dgate, a.dup)))
      .backward(a);
}

GDN_REGISTER(swiglu_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "y = silu(gate) * up (gate, up: separate [R, I] tensors); in-place backward allowed";
  d.fwd_inputs = {"gate", "up"};
  d.fwd_outputs = {"y"};
  d.bwd_inputs = {"gate", "up", "dy"};
  d.bwd_outputs = {"dgate", "dup"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
