// Fused linear cross-entropy on CUDA: bf16 x, w, dx; fp32 loss, lse, z_loss, dloss, dw (op.h has
// the contract, the "cuda" paragraph the plan and the numerics).
//
// Per row block of R rows (full-V mode; the H200 shape N = 8192, V = 248320, B = 1.5 GiB gives
// blocks of 3072, 3072, 2048 rows):
//   1. tile [R, V] = x_blk w^T             cuBLASLt, bf16 out (fp32 accumulation, rounded once)
//   2. lce_row_kernel<stats, grad>         one CTA per row: pass 1 reads the row once (online max
//      and sum-exp, sum of logits, the target logit), thread 0 finalises lse / L_t / z-loss / c_t,
//      pass 2 reads the row again and overwrites it in place with G in bf16
//   3. block sum                           one CTA: the block's L_t and Z_t in a fixed order, added
//      to fp64 accumulators in the workspace header (no atomics, no host read)
//   4. dx_blk = G w                        cuBLASLt, bf16 out (beta = 0)
//   5. dw += G^T x_blk                     cuBLASLt, fp32 C/D, beta = 1, straight into the caller's
//      buffer (no [V, D] temporary, Liger issue #1323)
// Slab mode (small budgets) splits the vocabulary: pass 1 runs steps 1-2 (statistics only) per
// slab, merging the row statistics in the workspace; pass 2 recomputes each tile, writes G, and
// accumulates dx in an fp32 [R, D] buffer (a bf16 dx accumulated over slabs would be rounded once
// per slab) and dw_slab += G^T x_blk; a last kernel rounds dx to bf16.
//
// The setup kernel counts the non-ignored targets and forms 1/den and the gradient coefficient
// (upstream scalar x 1/den) on the device, so the call never synchronises with the host (Liger's
// .item() on the count is the sync this avoids; QuACK and Liger's Ascend path keep it on device
// too, ops_notes §1.4/§1.6).
//
// Numerics (ops_notes §1.1): statistics in fp32 (exp2 of exact bf16 differences) with the max's
// exp(0) = 1 kept out of the sum (see merge_stat), the per-row loss assembled in double from them;
// p_y - 1 = expm1((z_y - m) - log1p s) so a confident row keeps its gradient; the target column of
// G is formed in double and rounded once. Deterministic: no atomics; every reduction has a fixed
// order (lane 0's shuffle tree, warps in index order, rows of a block in a fixed tree); GEMMs
// through cached cuBLASLt plans.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cublaslt.h"
#include "backend/cuda/vec.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/registry.h"
#include "ops/linear_cross_entropy/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

constexpr const char* kOp = "linear_cross_entropy";
constexpr int kRowThreads = 512;  // one CTA per row; 16 warps keep enough 16-byte loads in flight
constexpr int kWarps = kRowThreads / 32;
constexpr int kUnroll = 4;  // packs of 8 loaded per thread before the first is used
constexpr float kLog2e = 1.4426950408889634f;

// Per-row statistics in the workspace (kLceCudaRowStatBytes). m, s, zy, zs are merged across the
// slabs of pass 1; the rest is set when the row is finalised.
struct RowStat {
  float m;     // running max of the row's (bf16) logits
  float s;     // sum_j exp(z_j - m) over every logit but one maximal one (the "1" kept apart)
  float zy;    // the target's logit (0 until seen)
  float zs;    // sum_j z_j
  float lse;   // m + log1p(s)
  float c;     // gradient coefficient c_t (0: ignored, out of range, or a zero upstream)
  float loss;  // L_t (0 for ignored rows)
  float z;     // lambda lse^2 (0 for ignored rows)
};
static_assert(sizeof(RowStat) == kLceCudaRowStatBytes);

// Per-call values computed on the device (kLceCudaHeaderBytes at most).
struct Header {
  double loss_acc;  // sum of L_t over the blocks done so far
  double z_acc;     // sum of Z_t
  double scale;     // mean: 1/den (0 when den == 0); sum, none: 1
  int64_t valid;    // non-ignored targets of this call
  float coef;       // sum, mean: upstream scalar x scale (c_t of every valid row)
};
static_assert(sizeof(Header) <= kLceCudaHeaderBytes);

struct RowParams {
  const void* targets;  // [N] I64 or I32
  bool t64;
  bool none;
  int64_t V;
  float lam;
  float eps;
  const float* dloss;  // [N] per-token upstream (none, backward); nullptr otherwise
  float* lse;          // [N]
  float* loss;         // [N] (none)
  float* zl;           // [N] (none)
  const Header* hdr;
};

