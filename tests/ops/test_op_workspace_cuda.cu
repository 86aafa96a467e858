// Op workspace on the GPU (label gpu; issue 22, gdn/backend/op_workspace.h): at the shapes the
// model and the ops' GPU tests use, the largest scratch() request each op's CUDA kernels make
// (cuda::Context::peak_scratch_request) never exceeds the op's declared <op>_workspace_bytes; a
// bound region of the declared size gives the same bits as the unbound (grow-only) scratch; and a
// bound region too small is an error naming the op and both sizes, not a grow.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gdn/backend/cuda_check.h"
#include "gdn/backend/cuda_context.h"
#include "gdn/backend/op_workspace.h"
#include "gdn/core/tensor.h"
#include "ops/adamw/op.h"
#include "ops/causal_conv1d/op.h"
#include "ops/cuda_test_util.h"
#include "ops/embedding/op.h"
#include "ops/gated_attention/op.h"
#include "ops/gated_delta_rule/op.h"
#include "ops/gated_rmsnorm/op.h"
#include "ops/gdn_gates/op.h"
#include "ops/rmsnorm/op.h"

namespace gdn::ops {
namespace {

using testing::randn_as;
using testing::to_dev;

class OpWorkspaceCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cuda_available()) << "no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)";
    cuda::Context& ctx = cuda::Context::get();
    ASSERT_FALSE(ctx.workspace_bound());
    sms = ctx.sm_count();
    max_blocks = ctx.props().maxBlocksPerMultiProcessor;
  }
  // The largest request `fn` makes, measured on its second run: the first resolves the op's
  // implementation for the shape class, and the probe that may run then takes its own shapes.
  template <class F>
  size_t peak_of(F&& fn) {
    cuda::Context& ctx = cuda::Context::get();
    fn();
    ctx.reset_peak_scratch_request();
    fn();
    GDN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
    return ctx.peak_scratch_request();
  }
  int sms = 0, max_blocks = 0;
};

OwnedTensor dev_zeros(DType dt, std::initializer_list<int64_t> shape) {
  return OwnedTensor::zeros(dt, shape, Device::CUDA);
}

struct RmsNormCase {
  OwnedTensor x, w, rstd, dy, dx, dw;
};
// Random inputs (for comparing bits), or zeros (the requests do not depend on the values).
RmsNormCase rmsnorm_case(int64_t R, int64_t D, uint64_t seed, bool random) {
  auto act = [&](std::initializer_list<int64_t> shape, uint64_t s) {
    return random ? to_dev(randn_as(shape, s, DType::BF16), DType::BF16)
                  : dev_zeros(DType::BF16, shape);
  };
  RmsNormCase c{act({R, D}, seed),
                to_dev(randn_as({D}, seed + 1, DType::BF16), DType::BF16),
                dev_zeros(DType::F32, {R}),
                act({R, D}, seed + 2),
                dev_zeros(DType::BF16, {R, D}),
                dev_zeros(DType::F32, {D})};
  OwnedTensor y = dev_zeros(DType::BF16, {R, D});
  rmsnorm_forward({c.x, c.w, y, c.rstd, 1e-6, true});
  return c;
}

TEST_F(OpWorkspaceCuda, RmsNormRequestsStayWithinTheDeclaredBound) {
  for (const std::string impl : {"cuda.rowwise", "cuda.sm90_bulk"}) {
    const RmsNormTable* t = testing::cuda_table<RmsNormTable>("rmsnorm", impl);
    ASSERT_NE(t, nullptr) << impl;
    for (const int64_t R : {1, 100, 4096, 16384}) {
      for (const int64_t D : {1024, 2048, 4096, 5120}) {
        RmsNormCase c = rmsnorm_case(R, D, 1, false);
        const size_t peak = peak_of([&] {
          t->backward({c.x, c.w, c.rstd, c.dy, c.dx, c.dw, true});
        });
        EXPECT_GT(peak, 0u) << impl;
        EXPECT_LE(peak, rmsnorm_workspace_bytes(R, D, sms, max_blocks))
            << impl << " R " << R << " D " << D;
      }
    }
  }
}

