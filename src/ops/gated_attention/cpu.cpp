// Gated attention on the CPU: fp32, OpenMP, OpenBLAS tile GEMMs.
//
// Forward: norms + RoPE token-parallel, then FlashAttention-style blocked online softmax (Dao et
// al., "FlashAttention", 2022, Algorithm 1; FlashAttention-2, 2023, Algorithm 1): one work item per
// (document, query head, block of kBq queries) walks the causal key blocks of its document keeping
// a running row max m, row sum l and an unnormalized accumulator, so memory stays O(T · hd).
// Backward (FlashAttention-2, Algorithm 2, split in two passes to avoid atomics): the probabilities
// are recomputed tile by tile from q_hat, k_hat and lse. Pass A, one item per (document, kv head,
// key block), accumulates dk_hat and dv over every query of the kv head's group; pass B, one item
// per (document, query head, query block), accumulates dq_hat. Each output row is written by one
// item, so the result does not depend on the schedule. Pass C maps dq_hat / dk_hat back through
// RoPE and the norms in place and writes the gate gradient.
// Tiles are GEMMs on strided views of the [T, H, hd] tensors (lda = H · hd), called from inside
// OpenMP regions, so each runs on the calling thread (cpu::gemm, backend/cpu/blas.h).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/blas.h"
#include "gdn/backend/registry.h"
#include "ops/gated_attention/op.h"

namespace gdn::ops {

namespace {

constexpr int64_t kBq = 64;  // queries per tile
constexpr int64_t kBk = 64;  // keys per tile

struct Geo {
  int64_t T, Hq, Hkv, hd, rot, group, N;
  int64_t ldq() const { return Hq * hd; }       // row stride of q_hat / attn / o / do
  int64_t ldkv() const { return Hkv * hd; }     // row stride of k_hat / v / dk / dv
  int64_t ldqg() const { return Hq * 2 * hd; }  // row stride of qg / dqg
};

Geo geo_of(const Tensor& qg, const Tensor& k, const Tensor& cu, int64_t rot) {
  Geo g{qg.size(0), qg.size(1), k.size(1), k.size(2), rot, 0, cu.size(0) - 1};
  g.group = g.Hq / g.Hkv;
  return g;
}

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline size_t sz(int64_t n) { return static_cast<size_t>(n); }

// Per-token position in its document, and cos/sin of every (position, frequency) pair the batch
// uses: [max_len, rot/2] each, angles formed in fp64 and rounded once.
struct Rope {
  std::vector<int32_t> pos;     // [T]
  std::vector<float> cos, sin;  // [max_len, half]
  int64_t half = 0;
  const float* c(int64_t t) const { return cos.data() + sz(pos[sz(t)] * half); }
  const float* s(int64_t t) const { return sin.data() + sz(pos[sz(t)] * half); }
};

Rope make_rope(const Tensor& cu_t, int64_t T, int64_t rot, double theta) {
  const int32_t* cu = cu_t.ptr<int32_t>();  // [N+1]
  Rope r;
  r.half = rot / 2;
  r.pos.resize(sz(T));
  int64_t max_len = 0;
  for (int64_t n = 0; n + 1 < cu_t.size(0); ++n) {
    max_len = std::max<int64_t>(max_len, cu[n + 1] - cu[n]);
    for (int64_t t = cu[n]; t < cu[n + 1]; ++t) r.pos[sz(t)] = static_cast<int32_t>(t - cu[n]);
  }
  r.cos.resize(sz(max_len * r.half));
  r.sin.resize(sz(max_len * r.half));
  for (int64_t i = 0; i < r.half; ++i) {
    const double inv_freq =
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
    for (int64_t p = 0; p < max_len; ++p) {
      const double ang = static_cast<double>(p) * inv_freq;
      r.cos[sz(p * r.half + i)] = static_cast<float>(std::cos(ang));
      r.sin[sz(p * r.half + i)] = static_cast<float>(std::sin(ang));
    }
  }
  return r;
}

// y = rope(x · r · (1 + w)); returns r = 1/rms(x). x, y, w: [hd]; c, s: [half] (this position).
float norm_rope_row(const float* x, const float* w, int64_t hd, int64_t half, const float* c,
                    const float* s, float eps, float* y) {
  float ss = 0;
  for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(hd) + eps);
  for (int64_t i = 0; i < hd; ++i) y[i] = x[i] * r * (1.0f + w[i]);
  for (int64_t i = 0; i < half; ++i) {
    const float a = y[i], b = y[i + half];
    y[i] = a * c[i] - b * s[i];
    y[i + half] = b * c[i] + a * s[i];
  }
  return r;
}

// x, w, g, dw: [hd]; c, s: [half]. In place: g holds dL/dy on entry and dL/dx on exit; dw += dL/dw.
// RoPE is a rotation, so its backward rotates by −θ; then the zero-centred RMSNorm backward (see
// ops/rmsnorm/op.h).
void norm_rope_row_backward(const float* x, const float* w, float r, int64_t hd, int64_t half,
                            const float* c, const float* s, float* g, float* dw) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = g[i], b = g[i + half];
    g[i] = a * c[i] + b * s[i];
    g[i + half] = b * c[i] - a * s[i];
  }
  float dot = 0;
  for (int64_t i = 0; i < hd; ++i) dot += g[i] * (1.0f + w[i]) * x[i];
  dot = dot * r / static_cast<float>(hd);
  for (int64_t i = 0; i < hd; ++i) {
    const float xhat = x[i] * r;
    dw[i] += g[i] * xhat;
    g[i] = r * (g[i] * (1.0f + w[i]) - xhat * dot);
  }
}

