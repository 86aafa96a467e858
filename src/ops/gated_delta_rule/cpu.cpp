// Gated delta rule on the CPU: the chunked WY/UT algorithm (gdn_spec.md §3; the chunk maths of FLA
// fla/ops/gated_delta_rule/chunk.py, wy_fast.py, fla/ops/common/chunk_delta_h.py, chunk_o.py and
// chunk_scaled_dot_kkt.py, re-derived here in our notation): fp32 (only the gate exponents are
// summed in fp64), OpenBLAS for every matrix product, OpenMP over (document, value head) pairs.
//
// Per chunk of L <= C rows (local index i, gamma_i the inclusive chunk-local cumsum of g,
// G_i = e^{gamma_i}, dec_i = e^{gamma_last - gamma_i}, D_ij = e^{gamma_i - gamma_j} for j <= i;
// every gate is formed from its own sum of g's in fp64, see chunk_prepare):
//   M  = tril_{-1}(diag(beta) (K K^T) .* D)       T = (I + M)^{-1}          (unit lower, strsm)
//   W  = T diag(beta G) K      U = T diag(beta) V  V' = U - W S0             (V' = the deltas)
//   O  = s (diag(G) Q S0 + (Q K^T .* D .* [j <= i]) V')
//   S1 = G_last S0 + (diag(dec) K)^T V'
// Backward (dS = gradient of the chunk-END state, dO given), in reverse chunk order:
//   dV' = diag(dec) K dS + s P^T dO                      (P the masked, gated score matrix)
//   dP  = s dO V'^T on j <= i;  dQ += (dP .* D) K;  dK += (dP .* D)^T Q;  dgamma_i += dP_ij P_ij,
//         dgamma_j -= dP_ij P_ij
//   dQ += s diag(G) dO S0^T (and dgamma_i += q_i . that);  dK += diag(dec) V' dS^T, whose gate
//         derivative moves from dgamma_i to dgamma_last; dgamma_last += G_last <S0, dS>
//   dS0 = G_last dS + s (diag(G) Q)^T dO - W^T dV';  dW = -dV' S0^T;  dU = dV'
//   dT = dU (beta V)^T + dW (beta G K)^T; d(beta V) = T^T dU; d(beta G K) = T^T dW
//   through the inverse: dM = -T^T tril_{-1}(dT) T^T on i > j, then into beta, K and gamma
//   dg = reverse chunk-local cumsum of dgamma, summed term by term so that nothing cancels (below).
// The backward keeps only the chunk-start states of the pair it works on ([chunks, dk, dv]) and
// rebuilds T, W, U, V' per chunk (op.h: forward saves nothing).
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/blas.h"
#include "gdn/backend/registry.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops {

namespace {
constexpr int64_t C = kGdrChunk;

using cpu::gemm;  // row-major Cm[m, n] = alpha op(A) op(B) + beta Cm (backend/cpu/blas.h)

float dot(const float* a, const float* b, int64_t n) {
  float s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Read-only view of the inputs of one call, with q and k already normalised.
struct Ctx {
  int64_t T, Hk, Hv, dk, dv, N, r;
  float s;
  const int32_t* cu;  // [N+1]
  const float* qn;    // [T, Hk, dk] q as the recurrence sees it
  const float* kn;    // [T, Hk, dk]
  const float* v;     // [T, Hv, dv]
  const float* g;     // [T, Hv]
  const float* beta;  // [T, Hv]
  const float* h0;    // [N, Hv, dk, dv] or null
};

// Per-thread scratch for one chunk (all row-major, leading dimension = the last size).
struct Work {
  explicit Work(int64_t dk, int64_t dv)
      : G(C),
        dec(C),
        b(C),
        dgam(C),
        phi(C),
        db(C),
        D(C * C),
        KK(C * C),
        M(C * C),
        Tm(C * C),
        P(C * C),
        E(C * C),
        dT(C * C),
        tmpC(C * C),
        Hs(C * C),
        Xk(C * dk),
        Xv(C * dv),
        W(C * dk),
        Vp(C * dv),
        Qg(C * dk),
        Kt(C * dk),
        dVp(C * dv),
        dW(C * dk),
        dQ(C * dk),
        dK(C * dk),
        tk(C * dk),
        tv(C * dv),
        S(dk * dv),
        dS(dk * dv) {}
  std::vector<float> G, dec, b;  // [C] e^{gamma_i}, e^{gamma_last - gamma_i}, beta_i
  std::vector<float> dgam;       // [C] gate derivatives that reach dg_t for t <= i (suffix sums)
  std::vector<float> phi;        // [C] gate derivatives that reach dg_t for t > i (prefix sums)
  std::vector<float> db;         // [C]
  std::vector<float> D;          // [C, C] e^{gamma_i - gamma_j} for j <= i, else 0
  std::vector<float> KK;         // [C, C] K K^T
  std::vector<float> M;          // [C, C] strictly lower beta_i D_ij (k_i . k_j)
  std::vector<float> Tm;         // [C, C] T = (I + M)^{-1}
  std::vector<float> P;          // [C, C] Q K^T .* D (j <= i)
  std::vector<float> E;          // [C, C] dP, then dP .* D
  std::vector<float> dT;         // [C, C] dT, then beta-scaled gated dM
  std::vector<float> tmpC;       // [C, C]
  std::vector<float> Hs;         // [C, C] pair terms h_ij (j < i) reaching dg_t for j < t <= i
  std::vector<float> Xk;         // [C, dk] diag(beta G) K
  std::vector<float> Xv;         // [C, dv] diag(beta) V
  std::vector<float> W;          // [C, dk]
  std::vector<float> Vp;         // [C, dv] U, then V' = U - W S0
  std::vector<float> Qg;         // [C, dk] diag(G) Q
  std::vector<float> Kt;         // [C, dk] diag(dec) K
  std::vector<float> dVp;        // [C, dv]
  std::vector<float> dW;         // [C, dk]
  std::vector<float> dQ;         // [C, dk]
  std::vector<float> dK;         // [C, dk]
  std::vector<float> tk;         // [C, dk]
  std::vector<float> tv;         // [C, dv]
  std::vector<float> S;          // [dk, dv] running state
  std::vector<float> dS;         // [dk, dv] running state gradient
  std::vector<float> states;     // [chunks, dk, dv] chunk-start states (backward)
};

// Rows of chunk [t0, t0 + L) of value head h: gates, T, W, U (into Vp), and the scaled copies.
void chunk_prepare(const Ctx& c, int64_t t0, int64_t L, int64_t h, Work& w) {
  const int64_t ldk = c.Hk * c.dk, ldv = c.Hv * c.dv;
  const float* Kc = c.kn + (t0 * c.Hk + h / c.r) * c.dk;  // [L, dk] at stride ldk
  const float* Vc = c.v + (t0 * c.Hv + h) * c.dv;         // [L, dv] at stride ldv
  // The gates. Every exponent is a sum of g's (all <= 0), so nothing overflows and strong decay
  // underflows to 0. Each exponent gamma_i - gamma_j is summed directly over g_{j+1..i} in fp64,
  // never formed as a difference of two cumsums: with g ~ -20, |gamma| reaches 1280, where the
  // fp32 ulp (1.2e-4) would make e^{gamma_i - gamma_j} wrong by 1e-4 relative (the dominant error
  // of an all-fp32 version, 10x the rest; FLA keeps fp32 cumsums).
  auto ex = [](double x) { return std::exp(static_cast<float>(x)); };
  const float* gh = c.g + t0 * c.Hv + h;  // g of row i at gh[i * Hv]
  double gamma = 0;
  for (int64_t i = 0; i < L; ++i) {
    gamma += gh[i * c.Hv];
    w.G[i] = ex(gamma);
    w.b[i] = c.beta[(t0 + i) * c.Hv + h];
    float* Di = w.D.data() + i * C;
    Di[i] = 1.f;
    double acc = 0;
    for (int64_t j = i - 1; j >= 0; --j) {
      acc += gh[(j + 1) * c.Hv];
      Di[j] = ex(acc);
    }
    std::fill(Di + i + 1, Di + L, 0.f);
  }
  for (int64_t i = 0; i < L; ++i) w.dec[i] = w.D[(L - 1) * C + i];
  gemm(false, true, L, L, c.dk, 1.f, Kc, ldk, Kc, ldk, 0.f, w.KK.data(), C);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) {
      w.M[i * C + j] = j < i ? w.b[i] * w.D[i * C + j] * w.KK[i * C + j] : 0.f;
      w.Tm[i * C + j] = i == j ? 1.f : 0.f;
    }
  // (I + M) T = I by forward substitution; CblasUnit takes the unit diagonal as implied. L >= 1:
  // a chunk holds at least one token.
  cblas_strsm(CblasRowMajor, CblasLeft, CblasLower, CblasNoTrans, CblasUnit,
              static_cast<blasint>(L), static_cast<blasint>(L), 1.f, w.M.data(), C, w.Tm.data(), C);
  for (int64_t i = 0; i < L; ++i) {
    const float* ki = Kc + i * ldk;
    const float* vi = Vc + i * ldv;
    const float bk = w.b[i] * w.G[i];
    for (int64_t e = 0; e < c.dk; ++e) w.Xk[i * c.dk + e] = bk * ki[e];
    for (int64_t e = 0; e < c.dv; ++e) w.Xv[i * c.dv + e] = w.b[i] * vi[e];
    for (int64_t e = 0; e < c.dk; ++e) w.Kt[i * c.dk + e] = w.dec[i] * ki[e];
  }
  gemm(false, false, L, c.dk, L, 1.f, w.Tm.data(), C, w.Xk.data(), c.dk, 0.f, w.W.data(), c.dk);
  gemm(false, false, L, c.dv, L, 1.f, w.Tm.data(), C, w.Xv.data(), c.dv, 0.f, w.Vp.data(), c.dv);
}

// V' = U - W S0, in place over U (w.Vp), with S0 = w.S the chunk-start state.
void chunk_vnew(const Ctx& c, int64_t L, Work& w) {
  gemm(false, false, L, c.dv, c.dk, -1.f, w.W.data(), c.dk, w.S.data(), c.dv, 1.f, w.Vp.data(),
       c.dv);
}
// S <- G_last S + Kt^T V': the state at the chunk's end.
void chunk_advance(const Ctx& c, int64_t L, Work& w) {
  const float gl = w.G[L - 1];
  for (float& x : w.S) x *= gl;
  gemm(true, false, c.dk, c.dv, L, 1.f, w.Kt.data(), c.dk, w.Vp.data(), c.dv, 1.f, w.S.data(),
       c.dv);
}

// P = Q K^T .* D on j <= i, and Qg = diag(G) Q.
void chunk_scores(const Ctx& c, int64_t t0, int64_t L, int64_t h, Work& w) {
  const int64_t ldk = c.Hk * c.dk;
  const float* Qc = c.qn + (t0 * c.Hk + h / c.r) * c.dk;  // [L, dk] at stride ldk
  const float* Kc = c.kn + (t0 * c.Hk + h / c.r) * c.dk;  // [L, dk] at stride ldk
  gemm(false, true, L, L, c.dk, 1.f, Qc, ldk, Kc, ldk, 0.f, w.P.data(), C);
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < L; ++j) w.P[i * C + j] *= w.D[i * C + j];
    for (int64_t e = 0; e < c.dk; ++e) w.Qg[i * c.dk + e] = w.G[i] * Qc[i * ldk + e];
  }
}

