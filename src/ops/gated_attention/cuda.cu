// Gated attention on CUDA (op.h has the contract): bf16 qg/k/v/weights/outputs, fp32 lse, rstd and
// norm-weight gradients, fp32 arithmetic, tensor-core (bf16 -> fp32) attention.
//
// The two implementations share this host side and the row kernels and differ in the three
// attention kernels (fwd, dk/dv, dq), which compute the same things with the same tiles of work
// and, on an H200, the same bits (HGMMA and HMMA round alike and the products accumulate in the
// same order):
//   cuda.sm90_tma (priority 39, Hopper): the default: warpgroup MMAs (wgmma) on 128-byte-swizzled
//              tiles (sm90_pipe.cuh), every attention kernel warp-specialized, a producer
//              warpgroup bringing the tiles in with TMA into slots guarded by full / empty
//              mbarriers and the two consumer warpgroups never meeting at a block barrier
//              (sm90_tma.cuh; FlashAttention-3's design);
//   cuda.flash    (10, any sm_80+): mma.sync m16n8k16 with ldmatrix, cuda_fwd.cuh / cuda_bwd.cuh.
// The resolver takes the first that the device supports and that passes the probe, so a Hopper
// kernel that went wrong falls back to the mma.sync one. (The cp.async wgmma kernels and the
// partly-TMA sets between them, cuda.pipe, cuda.pipe_xi, cuda.tma and cuda.tma_kv, measured slower:
// docs/PERF.md.)
//
// Forward, three launches on the context stream:
//   1. attn_tile_index_kernel (one block): per-document prefix sums of the query / key tile
//      counts into scratch, so that the attention kernels map a block index to (document, tile)
//      by binary search without any host-side knowledge of cu_seqlens (which lives on the device).
//   2. attn_prologue_kernel: q_hat, k_hat = RoPE(RMSNorm_(1+w)(x)), q_rstd, k_rstd; cos/sin formed
//      in fp64 per (token, frequency) (as ref and cpu), all of a block's at once.
//   3. the attention forward (attn_fwd_kernel<HD> and its wgmma versions): FlashAttention-2 forward
//   (Dao, "FlashAttention-2", 2023, Algorithm 1)
//      per (document, 128 query rows, query head), online softmax in base 2, causal masking only
//      on the key tiles that reach past the tile's first query, GQA by reading kv head h / group;
//      epilogue writes attn, o = attn ⊙ σ(gate) and lse.
// Backward, six launches:
//   1. tile index (as above);
//   2. attn_bwd_preprocess_kernel: dA = do ⊙ σ(gate) (bf16 scratch), D = rowsum(dA ⊙ attn) (fp32
//      scratch) and the gate gradient into dqg's gate half (do, attn and gate are read once);
//   3. the dk/dv kernel: per (document, 64 keys, kv head), every query tile of every query
//      head of the group: dv (bf16, final) and dk_hat (fp32 scratch);
//   4. the dq kernel: per (document, 128 query rows, query head): dq_hat (fp32 scratch);
//   5. attn_bwd_epilogue_kernel: dq_hat and dk_hat back through RoPE and the norms into dqg's
//      query half and dk, per-block weight-grad partials;
//   6. attn_dw_reduce_kernel: dq_norm_w, dk_norm_w += the partials summed in a fixed order.
// dq is computed by its own kernel instead of FlashAttention-2's atomic dQ accumulation inside
// the dk/dv kernel: S and dP are recomputed (7 tile products per (query, key) tile pair instead of
// 5), and in exchange every output element is written by one block with a fixed summation order,
// so the backward is deterministic (bit-identical run to run).
//
// Head dims: kernels are instantiated for HD = 64, 128, 256 and any hd with hd % 8 == 0 and
// hd <= 256 runs on the smallest HD >= hd, the columns past hd zero-filled in shared memory. Every
// bf16 tensor must be 16-byte aligned (16-byte copies); the host checks that and the head dim.
//
// cu_seqlens is never read on the host. The kernels clamp every document to [0, T] and every tile
// to its document, and the host sizes the grids for the worst case (ceil(T / tile) + N tiles), so
// no cu_seqlens value makes them access memory out of bounds (inconsistent values give unspecified
// results, as op.h allows).
//
// Scratch (Context::scratch, grown once): forward 2(N+1) int32; backward also D [T, Hq], dA
// [T, Hq, hd] bf16, dq_hat [T, Hq, hd] and dk_hat [T, Hkv, hd] fp32 and the weight-grad partials
// (ceil(T / kRowTokens) x 2hd fp32).
//
// Where the time goes (H200, T = 8192 as one document, 16 / 4 heads x 256; the per-kernel split
// and the comparison with torch SDPA are measured in docs/PERF.md with
// bench/cuda_bench_attn_kernels and cuda_bench_ops --peers). The TMA producer warpgroup and
// mbarriers (sm90_tma.cuh) replaced cp.async kernels in which a third of dk/dv's stall cycles were
// at the two block barriers per item: every thread spent issue slots and registers on copies, and
// the warpgroups waited for each other at every step. What remains, in order of size:
//   - dk/dv re-reads Q and dA from L2 once per key tile (64 KB per 8.4 MFLOP): a cluster of two key
//     tiles sharing Q / dA by TMA multicast is the next step;
//   - the forward (below SDPA's rate): FlashAttention-3's ping-pong of the two consumer
//     warpgroups (one's softmax under the other's products) is not done;
//   - the row kernels (epilogue and prologue near 0.6 of copy). Fusing the query rows' epilogue
//     into the dq kernel (dq_hat staged through shared memory, RoPE from a table) was tried and
//     lost more in dq than it saved (the epilogue runs at one block per SM with nothing to overlap
//     it), so dropped;
//   - documents are ordered by their tile index, not by work, so with several documents the
//     longest tiles do not all start first.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/registry.h"
#include "ops/gated_attention/cuda_launch.h"
#include "ops/gated_attention/cuda_rows.cuh"
#include "ops/gated_attention/op.h"

