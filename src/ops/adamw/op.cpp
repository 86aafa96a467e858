// AdamW: validation, dispatch, clip scale, and the op's registration (probe, tolerance, file
// runner).
#include "ops/adamw/op.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "gdn/core/rng.h"
#include "gdn/core/split_f32.h"

namespace gdn::ops {

namespace {
constexpr const char* kOp = "adamw";

std::string label(const AdamWParam& e, size_t i, const char* field) {
  return e.name.empty() ? fmt::format("params[{}].{}", i, field)
                        : fmt::format("{}.{}", e.name, field);
}

// t must be defined, contiguous, on p's device, with p's shape and the given dtype.
void expect_like(const Tensor& t, const Tensor& p, const std::string& name, DType dtype) {
  expect_defined(t, kOp, name);
  bool same = t.ndim() == p.ndim();
  for (int d = 0; same && d < p.ndim(); ++d) same = t.size(d) == p.size(d);
  GDN_CHECK(same, "{}: tensor '{}' has shape {}, expected {}", kOp, name, t.shape_str(),
            p.shape_str());
  expect_dtype(t, kOp, name, dtype);
  expect_contiguous(t, kOp, name);
  expect_device(t, kOp, name, p.device());
}

void validate_hyper(const AdamWHyper& h) {
  GDN_CHECK(std::isfinite(h.lr) && h.lr >= 0, "{}: lr must be finite and >= 0, got {}", kOp, h.lr);
  GDN_CHECK(h.beta1 >= 0 && h.beta1 < 1, "{}: beta1 must be in [0, 1), got {}", kOp, h.beta1);
  GDN_CHECK(h.beta2 >= 0 && h.beta2 < 1, "{}: beta2 must be in [0, 1), got {}", kOp, h.beta2);
  GDN_CHECK(std::isfinite(h.eps) && h.eps > 0, "{}: eps must be finite and > 0, got {}", kOp,
            h.eps);
  GDN_CHECK(std::isfinite(h.weight_decay) && h.weight_decay >= 0,
            "{}: weight_decay must be finite and >= 0, got {}", kOp, h.weight_decay);
  GDN_CHECK(h.step >= 1, "{}: step must be >= 1 (1-based count of updates), got {}", kOp, h.step);
  GDN_CHECK(std::isfinite(h.grad_scale) && h.grad_scale >= 0,
            "{}: grad_scale must be finite and >= 0, got {}", kOp, h.grad_scale);
}

void validate_clip(const AdamWClip& h, Device device) {
  GDN_CHECK(std::isfinite(h.max_norm), "{}: max_norm must be finite, got {}", kOp, h.max_norm);
  if (!h.sumsq.defined()) {
    GDN_CHECK(!h.losses.defined(), "{}: clip losses given without clip sumsq", kOp);
    return;
  }
  expect_tensor(h.sumsq, kOp, "clip_sumsq", DType::F64, {1});
  expect_device(h.sumsq, kOp, "clip_sumsq", device);
  if (h.losses.defined()) {
    const DType dt = h.losses.dtype();
    GDN_CHECK(dt == DType::F32 || dt == DType::F64,
              "{}: tensor 'clip_losses' has dtype {}, expected F32 or F64", kOp, dtype_name(dt));
    GDN_CHECK(h.losses.ndim() == 1, "{}: tensor 'clip_losses' has shape {}, expected [n]", kOp,
              h.losses.shape_str());
    expect_contiguous(h.losses, kOp, "clip_losses");
    expect_device(h.losses, kOp, "clip_losses", device);
  }
}

void validate_step(std::span<const AdamWParam> params, const AdamWHyper& h,
                   const AdamWClip& clip = {}) {
  validate_hyper(h);
  if (params.empty()) return;
  expect_defined(params[0].p, kOp, label(params[0], 0, "p"));
  validate_clip(clip, params[0].p.device());
  // The state dtype of the call: F32 (F64 on ref); an I16 p is a split master over F32 state.
  const DType dt = params[0].p.dtype() == DType::I16 ? DType::F32 : params[0].p.dtype();
  for (size_t i = 0; i < params.size(); ++i) {
    const AdamWParam& e = params[i];
    const std::string pn = label(e, i, "p");
    expect_defined(e.p, kOp, pn);
    const bool split = e.p.dtype() == DType::I16;
    GDN_CHECK(
        e.p.dtype() == dt || (split && dt == DType::F32),
        "{}: tensor '{}' has dtype {}, expected {}: master weights are fp32 (F64 on ref), or I16 "
        "for the low half of a split fp32 master (cpu and cuda)",
        kOp, pn, dtype_name(e.p.dtype()), dtype_name(dt));
    GDN_CHECK(dt == DType::F32 || dt == DType::F64,
              "{}: tensor '{}' has dtype {}, expected F32 (F64 on ref): master weights are fp32",
              kOp, pn, dtype_name(dt));
    expect_contiguous(e.p, kOp, pn);
    expect_device(e.p, kOp, pn, params[0].p.device());
    expect_like(e.g, e.p, label(e, i, "g"), dt);
    expect_like(e.m, e.p, label(e, i, "m"), dt);
    expect_like(e.v, e.p, label(e, i, "v"), dt);
    GDN_CHECK(!split || e.p_bf16.defined(),
              "{}: tensor '{}' is the I16 low half of a split master, but '{}' (its high half) is "
              "not given",
              kOp, pn, label(e, i, "p_bf16"));
    if (e.p_bf16.defined()) expect_like(e.p_bf16, e.p, label(e, i, "p_bf16"), DType::BF16);
    // Each element is read and written once, so p, g, m, v must be four distinct buffers.
    if (e.p.numel() > 0) {
      const void* ptrs[] = {e.p.data(), e.g.data(), e.m.data(), e.v.data()};
      const char* names[] = {"p", "g", "m", "v"};
      for (int a = 0; a < 4; ++a)
        for (int b = a + 1; b < 4; ++b)
          GDN_CHECK(ptrs[a] != ptrs[b], "{}: tensors '{}' and '{}' share memory", kOp,
                    label(e, i, names[a]), label(e, i, names[b]));
    }
  }
}

void validate_grads(std::span<const Tensor> grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const std::string name = fmt::format("grads[{}]", i);
    expect_defined(grads[i], kOp, name);
    expect_dtype(grads[i], kOp, name, adamw_state_dtype(grads[0].dtype()));
    expect_contiguous(grads[i], kOp, name);
    expect_device(grads[i], kOp, name, grads[0].device());
  }
}

void validate_copies(std::span<const Bf16Copy> copies) {
  for (size_t i = 0; i < copies.size(); ++i) {
    const std::string mn = fmt::format("copies[{}].master", i);
    expect_defined(copies[i].master, kOp, mn);
    expect_dtype(copies[i].master, kOp, mn, adamw_state_dtype(copies[0].master.dtype()));
    expect_contiguous(copies[i].master, kOp, mn);
    expect_device(copies[i].master, kOp, mn, copies[0].master.device());
    expect_like(copies[i].copy, copies[i].master, fmt::format("copies[{}].copy", i), DType::BF16);
    if (copies[i].lo.defined()) {
      expect_dtype(copies[i].master, kOp, mn, DType::F32);
      expect_like(copies[i].lo, copies[i].master, fmt::format("copies[{}].lo", i), DType::I16);
    }
  }
}

// The shape class of a step: whether any master is split (I16 low half + bf16 high half: the
// kernels' split instantiations) and whether the clip decision is read from the device (clip.sumsq:
// the CUDA clip kernel and the step kernel's early return). Per-tensor branches (16-byte groups,
// several work units, more tensors than one launch holds) are covered by every class's probe.
ShapeClass class_of(const AdamWStep& s) {
  bool split = false;
  for (const AdamWParam& e : s.params) split = split || e.p.dtype() == DType::I16;
  return ShapeClass(infer_backend(s.params[0].p))
      .flag("split", split)
      .flag("clip", s.clip.sumsq.defined());
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}
// grad_global_norm, grad_sumsq_into and refresh_bf16: the default class (its probe runs them all,
// and every class's probe runs them too).
const AdamWTable& table_for(const Tensor& t) {
  return dispatch().table<AdamWTable>(ShapeClass(infer_backend(t)));
}

std::vector<double> deltas(const Tensor& after, const std::vector<double>& before) {
  std::vector<double> d = to_f64_vector(after);
  for (size_t i = 0; i < d.size(); ++i) d[i] -= before[i];
  return d;
}

// Probe, in every class: 135 tensors (more than one CUDA launch's 128): odd sizes, one of a single
// element, one with all-zero gradients whose tensors start one element past a 16-byte boundary
// (the per-element path), one of 40000 elements (several step units of 4096 and grad_sumsq units
// of 32768), 130 of 3 elements; decay on and off, bf16 copies on most. The steps: with the class
// without clip, three with the host's scale (clipping inactive, active, inactive); with clip, the
// device's decision from grad_sumsq_into's sum and the step's losses: off, active, a non-finite
// loss (the step is skipped: nothing may change), inactive; the default class runs both series.
// Compared with ref: the change of p over the steps (p itself hides the update under its own
// rounding), m, v and the norms; the candidate's bf16 copies must equal its own masters rounded
// to nearest even, bit for bit. With split masters (the class with split, and the default class;
// cpu, cuda) three twins run in the same calls as (bf16, I16) halves and must give the fp32 path's
// bits. Every class also checks refresh_bf16: plain copies of every tensor, and split copies at
// exact ties (away from zero) and near them.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const AdamWTable*>(impl.table);
  const auto& ref = *static_cast<const AdamWTable*>(Registry::global().ref(kOp).table);
  const DType sd = adamw_state_dtype(backend_dtype(impl.backend));
  const bool all = query.dims.empty();
  const bool with_split = sd == DType::F32 && (all || query.dim("split", 0) != 0);
  const bool host_steps = all || query.dim("clip", 0) == 0;
  const bool clip_steps = all || query.dim("clip", 0) != 0;
  ProbeTensors pt(impl.backend);
  struct Slot {
    ProbeTensors::Pair p, g, m, v, bf;
    bool decay, has_bf16;
  };
  auto filled = [&](const std::vector<int64_t>& shape, uint64_t seed, double std, DType dt,
                    bool shift = false) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<double> x(static_cast<size_t>(n));
    for (size_t j = 0; j < x.size(); ++j) x[j] = std * rng::normal(seed, 3, j);
    return misaligned(pt, pt.input(x, shape, dt), shift);
  };
  std::vector<std::vector<int64_t>> shapes = {{7, 13}, {5}, {33}, {1}, {40000}};
  for (int i = 0; i < 130; ++i) shapes.push_back({3});
  std::vector<Slot> slots;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& sh = shapes[i];
    const uint64_t k = i;
    const bool shift = i == 2;
    slots.push_back({filled(sh, 70 + k, 1.0, sd, shift),
                     filled(sh, 1000 + k, i == 2 ? 0.0 : 0.5, sd, shift),
                     filled(sh, 0, 0.0, sd, shift), filled(sh, 0, 0.0, sd, shift),
                     filled(sh, 0, 0.0, DType::BF16), i % 2 == 0 || i == 4, i != 2 && i != 3});
  }
  std::vector<std::vector<double>> p0;
  for (const Slot& s : slots) p0.push_back(to_f64_vector(s.p.ref));
  std::vector<AdamWParam> rp, cp;
  std::vector<Tensor> rg, cg;
  for (const Slot& s : slots) {
    rp.push_back({s.p.ref, s.g.ref, s.m.ref, s.v.ref, Tensor(), s.decay, {}});
    cp.push_back(
        {s.p.cand, s.g.cand, s.m.cand, s.v.cand, s.has_bf16 ? s.bf.cand : Tensor(), s.decay, {}});
    rg.push_back(s.g.ref);
    cg.push_back(s.g.cand);
  }
  // Split masters (op.h): twins of slots 0, 1 and 4 with the master as (bf16, I16) halves and
  // their own m, v, in the same calls. After the steps the joined halves must be the fp32
  // master's bits and the high half its split_hi, exactly.
  struct Twin {
    size_t of;
    ProbeTensors::Pair lo, hi, m, v;
  };
  std::vector<Twin> twins;
  if (with_split) {
    for (const size_t i : {size_t{0}, size_t{1}, size_t{4}}) {
      const Slot& s = slots[i];
      std::vector<double> hi;
      std::vector<int64_t> lo;
      for (double x : to_f64_vector(s.p.cand)) {
        const uint32_t b = f32_bits(static_cast<float>(x));
        const uint16_t h = split_hi(b);
        hi.push_back(bf16_bits_to_float(h));
        lo.push_back(split_lo(b, h));
      }
      const std::vector<int64_t> sh = s.p.cand.shape_vec();
      twins.push_back({i, pt.ints(lo, sh, DType::I16), pt.input(hi, sh, DType::BF16),
                       filled(sh, 0, 0.0, sd), filled(sh, 0, 0.0, sd)});
    }
    for (const Twin& w : twins)
      cp.push_back(
          {w.lo.cand, slots[w.of].g.cand, w.m.cand, w.v.cand, w.hi.cand, slots[w.of].decay, {}});
  }
  ProbeError err;
  // The norms: grad_sumsq on the host and grad_sumsq_into (the clip path's sum, on the device).
  const double sr = ref.grad_sumsq(rg), nr = std::sqrt(sr);
  err.fwd = std::abs(std::sqrt(cand.grad_sumsq(cg)) - nr) / nr;
  auto sumsq = pt.zeros({1}, DType::F64);
  ref.grad_sumsq_into(rg, sumsq.ref);
  cand.grad_sumsq_into(cg, sumsq.cand);
  err.fwd = std::max(err.fwd, std::abs(std::sqrt(to_f64_vector(sumsq.cand)[0]) - nr) / nr);
  int64_t t = 0;
  if (host_steps)
    for (int k = 0; k < 3; ++k) {
      ++t;
      AdamWHyper h{0.05, 0.9, 0.95, 1e-8, 0.1, t, k == 1 ? clip_scale(nr, 0.5 * nr) : 1.0};
      ref.step({rp, h, {}});
      cand.step({cp, h, {}});
    }
  if (clip_steps) {
    const std::vector<double> fine = {2.5, 3.0}, bad = {2.5, std::nan("")};
    auto losses = pt.input(fine, {2}, DType::F32), nan_losses = pt.input(bad, {2}, DType::F32);
    // max_norm 0 (off), half the norm (active), a NaN loss (skipped), 10x the norm (inactive).
    const double max_norms[] = {0.0, 0.5 * nr, 0.5 * nr, 10 * nr};
    for (int k = 0; k < 4; ++k) {
      if (k != 2) ++t;
      const AdamWHyper h{0.05, 0.9, 0.95, 1e-8, 0.1, std::max<int64_t>(t, 1), 1.0};
      const auto& l = k == 2 ? nan_losses : losses;
      ref.step({rp, h, {sumsq.ref, l.ref, max_norms[k]}});
      cand.step({cp, h, {sumsq.cand, l.cand, max_norms[k]}});
    }
  }
  std::vector<double> dr, dc, mr, mc, vr, vc;
  for (size_t i = 0; i < slots.size(); ++i) {
    for (double x : deltas(slots[i].p.ref, p0[i])) dr.push_back(x);
    for (double x : deltas(slots[i].p.cand, p0[i])) dc.push_back(x);
    for (double x : to_f64_vector(slots[i].m.ref)) mr.push_back(x);
    for (double x : to_f64_vector(slots[i].m.cand)) mc.push_back(x);
    for (double x : to_f64_vector(slots[i].v.ref)) vr.push_back(x);
    for (double x : to_f64_vector(slots[i].v.cand)) vc.push_back(x);
    if (slots[i].has_bf16) {
      OwnedTensor want = convert(slots[i].p.cand, DType::BF16);
      err.fwd = std::max(err.fwd, rel_l2_error(slots[i].bf.cand, want) > 0 ? INFINITY : 0.0);
    }
  }
  for (const Twin& w : twins) {
    const std::vector<double> want = to_f64_vector(slots[w.of].p.cand),
                              hi = to_f64_vector(w.hi.cand);
    const OwnedTensor lo = convert(w.lo.cand, DType::I16);  // host copy of the bits
    for (size_t j = 0; j < want.size(); ++j) {
      const uint32_t b = f32_bits(static_cast<float>(want[j]));
      const uint16_t h = float_to_bf16_bits(static_cast<float>(hi[j]));  // exact: hi is a bf16
      const int16_t l = lo.view().ptr<int16_t>()[j];
      if (split_join(h, l) != b || h != split_hi(b)) err.fwd = INFINITY;
    }
  }
  if (sd == DType::F32) {
    // refresh_bf16, plain: a fresh bf16 copy of every master (multi-launch, several units).
    std::vector<Bf16Copy> copies;
    std::vector<ProbeTensors::Pair> outs;
    for (const Slot& s : slots) outs.push_back(pt.zeros({s.p.cand.numel()}, DType::BF16));
    for (size_t i = 0; i < slots.size(); ++i)
      copies.push_back({slots[i].p.cand, outs[i].cand.reshape(slots[i].p.cand.shape())});
    cand.refresh_bf16(copies);
    for (size_t i = 0; i < slots.size(); ++i) {
      OwnedTensor want = convert(slots[i].p.cand, DType::BF16);
      err.fwd = std::max(err.fwd, rel_l2_error(copies[i].copy, want) > 0 ? INFINITY : 0.0);
    }
    // refresh_bf16, split: at exact ties (away from zero) and near them.
    const std::vector<double> xs = {1.0 + 0x1p-8, -(1.0 + 0x1p-8), 1.0 + 3 * 0x1p-8, 0.1, -7.0};
    ProbeTensors::Pair x = pt.input(xs, {5}, DType::F32), h = pt.zeros({5}, DType::BF16);
    const std::vector<int64_t> zeros(5, 0);
    ProbeTensors::Pair l = pt.ints(zeros, {5}, DType::I16);
    const std::vector<Bf16Copy> c = {{x.cand, h.cand, l.cand}};
    cand.refresh_bf16(c);
    const std::vector<double> hv = to_f64_vector(h.cand);
    const OwnedTensor lv = convert(l.cand, DType::I16);
    for (size_t j = 0; j < xs.size(); ++j) {
      const uint32_t w = f32_bits(static_cast<float>(xs[j]));
      const uint16_t hb = float_to_bf16_bits(static_cast<float>(hv[j]));
      if (hb != split_hi(w) || split_join(hb, lv.view().ptr<int16_t>()[j]) != w) err.fwd = INFINITY;
    }
  }
  err.fwd = std::max({err.fwd, rel_l2_error(dc, dr), rel_l2_error(mc, mr), rel_l2_error(vc, vr)});
  // No backward: bwd stays 0.
  return err;
}

ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {1e-5, 0.0};
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  GDN_CHECK_HINT(!backward, "run it without --backward", "{}: the optimizer step has no backward",
                 kOp);
  const auto& t = *static_cast<const AdamWTable*>(impl.table);
  const DType sd = adamw_state_dtype(backend_dtype(impl.backend));
  const Device dev = backend_device(impl.backend);
  Tensor p_in = io.input("p", sd, dev);
  Tensor g = io.input("g", sd, dev);
  Tensor p = io.output("p", sd, dev, p_in.shape());
  Tensor m = io.output("m", sd, dev, p_in.shape());
  Tensor v = io.output("v", sd, dev, p_in.shape());
  Tensor p_bf16 = io.output("p_bf16", DType::BF16, dev, p_in.shape());
  copy_into(p, p_in);
  if (io.has_input("m")) copy_into(m, io.input("m", sd, dev));
  if (io.has_input("v")) copy_into(v, io.input("v", sd, dev));
  const double norm = std::sqrt(t.grad_sumsq(std::span<const Tensor>(&g, 1)));
  Tensor gn = io.output("grad_norm", DType::F64, Device::CPU, {1});
  gn.ptr<double>()[0] = norm;
  AdamWHyper h;
  h.lr = io.attr("lr", h.lr);
  h.beta1 = io.attr("beta1", h.beta1);
  h.beta2 = io.attr("beta2", h.beta2);
  h.eps = io.attr("eps", h.eps);
  h.weight_decay = io.attr("weight_decay", h.weight_decay);
  h.step = static_cast<int64_t>(io.attr("step", 1));
  h.grad_scale = io.attr("grad_scale", 1.0) * clip_scale(norm, io.attr("max_norm", 0.0));
  AdamWParam e{p, g, m, v, p_bf16, io.attr("decay", 1) != 0, "p"};
  validate_step(std::span<const AdamWParam>(&e, 1), h);
  t.step({std::span<const AdamWParam>(&e, 1), h, {}});
}
}  // namespace

