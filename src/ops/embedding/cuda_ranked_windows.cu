// Embedding on CUDA, "cuda.ranked_windows": the forward of cuda.sorted_windows and a backward
// rebuilt around where that one spends its time: the ids ranked by counting in one kernel instead
// of sorted in one block, dW summed over windows of sorted positions with evict-first dW rows
// (op.h has the contract; cuda.cu keeps cuda.sorted_windows, the implementation for any device).
//
// Where cuda.sorted_windows' backward loses time (T = 8192 uniform ids over V = 248320, D = 4096:
// 127.7 us against 78 us of bytes at copy bandwidth):
//  - its sort is one block (cub::BlockRadixSort, 1024 threads x 8 keys, 4-bit digits: five passes
//    of ranking, a block scan and two shared-memory exchanges each) on one multiprocessor while
//    the other 131 idle, then two dependent launches with their own start-up;
//  - the step that combines segments spanning several windows is a third launch that every
//    window's block enters to read three keys, although a few windows own such a segment;
//  - each thread's dW row segment is 8 consecutive floats read and written as two 16-byte
//    accesses 32 bytes apart, so every warp instruction touches each 32-byte sector half.
//
// Backward here (same order semantics as cuda.sorted_windows: windows of sorted positions summed
// in t order, windows combined in window order, no float atomics):
//  1. Rank kernel (T <= kRankMaxT): every block builds, in shared memory, all T keys (id, or V for
//     an invalid id) bucketed by their high bits (histogram by shared-memory atomics, a block scan,
//     a scatter), then ranks its own 256 tokens: one warp per token counts, inside the token's
//     bucket, the keys that are smaller and the equal keys at smaller t. The rank is the stable
//     sorted position of (key, t) exactly (the bucket order does not matter: only counts are
//     used), so the output equals a stable radix sort's. The same counts give each token's
//     segment [first, end) of equal keys; the tokens at a window's first and last positions write
//     the window's head segment start and tail segment end. 32 blocks for T = 8192, one launch;
//     the work a block repeats (T / 1024 keys per thread) is latency, not bandwidth. Longer
//     sequences: the keys kernel, cub::DeviceRadixSort and a bounds kernel (binary searches).
//     Either way the first kernel also zeroes the combine counters of step 2.
//  2. dW kernel, a persistent grid over items (window of kWin sorted positions, 1024-column
//     chunk), window-major, launched with programmatic dependent launch so that its blocks are
//     resident and waiting (griddepcontrol.wait) while step 1 runs. A block prefetches the next
//     item's keys and tokens while it works on the current one, and each thread the next batch's
//     dy and dW rows into L2 (prefetch) while it loads the current batch. A thread owns two groups
//     of 4 consecutive columns 512 apart: every warp access covers whole sectors (256 B of dy, 512
//     B of dW). Runs wholly inside the window go straight to dW (read-modify-write, the only writer
//     of that row). A run that continues from an earlier window or into a later one is stored as
//     the window's head (slot 0) or tail (slot 1) partial; the block then increments the segment's
//     counter (slot of its first window, after a __threadfence), and the block that brings it to
//     the number of windows the segment spans adds the first window's tail and the later windows'
//     heads, in window order, to dW (no waiting on other blocks, no third launch).
// Every dW element thus receives its terms in an order fixed by the ids alone: bitwise
// reproducible. The window size is a kernel argument (16; windows of 8 and 32 measured the same or
// slower: docs/PERF.md): it changes the rounding, not the determinism.
// With a plan (op.h), step 1 runs in the forward instead, on a side stream beside the gather, into
// the plan; the backward is then step 2 alone, and step 2 sets each combine counter back to zero
// as the segment's last block takes it, so the plan serves any number of backwards (measured:
// docs/PERF.md).
// Bytes moved (the floor): dy, ids, and the touched dW rows read and written; plus ~20 bytes per
// token of ranks and the partials of spanning segments.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/embedding/cuda_keys.cuh"
#include "ops/embedding/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

constexpr int kRankThreads = 1024;
constexpr int kRankTokens = 256;     // tokens ranked per block (8 per warp) beside the gather
constexpr int kRankTokensFine = 64;  // in the backward: 2 per warp, 4 x the blocks
constexpr int kRankIdBatch = 8;      // ids loaded per thread before their first use
constexpr int kRankBinBits = 12;     // at most 4096 buckets
constexpr int kRankMaxT = 16384;     // beyond: cub::DeviceRadixSort
constexpr int kRankMaxBins = 1 << kRankBinBits;
constexpr size_t kRankSmemMax = (2 * size_t{kRankMaxT} + 2 * size_t{kRankMaxBins} + 1) * 4;