// One block of rows [r0, r1) of document [b, e) for head `h`; `work` orders the items so that the
// longest start first under the dynamic schedule.
struct Item {
  int64_t b, e, h, r0, r1, work;
};

// Query-block items of every (document, query head): causal work grows with the block's end.
std::vector<Item> query_items(const int32_t* cu, const Geo& g) {
  std::vector<Item> items;
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t h = 0; h < g.Hq; ++h)
      for (int64_t q0 = cu[n]; q0 < cu[n + 1]; q0 += kBq) {
        const int64_t q1 = std::min<int64_t>(q0 + kBq, cu[n + 1]);
        items.push_back({cu[n], cu[n + 1], h, q0, q1, q1 - cu[n]});
      }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.work > y.work; });
  return items;
}

// Key-block items of every (document, kv head): every later query of the group reads the block.
std::vector<Item> key_items(const int32_t* cu, const Geo& g) {
  std::vector<Item> items;
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t j = 0; j < g.Hkv; ++j)
      for (int64_t k0 = cu[n]; k0 < cu[n + 1]; k0 += kBk) {
        const int64_t k1 = std::min<int64_t>(k0 + kBk, cu[n + 1]);
        items.push_back({cu[n], cu[n + 1], j, k0, k1, cu[n + 1] - k0});
      }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.work > y.work; });
  return items;
}

// Number of keys of block [k0, k0 + bk) that query t may see (causal): clamp(t − k0 + 1, 0, bk).
inline int64_t visible(int64_t t, int64_t k0, int64_t bk) {
  return std::clamp<int64_t>(t - k0 + 1, 0, bk);
}

