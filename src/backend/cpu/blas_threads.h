// Running OpenBLAS on the calling thread inside an op's OpenMP region.
//
// The pthreads build of OpenBLAS (the one CMake finds on Debian) splits any GEMM with
// m·n·k >= 4·65536 over its own thread pool, even when called from an OpenMP worker, and
// serialises concurrent callers on its server lock: a 64x64x256 attention tile made the hd = 256
// forward 15x slower (bench_attention), and the GDN chunk GEMMs lost their (document, head)
// parallelism. An op that parallelises with OpenMP holds this guard for its duration: the pool is
// set to one thread and restored afterwards. The OpenMP build of OpenBLAS already runs
// single-threaded inside a parallel region, so the guard does nothing there. The setting is
// process-wide: ops must not run concurrently from several host threads while holding it.
#pragma once

#include <cblas.h>

namespace gdn::cpu {

class BlasOnCallingThread {
 public:
  BlasOnCallingThread() {
#if defined(OPENBLAS_VERSION)
    if (openblas_get_parallel() == 1) {
      saved_ = openblas_get_num_threads();
      if (saved_ > 1) openblas_set_num_threads(1);
    }
#endif
  }
  ~BlasOnCallingThread() {
#if defined(OPENBLAS_VERSION)
    if (saved_ > 1) openblas_set_num_threads(saved_);
#endif
  }
  BlasOnCallingThread(const BlasOnCallingThread&) = delete;
  BlasOnCallingThread& operator=(const BlasOnCallingThread&) = delete;

 private:
  [[maybe_unused]] int saved_ = 0;
};

}  // namespace gdn::cpu
