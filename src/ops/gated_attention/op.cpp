// Gated attention: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/gated_attention/op.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

#if GDN_WITH_CUDA
// cuda.cu: the larger carve of its forward and backward.
size_t gated_attention_cuda_workspace_bytes(int64_t T, int64_t N, int64_t Hq, int64_t Hkv,
                                            int64_t hd);
#endif

size_t gated_attention_workspace_bytes(int64_t T, int64_t N, int64_t Hq, int64_t Hkv, int64_t hd) {
  GDN_CHECK(T >= 0 && N >= 0 && Hq >= 1 && Hkv >= 1 && hd >= 1,
            "gated_attention: gated_attention_workspace_bytes needs T, N >= 0 and Hq, Hkv, hd >= "
            "1, got T = {}, N = {}, Hq = {}, Hkv = {}, hd = {}",
            T, N, Hq, Hkv, hd);
#if GDN_WITH_CUDA
  return gated_attention_cuda_workspace_bytes(T, N, Hq, Hkv, hd);
#else
  return 0;
#endif
}

namespace {
constexpr const char* kOp = "gated_attention";

// Shapes shared by forward and backward, read from qg and k and checked against each other.
struct Shape {
  int64_t T, Hq, Hkv, hd;
};

Shape validate_inputs(const Tensor& qg, const Tensor& k, const Tensor& v, const Tensor& q_norm_w,
                      const Tensor& k_norm_w, const Tensor& cu, int64_t rotary_dim,
                      double rope_theta, double eps) {
  expect_shape(qg, kOp, "qg", {-1, -1, -1});
  expect_contiguous(qg, kOp, "qg");
  const DType dt = qg.dtype();
  GDN_CHECK(dtype_is_float(dt), "{}: tensor 'qg' has dtype {}, expected a float dtype", kOp,
            dtype_name(dt));
  const int64_t T = qg.size(0), Hq = qg.size(1);
  expect_shape(k, kOp, "k", {T, -1, -1});
  const int64_t Hkv = k.size(1), hd = k.size(2);
  GDN_CHECK(Hkv >= 1 && hd >= 1, "{}: tensor 'k' has shape {}, expected [T, Hkv >= 1, hd >= 1]",
            kOp, k.shape_str());
  GDN_CHECK(hd % 2 == 0, "{}: head dim hd = {} (tensor 'k' dim 2) must be even", kOp, hd);
  expect_tensor(qg, kOp, "qg", dt, {T, -1, 2 * hd});
  GDN_CHECK(Hq >= 1 && Hq % Hkv == 0,
            "{}: Hq = {} query heads (tensor 'qg' dim 1) must be a positive multiple of Hkv = {} "
            "key/value heads (tensor 'k' dim 1)",
            kOp, Hq, Hkv);
  expect_tensor(k, kOp, "k", dt, {T, Hkv, hd});
  expect_tensor(v, kOp, "v", dt, {T, Hkv, hd});
  expect_tensor(q_norm_w, kOp, "q_norm_w", dt, {hd});
  expect_tensor(k_norm_w, kOp, "k_norm_w", dt, {hd});
  expect_tensor(cu, kOp, "cu_seqlens", DType::I32, {-1});
  GDN_CHECK(cu.size(0) >= 2, "{}: tensor 'cu_seqlens' has shape {}, expected [N+1] with N >= 1",
            kOp, cu.shape_str());
  GDN_CHECK(rotary_dim >= 0 && rotary_dim <= hd && rotary_dim % 2 == 0,
            "{}: rotary_dim = {} must be even and in [0, hd = {}]", kOp, rotary_dim, hd);
  GDN_CHECK(rope_theta > 0 && std::isfinite(rope_theta), "{}: rope_theta must be positive, got {}",
            kOp, rope_theta);
  GDN_CHECK(eps > 0, "{}: eps must be positive, got {}", kOp, eps);
  for (auto [t, name] : {std::pair{&k, "k"},
                         {&v, "v"},
                         {&q_norm_w, "q_norm_w"},
                         {&k_norm_w, "k_norm_w"},
                         {&cu, "cu_seqlens"}})
    expect_device(*t, kOp, name, qg.device());
  if (cu.device() == Device::CPU) {
    const int32_t* c = cu.ptr<int32_t>();  // [N+1]
    GDN_CHECK(c[0] == 0, "{}: cu_seqlens[0] = {}, expected 0", kOp, c[0]);
    for (int64_t n = 1; n < cu.size(0); ++n)
      GDN_CHECK(c[n] >= c[n - 1],
                "{}: cu_seqlens[{}] = {} is less than cu_seqlens[{}] = {} (offsets must not "
                "decrease)",
                kOp, n, c[n], n - 1, c[n - 1]);
    const int64_t last = cu.size(0) - 1;
    GDN_CHECK(c[last] == T,
              "{}: cu_seqlens[{}] = {} (the last offset) must equal T = {} (tensor "
              "'qg' dim 0)",
              kOp, last, c[last], T);
  }
  return {T, Hq, Hkv, hd};
}

void expect_out(const Tensor& t, const char* name, DType dt, Device dev,
                std::initializer_list<int64_t> shape) {
  expect_tensor(t, kOp, name, dt, shape);
  expect_device(t, kOp, name, dev);
}

void validate_fwd(const GatedAttentionFwd& a) {
  const Shape s = validate_inputs(a.qg, a.k, a.v, a.q_norm_w, a.k_norm_w, a.cu_seqlens,
                                  a.rotary_dim, a.rope_theta, a.eps);
  const DType dt = a.qg.dtype(), st = gated_attention_stat_dtype(dt);
  const Device dev = a.qg.device();
  expect_out(a.o, "o", dt, dev, {s.T, s.Hq, s.hd});
  expect_out(a.q_hat, "q_hat", dt, dev, {s.T, s.Hq, s.hd});
  expect_out(a.k_hat, "k_hat", dt, dev, {s.T, s.Hkv, s.hd});
  expect_out(a.attn, "attn", dt, dev, {s.T, s.Hq, s.hd});
  expect_out(a.lse, "lse", st, dev, {s.T, s.Hq});
  expect_out(a.q_rstd, "q_rstd", st, dev, {s.T, s.Hq});
  expect_out(a.k_rstd, "k_rstd", st, dev, {s.T, s.Hkv});
}

void validate_bwd(const GatedAttentionBwd& a) {
  const Shape s = validate_inputs(a.qg, a.k, a.v, a.q_norm_w, a.k_norm_w, a.cu_seqlens,
                                  a.rotary_dim, a.rope_theta, a.eps);
  const DType dt = a.qg.dtype(), st = gated_attention_stat_dtype(dt);
  const Device dev = a.qg.device();
  expect_out(a.q_hat, "q_hat", dt, dev, {s.T, s.Hq, s.hd});
  expect_out(a.k_hat, "k_hat", dt, dev, {s.T, s.Hkv, s.hd});
  expect_out(a.attn, "attn", dt, dev, {s.T, s.Hq, s.hd});
  expect_out(a.lse, "lse", st, dev, {s.T, s.Hq});
  expect_out(a.q_rstd, "q_rstd", st, dev, {s.T, s.Hq});
  expect_out(a.k_rstd, "k_rstd", st, dev, {s.T, s.Hkv});
  expect_out(a.d_o, "d_o", dt, dev, {s.T, s.Hq, s.hd});
  expect_out(a.dqg, "dqg", dt, dev, {s.T, s.Hq, 2 * s.hd});
  expect_out(a.dk, "dk", dt, dev, {s.T, s.Hkv, s.hd});
  expect_out(a.dv, "dv", dt, dev, {s.T, s.Hkv, s.hd});
  expect_out(a.dq_norm_w, "dq_norm_w", st, dev, {s.hd});
  expect_out(a.dk_norm_w, "dk_norm_w", st, dev, {s.hd});
}

// The shape class: the head dim (the CUDA kernels are instantiated for head-dim classes 64, 128
// and 256), the rotary dim (RoPE by lane shuffles when half of it is a multiple of 8) and the GQA
// group (query heads per kv head).
ShapeClass class_of(const Tensor& qg, const Tensor& k, int64_t rot) {
  return ShapeClass(infer_backend(qg))
      .dim("hd", k.size(2))
      .dim("rot", rot)
      .dim("group", k.size(1) > 0 ? qg.size(1) / k.size(1) : 0);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// The forward's saved tensors and outputs for one backend's dtype.
struct Saved {
  OwnedTensor o, q_hat, k_hat, attn, lse, q_rstd, k_rstd;
  Saved(DType dt, int64_t T, int64_t Hq, int64_t Hkv, int64_t hd, Device dev) {
    const DType st = gated_attention_stat_dtype(dt);
    o = OwnedTensor::zeros(dt, {T, Hq, hd}, dev);
    q_hat = OwnedTensor::zeros(dt, {T, Hq, hd}, dev);
    k_hat = OwnedTensor::zeros(dt, {T, Hkv, hd}, dev);
    attn = OwnedTensor::zeros(dt, {T, Hq, hd}, dev);
    lse = OwnedTensor::zeros(st, {T, Hq}, dev);
    q_rstd = OwnedTensor::zeros(st, {T, Hq}, dev);
    k_rstd = OwnedTensor::zeros(st, {T, Hkv}, dev);
  }
};

// Probe. At a class (hd, rot, group): documents of 1, 0, 129 (two 128-query tiles, the second
// partial), 5 and 1 tokens, 2 kv heads of the class's group. Without one (the default class):
// documents of 1, 70 (more than one 64-row block, not a multiple of it), 5 and 1 tokens, grouped
// heads (Hq/Hkv = 2), partial RoPE; and full-width RoPE with Hq = Hkv. Gates spread over the
// sigmoid's range.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const GatedAttentionTable*>(impl.table);
  const auto& ref = *static_cast<const GatedAttentionTable*>(Registry::global().ref(kOp).table);
  struct Case {
    std::vector<int64_t> cu;
    int64_t Hq, Hkv, hd, rot;
  };
  std::vector<Case> cases;
  if (query.dims.contains("hd")) {
    const int64_t hd = query.dim("hd", 16), group = std::max<int64_t>(query.dim("group", 1), 1);
    cases = {{{0, 1, 1, 130, 135, 136}, 2 * group, 2, hd, query.dim("rot", 0)}};
  } else {
    cases = {{{0, 1, 71, 76, 77}, 4, 2, 16, 4}, {{0, 9, 12}, 2, 2, 8, 8}};
  }
  ProbeError err;
  uint64_t seed = 100;
  for (const Case& c : cases) {
    const int64_t T = c.cu.back(), Hq = c.Hq, Hkv = c.Hkv, hd = c.hd;
    const int64_t N1 = static_cast<int64_t>(c.cu.size());
    const DType dt = backend_dtype(impl.backend), st = gated_attention_stat_dtype(dt);
    const Device dev = backend_device(impl.backend);
    ProbeTensors p(impl.backend);
    auto qg = p.normal({T, Hq, 2 * hd}, seed + 1, 1.5);
    auto k = p.normal({T, Hkv, hd}, seed + 2, 1.0);
    auto v = p.normal({T, Hkv, hd}, seed + 3, 1.0);
    auto wq = p.normal({hd}, seed + 4, 0.3);
    auto wk = p.normal({hd}, seed + 5, 0.3);
    auto cu = p.ints(c.cu, {N1}, DType::I32);
    auto dout = p.normal({T, Hq, hd}, seed + 6, 1.0);
    seed += 10;
    Saved r(DType::F64, T, Hq, Hkv, hd, Device::CPU), x(dt, T, Hq, Hkv, hd, dev);
    const double theta = 1e4;  // a small base so that the short probe documents rotate visibly
    ref.forward({qg.ref, k.ref, v.ref, wq.ref, wk.ref, cu.ref, r.o, r.q_hat, r.k_hat, r.attn, r.lse,
                 r.q_rstd, r.k_rstd, c.rot, theta, 1e-6});
    cand.forward({qg.cand, k.cand, v.cand, wq.cand, wk.cand, cu.cand, x.o, x.q_hat, x.k_hat, x.attn,
                  x.lse, x.q_rstd, x.k_rstd, c.rot, theta, 1e-6});
    for (auto [got, want] : {std::pair{&x.o, &r.o},
                             {&x.q_hat, &r.q_hat},
                             {&x.k_hat, &r.k_hat},
                             {&x.attn, &r.attn},
                             {&x.lse, &r.lse},
                             {&x.q_rstd, &r.q_rstd},
                             {&x.k_rstd, &r.k_rstd}})
      err.fwd = std::max(err.fwd, rel_l2_error(*got, *want));
    auto rdqg = OwnedTensor::zeros(DType::F64, {T, Hq, 2 * hd});
    auto rdk = OwnedTensor::zeros(DType::F64, {T, Hkv, hd});
    auto rdv = OwnedTensor::zeros(DType::F64, {T, Hkv, hd});
    auto rdwq = OwnedTensor::zeros(DType::F64, {hd}), rdwk = OwnedTensor::zeros(DType::F64, {hd});
    auto xdqg = OwnedTensor::zeros(dt, {T, Hq, 2 * hd}, dev);
    auto xdk = OwnedTensor::zeros(dt, {T, Hkv, hd}, dev);
    auto xdv = OwnedTensor::zeros(dt, {T, Hkv, hd}, dev);
    auto xdwq = OwnedTensor::zeros(st, {hd}, dev), xdwk = OwnedTensor::zeros(st, {hd}, dev);
    ref.backward({qg.ref,  k.ref,  v.ref, wq.ref,   wk.ref,   cu.ref,   r.q_hat,
                  r.k_hat, r.attn, r.lse, r.q_rstd, r.k_rstd, dout.ref, rdqg,
                  rdk,     rdv,    rdwq,  rdwk,     c.rot,    theta,    1e-6});
    cand.backward({qg.cand, k.cand, v.cand, wq.cand,  wk.cand,  cu.cand,   x.q_hat,
                   x.k_hat, x.attn, x.lse,  x.q_rstd, x.k_rstd, dout.cand, xdqg,
                   xdk,     xdv,    xdwq,   xdwk,     c.rot,    theta,     1e-6});
    for (auto [got, want] :
         {std::pair{&xdqg, &rdqg}, {&xdk, &rdk}, {&xdv, &rdv}, {&xdwq, &rdwq}, {&xdwk, &rdwk}})
      err.bwd = std::max(err.bwd, rel_l2_error(*got, *want));
  }
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {2e-6, 5e-6};
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const GatedAttentionTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), st = gated_attention_stat_dtype(dt);
  const Device dev = backend_device(impl.backend);
  Tensor qg = io.input("qg", dt, dev);
  Tensor k = io.input("k", dt, dev);
  Tensor v = io.input("v", dt, dev);
  Tensor wq = io.input("q_norm_w", dt, dev);
  Tensor wk = io.input("k_norm_w", dt, dev);
  GDN_CHECK(qg.ndim() == 3 && k.ndim() == 3,
            "{}: tensors 'qg' and 'k' must be 3-D ([T, Hq, 2*hd] and [T, Hkv, hd]), got {} and {}",
            kOp, qg.shape_str(), k.shape_str());
  const int64_t T = qg.size(0), Hq = qg.size(1), Hkv = k.size(1), hd = k.size(2);
  // Without cu_seqlens the whole file is one document.
  OwnedTensor whole;
  Tensor cu;
  if (io.has_input("cu_seqlens")) {
    cu = io.input("cu_seqlens", DType::I32, dev);
  } else {
    const std::vector<int64_t> c{0, T};
    whole = convert(Tensor(const_cast<int64_t*>(c.data()), DType::I64, {2}), DType::I32, dev);
    cu = whole;
  }
  const int64_t rot = gated_attention_rotary_dim(hd, io.attr("partial_rotary_factor", 0.25));
  const double theta = io.attr("rope_theta", 1e7), eps = io.attr("eps", 1e-6);
  Tensor o = io.output("o", dt, dev, {T, Hq, hd});
  Tensor q_hat = io.output("q_hat", dt, dev, {T, Hq, hd});
  Tensor k_hat = io.output("k_hat", dt, dev, {T, Hkv, hd});
  Tensor attn = io.output("attn", dt, dev, {T, Hq, hd});
  Tensor lse = io.output("lse", st, dev, {T, Hq});
  Tensor q_rstd = io.output("q_rstd", st, dev, {T, Hq});
  Tensor k_rstd = io.output("k_rstd", st, dev, {T, Hkv});
  GatedAttentionFwd f{qg,    k,    v,   wq,     wk,     cu,  o,     q_hat,
                      k_hat, attn, lse, q_rstd, k_rstd, rot, theta, eps};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  Tensor d_o = io.input("do", dt, dev);
  Tensor dqg = io.output("dqg", dt, dev, {T, Hq, 2 * hd});
  Tensor dk = io.output("dk", dt, dev, {T, Hkv, hd});
  Tensor dv = io.output("dv", dt, dev, {T, Hkv, hd});
  Tensor dwq = io.output("dq_norm_w", st, dev, {hd});
  Tensor dwk = io.output("dk_norm_w", st, dev, {hd});
  GatedAttentionBwd b{qg,     k,   v,   wq, wk, cu,  q_hat, k_hat, attn,  lse, q_rstd,
                      k_rstd, d_o, dqg, dk, dv, dwq, dwk,   rot,   theta, eps};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

int64_t gated_attention_rotary_dim(int64_t hd, double partial_rotary_factor) {
  GDN_CHECK(partial_rotary_factor >= 0 && partial_rotary_factor <= 1,
            "{}: partial_rotary_factor = {} must be in [0, 1]", kOp, partial_rotary_factor);
  return static_cast<int64_t>(static_cast<double>(hd) * partial_rotary_factor);
}

void gated_attention_forward(const GatedAttentionFwd& a) {
  validate_fwd(a);
  dispatch().table<GatedAttentionTable>(class_of(a.qg, a.k, a.rotary_dim)).forward(a);
}

void gated_attention_backward(const GatedAttentionBwd& a) {
  validate_bwd(a);
  dispatch().table<GatedAttentionTable>(class_of(a.qg, a.k, a.rotary_dim)).backward(a);
}

GDN_REGISTER(gated_attention_op) {
  OpDesc d;
  d.name = kOp;
  d.summary =
      "Qwen3.5 gated attention core: q/k zero-centred RMSNorm, partial RoPE, varlen causal GQA "
      "softmax attention, sigmoid output gate (no cu_seqlens: one document)";
  d.fwd_inputs = {"qg", "k", "v", "q_norm_w", "k_norm_w", "cu_seqlens"};
  d.fwd_outputs = {"o", "q_hat", "k_hat", "attn", "lse", "q_rstd", "k_rstd"};
  d.bwd_inputs = {"do"};
  d.bwd_outputs = {"dqg", "dk", "dv", "dq_norm_w", "dk_norm_w"};
  d.attrs = {"partial_rotary_factor=0.25", "rope_theta=1e7", "eps=1e-6"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
