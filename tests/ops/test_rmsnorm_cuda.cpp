// RMSNorm on CUDA (label gpu), for every implementation, cuda.rowwise (cuda.cu, any shape) and
// cuda.sm90_bulk (sm90_bulk.cu: its own backward, cuda.rowwise's forward; only the shape classes
// its `supports` accepts), each called through its own table: cuda vs ref over swept shapes
// (forward and both gradients, both flavours, both the 16-byte and the scalar paths, rows wider
// than the register-held part, the bulk ring wrapping several times), dw accumulation and
// determinism, unaligned tensors (through the op's entry points); then the resolver's choice per
// class (kChosen in the production class, cuda.rowwise in the default one) and probe,
// deliberately wrong CUDA implementations rejected by the probe, `ops run` on the cuda backend,
// and bad input. Tolerances come from the one table, src/backend/tolerances.h.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "backend/tolerances.h"
#include "ops/cuda_test_util.h"
#include "ops/rmsnorm/op.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using testing::randn;

constexpr ProbeError kTol = bf16_tolerance("rmsnorm");

// The implementations under test, and the resolver's choice in the production class (the highest
// priority).
const char* const kImpls[] = {"cuda.rowwise", "cuda.sm90_bulk"};
const char* const kChosen = "cuda.sm90_bulk";

// cuda.sm90_bulk takes the classes D % 8 == 0, 1024 <= D <= 8192 with 16-byte aligned tensors
// (the sweep's are); the resolver gives every other class to cuda.rowwise (checked below).
bool sweep_runs(const std::string& impl, int64_t D) {
  const bool own = D % 8 == 0 && D >= 1024 && D <= 8192;
  return own || impl == "cuda.rowwise";
}

// The shape class of rows of width D (op.cpp's class_of).
OpQuery class_query(int64_t D, bool vec) {
  return OpQuery{
      Backend::Cuda, fmt::format("D={},vec={}", D, vec ? 1 : 0), {{"D", D}, {"vec", vec ? 1 : 0}}};
}

// The registered cuda implementation `name` (its function table); a test fails without it.
const RmsNormTable& impl_table(const std::string& name) {
  const RmsNormTable* t = testing::cuda_table<RmsNormTable>("rmsnorm", name);
  GDN_CHECK(t != nullptr, "rmsnorm implementation {} is not registered", name);
  return *t;
}

// Every test needs the device; say plainly when there is none instead of failing obscurely.
class RmsNormCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available())
        << "no CUDA device: the CUDA runtime did not install its device hooks (is a GPU visible? "
           "check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  }
};

// A device tensor whose every element is NaN: outputs start poisoned, so an element the kernel
// does not write fails the comparison as non-finite.
OwnedTensor poisoned(DType dt, std::initializer_list<int64_t> shape) {
  Tensor probe(nullptr, dt, shape);
  std::vector<double> v(static_cast<size_t>(probe.numel()),
                        std::numeric_limits<double>::quiet_NaN());
  return from_f64(v, dt, std::span<const int64_t>(shape.begin(), shape.size()), Device::CUDA);
}

struct Inputs {
  OwnedTensor x, w, dy;  // F64 host, rounded through bf16 (both paths see the same numbers)
};

Inputs make_inputs(int64_t R, int64_t D, bool zc, uint64_t seed) {
  return {testing::rounded(randn({R, D}, seed, 3.0), DType::BF16),
          testing::rounded(randn({D}, seed + 1, zc ? 0.2 : 0.3, zc ? 0.0 : 1.0), DType::BF16),
          testing::rounded(randn({R, D}, seed + 2), DType::BF16)};
}

struct Ref {
  OwnedTensor y, rstd, dx, dw;
};

Ref run_ref(const Inputs& in, bool zc) {
  const int64_t R = in.x.view().size(0), D = in.x.view().size(1);
  Ref r{OwnedTensor::zeros(DType::F64, {R, D}), OwnedTensor::zeros(DType::F64, {R}),
        OwnedTensor::zeros(DType::F64, {R, D}), OwnedTensor::zeros(DType::F64, {D})};
  rmsnorm_forward({in.x, in.w, r.y, r.rstd, 1e-6, zc});
  rmsnorm_backward({in.x, in.w, r.rstd, in.dy, r.dx, r.dw, zc});
  return r;
}

struct Dev {
  OwnedTensor x, w, dy, y, rstd, dx, dw;
};

