// The chunk index of a packed batch (cuda.h): two small kernels, plus the thread-local scope that
// lets a micro-batch build it once for all its GDN layers, and the shared-memory limit helper.
//
// Kernel 1 (one block of 1024 threads) sanitises cu_seqlens: bos[i] = max_{i' <= i} clamp(cu[i'],
// 0, T), so documents are disjoint, ordered and inside [0, T) whatever the device tensor holds
// (op.h's host-side checks cannot read it), then chunk0 = exclusive prefix sum of
// ceil((bos[n+1] - bos[n]) / 64). Both scans run in tiles of 1024 with a carry. Kernel 2 fills the
// per-chunk table by a binary search of chunk0 (upper bound), one thread per chunk slot.
#include <algorithm>
#include <climits>
#include <map>
#include <mutex>

#include "gdn/backend/cuda_check.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/cuda_kernels.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops {

namespace gdr {

namespace {

constexpr int kScanThreads = 1024;

// Inclusive scan (max when is_max, else sum) of one value per thread over the block.
__device__ int block_scan(int v, int* sh, bool is_max) {
  const int tid = static_cast<int>(threadIdx.x);
  sh[tid] = v;
  __syncthreads();
  for (int off = 1; off < kScanThreads; off <<= 1) {
    const int o = tid >= off ? sh[tid - off] : 0;
    __syncthreads();
    if (tid >= off) v = is_max ? max(v, o) : v + o;
    sh[tid] = v;
    __syncthreads();
  }
  return v;
}

__global__ void __launch_bounds__(kScanThreads)
    gdr_index_docs_kernel(const int32_t* __restrict__ cu,  // [N+1]
                          int N, int T,
                          int32_t* __restrict__ bos,       // [N+1]
                          int32_t* __restrict__ chunk0) {  // [N+1]
  __shared__ int sh[kScanThreads];
  __shared__ int carry;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) carry = 0;
  __syncthreads();
  // Values are >= 0, so the 0 of slots past N never raises a maximum.
  for (int base = 0; base <= N; base += kScanThreads) {
    const int i = base + tid;
    const int x = i <= N ? min(max(cu[i], 0), T) : 0;
    const int m = max(block_scan(x, sh, true), carry);
    if (i <= N) bos[i] = m;
    __syncthreads();  // every thread has read carry
    if (tid == kScanThreads - 1) carry = m;
    __syncthreads();
  }
  if (tid == 0) carry = 0;
  __syncthreads();  // also makes bos (global) visible to the whole block
  for (int base = 0; base < N; base += kScanThreads) {
    const int i = base + tid;
    const int c = i < N ? (bos[i + 1] - bos[i] + kC - 1) / kC : 0;
    const int incl = block_scan(c, sh, false);
    if (i < N) chunk0[i] = carry + incl - c;
    __syncthreads();
    if (tid == kScanThreads - 1) carry += incl;
    __syncthreads();
  }
  if (tid == 0) chunk0[N] = carry;
}

__global__ void __launch_bounds__(256)
    gdr_index_chunks_kernel(const int32_t* __restrict__ bos,     // [N+1]
                            const int32_t* __restrict__ chunk0,  // [N+1]
                            int N, int64_t nt_max,
                            ChunkInfo* __restrict__ table) {  // [nt_max]
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= nt_max) return;
  ChunkInfo ci{0, 0, -1, 0};
  if (c < chunk0[N]) {
    // The document n with chunk0[n] <= c < chunk0[n+1]: upper bound of c in chunk0[0..N], minus 1
    // (empty documents share their successor's chunk0 and are skipped by the upper bound).
    int lo = 0, hi = N + 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (chunk0[mid] <= c)
        lo = mid + 1;
      else
        hi = mid;
    }
    const int n = lo - 1;
    const int j = static_cast<int>(c - chunk0[n]);
    ci.t0 = bos[n] + j * kC;
    ci.len = min(kC, bos[n + 1] - ci.t0);
    ci.doc = n;
    ci.idx = j;
  }
  table[c] = ci;
}

}  // namespace

int64_t index_table_offset(int64_t N) { return (2 * (N + 1) + 3) / 4 * 4; }

IndexView index_view(const int32_t* base, int64_t N) {
  return {base, base + (N + 1), reinterpret_cast<const ChunkInfo*>(base + index_table_offset(N))};
}

