// Causal conv1d on CUDA (label gpu), for every implementation, cuda.tiled (cuda.cu, any shape) and
// cuda.sliding_window (cuda_sliding_window.cu; y bitwise cuda.tiled's, checked below; only the
// classes W <= 4, C % 8 == 0, aligned tensors: the other cases run through the op's entry points,
// where the resolver gives them to cuda.tiled): cuda vs ref over widths W in {1, 2, 4, 8},
// document layouts (T < W, 1-token documents, zero-length documents at the start, middle and end,
// 50 documents, one long document crossing many tiles / segments, documents starting just before /
// at / after tile and warp boundaries, many documents of 0..100 tokens across the segments,
// 8-token chunks and 8-token forward runs, no cu_seqlens) and every option combination (bias, SiLU,
// initial state, dfinal_state, final state requested), on both load paths (16-byte and scalar) and
// both store paths; forward and every gradient. Then: no read across documents (NaN in one document
// leaves the others finite), dweight / dbias accumulation and run-to-run determinism over a
// persistent grid whose blocks walk several tiles, unaligned tensors, saturating SiLU, empty
// batches, the resolver's choice per class and probe, leaking implementations rejected by the
// probe, `ops run` on the cuda backend, and bad input. Tolerances come from the one table,
// src/backend/tolerances.h.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "backend/tolerances.h"
#include "gdn/backend/op_run.h"
#include "gdn/core/rng.h"
#include "gdn/core/safetensors.h"
#include "ops/causal_conv1d/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

constexpr ProbeError kTol = bf16_tolerance("causal_conv1d");

// The implementations under test; "" is ref (F64 on the host), kEntry the op's entry points on
// the device (the resolver's choice for the call's shape class).
const char* const kImpls[] = {"cuda.tiled", "cuda.sliding_window"};
const char* const kChosen = "cuda.sliding_window";  // in the classes it takes
const std::string kEntry = "entry points";
const CausalConv1dTable kEntryTable{causal_conv1d_forward, causal_conv1d_backward};

// The registered cuda implementation `name` (its function table), or kEntryTable for kEntry; a
// test fails without it.
const CausalConv1dTable& impl_table(const std::string& name) {
  if (name == kEntry) return kEntryTable;
  for (const ImplDesc* i : Registry::global().impls("causal_conv1d", Backend::Cuda))
    if (i->name == name) return *static_cast<const CausalConv1dTable*>(i->table);
  GDN_FAIL("causal_conv1d implementation {} is not registered", name);
}

// The shape class of a call at width W over C channels with SiLU, bias and states (op.cpp's
// class_of; `aligned`: every tensor 16-byte aligned).
OpQuery class_query(int64_t W, int64_t C, bool aligned = true) {
  const bool vec = aligned && C % 8 == 0;
  return OpQuery{
      Backend::Cuda,
      fmt::format("W={},C={},vec={},silu=1,bias=1,states=1", W, C, vec ? 1 : 0),
      {{"W", W}, {"C", C}, {"vec", vec ? 1 : 0}, {"silu", 1}, {"bias", 1}, {"states", 1}}};
}

// What runs `impl`'s part of a case at (W, C): the implementation itself where its `supports`
// takes the class, else the entry points (the resolver's choice, checked to be cuda.tiled by
// UnsupportedClassesResolveToTiled).
std::string runner(const std::string& impl, int64_t W, int64_t C, bool aligned = true) {
  for (const ImplDesc* i : Registry::global().impls("causal_conv1d", Backend::Cuda))
    if (i->name == impl)
      return !i->supports || i->supports(class_query(W, C, aligned)).empty() ? impl : kEntry;
  GDN_FAIL("causal_conv1d implementation {} is not registered", impl);
}
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

class CausalConv1dCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

// A device tensor whose every element is NaN: an output element the kernels do not write fails
// the comparison as non-finite.
OwnedTensor poisoned(DType dt, std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  std::vector<double> v(static_cast<size_t>(n), kNaN);
  return from_f64(v, dt, shape, Device::CUDA);
}
OwnedTensor poisoned(DType dt, std::initializer_list<int64_t> shape) {
  return poisoned(dt, std::span<const int64_t>(shape.begin(), shape.size()));
}

// One problem, held in F64 with values rounded through bf16 (ref and cuda see the same numbers).
struct Case {
  int64_t C = 0, W = 0;
  std::vector<int32_t> cu;  // document boundaries
  bool use_cu = true;       // false: no cu_seqlens (cu must be {0, T})
  bool bias = false, silu = false, init = false, dfin = false, fin = true;
  OwnedTensor x, w, b, s0, dy, dsN;  // [T, C], [C, W], [C], [N, C, W-1], [T, C], [N, C, W-1]
  int64_t T() const { return cu.back(); }
  int64_t N() const { return static_cast<int64_t>(cu.size()) - 1; }
};

