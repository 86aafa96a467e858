// Embedding on CUDA: bf16 W / y / dy, fp32 dW accumulated (+=), int32 or int64 device ids (op.h has
// the contract).
//
// Ids are device data: they are not checked on the host (that would synchronise). The kernels
// never read or write out of bounds whatever the ids hold: forward writes a NaN row for an id
// outside [0, V) (so the loss turns NaN and the trainer stops on it instead of training on a wrong
// row), backward drops that token's gradient.
//
// Forward: a copy, blocks over (token, column chunk), 16-byte packs when D % 8 == 0 and W and y
// are 16-byte aligned.
//
// Backward, deterministic without float atomics and balanced whatever the id distribution:
//  1. keys[t] = ids[t] (or V for an invalid id), vals[t] = t; a stable radix sort of (key, t)
//     pairs over bit_width(V) bits, so equal ids end up contiguous and in increasing t: one block
//     (cub::BlockRadixSort, one launch) up to 8192 tokens, cub::DeviceRadixSort (deterministic,
//     about eight launches) beyond.
//  2. The sorted positions are cut into windows of kWin; one block per (window, column chunk)
//     walks its window in order, summing the dy rows of each run of equal ids in fp32 registers.
//     A run wholly inside the window is its id's whole segment: the block adds it to dW directly
//     (no other block touches that row). A run that continues into the previous or the next window
//     is stored instead as the window's head (slot 0) or tail (slot 1) partial.
//  3. For each id whose segment spans several windows, the window where it starts ("owner") adds
//     its tail partial and the head partials of the following windows, in window order, to dW.
// Every dW element thus receives its terms in an order fixed by the ids alone (increasing t within
// a window, windows in order): bitwise reproducible. One id repeated over all T tokens costs a
// T / kWin-long sum in step 3, not a T-long serial walk. (PyTorch's deterministic embedding
// backward, aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu, also sorts the ids and sums
// fixed-size pieces of each segment before combining them; here the pieces are fixed windows of
// the sorted positions, so segments shorter than a window need no second pass.)
// Bytes moved (the floor): dy, ids, and the touched dW rows read and written; plus the sort (a
// few tens of bytes per token) and the partials of spanning segments.
#include <cub/block/block_radix_sort.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <bit>
#include <climits>
#include <cstdint>
#include <limits>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/embedding/cuda_keys.cuh"
#include "ops/embedding/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::Pack;

constexpr int kFwdThreads = 256;
constexpr int kFwdUnroll = 2;  // packs per thread: a block covers 4096 bf16 columns
constexpr int kBwdThreads = 128;
constexpr int kWin = 32;   // sorted positions per backward window
constexpr int kBatch = 2;  // positions per load batch in step 2 (64 registers, 8 blocks per SM)
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();  // "no neighbour" key
constexpr int kSortThreads = 1024;  // step 1 in one block up to kSortMax tokens
constexpr int kSortItems = 8;
constexpr int kSortMax = kSortThreads * kSortItems;

template <int V>
__device__ __forceinline__ Pack<V> nan_pack() {
  Pack<V> r;
  if constexpr (V == 8) {
    r.u = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);  // bf16 quiet NaNs
  } else {
    r.u = 0x7fc0u;
  }
  return r;
}

// grid (T, column chunks of kFwdThreads * kFwdUnroll packs).
template <class Id, int V>
__global__ void __launch_bounds__(kFwdThreads)
    embedding_fwd_kernel(const Id* __restrict__ ids,    // [T]
                         const bf16_t* __restrict__ w,  // [Vocab, D]
                         bf16_t* __restrict__ y,        // [T, D]
                         int64_t vocab, int D) {
  const int64_t t = blockIdx.x;
  const int64_t id = static_cast<int64_t>(ids[t]);
  const bool valid = id >= 0 && id < vocab;
  const int npacks = D / V;
  const int first = static_cast<int>(blockIdx.y) * kFwdThreads * kFwdUnroll + threadIdx.x;
  Pack<V> p[kFwdUnroll];
#pragma unroll
  for (int k = 0; k < kFwdUnroll; ++k) {
    const int c = first + k * kFwdThreads;
    if (c < npacks)
      p[k] = valid ? cuda::load_pack<V>(w, id * D + static_cast<int64_t>(c) * V) : nan_pack<V>();
  }
#pragma unroll
  for (int k = 0; k < kFwdUnroll; ++k) {
    const int c = first + k * kFwdThreads;
    if (c < npacks) cuda::store_pack<V>(y, t * D + static_cast<int64_t>(c) * V, p[k]);
  }
}

