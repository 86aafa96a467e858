// Causal conv1d on CUDA, "cuda.sliding_window": bf16 x / weight / bias / states / y / dy / dx,
// fp32 dweight / dbias, fp32 arithmetic (op.h has the contract). Covers the shape classes W <= 4
// with C % 8 == 0 and every tensor 16-byte aligned; `supports` rejects every other class (the
// resolver then picks "cuda.tiled", cuda.cu). Both kernels slide the W-tap window in registers
// along the tokens of their run or segment, 8 channels (one 16-byte pack) a lane.
//
// Why a second kernel: cuda.tiled is limited by instruction issue, not memory (a binary search of
// cu_seqlens per token per tile, per-token document tests, 4 channels a lane over 16-token runs
// whose halo and recompute cost 20 %). Here the per-byte instruction count is cut instead:
//
// Backward work split: a warp owns 256 channels (8 a lane: one 16-byte pack per row) and one
// contiguous segment of tokens [a, b): the T tokens of a channel column are cut into P equal
// segments, P = the warps of the column's blocks (a persistent grid: as many blocks as fit at once,
// no fewer than kMinSeg tokens a segment). A warp streams its rows once, in order, so the halo (the
// W-1 rows before a, and in backward the W-1 rows after b) is paid once per segment (~2 % at the
// benchmark shape) instead of once per 16 tokens, and the W-tap window slides in registers.
//
// Streaming: each lane copies its own 16 bytes of every row into a per-warp ring of shared memory
// with cp.async (16-byte, one commit group per kK = 8 rows, kStages groups in the ring), so there
// is no block barrier in the main loop: a lane only ever reads the bytes it copied itself
// (cp.async.wait_group makes them visible to it), and __syncwarp() orders its shared-memory reads
// of a stage before the copies that refill it. Several stages of every warp are in flight at once
// (see the constants), far more than the ~30 KB per multiprocessor that the H200's bandwidth x
// latency needs.
//
// Documents: the warp finds the document of its first token with one binary search of cu_seqlens,
// then walks forward (documents are sorted): the only per-token test is t >= e (the current
// document's end), warp-uniform. At a document start the window's W-1 history rows are replaced
// by the document's initial-state columns (or zeros), so no tap reads another document, and
// nothing of a row is masked by multiplying with zero. Every chunk of kK tokens that needs no test
// at all (inside one document and the segment, and in backward past the first W-1 tokens of both)
// runs an unrolled loop without any; the others run the same arithmetic with the tests. Values
// read from a device cu_seqlens are clamped (start in [0, t], end in [t+1, T]) before they address
// memory, so a garbage cu_seqlens gives garbage values but no out-of-range access.
//
// Forward: its own kernel, not the streaming design (a streamed forward measured slower than
// cuda.tiled's; measured: docs/PERF.md): a block's token tile is staged through shared memory and
// each thread computes a run of R = 16 tokens of 8 channels from it (conv2_fwd_staged_kernel).
// Backward: per token t' of [a, min(b + S, T)) the warp recomputes z and u = dy * silu'(z) from the
// window (Dao's causal-conv1d recomputes z the same way), adds u * ext taps to its dweight / dbias
// register sums for t' < b, and emits dx[t' - S] = sum_j w[j] u[t' - j] once u of its W taps is
// known (all of t's document, since t' < e). At a document end the last W-1 tokens still pending
// are flushed with the taps of their own document plus dfinal_state. dweight / dbias: per-lane
// fp32 sums over the warp's segment, summed over the block's warps in warp order through shared
// memory into one fp32 partial row set per block ([G, W+1, C] in scratch), then the second kernel
// of cuda_state.cuh adds the G partials in block order. No float atomics: the results depend only
// on the shapes, the documents and the device's multiprocessor count. dinitial_state: the small
// kernel of cuda_state.cuh.
//
// Bytes moved: forward x once (+ W-1 halo rows per 8-token run, L2 hits) and y once; backward x
// and dy once (+ 2 (W-1) and W-1 halo rows per segment) and dx once; plus the partials.
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

// The tiles and per-warp rings of the kernels below (dynamic shared memory).
extern __shared__ __align__(16) unsigned char conv2_smem[];