__device__ __forceinline__ int64_t target_at(const void* t, bool t64, int64_t i) {
  return t64 ? static_cast<const int64_t*>(t)[i] : static_cast<const int32_t*>(t)[i];
}

__device__ __forceinline__ float bf16_to_f(const bf16_t& v) { return __bfloat162float(v); }

// Plain (coherent) 16-byte accesses: the fused kernel writes the tile it reads, so the read-only
// path (__ldg) is not used on it.
__device__ __forceinline__ cuda::Pack<8> load8(const bf16_t* p) {
  return cuda::Pack<8>{*reinterpret_cast<const uint4*>(p)};
}
__device__ __forceinline__ void store8(bf16_t* p, const cuda::Pack<8>& v) {
  *reinterpret_cast<uint4*>(p) = v.u;
}

// Row statistics (m, s): m the max, s = sum exp(z - m) over all logits but one maximal one, i.e.
// the full sum is 1 + s. Keeping the max's 1 apart lets s hold what fp32 could not add to 1: a
// confident row (1 - p_y ~ 1e-8) keeps 1 - p_y = s / (1 + s) to fp32 accuracy, where a plain fp32
// sum would round 1 + s to 1 and zero the target's gradient. Empty: (-inf, 0).
//
// (m, s) <- (m, s) merged with (m2, s2). Deterministic for a fixed order of merges.
__device__ __forceinline__ void merge_stat(float& m, float& s, float m2, float s2) {
  if (m2 > m) {  // keep the larger max in (m, s)
    const float tm = m, ts = s;
    m = m2, s = s2, m2 = tm, s2 = ts;
  }
  if (m2 == -INFINITY) return;                 // the other side is empty
  s += (s2 + 1.f) * exp2f((m2 - m) * kLog2e);  // its max joins the sum
}

// Online update with one value (the scalar tail of a row).
__device__ __forceinline__ void update1(float f, float& m, float& s, float& zs) {
  if (f > m) {
    s = (s + 1.f) * exp2f((m - f) * kLog2e);  // the old max joins the sum (0 when m = -inf)
    m = f;
  } else {
    s += exp2f((f - m) * kLog2e);
  }
  zs += f;
}

// Online update with 8 values: one rescale at most per pack. z - m of two bf16 values is exact in
// fp32 (for any realistic spread), so exp2 sees one rounding (the multiply by log2 e).
__device__ __forceinline__ void update8(const float (&f)[8], float& m, float& s, float& zs) {
  float pm = f[0];
#pragma unroll
  for (int k = 1; k < 8; ++k) pm = fmaxf(pm, f[k]);
  bool skip = pm > m;  // a new max: its first occurrence is the kept-apart 1
  if (skip) {
    s = (s + 1.f) * exp2f((m - pm) * kLog2e);
    m = pm;
  }
  float acc = 0.f, zacc = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const bool me = skip && f[k] == m;
    skip = skip && !me;
    acc += me ? 0.f : exp2f((f[k] - m) * kLog2e);
    zacc += f[k];
  }
  s += acc;
  zs += zacc;
}

// Pass 1 over one row segment [0, sb): block-wide (m, s, zs), valid in thread 0 only. Lanes and
// then warps are merged in a fixed order (lane 0's butterfly, warps by index): deterministic.
__device__ void row_stats(const bf16_t* __restrict__ row, int sb, float& m_out, float& s_out,
                          float& zs_out) {
  __shared__ float red[3][kWarps];
  float m = -INFINITY, s = 0.f, zs = 0.f;
  const int npk = sb >> 3;  // whole packs of 8
  for (int p0 = static_cast<int>(threadIdx.x); p0 < npk; p0 += kUnroll * kRowThreads) {
    cuda::Pack<8> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = p0 + u * kRowThreads;
      if (p < npk) v[u] = load8(row + 8 * static_cast<int64_t>(p));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (p0 + u * kRowThreads < npk) {
        float f[8];
        cuda::unpack(v[u], f);
        update8(f, m, s, zs);
      }
    }
  }
  if (threadIdx.x == 0)
    for (int j = npk * 8; j < sb; ++j) update1(bf16_to_f(row[j]), m, s, zs);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_down_sync(0xffffffffu, m, o);
    const float s2 = __shfl_down_sync(0xffffffffu, s, o);
    const float z2 = __shfl_down_sync(0xffffffffu, zs, o);
    merge_stat(m, s, m2, s2);
    zs += z2;
  }
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) {
    red[0][warp] = m;
    red[1][warp] = s;
    red[2][warp] = zs;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {  // warps in index order: deterministic
      merge_stat(m, s, red[0][w], red[1][w]);
      zs += red[2][w];
    }
    m_out = m;
    s_out = s;
    zs_out = zs;
  }
}

