// RMSNorm backward on CUDA with Hopper bulk copies ("cuda.sm90_bulk", the default for the shape
// classes it covers: see `supports`): the same contract as cuda.rowwise (op.h; bf16 x/w/dy/dx,
// fp32 rstd and dw), a different memory pipeline. The forward is cuda.rowwise's.
//
// Why: cuda.rowwise's backward stays well below the copy rate at [8192, 4096] (measured:
// docs/PERF.md), with its loads issued by every thread into registers; a cp.async-staged version
// with deep per-thread rings was slower still because one block per multiprocessor worked on one
// row at a time with a block barrier per row. Here a whole row of x and of dy arrives in shared
// memory by two bulk copies (cp.async.bulk, one elected thread, completion counted in bytes on an
// mbarrier), several rows are in process per multiprocessor at once, each by its own row group
// with only a group-local barrier, and the ring keeps up to `stages` rows per group in flight.
//
// Layout: one block of kThreads = 512 threads per multiprocessor (persistent grid), split into
// G = 512 / tpr row groups of tpr threads (whole warps: tpr = 32, 64, 128 or 256, the smallest
// that covers the row with kP = 4 packs of 8 bf16 per thread; 128 at D = 4096, so G = 4 rows in
// process per multiprocessor). Thread `lane` of a group owns the packs c = lane + k * tpr (k < kP)
// of every row, i.e. fixed columns: its (1 + w) or w factors and its dw sums stay in registers for
// the whole kernel. Group `g` of block `b` walks the rows first + i * NG (first = b * G + g,
// NG = gridDim.x * G, i = 0, 1, ...: its "iterations").
//
// The ring: group g owns `stages` slots of shared memory, slot s holding x then dy of one row
// (4 D bytes), and one mbarrier full[s] (arrival count 1). Iteration i uses slot s = i % stages.
// Its row is requested by the group's lane 0 (the producer): mbar_arrive_expect_tx(full[s],
// 4 D) and two bulk copies completing on full[s]. Requests for iterations 0 .. stages-1 go out
// before the loop; the request for iteration i + stages goes out in iteration i right after the
// group barrier, by which point every thread of the group has copied its packs of slot s into
// registers (the barrier orders those shared-memory reads before the copy engine's writes, as
// CUTLASS's consumer-release arrive does).
// Phase logic (documented in bulk_copy.cuh): iteration i is the u-th use of its slot,
// u = i / stages, and waits for phase u of full[s], i.e. parity u & 1 (kept as `phase`, flipped
// each time s wraps to 0). Phase u + 1 of full[s] belongs to iteration i + stages, which is
// requested only after the group barrier of iteration i, which no thread passes before its own
// wait of iteration i; and phase u - 1 was waited for by every thread in iteration i - stages.
// So a waiter always finds full[s] in phase u (not complete: the parity matches, it waits) or
// phase u + 1 (u complete: it proceeds), never two phases away, and a parity names its phase.
// Every request is for an iteration < n (the group's row count) and every iteration waits, so
// no copy is in flight when the loop ends and the ring can be reused by ordinary stores.
//
// Per row, per thread: rstd (one __ldg, issued before the wait), the packs of x and dy from the
// slot (16-byte shared loads, conflict-free: a warp reads 512 contiguous bytes), the partial dot
// sum(dy * gw * x), a group reduction (warp butterfly; across warps through a double-buffered
// shared array and the group's named barrier, bar.sync 1 + g: no block barrier in the loop), then
// dx with 16-byte global stores and dw += dy * xhat in registers.
// dw: at the end each group writes its sums to shared memory (the ring, now idle), the block adds
// the groups in group order into one fp32 partial row per block, and column_sum_add_kernel
// (memory_bound.cuh: its 32-slice form through launch_column_sum_add_pdl, launched as a
// programmatic dependent that waits on the multiprocessors this kernel's blocks leave) sums the
// partial rows in a fixed order into dw. No float atomics: the result depends only on the shapes
// and the device's multiprocessor count.
//
// Covered: D % 8 == 0 (a row is a whole number of 16-byte units, so every row starts 16-byte
// aligned), 16-byte aligned x, w, dy, dx, and kMinD <= D <= kMaxD (= 8 * kP * 256); the ring must
// hold at least two stages. `supports` rejects every other shape class (the resolver then picks
// cuda.rowwise); the forward is cuda.rowwise's, unchanged.
//
// Resources at D = 4096 (H200, 227 KB of shared memory per block): 128 threads per row, 4 rows in
// process per multiprocessor, 2 stages of 16 KB per group (128 KB ring + 16 KB fp32 gw + 2 KB
// static; 8 rows = 128 KB requested ahead per multiprocessor: after a row's group barrier its
// slot is refilled), 512 threads at 128 registers, no spills (nvcc 13.0, -Xptxas -v). Every width
// covered would fit 3 to 6 stages (G * 4 D is 32-64 KB); 2 measured faster (docs/PERF.md). The
// first rows are requested before the w load, and the dw sum is a programmatic dependent.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/bulk_copy.cuh"
#include "backend/cuda/memory_bound.cuh"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/registry.h"
#include "ops/rmsnorm/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;
using cuda::Pack;

