// Causal conv1d: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include <algorithm>
#include <vector>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "ops/causal_conv1d/op.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "causal_conv1d";

void expect_on(const Tensor& t, const char* name, const Tensor& x) {
  if (t.defined()) expect_device(t, kOp, name, x.device());
}

// x [T, C], weight [C, W] with W in 1..8, cu_seqlens [N+1] I32 with values 0 = c_0 <= ... <= c_N
// = T; returns {C, W, N}.
struct Dims {
  int64_t T, C, W, N;
};
Dims validate_common(const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const Tensor& cu_seqlens) {
  expect_shape(x, kOp, "x", {-1, -1});
  expect_contiguous(x, kOp, "x");
  const int64_t T = x.size(0), C = x.size(1);
  expect_tensor(weight, kOp, "weight", x.dtype(), {C, -1});
  const int64_t W = weight.size(1);
  GDN_CHECK(W >= 1 && W <= kConvMaxWidth,
            "{}: tensor 'weight' has shape {}: width W = {} is outside 1..{}", kOp,
            weight.shape_str(), W, kConvMaxWidth);
  expect_on(weight, "weight", x);
  if (bias.defined()) {
    expect_tensor(bias, kOp, "bias", x.dtype(), {C});
    expect_on(bias, "bias", x);
  }
  int64_t N = 1;
  if (cu_seqlens.defined()) {
    expect_tensor(cu_seqlens, kOp, "cu_seqlens", DType::I32, {-1});
    expect_on(cu_seqlens, "cu_seqlens", x);
    GDN_CHECK(cu_seqlens.numel() >= 1,
              "{}: tensor 'cu_seqlens' is empty; it needs N+1 >= 1 entries (0, ..., T)", kOp);
    N = cu_seqlens.numel() - 1;
    if (cu_seqlens.device() == Device::CPU) {
      const int32_t* cu = cu_seqlens.ptr<int32_t>();  // [N+1]
      GDN_CHECK(cu[0] == 0, "{}: tensor 'cu_seqlens' must start at 0, got cu_seqlens[0] = {}", kOp,
                cu[0]);
      for (int64_t i = 1; i <= N; ++i)
        GDN_CHECK(cu[i] >= cu[i - 1],
                  "{}: tensor 'cu_seqlens' decreases at index {}: cu_seqlens[{}] = {} < "
                  "cu_seqlens[{}] = {}",
                  kOp, i, i, cu[i], i - 1, cu[i - 1]);
      GDN_CHECK(cu[N] == T,
                "{}: tensor 'cu_seqlens' must end at T = {} (the rows of 'x'), got "
                "cu_seqlens[{}] = {}",
                kOp, T, N, cu[N]);
    }
  }
  return {T, C, W, N};
}

void expect_state(const Tensor& t, const char* name, const Tensor& x, const Dims& d) {
  if (!t.defined()) return;
  expect_tensor(t, kOp, name, x.dtype(), {d.N, d.C, d.W - 1});
  expect_on(t, name, x);
}

void validate_fwd(const CausalConv1dFwd& p) {
  const Dims d = validate_common(p.x, p.weight, p.bias, p.cu_seqlens);
  expect_state(p.initial_state, "initial_state", p.x, d);
  expect_tensor(p.y, kOp, "y", p.x.dtype(), {d.T, d.C});
  expect_on(p.y, "y", p.x);
  expect_state(p.final_state, "final_state", p.x, d);
}

void validate_bwd(const CausalConv1dBwd& p) {
  const Dims d = validate_common(p.x, p.weight, p.bias, p.cu_seqlens);
  expect_state(p.initial_state, "initial_state", p.x, d);
  expect_tensor(p.dy, kOp, "dy", p.x.dtype(), {d.T, d.C});
  expect_on(p.dy, "dy", p.x);
  expect_state(p.dfinal_state, "dfinal_state", p.x, d);
  expect_tensor(p.dx, kOp, "dx", p.x.dtype(), {d.T, d.C});
  expect_on(p.dx, "dx", p.x);
  const DType gt = causal_conv1d_grad_dtype(p.x.dtype());
  expect_tensor(p.dweight, kOp, "dweight", gt, {d.C, d.W});
  expect_on(p.dweight, "dweight", p.x);
  if (p.dbias.defined()) {
    GDN_CHECK(p.bias.defined(), "{}: tensor 'dbias' was given but 'bias' was not", kOp);
    expect_tensor(p.dbias, kOp, "dbias", gt, {d.C});
    expect_on(p.dbias, "dbias", p.x);
  }
  if (p.dinitial_state.defined()) {
    GDN_CHECK(p.initial_state.defined(),
              "{}: tensor 'dinitial_state' was given but 'initial_state' was not (a zero initial "
              "state is a constant)",
              kOp);
    expect_state(p.dinitial_state, "dinitial_state", p.x, d);
  }
}