void adamw_step(std::span<const AdamWParam> params, const AdamWHyper& hyper,
                const AdamWClip& clip) {
  validate_step(params, hyper, clip);
  if (params.empty()) return;
  const AdamWStep s{params, hyper, clip};
  dispatch().table<AdamWTable>(class_of(s)).step(s);
}

double grad_global_norm(std::span<const Tensor> grads) {
  validate_grads(grads);
  if (grads.empty()) return 0.0;
  return std::sqrt(table_for(grads[0]).grad_sumsq(grads));
}

void grad_sumsq_into(std::span<const Tensor> grads, const Tensor& out) {
  validate_grads(grads);
  expect_tensor(out, kOp, "out", DType::F64, {1});
  if (grads.empty()) {
    const double zero = 0.0;
    copy_bytes(out.data(), out.device(), &zero, Device::CPU, sizeof(double));
    return;
  }
  expect_device(out, kOp, "out", grads[0].device());
  table_for(grads[0]).grad_sumsq_into(grads, out);
}

double host_clip_decision(const AdamWStep& s) {
  const AdamWClip& c = s.clip;
  if (!c.sumsq.defined()) return s.hyper.grad_scale;
  const double ss = c.sumsq.ptr<double>()[0];
  bool finite = std::isfinite(ss);
  if (c.losses.defined()) {
    const int64_t n = c.losses.numel();
    for (int64_t i = 0; i < n; ++i)
      finite = finite && std::isfinite(c.losses.dtype() == DType::F64
                                           ? c.losses.ptr<double>()[i]
                                           : static_cast<double>(c.losses.ptr<float>()[i]));
  }
  if (!finite) return -1.0;
  return s.hyper.grad_scale * clip_scale(std::sqrt(ss), c.max_norm);
}

