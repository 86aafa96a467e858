// Causal conv1d on CUDA: bf16 x / weight / bias / states / y / dy / dx, fp32 dweight / dbias, fp32
// arithmetic (op.h has the contract).
//
// Tiles (the channel-last design of Dao's causal-conv1d, csrc/causal_conv1d_fwd.cu and
// causal_conv1d_bwd.cu, channellast kernels; ops_notes.md §5): a block of 128 threads owns a tile
// of kBT = 64 tokens x kBC = 128 channels. It copies the tile's rows plus the W-1 halo rows before
// them (and, in backward, W-1 rows after them) from device memory into shared memory with 16-byte
// cp.async copies (2-byte loads when C % 8 != 0 or a base pointer is not 16-byte aligned), rows
// outside [0, T) and channels >= C zero-filled. Then warp g owns tokens [t0 + 16 g, t0 + 16 g + 16)
// and lane l owns channels c0 + 4 l .. c0 + 4 l + 3: it slides over its tokens with the last W rows
// in fp32 registers, so every shared-memory row is read once per warp. A warp shares its tokens, so
// every document test below is warp-uniform.
//
// Documents: at each tile the block looks up, per token, the document it belongs to (binary search
// in cu_seqlens: the largest n with cu[n] <= t, which skips zero-length documents) into shared
// memory. A tap that would read a position before the token's document start reads the document's
// initial state (or zero) instead, never the row in the tile, so no output reads another
// document; in backward, u of a token of the next document never reaches dx. The lookup reads only
// cu[0..N] whatever the values, and every index derived from a (possibly garbage, device-side)
// cu_seqlens is range-checked before it addresses memory.
//
// Fast path: a warp whose rows all lie inside one document (and before T) runs a loop with no
// per-token document or state test; the general loop (document starts and ends, states, the last
// tile) spends most of its instructions on those tests, and both kernels are otherwise limited by
// instruction issue rather than memory.
//
// Forward: a persistent grid (as many blocks as fit at once, split over the channel blocks), each
// block walking token tiles of its channel block with two tile buffers: the next tile's copies are
// in flight while the current one is computed. y written once. final_state: a small kernel over
// (document, channel), bits copied exactly.
// Backward: a persistent grid (as many blocks as fit at once, split over the channel blocks),
// each block walking token tiles of its channel block with two stages of (x, dy) tiles, the next
// tile's copies in flight while the current one is computed. Per token t' it recomputes z and
// u = dy * silu'(z) (Dao's causal-conv1d recomputes z the same way; FLA stores z instead), for the
// warp's 16 tokens and the W-1 after them (whose u dx needs), then dx[t] = sum_j w[j] u[t+W-1-j]
// over u of t's own document, plus dfinal_state for the last W-1 tokens of a document.
// dweight / dbias: fp32 per-thread sums over the thread's tokens in all of its tiles, summed over
// the block's warps in warp order through shared memory, one fp32 partial row set per block in
// scratch ([G, W+1, C]), and a second kernel adds the G partials per (channel, tap) in block order
// to dweight / dbias. No float atomics: results depend only on the shapes, the documents and the
// device's multiprocessor count. dinitial_state: a small kernel over (document, channel) that
// recomputes u of the document's first W-1 tokens.
//
// Bytes moved (the floor): forward reads x and writes y; backward reads x and dy and writes dx;
// plus the halo rows (W-1 per 64 tokens, mostly L2 hits) and the partials (G (W+1) C fp32).
//
// The small kernels (final_state, dinitial_state, the dweight second pass) and the sigmoid live in
// cuda_state.cuh, shared with cuda_sliding_window.cu ("cuda.sliding_window", the default in the
// shape classes it covers; the resolver gives every other class to this implementation).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/causal_conv1d/cuda_state.cuh"
#include "ops/causal_conv1d/op.h"

