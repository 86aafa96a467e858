// The sort input shared by the embedding CUDA implementations (cuda.cu "cuda.sorted_windows" and
// cuda_ranked_windows.cu "cuda.ranked_windows"): one (key, token) pair per token, invalid ids keyed
// to the vocabulary size so they sort last. Included by those two translation units only (unnamed
// namespace).
#pragma once

#include <cstdint>

namespace gdn::ops {
namespace {

template <class Id>
__global__ void __launch_bounds__(256) embedding_keys_kernel(const Id* __restrict__ ids,   // [T]
                                                             uint32_t* __restrict__ keys,  // [T]
                                                             uint32_t* __restrict__ vals,  // [T]
                                                             int T, int64_t vocab) {
  const int t = static_cast<int>(blockIdx.x) * 256 + static_cast<int>(threadIdx.x);
  if (t >= T) return;
  const int64_t id = static_cast<int64_t>(ids[t]);
  keys[t] = id >= 0 && id < vocab ? static_cast<uint32_t>(id) : static_cast<uint32_t>(vocab);
  vals[t] = static_cast<uint32_t>(t);
}

}  // namespace
}  // namespace gdn::ops