void forward(const GatedAttentionFwd& a) {
  const Geo g = geo_of(a.qg, a.k, a.cu_seqlens, a.rotary_dim);
  const float* qg = a.qg.ptr<float>();              // [T, Hq, 2*hd]
  const float* k = a.k.ptr<float>();                // [T, Hkv, hd]
  const float* v = a.v.ptr<float>();                // [T, Hkv, hd]
  const float* wq = a.q_norm_w.ptr<float>();        // [hd]
  const float* wk = a.k_norm_w.ptr<float>();        // [hd]
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();  // [N+1]
  float* o = a.o.ptr<float>();                      // [T, Hq, hd]
  float* qh = a.q_hat.ptr<float>();                 // [T, Hq, hd]
  float* kh = a.k_hat.ptr<float>();                 // [T, Hkv, hd]
  float* attn = a.attn.ptr<float>();                // [T, Hq, hd]
  float* lse = a.lse.ptr<float>();                  // [T, Hq]
  float* qr = a.q_rstd.ptr<float>();                // [T, Hq]
  float* kr = a.k_rstd.ptr<float>();                // [T, Hkv]
  const int64_t hd = g.hd;
  const float eps = static_cast<float>(a.eps);
  const Rope rope = make_rope(a.cu_seqlens, g.T, g.rot, a.rope_theta);

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < g.T; ++t) {
    for (int64_t h = 0; h < g.Hq; ++h)
      qr[t * g.Hq + h] = norm_rope_row(qg + (t * g.Hq + h) * 2 * hd, wq, hd, rope.half, rope.c(t),
                                       rope.s(t), eps, qh + (t * g.Hq + h) * hd);
    for (int64_t j = 0; j < g.Hkv; ++j)
      kr[t * g.Hkv + j] = norm_rope_row(k + (t * g.Hkv + j) * hd, wk, hd, rope.half, rope.c(t),
                                        rope.s(t), eps, kh + (t * g.Hkv + j) * hd);
  }

  const std::vector<Item> items = query_items(cu, g);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    std::vector<float> S(sz(kBq * kBk));   // [kBq, kBk] scores, then probabilities
    std::vector<float> acc(sz(kBq * hd));  // [kBq, hd] unnormalized output
    std::vector<float> m(sz(kBq)), l(sz(kBq));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[sz(it)];
      const int64_t h = w.h, j = h / g.group, q0 = w.r0, q1 = w.r1, bq = q1 - q0;
      const float* Q = qh + (q0 * g.Hq + h) * hd;  // [bq, hd] rows strided by ldq
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.begin() + bq * hd, 0.0f);
      for (int64_t k0 = w.b; k0 < q1; k0 += kBk) {
        const int64_t bk = std::min(kBk, q1 - k0);
        const float* K = kh + (k0 * g.Hkv + j) * hd;  // [bk, hd] strided by ldkv
        const float* V = v + (k0 * g.Hkv + j) * hd;   // [bk, hd] strided by ldkv
        cpu::gemm(false, true, bq, bk, hd, scale, Q, g.ldq(), K, g.ldkv(), 0.0f, S.data(), kBk);
        for (int64_t i = 0; i < bq; ++i) {
          float* srow = S.data() + i * kBk;  // [bk]
          const int64_t nv = visible(q0 + i, k0, bk);
          if (nv == 0) {
            std::fill(srow, srow + bk, 0.0f);
            continue;
          }
          float mx = m[sz(i)];
          for (int64_t c = 0; c < nv; ++c) mx = std::max(mx, srow[c]);
          // Rescale the running sum and accumulator to the new max (exp(−inf) = 0 on the first
          // visible block, when both are still zero).
          const float alpha = std::exp(m[sz(i)] - mx);
          float sum = 0;
          for (int64_t c = 0; c < nv; ++c) sum += (srow[c] = std::exp(srow[c] - mx));
          std::fill(srow + nv, srow + bk, 0.0f);
          l[sz(i)] = l[sz(i)] * alpha + sum;
          m[sz(i)] = mx;
          if (alpha != 1.0f)
            for (int64_t c = 0; c < hd; ++c) acc[sz(i * hd + c)] *= alpha;
        }
        cpu::gemm(false, false, bq, hd, bk, 1.0f, S.data(), kBk, V, g.ldkv(), 1.0f, acc.data(), hd);
      }
      // Every row saw at least its own key, so l >= 1.
      for (int64_t i = 0; i < bq; ++i) {
        const int64_t t = q0 + i;
        const float inv = 1.0f / l[sz(i)];
        float* at = attn + (t * g.Hq + h) * hd;                 // [hd]
        float* ot = o + (t * g.Hq + h) * hd;                    // [hd]
        const float* gate = qg + (t * g.Hq + h) * 2 * hd + hd;  // [hd]
        for (int64_t c = 0; c < hd; ++c) {
          at[c] = acc[sz(i * hd + c)] * inv;
          ot[c] = at[c] * sigmoidf(gate[c]);
        }
        lse[t * g.Hq + h] = m[sz(i)] + std::log(l[sz(i)]);
      }
    }
  }
}

