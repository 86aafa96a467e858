// AdamW: ref and cpu against a direct fp64 implementation of op.h's formula over several steps
// (decay mask on/off, clipping active/inactive, zero gradients), the global norm and clip scale,
// the bf16 compute copy (round to nearest even, ties, specials), multi-tensor == per-tensor, bad
// input, the probe and `ops run`.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "ops/adamw/op.h"
#include "ops/adamw_clip_check.h"
#include "ops/adamw_split_check.h"
#include "ops/dense_test_util.h"
#include "support/op_test_util.h"

namespace gdn::ops {
namespace {

using Vec = std::vector<double>;

// The formula of op.h, written out again independently of reference.cpp.
struct Oracle {
  std::vector<Vec> p, m, v;
  std::vector<bool> decay;
  void step(const std::vector<Vec>& g, const AdamWHyper& h) {
    const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
    for (size_t k = 0; k < p.size(); ++k) {
      for (size_t i = 0; i < p[k].size(); ++i) {
        const double gi = h.grad_scale * g[k][i];
        m[k][i] = h.beta1 * m[k][i] + (1 - h.beta1) * gi;
        v[k][i] = h.beta2 * v[k][i] + (1 - h.beta2) * gi * gi;
        if (decay[k]) p[k][i] = p[k][i] - h.lr * h.weight_decay * p[k][i];
        p[k][i] = p[k][i] - h.lr * (m[k][i] / bc1) / (std::sqrt(v[k][i] / bc2) + h.eps);
      }
    }
  }
};

double norm_of(const std::vector<Vec>& g) {
  double s = 0;
  for (const Vec& x : g)
    for (double y : x) s += y * y;
  return std::sqrt(s);
}

// Random values rounded through `dt` (so fp32 runs and the oracle start from the same numbers).
Vec values(int64_t n, uint64_t seed, double std, DType dt) {
  Vec x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std * rng::normal(seed, 9, i);
  if (dt == DType::F32)
    for (double& y : x) y = static_cast<float>(y);
  return x;
}

// Relative L2 of the concatenation of a - b against the concatenation of b - base (or b).
double rel_concat(const std::vector<Vec>& got, const std::vector<Vec>& want,
                  const std::vector<Vec>* base = nullptr) {
  double num = 0, den = 0;
  for (size_t k = 0; k < got.size(); ++k)
    for (size_t i = 0; i < got[k].size(); ++i) {
      const double w = want[k][i] - (base ? (*base)[k][i] : 0.0);
      const double d = got[k][i] - want[k][i];
      num += d * d;
      den += w * w;
    }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

class AdamWVsFormula : public ::testing::TestWithParam<std::tuple<bool, bool, DType>> {};

// Five steps over five tensors: a matrix, a single element, one crossing the cpu chunk size
// (64K), an empty one, and one whose gradient is always zero.
TEST_P(AdamWVsFormula, MatchesDirectFp64Formula) {
  auto [mask, clip, dt] = GetParam();
  const std::vector<int64_t> sizes = {15, 1, 70001, 0, 17};
  const size_t K = sizes.size();
  Oracle o;
  std::vector<OwnedTensor> p, g, m, v;
  for (size_t k = 0; k < K; ++k) {
    o.p.push_back(values(sizes[k], 10 + k, 1.0, dt));
    o.m.push_back(Vec(static_cast<size_t>(sizes[k]), 0.0));
    o.v.push_back(Vec(static_cast<size_t>(sizes[k]), 0.0));
    o.decay.push_back(!mask || k % 2 == 0);
    p.push_back(from_f64(o.p[k], dt, {sizes[k]}));
    g.push_back(OwnedTensor::zeros(dt, {sizes[k]}));
    m.push_back(OwnedTensor::zeros(dt, {sizes[k]}));
    v.push_back(OwnedTensor::zeros(dt, {sizes[k]}));
  }
  const std::vector<Vec> p0 = o.p;
  std::vector<AdamWParam> params;
  std::vector<Tensor> grads;
  for (size_t k = 0; k < K; ++k) {
    params.push_back({p[k], g[k], m[k], v[k], Tensor(), o.decay[k], {}});
    grads.push_back(g[k]);
  }
  double worst_p = 0, worst_m = 0, worst_v = 0;
  for (int64_t t = 1; t <= 5; ++t) {
    std::vector<Vec> gv(K);
    for (size_t k = 0; k < K; ++k) {
      // Gradients change scale between steps so that v's history matters.
      gv[k] = k == 4 ? Vec(static_cast<size_t>(sizes[k]), 0.0)
                     : values(sizes[k], 100 * static_cast<uint64_t>(t) + k, 0.3 * t, dt);
      if (sizes[k] > 0)
        std::memcpy(g[k].view().data(), from_f64(gv[k], dt, {sizes[k]}).view().data(),
                    static_cast<size_t>(g[k].view().nbytes()));
    }
    const double want_norm = norm_of(gv);
    const double norm = grad_global_norm(grads);
    EXPECT_NEAR(norm, want_norm, 1e-12 * want_norm) << "step " << t;
    const double max_norm = clip ? 0.25 * want_norm : 0.0;
    const double scale = clip_scale(norm, max_norm);
    if (clip) {
      EXPECT_LT(scale, 0.3);
    } else {
      EXPECT_EQ(scale, 1.0);
    }
    AdamWHyper h{2e-2, 0.9, 0.95, 1e-8, 0.1, t, scale};
    adamw_step(params, h);
    o.step(gv, h);
    std::vector<Vec> gp(K), gm(K), gvv(K);
    for (size_t k = 0; k < K; ++k) {
      gp[k] = to_f64_vector(p[k]);
      gm[k] = to_f64_vector(m[k]);
      gvv[k] = to_f64_vector(v[k]);
    }
    worst_p = std::max(worst_p, rel_concat(gp, o.p, &p0));  // error of the change of p
    worst_m = std::max(worst_m, rel_concat(gm, o.m));
    worst_v = std::max(worst_v, rel_concat(gvv, o.v));
  }
  // ref: the same formula in fp64 (measured: equal). cpu: fp32 states; the change of p carries
  // p's own rounding (~6e-8 |p| per step) against changes of ~lr per step: measured 3.1e-6;
  // m and v measured 5.5e-8.
  const bool f64 = dt == DType::F64;
  EXPECT_LE(worst_p, f64 ? 1e-13 : 1e-5) << "p change";
  EXPECT_LE(worst_m, f64 ? 1e-13 : 2e-7) << "m";
  EXPECT_LE(worst_v, f64 ? 1e-13 : 2e-7) << "v";
  std::printf("[ errors ] %s mask=%d clip=%d: dp %.2e, m %.2e, v %.2e\n",
              std::string(dtype_name(dt)).c_str(), mask, clip, worst_p, worst_m, worst_v);
}

std::string adamw_case_name(const ::testing::TestParamInfo<std::tuple<bool, bool, DType>>& info) {
  const auto& p = info.param;
  return fmt::format("mask{}_clip{}_{}", std::get<0>(p) ? 1 : 0, std::get<1>(p) ? 1 : 0,
                     std::get<2>(p) == DType::F64 ? "ref" : "cpu");
}

INSTANTIATE_TEST_SUITE_P(Cases, AdamWVsFormula,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(DType::F64, DType::F32)),
                         adamw_case_name);

TEST(AdamW, ZeroGradientsOnlyDecay) {
  for (DType dt : {DType::F64, DType::F32}) {
    Vec p0 = values(9, 1, 1.0, dt);
    auto pa = from_f64(p0, dt, {9}), pb = from_f64(p0, dt, {9});
    auto g = OwnedTensor::zeros(dt, {9});
    auto ma = OwnedTensor::zeros(dt, {9}), va = OwnedTensor::zeros(dt, {9});
    auto mb = OwnedTensor::zeros(dt, {9}), vb = OwnedTensor::zeros(dt, {9});
    std::vector<AdamWParam> ps = {{pa, g, ma, va, Tensor(), true, "a"},
                                  {pb, g, mb, vb, Tensor(), false, "b"}};
    AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.5, 1, 1.0};
    adamw_step(ps, h);
    auto a = to_f64_vector(pa), b = to_f64_vector(pb);
    for (size_t i = 0; i < p0.size(); ++i) {
      EXPECT_EQ(b[i], p0[i]) << "no decay, no gradient: p must not move";
      EXPECT_NEAR(a[i], p0[i] * (1 - 1e-2 * 0.5), 1e-7 * std::abs(p0[i]));
    }
    for (const Tensor* t : {&ma.view(), &va.view(), &mb.view(), &vb.view()})
      for (double x : to_f64_vector(*t)) EXPECT_EQ(x, 0.0);
  }
}

TEST(AdamW, GlobalNormIsDeterministicAcrossThreadCounts) {
  std::vector<OwnedTensor> own;
  std::vector<Tensor> grads;
  std::vector<Vec> gv;
  for (int64_t n : {200000, 3, 0, 65536, 65537}) {
    gv.push_back(values(n, static_cast<uint64_t>(n) + 1, 1e3, DType::F32));
    own.push_back(from_f64(gv.back(), DType::F32, {n}));
    grads.push_back(own.back());
  }
  const int keep = omp_get_max_threads();
  omp_set_num_threads(1);
  const double n1 = grad_global_norm(grads);
  omp_set_num_threads(2);
  const double n2 = grad_global_norm(grads);
  omp_set_num_threads(3);
  const double n3 = grad_global_norm(grads);
  omp_set_num_threads(keep);
  EXPECT_EQ(n1, n2);
  EXPECT_EQ(n1, n3);
  // fp64 sums of exact fp32 squares in another order: ~1e-16 per term, 3e5 terms.
  EXPECT_NEAR(n1, norm_of(gv), 1e-12 * norm_of(gv));
  EXPECT_EQ(grad_global_norm({}), 0.0);
}

TEST(AdamW, ClipScaleFollowsTorch) {
  EXPECT_EQ(clip_scale(10.0, 0.0), 1.0);  // off
  EXPECT_EQ(clip_scale(10.0, -1.0), 1.0);
  EXPECT_EQ(clip_scale(0.5, 1.0), 1.0);  // below the threshold
  EXPECT_DOUBLE_EQ(clip_scale(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(clip_scale(std::numeric_limits<double>::infinity(), 0.0), 1.0);  // off: not looked at
  testing::expect_error([] { clip_scale(std::numeric_limits<double>::quiet_NaN(), 1.0); },
                        "adamw: the global gradient norm is nan, cannot clip");
  testing::expect_error([] { clip_scale(std::numeric_limits<double>::infinity(), 1.0); },
                        "adamw: the global gradient norm is inf, cannot clip");
}

TEST(AdamW, Bf16RefreshRoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between bf16 1 and 1 + 2^-7: the tie goes to even (1). 1 + 3*2^-8 lies
  // halfway between 1 + 2^-7 and 1 + 2^-6: even is the upper one. Then specials, a subnormal,
  // FLT_MAX (beyond the largest bf16 plus half a step: inf) and 65504 (rounds up to 65536).
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> xs = {1.0f + 0x1p-8f,
                                 1.0f + 3 * 0x1p-8f,
                                 -(1.0f + 0x1p-8f),
                                 1.0f + 0x1.2p-8f,
                                 0.0f,
                                 -0.0f,
                                 inf,
                                 -inf,
                                 0x1p-130f,
                                 std::numeric_limits<float>::max(),
                                 65504.0f,
                                 std::nanf("")};
  const std::vector<uint16_t> want = {0x3f80, 0x3f82, 0xbf80, 0x3f81, 0x0000, 0x8000,
                                      0x7f80, 0xff80, 0x0008, 0x7f80, 0x4780};
  const int64_t n = static_cast<int64_t>(xs.size());
  auto master = OwnedTensor::empty(DType::F32, {n});
  std::memcpy(master.view().data(), xs.data(), xs.size() * sizeof(float));
  auto copy = OwnedTensor::zeros(DType::BF16, {n});
  std::vector<Bf16Copy> cs = {{master, copy}};
  adamw_refresh_bf16(cs);
  const bf16* out = copy.ptr<bf16>();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(out[i].bits, want[i]) << "value " << xs[i];
  EXPECT_TRUE(std::isnan(to_float(out[n - 1]))) << "NaN must stay NaN";
  // ref (F64 masters) gives the same bits for the same values.
  auto master64 = convert(master, DType::F64);
  auto copy64 = OwnedTensor::zeros(DType::BF16, {n});
  std::vector<Bf16Copy> cs64 = {{master64, copy64}};
  adamw_refresh_bf16(cs64);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(copy64.ptr<bf16>()[i].bits, want[i]) << i;
}

TEST(AdamW, RefBf16RoundsOnceFromFp64) {
  // 1 + 2^-8 + 2^-40 rounds to the float 1 + 2^-8 (a bf16 tie, which would go down to 1), but the
  // fp64 value is above the midpoint: correct rounding is 1 + 2^-7. Likewise below the midpoint.
  const std::vector<double> xs = {1.0 + 0x1p-8 + 0x1p-40, 1.0 + 0x1p-8 - 0x1p-40,
                                  -(1.0 + 3 * 0x1p-8 - 0x1p-40), 1.0 + 0x1p-8};
  const std::vector<uint16_t> want = {0x3f81, 0x3f80, 0xbf81, 0x3f80};
  auto master = from_f64(xs, DType::F64, {4});
  auto copy = OwnedTensor::zeros(DType::BF16, {4});
  std::vector<Bf16Copy> cs = {{master, copy}};
  adamw_refresh_bf16(cs);
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_EQ(copy.ptr<bf16>()[i].bits, want[i]) << i;
}

TEST(AdamW, FusedBf16CopyEqualsRefresh) {
  for (DType dt : {DType::F64, DType::F32}) {
    auto p = from_f64(values(1000, 3, 1.0, dt), dt, {10, 100});
    auto g = from_f64(values(1000, 4, 1.0, dt), dt, {10, 100});
    auto m = OwnedTensor::zeros(dt, {10, 100}), v = OwnedTensor::zeros(dt, {10, 100});
    auto fused = OwnedTensor::zeros(DType::BF16, {10, 100});
    auto refreshed = OwnedTensor::zeros(DType::BF16, {10, 100});
    std::vector<AdamWParam> ps = {{p, g, m, v, fused, true, "w"}};
    adamw_step(ps, AdamWHyper{});
    std::vector<Bf16Copy> cs = {{p, refreshed}};
    adamw_refresh_bf16(cs);
    EXPECT_EQ(std::memcmp(fused.view().data(), refreshed.view().data(), 2000), 0) << dtype_name(dt);
  }
}

TEST(AdamW, SplitMastersStepLikeFp32Masters) {
  testing_adamw::check_split_master_steps(Device::CPU, [](const Tensor& t, bool) { return t; });
}

TEST(AdamW, SplitRefreshWritesBothHalves) { testing_adamw::check_split_refresh(Device::CPU); }

TEST(AdamW, MultiTensorCallEqualsOneCallPerTensor) {
  const std::vector<int64_t> sizes = {5, 70000, 1, 300};
  std::vector<OwnedTensor> a, b;  // p, g, m, v per tensor, twice
  for (size_t k = 0; k < sizes.size(); ++k)
    for (int j = 0; j < 4; ++j) {
      Vec x = values(sizes[k], 20 + 4 * k + j, j == 3 ? 0.1 : 1.0, DType::F32);
      if (j == 3)
        for (double& y : x) y = y * y;  // v >= 0
      a.push_back(from_f64(x, DType::F32, {sizes[k]}));
      b.push_back(from_f64(x, DType::F32, {sizes[k]}));
    }
  AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 7, 0.6};
  std::vector<AdamWParam> all;
  for (size_t k = 0; k < sizes.size(); ++k)
    all.push_back({a[4 * k], a[4 * k + 1], a[4 * k + 2], a[4 * k + 3], Tensor(), k != 2, {}});
  adamw_step(all, h);
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<AdamWParam> one = {
        {b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3], Tensor(), k != 2, {}}};
    adamw_step(one, h);
  }
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].view().data(), b[i].view().data(), a[i].view().nbytes()), 0) << i;
}

