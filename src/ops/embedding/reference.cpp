// Embedding reference: fp64, plain loops in token order. The oracle for every other
// implementation.
#include "gdn/backend/registry.h"
#include "ops/embedding/op.h"

namespace gdn::ops {

namespace {
void forward(const EmbeddingFwd& a) {
  const int64_t T = a.ids.size(0), D = a.w.size(1);
  const double* w = a.w.ptr<double>();  // [V, D]
  double* y = a.y.ptr<double>();        // [T, D]
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = embedding_id(a.ids, t);
    for (int64_t d = 0; d < D; ++d) y[t * D + d] = w[id * D + d];
  }
}

void backward(const EmbeddingBwd& a) {
  const int64_t T = a.ids.size(0), D = a.dy.size(1);
  const double* dy = a.dy.ptr<double>();  // [T, D]
  double* dw = a.dw.ptr<double>();        // [V, D]
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = embedding_id(a.ids, t);
    for (int64_t d = 0; d < D; ++d) dw[id * D + d] += dy[t * D + d];
  }
}

const EmbeddingTable kTable{forward, backward};
}  // namespace

GDN_REGISTER(embedding_ref) {
  Registry::global().add_impl({"embedding", "ref", Backend::Ref, 0, nullptr, &kTable});
}

}  // namespace gdn::ops
