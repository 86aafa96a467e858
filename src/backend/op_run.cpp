#include "gdn/backend/op_run.h"

#include <cstdlib>

#include "gdn/core/safetensors.h"

namespace gdn {

namespace {
class FileOpIO final : public OpIO {
 public:
  FileOpIO(const SafeTensorsFile& in, const std::string& op,
           const std::map<std::string, double>& attrs)
      : in_(in), op_(op) {
    for (const auto& [k, v] : in.metadata()) {
      char* end = nullptr;
      double x = std::strtod(v.c_str(), &end);
      if (end != v.c_str() && *end == '\0') attrs_[k] = x;
    }
    for (const auto& [k, v] : attrs) attrs_[k] = v;
  }
  Tensor input(const std::string& name, DType dtype, Device device) override {
    GDN_CHECK_HINT(
        in_.contains(name), fmt::format("`gdntrain ops list` shows the tensors op '{}' reads", op_),
        "{}: op '{}' needs input tensor '{}' which the file does not have", in_.path(), op_, name);
    kept_.push_back(in_.load(name, dtype, device));
    return kept_.back().view();
  }
  bool has_input(const std::string& name) const override { return in_.contains(name); }
  Tensor output(const std::string& name, DType dtype, Device device,
                std::span<const int64_t> shape) override {
    GDN_CHECK(!outputs_.contains(name), "op '{}' wrote output '{}' twice", op_, name);
    OwnedTensor t = OwnedTensor::zeros(dtype, shape, device);
    Tensor v = t.view();
    outputs_.emplace(name, std::move(t));
    return v;
  }
  double attr(const std::string& name, double dflt) const override {
    auto it = attrs_.find(name);
    return it == attrs_.end() ? dflt : it->second;
  }
  std::map<std::string, OwnedTensor>& outputs() { return outputs_; }

 private:
  const SafeTensorsFile& in_;
  std::string op_;
  std::map<std::string, double> attrs_;
  std::vector<OwnedTensor> kept_;
  std::map<std::string, OwnedTensor> outputs_;
};
}  // namespace

OpRunResult run_op_file(const std::string& op_name, Backend backend, const std::string& in_path,
                        const std::string& out_path, bool backward,
                        const std::map<std::string, double>& attrs) {
  Registry& reg = Registry::global();
  const OpDesc& op = reg.op(op_name);
  GDN_CHECK(op.run, "op '{}' cannot be run from files", op_name);
  SafeTensorsFile in(in_path);
  OpQuery q;
  q.backend = backend;
  const Resolution& r = reg.resolve(op_name, q);
  FileOpIO io(in, op_name, attrs);
  op.run(*r.impl, io, backward);
  device_synchronize(backend_device(backend));
  std::vector<NamedTensor> out;
  OpRunResult result;
  result.impl = r.impl->name;
  for (auto& [name, t] : io.outputs()) {
    out.push_back(NamedTensor{name, t.view(), {}, {}, nullptr, 0});
    result.written.push_back(name);
  }
  write_safetensors(out_path, out, {{"op", op_name}, {"impl", r.impl->name}});
  return result;
}

}  // namespace gdn
