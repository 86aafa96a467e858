// Gated RMSNorm on the CPU: fp32 storage, fp32 accumulation, rows in parallel with OpenMP.
// Backward keeps sigmoid(z) of the current row in a per-thread scratch row (one exp per element),
// reduces dw per thread into a private fp32 row and sums the rows in thread order, so the result is
// deterministic for a given thread count (the FLA / Liger per-SM partial-dw scheme, ops_notes §3).
#include <omp.h>

#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/gated_rmsnorm/op.h"

namespace gdn::ops {

namespace {
// exp(-v) overflows to +inf for v < -88.7, giving sigmoid = 0 exactly: no NaN at either end.
inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void forward(const GatedRmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const float* x = a.x.ptr<float>();  // [R, D]
  const float* z = a.z.ptr<float>();  // [R, D]
  const float* w = a.w.ptr<float>();  // [D]
  float* y = a.y.ptr<float>();        // [R, D]
  float* rstd = a.rstd.ptr<float>();  // [R]
  const float eps = static_cast<float>(a.eps);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const float* xr = x + i * D;  // [D]
    const float* zr = z + i * D;  // [D]
    float ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    rstd[i] = r;
    float* yr = y + i * D;  // [D]
    for (int64_t j = 0; j < D; ++j) yr[j] = xr[j] * r * w[j] * (zr[j] * sigmoid(zr[j]));
  }
}

void backward(const GatedRmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const float* x = a.x.ptr<float>();        // [R, D]
  const float* z = a.z.ptr<float>();        // [R, D]
  const float* w = a.w.ptr<float>();        // [D]
  const float* rstd = a.rstd.ptr<float>();  // [R]
  const float* dy = a.dy.ptr<float>();      // [R, D]
  float* dx = a.dx.ptr<float>();            // [R, D]
  float* dz = a.dz.ptr<float>();            // [R, D]
  float* dw = a.dw.ptr<float>();            // [D]
  const int nt = omp_get_max_threads();
  const size_t ud = static_cast<size_t>(D);
  std::vector<float> partial(static_cast<size_t>(nt) * ud, 0.0f);  // [nt, D] dw partials
  std::vector<float> sig(static_cast<size_t>(nt) * ud);            // [nt, D] sigmoid(z) of a row
#pragma omp parallel num_threads(nt)
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    float* my = partial.data() + t * ud;  // [D]
    float* s = sig.data() + t * ud;       // [D]
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R; ++i) {
      const float r = rstd[i];
      const float* xr = x + i * D;    // [D]
      const float* zr = z + i * D;    // [D]
      const float* dyr = dy + i * D;  // [D]
      float dot = 0;                  // sum_j g_j * w_j * xhat_j with g = dy * silu(z)
      for (int64_t j = 0; j < D; ++j) {
        s[j] = sigmoid(zr[j]);
        dot += dyr[j] * zr[j] * s[j] * w[j] * xr[j];
      }
      dot = dot * r / static_cast<float>(D);
      float* dxr = dx + i * D;  // [D]
      float* dzr = dz + i * D;  // [D]
      for (int64_t j = 0; j < D; ++j) {
        const float xhat = xr[j] * r;
        const float g = dyr[j] * zr[j] * s[j];
        dzr[j] = dyr[j] * xhat * w[j] * s[j] * (1.0f + zr[j] * (1.0f - s[j]));
        dxr[j] = r * (g * w[j] - xhat * dot);
        my[j] += g * xhat;
      }
    }
  }
  for (int t = 0; t < nt; ++t)
    for (int64_t j = 0; j < D; ++j) dw[j] += partial[static_cast<size_t>(t) * ud + j];
}

const GatedRmsNormTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(gated_rmsnorm_cpu) {
  Registry::global().add_impl({"gated_rmsnorm", "cpu.rowwise", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
