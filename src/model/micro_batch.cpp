#include "model/micro_batch.h"

#include <algorithm>

#include "gdn/core/error.h"

namespace gdn::model {

int64_t MicroBatch::num_targets() const {
  return std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l != kIgnoreIndex; });
}

int32_t MicroBatch::max_seqlen() const {
  int32_t m = 0;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) m = std::max(m, cu_seqlens[i] - cu_seqlens[i - 1]);
  return m;
}

MicroBatch micro_batch_of_documents(std::span<const std::vector<int32_t>> docs) {
  GDN_CHECK(!docs.empty(), "micro-batch: no documents");
  MicroBatch mb;
  mb.cu_seqlens.push_back(0);
  for (size_t d = 0; d < docs.size(); ++d) {
    const std::vector<int32_t>& doc = docs[d];
    GDN_CHECK(!doc.empty(), "micro-batch: document {} is empty", d);
    for (size_t i = 0; i < doc.size(); ++i) {
      mb.input_ids.push_back(doc[i]);
      mb.labels.push_back(i + 1 < doc.size() ? doc[i + 1] : kIgnoreIndex);
      mb.positions.push_back(static_cast<int32_t>(i));
    }
    mb.cu_seqlens.push_back(static_cast<int32_t>(mb.input_ids.size()));
  }
  return mb;
}

}  // namespace gdn::model
