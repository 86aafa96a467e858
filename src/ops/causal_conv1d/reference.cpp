// Causal conv1d reference: fp64, plain loops over (document, channel, token), no threading, the
// extended-input formulation of op.h written out literally. The oracle for every other
// implementation.
#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/causal_conv1d/op.h"

namespace gdn::ops {

namespace {
double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// The extended input of one (document, channel): W-1 state values, then the document's inputs.
std::vector<double> extended(const Tensor& x_t, const Tensor& state_t, int64_t n, int64_t c,
                             int64_t s, int64_t L, int64_t W) {
  const int64_t C = x_t.size(1), S = W - 1;
  const double* x = x_t.ptr<double>();  // [T, C]
  std::vector<double> ext(static_cast<size_t>(L + S), 0.0);
  if (state_t.defined()) {
    const double* st = state_t.ptr<double>();  // [N, C, W-1]
    for (int64_t k = 0; k < S; ++k) ext[static_cast<size_t>(k)] = st[(n * C + c) * S + k];
  }
  for (int64_t t = 0; t < L; ++t) ext[static_cast<size_t>(S + t)] = x[(s + t) * C + c];
  return ext;
}

double preact(const double* w, const double* bias, int64_t c, const std::vector<double>& ext,
              int64_t t, int64_t W) {
  double z = bias ? bias[c] : 0.0;
  for (int64_t j = 0; j < W; ++j) z += w[c * W + j] * ext[static_cast<size_t>(t + j)];
  return z;
}

void forward(const CausalConv1dFwd& p) {
  const int64_t T = p.x.size(0), C = p.x.size(1), W = p.weight.size(1), S = W - 1;
  const double* w = p.weight.ptr<double>();                                       // [C, W]
  const double* bias = p.bias.defined() ? p.bias.ptr<double>() : nullptr;         // [C]
  double* y = p.y.ptr<double>();                                                  // [T, C]
  double* fin = p.final_state.defined() ? p.final_state.ptr<double>() : nullptr;  // [N, C, W-1]
  const std::vector<int64_t> cu = causal_conv1d_bounds(p.cu_seqlens, T);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t s = cu[n], L = cu[n + 1] - s;
    for (int64_t c = 0; c < C; ++c) {
      const auto ext = extended(p.x, p.initial_state, static_cast<int64_t>(n), c, s, L, W);
      for (int64_t t = 0; t < L; ++t) {
        const double z = preact(w, bias, c, ext, t, W);
        y[(s + t) * C + c] = p.silu ? z * sigmoid(z) : z;
      }
      if (fin)
        for (int64_t k = 0; k < S; ++k)
          fin[(static_cast<int64_t>(n) * C + c) * S + k] = ext[static_cast<size_t>(L + k)];
    }
  }
}

void backward(const CausalConv1dBwd& p) {
  const int64_t T = p.x.size(0), C = p.x.size(1), W = p.weight.size(1), S = W - 1;
  const double* w = p.weight.ptr<double>();                                // [C, W]
  const double* bias = p.bias.defined() ? p.bias.ptr<double>() : nullptr;  // [C]
  const double* dy = p.dy.ptr<double>();                                   // [T, C]
  const double* dfin =
      p.dfinal_state.defined() ? p.dfinal_state.ptr<double>() : nullptr;  // [N, C, W-1]
  double* dx = p.dx.ptr<double>();                                        // [T, C]
  double* dw = p.dweight.ptr<double>();                                   // [C, W]
  double* db = p.dbias.defined() ? p.dbias.ptr<double>() : nullptr;       // [C]
  double* dinit =
      p.dinitial_state.defined() ? p.dinitial_state.ptr<double>() : nullptr;  // [N, C, W-1]
  const std::vector<int64_t> cu = causal_conv1d_bounds(p.cu_seqlens, T);
  for (size_t n = 0; n + 1 < cu.size(); ++n) {
    const int64_t s = cu[n], L = cu[n + 1] - s, nn = static_cast<int64_t>(n);
    for (int64_t c = 0; c < C; ++c) {
      const auto ext = extended(p.x, p.initial_state, nn, c, s, L, W);
      std::vector<double> dext(ext.size(), 0.0);
      for (int64_t t = 0; t < L; ++t) {
        double u = dy[(s + t) * C + c];
        if (p.silu) {
          const double z = preact(w, bias, c, ext, t, W), sg = sigmoid(z);
          u *= sg * (1.0 + z * (1.0 - sg));
        }
        for (int64_t j = 0; j < W; ++j) {
          dext[static_cast<size_t>(t + j)] += w[c * W + j] * u;
          dw[c * W + j] += u * ext[static_cast<size_t>(t + j)];
        }
        if (db) db[c] += u;
      }
      if (dfin)
        for (int64_t k = 0; k < S; ++k)
          dext[static_cast<size_t>(L + k)] += dfin[(nn * C + c) * S + k];
      for (int64_t t = 0; t < L; ++t) dx[(s + t) * C + c] = dext[static_cast<size_t>(S + t)];
      if (dinit)
        for (int64_t k = 0; k < S; ++k) dinit[(nn * C + c) * S + k] = dext[static_cast<size_t>(k)];
    }
  }
}

const CausalConv1dTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(causal_conv1d_ref) {
  Registry::global().add_impl({"causal_conv1d", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