namespace gdn::ops {

// The tiles of the conv kernels (dynamic shared memory).
extern __shared__ __align__(16) unsigned char conv_smem[];

namespace {

using cuda::bf16_t;

constexpr int kThreads = 128;          // 4 warps
constexpr int kWarps = kThreads / 32;  // token groups of a tile
constexpr int kCV = 4;                 // channels per lane (one 8-byte shared-memory read)
constexpr int kBC = 32 * kCV;          // channels per tile (256 bytes of a row)
static_assert(kBC <= kCausalConv1dMaxColumn, "op.h's workspace bound assumes wider columns");
constexpr int kTT = 16;            // tokens per warp
constexpr int kBT = kWarps * kTT;  // tokens per tile
constexpr int kMaxS = static_cast<int>(kConvMaxWidth) - 1;
constexpr int kDocSlots = kBT + kMaxS;  // tile tokens + the backward's u look-ahead

// Backward: three blocks per multiprocessor (two stages of ~35 KB each) for W <= 4, so <= 168
// registers; the W > 4 kernels hold twice the taps and get 255 (two blocks).
template <int W>
constexpr int bwd_min_blocks() {
  return W <= 4 ? 3 : 2;
}

// Forward: six blocks per multiprocessor (<= 80 registers) for W <= 4, as the shared memory allows.
template <int W>
constexpr int fwd_min_blocks() {
  return W <= 4 ? 6 : 4;
}

// Shared-memory bytes of the tiles: forward two tiles of x rows [t0 - S, t0 + kBT); backward x rows
// [t0 - S, t0 + kBT + S) and dy rows [t0, t0 + kBT + S).
constexpr size_t fwd_smem(int W) { return static_cast<size_t>(kBT + W - 1) * kBC * 2 * 2; }
constexpr size_t bwd_smem(int W) {
  return static_cast<size_t>(2 * kBT + 3 * (W - 1)) * kBC * 2 * 2;
}
static_assert(fwd_smem(kConvMaxWidth) <= 48 * 1024,
              "the forward tiles must fit the default 48 KiB");
static_assert(kWarps * (kConvMaxWidth + 1) * kBC * 4 <= bwd_smem(1),
              "the dweight reduction reuses the tile memory");
static_assert(kThreads == kBC, "the dweight reduction gives each thread one channel of the tile");

// The document of one token: index, first token, one past its last token.
struct DocSlot {
  int64_t s, e;
  int n;
};

static_assert(bwd_smem(kConvMaxWidth) + 2 * kDocSlots * sizeof(DocSlot) <= 200 * 1024,
              "the backward stages must fit one multiprocessor's shared memory");

// --- device helpers ----------------------------------------------------------------------------

// Rows [r0, r0 + rows) x channels [c0, c0 + kBC) of a [T, C] tensor into tile [rows, kBC]; rows
// outside [0, T) and channels >= C become zeros. vec: C % 8 == 0 and `a` 16-byte aligned, so that
// every 8-channel chunk is one aligned 16-byte copy. The caller commits and waits.
__device__ __forceinline__ void load_tile(bf16_t* tile, const bf16_t* __restrict__ a, int64_t r0,
                                          int rows, int64_t c0, int64_t T, int64_t C, bool vec) {
  if (vec) {
    constexpr int kChunks = kBC / 8;
    for (int i = static_cast<int>(threadIdx.x); i < rows * kChunks; i += kThreads) {
      const int row = i / kChunks, ch = i % kChunks;
      const int64_t p = r0 + row, c = c0 + ch * 8;
      const bool ok = p >= 0 && p < T && c < C;
      cuda::cp_async16_zfill(tile + row * kBC + ch * 8, ok ? a + p * C + c : a, ok ? 16 : 0);
    }
  } else {
    for (int i = static_cast<int>(threadIdx.x); i < rows * kBC; i += kThreads) {
      const int row = i / kBC, ch = i % kBC;
      const int64_t p = r0 + row, c = c0 + ch;
      tile[i] = p >= 0 && p < T && c < C ? a[p * C + c] : __float2bfloat16_rn(0.f);
    }
  }
}

// Documents of tokens t0 .. t0 + count - 1 into docs[0 .. count). Without cu_seqlens: one
// document [0, T). Reads only cu[0 .. N] (N >= 1): the search keeps lo, hi in [0, N-1].
__device__ __forceinline__ void find_docs(DocSlot* docs, const int32_t* __restrict__ cu, int N,
                                          int64_t T, int64_t t0, int count) {
  for (int i = static_cast<int>(threadIdx.x); i < count; i += kThreads) {
    DocSlot d{0, T, 0};
    if (cu != nullptr) {
      const int64_t t = t0 + i;
      int lo = 0, hi = N - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (__ldg(cu + mid) <= t)
          lo = mid;
        else
          hi = mid - 1;
      }
      d.n = lo;
      d.s = __ldg(cu + lo);
      d.e = __ldg(cu + lo + 1);
    }
    docs[i] = d;
  }
}

// The lane's 4 channels of a tile row, as fp32.
__device__ __forceinline__ void read_row(const bf16_t* tile, int row, int lane, float (&f)[kCV]) {
  const uint2 v = *reinterpret_cast<const uint2*>(tile + row * kBC + lane * kCV);
  f[0] = cuda::bf16_lo(v.x);
  f[1] = cuda::bf16_hi(v.x);
  f[2] = cuda::bf16_lo(v.y);
  f[3] = cuda::bf16_hi(v.y);
}

// out[off + v] = f[v] for the channels c + v < C. vec: C % 4 == 0 and `out` 8-byte aligned.
__device__ __forceinline__ void store4(bf16_t* __restrict__ out, int64_t off, int64_t c, int64_t C,
                                       const float (&f)[kCV], bool vec) {
  if (vec) {
    if (c < C)
      *reinterpret_cast<uint2*>(out + off) =
          make_uint2(cuda::pack2(f[0], f[1]), cuda::pack2(f[2], f[3]));
  } else {
#pragma unroll
    for (int v = 0; v < kCV; ++v)
      if (c + v < C) out[off + v] = __float2bfloat16_rn(f[v]);
  }
}

// Column k of document n's [C, S] state slice for the lane's channels; zero when there is no
// state or k is out of range (only a garbage cu_seqlens makes k negative).
template <int S>
__device__ __forceinline__ void state_cols(const bf16_t* __restrict__ st, int n, int64_t k,
                                           int64_t c, int64_t C, float (&f)[kCV]) {
#pragma unroll
  for (int v = 0; v < kCV; ++v)
    f[v] = st != nullptr && k >= 0 && k < S && c + v < C
               ? to_f(st[(static_cast<int64_t>(n) * C + c + v) * S + k])
               : 0.f;
}

// The extended-input values of the W taps of a token at document position q (document n):
// taps j with q + j < S read the state column q + j, the others the window rows.
template <int W>
__device__ __forceinline__ void taps(const float (&win)[W][kCV], int64_t q, int n,
                                     const bf16_t* __restrict__ init, int64_t c, int64_t C,
                                     float (&e)[W][kCV]) {
  constexpr int S = W - 1;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    if (q + j < S) {
      state_cols<S>(init, n, q + j, c, C, e[j]);
    } else {
#pragma unroll
      for (int v = 0; v < kCV; ++v) e[j][v] = win[j][v];
    }
  }
}

