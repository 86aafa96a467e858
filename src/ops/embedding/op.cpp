// Embedding: validation (including the id range), dispatch and the op's registration (probe,
// tolerance, file runner).
#include "ops/embedding/op.h"

#include "backend/tolerances.h"
#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"

namespace gdn::ops {

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

OpQuery query_for(const Tensor& t) { return OpQuery{infer_backend(t), "", {}}; }

// Probe: an odd width, ids repeated many times (including 0 and V-1) and rows never used, both id
// dtypes, dW accumulated onto nonzero values.
ProbeError probe(const ImplDesc& impl, const OpQuery&) {
  const auto& cand = *static_cast<const EmbeddingTable*>(impl.table);
  const auto& ref = *static_cast<const EmbeddingTable*>(Registry::global().ref(kOp).table);
  const int64_t V = 37, D = 19, T = 41;
  const DType gdt = embedding_grad_dtype(backend_dtype(impl.backend));
  ProbeError err;
  for (DType idt : {DType::I32, DType::I64}) {
    ProbeTensors p(impl.backend);
    std::vector<int64_t> idv(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) idv[static_cast<size_t>(t)] = (t * t * 7) % 13 * 3 % V;
    idv[0] = V - 1;
    auto ids = p.ints(idv, {T}, idt);
    auto w = p.normal({V, D}, 41, 1.0);
    auto dy = p.normal({T, D}, 42, 1.0);
    auto y = p.zeros({T, D});
    auto dw = p.normal({V, D}, 43, 1.0, gdt);
    ref.forward({ids.ref, w.ref, y.ref});
    cand.forward({ids.cand, w.cand, y.cand});
    ref.backward({ids.ref, dy.ref, dw.ref});
    cand.backward({ids.cand, dy.cand, dw.cand});
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
  Registry::global().table<EmbeddingTable>(kOp, query_for(a.w)).forward(a);
}

void embedding_backward(const EmbeddingBwd& a) {
  validate_bwd(a);
  Registry::global().table<EmbeddingTable>(kOp, query_for(a.dy)).backward(a);
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
