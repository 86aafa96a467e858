// Row-major GEMM through cuBLASLt with cached plans (cublaslt.h has the contract).
//
// Row-major to cuBLASLt's column-major: a row-major [R, C] buffer with leading dimension ld is the
// column-major [C, R] matrix with the same leading dimension, so C = op(A) op(B) (row-major,
// [m, n]) is computed as the column-major product C^T [n, m] = op(B)^T op(A)^T, with our B as
// cuBLASLt's first operand:
//   cuBLASLt A := b, stored col-major [n, k] (ld ldb) when !trans_b (op N), [k, n] if trans_b (op
//   T) cuBLASLt B := a, stored col-major [k, m] (ld lda) when !trans_a (op N), [m, k] if trans_a
//   (op T) cuBLASLt C = D := c, col-major [n, m] (ld ldc)
#include "backend/cuda/cublaslt.h"

#include <cuda_bf16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"

namespace gdn::cuda {

namespace {

struct PlanKey {
  int64_t m, n, k;
  int64_t lda, ldb, ldc;
  bool ta, tb;
  bool c_f32;
  uint32_t align_a, align_b, align_c;
  auto tie() const {
    return std::tie(m, n, k, lda, ldb, ldc, ta, tb, c_f32, align_a, align_b, align_c);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t lb = nullptr;  // cuBLASLt's A: our b
  cublasLtMatrixLayout_t la = nullptr;  // cuBLASLt's B: our a
  cublasLtMatrixLayout_t lc = nullptr;  // C and D
  cublasLtMatmulAlgo_t algo{};
};

// The largest power of two <= 256 that divides the address (cuBLASLt's alignment preferences).
uint32_t alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && u % a != 0) a /= 2;
  return a;
}

// A never-seen packed length must not cost a heuristic query (~2 ms each, seen on the H200
// 2026-11-29: a linear layer's first call at a new T took 7x its steady time). Algorithms are
// therefore also cached by a coarse key, every dimension rounded up to a power of two, and a new
// exact shape first tries the algorithm of its bucket through cublasLtMatmulAlgoCheck (host-only,
// cheap); only when that check fails does it run the heuristic.
struct AlgoKey {
  int64_t m, n, k;
  bool ta, tb, c_f32;
  uint32_t align_a, align_b, align_c;
  auto tie() const { return std::tie(m, n, k, ta, tb, c_f32, align_a, align_b, align_c); }
  bool operator<(const AlgoKey& o) const { return tie() < o.tie(); }
};

int64_t pow2_bucket(int64_t x) {
  int64_t b = 1;
  while (b < x) b *= 2;
  return b;
}

AlgoKey algo_key(const PlanKey& k) {
  return {pow2_bucket(k.m), pow2_bucket(k.n), pow2_bucket(k.k), k.ta,     k.tb,
          k.c_f32,          k.align_a,        k.align_b,        k.align_c};
}

// Algorithms by bucket (guarded by plan_for's mutex).
std::map<AlgoKey, cublasLtMatmulAlgo_t>& algo_cache() {
  static auto* cache = new std::map<AlgoKey, cublasLtMatmulAlgo_t>();
  return *cache;
}

Plan make_plan(const PlanKey& key, const char* what) {
  Context& ctx = Context::get();
  Plan p;
  GDN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;   // on our b
  const cublasOperation_t op_second = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // on our a
  GDN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                                  sizeof(op_first)));
  GDN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                                  sizeof(op_second)));
  const uint64_t M = static_cast<uint64_t>(key.m), N = static_cast<uint64_t>(key.n),
                 K = static_cast<uint64_t>(key.k);
  // Stored (pre-op) column-major shapes; the leading dimension is the row stride of our buffer.
  const uint64_t b_rows = key.tb ? K : N, b_cols = key.tb ? N : K;
  const uint64_t a_rows = key.ta ? M : K, a_cols = key.ta ? K : M;
  GDN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, b_rows, b_cols, key.ldb));
  GDN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, a_rows, a_cols, key.lda));
  GDN_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.lc, key.c_f32 ? CUDA_R_32F : CUDA_R_16BF, N, M, key.ldc));

  auto cached = algo_cache().find(algo_key(key));
  if (cached != algo_cache().end()) {
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(ctx.cublaslt(), p.op, p.lb, p.la, p.lc, p.lc, &cached->second,
                                &check) == CUBLAS_STATUS_SUCCESS &&
        check.state == CUBLAS_STATUS_SUCCESS && check.workspaceSize <= ctx.workspace_bytes()) {
      p.algo = cached->second;
      return p;
    }
  }

  cublasLtMatmulPreference_t pref = nullptr;
  GDN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    GDN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  };
  const size_t ws = ctx.workspace_bytes();
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
  const uint32_t schemes =
      CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | (key.c_f32 ? CUBLASLT_REDUCTION_SCHEME_INPLACE : 0u);
  set_pref(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.cublaslt(), p.op, p.lb, p.la, p.lc,
                                                           p.lc, pref, 1, &heur, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  GDN_CHECK_HINT(st == CUBLAS_STATUS_SUCCESS && found > 0 && heur.state == CUBLAS_STATUS_SUCCESS,
                 "the shapes, transposes and pointer alignments above are what cuBLASLt was asked",
                 "{}: cuBLASLt has no algorithm for M={} N={} K={} trans_a={} trans_b={} C={} "
                 "(lda {} ldb {} ldc {}; alignments a {} b {} c {} bytes): {}",
                 what, key.m, key.n, key.k, key.ta, key.tb, key.c_f32 ? "F32" : "BF16", key.lda,
                 key.ldb, key.ldc, key.align_a, key.align_b, key.align_c,
                 cublasGetStatusString(st));
  p.algo = heur.algo;
  algo_cache().emplace(algo_key(key), heur.algo);
  return p;
}

const Plan& plan_for(const PlanKey& key, const char* what) {
  static std::mutex mu;
  // Leaked on purpose: descriptors must not be destroyed after the CUDA runtime unloads.
  static auto* plans = new std::map<PlanKey, Plan>();
  std::lock_guard lock(mu);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, make_plan(key, what)).first;
  return it->second;
}

}  // namespace

void lt_matmul(const LtMatmul& g) {
  GDN_CHECK(g.m >= 1 && g.n >= 1 && g.k >= 1, "{}: internal: empty product M={} N={} K={}", g.what,
            g.m, g.n, g.k);
  GDN_CHECK(g.lda >= (g.trans_a ? g.m : g.k) && g.ldb >= (g.trans_b ? g.k : g.n) && g.ldc >= g.n,
            "{}: internal: leading dimensions lda {} ldb {} ldc {} too small for M={} N={} K={}",
            g.what, g.lda, g.ldb, g.ldc, g.m, g.n, g.k);
  Context& ctx = Context::get();
  const PlanKey key{g.m,       g.n,       g.k,     g.lda,          g.ldb,          g.ldc,
                    g.trans_a, g.trans_b, g.c_f32, alignment(g.a), alignment(g.b), alignment(g.c)};
  const Plan& p = plan_for(key, g.what);
  GDN_CUBLAS_CHECK(cublasLtMatmul(ctx.cublaslt(), p.op, &g.alpha, g.b, p.lb, g.a, p.la, &g.beta,
                                  g.c, p.lc, g.c, p.lc, &p.algo, ctx.workspace(),
                                  ctx.workspace_bytes(), ctx.stream()));
#ifndef NDEBUG
  note_drain();
  GDN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));  // fault at its own call in debug builds
#endif
}

}  // namespace gdn::cuda