// Step 1 for T <= kSortMax in one block: keys (invalid ids -> vocab) and token indices formed in
// registers, a stable block radix sort over end_bit bits, the first T sorted pairs written. The
// same order as the device-wide sort (stable, same keys), in one launch instead of the eight of
// cub::DeviceRadixSort's onesweep passes (histogram, scan, then a memset and a kernel per 8 bits)
// plus the keys kernel. Positions past T get the largest end_bit-bit key: they sort after every
// real token (after invalid ones too when the two keys are equal, the sort being stable) and are
// not written.
template <class Id>
__global__ void __launch_bounds__(kSortThreads)
    embedding_sort_block_kernel(const Id* __restrict__ ids,   // [T]
                                uint32_t* __restrict__ keys,  // [T] sorted ids
                                uint32_t* __restrict__ toks,  // [T] token of each position
                                int T, int64_t vocab, int end_bit) {
  using Sort = cub::BlockRadixSort<uint32_t, kSortThreads, kSortItems, uint32_t>;
  __shared__ typename Sort::TempStorage tmp;
  const uint32_t pad = end_bit >= 32 ? 0xffffffffu : (1u << end_bit) - 1u;
  uint32_t k[kSortItems], v[kSortItems];  // blocked: thread i holds positions i * kSortItems + j
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int t = static_cast<int>(threadIdx.x) * kSortItems + j;
    k[j] = pad;
    if (t < T) {
      const int64_t id = static_cast<int64_t>(ids[t]);
      k[j] = id >= 0 && id < vocab ? static_cast<uint32_t>(id) : static_cast<uint32_t>(vocab);
    }
    v[j] = static_cast<uint32_t>(t);
  }
  Sort(tmp).Sort(k, v, 0, end_bit);
#pragma unroll
  for (int j = 0; j < kSortItems; ++j) {
    const int t = static_cast<int>(threadIdx.x) * kSortItems + j;
    if (t < T) {
      keys[t] = k[j];
      toks[t] = v[j];
    }
  }
}

// p[0 .. V) = acc; with V = 8 as two 16-byte stores (p is 32-byte aligned: D % 8 == 0, c % 8 == 0
// and the buffer 16-byte aligned, checked on the host).
template <int V>
__device__ __forceinline__ void store_row(float* p, const float (&acc)[V]) {
  if constexpr (V == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    p[0] = acc[0];
  }
}

template <int V>
__device__ __forceinline__ void load_row(const float* p, float (&f)[V]) {
  if constexpr (V == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0],
                 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  } else {
    f[0] = p[0];
  }
}

// dW[k, c .. c+V) += acc (fp32, plain read-modify-write: this thread is the only writer).
template <int V>
__device__ __forceinline__ void add_row(float* dw, int64_t k, int D, int c, const float (&acc)[V]) {
  float* p = dw + k * D + c;
  float cur[V];
  load_row<V>(p, cur);
#pragma unroll
  for (int v = 0; v < V; ++v) cur[v] += acc[v];
  store_row<V>(p, cur);
}

