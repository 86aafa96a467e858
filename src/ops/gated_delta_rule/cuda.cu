// Gated delta rule on CUDA ("cuda.chunk64"): bf16 q, k, v, o and their gradients, fp32 g, beta,
// states and their gradients (op.h has the contract). The chunked WY/UT algorithm with C = 64 as a
// decomposed kernel chain; this file plans the op's scratch and issues the chain.
//
//   forward:  [index] [l2norm] prep (W, U) -> state_fwd (H, V', hT) -> output (o)
//   GDN_FUSED_FWD=1: [index] [l2norm] prep (W, U, P) -> state_fwd writing o and hT: the state stays
//             on chip from chunk to chunk and the output is formed there (no snapshots in memory,
//             no output kernel; one sequential pass per (document, head, dv block) does all the
//             state-dependent work, so it favours many documents over one long one)
//   backward: [index] [l2norm] prep -> state_fwd -> dvloc -> state_bwd (dH, dV', dh0) -> dqk
//             (dq_h, dk_h, dg part) -> wy (dv, dbeta, dg, dk_h +=) -> reduce (dq, dk)
// The forward saves nothing (op.h): the backward rebuilds W, U, the snapshots and V' (as FLA
// rebuilds w, u, h and v_new; FLA also keeps T, which we re-invert in fp32 instead).
//
// Scratch (Context::scratch, one request per call, carved at 256-byte boundaries): the chunk index
// unless a GdrChunkIndexScope provides it; q, k normalised (l2norm only); W [T, Hv, dk] and
// U / V' [T, Hv, dv] bf16; the chunk-start states H [chunks, Hv, dk, dv] bf16; backward adds
// dV'_loc [T, Hv, dv] fp32, dV' [T, Hv, dv] bf16, the chunk-end state gradients dH bf16, dq_h and
// dk_h [T, Hv, dk] fp32 and a dg part [T, Hv] fp32. At T = 8192, Hv = 32, dk = dv = 128 that is
// about 0.5 GB for the forward and 1.2 GB for the backward.
//
// Nothing synchronises the host; every launch goes to the compute stream. Device-resident
// cu_seqlens are never read on the host: the index sanitises them (cuda.h).
#include <climits>
#include <cstdint>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "gdn/core/env.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/cuda_kernels.h"
#include "ops/gated_delta_rule/op.h"

