// The CPU backend's one door to BLAS, and its threading contract.
//
// Threads: every CPU kernel parallelises with OpenMP, and OpenBLAS itself runs single-threaded
// (set once per process, below). The pthreads OpenBLAS that Debian links by default keeps a pool
// of its own whose idle threads spin (sched_yield) next to OpenMP's: on a 2-core VM that pool
// turned the default job's minutes into system time and, under its Prescott kernels, made a
// 2-thread GEMM round differently from run to run of the same step (issue 21). With one pool, a
// large GEMM is split over the OpenMP threads here, each slice one single-threaded cblas call.
//
// Determinism contract (docs/TRAINING.md "Determinism"): on the CPU every op's result is a
// function of its inputs, the OpenMP thread count and the OpenBLAS kernel set. The partition of a
// GEMM depends only on (M, N, K) and the thread count, so two runs with the same thread count give
// the same bits; another thread count may round differently (fp32 sums in another grouping).
//
// Shapes: cblas rejects a zero leading dimension and leaves nothing defined for an empty product,
// so gemm() handles M, N or K == 0 itself (C untouched, or C = beta C) and never hands BLAS a
// degenerate shape.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace gdn::cpu {

// Called once before the first CPU kernel (the resolver does): OpenBLAS on one thread, and
// GDN_NUM_THREADS (when > 0) as the OpenMP thread count. Idempotent and thread-safe.
void init_runtime();

// Row-major C[m, n] = alpha op(A) op(B) + beta C (op = transpose when ta / tb); beta == 0 ignores
// what C held. Inside an OpenMP parallel region it runs on the calling thread; outside one, a
// product of at least kSplitFlops multiply-adds is split over the OpenMP threads by rows or
// columns of C.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// OpenBLAS's dynamic dispatch falls back to its oldest x86 kernels (Prescott: SSE3) on a CPU it
// does not recognise by family and model, which virtual machines often report ("Intel(R) Xeon(R)
// Processor", "AMD EPYC"): GEMMs then run 2-3x slower. When that happened and the CPU has the
// instructions of a newer kernel set (AVX2 + FMA: Haswell; AVX-512 F/BW/DQ/VL: SkylakeX), returns
// that set's name; otherwise (a recognised CPU, OPENBLAS_CORETYPE set by the user, no better set)
// nothing. OpenBLAS reads OPENBLAS_CORETYPE only when it loads, so a program applies the answer
// by setting it and restarting itself (apps/gdntrain/main.cpp).
std::optional<std::string> better_openblas_core();
// The decision itself, from what better_openblas_core() reads (tests): the OPENBLAS_CORETYPE
// value (null when unset), OpenBLAS's chosen core, and the CPU's AVX2 + FMA and AVX-512 support.
std::optional<std::string> better_openblas_core(const char* coretype_env, std::string_view chosen,
                                                bool avx2_fma, bool avx512);

// Below this many multiply-adds a GEMM stays on one thread (a slice would cost more in fork and
// join than it saves).
inline constexpr int64_t kSplitFlops = int64_t{1} << 21;

}  // namespace gdn::cpu