// Thread 0: lse, L_t, Z_t and c_t of a row whose statistics are complete.
__device__ void finalize_row(RowStat& st, int64_t t, const RowParams& P) {
  const double lse = static_cast<double>(st.m) + log1p(static_cast<double>(st.s));
  const int64_t y = target_at(P.targets, P.t64, t);
  double L = 0, Z = 0;
  float c = 0.f;
  if (y != kLceIgnoreIndex) {
    Z = static_cast<double>(P.lam) * lse * lse;
    if (y < 0 || y >= P.V) {
      L = __longlong_as_double(0x7ff8000000000000LL);  // NaN: the host never sees the targets
    } else {
      const double eps = P.eps;
      const double ce = (static_cast<double>(st.m) - static_cast<double>(st.zy)) +
                        log1p(static_cast<double>(st.s));  // lse - z_y without cancellation
      L = (1 - eps) * ce + eps * (lse - static_cast<double>(st.zs) / static_cast<double>(P.V)) + Z;
      c = P.none ? (P.dloss != nullptr ? P.dloss[t] : 0.f) : P.hdr->coef;
    }
  }
  st.lse = static_cast<float>(lse);
  st.loss = static_cast<float>(L);
  st.z = static_cast<float>(Z);
  st.c = c;
  P.lse[t] = st.lse;
  if (P.none) {
    P.loss[t] = st.loss;
    P.zl[t] = st.z;
  }
}

// One CTA per row of the tile [rows, ld] (the slab [c0, c0 + sb) of the vocabulary, rows r0...).
// kStats: pass 1 over the slab, merged into stats[i] (from scratch when `first`); the row is
// finalised when `last`. kGrad: pass 2 overwrites the slab with G in bf16, using the complete
// statistics (finalised just above when kStats, else read from stats[i]).
template <bool kStats, bool kGrad>
__global__ void __launch_bounds__(kRowThreads)
    lce_row_kernel(bf16_t* __restrict__ tile,    // [rows, ld] logits in, G out (kGrad)
                   RowStat* __restrict__ stats,  // [rows]
                   int64_t ld, int sb, int64_t c0, int64_t r0, bool first, bool last, RowParams P) {
  __shared__ float bc[6];
  const int64_t i = blockIdx.x;
  const int64_t t = r0 + i;
  bf16_t* row = tile + i * ld;  // [sb]
  const int64_t y = target_at(P.targets, P.t64, t);
  const int64_t yl = y >= c0 && y < c0 + sb ? y - c0 : -1;  // the target's column in this slab
  RowStat st{};
  if constexpr (kStats) {
    float m = 0.f, s = 0.f, zs = 0.f;
    row_stats(row, sb, m, s, zs);
    if (threadIdx.x == 0) {
      st = first ? RowStat{-INFINITY, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f} : stats[i];
      merge_stat(st.m, st.s, m, s);
      st.zs += zs;
      if (yl >= 0) st.zy = bf16_to_f(row[yl]);  // read before any thread writes G
      if (last) finalize_row(st, t, P);
      stats[i] = st;
    }
  } else {
    if (threadIdx.x == 0) st = stats[i];
  }
  if constexpr (kGrad) {
    if (threadIdx.x == 0) {
      // G_j = c ((1 + 2 lambda lse) p_j - eps/V) for j != y, p_j = exp2((z_j - m) log2 e - l2s),
      // l2s = log2(1 + s); G_y = c (2 lambda lse p_y + (p_y - 1) + eps - eps/V) with
      // p_y - 1 = expm1((z_y - m) - log1p(s)): no cancellation when p_y ~ 1.
      const double lse = st.lse, c = st.c, lam = P.lam, eps = P.eps;
      const double inv_v = 1.0 / static_cast<double>(P.V);
      const double l1s = log1p(static_cast<double>(st.s));
      const double pm1 = expm1(static_cast<double>(st.zy) - static_cast<double>(st.m) - l1s);
      bc[0] = st.m;
      bc[1] = static_cast<float>(l1s * 1.4426950408889634);
      bc[2] = static_cast<float>(c * (1 + 2 * lam * lse));
      bc[3] = static_cast<float>(c * eps * inv_v);
      bc[4] = static_cast<float>(c * (2 * lam * lse * (1 + pm1) + pm1 + eps - eps * inv_v));
      bc[5] = st.c;
    }
    __syncthreads();
    const float m = bc[0], l2s = bc[1], amp = bc[2], ce = bc[3], gy = bc[4];
    const bool zero = bc[5] == 0.f;
    const int npk = sb >> 3;
    for (int p0 = static_cast<int>(threadIdx.x); p0 < npk; p0 += kUnroll * kRowThreads) {
      cuda::Pack<8> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int p = p0 + u * kRowThreads;
        if (p < npk && !zero) v[u] = load8(row + 8 * static_cast<int64_t>(p));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int p = p0 + u * kRowThreads;
        if (p >= npk) continue;
        float f[8];
        if (zero) {
#pragma unroll
          for (int k = 0; k < 8; ++k) f[k] = 0.f;
        } else {
          cuda::unpack(v[u], f);
#pragma unroll
          for (int k = 0; k < 8; ++k) f[k] = amp * exp2f((f[k] - m) * kLog2e - l2s) - ce;
          const int64_t d = yl - 8 * static_cast<int64_t>(p);
          if (d >= 0 && d < 8) {
#pragma unroll
            for (int k = 0; k < 8; ++k)
              if (k == d) f[k] = gy;  // constant indices: f stays in registers
          }
        }
        store8(row + 8 * static_cast<int64_t>(p), cuda::pack(f));
      }
    }
    if (threadIdx.x == 0)
      for (int j = npk * 8; j < sb; ++j) {
        const float g =
            zero ? 0.f : (j == yl ? gy : amp * exp2f((bf16_to_f(row[j]) - m) * kLog2e - l2s) - ce);
        row[j] = __float2bfloat16_rn(g);
      }
  }
}