namespace {

constexpr int kV = 8;         // channels per lane: one 16-byte pack of a row
constexpr int kCB = 32 * kV;  // channels per warp (and per block column): 512 bytes of a row
static_assert(kCB <= kCausalConv1dMaxColumn, "op.h's workspace bound assumes wider columns");
constexpr int kK = 8;        // rows per stage (one cp.async commit group)
constexpr int kMaxW = 4;     // widths this kernel covers (W > 4 runs cuda.tiled)
constexpr int kMinSeg = 64;  // shortest segment a warp is given (halo and setup amortise)

// Backward: 2 warps a block, 3 stages of (x, dy) a warp (2 in flight while one is computed,
// 16 KB a warp), 24 KB a warp; 4 blocks (8 warps, 2 per scheduler) a multiprocessor, <= 255
// registers: the window, the u window, the weights and the dweight sums are 8 channels x W fp32
// each (~170 live at W = 4), and 3 warps per scheduler (<= 168) spill.
constexpr int kBwdWarps = 2, kBwdStages = 3, kBwdMinBlocks = 4;

constexpr int kRowU4 = 32;                      // uint4 per ring row (one per lane)
constexpr int kStageU4 = kK * kRowU4;           // uint4 per stage of one tensor
constexpr size_t kStageBytes = kStageU4 * 16u;  // 4 KB
constexpr size_t bwd_smem() { return kBwdWarps * 2 * kBwdStages * kStageBytes; }  // 48 KB
static_assert(kBwdWarps * (kMaxW + 1) * kCB * sizeof(float) <= bwd_smem(),
              "the dweight reduction reuses the ring memory");

// --- device helpers ----------------------------------------------------------------------------

__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[kV]) {
  f[0] = cuda::bf16_lo(u.x);
  f[1] = cuda::bf16_hi(u.x);
  f[2] = cuda::bf16_lo(u.y);
  f[3] = cuda::bf16_hi(u.y);
  f[4] = cuda::bf16_lo(u.z);
  f[5] = cuda::bf16_hi(u.z);
  f[6] = cuda::bf16_lo(u.w);
  f[7] = cuda::bf16_hi(u.w);
}

__device__ __forceinline__ uint4 pack8(const float (&f)[kV]) {
  return make_uint4(cuda::pack2(f[0], f[1]), cuda::pack2(f[2], f[3]), cuda::pack2(f[4], f[5]),
                    cuda::pack2(f[6], f[7]));
}

// A 16-byte store of an output that is not read again (y, dx): st.global.cs, evict-first, so that
// it need not displace x and dy from L2 (faster than plain stores; measured: docs/PERF.md).
__device__ __forceinline__ void put16(bf16_t* p, const uint4& v) {
  __stcs(reinterpret_cast<uint4*>(p), v);
}

// The document of the warp's current token: index, first token, one past its last token.
struct Doc {
  int64_t s, e;
  int n;
};

// The document n of token t (0 <= t < T): the largest n in [0, N-1] with cu[n] <= t (which skips
// zero-length documents), then s, e clamped so that 0 <= s <= t < e <= T whatever cu holds.
// Without cu_seqlens: one document [0, T).
__device__ __forceinline__ Doc find_doc(const int32_t* __restrict__ cu, int N, int64_t T,
                                        int64_t t) {
  if (cu == nullptr) return {0, T, 0};
  int lo = 0, hi = N - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(cu + mid) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t s = __ldg(cu + lo), e = __ldg(cu + lo + 1);
  return {std::clamp<int64_t>(s, 0, t), std::clamp<int64_t>(e, t + 1, T), lo};
}

// find_doc for a token t shared by the 32 lanes of a warp (all of them must call it): a 32-ary
// search, each round one load per lane issued together and a ballot, instead of log2(N)
// dependent loads per thread. For sorted cu the answer is find_doc's (the largest n with
// cu[n] <= t); for garbage cu it is still some n in [0, N-1], clamped the same way. Why: in the
// staged forward the binary search's chain of L2 round trips outlasted the row copies (H200, 1 / 4
// / 16 documents: 70.4 / 71.6 / 76.3 us, each search step ~1.5 us of a block's life).
__device__ __forceinline__ Doc find_doc_warp(const int32_t* __restrict__ cu, int N, int64_t T,
                                             int64_t t) {
  if (cu == nullptr) return {0, T, 0};
  const int lane = static_cast<int>(threadIdx.x) & 31;
  int lo = 0, hi = N - 1;  // the answer lies in [lo, hi]
  while (hi > lo) {        // warp-uniform: lo, hi come from ballots
    const int step = (hi - lo + 31) / 32;
    const int p = lo + 1 + lane * step;  // probes lo + 1 .. >= hi; those past hi count as false
    const bool le = p <= hi && __ldg(cu + p) <= t;
    const int cnt = __popc(__ballot_sync(0xffffffffu, le));
    if (cnt == 0) {
      hi = lo;  // cu[lo + 1] > t
    } else {  // the true probes are lanes [0, cnt) when cu is sorted; p of lane cnt-1 <= hi always
      lo = lo + 1 + (cnt - 1) * step;
      hi = std::min(hi, lo + step - 1);
    }
  }
  const int64_t s = __ldg(cu + lo), e = __ldg(cu + lo + 1);
  return {std::clamp<int64_t>(s, 0, t), std::clamp<int64_t>(e, t + 1, T), lo};
}