// The shape class: the width (kernels per W), the channels, whether every token row is whole
// 16-byte packs with every tensor aligned, SiLU, and which optional tensors are given (bias; any
// state: initial, final, their gradients).
ShapeClass class_of(const Tensor& x, const Tensor& weight, bool vec, bool silu, bool bias,
                    bool states) {
  return ShapeClass(infer_backend(x))
      .dim("W", weight.size(1))
      .dim("C", x.size(1))
      .flag("vec", vec && x.size(1) % 8 == 0)
      .flag("silu", silu)
      .flag("bias", bias)
      .flag("states", states);
}
ShapeClass class_of(const CausalConv1dFwd& p) {
  return class_of(p.x, p.weight,
                  all_aligned16(p.x, p.weight, p.bias, p.y, p.initial_state, p.final_state), p.silu,
                  p.bias.defined(), p.initial_state.defined() || p.final_state.defined());
}
ShapeClass class_of(const CausalConv1dBwd& p) {
  return class_of(
      p.x, p.weight,
      all_aligned16(p.x, p.weight, p.bias, p.dy, p.dx, p.initial_state, p.dfinal_state,
                    p.dinitial_state),
      p.silu, p.bias.defined(),
      p.initial_state.defined() || p.dfinal_state.defined() || p.dinitial_state.defined());
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe. At a class: its W, channels, SiLU and optional tensors over documents of 1, 0, 2, 40,
// 70, 9 and 78 tokens (a 1-token and a zero-length document, one shorter than W-1, documents
// longer than a 64-token tile and than the backward's segments). Without one (the default
// class): W = 4 over 13 channels and documents of 1, 0, 2, 8, 9 and 3 tokens with initial state,
// final state and its gradient, bias, SiLU on; the plain variant (no bias, no state, no SiLU) at
// W = 3; and the first variant again over 136 channels (the 16-byte paths).
struct ConvCase {
  int64_t C, W;
  bool silu, bias, states;
  std::vector<int64_t> cu;
};
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const CausalConv1dTable*>(impl.table);
  const auto& ref = *static_cast<const CausalConv1dTable*>(Registry::global().ref(kOp).table);
  const DType gt = causal_conv1d_grad_dtype(backend_dtype(impl.backend));
  std::vector<ConvCase> cases;
  if (query.dims.contains("C")) {
    const int64_t C = probe_width(query.dim("C", 13), query.dim("vec", 0) != 0, 8);
    cases = {{C,
              query.dim("W", 4),
              query.dim("silu", 1) != 0,
              query.dim("bias", 1) != 0,
              query.dim("states", 1) != 0,
              {0, 1, 1, 3, 43, 113, 122, 200}}};
  } else {
    const std::vector<int64_t> cu = {0, 1, 1, 3, 11, 20, 23};
    cases = {{13, 4, true, true, true, cu},
             {13, 3, false, false, false, cu},
             {136, 4, true, true, true, cu}};
  }
  ProbeError err;
  for (const ConvCase& c : cases) {
    const int64_t C = c.C, W = c.W, S = W - 1;
    const bool full = c.states;
    const std::vector<int64_t>& cuv = c.cu;
    const int64_t T = cuv.back(), N = static_cast<int64_t>(cuv.size()) - 1;
    ProbeTensors p(impl.backend);
    auto x = p.normal({T, C}, 41, 1.5);
    auto w = p.normal({C, W}, 42, 0.5);
    auto bias = p.normal({C}, 43, 0.3);
    auto cu = p.ints(cuv, {N + 1}, DType::I32);
    auto init = p.normal({N, C, S}, 44, 1.0);
    auto dy = p.normal({T, C}, 45, 1.0);
    auto dfin = p.normal({N, C, S}, 46, 1.0);
    auto y = p.zeros({T, C}), fin = p.zeros({N, C, S});
    auto dx = p.zeros({T, C}), dinit = p.zeros({N, C, S});
    auto dw = p.zeros({C, W}, gt), db = p.zeros({C}, gt);
    auto pick = [&](const ProbeTensors::Pair& t, bool r) { return r ? t.ref : t.cand; };
    for (bool r : {false, true}) {
      const auto& t = r ? ref : cand;
      t.forward({pick(x, r), pick(w, r), c.bias ? pick(bias, r) : Tensor(), pick(cu, r),
                 full ? pick(init, r) : Tensor(), pick(y, r), full ? pick(fin, r) : Tensor(),
                 c.silu});
      t.backward({pick(x, r), pick(w, r), c.bias ? pick(bias, r) : Tensor(), pick(cu, r),
                  full ? pick(init, r) : Tensor(), pick(dy, r), full ? pick(dfin, r) : Tensor(),
                  pick(dx, r), pick(dw, r), c.bias ? pick(db, r) : Tensor(),
                  full ? pick(dinit, r) : Tensor(), c.silu});
    }
    err.fwd = std::max(err.fwd, rel_l2_error(y.cand, y.ref));
    if (full) err.fwd = std::max(err.fwd, rel_l2_error(fin.cand, fin.ref));
    err.bwd = std::max({err.bwd, rel_l2_error(dx.cand, dx.ref), rel_l2_error(dw.cand, dw.ref)});
    if (c.bias) err.bwd = std::max(err.bwd, rel_l2_error(db.cand, db.ref));
    if (full) err.bwd = std::max(err.bwd, rel_l2_error(dinit.cand, dinit.ref));
  }
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);
    return kBf16;
  }
  return {1e-5, 1e-5};
}

