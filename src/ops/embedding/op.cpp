// Embedding: validation (including the id range), dispatch and the op's registration (probe,
// tolerance, file runner).
#include "ops/embedding/op.h"

#include <algorithm>

#include "backend/probe_layout.h"
#include "backend/shape_class.h"
#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

#if GDN_WITH_CUDA
// cuda.cu and cuda_ranked_windows.cu: each implementation's largest request.
size_t embedding_sorted_windows_workspace_bytes(int64_t T, int64_t vocab, int64_t D);
size_t embedding_ranked_windows_workspace_bytes(int64_t T, int64_t vocab, int64_t D);
#endif

size_t embedding_workspace_bytes(int64_t T, int64_t vocab, int64_t D) {
  GDN_CHECK(T >= 0 && vocab >= 1 && D >= 0,
            "embedding: embedding_workspace_bytes needs T, D >= 0 and vocab >= 1, got T = {}, "
            "vocab = {}, D = {}",
            T, vocab, D);
#if GDN_WITH_CUDA
  return std::max(embedding_sorted_windows_workspace_bytes(T, vocab, D),
                  embedding_ranked_windows_workspace_bytes(T, vocab, D));
#else
  return 0;
#endif
}

namespace {
constexpr const char* kOp = "embedding";

void expect_ids(const Tensor& ids) {
  expect_shape(ids, kOp, "ids", {-1});
  GDN_CHECK(ids.dtype() == DType::I32 || ids.dtype() == DType::I64,
            "{}: tensor 'ids' has dtype {}, expected I32 or I64", kOp, dtype_name(ids.dtype()));
  expect_contiguous(ids, kOp, "ids");
}

void same_device(const Tensor& ref, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    GDN_CHECK(t->device() == ref.device(), "{}: all tensors must be on {}", kOp,
              device_name(ref.device()));
}

// The optional plan (op.h): I32 [embedding_plan_numel(T, D)], contiguous, on `dev`.
void expect_plan(const Tensor& plan, int64_t T, int64_t D, Device dev) {
  if (!plan.defined()) return;
  const int64_t want = embedding_plan_numel(T, D);
  GDN_CHECK(plan.ndim() == 1 && plan.size(0) == want,
            "{}: tensor 'plan' has shape {}, expected [{}] (embedding_plan_numel(T={}, D={}))", kOp,
            plan.shape_str(), want, T, D);
  GDN_CHECK(plan.dtype() == DType::I32, "{}: tensor 'plan' has dtype {}, expected I32", kOp,
            dtype_name(plan.dtype()));
  expect_contiguous(plan, kOp, "plan");
  expect_device(plan, kOp, "plan", dev);
}

void validate_fwd(const EmbeddingFwd& a) {
  expect_ids(a.ids);
  expect_shape(a.w, kOp, "w", {-1, -1});
  expect_contiguous(a.w, kOp, "w");
  GDN_CHECK(dtype_is_float(a.w.dtype()), "{}: tensor 'w' has dtype {}, expected a float dtype", kOp,
            dtype_name(a.w.dtype()));
  expect_tensor(a.y, kOp, "y", a.w.dtype(), {a.ids.size(0), a.w.size(1)});
  same_device(a.w, {&a.ids, &a.y});
  expect_plan(a.plan, a.ids.size(0), a.w.size(1), a.ids.device());
  // Device ids are checked by the device kernel; host ids here, before any row is copied.
  if (a.ids.device() == Device::CPU) embedding_check_ids(a.ids, a.w.size(0));
}

void validate_bwd(const EmbeddingBwd& a) {
  expect_ids(a.ids);
  expect_shape(a.dy, kOp, "dy", {a.ids.size(0), -1});
  expect_contiguous(a.dy, kOp, "dy");
  GDN_CHECK(dtype_is_float(a.dy.dtype()), "{}: tensor 'dy' has dtype {}, expected a float dtype",
            kOp, dtype_name(a.dy.dtype()));
  expect_tensor(a.dw, kOp, "dw", embedding_grad_dtype(a.dy.dtype()), {-1, a.dy.size(1)});
  same_device(a.dy, {&a.ids, &a.dw});
  expect_plan(a.plan, a.ids.size(0), a.dy.size(1), a.ids.device());
  if (a.ids.device() == Device::CPU) embedding_check_ids(a.ids, a.dw.size(0));
}

// The shape class (`rows`: w or dy, [*, D]): the width D (the CUDA gather's 8-wide packs need D % 8
// == 0, cuda.ranked_windows' dW 4-wide groups D % 4 == 0, and D sets the column chunks), whether
// the rows allow 16-byte vectors (w and y; dy and dW), whether the caller passes a plan
// (cuda.ranked_windows: the forward ranks the ids on a side stream and the backward reads that
// ranking instead of ranking again; the model passes one on cuda) and whether the ids are I64 (else
// I32).
ShapeClass class_of(const Tensor& rows, const Tensor& ids, bool vec, const Tensor& plan) {
  return ShapeClass(infer_backend(rows))
      .dim("D", rows.size(1))
      .flag("vec", vec)
      .flag("plan", plan.defined())
      .flag("i64", ids.dtype() == DType::I64);
}
OpDispatch& dispatch() {
  static OpDispatch d(kOp);
  return d;
}

// Probe: ids repeated many times (0 and V - 1 among them) and rows never used, dW accumulated onto
// nonzero values; the forward and then the backward of the same ids, with the plan between them
// when the class has one. Given a class: its D, id dtype and plan over V = 300 rows and T = 300
// tokens (19 windows of 16 sorted positions), tensors one element past a 16-byte boundary when
// the class is not vec. The default class: D = 19 and 64, V = 37, T = 41, both id dtypes, with
// and without a plan.
ProbeError probe(const ImplDesc& impl, const OpQuery& query) {
  const auto& cand = *static_cast<const EmbeddingTable*>(impl.table);
  const auto& ref = *static_cast<const EmbeddingTable*>(Registry::global().ref(kOp).table);
  const bool classed = query.dims.contains("D");
  const int64_t V = classed ? 300 : 37, T = classed ? 300 : 41;
  std::vector<int64_t> widths = {19, 64};  // the default class: odd rows and whole 16-byte ones
  if (classed) widths = {query.dim("D", 0)};
  const bool shift = classed && query.dim("vec", 1) == 0;
  const DType gdt = embedding_grad_dtype(backend_dtype(impl.backend));
  std::vector<DType> idts = {DType::I32, DType::I64};
  std::vector<bool> plans = {false, true};
  if (classed) {
    idts = {query.dim("i64", 0) != 0 ? DType::I64 : DType::I32};
    plans = {query.dim("plan", 0) != 0};
  }
  ProbeError err;
  for (const int64_t D : widths)
    for (const DType idt : idts)
      for (const bool with_plan : plans) {
        ProbeTensors p(impl.backend);
        std::vector<int64_t> idv(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) idv[static_cast<size_t>(t)] = (t * t * 7) % 13 * 3 % V;
        if (classed)  // half the tokens spread over the vocabulary, half on 13 hot rows
          for (int64_t t = 1; t < T; t += 2) idv[static_cast<size_t>(t)] = (t * 97 + 5) % V;
        idv[0] = V - 1;
        idv[static_cast<size_t>(T - 1)] = 0;
        auto ids = p.ints(idv, {T}, idt);
        auto w = misaligned(p, p.normal({V, D}, 41, 1.0), shift);
        auto dy = misaligned(p, p.normal({T, D}, 42, 1.0), shift);
        auto y = misaligned(p, p.zeros({T, D}), shift);
        auto dw = misaligned(p, p.normal({V, D}, 43, 1.0, gdt), shift);
        auto plan = p.zeros({embedding_plan_numel(T, D)}, DType::I32);
        const Tensor cplan = with_plan ? plan.cand : Tensor();
        ref.forward({ids.ref, w.ref, y.ref});
        cand.forward({ids.cand, w.cand, y.cand, cplan});
        ref.backward({ids.ref, dy.ref, dw.ref});
        cand.backward({ids.cand, dy.cand, dw.cand, cplan});
        err.fwd = std::max(err.fwd, rel_l2_error(y.cand, y.ref));
        err.bwd = std::max(err.bwd, rel_l2_error(dw.cand, dw.ref));
      }
  return err;
}

// The forward is a copy: any difference is a bug.
ProbeError tolerance(DType dt) {
  if (dt == DType::BF16) {
    constexpr ProbeError kBf16 = bf16_tolerance(kOp);  // the one table: src/backend/tolerances.h
    return kBf16;
  }
  return {0.0, 1e-6};
}

void run(const ImplDesc& impl, OpIO& io, bool backward) {
  const auto& t = *static_cast<const EmbeddingTable*>(impl.table);
  const DType dt = backend_dtype(impl.backend);
  const Device dev = backend_device(impl.backend);
  Tensor ids = io.input("ids", DType::I64, dev);
  ids = ids.reshape({ids.numel()});
  Tensor w = io.input("w", dt, dev);
  const int64_t T = ids.size(0);
  EmbeddingFwd f{ids, w, io.output("y", dt, dev, {T, w.ndim() == 2 ? w.size(1) : 0})};
  validate_fwd(f);
  t.forward(f);
  if (!backward) return;
  Tensor dy = io.input("dy", dt, dev);
  EmbeddingBwd b{ids, dy, io.output("dw", embedding_grad_dtype(dt), dev, w.shape())};
  validate_bwd(b);
  t.backward(b);
}
}  // namespace