constexpr int kDwThreads = 128;
constexpr int kGroups = 2;   // column groups per thread, kDwThreads * V apart
constexpr int kBatch = 2;    // positions whose loads are issued together
constexpr int kMaxWin = 64;  // window sizes accepted (shared-memory staging arrays)
// The window (16; windows of 8 and 32 measured the same or slower: docs/PERF.md) and the
// narrowest column chunk (V = 1) are the plan's (op.h).
constexpr int kPlanWin = static_cast<int>(EmbeddingPlanLayout::kWin);
static_assert(kPlanWin >= 4 && kPlanWin % 4 == 0 && kPlanWin <= kMaxWin,
              "staging: 16-byte pieces of the window, at most 16 per array");
static_assert(kGroups * kDwThreads == EmbeddingPlanLayout::kChunkCols);

// Programmatic dependent launch (memory_bound.cuh): the dW kernel waits for the ranks.
using cuda::pdl_launch_dependents;
using cuda::pdl_wait;

// --- step 1: ranks ---------------------------------------------------------------------------

// Output of step 1, read by step 2.
struct Ranked {
  uint32_t* keys;  // [T] sorted keys (ids; V for an invalid id, sorted last)
  uint32_t* toks;  // [T] token at each sorted position
  // [nwin] per window: .x first sorted position of the segment holding the window's first
  // position, .y end (one past) of the segment holding its last position (.z, .w unused: 16 bytes
  // for one cp.async)
  uint4* win_info;
  uint32_t* counters;  // [nwin * chunks] combine counters, zeroed by step 1
  int ncounters;
};

__device__ __forceinline__ void zero_counters(const Ranked& r) {
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < r.ncounters;
       i += stride)
    r.counters[i] = 0;
}

// grid ceil(T / per_block), kRankThreads threads, (2 T + 2 nbins + 1) * 4 bytes of dynamic
// shared memory. Buckets: key >> shift, nbins = (vocab >> shift) + 1 <= kRankMaxBins.
// `per_block`: tokens ranked per block (grid ceil(T / per_block)). Every block repeats the O(T)
// bucketing; the ranking is O(per_block). At T = 8192, 256 tokens a block leave 32 blocks each
// busy ~19k cycles, so the backward spreads the ranking over 4 x the blocks (64 tokens, 2 per
// warp); the forward's ranking, beside the gather, keeps 256.
template <class Id>
__global__ void __launch_bounds__(kRankThreads)
    emb2_rank_kernel(const Id* __restrict__ ids,  // [T]
                     Ranked r, int T, int64_t vocab, int shift, int nbins, int win, int per_block) {
  pdl_launch_dependents();  // the dW kernel may take its place now; it waits for our end
  extern __shared__ uint32_t smem[];
  uint32_t* skey = smem;              // [T] keys in token order
  uint32_t* members = skey + T;       // [T] tokens grouped by bucket (any order inside)
  uint32_t* start = members + T;      // [nbins + 1] first member of each bucket
  uint32_t* cur = start + nbins + 1;  // [nbins] counts, then scatter cursors
  __shared__ uint32_t warp_sum[kRankThreads / 32];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const uint32_t invalid = static_cast<uint32_t>(vocab);

  zero_counters(r);
  for (int b = tid; b < nbins; b += kRankThreads) cur[b] = 0;
  __syncthreads();
  // Keys and bucket counts (integer atomics: the counts do not depend on the order).
  for (int base = 0; base < T; base += kRankThreads * kRankIdBatch) {
    int64_t v[kRankIdBatch];
#pragma unroll
    for (int j = 0; j < kRankIdBatch; ++j) {
      const int t = base + j * kRankThreads + tid;
      v[j] = t < T ? static_cast<int64_t>(ids[t]) : 0;
    }
#pragma unroll
    for (int j = 0; j < kRankIdBatch; ++j) {
      const int t = base + j * kRankThreads + tid;
      if (t < T) {
        const uint32_t k = v[j] >= 0 && v[j] < vocab ? static_cast<uint32_t>(v[j]) : invalid;
        skey[t] = k;
        atomicAdd(&cur[k >> shift], 1u);
      }
    }
  }
  __syncthreads();
  // Exclusive scan of the counts: thread tid owns buckets [tid * per, tid * per + per).
  const int per = (nbins + kRankThreads - 1) / kRankThreads;
  const int b0 = tid * per;
  uint32_t local = 0;
  for (int j = 0; j < per; ++j)
    if (b0 + j < nbins) local += cur[b0 + j];
  uint32_t incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const uint32_t mine = warp_sum[lane];
    uint32_t wi = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t x = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += x;
    }
    warp_sum[lane] = wi - mine;  // exclusive prefix of the warp totals
  }
  __syncthreads();
  uint32_t run = warp_sum[warp] + incl - local;
  for (int j = 0; j < per; ++j) {
    if (b0 + j < nbins) {
      const uint32_t c = cur[b0 + j];
      start[b0 + j] = run;
      cur[b0 + j] = run;
      run += c;
    }
  }
  if (tid == 0) start[nbins] = static_cast<uint32_t>(T);
  __syncthreads();
  // Scatter the tokens into their buckets (the order inside a bucket is whatever the atomics give:
  // the ranks below only count).
  for (int t = tid; t < T; t += kRankThreads) {
    const uint32_t pos = atomicAdd(&cur[skey[t] >> shift], 1u);
    members[pos] = static_cast<uint32_t>(t);
  }
  __syncthreads();
  // Rank this block's tokens, one warp per token.
  const int first = static_cast<int>(blockIdx.x) * per_block;
  const int last = min(T, first + per_block);
  for (int t = first + warp; t < last; t += kRankThreads / 32) {
    const uint32_t k = skey[t];
    const uint32_t lo = start[k >> shift], hi = start[(k >> shift) + 1];
    uint32_t less = 0, eq = 0, before = 0;
    for (uint32_t j = lo + static_cast<uint32_t>(lane); j < hi; j += 32) {
      const uint32_t m = members[j];
      const uint32_t km = skey[m];
      less += km < k ? 1u : 0u;
      eq += km == k ? 1u : 0u;
      before += km == k && m < static_cast<uint32_t>(t) ? 1u : 0u;
    }
    less = __reduce_add_sync(0xffffffffu, less);
    eq = __reduce_add_sync(0xffffffffu, eq);
    before = __reduce_add_sync(0xffffffffu, before);
    if (lane == 0) {
      const uint32_t seg = lo + less, rank = seg + before;  // eq >= 1: t itself
      r.keys[rank] = k;
      r.toks[rank] = static_cast<uint32_t>(t);
      const uint32_t w = rank / static_cast<uint32_t>(win), off = rank % static_cast<uint32_t>(win);
      if (off == 0) r.win_info[w].x = seg;
      if (off == static_cast<uint32_t>(win) - 1 || rank == static_cast<uint32_t>(T) - 1)
        r.win_info[w].y = seg + eq;
    }
  }
}