// Device copies of the inputs; outputs poisoned, dw = dw0 (zeros unless given).
Dev to_device(const Inputs& in, const Tensor* dw0 = nullptr) {
  const int64_t R = in.x.view().size(0), D = in.x.view().size(1);
  Dev d{convert(in.x, DType::BF16, Device::CUDA),
        convert(in.w, DType::BF16, Device::CUDA),
        convert(in.dy, DType::BF16, Device::CUDA),
        poisoned(DType::BF16, {R, D}),
        poisoned(DType::F32, {R}),
        poisoned(DType::BF16, {R, D}),
        dw0 != nullptr ? convert(*dw0, DType::F32, Device::CUDA)
                       : OwnedTensor::zeros(DType::F32, {D}, Device::CUDA)};
  return d;
}

// Poisoned outputs kept aside: `reset` copies them over `d`'s outputs (device to device) and
// zeroes dw, so one device copy of the inputs serves every implementation (the host-side
// conversions of the large shapes are most of this test's time).
struct Poison {
  OwnedTensor y, rstd, dx;
  explicit Poison(const Dev& d)
      : y(poisoned(DType::BF16, {d.y.view().size(0), d.y.view().size(1)})),
        rstd(poisoned(DType::F32, {d.rstd.view().size(0)})),
        dx(poisoned(DType::BF16, {d.dx.view().size(0), d.dx.view().size(1)})) {}
  void reset(Dev& d) const {
    for (auto [dst, src] : {std::pair{&d.y, &y}, std::pair{&d.rstd, &rstd}, std::pair{&d.dx, &dx}})
      copy_bytes(dst->view().data(), Device::CUDA, src->view().data(), Device::CUDA,
                 static_cast<size_t>(src->view().nbytes()));
    zero_bytes(d.dw.view().data(), Device::CUDA, static_cast<size_t>(d.dw.view().nbytes()));
  }
};

void run_cuda(Dev& d, bool zc, const std::string& impl) {
  const RmsNormTable& t = impl_table(impl);
  t.forward({d.x, d.w, d.y, d.rstd, 1e-6, zc});
  t.backward({d.x, d.w, d.rstd, d.dy, d.dx, d.dw, zc});
}

// y is x * r * gw computed in fp32 and rounded once to bf16: within half a bf16 ulp of the fp64
// value (plus fp32 noise), i.e. |y - y_ref| <= 2^-8 |y_ref|, element by element.
void expect_y_within_half_ulp(const Tensor& got, const Tensor& want) {
  auto g = to_f64_vector(got), w = to_f64_vector(want);
  ASSERT_EQ(g.size(), w.size());
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double lim = std::ldexp(std::abs(w[i]), -8) * (1 + 1e-4) + 1e-30;
    if (!(std::abs(g[i] - w[i]) <= lim) && bad++ < 5)
      ADD_FAILURE() << "y[" << i << "] = " << g[i] << ", ref " << w[i] << " (more than half a "
                    << "bf16 ulp away)";
  }
  EXPECT_EQ(bad, 0) << "elements of y off by more than half a bf16 ulp";
}

void compare(const Dev& d, const Ref& r, const Tensor& dy64) {
  testing::expect_close(d.y, r.y, kTol.fwd, "y");
  expect_y_within_half_ulp(d.y, r.y);
  testing::expect_close(d.rstd, r.rstd, kTol.fwd, "rstd");
  // dx cancels to ~0 when D = 1 (xhat = +-1): measure it against the scale of r * dy.
  auto rs = to_f64_vector(r.rstd);
  const double rmax = *std::max_element(rs.begin(), rs.end());
  testing::expect_close(d.dx, r.dx, kTol.bwd, "dx", testing::l2(dy64) * rmax);
  testing::expect_close(d.dw, r.dw, kTol.bwd, "dw");
  // rstd and dw are fp32 outputs of fp32 arithmetic on the same bf16 inputs: their error is fp32
  // rounding (~1e-6), so a bf16 round trip anywhere on their path (~2e-3) fails these.
  testing::expect_close(d.rstd, r.rstd, 1e-5, "rstd (fp32)");
  testing::expect_close(d.dw, r.dw, 1e-4, "dw (fp32)");
}