namespace gdn::ops {

namespace {

using attn::bf16_t;
constexpr const char* kName = "gated_attention (cuda)";

template <class T>
T* dev(const Tensor& t) {
  return reinterpret_cast<T*>(t.data());
}

struct Dims {
  int T, Hq, Hkv, hd, N, group, hd_class;
};

// The head dims the kernels run: multiples of 8 (16-byte rows) up to 256.
std::string unsupported_head_dim(int64_t hd) {
  if (hd >= 8 && hd <= attn::kMaxHd && hd % 8 == 0) return "";
  return fmt::format("head dim {} is not a multiple of 8 in [8, {}]", hd, attn::kMaxHd);
}

void check_aligned(const Tensor& t, const char* name) {
  GDN_CHECK(reinterpret_cast<uintptr_t>(t.data()) % 16 == 0,
            "{}: tensor '{}' must start on a 16-byte boundary (the kernels copy 16 bytes at a "
            "time)",
            kName, name);
}

Dims dims_of(const Tensor& qg, const Tensor& k, const Tensor& cu) {
  const int64_t T = qg.size(0), Hq = qg.size(1), Hkv = k.size(1), hd = k.size(2);
  const int64_t N = cu.size(0) - 1;
  const std::string why = unsupported_head_dim(hd);
  GDN_CHECK(why.empty(), "{}: {}", kName, why);
  // Grid sizes: (ceil(T / 64) + N) tiles per head must fit the 1-D grid; element offsets are
  // size_t, token and head indices int.
  GDN_CHECK(T <= INT_MAX / 2 && N <= INT_MAX / 2 &&
                (T / attn::kSmallTile + 1 + N) * std::max(Hq, Hkv) <= INT_MAX,
            "{}: T = {}, N = {} documents and {} heads are too large for one launch", kName, T, N,
            std::max(Hq, Hkv));
  const int hd_class = hd <= 64 ? 64 : hd <= 128 ? 128 : 256;
  return {static_cast<int>(T),
          static_cast<int>(Hq),
          static_cast<int>(Hkv),
          static_cast<int>(hd),
          static_cast<int>(N),
          static_cast<int>(Hq / Hkv),
          hd_class};
}

// Bump allocation of one scratch buffer: the same calls once with base = nullptr to size it.
struct Carve {
  char* base;
  size_t off = 0;
  template <class T>
  T* take(size_t count) {
    off = (off + 255) & ~size_t{255};
    T* p = reinterpret_cast<T*>(base + off);
    off += count * sizeof(T);
    return p;
  }
};

// The scratch of one call (one request, carved at 256-byte boundaries; with a null base, only its
// size): the tile index's two tables; the backward adds D, dA, the fp32 dq_hat and dk_hat and the
// q/k-norm weight gradients' per-block partials. gated_attention_cuda_workspace_bytes takes its
// bound from the same functions.
struct FwdScratch {
  int32_t* ts_big;    // [N+1]
  int32_t* ts_small;  // [N+1]
};
FwdScratch carve_fwd(Carve& c, int64_t N) {
  const size_t nts = static_cast<size_t>(N) + 1;
  FwdScratch f{};
  f.ts_big = c.take<int32_t>(nts);
  f.ts_small = c.take<int32_t>(nts);
  return f;
}
struct BwdScratch {
  int32_t* ts_big;    // [N+1]
  int32_t* ts_small;  // [N+1]
  float* D;           // [T, Hq]
  bf16_t* dA;         // [T, Hq, hd]
  float* dq_hat;      // [T, Hq, hd]
  float* dk_hat;      // [T, Hkv, hd]
  float* partial;     // [blocks, 2 hd]
};
unsigned epilogue_blocks(int64_t T) {
  return static_cast<unsigned>((T + attn::kRowTokens - 1) / attn::kRowTokens);
}
BwdScratch carve_bwd(Carve& c, int64_t T, int64_t N, int64_t Hq, int64_t Hkv, int64_t hd) {
  const size_t nts = static_cast<size_t>(N) + 1;
  const size_t rows_q = static_cast<size_t>(T * Hq), rows_k = static_cast<size_t>(T * Hkv);
  const size_t h = static_cast<size_t>(hd);
  BwdScratch b{};
  b.ts_big = c.take<int32_t>(nts);
  b.ts_small = c.take<int32_t>(nts);
  b.D = c.take<float>(rows_q);
  b.dA = c.take<bf16_t>(rows_q * h);
  b.dq_hat = c.take<float>(rows_q * h);
  b.dk_hat = c.take<float>(rows_k * h);
  b.partial = c.take<float>(static_cast<size_t>(epilogue_blocks(T)) * 2 * h);
  return b;
}

unsigned grid_for(int T, int N, int tile, int heads) {
  return static_cast<unsigned>((static_cast<int64_t>(T + tile - 1) / tile + N) * heads);
}

void launch_tile_index(const Dims& d, const int32_t* cu, int32_t* ts_big, int32_t* ts_small,
                       cudaStream_t s) {
  attn::attn_tile_index_kernel<<<1, attn::kIndexThreads, 0, s>>>(
      attn::TileIndexParams{cu, ts_big, ts_small, d.T, d.N});
  GDN_CUDA_LAUNCH_CHECK("attn_tile_index_kernel");
}

// Records marks[i] (when marks is not null) after the i-th launch; marks[0] before the first.
struct Marks {
  cudaEvent_t* ev;
  cudaStream_t s;
  int i = 0;
  void operator()() {
    if (ev != nullptr) GDN_CUDA_CHECK(cudaEventRecord(ev[i++], s));
  }
};

void forward_with(const GatedAttentionFwd& a, const attn::AttnKernels& kernels,
                  cudaEvent_t* marks = nullptr) {
  const Dims d = dims_of(a.qg, a.k, a.cu_seqlens);
  if (d.T == 0) return;
  for (auto [t, name] : {std::pair{&a.qg, "qg"},
                         {&a.k, "k"},
                         {&a.v, "v"},
                         {&a.q_norm_w, "q_norm_w"},
                         {&a.k_norm_w, "k_norm_w"},
                         {&a.o, "o"},
                         {&a.q_hat, "q_hat"},
                         {&a.k_hat, "k_hat"},
                         {&a.attn, "attn"}})
    check_aligned(*t, name);
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t s = ctx.stream();
  Carve size{nullptr};
  carve_fwd(size, d.N);
  Carve c{static_cast<char*>(ctx.scratch(size.off, "gated_attention"))};
  const auto [ts_big, ts_small] = carve_fwd(c, d.N);
  const int32_t* cu = dev<const int32_t>(a.cu_seqlens);  // [N+1]
  Marks mark{marks, s};

  mark();
  launch_tile_index(d, cu, ts_big, ts_small, s);
  mark();

  attn::PrologueParams pp{dev<const bf16_t>(a.qg),
                          dev<const bf16_t>(a.k),
                          dev<const bf16_t>(a.q_norm_w),
                          dev<const bf16_t>(a.k_norm_w),
                          cu,
                          dev<bf16_t>(a.q_hat),
                          dev<bf16_t>(a.k_hat),
                          dev<float>(a.q_rstd),
                          dev<float>(a.k_rstd),
                          d.T,
                          d.Hq,
                          d.Hkv,
                          d.hd,
                          static_cast<int>(a.rotary_dim),
                          d.N,
                          static_cast<float>(a.eps),
                          a.rope_theta};
  attn::
      attn_prologue_kernel<<<static_cast<unsigned>((d.T + attn::kRowTokens - 1) / attn::kRowTokens),
                             attn::kThreads, 0, s>>>(pp);
  GDN_CUDA_LAUNCH_CHECK("attn_prologue_kernel");
  mark();

  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.hd)));
  attn::FwdParams fp{dev<const bf16_t>(a.q_hat),
                     dev<const bf16_t>(a.k_hat),
                     dev<const bf16_t>(a.v),
                     dev<const bf16_t>(a.qg),
                     cu,
                     ts_big,
                     dev<bf16_t>(a.attn),
                     dev<bf16_t>(a.o),
                     dev<float>(a.lse),
                     d.T,
                     d.Hq,
                     d.Hkv,
                     d.hd,
                     d.N,
                     d.group,
                     scale * attn::kLog2e};
  kernels.fwd(fp, d.hd_class, grid_for(d.T, d.N, attn::kBigTile, d.Hq), s);
  mark();
}