// After the device-wide sort: each window's head segment start and tail segment end by binary
// search over the sorted keys; the combine counters zeroed. One thread per window (grid-stride
// over the counters).
__global__ void __launch_bounds__(256) emb2_bounds_kernel(Ranked r, int T, int win, int nwin) {
  pdl_launch_dependents();
  zero_counters(r);
  const int w = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (w >= nwin) return;
  const int s = w * win, e = min(T, s + win);
  const uint32_t kh = r.keys[s], kt = r.keys[e - 1];
  int lo = 0, hi = s;  // first position with key >= kh, in [0, s]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (r.keys[mid] < kh) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  r.win_info[w].x = static_cast<uint32_t>(lo);
  lo = e, hi = T;  // first position with key > kt, in [e, T]
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (r.keys[mid] <= kt) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  r.win_info[w].y = static_cast<uint32_t>(lo);
}

// --- step 2: dW ------------------------------------------------------------------------------

// V consecutive columns of one group: dy as bf16 (V = 4: one 8-byte access), dW as fp32 (V = 4:
// one 16-byte access).
template <int V>
struct DyBits;
template <>
struct DyBits<4> {
  uint2 u;
};
template <>
struct DyBits<1> {
  unsigned short u;
};

// dy is read once: streaming (evict-first) loads.
template <int V>
__device__ __forceinline__ DyBits<V> load_dy(const bf16_t* p) {
  DyBits<V> r;
  if constexpr (V == 4) {
    r.u = __ldcs(reinterpret_cast<const uint2*>(p));
  } else {
    r.u = __ldcs(reinterpret_cast<const unsigned short*>(p));
  }
  return r;
}

template <int V>
__device__ __forceinline__ void add_dy(float (&acc)[V], const DyBits<V>& d) {
  if constexpr (V == 4) {
    acc[0] += cuda::bf16_lo(d.u.x);
    acc[1] += cuda::bf16_hi(d.u.x);
    acc[2] += cuda::bf16_lo(d.u.y);
    acc[3] += cuda::bf16_hi(d.u.y);
  } else {
    acc[0] += __uint_as_float(static_cast<uint32_t>(d.u) << 16);
  }
}

using cuda::prefetch_l2;  // a hint: the L2 line, fetched now (no register, no effect on results)

// fp32 rows (dW and the partials) through L2 only (__ldcg): a partial written by another block
// must not come from a stale L1 line, and dW lines are not reused by this block.
template <int V>
__device__ __forceinline__ void load_f(const float* p, float (&f)[V]) {
  if constexpr (V == 4) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  } else {
    f[0] = __ldcg(p);
  }
}

template <int V>
__device__ __forceinline__ void store_f(float* p, const float (&f)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  } else {
    p[0] = f[0];
  }
}

// dW rows with evict-first loads and stores (ld.global.cs / st.global.cs): each row is read and
// written once, by one thread, so L2 need not keep it at the expense of lines still to be read.
// Coherent loads (not .nc), as load_f's.
template <int V>
__device__ __forceinline__ void load_dw(const float* p, float (&f)[V]) {
  if constexpr (V == 4) {
    const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  } else {
    f[0] = __ldcs(p);
  }
}

