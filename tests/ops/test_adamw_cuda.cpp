// AdamW on CUDA (label gpu): the multi-tensor step against ref over several steps and many tensors
// and bit for bit against the cpu step
// (more than one kernel-argument list, sizes around the 4096-element unit and the 16-byte groups,
// empty tensors, decay on and off, clipping on and off, zero gradients), the fused bf16 copy equal
// bit for bit to the masters rounded to nearest even, tensors that are not 16-byte aligned, the
// global gradient norm against an fp64 sum and bitwise reproducible (also over more units than
// resident blocks and more tensors than one list), refresh_bf16, the resolver's
// choice and probe, `ops run` on the cuda backend, and bad input. The tolerance comes from
// src/backend/tolerances.h.
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "backend/tolerances.h"
#include "gdn/core/rng.h"
#include "ops/adamw/op.h"
#include "ops/adamw_clip_check.h"
#include "ops/adamw_split_check.h"
#include "ops/cuda_test_util.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

constexpr ProbeError kTol = bf16_tolerance("adamw");

class AdamWCuda : public CudaOpTest {};

using Vec = std::vector<double>;

// fp32-representable random values.
Vec values(int64_t n, uint64_t seed, double std) {
  Vec x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std * rng::normal(seed, 9, i));
  return x;
}

// One parameter tensor on both sides: F64 host for ref, F32 (+ BF16 copy) on the device, the
// device ones optionally starting `offset` bytes past a 16-byte boundary.
struct Slot {
  int64_t n;
  bool decay, copy;
  OwnedTensor rp, rg, rm, rv;  // ref, F64 host
  Tensor p, g, m, v, pb;       // device views
  Vec p0;
};

struct Model {
  std::vector<Slot> slots;
  std::vector<OwnedTensor> keep;  // device buffers behind the views

  Tensor device_f32(const Vec& x, int offset) {
    OwnedTensor t = from_f64(x, DType::F32, {static_cast<int64_t>(x.size())}, Device::CUDA);
    if (offset == 0) {
      Tensor v = t.view();
      keep.push_back(std::move(t));
      return v;
    }
    return unaligned_copy(t, offset, keep);
  }

  void add(int64_t n, bool decay, bool copy, uint64_t seed, int offset = 0) {
    Slot s{n, decay, copy, {}, {}, {}, {}, {}, {}, {}, {}, {}, values(n, seed, 1.0)};
    s.rp = from_f64(s.p0, DType::F64, {n});
    s.rg = OwnedTensor::zeros(DType::F64, {n});
    s.rm = OwnedTensor::zeros(DType::F64, {n});
    s.rv = OwnedTensor::zeros(DType::F64, {n});
    s.p = device_f32(s.p0, offset);
    s.g = device_f32(Vec(static_cast<size_t>(n), 0.0), offset);
    s.m = device_f32(Vec(static_cast<size_t>(n), 0.0), offset);
    s.v = device_f32(Vec(static_cast<size_t>(n), 0.0), offset);
    if (copy) {
      OwnedTensor b = poisoned(DType::BF16, {n});
      s.pb = offset == 0 ? b.view() : unaligned_copy(b, 2, keep);
      keep.push_back(std::move(b));
    }
    slots.push_back(std::move(s));
  }

  // New gradients (zero for every 5th tensor), the same values on both sides.
  void set_grads(uint64_t seed, double std) {
    for (size_t k = 0; k < slots.size(); ++k) {
      Slot& s = slots[k];
      const Vec g = k % 5 == 4 ? Vec(static_cast<size_t>(s.n), 0.0) : values(s.n, seed + k, std);
      if (s.n == 0) continue;
      std::memcpy(s.rg.view().data(), g.data(), g.size() * sizeof(double));
      copy_into(s.g, from_f64(g, DType::F32, {s.n}));
    }
  }

  std::vector<AdamWParam> ref_params() const {
    std::vector<AdamWParam> r;
    for (const Slot& s : slots) r.push_back({s.rp, s.rg, s.rm, s.rv, Tensor(), s.decay, {}});
    return r;
  }
  std::vector<AdamWParam> cuda_params() const {
    std::vector<AdamWParam> r;
    for (const Slot& s : slots) r.push_back({s.p, s.g, s.m, s.v, s.pb, s.decay, {}});
    return r;
  }
  std::vector<Tensor> cuda_grads() const {
    std::vector<Tensor> r;
    for (const Slot& s : slots) r.push_back(s.g);
    return r;
  }
  double ref_norm() const {
    double sum = 0;
    for (const Slot& s : slots)
      for (double x : to_f64_vector(s.rg)) sum += x * x;
    return std::sqrt(sum);
  }
};

