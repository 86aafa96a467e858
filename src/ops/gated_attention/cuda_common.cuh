// Shared by the gated-attention CUDA kernels and their host launchers: tile sizes, shared-memory
// budgets, kernel parameter blocks, and the device helpers that map a block to its document and
// tile. See cuda.cu for the design.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/gated_attention/cuda_prims.cuh"

namespace gdn::ops::attn {

// --- tiles -----------------------------------------------------------------------------------
// Every attention kernel gives each warp 16 rows of the MMA's M dimension. Head dims are padded to
// the kernel's HD (64, 128 or 256) with zero-filled shared-memory columns; shared rows are padded
// by 8 bf16 (16 bytes), so the 8 row addresses of an ldmatrix fall in 8 different 16-byte bank
// groups (row stride = 16 mod 128 bytes) and the copies stay 16-byte aligned.
constexpr int kWarps = 8;              // every attention kernel: 8 warps, 256 threads
constexpr int kThreads = kWarps * 32;  //
constexpr int kBigTile = 16 * kWarps;  // query rows per block: forward and dq (128)
constexpr int kSmallTile = 64;         // keys per block of the dk/dv kernel, queries per step
constexpr int kFwdKeys = 64;           // keys per step of the forward
constexpr int kMaxHd = 256;            // largest head dim of the kernels
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int HD>
constexpr int ld_of() {
  return HD + 8;
}
// Keys per step of the dq kernel: 32 at HD = 256 keeps S, dP and the 16 x 256 fp32 dQ accumulator
// of a warp within 255 registers.
template <int HD>
constexpr int dq_keys() {
  return HD == 256 ? 32 : 64;
}
template <int HD>
constexpr size_t fwd_smem_bytes() {  // Q [BM][LD], K and V [2][BN][LD]
  return sizeof(bf16_t) * ld_of<HD>() * (kBigTile + 4 * kFwdKeys);
}
template <int HD>
constexpr size_t dq_smem_bytes() {  // Q, dA [BM][LD], K and V [2][BN][LD]
  return sizeof(bf16_t) * ld_of<HD>() * (2 * kBigTile + 4 * dq_keys<HD>());
}
constexpr int kLdP = kSmallTile + 8;  // row stride of the P^T / dS^T tiles of the dk/dv kernel
template <int HD>
constexpr size_t dkdv_smem_bytes() {  // K, V [BN][LD]; Q, dA [2][BM][LD]; P^T, dS^T; lse, D [2][BM]
  return sizeof(bf16_t) * (ld_of<HD>() * 6 * kSmallTile + 2 * kSmallTile * kLdP) +
         sizeof(float) * 4 * kSmallTile;
}
static_assert(fwd_smem_bytes<256>() <= 227 * 1024 && dq_smem_bytes<256>() <= 227 * 1024 &&
                  dkdv_smem_bytes<256>() <= 227 * 1024,
              "a kernel's shared memory exceeds the 227 KiB an sm_90 block may have");

// Row kernels (norm + RoPE prologue, backward preprocess and epilogue): 8 warps, one row per warp
// at a time, each lane owning 8 consecutive elements (one 16-byte access) of a row of hd <= 256.
constexpr int kRowTokens = 8;  // tokens per block of the prologue and the epilogue

// --- parameter blocks ------------------------------------------------------------------------
struct TileIndexParams {
  const int32_t* cu;  // [N+1]
  int32_t* ts_big;    // [N+1] first kBigTile-tile of each document; ts_big[N] = total
  int32_t* ts_small;  // [N+1] same for kSmallTile
  int T, N;
};

struct PrologueParams {
  const bf16_t* qg;   // [T, Hq, 2*hd]
  const bf16_t* k;    // [T, Hkv, hd]
  const bf16_t* wq;   // [hd]
  const bf16_t* wk;   // [hd]
  const int32_t* cu;  // [N+1]
  bf16_t* q_hat;      // [T, Hq, hd]
  bf16_t* k_hat;      // [T, Hkv, hd]
  float* q_rstd;      // [T, Hq]
  float* k_rstd;      // [T, Hkv]
  int T, Hq, Hkv, hd, rot, N;
  float eps;
  double theta;
};

struct FwdParams {
  const bf16_t* q_hat;  // [T, Hq, hd]
  const bf16_t* k_hat;  // [T, Hkv, hd]
  const bf16_t* v;      // [T, Hkv, hd]
  const bf16_t* qg;     // [T, Hq, 2*hd] (the gate half is read)
  const int32_t* cu;    // [N+1]
  const int32_t* ts;    // [N+1] kBigTile tile starts
  bf16_t* attn;         // [T, Hq, hd]
  bf16_t* o;            // [T, Hq, hd]
  float* lse;           // [T, Hq]
  int T, Hq, Hkv, hd, N, group;
  float scale_log2;  // hd^-1/2 · log2(e): scores in base-2 units
};

struct PreprocessParams {
  const bf16_t* qg;    // [T, Hq, 2*hd] (gate half)
  const bf16_t* d_o;   // [T, Hq, hd]
  const bf16_t* attn;  // [T, Hq, hd]
  bf16_t* dA;          // [T, Hq, hd] dA = do ⊙ σ(gate) (scratch)
  bf16_t* dqg;         // [T, Hq, 2*hd]: the gate half gets the gate gradient
  float* D;            // [T, Hq]
  int64_t rows;        // T · Hq
  int hd;
};

struct BwdParams {
  const bf16_t* q_hat;  // [T, Hq, hd]
  const bf16_t* k_hat;  // [T, Hkv, hd]
  const bf16_t* v;      // [T, Hkv, hd]
  const bf16_t* dA;     // [T, Hq, a_stride]: dA of (t, h) at dA + (t·Hq + h)·a_stride
  const float* lse;     // [T, Hq]
  const float* D;       // [T, Hq]
  const int32_t* cu;    // [N+1]
  const int32_t* ts;    // [N+1] tile starts (kBigTile for dq, kSmallTile for dk/dv)
  float* dq_hat;        // [T, Hq, hd] (dq kernel)
  float* dk_hat;        // [T, Hkv, hd] (dk/dv kernel)
  bf16_t* dv;           // [T, Hkv, hd] (dk/dv kernel)
  int T, Hq, Hkv, hd, N, group;
  int a_stride;      // elements from one head's dA row to the next: hd (scratch) or 2hd (in dqg)
  float scale;       // hd^-1/2
  float scale_log2;  // hd^-1/2 · log2(e)
};

struct EpilogueParams {
  const bf16_t* qg;     // [T, Hq, 2*hd]
  const bf16_t* k;      // [T, Hkv, hd]
  const bf16_t* wq;     // [hd]
  const bf16_t* wk;     // [hd]
  const int32_t* cu;    // [N+1]
  const float* q_rstd;  // [T, Hq]
  const float* k_rstd;  // [T, Hkv]
  const float* dq_hat;  // [T, Hq, hd]
  const float* dk_hat;  // [T, Hkv, hd]
  bf16_t* dqg;          // [T, Hq, 2*hd] (the query half is written)
  bf16_t* dk;           // [T, Hkv, hd]
  float* partial;       // [gridDim.x, 2*hd] per-block (dq_norm_w | dk_norm_w) sums
  int T, Hq, Hkv, hd, rot, N;
  double theta;
};

// --- device helpers --------------------------------------------------------------------------
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// Document n's token range [b, e), clamped into [0, T] and non-empty-or-empty (b <= e) whatever
// cu holds: device callers validate cu_seqlens when they build the batch (op.h); the kernels only
// guarantee that no value makes them read or write out of bounds.
struct Doc {
  int b, e;
};
__device__ __forceinline__ Doc doc_bounds(const int32_t* cu, int n, int T) {
  const int b = imin(imax(cu[n], 0), T);
  return {b, imin(imax(cu[n + 1], b), T)};
}

// The largest n in [0, N) with ts[n] <= tile, given ts[0] = 0 <= tile: the document of `tile`
// (documents with no tiles share their start with the next one and are skipped). Reads only
// ts[1 .. N-1] whatever the values.
__device__ __forceinline__ int find_doc(const int32_t* ts, int N, int tile) {
  int lo = 0, hi = N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (ts[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The query tile of a forward or dq block (cuda_fwd.cuh, cuda_bwd.cuh, sm90_pipe.cuh,
// sm90_tma.cuh): block -> (query head h, tile), heads fastest (the heads of a kv group run side by
// side and share K/V through L2), tiles in reverse order so the last (longest) tiles start first;
// tiles of BM queries from each document's start (p.ts: the documents' first tile numbers).
// False when the block has no tile (the grid covers the worst case; inconsistent cu_seqlens).
// j: the kv head, q0 .. q_end: the tile's queries, nk: the key tiles of BN keys in [d.b, q_end).
struct QueryTile {
  int h, j, q0, q_end, nk;
  Doc d;
};
template <int BM, int BN, class Params>
__device__ __forceinline__ bool query_tile(const Params& p, QueryTile& t) {
  t.h = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hq));
  const int rev = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hq));
  const int total = p.ts[p.N];
  if (rev >= total) return false;
  const int tile = total - 1 - rev;
  const int n = find_doc(p.ts, p.N, tile);
  t.d = doc_bounds(p.cu, n, p.T);
  const int64_t q0l = t.d.b + static_cast<int64_t>(tile - p.ts[n]) * BM;
  if (q0l >= t.d.e) return false;
  t.q0 = static_cast<int>(q0l);
  t.q_end = imin(t.q0 + BM, t.d.e);
  t.j = t.h / p.group;
  t.nk = (t.q_end - t.d.b + BN - 1) / BN;
  return true;
}

// The key tile of a dk/dv block (cuda_bwd.cuh, sm90_pipe.cuh, sm90_tma.cuh): block -> (kv head j,
// key tile), heads fastest, tiles in natural order (the first key tiles of a document, seen by
// every later query, have the longest walks and start first); tiles of BN keys from each
// document's start. False when the block has no tile. k0 .. k_end: the tile's keys; the query tiles
// (BM == BN, aligned to the document start like the key tiles) m_first .. m_first + n_m - 1 see
// them (m_first holds the key tile's own tokens), n_items = group x n_m (query head, query tile)
// items.
struct KeyTile {
  int j, k0, k_end, m_first, n_m, n_items;
  Doc d;
};
template <int BM, int BN, class Params>
__device__ __forceinline__ bool key_tile(const Params& p, KeyTile& t) {
  t.j = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.Hkv));
  const int tile = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.Hkv));
  const int total = p.ts[p.N];
  if (tile >= total) return false;
  const int n = find_doc(p.ts, p.N, tile);
  t.d = doc_bounds(p.cu, n, p.T);
  const int64_t k0l = t.d.b + static_cast<int64_t>(tile - p.ts[n]) * BN;
  if (k0l >= t.d.e) return false;
  t.k0 = static_cast<int>(k0l);
  t.k_end = imin(t.k0 + BN, t.d.e);
  t.m_first = (t.k0 - t.d.b) / BM;
  t.n_m = (t.d.e - t.d.b + BM - 1) / BM - t.m_first;
  t.n_items = p.group * t.n_m;
  return true;
}