template <int W>
__device__ __forceinline__ void load_weights(const bf16_t* __restrict__ w,
                                             const bf16_t* __restrict__ bias, int64_t c, int64_t C,
                                             float (&wr)[W][kCV], float (&br)[kCV]) {
#pragma unroll
  for (int v = 0; v < kCV; ++v) {
    const bool ok = c + v < C;
#pragma unroll
    for (int j = 0; j < W; ++j) wr[j][v] = ok ? to_f(w[(c + v) * W + j]) : 0.f;
    br[v] = ok && bias != nullptr ? to_f(bias[c + v]) : 0.f;
  }
}

// --- forward -----------------------------------------------------------------------------------

// The forward of a warp whose kTT tokens and the S rows before them all lie in one document and
// before T, with 8-byte stores (vec_store): every tap reads a tile row, so no document or state
// test is needed per token (the general loop below spends most of its instructions on them). Same
// arithmetic, in the same order, as the general loop.
template <int W, bool kSilu>
__device__ __forceinline__ void fwd_warp_inside(const bf16_t* tile, int row0, int lane,
                                                const float (&wr)[W][kCV], const float (&br)[kCV],
                                                bf16_t* __restrict__ y, int64_t tg, int64_t c,
                                                int64_t C) {
  constexpr int S = W - 1;
  float win[W][kCV];  // win[j] = row of token t - S + j, for the current token t
#pragma unroll
  for (int j = 0; j < S; ++j) read_row(tile, row0 + j, lane, win[j]);
#pragma unroll
  for (int i = 0; i < kTT; ++i) {
    read_row(tile, row0 + i + S, lane, win[S]);
    float z[kCV];
    preact<W>(wr, br, win, z);
    if constexpr (kSilu) {
#pragma unroll
      for (int v = 0; v < kCV; ++v) z[v] *= sigmoid(z[v]);
    }
    store4(y, (tg + i) * C + c, c, C, z, true);
#pragma unroll
    for (int j = 0; j < S; ++j)
#pragma unroll
      for (int v = 0; v < kCV; ++v) win[j][v] = win[j + 1][v];
  }
}