// (R, D): one row, odd and tiny widths (scalar path), widths with D % 8 == 0 (16-byte path) from
// one warp per row up to the register limit (D = 8192) and past it (D = 12288 with 16-byte packs,
// D = 9001 / 4100 scalar: re-read tail and dw accumulated in the partial rows), many rows (the
// backward's grid-stride walk takes several turns), and the benchmark's width.
// cuda.sm90_bulk covers D % 8 == 0 with 1024 <= D <= 8192: 32 threads per row (D = 1024; [13000,
// 1024] gives each of the 16 x 132 row groups of an H200 6-7 rows, so its 3-slot ring wraps twice
// and the waits use both parities twice), 64 with packs left over (1032), 128 (3000: some threads
// own 2 packs, some 3; 4096), 256 (4104: one row, groups without rows; 8192); its `supports`
// rejects the other widths (UnsupportedClassesResolveToRowwise). The forward's fixed-width kernel
// (2048 <= D <= 4096, 16-byte packs): 128 threads a row with an odd row count ([4099, 2048]), 256
// (4096, and 3000 with packs left over).
struct Shape {
  int64_t R, D;
};
void PrintTo(const Shape& s, std::ostream* os) { *os << "[" << s.R << ", " << s.D << "]"; }
const Shape kShapes[] = {{1, 1},     {1, 7},        {3, 97},   {1, 128},    {64, 128},
                         {33, 1000}, {257, 1031},   {5, 4096}, {130, 4096}, {2, 4100},
                         {16, 8192}, {3, 12288},    {7, 9001}, {70000, 64}, {4099, 2048},
                         {3, 1024},  {13000, 1024}, {9, 1032}, {40, 3000},  {1, 4104}};

class RmsNormCudaSweep : public RmsNormCuda,
                         public ::testing::WithParamInterface<std::tuple<Shape, bool>> {};

TEST_P(RmsNormCudaSweep, MatchesRef) {
  auto [shape, zc] = GetParam();
  Inputs in = make_inputs(shape.R, shape.D, zc, 100 + static_cast<uint64_t>(shape.D));
  Ref ref = run_ref(in, zc);
  Dev d = to_device(in);
  const Poison poison(d);
  for (const std::string impl : kImpls) {
    if (!sweep_runs(impl, shape.D)) continue;
    SCOPED_TRACE(impl);
    poison.reset(d);
    run_cuda(d, zc, impl);
    compare(d, ref, in.dy);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormCudaSweep,
                         ::testing::Combine(::testing::ValuesIn(kShapes), ::testing::Bool()),
                         [](const auto& info) {
                           const Shape s = std::get<0>(info.param);
                           return "R" + std::to_string(s.R) + "_D" + std::to_string(s.D) +
                                  (std::get<1>(info.param) ? "_zc" : "_plain");
                         });

TEST_F(RmsNormCuda, ZeroCentredFormsOnePlusWInFp32) {
  // w = 1e-3 everywhere: in bf16, 1 + w rounds to 1 (the spacing there is 2^-7), which would make
  // every y 1e-3 too small relative to ref. Each y's own rounding error is unbiased (std ~1.6e-3
  // relative), so over 16k elements the mean signed relative error is ~1e-5 when (1 + w) is formed
  // in fp32 and ~-1e-3 when it is not: a bias the L2 tolerance alone could not see.
  // D = 1024: cuda.sm90_bulk's own backward (the forward is cuda.rowwise's in both).
  const int64_t R = 16, D = 1024;
  Inputs in = make_inputs(R, D, true, 7);
  std::vector<double> wv(static_cast<size_t>(D), 1e-3);
  in.w = testing::rounded(from_f64(wv, DType::F64, {D}), DType::BF16);
  Ref ref = run_ref(in, true);
  for (const std::string impl : kImpls) {
    SCOPED_TRACE(impl);
    Dev d = to_device(in);
    run_cuda(d, true, impl);
    compare(d, ref, in.dy);
    auto g = to_f64_vector(d.y), w = to_f64_vector(ref.y);
    double bias = 0;
    int n = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (std::abs(w[i]) < 1e-6) continue;
      bias += (g[i] - w[i]) / w[i];
      ++n;
    }
    bias /= std::max(n, 1);
    EXPECT_LT(std::abs(bias), 2e-4)
        << "y is biased by " << bias << " relative: (1 + w) was not formed in fp32";
  }
}

