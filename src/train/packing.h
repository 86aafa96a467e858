// Packing documents into variable-length micro-batches (ARCHITECTURE.md §3: token-major, batch
// size 1, cu_seqlens in the FlashAttention convention).
//
// Plan. Documents are visited in a given order (identity, or shuffled_order(n, seed, epoch), a
// Fisher-Yates permutation drawn from the counter RNG: the same (n, seed, epoch) gives the same
// order on every machine). A document of at most max_tokens tokens is never split: it joins the
// current micro-batch if it fits, otherwise it starts the next one. A document longer than
// max_tokens is cut into pieces of exactly max_tokens tokens (the last piece shorter), placed by
// the same rule. Empty documents are skipped (a zero-length segment would be a zero-length
// cu_seqlens entry, which varlen GDN kernels mishandle, gdn_spec.md §6). Micro-batches therefore
// hold 1..max_tokens tokens; they are not padded.
//
// Split documents: EACH PIECE IS ITS OWN DOCUMENT. Its positions restart at 0, the model starts
// it with a fresh GDN state, conv window and attention context, and its last token has no target
// (-100): no state and no label crosses a micro-batch (or a segment) boundary.
//
// Labels. For a segment with tokens x_0..x_{n-1}: input_ids = x, labels = x_1..x_{n-1}, -100.
// The target at position t is the next token OF THE SAME SEGMENT; the last token of every segment
// is ignored, so a label never points at the next document's first token. (With `gdntrain
// prepare` data every document ends with EOS: the last real byte predicts EOS, EOS predicts
// nothing.) Positions restart at 0 in every segment (RoPE).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "model/micro_batch.h"

namespace gdn::train {

// The micro-batch is the model's input type (model/micro_batch.h); train code names it here.
using model::kIgnoreIndex;
using model::MicroBatch;

// Tokens [begin, end) of document `doc`.
struct Segment {
  int64_t doc = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

struct PackPlan {
  int64_t max_tokens = 0;
  std::vector<Segment> segments;       // every segment, micro-batch after micro-batch
  std::vector<int64_t> batch_offsets;  // [num_batches + 1] into segments

  int64_t num_batches() const { return static_cast<int64_t>(batch_offsets.size()) - 1; }
  std::span<const Segment> batch(int64_t b) const;
  int64_t batch_tokens(int64_t b) const;
};

// A permutation of [0, n) from the counter RNG (stream "packing.order" + epoch).
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, uint64_t epoch);
std::vector<int64_t> identity_order(int64_t n);

// Plans micro-batches of at most `max_tokens` (1 <= max_tokens < 2^31) over documents of the given
// lengths visited in `order` (a permutation of [0, doc_lengths.size())).
PackPlan plan_packing(std::span<const int64_t> doc_lengths, std::span<const int64_t> order,
                      int64_t max_tokens);

// Fills out[0 .. end-begin) with tokens [begin, end) of document `doc`.
using TokenReader = std::function<void(int64_t doc, int64_t begin, int64_t end, int32_t* out)>;

// Materialises micro-batch `b` of the plan.
MicroBatch build_micro_batch(const PackPlan& plan, int64_t b, const TokenReader& read);

// Checks the structural invariants of a micro-batch (sizes, cu_seqlens strictly increasing from 0
// to T <= max_tokens, positions restarting per segment, the last label of every segment ignored,
// labels in [0, vocab) or ignored; with `next_token_labels`, every label equal to the next input
// token of its segment); throws gdn::Error naming the first violation. Cheap: the trainer may
// call it on every batch in debug runs. Task batches (MQAR) pass next_token_labels = false.
void validate_micro_batch(const MicroBatch& mb, int64_t max_tokens, int64_t vocab_size,
                          bool next_token_labels = true);

}  // namespace gdn::train
