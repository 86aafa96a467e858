// GDN gates on the CPU: fp32, elementwise in parallel with OpenMP.
// The per-head reductions of backward (dA_log, ddt_bias) are summed over fixed blocks of kBlock
// tokens, then the block partials are added in block order: the result is the same for any
// thread count, and the two-level sum keeps the fp32 rounding error at about
// (kBlock + T / kBlock) ulps instead of T ulps.
#include <algorithm>
#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/gdn_gates/op.h"

namespace gdn::ops {

namespace {
constexpr int64_t kBlock = 128;
constexpr float kThreshold = static_cast<float>(kGdnSoftplusThreshold);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void forward(const GdnGatesFwd& p) {
  const int64_t T = p.a.size(0), H = p.a.size(1);
  const float* a = p.a.ptr<float>();                 // [T, Hv]
  const float* b = p.b.ptr<float>();                 // [T, Hv]
  const float* A_log = p.A_log.ptr<float>();         // [Hv]
  const float* dt_bias = p.dt_bias.ptr<float>();     // [Hv]
  float* g = p.g.ptr<float>();                       // [T, Hv]
  float* beta = p.beta.ptr<float>();                 // [T, Hv]
  std::vector<float> neg_e(static_cast<size_t>(H));  // [Hv] -exp(A_log)
  for (int64_t h = 0; h < H; ++h) neg_e[static_cast<size_t>(h)] = -std::exp(A_log[h]);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = t * H + h;
      const float x = a[i] + dt_bias[h];
      const float sp = x > kThreshold ? x : std::log1p(std::exp(x));
      g[i] = neg_e[static_cast<size_t>(h)] * sp;
      beta[i] = sigmoid(b[i]);
    }
}

void backward(const GdnGatesBwd& p) {
  const int64_t T = p.a.size(0), H = p.a.size(1);
  const float* a = p.a.ptr<float>();                 // [T, Hv]
  const float* b = p.b.ptr<float>();                 // [T, Hv]
  const float* A_log = p.A_log.ptr<float>();         // [Hv]
  const float* dt_bias = p.dt_bias.ptr<float>();     // [Hv]
  const float* dg = p.dg.ptr<float>();               // [T, Hv]
  const float* dbeta = p.dbeta.ptr<float>();         // [T, Hv]
  float* da = p.da.ptr<float>();                     // [T, Hv]
  float* db = p.db.ptr<float>();                     // [T, Hv]
  float* dA_log = p.dA_log.ptr<float>();             // [Hv]
  float* ddt_bias = p.ddt_bias.ptr<float>();         // [Hv]
  std::vector<float> neg_e(static_cast<size_t>(H));  // [Hv] -exp(A_log)
  for (int64_t h = 0; h < H; ++h) neg_e[static_cast<size_t>(h)] = -std::exp(A_log[h]);
  const int64_t nblk = (T + kBlock - 1) / kBlock;
  // Block partials: [nblk, 2, Hv]; row 0 = sum dg * g, row 1 = sum da.
  std::vector<float> part(static_cast<size_t>(nblk * 2 * H), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblk; ++blk) {
    float* pa = part.data() + blk * 2 * H;  // [Hv]
    float* pd = pa + H;                     // [Hv]
    const int64_t t1 = std::min(T, (blk + 1) * kBlock);
    for (int64_t t = blk * kBlock; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t i = t * H + h;
        const float x = a[i] + dt_bias[h], ne = neg_e[static_cast<size_t>(h)];
        float sp, dsp;
        if (x > kThreshold) {
          sp = x;
          dsp = 1.0f;
        } else {
          const float ex = std::exp(x);  // <= e^20: no overflow; shared by softplus and sigmoid
          sp = std::log1p(ex);
          dsp = ex / (1.0f + ex);
        }
        const float dai = dg[i] * ne * dsp;
        da[i] = dai;
        pa[h] += dg[i] * (ne * sp);
        pd[h] += dai;
        const float s = sigmoid(b[i]);
        db[i] = dbeta[i] * s * (1.0f - s);
      }
  }
  for (int64_t h = 0; h < H; ++h) {
    float sa = 0, sd = 0;
    for (int64_t blk = 0; blk < nblk; ++blk) {
      sa += part[static_cast<size_t>(blk * 2 * H + h)];
      sd += part[static_cast<size_t>(blk * 2 * H + H + h)];
    }
    dA_log[h] += sa;
    ddt_bias[h] += sd;
  }
}

const GdnGatesTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gdn_gates_cpu) {
  Registry::global().add_impl({"gdn_gates", "cpu.elementwise", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
