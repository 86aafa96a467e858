// GDN gates on CUDA: bf16 a, b, da, db; fp32 A_log, dt_bias, g, beta, dg, dbeta, dA_log, ddt_bias;
// fp32 arithmetic with the accurate expf / log1pf (op.h has the contract).
//
// Forward: 4 consecutive (token, head) elements a thread (8-byte loads of a and b, 16-byte stores
// of g and beta) when every pointer allows it, else one element a thread (one kernel; measured:
// docs/PERF.md).
// Backward: blocks of 32 heads x 8 token lanes over tiles of kTileT tokens. Each thread writes da
// and db of its elements and keeps its sums of dg * g and da in fp32 registers; the 8 token lanes
// are summed in lane order through shared memory into one partial per (tile, head), and
// column_sum_add_kernel adds the tile partials to dA_log and ddt_bias in a fixed order (one launch
// for both). No float atomics: the result depends only on T and Hv. Each thread issues the loads of
// all its tokens before the arithmetic (latency, not bandwidth, bounds an op this small).
// The op moves ~3.5 MB at T = 8192, Hv = 32: it is bound by launch latency, not bandwidth.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "backend/cuda/memory_bound.cuh"
#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/gdn_gates/op.h"

namespace gdn::ops {

namespace {

using cuda::bf16_t;

constexpr float kThreshold = static_cast<float>(kGdnSoftplusThreshold);
constexpr int kTileT = static_cast<int>(kGdnGatesTileT);  // tokens per backward block (op.h)
constexpr int kLanes = 8;  // token lanes per backward block (blockDim.y)

__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __bfloat162float(v); }

// One (token, head) element of the forward.
__device__ __forceinline__ void gates_fwd_elem(float av, float bv, int h,
                                               const float* __restrict__ A_log,
                                               const float* __restrict__ dt_bias, float& g,
                                               float& beta) {
  const float x = av + dt_bias[h];
  const float sp = x > kThreshold ? x : log1pf(expf(x));
  g = -expf(A_log[h]) * sp;
  beta = cuda::sigmoidf_safe(bv);
}

// V consecutive (token, head) elements a thread: V = 4 (a and b as one 8-byte load each, g and
// beta as one 16-byte store each) when every pointer is aligned so, else V = 1; the last thread
// takes the n % V tail element by element.
template <int V>
__global__ void __launch_bounds__(256)
    gdn_gates_fwd_kernel(const bf16_t* __restrict__ a,       // [T, Hv]
                         const bf16_t* __restrict__ b,       // [T, Hv]
                         const float* __restrict__ A_log,    // [Hv]
                         const float* __restrict__ dt_bias,  // [Hv]
                         float* __restrict__ g,              // [T, Hv]
                         float* __restrict__ beta,           // [T, Hv]
                         int64_t n, int H) {
  const int64_t i0 = V * (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  if constexpr (V == 4) {
    if (i0 + 4 <= n) {
      const uint2 ua = *reinterpret_cast<const uint2*>(a + i0);
      const uint2 ub = *reinterpret_cast<const uint2*>(b + i0);
      const float af[4] = {cuda::bf16_lo(ua.x), cuda::bf16_hi(ua.x), cuda::bf16_lo(ua.y),
                           cuda::bf16_hi(ua.y)};
      const float bf[4] = {cuda::bf16_lo(ub.x), cuda::bf16_hi(ub.x), cuda::bf16_lo(ub.y),
                           cuda::bf16_hi(ub.y)};
      float gv[4], bv[4];
      int h = static_cast<int>(i0 % H);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        gates_fwd_elem(af[k], bf[k], h, A_log, dt_bias, gv[k], bv[k]);
        h = h + 1 == H ? 0 : h + 1;
      }
      *reinterpret_cast<float4*>(g + i0) = make_float4(gv[0], gv[1], gv[2], gv[3]);
      *reinterpret_cast<float4*>(beta + i0) = make_float4(bv[0], bv[1], bv[2], bv[3]);
      return;
    }
  }
  for (int64_t i = i0; i < n && i < i0 + V; ++i)
    gates_fwd_elem(bf16_to_f32(a[i]), bf16_to_f32(b[i]), static_cast<int>(i % H), A_log, dt_bias,
                   g[i], beta[i]);
}

// partial: [2, ntiles, Hv]; plane 0 = sum of dg * g per tile, plane 1 = sum of da per tile.
__global__ void __launch_bounds__(32 * kLanes)
    gdn_gates_bwd_kernel(const bf16_t* __restrict__ a,       // [T, Hv]
                         const bf16_t* __restrict__ b,       // [T, Hv]
                         const float* __restrict__ A_log,    // [Hv]
                         const float* __restrict__ dt_bias,  // [Hv]
                         const float* __restrict__ dg,       // [T, Hv]
                         const float* __restrict__ dbeta,    // [T, Hv]
                         bf16_t* __restrict__ da,            // [T, Hv]
                         bf16_t* __restrict__ db,            // [T, Hv]
                         float* __restrict__ partial,        // [2, ntiles, Hv]
                         int64_t T, int H) {
  __shared__ float red[2][kLanes][33];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int h = static_cast<int>(blockIdx.y) * 32 + tx;
  const int64_t tile = blockIdx.x, ntiles = gridDim.x;
  const int64_t t0 = tile * kTileT, t1 = std::min<int64_t>(T, t0 + kTileT);
  float sa = 0.f, sd = 0.f;  // sum dg * g, sum da
  if (h < H) {
    const float ne = -expf(A_log[h]), bias = dt_bias[h];
    // Every load of the thread's kTileT / kLanes tokens first, then the arithmetic: 4 * kPer
    // independent loads in flight per thread (a loop that loads and computes token by token waits
    // a memory latency per token; the op is too small for anything but latency to matter).
    constexpr int kPer = kTileT / kLanes;
    bf16_t av[kPer], bv[kPer];
    float dgv[kPer], dbv[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t t = t0 + ty + static_cast<int64_t>(k) * kLanes;
      const bool ok = t < t1;
      const int64_t i = ok ? t * H + h : 0;
      av[k] = ok ? a[i] : bf16_t{};
      bv[k] = ok ? b[i] : bf16_t{};
      dgv[k] = ok ? dg[i] : 0.f;
      dbv[k] = ok ? dbeta[i] : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t t = t0 + ty + static_cast<int64_t>(k) * kLanes;
      if (t >= t1) break;
      const int64_t i = t * H + h;
      const float x = bf16_to_f32(av[k]) + bias;
      float sp, dsp;
      if (x > kThreshold) {
        sp = x;
        dsp = 1.f;
      } else {
        const float ex = expf(x);  // <= e^20: no overflow; shared by softplus and its derivative
        sp = log1pf(ex);
        dsp = ex / (1.f + ex);
      }
      const float dai = dgv[k] * ne * dsp;
      da[i] = __float2bfloat16_rn(dai);
      sa += dgv[k] * (ne * sp);
      sd += dai;
      const float sg = cuda::sigmoidf_safe(bf16_to_f32(bv[k]));
      db[i] = __float2bfloat16_rn(dbv[k] * sg * (1.f - sg));
    }
  }
  red[0][ty][tx] = sa;
  red[1][ty][tx] = sd;
  __syncthreads();
  if (ty < 2 && h < H) {  // ty 0: dA_log plane, ty 1: ddt_bias plane
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kLanes; ++j) s += red[ty][j][tx];  // lane order: deterministic
    partial[(static_cast<int64_t>(ty) * ntiles + tile) * H + h] = s;
  }
}