// Tile of P = exp(scale · Q Kᵀ − lse) (causal-masked) for queries [q0, q0 + bq) of head h and keys
// [k0, k0 + bk): written into P [bq, kBk].
void probs_tile(const Geo& g, const float* qh, const float* kh, const float* lse, int64_t h,
                int64_t q0, int64_t bq, int64_t k0, int64_t bk, float scale, float* P) {
  const int64_t hd = g.hd, j = h / g.group;
  const float* Q = qh + (q0 * g.Hq + h) * hd;   // [bq, hd] strided by ldq
  const float* K = kh + (k0 * g.Hkv + j) * hd;  // [bk, hd] strided by ldkv
  cpu::gemm(false, true, bq, bk, hd, scale, Q, g.ldq(), K, g.ldkv(), 0.0f, P, kBk);
  for (int64_t i = 0; i < bq; ++i) {
    float* prow = P + i * kBk;  // [bk]
    const int64_t nv = visible(q0 + i, k0, bk);
    const float L = lse[(q0 + i) * g.Hq + h];
    for (int64_t c = 0; c < nv; ++c) prow[c] = std::exp(prow[c] - L);
    std::fill(prow + nv, prow + bk, 0.0f);
  }
}

// dP = dA Vᵀ for the tile, then dS = scale · P ∘ (dP − D) in place of dP.
void dscores_tile(const Geo& g, const float* dA, const float* v, const float* D, const float* P,
                  int64_t h, int64_t q0, int64_t bq, int64_t k0, int64_t bk, float scale,
                  float* dS) {
  const int64_t hd = g.hd, j = h / g.group;
  const float* V = v + (k0 * g.Hkv + j) * hd;  // [bk, hd] strided by ldkv
  cpu::gemm(false, true, bq, bk, hd, 1.0f, dA, g.ldqg(), V, g.ldkv(), 0.0f, dS, kBk);
  for (int64_t i = 0; i < bq; ++i) {
    const float Di = D[(q0 + i) * g.Hq + h];
    for (int64_t c = 0; c < bk; ++c)
      dS[i * kBk + c] = scale * P[i * kBk + c] * (dS[i * kBk + c] - Di);
  }
}