// Persistent: grid (G, channel blocks); block (b, cb) walks the token tiles b, b + G, ... of
// channel block cb with two tile buffers, the next tile's copies in flight while it computes the
// current one.
template <int W>
__global__ void __launch_bounds__(kThreads, fwd_min_blocks<W>())
    conv_fwd_kernel(const bf16_t* __restrict__ x,     // [T, C]
                    const bf16_t* __restrict__ w,     // [C, W]
                    const bf16_t* __restrict__ bias,  // [C] or null
                    const int32_t* __restrict__ cu,   // [N+1] or null
                    const bf16_t* __restrict__ init,  // [N, C, W-1] or null
                    bf16_t* __restrict__ y,           // [T, C]
                    int64_t T, int64_t C, int N, int64_t ntiles, bool silu, bool vec_load,
                    bool vec_store) {
  constexpr int S = W - 1;
  constexpr int kRows = kBT + S;
  // Two tiles: row r of a tile = token t0 - S + r.
  bf16_t* tiles = reinterpret_cast<bf16_t*>(conv_smem);  // [2, kRows, kBC]
  __shared__ DocSlot docs[2][kBT];
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kBC;
  const int g = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t c = c0 + lane * kCV;
  // Starts the copies of token tile `tile` into buffer `b` and looks up its documents.
  auto issue = [&](int64_t tile, int b) {
    const int64_t t0 = tile * kBT;
    load_tile(tiles + b * kRows * kBC, x, t0 - S, kRows, c0, T, C, vec_load);
    find_docs(docs[b], cu, N, T, t0, kBT);
  };
  issue(blockIdx.x, 0);  // gridDim.x <= ntiles
  cuda::cp_async_commit();
  float wr[W][kCV], br[kCV];
  load_weights<W>(w, bias, c, C, wr, br);

  int b = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, b ^= 1) {
    if (tile + gridDim.x < ntiles) issue(tile + gridDim.x, b ^ 1);
    cuda::cp_async_commit();  // possibly empty: one group per iteration either way
    cuda::cp_async_wait<1>();
    __syncthreads();  // tile `tile` and its documents are visible to every warp

    const bf16_t* cur = tiles + b * kRows * kBC;  // [kRows, kBC]
    const DocSlot* dcur = docs[b];                // [kBT]
    const int64_t tg = tile * kBT + g * kTT;
    // Warp-uniform: the document of the warp's first token holds its S rows before and all kTT
    // tokens (then every token has that document; the test reads only shared memory).
    const DocSlot d0 = dcur[g * kTT];
    if (vec_store && tg - S >= d0.s && tg + kTT <= d0.e && tg + kTT <= T) {
      if (silu) {
        fwd_warp_inside<W, true>(cur, g * kTT, lane, wr, br, y, tg, c, C);
      } else {
        fwd_warp_inside<W, false>(cur, g * kTT, lane, wr, br, y, tg, c, C);
      }
    } else {
      float win[W][kCV];  // win[j] = row of token t - S + j, for the current token t
#pragma unroll
      for (int j = 0; j < S; ++j) read_row(cur, g * kTT + j, lane, win[j]);
#pragma unroll
      for (int i = 0; i < kTT; ++i) {
        read_row(cur, g * kTT + i + S, lane, win[S]);
        const int64_t t = tg + i;
        if (t < T) {
          const DocSlot d = dcur[g * kTT + i];
          float e[W][kCV], z[kCV];
          taps<W>(win, t - d.s, d.n, init, c, C, e);
          preact<W>(wr, br, e, z);
          if (silu) {
#pragma unroll
            for (int v = 0; v < kCV; ++v) z[v] *= sigmoid(z[v]);
          }
          store4(y, t * C + c, c, C, z, vec_store);
        }
#pragma unroll
        for (int j = 0; j < S; ++j)
#pragma unroll
          for (int v = 0; v < kCV; ++v) win[j][v] = win[j + 1][v];
      }
    }
    __syncthreads();  // every warp is done with buffer b before the next iteration refills it
  }
}