// Moves d forward to the document of token t (t >= d.e, t < T): documents are sorted, so walk
// (zero-length ones included) instead of searching. Same clamps as find_doc.
__device__ __forceinline__ void advance_doc(Doc& d, const int32_t* __restrict__ cu, int N,
                                            int64_t T, int64_t t) {
  if (cu == nullptr) {  // unreachable for valid shapes (one document [0, T)): stay in range
    d = {0, T, 0};
    return;
  }
  int n = d.n;
  while (n < N - 1 && __ldg(cu + n + 1) <= t) ++n;
  const int64_t s = __ldg(cu + n), e = __ldg(cu + n + 1);
  d = {std::clamp<int64_t>(s, 0, t), std::clamp<int64_t>(e, t + 1, T), n};
}

// Column k (0 <= k < S) of document n's [C, S] state slice for the lane's 8 channels; zeros
// without a state or for an inactive lane.
template <int S>
__device__ __forceinline__ void state_cols(const bf16_t* __restrict__ st, int n, int k, int64_t c,
                                           int64_t C, bool active, float (&f)[kV]) {
#pragma unroll
  for (int v = 0; v < kV; ++v)
    f[v] = st != nullptr && active ? to_f(st[(static_cast<int64_t>(n) * C + c + v) * S + k]) : 0.f;
}

// The lane's 8 channels of row p of a [T, C] tensor, read directly (the halo rows of a segment).
__device__ __forceinline__ void global_row(const bf16_t* __restrict__ a, int64_t p, int64_t c,
                                           int64_t C, bool active, float (&f)[kV]) {
  if (active) {
    unpack8(__ldg(reinterpret_cast<const uint4*>(a + p * C + c)), f);
  } else {
#pragma unroll
    for (int v = 0; v < kV; ++v) f[v] = 0.f;
  }
}

template <int W>
__device__ __forceinline__ void load_weights(const bf16_t* __restrict__ w,
                                             const bf16_t* __restrict__ bias, int64_t c,
                                             bool active, float (&wr)[W][kV], float (&br)[kV]) {
#pragma unroll
  for (int v = 0; v < kV; ++v) {
#pragma unroll
    for (int j = 0; j < W; ++j) wr[j][v] = active ? to_f(w[(c + v) * W + j]) : 0.f;
    br[v] = active && bias != nullptr ? to_f(bias[c + v]) : 0.f;
  }
}

// The window's S history rows become columns 0 .. S-1 of document n's initial state (or zeros):
// ext[0 .. S-1] of a document that starts at the current token.
template <int W>
__device__ __forceinline__ void window_from_state(float (&win)[W][kV],
                                                  const bf16_t* __restrict__ init, int n, int64_t c,
                                                  int64_t C, bool active) {
  constexpr int S = W - 1;
#pragma unroll
  for (int j = 0; j < S; ++j) state_cols<S>(init, n, j, c, C, active, win[j]);
}

// The window's S history rows for a segment starting at token a of document d: ext of tokens
// a - S .. a - 1 (rows of x inside the document, initial-state columns before it).
template <int W>
__device__ __forceinline__ void window_at_start(float (&win)[W][kV], const bf16_t* __restrict__ x,
                                                const bf16_t* __restrict__ init, const Doc& d,
                                                int64_t a, int64_t c, int64_t C, bool active) {
  constexpr int S = W - 1;
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const int64_t p = a - S + j;
    if (p >= d.s) {  // d.s >= 0, so p is a row of x
      global_row(x, p, c, C, active, win[j]);
    } else {  // p - d.s + S in [0, S) since d.s <= a
      state_cols<S>(init, d.n, static_cast<int>(p - d.s + S), c, C, active, win[j]);
    }
  }
}

template <int W>
__device__ __forceinline__ void shift(float (&r)[W][kV]) {
#pragma unroll
  for (int j = 0; j + 1 < W; ++j)
#pragma unroll
    for (int v = 0; v < kV; ++v) r[j][v] = r[j + 1][v];
}

// --- forward -----------------------------------------------------------------------------------