void backward_with(const GatedAttentionBwd& a, const attn::AttnKernels& kernels,
                   cudaEvent_t* marks = nullptr) {
  const Dims d = dims_of(a.qg, a.k, a.cu_seqlens);
  if (d.T == 0) return;  // dq_norm_w, dk_norm_w += 0
  for (auto [t, name] : {std::pair{&a.qg, "qg"},
                         {&a.k, "k"},
                         {&a.v, "v"},
                         {&a.q_norm_w, "q_norm_w"},
                         {&a.k_norm_w, "k_norm_w"},
                         {&a.q_hat, "q_hat"},
                         {&a.k_hat, "k_hat"},
                         {&a.attn, "attn"},
                         {&a.d_o, "d_o"},
                         {&a.dqg, "dqg"},
                         {&a.dk, "dk"},
                         {&a.dv, "dv"}})
    check_aligned(*t, name);
  cuda::Context& ctx = cuda::Context::get();
  cudaStream_t s = ctx.stream();
  const size_t rows_q = static_cast<size_t>(d.T) * d.Hq;
  const unsigned epi_blocks = epilogue_blocks(d.T);
  Carve size{nullptr};
  carve_bwd(size, d.T, d.N, d.Hq, d.Hkv, d.hd);
  Carve c{static_cast<char*>(ctx.scratch(size.off, "gated_attention"))};
  const auto [ts_big, ts_small, D, dA, dq_hat, dk_hat, partial] =
      carve_bwd(c, d.T, d.N, d.Hq, d.Hkv, d.hd);
  const int32_t* cu = dev<const int32_t>(a.cu_seqlens);  // [N+1]
  Marks mark{marks, s};

  mark();
  launch_tile_index(d, cu, ts_big, ts_small, s);
  mark();

  attn::PreprocessParams pre{dev<const bf16_t>(a.qg),      dev<const bf16_t>(a.d_o),
                             dev<const bf16_t>(a.attn),    dA,
                             dev<bf16_t>(a.dqg),           D,
                             static_cast<int64_t>(rows_q), d.hd};
  attn::attn_bwd_preprocess_kernel<<<
      static_cast<unsigned>((rows_q + attn::kWarps - 1) / attn::kWarps), attn::kThreads, 0, s>>>(
      pre);
  GDN_CUDA_LAUNCH_CHECK("attn_bwd_preprocess_kernel");
  mark();

  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.hd)));
  attn::BwdParams bp{dev<const bf16_t>(a.q_hat),
                     dev<const bf16_t>(a.k_hat),
                     dev<const bf16_t>(a.v),
                     dA,
                     dev<const float>(a.lse),
                     D,
                     cu,
                     ts_small,
                     dq_hat,
                     dk_hat,
                     dev<bf16_t>(a.dv),
                     d.T,
                     d.Hq,
                     d.Hkv,
                     d.hd,
                     d.N,
                     d.group,
                     d.hd,
                     scale,
                     scale * attn::kLog2e};
  kernels.dkdv(bp, d.hd_class, grid_for(d.T, d.N, attn::kSmallTile, d.Hkv), s);
  mark();
  bp.ts = ts_big;
  kernels.dq(bp, d.hd_class, grid_for(d.T, d.N, attn::kBigTile, d.Hq), s);
  mark();

  attn::EpilogueParams ep{dev<const bf16_t>(a.qg),
                          dev<const bf16_t>(a.k),
                          dev<const bf16_t>(a.q_norm_w),
                          dev<const bf16_t>(a.k_norm_w),
                          cu,
                          dev<const float>(a.q_rstd),
                          dev<const float>(a.k_rstd),
                          dq_hat,
                          dk_hat,
                          dev<bf16_t>(a.dqg),
                          dev<bf16_t>(a.dk),
                          partial,
                          d.T,
                          d.Hq,
                          d.Hkv,
                          d.hd,
                          static_cast<int>(a.rotary_dim),
                          d.N,
                          a.rope_theta};
  attn::attn_bwd_epilogue_kernel<<<epi_blocks, attn::kThreads, 0, s>>>(ep);
  GDN_CUDA_LAUNCH_CHECK("attn_bwd_epilogue_kernel");
  mark();
  attn::
      attn_dw_reduce_kernel<<<static_cast<unsigned>((2 * d.hd + attn::kDwCols - 1) / attn::kDwCols),
                              attn::kDwCols * attn::kDwSlices, 0, s>>>(
          partial, dev<float>(a.dq_norm_w), dev<float>(a.dk_norm_w), static_cast<int>(epi_blocks),
          d.hd);
  GDN_CUDA_LAUNCH_CHECK("attn_dw_reduce_kernel");
  mark();
}