TEST(AdamW, ClipDecidedWhereTheTensorsLiveMatchesTheHostScale) {
  testing_adamw::check_clip_on_device(Device::CPU);
}

TEST(AdamW, BadClipInputIsAClearError) {
  auto p = OwnedTensor::zeros(DType::F32, {3});
  auto g = OwnedTensor::zeros(DType::F32, {3});
  auto m = OwnedTensor::zeros(DType::F32, {3});
  auto v = OwnedTensor::zeros(DType::F32, {3});
  std::vector<AdamWParam> ps = {{p, g, m, v, Tensor(), true, "w"}};
  auto ss32 = OwnedTensor::zeros(DType::F32, {1});
  auto ss2 = OwnedTensor::zeros(DType::F64, {2});
  auto ss = OwnedTensor::zeros(DType::F64, {1});
  auto li = OwnedTensor::zeros(DType::I32, {2});
  auto l2d = OwnedTensor::zeros(DType::F32, {1, 2});
  AdamWHyper h;
  testing::expect_error(
      [&] {
        adamw_step(ps, h, AdamWClip{ss32, Tensor(), 1.0});
      },
      "'clip_sumsq' has dtype F32");
  testing::expect_error([&] { adamw_step(ps, h, AdamWClip{ss2, Tensor(), 1.0}); }, "clip_sumsq");
  testing::expect_error(
      [&] {
        adamw_step(ps, h, AdamWClip{Tensor(), ss, 1.0});
      },
      "clip losses given without clip sumsq");
  testing::expect_error(
      [&] {
        adamw_step(ps, h, AdamWClip{ss, li, 1.0});
      },
      "'clip_losses' has dtype I32");
  testing::expect_error(
      [&] {
        adamw_step(ps, h, AdamWClip{ss, l2d, 1.0});
      },
      "'clip_losses' has shape [1, 2]");
  testing::expect_error(
      [&] {
        adamw_step(ps, h, AdamWClip{ss, Tensor(), std::numeric_limits<double>::infinity()});
      },
      "max_norm must be finite");
  std::vector<Tensor> gs = {g};
  testing::expect_error([&] { grad_sumsq_into(gs, ss32); }, "'out' has dtype F32");
}

