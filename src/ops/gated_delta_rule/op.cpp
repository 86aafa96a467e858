// Gated delta rule: validation, dispatch and the op's registration (probe, tolerance, file runner).
#include "ops/gated_delta_rule/op.h"

#include <cmath>
#include <new>
#include <optional>
#include <vector>

#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#if GDN_WITH_CUDA
#include "ops/gated_delta_rule/cuda.h"
#endif

namespace gdn::ops {

namespace {
constexpr const char* kOp = "gated_delta_rule";

struct Dims {
  int64_t T, Hk, Hv, dk, dv, N;
};

// Everything forward and backward share: the inputs. Returns the sizes.
Dims validate_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& cu, const Tensor& h0, double scale) {
  expect_shape(q, kOp, "q", {-1, -1, -1});
  expect_contiguous(q, kOp, "q");
  const DType act = q.dtype();
  GDN_CHECK(act == DType::F64 || act == DType::F32 || act == DType::BF16,
            "{}: tensor 'q' has dtype {}, expected F64 (ref), F32 (cpu) or BF16 (cuda)", kOp,
            dtype_name(act));
  const DType st = gdr_state_dtype(act);
  const Device dev = q.device();
  // The backend follows the device (infer_backend): device tensors run on cuda, which takes bf16.
  GDN_CHECK(dev != Device::CUDA || act == DType::BF16,
            "{}: tensor 'q' has dtype {}, expected BF16 on cuda", kOp, dtype_name(act));
  GDN_CHECK(dev == Device::CUDA || act != DType::BF16,
            "{}: tensor 'q' has dtype BF16 on the host, expected F64 (ref) or F32 (cpu)", kOp);
  Dims d{q.size(0), q.size(1), 0, q.size(2), 0, 0};
  expect_tensor(k, kOp, "k", act, {d.T, d.Hk, d.dk});
  expect_tensor(v, kOp, "v", act, {d.T, -1, -1});
  d.Hv = v.size(1);
  d.dv = v.size(2);
  GDN_CHECK(d.Hk >= 1 && d.Hv >= 1 && d.Hv % d.Hk == 0,
            "{}: value heads Hv = {} (tensor 'v') must be a positive multiple of key heads Hk = {} "
            "(tensor 'q')",
            kOp, d.Hv, d.Hk);
  GDN_CHECK(d.dk >= 1 && d.dk <= kGdrMaxHeadDim,
            "{}: key head dim dk = {} (tensor 'q') must be in [1, {}]", kOp, d.dk, kGdrMaxHeadDim);
  GDN_CHECK(d.dv >= 1 && d.dv <= kGdrMaxHeadDim,
            "{}: value head dim dv = {} (tensor 'v') must be in [1, {}]", kOp, d.dv,
            kGdrMaxHeadDim);
  expect_tensor(g, kOp, "g", st, {d.T, d.Hv});
  expect_tensor(beta, kOp, "beta", st, {d.T, d.Hv});
  expect_tensor(cu, kOp, "cu_seqlens", DType::I32, {-1});
  GDN_CHECK(cu.size(0) >= 2, "{}: tensor 'cu_seqlens' has {} entries, expected N+1 >= 2", kOp,
            cu.size(0));
  d.N = cu.size(0) - 1;
  if (h0.defined()) expect_tensor(h0, kOp, "h0", st, {d.N, d.Hv, d.dk, d.dv});
  GDN_CHECK(std::isfinite(scale) && scale >= 0,
            "{}: scale must be finite and >= 0 (0 selects dk^-1/2), got {}", kOp, scale);
  const std::pair<const Tensor*, const char*> all[] = {
      {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}, {&cu, "cu_seqlens"}, {&h0, "h0"}};
  for (const auto& [t, name] : all)
    if (t->defined()) expect_device(*t, kOp, name, dev);

  // Values. Only host tensors are read here: a device tensor would cost a synchronisation, and the
  // cuda implementation checks what it needs on the device.
  if (cu.device() == Device::CPU) {
    const int32_t* c = cu.ptr<int32_t>();  // [N+1]
    GDN_CHECK(c[0] == 0, "{}: cu_seqlens[0] = {}, expected 0", kOp, c[0]);
    for (int64_t i = 1; i <= d.N; ++i)
      GDN_CHECK(c[i] >= c[i - 1],
                "{}: cu_seqlens[{}] = {} is less than cu_seqlens[{}] = {} (document boundaries "
                "must not decrease)",
                kOp, i, c[i], i - 1, c[i - 1]);
    GDN_CHECK(c[d.N] == d.T, "{}: cu_seqlens[{}] = {}, expected T = {} (the tokens of 'q')", kOp,
              d.N, c[d.N], d.T);
  }
  if (g.device() == Device::CPU) {
    std::vector<double> gv = to_f64_vector(g), bv = to_f64_vector(beta);
    for (size_t i = 0; i < gv.size(); ++i) {
      const int64_t t = static_cast<int64_t>(i) / d.Hv, h = static_cast<int64_t>(i) % d.Hv;
      GDN_CHECK_FINITE(std::isfinite(gv[i]),
                       "{}: tensor 'g' has a non-finite value {} at [t={}, h={}]", kOp, gv[i], t,
                       h);
      GDN_CHECK(gv[i] <= 0, "{}: tensor 'g' must be <= 0 (a log-decay), got {} at [t={}, h={}]",
                kOp, gv[i], t, h);
      GDN_CHECK_FINITE(std::isfinite(bv[i]),
                       "{}: tensor 'beta' has a non-finite value {} at [t={}, h={}]", kOp, bv[i], t,
                       h);
    }
  }
  return d;
}

// `saved` (optional, op.h): validated on every backend, also where the implementation ignores it,
// so that a caller's plan is checked by the cpu tests before it reaches a GPU.
void validate_saved(const Tensor& saved, const Dims& d, DType act, Device dev) {
  if (!saved.defined()) return;
  const int64_t want = gdr_saved_numel(d.T, d.N, d.Hv, d.dk, d.dv);
  GDN_CHECK(saved.ndim() == 1 && saved.size(0) == want,
            "{}: tensor 'saved' has shape {}, expected [{}] (gdr_saved_numel(T={}, N={}, Hv={}, "
            "dk={}, dv={}))",
            kOp, saved.shape_str(), want, d.T, d.N, d.Hv, d.dk, d.dv);
  GDN_CHECK(saved.dtype() == act,
            "{}: tensor 'saved' has dtype {}, expected {} (the activation dtype of 'q')", kOp,
            dtype_name(saved.dtype()), dtype_name(act));
  expect_contiguous(saved, kOp, "saved");
  expect_device(saved, kOp, "saved", dev);
}

void validate_fwd(const GatedDeltaRuleFwd& a) {
  const Dims d = validate_inputs(a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.h0, a.scale);
  const DType act = a.q.dtype(), st = gdr_state_dtype(act);
  expect_tensor(a.o, kOp, "o", act, {d.T, d.Hv, d.dv});
  expect_device(a.o, kOp, "o", a.q.device());
  if (a.hT.defined()) {
    expect_tensor(a.hT, kOp, "hT", st, {d.N, d.Hv, d.dk, d.dv});
    expect_device(a.hT, kOp, "hT", a.q.device());
  }
  validate_saved(a.saved, d, act, a.q.device());
}

void validate_bwd(const GatedDeltaRuleBwd& a) {
  const Dims d = validate_inputs(a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.h0, a.scale);
  const DType act = a.q.dtype(), st = gdr_state_dtype(act);
  const Device dev = a.q.device();
  expect_tensor(a.dout, kOp, "do", act, {d.T, d.Hv, d.dv});
  expect_tensor(a.dq, kOp, "dq", act, {d.T, d.Hk, d.dk});
  expect_tensor(a.dk, kOp, "dk", act, {d.T, d.Hk, d.dk});
  expect_tensor(a.dv, kOp, "dv", act, {d.T, d.Hv, d.dv});
  expect_tensor(a.dg, kOp, "dg", st, {d.T, d.Hv});
  expect_tensor(a.dbeta, kOp, "dbeta", st, {d.T, d.Hv});
  if (a.dhT.defined()) expect_tensor(a.dhT, kOp, "dhT", st, {d.N, d.Hv, d.dk, d.dv});
  if (a.dh0.defined()) expect_tensor(a.dh0, kOp, "dh0", st, {d.N, d.Hv, d.dk, d.dv});
  const std::pair<const Tensor*, const char*> all[] = {
      {&a.dout, "do"}, {&a.dhT, "dhT"}, {&a.dq, "dq"},       {&a.dk, "dk"},
      {&a.dv, "dv"},   {&a.dg, "dg"},   {&a.dbeta, "dbeta"}, {&a.dh0, "dh0"}};
  for (const auto& [t, name] : all)
    if (t->defined()) expect_device(*t, kOp, name, dev);
  validate_saved(a.saved, d, act, dev);
  if (dev == Device::CPU && a.dhT.defined())
    for (double x : to_f64_vector(a.dhT))
      GDN_CHECK_FINITE(std::isfinite(x), "{}: tensor 'dhT' has a non-finite value {}", kOp, x);
}

// The shape class: the head dims (the CUDA fast route takes padded dk, dv <= 128 and has constant-
// shape kernels at dk = dv = 128, Qwen3.5's), whether every row is whole 16-byte vectors, the q/k
// l2norm, whether any state tensor (h0, hT / dhT, dh0) is given and whether `saved` is. The
// document structure (how many, how long) changes the schedule inside one class; the probe covers
// it with one long document and many short ones.
ShapeClass class_of(const Tensor& q, const Tensor& v, bool vec, bool l2, bool states, bool saved) {
  return ShapeClass(infer_backend(q))
      .dim("dk", q.size(2))
      .dim("dv", v.size(2))
      .flag("vec", vec && q.size(2) % 8 == 0 && v.size(2) % 8 == 0)
      .flag("l2", l2)
      .flag("states", states)
      .flag("saved", saved);
}
ShapeClass class_of(const GatedDeltaRuleFwd& a) {
  return class_of(a.q, a.v, all_aligned16(a.q, a.k, a.v, a.h0, a.o, a.hT), a.use_qk_l2norm,
                  a.h0.defined() || a.hT.defined(), a.saved.defined());
}
ShapeClass class_of(const GatedDeltaRuleBwd& a) {
  return class_of(
      a.q, a.v, all_aligned16(a.q, a.k, a.v, a.h0, a.dout, a.dhT, a.dq, a.dk, a.dv, a.dh0),
      a.use_qk_l2norm, a.h0.defined() || a.dhT.defined() || a.dh0.defined(), a.saved.defined());
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// One probe case: documents `cu`, Hk key heads and Hv value heads at the class's head dims and
// options, forward and every gradient against ref.
void probe_case(const GatedDeltaRuleTable& cand, const GatedDeltaRuleTable& ref, Backend backend,
                const std::vector<int64_t>& cu_v, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                bool l2, bool states, bool with_saved, uint64_t seed, ProbeError& err) {
  const int64_t N = static_cast<int64_t>(cu_v.size()) - 1, T = cu_v.back();
  const DType st = gdr_state_dtype(backend_dtype(backend));
  ProbeTensors p(backend);
  // Without the in-kernel l2norm, q and k come in at unit norm (as the model's l2norm op gives
  // them), so that the delta rule stays stable (beta |k|^2 <= 1).
  const double qk_std = l2 ? 1.0 : 1.0 / std::sqrt(static_cast<double>(dk));
  auto q = p.normal({T, Hk, dk}, seed + 1, qk_std);
  auto k = p.normal({T, Hk, dk}, seed + 2, qk_std);
  auto v = p.normal({T, Hv, dv}, seed + 3, 1.0);
  auto g = p.uniform({T, Hv}, seed + 4, -3.0, 0.0, st);
  auto beta = p.uniform({T, Hv}, seed + 5, 0.0, 1.0, st);
  auto cu = p.ints(cu_v, {N + 1}, DType::I32);
  auto dout = p.normal({T, Hv, dv}, seed + 7, 1.0);
  auto o = p.zeros({T, Hv, dv});
  auto dq = p.zeros({T, Hk, dk});
  auto dk_ = p.zeros({T, Hk, dk});
  auto dv_ = p.zeros({T, Hv, dv});
  auto dg = p.zeros({T, Hv}, st);
  auto db = p.zeros({T, Hv}, st);
  std::optional<ProbeTensors::Pair> h0, hT, dhT, dh0;
  if (states) {
    h0 = p.normal({N, Hv, dk, dv}, seed + 6, 0.5, st);
    dhT = p.normal({N, Hv, dk, dv}, seed + 8, 0.5, st);
    hT = p.zeros({N, Hv, dk, dv}, st);
    dh0 = p.zeros({N, Hv, dk, dv}, st);
  }
  // `saved` only on the candidate (ref and cpu ignore it): its forward writes it, its backward
  // reads it instead of recomputing (op.h).
  OwnedTensor saved;
  if (with_saved)
    saved = OwnedTensor::zeros(backend_dtype(backend), {gdr_saved_numel(T, N, Hv, dk, dv)},
                               backend_device(backend));
  auto run_one = [&](const GatedDeltaRuleTable& t, bool is_ref) {
    auto pick = [is_ref](const ProbeTensors::Pair& x) { return is_ref ? x.ref : x.cand; };
    auto opt = [&](const std::optional<ProbeTensors::Pair>& x) { return x ? pick(*x) : Tensor(); };
    const Tensor sv = is_ref ? Tensor() : saved.view();
    t.forward({pick(q), pick(k), pick(v), pick(g), pick(beta), pick(cu), opt(h0), pick(o), opt(hT),
               0.0, l2, sv});
    t.backward({pick(q), pick(k), pick(v), pick(g), pick(beta), pick(cu), opt(h0), pick(dout),
                opt(dhT), pick(dq), pick(dk_), pick(dv_), pick(dg), pick(db), opt(dh0), 0.0, l2,
                sv});
  };
  run_one(ref, true);
  run_one(cand, false);
  err.fwd = std::max(err.fwd, rel_l2_error(o.cand, o.ref));
  if (states) err.fwd = std::max(err.fwd, rel_l2_error(hT->cand, hT->ref));
  for (const auto* x : {&dq, &dk_, &dv_, &dg, &db})
    err.bwd = std::max(err.bwd, rel_l2_error(x->cand, x->ref));
  if (states) err.bwd = std::max(err.bwd, rel_l2_error(dh0->cand, dh0->ref));
}

// Probe, at the class's head dims and options (dk 32, dv 24, l2norm, states, no saved when the
// query has none), grouped heads r = 2, two cases that take the CUDA fast route's two schedules:
// one document of 150 tokens (2 full chunks and a partial one; few blocks, so the dk-split state
// pass with the trailing output), and 12 documents of 1, 0, 70 (a full chunk and a partial one),
// 13, ... tokens (more blocks than SMs at dv = 128: the plain state pass, then the output).
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const GatedDeltaRuleTable*>(impl.table);
  const auto& ref = *static_cast<const GatedDeltaRuleTable*>(Registry::global().ref(kOp).table);
  const int64_t dk = query.dim("dk", 32), dv = query.dim("dv", 24);
  const bool l2 = query.dim("l2", 1) != 0, states = query.dim("states", 1) != 0;
  const bool saved = query.dim("saved", 0) != 0;
  ProbeError err;
  probe_case(cand, ref, impl.backend, {0, 150}, 2, 4, dk, dv, l2, states, saved, 20, err);
  probe_case(cand, ref, impl.backend, {0, 1, 1, 71, 84, 86, 150, 151, 160, 224, 230, 231, 260}, 2,
             4, dk, dv, l2, states, saved, 40, err);
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance("gated_delta_rule");
    return kBf16;
  }
  return {1e-6, 2e-6};  // measured 1.4e-7 fwd, 2.4e-7 bwd (fp32 cpu.chunk64)
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const GatedDeltaRuleTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend), st = gdr_state_dtype(dt);
  const Device dev = backend_device(impl.backend);
  Tensor q = io.input("q", dt, dev), k = io.input("k", dt, dev), v = io.input("v", dt, dev);
  Tensor g = io.input("g", st, dev), beta = io.input("beta", st, dev);
  GDN_CHECK(q.ndim() == 3 && v.ndim() == 3,
            "{}: tensors 'q' [T, Hk, dk] and 'v' [T, Hv, dv] must be 3-D, got {} and {}", kOp,
            q.shape_str(), v.shape_str());
  const int64_t T = q.size(0), Hk = q.size(1), dk = q.size(2), Hv = v.size(1), dv = v.size(2);
  // Without cu_seqlens the file holds one document.
  OwnedTensor cu_own;
  Tensor cu;
  if (io.has_input("cu_seqlens")) {
    cu = io.input("cu_seqlens", DType::I32, dev);
  } else {
    const std::vector<int64_t> one{0, T};
    cu_own = convert(Tensor(const_cast<int64_t*>(one.data()), DType::I64, {2}), DType::I32, dev);
    cu = cu_own.view();
  }
  const int64_t N = cu.numel() - 1;
  Tensor h0 = io.has_input("h0") ? io.input("h0", st, dev) : Tensor();
  const double scale = io.attr("scale", 0.0);
  const bool l2 = io.attr("use_qk_l2norm", 0) != 0;
  GatedDeltaRuleFwd f{q,
                      k,
                      v,
                      g,
                      beta,
                      cu,
                      h0,
                      io.output("o", dt, dev, {T, Hv, dv}),
                      io.output("hT", st, dev, {N, Hv, dk, dv}),
                      scale,
                      l2};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  Tensor dhT = io.has_input("dhT") ? io.input("dhT", st, dev) : Tensor();
  GatedDeltaRuleBwd b{q,
                      k,
                      v,
                      g,
                      beta,
                      cu,
                      h0,
                      io.input("do", dt, dev),
                      dhT,
                      io.output("dq", dt, dev, {T, Hk, dk}),
                      io.output("dk", dt, dev, {T, Hk, dk}),
                      io.output("dv", dt, dev, {T, Hv, dv}),
                      io.output("dg", st, dev, {T, Hv}),
                      io.output("dbeta", st, dev, {T, Hv}),
                      io.output("dh0", st, dev, {N, Hv, dk, dv}),
                      scale,
                      l2};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