// Step 2. grid (windows, column chunks of kBwdThreads * V); partial: [nwin, 2, D].
template <int V>
__global__ void __launch_bounds__(kBwdThreads, 8)
    embedding_dw_window_kernel(const uint32_t* __restrict__ keys,  // [T] sorted ids
                               const uint32_t* __restrict__ toks,  // [T] token of each position
                               const bf16_t* __restrict__ dy,      // [T, D]
                               float* __restrict__ dw,             // [Vocab, D]
                               float* __restrict__ partial,        // [nwin, 2, D]
                               int T, int D, uint32_t invalid) {
  __shared__ uint32_t sk[kWin + 2];  // sk[0] key before the window, sk[1 + i] window, then after
  __shared__ uint32_t st[kWin];
  const int win = static_cast<int>(blockIdx.x);
  const int s = win * kWin, e = min(T, s + kWin), n = e - s;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kBwdThreads) {
    sk[1 + i] = keys[s + i];
    st[i] = toks[s + i];
  }
  if (threadIdx.x == 0) {
    sk[0] = s > 0 ? keys[s - 1] : kNone;
    sk[n + 1] = e < T ? keys[e] : kNone;
  }
  __syncthreads();
  const int c = (static_cast<int>(blockIdx.y) * kBwdThreads + static_cast<int>(threadIdx.x)) * V;
  if (c >= D) return;
  const bool head_left = sk[0] == sk[1];       // the first run continues from the previous window
  const bool tail_right = sk[n + 1] == sk[n];  // the last run continues into the next window
  float* head = partial + (static_cast<int64_t>(win) * 2) * D + c;  // [V]
  float* tail = head + D;                                           // [V]
  // Position i ends a run when the next key differs (or the window ends). Sorted keys: a key forms
  // one contiguous run, so the run ending at i is the head run iff its key is the window's first.
  auto ends_run = [&](int i) { return i + 1 >= n || sk[2 + i] != sk[1 + i]; };
  auto is_head = [&](int i) { return head_left && sk[1 + i] == sk[1]; };
  auto is_tail = [&](int i) { return i == n - 1 && tail_right; };

  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.f;
  for (int i0 = 0; i0 < n; i0 += kBatch) {
    // Every load of the batch first: its dy rows and the dW rows of the runs that end in it and
    // go straight to dW (distinct rows: one run per key), so a thread never waits on a chain of
    // dependent read-modify-writes.
    Pack<V> buf[kBatch];
    float cur[kBatch][V];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j;
      if (i < n) {
        buf[j] = cuda::load_pack<V>(dy, static_cast<int64_t>(st[i]) * D + c);
        const uint32_t k = sk[1 + i];
        if (ends_run(i) && k != invalid && !is_head(i) && !is_tail(i))
          load_row<V>(dw + static_cast<int64_t>(k) * D + c, cur[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = i0 + j;
      if (i >= n) break;
      float f[V];
      cuda::unpack(buf[j], f);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += f[v];
      if (!ends_run(i)) continue;
      const uint32_t k = sk[1 + i];
      if (k != invalid) {
        if (is_head(i)) {
          store_row(head, acc);  // also when the run continues right: one run, one slot
        } else if (is_tail(i)) {
          store_row(tail, acc);
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v) cur[j][v] += acc[v];
          store_row(dw + static_cast<int64_t>(k) * D + c, cur[j]);
        }
      }
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = 0.f;
    }
  }
}

// Step 3. grid (windows, column chunks); only the owner window of a spanning segment works.
template <int V>
__global__ void __launch_bounds__(kBwdThreads)
    embedding_dw_span_kernel(const uint32_t* __restrict__ keys,  // [T] sorted ids
                             const float* __restrict__ partial,  // [nwin, 2, D]
                             float* __restrict__ dw,             // [Vocab, D]
                             int T, int D, uint32_t invalid) {
  __shared__ int last;  // the last window of the segment
  const int win = static_cast<int>(blockIdx.x), nwin = static_cast<int>(gridDim.x);
  const int s = win * kWin, e = min(T, s + kWin);
  const uint32_t k = keys[e - 1];
  // Owner: the tail run continues right and the segment does not come from an earlier window.
  if (e >= T || keys[e] != k || (s > 0 && keys[s - 1] == k) || k == invalid) return;
  if (threadIdx.x == 0) last = INT_MAX;
  __syncthreads();
  // The segment ends in the first later window whose last key differs or that does not continue
  // (the last window never continues). Threads test kBwdThreads windows at a time; integer min.
  for (int base = win + 1;; base += kBwdThreads) {
    const int w2 = base + static_cast<int>(threadIdx.x);
    if (w2 < nwin) {
      const int e2 = min(T, (w2 + 1) * kWin);
      if (keys[e2 - 1] != k || e2 >= T || keys[e2] != k) atomicMin(&last, w2);
    }
    __syncthreads();
    const bool found = last != INT_MAX;
    __syncthreads();  // every thread has read `last` before the next round may lower it
    if (found) break;
  }
  const int c = (static_cast<int>(blockIdx.y) * kBwdThreads + static_cast<int>(threadIdx.x)) * V;
  if (c >= D) return;
  float acc[V];
  load_row<V>(partial + (static_cast<int64_t>(win) * 2 + 1) * D + c, acc);  // the owner's tail
#pragma unroll 8
  for (int w2 = win + 1; w2 <= last; ++w2) {  // then the heads, in window order (8 in flight)
    float h[V];
    load_row<V>(partial + (static_cast<int64_t>(w2) * 2) * D + c, h);
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] += h[v];
  }
  add_row(dw, k, D, c, acc);
}