template <int V>
__device__ __forceinline__ void store_dw(float* p, const float (&f)[V]) {
  if constexpr (V == 4) {
    __stcs(reinterpret_cast<float4*>(p), make_float4(f[0], f[1], f[2], f[3]));
  } else {
    __stcs(p, f[0]);
  }
}

struct DwArgs {
  const uint32_t* keys;   // [T] (16-byte aligned, readable up to the next 16 bytes)
  const uint32_t* toks;   // [T] (same)
  const uint4* win_info;  // [nwin]
  uint32_t* counters;     // [nwin * chunks]
  const bf16_t* dy;       // [T, D]
  float* dw;              // [Vocab, D]
  float* partial;         // [nwin, 2, D]
  int T, D, win, nwin, chunks;
  uint32_t invalid;  // the key of an out-of-range id (vocab)
};

// One item's window staged in shared memory (16-byte cp.async pieces).
struct alignas(16) Stage {
  uint32_t key[kMaxWin];
  uint32_t tok[kMaxWin];
  uint32_t head, tail, pad0, pad1;  // the window's win_info
};

// 16-byte asynchronous global -> shared copy through L2 only (.cg): the sources were written by
// the previous kernel, so no L1 line of this multiprocessor may serve them.

// Adds the partials of the segment of key k spanning windows [w0, w1] to dW: the tail of w0, then
// the heads of w0 + 1 .. w1 in window order. Called by the block that arrived last.
template <int V>
__device__ __forceinline__ void combine(const DwArgs& a, uint32_t k, int w0, int w1, int c) {
  const int64_t D = a.D;
  float acc[V];
  load_f<V>(a.partial + (static_cast<int64_t>(w0) * 2 + 1) * D + c, acc);
  for (int w = w0 + 1; w <= w1; w += 4) {
    float h[4][V];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (w + u <= w1) load_f<V>(a.partial + (static_cast<int64_t>(w + u) * 2) * D + c, h[u]);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (w + u > w1) break;
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += h[u][v];
    }
  }
  float* row = a.dw + static_cast<int64_t>(k) * D + c;  // [V]
  float cur[V];
  load_f<V>(row, cur);
#pragma unroll
  for (int v = 0; v < V; ++v) cur[v] += acc[v];
  store_f<V>(row, cur);
}