// Concatenated relative L2 error of (cuda - base) against (ref - base), for p (the update hides
// under p's own rounding otherwise), and of m and v; plus the bf16 copies checked bit for bit
// against the masters converted on the host (round to nearest even).
void compare(const Model& md, const std::string& tag) {
  Vec dp_c, dp_r, m_c, m_r, v_c, v_r;
  for (const Slot& s : md.slots) {
    const Vec pc = to_f64_vector(s.p), pr = to_f64_vector(s.rp);
    for (size_t i = 0; i < pc.size(); ++i) {
      dp_c.push_back(pc[i] - s.p0[i]);
      dp_r.push_back(pr[i] - s.p0[i]);
    }
    for (double x : to_f64_vector(s.m)) m_c.push_back(x);
    for (double x : to_f64_vector(s.rm)) m_r.push_back(x);
    for (double x : to_f64_vector(s.v)) v_c.push_back(x);
    for (double x : to_f64_vector(s.rv)) v_r.push_back(x);
    if (s.copy && s.n > 0) {
      OwnedTensor want = convert(s.p, DType::BF16);
      expect_bitwise_equal(s.pb, want,
                           "p_bf16 of a " + std::to_string(s.n) + "-element tensor" + tag);
    }
  }
  EXPECT_LE(rel_l2_error(dp_c, dp_r), kTol.fwd) << "p - p0" << tag;
  EXPECT_LE(rel_l2_error(m_c, m_r), kTol.fwd) << "m" << tag;
  EXPECT_LE(rel_l2_error(v_c, v_r), kTol.fwd) << "v" << tag;
}

// Steps 1..3 with the clip scale active on step 2 when `clip`.
void run_steps(Model& md, bool clip, const std::string& tag) {
  const std::vector<AdamWParam> rp = md.ref_params(), cp = md.cuda_params();
  const std::vector<Tensor> cg = md.cuda_grads();
  for (int64_t t = 1; t <= 3; ++t) {
    md.set_grads(1000 * static_cast<uint64_t>(t), 0.3 * static_cast<double>(t));
    const double want = md.ref_norm(), got = grad_global_norm(cg);
    EXPECT_NEAR(got, want, 1e-12 * want) << "global norm, step " << t << tag;
    const double scale = clip && t == 2 ? clip_scale(got, 0.25 * got) : 1.0;
    const AdamWHyper h{2e-2, 0.9, 0.95, 1e-8, 0.1, t, scale};
    adamw_step(rp, h);
    adamw_step(cp, h);
  }
  compare(md, tag);
}

TEST_F(AdamWCuda, ManyTensorsMatchRef) {
  // 300 tensors (three kernel-argument lists of <= 128): sizes around 1, the 4-element groups,
  // the 4096-element unit, and a few large ones; empty tensors; decay and the bf16 copy mixed.
  Model md;
  const int64_t special[] = {0, 1, 3, 4, 5, 7, 8, 4095, 4096, 4097, 8191, 70001, 262147};
  for (int k = 0; k < 300; ++k) {
    const int64_t n = k < static_cast<int>(std::size(special)) ? special[k] : (k * 7919) % 3001;
    md.add(n, k % 3 != 1, k % 2 == 0, 50 + static_cast<uint64_t>(k));
  }
  run_steps(md, false, " (no clip)");
}

TEST_F(AdamWCuda, ClippedStepsMatchRef) {
  Model md;
  for (int k = 0; k < 9; ++k)
    md.add(1000 * k + 13, k % 2 == 0, true, 70 + static_cast<uint64_t>(k));
  run_steps(md, true, " (clip on step 2)");
}

TEST_F(AdamWCuda, UnalignedTensorsMatchRef) {
  // Offsets of 4 bytes (fp32) and 2 bytes (the bf16 copy): the per-element path, mixed in one
  // call with aligned tensors.
  Model md;
  for (int k = 0; k < 8; ++k)
    md.add(4097 + 3 * k, k % 2 == 0, true, 90 + static_cast<uint64_t>(k), k % 2 == 0 ? 4 : 0);
  run_steps(md, false, " (unaligned)");
}

