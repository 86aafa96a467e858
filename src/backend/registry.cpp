#include "gdn/backend/registry.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "backend/cpu/blas.h"
#include "gdn/backend/op_workspace.h"
#include "gdn/core/env.h"
#include "gdn/core/log.h"

namespace gdn {

std::string_view backend_name(Backend b) {
  switch (b) {
    case Backend::Ref:
      return "ref";
    case Backend::Cpu:
      return "cpu";
    case Backend::Cuda:
      return "cuda";
  }
  return "?";
}

Backend backend_from_name(std::string_view name) {
  if (name == "ref") return Backend::Ref;
  if (name == "cpu") return Backend::Cpu;
  if (name == "cuda") return Backend::Cuda;
  GDN_FAIL_HINT("choose ref, cpu or cuda", "unknown backend '{}'", name);
}

Device backend_device(Backend b) { return b == Backend::Cuda ? Device::CUDA : Device::CPU; }

DType backend_dtype(Backend b) {
  switch (b) {
    case Backend::Ref:
      return DType::F64;
    case Backend::Cpu:
      return DType::F32;
    case Backend::Cuda:
      return DType::BF16;
  }
  return DType::F32;
}

Backend infer_backend(const Tensor& t) {
  if (t.device() == Device::CUDA) return Backend::Cuda;
  return t.dtype() == DType::F64 ? Backend::Ref : Backend::Cpu;
}

Registry& Registry::global() {
  static Registry r;
  return r;
}

void Registry::add_op(OpDesc op) {
  std::lock_guard lock(mu_);
  GDN_CHECK(!ops_.contains(op.name), "op '{}' registered twice", op.name);
  std::string name = op.name;
  ops_.emplace(std::move(name), std::move(op));
}

void Registry::add_impl(ImplDesc impl) {
  std::lock_guard lock(mu_);
  for (const auto& i : impls_) {
    GDN_CHECK(!(i->op == impl.op && i->name == impl.name),
              "implementation '{}' of op '{}' registered twice", impl.name, impl.op);
  }
  impls_.push_back(std::make_unique<ImplDesc>(std::move(impl)));
}

const OpDesc& Registry::op(std::string_view name) const {
  std::lock_guard lock(mu_);
  auto it = ops_.find(name);
  if (it == ops_.end()) {
    std::string known;
    for (const auto& [n, _] : ops_) known += (known.empty() ? "" : ", ") + n;
    GDN_FAIL_HINT("`gdntrain ops list` prints every op", "unknown op '{}' (known: {})", name,
                  known);
  }
  return it->second;
}

bool Registry::has_op(std::string_view name) const {
  std::lock_guard lock(mu_);
  return ops_.contains(name);
}

std::vector<const OpDesc*> Registry::ops() const {
  std::lock_guard lock(mu_);
  std::vector<const OpDesc*> out;
  for (const auto& [_, o] : ops_) out.push_back(&o);
  return out;
}

std::vector<const ImplDesc*> Registry::impls(std::string_view op, Backend backend) const {
  std::lock_guard lock(mu_);
  std::vector<const ImplDesc*> out;
  for (const auto& i : impls_)
    if (i->op == op && i->backend == backend) out.push_back(i.get());
  std::stable_sort(out.begin(), out.end(),
                   [](const ImplDesc* a, const ImplDesc* b) { return a->priority > b->priority; });
  return out;
}

const ImplDesc& Registry::ref(std::string_view op) const {
  auto r = impls(op, Backend::Ref);
  GDN_CHECK(!r.empty(), "op '{}' has no ref implementation", op);
  return *r.front();
}

const Resolution& Registry::resolve(std::string_view op, const OpQuery& query) {
  std::string key = fmt::format("{}/{}[{}]", op, backend_name(query.backend), query.shape_class);
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard lock(mu_);
    auto it = resolved_.find(key);
    if (it == resolved_.end()) {
      it = resolved_.emplace(key, std::make_shared<Entry>()).first;
      order_.emplace_back(key, query);
    }
    entry = it->second;
  }
  // call_once: concurrent callers wait for the first; if it throws (strict mode), the next call
  // tries again and throws the same error.
  std::call_once(entry->once, [&] { do_resolve(op, query, &entry->result); });
  return entry->result;
}

