// Gated delta rule on CUDA ("cuda.chunk64"): bf16 q, k, v, o and their gradients, fp32 g, beta,
// states and their gradients (op.h has the contract). The chunked WY/UT algorithm with C = 64 as a
// decomposed kernel chain; this file plans the op's scratch and issues the chain. Two routes:
//
// fast (cuda_fast.h; dk, dv <= 128, multiples of 8, 16-byte aligned tensors): mma.sync kernels
//   with the sequential passes' state in registers:
//   forward:  [index] [l2norm] prep (gamma, W, U) -> state_fwd (Ht, Vt, hT) -> output (o), the
//             output beside the state pass at few documents (cuda_fast.h: fast_state_output)
//   backward: [index] [l2norm] prep (+ T) and dvloc (one grid) -> state_fwd -> state_bwd (dHt,
//             dVt, dh0) -> dqkw (dq, dk summed over a key head's value heads, dW, dg part) ->
//             wy (dv, dbeta, dg, dk +=) -> l2norm backward (dq, dk)
// generic (cuda_kernels.h, "cuda.chunk64_generic"; any dims up to 256, unaligned tensors; every
//   shape with GDN_OP_GATED_DELTA_RULE=cuda.chunk64_generic): WMMA kernels
//   forward:  [index] [l2norm] prep (W, U) -> state_fwd (H, V', hT) -> output (o)
//   backward: [index] [l2norm] prep -> state_fwd -> dvloc -> state_bwd (dH, dV', dh0) -> dqk
//             (dq_h, dk_h, dg part) -> wy (dv, dbeta, dg, dk_h +=) -> reduce (dq, dk)
// By default the forward saves nothing (op.h): the backward rebuilds W, U, the snapshots and V' (as
// FLA rebuilds w, u, h and v_new). Given the optional `saved` (op.h has its layout, which is the
// fast route's Ht, Vt, W, T and gam), the forward also writes the state pass's output and the
// chunk factors there and the backward skips its state pass (and, on the fast route, prep):
//   fast:     the forward's prep writes W, T and gam and its state pass Ht and Vt into `saved`
//             instead of scratch; the backward runs no prep (only dV'_loc, from dO) and its kernels
//             read them from `saved`
//   generic:  the forward transposes its H and V' into `saved` (cuda_saved.cu) and runs the fast
//             route's prep for W, T and gam where a fast backward could read them; the backward
//             runs prep (W, U), then transposes `saved` back into H and V' (over U) instead of the
//             pass
// Either backward reads what either forward wrote: one layout, one meaning.
//
// Scratch (Context::scratch, one request per call, carved at 256-byte boundaries): the chunk index
// unless a GdrChunkIndexScope provides it; q, k normalised (l2norm only); W [T, Hv, dk] and U
// [T, Hv, dv] bf16; the fast route's gam [chunks, Hv, 64] fp32, Ht [chunks, Hv, dv, dk] and Vt
// [chunks, Hv, dv, 64] bf16, and in the backward Tinv [chunks, Hv, 64, 64] bf16, dvlocT
// [chunks, Hv, dv, 64] fp32, dHt, dVt bf16, dq and dk [T, Hk, dk] fp32 and a dg part [T, Hv]
// fp32 (dW reuses W once the reverse pass is done with it); the generic route's chunk-start states
// H [chunks, Hv, dk, dv] bf16 (V' over U), and in the backward dV'_loc [T, Hv, dv] fp32, dV' bf16,
// dH bf16, dq_h, dk_h and the dg part. With `saved` the fast route keeps Ht, Vt, W, gam (and in
// the backward T) there instead, and its backward needs no U (dW still takes a W-sized buffer).
//
// Nothing synchronises the host; every launch goes to the compute stream. Device-resident
// cu_seqlens are never read on the host: the index sanitises them (cuda.h).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/gated_delta_rule/cuda.h"
#include "ops/gated_delta_rule/cuda_fast.h"
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