// The cuda step rounds every operation of the update explicitly (cuda.cu, adamw_elem), as the
// cpu step computes it in fp32 without contraction, so the two give the same bits: p, m, v and the
// bf16 copy, over three steps with clipping, through the 16-byte path (aligned) and the
// per-element one (4 bytes off).
TEST_F(AdamWCuda, StepIsBitwiseTheCpuStep) {
  for (int offset : {0, 4}) {
    Model md;  // its device slots; the cpu twins below hold the same values on the host
    std::vector<OwnedTensor> hp, hg, hm, hv, hb;
    std::vector<AdamWParam> cpu;
    const int64_t sizes[] = {1, 7, 4096, 4101, 30011};
    for (int k = 0; k < 5; ++k) {
      md.add(sizes[k], k % 2 == 0, true, 300 + static_cast<uint64_t>(k), offset);
      const int64_t n = sizes[k];
      hp.push_back(from_f64(md.slots.back().p0, DType::F32, {n}));
      hg.push_back(OwnedTensor::zeros(DType::F32, {n}));
      hm.push_back(OwnedTensor::zeros(DType::F32, {n}));
      hv.push_back(OwnedTensor::zeros(DType::F32, {n}));
      hb.push_back(OwnedTensor::zeros(DType::BF16, {n}));
    }
    for (size_t k = 0; k < hp.size(); ++k)
      cpu.push_back({hp[k].view(),
                     hg[k].view(),
                     hm[k].view(),
                     hv[k].view(),
                     hb[k].view(),
                     md.slots[k].decay,
                     {}});
    const std::vector<AdamWParam> cp = md.cuda_params();
    for (int64_t t = 1; t <= 3; ++t) {
      md.set_grads(4000 * static_cast<uint64_t>(t), 0.2 * static_cast<double>(t));
      for (size_t k = 0; k < hg.size(); ++k) copy_into(hg[k].view(), md.slots[k].g);
      const AdamWHyper h{3e-2, 0.9, 0.95, 1e-8, 0.1, t, t == 2 ? 0.37 : 1.0};
      adamw_step(cpu, h);
      adamw_step(cp, h);
    }
    for (size_t k = 0; k < hp.size(); ++k) {
      const std::string tag =
          fmt::format(" of the {}-element tensor, offset {}", md.slots[k].n, offset);
      expect_bitwise_equal(md.slots[k].p, hp[k].view(), "p" + tag);
      expect_bitwise_equal(md.slots[k].m, hm[k].view(), "m" + tag);
      expect_bitwise_equal(md.slots[k].v, hv[k].view(), "v" + tag);
      expect_bitwise_equal(md.slots[k].pb, hb[k].view(), "p_bf16" + tag);
    }
  }
}

TEST_F(AdamWCuda, GlobalNormIsBitwiseReproducible) {
  Model md;
  for (int k = 0; k < 200; ++k)
    md.add((k * 104729) % 50000 + 1, true, false, 7 + static_cast<uint64_t>(k));
  md.set_grads(11, 3.0);
  const std::vector<Tensor> g = md.cuda_grads();
  const double first = grad_global_norm(g);
  EXPECT_NEAR(first, md.ref_norm(), 1e-12 * first);
  for (int rep = 0; rep < 5; ++rep) EXPECT_EQ(grad_global_norm(g), first) << "rep " << rep;
  const std::vector<Tensor> none;
  EXPECT_EQ(grad_global_norm(none), 0.0);
}

// Gradient tensors on the device (some starting past a 16-byte boundary) with the fp64 sum of
// their squares on the host; check(): grad_global_norm against it, and bitwise reproducible.
struct GradList {
  explicit GradList(double sd) : sd(sd) {}
  void add(int64_t n, uint64_t seed, int offset) {
    const Vec x = values(n, seed, sd);
    for (double v : x) want += v * v;
    OwnedTensor t = from_f64(x, DType::F32, {n}, Device::CUDA);
    if (offset == 0) {
      g.push_back(t.view());
      keep.push_back(std::move(t));
    } else {
      g.push_back(unaligned_copy(t, offset, keep));
    }
  }
  void check() const {
    const double got = grad_global_norm(g);
    EXPECT_NEAR(got, std::sqrt(want), 1e-12 * std::sqrt(want));
    for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(grad_global_norm(g), got) << "rep " << rep;
  }
  double sd, want = 0.0;
  std::vector<OwnedTensor> keep;
  std::vector<Tensor> g;
};

TEST_F(AdamWCuda, GlobalNormOverManyUnitsAndLists) {
  // One tensor of 2^23 + 5 elements (many more work units than blocks resident at once), 700
  // small ones (several grad_sumsq lists of <= 128 tensors), one of them unaligned (the
  // per-element path between vector units). Against the fp64 sum on the host, and bitwise
  // reproducible.
  GradList l(1.0);
  l.add((int64_t{1} << 23) + 5, 1, 0);
  for (int k = 0; k < 700; ++k)
    l.add((k * 7919) % 5000 + 1, 100 + static_cast<uint64_t>(k), k == 350 ? 4 : 0);
  l.check();
}