TEST_F(OpWorkspaceCuda, BoundRegionGivesTheSameBitsAndATooSmallOneIsAnError) {
  const int64_t R = 4096, D = 4096;
  RmsNormCase a = rmsnorm_case(R, D, 7, true), b = rmsnorm_case(R, D, 7, true);
  rmsnorm_backward({a.x, a.w, a.rstd, a.dy, a.dx, a.dw, true});  // unbound
  const size_t declared = rmsnorm_workspace_bytes(R, D, sms, max_blocks);
  OwnedTensor region = dev_zeros(DType::F32, {static_cast<int64_t>(declared / 4 + 1)});
  {
    cuda::ScopedWorkspace bind(region.view().data(), declared);
    EXPECT_TRUE(cuda::Context::get().workspace_bound());
    rmsnorm_backward({b.x, b.w, b.rstd, b.dy, b.dx, b.dw, true});
  }
  EXPECT_FALSE(cuda::Context::get().workspace_bound());
  testing::expect_bitwise_equal(b.dx, a.dx, "dx");
  testing::expect_bitwise_equal(b.dw, a.dw, "dw");
  {
    cuda::ScopedWorkspace bind(region.view().data(), 256);
    const std::string e = testing::error_of([&] {
      rmsnorm_backward({b.x, b.w, b.rstd, b.dy, b.dx, b.dw, true});
    });
    EXPECT_NE(e.find("rmsnorm"), std::string::npos) << e;
    EXPECT_NE(e.find("only 256 bytes"), std::string::npos) << e;
  }
  EXPECT_FALSE(cuda::Context::get().workspace_bound());
}

// The first call of a shape class resolves its implementation, whose probe runs at shapes of its
// own: inside a bound region sized for the call alone, the probe runs unbound (it asks for more
// than the region holds) and the call itself then takes the region, which stays bound.
TEST_F(OpWorkspaceCuda, ProbesAtTheFirstCallOfAClassRunOutsideTheBoundRegion) {
  cuda::Context& ctx = cuda::Context::get();
  const int64_t R = 1, D = 1024;  // this process's first rmsnorm call: its class is unresolved
  RmsNormCase c{dev_zeros(DType::BF16, {R, D}), to_dev(randn_as({D}, 3, DType::BF16), DType::BF16),
                dev_zeros(DType::F32, {R}),     dev_zeros(DType::BF16, {R, D}),
                dev_zeros(DType::BF16, {R, D}), dev_zeros(DType::F32, {D})};
  const size_t declared = rmsnorm_workspace_bytes(R, D, sms, max_blocks);
  OwnedTensor region = dev_zeros(DType::F32, {static_cast<int64_t>(declared / 4 + 1)});
  ctx.reset_peak_scratch_request();
  {
    cuda::ScopedWorkspace bind(region.view().data(), declared);
    rmsnorm_backward({c.x, c.w, c.rstd, c.dy, c.dx, c.dw, true});
    EXPECT_TRUE(ctx.workspace_bound());
    EXPECT_EQ(ctx.bound_workspace(), region.view().data());
    EXPECT_EQ(ctx.bound_workspace_bytes(), declared);
  }
  GDN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream()));
  EXPECT_GT(ctx.peak_scratch_request(), declared) << "the probe asked for no more than the call";
}

TEST_F(OpWorkspaceCuda, GatedRmsNormRequestsStayWithinTheDeclaredBound) {
  for (const int64_t R : {1, 1000, 4096 * 32}) {
    for (const int64_t D : {64, 128, 256}) {
      OwnedTensor x = dev_zeros(DType::BF16, {R, D}), z = dev_zeros(DType::BF16, {R, D}),
                  w = to_dev(randn_as({D}, 5, DType::BF16), DType::BF16),
                  y = dev_zeros(DType::BF16, {R, D}), rstd = dev_zeros(DType::F32, {R}),
                  dy = dev_zeros(DType::BF16, {R, D}), dx = dev_zeros(DType::BF16, {R, D}),
                  dz = dev_zeros(DType::BF16, {R, D}), dw = dev_zeros(DType::F32, {D});
      gated_rmsnorm_forward({x, z, w, y, rstd});
      const size_t peak = peak_of([&] { gated_rmsnorm_backward({x, z, w, rstd, dy, dx, dz, dw}); });
      EXPECT_LE(peak, gated_rmsnorm_workspace_bytes(R, D, sms, max_blocks))
          << "R " << R << " D " << D;
    }
  }
}