// The lane's 8 channels of weight [C, W] (W 16-byte pieces from channel c: c % 8 == 0 and weight
// 16-byte aligned) and bias (one 16-byte piece, bias 16-byte aligned) as fp32.
template <int W>
__device__ __forceinline__ void load_weights_vec(const bf16_t* __restrict__ w,
                                                 const bf16_t* __restrict__ bias, int64_t c,
                                                 float (&wr)[W][kV], float (&br)[kV]) {
  float wf[W * kV];  // channel-major: wf[v * W + j] = weight[c + v, j]
#pragma unroll
  for (int q = 0; q < W; ++q) {
    float f[kV];
    unpack8(__ldg(reinterpret_cast<const uint4*>(w + c * W) + q), f);
#pragma unroll
    for (int v = 0; v < kV; ++v) wf[q * kV + v] = f[v];
  }
#pragma unroll
  for (int j = 0; j < W; ++j)
#pragma unroll
    for (int v = 0; v < kV; ++v) wr[j][v] = wf[v * W + j];
  if (bias != nullptr) {
    unpack8(__ldg(reinterpret_cast<const uint4*>(bias + c)), br);
  } else {
#pragma unroll
    for (int v = 0; v < kV; ++v) br[v] = 0.f;
  }
}

// The R outputs of one run, tokens t0 .. t0 + R - 1 of channels c .. c + 7, from its rows
// row(r) = x[t0 - S + r] (r < R + S; rows before the document never read): the loop without
// tests when the run lies inside document d, else the general one (document edges, the end of T,
// taps from the initial state; not unrolled: unrolled, W = 4 spilled). Same arithmetic, in the
// same order, as cuda.tiled (preact, sigmoid): y is bit-identical to it.
template <int W, int R, bool kSilu, class Row>
__device__ __forceinline__ void conv2_fwd_run(Row row, const float (&wr)[W][kV],
                                              const float (&br)[kV], Doc& d,
                                              const int32_t* __restrict__ cu, int N,
                                              const bf16_t* __restrict__ init,
                                              bf16_t* __restrict__ y, int64_t T, int64_t C,
                                              int64_t c, int64_t t0) {
  constexpr int S = W - 1;
  auto put = [&](int64_t t, float(&z)[kV]) {
    if constexpr (kSilu) {
#pragma unroll
      for (int v = 0; v < kV; ++v) z[v] *= sigmoid(z[v]);
    }
    put16(y + t * C + c, pack8(z));
  };
  if (t0 - S >= d.s && t0 + R <= d.e) {  // d.e <= T
    float win[W][kV];
#pragma unroll
    for (int j = 0; j < S; ++j) unpack8(row(j), win[j]);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      unpack8(row(i + S), win[S]);
      float z[kV];
      preact<W>(wr, br, win, z);
      put(t0 + i, z);
      shift<W>(win);
    }
  } else {
#pragma unroll 1
    for (int i = 0; i < R; ++i) {
      const int64_t t = t0 + i;
      if (t >= T) break;
      if (t >= d.e) advance_doc(d, cu, N, T, t);
      float e[W][kV];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int64_t p = t - S + j;
        if (p >= d.s) {  // a row of x (0 <= d.s <= p <= t < T), among the run's rows
          unpack8(row(i + j), e[j]);
        } else {  // p - d.s + S in [0, S) since d.s <= t
          state_cols<S>(init, d.n, static_cast<int>(p - d.s + S), c, C, true, e[j]);
        }
      }
      float z[kV];
      preact<W>(wr, br, e, z);
      put(t, z);
    }
  }
}

// Forward: the rows of a block's token tile go through shared memory (cp.async), not registers.
// Why: a thread that holds its R + W-1 rows in registers leaves a multiprocessor few blocks and
// few loads in flight (measured: docs/PERF.md). Here a block of kStWarps warps owns kStWarps * R
// consecutive tokens of one 256-channel column: lane l of warp q copies its 16 bytes of rows
// tb + q R .. tb + q R + R-1 into the tile, warp 0 also the W-1 rows before tb, then (weights and
// document loaded meanwhile) one barrier, and each thread computes its R outputs from the tile
// (the tile row of token p is p - tb + W-1: thread (q, l) reads rows q R .. q R + R + W-2).
// Registers do not grow with R: at R = 16 and five blocks a multiprocessor (<= 96 registers, no
// spills; 34 KB of tile a block) 640 threads keep 164 KB in flight, and the halo is loaded once
// per kStWarps R = 64 tokens. Stores evict-first.
constexpr int kStWarps = 4;
template <int W, int R>
constexpr size_t st_smem() {
  return static_cast<size_t>(kStWarps * R + W - 1) * kRowU4 * 16;
}

