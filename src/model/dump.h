// `gdntrain dump`: logits, per-document losses and every parameter gradient for a set of
// documents packed into one micro-batch. This is how a user checks gdntrain against their own
// implementation, and how the golden tests against Hugging Face run.
//
// DOCS file: doc{i}.input_ids (I64 or I32, [L_i]) for i = 0, 1, ... (consecutive).
// OUT file:  doc{i}.logits [L_i, V] F32, doc{i}.loss_sum [1] F32 (next-token cross-entropy summed
//            over the document's L_i - 1 targets), grad.<HF tensor name> F32 for every trained
//            parameter: the gradient of sum_i loss_sum_i / sum_i (L_i - 1).
#pragma once

#include <map>
#include <string>

#include "gdn/backend/registry.h"
#include "gdn/core/tensor.h"

namespace gdn::model {

struct DumpResult {
  std::map<std::string, OwnedTensor> tensors;  // F32 host, named as in the OUT file
  double mean_loss = 0;
  int64_t tokens = 0, docs = 0;
};

DumpResult dump(const std::string& model_dir, const std::string& docs_path, Backend backend);
void dump_to_file(const std::string& model_dir, const std::string& docs_path,
                  const std::string& out_path, Backend backend);

}  // namespace gdn::model