double clip_scale(double norm, double max_norm) {
  if (!(max_norm > 0)) return 1.0;  // clipping off
  GDN_CHECK_HINT(std::isfinite(norm),
                 "skip the step (or stop) on a non-finite gradient instead of clipping it",
                 "{}: the global gradient norm is {}, cannot clip", kOp, norm);
  return std::min(1.0, max_norm / (norm + 1e-6));  // torch.nn.utils.clip_grad_norm_
}

void adamw_refresh_bf16(std::span<const Bf16Copy> copies) {
  validate_copies(copies);
  if (copies.empty()) return;
  table_for(copies[0].master).refresh_bf16(copies);
}

GDN_REGISTER(adamw_op) {
  OpDesc d;
  d.name = kOp;
  d.summary =
      "AdamW step over fp32 masters (decoupled decay mask, clip scale, fused bf16 copy); "
      "no backward";
  d.fwd_inputs = {"p", "g", "m (optional, zeros)", "v (optional, zeros)"};
  d.fwd_outputs = {"p", "m", "v", "p_bf16", "grad_norm"};
  d.attrs = {"lr=1e-3", "beta1=0.9", "beta2=0.999",      "eps=1e-8",    "weight_decay=1e-2",
             "step=1",  "decay=1",   "max_norm=0 (off)", "grad_scale=1"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
