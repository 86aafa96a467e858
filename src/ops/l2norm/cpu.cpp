// L2 normalisation on the CPU: fp32 storage, fp32 accumulation, rows in parallel with OpenMP.
// Rows are independent (no cross-row reduction), so the result does not depend on the thread count.
#include <cmath>

#include "gdn/backend/registry.h"
#include "ops/l2norm/op.h"

namespace gdn::ops {

namespace {
void forward(const L2NormFwd& a) {
  const int64_t R = a.x.size(0), D = a.x.size(1);
  const float* x = a.x.ptr<float>();  // [R, D]
  float* y = a.y.ptr<float>();        // [R, D]
  float* rstd = a.rstd.ptr<float>();  // [R]
  const float eps = static_cast<float>(a.eps);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const float* xr = x + i * D;  // [D]
    float ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss + eps);
    rstd[i] = r;
    float* yr = y + i * D;  // [D]
    for (int64_t j = 0; j < D; ++j) yr[j] = xr[j] * r;
  }
}

void backward(const L2NormBwd& a) {
  const int64_t R = a.y.size(0), D = a.y.size(1);
  const float* y = a.y.ptr<float>();        // [R, D]
  const float* rstd = a.rstd.ptr<float>();  // [R]
  const float* dy = a.dy.ptr<float>();      // [R, D]
  float* dx = a.dx.ptr<float>();            // [R, D]
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < R; ++i) {
    const float* yr = y + i * D;    // [D]
    const float* dyr = dy + i * D;  // [D]
    float dot = 0;
    for (int64_t j = 0; j < D; ++j) dot += dyr[j] * yr[j];
    const float r = rstd[i];
    float* dxr = dx + i * D;  // [D]
    for (int64_t j = 0; j < D; ++j) dxr[j] = r * (dyr[j] - yr[j] * dot);
  }
}

const L2NormTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(l2norm_cpu) {
  Registry::global().add_impl({"l2norm", "cpu.rowwise", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