void launch_build_index(const int32_t* cu, int64_t N, int64_t T, int64_t nt_max, int32_t* index,
                        cudaStream_t s) {
  GDN_CHECK(N < INT_MAX / 2 && T < INT_MAX / 2,
            "gated_delta_rule (cuda): {} documents / {} tokens exceed the index's int32 range", N,
            T);
  int32_t* bos = index;
  int32_t* chunk0 = index + (N + 1);
  auto* table = reinterpret_cast<ChunkInfo*>(index + index_table_offset(N));
  gdr_index_docs_kernel<<<1, kScanThreads, 0, s>>>(cu, static_cast<int>(N), static_cast<int>(T),
                                                   bos, chunk0);
  GDN_CUDA_LAUNCH_CHECK("gdr_index_docs_kernel");
  if (nt_max == 0) return;
  const int64_t blocks = (nt_max + 255) / 256;
  gdr_index_chunks_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(
      bos, chunk0, static_cast<int>(N), nt_max, table);
  GDN_CUDA_LAUNCH_CHECK("gdr_index_chunks_kernel");
}

void allow_smem(const void* kernel, size_t bytes, const char* what, int dk, int dv) {
  static std::mutex mu;
  static std::map<const void*, size_t> set;  // largest limit set so far per kernel
  const cudaDeviceProp& p = cuda::Context::get().props();
  GDN_CHECK(bytes <= p.sharedMemPerBlockOptin,
            "gated_delta_rule (cuda): {} needs {} bytes of shared memory at dk = {}, dv = {}; the "
            "device allows {}",
            what, bytes, dk, dv, p.sharedMemPerBlockOptin);
  std::lock_guard lock(mu);
  size_t& have = set[kernel];
  if (bytes <= have) return;
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  // Every kernel here lives on shared memory (tiles, not cached loads): ask for the whole carveout
  // so that as many blocks fit per multiprocessor as their size allows (a hint to the driver).
  GDN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  have = bytes;
}

}  // namespace gdr

namespace {
thread_local const GdrChunkIndexScope* t_scope = nullptr;
}  // namespace

// One bound for the index and the op's `saved` (op.h), so that their chunk slots always agree.
int64_t gdr_max_chunks(int64_t T, int64_t N) { return gdr_saved_chunks(T, N); }

int64_t gdr_chunk_index_numel(int64_t T, int64_t N) {
  return gdr::index_table_offset(N) + 4 * gdr_max_chunks(T, N);
}

void gdr_build_chunk_index(const Tensor& cu_seqlens, int64_t T, const Tensor& index) {
  const char* op = "gated_delta_rule";
  expect_tensor(cu_seqlens, op, "cu_seqlens", DType::I32, {-1});
  expect_device(cu_seqlens, op, "cu_seqlens", Device::CUDA);
  GDN_CHECK(cu_seqlens.size(0) >= 2, "{}: tensor 'cu_seqlens' has {} entries, expected N+1 >= 2",
            op, cu_seqlens.size(0));
  const int64_t N = cu_seqlens.size(0) - 1;
  expect_tensor(index, op, "chunk index", DType::I32, {-1});
  expect_device(index, op, "chunk index", Device::CUDA);
  GDN_CHECK(index.numel() >= gdr_chunk_index_numel(T, N),
            "{}: tensor 'chunk index' has {} elements, expected at least {} for T = {}, N = {}", op,
            index.numel(), gdr_chunk_index_numel(T, N), T, N);
  GDN_CHECK(reinterpret_cast<uintptr_t>(index.data()) % 16 == 0,
            "{}: tensor 'chunk index' must be 16-byte aligned", op);
  gdr::launch_build_index(cu_seqlens.ptr<int32_t>(), N, T, gdr_max_chunks(T, N),
                          index.ptr<int32_t>(), cuda::stream());
}

GdrChunkIndexScope::GdrChunkIndexScope(const Tensor& cu_seqlens, int64_t T, const Tensor& index)
    : cu_(cu_seqlens), index_(index), T_(T), prev_(t_scope) {
  gdr_build_chunk_index(cu_seqlens, T, index);
  t_scope = this;
}

GdrChunkIndexScope::~GdrChunkIndexScope() { t_scope = prev_; }

const GdrChunkIndexScope* GdrChunkIndexScope::find(const Tensor& cu_seqlens, int64_t T) {
  for (const GdrChunkIndexScope* s = t_scope; s != nullptr; s = s->prev_)
    if (s->cu_.data() == cu_seqlens.data() && s->cu_.numel() == cu_seqlens.numel() && s->T_ == T)
      return s;
  return nullptr;
}

}  // namespace gdn::ops
