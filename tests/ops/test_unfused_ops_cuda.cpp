// The unfused A/B routes' building blocks on CUDA (label gpu): silu, mul and cross_entropy vs ref
// over sizes with every n % 8 tail and unaligned tensors, in-place use bitwise equal to
// out-of-place, the resolver's choice and probe, probes rejecting wrong kernels, and
// cross_entropy's device-target rule (an out-of-range target gives a NaN row loss and a zero
// gradient row). Tolerances come from src/backend/tolerances.h.
#include <cmath>

#include "backend/tolerances.h"
#include "ops/cross_entropy/op.h"
#include "ops/cuda_test_util.h"
#include "ops/mul/op.h"
#include "ops/silu/op.h"

namespace gdn::ops {
namespace {

using namespace gdn::testing;  // NOLINT: test helpers

class UnfusedOpsCuda : public CudaOpTest {};

const int64_t kSizes[] = {1, 7, 8, 9, 1031, 4099, 65536 + 3};

TEST_F(UnfusedOpsCuda, SiluMatchesRefAlignedUnalignedAndInPlace) {
  constexpr ProbeError kTol = bf16_tolerance("silu");
  for (int64_t n : kSizes) {
    auto x = randn_as({n}, 1 + n, DType::BF16, 4.0);
    auto dy = randn_as({n}, 2 + n, DType::BF16);
    auto yr = OwnedTensor::zeros(DType::F64, {n}), dxr = OwnedTensor::zeros(DType::F64, {n});
    silu_forward({x, yr});
    silu_backward({x, dy, dxr});
    OwnedTensor xd = to_dev(x, DType::BF16), dyd = to_dev(dy, DType::BF16);
    OwnedTensor y = poisoned(DType::BF16, {n}), dx = poisoned(DType::BF16, {n});
    silu_forward({xd, y});
    silu_backward({xd, dyd, dx});
    expect_close(y, yr, kTol.fwd, "y n=" + std::to_string(n));
    expect_close(dx, dxr, kTol.bwd, "dx n=" + std::to_string(n));
    std::vector<OwnedTensor> keep;
    Tensor xu = unaligned_copy(xd, 2, keep),
           yu = unaligned_copy(poisoned(DType::BF16, {n}), 2, keep);
    silu_forward({xu, yu});
    expect_bitwise_equal(yu, y, "y (unaligned) n=" + std::to_string(n));
    silu_backward({xd, dyd, dyd});  // dx over dy
    expect_bitwise_equal(dyd, dx, "in-place dx n=" + std::to_string(n));
    silu_forward({xd, xd});  // y over x
    expect_bitwise_equal(xd, y, "in-place y n=" + std::to_string(n));
  }
}

TEST_F(UnfusedOpsCuda, MulMatchesRefAndInPlace) {
  constexpr ProbeError kTol = bf16_tolerance("mul");
  for (int64_t n : kSizes) {
    auto a = randn_as({n}, 3 + n, DType::BF16, 2.0), b = randn_as({n}, 4 + n, DType::BF16);
    auto yr = OwnedTensor::zeros(DType::F64, {n});
    mul({a, b, yr});
    OwnedTensor ad = to_dev(a, DType::BF16), bd = to_dev(b, DType::BF16);
    OwnedTensor y = poisoned(DType::BF16, {n});
    mul({ad, bd, y});
    expect_close(y, yr, kTol.fwd, "y n=" + std::to_string(n));
    std::vector<OwnedTensor> keep;
    Tensor au = unaligned_copy(ad, 2, keep),
           yu = unaligned_copy(poisoned(DType::BF16, {n}), 2, keep);
    mul({au, bd, yu});
    expect_bitwise_equal(yu, y, "y (unaligned) n=" + std::to_string(n));
    mul({ad, bd, ad});
    expect_bitwise_equal(ad, y, "in-place y n=" + std::to_string(n));
  }
}

struct Ce {
  OwnedTensor loss, lse, zl, dz;
};
Ce ce_cuda(const Tensor& z, const Tensor& y, double lam, double c) {
  const int64_t R = z.size(0), V = z.size(1);
  Ce o{poisoned(DType::F32, {R}), poisoned(DType::F32, {R}), poisoned(DType::F32, {R}),
       poisoned(DType::BF16, {R, V})};
  cross_entropy({z, y, o.loss, o.lse, o.zl, o.dz, lam, c});
  return o;
}

TEST_F(UnfusedOpsCuda, CrossEntropyMatchesRefAndInPlace) {
  constexpr ProbeError kTol = bf16_tolerance("cross_entropy");
  for (auto [R, V] : {std::pair<int64_t, int64_t>{1, 1}, {5, 97}, {33, 1031}, {7, 248320}}) {
    auto z = randn_as({R, V}, 5 + V, DType::BF16, 3.0);
    std::vector<int32_t> yv;
    for (int64_t i = 0; i < R; ++i)
      yv.push_back(i % 4 == 3 ? -100 : static_cast<int32_t>((i * 37) % V));
    OwnedTensor y = i32_tensor(yv);
    auto lr = OwnedTensor::zeros(DType::F64, {R}), sr = OwnedTensor::zeros(DType::F64, {R}),
         qr = OwnedTensor::zeros(DType::F64, {R}), dr = OwnedTensor::zeros(DType::F64, {R, V});
    cross_entropy({z, y, lr, sr, qr, dr, 1e-2, 0.25});
    OwnedTensor zd = to_dev(z, DType::BF16), yd = convert(y, DType::I32, Device::CUDA);
    Ce c = ce_cuda(zd, yd, 1e-2, 0.25);
    const std::string s = "[" + std::to_string(R) + ", " + std::to_string(V) + "]";
    expect_close(c.loss, lr, kTol.fwd, "loss " + s);
    expect_close(c.lse, sr, kTol.fwd, "lse " + s);
    expect_close(c.zl, qr, kTol.fwd, "z_loss " + s);
    expect_close(c.dz, dr, kTol.bwd, "dlogits " + s);
    auto l = poisoned(DType::F32, {R}), lse = poisoned(DType::F32, {R}),
         q = poisoned(DType::F32, {R});
    cross_entropy({zd, yd, l, lse, q, zd, 1e-2, 0.25});  // gradient over the logits
    expect_bitwise_equal(zd, c.dz, "in-place dlogits " + s);
    expect_bitwise_equal(l, c.loss, "loss with in-place dlogits " + s);
  }
}

TEST_F(UnfusedOpsCuda, CrossEntropyOutOfRangeDeviceTargetGivesANanRow) {
  auto z = randn_as({3, 10}, 9, DType::BF16);
  OwnedTensor zd = to_dev(z, DType::BF16);
  OwnedTensor yd = convert(i32_tensor({2, 10, -100}), DType::I32, Device::CUDA);
  Ce c = ce_cuda(zd, yd, 0.0, 1.0);
  auto l = to_f64_vector(c.loss), d = to_f64_vector(c.dz);
  EXPECT_TRUE(std::isfinite(l[0]));
  EXPECT_TRUE(std::isnan(l[1]));
  EXPECT_EQ(l[2], 0.0);
  for (int j = 0; j < 10; ++j) {
    EXPECT_EQ(d[static_cast<size_t>(10 + j)], 0.0);
    EXPECT_EQ(d[static_cast<size_t>(20 + j)], 0.0);
  }
}

TEST_F(UnfusedOpsCuda, ResolverChoosesCudaAndItPassesItsProbe) {
  expect_resolves_to_cuda("silu", "cuda.elementwise", bf16_tolerance("silu"), true, true);
  expect_resolves_to_cuda("mul", "cuda.elementwise", bf16_tolerance("mul"), true, false);
  expect_resolves_to_cuda("cross_entropy", "cuda.rows", bf16_tolerance("cross_entropy"), true,
                          true);
}

// Deliberately wrong kernels built from the real ones.
const SiluTable* silu_real() { return cuda_table<SiluTable>("silu", "cuda.elementwise"); }
void silu_fwd_real(const SiluFwd& a) { silu_real()->forward(a); }
void silu_bwd_as_fwd(const SiluBwd& a) { silu_real()->forward({a.x, a.dx}); }  // ignores dy
const SiluTable kWrongSilu{silu_fwd_real, silu_bwd_as_fwd};
const MulTable* mul_real() { return cuda_table<MulTable>("mul", "cuda.elementwise"); }
void mul_square(const MulArgs& a) { mul_real()->run({a.a, a.a, a.y}); }  // ignores b
const MulTable kWrongMul{mul_square};
const CrossEntropyTable* ce_real() {
  return cuda_table<CrossEntropyTable>("cross_entropy", "cuda.rows");
}
void ce_no_scale(const CrossEntropyArgs& a) {  // forgets the gradient scale
  CrossEntropyArgs b = a;
  b.grad_scale = 1;
  ce_real()->run(b);
}
const CrossEntropyTable kWrongCe{ce_no_scale};

TEST_F(UnfusedOpsCuda, ProbesRejectWrongKernels) {
  ASSERT_NE(silu_real(), nullptr);
  ASSERT_NE(mul_real(), nullptr);
  ASSERT_NE(ce_real(), nullptr);
  expect_probe_rejects("silu", "cuda.elementwise", {{"cuda.wrong_dx", &kWrongSilu}});
  expect_probe_rejects("mul", "cuda.elementwise", {{"cuda.wrong_y", &kWrongMul}});
  expect_probe_rejects("cross_entropy", "cuda.rows", {{"cuda.wrong_scale", &kWrongCe}});
}

}  // namespace
}  // namespace gdn::ops
