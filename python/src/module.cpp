// gdntrain._C: libgdn's op entry points for Python (docs/PYTHON.md). No libtorch: a tensor
// crosses as a tuple (data pointer, dtype name, shape, device index; -1 = host) describing
// contiguous memory the caller owns, which becomes a non-owning gdn::Tensor view; the op then runs
// through the same validation and resolver as in the C++ engine (src/ops/*/op.h), which picks the
// backend from the views (F64 host: ref, F32 host: cpu, device: cuda). `stream` is the caller's
// CUDA stream (cudaStream_t as an integer) for device tensors, ignored for host ones: libgdn's
// work is ordered after and before the caller's (StreamOrder, bridge.h). The PyTorch
// ops (python/gdntrain/torch) allocate every output and pass it in.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bridge.h"
#include "gdn/core/dtype.h"
#include "gdn/core/error.h"
#include "gdn/core/tensor.h"
#include "model/dump.h"
#include "model/probe_model.h"
#include "ops/causal_conv1d/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/linear_cross_entropy/op.h"
#include "ops/rmsnorm/op.h"
#include "ops/swiglu/op.h"
#include "text/tokenizer.h"
#include "train/config_tree.h"
#include "train/trainer.h"

namespace nb = nanobind;

namespace gdn::python {
namespace {

// A view of a (ptr, dtype, shape, device) tuple; None = an absent optional tensor.
Tensor view(nb::handle h, const char* name) {
  if (h.is_none()) return {};
  GDN_CHECK(nb::isinstance<nb::tuple>(h) && nb::len(h) == 4,
            "gdntrain._C: argument '{}' must be None or a (ptr, dtype, shape, device) tuple", name);
  const nb::tuple t = nb::borrow<nb::tuple>(h);
  const auto ptr = nb::cast<uintptr_t>(t[0]);
  const auto dt = nb::cast<std::string>(t[1]);
  const auto shape = nb::cast<std::vector<int64_t>>(t[2]);
  const int device = nb::cast<int>(t[3]);
  return Tensor(reinterpret_cast<void*>(ptr), dtype_from_name(dt), shape,
                device < 0 ? Device::CPU : Device::CUDA);
}

// Runs `f`: on the host without the GIL; on CUDA (device >= 0) ordered with the caller's stream
// (StreamOrder) and with the GIL held (the launches are asynchronous anyway).
template <class F>
void run(int device, uintptr_t stream, F&& f) {
  if (device >= 0) {
    const StreamOrder order(stream, device);
    f();
    return;
  }
  nb::gil_scoped_release release;
  f();
}

}  // namespace
}  // namespace gdn::python

