// Backend registry and resolver (ARCHITECTURE.md §5).
//
// Every op registers one OpDesc (its contract for tools: tensor names, probe, tolerance, runner)
// and any number of implementations (ImplDesc: backend, name, priority, capability check and an
// op-specific function table). resolve() picks, once per process per (op, backend, shape class),
// the highest-priority implementation that (1) says it can run the query and (2) passes the op's
// numeric probe against `ref`, forward and backward. Rejections print one line each with the reason
// or the measured error; GDN_STRICT_KERNELS=1 turns any rejection into an error, and
// GDN_OP_<OP>=<impl> forces an implementation. `ref` implementations are the oracle and are not
// probed.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gdn/core/tensor.h"

namespace gdn {

enum class Backend : uint8_t { Ref, Cpu, Cuda };
std::string_view backend_name(Backend b);
Backend backend_from_name(std::string_view name);
// Where a backend's tensors live and what its activations are stored in (ARCHITECTURE.md §4).
Device backend_device(Backend b);
DType backend_dtype(Backend b);
// F64 host tensors run on ref, F32 host tensors on cpu, device tensors on cuda.
Backend infer_backend(const Tensor& t);

// What a caller asks an op to run: the backend, the resolution key's shape class and the dims
// that define it (op-specific names: "dk", "W", ...), which the capability checks read and the
// probe builds its case from, so that the probe runs the kernels that class runs.
struct OpQuery {
  Backend backend = Backend::Cpu;
  std::string shape_class;  // "" is the op's default class; else "D=2560,vec=1"
  std::map<std::string, int64_t> dims;
  // dims[name], or `dflt` when the query does not set it (the default class, `ops run`).
  int64_t dim(const std::string& name, int64_t dflt) const {
    auto it = dims.find(name);
    return it == dims.end() ? dflt : it->second;
  }
};

// A call's shape class: the values its kernels dispatch on (head dims, widths, whether the
// pointers allow 16-byte vectors, which optional tensors are present), added in a fixed order per
// op. Building one allocates nothing: the per-call lookup uses a 64-bit hash of the values, and
// the OpQuery (class name and dims) is made only the first time a class is seen.
class ShapeClass {
 public:
  explicit ShapeClass(Backend b) : backend_(b) {}
  ShapeClass& dim(const char* name, int64_t value) {
    if (n_ < kMaxDims) {
      names_[n_] = name;
      values_[n_] = value;
    }
    ++n_;  // past kMaxDims only counted: query() then fails (a class must never lose a dim)
    // FNV-1a over the value's bytes, and the count so that a short class is not a prefix.
    for (int i = 0; i < 8; ++i)
      hash_ = (hash_ ^ ((static_cast<uint64_t>(value) >> (8 * i)) & 0xff)) * 1099511628211ull;
    hash_ = (hash_ ^ static_cast<uint64_t>(n_)) * 1099511628211ull;
    return *this;
  }
  ShapeClass& flag(const char* name, bool value) { return dim(name, value ? 1 : 0); }
  Backend backend() const { return backend_; }
  uint64_t hash() const { return hash_; }
  // The class as an OpQuery (its dims by name, shape_class "a=1,b=2"); throws when the class has
  // more than kMaxDims dims.
  OpQuery query() const;

 private:
  static constexpr int kMaxDims = 10;
  Backend backend_;
  uint64_t hash_ = 1469598103934665603ull;
  const char* names_[kMaxDims] = {};
  int64_t values_[kMaxDims] = {};
  int n_ = 0;
};

class OpDispatch;

struct ImplDesc {
  std::string op;
  std::string name;  // unique within the op, e.g. "cpu.rowwise"; shown by probe / forced by knob
  Backend backend = Backend::Cpu;
  int priority = 0;  // higher is tried first
  // Returns "" when the implementation can run the query, otherwise the reason it cannot.
  std::function<std::string(const OpQuery&)> supports;
  const void* table = nullptr;  // the op's function table (e.g. const RmsNormTable*)
};

struct ProbeError {
  double fwd = 0;  // relative L2 error of the forward outputs vs ref (max over outputs)
  double bwd = 0;  // same for the gradients
};

// A tensor-file view of an op call, used by `gdntrain ops run`: inputs come from a safetensors
// file (converted to what the implementation needs), outputs are collected and written back.
class OpIO {
 public:
  virtual ~OpIO() = default;
  // A required input converted to dtype/device; throws naming the tensor when it is missing.
  virtual Tensor input(const std::string& name, DType dtype, Device device) = 0;
  virtual bool has_input(const std::string& name) const = 0;
  // A new zero-filled output tensor that will be written under `name`.
  virtual Tensor output(const std::string& name, DType dtype, Device device,
                        std::span<const int64_t> shape) = 0;
  Tensor output(const std::string& name, DType dtype, Device device,
                std::initializer_list<int64_t> shape) {
    return output(name, dtype, device, std::span<const int64_t>(shape.begin(), shape.size()));
  }
  // A scalar attribute (from the file's __metadata__ or --attr); default when absent.
  virtual double attr(const std::string& name, double dflt) const = 0;
};

struct OpDesc {
  std::string name;     // "rmsnorm"
  std::string summary;  // one line
  std::vector<std::string> fwd_inputs, fwd_outputs, bwd_inputs, bwd_outputs, attrs;
  // Runs the op's probe case through `impl` and through ref; returns the relative errors.
  std::function<ProbeError(const ImplDesc& impl, const OpQuery& query)> probe;
  // Probe thresholds for an implementation whose activations are `dtype` (fwd, bwd).
  std::function<ProbeError(DType dtype)> tolerance;
  // `gdntrain ops run`: forward, and backward too when `backward` is set.
  std::function<void(const ImplDesc& impl, OpIO& io, bool backward)> run;
};

struct Resolution {
  const ImplDesc* impl = nullptr;
  ProbeError error;                   // zero for ref
  double probe_ms = 0;                // time spent probing the chosen implementation
  std::vector<std::string> rejected;  // one line per rejected implementation
};

class Registry {
 public:
  static Registry& global();