// `gdntrain ops run causal_conv1d`: x and weight are required; bias, cu_seqlens, initial_state
// (and dfinal_state for backward) are used when the file has them. final_state is always
// written. Attribute silu (default 1).
void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const CausalConv1dTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), gt = causal_conv1d_grad_dtype(dt);
  const Device dev = backend_device(impl.backend);
  auto opt = [&](const char* name, DType type) {
    return io.has_input(name) ? io.input(name, type, dev) : Tensor();
  };
  Tensor x = io.input("x", dt, dev);
  Tensor weight = io.input("weight", dt, dev);
  GDN_CHECK(x.ndim() == 2 && weight.ndim() >= 2, "{}: 'x' must be [T, C] and 'weight' [C, W]", kOp);
  const int64_t T = x.size(0), C = x.size(1), W = weight.size(-1);
  weight = weight.reshape({weight.numel() / std::max<int64_t>(W, 1), W});  // HF's [C, 1, W]
  Tensor bias = opt("bias", dt);
  Tensor cu = opt("cu_seqlens", DType::I32);
  Tensor init = opt("initial_state", dt);
  const bool silu = io.attr("silu", 1) != 0;
  const int64_t N = causal_conv1d_num_docs(cu);
  Tensor y = io.output("y", dt, dev, {T, C});
  Tensor fin = io.output("final_state", dt, dev, {N, C, std::max<int64_t>(W - 1, 0)});
  const CausalConv1dFwd fa{x, weight, bias, cu, init, y, fin, silu};
  validate_fwd(fa);
  t.forward(fa);
  if (!backward) return;
  Tensor dy = io.input("dy", dt, dev);
  Tensor dfin = opt("dfinal_state", dt);
  Tensor dx = io.output("dx", dt, dev, {T, C});
  Tensor dw = io.output("dweight", gt, dev, {C, W});
  Tensor db = bias.defined() ? io.output("dbias", gt, dev, {C}) : Tensor();
  Tensor dinit = init.defined() ? io.output("dinitial_state", dt, dev, {N, C, W - 1}) : Tensor();
  const CausalConv1dBwd ba{x, weight, bias, cu, init, dy, dfin, dx, dw, db, dinit, silu};
  validate_bwd(ba);
  t.backward(ba);
}
}  // namespace

void causal_conv1d_forward(const CausalConv1dFwd& args) {
  validate_fwd(args);
  dispatch().table<CausalConv1dTable>(class_of(args)).forward(args);
}

void causal_conv1d_backward(const CausalConv1dBwd& args) {
  validate_bwd(args);
  dispatch().table<CausalConv1dTable>(class_of(args)).backward(args);
}

GDN_REGISTER(causal_conv1d_op) {
  OpDesc d;
  d.name = kOp;
  d.summary =
      "depthwise causal conv1d over packed documents (cu_seqlens), optional bias, SiLU, "
      "initial/final state [N, C, W-1]";
  d.fwd_inputs = {"x", "weight", "bias (optional)", "cu_seqlens (optional, I32)",
                  "initial_state (optional)"};
  d.fwd_outputs = {"y", "final_state"};
  d.bwd_inputs = {"x",
                  "weight",
                  "bias (optional)",
                  "cu_seqlens (optional, I32)",
                  "initial_state (optional)",
                  "dy",
                  "dfinal_state (optional)"};
  d.bwd_outputs = {"dx", "dweight", "dbias (with bias)", "dinitial_state (with initial_state)"};
  d.attrs = {"silu=1"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
