// The generic route's side of the op's `saved` tensor (op.h): the fast route's state pass writes
// the saved layout (Ht [nt_max, Hv, dv, dk], Vt [nt_max, Hv, dv, 64]) directly, the generic one
// keeps H [nt_max, Hv, dk, dv] and V' [T, Hv, dv] for its WMMA kernels, so its forward transposes
// them into `saved` and its backward transposes them back. Both directions are bf16 copies: the
// values round-trip exactly, which is what makes a generic backward given a generic forward's
// `saved` bitwise equal to one that recomputes.
//
// One block per (chunk slot, value head) (slots past the batch's chunk count exit at once), 256
// threads, each [R, C] -> [C, R] transpose in 32 x 32 tiles through shared memory (rows of the
// source read and rows of the destination written by consecutive threads).
#include <climits>

#include "gdn/backend/cuda_check.h"
#include "ops/gated_delta_rule/cuda_kernels.h"

namespace gdn::ops::gdr {

namespace {

constexpr int kThreads = 256;  // 32 x 8
constexpr int kTile = 32;

// dst[c * ld_dst + r] = (r < rows ? src[r * ld_src + c] : 0) for r < rows_out, c < cols. Every
// thread of the block calls it (block barriers inside).
__device__ void transpose(const bf16_t* __restrict__ src, int64_t ld_src, int rows, int rows_out,
                          int cols, bf16_t* __restrict__ dst, int64_t ld_dst,
                          bf16_t (*tile)[kTile + 1]) {
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  for (int r0 = 0; r0 < rows_out; r0 += kTile) {
    for (int c0 = 0; c0 < cols; c0 += kTile) {
#pragma unroll
      for (int j = 0; j < kTile; j += 8) {
        const int r = r0 + ty + j, c = c0 + tx;
        tile[ty + j][tx] =
            r < rows && c < cols ? src[static_cast<int64_t>(r) * ld_src + c] : bf16_zero();
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kTile; j += 8) {
        const int c = c0 + ty + j, r = r0 + tx;
        if (c < cols && r < rows_out) dst[static_cast<int64_t>(c) * ld_dst + r] = tile[tx][ty + j];
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    gdr_save_states_kernel(Dims d, IndexView ix,
                           const bf16_t* __restrict__ H,     // [nt_max, Hv, dk, dv]
                           const bf16_t* __restrict__ vnew,  // [T, Hv, dv] V'
                           bf16_t* __restrict__ Ht,          // [nt_max, Hv, dv, dk]
                           bf16_t* __restrict__ Vt) {        // [nt_max, Hv, dv, 64]
  __shared__ bf16_t tile[kTile][kTile + 1];
  const int c = static_cast<int>(blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
  const int64_t sd = static_cast<int64_t>(d.dk) * d.dv;
  transpose(H + slot * sd, d.dv, d.dk, d.dk, d.dv, Ht + slot * sd, d.dk, tile);
  // Tokens past the chunk's end become exact zeros (the fast route's Vt holds them so).
  transpose(vnew + (static_cast<int64_t>(ci.t0) * d.Hv + h) * d.dv,
            static_cast<int64_t>(d.Hv) * d.dv, ci.len, kC, d.dv, Vt + slot * d.dv * kC, kC, tile);
}

__global__ void __launch_bounds__(kThreads)
    gdr_load_states_kernel(Dims d, IndexView ix,
                           const bf16_t* __restrict__ Ht,  // [nt_max, Hv, dv, dk]
                           const bf16_t* __restrict__ Vt,  // [nt_max, Hv, dv, 64]
                           bf16_t* __restrict__ H,         // [nt_max, Hv, dk, dv]
                           bf16_t* __restrict__ vnew) {    // [T, Hv, dv] V'
  __shared__ bf16_t tile[kTile][kTile + 1];
  const int c = static_cast<int>(blockIdx.x);
  const ChunkInfo ci = ix.table[c];
  if (ci.len <= 0) return;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t slot = static_cast<int64_t>(c) * d.Hv + h;
  const int64_t sd = static_cast<int64_t>(d.dk) * d.dv;
  transpose(Ht + slot * sd, d.dk, d.dv, d.dv, d.dk, H + slot * sd, d.dv, tile);
  transpose(Vt + slot * d.dv * kC, kC, d.dv, d.dv, ci.len,
            vnew + (static_cast<int64_t>(ci.t0) * d.Hv + h) * d.dv,
            static_cast<int64_t>(d.Hv) * d.dv, tile);
}

dim3 grid_of(const Dims& d, const char* what) {
  GDN_CHECK(d.nt_max <= INT_MAX, "gated_delta_rule (cuda): {} needs a grid of {} blocks", what,
            d.nt_max);
  return dim3(static_cast<unsigned>(d.nt_max), static_cast<unsigned>(d.Hv));
}

}  // namespace

void launch_save_states(const Dims& d, const IndexView& ix, const bf16_t* H, const bf16_t* vnew,
                        bf16_t* Ht, bf16_t* Vt, cudaStream_t s) {
  if (d.nt_max == 0) return;
  gdr_save_states_kernel<<<grid_of(d, "gdr_save_states_kernel"), kThreads, 0, s>>>(d, ix, H, vnew,
                                                                                   Ht, Vt);
  GDN_CUDA_LAUNCH_CHECK("gdr_save_states_kernel");
}

void launch_load_states(const Dims& d, const IndexView& ix, const bf16_t* Ht, const bf16_t* Vt,
                        bf16_t* H, bf16_t* vnew, cudaStream_t s) {
  if (d.nt_max == 0) return;
  gdr_load_states_kernel<<<grid_of(d, "gdr_load_states_kernel"), kThreads, 0, s>>>(d, ix, Ht, Vt, H,
                                                                                   vnew);
  GDN_CUDA_LAUNCH_CHECK("gdr_load_states_kernel");
}

}  // namespace gdn::ops::gdr