TEST_F(RmsNormCuda, BackwardAccumulatesDwAndIsDeterministic) {
  const int64_t R = 3000, D = 4096;
  Inputs in = make_inputs(R, D, false, 21);
  Ref ref = run_ref(in, false);
  OwnedTensor dw0 = randn({D}, 24, 5.0);
  for (const std::string impl : kImpls) {
    SCOPED_TRACE(impl);
    const RmsNormTable& t = impl_table(impl);
    Dev d = to_device(in, &dw0.view());
    run_cuda(d, false, impl);
    // dw = dw0 + ref
    auto got = to_f64_vector(d.dw), base = to_f64_vector(dw0), add = to_f64_vector(ref.dw);
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double want = static_cast<double>(static_cast<float>(base[i])) + add[i];
      num += (got[i] - want) * (got[i] - want);
      den += add[i] * add[i];
    }
    EXPECT_LE(std::sqrt(num / den), kTol.bwd) << "dw after += (error relative to the added part)";
    // The same backward again from the same dw0: bit-identical dx and dw.
    auto dx1 = to_f64_vector(d.dx), dw1 = to_f64_vector(d.dw);
    for (int rep = 0; rep < 3; ++rep) {
      OwnedTensor dw = convert(dw0, DType::F32, Device::CUDA);
      OwnedTensor dx = poisoned(DType::BF16, {R, D});
      t.backward({d.x, d.w, d.rstd, d.dy, dx, dw, false});
      EXPECT_EQ(to_f64_vector(dx), dx1) << "dx differs between identical runs (rep " << rep << ")";
      EXPECT_EQ(to_f64_vector(dw), dw1) << "dw differs between identical runs (rep " << rep << ")";
    }
  }
}

TEST_F(RmsNormCuda, UnalignedTensorsTakeTheScalarPath) {
  // D % 8 == 0 but x, y, dy, dx start 2 bytes past a 16-byte boundary; D = 1024 is a width
  // cuda.sm90_bulk covers when aligned, so it is the alignment ("vec") that gives the class to
  // cuda.rowwise: its table directly, then the op's entry points (the resolver's choice).
  const int64_t R = 9, D = 1024;
  Inputs in = make_inputs(R, D, false, 31);
  Ref ref = run_ref(in, false);
  const ImplDesc* bulk = nullptr;
  for (const ImplDesc* i : Registry::global().impls("rmsnorm", Backend::Cuda))
    if (i->name == "cuda.sm90_bulk") bulk = i;
  ASSERT_NE(bulk, nullptr);
  EXPECT_NE(bulk->supports(class_query(D, false)), "") << "cuda.sm90_bulk takes unaligned rows";
  EXPECT_EQ(bulk->supports(class_query(D, true)), "");
  const RmsNormTable entry{rmsnorm_forward, rmsnorm_backward};
  for (const std::string impl : {"cuda.rowwise", "entry points"}) {
    SCOPED_TRACE(impl);
    const RmsNormTable& t = impl == "cuda.rowwise" ? impl_table(impl) : entry;
    Dev d = to_device(in);
    auto shifted = [&](const Tensor& src) {
      OwnedTensor buf = OwnedTensor::zeros(DType::BF16, {R * D + 8}, Device::CUDA);
      Tensor v(static_cast<char*>(buf.view().data()) + 2, DType::BF16, {R, D}, Device::CUDA);
      copy_into(v, src);
      return std::make_pair(std::move(buf), v);
    };
    auto [xb, x] = shifted(d.x);
    auto [dyb, dy] = shifted(d.dy);
    auto [yb, y] = shifted(d.y);
    auto [dxb, dx] = shifted(d.dx);
    t.forward({x, d.w, y, d.rstd, 1e-6, false});
    t.backward({x, d.w, d.rstd, dy, dx, d.dw, false});
    testing::expect_close(y, ref.y, kTol.fwd, "y (unaligned)");
    expect_y_within_half_ulp(y, ref.y);
    testing::expect_close(dx, ref.dx, kTol.bwd, "dx (unaligned)");
    testing::expect_close(d.dw, ref.dw, kTol.bwd, "dw (unaligned)");
  }
}

TEST_F(RmsNormCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  // The production classes (hidden sizes 2048 and 4096, aligned rows): cuda.sm90_bulk.
  testing::expect_resolves_to_cuda("rmsnorm", kChosen, kTol, true, true, class_query(4096, true));
  testing::expect_resolves_to_cuda("rmsnorm", kChosen, kTol, true, true, class_query(2048, true));
}

