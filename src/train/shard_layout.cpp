#include "train/shard_layout.h"

#include <algorithm>

#include "gdn/core/error.h"

namespace gdn::train {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

ShardLayout::ShardLayout(std::vector<Param> params, int world, int64_t align, int64_t bucket)
    : params_(std::move(params)), world_(world), align_(align) {
  GDN_CHECK(world >= 1 && align >= 1 && bucket >= 1,
            "shard layout: world {}, align {} and bucket {} must be positive", world, align,
            bucket);
  int64_t end = 0;
  for (const Param& p : params_) {
    GDN_CHECK(p.numel >= 0, "shard layout: parameter {} has {} elements", p.id, p.numel);
    const int64_t at = round_up(end, align_);
    offsets_.push_back(at);
    end = at + p.numel;
    numel_ += p.numel;
  }
  // At least one aligned unit per shard, so that every rank has a (possibly empty) shard of the
  // same size and the collectives' counts agree.
  shard_numel_ = std::max(round_up(round_up(end, world_) / world_, align_), align_);
  bucket_ = std::min(round_up(bucket, align_), shard_numel_);
}

std::vector<ShardPiece> ShardLayout::pieces(int64_t begin, int64_t end) const {
  std::vector<ShardPiece> out;
  // The parameters are in flat order: skip to the first one ending after `begin`.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end(), begin);
  size_t k = it == offsets_.begin() ? 0 : static_cast<size_t>(it - offsets_.begin()) - 1;
  for (; k < params_.size() && offsets_[k] < end; ++k) {
    const int64_t lo = std::max(begin, offsets_[k]);
    const int64_t hi = std::min(end, offsets_[k] + params_[k].numel);
    if (hi > lo) out.push_back({params_[k].id, lo - offsets_[k], lo, hi - lo});
  }
  return out;
}

int64_t ShardLayout::buckets() const { return (shard_numel_ + bucket_ - 1) / bucket_; }

int64_t ShardLayout::bucket_len(int64_t k) const {
  return std::min(bucket_, shard_numel_ - k * bucket_);
}

std::vector<ShardPiece> ShardLayout::bucket_pieces(int64_t k) const {
  std::vector<ShardPiece> out;
  const int64_t len = bucket_len(k);
  for (int r = 0; r < world_; ++r) {
    const int64_t b = shard_begin(r) + bucket_begin(k);
    for (ShardPiece p : pieces(b, b + len)) {
      p.flat_begin = r * len + (p.flat_begin - b);
      out.push_back(p);
    }
  }
  return out;
}

}  // namespace gdn::train