const bf16_t* in(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }

void forward(const GdnGatesFwd& p) {
  const int64_t T = p.a.size(0), H = p.a.size(1), n = T * H;
  if (n == 0) return;
  GDN_CHECK(H <= INT_MAX, "gdn_gates (cuda): {} heads is too many", H);
  const bf16_t* a = in(p.a);                      // [T, Hv]
  const bf16_t* b = in(p.b);                      // [T, Hv]
  const float* A_log = p.A_log.ptr<float>();      // [Hv]
  const float* dt_bias = p.dt_bias.ptr<float>();  // [Hv]
  float* g = p.g.ptr<float>();                    // [T, Hv]
  float* beta = p.beta.ptr<float>();              // [T, Hv]
  const bool vec = reinterpret_cast<uintptr_t>(a) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(b) % 8 == 0 && cuda::aligned16(g) &&
                   cuda::aligned16(beta);
  const int64_t blocks = ((vec ? (n + 3) / 4 : n) + 255) / 256;
  GDN_CHECK(blocks <= INT_MAX, "gdn_gates (cuda): [{}, {}] is too large", T, H);
  auto* kernel = vec ? gdn_gates_fwd_kernel<4> : gdn_gates_fwd_kernel<1>;
  kernel<<<static_cast<unsigned>(blocks), 256, 0, cuda::stream()>>>(a, b, A_log, dt_bias, g, beta,
                                                                    n, static_cast<int>(H));
  GDN_CUDA_LAUNCH_CHECK("gdn_gates_fwd_kernel");
}