// --- backward ----------------------------------------------------------------------------------

// The backward of a warp whose S rows before, kTT tokens and S tokens after all lie in one
// document and before T, with 8-byte stores (vec_store): u of every token reads tile rows only,
// every dx gets all W taps and no dfinal_state term, so no document or state test is needed per
// token. Same arithmetic, in the same order, as the general loop.
template <int W, bool kSilu>
__device__ __forceinline__ void bwd_warp_inside(const bf16_t* tile_x, const bf16_t* tile_dy,
                                                int row0, int lane, const float (&wr)[W][kCV],
                                                const float (&br)[kCV], float (&acc)[W + 1][kCV],
                                                bf16_t* __restrict__ dx, int64_t tg, int64_t c,
                                                int64_t C) {
  constexpr int S = W - 1;
  float win[W][kCV];  // x rows t' - S .. t' for the current u token t'
  float uw[W][kCV];   // uw[m] = u(t' - S + m)
#pragma unroll
  for (int j = 0; j < S; ++j) {
    read_row(tile_x, row0 + j, lane, win[j]);
#pragma unroll
    for (int v = 0; v < kCV; ++v) uw[j][v] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kTT + S; ++i) {
    read_row(tile_x, row0 + i + S, lane, win[S]);
    float z[kCV], dyv[kCV];
    preact<W>(wr, br, win, z);
    read_row(tile_dy, row0 + i, lane, dyv);
#pragma unroll
    for (int v = 0; v < kCV; ++v) {
      float u = dyv[v];
      if constexpr (kSilu) {
        const float sg = sigmoid(z[v]);
        u *= sg * (1.f + z[v] * (1.f - sg));
      }
      uw[S][v] = u;
    }
    if (i < kTT) {  // the warp's own token: its dweight / dbias terms
#pragma unroll
      for (int v = 0; v < kCV; ++v) {
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j][v] = fmaf(uw[S][v], win[j][v], acc[j][v]);
        acc[W][v] += uw[S][v];
      }
    }
    if (i >= S) {
      float o[kCV];
#pragma unroll
      for (int v = 0; v < kCV; ++v) o[v] = 0.f;
#pragma unroll
      for (int j = 0; j < W; ++j)
#pragma unroll
        for (int v = 0; v < kCV; ++v) o[v] = fmaf(wr[j][v], uw[S - j][v], o[v]);
      store4(dx, (tg + i - S) * C + c, c, C, o, true);
    }
#pragma unroll
    for (int j = 0; j < S; ++j)
#pragma unroll
      for (int v = 0; v < kCV; ++v) {
        win[j][v] = win[j + 1][v];
        uw[j][v] = uw[j + 1][v];
      }
  }
}