TEST_F(AdamWCuda, ClipDecidedOnTheDeviceMatchesTheHostScaleWithoutDraining) {
  testing_adamw::check_clip_on_device(Device::CUDA);
}

TEST_F(AdamWCuda, GlobalNormAroundTheUnitAndLoadStepEdges) {
  // grad_sumsq's blocks read units of 32768 elements in steps of 8192 (256 threads x 8 groups of
  // 4): sizes just under, at and past both, with 1-3 trailing elements past the last whole group,
  // and tensors starting 4, 8 or 12 bytes past a 16-byte boundary (the per-element path) over
  // several units. Against the fp64 sum on the host, and bitwise reproducible.
  GradList l(0.5);
  const int64_t sizes[] = {1,     3,     4,     5,     8191,  8192,  8193,  8195,
                           32767, 32768, 32769, 32771, 32772, 65541, 98303, 3 * 32768 + 7};
  uint64_t seed = 500;
  for (int64_t n : sizes) l.add(n, seed++, 0);
  l.add(2 * 32768 + 5, seed++, 4);
  l.add(32768 + 8192 + 2, seed++, 8);
  l.add(7, seed++, 12);
  l.check();
}

TEST_F(AdamWCuda, RefreshBf16RoundsToNearestEven) {
  // Masters exactly halfway between two bf16 values (m + 1/2) 2^e with m of 8 significant bits
  // (ties go to the even m), just above and below such ties, random values, and specials.
  std::vector<double> vals;
  for (int i = 0; i < 3000; ++i) {
    const double m = 128 + i % 128, scale = std::ldexp(1.0, i % 40 - 20), sign = i % 3 ? 1 : -1;
    vals.push_back(sign * (m + 0.5) * scale);
    vals.push_back(sign * (m + 0.5 + 1.0 / 1024) * scale);
    vals.push_back(sign * (m + 0.5 - 1.0 / 1024) * scale);
    vals.push_back(static_cast<float>(rng::normal(3, 3, static_cast<uint64_t>(i))));
  }
  vals.push_back(0.0);
  vals.push_back(-0.0);
  vals.push_back(std::numeric_limits<double>::infinity());
  vals.push_back(3.4e38);  // finite in fp32, past the largest bf16: rounds to infinity
  const int64_t n = static_cast<int64_t>(vals.size());
  std::vector<OwnedTensor> keep;
  OwnedTensor m = from_f64(vals, DType::F32, {n}, Device::CUDA);
  OwnedTensor c = poisoned(DType::BF16, {n});
  OwnedTensor m_odd =
      from_f64(Vec(vals.begin(), vals.begin() + 1001), DType::F32, {1001}, Device::CUDA);
  Tensor mu = unaligned_copy(m_odd, 4, keep);
  Tensor cu = unaligned_copy(poisoned(DType::BF16, {1001}), 2, keep);
  const Bf16Copy copies[] = {{m, c}, {mu, cu}};
  adamw_refresh_bf16(copies);
  expect_bitwise_equal(c, convert(m, DType::BF16), "refreshed copy");
  expect_bitwise_equal(cu, convert(mu, DType::BF16), "refreshed copy (unaligned)");
}

TEST_F(AdamWCuda, SplitMastersStepLikeFp32Masters) {
  // Odd tensors go through copies one element past a 16-byte boundary (the per-element path).
  std::vector<OwnedTensor> keep;
  testing_adamw::check_split_master_steps(Device::CUDA, [&](const Tensor& t, bool odd) {
    return odd ? unaligned_copy(t, static_cast<int>(dtype_size(t.dtype())), keep) : t;
  });
}

TEST_F(AdamWCuda, SplitRefreshWritesBothHalves) {
  testing_adamw::check_split_refresh(Device::CUDA);
}

TEST_F(AdamWCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("adamw", "cuda.multi_tensor", kTol, false, false);
}