double gdr_effective_scale(double scale, int64_t dk) {
  return scale == 0 ? 1.0 / std::sqrt(static_cast<double>(dk)) : scale;
}

int64_t gdr_saved_chunks(int64_t T, int64_t N) {
  GDN_CHECK(T >= 0 && N >= 0, "{}: gdr_saved_chunks needs T >= 0 and N >= 0, got T = {}, N = {}",
            kOp, T, N);
  return (T + (kGdrChunk - 1) * N) / kGdrChunk;
}

int64_t gdr_saved_numel(int64_t T, int64_t N, int64_t Hv, int64_t dk, int64_t dv) {
  GDN_CHECK(Hv >= 1 && dk >= 1 && dv >= 1,
            "{}: gdr_saved_numel needs Hv, dk, dv >= 1, got Hv = {}, dk = {}, dv = {}", kOp, Hv, dk,
            dv);
  constexpr int64_t C = kGdrChunk;
  // Per chunk slot and value head: Ht (dv dk), Vt (dv C), W (C dk), T (C C), gamma (C fp32 values
  // in 2 C elements of the bf16 tensor): op.h.
  return gdr_saved_chunks(T, N) * Hv * (dv * dk + dv * C + C * dk + C * C + 2 * C);
}

void gated_delta_rule_forward(const GatedDeltaRuleFwd& a) {
  validate_fwd(a);
  dispatch().table<GatedDeltaRuleTable>(class_of(a)).forward(a);
}