// The kernel sets, one per implementation: forward, dq and dk/dv launchers.
constexpr attn::AttnKernels kMmaSync{attn::launch_fwd, attn::launch_bwd_dq, attn::launch_bwd_dkdv};
constexpr attn::AttnKernels kSm90Tma{attn::launch_fwd_tma, attn::launch_bwd_dq_tma,
                                     attn::launch_bwd_dkdv_tma};

// The op table of kernel set K: the one host side above over K's kernels.
template <const attn::AttnKernels& K>
constexpr GatedAttentionTable table_of() {
  return {[](const GatedAttentionFwd& a) { forward_with(a, K); },
          [](const GatedAttentionBwd& a) { backward_with(a, K); }};
}
const GatedAttentionTable kTables[] = {table_of<kMmaSync>(), table_of<kSm90Tma>()};

// The implementations: the Hopper one (wgmma) first, "cuda.flash" the fallback the resolver takes
// when it cannot run or does not pass its probe.
struct Variant {
  const char* name;
  int priority;
  bool wgmma;
  const attn::AttnKernels* kernels;
  const GatedAttentionTable* table;
};
const Variant kVariants[] = {{"cuda.flash", 10, false, &kMmaSync, &kTables[0]},
                             {"cuda.sm90_tma", 39, true, &kSm90Tma, &kTables[1]}};

