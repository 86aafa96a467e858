// The CUDA implementation's chunk index of a packed batch, exposed so that a micro-batch builds it
// once and every GDN layer reuses it (CUDA builds only; the op itself is reached through op.h).
//
// The index says, for the batch's cu_seqlens, where each document starts (cu_seqlens clamped into
// [0, T] and made non-decreasing, so that whatever a device tensor holds no kernel reads out of
// bounds), the first global chunk of each document (chunks of C = 64 tokens never straddle
// documents; a document's last chunk may be partial) and, per global chunk, its tokens
// (fla/ops/utils/index.py prepare_chunk_indices is the same idea). It is built on the device by two
// small kernels on the compute stream: no host synchronisation.
//
//   OwnedTensor ix = OwnedTensor::empty(DType::I32, {gdr_chunk_index_numel(T, N)}, Device::CUDA);
//   GdrChunkIndexScope scope(cu_seqlens, T, ix.view());   // builds it
//   ... every gated_delta_rule forward/backward with this cu_seqlens tensor reuses it ...
//
// Without a scope (or for another cu_seqlens) the op builds the index itself, into its scratch.
#pragma once

#include <cstdint>

#include "gdn/core/tensor.h"

#if GDN_WITH_CUDA

namespace gdn::ops {

// Upper bound on the number of chunks of a batch of T tokens in N documents: each document adds at
// most one partial chunk, so sum ceil(len_n / 64) <= (T + 63 N) / 64.
int64_t gdr_max_chunks(int64_t T, int64_t N);
// I32 elements of the index of a batch of T tokens and N documents.
int64_t gdr_chunk_index_numel(int64_t T, int64_t N);
// Builds the index of cu_seqlens (I32 [N+1] on the device) for T tokens into `index` (I32 on the
// device, at least gdr_chunk_index_numel(T, N) elements, 16-byte aligned), on the compute stream.
void gdr_build_chunk_index(const Tensor& cu_seqlens, int64_t T, const Tensor& index);

// While alive, gated_delta_rule calls on the constructing thread whose cu_seqlens is this tensor
// (same data pointer and N) and whose token count is T use `index` instead of rebuilding it. The
// constructor builds it. cu_seqlens must not change while the scope lives. Scopes nest (the inner
// one wins until it ends).
class GdrChunkIndexScope {
 public:
  GdrChunkIndexScope(const Tensor& cu_seqlens, int64_t T, const Tensor& index);
  ~GdrChunkIndexScope();
  GdrChunkIndexScope(const GdrChunkIndexScope&) = delete;
  GdrChunkIndexScope& operator=(const GdrChunkIndexScope&) = delete;

  // The innermost scope of this thread that matches (cu_seqlens, T), or null.
  static const GdrChunkIndexScope* find(const Tensor& cu_seqlens, int64_t T);
  const Tensor& index() const { return index_; }

 private:
  Tensor cu_;
  Tensor index_;
  int64_t T_;
  const GdrChunkIndexScope* prev_;
};

// gated_delta_rule_workspace_bytes of op.h on CUDA builds: the largest scratch plan of cuda.cu.
size_t gated_delta_rule_cuda_workspace_bytes(int64_t T, int64_t N, int64_t Hk, int64_t Hv,
                                             int64_t dk, int64_t dv, bool l2norm,
                                             bool backward_saved);

// Test and benchmark hook: the dk split of the fast route's sequential state passes (cuda_fast.h):
// 0 = automatic (the default), 1, 2, 4 or 8 forces it for every later call on any thread.
void gdr_set_state_split(int ks);
// The split the fast route's state passes take for N documents, Hv value heads and dv value columns
// (the override when one is set).
int gdr_state_split_for(int64_t N, int64_t Hv, int64_t dv);
// Whether the fast route's forward runs its output beside the state pass (cuda_fast.h:
// fast_state_output) for a batch of T tokens in N documents with these heads and head dims (dk, dv
// multiples of 8 up to 128), under the split override (gdr_set_state_split).
bool gdr_trailing_output_for(int64_t T, int64_t N, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv);

}  // namespace gdn::ops

#endif  // GDN_WITH_CUDA