constexpr int kThreads = 512;
constexpr int kP = 4;                      // 16-byte packs per thread per row, at most
constexpr int kMaxTpr = 256;               // threads per row, at most
constexpr int kMaxGroups = kThreads / 32;  // row groups per block, at most (tpr = 32)
constexpr int kMaxWarpsPerGroup = kMaxTpr / 32;
constexpr int kMaxStages = 8;
constexpr int kMinD = 1024;              // narrower rows: cuda.rowwise (not measured here)
constexpr int kMaxD = 8 * kP * kMaxTpr;  // 8192
constexpr int kRingStages = 2;           // ring stages per group (at most: see stages_for)

// Sum of v over the caller's row group, bit-identical in every thread of the group. Groups of one
// warp reduce by the xor butterfly (each partner adds the same two numbers). Wider groups: warp
// butterfly, then lane 0 of each warp stores its sum in red[buf][g][warp], the group's named
// barrier (id 1 + g: id 0 is __syncthreads'; g < 8 here, so ids stay below 16), and every thread
// adds the group's warp sums in warp order. `red` is double-buffered by iteration parity: a
// thread writes red[buf] again only two iterations later, after passing the next barrier, which
// every thread of the group reaches only after reading red[buf]. The barrier (or __syncwarp) is
// also the point after which the group's slot of this iteration may be overwritten.
__device__ __forceinline__ float group_sum(float v, int tpr, int g, int lane,
                                           float (*red)[kMaxWarpsPerGroup] /* [kMaxGroups] */) {
  v = cuda::warp_allreduce_sum(v);
  if (tpr == 32) {
    __syncwarp();
    return v;
  }
  if ((lane & 31) == 0) red[g][lane >> 5] = v;
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + g), "r"(tpr) : "memory");
  float s = 0.f;
  for (int i = 0; i < tpr / 32; ++i) s += red[g][i];  // fixed order: deterministic
  return s;
}

// The 8 gw factors of pack c from shared memory (layout: see the kernel).
__device__ __forceinline__ void gw_of(const float4* sgw, int npacks, int c, float (&f)[8]) {
  const float4 lo = sgw[c], hi = sgw[npacks + c];
  f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w;
  f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
}

