// Shared helpers of the GPU op tests of the memory-bound ops (label gpu): a fixture that fails
// plainly when there is no device, NaN-poisoned device outputs (an element a kernel forgets to
// write fails the comparison as non-finite), inputs rounded to their device dtype (so ref and cuda
// see the same numbers and the measured error is the kernel's alone), bitwise comparisons, the
// resolver check, `ops run` through a temporary safetensors file, and unaligned device views.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gdn/backend/op_run.h"
#include "gdn/backend/registry.h"
#include "gdn/core/safetensors.h"
#include "gdn/core/tensor.h"
#include "support/op_test_util.h"

namespace gdn::testing {

class CudaOpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

// A device tensor whose every element is NaN.
inline OwnedTensor poisoned(DType dt, std::span<const int64_t> shape) {
  Tensor probe(nullptr, dt, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()),
                        std::numeric_limits<double>::quiet_NaN());
  return from_f64(v, dt, shape, Device::CUDA);
}
inline OwnedTensor poisoned(DType dt, std::initializer_list<int64_t> shape) {
  return poisoned(dt, std::span<const int64_t>(shape.begin(), shape.size()));
}

// F64 host values already rounded through `dt`.
inline OwnedTensor randn_as(std::initializer_list<int64_t> shape, uint64_t seed, DType dt,
                            double std = 1.0, double mean = 0.0) {
  return rounded(randn(shape, seed, std, mean), dt);
}
inline OwnedTensor randu_as(std::initializer_list<int64_t> shape, uint64_t seed, DType dt,
                            double lo, double hi) {
  return rounded(randu(shape, seed, lo, hi), dt);
}

inline OwnedTensor to_dev(const Tensor& t, DType dt) { return convert(t, dt, Device::CUDA); }
inline OwnedTensor to_f64(const Tensor& t) { return convert(t, DType::F64); }

// Same dtype, same bytes (copied to the host first).
inline void expect_bitwise_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.numel(), want.numel()) << what;
  OwnedTensor a = convert(got, got.dtype()), b = convert(want, want.dtype());
  EXPECT_EQ(std::memcmp(a.view().data(), b.view().data(), static_cast<size_t>(a.view().nbytes())),
            0)
      << what << " differs bitwise";
}

// The resolver picks `impl` for `op` on cuda in shape class `query` (the op's default class when
// not given) with a probe error within `tol` and no implementation skipped or rejected; outputs
// rounded to bf16 cannot match fp64 exactly, so a zero error where `*_nonzero` is set would mean
// the probe compared nothing.
inline void expect_resolves_to_cuda(const std::string& op, const std::string& impl, ProbeError tol,
                                    bool fwd_nonzero, bool bwd_nonzero,
                                    const OpQuery& query = OpQuery{Backend::Cuda, "", {}}) {
  const Resolution& r = Registry::global().resolve(op, query);
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, impl);
  EXPECT_EQ(r.impl->backend, Backend::Cuda);
  EXPECT_LE(r.error.fwd, tol.fwd) << op << " probe forward error";
  EXPECT_LE(r.error.bwd, tol.bwd) << op << " probe backward error";
  if (fwd_nonzero) {
    EXPECT_GT(r.error.fwd, 0.0) << op << ": the probe compared no rounded output";
  }
  if (bwd_nonzero) {
    EXPECT_GT(r.error.bwd, 0.0) << op << ": the probe compared no rounded gradient";
  }
  EXPECT_TRUE(r.rejected.empty()) << r.rejected.front();
}

// The registered cuda implementation `name` of `op` (its function table), or null.
template <class Table>
const Table* cuda_table(const std::string& op, const std::string& name) {
  for (const ImplDesc* i : Registry::global().impls(op, Backend::Cuda))
    if (i->name == name) return static_cast<const Table*>(i->table);
  return nullptr;
}

// In a private registry (the global one is untouched) holding the op, its ref and its registered
// cuda implementations, adds the deliberately wrong implementations `wrong` (name, table) above
// them in priority and checks that the resolver rejects each one by its probe in shape class
// `query` (the op's default class when not given) and picks `real`, which that class supports.
inline void expect_probe_rejects(const std::string& op, const std::string& real,
                                 const std::vector<std::pair<std::string, const void*>>& wrong,
                                 const OpQuery& query = OpQuery{Backend::Cuda, "", {}}) {
  Registry reg;
  reg.add_op(Registry::global().op(op));
  reg.add_impl(Registry::global().ref(op));
  for (const ImplDesc* i : Registry::global().impls(op, Backend::Cuda)) reg.add_impl(*i);
  int priority = 100;
  for (const auto& [name, table] : wrong)
    reg.add_impl({op, name, Backend::Cuda, priority++, nullptr, table});
  const Resolution& r = reg.resolve(op, query);
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, real);
  ASSERT_EQ(r.rejected.size(), wrong.size());
  for (const auto& [name, table] : wrong) {
    bool found = false;
    for (const std::string& line : r.rejected)
      found = found || line.find("rejecting " + name + ": probe error") != std::string::npos;
    EXPECT_TRUE(found) << name << " was not rejected by its probe error";
  }
}

// Writes `inputs` to a temporary safetensors file, runs `op` through run_op_file on the cuda
// backend and returns the output file (read while the returned object lives).
class OpsRunOnCuda {
 public:
  OpsRunOnCuda(const std::string& op, const std::vector<std::pair<std::string, Tensor>>& inputs,
               bool backward, const std::map<std::string, double>& attrs = {}) {
    namespace fs = std::filesystem;
    dir_ = fs::temp_directory_path() / (op + "_cuda_" + std::to_string(getpid()));
    fs::create_directories(dir_);
    const std::string in = (dir_ / "in.safetensors").string(),
                      out = (dir_ / "out.safetensors").string();
    std::vector<NamedTensor> named;
    for (const auto& [name, t] : inputs) named.push_back({name, t, {}, {}, nullptr, 0});
    write_safetensors(in, named);
    result_ = run_op_file(op, Backend::Cuda, in, out, backward, attrs);
    file_ = std::make_unique<SafeTensorsFile>(out);
  }
  ~OpsRunOnCuda() {
    file_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  const OpRunResult& result() const { return result_; }
  OwnedTensor load(const std::string& name) const { return file_->load(name, DType::F64); }

 private:
  std::filesystem::path dir_;
  OpRunResult result_;
  std::unique_ptr<SafeTensorsFile> file_;
};

// A device view of `src`'s values starting `offset_bytes` past a 16-byte boundary (the scalar
// paths); the buffer is kept in `keep`.
inline Tensor unaligned_copy(const Tensor& src, int offset_bytes, std::vector<OwnedTensor>& keep) {
  const int64_t es = dtype_size(src.dtype());
  const int64_t extra = (16 + es - 1) / es + 1;
  OwnedTensor buf = OwnedTensor::zeros(src.dtype(), {src.numel() + extra}, Device::CUDA);
  Tensor v(static_cast<char*>(buf.view().data()) + offset_bytes, src.dtype(), src.shape(),
           Device::CUDA);
  copy_into(v, src);
  keep.push_back(std::move(buf));
  return v;
}

// Message of the gdn::Error `fn` throws ("" and a test failure when it does not throw).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a gdn::Error";
  return "";
}

}  // namespace gdn::testing