Case make_case(int64_t C, int64_t W, std::vector<int32_t> cu, uint64_t seed) {
  Case k;
  k.C = C;
  k.W = W;
  k.cu = std::move(cu);
  const int64_t T = k.T(), N = k.N(), S = W - 1;
  auto r = [](const OwnedTensor& t) { return testing::rounded(t, DType::BF16); };
  k.x = r(randn({T, C}, seed, 1.5));
  k.w = r(randn({C, W}, seed + 1, 0.5));
  k.b = r(randn({C}, seed + 2, 0.3));
  k.s0 = r(randn({N, C, S}, seed + 3));
  k.dy = r(randn({T, C}, seed + 4));
  k.dsN = r(randn({N, C, S}, seed + 5));
  return k;
}

Tensor opt(bool on, const OwnedTensor& t) { return on ? t.view() : Tensor(); }

struct Out {
  OwnedTensor y, fin, dx, dw, db, dinit;
};

// Forward + backward on ref (impl "", F64 host) or the cuda implementation `impl` called directly
// (bf16 device; dweight / dbias F32; kEntry: the op's entry points). cuda outputs start poisoned;
// dweight / dbias start at zero.
Out run(const Case& k, const std::string& impl) {
  const bool cuda = !impl.empty();
  const int64_t T = k.T(), N = k.N(), C = k.C, S = k.W - 1;
  const DType dt = cuda ? DType::BF16 : DType::F64, gt = causal_conv1d_grad_dtype(dt);
  const Device dev = cuda ? Device::CUDA : Device::CPU;
  auto in = [&](const OwnedTensor& t) { return convert(t, dt, dev); };
  auto out = [&](std::initializer_list<int64_t> shape) {
    return cuda ? poisoned(dt, shape) : OwnedTensor::zeros(dt, shape);
  };
  OwnedTensor x = in(k.x), w = in(k.w), b = in(k.b), s0 = in(k.s0), dy = in(k.dy), dsN = in(k.dsN);
  OwnedTensor cu = convert(testing::i32_tensor(k.cu), DType::I32, dev);
  Out o{out({T, C}),
        out({N, C, S}),
        out({T, C}),
        OwnedTensor::zeros(gt, {C, k.W}, dev),
        OwnedTensor::zeros(gt, {C}, dev),
        out({N, C, S})};
  const Tensor cuv = opt(k.use_cu, cu);
  const CausalConv1dFwd fa{x,     w, opt(k.bias, b), cuv, opt(k.init, s0), o.y, opt(k.fin, o.fin),
                           k.silu};
  const CausalConv1dBwd ba{x,
                           w,
                           opt(k.bias, b),
                           cuv,
                           opt(k.init, s0),
                           dy,
                           opt(k.dfin, dsN),
                           o.dx,
                           o.dw,
                           opt(k.bias, o.db),
                           opt(k.init, o.dinit),
                           k.silu};
  if (cuda) {
    const CausalConv1dTable& t = impl_table(impl);
    t.forward(fa);
    t.backward(ba);
  } else {
    causal_conv1d_forward(fa);
    causal_conv1d_backward(ba);
  }
  return o;
}

// cuda against ref: y, dx, dinitial_state (bf16 outputs) and dweight, dbias (fp32) within the
// table's tolerance; final_state copies inputs, so it must be exact.
void compare(const Case& k, const Out& got, const Out& want) {
  testing::expect_close(got.y, want.y, kTol.fwd, "y");
  if (k.fin) {
    const auto g = to_f64_vector(got.fin), w = to_f64_vector(want.fin);
    ASSERT_EQ(g.size(), w.size());
    for (size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i], w[i]) << "final_state[" << i << "]";
  }
  testing::expect_close(got.dx, want.dx, kTol.bwd, "dx");
  testing::expect_close(got.dw, want.dw, kTol.bwd, "dweight");
  if (k.bias) testing::expect_close(got.db, want.db, kTol.bwd, "dbias");
  if (k.init) testing::expect_close(got.dinit, want.dinit, kTol.bwd, "dinitial_state");
}

// Random document lengths in [lo, hi].
std::vector<int32_t> random_cu(int n, int lo, int hi, uint64_t seed) {
  std::vector<int32_t> cu = {0};
  for (int i = 0; i < n; ++i)
    cu.push_back(cu.back() + lo + static_cast<int32_t>(rng::bits(seed, 9, i) % (hi - lo + 1)));
  return cu;
}