// The backward of any warp (documents, states, the last tile): per token t' the document test
// and the state taps, dx with the taps of t's own document and the dfinal_state term.
template <int W>
__device__ __forceinline__ void bwd_warp_general(
    const bf16_t* tile_x, const bf16_t* tile_dy, const DocSlot* docs, int g, int lane,
    const float (&wr)[W][kCV], const float (&br)[kCV], float (&acc)[W + 1][kCV],
    const bf16_t* __restrict__ init, const bf16_t* __restrict__ dfin, bf16_t* __restrict__ dx,
    int64_t tg, int64_t c, int64_t C, int64_t T, bool silu, bool vec_store) {
  constexpr int S = W - 1;
  float win[W][kCV];  // x rows t' - S .. t' for the current u token t'
  float uw[W][kCV];   // uw[m] = u(t' - S + m)
#pragma unroll
  for (int j = 0; j < S; ++j) {
    read_row(tile_x, g * kTT + j, lane, win[j]);
#pragma unroll
    for (int v = 0; v < kCV; ++v) uw[j][v] = 0.f;
  }
  // u for t' = tg + i, i < kTT + S; dx for t = t' - S once u(t .. t + S) are known.
#pragma unroll
  for (int i = 0; i < kTT + S; ++i) {
    read_row(tile_x, g * kTT + i + S, lane, win[S]);
    const int64_t tp = tg + i;
#pragma unroll
    for (int v = 0; v < kCV; ++v) uw[S][v] = 0.f;
    if (tp < T) {
      const DocSlot d = docs[g * kTT + i];
      float e[W][kCV], z[kCV], dyv[kCV];
      taps<W>(win, tp - d.s, d.n, init, c, C, e);
      preact<W>(wr, br, e, z);
      read_row(tile_dy, g * kTT + i, lane, dyv);
#pragma unroll
      for (int v = 0; v < kCV; ++v) {
        float u = dyv[v];
        if (silu) {
          const float sg = sigmoid(z[v]);
          u *= sg * (1.f + z[v] * (1.f - sg));
        }
        uw[S][v] = u;
      }
      if (i < kTT) {  // the warp's own token: its dweight / dbias terms
#pragma unroll
        for (int v = 0; v < kCV; ++v) {
#pragma unroll
          for (int j = 0; j < W; ++j) acc[j][v] = fmaf(uw[S][v], e[j][v], acc[j][v]);
          acc[W][v] += uw[S][v];
        }
      }
    }
    if (i >= S) {
      const int64_t t = tg + i - S;
      if (t < T) {
        const DocSlot d = docs[g * kTT + i - S];
        const int64_t lim = d.e - t;  // u(t + m) belongs to t's document for m < lim
        float o[kCV];
#pragma unroll
        for (int v = 0; v < kCV; ++v) o[v] = 0.f;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if (S - j < lim) {
#pragma unroll
            for (int v = 0; v < kCV; ++v) o[v] = fmaf(wr[j][v], uw[S - j][v], o[v]);
          }
        }
        if (dfin != nullptr && S - lim >= 0 && lim > 0) {  // t in the last S of its document
          float f[kCV];
          state_cols<S>(dfin, d.n, S - lim, c, C, f);
#pragma unroll
          for (int v = 0; v < kCV; ++v) o[v] += f[v];
        }
        store4(dx, t * C + c, c, C, o, vec_store);
      }
    }
#pragma unroll
    for (int j = 0; j < S; ++j)
#pragma unroll
      for (int v = 0; v < kCV; ++v) {
        win[j][v] = win[j + 1][v];
        uw[j][v] = uw[j + 1][v];
      }
  }
}