// l2norm (or a copy) of x [rows, d] into y, rstd = 1/sqrt(sum x^2 + eps) (1 when off).
void normalise(const float* x, int64_t rows, int64_t d, bool l2, float* y, float* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    float rs = 1.f;
    if (l2) {
      float ss = 0;
      for (int64_t e = 0; e < d; ++e) ss += x[i * d + e] * x[i * d + e];
      rs = 1.f / std::sqrt(ss + static_cast<float>(kGdrL2NormEps));
    }
    rstd[i] = rs;
    for (int64_t e = 0; e < d; ++e) y[i * d + e] = x[i * d + e] * rs;
  }
}

struct Prepared {
  Ctx c;
  std::vector<float> qn, kn, qr, kr;  // [T, Hk, dk], [T, Hk, dk], [T, Hk], [T, Hk]
};

template <class A>
void prepare(const A& a, Prepared& p) {
  Ctx& c = p.c;
  c.T = a.q.size(0);
  c.Hk = a.q.size(1);
  c.dk = a.q.size(2);
  c.Hv = a.v.size(1);
  c.dv = a.v.size(2);
  c.N = a.cu_seqlens.size(0) - 1;
  c.r = c.Hv / c.Hk;
  c.s = static_cast<float>(gdr_effective_scale(a.scale, c.dk));
  c.cu = a.cu_seqlens.template ptr<int32_t>();
  c.v = a.v.template ptr<float>();
  c.g = a.g.template ptr<float>();
  c.beta = a.beta.template ptr<float>();
  c.h0 = a.h0.defined() ? a.h0.template ptr<float>() : nullptr;
  const int64_t rows = c.T * c.Hk;
  p.qn.resize(static_cast<size_t>(rows * c.dk));
  p.kn.resize(static_cast<size_t>(rows * c.dk));
  p.qr.resize(static_cast<size_t>(rows));
  p.kr.resize(static_cast<size_t>(rows));
  normalise(a.q.template ptr<float>(), rows, c.dk, a.use_qk_l2norm, p.qn.data(), p.qr.data());
  normalise(a.k.template ptr<float>(), rows, c.dk, a.use_qk_l2norm, p.kn.data(), p.kr.data());
  c.qn = p.qn.data();
  c.kn = p.kn.data();
}

