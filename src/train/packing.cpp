#include "train/packing.h"

#include <algorithm>
#include <limits>

#include "gdn/core/error.h"
#include "gdn/core/rng.h"

namespace gdn::train {

std::span<const Segment> PackPlan::batch(int64_t b) const {
  GDN_CHECK(b >= 0 && b < num_batches(), "packing: micro-batch {} out of range [0, {})", b,
            num_batches());
  const auto lo = static_cast<size_t>(batch_offsets[static_cast<size_t>(b)]);
  const auto hi = static_cast<size_t>(batch_offsets[static_cast<size_t>(b) + 1]);
  return std::span<const Segment>(segments).subspan(lo, hi - lo);
}

int64_t PackPlan::batch_tokens(int64_t b) const {
  int64_t n = 0;
  for (const Segment& s : batch(b)) n += s.size();
  return n;
}

std::vector<int64_t> identity_order(int64_t n) {
  GDN_CHECK(n >= 0, "packing: negative document count {}", n);
  std::vector<int64_t> o(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) o[static_cast<size_t>(i)] = i;
  return o;
}

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<int64_t> o = identity_order(n);
  const uint64_t stream = rng::stream_id("packing.order") + epoch;
  // Fisher-Yates from the back; 64 random bits per draw keep the modulo bias below 2^-30.
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t k = static_cast<uint64_t>(i);
    const uint64_t r = (static_cast<uint64_t>(rng::bits(seed, stream, 2 * k)) << 32) |
                       rng::bits(seed, stream, 2 * k + 1);
    const auto j = static_cast<int64_t>(r % (k + 1));
    std::swap(o[static_cast<size_t>(i)], o[static_cast<size_t>(j)]);
  }
  return o;
}

PackPlan plan_packing(std::span<const int64_t> doc_lengths, std::span<const int64_t> order,
                      int64_t max_tokens) {
  GDN_CHECK(max_tokens >= 1 && max_tokens <= std::numeric_limits<int32_t>::max(),
            "packing: max_tokens {} must be in [1, 2^31)", max_tokens);
  const auto n = static_cast<int64_t>(doc_lengths.size());
  GDN_CHECK(static_cast<int64_t>(order.size()) == n,
            "packing: the order has {} entries for {} documents", order.size(), n);
  std::vector<bool> seen(static_cast<size_t>(n), false);
  PackPlan p;
  p.max_tokens = max_tokens;
  p.batch_offsets.push_back(0);
  int64_t cur = 0;  // tokens in the open micro-batch
  auto place = [&](int64_t doc, int64_t begin, int64_t end) {
    if (cur + (end - begin) > max_tokens) {
      p.batch_offsets.push_back(static_cast<int64_t>(p.segments.size()));
      cur = 0;
    }
    p.segments.push_back(Segment{doc, begin, end});
    cur += end - begin;
  };
  for (int64_t k = 0; k < n; ++k) {
    const int64_t doc = order[static_cast<size_t>(k)];
    GDN_CHECK(doc >= 0 && doc < n && !seen[static_cast<size_t>(doc)],
              "packing: order entry {} = {} is not a permutation of [0, {})", k, doc, n);
    seen[static_cast<size_t>(doc)] = true;
    const int64_t len = doc_lengths[static_cast<size_t>(doc)];
    GDN_CHECK(len >= 0, "packing: document {} has negative length {}", doc, len);
    for (int64_t begin = 0; begin < len; begin += max_tokens) {
      place(doc, begin, std::min(len, begin + max_tokens));
    }
  }
  if (cur > 0) p.batch_offsets.push_back(static_cast<int64_t>(p.segments.size()));
  return p;
}

MicroBatch build_micro_batch(const PackPlan& plan, int64_t b, const TokenReader& read) {
  std::span<const Segment> segs = plan.batch(b);
  const int64_t T = plan.batch_tokens(b);
  MicroBatch mb;
  mb.input_ids.resize(static_cast<size_t>(T));
  mb.labels.resize(static_cast<size_t>(T));
  mb.positions.resize(static_cast<size_t>(T));
  mb.cu_seqlens.reserve(segs.size() + 1);
  mb.cu_seqlens.push_back(0);
  int64_t off = 0;
  for (const Segment& s : segs) {
    const int64_t len = s.size();
    int32_t* ids = mb.input_ids.data() + off;  // [len]
    read(s.doc, s.begin, s.end, ids);
    for (int64_t i = 0; i < len; ++i) {
      mb.positions[static_cast<size_t>(off + i)] = static_cast<int32_t>(i);
      mb.labels[static_cast<size_t>(off + i)] = i + 1 < len ? ids[i + 1] : kIgnoreIndex;
    }
    off += len;
    mb.cu_seqlens.push_back(static_cast<int32_t>(off));
  }
  return mb;
}

void validate_micro_batch(const MicroBatch& mb, int64_t max_tokens, int64_t vocab_size,
                          bool next_token_labels) {
  const int64_t T = mb.num_tokens();
  GDN_CHECK(T >= 1 && T <= max_tokens, "micro-batch: {} tokens, expected 1..{}", T, max_tokens);
  GDN_CHECK(mb.labels.size() == mb.input_ids.size() && mb.positions.size() == mb.input_ids.size(),
            "micro-batch: input_ids [{}], labels [{}] and positions [{}] differ in length", T,
            mb.labels.size(), mb.positions.size());
  GDN_CHECK(mb.cu_seqlens.size() >= 2 && mb.cu_seqlens.front() == 0 && mb.cu_seqlens.back() == T,
            "micro-batch: cu_seqlens must run from 0 to T = {} with at least one segment", T);
  for (int64_t s = 0; s < mb.num_segments(); ++s) {
    const int32_t a = mb.cu_seqlens[static_cast<size_t>(s)];
    const int32_t e = mb.cu_seqlens[static_cast<size_t>(s) + 1];
    GDN_CHECK(e > a, "micro-batch: segment {} is empty or reversed (cu_seqlens {} -> {})", s, a, e);
    for (int32_t t = a; t < e; ++t) {
      const auto i = static_cast<size_t>(t);
      GDN_CHECK(mb.positions[i] == t - a, "micro-batch: position[{}] = {}, expected {}", t,
                mb.positions[i], t - a);
      GDN_CHECK(mb.input_ids[i] >= 0 && mb.input_ids[i] < vocab_size,
                "micro-batch: input_ids[{}] = {} is outside the vocabulary [0, {})", t,
                mb.input_ids[i], vocab_size);
      const int32_t l = mb.labels[i];
      GDN_CHECK(l == kIgnoreIndex || (l >= 0 && l < vocab_size),
                "micro-batch: labels[{}] = {} is neither -100 nor in [0, {})", t, l, vocab_size);
      if (t == e - 1) {
        GDN_CHECK(l == kIgnoreIndex,
                  "micro-batch: the last token of segment {} (position {}) has label {}, expected "
                  "-100 (a label must not cross into the next document)",
                  s, t, l);
      } else if (next_token_labels) {
        GDN_CHECK(l == kIgnoreIndex || l == mb.input_ids[i + 1],
                  "micro-batch: labels[{}] = {} is not the next input token {}", t, l,
                  mb.input_ids[i + 1]);
      }
    }
  }
}

}  // namespace gdn::train
