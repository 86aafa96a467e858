// What the blocks share (step.h): the pre-norms, the residual GEMM, the gradient groups' zeroing.
#include "gdn/core/profile.h"
#include "model/step.h"
#include "ops/axpy/op.h"
#include "ops/gemm/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn::model {

using namespace gdn::ops;

void Step::zero_group(size_t g) const {
  if (!live || grad_groups.empty()) return;
  const Tensor& t = grad_groups.at(g);
  if (t.defined()) zero_bytes(t.data(), dev, static_cast<size_t>(t.nbytes()));
}

void copy_tensor(const Tensor& dst, const Tensor& src) {
  copy_bytes(dst.data(), dst.device(), src.data(), src.device(), static_cast<size_t>(src.nbytes()));
}

void residual_linear(const Tensor& res, const Tensor& x, const Tensor& W, const Tensor& out) {
  copy_tensor(out, res);
  gemm({.a = x, .b = W, .c = out, .trans_b = true, .beta = 1.0});
}

void norm_forward(Step& st, const Tensor& x, int64_t w, NormActs& n, bool again) {
  st.place(n.rstd, st.stat, st.full, again, {st.T});
  st.place(n.y, st.act, st.cheap, again, {st.T, st.cfg.hidden_size});
  if (!st.run_op(again, st.cheap)) return;
  ProfileRange pr("rmsnorm.fwd");
  rmsnorm_forward({.x = x,
                   .w = st.norm_w(w),
                   .y = n.y,
                   .rstd = n.rstd,
                   .eps = st.cfg.rms_norm_eps,
                   .zero_centred = st.zc()});
}

void norm_backward(Step& st, const Tensor& x, int64_t w, const NormActs& n, const Tensor& dy,
                   const Tensor& dtmp, const Tensor& dh) {
  ProfileRange pr("rmsnorm.bwd");
  rmsnorm_backward({.x = x,
                    .w = st.norm_w(w),
                    .rstd = n.rstd,
                    .dy = dy,
                    .dx = dtmp,
                    .dw = st.G(w),
                    .zero_centred = st.zc()});
  axpy({.x = dtmp, .y = dh, .alpha = 1.0});
}

}  // namespace gdn::model
