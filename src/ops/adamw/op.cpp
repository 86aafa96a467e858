// AdamW: validation, dispatch, clip scale, and the op's registration (probe, tolerance, file
// runner).
#include "ops/adamw/op.h"

#include <cmath>
#include <string>
#include <vector>

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

const AdamWTable& table_for(const Tensor& t) {
  return Registry::global().table<AdamWTable>(kOp, OpQuery{infer_backend(t), "", {}});
}

std::vector<double> deltas(const Tensor& after, const std::vector<double>& before) {
  std::vector<double> d = to_f64_vector(after);
  for (size_t i = 0; i < d.size(); ++i) d[i] -= before[i];
  return d;
}

// Probe: four tensors (odd sizes, one of a single element, one with all-zero gradients, decay on
// and off), three steps with the clip scale active and inactive, the fused bf16 copy on two of
// them, and the global norm. Compared with ref: the change of p over the steps (p itself hides
// the update under its own rounding), m, v and the norm; the candidate's bf16 copies must equal
// its own masters rounded to nearest even, bit for bit. Split masters (cpu, cuda) must give the
// fp32 path's bits, and the split refresh must round exact ties away from zero.
ProbeError probe(const ImplDesc& impl, const OpQuery&) {
  const auto& cand = *static_cast<const AdamWTable*>(impl.table);
  const auto& ref = *static_cast<const AdamWTable*>(Registry::global().ref(kOp).table);
  const DType sd = adamw_state_dtype(backend_dtype(impl.backend));
  ProbeTensors pt(impl.backend);
  struct Slot {
    ProbeTensors::Pair p, g, m, v, bf;
    bool decay, has_bf16;
  };
  auto filled = [&](const std::vector<int64_t>& shape, uint64_t seed, double std, DType dt) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<double> x(static_cast<size_t>(n));
    for (size_t j = 0; j < x.size(); ++j) x[j] = std * rng::normal(seed, 3, j);
    return pt.input(x, shape, dt);
  };
  const std::vector<int64_t> shapes[] = {{7, 13}, {5}, {33}, {1}};
  const bool decays[] = {true, false, true, false};
  std::vector<Slot> slots;
  for (uint64_t i = 0; i < 4; ++i) {
    const auto& sh = shapes[i];
    slots.push_back({filled(sh, 70 + i, 1.0, sd), filled(sh, 80 + i, i == 2 ? 0.0 : 0.5, sd),
                     filled(sh, 0, 0.0, sd), filled(sh, 0, 0.0, sd),
                     filled(sh, 0, 0.0, DType::BF16), decays[i], i < 2});
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
  // Split masters (op.h): a twin of slots 0 and 1 with the master as (bf16, I16) halves and its
  // own m, v, in the same calls. After the steps the joined halves must be the fp32 master's
  // bits and the high half its split_hi, exactly.
  struct Twin {
    ProbeTensors::Pair lo, hi, m, v;
  };
  std::vector<Twin> twins;
  if (sd == DType::F32) {
    for (size_t i = 0; i < 2; ++i) {
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
      twins.push_back({pt.ints(lo, sh, DType::I16), pt.input(hi, sh, DType::BF16),
                       filled(sh, 0, 0.0, sd), filled(sh, 0, 0.0, sd)});
    }
    for (size_t i = 0; i < twins.size(); ++i)
      cp.push_back({twins[i].lo.cand,
                    slots[i].g.cand,
                    twins[i].m.cand,
                    twins[i].v.cand,
                    twins[i].hi.cand,
                    slots[i].decay,
                    {}});
  }
  ProbeError err;
  const double nr = std::sqrt(ref.grad_sumsq(rg)), nc = std::sqrt(cand.grad_sumsq(cg));
  err.fwd = std::abs(nc - nr) / nr;
  for (int64_t t = 1; t <= 3; ++t) {
    AdamWHyper h{0.05, 0.9, 0.95, 1e-8, 0.1, t, t == 2 ? clip_scale(nr, 0.5 * nr) : 1.0};
    ref.step({rp, h, {}});
    cand.step({cp, h, {}});
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
  for (size_t i = 0; i < twins.size(); ++i) {
    const std::vector<double> want = to_f64_vector(slots[i].p.cand),
                              hi = to_f64_vector(twins[i].hi.cand);
    const OwnedTensor lo = convert(twins[i].lo.cand, DType::I16);  // host copy of the bits
    for (size_t j = 0; j < want.size(); ++j) {
      const uint32_t w = f32_bits(static_cast<float>(want[j]));
      const uint16_t h = float_to_bf16_bits(static_cast<float>(hi[j]));  // exact: hi is a bf16
      const int16_t l = lo.view().ptr<int16_t>()[j];
      if (split_join(h, l) != w || h != split_hi(w)) err.fwd = INFINITY;
    }
  }
  if (sd == DType::F32) {  // the split refresh at exact ties (away from zero) and near them
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
  table_for(params[0].p).step({params, hyper, clip});
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