TEST(AdamW, BadInputIsAClearError) {
  auto p = OwnedTensor::zeros(DType::F32, {4, 6});
  auto g = OwnedTensor::zeros(DType::F32, {4, 6});
  auto m = OwnedTensor::zeros(DType::F32, {4, 6});
  auto v = OwnedTensor::zeros(DType::F32, {4, 6});
  auto g_bad = OwnedTensor::zeros(DType::F32, {4, 5});
  auto p2 = OwnedTensor::zeros(DType::F32, {3});
  auto g2 = OwnedTensor::zeros(DType::F32, {3});
  auto m2 = OwnedTensor::zeros(DType::F32, {3});
  auto v2 = OwnedTensor::zeros(DType::F32, {3});
  {
    std::vector<AdamWParam> ps = {{p2, g2, m2, v2, Tensor(), true, {}},
                                  {p, g_bad, m, v, Tensor(), true, {}}};
    testing::expect_error([&] { adamw_step(ps, AdamWHyper{}); },
                          "adamw: tensor 'params[1].g' has shape [4, 5], expected [4, 6]");
  }
  {
    std::vector<AdamWParam> ps = {{p, g_bad, m, v, Tensor(), true, "layers.0.mlp.up_proj.weight"}};
    testing::expect_error(
        [&] { adamw_step(ps, AdamWHyper{}); },
        "adamw: tensor 'layers.0.mlp.up_proj.weight.g' has shape [4, 5], expected [4, 6]");
  }
  {
    auto m64 = OwnedTensor::zeros(DType::F64, {4, 6});
    std::vector<AdamWParam> ps = {{p, g, m64, v, Tensor(), true, {}}};
    testing::expect_error([&] { adamw_step(ps, AdamWHyper{}); },
                          "adamw: tensor 'params[0].m' has dtype F64, expected F32");
  }
  {
    auto bf_bad = OwnedTensor::zeros(DType::F32, {4, 6});
    std::vector<AdamWParam> ps = {{p, g, m, v, bf_bad, true, {}}};
    testing::expect_error([&] { adamw_step(ps, AdamWHyper{}); },
                          "adamw: tensor 'params[0].p_bf16' has dtype F32, expected BF16");
  }
  {
    std::vector<AdamWParam> ps = {{p, g, m, m, Tensor(), true, {}}};
    testing::expect_error([&] { adamw_step(ps, AdamWHyper{}); },
                          "adamw: tensors 'params[0].m' and 'params[0].v' share memory");
  }
  {
    auto pb = OwnedTensor::zeros(DType::BF16, {4, 6});
    std::vector<AdamWParam> ps = {{pb, g, m, v, Tensor(), true, {}}};
    testing::expect_error([&] { adamw_step(ps, AdamWHyper{}); },
                          "adamw: tensor 'params[0].p' has dtype BF16, expected F32");
  }
  {
    auto lo = OwnedTensor::zeros(DType::I16, {4, 6});
    std::vector<AdamWParam> ps = {{lo, g, m, v, Tensor(), true, "w"}};
    testing::expect_error([&] { adamw_step(ps, AdamWHyper{}); },
                          "adamw: tensor 'w.p' is the I16 low half of a split master, but "
                          "'w.p_bf16' (its high half) is not given");
    auto g64 = OwnedTensor::zeros(DType::F64, {4, 6});
    auto hi = OwnedTensor::zeros(DType::BF16, {4, 6});
    std::vector<AdamWParam> ps64 = {{lo, g64, m, v, hi, true, "w"}};
    testing::expect_error([&] { adamw_step(ps64, AdamWHyper{}); },
                          "adamw: tensor 'w.g' has dtype F64, expected F32");
    auto p64 = OwnedTensor::zeros(DType::F64, {4, 6});
    auto m64 = OwnedTensor::zeros(DType::F64, {4, 6}), v64 = OwnedTensor::zeros(DType::F64, {4, 6});
    std::vector<AdamWParam> mixed = {{p64, g64, m64, v64, Tensor(), true, "a"},
                                     {lo, g, m, v, hi, true, "b"}};
    testing::expect_error([&] { adamw_step(mixed, AdamWHyper{}); },
                          "adamw: tensor 'b.p' has dtype I16, expected F64");
    auto lo_bad = OwnedTensor::zeros(DType::I16, {6, 4});
    std::vector<Bf16Copy> split_bad = {{p, hi, lo_bad}};
    testing::expect_error([&] { adamw_refresh_bf16(split_bad); },
                          "adamw: tensor 'copies[0].lo' has shape [6, 4], expected [4, 6]");
    std::vector<Bf16Copy> split64 = {{p64, hi, lo}};
    testing::expect_error([&] { adamw_refresh_bf16(split64); },
                          "adamw: tensor 'copies[0].master' has dtype F64, expected F32");
  }
  std::vector<AdamWParam> ok = {{p, g, m, v, Tensor(), true, {}}};
  AdamWHyper h;
  h.step = 0;
  testing::expect_error([&] { adamw_step(ok, h); }, "adamw: step must be >= 1");
  h = AdamWHyper{};
  h.beta1 = 1.0;
  testing::expect_error([&] { adamw_step(ok, h); }, "adamw: beta1 must be in [0, 1), got 1");
  h = AdamWHyper{};
  h.eps = 0;
  testing::expect_error([&] { adamw_step(ok, h); }, "adamw: eps must be finite and > 0");
  h = AdamWHyper{};
  h.grad_scale = std::numeric_limits<double>::quiet_NaN();
  testing::expect_error([&] { adamw_step(ok, h); }, "adamw: grad_scale must be finite");
  std::vector<Tensor> grads = {g, OwnedTensor::zeros(DType::F64, {2}).view()};
  testing::expect_error([&] { grad_global_norm(grads); },
                        "adamw: tensor 'grads[1]' has dtype F64, expected F32");
  auto c_bad = OwnedTensor::zeros(DType::BF16, {6, 4});
  std::vector<Bf16Copy> cs = {{p, c_bad}};
  testing::expect_error([&] { adamw_refresh_bf16(cs); },
                        "adamw: tensor 'copies[0].copy' has shape [6, 4], expected [4, 6]");
}