void load_state(const Ctx& c, int64_t pair, std::vector<float>& S) {
  const int64_t sd = c.dk * c.dv;
  if (c.h0)
    std::copy(c.h0 + pair * sd, c.h0 + (pair + 1) * sd, S.begin());
  else
    std::fill(S.begin(), S.end(), 0.f);
}

void forward(const GatedDeltaRuleFwd& a) {
  Prepared p;
  prepare(a, p);
  const Ctx& c = p.c;
  float* o = a.o.ptr<float>();                               // [T, Hv, dv]
  float* hT = a.hT.defined() ? a.hT.ptr<float>() : nullptr;  // [N, Hv, dk, dv]
  const int64_t pairs = c.N * c.Hv, sd = c.dk * c.dv, ldo = c.Hv * c.dv;
#pragma omp parallel
  {
    Work w(c.dk, c.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t n = pair / c.Hv, h = pair % c.Hv;
      load_state(c, pair, w.S);
      for (int64_t t0 = c.cu[n]; t0 < c.cu[n + 1]; t0 += C) {
        const int64_t L = std::min<int64_t>(C, c.cu[n + 1] - t0);
        float* Oc = o + (t0 * c.Hv + h) * c.dv;  // [L, dv] at stride ldo
        chunk_prepare(c, t0, L, h, w);
        chunk_vnew(c, L, w);
        chunk_scores(c, t0, L, h, w);
        gemm(false, false, L, c.dv, c.dk, c.s, w.Qg.data(), c.dk, w.S.data(), c.dv, 0.f, Oc, ldo);
        gemm(false, false, L, c.dv, L, c.s, w.P.data(), C, w.Vp.data(), c.dv, 1.f, Oc, ldo);
        chunk_advance(c, L, w);
      }
      if (hT) std::copy(w.S.begin(), w.S.end(), hT + pair * sd);
    }
  }
}

