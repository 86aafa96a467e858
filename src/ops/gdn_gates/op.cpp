// GDN gates: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "gdn/core/rng.h"
#include "ops/gdn_gates/op.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "gdn_gates";

// A non-finite A_log or dt_bias poisons every g of its head; name the first bad index. Device
// tensors are not read back here (that would synchronise inside the step): the parameters come
// from the checkpoint loader and the optimizer, which check them on the host.
void expect_finite_params(const Tensor& t, const char* name) {
  if (t.device() != Device::CPU) return;
  const std::vector<double> v = to_f64_vector(t);
  for (size_t i = 0; i < v.size(); ++i)
    GDN_CHECK_FINITE(std::isfinite(v[i]), "{}: tensor '{}' has a non-finite value {} at index {}",
                     kOp, name, v[i], i);
}

void expect_same_device(std::initializer_list<const Tensor*> ts, const Tensor& ref) {
  for (const Tensor* t : ts)
    GDN_CHECK(t->device() == ref.device(), "{}: all tensors must be on {}", kOp,
              device_name(ref.device()));
}

// Checks a, b, A_log, dt_bias (common to forward and backward); returns the gate dtype.
DType validate_inputs(const Tensor& a, const Tensor& b, const Tensor& A_log,
                      const Tensor& dt_bias) {
  expect_shape(a, kOp, "a", {-1, -1});
  expect_contiguous(a, kOp, "a");
  const int64_t T = a.size(0), H = a.size(1);
  const DType gt = gdn_gates_dtype(a.dtype());
  expect_tensor(b, kOp, "b", a.dtype(), {T, H});
  expect_tensor(A_log, kOp, "A_log", gt, {H});
  expect_tensor(dt_bias, kOp, "dt_bias", gt, {H});
  expect_same_device({&b, &A_log, &dt_bias}, a);
  expect_finite_params(A_log, "A_log");
  expect_finite_params(dt_bias, "dt_bias");
  return gt;
}

void validate_fwd(const GdnGatesFwd& p) {
  const DType gt = validate_inputs(p.a, p.b, p.A_log, p.dt_bias);
  const int64_t T = p.a.size(0), H = p.a.size(1);
  expect_tensor(p.g, kOp, "g", gt, {T, H});
  expect_tensor(p.beta, kOp, "beta", gt, {T, H});
  expect_same_device({&p.g, &p.beta}, p.a);
}

void validate_bwd(const GdnGatesBwd& p) {
  const DType gt = validate_inputs(p.a, p.b, p.A_log, p.dt_bias);
  const int64_t T = p.a.size(0), H = p.a.size(1);
  expect_tensor(p.dg, kOp, "dg", gt, {T, H});
  expect_tensor(p.dbeta, kOp, "dbeta", gt, {T, H});
  expect_tensor(p.da, kOp, "da", p.a.dtype(), {T, H});
  expect_tensor(p.db, kOp, "db", p.a.dtype(), {T, H});
  expect_tensor(p.dA_log, kOp, "dA_log", gt, {H});
  expect_tensor(p.ddt_bias, kOp, "ddt_bias", gt, {H});
  expect_same_device({&p.dg, &p.dbeta, &p.da, &p.db, &p.dA_log, &p.ddt_bias}, p.a);
}

