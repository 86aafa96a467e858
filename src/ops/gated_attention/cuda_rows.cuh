// Gated attention on CUDA, the row-wise (memory-bound) kernels: the per-batch tile index, the
// forward prologue (q/k zero-centred RMSNorm + partial RoPE), the backward preprocess
// (dA = do ⊙ σ(gate), D = rowsum(dA ⊙ attn)), the backward epilogue (dq_hat, dk_hat back through
// RoPE and the norms, the gate gradient, per-block norm-weight partials) and the fixed-order
// reduction of those partials. See cuda.cu for the design.
#pragma once

#include <climits>

#include "ops/gated_attention/cuda_common.cuh"

namespace gdn::ops::attn {

// One block of 1024 threads: exclusive prefix sums over the documents of ceil(len / kBigTile) and
// ceil(len / kSmallTile), in 1024-document chunks (Hillis-Steele scan in shared memory, int64 so
// that no cu_seqlens value overflows it; stored saturated to int32).
constexpr int kIndexThreads = 1024;
__global__ void __launch_bounds__(kIndexThreads) attn_tile_index_kernel(const TileIndexParams p) {
  __shared__ long long sa[kIndexThreads], sb[kIndexThreads];
  const int tid = static_cast<int>(threadIdx.x);
  long long carry_a = 0, carry_b = 0;
  auto sat = [](long long x) { return static_cast<int32_t>(x < INT_MAX ? x : INT_MAX); };
  for (int base = 0; base < p.N; base += kIndexThreads) {
    const int n = base + tid;
    long long a = 0, b = 0;
    if (n < p.N) {
      const Doc d = doc_bounds(p.cu, n, p.T);
      a = (d.e - d.b + kBigTile - 1) / kBigTile;
      b = (d.e - d.b + kSmallTile - 1) / kSmallTile;
    }
    sa[tid] = a;
    sb[tid] = b;
    __syncthreads();
    for (int off = 1; off < kIndexThreads; off <<= 1) {
      const long long va = tid >= off ? sa[tid - off] : 0, vb = tid >= off ? sb[tid - off] : 0;
      __syncthreads();
      sa[tid] += va;
      sb[tid] += vb;
      __syncthreads();
    }
    if (n < p.N) {
      p.ts_big[n] = sat(carry_a + sa[tid] - a);
      p.ts_small[n] = sat(carry_b + sb[tid] - b);
    }
    carry_a += sa[kIndexThreads - 1];
    carry_b += sb[kIndexThreads - 1];
    __syncthreads();  // sa, sb are rewritten by the next chunk
  }
  if (tid == 0) {
    p.ts_big[p.N] = sat(carry_a);
    p.ts_small[p.N] = sat(carry_b);
  }
}

// cos/sin of the rotary angles of token t into cs, sn [rot/2]: θ_i = pos · theta^(−2i/rot), formed
// in fp64 and rounded once (as ref and cpu). Called by every thread of the block; ends with a
// barrier.
__device__ __forceinline__ void rope_angles(const int32_t* cu, int N, int T, int t, int rot,
                                            double theta, float* cs, float* sn) {
  const int half = rot / 2;
  const int i = static_cast<int>(threadIdx.x);
  if (i < half) {
    const int pos = position_of(cu, N, T, t);
    const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
    double s, c;
    sincos(static_cast<double>(pos) * inv_freq, &s, &c);
    cs[i] = static_cast<float>(c);
    sn[i] = static_cast<float>(s);
  }
  __syncthreads();
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

// RoPE over a row held 8 elements per lane, partners exchanged through the warp's buffer buf [hd]:
// forward (sign = +1) y[i] = u[i] c_i − u[i+h] s_i, y[i+h] = u[i+h] c_i + u[i] s_i for i < h =
// rot/2; backward (sign = −1) rotates by −θ. Elements >= rot pass through. Holds __syncwarp()s:
// every lane of the warp must call it.
__device__ __forceinline__ void rope_row(float (&u)[8], int lane, bool act, int half, float sign,
                                         const float* cs, const float* sn, float* buf) {
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

// Forward prologue: q_hat, k_hat, q_rstd, k_rstd for kRowTokens tokens per block; warp w takes
// rows w, w + 8, ... of the token's Hq query and Hkv key rows.
__global__ void __launch_bounds__(kThreads) attn_prologue_kernel(const PrologueParams p) {
  __shared__ float cs[kMaxHd / 2], sn[kMaxHd / 2];
  __shared__ float bufs[kWarps][kMaxHd];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const bool act = lane * 8 < p.hd;
  float* buf = bufs[warp];
  float gq[8], gk[8];  // 1 + w in fp32 (in bf16, 1 + 0.0039 would round to 1)
  load8(p.wq, lane, act, gq);
  load8(p.wk, lane, act, gk);
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    gq[v] += 1.0f;
    gk[v] += 1.0f;
  }
  const int half = p.rot / 2;
  for (int i = 0; i < kRowTokens; ++i) {
    const int t = static_cast<int>(blockIdx.x) * kRowTokens + i;
    if (t >= p.T) break;  // uniform over the block
    rope_angles(p.cu, p.N, p.T, t, p.rot, p.theta, cs, sn);
    for (int r = warp; r < p.Hq + p.Hkv; r += kWarps) {
      const bool is_q = r < p.Hq;
      const size_t row =
          is_q ? static_cast<size_t>(t) * p.Hq + r : static_cast<size_t>(t) * p.Hkv + (r - p.Hq);
      const bf16_t* x = is_q ? p.qg + row * 2 * p.hd : p.k + row * p.hd;  // [hd]
      float u[8];
      load8(x, lane, act, u);
      float ss = 0.f;
#pragma unroll
      for (int v = 0; v < 8; ++v) ss += u[v] * u[v];
      ss = warp_sum(ss);
      const float rs = 1.0f / sqrtf(ss / static_cast<float>(p.hd) + p.eps);
#pragma unroll
      for (int v = 0; v < 8; ++v) u[v] = u[v] * rs * (is_q ? gq[v] : gk[v]);
      rope_row(u, lane, act, half, 1.0f, cs, sn, buf);
      if (act) store8((is_q ? p.q_hat : p.k_hat) + row * p.hd, lane, u);
      if (lane == 0) (is_q ? p.q_rstd : p.k_rstd)[row] = rs;
    }
    __syncthreads();  // cs, sn are rewritten for the next token
  }
}

// Backward preprocess, one warp per (t, h) row: dA = do ⊙ σ(gate) rounded to bf16 and parked in
// the gate half of dqg (the epilogue overwrites it with the gate gradient), D = Σ dA ⊙ attn over
// the rounded dA (the same operand the dP = dA Vᵀ products see).
__global__ void __launch_bounds__(kThreads) attn_bwd_preprocess_kernel(const PreprocessParams p) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= p.rows) return;  // uniform over the warp; no block barrier follows
  const bool act = lane * 8 < p.hd;
  const size_t r = static_cast<size_t>(row);
  float gate[8], dout[8], at[8], da[8];
  load8(p.qg + r * 2 * p.hd + p.hd, lane, act, gate);
  load8(p.d_o + r * p.hd, lane, act, dout);
  load8(p.attn + r * p.hd, lane, act, at);
  float s = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    da[v] = dout[v] * sigmoidf_(gate[v]);
    da[v] = bf16x2_lo(pack_bf16x2(da[v], 0.f));  // the stored (rounded) value
    s += da[v] * at[v];
  }
  s = warp_sum(s);
  if (act) store8(p.dqg + r * 2 * p.hd + p.hd, lane, da);
  if (lane == 0) p.D[r] = s;
}

