// The decoder against Hugging Face transformers' own Qwen3.5 (fixtures written by
// scripts/make_golden.py, HF in float64 document by document): `dump` packs the same documents into
// one batch and must reproduce every document's logits and loss and every parameter gradient.
#include <gtest/gtest.h>

#include <filesystem>

#include "gdn/core/safetensors.h"
#include "model/dump.h"
#include "support/golden_util.h"
#include "support/op_test_util.h"

namespace gdn::model {
namespace {

namespace fs = std::filesystem;
using testing::compare;
using testing::Errors;

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, CpuMatchesHuggingFace) {
  Errors e = compare(GetParam(), Backend::Cpu);
  std::printf("%s cpu: logits %.2e loss %.2e grad %.2e (%s)\n", GetParam().c_str(), e.logits,
              e.loss, e.grad, e.worst_grad.c_str());
  // fp32 against fp64. Reached (2026-11-29): logits <= 5.6e-6, losses <= 5.2e-7, gradients
  // <= 2.1e-4 (r2_untied: its initializer_range 0.2 makes the random net ill-conditioned; every
  // layer-0 gradient sits near 1e-4 while the fp64 ref path agrees to 1e-7, so this is fp32
  // rounding amplified through the layers, not a formula difference: splitting the q/k/v
  // in-projection into three GEMMs, a different fp32 summation order and nothing else, moved
  // its worst gradient from 1.26e-4 to 2.07e-4 and its logits from 4.0e-6 to 5.5e-6).
  EXPECT_LE(e.logits, 2e-5);
  EXPECT_LE(e.loss, 1e-5);
  EXPECT_LE(e.grad, 3e-4) << e.worst_grad;
}

TEST_P(Golden, RefMatchesHuggingFace) {
  Errors e = compare(GetParam(), Backend::Ref);
  std::printf("%s ref: logits %.2e loss %.2e grad %.2e (%s)\n", GetParam().c_str(), e.logits,
              e.loss, e.grad, e.worst_grad.c_str());
  // fp64 against HF evaluated in float64. Reached: logits <= 1.2e-7, losses <= 7.2e-8,
  // gradients <= 5.3e-7.
  EXPECT_LE(e.logits, 1e-6);
  EXPECT_LE(e.loss, 1e-6);
  EXPECT_LE(e.grad, 2e-6) << e.worst_grad;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Golden,
                         ::testing::Values("r2_untied", "r1_tied", "nested_vl", "r2_std_init",
                                           "prod_dims"));

TEST(Dump, PackedBatchEqualsDocumentsOneByOne) {
  // The same checkpoint on each document alone gives the same logits as the packed batch: no
  // state, conv window, RoPE position or attention crosses a document boundary.
  fs::path dir = fs::path(GDN_TEST_DATA_DIR) / "golden" / "r2_untied";
  DumpResult all = dump(dir.string(), (dir / "docs.safetensors").string(), Backend::Ref);
  SafeTensorsFile docs((dir / "docs.safetensors").string());
  fs::path tmp = fs::temp_directory_path() / fmt::format("gdn_golden_{}", ::getpid());
  fs::create_directories(tmp);
  for (int i = 0; i < 4; ++i) {
    OwnedTensor ids = docs.load(fmt::format("doc{}.input_ids", i), DType::I64);
    std::string one = (tmp / "one.safetensors").string();
    write_safetensors(one, {{"doc0.input_ids", ids, {}, {}, nullptr, 0}});
    DumpResult single = dump(dir.string(), one, Backend::Ref);
    double err = rel_l2_error(single.tensors.at("doc0.logits"),
                              all.tensors.at(fmt::format("doc{}.logits", i)));
    EXPECT_LE(err, 1e-12) << "document " << i;
  }
  fs::remove_all(tmp);
}

TEST(Dump, BadDocsFileIsAClearError) {
  fs::path dir = fs::path(GDN_TEST_DATA_DIR) / "golden" / "r1_tied";
  fs::path tmp = fs::temp_directory_path() / fmt::format("gdn_golden_bad_{}", ::getpid());
  fs::create_directories(tmp);
  OwnedTensor ids = OwnedTensor::empty(DType::I64, {3});
  ids.ptr<int64_t>()[0] = 1;
  ids.ptr<int64_t>()[1] = 2;
  ids.ptr<int64_t>()[2] = 100000;
  std::string f = (tmp / "d.safetensors").string();
  write_safetensors(f, {{"doc0.input_ids", ids, {}, {}, nullptr, 0}});
  try {
    dump(dir.string(), f, Backend::Cpu);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'doc0.input_ids'[2] = 100000 is outside the vocabulary"),
              std::string::npos)
        << e.what();
  }
  write_safetensors(f, {{"doc1.input_ids", ids, {}, {}, nullptr, 0}});
  EXPECT_THROW(dump(dir.string(), f, Backend::Cpu), Error);
  fs::remove_all(tmp);
}

}  // namespace
}  // namespace gdn::model
