// The staging pipeline of the fast route's sequential state passes (gdr_fast_state_fwd_kernel,
// gdr_fast_state_bwd_kernel): a ring of `ns` chunk buffers filled by cp.async groups, one group per
// chunk, so that ns - 1 chunks' tiles are in flight while the current chunk's mma chain runs
// (fla's chunk_delta_h kernels get the same from Triton's loop pipeliner, num_stages 2..4), and the
// per-chunk copies without any division: each thread owns one 16-byte column piece of a tile and
// every rstep-th row of it, fixed for the whole pass. Snapshots (Ht, Vt; dHt, dVt) can go through a
// shared tile and leave as coalesced 16-byte stores instead of one 4-byte store per fragment pair.
//
// Group accounting: the prologue commits ns - 1 groups (chunks 0 .. ns - 2) and every chunk step
// commits exactly one more (possibly empty: past the last chunk), so at the top of step i the
// groups of chunks i .. i + ns - 2 are the newest ns - 1; cp.async.wait_group(ns - 2) leaves at
// most ns - 2 of them pending, i.e. chunk i's has landed (for this thread; the block barrier after
// it makes every thread's pieces visible).
#pragma once

#include "ops/gated_delta_rule/cuda_common.cuh"

namespace gdn::ops::gdr {

// Host-chosen shape of a state pass launch (cuda_fast.h: state_pipe).
struct StatePipe {
  int ns;    // ring depth (2..4): ns - 1 chunks staged ahead
  int nvw;   // 16-column value slices per block: 1 (16 value columns) or 2 (32)
  int snap;  // 1: snapshots through shared memory and 16-byte stores (needs a block barrier
             //    between the fragment writes and the copy-out: KS > 1)
  int dls;   // backward: 1 stages dV'_loc through the ring, 0 loads it into registers a chunk ahead
};

// This thread's pieces of a tile of 16-byte rows pieces `per_row` wide: column piece c (in
// elements) of rows r0, r0 + rstep, ...; valid only when the block size is a multiple of per_row
// (ok), else the caller takes the general stage_tile.
struct RowPieces {
  int r0, rstep, c;
  bool ok;
};

template <class T>
__device__ __forceinline__ RowPieces row_pieces(int per_row) {
  constexpr int kPiece = 16 / static_cast<int>(sizeof(T));
  const int nt = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  RowPieces p;
  p.ok = per_row > 0 && nt % per_row == 0;
  p.r0 = p.ok ? tid / per_row : 0;
  p.rstep = p.ok ? nt / per_row : 1;
  p.c = p.ok ? (tid % per_row) * kPiece : 0;
  return p;
}

// cp.async.wait_group with a run-time count (0 .. 2): ns - 2 of the ring.
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  if (n <= 0)
    cp_async_wait<0>();
  else if (n == 1)
    cp_async_wait<1>();
  else
    cp_async_wait<2>();
}

// dst[r][c] (shared, ld) = src[r * stride + c] over this thread's pieces of a [R, *] tile: rows
// >= rows and pieces with col_ok false are zero-filled (never read). As stage_tile with vec, for
// p.ok layouts.
template <class T>
__device__ __forceinline__ void stage_rows(T* dst, int ld, const T* src, int64_t stride, int rows,
                                           int R, bool col_ok, const RowPieces& p) {
  const T* s = src + static_cast<int64_t>(p.r0) * stride + p.c;
  const int64_t sstep = static_cast<int64_t>(p.rstep) * stride;
  T* o = dst + p.r0 * ld + p.c;
  const int ostep = p.rstep * ld;
  if (rows >= R && col_ok) {  // every piece in range (all but a document's last chunk)
#pragma unroll 4
    for (int r = p.r0; r < R; r += p.rstep, s += sstep, o += ostep) cp_async16(o, s);
    return;
  }
  for (int r = p.r0; r < R; r += p.rstep, s += sstep, o += ostep) {
    if (r < rows && col_ok)
      cp_async16(o, s);
    else
      *reinterpret_cast<uint4*>(o) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// dst[r * stride + c] = src[r][c] (shared, ld) for this thread's pieces with r < rows and col_ok:
// the coalesced copy-out of a snapshot tile (16-byte stores; dst and stride 16-byte aligned).
template <class T>
__device__ __forceinline__ void store_rows(T* dst, int64_t stride, const T* src, int ld, int rows,
                                           bool col_ok, const RowPieces& p) {
  if (!col_ok) return;
  T* o = dst + static_cast<int64_t>(p.r0) * stride + p.c;
  const int64_t ostep = static_cast<int64_t>(p.rstep) * stride;
  const T* s = src + p.r0 * ld + p.c;
  const int sstep = p.rstep * ld;
  for (int r = p.r0; r < rows; r += p.rstep, o += ostep, s += sstep)
    *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(s);
}

}  // namespace gdn::ops::gdr