void backward(const GatedAttentionBwd& a) {
  const Geo g = geo_of(a.qg, a.k, a.cu_seqlens, a.rotary_dim);
  const float* qg = a.qg.ptr<float>();              // [T, Hq, 2*hd]
  const float* k = a.k.ptr<float>();                // [T, Hkv, hd]
  const float* v = a.v.ptr<float>();                // [T, Hkv, hd]
  const float* wq = a.q_norm_w.ptr<float>();        // [hd]
  const float* wk = a.k_norm_w.ptr<float>();        // [hd]
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();  // [N+1]
  const float* qh = a.q_hat.ptr<float>();           // [T, Hq, hd]
  const float* kh = a.k_hat.ptr<float>();           // [T, Hkv, hd]
  const float* attn = a.attn.ptr<float>();          // [T, Hq, hd]
  const float* lse = a.lse.ptr<float>();            // [T, Hq]
  const float* qr = a.q_rstd.ptr<float>();          // [T, Hq]
  const float* kr = a.k_rstd.ptr<float>();          // [T, Hkv]
  const float* dout = a.d_o.ptr<float>();           // [T, Hq, hd]
  float* dqg = a.dqg.ptr<float>();                  // [T, Hq, 2*hd]
  float* dk = a.dk.ptr<float>();                    // [T, Hkv, hd]
  float* dv = a.dv.ptr<float>();                    // [T, Hkv, hd]
  float* dwq = a.dq_norm_w.ptr<float>();            // [hd]
  float* dwk = a.dk_norm_w.ptr<float>();            // [hd]
  const int64_t hd = g.hd;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const Rope rope = make_rope(a.cu_seqlens, g.T, g.rot, a.rope_theta);

  // Pass 0: dA = do ∘ σ(gate), the gradient of attn, parked in the gate half of dqg (pass C
  // overwrites it with the gate gradient once passes A and B have read it); D = rowsum(dA ∘ attn).
  std::vector<float> D(sz(g.T * g.Hq));  // [T, Hq]
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < g.T; ++t)
    for (int64_t h = 0; h < g.Hq; ++h) {
      const float* gate = qg + (t * g.Hq + h) * 2 * hd + hd;  // [hd]
      const float* dot = dout + (t * g.Hq + h) * hd;          // [hd]
      const float* at = attn + (t * g.Hq + h) * hd;           // [hd]
      float* dA = dqg + (t * g.Hq + h) * 2 * hd + hd;         // [hd]
      float s = 0;
      for (int64_t c = 0; c < hd; ++c) {
        dA[c] = dot[c] * sigmoidf(gate[c]);
        s += dA[c] * at[c];
      }
      D[sz(t * g.Hq + h)] = s;
    }
  const float* dA_all = dqg + hd;  // [T, Hq, hd] rows strided by ldqg

  // Pass A: dk_hat (into dk) and dv, one item per (document, kv head, key block).
  {
    const std::vector<Item> items = key_items(cu, g);
    const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel
    {
      std::vector<float> P(sz(kBq * kBk)), dS(sz(kBq * kBk));  // [kBq, kBk]
      std::vector<float> dK(sz(kBk * hd)), dV(sz(kBk * hd));   // [kBk, hd]
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n_items; ++it) {
        const Item& w = items[sz(it)];
        const int64_t j = w.h, k0 = w.r0, bk = w.r1 - w.r0;
        std::fill(dK.begin(), dK.end(), 0.0f);
        std::fill(dV.begin(), dV.end(), 0.0f);
        // The first query block that can see key k0.
        const int64_t first_q0 = w.b + (k0 - w.b) / kBq * kBq;
        for (int64_t h = j * g.group; h < (j + 1) * g.group; ++h)
          for (int64_t q0 = first_q0; q0 < w.e; q0 += kBq) {
            const int64_t bq = std::min(kBq, w.e - q0);
            const float* Q = qh + (q0 * g.Hq + h) * hd;           // [bq, hd] strided by ldq
            const float* dA = dA_all + (q0 * g.Hq + h) * 2 * hd;  // [bq, hd] strided by ldqg
            probs_tile(g, qh, kh, lse, h, q0, bq, k0, bk, scale, P.data());
            cpu::gemm(true, false, bk, hd, bq, 1.0f, P.data(), kBk, dA, g.ldqg(), 1.0f, dV.data(),
                      hd);
            dscores_tile(g, dA, v, D.data(), P.data(), h, q0, bq, k0, bk, scale, dS.data());
            cpu::gemm(true, false, bk, hd, bq, 1.0f, dS.data(), kBk, Q, g.ldq(), 1.0f, dK.data(),
                      hd);
          }
        for (int64_t r = 0; r < bk; ++r) {
          std::copy_n(dK.data() + r * hd, hd, dk + ((k0 + r) * g.Hkv + j) * hd);
          std::copy_n(dV.data() + r * hd, hd, dv + ((k0 + r) * g.Hkv + j) * hd);
        }
      }
    }
  }

  // Pass B: dq_hat into the query half of dqg, one item per (document, query head, query block).
  {
    const std::vector<Item> items = query_items(cu, g);
    const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel
    {
      std::vector<float> P(sz(kBq * kBk)), dS(sz(kBq * kBk));  // [kBq, kBk]
      std::vector<float> dQ(sz(kBq * hd));                     // [kBq, hd]
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n_items; ++it) {
        const Item& w = items[sz(it)];
        const int64_t h = w.h, j = h / g.group, q0 = w.r0, q1 = w.r1, bq = q1 - q0;
        const float* dA = dA_all + (q0 * g.Hq + h) * 2 * hd;  // [bq, hd] strided by ldqg
        std::fill(dQ.begin(), dQ.end(), 0.0f);
        for (int64_t k0 = w.b; k0 < q1; k0 += kBk) {
          const int64_t bk = std::min(kBk, q1 - k0);
          const float* K = kh + (k0 * g.Hkv + j) * hd;  // [bk, hd] strided by ldkv
          probs_tile(g, qh, kh, lse, h, q0, bq, k0, bk, scale, P.data());
          dscores_tile(g, dA, v, D.data(), P.data(), h, q0, bq, k0, bk, scale, dS.data());
          cpu::gemm(false, false, bq, hd, bk, 1.0f, dS.data(), kBk, K, g.ldkv(), 1.0f, dQ.data(),
                    hd);
        }
        for (int64_t i = 0; i < bq; ++i)
          std::copy_n(dQ.data() + i * hd, hd, dqg + ((q0 + i) * g.Hq + h) * 2 * hd);
      }
    }
  }

  // Pass C: through RoPE and the norms in place; the gate gradient replaces dA. The weight
  // gradients are summed per thread, then over threads in order (deterministic).
  const int nt = omp_get_max_threads();
  std::vector<float> pq(sz(nt * hd), 0.0f), pk(sz(nt * hd), 0.0f);  // [nt, hd]