// One item: window w (sorted positions [s, e)), column chunk `chunk`. Every thread of the block
// calls it (it holds barriers); `st` is the staged window.
// While it loads a batch, each thread prefetches the next batch's dy rows (not its dW rows)
// towards L2: the kernel runs at ~85% of the L2's throughput and every prefetch is one more L2
// request (the dW rows too, deeper prefetch, no prefetch and a cp.async ring measured slower:
// docs/PERF.md).
template <int V>
__device__ __forceinline__ void dw_item(const DwArgs& a, const Stage& st, int w, int chunk,
                                        int* s_last) {
  const int D = a.D;
  const int s = w * a.win, e = min(a.T, s + a.win), n = e - s;
  // Invalid keys sort last: the window's valid positions are [0, nv).
  int nv = n;
  while (nv > 0 && st.key[nv - 1] == a.invalid) --nv;
  if (nv == 0) return;  // uniform over the block: no barrier skipped by some threads only
  const uint32_t k_first = st.key[0], k_last = st.key[nv - 1];
  // p0: the first run began in an earlier window; p1: the last run continues into the next one
  // (never when invalid keys follow it).
  const bool p0 = st.head < static_cast<uint32_t>(s);
  const bool p1 = nv == n && st.tail > static_cast<uint32_t>(e);
  const int cw = kGroups * kDwThreads * V;
  int c[kGroups];
  bool has[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    c[g] = chunk * cw + g * kDwThreads * V + static_cast<int>(threadIdx.x) * V;
    has[g] = c[g] < D;  // V = 4: D % 4 == 0, so the whole group is inside
  }
  // Where the run ending at i goes: -1 straight to dW, 0 head partial, 1 tail partial.
  auto slot_of = [&](uint32_t k) { return k == k_first && p0 ? 0 : k == k_last && p1 ? 1 : -1; };
  auto ends_run = [&](int i) { return i + 1 == nv || st.key[i + 1] != st.key[i]; };
  float* part = a.partial + static_cast<int64_t>(w) * 2 * D;  // [2, D]

  float acc[kGroups][V];
#pragma unroll
  for (int g = 0; g < kGroups; ++g)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[g][v] = 0.f;
  for (int i0 = 0; i0 < nv; i0 += kBatch) {
    // Every load of the batch first: the dy rows, and the dW rows of the runs that end in the
    // batch and go straight to dW (distinct rows: one run per key).
    DyBits<V> d[kBatch][kGroups] = {};
    float cur[kBatch][kGroups][V];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j;
      if (i < nv) {
        const int64_t t = st.tok[i];
        const uint32_t k = st.key[i];
        const bool direct = ends_run(i) && slot_of(k) < 0;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          if (has[g]) {
            d[j][g] = load_dy<V>(a.dy + t * D + c[g]);
            if (direct) load_dw<V>(a.dw + static_cast<int64_t>(k) * D + c[g], cur[j][g]);
          }
        }
      }
    }
    // The next batch's dy rows towards L2 meanwhile: more bytes in flight per thread for no
    // registers (the loads above hold 96 bytes per thread, 1024 threads per multiprocessor).
    auto prefetch = [&](int i) {
      const int64_t t = st.tok[i];
#pragma unroll
      for (int g = 0; g < kGroups; ++g)
        if (has[g]) prefetch_l2(a.dy + t * D + c[g]);
    };
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (i0 + kBatch + j < nv) prefetch(i0 + kBatch + j);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j;
      if (i < nv) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
          if (has[g]) add_dy<V>(acc[g], d[j][g]);
        if (ends_run(i)) {
          const uint32_t k = st.key[i];
          const int slot = slot_of(k);
#pragma unroll
          for (int g = 0; g < kGroups; ++g) {
            if (!has[g]) continue;
            if (slot < 0) {
#pragma unroll
              for (int v = 0; v < V; ++v) cur[j][g][v] += acc[g][v];
              store_dw<V>(a.dw + static_cast<int64_t>(k) * D + c[g], cur[j][g]);
            } else {
              store_f<V>(part + static_cast<int64_t>(slot) * D + c[g], acc[g]);
            }
#pragma unroll
            for (int v = 0; v < V; ++v) acc[g][v] = 0.f;
          }
        }
      }
    }
  }

  // Arrivals. A0: the first run (slot 0), of a segment that starts in window head / win and ends
  // here or, when it is also the last run and continues, in the window of tail - 1. A1: the last
  // run (slot 1) when it is not that same run: its segment starts here.
  const bool single = k_first == k_last;
  const bool a0 = p0, a1 = p1 && !(single && p0);
  if (!a0 && !a1) return;
  const int w0a = static_cast<int>(st.head) / a.win;
  const int w1a = single && p1 ? static_cast<int>(st.tail - 1) / a.win : w;
  const int w1b = static_cast<int>(st.tail - 1) / a.win;
  __threadfence();  // this thread's partial stores, before thread 0 counts the arrival
  __syncthreads();
  // The last arrival also sets the counter back to zero (no other block touches it after that):
  // the counters are zero again when the kernel ends, so a forward's plan serves every backward.
  if (threadIdx.x == 0) {
    auto arrive = [&](uint32_t* counter, int others) {
      const bool last = atomicAdd(counter, 1u) == static_cast<uint32_t>(others);
      if (last) *counter = 0u;
      return last ? 1 : 0;
    };
    if (a0) s_last[0] = arrive(&a.counters[w0a * a.chunks + chunk], w1a - w0a);
    if (a1) s_last[1] = arrive(&a.counters[w * a.chunks + chunk], w1b - w);
  }
  __syncthreads();
  const bool last0 = a0 && s_last[0] != 0, last1 = a1 && s_last[1] != 0;
  if (last0 || last1) __threadfence();  // the other blocks' partials, after their arrivals
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    if (!has[g]) continue;
    if (last0) combine<V>(a, k_first, w0a, w1a, c[g]);
    if (last1) combine<V>(a, k_last, w, w1b, c[g]);
  }
}

// Persistent grid over items (window-major: item = w * chunks + chunk); kDwThreads threads.
template <int V>
__global__ void __launch_bounds__(kDwThreads, 8) emb2_dw_kernel(const DwArgs a) {
  pdl_wait();  // step 1's ranks and zeroed counters
  __shared__ Stage stage[2];
  __shared__ int s_last[2];
  const int nitems = a.nwin * a.chunks;
  const int tid = static_cast<int>(threadIdx.x);
  // Copies item `it`'s window into `dst`: threads [0, 16) the keys, [32, 48) the tokens, 16
  // bytes each (the window starts 16-byte aligned: win % 4 == 0; a last partial window reads up
  // to 12 bytes past T, inside the 256-byte aligned region, into slots never used), the last
  // thread the window's info. Committed as one group.
  auto stage_window = [&](int it, Stage& dst) {
    const int w = it / a.chunks, s = w * a.win, pieces = (min(a.T - s, a.win) + 3) / 4;
    if (tid < pieces) cuda::cp_async16(&dst.key[4 * tid], a.keys + s + 4 * tid);
    if (tid >= 32 && tid - 32 < pieces)
      cuda::cp_async16(&dst.tok[4 * (tid - 32)], a.toks + s + 4 * (tid - 32));
    if (tid == kDwThreads - 1) cuda::cp_async16(&dst.head, a.win_info + w);
    cuda::cp_async_commit();
  };
  int item = static_cast<int>(blockIdx.x);
  if (item >= nitems) return;  // uniform over the block
  stage_window(item, stage[0]);
  cuda::cp_async_wait<0>();
  __syncthreads();
  for (int buf = 0; item < nitems; item += static_cast<int>(gridDim.x), buf ^= 1) {
    // The next item's window lands in the other buffer while this item runs (that buffer was last
    // read during the previous item, before the barrier that ended it).
    const int next = item + static_cast<int>(gridDim.x);
    if (next < nitems) stage_window(next, stage[buf ^ 1]);
    const int w = item / a.chunks;
    dw_item<V>(a, stage[buf], w, item - w * a.chunks, s_last);
    cuda::cp_async_wait<0>();
    __syncthreads();
  }
}