__global__ void __launch_bounds__(kThreads, 1)
    rmsnorm_bulk_bwd_kernel(const bf16_t* __restrict__ x,    // [R, D]
                            const bf16_t* __restrict__ w,    // [D]
                            const float* __restrict__ rstd,  // [R]
                            const bf16_t* __restrict__ dy,   // [R, D]
                            bf16_t* __restrict__ dx,         // [R, D]
                            float* __restrict__ partial,     // [gridDim.x, D] dw partial rows
                            int64_t R, int D, int tpr, int stages, float shift) {
  // Dynamic shared memory: the ring [G][stages][2][D] bf16, then gw as float4 [2][D / 8].
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kMaxGroups * kMaxStages];  // [G][stages] mbarriers
  __shared__ float red[2][kMaxGroups][kMaxWarpsPerGroup];

  const int G = kThreads / tpr;
  const int g = static_cast<int>(threadIdx.x) / tpr;
  const int lane = static_cast<int>(threadIdx.x) % tpr;
  const int npacks = D / 8;
  const uint32_t row_bytes = static_cast<uint32_t>(D) * 2u;
  // This group's rows: first + i * step, i < n (its "iterations"), so that at any time the grid's
  // groups work on nearby rows (contiguous per-block row ranges measured slower: the
  // multiprocessors then stream from 132 regions at once; docs/PERF.md).
  const int64_t step = static_cast<int64_t>(gridDim.x) * G;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * G + g;
  const int64_t n = first < R ? (R - first + step - 1) / step : 0;
  uint64_t* bars = full + g * stages;  // [stages]
  bf16_t* ring = reinterpret_cast<bf16_t*>(smem) + static_cast<int64_t>(g) * stages * 2 * D;

  if (threadIdx.x == 0) {
    for (int i = 0; i < G * stages; ++i) cuda::mbar_init(&full[i], 1);
    cuda::mbar_init_fence();
  }
  __syncthreads();
  // A dw sum launched as a programmatic dependent (memory_bound.cuh) may be created now; it waits
  // for this grid's end. No effect on an ordinary launch after this kernel.
  cuda::pdl_launch_dependents();

  // Requests iteration i's row into slot s = i % stages (producer only; i < n).
  auto request = [&](int64_t i, int s) {
    const int64_t off = (first + i * step) * D;
    bf16_t* slot = ring + static_cast<int64_t>(s) * 2 * D;  // [2][D]
    cuda::mbar_arrive_expect_tx(&bars[s], 2u * row_bytes);
    cuda::cp_async_bulk_g2s(slot, x + off, row_bytes, &bars[s]);
    cuda::cp_async_bulk_g2s(slot + D, dy + off, row_bytes, &bars[s]);
  };
  const bool producer = lane == 0;
  // The first rows are requested before w is read (the ring and sgw are disjoint), so the w round
  // trip overlaps the first rows' instead of preceding them.
  if (producer)
    for (int i = 0; i < n && i < stages; ++i) request(i, i);

  // gw = w or 1 + w (formed in fp32) of pack c: sgw[c] (elements 0-3) and sgw[npacks + c] (4-7),
  // so that a warp's 16-byte reads of consecutive packs are conflict-free. In shared memory
  // rather than registers: with the dw sums and the row's packs in registers, 32 more would spill.
  float4* sgw = reinterpret_cast<float4*>(smem + static_cast<size_t>(G) * stages * 4 * D);
  for (int c = static_cast<int>(threadIdx.x); c < npacks; c += kThreads) {
    float f[8];
    cuda::unpack(cuda::load_pack<8>(w, static_cast<int64_t>(c) * 8), f);
    sgw[c] = make_float4(shift + f[0], shift + f[1], shift + f[2], shift + f[3]);
    sgw[npacks + c] = make_float4(shift + f[4], shift + f[5], shift + f[6], shift + f[7]);
  }
  __syncthreads();  // sgw complete

  // This thread's dw sums (its columns are fixed over the rows).
  float acc[kP][8];
#pragma unroll
  for (int k = 0; k < kP; ++k)
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[k][v] = 0.f;

  int s = 0;           // slot of iteration i
  uint32_t phase = 0;  // parity of the use of slot s that iteration i waits for
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = first + i * step;
    const int64_t off = row * D;
    const float r = __ldg(rstd + row);
    cuda::mbar_wait_parity(&bars[s], phase);
    const uint4* sx = reinterpret_cast<const uint4*>(ring + static_cast<int64_t>(s) * 2 * D);
    const uint4* sd = sx + npacks;  // dy follows x in the slot (2 D bytes = npacks uint4)
    Pack<8> xp[kP], dp[kP];
#pragma unroll
    for (int k = 0; k < kP; ++k) {
      const int c = lane + k * tpr;
      xp[k] = cuda::zero_pack<8>();
      dp[k] = cuda::zero_pack<8>();
      if (c < npacks) xp[k].u = sx[c], dp[k].u = sd[c];
    }
    float dot = 0.f;  // sum(dy * gw * x) over this thread's columns