NB_MODULE(_C, m) {
  using namespace gdn;
  using namespace gdn::python;
  using nb::handle;
  m.doc() = "gdntrain's ops on caller-owned memory (see docs/PYTHON.md); used by gdntrain.torch";
  m.def("cuda_built", &cuda_built, "True when this module was built with the CUDA backend");

  m.def(
      "rmsnorm_forward",
      [](handle x, handle w, handle y, handle rstd, double eps, bool zc, int dev, uintptr_t s) {
        const ops::RmsNormFwd a{view(x, "x"),       view(w, "w"), view(y, "y"),
                                view(rstd, "rstd"), eps,          zc};
        run(dev, s, [&] { ops::rmsnorm_forward(a); });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("y"), nb::arg("rstd"), nb::arg("eps"),
      nb::arg("zero_centred"), nb::arg("device"), nb::arg("stream"));
  m.def(
      "rmsnorm_backward",
      [](handle x, handle w, handle rstd, handle dy, handle dx, handle dw, bool zc, int dev,
         uintptr_t s) {
        const ops::RmsNormBwd a{view(x, "x"),
                                view(w, "w"),
                                view(rstd, "rstd"),
                                view(dy, "dy"),
                                view(dx, "dx"),
                                view(dw, "dw"),
                                zc};
        run(dev, s, [&] { ops::rmsnorm_backward(a); });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("rstd"), nb::arg("dy"), nb::arg("dx"), nb::arg("dw"),
      nb::arg("zero_centred"), nb::arg("device"), nb::arg("stream"));

  m.def(
      "swiglu_forward",
      [](handle gate, handle up, handle y, int dev, uintptr_t s) {
        const ops::SwigluFwd a{view(gate, "gate"), view(up, "up"), view(y, "y")};
        run(dev, s, [&] { ops::swiglu_forward(a); });
      },
      nb::arg("gate"), nb::arg("up"), nb::arg("y"), nb::arg("device"), nb::arg("stream"));
  m.def(
      "swiglu_backward",
      [](handle gate, handle up, handle dy, handle dgate, handle dup, int dev, uintptr_t s) {
        const ops::SwigluBwd a{view(gate, "gate"), view(up, "up"), view(dy, "dy"),
                               view(dgate, "dgate"), view(dup, "dup")};
        run(dev, s, [&] { ops::swiglu_backward(a); });
      },
      nb::arg("gate"), nb::arg("up"), nb::arg("dy"), nb::arg("dgate"), nb::arg("dup"),
      nb::arg("device"), nb::arg("stream"));

  m.def(
      "gated_rmsnorm_forward",
      [](handle x, handle z, handle w, handle y, handle rstd, double eps, int dev, uintptr_t s) {
        const ops::GatedRmsNormFwd a{view(x, "x"), view(z, "z"),       view(w, "w"),
                                     view(y, "y"), view(rstd, "rstd"), eps};
        run(dev, s, [&] { ops::gated_rmsnorm_forward(a); });
      },
      nb::arg("x"), nb::arg("z"), nb::arg("w"), nb::arg("y"), nb::arg("rstd"), nb::arg("eps"),
      nb::arg("device"), nb::arg("stream"));
  m.def(
      "gated_rmsnorm_backward",
      [](handle x, handle z, handle w, handle rstd, handle dy, handle dx, handle dz, handle dw,
         int dev, uintptr_t s) {
        const ops::GatedRmsNormBwd a{view(x, "x"),       view(z, "z"),   view(w, "w"),
                                     view(rstd, "rstd"), view(dy, "dy"), view(dx, "dx"),
                                     view(dz, "dz"),     view(dw, "dw")};
        run(dev, s, [&] { ops::gated_rmsnorm_backward(a); });
      },
      nb::arg("x"), nb::arg("z"), nb::arg("w"), nb::arg("rstd"), nb::arg("dy"), nb::arg("dx"),
      nb::arg("dz"), nb::arg("dw"), nb::arg("device"), nb::arg("stream"));

  m.def(
      "causal_conv1d_forward",
      [](handle x, handle weight, handle bias, handle cu_seqlens, handle initial_state, handle y,
         handle final_state, bool silu, int dev, uintptr_t s) {
        const ops::CausalConv1dFwd a{view(x, "x"),
                                     view(weight, "weight"),
                                     view(bias, "bias"),
                                     view(cu_seqlens, "cu_seqlens"),
                                     view(initial_state, "initial_state"),
                                     view(y, "y"),
                                     view(final_state, "final_state"),
                                     silu};
        run(dev, s, [&] { ops::causal_conv1d_forward(a); });
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(), nb::arg("cu_seqlens").none(),
      nb::arg("initial_state").none(), nb::arg("y"), nb::arg("final_state").none(), nb::arg("silu"),
      nb::arg("device"), nb::arg("stream"));
  m.def(
      "causal_conv1d_backward",
      [](handle x, handle weight, handle bias, handle cu_seqlens, handle initial_state, handle dy,
         handle dfinal_state, handle dx, handle dweight, handle dbias, handle dinitial_state,
         bool silu, int dev, uintptr_t s) {
        const ops::CausalConv1dBwd a{view(x, "x"),
                                     view(weight, "weight"),
                                     view(bias, "bias"),
                                     view(cu_seqlens, "cu_seqlens"),
                                     view(initial_state, "initial_state"),
                                     view(dy, "dy"),
                                     view(dfinal_state, "dfinal_state"),
                                     view(dx, "dx"),
                                     view(dweight, "dweight"),
                                     view(dbias, "dbias"),
                                     view(dinitial_state, "dinitial_state"),
                                     silu};
        run(dev, s, [&] { ops::causal_conv1d_backward(a); });
      },
      nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(), nb::arg("cu_seqlens").none(),
      nb::arg("initial_state").none(), nb::arg("dy"), nb::arg("dfinal_state").none(), nb::arg("dx"),
      nb::arg("dweight"), nb::arg("dbias").none(), nb::arg("dinitial_state").none(),
      nb::arg("silu"), nb::arg("device"), nb::arg("stream"));

  m.def(
      "gated_delta_rule_forward",
      [](handle q, handle k, handle v, handle g, handle beta, handle cu_seqlens, handle h0,
         handle o, handle hT, double scale, bool l2norm, int dev, uintptr_t s) {
        ops::GatedDeltaRuleFwd a{};
        a.q = view(q, "q");
        a.k = view(k, "k");
        a.v = view(v, "v");
        a.g = view(g, "g");
        a.beta = view(beta, "beta");
        a.cu_seqlens = view(cu_seqlens, "cu_seqlens");
        a.h0 = view(h0, "initial_state");
        a.o = view(o, "o");
        a.hT = view(hT, "final_state");
        a.scale = scale;
        a.use_qk_l2norm = l2norm;
        run(dev, s, [&] { ops::gated_delta_rule_forward(a); });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
      nb::arg("cu_seqlens"), nb::arg("h0").none(), nb::arg("o"), nb::arg("hT").none(),
      nb::arg("scale"), nb::arg("use_qk_l2norm"), nb::arg("device"), nb::arg("stream"));
  m.def(
      "gated_delta_rule_backward",
      [](handle q, handle k, handle v, handle g, handle beta, handle cu_seqlens, handle h0,
         handle dout, handle dhT, handle dq, handle dk, handle dv, handle dg, handle dbeta,
         handle dh0, double scale, bool l2norm, int dev, uintptr_t s) {
        ops::GatedDeltaRuleBwd a{};
        a.q = view(q, "q");
        a.k = view(k, "k");
        a.v = view(v, "v");
        a.g = view(g, "g");
        a.beta = view(beta, "beta");
        a.cu_seqlens = view(cu_seqlens, "cu_seqlens");
        a.h0 = view(h0, "initial_state");
        a.dout = view(dout, "do");
        a.dhT = view(dhT, "dfinal_state");
        a.dq = view(dq, "dq");
        a.dk = view(dk, "dk");
        a.dv = view(dv, "dv");
        a.dg = view(dg, "dg");
        a.dbeta = view(dbeta, "dbeta");
        a.dh0 = view(dh0, "dinitial_state");
        a.scale = scale;
        a.use_qk_l2norm = l2norm;
        run(dev, s, [&] { ops::gated_delta_rule_backward(a); });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
      nb::arg("cu_seqlens"), nb::arg("h0").none(), nb::arg("dout"), nb::arg("dhT").none(),
      nb::arg("dq"), nb::arg("dk"), nb::arg("dv"), nb::arg("dg"), nb::arg("dbeta"),
      nb::arg("dh0").none(), nb::arg("scale"), nb::arg("use_qk_l2norm"), nb::arg("device"),
      nb::arg("stream"));

  // reduction: 0 mean, 1 sum, 2 none (ops::LceReduction). With dx = None: the forward only.
  m.def(
      "linear_cross_entropy",
      [](handle x, handle w, handle targets, handle loss, handle lse, handle z_loss, handle dloss,
         handle dx, handle dw, int reduction, double z_loss_scale, double label_smoothing, int dev,
         uintptr_t s) {
        GDN_CHECK(reduction >= 0 && reduction <= 2,
                  "linear_cross_entropy: reduction {} is not 0 "
                  "(mean), 1 (sum) or 2 (none)",
                  reduction);
        ops::LinearCrossEntropyArgs a{};
        a.x = view(x, "x");
        a.w = view(w, "w");
        a.targets = view(targets, "targets");
        a.loss = view(loss, "loss");
        a.lse = view(lse, "lse");
        a.z_loss = view(z_loss, "z_loss");
        a.dloss = view(dloss, "dloss");
        a.dx = view(dx, "dx");
        a.dw = view(dw, "dw");
        a.reduction = static_cast<ops::LceReduction>(reduction);
        a.z_loss_scale = z_loss_scale;
        a.label_smoothing = label_smoothing;
        const bool backward = a.dx.defined();
        run(dev, s, [&] {
          if (backward)
            ops::linear_cross_entropy_forward_backward(a);
          else
            ops::linear_cross_entropy_forward(a);
        });
      },
      nb::arg("x"), nb::arg("w"), nb::arg("targets"), nb::arg("loss"), nb::arg("lse"),
      nb::arg("z_loss"), nb::arg("dloss").none(), nb::arg("dx").none(), nb::arg("dw").none(),
      nb::arg("reduction"), nb::arg("z_loss_scale"), nb::arg("label_smoothing"), nb::arg("device"),
      nb::arg("stream"));

  // The tokenizer of `gdntrain tokenize` and `prepare` (src/text/tokenizer.h): an HF
  // tokenizer.json's BPE (ByteLevel), exact against HF `tokenizers` (tests/text).
  nb::class_<text::Tokenizer>(m, "Tokenizer")
      .def_static("from_file", &text::Tokenizer::from_file, nb::arg("path"))
      .def(
          "encode", [](const text::Tokenizer& t, const std::string& s) { return t.encode(s); },
          nb::arg("text"))
      .def(
          "decode",
          [](const text::Tokenizer& t, const std::vector<int32_t>& ids) { return t.decode(ids); },
          nb::arg("ids"))
      .def("vocab_size", &text::Tokenizer::vocab_size)
      .def(
          "token_to_id",
          [](const text::Tokenizer& t, const std::string& token) { return t.token_to_id(token); },
          nb::arg("token"))
      .def("describe", &text::Tokenizer::describe);

  // `gdntrain probe --model`: every (op, shape class) one training step of the model resolves on
  // `backend` (model/probe_model.h), as JSON text: a list of {op, backend, shape_class, impl,
  // fwd_err, bwd_err, probe_ms, rejected}. `model` is "tiny" (the built-in default) or a
  // config.json / checkpoint directory.
  m.def(
      "probe_model",
      [](const std::string& model, const std::string& backend, const std::string& recompute) {
        const model::Qwen35Config cfg =
            model == "tiny" ? model::tiny_config() : model::load_model_config(model);
        const Backend b = backend_from_name(backend);
        std::vector<Registry::Decision> ds;
        {
          nb::gil_scoped_release release;
          ds = model::probe_model(cfg, b, model::recompute_from_name(recompute));
        }
        nlohmann::json out = nlohmann::json::array();
        for (const Registry::Decision& d : ds)
          out.push_back({{"op", d.op},
                         {"backend", std::string(backend_name(b))},
                         {"shape_class", d.query.shape_class},
                         {"impl", d.result.impl->name},
                         {"fwd_err", d.result.error.fwd},
                         {"bwd_err", d.result.error.bwd},
                         {"probe_ms", d.result.probe_ms},
                         {"rejected", d.result.rejected}});
        return out.dump();
      },
      nb::arg("model"), nb::arg("backend"), nb::arg("recompute"));

  // `gdntrain dump` (model/dump.h): the logits, per-document losses and parameter gradients of an
  // HF checkpoint on the documents of a safetensors file, returned as NumPy arrays over the dump's
  // own host memory (no copy; each array keeps its tensor alive, and torch.from_numpy or any
  // DLPack consumer takes it without a copy either), with the mean loss and the counts.
  m.def(
      "dump",
      [](const std::string& model_dir, const std::string& docs, const std::string& backend) {
        model::DumpResult r;
        {
          nb::gil_scoped_release release;
          r = model::dump(model_dir, docs, backend_from_name(backend));
        }
        nb::dict arrays;
        for (auto& [name, t] : r.tensors) {
          GDN_CHECK(t.view().dtype() == DType::F32 && t.view().device() == Device::CPU,
                    "gdntrain.dump: tensor '{}' is not F32 on the host", name);
          auto* owned = new OwnedTensor(std::move(t));
          nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<OwnedTensor*>(p); });
          std::vector<size_t> shape;
          for (int64_t d : owned->view().shape_vec()) shape.push_back(static_cast<size_t>(d));
          arrays[name.c_str()] = nb::ndarray<nb::numpy, float>(owned->view().data(), shape.size(),
                                                               shape.data(), owner);
        }
        return nb::make_tuple(arrays, r.mean_loss, r.tokens, r.docs);
      },
      nb::arg("model_dir"), nb::arg("docs"), nb::arg("backend"));

  // The trainer (src/train/trainer.h), as `gdntrain train` runs it (apps/gdntrain/cmd_train.cpp):
  // the built-in defaults, then `config_json` (a JSON object's text, may be empty) or the file
  // `config_path`, then each "key=value" of `sets`. `on_step` gets each step's metrics record as
  // JSON text (called with the GIL; training runs without it). Returns the result as JSON text.
  m.def("default_train_config", [] { return train::default_train_config().dump(); });
  m.def(
      "train",
      [](const std::string& config_json, const std::string& config_path,
         const std::vector<std::string>& sets, nb::object on_step, bool resume, bool quiet,
         int64_t stop_after) {
        train::ConfigTree cfg(train::default_train_config());
        if (!config_json.empty()) cfg.merge_text(config_json, true, "<python config>");
        if (!config_path.empty()) cfg.merge_file(config_path);
        for (const auto& s : sets) cfg.set(s);
        train::TrainOptions to;
        to.resume = resume;
        to.quiet = quiet;
        to.stop_after = stop_after;
        if (!on_step.is_none())
          to.on_step = [on_step](const nlohmann::json& rec) {
            nb::gil_scoped_acquire gil;
            on_step(rec.dump());
          };
        train::TrainResult r;
        {
          nb::gil_scoped_release release;
          r = train::run_training(cfg, to);
        }
        nlohmann::json out = {
            {"steps_done", r.steps_done},       {"final_loss", r.final_loss},
            {"eval_loss", r.eval_loss},         {"eval_accuracy", r.eval_accuracy},
            {"skipped_steps", r.skipped_steps}, {"losses", r.losses}};
        return out.dump();
      },
      nb::arg("config_json"), nb::arg("config_path"), nb::arg("sets"), nb::arg("on_step").none(),
      nb::arg("resume"), nb::arg("quiet"), nb::arg("stop_after"));
}