void backward(const GatedDeltaRuleBwd& a) {
  Prepared p;
  prepare(a, p);
  const Ctx& c = p.c;
  const float* dout = a.dout.ptr<float>();                            // [T, Hv, dv]
  const float* dhT = a.dhT.defined() ? a.dhT.ptr<float>() : nullptr;  // [N, Hv, dk, dv]
  float* dvo = a.dv.ptr<float>();                                     // [T, Hv, dv]
  float* dg = a.dg.ptr<float>();                                      // [T, Hv]
  float* dbeta = a.dbeta.ptr<float>();                                // [T, Hv]
  float* dh0 = a.dh0.defined() ? a.dh0.ptr<float>() : nullptr;        // [N, Hv, dk, dv]
  // Per value head gradients of the normalised q and k, summed over each key head's group below.
  std::vector<float> dqh(static_cast<size_t>(c.T * c.Hv * c.dk));  // [T, Hv, dk]
  std::vector<float> dkh(static_cast<size_t>(c.T * c.Hv * c.dk));  // [T, Hv, dk]
  const int64_t pairs = c.N * c.Hv, sd = c.dk * c.dv;
  const int64_t ldk = c.Hk * c.dk, ldv = c.Hv * c.dv, ldh = c.Hv * c.dk;
#pragma omp parallel
  {
    Work w(c.dk, c.dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t n = pair / c.Hv, h = pair % c.Hv, kh = h / c.r;
      const int64_t bos = c.cu[n], len = c.cu[n + 1] - bos, nc = (len + C - 1) / C;
      // Pass 1: the chunk-start states.
      w.states.resize(static_cast<size_t>(nc * sd));
      load_state(c, pair, w.S);
      for (int64_t ci = 0; ci < nc; ++ci) {
        const int64_t t0 = bos + ci * C, L = std::min<int64_t>(C, bos + len - t0);
        std::copy(w.S.begin(), w.S.end(), w.states.begin() + ci * sd);
        if (ci + 1 == nc) break;  // the final state is not needed
        chunk_prepare(c, t0, L, h, w);
        chunk_vnew(c, L, w);
        chunk_advance(c, L, w);
      }
      // Pass 2: reverse over chunks; w.dS is the gradient of the state at the current chunk's end.
      if (dhT)
        std::copy(dhT + pair * sd, dhT + (pair + 1) * sd, w.dS.begin());
      else
        std::fill(w.dS.begin(), w.dS.end(), 0.f);
      for (int64_t ci = nc - 1; ci >= 0; --ci) {
        const int64_t t0 = bos + ci * C, L = std::min<int64_t>(C, bos + len - t0);
        const float* Qc = c.qn + (t0 * c.Hk + kh) * c.dk;  // [L, dk] at stride ldk
        const float* Kc = c.kn + (t0 * c.Hk + kh) * c.dk;  // [L, dk] at stride ldk
        const float* Vc = c.v + (t0 * c.Hv + h) * c.dv;    // [L, dv] at stride ldv
        const float* dOc = dout + (t0 * c.Hv + h) * c.dv;  // [L, dv] at stride ldv
        const float* S0 = w.states.data() + ci * sd;       // [dk, dv]
        std::copy(S0, S0 + sd, w.S.begin());
        chunk_prepare(c, t0, L, h, w);
        chunk_vnew(c, L, w);
        chunk_scores(c, t0, L, h, w);
        std::fill(w.dgam.begin(), w.dgam.end(), 0.f);
        std::fill(w.db.begin(), w.db.end(), 0.f);
        const float gl = w.G[L - 1];

        // Output and state paths into V'.
        gemm(false, false, L, c.dv, c.dk, 1.f, w.Kt.data(), c.dk, w.dS.data(), c.dv, 0.f,
             w.dVp.data(), c.dv);
        gemm(true, false, L, c.dv, L, c.s, w.P.data(), C, dOc, ldv, 1.f, w.dVp.data(), c.dv);
        // Intra-chunk scores: dP = s dO V'^T on j <= i.
        gemm(false, true, L, L, c.dv, c.s, dOc, ldv, w.Vp.data(), c.dv, 0.f, w.E.data(), C);
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < L; ++j) {
            float& e = w.E[i * C + j];
            w.Hs[i * C + j] = j < i ? e * w.P[i * C + j] : 0.f;
            e = j <= i ? e * w.D[i * C + j] : 0.f;
          }
        gemm(false, false, L, c.dk, L, 1.f, w.E.data(), C, Kc, ldk, 0.f, w.dQ.data(), c.dk);
        gemm(true, false, L, c.dk, L, 1.f, w.E.data(), C, Qc, ldk, 0.f, w.dK.data(), c.dk);
        // Inter-chunk output term s diag(G) Q S0.
        gemm(false, true, L, c.dk, c.dv, 1.f, dOc, ldv, S0, c.dv, 0.f, w.tk.data(), c.dk);
        for (int64_t i = 0; i < L; ++i) {
          const float sg = c.s * w.G[i];
          float* dq = w.dQ.data() + i * c.dk;
          const float* t = w.tk.data() + i * c.dk;
          for (int64_t e = 0; e < c.dk; ++e) dq[e] += sg * t[e];
          w.dgam[i] += sg * dot(Qc + i * ldk, t, c.dk);
        }
        // State update S1 = G_last S0 + Kt^T V': the Kt and G_last gate terms.
        gemm(false, true, L, c.dk, c.dv, 1.f, w.Vp.data(), c.dv, w.dS.data(), c.dv, 0.f,
             w.tk.data(), c.dk);
        for (int64_t i = 0; i < L; ++i) {
          const float* t = w.tk.data() + i * c.dk;
          float* dk = w.dK.data() + i * c.dk;
          for (int64_t e = 0; e < c.dk; ++e) dk[e] += w.dec[i] * t[e];
          w.phi[i] = i == L - 1 ? 0.f : w.dec[i] * dot(Kc + i * ldk, t, c.dk);
        }
        const float dg_all = gl * dot(S0, w.dS.data(), sd);  // reaches every dg_t of the chunk
        // dS0 = G_last dS + s Qg^T dO - W^T dV'.
        for (float& x : w.dS) x *= gl;
        gemm(true, false, c.dk, c.dv, L, c.s, w.Qg.data(), c.dk, dOc, ldv, 1.f, w.dS.data(), c.dv);
        gemm(true, false, c.dk, c.dv, L, -1.f, w.W.data(), c.dk, w.dVp.data(), c.dv, 1.f,
             w.dS.data(), c.dv);
        // V' = U - W S0.
        gemm(false, true, L, c.dk, c.dv, -1.f, w.dVp.data(), c.dv, S0, c.dv, 0.f, w.dW.data(),
             c.dk);
        // WY factors U = T Xv, W = T Xk.
        gemm(false, true, L, L, c.dv, 1.f, w.dVp.data(), c.dv, w.Xv.data(), c.dv, 0.f, w.dT.data(),
             C);
        gemm(false, true, L, L, c.dk, 1.f, w.dW.data(), c.dk, w.Xk.data(), c.dk, 1.f, w.dT.data(),
             C);
        gemm(true, false, L, c.dv, L, 1.f, w.Tm.data(), C, w.dVp.data(), c.dv, 0.f, w.tv.data(),
             c.dv);
        for (int64_t i = 0; i < L; ++i) {
          const float* t = w.tv.data() + i * c.dv;
          float* dvi = dvo + ((t0 + i) * c.Hv + h) * c.dv;
          for (int64_t e = 0; e < c.dv; ++e) dvi[e] = w.b[i] * t[e];
          w.db[i] += dot(Vc + i * ldv, t, c.dv);
        }
        gemm(true, false, L, c.dk, L, 1.f, w.Tm.data(), C, w.dW.data(), c.dk, 0.f, w.tk.data(),
             c.dk);
        for (int64_t i = 0; i < L; ++i) {
          const float* t = w.tk.data() + i * c.dk;
          float* dk = w.dK.data() + i * c.dk;
          const float bg = w.b[i] * w.G[i];
          for (int64_t e = 0; e < c.dk; ++e) dk[e] += bg * t[e];
          const float kt = dot(Kc + i * ldk, t, c.dk);
          w.db[i] += w.G[i] * kt;
          w.dgam[i] += bg * kt;
        }
        // Through T = (I + M)^{-1}: dM = -T^T tril_{-1}(dT) T^T on i > j.
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = i; j < L; ++j) w.dT[i * C + j] = 0.f;
        gemm(false, true, L, L, L, 1.f, w.dT.data(), C, w.Tm.data(), C, 0.f, w.tmpC.data(), C);
        gemm(true, false, L, L, L, -1.f, w.Tm.data(), C, w.tmpC.data(), C, 0.f, w.dT.data(), C);
        // M_ij = beta_i D_ij KK_ij: w.dT becomes dKK = dM .* beta_i D_ij (strictly lower).
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < L; ++j) {
            float& x = w.dT[i * C + j];
            if (j < i) {
              const float gd = x * w.D[i * C + j];  // gradient w.r.t. beta_i KK_ij
              w.db[i] += gd * w.KK[i * C + j];
              x = w.b[i] * gd;
              w.Hs[i * C + j] += x * w.KK[i * C + j];  // = dM_ij M_ij
            } else {
              x = 0.f;
            }
          }
        gemm(false, false, L, c.dk, L, 1.f, w.dT.data(), C, Kc, ldk, 1.f, w.dK.data(), c.dk);
        gemm(true, false, L, c.dk, L, 1.f, w.dT.data(), C, Kc, ldk, 1.f, w.dK.data(), c.dk);
        // dg_t = sum_{i >= t} dgamma_i. A pair term h_ij (a factor e^{gamma_i - gamma_j}) adds to
        // dgamma_i and subtracts from dgamma_j, so it reaches exactly the dg_t with j < t <= i;
        // phi_i moves from dgamma_i to dgamma_last, reaching the dg_t with t > i. Summing those
        // sets directly, instead of the reverse cumsum of the differences, avoids cancelling O(1)
        // terms into a tiny dg (strong decay: dg ~ e^g).
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 1; j < i; ++j) w.Hs[i * C + j] += w.Hs[i * C + j - 1];  // row prefix
        float suffix = 0, prefix = 0;
        for (int64_t t = L - 1; t >= 0; --t) {
          suffix += w.dgam[t];
          w.dgam[t] = suffix;
        }
        for (int64_t t = 0; t < L; ++t) {
          float pair_sum = 0;
          if (t > 0)
            for (int64_t i = t; i < L; ++i) pair_sum += w.Hs[i * C + t - 1];
          dg[(t0 + t) * c.Hv + h] = w.dgam[t] + prefix + pair_sum + dg_all;
          dbeta[(t0 + t) * c.Hv + h] = w.db[t];
          prefix += w.phi[t];
        }
        for (int64_t i = 0; i < L; ++i) {
          std::copy(w.dQ.begin() + i * c.dk, w.dQ.begin() + (i + 1) * c.dk,
                    dqh.begin() + (t0 + i) * ldh + h * c.dk);
          std::copy(w.dK.begin() + i * c.dk, w.dK.begin() + (i + 1) * c.dk,
                    dkh.begin() + (t0 + i) * ldh + h * c.dk);
        }
      }
      if (dh0) std::copy(w.dS.begin(), w.dS.end(), dh0 + pair * sd);
    }
  }
  // Sum the r value heads of each key head (in head order), then the l2norm backward.
  float* dq = a.dq.ptr<float>();  // [T, Hk, dk]
  float* dk = a.dk.ptr<float>();  // [T, Hk, dk]
  const int64_t rows = c.T * c.Hk;
  auto reduce = [&](const std::vector<float>& src, float* dst, const float* y, const float* rstd,
                    int64_t row) {
    const int64_t t = row / c.Hk, kh = row % c.Hk;
    float* out = dst + row * c.dk;
    std::fill(out, out + c.dk, 0.f);
    for (int64_t j = 0; j < c.r; ++j) {
      const float* part = src.data() + t * ldh + (kh * c.r + j) * c.dk;
      for (int64_t e = 0; e < c.dk; ++e) out[e] += part[e];
    }
    if (!a.use_qk_l2norm) return;
    // dx = rstd (dy - <dy, y> y), y the normalised row.
    const float* yr = y + row * c.dk;
    const float d = dot(out, yr, c.dk);
    for (int64_t e = 0; e < c.dk; ++e) out[e] = rstd[row] * (out[e] - d * yr[e]);
  };
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    reduce(dqh, dq, p.qn.data(), p.qr.data(), row);
    reduce(dkh, dk, p.kn.data(), p.kr.data(), row);
  }
}

const GatedDeltaRuleTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gated_delta_rule_cpu) {
  Registry::global().add_impl(
      {"gated_delta_rule", "cpu.chunk64", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