// MB: blocks a multiprocessor (the launch bounds; 4 measured no faster than 5). The document of
// the warp's first token by find_doc_warp.
template <int W, int R, int MB, bool kSilu>
__global__ void __launch_bounds__(kStWarps * 32, MB)
    conv2_fwd_staged_kernel(const bf16_t* __restrict__ x,     // [T, C]
                            const bf16_t* __restrict__ w,     // [C, W]
                            const bf16_t* __restrict__ bias,  // [C] or null
                            const int32_t* __restrict__ cu,   // [N+1] or null
                            const bf16_t* __restrict__ init,  // [N, C, W-1] or null
                            bf16_t* __restrict__ y,           // [T, C]
                            int64_t T, int64_t C, int N, int64_t ncb) {
  constexpr int S = W - 1;
  constexpr int kRows = kStWarps * R + S;
  // [rows tb - S .. tb + kStWarps R - 1][lanes] (dynamic: st_smem<W, R>() bytes)
  auto tile = reinterpret_cast<uint4(*)[kRowU4]>(conv2_smem);
  static_assert(kRows * kRowU4 * 16 == st_smem<W, R>());
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  // Column-fastest block order: the blocks resident at once cover whole rows of x and y.
  const int64_t col = static_cast<int64_t>(blockIdx.x) % ncb;
  const int64_t tb = static_cast<int64_t>(blockIdx.x) / ncb * (kStWarps * R);
  const int64_t c = col * kCB + lane * kV;
  const bool active = c < C;
  const int64_t t0 = tb + warp * R;  // may be >= T: the warp then only joins the barrier
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t p = t0 + r;
    const bool ok = active && p < T;
    cuda::cp_async16_zfill(&tile[S + warp * R + r][lane], ok ? x + p * C + c : x, ok ? 16 : 0);
  }
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      const int64_t p = tb - S + j;
      const bool ok = active && p >= 0;
      cuda::cp_async16_zfill(&tile[j][lane], ok ? x + p * C + c : x, ok ? 16 : 0);
    }
  }
  cuda::cp_async_commit();
  float wr[W][kV], br[kV];
  if (active) {
    load_weights_vec<W>(w, bias, c, wr, br);
  } else {
#pragma unroll
    for (int v = 0; v < kV; ++v) {
#pragma unroll
      for (int j = 0; j < W; ++j) wr[j][v] = 0.f;
      br[v] = 0.f;
    }
  }
  const int64_t tq = std::min<int64_t>(t0, T - 1);  // warp-uniform
  Doc d = find_doc_warp(cu, N, T, tq);
  cuda::cp_async_wait<0>();
  __syncthreads();
  if (!active || t0 >= T) return;
  const uint4* rows = &tile[warp * R][lane];  // rows[r * kRowU4]: token t0 - S + r
  // The edge loop not unrolled (rare: a document edge, the end of T, a state): fewer registers.
  conv2_fwd_run<W, R, kSilu>([&](int r) { return rows[r * kRowU4]; }, wr, br, d, cu, N, init, y, T,
                             C, c, t0);
}

// --- backward ----------------------------------------------------------------------------------