// Deliberately wrong CUDA implementations built from the real one: a step that ignores the clip
// scale, and a gradient sum of squares that misses the tail of every tensor.
const AdamWTable* real_table() { return cuda_table<AdamWTable>("adamw", "cuda.multi_tensor"); }
void real_step(const AdamWStep& s) { real_table()->step(s); }
double real_sumsq(std::span<const Tensor> g) { return real_table()->grad_sumsq(g); }
void real_sumsq_into(std::span<const Tensor> g, const Tensor& out) {
  real_table()->grad_sumsq_into(g, out);
}
void real_refresh(std::span<const Bf16Copy> c) { real_table()->refresh_bf16(c); }
void unscaled_step(const AdamWStep& s) {
  AdamWStep t = s;
  t.hyper.grad_scale = 1.0;
  real_table()->step(t);
}
double head_sumsq(std::span<const Tensor> grads) {
  std::vector<Tensor> heads;
  for (const Tensor& g : grads)
    heads.push_back(g.numel() > 1 ? g.reshape({g.numel()}).slice0(0, g.numel() - 1) : g);
  return real_table()->grad_sumsq(heads);
}
const AdamWTable kWrongStep{unscaled_step, real_sumsq, real_sumsq_into, real_refresh};
const AdamWTable kWrongNorm{real_step, head_sumsq, real_sumsq_into, real_refresh};

TEST_F(AdamWCuda, ProbeRejectsWrongCudaKernels) {
  ASSERT_NE(real_table(), nullptr) << "cuda.multi_tensor is not registered";
  expect_probe_rejects("adamw", "cuda.multi_tensor",
                       {{"cuda.wrong_scale", &kWrongStep}, {"cuda.wrong_norm", &kWrongNorm}});
}

TEST_F(AdamWCuda, OpsRunOnCudaBackend) {
  const int64_t n = 300;
  const Vec p0 = values(n, 1, 1.0), g = values(n, 2, 0.5);
  OwnedTensor pf = from_f64(p0, DType::F32, {n}), gf = from_f64(g, DType::F32, {n});
  OpsRunOnCuda run("adamw", {{"p", pf}, {"g", gf}}, false, {{"lr", 0.01}, {"max_norm", 1.0}});
  EXPECT_EQ(run.result().impl, "cuda.multi_tensor");
  // ref on the same file values
  OwnedTensor rp = from_f64(p0, DType::F64, {n}), rg = from_f64(g, DType::F64, {n});
  OwnedTensor rm = OwnedTensor::zeros(DType::F64, {n}), rv = OwnedTensor::zeros(DType::F64, {n});
  const Tensor rgv = rg.view();
  const double norm = grad_global_norm(std::span<const Tensor>(&rgv, 1));
  EXPECT_NEAR(run.load("grad_norm").view().ptr<double>()[0], norm, 1e-12 * norm);
  AdamWHyper h;
  h.lr = 0.01;
  h.grad_scale = clip_scale(norm, 1.0);
  const AdamWParam e{rp, rg, rm, rv, Tensor(), true, "p"};
  adamw_step(std::span<const AdamWParam>(&e, 1), h);
  Vec dc = to_f64_vector(run.load("p")), dr = to_f64_vector(rp);
  for (size_t i = 0; i < dc.size(); ++i) {
    dc[i] -= p0[i];
    dr[i] -= p0[i];
  }
  EXPECT_LE(rel_l2_error(dc, dr), kTol.fwd) << "p - p0 (ops run)";
  expect_close(run.load("m"), rm, kTol.fwd, "m (ops run)");
  expect_close(run.load("v"), rv, kTol.fwd, "v (ops run)");
}

TEST_F(AdamWCuda, BadInputIsAClearError) {
  auto p = OwnedTensor::zeros(DType::F32, {8}, Device::CUDA);
  auto g = OwnedTensor::zeros(DType::F32, {8}, Device::CUDA);
  auto m = OwnedTensor::zeros(DType::F32, {8}, Device::CUDA);
  auto v16 = OwnedTensor::zeros(DType::BF16, {8}, Device::CUDA);
  const AdamWParam bad_v{p, g, m, v16, Tensor(), true, "w"};
  EXPECT_NE(error_of([&] {
              adamw_step(std::span<const AdamWParam>(&bad_v, 1), AdamWHyper{});
            }).find("adamw: tensor 'w.v' has dtype BF16, expected F32"),
            std::string::npos);
  auto v = OwnedTensor::zeros(DType::F32, {8}, Device::CUDA);
  auto pb32 = OwnedTensor::zeros(DType::F32, {8}, Device::CUDA);
  const AdamWParam bad_copy{p, g, m, v, pb32, true, "w"};
  EXPECT_NE(error_of([&] {
              adamw_step(std::span<const AdamWParam>(&bad_copy, 1), AdamWHyper{});
            }).find("adamw: tensor 'w.p_bf16' has dtype F32, expected BF16"),
            std::string::npos);
}

}  // namespace
}  // namespace gdn::ops
