// Gated delta rule reference: the token-by-token recurrence of gdn_spec.md §2 in fp64 and its exact
// reverse-time backward. Plain loops, no threading, no chunking: the oracle for every other
// implementation. Backward re-runs the recurrence and keeps every state S_{t-1} of a (document,
// head) pair, O(L dk dv) doubles: fine for the small shapes the oracle is used on.
#include <algorithm>
#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops {

namespace {

struct Dims {
  int64_t T, Hk, Hv, dk, dv, N, r;
};

Dims dims_of(const Tensor& q, const Tensor& v, const Tensor& cu) {
  Dims d{q.size(0), q.size(1), v.size(1), q.size(2), v.size(2), cu.size(0) - 1, 0};
  d.r = d.Hv / d.Hk;
  return d;
}

// q and k as the recurrence sees them: copied, or l2-normalised per (token, key head) row, with
// rstd = 1/sqrt(sum(x^2) + eps) kept for the backward (1 when the norm is off).
void normalise(const double* x, int64_t rows, int64_t d, bool l2, std::vector<double>& y,
               std::vector<double>& rstd) {
  y.assign(x, x + rows * d);
  rstd.assign(static_cast<size_t>(rows), 1.0);
  if (!l2) return;
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t e = 0; e < d; ++e) ss += x[i * d + e] * x[i * d + e];
    const double rs = 1.0 / std::sqrt(ss + kGdrL2NormEps);
    rstd[static_cast<size_t>(i)] = rs;
    for (int64_t e = 0; e < d; ++e) y[static_cast<size_t>(i * d + e)] = x[i * d + e] * rs;
  }
}

// dx = rstd * (dy - <dy, y> y) per row (y the normalised row), in place over dy.
void l2norm_backward(std::vector<double>& dy, const std::vector<double>& y,
                     const std::vector<double>& rstd, int64_t rows, int64_t d) {
  for (int64_t i = 0; i < rows; ++i) {
    double* dr = dy.data() + i * d;
    const double* yr = y.data() + i * d;
    double dot = 0;
    for (int64_t e = 0; e < d; ++e) dot += dr[e] * yr[e];
    for (int64_t e = 0; e < d; ++e) dr[e] = rstd[static_cast<size_t>(i)] * (dr[e] - dot * yr[e]);
  }
}

void forward(const GatedDeltaRuleFwd& a) {
  const Dims d = dims_of(a.q, a.v, a.cu_seqlens);
  const double s = gdr_effective_scale(a.scale, d.dk);
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();                   // [N+1]
  const double* v = a.v.ptr<double>();                               // [T, Hv, dv]
  const double* g = a.g.ptr<double>();                               // [T, Hv]
  const double* beta = a.beta.ptr<double>();                         // [T, Hv]
  const double* h0 = a.h0.defined() ? a.h0.ptr<double>() : nullptr;  // [N, Hv, dk, dv]
  double* o = a.o.ptr<double>();                                     // [T, Hv, dv]
  double* hT = a.hT.defined() ? a.hT.ptr<double>() : nullptr;        // [N, Hv, dk, dv]
  std::vector<double> qn, kn, qr, kr;                                // [T, Hk, dk], [T, Hk]
  normalise(a.q.ptr<double>(), d.T * d.Hk, d.dk, a.use_qk_l2norm, qn, qr);
  normalise(a.k.ptr<double>(), d.T * d.Hk, d.dk, a.use_qk_l2norm, kn, kr);
  const int64_t sd = d.dk * d.dv;
  std::vector<double> S(static_cast<size_t>(sd)), p(static_cast<size_t>(d.dv));  // [dk, dv]
  for (int64_t n = 0; n < d.N; ++n) {
    for (int64_t h = 0; h < d.Hv; ++h) {
      const int64_t kh = h / d.r, pair = n * d.Hv + h;
      for (int64_t i = 0; i < sd; ++i) S[static_cast<size_t>(i)] = h0 ? h0[pair * sd + i] : 0.0;
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        const double* kt = kn.data() + (t * d.Hk + kh) * d.dk;
        const double* qt = qn.data() + (t * d.Hk + kh) * d.dk;
        const double* vt = v + (t * d.Hv + h) * d.dv;
        const double alpha = std::exp(g[t * d.Hv + h]), b = beta[t * d.Hv + h];
        for (double& x : S) x *= alpha;
        for (int64_t j = 0; j < d.dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < d.dk; ++i) acc += S[static_cast<size_t>(i * d.dv + j)] * kt[i];
          p[static_cast<size_t>(j)] = b * (vt[j] - acc);  // p now holds delta_t
        }
        for (int64_t i = 0; i < d.dk; ++i)
          for (int64_t j = 0; j < d.dv; ++j)
            S[static_cast<size_t>(i * d.dv + j)] += kt[i] * p[static_cast<size_t>(j)];
        double* ot = o + (t * d.Hv + h) * d.dv;
        for (int64_t j = 0; j < d.dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < d.dk; ++i) acc += S[static_cast<size_t>(i * d.dv + j)] * qt[i];
          ot[j] = s * acc;
        }
      }
      if (hT)
        for (int64_t i = 0; i < sd; ++i) hT[pair * sd + i] = S[static_cast<size_t>(i)];
    }
  }
}