// Position of token t in its document: t minus the start of the last document starting at or
// before t (empty documents share that start). Never negative.
__device__ __forceinline__ int position_of(const int32_t* cu, int N, int T, int t) {
  int lo = 0, hi = N;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return imax(t - imin(imax(cu[lo], 0), T), 0);
}

// ROWS x HD bf16 tile from global rows src + r·ld (r < valid_rows, columns < hd) into shared
// dst [ROWS][HD+8] with cp.async; invalid rows and the padding columns hd..HD-1 are zero-filled.
// `src` must point at an existing row (it stands in as the address of zero-filled chunks).
template <int ROWS, int HD>
__device__ __forceinline__ void load_tile_async(bf16_t* dst, const bf16_t* src, size_t ld,
                                                int valid_rows, int hd, int tid) {
  constexpr int CH = HD / 8;  // 16-byte chunks per row
  constexpr int TOTAL = ROWS * CH;
#pragma unroll
  for (int it = 0; it < (TOTAL + kThreads - 1) / kThreads; ++it) {
    const int i = it * kThreads + tid;
    if (TOTAL % kThreads == 0 || i < TOTAL) {
      const int r = i / CH, c = i % CH;
      const bool valid = r < valid_rows && c * 8 < hd;
      const bf16_t* s = valid ? src + static_cast<size_t>(r) * ld + c * 8 : src;
      cp_async_16(dst + r * ld_of<HD>() + c * 8, s, valid);
    }
  }
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// The forward kernels' epilogue (cuda_fwd.cuh, sm90_pipe.cuh, sm90_tma.cuh): this thread's two
// rows t0, t1 (m16n8 C layout: column 8 nt + 2c + (e & 1), row t0 for e < 2, t1 otherwise),
// normalised by their softmax sums, written as attn (before the gate) and o = attn * sigmoid(gate)
// for the columns < hd, and each row's lse (natural log), for the rows inside the document (t <
// q_end). acc(nt, e) reads the O accumulator.
template <int HD, class Acc>
__device__ __forceinline__ void fwd_epilogue(const FwdParams& p, const Acc& acc,
                                             const float (&m_run)[2], const float (&l_run)[2],
                                             int t0, int t1, int q_end, int h, int c) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r == 0 ? t0 : t1;
    const float l = quad_sum(l_run[r]);
    if (t >= q_end) continue;
    const float inv = 1.0f / l;
    const size_t row = static_cast<size_t>(t) * p.Hq + h;
    const bf16_t* gate = p.qg + row * 2 * p.hd + p.hd;  // [hd]
    bf16_t* at = p.attn + row * p.hd;                   // [hd]
    bf16_t* o = p.o + row * p.hd;                       // [hd]
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      const int col = nt * 8 + 2 * c;
      if (col < p.hd) {
        const float a0 = acc(nt, 2 * r) * inv, a1 = acc(nt, 2 * r + 1) * inv;
        const uint32_t gw = *reinterpret_cast<const uint32_t*>(gate + col);
        *reinterpret_cast<uint32_t*>(at + col) = pack_bf16x2(a0, a1);
        *reinterpret_cast<uint32_t*>(o + col) =
            pack_bf16x2(a0 * sigmoidf_(bf16x2_lo(gw)), a1 * sigmoidf_(bf16x2_hi(gw)));
      }
    }
    if (c == 0) p.lse[row] = (m_run[r] + log2f(l)) * kLn2;
  }
}