// --- host ------------------------------------------------------------------------------------

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

// Raises the rank kernel's dynamic shared-memory limit once per process (every instantiation).
template <class Id>
void rank_opt_in(size_t limit) {
  static std::once_flag once;
  std::call_once(once, [limit] {
    GDN_CUDA_CHECK(cudaFuncSetAttribute(emb2_rank_kernel<Id>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(limit)));
  });
}

// The plan's parts (op.h, EmbeddingPlanLayout) at `base`: in the caller's plan, or in scratch.
Ranked ranked_at(uint32_t* base, const EmbeddingPlanLayout& l) {
  Ranked r;
  r.keys = base + l.keys;                                    // [T]
  r.toks = base + l.toks;                                    // [T]
  r.win_info = reinterpret_cast<uint4*>(base + l.win_info);  // [nwin]
  r.counters = base + l.counters;                            // [nwin * chunks]
  r.ncounters = static_cast<int>(l.nwin * l.chunks);
  return r;
}

// Step 1's sizes for T ids over `vocab`: its bucket bits, shared memory and path; for the
// device-wide sort, cub's temporary bytes.
struct RankSetup {
  int n, bits, shift, nbins;
  size_t rank_smem, smem_limit;
  bool rank_path;        // one rank kernel
  size_t cub_bytes = 0;  // otherwise: cub's temporaries
  size_t tok_bytes;
  // Scratch the device-wide sort needs (keys_in, vals_in, cub's temporaries); 0 on the rank path.
  size_t sort_bytes() const { return rank_path ? 0 : 2 * tok_bytes + align256(cub_bytes); }
};

RankSetup rank_setup(int64_t T, int64_t vocab, cudaStream_t s) {
  RankSetup k;
  k.n = static_cast<int>(T);
  k.bits = std::bit_width(static_cast<uint64_t>(vocab));  // keys <= vocab
  k.shift = std::max(0, k.bits - kRankBinBits);
  k.nbins = static_cast<int>(vocab >> k.shift) + 1;
  k.rank_smem = (2 * static_cast<size_t>(k.n) + 2 * static_cast<size_t>(k.nbins) + 1) * 4;
  k.smem_limit = std::min(kRankSmemMax, cuda::Context::get().props().sharedMemPerBlockOptin);
  k.rank_path = k.n <= kRankMaxT && k.rank_smem <= k.smem_limit;
  k.tok_bytes = align256(static_cast<size_t>(k.n) * 4);
  if (!k.rank_path) {
    GDN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, k.cub_bytes, static_cast<const uint32_t*>(nullptr),
        static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
        static_cast<uint32_t*>(nullptr), k.n, 0, k.bits, s));
  }
  return k;
}