// grid (G, channel columns), kBwdWarps warps a block; warp q = blockIdx.x * kBwdWarps + warp of a
// column owns tokens [T q / P, T (q+1) / P), P = G kBwdWarps. Writes dx rows
// [a, b) of its segment and its block's dweight / dbias partial row set partial[blockIdx.x].
template <int W, bool kSilu>
__global__ void __launch_bounds__(kBwdWarps * 32, kBwdMinBlocks)
    conv2_bwd_kernel(const bf16_t* __restrict__ x,     // [T, C]
                     const bf16_t* __restrict__ w,     // [C, W]
                     const bf16_t* __restrict__ bias,  // [C] or null
                     const int32_t* __restrict__ cu,   // [N+1] or null
                     const bf16_t* __restrict__ init,  // [N, C, W-1] or null
                     const bf16_t* __restrict__ dy,    // [T, C]
                     const bf16_t* __restrict__ dfin,  // [N, C, W-1] or null
                     bf16_t* __restrict__ dx,          // [T, C]
                     float* __restrict__ partial,      // [gridDim.x, W+1, C]
                     int64_t T, int64_t C, int N) {
  cuda::pdl_launch_dependents();  // the dweight reduction's blocks may wait on the device now
  constexpr int S = W - 1;
  constexpr int NS = kBwdStages;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t P = static_cast<int64_t>(gridDim.x) * kBwdWarps;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kBwdWarps + warp;
  const int64_t a = T * q / P, b = T * (q + 1) / P;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kCB;
  const int64_t c = c0 + lane * kV;
  const bool active = c < C;
  float acc[W + 1][kV];  // dweight taps, then dbias: this lane's tokens of the segment
#pragma unroll
  for (int j = 0; j <= W; ++j)
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[j][v] = 0.f;

  if (a < b) {  // warp-uniform; an empty segment only joins the reduction
    // Rows [a, rend) of x and dy: u of the S tokens after b is needed by dx of b - S .. b - 1.
    const int64_t rend = std::min<int64_t>(b + S, T);
    const int64_t nchunks = (rend - a + kK - 1) / kK;
    uint4* ring_x = reinterpret_cast<uint4*>(conv2_smem) + warp * 2 * NS * kStageU4 + lane;
    uint4* ring_dy = ring_x + NS * kStageU4;  // each [NS, kK] rows of the lane's 16 bytes
    auto issue = [&](int64_t k) {
      if (k < nchunks) {
        const int64_t r0 = a + k * kK;
        const int off = static_cast<int>(k % NS) * kStageU4;
#pragma unroll
        for (int r = 0; r < kK; ++r) {
          if (r0 + r < rend) {
            const int64_t g = (r0 + r) * C + c;
            cuda::cp_async16_zfill(ring_x + off + r * kRowU4, active ? x + g : x, active ? 16 : 0);
            cuda::cp_async16_zfill(ring_dy + off + r * kRowU4, active ? dy + g : dy,
                                   active ? 16 : 0);
          }
        }
      }
      cuda::cp_async_commit();
    };
#pragma unroll
    for (int k = 0; k < NS; ++k) issue(k);

    float wr[W][kV], br[kV];
    load_weights<W>(w, bias, c, active, wr, br);
    Doc d = find_doc(cu, N, T, a);
    float win[W][kV];  // win[j] = ext of token t' - S + j, for the current token t'
    float uw[W][kV];   // uw[m] = u(t' - S + m); only entries of tokens in [max(a, d.s), t'] are
                       // ever read (dx of t reads u(t .. t + S))
    window_at_start<W>(win, x, init, d, a, c, C, active);
#pragma unroll
    for (int j = 0; j < W; ++j)
#pragma unroll
      for (int v = 0; v < kV; ++v) uw[j][v] = 0.f;

    // dx of the tokens e - S .. e - 1 of document d still pending when the walk reaches its end e
    // (uw[m] = u(e - S + m)): the taps inside the document plus dfinal_state. Only tokens of
    // [max(a, d.s), b) are written.
    auto flush = [&]() {
#pragma unroll
      for (int i = 0; i < S; ++i) {
        const int64_t t = d.e - S + i;
        if (t < a || t < d.s || t >= b) continue;
        float o[kV];
        state_cols<S>(dfin, d.n, i, c, C, active, o);  // dext[L + i] = dfinal_state[i] + ...
#pragma unroll
        for (int j = i + 1; j < W; ++j)  // u(t + S - j) inside the document: t + S - j < e
#pragma unroll
          for (int v = 0; v < kV; ++v) o[v] = fmaf(wr[j][v], uw[i + S - j][v], o[v]);
        if (active) put16(dx + t * C + c, pack8(o));
      }
    };

    // Token t' from ring rows xr, dr: u(t'), its dweight / dbias terms when t' < b (kAcc), and
    // dx of t = t' - S when kEmit (every u it reads is of t's document). Then the windows slide.
    auto token = [&](const uint4* xr, const uint4* dr, int64_t tp, bool acc_on, bool emit) {
      unpack8(*xr, win[S]);
      float z[kV], g[kV];
      preact<W>(wr, br, win, z);
      unpack8(*dr, g);
#pragma unroll
      for (int v = 0; v < kV; ++v) {
        float u = g[v];
        if constexpr (kSilu) {
          const float sg = sigmoid(z[v]);
          u *= sg * (1.f + z[v] * (1.f - sg));
        }
        uw[S][v] = u;
      }
      if (acc_on) {
#pragma unroll
        for (int v = 0; v < kV; ++v) {
#pragma unroll
          for (int j = 0; j < W; ++j) acc[j][v] = fmaf(uw[S][v], win[j][v], acc[j][v]);
          acc[W][v] += uw[S][v];
        }
      }
      if (emit) {
        float o[kV];
#pragma unroll
        for (int v = 0; v < kV; ++v) o[v] = 0.f;
#pragma unroll
        for (int j = 0; j < W; ++j)
#pragma unroll
          for (int v = 0; v < kV; ++v) o[v] = fmaf(wr[j][v], uw[S - j][v], o[v]);
        if (active) put16(dx + (tp - S) * C + c, pack8(o));
      }
      shift<W>(win);
      shift<W>(uw);
    };

    bool done = false;
    for (int64_t k = 0; k < nchunks && !done; ++k) {
      cuda::cp_async_wait<NS - 1>();  // chunk k (this lane's copies) has landed
      const int off = static_cast<int>(k % NS) * kStageU4;
      const int64_t t0 = a + k * kK;
      if (t0 + kK <= d.e && t0 + kK <= b && t0 - S >= std::max(a, d.s)) {
        // One document, every token of the segment, every dx of the document: no test.
#pragma unroll
        for (int i = 0; i < kK; ++i)
          token(ring_x + off + i * kRowU4, ring_dy + off + i * kRowU4, t0 + i, true, true);
      } else {
#pragma unroll 1
        for (int i = 0; i < kK; ++i) {
          const int64_t tp = t0 + i;
          if (tp >= d.e) {  // the walk leaves document d: flush it, then enter the next one
            flush();
            if (tp >= b) {
              done = true;
              break;
            }
            advance_doc(d, cu, N, T, tp);
            window_from_state<W>(win, init, d.n, c, C, active);
#pragma unroll
            for (int j = 0; j < W; ++j)
#pragma unroll
              for (int v = 0; v < kV; ++v) uw[j][v] = 0.f;
          }
          if (tp >= rend) {  // tp = b + S < d.e: every dx of [a, b) is written
            done = true;
            break;
          }
          token(ring_x + off + i * kRowU4, ring_dy + off + i * kRowU4, tp, tp < b,
                tp - S >= std::max(a, d.s));
        }
      }
      __syncwarp();  // this stage's shared-memory reads are performed before it is refilled
      issue(k + NS);
    }
    // The walk stopped at rend without reaching the step that ends the last document: when
    // rend = T (or the document ends exactly at rend), flush it.
    if (!done && rend >= d.e) flush();
  }

  // Sum the warps' partials in warp order (the rings are reused: wait for every copy first).
  cuda::cp_async_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(conv2_smem);  // [kBwdWarps, W+1, kCB]
#pragma unroll
  for (int j = 0; j <= W; ++j)
#pragma unroll
    for (int v = 0; v < kV; ++v) red[(warp * (W + 1) + j) * kCB + lane * kV + v] = acc[j][v];
  __syncthreads();
  for (int idx = static_cast<int>(threadIdx.x); idx < (W + 1) * kCB; idx += kBwdWarps * 32) {
    const int j = idx / kCB, col = idx % kCB;
    if (c0 + col >= C) continue;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kBwdWarps; ++k) sum += red[(k * (W + 1) + j) * kCB + col];
    partial[(static_cast<int64_t>(blockIdx.x) * (W + 1) + j) * C + c0 + col] = sum;
  }
}