void Registry::clear_resolutions() {
  std::lock_guard lock(mu_);
  resolved_.clear();
  order_.clear();
  for (OpDispatch* d : dispatches_) d->clear();
}

std::vector<Registry::Decision> Registry::decisions() const {
  std::lock_guard lock(mu_);
  std::vector<Decision> out;
  for (const auto& [key, query] : order_) {
    auto it = resolved_.find(key);
    if (it == resolved_.end() || it->second->result.impl == nullptr) continue;
    out.push_back({it->second->result.impl->op, query, it->second->result});
  }
  return out;
}

void Registry::add_dispatch(OpDispatch* d) {
  std::lock_guard lock(mu_);
  dispatches_.push_back(d);
}

void Registry::remove_dispatch(OpDispatch* d) {
  std::lock_guard lock(mu_);
  std::erase(dispatches_, d);
}

OpQuery ShapeClass::query() const {
  GDN_CHECK(n_ <= kMaxDims, "internal: a shape class has {} dims, at most {} are supported ({}...)",
            n_, kMaxDims, names_[0]);
  OpQuery q;
  q.backend = backend_;
  for (int i = 0; i < n_; ++i) {
    q.shape_class += fmt::format("{}{}={}", i ? "," : "", names_[i], values_[i]);
    q.dims[names_[i]] = values_[i];
  }
  return q;
}

OpDispatch::OpDispatch(std::string op) : op_(std::move(op)) {
  Registry::global().add_dispatch(this);
}
OpDispatch::~OpDispatch() { Registry::global().remove_dispatch(this); }

void OpDispatch::clear() {
  std::lock_guard lock(mu_);
  for (auto& row : slots_)
    for (Slot& s : row) s.impl.store(nullptr, std::memory_order_release);
}

const ImplDesc& OpDispatch::resolve_slow(const ShapeClass& c) {
  const ImplDesc* impl = Registry::global().resolve(op_, c.query()).impl;
  std::lock_guard lock(mu_);
  Slot* slots = slots_[static_cast<int>(c.backend())];
  for (int i = 0; i < kSlots; ++i) {
    const ImplDesc* p = slots[i].impl.load(std::memory_order_relaxed);
    if (p != nullptr && slots[i].hash.load(std::memory_order_relaxed) == c.hash()) break;
    if (p == nullptr) {  // the hash first, then the pointer that publishes it
      slots[i].hash.store(c.hash(), std::memory_order_relaxed);
      slots[i].impl.store(impl, std::memory_order_release);
      break;
    }
  }
  return *impl;
}

namespace {
std::string knob_suffix(std::string_view op) {
  std::string s(op);
  for (char& c : s) c = (c >= 'a' && c <= 'z') ? static_cast<char>(c - 'a' + 'A') : c;
  return s;
}
}  // namespace