  void add_op(OpDesc op);
  void add_impl(ImplDesc impl);

  const OpDesc& op(std::string_view name) const;
  bool has_op(std::string_view name) const;
  std::vector<const OpDesc*> ops() const;
  // Implementations of `op` on `backend`, highest priority first.
  std::vector<const ImplDesc*> impls(std::string_view op, Backend backend) const;
  // The highest-priority ref implementation (the oracle); throws if the op has none.
  const ImplDesc& ref(std::string_view op) const;

  // Resolves once per (op, backend, shape class); thread-safe; later calls return the cached
  // decision without probing or logging again.
  const Resolution& resolve(std::string_view op, const OpQuery& query);
  template <class Table>
  const Table& table(std::string_view op, const OpQuery& query) {
    return *static_cast<const Table*>(resolve(op, query).impl->table);
  }
  // Forget every decision, the OpDispatch tables' too (tests only; no op may run meanwhile).
  void clear_resolutions();
  // Every (op, backend, class) resolved so far, in resolution order: `gdntrain probe --model`.
  struct Decision {
    std::string op;
    OpQuery query;
    Resolution result;
  };
  std::vector<Decision> decisions() const;
  void add_dispatch(OpDispatch* d);
  void remove_dispatch(OpDispatch* d);

 private:
  struct Entry {
    std::once_flag once;
    Resolution result;
  };
  mutable std::mutex mu_;
  std::map<std::string, OpDesc, std::less<>> ops_;
  std::vector<std::unique_ptr<ImplDesc>> impls_;
  std::map<std::string, std::shared_ptr<Entry>, std::less<>> resolved_;
  std::vector<std::pair<std::string, OpQuery>> order_;  // keys of resolved_ in resolution order
  std::vector<OpDispatch*> dispatches_;
  void do_resolve(std::string_view op, const OpQuery& query, Resolution* out);
};

// The per-call door to an op's implementations: one per op (a function-local static in its
// op.cpp). The first call of a (backend, shape class) resolves through Registry::resolve (probe,
// one log line); every later call is a lookup in a fixed table of atomics (no string, no lock, no
// map). Registry::clear_resolutions() empties every OpDispatch too.
class OpDispatch {
 public:
  explicit OpDispatch(std::string op);
  ~OpDispatch();
  OpDispatch(const OpDispatch&) = delete;
  OpDispatch& operator=(const OpDispatch&) = delete;

  const ImplDesc& impl(const ShapeClass& c) {
    const Slot* slots = slots_[static_cast<int>(c.backend())];
    for (int i = 0; i < kSlots; ++i) {
      const ImplDesc* p = slots[i].impl.load(std::memory_order_acquire);
      if (p == nullptr) break;
      if (slots[i].hash.load(std::memory_order_relaxed) == c.hash()) return *p;
    }
    return resolve_slow(c);
  }
  template <class Table>
  const Table& table(const ShapeClass& c) {
    return *static_cast<const Table*>(impl(c).table);
  }
  const std::string& op() const { return op_; }
  void clear();

 private:
  static constexpr int kSlots = 32;  // classes per backend kept in the table; more still resolve
  struct Slot {
    std::atomic<uint64_t> hash{0};
    std::atomic<const ImplDesc*> impl{nullptr};
  };
  const ImplDesc& resolve_slow(const ShapeClass& c);
  std::string op_;
  std::mutex mu_;
  Slot slots_[3][kSlots];
};

// Relative L2 error ||got - want|| / max(||want||, 1e-30); +inf if got has a non-finite value.
double rel_l2_error(std::span<const double> got, std::span<const double> want);
double rel_l2_error(const Tensor& got, const Tensor& want);

}  // namespace gdn

// Static registration: GDN_REGISTER(tag) { Registry::global().add_impl(...); }
#define GDN_REGISTER(tag)                                                          \
  static void gdn_register_##tag();                                                \
  namespace {                                                                      \
  [[maybe_unused]] const bool gdn_registered_##tag = (gdn_register_##tag(), true); \
  }                                                                                \
  static void gdn_register_##tag()