// Layouts (cuda.tiled: tiles of 64 tokens, a warp's run 16, 128 channels a block;
// cuda.sliding_window's backward: a warp owns a segment of >= 64 tokens streamed in chunks of 8,
// 256 channels a column, and runs only for C % 8 == 0) and their channel counts, chosen so that
// every load / store path and partial channel blocks are covered:
//   0 one document shorter than W (1 token for W = 1); C = 13 (scalar loads and stores)
//   1 six 1-token documents; C = 128 (16-byte loads, 8-byte stores, one full channel block)
//   2 zero-length documents at the start, middle and end; C = 70 (scalar)
//   3 fifty documents of 0..12 tokens; C = 136 (16-byte loads, a partial second channel block)
//   4 one document of 1000 tokens (16 tiles); C = 260 (scalar loads, 8-byte stores, 3 blocks)
//   5 documents starting just before, at and after tile and warp boundaries; C = 8
//   6 no cu_seqlens, T = 300; C = 24
//   7 one document of 1000 tokens; C = 264 (~16 segments, two channel columns, the second
//     with one active lane)
//   8 24 documents of 0..100 tokens; C = 256 (boundaries inside segments and chunks, at chunk and
//     segment edges, zero-length documents between segments)
//   9 no cu_seqlens, T = 777; C = 32
struct Layout {
  std::vector<int32_t> cu;
  int64_t C;
  bool use_cu;
};
Layout layout(int which, int64_t W) {
  switch (which) {
    case 0:
      return {{0, static_cast<int32_t>(std::max<int64_t>(1, W - 1))}, 13, true};
    case 1:
      return {{0, 1, 2, 3, 4, 5, 6}, 128, true};
    case 2:
      return {{0, 0, 0, 3, 3, 4, 11, 11, 30, 30, 30}, 70, true};
    case 3:
      return {random_cu(50, 0, 12, 77), 136, true};
    case 4:
      return {{0, 1000}, 260, true};
    case 5:
      return {{0, 15, 16, 17, 63, 64, 65, 127, 129, 130, 191, 192, 250, 260}, 8, true};
    case 6:
      return {{0, 300}, 24, false};
    case 7:
      return {{0, 1000}, 264, true};
    case 8:
      return {random_cu(24, 0, 100, 78), 256, true};
    default:
      return {{0, 777}, 32, false};
  }
}

// One test per (W, layout); the 32 option combinations and both implementations (against one ref
// run) run inside it.
class ConvCudaSweep : public CausalConv1dCuda,
                      public ::testing::WithParamInterface<std::tuple<int64_t, int>> {};