void backward(const GdnGatesBwd& p) {
  const int64_t T = p.a.size(0), H = p.a.size(1);
  if (T == 0 || H == 0) return;  // dA_log, ddt_bias += 0
  const int64_t ntiles = (T + kTileT - 1) / kTileT, hblocks = (H + 31) / 32;
  GDN_CHECK(ntiles <= INT_MAX && hblocks <= 65535 && ntiles * H <= INT_MAX,
            "gdn_gates (cuda): [{}, {}] is too large", T, H);
  const bf16_t* a = in(p.a);                      // [T, Hv]
  const bf16_t* b = in(p.b);                      // [T, Hv]
  const float* A_log = p.A_log.ptr<float>();      // [Hv]
  const float* dt_bias = p.dt_bias.ptr<float>();  // [Hv]
  const float* dg = p.dg.ptr<float>();            // [T, Hv]
  const float* dbeta = p.dbeta.ptr<float>();      // [T, Hv]
  bf16_t* da = out(p.da);                         // [T, Hv]
  bf16_t* db = out(p.db);                         // [T, Hv]
  float* dA_log = p.dA_log.ptr<float>();          // [Hv]
  float* ddt_bias = p.ddt_bias.ptr<float>();      // [Hv]
  cuda::Context& ctx = cuda::Context::get();
  float* partial = static_cast<float*>(  // [2, ntiles, Hv]
      ctx.scratch(gdn_gates_workspace_bytes(T, H), "gdn_gates"));
  cudaStream_t s = ctx.stream();
  const dim3 grid(static_cast<unsigned>(ntiles), static_cast<unsigned>(hblocks));
  gdn_gates_bwd_kernel<<<grid, dim3(32, kLanes), 0, s>>>(a, b, A_log, dt_bias, dg, dbeta, da, db,
                                                         partial, T, static_cast<int>(H));
  GDN_CUDA_LAUNCH_CHECK("gdn_gates_bwd_kernel");
  // Both parameter sums in one launch: plane 0 into dA_log, plane 1 into ddt_bias.
  cuda::column_sum_add_kernel<><<<dim3(static_cast<unsigned>(hblocks), 2), 256, 0, s>>>(
      partial, dA_log, static_cast<int>(ntiles), static_cast<int>(H), ddt_bias);
  GDN_CUDA_LAUNCH_CHECK("column_sum_add_kernel");
}

const GdnGatesTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(gdn_gates_cuda) {
  Registry::global().add_impl(
      {"gdn_gates", "cuda.elementwise", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
