// Compares `gdntrain dump` on a golden fixture with the fixture (HF transformers in float64).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>

#include "gdn/core/safetensors.h"
#include "model/dump.h"

namespace gdn::model::testing {

struct Errors {
  double logits = 0, loss = 0, grad = 0;
  std::string worst_grad;
};

Errors compare(const std::string& name, Backend backend) {
  std::filesystem::path dir = std::filesystem::path(GDN_TEST_DATA_DIR) / "golden" / name;
  DumpResult r = dump(dir.string(), (dir / "docs.safetensors").string(), backend);
  SafeTensorsFile want((dir / "out.safetensors").string());
  Errors e;
  size_t grads = 0;
  for (const auto& t : want.tensors()) {
    auto it = r.tensors.find(t.name);
    EXPECT_NE(it, r.tensors.end()) << name << ": dump did not write " << t.name;
    if (it == r.tensors.end()) continue;
    OwnedTensor w = want.load(t.name, DType::F64);
    double err = rel_l2_error(it->second, w);
    if (t.name.ends_with(".logits"))
      e.logits = std::max(e.logits, err);
    else if (t.name.ends_with(".loss_sum")) {
      // A 1-token document has no target: its loss is exactly 0 on both sides.
      double got = to_f64_vector(it->second)[0], ref = to_f64_vector(w)[0];
      e.loss = std::max(e.loss, std::abs(got - ref) / std::max(1e-30, std::abs(ref)) * (ref != 0));
      if (ref == 0) {
        EXPECT_EQ(got, 0.0) << t.name;
      }
    } else {
      ++grads;
      if (err > e.grad) {
        e.grad = err;
        e.worst_grad = t.name;
      }
    }
  }
  EXPECT_EQ(r.tensors.size(), want.tensors().size()) << name << ": dump wrote extra tensors";
  EXPECT_GT(grads, 40u) << name;
  return e;
}

}  // namespace gdn::model::testing