template <int W>
__global__ void __launch_bounds__(kThreads, bwd_min_blocks<W>())
    conv_bwd_kernel(const bf16_t* __restrict__ x,     // [T, C]
                    const bf16_t* __restrict__ w,     // [C, W]
                    const bf16_t* __restrict__ bias,  // [C] or null
                    const int32_t* __restrict__ cu,   // [N+1] or null
                    const bf16_t* __restrict__ init,  // [N, C, W-1] or null
                    const bf16_t* __restrict__ dy,    // [T, C]
                    const bf16_t* __restrict__ dfin,  // [N, C, W-1] or null
                    bf16_t* __restrict__ dx,          // [T, C]
                    float* __restrict__ partial,      // [gridDim.x, W+1, C]
                    int64_t T, int64_t C, int N, int64_t ntiles, bool silu, bool vec_load,
                    bool vec_store) {
  constexpr int S = W - 1;
  constexpr int kXRows = kBT + 2 * S, kDyRows = kBT + S;
  constexpr int kStage = (kXRows + kDyRows) * kBC;
  // Two stages, each x rows [t0 - S, t0 + kBT + S) then dy rows [t0, t0 + kBT + S), [rows, kBC].
  bf16_t* stages = reinterpret_cast<bf16_t*>(conv_smem);  // [2, kXRows + kDyRows, kBC]
  __shared__ DocSlot doc_stages[2][kDocSlots];
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kBC;
  const int g = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t c = c0 + lane * kCV;
  // Starts the copies of token tile `tile` into stage `b` and looks up its documents.
  auto issue = [&](int64_t tile, int b) {
    const int64_t t0 = tile * kBT;
    bf16_t* tx = stages + b * kStage;  // [kXRows + kDyRows, kBC]
    load_tile(tx, x, t0 - S, kXRows, c0, T, C, vec_load);
    load_tile(tx + kXRows * kBC, dy, t0, kDyRows, c0, T, C, vec_load);
    find_docs(doc_stages[b], cu, N, T, t0, kBT + S);
  };
  issue(blockIdx.x, 0);  // gridDim.x <= ntiles
  cuda::cp_async_commit();
  float wr[W][kCV], br[kCV];
  load_weights<W>(w, bias, c, C, wr, br);
  float acc[W + 1][kCV];  // dweight taps, then dbias: this thread's tokens, all its tiles
#pragma unroll
  for (int j = 0; j <= W; ++j)
#pragma unroll
    for (int v = 0; v < kCV; ++v) acc[j][v] = 0.f;

  int b = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, b ^= 1) {
    const int64_t t0 = tile * kBT;
    if (tile + gridDim.x < ntiles) issue(tile + gridDim.x, b ^ 1);
    cuda::cp_async_commit();  // possibly empty: one group per iteration either way
    cuda::cp_async_wait<1>();
    __syncthreads();  // tile `tile` and its documents are visible to every warp
    const bf16_t* tile_x = stages + b * kStage;     // [kXRows, kBC] from t0 - S
    const bf16_t* tile_dy = tile_x + kXRows * kBC;  // [kDyRows, kBC] from t0
    const DocSlot* docs = doc_stages[b];            // [kBT + S]

    const int64_t tg = t0 + g * kTT;
    // Warp-uniform: the document of the warp's first token holds every row the warp reads.
    const DocSlot d0 = docs[g * kTT];
    if (vec_store && tg - S >= d0.s && tg + kTT + S <= d0.e && tg + kTT + S <= T) {
      if (silu) {
        bwd_warp_inside<W, true>(tile_x, tile_dy, g * kTT, lane, wr, br, acc, dx, tg, c, C);
      } else {
        bwd_warp_inside<W, false>(tile_x, tile_dy, g * kTT, lane, wr, br, acc, dx, tg, c, C);
      }
    } else {
      bwd_warp_general<W>(tile_x, tile_dy, docs, g, lane, wr, br, acc, init, dfin, dx, tg, c, C, T,
                          silu, vec_store);
    }
    __syncthreads();  // every warp is done with stage b before the next iteration refills it
  }

  // Sum the warps' partials in warp order (shared memory reused: tiles are done).
  __syncthreads();
  float* red = reinterpret_cast<float*>(conv_smem);  // [kWarps, W+1, kBC]
#pragma unroll
  for (int j = 0; j <= W; ++j)
#pragma unroll
    for (int v = 0; v < kCV; ++v) red[(g * (W + 1) + j) * kBC + lane * kCV + v] = acc[j][v];
  __syncthreads();
  const int col = static_cast<int>(threadIdx.x);  // kThreads == kBC
  if (c0 + col < C) {
    for (int j = 0; j <= W; ++j) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < kWarps; ++k) sum += red[(k * (W + 1) + j) * kBC + col];
      partial[(static_cast<int64_t>(blockIdx.x) * (W + 1) + j) * C + c0 + col] = sum;
    }
  }
}

// --- host side ---------------------------------------------------------------------------------

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The shared checks plus this kernel's tiling.
struct Common : ConvDims {
  int64_t ntiles, ncb;
};