void backward(const GatedDeltaRuleBwd& a) {
  const Dims d = dims_of(a.q, a.v, a.cu_seqlens);
  const double s = gdr_effective_scale(a.scale, d.dk);
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();                      // [N+1]
  const double* v = a.v.ptr<double>();                                  // [T, Hv, dv]
  const double* g = a.g.ptr<double>();                                  // [T, Hv]
  const double* beta = a.beta.ptr<double>();                            // [T, Hv]
  const double* h0 = a.h0.defined() ? a.h0.ptr<double>() : nullptr;     // [N, Hv, dk, dv]
  const double* dout = a.dout.ptr<double>();                            // [T, Hv, dv]
  const double* dhT = a.dhT.defined() ? a.dhT.ptr<double>() : nullptr;  // [N, Hv, dk, dv]
  double* dv = a.dv.ptr<double>();                                      // [T, Hv, dv]
  double* dg = a.dg.ptr<double>();                                      // [T, Hv]
  double* dbeta = a.dbeta.ptr<double>();                                // [T, Hv]
  double* dh0 = a.dh0.defined() ? a.dh0.ptr<double>() : nullptr;        // [N, Hv, dk, dv]
  std::vector<double> qn, kn, qr, kr;                                   // [T, Hk, dk], [T, Hk]
  normalise(a.q.ptr<double>(), d.T * d.Hk, d.dk, a.use_qk_l2norm, qn, qr);
  normalise(a.k.ptr<double>(), d.T * d.Hk, d.dk, a.use_qk_l2norm, kn, kr);
  // Gradients w.r.t. the normalised q and k, summed over the value heads of each key head.
  std::vector<double> dqn(qn.size(), 0.0), dkn(kn.size(), 0.0);  // [T, Hk, dk]
  const int64_t sd = d.dk * d.dv;
  const size_t usd = static_cast<size_t>(sd);
  std::vector<double> states;             // [L+1, dk, dv]: S_{t-1} for every t, then S_L
  std::vector<double> dS(usd), dSt(usd);  // [dk, dv]
  std::vector<double> delta(static_cast<size_t>(d.dv)), ddelta(static_cast<size_t>(d.dv));
  std::vector<double> pred(static_cast<size_t>(d.dv)), dp(static_cast<size_t>(d.dv));
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t bos = cu[n], L = cu[n + 1] - cu[n];
    for (int64_t h = 0; h < d.Hv; ++h) {
      const int64_t kh = h / d.r, pair = n * d.Hv + h;
      // Forward again, keeping the states.
      states.assign(static_cast<size_t>(L + 1) * usd, 0.0);
      if (h0)
        for (int64_t i = 0; i < sd; ++i) states[static_cast<size_t>(i)] = h0[pair * sd + i];
      for (int64_t l = 0; l < L; ++l) {
        const int64_t t = bos + l;
        const double* kt = kn.data() + (t * d.Hk + kh) * d.dk;
        const double* vt = v + (t * d.Hv + h) * d.dv;
        const double alpha = std::exp(g[t * d.Hv + h]), b = beta[t * d.Hv + h];
        const double* Sp = states.data() + static_cast<size_t>(l) * usd;
        double* Sn = states.data() + static_cast<size_t>(l + 1) * usd;
        for (int64_t i = 0; i < sd; ++i) Sn[i] = alpha * Sp[i];
        for (int64_t j = 0; j < d.dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < d.dk; ++i) acc += Sn[i * d.dv + j] * kt[i];
          delta[static_cast<size_t>(j)] = b * (vt[j] - acc);
        }
        for (int64_t i = 0; i < d.dk; ++i)
          for (int64_t j = 0; j < d.dv; ++j)
            Sn[i * d.dv + j] += kt[i] * delta[static_cast<size_t>(j)];
      }
      for (int64_t i = 0; i < sd; ++i) dS[static_cast<size_t>(i)] = dhT ? dhT[pair * sd + i] : 0.0;
      // Reverse time. dS is the gradient w.r.t. S_t on entry and w.r.t. S_{t-1} on exit.
      for (int64_t l = L - 1; l >= 0; --l) {
        const int64_t t = bos + l;
        const double* kt = kn.data() + (t * d.Hk + kh) * d.dk;
        const double* qt = qn.data() + (t * d.Hk + kh) * d.dk;
        const double* vt = v + (t * d.Hv + h) * d.dv;
        const double* dot_t = dout + (t * d.Hv + h) * d.dv;
        double* dqt = dqn.data() + (t * d.Hk + kh) * d.dk;
        double* dkt = dkn.data() + (t * d.Hk + kh) * d.dk;
        const double alpha = std::exp(g[t * d.Hv + h]), b = beta[t * d.Hv + h];
        const double* Sp = states.data() + static_cast<size_t>(l) * usd;      // S_{t-1}
        const double* Sn = states.data() + static_cast<size_t>(l + 1) * usd;  // S_t
        // o_t = s S_t^T q_t.
        for (int64_t i = 0; i < d.dk; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < d.dv; ++j) {
            dS[static_cast<size_t>(i * d.dv + j)] += s * qt[i] * dot_t[j];
            acc += Sn[i * d.dv + j] * dot_t[j];
          }
          dqt[i] += s * acc;
        }
        // St = alpha S_{t-1}; the prediction p = St^T k and delta = b (v - p).
        for (int64_t j = 0; j < d.dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < d.dk; ++i) acc += alpha * Sp[i * d.dv + j] * kt[i];
          pred[static_cast<size_t>(j)] = acc;
          delta[static_cast<size_t>(j)] = b * (vt[j] - acc);
        }
        // S_t = St + k delta^T.
        for (int64_t j = 0; j < d.dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < d.dk; ++i) acc += dS[static_cast<size_t>(i * d.dv + j)] * kt[i];
          ddelta[static_cast<size_t>(j)] = acc;
        }
        for (int64_t i = 0; i < d.dk; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < d.dv; ++j)
            acc += dS[static_cast<size_t>(i * d.dv + j)] * delta[static_cast<size_t>(j)];
          dkt[i] += acc;
        }
        double db = 0;
        double* dvt = dv + (t * d.Hv + h) * d.dv;
        for (int64_t j = 0; j < d.dv; ++j) {
          const double dd = ddelta[static_cast<size_t>(j)];
          dvt[j] = b * dd;
          db += dd * (vt[j] - pred[static_cast<size_t>(j)]);
          dp[static_cast<size_t>(j)] = -b * dd;
        }
        dbeta[t * d.Hv + h] = db;
        // p = St^T k: dSt = dS + k dp^T, dk += St dp.
        for (int64_t i = 0; i < d.dk; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < d.dv; ++j) {
            dSt[static_cast<size_t>(i * d.dv + j)] =
                dS[static_cast<size_t>(i * d.dv + j)] + kt[i] * dp[static_cast<size_t>(j)];
            acc += alpha * Sp[i * d.dv + j] * dp[static_cast<size_t>(j)];
          }
          dkt[i] += acc;
        }
        // St = alpha S_{t-1}: dg = alpha <dSt, S_{t-1}>, dS_{t-1} = alpha dSt.
        double dgt = 0;
        for (int64_t i = 0; i < sd; ++i) {
          dgt += dSt[static_cast<size_t>(i)] * Sp[i];
          dS[static_cast<size_t>(i)] = alpha * dSt[static_cast<size_t>(i)];
        }
        dg[t * d.Hv + h] = alpha * dgt;
      }
      if (dh0)
        for (int64_t i = 0; i < sd; ++i) dh0[pair * sd + i] = dS[static_cast<size_t>(i)];
    }
  }
  if (a.use_qk_l2norm) {
    l2norm_backward(dqn, qn, qr, d.T * d.Hk, d.dk);
    l2norm_backward(dkn, kn, kr, d.T * d.Hk, d.dk);
  }
  double* dq = a.dq.ptr<double>();  // [T, Hk, dk]
  double* dk = a.dk.ptr<double>();  // [T, Hk, dk]
  std::copy(dqn.begin(), dqn.end(), dq);
  std::copy(dkn.begin(), dkn.end(), dk);
}

const GatedDeltaRuleTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gated_delta_rule_ref) {
  Registry::global().add_impl({"gated_delta_rule", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