// Step 1 on stream s: the sorted (key, token) pairs, the windows' segment bounds and zeroed
// counters into r. On the rank path one rank kernel of ceil(T / per_block) blocks; otherwise the
// keys kernel, cub::DeviceRadixSort and the bounds kernel, their buffers at `sort_base`
// (k.sort_bytes() of scratch: the caller takes all its scratch in one call).
void rank_ids(const Tensor& ids, const Ranked& r, int64_t vocab, const RankSetup& k,
              char* sort_base, int per_block, cudaStream_t s) {
  const int n = k.n;
  const bool i32 = ids.dtype() == DType::I32;
  if (k.rank_path) {
    const auto grid = static_cast<unsigned>((n + per_block - 1) / per_block);
    if (i32) {
      rank_opt_in<int32_t>(k.smem_limit);
      emb2_rank_kernel<int32_t><<<grid, kRankThreads, k.rank_smem, s>>>(
          ids.ptr<int32_t>(), r, n, vocab, k.shift, k.nbins, kPlanWin, per_block);
    } else {
      rank_opt_in<int64_t>(k.smem_limit);
      emb2_rank_kernel<int64_t><<<grid, kRankThreads, k.rank_smem, s>>>(
          ids.ptr<int64_t>(), r, n, vocab, k.shift, k.nbins, kPlanWin, per_block);
    }
    GDN_CUDA_LAUNCH_CHECK("emb2_rank_kernel");
    return;
  }
  size_t cub_bytes = k.cub_bytes;                              // (cub takes it by reference)
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(sort_base);  // [T]
  uint32_t* vals_in = reinterpret_cast<uint32_t*>(sort_base + k.tok_bytes);  // [T]
  void* cub_tmp = sort_base + 2 * k.tok_bytes;                               // [cub_bytes]
  const auto kblocks = static_cast<unsigned>((n + 255) / 256);
  if (i32) {
    embedding_keys_kernel<int32_t>
        <<<kblocks, 256, 0, s>>>(ids.ptr<int32_t>(), keys_in, vals_in, n, vocab);
  } else {
    embedding_keys_kernel<int64_t>
        <<<kblocks, 256, 0, s>>>(ids.ptr<int64_t>(), keys_in, vals_in, n, vocab);
  }
  GDN_CUDA_LAUNCH_CHECK("embedding_keys_kernel");
  GDN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, keys_in, r.keys, vals_in,
                                                 r.toks, n, 0, k.bits, s));
  GDN_CUDA_LAUNCH_CHECK("cub::DeviceRadixSort::SortPairs");
  const int nwin = (n + kPlanWin - 1) / kPlanWin;
  const int threads = std::max(nwin, r.ncounters);
  emb2_bounds_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, s>>>(r, n, kPlanWin,
                                                                                  nwin);
  GDN_CUDA_LAUNCH_CHECK("emb2_bounds_kernel");
}

// The sizes the kernels keep in int.
void check_sizes(int64_t T, int64_t vocab, int64_t D) {
  const EmbeddingPlanLayout l(T, D);
  GDN_CHECK(T < INT_MAX / 2 && vocab < (int64_t{1} << 31) && D <= INT_MAX / 2 &&
                l.nwin * l.chunks < INT_MAX,
            "embedding (cuda): T = {}, V = {}, D = {} is too large", T, vocab, D);
}

// A second stream for the forward's ranks, forked from and joined to the compute stream inside
// the call (two events), created on first use and never destroyed (as the compute stream). Higher
// priority: the rank blocks take their multiprocessors before the gather's blocks fill them.
struct SideStream {
  cudaStream_t s = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  static const SideStream& get() {
    static const SideStream side = [] {
      SideStream r;
      int least = 0, greatest = 0;
      GDN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      GDN_CUDA_CHECK(cudaStreamCreateWithPriority(&r.s, cudaStreamNonBlocking, greatest));
      GDN_CUDA_CHECK(cudaEventCreateWithFlags(&r.fork, cudaEventDisableTiming));
      GDN_CUDA_CHECK(cudaEventCreateWithFlags(&r.join, cudaEventDisableTiming));
      return r;
    }();
    return side;
  }
};

// The forward: cuda.sorted_windows' gather (this implementation changes the backward only). With
// a plan, step 1 runs on the side stream at the same time: the gather is bound by device memory,
// the ranking by latency inside 32 blocks (kRankTokens a block at T = 8192), so its ~10 us hide
// under the gather's ~38 (measured: docs/PERF.md).
void forward(const EmbeddingFwd& a) {
  static const EmbeddingTable* t = [] {
    for (const ImplDesc* i : Registry::global().impls("embedding", Backend::Cuda))
      if (i->name == "cuda.sorted_windows") return static_cast<const EmbeddingTable*>(i->table);
    return static_cast<const EmbeddingTable*>(nullptr);
  }();
  GDN_CHECK(t != nullptr, "embedding (cuda.ranked_windows): cuda.sorted_windows is not registered");
  const int64_t T = a.ids.size(0), vocab = a.w.size(0), D = a.w.size(1);
  if (!a.plan.defined() || T == 0 || D == 0) {  // (a backward with T or D = 0 reads no plan)
    t->forward(a);
    return;
  }
  check_sizes(T, vocab, D);
  const EmbeddingPlanLayout l(T, D);
  const Ranked r = ranked_at(reinterpret_cast<uint32_t*>(a.plan.ptr<int32_t>()), l);
  cudaStream_t s = cuda::stream();
  const SideStream& side = SideStream::get();
  GDN_CUDA_CHECK(cudaEventRecord(side.fork, s));
  GDN_CUDA_CHECK(cudaStreamWaitEvent(side.s, side.fork, 0));
  const RankSetup k = rank_setup(T, vocab, side.s);
  char* sort_base = k.sort_bytes() == 0 ? nullptr
                                        : static_cast<char*>(cuda::Context::get().scratch(
                                              k.sort_bytes(), "embedding (cuda.ranked_windows)"));
  rank_ids(a.ids, r, vocab, k, sort_base, kRankTokens, side.s);
  GDN_CUDA_CHECK(cudaEventRecord(side.join, side.s));
  t->forward(a);
  GDN_CUDA_CHECK(cudaStreamWaitEvent(s, side.join, 0));
}