// Wrong variants the probe must reject: no bias correction; weight decay ignoring the mask.
void cpu_step(const AdamWStep& s) {
  Registry::global().table<AdamWTable>("adamw", OpQuery{Backend::Cpu, "", {}}).step(s);
}
void no_bias_correction(const AdamWStep& s) {
  AdamWStep t = s;
  t.hyper.step = 1 << 20;  // b^t ~ 0: both corrections vanish
  cpu_step(t);
}
void decay_everything(const AdamWStep& s) {
  std::vector<AdamWParam> ps(s.params.begin(), s.params.end());
  for (auto& e : ps) e.decay = true;
  cpu_step({ps, s.hyper, s.clip});
}
double cpu_sumsq(std::span<const Tensor> g) {
  return Registry::global().table<AdamWTable>("adamw", OpQuery{Backend::Cpu, "", {}}).grad_sumsq(g);
}
void cpu_sumsq_into(std::span<const Tensor> g, const Tensor& out) {
  Registry::global()
      .table<AdamWTable>("adamw", OpQuery{Backend::Cpu, "", {}})
      .grad_sumsq_into(g, out);
}
void cpu_refresh(std::span<const Bf16Copy> c) {
  Registry::global().table<AdamWTable>("adamw", OpQuery{Backend::Cpu, "", {}}).refresh_bf16(c);
}
const AdamWTable kNoBias{no_bias_correction, cpu_sumsq, cpu_sumsq_into, cpu_refresh};
const AdamWTable kDecayAll{decay_everything, cpu_sumsq, cpu_sumsq_into, cpu_refresh};