TEST_P(ConvCudaSweep, MatchesRef) {
  auto [W, lay] = GetParam();
  const Layout l = layout(lay, W);
  Case k = make_case(l.C, W, l.cu, 1000 + static_cast<uint64_t>(W * 31 + lay * 7));
  k.use_cu = l.use_cu;
  for (int flags = 0; flags < 32; ++flags) {
    k.bias = flags & 1;
    k.silu = flags & 2;
    k.init = flags & 4;
    k.dfin = flags & 8;
    k.fin = !(flags & 16);
    const Out want = run(k, "");
    for (const std::string name : kImpls) {
      const std::string impl = runner(name, W, l.C);
      SCOPED_TRACE(fmt::format("{} W={} layout={} bias={} silu={} init={} dfin={} fin={}", impl, W,
                               lay, k.bias, k.silu, k.init, k.dfin, k.fin));
      compare(k, run(k, impl), want);
      if (::testing::Test::HasFatalFailure()) return;
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ConvCudaSweep,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Range(0, 10)),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_layout" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Every other width (3, 5, 6, 7) on the mixed layouts, all options on.
TEST_F(CausalConv1dCuda, OtherWidthsMatchRef) {
  for (int64_t W : {3, 5, 6, 7}) {
    for (int lay : {2, 3, 5, 8}) {
      const Layout l = layout(lay, W);
      Case k = make_case(l.C, W, l.cu, 2000 + static_cast<uint64_t>(W * 13 + lay));
      k.bias = k.silu = k.init = k.dfin = true;
      const Out want = run(k, "");
      for (const std::string name : kImpls) {
        const std::string impl = runner(name, W, l.C);
        SCOPED_TRACE(fmt::format("{} W={} layout={}", impl, W, lay));
        compare(k, run(k, impl), want);
      }
    }
  }
}

// The staged forward (token tiles of 64 through shared memory) computes y and the final state
// with cuda.tiled's arithmetic in its order (preact, sigmoid of cuda_state.cuh): bit-identical to
// cuda.tiled on documents that start before, at and after the tile edges, with and without SiLU,
// bias and initial state; layout -1: 1500 documents of 0..3 tokens (the 32-ary document search
// takes three rounds).
TEST_F(CausalConv1dCuda, StagedForwardIsBitwiseTiled) {
  for (int64_t W : {2, 4}) {
    for (int lay : {-1, 3, 5, 7, 8}) {
      const Layout l = lay < 0 ? Layout{random_cu(1500, 0, 3, 79), 16, true} : layout(lay, W);
      Case k = make_case(l.C, W, l.cu, 3000 + static_cast<uint64_t>(W * 17 + lay + 1));
      for (int flags = 0; flags < 8; ++flags) {
        k.bias = flags & 1;
        k.silu = flags & 2;
        k.init = flags & 4;
        const Out want = run(k, "cuda.tiled");
        SCOPED_TRACE(fmt::format("W={} layout={} flags={}", W, lay, flags));
        ASSERT_EQ(runner(kChosen, W, l.C), kChosen);
        const Out got = run(k, kChosen);
        EXPECT_EQ(to_f64_vector(got.y), to_f64_vector(want.y)) << "y";
        EXPECT_EQ(to_f64_vector(got.fin), to_f64_vector(want.fin)) << "final state";
      }
    }
  }
}

// NaN in one document's inputs must not reach any output of another document: a kernel that
// masks a cross-document tap by multiplying with zero (0 * NaN = NaN) instead of not reading it
// fails here. Forward direction: x of document 0 poisoned, document 1 checked (y, dx, final
// state, d initial state). Backward direction: dy of document 1 poisoned, document 0's dx checked.
TEST_F(CausalConv1dCuda, NoCrossDocumentReads) {
  const int64_t C = 136, W = 4;
  // Document 1 starts inside / at / after a tile start (and inside a segment's chunk).
  for (const std::string impl : kImpls) {
    ASSERT_EQ(runner(impl, W, C), impl);
    for (int64_t split : {5, 40, 64, 65, 70}) {
      SCOPED_TRACE(impl + ": document 1 starts at " + std::to_string(split));
      Case k = make_case(C, W, {0, static_cast<int32_t>(split), 150}, 31);
      k.bias = k.silu = k.init = k.dfin = true;
      const Out clean = run(k, impl);
      for (int dir = 0; dir < 2; ++dir) {
        Case bad = make_case(C, W, k.cu, 31);
        bad.bias = bad.silu = bad.init = bad.dfin = true;
        OwnedTensor& target = dir == 0 ? bad.x : bad.dy;
        const int64_t r0 = dir == 0 ? 0 : split, r1 = dir == 0 ? split : 150;
        double* p = target.ptr<double>();
        for (int64_t i = r0 * C; i < r1 * C; ++i) p[i] = kNaN;
        const Out o = run(bad, impl);
        // The rows and the document whose outputs must be unaffected.
        const int64_t q0 = dir == 0 ? split : 0, q1 = dir == 0 ? 150 : split;
        const int64_t n = dir == 0 ? 1 : 0;
        EXPECT_EQ(to_f64_vector(o.dx.view().slice0(q0, q1)),
                  to_f64_vector(clean.dx.view().slice0(q0, q1)))
            << "dx of document " << n << " changed (direction " << dir << ")";
        if (dir == 0) {
          EXPECT_EQ(to_f64_vector(o.y.view().slice0(q0, q1)),
                    to_f64_vector(clean.y.view().slice0(q0, q1)))
              << "y of document 1 changed";
          EXPECT_EQ(to_f64_vector(o.fin.view().slice0(1, 2)),
                    to_f64_vector(clean.fin.view().slice0(1, 2)))
              << "final state of document 1 changed";
          EXPECT_EQ(to_f64_vector(o.dinit.view().slice0(1, 2)),
                    to_f64_vector(clean.dinit.view().slice0(1, 2)))
              << "d initial state of document 1 changed";
        } else {
          EXPECT_EQ(to_f64_vector(o.dinit.view().slice0(0, 1)),
                    to_f64_vector(clean.dinit.view().slice0(0, 1)))
              << "d initial state of document 0 changed";
        }
      }
    }
  }
}

// dweight / dbias are accumulated (+=), and dx, dweight, dbias are bit-identical run to run. The
// shape makes the persistent backward grid walk several tiles per block (about 1100 tokens, 18
// tiles, over 64 channel blocks: an H200 fits about 8 blocks per channel block;
// cuda.sliding_window: ~18 segments of ~61 tokens over 32 channel columns) and sums 15 documents'
// contributions.
TEST_F(CausalConv1dCuda, BackwardAccumulatesAndIsDeterministic) {
  const int64_t C = 8192, W = 4;
  Case k = make_case(C, W, random_cu(15, 1, 150, 5), 41);
  k.bias = k.silu = k.init = k.dfin = true;
  const int64_t T = k.T(), N = k.N();
  const Out ref = run(k, "");
  OwnedTensor dw0 = randn({C, W}, 42, 3.0), db0 = randn({C}, 43, 3.0);
  auto x = convert(k.x, DType::BF16, Device::CUDA), w = convert(k.w, DType::BF16, Device::CUDA),
       b = convert(k.b, DType::BF16, Device::CUDA), s0 = convert(k.s0, DType::BF16, Device::CUDA),
       dy = convert(k.dy, DType::BF16, Device::CUDA),
       dsN = convert(k.dsN, DType::BF16, Device::CUDA);
  auto cu = convert(testing::i32_tensor(k.cu), DType::I32, Device::CUDA);
  for (const std::string impl : kImpls) {
    SCOPED_TRACE(impl);
    ASSERT_EQ(runner(impl, W, C), impl);
    std::vector<double> dx1, dw1, db1;
    for (int rep = 0; rep < 3; ++rep) {
      auto dw = convert(dw0, DType::F32, Device::CUDA), db = convert(db0, DType::F32, Device::CUDA);
      auto dx = poisoned(DType::BF16, {T, C}), dinit = poisoned(DType::BF16, {N, C, W - 1});
      impl_table(impl).backward({x, w, b, cu, s0, dy, dsN, dx, dw, db, dinit, true});
      if (rep == 0) {
        dx1 = to_f64_vector(dx);
        dw1 = to_f64_vector(dw);
        db1 = to_f64_vector(db);
        testing::expect_close(dx, ref.dx, kTol.bwd, "dx");
        testing::expect_close(dinit, ref.dinit, kTol.bwd, "dinitial_state");
        // got - start == ref, measured against the added part.
        auto check = [](const std::vector<double>& got, const Tensor& start, const Tensor& add,
                        const char* what) {
          const auto s = to_f64_vector(start), a = to_f64_vector(add);
          double num = 0, den = 0;
          for (size_t i = 0; i < got.size(); ++i) {
            const double want = static_cast<double>(static_cast<float>(s[i])) + a[i];
            num += (got[i] - want) * (got[i] - want);
            den += a[i] * a[i];
          }
          EXPECT_LE(std::sqrt(num / den), kTol.bwd) << what << " after += (relative to the added "
                                                    << "part)";
        };
        check(dw1, dw0, ref.dw, "dweight");
        check(db1, db0, ref.db, "dbias");
      } else {
        EXPECT_EQ(to_f64_vector(dx), dx1)
            << "dx differs between identical runs (rep " << rep << ")";
        EXPECT_EQ(to_f64_vector(dw), dw1) << "dweight differs between identical runs";
        EXPECT_EQ(to_f64_vector(db), db1) << "dbias differs between identical runs";
      }
    }
  }
}

// C % 8 == 0 but x, dy, y, dx start 2 bytes past a 16-byte boundary: the scalar load and store
// paths, cuda.tiled's; cuda.sliding_window's `supports` rejects the class, so through the entry
// points the resolver gives it to cuda.tiled.
TEST_F(CausalConv1dCuda, UnalignedTensorsTakeTheScalarPaths) {
  const int64_t C = 256, W = 4;
  Case k = make_case(C, W, {0, 3, 90, 200}, 51);
  k.bias = k.silu = k.init = k.dfin = true;
  const Out ref = run(k, "");
  EXPECT_EQ(runner(kChosen, W, C, false), kEntry) << kChosen << " takes unaligned tensors";
  EXPECT_EQ(runner(kChosen, W, C, true), kChosen);
  for (const std::string& impl : {std::string("cuda.tiled"), kEntry}) {
    SCOPED_TRACE(impl);
    const int64_t T = k.T(), N = k.N();
    auto shifted = [&](const Tensor& src) {
      OwnedTensor buf = OwnedTensor::zeros(DType::BF16, {T * C + 8}, Device::CUDA);
      Tensor v(static_cast<char*>(buf.view().data()) + 2, DType::BF16, {T, C}, Device::CUDA);
      if (src.defined()) copy_into(v, src);
      return std::make_pair(std::move(buf), v);
    };
    auto xd = convert(k.x, DType::BF16, Device::CUDA),
         dyd = convert(k.dy, DType::BF16, Device::CUDA);
    auto [xb, x] = shifted(xd);
    auto [dyb, dy] = shifted(dyd);
    auto [yb, y] = shifted(Tensor());
    auto [dxb, dx] = shifted(Tensor());
    auto w = convert(k.w, DType::BF16, Device::CUDA), b = convert(k.b, DType::BF16, Device::CUDA),
         s0 = convert(k.s0, DType::BF16, Device::CUDA),
         dsN = convert(k.dsN, DType::BF16, Device::CUDA);
    auto cu = convert(testing::i32_tensor(k.cu), DType::I32, Device::CUDA);
    auto fin = poisoned(DType::BF16, {N, C, W - 1}), dinit = poisoned(DType::BF16, {N, C, W - 1});
    auto dw = OwnedTensor::zeros(DType::F32, {C, W}, Device::CUDA),
         db = OwnedTensor::zeros(DType::F32, {C}, Device::CUDA);
    impl_table(impl).forward({x, w, b, cu, s0, y, fin, true});
    impl_table(impl).backward({x, w, b, cu, s0, dy, dsN, dx, dw, db, dinit, true});
    testing::expect_close(y, ref.y, kTol.fwd, "y (unaligned)");
    EXPECT_EQ(to_f64_vector(fin), to_f64_vector(ref.fin)) << "final_state (unaligned)";
    testing::expect_close(dx, ref.dx, kTol.bwd, "dx (unaligned)");
    testing::expect_close(dw, ref.dw, kTol.bwd, "dweight (unaligned)");
    testing::expect_close(db, ref.db, kTol.bwd, "dbias (unaligned)");
    testing::expect_close(dinit, ref.dinit, kTol.bwd, "dinitial_state (unaligned)");
  }
}

// SiLU saturates for any finite input (silu(z) -> 0 for z -> -inf, -> z for z -> +inf) without
// inf / NaN in y or in the gradients. C = 1 and C = 8 (every channel the same;
// cuda.sliding_window needs C % 8 == 0: C = 1 runs through the entry points).
TEST_F(CausalConv1dCuda, ExtremeFiniteInputs) {
  const std::vector<double> xs = {-1e30, -3e38, -100, -88.5, -87, -20, 0, 20, 87, 88.5, 100, 1e30};
  const int64_t T = static_cast<int64_t>(xs.size()), W = 2;
  for (int64_t C : {1, 8}) {
    Case k = make_case(C, W, {0, static_cast<int32_t>(T)}, 61);
    k.silu = true;
    std::vector<double> xv, wv;
    for (double v : xs)
      for (int64_t c = 0; c < C; ++c) xv.push_back(v);
    for (int64_t c = 0; c < C; ++c) wv.insert(wv.end(), {0.0, 1.0});
    k.x = testing::rounded(from_f64(xv, DType::F64, {T, C}), DType::BF16);
    k.w = from_f64(wv, DType::F64, {C, W});  // y = silu(x)
    const Out ref = run(k, "");
    for (const std::string name : kImpls) {
      const std::string impl = runner(name, W, C);
      SCOPED_TRACE(fmt::format("{} C={}", impl, C));
      const Out got = run(k, impl);
      const auto yr = to_f64_vector(ref.y), yc = to_f64_vector(got.y);
      const auto dr = to_f64_vector(ref.dx), dc = to_f64_vector(got.dx);
      for (size_t i = 0; i < xv.size(); ++i) {
        EXPECT_NEAR(yc[i], yr[i], 4e-3 * std::abs(yr[i]) + 1e-30) << "y at x = " << xv[i];
        EXPECT_NEAR(dc[i], dr[i], 4e-3 * std::abs(dr[i]) + 1e-30) << "dx at x = " << xv[i];
      }
      testing::expect_close(got.dw, ref.dw, kTol.bwd, "dweight");
    }
  }
}

// Empty batches: T = 0 with zero-length documents (final state = initial state or zeros,
// d initial state = d final state, dweight untouched), and T = 0 with no document.
TEST_F(CausalConv1dCuda, EmptyBatches) {
  for (const std::string name : kImpls) {
    for (int64_t C : {5, 8}) {
      const std::string impl = runner(name, 4, C);
      for (auto cu : {std::vector<int32_t>{0, 0, 0}, std::vector<int32_t>{0}}) {
        SCOPED_TRACE(fmt::format("{} C={} documents: {}", impl, C, cu.size() - 1));
        Case k = make_case(C, 4, cu, 71);
        k.bias = k.silu = k.init = k.dfin = true;
        const Out got = run(k, impl);
        EXPECT_EQ(to_f64_vector(got.fin), to_f64_vector(k.s0));
        EXPECT_EQ(to_f64_vector(got.dinit), to_f64_vector(k.dsN));
        EXPECT_EQ(to_f64_vector(got.dw), std::vector<double>(static_cast<size_t>(4 * C), 0.0));
        k.init = false;
        const Out z = run(k, impl);
        for (double v : to_f64_vector(z.fin)) EXPECT_EQ(v, 0.0);
      }
    }
  }
}

// The production class (Qwen3.5: W = 4, 8192 channels, aligned) resolves to cuda.sliding_window,
// which passes its probe there.
TEST_F(CausalConv1dCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  const Resolution& r = Registry::global().resolve("causal_conv1d", class_query(4, 8192));
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, kChosen);
  EXPECT_EQ(r.impl->backend, Backend::Cuda);
  EXPECT_LE(r.error.fwd, kTol.fwd);
  EXPECT_LE(r.error.bwd, kTol.bwd);
  // bf16 outputs cannot match fp64 exactly: a zero error would mean the probe compared nothing.
  EXPECT_GT(r.error.fwd, 0.0);
  EXPECT_GT(r.error.bwd, 0.0);
  EXPECT_TRUE(r.rejected.empty()) << r.rejected.front();
}

// Every class cuda.sliding_window does not take (W > 4, C % 8 != 0, unaligned tensors, and the
// default class without dims) resolves to cuda.tiled, with one line saying why it was skipped.
TEST_F(CausalConv1dCuda, UnsupportedClassesResolveToTiled) {
  for (const OpQuery& q : {OpQuery{Backend::Cuda, "", {}}, class_query(8, 256), class_query(4, 13),
                           class_query(4, 256, false), class_query(2, 70)}) {
    SCOPED_TRACE(q.shape_class);
    const Resolution& r = Registry::global().resolve("causal_conv1d", q);
    ASSERT_NE(r.impl, nullptr);
    EXPECT_EQ(r.impl->name, "cuda.tiled");
    EXPECT_LE(r.error.fwd, kTol.fwd);
    EXPECT_LE(r.error.bwd, kTol.bwd);
    ASSERT_EQ(r.rejected.size(), 1u);
    EXPECT_NE(r.rejected[0].find("skipping cuda.sliding_window"), std::string::npos)
        << r.rejected[0];
  }
}

// Deliberately wrong CUDA implementations built from the real one (cuda.sliding_window, the
// resolver's choice in the production class): one that ignores the document boundaries (reads
// across documents), one that drops the dweight accumulation.
const CausalConv1dTable* real_cuda_table() {
  for (const ImplDesc* i : Registry::global().impls("causal_conv1d", Backend::Cuda))
    if (i->name == kChosen) return static_cast<const CausalConv1dTable*>(i->table);
  return nullptr;
}
void leaky_forward(const CausalConv1dFwd& a) {
  real_cuda_table()->forward(a);  // final_state right, then y overwritten by the leaking run
  CausalConv1dFwd b = a;
  b.cu_seqlens = Tensor();  // one document: taps read the previous document's tokens
  b.initial_state = Tensor();
  b.final_state = Tensor();
  real_cuda_table()->forward(b);
}
void no_dw_backward(const CausalConv1dBwd& a) {
  OwnedTensor junk = OwnedTensor::zeros(DType::F32, a.dweight.shape(), Device::CUDA);
  CausalConv1dBwd b = a;
  b.dweight = junk;
  real_cuda_table()->backward(b);
  device_synchronize(Device::CUDA);  // junk is freed on return
}
void real_forward(const CausalConv1dFwd& a) { real_cuda_table()->forward(a); }
void real_backward(const CausalConv1dBwd& a) { real_cuda_table()->backward(a); }
const CausalConv1dTable kLeaky{leaky_forward, real_backward};
const CausalConv1dTable kNoDw{real_forward, no_dw_backward};

TEST_F(CausalConv1dCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_cuda_table(), nullptr) << kChosen << " is not registered";
  Registry reg;  // private: the global registry is untouched
  reg.add_op(Registry::global().op("causal_conv1d"));
  reg.add_impl(Registry::global().ref("causal_conv1d"));
  for (const ImplDesc* i : Registry::global().impls("causal_conv1d", Backend::Cuda))
    reg.add_impl(*i);
  reg.add_impl({"causal_conv1d", "cuda.leaky", Backend::Cuda, 30, nullptr, &kLeaky});
  reg.add_impl({"causal_conv1d", "cuda.no_dw", Backend::Cuda, 40, nullptr, &kNoDw});
  const Resolution& r = reg.resolve("causal_conv1d", class_query(4, 8192));
  ASSERT_NE(r.impl, nullptr);
  EXPECT_EQ(r.impl->name, kChosen);
  ASSERT_EQ(r.rejected.size(), 2u);
  EXPECT_NE(r.rejected[0].find("rejecting cuda.no_dw: probe error"), std::string::npos)
      << r.rejected[0];
  EXPECT_NE(r.rejected[1].find("rejecting cuda.leaky: probe error"), std::string::npos)
      << r.rejected[1];
}