// The dq kernels' row statistics (cuda_bwd.cuh, sm90_pipe.cuh, sm90_tma.cuh): lse in base-2
// units and D of this thread's rows t0, t1 of head h; a row past the document (t >= q_end) gets
// lse +inf (its probabilities are 0) and D 0, reading no memory past the document's rows.
__device__ __forceinline__ void dq_row_stats(const BwdParams& p, int t0, int t1, int q0, int q_end,
                                             int h, float (&lse2)[2], float (&Dr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r == 0 ? t0 : t1;
    const bool ok = t < q_end;
    const size_t row = static_cast<size_t>(ok ? t : q0) * p.Hq + h;
    lse2[r] = ok ? p.lse[row] * kLog2e : INFINITY;
    Dr[r] = ok ? p.D[row] : 0.f;
  }
}

// The dq kernels' epilogue (cuda_bwd.cuh, sm90_pipe.cuh, sm90_tma.cuh): dq_hat = scale · dQ for
// this thread's two rows t0, t1 inside the document (t < q_end), fp32, columns < hd; acc(nt, e)
// reads the dQ accumulator (m16n8 C layout, as in fwd_epilogue).
template <int HD, class Acc>
__device__ __forceinline__ void dq_epilogue(const BwdParams& p, const Acc& acc, int t0, int t1,
                                            int q_end, int h, int c) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r == 0 ? t0 : t1;
    if (t >= q_end) continue;
    float* out = p.dq_hat + (static_cast<size_t>(t) * p.Hq + h) * p.hd;  // [hd]
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      const int col = nt * 8 + 2 * c;
      if (col < p.hd)
        *reinterpret_cast<float2*>(out + col) =
            make_float2(acc(nt, 2 * r) * p.scale, acc(nt, 2 * r + 1) * p.scale);
    }
  }
}

}  // namespace gdn::ops::attn