size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

template <class Id>
void forward_ids(const Id* ids, const EmbeddingFwd& a) {
  const int64_t T = a.ids.size(0), vocab = a.w.size(0), D = a.w.size(1);
  const bf16_t* w = reinterpret_cast<const bf16_t*>(a.w.ptr<bf16>());  // [Vocab, D]
  bf16_t* y = reinterpret_cast<bf16_t*>(a.y.ptr<bf16>());              // [T, D]
  const int V = D % 8 == 0 && cuda::aligned16(w) && cuda::aligned16(y) ? 8 : 1;
  const int64_t chunks = (D / V + kFwdThreads * kFwdUnroll - 1) / (kFwdThreads * kFwdUnroll);
  GDN_CHECK(T <= INT_MAX && chunks <= 65535 && D <= INT_MAX / 2,
            "embedding (cuda): [{}, {}] is too large", T, D);
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(chunks));
  cudaStream_t s = cuda::stream();
  if (V == 8) {
    embedding_fwd_kernel<Id, 8><<<grid, kFwdThreads, 0, s>>>(ids, w, y, vocab, static_cast<int>(D));
  } else {
    embedding_fwd_kernel<Id, 1><<<grid, kFwdThreads, 0, s>>>(ids, w, y, vocab, static_cast<int>(D));
  }
  GDN_CUDA_LAUNCH_CHECK("embedding_fwd_kernel");
}

void forward(const EmbeddingFwd& a) {
  if (a.ids.size(0) == 0 || a.w.size(1) == 0) return;
  if (a.ids.dtype() == DType::I32) {
    forward_ids(a.ids.ptr<int32_t>(), a);
  } else {
    forward_ids(a.ids.ptr<int64_t>(), a);
  }
}

// The backward's scratch: keys_in, vals_in, keys_out, vals_out [T] u32, cub's temporaries,
// partial [nwin, 2, D] (keys_in, vals_in and cub's temporaries unused when one block sorts).
// embedding_sorted_windows_workspace_bytes is its total.
struct BwdScratch {
  size_t ids_bytes, cub_bytes, part_bytes;
  size_t total() const { return 4 * ids_bytes + align256(cub_bytes) + part_bytes; }
};
BwdScratch backward_scratch(int64_t T, int64_t vocab, int64_t D) {
  const int n = static_cast<int>(T);
  const int nwin = (n + kWin - 1) / kWin;
  BwdScratch sc{};
  if (n > kSortMax) {
    // The sentinel `vocab` must fit in the sorted bits.
    const int end_bit = std::bit_width(static_cast<uint64_t>(vocab));
    GDN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, sc.cub_bytes, static_cast<const uint32_t*>(nullptr),
        static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
        static_cast<uint32_t*>(nullptr), n, 0, end_bit, cuda::stream()));
  }
  sc.ids_bytes = align256(static_cast<size_t>(n) * sizeof(uint32_t));
  sc.part_bytes = static_cast<size_t>(nwin) * 2 * static_cast<size_t>(D) * sizeof(float);
  return sc;
}

