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

// cos/sin of the rotary angles of the block's tokens t0 .. t0 + kRowTokens − 1 into cs, sn
// [kRowTokens][rot/2]: θ_i = pos · theta^(−2i/rot), formed in fp64 and rounded once (as ref and
// cpu). Every (token, i) pair on its own thread, all at once, so that the fp64 latency is paid once
// per block and not once per token behind a barrier. Called by every thread of the block; ends
// with a barrier.
__device__ __forceinline__ void rope_angles_block(const int32_t* cu, int N, int T, int t0, int rot,
                                                  double theta, float (*cs)[kMaxHd / 2],
                                                  float (*sn)[kMaxHd / 2]) {
  const int half = rot / 2;
  for (int idx = static_cast<int>(threadIdx.x); idx < kRowTokens * half; idx += kThreads) {
    const int tk = idx / half, i = idx - tk * half, t = t0 + tk;
    if (t < T) {
      const int pos = position_of(cu, N, T, t);
      const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
      double s, c;
      sincos(static_cast<double>(pos) * inv_freq, &s, &c);
      cs[tk][i] = static_cast<float>(c);
      sn[tk][i] = static_cast<float>(s);
    }
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

// Rows of a row-kernel block: its kRowTokens tokens' Hq query and Hkv key rows, numbered
// idx = tk · (Hq + Hkv) + r (r < Hq: query head r, else key head r − Hq), dealt to the warps
// round-robin (warp w: idx = w, w + 8, ...) and taken kRowPair at a time so that a warp has the
// loads of two rows in flight.
constexpr int kRowPair = 2;
struct RowAt {
  int tk;      // token of the block
  bool is_q;   // query row (else key row)
  size_t row;  // t · Hq + h or t · Hkv + j
};
__device__ __forceinline__ RowAt row_at(int idx, int t0, int Hq, int Hkv) {
  const int H = Hq + Hkv, tk = idx / H, r = idx - tk * H, t = t0 + tk;
  const bool is_q = r < Hq;
  return {tk, is_q,
          is_q ? static_cast<size_t>(t) * Hq + r : static_cast<size_t>(t) * Hkv + (r - Hq)};
}

// Forward prologue: q_hat, k_hat, q_rstd, k_rstd for kRowTokens tokens per block.
__global__ void __launch_bounds__(kThreads, 4) attn_prologue_kernel(const PrologueParams p) {
  __shared__ float cs[kRowTokens][kMaxHd / 2], sn[kRowTokens][kMaxHd / 2];
  __shared__ float bufs[kWarps][kMaxHd];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const bool act = lane * 8 < p.hd;
  float* buf = bufs[warp];
  const int t0 = static_cast<int>(blockIdx.x) * kRowTokens;
  rope_angles_block(p.cu, p.N, p.T, t0, p.rot, p.theta, cs, sn);
  const int half = p.rot / 2;
  const int n_rows = imin(kRowTokens, p.T - t0) * (p.Hq + p.Hkv);
  for (int i0 = warp; i0 < n_rows; i0 += kRowPair * kWarps) {
    RowAt at[kRowPair];
    float u[kRowPair][8];
#pragma unroll
    for (int k = 0; k < kRowPair; ++k) {  // both rows' loads first
      const int idx = i0 + k * kWarps;
      at[k] = row_at(idx < n_rows ? idx : i0, t0, p.Hq, p.Hkv);
      const bf16_t* x = at[k].is_q ? p.qg + at[k].row * 2 * p.hd : p.k + at[k].row * p.hd;  // [hd]
      load8(x, lane, act && idx < n_rows, u[k]);
    }
#pragma unroll
    for (int k = 0; k < kRowPair; ++k) {
      if (i0 + k * kWarps >= n_rows) break;  // uniform over the warp
      const bool is_q = at[k].is_q;
      float ss = 0.f;
#pragma unroll
      for (int v = 0; v < 8; ++v) ss += u[k][v] * u[k][v];
      ss = warp_sum(ss);
      const float rs = 1.0f / sqrtf(ss / static_cast<float>(p.hd) + p.eps);
      float w[8];  // 1 + w in fp32 (in bf16, 1 + 0.0039 would round to 1); L1-resident
      load8(is_q ? p.wq : p.wk, lane, act, w);
#pragma unroll
      for (int v = 0; v < 8; ++v) u[k][v] = u[k][v] * rs * (w[v] + 1.0f);
      rope_row(u[k], lane, act, half, 1.0f, cs[at[k].tk], sn[at[k].tk], buf);
      if (act) store8((is_q ? p.q_hat : p.k_hat) + at[k].row * p.hd, lane, u[k]);
      if (lane == 0) (is_q ? p.q_rstd : p.k_rstd)[at[k].row] = rs;
    }
  }
}

// Backward preprocess, one warp per (t, h) row: dA = do ⊙ σ(gate) rounded to bf16 into the dA
// scratch, D = Σ dA ⊙ attn over the rounded dA (the same operand the dP = dA Vᵀ products see), and
// the gate gradient do ⊙ attn ⊙ σ(gate) σ(−gate) into the gate half of dqg (done here, where do,
// attn and gate are read anyway, instead of in the epilogue, which would read them again).
__global__ void __launch_bounds__(kThreads) attn_bwd_preprocess_kernel(const PreprocessParams p) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (row >= p.rows) return;  // uniform over the warp; no block barrier follows
  const bool act = lane * 8 < p.hd;
  const size_t r = static_cast<size_t>(row);
  float gate[8], dout[8], at[8], da[8], dg[8];
  load8(p.qg + r * 2 * p.hd + p.hd, lane, act, gate);
  load8(p.d_o + r * p.hd, lane, act, dout);
  load8(p.attn + r * p.hd, lane, act, at);
  float s = 0.f;
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    da[v] = dout[v] * sigmoidf_(gate[v]);
    da[v] = bf16x2_lo(pack_bf16x2(da[v], 0.f));  // the stored (rounded) value
    s += da[v] * at[v];
    // σ'(x) = σ(x) σ(−x): no cancellation in 1 − σ(x)
    dg[v] = dout[v] * at[v] * sigmoidf_(gate[v]) * sigmoidf_(-gate[v]);
  }
  s = warp_sum(s);
  if (act) {
    store8(p.dA + r * p.hd, lane, da);
    store8(p.dqg + r * 2 * p.hd + p.hd, lane, dg);
  }
  if (lane == 0) p.D[r] = s;
}