TEST_F(OpWorkspaceCuda, GdnGatesRequestsTheDeclaredBytes) {
  for (const int64_t T : {1, 64, 65, 4096, 16384}) {
    for (const int64_t H : {16, 32, 48}) {
      OwnedTensor a = dev_zeros(DType::BF16, {T, H}), b = dev_zeros(DType::BF16, {T, H}),
                  A_log = dev_zeros(DType::F32, {H}), dt = dev_zeros(DType::F32, {H}),
                  dg = dev_zeros(DType::F32, {T, H}), dbeta = dev_zeros(DType::F32, {T, H}),
                  da = dev_zeros(DType::BF16, {T, H}), db = dev_zeros(DType::BF16, {T, H}),
                  dA = dev_zeros(DType::F32, {H}), ddt = dev_zeros(DType::F32, {H});
      const size_t peak = peak_of([&] {
        gdn_gates_backward({a, b, A_log, dt, dg, dbeta, da, db, dA, ddt});
      });
      EXPECT_EQ(peak, gdn_gates_workspace_bytes(T, H)) << "T " << T << " H " << H;
    }
  }
}

TEST_F(OpWorkspaceCuda, CausalConv1dRequestsStayWithinTheDeclaredBound) {
  for (const std::vector<int32_t>& cu :
       {std::vector<int32_t>{0, 1}, std::vector<int32_t>{0, 4096},
        std::vector<int32_t>{0, 1000, 2500, 4096}, std::vector<int32_t>{0, 16384}}) {
    const int64_t T = cu.back();
    for (const int64_t C : {128, 6144, 8192}) {
      const int64_t W = 4;
      OwnedTensor cus = convert(testing::i32_tensor(cu), DType::I32, Device::CUDA);
      OwnedTensor x = dev_zeros(DType::BF16, {T, C}),
                  w = to_dev(randn_as({C, W}, 9, DType::BF16), DType::BF16),
                  bias = to_dev(randn_as({C}, 10, DType::BF16), DType::BF16),
                  dy = dev_zeros(DType::BF16, {T, C}), dx = dev_zeros(DType::BF16, {T, C}),
                  dw = dev_zeros(DType::F32, {C, W}), dbias = dev_zeros(DType::F32, {C});
      CausalConv1dBwd args;
      args.x = x;
      args.weight = w;
      args.bias = bias;
      args.cu_seqlens = cus;
      args.dy = dy;
      args.dx = dx;
      args.dweight = dw;
      args.dbias = dbias;
      const size_t peak = peak_of([&] { causal_conv1d_backward(args); });
      EXPECT_GT(peak, 0u);
      EXPECT_LE(peak, causal_conv1d_workspace_bytes(T, W, C, sms, max_blocks))
          << "T " << T << " C " << C;
    }
  }
}

TEST_F(OpWorkspaceCuda, AdamWSumsqRequestsStayWithinTheDeclaredBound) {
  std::vector<OwnedTensor> owned;
  std::vector<Tensor> grads;
  std::vector<int64_t> numels;
  owned.reserve(8);
  for (const int64_t n : {int64_t{1}, int64_t{32768}, int64_t{32769}, int64_t{4096} * 4096,
                          int64_t{1000}, int64_t{151936} * 64}) {
    owned.push_back(dev_zeros(DType::F32, {n}));
    grads.push_back(owned.back());
    numels.push_back(n);
  }
  const size_t bound = adamw_workspace_bytes(numels);
  EXPECT_LE(peak_of([&] { (void)grad_global_norm(grads); }), bound);
  OwnedTensor out = dev_zeros(DType::F64, {1});
  EXPECT_LE(peak_of([&] { grad_sumsq_into(grads, out); }), bound);
}

// Document boundaries of T tokens in N near-equal documents (N >= 1).
std::vector<int32_t> even_docs(int64_t T, int64_t N) {
  std::vector<int32_t> cu{0};
  for (int64_t n = 1; n <= N; ++n) cu.push_back(static_cast<int32_t>(T * n / N));
  return cu;
}