TEST_F(CausalConv1dCuda, OpsRunOnCudaBackend) {
  const int64_t C = 40, W = 4;
  Case k = make_case(C, W, {0, 2, 2, 19, 30}, 81);
  k.bias = k.silu = k.init = k.dfin = true;
  const Out ref = run(k, "");
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("gdn_conv_cuda_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string inp = (dir / "in.safetensors").string(),
                    outp = (dir / "out.safetensors").string();
  auto f32 = [](const OwnedTensor& t) { return convert(t, DType::F32); };
  OwnedTensor x = f32(k.x), w = f32(k.w), b = f32(k.b), s0 = f32(k.s0), dy = f32(k.dy),
              dsN = f32(k.dsN), cu = testing::i32_tensor(k.cu);
  write_safetensors(inp, {{"x", x.view(), {}, {}, nullptr, 0},
                          {"weight", w.view(), {}, {}, nullptr, 0},
                          {"bias", b.view(), {}, {}, nullptr, 0},
                          {"cu_seqlens", cu.view(), {}, {}, nullptr, 0},
                          {"initial_state", s0.view(), {}, {}, nullptr, 0},
                          {"dy", dy.view(), {}, {}, nullptr, 0},
                          {"dfinal_state", dsN.view(), {}, {}, nullptr, 0}});
  OpRunResult res = run_op_file("causal_conv1d", Backend::Cuda, inp, outp, true, {{"silu", 1}});
  // `ops run` resolves the op's default class (no dims): the implementation that takes any shape.
  EXPECT_EQ(res.impl, "cuda.tiled");
  SafeTensorsFile f(outp);
  testing::expect_close(f.load("y", DType::F64), ref.y, kTol.fwd, "y (ops run)");
  testing::expect_close(f.load("final_state", DType::F64), ref.fin, 0.0, "final_state (ops run)");
  testing::expect_close(f.load("dx", DType::F64), ref.dx, kTol.bwd, "dx (ops run)");
  testing::expect_close(f.load("dweight", DType::F64), ref.dw, kTol.bwd, "dweight (ops run)");
  testing::expect_close(f.load("dbias", DType::F64), ref.db, kTol.bwd, "dbias (ops run)");
  testing::expect_close(f.load("dinitial_state", DType::F64), ref.dinit, kTol.bwd,
                        "dinitial_state (ops run)");
  fs::remove_all(dir);
}

using testing::expect_error;

TEST_F(CausalConv1dCuda, BadInputIsAClearError) {
  const int64_t T = 6, C = 8, W = 4;
  auto z = [](std::initializer_list<int64_t> s, DType dt = DType::BF16) {
    return OwnedTensor::zeros(dt, s, Device::CUDA);
  };
  auto x = z({T, C}), w = z({C, W}), y = z({T, C}), dy = z({T, C}), dx = z({T, C});
  auto w_host = OwnedTensor::zeros(DType::BF16, {C, W});
  expect_error(
      [&] {
        causal_conv1d_forward({x, w_host, {}, {}, {}, y, {}, true});
      },
      "causal_conv1d: tensor 'weight' is on cpu, expected cuda");
  auto dw_bf16 = z({C, W});
  expect_error(
      [&] {
        causal_conv1d_backward({x, w, {}, {}, {}, dy, {}, dx, dw_bf16, {}, {}, true});
      },
      "causal_conv1d: tensor 'dweight' has dtype BF16, expected F32");
  // A device cu_seqlens with no document cannot describe T = 6 rows (its values are not read).
  auto cu_empty = z({1}, DType::I32);
  expect_error(
      [&] {
        causal_conv1d_forward({x, w, {}, cu_empty, {}, y, {}, true});
      },
      "causal_conv1d: tensor 'cu_seqlens' has no document but 'x' has 6 rows");
}

}  // namespace
}  // namespace gdn::ops