// The dims of a batch of T tokens in N documents (no tensors: the workspace bound uses it too).
gdr::Dims make_dims(int64_t T, int64_t N, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                    double scale, bool l2) {
  gdr::Dims d{};
  GDN_CHECK(T < (int64_t{1} << 30) && N < (int64_t{1} << 30),
            "{}: {} tokens / {} documents exceed the implementation's int32 indexing", kWhat, T, N);
  d.T = static_cast<int>(T);
  d.N = static_cast<int>(N);
  d.Hk = static_cast<int>(Hk);
  d.dk = static_cast<int>(dk);
  d.Hv = static_cast<int>(Hv);
  d.dv = static_cast<int>(dv);
  GDN_CHECK(d.Hv <= 65535, "{}: Hv = {} value heads exceed the grid's y limit 65535", kWhat, d.Hv);
  d.r = d.Hv / d.Hk;
  d.KP = gdr::pad16(d.dk);
  d.VP = gdr::pad16(d.dv);
  d.nt_max = gdr_max_chunks(T, N);
  d.scale = static_cast<float>(gdr_effective_scale(scale, d.dk));
  d.l2norm = l2;
  return d;
}
gdr::Dims make_dims(const Tensor& q, const Tensor& v, const Tensor& cu, double scale, bool l2) {
  return make_dims(q.size(0), cu.size(0) - 1, q.size(1), v.size(1), q.size(2), v.size(2), scale,
                   l2);
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

// The chunk index and the l2norm, common to both routes.
struct Prologue {
  gdr::IndexView ix;
  const bf16_t* qn;
  const bf16_t* kn;
};
struct PrologueScratch {
  size_t index, qn, kn;
};
PrologueScratch plan_prologue(ScratchPlan& sp, const gdr::Dims& d) {
  const int64_t T = d.T;
  PrologueScratch p{};
  p.index = sp.add(gdr_chunk_index_numel(T, d.N) * 4);
  p.qn = sp.add(d.l2norm ? T * d.Hk * d.dk * 2 : 0);
  p.kn = sp.add(d.l2norm ? T * d.Hk * d.dk * 2 : 0);
  return p;
}
Prologue run_prologue(const gdr::Dims& d, const PrologueScratch& ps, char* base, const Tensor& q,
                      const Tensor& k, const Tensor& cu, cudaStream_t s) {
  Prologue p{};
  p.ix = gdr::index_view(chunk_index(cu, d, base, ps.index, s), d.N);
  p.qn = bf(q);
  p.kn = bf(k);
  if (d.l2norm) {
    bf16_t* qn = at<bf16_t>(base, ps.qn);
    bf16_t* kn = at<bf16_t>(base, ps.kn);
    gdr::launch_l2norm(d, bf(q), bf(k), qn, kn, s);
    p.qn = qn;
    p.kn = kn;
  }
  return p;
}

// The op's `saved` (op.h): Ht [nt_max, Hv, dv, dk] at its start, Vt [nt_max, Hv, dv, 64] after it;
// both null when it is absent. The wrapper validated it against the batch; the table can also be
// called directly (the probe), so the sizes are checked again, and the 16-byte alignment the fast
// route's 4-byte stores and cp.async staging of Vt need (Vt's offset is a multiple of 16 bytes
// there: dk, dv % 8 == 0).
struct Saved {
  bf16_t* Ht = nullptr;
  bf16_t* Vt = nullptr;
  bf16_t* W = nullptr;   // [nt_max 64, Hv, dk], token-indexed
  bf16_t* Tm = nullptr;  // [nt_max, Hv, 64, 64]
  float* gam = nullptr;  // [nt_max, Hv, 64]
  explicit operator bool() const { return Ht != nullptr; }
};
Saved saved_view(const Tensor& saved, const gdr::Dims& d) {
  if (!saved.defined()) return {};
  GDN_CHECK(d.nt_max == gdr_saved_chunks(d.T, d.N),
            "{}: the chunk slots of 'saved' ({}) and of the chunk index ({}) disagree", kWhat,
            gdr_saved_chunks(d.T, d.N), d.nt_max);
  const int64_t want = gdr_saved_numel(d.T, d.N, d.Hv, d.dk, d.dv);
  GDN_CHECK(saved.dtype() == DType::BF16 && saved.device() == Device::CUDA &&
                saved.numel() == want && saved.is_contiguous(),
            "{}: tensor 'saved' ({}) must be a contiguous BF16 device tensor of {} elements "
            "(gdr_saved_numel)",
            kWhat, saved.describe(), want);
  GDN_CHECK(aligned16(saved), "{}: tensor 'saved' must be 16-byte aligned", kWhat);
  // Every section's offset is a multiple of 16 bytes: nt_max Hv times 2 (dv dk), 128 dv, 128 dk
  // and 8192 bytes, with dk, dv % 8 == 0 on the fast route.
  Saved v;
  const int64_t slots = d.nt_max * d.Hv;
  v.Ht = bf_out(saved);
  v.Vt = v.Ht + slots * d.dv * d.dk;
  v.W = v.Vt + slots * d.dv * gdr::kC;
  v.Tm = v.W + slots * gdr::kC * d.dk;
  v.gam = reinterpret_cast<float*>(v.Tm + slots * gdr::kC * gdr::kC);
  return v;
}

// Whether the forward writes `saved`'s W, T and gamma (op.h): where a fast backward could read
// them, from the fast route's prep (its conditions on the dims, and kn's alignment for its staging;
// kn is the prologue's, or k itself without the l2norm).
bool writes_saved_factors(const gdr::Dims& d, const bf16_t* kn) {
  return d.dk % 8 == 0 && d.dv % 8 == 0 && d.KP <= 128 && d.VP <= 128 &&
         reinterpret_cast<uintptr_t>(kn) % 16 == 0;
}

// --- the fast route
// ----------------------------------------------------------------------------------
// Scratch of prep and the state pass: U only when the state pass runs, Ht and Vt only when they do
// not live in `saved`.
struct FastFwdScratch {
  size_t W, U, gam, Ht, Vt;
};
// With `saved` (need_states false), W and gamma live there; the backward still takes a W-sized
// buffer for dW (need_W).
FastFwdScratch plan_fast_fwd(ScratchPlan& sp, const gdr::Dims& d, bool need_U, bool need_states,
                             bool need_W) {
  const int64_t T = d.T, nt = d.nt_max;
  FastFwdScratch f{};
  f.W = sp.add(need_W || need_states ? T * d.Hv * d.dk * 2 : 0);
  f.U = sp.add(need_U ? T * d.Hv * d.dv * 2 : 0);
  f.gam = sp.add(need_states ? nt * d.Hv * gdr::kC * 4 : 0);
  f.Ht = sp.add(need_states ? nt * d.Hv * d.dv * d.dk * 2 : 0);
  f.Vt = sp.add(need_states ? nt * d.Hv * d.dv * gdr::kC * 2 : 0);
  return f;
}
struct FastFwd {
  bf16_t* W;
  float* gam;
  const bf16_t* Ht;
  const bf16_t* Vt;
};
// What run_fast_fwd adds to prep and the state pass: the forward's o and the trailing output's
// progress counts (fast_state_output), or the backward's dV'_loc (from dO, in prep's grid).
struct FastExtra {
  bf16_t* o = nullptr;
  int* prog = nullptr;
  const bf16_t* dout = nullptr;
  float* dvl = nullptr;
};
// prep, then the state pass into `saved` or scratch (the backward without `saved`; with `out`, the
// forward's pass and output; given `saved`, prep writes W, T and gamma there), or only the
// backward's dV'_loc with Ht, Vt, W, T and gamma from `saved` (the backward given it: `run_state`
// false).
FastFwd run_fast_fwd(const gdr::Dims& d, const FastFwdScratch& f, char* base, const Prologue& p,
                     const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& h0,
                     float* hT, bf16_t* Tinv, const Saved& sv, bool run_state, const FastExtra& out,
                     cudaStream_t s) {
  bf16_t* Ht = sv ? sv.Ht : at<bf16_t>(base, f.Ht);
  bf16_t* Vt = sv ? sv.Vt : at<bf16_t>(base, f.Vt);
  FastFwd r{sv ? sv.W : at<bf16_t>(base, f.W), sv ? sv.gam : at<float>(base, f.gam), Ht, Vt};
  if (sv) Tinv = sv.Tm;
  if (sv && !run_state) {
    gdr::fast_dvloc(d, p.ix, p.qn, p.kn, g.ptr<float>(), out.dout, out.dvl, s);
    return r;
  }
  bf16_t* U = run_state ? at<bf16_t>(base, f.U) : nullptr;
  if (out.dvl != nullptr)
    gdr::fast_prep_dvloc(d, p.ix, p.qn, p.kn, bf(v), g.ptr<float>(), beta.ptr<float>(), out.dout,
                         r.W, U, r.gam, Tinv, out.dvl, s);
  else
    gdr::fast_prep(d, p.ix, p.kn, bf(v), g.ptr<float>(), beta.ptr<float>(), r.W, U, r.gam, Tinv, s);
  if (run_state && out.o != nullptr)
    gdr::fast_state_output(d, p.ix, r.W, p.qn, p.kn, U, r.gam, f32_or_null(h0), Ht, Vt, hT, out.o,
                           out.prog, s);
  else if (run_state)
    gdr::fast_state_fwd(d, p.ix, r.W, p.kn, U, r.gam, f32_or_null(h0), Ht, Vt, hT, s);
  return r;
}

// `saved`'s W, T and gamma from the fast route's prep (no U), for the forwards whose own chain
// does not leave them there (the generic route), where a fast backward could read
// them (op.h).
void save_factors(const gdr::Dims& d, const Prologue& p, const GatedDeltaRuleFwd& a,
                  const Saved& sv, cudaStream_t s) {
  if (!writes_saved_factors(d, p.kn)) return;
  gdr::fast_prep(d, p.ix, p.kn, nullptr, a.g.ptr<float>(), a.beta.ptr<float>(), sv.W, nullptr,
                 sv.gam, sv.Tm, s);
}

// Each entry point's scratch layout is one plan_* function of the dims and whether `saved` is
// given, so that gated_delta_rule_cuda_workspace_bytes bounds every request with the same code.
struct FastFwdPlan {
  ScratchPlan sp;
  PrologueScratch ps;
  FastFwdScratch f;
  size_t o_prog;
};
FastFwdPlan plan_forward_fast(const gdr::Dims& d, bool saved) {
  FastFwdPlan p{};
  p.ps = plan_prologue(p.sp, d);
  p.f = plan_fast_fwd(p.sp, d, true, !saved, false);
  p.o_prog = p.sp.add(static_cast<int64_t>(gdr::fast_trail_prog_bytes(d)));
  return p;
}

void forward_fast(const GatedDeltaRuleFwd& a, const gdr::Dims& d) {
  cuda::Context& ctx = cuda::Context::get();
  const Saved sv = saved_view(a.saved, d);
  const FastFwdPlan pl = plan_forward_fast(d, static_cast<bool>(sv));
  char* base = static_cast<char*>(ctx.scratch(pl.sp.total(), "gated_delta_rule"));
  cudaStream_t s = ctx.stream();
  const Prologue p = run_prologue(d, pl.ps, base, a.q, a.k, a.cu_seqlens, s);
  run_fast_fwd(d, pl.f, base, p, a.v, a.g, a.beta, a.h0, f32_out_or_null(a.hT), nullptr, sv, true,
               {.o = bf_out(a.o), .prog = at<int>(base, pl.o_prog)}, s);
}

struct FastBwdPlan {
  ScratchPlan sp;
  PrologueScratch ps;
  FastFwdScratch f;
  size_t o_Tinv, o_dvl, o_dHt, o_dVt, o_dqk, o_dkk, o_dgp;
};
FastBwdPlan plan_backward_fast(const gdr::Dims& d, bool saved) {
  FastBwdPlan p{};
  p.ps = plan_prologue(p.sp, d);
  p.f = plan_fast_fwd(p.sp, d, !saved, !saved, true);
  const int64_t T = d.T, nt = d.nt_max;
  p.o_Tinv = p.sp.add(saved ? 0 : nt * d.Hv * gdr::kC * gdr::kC * 2);
  p.o_dvl = p.sp.add(nt * d.Hv * d.dv * gdr::kC * 4);
  p.o_dHt = p.sp.add(nt * d.Hv * d.dv * d.dk * 2);
  p.o_dVt = p.sp.add(nt * d.Hv * d.dv * gdr::kC * 2);
  p.o_dqk = p.sp.add(T * d.Hk * d.dk * 4);
  p.o_dkk = p.sp.add(T * d.Hk * d.dk * 4);
  p.o_dgp = p.sp.add(T * d.Hv * 4);
  return p;
}

void backward_fast(const GatedDeltaRuleBwd& a, const gdr::Dims& d) {
  cuda::Context& ctx = cuda::Context::get();
  const Saved sv = saved_view(a.saved, d);
  const FastBwdPlan pl = plan_backward_fast(d, static_cast<bool>(sv));
  char* base = static_cast<char*>(ctx.scratch(pl.sp.total(), "gated_delta_rule"));
  cudaStream_t s = ctx.stream();
  const Prologue p = run_prologue(d, pl.ps, base, a.q, a.k, a.cu_seqlens, s);
  bf16_t* Tinv = sv ? sv.Tm : at<bf16_t>(base, pl.o_Tinv);
  float* dvl = at<float>(base, pl.o_dvl);
  const FastFwd r = run_fast_fwd(d, pl.f, base, p, a.v, a.g, a.beta, a.h0, nullptr, Tinv, sv, !sv,
                                 {.dout = bf(a.dout), .dvl = dvl}, s);
  bf16_t* dHt = at<bf16_t>(base, pl.o_dHt);
  bf16_t* dVt = at<bf16_t>(base, pl.o_dVt);
  float* dqk = at<float>(base, pl.o_dqk);
  float* dkk = at<float>(base, pl.o_dkk);
  float* dgp = at<float>(base, pl.o_dgp);
  // W is dead once the reverse pass has run; `saved`'s is the caller's, so dW takes scratch then.
  bf16_t* dW = sv ? at<bf16_t>(base, pl.f.W) : r.W;
  gdr::fast_state_bwd(d, p.ix, p.qn, p.kn, r.W, bf(a.dout), dvl, r.gam, f32_or_null(a.dhT), dHt,
                      dVt, f32_out_or_null(a.dh0), s);
  gdr::fast_dqkw(d, p.ix, p.qn, p.kn, bf(a.dout), r.Vt, dVt, r.Ht, dHt, r.gam, dqk, dkk, dW, dgp,
                 s);
  gdr::fast_wy(d, p.ix, p.kn, bf(a.v), dVt, dW, Tinv, r.gam, a.beta.ptr<float>(), dgp, dkk,
               bf_out(a.dv), a.dg.ptr<float>(), a.dbeta.ptr<float>(), s);
  gdr::fast_l2norm_bwd_qk(d, bf(a.q), bf(a.k), dqk, dkk, bf_out(a.dq), bf_out(a.dk), s);
}

// --- the generic route
// -------------------------------------------------------------------------------
struct FwdScratch {
  size_t W, U, H;
};
FwdScratch plan_fwd(ScratchPlan& sp, const gdr::Dims& d) {
  const int64_t T = d.T;
  FwdScratch f{};
  f.W = sp.add(T * d.Hv * d.dk * 2);
  f.U = sp.add(T * d.Hv * d.dv * 2);
  f.H = sp.add(d.nt_max * d.Hv * d.dk * d.dv * 2);
  return f;
}

struct FwdPtrs {
  bf16_t* W;
  bf16_t* U;  // U, then V'
  bf16_t* H;
};

// prep (W, U), then the state pass (H, V' over U, hT).
FwdPtrs run_fwd_chain(const gdr::Dims& d, const FwdScratch& f, char* base, const Prologue& p,
                      const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& h0,
                      float* hT, cudaStream_t s) {
  FwdPtrs r{at<bf16_t>(base, f.W), at<bf16_t>(base, f.U), at<bf16_t>(base, f.H)};
  gdr::launch_prep(d, p.ix, p.kn, bf(v), g.ptr<float>(), beta.ptr<float>(), r.W, r.U, s);
  gdr::launch_state_fwd(d, p.ix, r.W, p.kn, g.ptr<float>(), f32_or_null(h0), r.U, r.H, hT, s);
  return r;
}

struct GenericFwdPlan {
  ScratchPlan sp;
  PrologueScratch ps;
  FwdScratch f;
};
GenericFwdPlan plan_forward_generic(const gdr::Dims& d) {
  GenericFwdPlan p{};
  p.ps = plan_prologue(p.sp, d);
  p.f = plan_fwd(p.sp, d);
  return p;
}

void forward_generic(const GatedDeltaRuleFwd& a, const gdr::Dims& d) {
  cuda::Context& ctx = cuda::Context::get();
  const Saved sv = saved_view(a.saved, d);
  const GenericFwdPlan pl = plan_forward_generic(d);
  char* base = static_cast<char*>(ctx.scratch(pl.sp.total(), "gated_delta_rule"));
  cudaStream_t s = ctx.stream();
  const Prologue p = run_prologue(d, pl.ps, base, a.q, a.k, a.cu_seqlens, s);
  const FwdPtrs r =
      run_fwd_chain(d, pl.f, base, p, a.v, a.g, a.beta, a.h0, f32_out_or_null(a.hT), s);
  gdr::launch_output(d, p.ix, p.qn, p.kn, r.U, r.H, a.g.ptr<float>(), bf_out(a.o), s);
  if (sv) {
    gdr::launch_save_states(d, p.ix, r.H, r.U, sv.Ht, sv.Vt, s);
    save_factors(d, p, a, sv, s);
  }
}

struct GenericBwdPlan {
  ScratchPlan sp;
  PrologueScratch ps;
  FwdScratch f;
  size_t o_dvloc, o_dvp, o_dH, o_dqh, o_dkh, o_dgp;
};
GenericBwdPlan plan_backward_generic(const gdr::Dims& d) {
  GenericBwdPlan p{};
  p.ps = plan_prologue(p.sp, d);
  p.f = plan_fwd(p.sp, d);
  const int64_t T = d.T;
  p.o_dvloc = p.sp.add(T * d.Hv * d.dv * 4);
  p.o_dvp = p.sp.add(T * d.Hv * d.dv * 2);
  p.o_dH = p.sp.add(d.nt_max * d.Hv * d.dk * d.dv * 2);
  p.o_dqh = p.sp.add(T * d.Hv * d.dk * 4);
  p.o_dkh = p.sp.add(T * d.Hv * d.dk * 4);
  p.o_dgp = p.sp.add(T * d.Hv * 4);
  return p;
}

void backward_generic(const GatedDeltaRuleBwd& a, const gdr::Dims& d) {
  cuda::Context& ctx = cuda::Context::get();
  const Saved sv = saved_view(a.saved, d);
  const GenericBwdPlan pl = plan_backward_generic(d);
  char* base = static_cast<char*>(ctx.scratch(pl.sp.total(), "gated_delta_rule"));
  cudaStream_t s = ctx.stream();
  const Prologue p = run_prologue(d, pl.ps, base, a.q, a.k, a.cu_seqlens, s);
  const FwdScratch& f = pl.f;
  FwdPtrs r{at<bf16_t>(base, f.W), at<bf16_t>(base, f.U), at<bf16_t>(base, f.H)};
  if (sv) {
    // prep's W (and U, overwritten at every token of the batch), then H and V' from `saved`.
    gdr::launch_prep(d, p.ix, p.kn, bf(a.v), a.g.ptr<float>(), a.beta.ptr<float>(), r.W, r.U, s);
    gdr::launch_load_states(d, p.ix, sv.Ht, sv.Vt, r.H, r.U, s);
  } else {
    r = run_fwd_chain(d, f, base, p, a.v, a.g, a.beta, a.h0, nullptr, s);
  }
  float* dvloc = at<float>(base, pl.o_dvloc);
  bf16_t* dvp = at<bf16_t>(base, pl.o_dvp);
  bf16_t* dH = at<bf16_t>(base, pl.o_dH);
  float* dqh = at<float>(base, pl.o_dqh);
  float* dkh = at<float>(base, pl.o_dkh);
  float* dgp = at<float>(base, pl.o_dgp);
  const float* g = a.g.ptr<float>();
  gdr::launch_dvloc(d, p.ix, p.qn, p.kn, bf(a.dout), g, dvloc, s);
  gdr::launch_state_bwd(d, p.ix, p.qn, p.kn, r.W, bf(a.dout), dvloc, g, f32_or_null(a.dhT), dvp, dH,
                        f32_out_or_null(a.dh0), s);
  gdr::launch_bwd_dqk(d, p.ix, p.qn, p.kn, r.U, bf(a.dout), r.H, dH, g, dqh, dkh, dgp, s);
  gdr::launch_bwd_wy(d, p.ix, p.kn, bf(a.v), dvp, r.H, g, a.beta.ptr<float>(), dgp, dkh,
                     bf_out(a.dv), a.dg.ptr<float>(), a.dbeta.ptr<float>(), s);
  gdr::launch_reduce_qk(d, bf(a.q), bf(a.k), dqh, dkh, bf_out(a.dq), bf_out(a.dk), s);
}

gdr::Dims fwd_dims(const GatedDeltaRuleFwd& a) {
  gdr::Dims d = make_dims(a.q, a.v, a.cu_seqlens, a.scale, a.use_qk_l2norm);
  d.vec = d.dk % 8 == 0 && d.dv % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
          aligned16(a.h0) && aligned16(a.o) && aligned16(a.hT);
  return d;
}

gdr::Dims bwd_dims(const GatedDeltaRuleBwd& a) {
  gdr::Dims d = make_dims(a.q, a.v, a.cu_seqlens, a.scale, a.use_qk_l2norm);
  d.vec = d.dk % 8 == 0 && d.dv % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
          aligned16(a.h0) && aligned16(a.dout) && aligned16(a.dhT) && aligned16(a.dq) &&
          aligned16(a.dk) && aligned16(a.dv);
  return d;
}

// The fast route (cuda.chunk64): only for the shape classes its `supports` accepts, so a call
// outside them is a resolver bug, not a fallback.
void forward(const GatedDeltaRuleFwd& a) {
  const gdr::Dims d = fwd_dims(a);
  GDN_CHECK(gdr::fast_path(d), "gated_delta_rule (cuda.chunk64): a call outside its shape class");
  forward_fast(a, d);
}
void backward(const GatedDeltaRuleBwd& a) {
  const gdr::Dims d = bwd_dims(a);
  GDN_CHECK(gdr::fast_path(d), "gated_delta_rule (cuda.chunk64): a call outside its shape class");
  backward_fast(a, d);
}
// The generic route (cuda.chunk64_generic): any shape.
void forward_any(const GatedDeltaRuleFwd& a) { forward_generic(a, fwd_dims(a)); }
void backward_any(const GatedDeltaRuleBwd& a) { backward_generic(a, bwd_dims(a)); }

const GatedDeltaRuleTable kTable{forward, backward};
const GatedDeltaRuleTable kGenericTable{forward_any, backward_any};

// The classes the fast route takes (op.cpp's class_of: dk, dv, vec).
std::string supports_fast(const OpQuery& q) {
  const int64_t dk = q.dim("dk", -1), dv = q.dim("dv", -1);
  if (dk < 0 || dv < 0) return "needs the call's head dims (shape class)";
  if (q.dim("vec", 0) == 0) return "head dims not multiples of 8 or tensors not 16-byte aligned";
  if (gdr::pad16(static_cast<int>(dk)) > 128 || gdr::pad16(static_cast<int>(dv)) > 128)
    return fmt::format("dk = {}, dv = {}: the fast route takes up to 128", dk, dv);
  return "";
}

}  // namespace

