// Helpers shared by the dense-op tests (gemm, swiglu, embedding, adamw): expect_error (from
// support/op_test_util.h) and a round trip through `gdntrain ops run`'s file runner.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include "gdn/backend/op_run.h"
#include "gdn/core/error.h"
#include "gdn/core/safetensors.h"
#include "gdn/core/tensor.h"
#include "support/op_test_util.h"

namespace gdn::testing {

// Writes `inputs` to a temporary safetensors file, runs `op` through run_op_file on `backend` and
// returns the output file's tensors as host F64 (integers stay as they are).
inline std::map<std::string, OwnedTensor> run_op_via_file(
    const std::string& op, Backend backend, const std::vector<std::pair<std::string, Tensor>>& in,
    bool backward, const std::map<std::string, double>& attrs) {
  const std::string base = ::testing::TempDir() + "gdn_" + op + "_" + std::to_string(::getpid());
  std::vector<NamedTensor> named;
  for (const auto& [name, t] : in) named.push_back(NamedTensor{name, t, {}, {}, nullptr, 0});
  write_safetensors(base + "_in.safetensors", named);
  OpRunResult r = run_op_file(op, backend, base + "_in.safetensors", base + "_out.safetensors",
                              backward, attrs);
  SafeTensorsFile out(base + "_out.safetensors");
  std::map<std::string, OwnedTensor> result;
  for (const auto& info : out.tensors()) {
    DType dt = dtype_is_float(info.dtype) ? DType::F64 : info.dtype;
    result.emplace(info.name, out.load(info.name, dt));
  }
  EXPECT_EQ(result.size(), r.written.size());
  ::unlink((base + "_in.safetensors").c_str());
  ::unlink((base + "_out.safetensors").c_str());
  return result;
}

}  // namespace gdn::testing