TEST_F(RmsNormCuda, UnsupportedClassesResolveToRowwise) {
  // Every class cuda.sm90_bulk's backward does not cover, the default one (no dims) included, goes
  // to cuda.rowwise, with one line saying why cuda.sm90_bulk was skipped.
  for (const OpQuery& q :
       {OpQuery{Backend::Cuda, "", {}}, class_query(128, true), class_query(1000, false),
        class_query(1024, false), class_query(12288, true)}) {
    SCOPED_TRACE(q.shape_class);
    const Resolution& r = Registry::global().resolve("rmsnorm", q);
    ASSERT_NE(r.impl, nullptr);
    EXPECT_EQ(r.impl->name, "cuda.rowwise");
    EXPECT_LE(r.error.fwd, kTol.fwd);
    EXPECT_LE(r.error.bwd, kTol.bwd);
    ASSERT_EQ(r.rejected.size(), 1u);
    EXPECT_NE(r.rejected[0].find("skipping cuda.sm90_bulk"), std::string::npos) << r.rejected[0];
  }
}

// Deliberately wrong CUDA implementations, built from cuda.rowwise.
const RmsNormTable* real_cuda_table() {
  return testing::cuda_table<RmsNormTable>("rmsnorm", "cuda.rowwise");
}
// Forward uses w where it should use 1 + w and vice versa.
void wrong_forward(const RmsNormFwd& a) {
  RmsNormFwd b = a;
  b.zero_centred = !a.zero_centred;
  real_cuda_table()->forward(b);
}
// Backward forgets to accumulate dw (writes its dw into a throw-away buffer).
void wrong_backward(const RmsNormBwd& a) {
  OwnedTensor junk = OwnedTensor::zeros(DType::F32, {a.dw.size(0)}, Device::CUDA);
  RmsNormBwd b = a;
  b.dw = junk;
  real_cuda_table()->backward(b);
  device_synchronize(Device::CUDA);  // junk is freed on return
}
void real_forward(const RmsNormFwd& a) { real_cuda_table()->forward(a); }
void real_backward(const RmsNormBwd& a) { real_cuda_table()->backward(a); }
const RmsNormTable kWrongFwd{wrong_forward, real_backward};
const RmsNormTable kWrongBwd{real_forward, wrong_backward};

TEST_F(RmsNormCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_cuda_table(), nullptr) << "cuda.rowwise is not registered";
  testing::expect_probe_rejects("rmsnorm", kChosen,
                                {{"cuda.wrong_fwd", &kWrongFwd}, {"cuda.wrong_dw", &kWrongBwd}},
                                class_query(4096, true));
}

TEST_F(RmsNormCuda, OpsRunOnCudaBackend) {
  const int64_t R = 6, D = 40;
  Inputs in = make_inputs(R, D, true, 41);
  Ref ref = run_ref(in, true);
  OwnedTensor x = convert(in.x, DType::F32), w = convert(in.w, DType::F32),
              dy = convert(in.dy, DType::F32);
  testing::OpsRunOnCuda run("rmsnorm", {{"x", x.view()}, {"w", w.view()}, {"dy", dy.view()}}, true,
                            {{"zero_centred", 1}});
  // `ops run` resolves the op's default class (no dims): the implementation that takes any shape.
  EXPECT_EQ(run.result().impl, "cuda.rowwise");
  testing::expect_close(run.load("y"), ref.y, kTol.fwd, "y (ops run)");
  testing::expect_close(run.load("rstd"), ref.rstd, kTol.fwd, "rstd (ops run)");
  testing::expect_close(run.load("dx"), ref.dx, kTol.bwd, "dx (ops run)");
  testing::expect_close(run.load("dw"), ref.dw, kTol.bwd, "dw (ops run)");
}

TEST_F(RmsNormCuda, BadInputIsAClearError) {
  auto x = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto y = OwnedTensor::zeros(DType::BF16, {4, 8}, Device::CUDA);
  auto r = OwnedTensor::zeros(DType::F32, {4}, Device::CUDA);
  auto w_host = OwnedTensor::zeros(DType::BF16, {8});
  try {
    rmsnorm_forward({x, w_host, y, r, 1e-6, false});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm: all tensors must be on cuda"), std::string::npos)
        << e.what();
  }
  auto w = OwnedTensor::zeros(DType::BF16, {8}, Device::CUDA);
  auto r_bf16 = OwnedTensor::zeros(DType::BF16, {4}, Device::CUDA);
  try {
    rmsnorm_forward({x, w, y, r_bf16, 1e-6, false});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'rstd' has dtype BF16, expected F32"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace gdn::ops