template <int V>
void launch_dw(const DwArgs& args, cudaStream_t s) {
  int per_sm = 0;
  GDN_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, emb2_dw_kernel<V>, kDwThreads, 0));
  const int64_t items = static_cast<int64_t>(args.nwin) * args.chunks;
  const auto grid = static_cast<unsigned>(std::min<int64_t>(
      items, static_cast<int64_t>(cuda::Context::get().sm_count()) * std::max(per_sm, 1)));
  cuda::launch_pdl(emb2_dw_kernel<V>, dim3(grid), dim3(kDwThreads), s, args);
  GDN_CUDA_LAUNCH_CHECK("emb2_dw_kernel");
}

// The backward's scratch: the partials [nwin, 2, D]; without a plan (`k` given) also the plan's
// parts (step 1 writes them) and the sort's buffers.
struct BwdScratch {
  size_t part_bytes = 0, plan_bytes = 0, sort_bytes = 0;
  size_t total() const { return part_bytes + plan_bytes + sort_bytes; }
};
BwdScratch backward_scratch(const EmbeddingPlanLayout& l, int64_t D, const RankSetup* k) {
  BwdScratch sc;
  sc.part_bytes = align256(static_cast<size_t>(l.nwin) * 2 * static_cast<size_t>(D) * 4);
  if (k != nullptr) {
    sc.plan_bytes = align256(static_cast<size_t>(l.numel) * 4);
    sc.sort_bytes = k->sort_bytes();
  }
  return sc;
}

void backward(const EmbeddingBwd& a) {
  const int64_t T = a.ids.size(0), vocab = a.dw.size(0), D = a.dy.size(1);
  if (T == 0 || D == 0) return;  // dW += 0
  check_sizes(T, vocab, D);
  const bf16_t* dy = reinterpret_cast<const bf16_t*>(a.dy.ptr<bf16>());  // [T, D]
  float* dw = a.dw.ptr<float>();                                         // [Vocab, D]
  const int n = static_cast<int>(T), d = static_cast<int>(D);
  const EmbeddingPlanLayout l(T, D);
  const int nwin = static_cast<int>(l.nwin);
  const int V =
      D % 4 == 0 && reinterpret_cast<uintptr_t>(dy) % 8 == 0 && cuda::aligned16(dw) ? 4 : 1;
  const int chunks =
      static_cast<int>((D + kGroups * kDwThreads * V - 1) / (kGroups * kDwThreads * V));

  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t s = ctx.stream();
  const bool plan = a.plan.defined();
  const RankSetup k = plan ? RankSetup{} : rank_setup(T, vocab, s);
  const BwdScratch sc = backward_scratch(l, D, plan ? nullptr : &k);
  const size_t part_bytes = sc.part_bytes, plan_bytes = sc.plan_bytes;
  char* base = static_cast<char*>(ctx.scratch(sc.total(), "embedding (cuda.ranked_windows)"));
  float* partial = reinterpret_cast<float*>(base);  // [nwin, 2, D]
  Ranked r;
  if (plan) {
    r = ranked_at(reinterpret_cast<uint32_t*>(a.plan.ptr<int32_t>()), l);
  } else {
    r = ranked_at(reinterpret_cast<uint32_t*>(base + part_bytes), l);
    rank_ids(a.ids, r, vocab, k, base + part_bytes + plan_bytes, kRankTokensFine, s);
  }

  DwArgs args{r.keys,
              r.toks,
              r.win_info,
              r.counters,
              dy,
              dw,
              partial,
              n,
              d,
              kPlanWin,
              nwin,
              chunks,
              static_cast<uint32_t>(vocab)};
  if (V == 4) {
    launch_dw<4>(args, s);
  } else {
    launch_dw<1>(args, s);
  }
}

const EmbeddingTable kTable{forward, backward};

}  // namespace

// The larger of the forward's request (the sort's buffers, with a plan) and the backward's without
// a plan (which takes the same sort's and more).
size_t embedding_ranked_windows_workspace_bytes(int64_t T, int64_t vocab, int64_t D) {
  if (T <= 0 || D <= 0) return 0;
  check_sizes(T, vocab, D);
  const RankSetup k = rank_setup(T, vocab, cuda::stream());
  return std::max(k.sort_bytes(), backward_scratch(EmbeddingPlanLayout(T, D), D, &k).total());
}

// Above cuda.sorted_windows (priority 10) for every shape (formerly "cuda.v2re"; its siblings
// cuda.v2, cuda.v2r and cuda.v2ry, which differed in the tokens ranked per block, the prefetch and
// the dW stores, measured slower: docs/PERF.md).
GDN_REGISTER(embedding_cuda_ranked_windows) {
  Registry::global().add_impl(
      {"embedding", "cuda.ranked_windows", Backend::Cuda, 23, nullptr, &kTable});
}

}  // namespace gdn::ops