#pragma unroll
    for (int k = 0; k < kP; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float xf[8], df[8], gf[8];
        cuda::unpack(xp[k], xf);
        cuda::unpack(dp[k], df);
        gw_of(sgw, npacks, c, gf);
#pragma unroll
        for (int v = 0; v < 8; ++v) dot += df[v] * gf[v] * xf[v];
      }
    }
    dot = group_sum(dot, tpr, g, lane, red[i & 1]);
    // Slot s is free: every thread of the group holds its packs in registers.
    if (producer && i + stages < n) request(i + stages, s);  // (i + stages) % stages == s
    if (++s == stages) s = 0, phase ^= 1u;

    const float m = dot * r / static_cast<float>(D);  // mean(dy * gw * xhat)
#pragma unroll
    for (int k = 0; k < kP; ++k) {
      const int c = lane + k * tpr;
      if (c < npacks) {
        float xf[8], df[8], gf[8], out[8];
        cuda::unpack(xp[k], xf);
        cuda::unpack(dp[k], df);
        gw_of(sgw, npacks, c, gf);
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          const float xhat = xf[v] * r;
          out[v] = r * (df[v] * gf[v] - xhat * m);
          acc[k][v] += df[v] * xhat;
        }
        cuda::store_pack<8>(dx, off + static_cast<int64_t>(c) * 8, cuda::pack(out));
      }
    }
  }

  // The block's partial row: every group's sums into the idle ring (G * D fp32 <= the ring's
  // G * stages * 4 D bytes), then the groups added in group order, column by column.
  __syncthreads();  // every group is done with its slots (no copy in flight: see the header)
  float* sdw = reinterpret_cast<float*>(smem);  // [G][D]
#pragma unroll
  for (int k = 0; k < kP; ++k) {
    const int c = lane + k * tpr;
    if (c < npacks) {
      float4* d = reinterpret_cast<float4*>(sdw + static_cast<int64_t>(g) * D + c * 8);
      d[0] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
      d[1] = make_float4(acc[k][4], acc[k][5], acc[k][6], acc[k][7]);
    }
  }
  __syncthreads();
  float* mine = partial + static_cast<int64_t>(blockIdx.x) * D;  // [D]
  for (int col = static_cast<int>(threadIdx.x); col < D; col += kThreads) {
    float sum = 0.f;
    for (int j = 0; j < G; ++j) sum += sdw[j * D + col];
    mine[col] = sum;
  }
}

// --- host side ---------------------------------------------------------------------------------

// cuda.rowwise (cuda.cu): the forward.
const RmsNormTable& rowwise() {
  static const RmsNormTable* t = [] {
    for (const ImplDesc* i : Registry::global().impls("rmsnorm", Backend::Cuda))
      if (i->name == "cuda.rowwise") return static_cast<const RmsNormTable*>(i->table);
    return static_cast<const RmsNormTable*>(nullptr);
  }();
  GDN_CHECK(t != nullptr, "rmsnorm (cuda.sm90_bulk): cuda.rowwise is not registered");
  return *t;
}

// Threads per row: the smallest power of two >= 32 whose kP packs per thread cover the row.
int tpr_for(int64_t D) {
  int tpr = 32;
  while (static_cast<int64_t>(tpr) * kP * 8 < D) tpr *= 2;
  return tpr;
}

// The dynamic shared memory the kernel may use (the device's opt-in limit less the kernel's
// static arrays), with the kernel's limit raised to it; set once per process (one device).
size_t smem_budget() {
  static const size_t budget = [] {
    const void* k = reinterpret_cast<const void*>(&rmsnorm_bulk_bwd_kernel);
    cudaFuncAttributes attr{};
    GDN_CUDA_CHECK(cudaFuncGetAttributes(&attr, k));
    const size_t optin = cuda::Context::get().props().sharedMemPerBlockOptin;
    const size_t b = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
    GDN_CUDA_CHECK(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(b)));
    GDN_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    return b;
  }();
  return budget;
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// Ring stages for rows of D at tpr threads per row (0 when fewer than two fit).
int stages_for(int64_t D, int tpr) {
  const size_t per_stage = static_cast<size_t>(kThreads / tpr) * 4 * static_cast<size_t>(D);
  const size_t gw = 4 * static_cast<size_t>(D);  // fp32 gw after the ring
  const size_t budget = smem_budget();
  const size_t s = budget > gw ? std::min<size_t>(kMaxStages, (budget - gw) / per_stage) : 0;
  return s >= 2 ? static_cast<int>(s) : 0;
}