void Registry::do_resolve(std::string_view op_name, const OpQuery& query, Resolution* out) {
  const OpDesc& op = this->op(op_name);
  std::string where = fmt::format("{}/{}{}", op_name, backend_name(query.backend),
                                  query.shape_class.empty() ? "" : "[" + query.shape_class + "]");
  const bool strict = env::get_bool("GDN_STRICT_KERNELS");
  // The CPU thread contract (one OpenMP pool, OpenBLAS single-threaded) holds before any CPU
  // kernel runs, the probe's included: every kernel is reached through a resolution.
  if (query.backend != Backend::Cuda) cpu::init_runtime();
  std::vector<const ImplDesc*> candidates = impls(op_name, query.backend);
  GDN_CHECK_HINT(!candidates.empty(), "`gdntrain ops list` shows what is compiled in",
                 "op '{}' has no implementation on backend {}", op_name,
                 backend_name(query.backend));

  auto forced = env::get_family("GDN_OP_", knob_suffix(op_name));
  if (forced) {
    auto it = std::find_if(candidates.begin(), candidates.end(),
                           [&](const ImplDesc* i) { return i->name == *forced; });
    if (it == candidates.end()) {
      std::string names;
      for (const ImplDesc* i : candidates) names += (names.empty() ? "" : ", ") + i->name;
      GDN_FAIL_HINT(fmt::format("implementations of {} on {}: {}", op_name,
                                backend_name(query.backend), names),
                    "GDN_OP_{}={} names no implementation of op '{}' on backend {}",
                    knob_suffix(op_name), *forced, op_name, backend_name(query.backend));
    }
    candidates = {*it};
  }

  std::vector<std::string> reasons;
  for (const ImplDesc* impl : candidates) {
    std::string why = impl->supports ? impl->supports(query) : std::string();
    if (!why.empty()) {
      std::string line = fmt::format("[resolve] {}: skipping {}: {}", where, impl->name, why);
      GDN_CHECK_HINT(!strict, "unset GDN_STRICT_KERNELS to allow fallbacks",
                     "GDN_STRICT_KERNELS: op '{}' implementation '{}' cannot run: {}", op_name,
                     impl->name, why);
      log::warn("{}", line);
      reasons.push_back(line);
      continue;
    }
    if (query.backend == Backend::Ref) {
      out->impl = impl;
      return;  // the oracle is not probed
    }
    auto t0 = std::chrono::steady_clock::now();
    ProbeError err;
    std::string failure;
    try {
      // A probe runs at shapes of its own, outside the caller's planned op workspace (it may be
      // resolving the first call of a shape class inside a model step).
      std::optional<OpWorkspaceSuspend> unplanned;
      if (query.backend == Backend::Cuda) unplanned.emplace();
      err = op.probe(*impl, query);
    } catch (const Error& e) {
      failure = fmt::format("probe raised an error: {}", e.message());
    }
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ProbeError tol = op.tolerance(backend_dtype(query.backend));
    if (failure.empty() && !(err.fwd <= tol.fwd && err.bwd <= tol.bwd)) {
      failure = fmt::format("probe error fwd {:.3g} (limit {:.3g}), bwd {:.3g} (limit {:.3g})",
                            err.fwd, tol.fwd, err.bwd, tol.bwd);
    }
    if (!failure.empty()) {
      GDN_CHECK_HINT(!strict,
                     "unset GDN_STRICT_KERNELS to fall back, or force another "
                     "implementation with GDN_OP_<OP>",
                     "GDN_STRICT_KERNELS: op '{}' implementation '{}' rejected: {}", op_name,
                     impl->name, failure);
      std::string line = fmt::format("[resolve] {}: rejecting {}: {}", where, impl->name, failure);
      log::warn("{}", line);
      reasons.push_back(line);
      continue;
    }
    out->impl = impl;
    out->error = err;
    out->probe_ms = ms;
    out->rejected = reasons;
    log::info("[resolve] {}: {} (probe fwd {:.2g}, bwd {:.2g}, {:.1f} ms){}", where, impl->name,
              err.fwd, err.bwd, ms,
              forced ? " [forced by GDN_OP_" + knob_suffix(op_name) + "]" : "");
    return;
  }
  std::string all;
  for (const auto& r : reasons) all += "\n  " + r;
  GDN_FAIL_HINT("GDN_OP_<OP>=<impl> forces an implementation; `gdntrain probe` shows the decisions",
                "no implementation of op '{}' on backend {} passed its checks:{}", op_name,
                backend_name(query.backend), all);
}

double rel_l2_error(std::span<const double> got, std::span<const double> want) {
  GDN_CHECK(got.size() == want.size(), "rel_l2_error: sizes differ ({} vs {})", got.size(),
            want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    double d = got[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

double rel_l2_error(const Tensor& got, const Tensor& want) {
  auto g = to_f64_vector(got);
  auto w = to_f64_vector(want);
  return rel_l2_error(g, w);
}

}  // namespace gdn