// Both routes (cuda.chunk64 at the model's head dims, cuda.chunk64_generic at any), forward and
// backward, with and without `saved`, with and without the in-kernel l2norm: every request is
// within the declared bound at the call's (T, N), and within the bound at a larger (T, N) (what a
// planner declares for its largest batch).
TEST_F(OpWorkspaceCuda, GatedDeltaRuleRequestsStayWithinTheDeclaredBound) {
  struct Heads {
    int64_t Hk, Hv, dk, dv;
  };
  for (const std::string impl : {"cuda.chunk64", "cuda.chunk64_generic"}) {
    const GatedDeltaRuleTable* t =
        testing::cuda_table<GatedDeltaRuleTable>("gated_delta_rule", impl);
    ASSERT_NE(t, nullptr) << impl;
    for (const Heads h : {Heads{16, 32, 128, 128}, Heads{2, 4, 64, 96}}) {
      for (const auto& [T, N] :
           {std::pair<int64_t, int64_t>{64, 1}, {1000, 3}, {4096, 1}, {4096, 64}, {4096, 700}}) {
        for (const bool l2 : {false, true}) {
          const std::vector<int32_t> docs = even_docs(T, N);
          OwnedTensor cu = convert(testing::i32_tensor(docs), DType::I32, Device::CUDA);
          OwnedTensor q = dev_zeros(DType::BF16, {T, h.Hk, h.dk}),
                      k = dev_zeros(DType::BF16, {T, h.Hk, h.dk}),
                      v = dev_zeros(DType::BF16, {T, h.Hv, h.dv}),
                      g = dev_zeros(DType::F32, {T, h.Hv}), beta = dev_zeros(DType::F32, {T, h.Hv}),
                      o = dev_zeros(DType::BF16, {T, h.Hv, h.dv}),
                      dq = dev_zeros(DType::BF16, {T, h.Hk, h.dk}),
                      dk = dev_zeros(DType::BF16, {T, h.Hk, h.dk}),
                      dv = dev_zeros(DType::BF16, {T, h.Hv, h.dv}),
                      dg = dev_zeros(DType::F32, {T, h.Hv}), db = dev_zeros(DType::F32, {T, h.Hv}),
                      saved = dev_zeros(DType::BF16, {gdr_saved_numel(T, N, h.Hv, h.dk, h.dv)});
          const size_t bound = gated_delta_rule_workspace_bytes(T, N, h.Hk, h.Hv, h.dk, h.dv, l2);
          const size_t bound_saved =
              gated_delta_rule_workspace_bytes(T, N, h.Hk, h.Hv, h.dk, h.dv, l2, true);
          EXPECT_LE(bound_saved, bound);
          EXPECT_LE(bound,
                    gated_delta_rule_workspace_bytes(2 * T, N + 5, h.Hk, h.Hv, h.dk, h.dv, l2));
          const std::string at = impl + " T " + std::to_string(T) + " N " + std::to_string(N) +
                                 " dk " + std::to_string(h.dk) + " l2 " + std::to_string(l2);
          for (const bool with_saved : {false, true}) {
            const Tensor sv = with_saved ? Tensor(saved) : Tensor();
            const GatedDeltaRuleFwd f{.q = q,
                                      .k = k,
                                      .v = v,
                                      .g = g,
                                      .beta = beta,
                                      .cu_seqlens = cu,
                                      .o = o,
                                      .use_qk_l2norm = l2,
                                      .saved = sv};
            const GatedDeltaRuleBwd b{.q = q,
                                      .k = k,
                                      .v = v,
                                      .g = g,
                                      .beta = beta,
                                      .cu_seqlens = cu,
                                      .dout = o,
                                      .dq = dq,
                                      .dk = dk,
                                      .dv = dv,
                                      .dg = dg,
                                      .dbeta = db,
                                      .use_qk_l2norm = l2,
                                      .saved = sv};
            const size_t fwd = peak_of([&] { t->forward(f); });
            const size_t bwd = peak_of([&] { t->backward(b); });
            EXPECT_GT(fwd, 0u) << at;
            EXPECT_LE(fwd, bound_saved) << at << " forward, saved " << with_saved;
            EXPECT_LE(bwd, with_saved ? bound_saved : bound) << at << " backward";
          }
        }
      }
    }
  }
}