Common common(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens) {
  Common k;
  static_cast<ConvDims&>(k) = conv_dims(x, weight, cu_seqlens, "cuda");
  k.ntiles = (k.T + kBT - 1) / kBT;
  k.ncb = (k.C + kBC - 1) / kBC;
  GDN_CHECK(k.ncb <= 65535, "causal_conv1d (cuda): {} channels is too many (at most {})", k.C,
            65535 * kBC);
  GDN_CHECK(k.ntiles * k.ncb <= INT_MAX, "causal_conv1d (cuda): [{}, {}] is too large", k.T, k.C);
  return k;
}

void forward(const CausalConv1dFwd& a) {
  const Common k = common(a.x, a.weight, a.cu_seqlens);
  if (k.C == 0) return;
  const ConvFwdPtrs p = conv_fwd_ptrs(a);
  const bool vec_load = k.C % 8 == 0 && aligned(p.x, 16);
  const bool vec_store = k.C % 4 == 0 && aligned(p.y, 8);
  const int N = static_cast<int>(k.N);
  cudaStream_t s = cuda::stream();
  with_width<8>(k.W, "cuda", [&](auto wc) {
    constexpr int W = decltype(wc)::value;
    if (k.T > 0) {
      // Persistent grid: the blocks that fit at once, split over the channel blocks.
      const int64_t fit =
          resident_blocks(reinterpret_cast<const void*>(conv_fwd_kernel<W>), kThreads, fwd_smem(W));
      const int64_t G = std::clamp<int64_t>(fit / k.ncb, 1, k.ntiles);
      const dim3 grid(static_cast<unsigned>(G), static_cast<unsigned>(k.ncb));
      conv_fwd_kernel<W><<<grid, kThreads, fwd_smem(W), s>>>(
          p.x, p.w, p.bias, k.cu, p.init, p.y, k.T, k.C, N, k.ntiles, a.silu, vec_load, vec_store);
      GDN_CUDA_LAUNCH_CHECK("conv_fwd_kernel");
    }
    launch_final_state<W>(p, k, s);
  });
}

void backward(const CausalConv1dBwd& a) {
  const Common k = common(a.x, a.weight, a.cu_seqlens);
  if (k.C == 0) return;
  const ConvBwdPtrs p = conv_bwd_ptrs(a);
  const bf16_t *x = p.x, *w = p.w, *bias = p.bias, *init = p.init, *dy = p.dy, *dfin = p.dfin;
  bf16_t* dx = p.dx;
  const bool vec_load = k.C % 8 == 0 && aligned(x, 16) && aligned(dy, 16);
  const bool vec_store = k.C % 4 == 0 && aligned(dx, 8);
  const int N = static_cast<int>(k.N);
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t s = ctx.stream();
  with_width<8>(k.W, "cuda", [&](auto wc) {
    constexpr int W = decltype(wc)::value;
    if (k.T > 0) {
      // Persistent grid: the blocks that fit at once, split over the channel blocks (two stages
      // exceed the default 48 KB of dynamic shared memory: resident_blocks raises the limit).
      const int64_t fit =
          resident_blocks(reinterpret_cast<const void*>(conv_bwd_kernel<W>), kThreads, bwd_smem(W));
      const int64_t G = std::clamp<int64_t>(fit / k.ncb, 1, k.ntiles);
      float* partial = static_cast<float*>(  // [G, W+1, C]
          ctx.scratch(causal_conv1d_partial_bytes(G, W, k.C), "causal_conv1d"));
      const dim3 grid(static_cast<unsigned>(G), static_cast<unsigned>(k.ncb));
      conv_bwd_kernel<W><<<grid, kThreads, bwd_smem(W), s>>>(x, w, bias, k.cu, init, dy, dfin, dx,
                                                             partial, k.T, k.C, N, k.ntiles, a.silu,
                                                             vec_load, vec_store);
      GDN_CUDA_LAUNCH_CHECK("conv_bwd_kernel");
      launch_dw_reduce<W>(p, k, partial, G, s);
    }
    launch_dinit<W>(p, k, a.silu, s);
  });
}

const CausalConv1dTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(causal_conv1d_cuda) {
  Registry::global().add_impl({"causal_conv1d", "cuda.tiled", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