// Backward epilogue, kRowTokens tokens per block. Query rows: dq_hat rotated back by −θ, through
// the zero-centred RMSNorm (dx = r ((1+w) g − x̂ · mean((1+w) g x̂))) into the query half of dqg;
// the gate half gets do ⊙ attn ⊙ σ(gate) σ(−gate). Key rows likewise from dk_hat into dk. The
// weight gradients g ⊙ x̂ stay in each lane's registers (a lane owns the same 8 columns in every
// row), are summed over the warps in warp order and written as this block's partial row.
__global__ void __launch_bounds__(kThreads) attn_bwd_epilogue_kernel(const EpilogueParams p) {
  __shared__ float cs[kMaxHd / 2], sn[kMaxHd / 2];
  __shared__ float bufs[kWarps][kMaxHd];
  __shared__ float red[kWarps][2 * kMaxHd];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const bool act = lane * 8 < p.hd;
  float* buf = bufs[warp];
  float gq[8], gk[8];
  load8(p.wq, lane, act, gq);
  load8(p.wk, lane, act, gk);
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    gq[v] += 1.0f;
    gk[v] += 1.0f;
  }
  float aq[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float ak[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int half = p.rot / 2;
  for (int i = 0; i < kRowTokens; ++i) {
    const int t = static_cast<int>(blockIdx.x) * kRowTokens + i;
    if (t >= p.T) break;  // uniform over the block
    rope_angles(p.cu, p.N, p.T, t, p.rot, p.theta, cs, sn);
    for (int r = warp; r < p.Hq + p.Hkv; r += kWarps) {
      const bool is_q = r < p.Hq;
      const size_t row =
          is_q ? static_cast<size_t>(t) * p.Hq + r : static_cast<size_t>(t) * p.Hkv + (r - p.Hq);
      const float* gsrc = (is_q ? p.dq_hat : p.dk_hat) + row * p.hd;  // [hd]
      float g[8];
      if (act) {
        const float4 g0 = *reinterpret_cast<const float4*>(gsrc + lane * 8);
        const float4 g1 = *reinterpret_cast<const float4*>(gsrc + lane * 8 + 4);
        g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w;
        g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
      } else {
#pragma unroll
        for (int v = 0; v < 8; ++v) g[v] = 0.f;
      }
      rope_row(g, lane, act, half, -1.0f, cs, sn, buf);
      const bf16_t* xrow = is_q ? p.qg + row * 2 * p.hd : p.k + row * p.hd;  // [hd]
      float x[8];
      load8(xrow, lane, act, x);
      const float rs = (is_q ? p.q_rstd : p.k_rstd)[row];
      float gw[8];  // selected element-wise: a reference to either array would spill both
#pragma unroll
      for (int v = 0; v < 8; ++v) gw[v] = is_q ? gq[v] : gk[v];
      float dot = 0.f;
#pragma unroll
      for (int v = 0; v < 8; ++v) dot += g[v] * gw[v] * x[v];
      const float m = warp_sum(dot) * rs / static_cast<float>(p.hd);
      float dx[8];
#pragma unroll
      for (int v = 0; v < 8; ++v) {
        const float xh = x[v] * rs;
        dx[v] = rs * (g[v] * gw[v] - xh * m);
        if (is_q) {
          aq[v] += g[v] * xh;
        } else {
          ak[v] += g[v] * xh;
        }
      }
      if (act) store8(is_q ? p.dqg + row * 2 * p.hd : p.dk + row * p.hd, lane, dx);
      if (is_q) {
        float gate[8], dout[8], at[8], dg[8];
        load8(p.qg + row * 2 * p.hd + p.hd, lane, act, gate);
        load8(p.d_o + row * p.hd, lane, act, dout);
        load8(p.attn + row * p.hd, lane, act, at);
#pragma unroll
        for (int v = 0; v < 8; ++v)  // σ'(x) = σ(x) σ(−x): no cancellation in 1 − σ(x)
          dg[v] = dout[v] * at[v] * sigmoidf_(gate[v]) * sigmoidf_(-gate[v]);
        if (act) store8(p.dqg + row * 2 * p.hd + p.hd, lane, dg);
      }
    }
    __syncthreads();  // cs, sn are rewritten for the next token
  }
  if (act) {
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      red[warp][lane * 8 + v] = aq[v];
      red[warp][p.hd + lane * 8 + v] = ak[v];
    }
  }
  __syncthreads();
  float* out = p.partial + static_cast<size_t>(blockIdx.x) * 2 * p.hd;  // [2*hd]
  for (int c = static_cast<int>(threadIdx.x); c < 2 * p.hd; c += kThreads) {
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += red[w][c];  // fixed order: deterministic
    out[c] = s;
  }
}

// dwq[c] += Σ_b partial[b][c], dwk[c] += Σ_b partial[b][hd + c], b in a fixed order: 8 slices of b
// per column (each in increasing b), then the slice sums in slice order. Block: 32 columns x 8
// slices.
__global__ void __launch_bounds__(256) attn_dw_reduce_kernel(const float* partial,  // [P, 2*hd]
                                                             float* dwq,            // [hd]
                                                             float* dwk,            // [hd]
                                                             int P, int hd) {
  __shared__ float s[8][33];
  const int tx = static_cast<int>(threadIdx.x) & 31, ty = static_cast<int>(threadIdx.x) >> 5;
  const int col = static_cast<int>(blockIdx.x) * 32 + tx;
  float acc = 0.f;
  if (col < 2 * hd)
    for (int b = ty; b < P; b += 8) acc += partial[static_cast<size_t>(b) * 2 * hd + col];
  s[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < 2 * hd) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) t += s[j][tx];
    if (col < hd) {
      dwq[col] += t;
    } else {
      dwk[col - hd] += t;
    }
  }
}

}  // namespace gdn::ops::attn
