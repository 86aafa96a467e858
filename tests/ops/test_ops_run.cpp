// `gdntrain ops run` end to end for the norm ops: write an input safetensors file, run the CLI
// binary, read its output file and compare with the ref op called directly. Also: attributes from
// file metadata and from --attr, and a missing input tensor giving a non-zero exit and a message
// that names the tensor.
#include <gmock/gmock.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gdn/core/safetensors.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/l2norm/op.h"
#include "ops/rmsnorm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::randn;

class OpsRun : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("gdn_ops_run_" + std::to_string(getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes F32 copies of `tensors` (F64 host tensors) to `name`.
  std::string write_input(const std::string& name,
                          const std::vector<std::pair<std::string, Tensor>>& tensors,
                          const std::map<std::string, std::string>& metadata = {}) {
    std::vector<OwnedTensor> keep;
    std::vector<NamedTensor> out;
    keep.reserve(tensors.size());
    for (const auto& [n, t] : tensors) {
      keep.push_back(convert(t, DType::F32));
      out.push_back(NamedTensor{n, keep.back().view(), {}, {}, nullptr, 0});
    }
    write_safetensors(path(name), out, metadata);
    return path(name);
  }

  // Runs the CLI with `args`; stdout and stderr go to files in the temp dir. Returns the exit code.
  int run_cli(const std::string& args) {
    const std::string cmd = std::string("'") + GDN_GDNTRAIN_BIN + "' " + args + " > '" +
                            path("stdout.txt") + "' 2> '" + path("stderr.txt") + "'";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string read_text(const std::string& name) const {
    std::ifstream f(path(name));
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  // Runs `ops run` and returns the output file (the test fails if the command does).
  std::string ops_run(const std::string& op, const std::string& in, const std::string& backend,
                      const std::string& extra = "") {
    const std::string out = path(op + "_" + backend + "_out.safetensors");
    const int rc = run_cli("ops run " + op + " --in '" + in + "' --out '" + out + "' --backend " +
                           backend + " --backward " + extra);
    EXPECT_EQ(rc, 0) << read_text("stdout.txt") << read_text("stderr.txt");
    return out;
  }

  fs::path dir_;
};

// Every output of the file equals `want` (the ref op's result) within tol: 0 for the ref backend
// (the same code on the same numbers), fp32-vs-fp64 tolerance for cpu.
void expect_outputs(const std::string& out_path,
                    const std::vector<std::pair<std::string, Tensor>>& want, double tol) {
  SafeTensorsFile f(out_path);
  EXPECT_EQ(f.tensors().size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(f.contains(name)) << "output file lacks '" << name << "'";
    OwnedTensor got = f.load(name, DType::F64);
    EXPECT_EQ(got.numel(), t.numel()) << name;
    testing::expect_close(got, t, tol, name);
  }
}

TEST_F(OpsRun, RmsNormZeroCentredFromFileMetadata) {
  const int64_t T = 2, H = 3, D = 16, R = T * H;
  // Inputs rounded to F32 (what the file holds), so ref sees exactly the file's numbers.
  auto x = testing::rounded(randn({T, H, D}, 1, 2.0), DType::F32);
  auto w = testing::rounded(randn({D}, 2, 0.1), DType::F32);  // ~0: zero-centred uses 1 + w
  auto dy = testing::rounded(randn({T, H, D}, 3), DType::F32);
  const std::string in = write_input("rms.safetensors", {{"x", x}, {"w", w}, {"dy", dy}},
                                     {{"zero_centred", "1"}, {"eps", "1e-5"}});
  for (bool zc : {true, false}) {
    auto xr = x.view().reshape({R, D}), dyr = dy.view().reshape({R, D});
    auto y = OwnedTensor::zeros(DType::F64, {R, D}), rstd = OwnedTensor::zeros(DType::F64, {R});
    auto dx = OwnedTensor::zeros(DType::F64, {R, D}), dw = OwnedTensor::zeros(DType::F64, {D});
    rmsnorm_forward({xr, w, y, rstd, 1e-5, zc});
    rmsnorm_backward({xr, w, rstd, dyr, dx, dw, zc});
    // zero_centred=1 comes from the file; --attr overrides it for the plain case.
    const std::string extra = zc ? "" : "--attr zero_centred=0";
    std::vector<std::pair<std::string, Tensor>> want{
        {"y", y}, {"rstd", rstd}, {"dx", dx}, {"dw", dw}};
    expect_outputs(ops_run("rmsnorm", in, "cpu", extra), want, 1e-5);
    expect_outputs(ops_run("rmsnorm", in, "ref", extra), want, 0.0);
  }
}

TEST_F(OpsRun, GatedRmsNorm) {
  const int64_t T = 4, Hv = 2, D = 16, R = T * Hv;
  auto x = testing::rounded(randn({T, Hv, D}, 4, 2.0), DType::F32);
  auto z = testing::rounded(randn({T, Hv, D}, 5, 3.0), DType::F32);
  auto w = testing::rounded(randn({D}, 6, 0.2, 1.0), DType::F32);
  auto dy = testing::rounded(randn({T, Hv, D}, 7), DType::F32);
  const std::string in =
      write_input("gated.safetensors", {{"x", x}, {"z", z}, {"w", w}, {"dy", dy}});
  auto xr = x.view().reshape({R, D}), zr = z.view().reshape({R, D});
  auto dyr = dy.view().reshape({R, D});
  auto y = OwnedTensor::zeros(DType::F64, {R, D}), rstd = OwnedTensor::zeros(DType::F64, {R});
  auto dx = OwnedTensor::zeros(DType::F64, {R, D}), dz = OwnedTensor::zeros(DType::F64, {R, D});
  auto dw = OwnedTensor::zeros(DType::F64, {D});
  gated_rmsnorm_forward({xr, zr, w, y, rstd, 1e-6});
  gated_rmsnorm_backward({xr, zr, w, rstd, dyr, dx, dz, dw});
  std::vector<std::pair<std::string, Tensor>> want{
      {"y", y}, {"rstd", rstd}, {"dx", dx}, {"dz", dz}, {"dw", dw}};
  expect_outputs(ops_run("gated_rmsnorm", in, "cpu"), want, 1e-5);
  expect_outputs(ops_run("gated_rmsnorm", in, "ref"), want, 0.0);
}

TEST_F(OpsRun, L2Norm) {
  const int64_t T = 4, H = 3, D = 8, R = T * H;
  auto x = testing::rounded(randn({T, H, D}, 8), DType::F32);
  auto dy = testing::rounded(randn({T, H, D}, 9), DType::F32);
  const std::string in = write_input("l2.safetensors", {{"x", x}, {"dy", dy}});
  auto y = OwnedTensor::zeros(DType::F64, {R, D}), rstd = OwnedTensor::zeros(DType::F64, {R});
  auto dx = OwnedTensor::zeros(DType::F64, {R, D});
  l2norm_forward({x.view().reshape({R, D}), y, rstd, 1e-6});
  l2norm_backward({y, rstd, dy.view().reshape({R, D}), dx});
  std::vector<std::pair<std::string, Tensor>> want{{"y", y}, {"rstd", rstd}, {"dx", dx}};
  expect_outputs(ops_run("l2norm", in, "cpu"), want, 1e-5);
  expect_outputs(ops_run("l2norm", in, "ref"), want, 0.0);
}

TEST_F(OpsRun, MissingInputNamesTheTensor) {
  auto x = randn({4, 16}, 10);
  auto w = randn({16}, 11);
  const std::string in = write_input("no_z.safetensors", {{"x", x}, {"w", w}});
  const std::string out = path("no_z_out.safetensors");
  const int rc = run_cli("ops run gated_rmsnorm --in '" + in + "' --out '" + out + "'");
  EXPECT_NE(rc, 0);
  EXPECT_THAT(read_text("stderr.txt"), HasSubstr("needs input tensor 'z'"));
  EXPECT_FALSE(fs::exists(out)) << "no output file on error";

  // Backward without the upstream gradient: forward succeeds, the error names 'dy'.
  const std::string in2 = write_input("no_dy.safetensors", {{"x", x}});
  EXPECT_NE(run_cli("ops run l2norm --backward --in '" + in2 + "' --out '" + out + "'"), 0);
  EXPECT_THAT(read_text("stderr.txt"), HasSubstr("needs input tensor 'dy'"));
}

TEST_F(OpsRun, MisshapenInputNamesTheTensor) {
  auto x = randn({4, 16}, 12);
  auto z = randn({4, 15}, 13);
  auto w = randn({16}, 14);
  const std::string in = write_input("bad_z.safetensors", {{"x", x}, {"z", z}, {"w", w}});
  EXPECT_NE(
      run_cli("ops run gated_rmsnorm --in '" + in + "' --out '" + path("o.safetensors") + "'"), 0);
  EXPECT_THAT(read_text("stderr.txt"), HasSubstr("tensor 'z' has shape [4, 15]"));
}

}  // namespace
}  // namespace gdn::ops
