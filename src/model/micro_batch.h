// A packed micro-batch, the model's input (ARCHITECTURE.md §3: token-major, batch size 1,
// cu_seqlens in the FlashAttention convention). The trainer's packer (train/packing.h) makes them
// from a dataset; micro_batch_of_documents makes one from whole documents (dump, probe).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace gdn::model {

constexpr int32_t kIgnoreIndex = -100;  // a label without a target

// One packed micro-batch: T tokens in N segments (documents). No recurrent state, conv window,
// RoPE position or attention crosses a segment boundary, and no label points into the next one.
struct MicroBatch {
  std::vector<int32_t> input_ids;   // [T]
  std::vector<int32_t> labels;      // [T] target of the output at each position, or kIgnoreIndex
  std::vector<int32_t> cu_seqlens;  // [N+1] 0 = cu[0] < cu[1] < ... < cu[N] = T
  std::vector<int32_t> positions;   // [T] position within the segment: 0, 1, ... per segment

  int64_t num_tokens() const { return static_cast<int64_t>(input_ids.size()); }
  int64_t num_segments() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  int64_t num_targets() const;  // labels != kIgnoreIndex (the loss normaliser)
  int32_t max_seqlen() const;
};

// One micro-batch of the given documents, whole and in order, each a segment with next-token
// labels (its last token has none): what the packer makes of them with a budget of all their
// tokens. Throws if a document is empty or there is none.
MicroBatch micro_batch_of_documents(std::span<const std::vector<int32_t>> docs);

}  // namespace gdn::model