size_t gated_delta_rule_cuda_workspace_bytes(int64_t T, int64_t N, int64_t Hk, int64_t Hv,
                                             int64_t dk, int64_t dv, bool l2norm,
                                             bool backward_saved) {
  if (T <= 0) return 0;
  const gdr::Dims d = make_dims(T, std::max<int64_t>(N, 1), Hk, Hv, dk, dv, 0, l2norm);
  // The generic route's plans do not depend on `saved`.
  size_t bound = std::max(plan_forward_generic(d).sp.total(), plan_backward_generic(d).sp.total());
  if (gdr::pad16(d.dk) <= 128 && gdr::pad16(d.dv) <= 128) {  // the fast route's dims
    bound =
        std::max({bound, plan_forward_fast(d, false).sp.total(),
                  plan_forward_fast(d, true).sp.total(), plan_backward_fast(d, true).sp.total()});
    if (!backward_saved) bound = std::max(bound, plan_backward_fast(d, false).sp.total());
  }
  return bound;
}

// Two candidates per shape class (op.h): the fast route, and the generic one (any class, and the
// fallback when the fast one fails its probe). The fused forward (one kernel per document and
// value head over all its chunks) measured slower and is gone (docs/PERF.md).
GDN_REGISTER(gated_delta_rule_cuda) {
  Registry::global().add_impl(
      {"gated_delta_rule", "cuda.chunk64", Backend::Cuda, 20, supports_fast, &kTable});
  Registry::global().add_impl(
      {"gated_delta_rule", "cuda.chunk64_generic", Backend::Cuda, 10, nullptr, &kGenericTable});
}

}  // namespace gdn::ops
