// The flat layout of dist.shard = optimizer (ZeRO-2; Rajbhandari et al. 2020, "ZeRO: Memory
// Optimizations Toward Training Trillion Parameter Models", and Megatron-LM's distributed
// optimizer, megatron/core/distributed/param_and_grad_buffer.py): the sharded parameters placed
// one after another in one flat index space, each starting at a multiple of `align` elements, the
// whole padded to world * shard_numel elements with shard_numel a multiple of `align`. Rank r owns
// the contiguous range [r * shard_numel, (r + 1) * shard_numel): its slice of the fp32 master
// weights, Adam m and v and the reduced gradients. A parameter may straddle two (or more) shards;
// a piece is the part of one parameter inside a range, so that an update over pieces is the
// update over whole parameters, element for element.
//
// The collectives move a shard in buckets of at most `bucket` elements per rank: bucket k of
// every shard is its range [k * bucket, min(shard_numel, (k + 1) * bucket)), and one
// reduce-scatter (all-gather) moves bucket k of all ranks at once, rank r's part at r * len.
// Padding and alignment gaps belong to no piece: nothing reads them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gdn::train {

struct ShardPiece {
  size_t param = 0;         // the parameter's id (as given to the layout)
  int64_t param_begin = 0;  // first element inside the parameter
  int64_t flat_begin = 0;   // first element in the flat layout
  int64_t len = 0;          // elements
};

class ShardLayout {
 public:
  struct Param {
    size_t id = 0;
    int64_t numel = 0;
  };
  ShardLayout() = default;
  // `params` in layout order; `world` >= 1; `align` >= 1; `bucket` >= 1 elements per rank (it is
  // rounded up to a multiple of `align` and capped at the shard size).
  ShardLayout(std::vector<Param> params, int world, int64_t align, int64_t bucket);

  int world() const { return world_; }
  int64_t align() const { return align_; }
  size_t params() const { return params_.size(); }
  int64_t offset(size_t k) const { return offsets_.at(k); }  // of the k-th parameter given
  int64_t numel() const { return numel_; }                   // parameter elements, no padding
  int64_t padded_numel() const { return shard_numel_ * world_; }
  int64_t shard_numel() const { return shard_numel_; }
  int64_t shard_begin(int rank) const { return shard_numel_ * rank; }

  // The pieces of the parameters inside flat range [begin, end), in flat order.
  std::vector<ShardPiece> pieces(int64_t begin, int64_t end) const;
  std::vector<ShardPiece> shard_pieces(int rank) const {
    return pieces(shard_begin(rank), shard_begin(rank) + shard_numel_);
  }

  // Buckets: count, elements per rank of bucket k, and where it starts inside every shard.
  int64_t buckets() const;
  int64_t bucket_begin(int64_t k) const { return k * bucket_; }
  int64_t bucket_len(int64_t k) const;
  // Every rank's pieces of bucket k with their place in the bucket's world * len elements (rank
  // r's part first at r * len): flat_begin is replaced by that place.
  std::vector<ShardPiece> bucket_pieces(int64_t k) const;

 private:
  std::vector<Param> params_;
  std::vector<int64_t> offsets_;
  int world_ = 1;
  int64_t align_ = 1, bucket_ = 1;
  int64_t numel_ = 0, shard_numel_ = 0;
};

}  // namespace gdn::train
