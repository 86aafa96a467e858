// Gated attention reference: fp64, the plain O(T_n^2) per-document loops, no threading, no tiling.
// The backward recomputes the norms, RoPE and each row's softmax from the inputs and ignores the
// tensors the forward saved, so the oracle shares no intermediate with the implementations it
// checks.
#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/gated_attention/op.h"

namespace gdn::ops {

namespace {

struct Dims {
  int64_t T, Hq, Hkv, hd, rot, group, N;
};

Dims dims_of(const Tensor& qg, const Tensor& k, const Tensor& cu, int64_t rot) {
  Dims d{qg.size(0), qg.size(1), k.size(1), k.size(2), rot, 0, cu.size(0) - 1};
  d.group = d.Hq / d.Hkv;
  return d;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Position of every token inside its document.
std::vector<int64_t> positions(const Tensor& cu, int64_t T) {
  const int32_t* c = cu.ptr<int32_t>();  // [N+1]
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (int64_t n = 0; n + 1 < cu.size(0); ++n)
    for (int64_t t = c[n]; t < c[n + 1]; ++t) pos[static_cast<size_t>(t)] = t - c[n];
  return pos;
}

// y = rope_p(x · r · (1 + w)) for one head vector (x, w, y: [hd]); returns r.
double norm_rope(const double* x, const double* w, int64_t hd, int64_t rot, int64_t p, double theta,
                 double eps, double* y) {
  double ss = 0;
  for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(hd) + eps);
  std::vector<double> u(static_cast<size_t>(hd));
  for (int64_t i = 0; i < hd; ++i) u[i] = x[i] * r * (1.0 + w[i]);
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < hd; ++i) y[i] = u[i];
  for (int64_t i = 0; i < half; ++i) {
    const double ang = static_cast<double>(p) * std::pow(theta, -2.0 * i / rot);
    const double c = std::cos(ang), s = std::sin(ang);
    y[i] = u[i] * c - u[i + half] * s;
    y[i + half] = u[i + half] * c + u[i] * s;
  }
  return r;
}

// Backward of norm_rope: dy (gradient w.r.t. y) -> dx (=), dw (+=); all [hd].
void norm_rope_backward(const double* x, const double* w, int64_t hd, int64_t rot, int64_t p,
                        double theta, double eps, const double* dy, double* dx, double* dw) {
  double ss = 0;
  for (int64_t i = 0; i < hd; ++i) ss += x[i] * x[i];
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(hd) + eps);
  std::vector<double> du(dy, dy + hd);  // gradient w.r.t. u = x·r·(1+w)
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double ang = static_cast<double>(p) * std::pow(theta, -2.0 * i / rot);
    const double c = std::cos(ang), s = std::sin(ang);
    du[i] = dy[i] * c + dy[i + half] * s;
    du[i + half] = dy[i + half] * c - dy[i] * s;
  }
  double dot = 0;  // Σ du·(1+w)·xhat
  for (int64_t i = 0; i < hd; ++i) dot += du[i] * (1.0 + w[i]) * x[i] * r;
  dot /= static_cast<double>(hd);
  for (int64_t i = 0; i < hd; ++i) {
    const double xhat = x[i] * r;
    dx[i] = r * (du[i] * (1.0 + w[i]) - xhat * dot);
    dw[i] += du[i] * xhat;
  }
}