void gated_delta_rule_backward(const GatedDeltaRuleBwd& a) {
  validate_bwd(a);
  dispatch().table<GatedDeltaRuleTable>(class_of(a)).backward(a);
}

size_t gated_delta_rule_workspace_bytes(int64_t T, int64_t N, int64_t Hk, int64_t Hv, int64_t dk,
                                        int64_t dv, bool use_qk_l2norm, bool backward_saved) {
  GDN_CHECK(T >= 0 && N >= 0 && Hk >= 1 && Hv >= 1 && dk >= 1 && dv >= 1,
            "{}: gated_delta_rule_workspace_bytes needs T, N >= 0 and Hk, Hv, dk, dv >= 1, got "
            "T = {}, N = {}, Hk = {}, Hv = {}, dk = {}, dv = {}",
            kOp, T, N, Hk, Hv, dk, dv);
#if GDN_WITH_CUDA
  return gated_delta_rule_cuda_workspace_bytes(T, N, Hk, Hv, dk, dv, use_qk_l2norm, backward_saved);
#else
  (void)use_qk_l2norm, (void)backward_saved;
  return 0;
#endif
}

int64_t gdr_batch_index_numel(Device device, int64_t T, int64_t N) {
#if GDN_WITH_CUDA
  if (device == Device::CUDA) return gdr_chunk_index_numel(T, N);
#endif
  (void)T, (void)N;
  return 0;
}