namespace gdn::ops {

namespace {

using gdr::bf16_t;
constexpr const char* kWhat = "gated_delta_rule (cuda)";

// Offsets into one scratch request.
class ScratchPlan {
 public:
  size_t add(int64_t bytes) {
    const size_t off = total_;
    total_ += (static_cast<size_t>(bytes) + 255) / 256 * 256;
    return off;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

bool aligned16(const Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.data()) % 16 == 0;
}

template <class T>
T* at(char* base, size_t off) {
  return reinterpret_cast<T*>(base + off);
}

const bf16_t* bf(const Tensor& t) { return reinterpret_cast<const bf16_t*>(t.ptr<bf16>()); }
bf16_t* bf_out(const Tensor& t) { return reinterpret_cast<bf16_t*>(t.ptr<bf16>()); }
const float* f32_or_null(const Tensor& t) { return t.defined() ? t.ptr<float>() : nullptr; }
float* f32_out_or_null(const Tensor& t) { return t.defined() ? t.ptr<float>() : nullptr; }

gdr::Dims make_dims(const Tensor& q, const Tensor& v, const Tensor& cu, double scale, bool l2) {
  gdr::Dims d{};
  const int64_t T = q.size(0), N = cu.size(0) - 1;
  GDN_CHECK(T < (int64_t{1} << 30) && N < (int64_t{1} << 30),
            "{}: {} tokens / {} documents exceed the implementation's int32 indexing", kWhat, T, N);
  d.T = static_cast<int>(T);
  d.N = static_cast<int>(N);
  d.Hk = static_cast<int>(q.size(1));
  d.dk = static_cast<int>(q.size(2));
  d.Hv = static_cast<int>(v.size(1));
  d.dv = static_cast<int>(v.size(2));
  GDN_CHECK(d.Hv <= 65535, "{}: Hv = {} value heads exceed the grid's y limit 65535", kWhat, d.Hv);
  d.r = d.Hv / d.Hk;
  d.KP = gdr::pad16(d.dk);
  d.VP = gdr::pad16(d.dv);
  d.nt_max = gdr_max_chunks(T, N);
  d.scale = static_cast<float>(gdr_effective_scale(scale, d.dk));
  d.l2norm = l2;
  return d;
}

// The chunk index: the caller's (a matching GdrChunkIndexScope) or built into scratch at `off`.
const int32_t* chunk_index(const Tensor& cu, const gdr::Dims& d, char* base, size_t off,
                           cudaStream_t s) {
  if (const GdrChunkIndexScope* sc = GdrChunkIndexScope::find(cu, d.T))
    return sc->index().ptr<int32_t>();
  int32_t* ix = at<int32_t>(base, off);
  gdr::launch_build_index(cu.ptr<int32_t>(), d.N, d.T, d.nt_max, ix, s);
  return ix;
}

// Scratch shared by forward and backward (the forward chain's intermediates).
// fused: the GDN_FUSED_FWD route keeps no snapshots H but the score matrices P.
struct FwdScratch {
  size_t index, qn, kn, W, U, H, P;
};
FwdScratch plan_fwd(ScratchPlan& sp, const gdr::Dims& d, bool fused) {
  const int64_t T = d.T;
  FwdScratch f{};
  f.index = sp.add(gdr_chunk_index_numel(T, d.N) * 4);
  f.qn = sp.add(d.l2norm ? T * d.Hk * d.dk * 2 : 0);
  f.kn = sp.add(d.l2norm ? T * d.Hk * d.dk * 2 : 0);
  f.W = sp.add(T * d.Hv * d.dk * 2);
  f.U = sp.add(T * d.Hv * d.dv * 2);
  f.H = sp.add(fused ? 0 : d.nt_max * d.Hv * d.dk * d.dv * 2);
  f.P = sp.add(fused ? d.nt_max * d.Hv * gdr::kC * gdr::kC * 2 : 0);
  return f;
}

struct FwdPtrs {
  gdr::IndexView ix;
  const bf16_t* qn;
  const bf16_t* kn;
  bf16_t* W;
  bf16_t* U;  // U, then V'
  bf16_t* H;
};

// The forward chain up to (not including) the output: index, l2norm, W and U (and P when fused),
// then the state pass (which, fused, writes o as well).
FwdPtrs run_fwd_chain(const gdr::Dims& d, const FwdScratch& f, char* base, const Tensor& q,
                      const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const Tensor& cu, const Tensor& h0, float* hT, bf16_t* fused_o,
                      cudaStream_t s) {
  FwdPtrs p{};
  p.ix = gdr::index_view(chunk_index(cu, d, base, f.index, s), d.N);
  p.qn = bf(q);
  p.kn = bf(k);
  if (d.l2norm) {
    bf16_t* qn = at<bf16_t>(base, f.qn);
    bf16_t* kn = at<bf16_t>(base, f.kn);
    gdr::launch_l2norm(d, bf(q), bf(k), qn, kn, s);
    p.qn = qn;
    p.kn = kn;
  }
  p.W = at<bf16_t>(base, f.W);
  p.U = at<bf16_t>(base, f.U);
  p.H = at<bf16_t>(base, f.H);
  bf16_t* P = fused_o != nullptr ? at<bf16_t>(base, f.P) : nullptr;
  gdr::launch_prep(d, p.ix, p.kn, bf(v), g.ptr<float>(), beta.ptr<float>(), p.W, p.U, p.qn, P, s);
  if (fused_o != nullptr)
    gdr::launch_state_fwd_fused(d, p.ix, p.W, p.qn, p.kn, g.ptr<float>(), f32_or_null(h0), p.U, P,
                                hT, fused_o, s);
  else
    gdr::launch_state_fwd(d, p.ix, p.W, p.kn, g.ptr<float>(), f32_or_null(h0), p.U, p.H, hT, s);
  return p;
}

void forward(const GatedDeltaRuleFwd& a) {
  gdr::Dims d = make_dims(a.q, a.v, a.cu_seqlens, a.scale, a.use_qk_l2norm);
  d.vec = d.dk % 8 == 0 && d.dv % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
          aligned16(a.h0);
  const bool fused = env::get_bool("GDN_FUSED_FWD");
  cuda::Context& ctx = cuda::Context::get();
  ScratchPlan sp;
  const FwdScratch f = plan_fwd(sp, d, fused);
  char* base = static_cast<char*>(ctx.scratch(sp.total()));
  cudaStream_t s = ctx.stream();
  const FwdPtrs p = run_fwd_chain(d, f, base, a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.h0,
                                  f32_out_or_null(a.hT), fused ? bf_out(a.o) : nullptr, s);
  if (!fused) gdr::launch_output(d, p.ix, p.qn, p.kn, p.U, p.H, a.g.ptr<float>(), bf_out(a.o), s);
}

void backward(const GatedDeltaRuleBwd& a) {
  gdr::Dims d = make_dims(a.q, a.v, a.cu_seqlens, a.scale, a.use_qk_l2norm);
  d.vec = d.dk % 8 == 0 && d.dv % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
          aligned16(a.h0) && aligned16(a.dout) && aligned16(a.dhT);
  cuda::Context& ctx = cuda::Context::get();
  ScratchPlan sp;
  const FwdScratch f = plan_fwd(sp, d, false);
  const int64_t T = d.T;
  const size_t o_dvloc = sp.add(T * d.Hv * d.dv * 4);
  const size_t o_dvp = sp.add(T * d.Hv * d.dv * 2);
  const size_t o_dH = sp.add(d.nt_max * d.Hv * d.dk * d.dv * 2);
  const size_t o_dqh = sp.add(T * d.Hv * d.dk * 4);
  const size_t o_dkh = sp.add(T * d.Hv * d.dk * 4);
  const size_t o_dgp = sp.add(T * d.Hv * 4);
  char* base = static_cast<char*>(ctx.scratch(sp.total()));
  cudaStream_t s = ctx.stream();
  const FwdPtrs p = run_fwd_chain(d, f, base, a.q, a.k, a.v, a.g, a.beta, a.cu_seqlens, a.h0,
                                  nullptr, nullptr, s);
  float* dvloc = at<float>(base, o_dvloc);
  bf16_t* dvp = at<bf16_t>(base, o_dvp);
  bf16_t* dH = at<bf16_t>(base, o_dH);
  float* dqh = at<float>(base, o_dqh);
  float* dkh = at<float>(base, o_dkh);
  float* dgp = at<float>(base, o_dgp);
  const float* g = a.g.ptr<float>();
  gdr::launch_dvloc(d, p.ix, p.qn, p.kn, bf(a.dout), g, dvloc, s);
  gdr::launch_state_bwd(d, p.ix, p.qn, p.kn, p.W, bf(a.dout), dvloc, g, f32_or_null(a.dhT), dvp, dH,
                        f32_out_or_null(a.dh0), s);
  gdr::launch_bwd_dqk(d, p.ix, p.qn, p.kn, p.U, bf(a.dout), p.H, dH, g, dqh, dkh, dgp, s);
  gdr::launch_bwd_wy(d, p.ix, p.kn, bf(a.v), dvp, p.H, g, a.beta.ptr<float>(), dgp, dkh,
                     bf_out(a.dv), a.dg.ptr<float>(), a.dbeta.ptr<float>(), s);
  gdr::launch_reduce_qk(d, bf(a.q), bf(a.k), dqh, dkh, bf_out(a.dq), bf_out(a.dk), s);
}

const GatedDeltaRuleTable kTable{forward, backward};

}  // namespace

GDN_REGISTER(gated_delta_rule_cuda) {
  Registry::global().add_impl(
      {"gated_delta_rule", "cuda.chunk64", Backend::Cuda, 10, nullptr, &kTable});
}

}  // namespace gdn::ops