// Counts the non-ignored targets; forms 1/den and the gradient coefficient; zeroes the loss
// accumulators. One CTA of 1024 threads (integer sums: any order gives the same count).
__global__ void __launch_bounds__(1024)
    lce_setup_kernel(const void* targets, bool t64, int64_t n, double den_arg, bool mean,
                     const float* upstream,  // [1] or nullptr (1)
                     Header* hdr) {
  __shared__ long long part[32];
  long long cnt = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    cnt += target_at(targets, t64, i) != kLceIgnoreIndex ? 1 : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = cnt;
  __syncthreads();
  if (threadIdx.x != 0) return;
  long long total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += part[w];
  const double den = den_arg >= 0 ? den_arg : static_cast<double>(total);
  const double scale = mean ? (den > 0 ? 1.0 / den : 0.0) : 1.0;
  const double g = upstream != nullptr ? static_cast<double>(*upstream) : 1.0;
  hdr->loss_acc = 0;
  hdr->z_acc = 0;
  hdr->scale = scale;
  hdr->valid = total;
  hdr->coef = static_cast<float>(g * scale);
}

// Adds the block's L_t and Z_t (rows in a fixed tree order, in double) to the accumulators; the
// last block writes loss = sum * scale and z_loss likewise. One CTA.
constexpr int kSumThreads = 256;
__global__ void __launch_bounds__(kSumThreads)
    lce_block_sum_kernel(const RowStat* __restrict__ stats,  // [rows]
                         int64_t rows, Header* hdr, bool last, float* loss, float* zl) {
  __shared__ double sl[kSumThreads], sz[kSumThreads];
  double a = 0, b = 0;
  for (int64_t i = threadIdx.x; i < rows; i += kSumThreads) {
    a += stats[i].loss;
    b += stats[i].z;
  }
  sl[threadIdx.x] = a;
  sz[threadIdx.x] = b;
  __syncthreads();
  for (int w = kSumThreads / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) {
      sl[threadIdx.x] += sl[threadIdx.x + w];
      sz[threadIdx.x] += sz[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  hdr->loss_acc += sl[0];
  hdr->z_acc += sz[0];
  if (last) {
    loss[0] = static_cast<float>(hdr->loss_acc * hdr->scale);
    zl[0] = static_cast<float>(hdr->z_acc * hdr->scale);
  }
}

// N == 0 with sum / mean: loss = z_loss = 0.
__global__ void lce_zero_loss_kernel(float* loss, float* zl) {
  loss[0] = 0.f;
  zl[0] = 0.f;
}

// Slab mode: dx_blk = bf16(dx_acc), rounded once.
__global__ void lce_dx_store_kernel(const float* __restrict__ acc,  // [n]
                                    bf16_t* __restrict__ dx,        // [n]
                                    int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dx[i] = __float2bfloat16_rn(acc[i]);
}

int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }

template <bool kStats, bool kGrad>
void launch_rows(int64_t rows, bf16_t* tile, RowStat* stats, int64_t ld, int64_t sb, int64_t c0,
                 int64_t r0, bool first, bool last, const RowParams& p, cudaStream_t s) {
  lce_row_kernel<kStats, kGrad><<<static_cast<unsigned>(rows), kRowThreads, 0, s>>>(
      tile, stats, ld, static_cast<int>(sb), c0, r0, first, last, p);
  GDN_CUDA_LAUNCH_CHECK("lce_row_kernel");
}

void run(const LinearCrossEntropyArgs& a, bool backward) {
  GDN_CHECK(a.x.dtype() == DType::BF16, "{} (cuda): x and w must be BF16, got {}", kOp,
            dtype_name(a.x.dtype()));
  const int64_t N = a.x.size(0), D = a.x.size(1), V = a.w.size(0);
  const bool none = a.reduction == LceReduction::None;
  const bool mean = a.reduction == LceReduction::Mean;
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t stream = ctx.stream();
  float* loss = a.loss.ptr<float>();  // [1] or [N]
  float* zl = a.z_loss.ptr<float>();  // [1] or [N]
  if (N == 0) {
    if (!none) {
      lce_zero_loss_kernel<<<1, 1, 0, stream>>>(loss, zl);
      GDN_CUDA_LAUNCH_CHECK("lce_zero_loss_kernel");
    }
    return;
  }
  GDN_CHECK(V < INT_MAX - 8, "{} (cuda): vocabulary {} is too large", kOp, V);
  const LceChunkPlan plan = linear_cross_entropy_cuda_plan(N, V, D, a.chunk_bytes);
  const int64_t R = plan.rows, S = plan.cols, ld = (S + 7) / 8 * 8;
  const bool slab = S < V;

  char* base = nullptr;  // [plan.workspace_bytes]
  if (a.workspace.defined()) {
    const int64_t need = linear_cross_entropy_workspace_bytes(N, V, a.chunk_bytes);
    GDN_CHECK(a.workspace.nbytes() >= need,
              "{}: tensor 'workspace' has {} bytes, needs {} (linear_cross_entropy_workspace_bytes "
              "for N = {}, V = {}, budget {})",
              kOp, a.workspace.nbytes(), need, N, V, plan.budget);
    base = static_cast<char*>(a.workspace.data());
    GDN_CHECK(reinterpret_cast<uintptr_t>(base) % 16 == 0,
              "{}: tensor 'workspace' must be 16-byte aligned on cuda", kOp);
  } else {
    base = static_cast<char*>(
        ctx.scratch(static_cast<size_t>(plan.workspace_bytes), "linear_cross_entropy"));
  }
  bf16_t* tile = reinterpret_cast<bf16_t*>(base);  // [R, ld]
  int64_t off = align16(2 * R * ld);
  float* dx_acc = nullptr;  // [R, D] slab mode only
  if (slab) {
    dx_acc = reinterpret_cast<float*>(base + off);
    off += align16(4 * R * D);
  }
  RowStat* stats = reinterpret_cast<RowStat*>(base + off);  // [R]
  off += kLceCudaRowStatBytes * R;
  Header* hdr = reinterpret_cast<Header*>(base + off);
  off += kLceCudaHeaderBytes;
  GDN_CHECK(off == plan.workspace_bytes, "{} (cuda): internal: layout {} bytes, plan {}", kOp, off,
            plan.workspace_bytes);

  const bool t64 = a.targets.dtype() == DType::I64;
  const void* targets = a.targets.data();  // [N]
  const float* upstream = backward && !none && a.dloss.defined() ? a.dloss.ptr<float>() : nullptr;
  lce_setup_kernel<<<1, 1024, 0, stream>>>(targets, t64, N, a.denominator, mean, upstream, hdr);
  GDN_CUDA_LAUNCH_CHECK("lce_setup_kernel");

  const RowParams P{targets,
                    t64,
                    none,
                    V,
                    static_cast<float>(a.z_loss_scale),
                    static_cast<float>(a.label_smoothing),
                    backward && none ? a.dloss.ptr<float>() : nullptr,
                    a.lse.ptr<float>(),
                    none ? loss : nullptr,
                    none ? zl : nullptr,
                    hdr};
  const auto* x = reinterpret_cast<const bf16_t*>(a.x.data());               // [N, D]
  const auto* w = reinterpret_cast<const bf16_t*>(a.w.data());               // [V, D]
  bf16_t* dx = backward ? reinterpret_cast<bf16_t*>(a.dx.data()) : nullptr;  // [N, D]
  float* dw = backward ? a.dw.ptr<float>() : nullptr;                        // [V, D]

  // tile[:rb, :sb] = x_blk w[c0 : c0 + sb]^T
  auto logits = [&](const bf16_t* xb, int64_t rb, int64_t c0, int64_t sb) {
    cuda::lt_matmul({rb, sb, D, xb, D, false, w + c0 * D, D, true, tile, ld, false, 1.f, 0.f,
                     "linear_cross_entropy (cuda) logits"});
  };
  for (int64_t r0 = 0; r0 < N; r0 += R) {
    const int64_t rb = std::min(R, N - r0);
    const bf16_t* xb = x + r0 * D;  // [rb, D]
    if (!slab) {
      logits(xb, rb, 0, V);
      if (backward) {
        launch_rows<true, true>(rb, tile, stats, ld, V, 0, r0, true, true, P, stream);
      } else {
        launch_rows<true, false>(rb, tile, stats, ld, V, 0, r0, true, true, P, stream);
      }
    } else {
      for (int64_t c0 = 0; c0 < V; c0 += S) {
        const int64_t sb = std::min(S, V - c0);
        logits(xb, rb, c0, sb);
        launch_rows<true, false>(rb, tile, stats, ld, sb, c0, r0, c0 == 0, c0 + sb == V, P, stream);
      }
    }
    if (!none) {
      lce_block_sum_kernel<<<1, kSumThreads, 0, stream>>>(stats, rb, hdr, r0 + rb == N, loss, zl);
      GDN_CUDA_LAUNCH_CHECK("lce_block_sum_kernel");
    }
    if (!backward) continue;
    if (!slab) {
      // dx_blk = G w (bf16, rounded once); dw += G^T x_blk (fp32, beta = 1).
      cuda::lt_matmul({rb, D, V, tile, ld, false, w, D, false, dx + r0 * D, D, false, 1.f, 0.f,
                       "linear_cross_entropy (cuda) dx"});
      cuda::lt_matmul({V, D, rb, tile, ld, true, xb, D, false, dw, D, true, 1.f, 1.f,
                       "linear_cross_entropy (cuda) dw"});
      continue;
    }
    for (int64_t c0 = 0; c0 < V; c0 += S) {
      const int64_t sb = std::min(S, V - c0);
      logits(xb, rb, c0, sb);  // recomputed: the same plan gives the same bits as in pass 1
      launch_rows<false, true>(rb, tile, stats, ld, sb, c0, r0, false, false, P, stream);
      cuda::lt_matmul({rb, D, sb, tile, ld, false, w + c0 * D, D, false, dx_acc, D, true, 1.f,
                       c0 == 0 ? 0.f : 1.f, "linear_cross_entropy (cuda) dx slab"});
      cuda::lt_matmul({sb, D, rb, tile, ld, true, xb, D, false, dw + c0 * D, D, true, 1.f, 1.f,
                       "linear_cross_entropy (cuda) dw slab"});
    }
    const int64_t n = rb * D;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096));
    lce_dx_store_kernel<<<blocks, 256, 0, stream>>>(dx_acc, dx + r0 * D, n);
    GDN_CUDA_LAUNCH_CHECK("lce_dx_store_kernel");
  }
}

void forward(const LinearCrossEntropyArgs& a) { run(a, false); }
void forward_backward(const LinearCrossEntropyArgs& a) { run(a, true); }

const LinearCrossEntropyTable kTable{forward, forward_backward};

}  // namespace

GDN_REGISTER(linear_cross_entropy_cuda) {
  Registry::global().add_impl(
      {"linear_cross_entropy", "cuda.chunked", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
