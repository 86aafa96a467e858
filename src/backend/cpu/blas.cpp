#include "backend/cpu/blas.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include "gdn/core/env.h"
#include "gdn/core/error.h"

namespace gdn::cpu {

void init_runtime() {
  static std::once_flag once;
  std::call_once(once, [] {
#if defined(OPENBLAS_VERSION)
    openblas_set_num_threads(1);
#endif
    const int64_t n = env::get_int("GDN_NUM_THREADS");
    GDN_CHECK_HINT(n >= 0, "GDN_NUM_THREADS=0 keeps the OpenMP default",
                   "GDN_NUM_THREADS must be >= 0, got {}", n);
    if (n > 0) omp_set_num_threads(static_cast<int>(n));
  });
}

std::optional<std::string> better_openblas_core(const char* coretype_env, std::string_view chosen,
                                                bool avx2_fma, bool avx512) {
  if (coretype_env != nullptr || chosen != "Prescott") return std::nullopt;
  if (avx512) return "SkylakeX";
  if (avx2_fma) return "Haswell";
  return std::nullopt;
}

std::optional<std::string> better_openblas_core() {
#if defined(OPENBLAS_VERSION) && (defined(__x86_64__) || defined(__i386__))
  const char* core = openblas_get_corename();
  __builtin_cpu_init();
  return better_openblas_core(
      std::getenv("OPENBLAS_CORETYPE"), core != nullptr ? core : "",
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"));
#else
  return std::nullopt;
#endif
}

namespace {
void one_call(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(std::max<int64_t>(lda, 1)), b,
              static_cast<blasint>(std::max<int64_t>(ldb, 1)), beta, c,
              static_cast<blasint>(std::max<int64_t>(ldc, 1)));
}
}  // namespace

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  GDN_CHECK(m >= 0 && n >= 0 && k >= 0, "cpu gemm: negative size m = {}, n = {}, k = {}", m, n, k);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: C = beta C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  const int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (nt <= 1 || m * n * k < kSplitFlops) {
    one_call(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Split the larger side of C into nt slices of whole 16-row (or 16-column) groups: each slice
  // is one single-threaded call on the same A or B, so a slice's result does not depend on the
  // others, and the partition only on (m, n, k, nt).
  const bool by_rows = m >= n;
  const int64_t len = by_rows ? m : n, unit = 16;
  const int64_t groups = (len + unit - 1) / unit;
  const int parts = static_cast<int>(std::min<int64_t>(nt, groups));
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; ++p) {
    const int64_t g0 = groups * p / parts, g1 = groups * (p + 1) / parts;
    const int64_t i0 = g0 * unit, i1 = std::min(len, g1 * unit);
    if (i1 <= i0) continue;
    if (by_rows) {
      const float* ap = ta ? a + i0 : a + i0 * lda;  // rows i0.. of op(A)
      one_call(ta, tb, i1 - i0, n, k, alpha, ap, lda, b, ldb, beta, c + i0 * ldc, ldc);
    } else {
      const float* bp = tb ? b + i0 * ldb : b + i0;  // columns i0.. of op(B)
      one_call(ta, tb, m, i1 - i0, k, alpha, a, lda, bp, ldb, beta, c + i0, ldc);
    }
  }
}

}  // namespace gdn::cpu