GdrBatchIndex::GdrBatchIndex(const Tensor& cu_seqlens, int64_t T, const Tensor& index) {
#if GDN_WITH_CUDA
  static_assert(sizeof(GdrChunkIndexScope) <= kScopeBytes &&
                alignof(GdrChunkIndexScope) <= alignof(std::max_align_t));
  if (cu_seqlens.device() == Device::CUDA)
    scope_ = new (storage_) GdrChunkIndexScope(cu_seqlens, T, index);
#endif
  (void)cu_seqlens, (void)T, (void)index;
}

GdrBatchIndex::~GdrBatchIndex() {
#if GDN_WITH_CUDA
  if (scope_ != nullptr) scope_->~GdrChunkIndexScope();
#endif
}

GDN_REGISTER(gated_delta_rule_op) {
  OpDesc d;
  d.name = kOp;
  d.summary =
      "Gated delta rule (GDN core): S = e^g S; S += k (beta (v - S^T k))^T; o = S^T (scale q); "
      "varlen, grouped heads, initial/final state, optional q/k l2norm";
  d.fwd_inputs = {"q", "k", "v", "g", "beta", "cu_seqlens (optional)", "h0 (optional)"};
  d.fwd_outputs = {"o", "hT"};
  d.bwd_inputs = {
      "q", "k", "v", "g", "beta", "cu_seqlens (optional)", "h0 (optional)", "do", "dhT (optional)"};
  d.bwd_outputs = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
  d.attrs = {"scale=0 (dk^-1/2)", "use_qk_l2norm=0"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