void forward(const GatedAttentionFwd& a) {
  const Dims d = dims_of(a.qg, a.k, a.cu_seqlens, a.rotary_dim);
  const double* qg = a.qg.ptr<double>();            // [T, Hq, 2*hd]
  const double* k = a.k.ptr<double>();              // [T, Hkv, hd]
  const double* v = a.v.ptr<double>();              // [T, Hkv, hd]
  const double* wq = a.q_norm_w.ptr<double>();      // [hd]
  const double* wk = a.k_norm_w.ptr<double>();      // [hd]
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();  // [N+1]
  double* o = a.o.ptr<double>();                    // [T, Hq, hd]
  double* qh = a.q_hat.ptr<double>();               // [T, Hq, hd]
  double* kh = a.k_hat.ptr<double>();               // [T, Hkv, hd]
  double* attn = a.attn.ptr<double>();              // [T, Hq, hd]
  double* lse = a.lse.ptr<double>();                // [T, Hq]
  double* qr = a.q_rstd.ptr<double>();              // [T, Hq]
  double* kr = a.k_rstd.ptr<double>();              // [T, Hkv]
  const int64_t hd = d.hd;
  const std::vector<int64_t> pos = positions(a.cu_seqlens, d.T);
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t h = 0; h < d.Hq; ++h)
      qr[t * d.Hq + h] = norm_rope(qg + (t * d.Hq + h) * 2 * hd, wq, hd, d.rot, pos[t],
                                   a.rope_theta, a.eps, qh + (t * d.Hq + h) * hd);
    for (int64_t j = 0; j < d.Hkv; ++j)
      kr[t * d.Hkv + j] = norm_rope(k + (t * d.Hkv + j) * hd, wk, hd, d.rot, pos[t], a.rope_theta,
                                    a.eps, kh + (t * d.Hkv + j) * hd);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t b = cu[n], e = cu[n + 1];
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t j = h / d.group;
      for (int64_t t = b; t < e; ++t) {
        const double* q = qh + (t * d.Hq + h) * hd;  // [hd]
        std::vector<double> s(static_cast<size_t>(t - b + 1));
        double m = -INFINITY;
        for (int64_t u = b; u <= t; ++u) {
          double dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += q[i] * kh[(u * d.Hkv + j) * hd + i];
          s[u - b] = dot * scale;
          m = std::max(m, s[u - b]);
        }
        double l = 0;
        for (double x : s) l += std::exp(x - m);
        lse[t * d.Hq + h] = m + std::log(l);
        double* at = attn + (t * d.Hq + h) * hd;  // [hd]
        for (int64_t i = 0; i < hd; ++i) at[i] = 0;
        for (int64_t u = b; u <= t; ++u) {
          const double p = std::exp(s[u - b] - m) / l;
          for (int64_t i = 0; i < hd; ++i) at[i] += p * v[(u * d.Hkv + j) * hd + i];
        }
        const double* gate = qg + (t * d.Hq + h) * 2 * hd + hd;  // [hd]
        for (int64_t i = 0; i < hd; ++i) o[(t * d.Hq + h) * hd + i] = at[i] * sigmoid(gate[i]);
      }
    }
  }
}

