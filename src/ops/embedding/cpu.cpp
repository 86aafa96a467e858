// Embedding on the CPU: fp32. Forward copies rows, tokens in parallel. Backward splits the D
// columns into one block per thread (blocks a multiple of 16 floats, so no two threads write the
// same cache line); each thread walks every token in order and adds its slice of dy[t] into
// dW[ids[t]]. Every dW element therefore sums its terms in ascending t whatever the thread count:
// bitwise the serial result, no atomics, no sort, and balanced even when a few ids dominate.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "gdn/backend/registry.h"
#include "ops/embedding/op.h"

namespace gdn::ops {

namespace {
void forward(const EmbeddingFwd& a) {
  const int64_t T = a.ids.size(0), D = a.w.size(1);
  const float* w = a.w.ptr<float>();  // [V, D]
  float* y = a.y.ptr<float>();        // [T, D]
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = embedding_id(a.ids, t);
    std::memcpy(y + t * D, w + id * D, static_cast<size_t>(D) * sizeof(float));
  }
}

void backward(const EmbeddingBwd& a) {
  const int64_t T = a.ids.size(0), D = a.dy.size(1);
  const float* dy = a.dy.ptr<float>();  // [T, D]
  float* dw = a.dw.ptr<float>();        // [V, D]
  constexpr int64_t kLine = 16;         // floats per 64-byte cache line
  if (T == 0 || D == 0) return;
  const int64_t lines = (D + kLine - 1) / kLine;
  const int64_t nblocks = std::min<int64_t>(omp_get_max_threads(), lines);
  const int64_t block = (lines + nblocks - 1) / nblocks * kLine;  // columns per block
#pragma omp parallel for schedule(static, 1)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t d0 = std::min(D, b * block), d1 = std::min(D, d0 + block);
    for (int64_t t = 0; t < T; ++t) {
      const float* src = dy + t * D;                 // [D]
      float* dst = dw + embedding_id(a.ids, t) * D;  // [D]
      for (int64_t d = d0; d < d1; ++d) dst[d] += src[d];
    }
  }
}

const EmbeddingTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(embedding_cpu) {
  Registry::global().add_impl(
      {"embedding", "cpu.column_blocks", Backend::Cpu, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