// --- host side ---------------------------------------------------------------------------------

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// The calls this kernel covers: W <= 4, C % 8 == 0 (whole 16-byte packs per lane), 16-byte
// aligned tensors, at most 65535 channel columns: the classes `supports` accepts.
bool covered(const Tensor& x, const Tensor& weight, const Tensor& a, const Tensor& b,
             const Tensor& c) {
  const int64_t C = x.size(1);
  bool ok = weight.size(1) <= kMaxW && C % 8 == 0 && (C + kCB - 1) / kCB <= 65535;
  for (const Tensor* t : {&x, &a, &b, &c})
    if (t->defined()) ok = ok && aligned16(*t);
  return ok;
}

// The shape classes this kernel covers (op.cpp's class_of: W, C and "vec", every tensor read as
// 16-byte pieces aligned): the resolver picks cuda.tiled for every other class, the default one
// (no dims: `ops run`, whose probe runs 13 channels) included.
std::string supports(const OpQuery& q) {
  const int64_t W = q.dim("W", -1), C = q.dim("C", -1);
  if (W < 0 || C < 0) return "needs the call's width and channels (shape class)";
  if (W > kMaxW) return fmt::format("W = {} above {}", W, kMaxW);
  if (q.dim("vec", 0) == 0) return "channels not whole 16-byte packs or tensors not aligned";
  if ((C + kCB - 1) / kCB > 65535) return fmt::format("C = {}: too many channel columns", C);
  return "";
}

// The shared checks plus this kernel's channel columns.
struct Shape : ConvDims {
  int64_t ncb;
};

Shape shape_of(const Tensor& x, const Tensor& weight, const Tensor& cu_seqlens) {
  Shape k;
  static_cast<ConvDims&>(k) = conv_dims(x, weight, cu_seqlens, "cuda.sliding_window");
  k.ncb = (k.C + kCB - 1) / kCB;
  return k;
}

// Blocks per channel column: the blocks that fit at once split over the columns, but no more
// than give every warp kMinSeg tokens.
int64_t blocks_per_column(const void* kernel, int warps, size_t smem, const Shape& k) {
  const int64_t fit = resident_blocks(kernel, warps * 32, smem);
  const int64_t segs = (k.T + kMinSeg - 1) / kMinSeg;
  const int64_t useful = std::max<int64_t>((segs + warps - 1) / warps, 1);
  return std::clamp<int64_t>(fit / k.ncb, 1, std::min<int64_t>(useful, 65535));
}

