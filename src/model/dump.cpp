#include "model/dump.h"

#include <cstring>

#include "gdn/core/log.h"
#include "gdn/core/safetensors.h"
#include "model/qwen35.h"
#include "model/weights.h"

namespace gdn::model {

DumpResult dump(const std::string& model_dir, const std::string& docs_path, Backend backend) {
  HfCheckpoint ck = load_hf_checkpoint(model_dir);
  SafeTensorsFile docs_file(docs_path);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t i = 0;; ++i) {
    std::string name = fmt::format("doc{}.input_ids", i);
    if (!docs_file.contains(name)) break;
    Tensor v = docs_file.view(name);
    GDN_CHECK(v.ndim() == 1 && v.numel() >= 1, "{}: '{}' must be a non-empty 1-D tensor, got {}",
              docs_path, name, v.shape_str());
    GDN_CHECK(v.dtype() == DType::I64 || v.dtype() == DType::I32,
              "{}: '{}' must be I64 or I32, got {}", docs_path, name, dtype_name(v.dtype()));
    OwnedTensor ids = docs_file.load(name, DType::I64);
    std::vector<int32_t> d;
    for (int64_t t = 0; t < ids.numel(); ++t) {
      int64_t id = ids.ptr<int64_t>()[t];
      GDN_CHECK(id >= 0 && id < ck.config.vocab_size,
                "{}: '{}'[{}] = {} is outside the vocabulary [0, {})", docs_path, name, t, id,
                ck.config.vocab_size);
      d.push_back(static_cast<int32_t>(id));
    }
    docs.push_back(std::move(d));
  }
  GDN_CHECK_HINT(!docs.empty(), "name the tensors doc0.input_ids, doc1.input_ids, ...",
                 "{}: no tensor 'doc0.input_ids'", docs_path);
  for (const auto& t : docs_file.tensors()) {
    GDN_CHECK(
        t.name.starts_with("doc") && t.name.ends_with(".input_ids") &&
            std::stoll(t.name.substr(3)) < static_cast<long long>(docs.size()),
        "{}: unexpected tensor '{}' (documents must be numbered doc0, doc1, ... without gaps)",
        docs_path, t.name);
  }
  // One micro-batch holding every document whole, in file order.
  const MicroBatch mb = micro_batch_of_documents(docs);
  const int64_t T = mb.num_tokens(), V = ck.config.vocab_size;
  Qwen35Model m(ck.config, backend, T, mb.num_segments());
  log::info("{}", m.memory_plan());
  m.load_params(ck.params);
  const DType act = backend_dtype(backend),
              stat = backend == Backend::Ref ? DType::F64 : DType::F32;
  OwnedTensor logits = OwnedTensor::zeros(act, {T, V}, backend_device(backend));
  OwnedTensor token_loss = OwnedTensor::zeros(stat, {T}, backend_device(backend));
  StepOptions opt;
  opt.backward = true;
  opt.logits = logits;
  opt.token_loss = token_loss;
  StepStats st = m.step(mb, opt);

  DumpResult r;
  r.mean_loss = st.loss;
  r.tokens = T;
  r.docs = mb.num_segments();
  OwnedTensor lg = convert(logits, DType::F32);
  auto tl = to_f64_vector(token_loss);
  for (int64_t i = 0; i < mb.num_segments(); ++i) {
    const int64_t b = mb.cu_seqlens[static_cast<size_t>(i)],
                  e = mb.cu_seqlens[static_cast<size_t>(i) + 1];
    OwnedTensor out = OwnedTensor::empty(DType::F32, {e - b, V});
    std::memcpy(out.view().data(), lg.ptr<float>() + b * V, static_cast<size_t>((e - b) * V) * 4);
    r.tensors.emplace(fmt::format("doc{}.logits", i), std::move(out));
    double sum = 0;
    for (int64_t t = b; t < e; ++t) sum += tl[static_cast<size_t>(t)];
    std::vector<double> one = {sum};
    r.tensors.emplace(fmt::format("doc{}.loss_sum", i), from_f64(one, DType::F32, {1}));
  }
  for (size_t i = 0; i < m.specs().size(); ++i) {
    const ParamSpec& s = m.specs()[i];
    OwnedTensor g = OwnedTensor::empty(DType::F32, s.shape);
    m.read_grad(i, g);
    r.tensors.emplace("grad." + hf_name(s.name, ck.extras.prefix), std::move(g));
  }
  return r;
}

void dump_to_file(const std::string& model_dir, const std::string& docs_path,
                  const std::string& out_path, Backend backend) {
  DumpResult r = dump(model_dir, docs_path, backend);
  std::vector<NamedTensor> out;
  for (auto& [name, t] : r.tensors) out.push_back({name, t.view(), {}, {}, nullptr, 0});
  write_safetensors(out_path, out, {{"backend", std::string(backend_name(backend))}});
  log::info("dump: {} documents, {} tokens, mean loss {:.6f}; wrote {} tensors to {}", r.docs,
            r.tokens, r.mean_loss, out.size(), out_path);
}

}  // namespace gdn::model