void backward(const GatedAttentionBwd& a) {
  const Dims d = dims_of(a.qg, a.k, a.cu_seqlens, a.rotary_dim);
  const double* qg = a.qg.ptr<double>();            // [T, Hq, 2*hd]
  const double* k = a.k.ptr<double>();              // [T, Hkv, hd]
  const double* v = a.v.ptr<double>();              // [T, Hkv, hd]
  const double* wq = a.q_norm_w.ptr<double>();      // [hd]
  const double* wk = a.k_norm_w.ptr<double>();      // [hd]
  const int32_t* cu = a.cu_seqlens.ptr<int32_t>();  // [N+1]
  const double* dout = a.d_o.ptr<double>();         // [T, Hq, hd]
  double* dqg = a.dqg.ptr<double>();                // [T, Hq, 2*hd]
  double* dk = a.dk.ptr<double>();                  // [T, Hkv, hd]
  double* dv = a.dv.ptr<double>();                  // [T, Hkv, hd]
  double* dwq = a.dq_norm_w.ptr<double>();          // [hd]
  double* dwk = a.dk_norm_w.ptr<double>();          // [hd]
  const int64_t hd = d.hd;
  const std::vector<int64_t> pos = positions(a.cu_seqlens, d.T);
  const auto sz = [](int64_t n) { return static_cast<size_t>(n); };
  std::vector<double> qh(sz(d.T * d.Hq * hd)), kh(sz(d.T * d.Hkv * hd));  // [T, H*, hd]
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t h = 0; h < d.Hq; ++h)
      norm_rope(qg + (t * d.Hq + h) * 2 * hd, wq, hd, d.rot, pos[t], a.rope_theta, a.eps,
                &qh[sz((t * d.Hq + h) * hd)]);
    for (int64_t j = 0; j < d.Hkv; ++j)
      norm_rope(k + (t * d.Hkv + j) * hd, wk, hd, d.rot, pos[t], a.rope_theta, a.eps,
                &kh[sz((t * d.Hkv + j) * hd)]);
  }
  std::vector<double> dqh(qh.size(), 0.0), dkh(kh.size(), 0.0);  // [T, H*, hd]
  for (int64_t i = 0; i < d.T * d.Hkv * hd; ++i) dv[i] = 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t b = cu[n], e = cu[n + 1];
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t j = h / d.group;
      for (int64_t t = b; t < e; ++t) {
        const double* q = &qh[sz((t * d.Hq + h) * hd)];  // [hd]
        const size_t L = sz(t - b + 1);
        std::vector<double> p(L);
        double m = -INFINITY;
        for (int64_t u = b; u <= t; ++u) {
          double dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += q[i] * kh[sz((u * d.Hkv + j) * hd + i)];
          p[sz(u - b)] = dot * scale;
          m = std::max(m, p[sz(u - b)]);
        }
        double l = 0;
        for (double& x : p) l += (x = std::exp(x - m));
        for (double& x : p) x /= l;
        // o = attn ⊙ σ(g): dattn = do ⊙ σ(g), dg = do ⊙ attn ⊙ σ(g)(1 − σ(g)).
        const double* gate = qg + (t * d.Hq + h) * 2 * hd + hd;  // [hd]
        const double* dout_t = dout + (t * d.Hq + h) * hd;       // [hd]
        std::vector<double> at(sz(hd), 0.0), da(sz(hd));
        for (int64_t u = b; u <= t; ++u)
          for (int64_t i = 0; i < hd; ++i) at[sz(i)] += p[sz(u - b)] * v[(u * d.Hkv + j) * hd + i];
        double* dgate = dqg + (t * d.Hq + h) * 2 * hd + hd;  // [hd]
        for (int64_t i = 0; i < hd; ++i) {
          const double sg = sigmoid(gate[i]);
          da[sz(i)] = dout_t[i] * sg;
          dgate[i] = dout_t[i] * at[sz(i)] * sg * sigmoid(-gate[i]);
        }
        // Softmax backward: ds_u = p_u (dp_u − Σ_w p_w dp_w), dp_u = <dattn, v_u>.
        std::vector<double> dp(L);
        double D = 0;
        for (int64_t u = b; u <= t; ++u) {
          double x = 0;
          for (int64_t i = 0; i < hd; ++i) x += da[sz(i)] * v[(u * d.Hkv + j) * hd + i];
          dp[sz(u - b)] = x;
          D += p[sz(u - b)] * x;
        }
        double* dq = &dqh[sz((t * d.Hq + h) * hd)];  // [hd]
        for (int64_t u = b; u <= t; ++u) {
          const double pu = p[sz(u - b)], ds = pu * (dp[sz(u - b)] - D) * scale;
          for (int64_t i = 0; i < hd; ++i) {
            dq[i] += ds * kh[sz((u * d.Hkv + j) * hd + i)];
            dkh[sz((u * d.Hkv + j) * hd + i)] += ds * q[i];
            dv[(u * d.Hkv + j) * hd + i] += pu * da[sz(i)];
          }
        }
      }
    }
  }
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t h = 0; h < d.Hq; ++h)
      norm_rope_backward(qg + (t * d.Hq + h) * 2 * hd, wq, hd, d.rot, pos[t], a.rope_theta, a.eps,
                         &dqh[sz((t * d.Hq + h) * hd)], dqg + (t * d.Hq + h) * 2 * hd, dwq);
    for (int64_t j = 0; j < d.Hkv; ++j)
      norm_rope_backward(k + (t * d.Hkv + j) * hd, wk, hd, d.rot, pos[t], a.rope_theta, a.eps,
                         &dkh[sz((t * d.Hkv + j) * hd)], dk + (t * d.Hkv + j) * hd, dwk);
  }
}

const GatedAttentionTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gated_attention_ref) {
  Registry::global().add_impl({"gated_attention", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