TEST(AdamW, ProbeAcceptsCpuAndRejectsWrongVariants) {
  const Resolution& r = Registry::global().resolve("adamw", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.multi_tensor");
  EXPECT_LE(r.error.fwd, 2e-6);
  const OpDesc& op = Registry::global().op("adamw");
  const double tol = op.tolerance(DType::F32).fwd;
  for (const AdamWTable* t : {&kNoBias, &kDecayAll}) {
    ProbeError e = op.probe({"adamw", "cpu.wrong", Backend::Cpu, 0, nullptr, t},
                            OpQuery{Backend::Cpu, "", {}});
    EXPECT_GT(e.fwd, tol);
  }
}

TEST(AdamW, OpsRunFromFile) {
  Vec p0 = values(12, 30, 1.0, DType::F32), g0 = values(12, 31, 2.0, DType::F32);
  Vec m0 = values(12, 32, 0.1, DType::F32), v0 = values(12, 33, 0.1, DType::F32);
  for (double& x : v0) x = x * x;
  for (double& x : v0) x = static_cast<float>(x);
  auto p = from_f64(p0, DType::F32, {3, 4}), g = from_f64(g0, DType::F32, {3, 4});
  auto m = from_f64(m0, DType::F32, {3, 4}), v = from_f64(v0, DType::F32, {3, 4});
  const double norm = norm_of({g0});
  auto out = testing::run_op_via_file(
      "adamw", Backend::Cpu, {{"p", p}, {"g", g}, {"m", m}, {"v", v}}, false,
      {{"lr", 0.1}, {"step", 3}, {"max_norm", 0.5 * norm}, {"weight_decay", 0.1}});
  Oracle o{{p0}, {m0}, {v0}, {true}};
  AdamWHyper h{0.1, 0.9, 0.999, 1e-8, 0.1, 3, clip_scale(norm, 0.5 * norm)};
  o.step({g0}, h);
  EXPECT_NEAR(to_f64_vector(out.at("grad_norm"))[0], norm, 1e-12 * norm);
  std::vector<Vec> base = {p0};
  EXPECT_LE(rel_concat({to_f64_vector(out.at("p"))}, o.p, &base), 5e-6);
  EXPECT_LE(rel_concat({to_f64_vector(out.at("m"))}, o.m), 2e-6);
  EXPECT_LE(rel_concat({to_f64_vector(out.at("v"))}, o.v), 2e-6);
  auto bf = convert(out.at("p"), DType::F32);
  EXPECT_EQ(testing::rel_err(out.at("p_bf16"), convert(bf, DType::BF16)), 0.0);
  testing::expect_error(
      [&] {
        testing::run_op_via_file("adamw", Backend::Cpu, {{"p", p}, {"g", g}}, true, {});
      },
      "adamw: the optimizer step has no backward");
}

}  // namespace
}  // namespace gdn::ops