// The shape class: the value heads Hv (16 or 32 in the Qwen3.5 models; the CUDA backward's blocks
// are 32 heads wide) and whether a and b allow 8-byte and g and beta 16-byte accesses (the CUDA
// forward's 4-wide path, fwd<4>; else fwd<1>). The backward kernel has no such branch; it is
// classed by the same tensors' alignment (a, b, dg, dbeta) so that a step's forward and
// backward share one class.
bool aligned8(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 8 == 0; }
ShapeClass class_of(const Tensor& a, const Tensor& b, const Tensor& g, const Tensor& beta) {
  return ShapeClass(infer_backend(a))
      .dim("Hv", a.size(1))
      .flag("vec", aligned8(a) && aligned8(b) && all_aligned16(g, beta));
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: the class's heads (5 without one) over T = 137 tokens (3 backward tiles of 64, the last
// partial; several forward blocks when Hv is large), a spread around 0 with the softplus
// threshold's neighbourhood (19.5 .. 20.5), a large a, very negative a and saturated b. The class
// without vec (and only it) runs on tensors one element past their alignment; the default class
// runs both.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const GdnGatesTable*>(impl.table);
  const auto& ref = *static_cast<const GdnGatesTable*>(Registry::global().ref(kOp).table);
  const int64_t T = 137, H = query.dim("Hv", 5);
  const DType gt = gdn_gates_dtype(backend_dtype(impl.backend));
  const std::vector<bool> shifts = probe_misalignments(query);
  ProbeError err;
  for (const bool shift : shifts) {
    ProbeTensors p(impl.backend);
    std::vector<double> av(static_cast<size_t>(T * H)), bv(av.size());
    for (size_t i = 0; i < av.size(); ++i) {
      av[i] = 4.0 * rng::normal(31, 1, i);
      bv[i] = 3.0 * rng::normal(31, 2, i);
    }
    const double special_a[] = {19.5, 19.99, 20.01, 20.5, 35.0, -40.0, -120.0};
    const double special_b[] = {-30.0, 30.0, -100.0, 100.0};
    for (size_t k = 0; k < std::size(special_a); ++k)
      av[static_cast<size_t>((5 + 3 * k) * H + 3 % H)] = special_a[k];
    for (size_t k = 0; k < std::size(special_b); ++k)
      bv[static_cast<size_t>((2 + 5 * k) * H + 1 % H)] = special_b[k];
    auto a = misaligned(p, p.input(av, {T, H}), shift);
    auto b = misaligned(p, p.input(bv, {T, H}), shift);
    auto A_log = p.uniform({H}, 32, 0.0, 2.7, gt);  // exp(A_log) in [1, 15]
    // dt_bias: 0.5, -1, 1, 0, 0.3 repeated over the heads.
    const double dts[] = {0.5, -1.0, 1.0, 0.0, 0.3};
    std::vector<double> dtv(static_cast<size_t>(H));
    for (size_t h = 0; h < dtv.size(); ++h) dtv[h] = dts[h % std::size(dts)];
    auto dt_bias = p.input(dtv, {H}, gt);
    auto dg = misaligned(p, p.normal({T, H}, 33, 1.0, gt), shift);
    auto dbeta = misaligned(p, p.normal({T, H}, 34, 1.0, gt), shift);
    auto g = misaligned(p, p.zeros({T, H}, gt), shift);
    auto beta = misaligned(p, p.zeros({T, H}, gt), shift);
    auto da = misaligned(p, p.zeros({T, H}), shift), db = misaligned(p, p.zeros({T, H}), shift);
    auto dA = p.zeros({H}, gt), ddt = p.zeros({H}, gt);
    cand.forward({a.cand, b.cand, A_log.cand, dt_bias.cand, g.cand, beta.cand});
    cand.backward({a.cand, b.cand, A_log.cand, dt_bias.cand, dg.cand, dbeta.cand, da.cand, db.cand,
                   dA.cand, ddt.cand});
    ref.forward({a.ref, b.ref, A_log.ref, dt_bias.ref, g.ref, beta.ref});
    ref.backward(
        {a.ref, b.ref, A_log.ref, dt_bias.ref, dg.ref, dbeta.ref, da.ref, db.ref, dA.ref, ddt.ref});
    err.fwd = std::max({err.fwd, rel_l2_error(g.cand, g.ref), rel_l2_error(beta.cand, beta.ref)});
    err.bwd = std::max({err.bwd, rel_l2_error(da.cand, da.ref), rel_l2_error(db.cand, db.ref),
                        rel_l2_error(dA.cand, dA.ref), rel_l2_error(ddt.cand, ddt.ref)});
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
  const auto& t = *static_cast<const GdnGatesTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), gt = gdn_gates_dtype(dt);
  const Device dev = backend_device(impl.backend);
  Tensor a = io.input("a", dt, dev);
  const int64_t H = a.size(-1), T = a.numel() / std::max<int64_t>(H, 1);
  a = a.reshape({T, H});
  Tensor b = io.input("b", dt, dev).reshape({T, H});
  Tensor A_log = io.input("A_log", gt, dev);
  Tensor dt_bias = io.input("dt_bias", gt, dev);
  Tensor g = io.output("g", gt, dev, {T, H});
  Tensor beta = io.output("beta", gt, dev, {T, H});
  const GdnGatesFwd fa{a, b, A_log, dt_bias, g, beta};
  validate_fwd(fa);
  t.forward(fa);
  if (!backward) return;
  Tensor dg = io.input("dg", gt, dev).reshape({T, H});
  Tensor dbeta = io.input("dbeta", gt, dev).reshape({T, H});
  Tensor da = io.output("da", dt, dev, {T, H});
  Tensor db = io.output("db", dt, dev, {T, H});
  Tensor dA = io.output("dA_log", gt, dev, {H});
  Tensor ddt = io.output("ddt_bias", gt, dev, {H});
  const GdnGatesBwd ba{a, b, A_log, dt_bias, dg, dbeta, da, db, dA, ddt};
  validate_bwd(ba);
  t.backward(ba);
}
}  // namespace

void gdn_gates_forward(const GdnGatesFwd& args) {
  validate_fwd(args);
  dispatch().table<GdnGatesTable>(class_of(args.a, args.b, args.g, args.beta)).forward(args);
}

void gdn_gates_backward(const GdnGatesBwd& args) {
  validate_bwd(args);
  dispatch().table<GdnGatesTable>(class_of(args.a, args.b, args.dg, args.dbeta)).backward(args);
}

GDN_REGISTER(gdn_gates_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "GDN gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)";
  d.fwd_inputs = {"a", "b", "A_log", "dt_bias"};
  d.fwd_outputs = {"g", "beta"};
  d.bwd_inputs = {"a", "b", "A_log", "dt_bias", "dg", "dbeta"};
  d.bwd_outputs = {"da", "db", "dA_log", "ddt_bias"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