void backward(const EmbeddingBwd& a) {
  const int64_t T = a.ids.size(0), vocab = a.dw.size(0), D = a.dy.size(1);
  if (T == 0 || D == 0) return;  // dW += 0
  GDN_CHECK(T < INT_MAX / 2 && vocab < (int64_t{1} << 31) && D <= INT_MAX / 2,
            "embedding (cuda): T = {}, V = {}, D = {} is too large", T, vocab, D);
  const bf16_t* dy = reinterpret_cast<const bf16_t*>(a.dy.ptr<bf16>());  // [T, D]
  float* dw = a.dw.ptr<float>();                                         // [Vocab, D]
  const int n = static_cast<int>(T), d = static_cast<int>(D);
  const int nwin = (n + kWin - 1) / kWin;
  const int V = D % 8 == 0 && cuda::aligned16(dy) && cuda::aligned16(dw) ? 8 : 1;
  const int64_t chunks = (D / V + kBwdThreads - 1) / kBwdThreads;
  GDN_CHECK(chunks <= 65535, "embedding (cuda): D = {} is too large", D);
  // The sentinel `vocab` must fit in the sorted bits.
  const int end_bit = std::bit_width(static_cast<uint64_t>(vocab));

  const bool one_block = n <= kSortMax;
  const BwdScratch sc = backward_scratch(T, vocab, D);
  const size_t ids_bytes = sc.ids_bytes;
  size_t cub_bytes = sc.cub_bytes;  // cub's argument is a reference
  cuda::Context& ctx = cuda::Context::get();
  char* base = static_cast<char*>(ctx.scratch(sc.total(), "embedding"));
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);               // [T]
  uint32_t* vals_in = reinterpret_cast<uint32_t*>(base + ids_bytes);   // [T]
  uint32_t* keys = reinterpret_cast<uint32_t*>(base + 2 * ids_bytes);  // [T] sorted
  uint32_t* toks = reinterpret_cast<uint32_t*>(base + 3 * ids_bytes);  // [T] sorted
  void* cub_tmp = base + 4 * ids_bytes;                                // [cub_bytes]
  float* partial =
      reinterpret_cast<float*>(base + 4 * ids_bytes + align256(cub_bytes));  // [nwin, 2, D]

  cudaStream_t s = ctx.stream();
  const bool i32 = a.ids.dtype() == DType::I32;
  if (one_block) {
    if (i32) {
      embedding_sort_block_kernel<int32_t>
          <<<1, kSortThreads, 0, s>>>(a.ids.ptr<int32_t>(), keys, toks, n, vocab, end_bit);
    } else {
      embedding_sort_block_kernel<int64_t>
          <<<1, kSortThreads, 0, s>>>(a.ids.ptr<int64_t>(), keys, toks, n, vocab, end_bit);
    }
    GDN_CUDA_LAUNCH_CHECK("embedding_sort_block_kernel");
  } else {
    const unsigned kblocks = static_cast<unsigned>((n + 255) / 256);
    if (i32) {
      embedding_keys_kernel<int32_t>
          <<<kblocks, 256, 0, s>>>(a.ids.ptr<int32_t>(), keys_in, vals_in, n, vocab);
    } else {
      embedding_keys_kernel<int64_t>
          <<<kblocks, 256, 0, s>>>(a.ids.ptr<int64_t>(), keys_in, vals_in, n, vocab);
    }
    GDN_CUDA_LAUNCH_CHECK("embedding_keys_kernel");
    GDN_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(cub_tmp, cub_bytes, keys_in, keys, vals_in, toks,
                                                   n, 0, end_bit, s));
    GDN_CUDA_LAUNCH_CHECK("cub::DeviceRadixSort::SortPairs");
  }
  const dim3 grid(static_cast<unsigned>(nwin), static_cast<unsigned>(chunks));
  const uint32_t invalid = static_cast<uint32_t>(vocab);
  if (V == 8) {
    embedding_dw_window_kernel<8>
        <<<grid, kBwdThreads, 0, s>>>(keys, toks, dy, dw, partial, n, d, invalid);
    GDN_CUDA_LAUNCH_CHECK("embedding_dw_window_kernel");
    embedding_dw_span_kernel<8><<<grid, kBwdThreads, 0, s>>>(keys, partial, dw, n, d, invalid);
  } else {
    embedding_dw_window_kernel<1>
        <<<grid, kBwdThreads, 0, s>>>(keys, toks, dy, dw, partial, n, d, invalid);
    GDN_CUDA_LAUNCH_CHECK("embedding_dw_window_kernel");
    embedding_dw_span_kernel<1><<<grid, kBwdThreads, 0, s>>>(keys, partial, dw, n, d, invalid);
  }
  GDN_CUDA_LAUNCH_CHECK("embedding_dw_span_kernel");
}

const EmbeddingTable kTable{forward, backward};

}  // namespace

size_t embedding_sorted_windows_workspace_bytes(int64_t T, int64_t vocab, int64_t D) {
  return T <= 0 || D <= 0 ? 0 : backward_scratch(T, vocab, D).total();
}

GDN_REGISTER(embedding_cuda) {
  Registry::global().add_impl(
      {"embedding", "cuda.sorted_windows", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