#pragma omp parallel num_threads(nt)
  {
    float* my_q = pq.data() + sz(omp_get_thread_num() * hd);  // [hd]
    float* my_k = pk.data() + sz(omp_get_thread_num() * hd);  // [hd]
#pragma omp for schedule(static)
    for (int64_t t = 0; t < g.T; ++t) {
      for (int64_t h = 0; h < g.Hq; ++h) {
        const float* x = qg + (t * g.Hq + h) * 2 * hd;  // [2*hd] query | gate
        const float* at = attn + (t * g.Hq + h) * hd;   // [hd]
        const float* dot = dout + (t * g.Hq + h) * hd;  // [hd]
        float* dx = dqg + (t * g.Hq + h) * 2 * hd;      // [2*hd]
        norm_rope_row_backward(x, wq, qr[t * g.Hq + h], hd, rope.half, rope.c(t), rope.s(t), dx,
                               my_q);
        // σ'(x) = σ(x) σ(−x): no cancellation in 1 − σ(x) for large x.
        for (int64_t c = 0; c < hd; ++c)
          dx[hd + c] = dot[c] * at[c] * sigmoidf(x[hd + c]) * sigmoidf(-x[hd + c]);
      }
      for (int64_t j = 0; j < g.Hkv; ++j)
        norm_rope_row_backward(k + (t * g.Hkv + j) * hd, wk, kr[t * g.Hkv + j], hd, rope.half,
                               rope.c(t), rope.s(t), dk + (t * g.Hkv + j) * hd, my_k);
    }
  }
  for (int t = 0; t < nt; ++t)
    for (int64_t c = 0; c < hd; ++c) {
      dwq[c] += pq[sz(t * hd + c)];
      dwk[c] += pk[sz(t * hd + c)];
    }
}

const GatedAttentionTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gated_attention_cpu) {
  Registry::global().add_impl({"gated_attention", "cpu.flash", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