// Both implementations (cuda.sm90_tma at hd 256, cuda.flash), forward and backward.
TEST_F(OpWorkspaceCuda, GatedAttentionRequestsStayWithinTheDeclaredBound) {
  for (const std::string impl : {"cuda.sm90_tma", "cuda.flash"}) {
    const GatedAttentionTable* t =
        testing::cuda_table<GatedAttentionTable>("gated_attention", impl);
    ASSERT_NE(t, nullptr) << impl;
    const int64_t Hq = 16, Hkv = 4, hd = 256;
    for (const auto& [T, N] : {std::pair<int64_t, int64_t>{1, 1}, {1000, 3}, {4096, 64}}) {
      OwnedTensor cu = convert(testing::i32_tensor(even_docs(T, N)), DType::I32, Device::CUDA);
      OwnedTensor qg = dev_zeros(DType::BF16, {T, Hq, 2 * hd}),
                  k = dev_zeros(DType::BF16, {T, Hkv, hd}),
                  v = dev_zeros(DType::BF16, {T, Hkv, hd}), qw = dev_zeros(DType::BF16, {hd}),
                  kw = dev_zeros(DType::BF16, {hd}), o = dev_zeros(DType::BF16, {T, Hq, hd}),
                  qh = dev_zeros(DType::BF16, {T, Hq, hd}),
                  kh = dev_zeros(DType::BF16, {T, Hkv, hd}),
                  attn = dev_zeros(DType::BF16, {T, Hq, hd}), lse = dev_zeros(DType::F32, {T, Hq}),
                  qr = dev_zeros(DType::F32, {T, Hq}), kr = dev_zeros(DType::F32, {T, Hkv}),
                  dqg = dev_zeros(DType::BF16, {T, Hq, 2 * hd}),
                  dk = dev_zeros(DType::BF16, {T, Hkv, hd}),
                  dv = dev_zeros(DType::BF16, {T, Hkv, hd}), dqw = dev_zeros(DType::F32, {hd}),
                  dkw = dev_zeros(DType::F32, {hd});
      const GatedAttentionFwd f{qg, k, v, qw, kw, cu, o, qh, kh, attn, lse, qr, kr, 64};
      const GatedAttentionBwd b{qg, k,  v, qw,  kw, cu, qh,  kh,  attn, lse,
                                qr, kr, o, dqg, dk, dv, dqw, dkw, 64};
      const size_t bound = gated_attention_workspace_bytes(T, N, Hq, Hkv, hd);
      const std::string at = impl + " T " + std::to_string(T) + " N " + std::to_string(N);
      EXPECT_LE(peak_of([&] { t->forward(f); }), bound) << at;
      const size_t bwd = peak_of([&] { t->backward(b); });
      EXPECT_GT(bwd, 0u) << at;
      EXPECT_LE(bwd, bound) << at;
    }
  }
}

// Both implementations; cuda.ranked_windows with and without a plan; short batches (one block
// or one rank kernel sorts) and long ones (cub's device-wide sort).
TEST_F(OpWorkspaceCuda, EmbeddingRequestsStayWithinTheDeclaredBound) {
  for (const std::string impl : {"cuda.ranked_windows", "cuda.sorted_windows"}) {
    const EmbeddingTable* t = testing::cuda_table<EmbeddingTable>("embedding", impl);
    ASSERT_NE(t, nullptr) << impl;
    for (const int64_t T : {1, 100, 4096, 65536}) {
      for (const auto& [V, D] : {std::pair<int64_t, int64_t>{248320, 1024}, {1000, 64}}) {
        OwnedTensor ids = dev_zeros(DType::I32, {T}), w = dev_zeros(DType::BF16, {V, D}),
                    y = dev_zeros(DType::BF16, {T, D}), dw = dev_zeros(DType::F32, {V, D}),
                    plan = dev_zeros(DType::I32, {embedding_plan_numel(T, D)});
        const size_t bound = embedding_workspace_bytes(T, V, D);
        const std::string at = impl + " T " + std::to_string(T) + " V " + std::to_string(V);
        for (const bool with_plan : {false, true}) {
          const Tensor p = with_plan ? Tensor(plan) : Tensor();
          EXPECT_LE(peak_of([&] { t->forward({ids, w, y, p}); }), bound) << at;
          const size_t bwd = peak_of([&] { t->backward({ids, y, dw, p}); });
          EXPECT_GT(bwd, 0u) << at;
          EXPECT_LE(bwd, bound) << at << " plan " << with_plan;
        }
        EXPECT_LE(bound, embedding_workspace_bytes(2 * T, V, D)) << at;
      }
    }
  }
}

}  // namespace
}  // namespace gdn::ops