int64_t embedding_plan_numel(int64_t T, int64_t D) {
  GDN_CHECK(T >= 0 && D >= 0,
            "{}: embedding_plan_numel needs T >= 0 and D >= 0, got T = {}, D = {}", kOp, T, D);
  return EmbeddingPlanLayout(T, D).numel;
}

void embedding_check_ids(const Tensor& ids, int64_t vocab) {
  GDN_CHECK(ids.device() == Device::CPU, "{}: embedding_check_ids needs host ids", kOp);
  const int64_t T = ids.numel();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = embedding_id(ids, t);
    GDN_CHECK_HINT(id >= 0 && id < vocab,
                   "token ids must be smaller than the model's vocab_size; check the tokenizer "
                   "and the dataset",
                   "{}: ids[{}] = {} is out of range [0, {})", kOp, t, id, vocab);
  }
}

void embedding_forward(const EmbeddingFwd& a) {
  validate_fwd(a);
  dispatch()
      .table<EmbeddingTable>(class_of(a.w, a.ids, all_aligned16(a.w, a.y), a.plan))
      .forward(a);
}

void embedding_backward(const EmbeddingBwd& a) {
  validate_bwd(a);
  dispatch()
      .table<EmbeddingTable>(class_of(a.dy, a.ids, all_aligned16(a.dy, a.dw), a.plan))
      .backward(a);
}

GDN_REGISTER(embedding_op) {
  OpDesc d;
  d.name = kOp;
  d.summary = "y[t] = W[ids[t]]; dW[v] += sum of dy over the tokens with id v (deterministic)";
  d.fwd_inputs = {"ids", "w"};
  d.fwd_outputs = {"y"};
  d.bwd_inputs = {"ids", "dy"};
  d.bwd_outputs = {"dw"};
  d.probe = probe;
  d.tolerance = tolerance;
  d.run = run;
  Registry::global().add_op(std::move(d));
}

}  // namespace gdn::ops