// Backward epilogue, kRowTokens tokens per block, rows dealt as in the prologue. Query rows:
// dq_hat rotated back by −θ, through the zero-centred RMSNorm (dx = r ((1+w) g − x̂ ·
// mean((1+w) g x̂))) into the query half of dqg; key rows likewise from dk_hat into dk. The weight
// gradients g ⊙ x̂ are summed per warp (a lane owns the same 8 columns in every row), then over
// the warps in warp order, and written as this block's partial row.
__global__ void __launch_bounds__(kThreads, 4) attn_bwd_epilogue_kernel(const EpilogueParams p) {
  __shared__ float cs[kRowTokens][kMaxHd / 2], sn[kRowTokens][kMaxHd / 2];
  __shared__ float bufs[kWarps][kMaxHd];
  __shared__ float red[kWarps][2 * kMaxHd];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const bool act = lane * 8 < p.hd;
  float* buf = bufs[warp];
  // This warp's weight-gradient sums (query columns, then key columns), lane-owned columns: kept
  // in shared memory rather than in 16 registers, which the two rows in flight need.
  float* acc = red[warp];  // [2*hd]
  if (act) {
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[lane * 8 + v] = acc[p.hd + lane * 8 + v] = 0.f;
  }
  const int t0 = static_cast<int>(blockIdx.x) * kRowTokens;
  rope_angles_block(p.cu, p.N, p.T, t0, p.rot, p.theta, cs, sn);
  const int half = p.rot / 2;
  const int n_rows = imax(imin(kRowTokens, p.T - t0), 0) * (p.Hq + p.Hkv);
  for (int i0 = warp; i0 < n_rows; i0 += kRowPair * kWarps) {
    RowAt at[kRowPair];
    float g[kRowPair][8], x[kRowPair][8], rs[kRowPair];
#pragma unroll
    for (int k = 0; k < kRowPair; ++k) {  // every load of both rows first
      const int idx = i0 + k * kWarps;
      const bool ok = idx < n_rows;
      at[k] = row_at(ok ? idx : i0, t0, p.Hq, p.Hkv);
      const size_t row = at[k].row;
      load8f((at[k].is_q ? p.dq_hat : p.dk_hat) + row * p.hd, lane, act && ok, g[k]);
      load8(at[k].is_q ? p.qg + row * 2 * p.hd : p.k + row * p.hd, lane, act && ok, x[k]);
      rs[k] = (at[k].is_q ? p.q_rstd : p.k_rstd)[row];
    }
#pragma unroll
    for (int k = 0; k < kRowPair; ++k) {
      if (i0 + k * kWarps >= n_rows) break;  // uniform over the warp
      const bool is_q = at[k].is_q;
      const size_t row = at[k].row;
      rope_row(g[k], lane, act, half, -1.0f, cs[at[k].tk], sn[at[k].tk], buf);
      float gw[8];  // 1 + w in fp32; L1-resident
      load8(is_q ? p.wq : p.wk, lane, act, gw);
#pragma unroll
      for (int v = 0; v < 8; ++v) gw[v] += 1.0f;
      float dot = 0.f;
#pragma unroll
      for (int v = 0; v < 8; ++v) dot += g[k][v] * gw[v] * x[k][v];
      const float m = warp_sum(dot) * rs[k] / static_cast<float>(p.hd);
      float dx[8];
      float* a = acc + (is_q ? 0 : p.hd) + lane * 8;
#pragma unroll
      for (int v = 0; v < 8; ++v) {
        const float xh = x[k][v] * rs[k];
        dx[v] = rs[k] * (g[k][v] * gw[v] - xh * m);
        if (act) a[v] += g[k][v] * xh;
      }
      if (act) store8(is_q ? p.dqg + row * 2 * p.hd : p.dk + row * p.hd, lane, dx);
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

// dwq[c] += Σ_b partial[b][c], dwk[c] += Σ_b partial[b][hd + c], b in a fixed order: kDwSlices
// slices of b per column (each in increasing b), then the slice sums in slice order. Block: 8
// columns x 32 slices (a warp reads 4 rows x 32 bytes), so that the 2hd / 8 blocks keep enough
// loads in flight (32 columns x 8 slices took 16 us at T = 8192, hd = 256; this 8).
constexpr int kDwCols = 8, kDwSlices = 32;
__global__ void __launch_bounds__(kDwCols* kDwSlices)
    attn_dw_reduce_kernel(const float* partial,  // [P, 2*hd]
                          float* dwq,            // [hd]
                          float* dwk,            // [hd]
                          int P, int hd) {
  __shared__ float s[kDwSlices][kDwCols + 1];
  const int tx = static_cast<int>(threadIdx.x) % kDwCols;
  const int ty = static_cast<int>(threadIdx.x) / kDwCols;
  const int col = static_cast<int>(blockIdx.x) * kDwCols + tx;
  float acc = 0.f;
  if (col < 2 * hd)
    for (int b = ty; b < P; b += kDwSlices) acc += partial[static_cast<size_t>(b) * 2 * hd + col];
  s[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < 2 * hd) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < kDwSlices; ++j) t += s[j][tx];
    if (col < hd) {
      dwq[col] += t;
    } else {
      dwk[col - hd] += t;
    }
  }
}

}  // namespace gdn::ops::attn
