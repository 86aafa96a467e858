// RMSNorm on the CPU: fp32 storage, fp32 accumulation, rows in parallel with OpenMP.
// Backward reduces dw per thread into a private fp32 row, then sums the rows in thread order, so
// the result is deterministic for a given thread count.
#include <omp.h>

#include <cmath>
#include <vector>

#include "gdn/backend/registry.h"
#include "ops/rmsnorm/op.h"

namespace gdn::ops {

namespace {
void forward(const RmsNormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const float* x = a.x.ptr<float>();  // [R, D]
  const float* w = a.w.ptr<float>();  // [D]
  float* y = a.y.ptr<float>();        // [R, D]
  float* rstd = a.rstd.ptr<float>();  // [R]
  const float eps = static_cast<float>(a.eps);
  const float shift = a.zero_centred ? 1.0f : 0.0f;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const float* xr = x + i * D;
    float ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    rstd[i] = r;
    float* yr = y + i * D;
    for (int64_t j = 0; j < D; ++j) yr[j] = xr[j] * r * (shift + w[j]);
  }
}

void backward(const RmsNormBwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const float* x = a.x.ptr<float>();        // [R, D]
  const float* w = a.w.ptr<float>();        // [D]
  const float* rstd = a.rstd.ptr<float>();  // [R]
  const float* dy = a.dy.ptr<float>();      // [R, D]
  float* dx = a.dx.ptr<float>();            // [R, D]
  float* dw = a.dw.ptr<float>();            // [D]
  const float shift = a.zero_centred ? 1.0f : 0.0f;
  const int nt = omp_get_max_threads();
  std::vector<float> partial(static_cast<size_t>(nt) * static_cast<size_t>(D), 0.0f);  // [nt, D]
#pragma omp parallel num_threads(nt)
  {
    float* my = partial.data() + static_cast<size_t>(omp_get_thread_num()) * D;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R; ++i) {
      const float r = rstd[i];
      const float* xr = x + i * D;
      const float* dyr = dy + i * D;
      float dot = 0;
      for (int64_t j = 0; j < D; ++j) dot += dyr[j] * (shift + w[j]) * xr[j];
      dot = dot * r / static_cast<float>(D);
      float* dxr = dx + i * D;
      for (int64_t j = 0; j < D; ++j) {
        const float xhat = xr[j] * r;
        dxr[j] = r * (dyr[j] * (shift + w[j]) - xhat * dot);
        my[j] += dyr[j] * xhat;
      }
    }
  }
  for (int t = 0; t < nt; ++t)
    for (int64_t j = 0; j < D; ++j) dw[j] += partial[static_cast<size_t>(t) * D + j];
}

const RmsNormTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(rmsnorm_cpu) {
  Registry::global().add_impl({"rmsnorm", "cpu.rowwise", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