// Forward through the staged kernel: R tokens a thread, MB blocks a multiprocessor (a call outside
// the classes `supports` accepts is a resolver bug, not a fallback; weight and bias are read as
// 16-byte pieces too); then the final states.
template <int R, int MB>
void forward_staged(const CausalConv1dFwd& a) {
  GDN_CHECK(covered(a.x, a.weight, a.y, a.weight, a.bias),
            "causal_conv1d (cuda.sliding_window): a call outside its shape class (W = {}, C = {})",
            a.weight.size(1), a.x.size(1));
  const Shape k = shape_of(a.x, a.weight, a.cu_seqlens);
  if (k.C == 0) return;
  const ConvFwdPtrs p = conv_fwd_ptrs(a);
  cudaStream_t s = cuda::stream();
  with_width<kMaxW>(k.W, "cuda.sliding_window", [&](auto wc) {
    constexpr int W = decltype(wc)::value;
    if (k.T > 0) {
      const int64_t tiles = (k.T + kStWarps * R - 1) / (kStWarps * R);
      const int64_t blocks = tiles * k.ncb;
      GDN_CHECK(blocks <= INT_MAX, "causal_conv1d (cuda.sliding_window): [{}, {}] is too large",
                k.T, k.C);
      auto launch = [&](auto kernel) {
        // The residency the launch bounds promise (MB blocks of up to 51 KB) needs more than the
        // default carveout and, past 48 KB, the opt-in; set on every call, per device (cheap:
        // driver attributes).
        constexpr size_t smem = st_smem<W, R>();
        GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
        GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
        kernel<<<static_cast<unsigned>(blocks), kStWarps * 32, smem, s>>>(
            p.x, p.w, p.bias, k.cu, p.init, p.y, k.T, k.C, static_cast<int>(k.N), k.ncb);
        GDN_CUDA_LAUNCH_CHECK("conv2_fwd_staged_kernel");
      };
      if (a.silu)
        launch(conv2_fwd_staged_kernel<W, R, MB, true>);
      else
        launch(conv2_fwd_staged_kernel<W, R, MB, false>);
    }
    launch_final_state<W>(p, k, s);
  });
}

void backward(const CausalConv1dBwd& a) {
  GDN_CHECK(covered(a.x, a.weight, a.dy, a.dx, Tensor()),
            "causal_conv1d (cuda.sliding_window): a call outside its shape class (W = {}, C = {})",
            a.weight.size(1), a.x.size(1));
  const Shape k = shape_of(a.x, a.weight, a.cu_seqlens);
  if (k.C == 0) return;
  const ConvBwdPtrs p = conv_bwd_ptrs(a);
  const bf16_t *x = p.x, *w = p.w, *bias = p.bias, *init = p.init, *dy = p.dy, *dfin = p.dfin;
  bf16_t* dx = p.dx;
  const int N = static_cast<int>(k.N);
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t s = ctx.stream();
  with_width<kMaxW>(k.W, "cuda.sliding_window", [&](auto wc) {
    constexpr int W = decltype(wc)::value;
    if (k.T > 0) {
      auto launch = [&](auto kernel) {
        const int64_t G =
            blocks_per_column(reinterpret_cast<const void*>(kernel), kBwdWarps, bwd_smem(), k);
        float* partial = static_cast<float*>(  // [G, W+1, C]
            ctx.scratch(causal_conv1d_partial_bytes(G, W, k.C),
                        "causal_conv1d (cuda.sliding_window)"));
        const dim3 grid(static_cast<unsigned>(G), static_cast<unsigned>(k.ncb));
        kernel<<<grid, kBwdWarps * 32, bwd_smem(), s>>>(x, w, bias, k.cu, init, dy, dfin, dx,
                                                        partial, k.T, k.C, N);
        GDN_CUDA_LAUNCH_CHECK("conv2_bwd_kernel");
        launch_dw_reduce<W>(p, k, partial, G, s);
      };
      if (a.silu)
        launch(conv2_bwd_kernel<W, true>);
      else
        launch(conv2_bwd_kernel<W, false>);
    }
    launch_dinit<W>(p, k, a.silu, s);
  });
}

// 16 tokens a thread and five blocks a multiprocessor in the forward (four blocks, and 24 tokens,
// measured slower: docs/PERF.md).
const CausalConv1dTable kTable{forward_staged<16, 5>, backward};

}  // namespace

// Above cuda.tiled (priority 10) in the classes `supports` accepts (formerly "cuda.v2sw"; its
// siblings cuda.v2, cuda.v2cs and cuda.v2st5 measured slower: docs/PERF.md).
GDN_REGISTER(causal_conv1d_cuda_sliding_window) {
  Registry::global().add_impl(
      {"causal_conv1d", "cuda.sliding_window", Backend::Cuda, 27, supports, &kTable});
}

}  // namespace gdn::ops