const attn::AttnKernels& kernels_of(std::string_view impl) {
  for (const Variant& v : kVariants)
    if (impl == v.name) return *v.kernels;
  GDN_FAIL("{}: no implementation named '{}'", kName, impl);
}

std::string supports(const OpQuery& q) {
  const auto it = q.dims.find("hd");
  return it == q.dims.end() ? std::string() : unsupported_head_dim(it->second);
}

// wgmma is Hopper's (compute capability 9.0; the build targets sm_90a).
std::string supports_wgmma(const OpQuery& q) {
  const cudaDeviceProp& prop = cuda::Context::get().props();
  if (prop.major != 9)
    return fmt::format("wgmma needs compute capability 9.0, the device has {}.{}", prop.major,
                       prop.minor);
  return supports(q);
}

}  // namespace

size_t gated_attention_cuda_workspace_bytes(int64_t T, int64_t N, int64_t Hq, int64_t Hkv,
                                            int64_t hd) {
  if (T <= 0) return 0;
  Carve fwd{nullptr}, bwd{nullptr};
  carve_fwd(fwd, N);
  carve_bwd(bwd, T, N, Hq, Hkv, hd);
  return std::max(fwd.off, bwd.off);
}

void attn::forward_marked(const GatedAttentionFwd& a, std::string_view impl, cudaEvent_t* marks) {
  forward_with(a, kernels_of(impl), marks);
}
void attn::backward_marked(const GatedAttentionBwd& a, std::string_view impl, cudaEvent_t* marks) {
  backward_with(a, kernels_of(impl), marks);
}

// The implementations (kVariants), one host side and the same row kernels (see the top of this
// file).
GDN_REGISTER(gated_attention_cuda) {
  for (const Variant& v : kVariants)
    Registry::global().add_impl({"gated_attention", v.name, Backend::Cuda, v.priority,
                                 v.wgmma ? supports_wgmma : supports, v.table});
}

}  // namespace gdn::ops
