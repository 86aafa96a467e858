// Gated attention on CUDA: the per-row device helpers shared by the row kernels (cuda_rows.cuh)
// and the fused dq epilogue of the Hopper dq kernel (sm90_pipe.cuh). A row of hd <= 256 elements
// is held 8 consecutive elements per lane (one 16-byte access). See cuda.cu for the design.
#pragma once

#include "ops/gated_attention/cuda_common.cuh"

namespace gdn::ops::attn {

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Loads this lane's 8 bf16 (elements 8·lane ..) of a row as fp32; zeros for inactive lanes.
__device__ __forceinline__ void load8(const bf16_t* row, int lane, bool act, float (&f)[8]) {
  uint4 u = make_uint4(0, 0, 0, 0);
  if (act) u = *reinterpret_cast<const uint4*>(row + lane * 8);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = bf16x2_lo(w[k]);
    f[2 * k + 1] = bf16x2_hi(w[k]);
  }
}
__device__ __forceinline__ void store8(bf16_t* row, int lane, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(row + lane * 8) =
      make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                 pack_bf16x2(f[6], f[7]));
}
// The same for 8 fp32 (two 16-byte loads).
__device__ __forceinline__ void load8f(const float* row, int lane, bool act, float (&f)[8]) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
  if (act) {
    a = *reinterpret_cast<const float4*>(row + lane * 8);
    b = *reinterpret_cast<const float4*>(row + lane * 8 + 4);
  }
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// RoPE over a row held 8 elements per lane: forward (sign = +1) y[i] = u[i] c_i − u[i+h] s_i,
// y[i+h] = u[i+h] c_i + u[i] s_i for i < h = rot/2; backward (sign = −1) rotates by −θ. Elements
// >= rot pass through. cs, sn [h] are the token's. When h is a multiple of 8 (Qwen3.5: 32) the
// partner of element i sits in lane ± h/8 at the same slot and comes by shuffle; otherwise through
// the warp's buffer buf [hd]. The arithmetic is the same on both paths. Every lane of the warp
// must call it (shuffles, __syncwarp()).
__device__ __forceinline__ void rope_row(float (&u)[8], int lane, bool act, int half, float sign,
                                         const float* cs, const float* sn, float* buf) {
  if ((half & 7) == 0) {
    const int h8 = half >> 3;
    const bool lo = lane < h8, rotated = lane < 2 * h8;
    const int src = lo ? lane + h8 : rotated ? lane - h8 : lane;
    float pv[8];
#pragma unroll
    for (int v = 0; v < 8; ++v) pv[v] = __shfl_sync(0xffffffffu, u[v], src);
    if (rotated) {
      const int ci = (lo ? lane : lane - h8) * 8;  // angle index of slot 0
#pragma unroll
      for (int v = 0; v < 8; ++v) {
        const float c = cs[ci + v], s = sn[ci + v];
        u[v] = lo ? u[v] * c - sign * pv[v] * s : u[v] * c + sign * pv[v] * s;
      }
    }
    return;
  }
  if (act) {
#pragma unroll
    for (int v = 0; v < 8; ++v) buf[lane * 8 + v] = u[v];
  }
  __syncwarp();
  float y[8];
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const int i = lane * 8 + v;
    if (i < half) {
      y[v] = u[v] * cs[i] - sign * buf[i + half] * sn[i];
    } else if (i < 2 * half) {
      y[v] = u[v] * cs[i - half] + sign * buf[i - half] * sn[i - half];
    } else {
      y[v] = u[v];
    }
  }
  __syncwarp();  // buf is rewritten by the next row
#pragma unroll
  for (int v = 0; v < 8; ++v) u[v] = y[v];
}

// Zero-centred RMSNorm backward of one row held 8 per lane: g the gradient of the normalised (and
// roped back) row, x the norm's input, rs its 1/rms, gw = 1 + w. Returns dx = rs ((1+w) g − x̂ ·
// mean((1+w) g x̂)) in dx and adds g ⊙ x̂ to acc (the weight gradient; active lanes only).
// Every lane of the warp must call it (warp_sum).
__device__ __forceinline__ void rmsnorm_bwd_row(const float (&g)[8], const float (&x)[8],
                                                const float (&gw)[8], float rs, int hd, bool act,
                                                float* acc, float (&dx)[8]) {
  float dot = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) dot += g[v] * gw[v] * x[v];
  const float m = warp_sum(dot) * rs / static_cast<float>(hd);
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    const float xh = x[v] * rs;
    dx[v] = rs * (g[v] * gw[v] - xh * m);
    if (act) acc[v] += g[v] * xh;
  }
}

}  // namespace gdn::ops::attn