bool covered(const RmsNormBwd& a) {
  const int64_t D = a.x.size(1);
  if (D % 8 != 0 || D < kMinD || D > kMaxD) return false;
  for (const Tensor* t : {&a.x, &a.w, &a.dy, &a.dx})
    if (!aligned16(*t)) return false;
  return stages_for(D, tpr_for(D)) >= 2;
}

void forward(const RmsNormFwd& a) { rowwise().forward(a); }

// The backward of the shape classes `supports` accepts (a call outside them is a resolver bug,
// not a fallback); the dw sum as a programmatic dependent (launch_column_sum_add_pdl,
// memory_bound.cuh).
void backward(const RmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  if (R == 0 || D == 0) return;  // dw += 0
  GDN_CHECK(covered(a), "rmsnorm (cuda.sm90_bulk): a call outside its shape class (D = {})", D);
  const bf16_t* x = reinterpret_cast<const bf16_t*>(a.x.ptr<bf16>());    // [R, D]
  const bf16_t* w = reinterpret_cast<const bf16_t*>(a.w.ptr<bf16>());    // [D]
  const float* rstd = a.rstd.ptr<float>();                               // [R]
  const bf16_t* dy = reinterpret_cast<const bf16_t*>(a.dy.ptr<bf16>());  // [R, D]
  bf16_t* dx = reinterpret_cast<bf16_t*>(a.dx.ptr<bf16>());              // [R, D]
  float* dw = a.dw.ptr<float>();                                         // [D]
  const int tpr = tpr_for(D), G = kThreads / tpr;
  const int stages = std::min(kRingStages, stages_for(D, tpr));
  const size_t smem = (static_cast<size_t>(stages) * G + 1) * 4 * static_cast<size_t>(D);
  cuda::Context& ctx = cuda::Context::get();
  static const int per_sm = [] {
    int b = 0;
    GDN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, rmsnorm_bulk_bwd_kernel,
                                                                 kThreads, smem_budget()));
    return b;
  }();
  GDN_CHECK(per_sm >= 1,
            "rmsnorm (cuda.sm90_bulk): the backward kernel does not fit a multiprocessor");
  const int grid = static_cast<int>(std::min<int64_t>(
      (R + G - 1) / G, static_cast<int64_t>(ctx.sm_count()) * std::max(per_sm, 1)));
  float* partial = static_cast<float*>(  // [grid, D]
      ctx.scratch(rmsnorm_partial_bytes(grid, D), "rmsnorm (cuda.sm90_bulk)"));
  const float shift = a.zero_centred ? 1.f : 0.f;
  cudaStream_t s = ctx.stream();
  rmsnorm_bulk_bwd_kernel<<<grid, kThreads, smem, s>>>(x, w, rstd, dy, dx, partial, R,
                                                       static_cast<int>(D), tpr, stages, shift);
  GDN_CUDA_LAUNCH_CHECK("rmsnorm_bulk_bwd_kernel");
  cuda::launch_column_sum_add_pdl(partial, dw, grid, static_cast<int>(D), s);
}

// The shape classes whose backward this kernel covers (op.cpp's class_of: D and "vec"): the
// resolver picks cuda.rowwise for every other class, the default one (no dims: `ops run`, whose
// probe runs D = 97) included.
std::string supports(const OpQuery& q) {
  const int64_t D = q.dim("D", -1);
  if (D < 0) return "needs the call's row width (shape class)";
  if (q.dim("vec", 0) == 0 || D % 8 != 0) return "rows are not whole 16-byte vectors";
  if (D < kMinD || D > kMaxD) return fmt::format("D = {} outside {}..{}", D, kMinD, kMaxD);
  if (stages_for(D, tpr_for(D)) < 2) return fmt::format("D = {}: fewer than 2 ring stages fit", D);
  return "";
}

const RmsNormTable kTable{forward, backward};

}  // namespace

// Above cuda.rowwise (priority 10) in the classes `supports` accepts (measured: docs/PERF.md;
// formerly "cuda.bulkp2").
GDN_REGISTER(rmsnorm_cuda_sm90_bulk) {
  Registry::global().add_impl({"rmsnorm", "cuda.sm90_bulk", Backend::Cuda, 22, supports, &kTable});
}

}  // namespace gdn::ops
