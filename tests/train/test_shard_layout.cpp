// dist.shard = optimizer's flat layout (train/shard_layout.h): offsets, padding and alignment,
// parameters straddling shards and buckets, and that every element of every parameter belongs to
// exactly one shard piece and one bucket piece. And the sharded optimizer at world size 1 (the
// Local communicator) against the host optimizer: the same bits, over several buckets.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include "dist/comm.h"
#include "gdn/core/error.h"
#include "model/config.h"
#include "model/qwen35.h"
#include "model/weights.h"
#include "ops/adamw/op.h"
#include "train/optimizer.h"
#include "train/shard_layout.h"

namespace gdn::train {
namespace {

std::vector<ShardLayout::Param> params_of(const std::vector<int64_t>& numels) {
  std::vector<ShardLayout::Param> p;
  for (size_t i = 0; i < numels.size(); ++i) p.push_back({i, numels[i]});
  return p;
}

TEST(ShardLayout, PadsToTheWorldAndSplitsStraddlingParameters) {
  const ShardLayout l(params_of({5, 3, 10, 1}), 3, 1, 100);
  EXPECT_EQ(l.numel(), 19);
  EXPECT_EQ(l.shard_numel(), 7);  // ceil(19 / 3)
  EXPECT_EQ(l.padded_numel(), 21);
  EXPECT_EQ(l.offset(2), 8);
  // Shard 1 = [7, 14): the last element of parameter 1, the first six of parameter 2.
  const auto s1 = l.shard_pieces(1);
  ASSERT_EQ(s1.size(), 2u);
  EXPECT_EQ(s1[0].param, 1u);
  EXPECT_EQ(s1[0].param_begin, 2);
  EXPECT_EQ(s1[0].flat_begin, 7);
  EXPECT_EQ(s1[0].len, 1);
  EXPECT_EQ(s1[1].param, 2u);
  EXPECT_EQ(s1[1].param_begin, 0);
  EXPECT_EQ(s1[1].len, 6);
  // Shard 2 = [14, 21): parameter 2's last four, parameter 3, two elements of padding.
  const auto s2 = l.shard_pieces(2);
  ASSERT_EQ(s2.size(), 2u);
  EXPECT_EQ(s2[0].param_begin, 6);
  EXPECT_EQ(s2[0].len, 4);
  EXPECT_EQ(s2[1].param, 3u);
  EXPECT_EQ(s2[1].flat_begin, 18);
}

TEST(ShardLayout, AlignsParametersAndShards) {
  const ShardLayout l(params_of({5, 3, 10, 1}), 3, 4, 100);
  EXPECT_EQ(l.offset(0), 0);
  EXPECT_EQ(l.offset(1), 8);
  EXPECT_EQ(l.offset(2), 12);
  EXPECT_EQ(l.offset(3), 24);
  EXPECT_EQ(l.shard_numel(), 12);  // ceil(25 / 3) = 9, rounded up to 4
  EXPECT_EQ(l.padded_numel(), 36);
  for (int r = 0; r < 3; ++r)
    for (const ShardPiece& p : l.shard_pieces(r)) {
      EXPECT_EQ(p.flat_begin % 4, 0);
      EXPECT_EQ(p.param_begin % 4, 0);
    }
}

TEST(ShardLayout, FewerElementsThanRanksLeavesEmptyShards) {
  const ShardLayout l(params_of({1}), 4, 1, 8);
  EXPECT_EQ(l.shard_numel(), 1);
  EXPECT_EQ(l.shard_pieces(0).size(), 1u);
  for (int r = 1; r < 4; ++r) EXPECT_TRUE(l.shard_pieces(r).empty());
  EXPECT_EQ(l.buckets(), 1);
}

TEST(ShardLayout, BucketsPlaceEveryRanksPartAtRankTimesLength) {
  const ShardLayout l(params_of({7}), 2, 1, 3);  // shards [0, 4) and [4, 8), one padding element
  ASSERT_EQ(l.shard_numel(), 4);
  ASSERT_EQ(l.buckets(), 2);
  EXPECT_EQ(l.bucket_len(0), 3);
  EXPECT_EQ(l.bucket_len(1), 1);
  const auto b0 = l.bucket_pieces(0);
  ASSERT_EQ(b0.size(), 2u);
  EXPECT_EQ(b0[0].param_begin, 0);
  EXPECT_EQ(b0[0].flat_begin, 0);
  EXPECT_EQ(b0[0].len, 3);
  EXPECT_EQ(b0[1].param_begin, 4);  // rank 1's part at 1 * 3
  EXPECT_EQ(b0[1].flat_begin, 3);
  EXPECT_EQ(b0[1].len, 3);
  const auto b1 = l.bucket_pieces(1);
  ASSERT_EQ(b1.size(), 1u);  // rank 1's last element is padding
  EXPECT_EQ(b1[0].param_begin, 3);
  EXPECT_EQ(b1[0].flat_begin, 0);
}

TEST(ShardLayout, EveryElementInExactlyOneShardAndOneBucket) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> numels(1 + rng() % 6);
    for (auto& n : numels) n = rng() % 40;
    const int world = 1 + static_cast<int>(rng() % 5);
    const int64_t align = 1 + rng() % 8, bucket = 1 + rng() % 20;
    const ShardLayout l(params_of(numels), world, align, bucket);
    EXPECT_EQ(l.shard_numel() % align, 0);
    std::vector<std::vector<int>> in_shard(numels.size()), in_bucket(numels.size());
    for (size_t i = 0; i < numels.size(); ++i) {
      in_shard[i].assign(static_cast<size_t>(numels[i]), 0);
      in_bucket[i].assign(static_cast<size_t>(numels[i]), 0);
    }
    for (int r = 0; r < world; ++r)
      for (const ShardPiece& p : l.shard_pieces(r)) {
        EXPECT_GE(p.flat_begin, l.shard_begin(r));
        EXPECT_LE(p.flat_begin + p.len, l.shard_begin(r) + l.shard_numel());
        EXPECT_EQ(p.flat_begin, l.offset(p.param) + p.param_begin);
        for (int64_t j = 0; j < p.len; ++j) ++in_shard[p.param][p.param_begin + j];
      }
    int64_t total = 0;
    for (int64_t k = 0; k < l.buckets(); ++k) {
      total += l.bucket_len(k);
      for (const ShardPiece& p : l.bucket_pieces(k)) {
        EXPECT_LE(p.flat_begin + p.len, l.bucket_len(k) * world);
        // The same rank's part of the bucket as of its shard.
        const int64_t r = p.flat_begin / l.bucket_len(k);
        EXPECT_EQ(l.offset(p.param) + p.param_begin, l.shard_begin(static_cast<int>(r)) +
                                                         l.bucket_begin(k) +
                                                         (p.flat_begin - r * l.bucket_len(k)));
        for (int64_t j = 0; j < p.len; ++j) ++in_bucket[p.param][p.param_begin + j];
      }
    }
    EXPECT_EQ(total, l.shard_numel());
    for (size_t i = 0; i < numels.size(); ++i)
      for (int64_t j = 0; j < numels[i]; ++j) {
        ASSERT_EQ(in_shard[i][j], 1) << "trial " << trial << " param " << i << " element " << j;
        ASSERT_EQ(in_bucket[i][j], 1) << "trial " << trial << " param " << i << " element " << j;
      }
  }
}

// The tiny model's sharded parameters (those whose cuda compute copy is bf16) at 2 ranks, in the
// optimizer's layout (64-element alignment): the boundary falls inside a parameter, so the np2
// trainer tests (tests/dist) update a straddling parameter from both ranks.
TEST(ShardLayout, TheTinyModelStraddlesTheTwoRankBoundary) {
  const std::vector<model::ParamSpec> specs = model::param_specs(model::tiny_config());
  std::vector<ShardLayout::Param> p;
  for (size_t i = 0; i < specs.size(); ++i)
    if (model::param_compute_dtype(specs[i], Backend::Cuda) == DType::BF16)
      p.push_back({i, specs[i].numel()});
  const ShardLayout l(p, 2, 64, int64_t{1} << 25);
  const auto r0 = l.shard_pieces(0), r1 = l.shard_pieces(1);
  ASSERT_FALSE(r0.empty());
  ASSERT_FALSE(r1.empty());
  EXPECT_EQ(r0.back().param, r1.front().param);
  EXPECT_GT(r1.front().param_begin, 0);
  std::printf("2 ranks: %s straddles the boundary (elements [0, %lld) on rank 0, from %lld on 1)\n",
              specs[r1.front().param].name.c_str(), static_cast<long long>(r0.back().len),
              static_cast<long long>(r1.front().param_begin));
}

// The parameters that straddle a shard boundary in the sharded optimizer's layout of the tiny
// model (buckets of 5000 elements) at `world` ranks.
std::vector<std::string> tiny_straddlers(int world) {
  const std::vector<model::ParamSpec> specs = model::param_specs(model::tiny_config());
  std::vector<ShardLayout::Param> p;
  for (size_t i = 0; i < specs.size(); ++i)
    if (model::param_compute_dtype(specs[i], Backend::Cuda) == DType::BF16)
      p.push_back({i, specs[i].numel()});
  const ShardLayout l(p, world, 64, 5000);
  std::vector<std::string> out;
  for (int r = 1; r < world; ++r) {
    const auto here = l.shard_pieces(r);
    if (!here.empty() && here.front().param_begin > 0)
      out.push_back(specs[here.front().param].name);
  }
  return out;
}

// The smallest world size at which a parameter that does not decay (the embedding, a norm)
// straddles a boundary: the thread-rank test below runs it, so that the per-piece decay flag is
// exercised on both kinds.
int world_with_non_decaying_straddler() {
  for (int world = 2; world <= 64; ++world)
    for (const std::string& n : tiny_straddlers(world))
      if (!weight_decay_applies(n)) {
        std::printf("%d ranks: %s (no decay) straddles a boundary\n", world, n.c_str());
        return world;
      }
  return -1;
}

TEST(ShardLayout, TheTinyModelStraddlesANonDecayingParameterAtSomeWorldSize) {
  EXPECT_GT(world_with_non_decaying_straddler(), 0);
}

TEST(ShardLayout, RejectsNonPositiveSizes) {
  EXPECT_THROW(ShardLayout(params_of({1}), 0, 1, 1), Error);
  EXPECT_THROW(ShardLayout(params_of({1}), 1, 0, 1), Error);
  EXPECT_THROW(ShardLayout(params_of({1}), 1, 1, 0), Error);
}

// At world size 1 (the Local communicator) the sharded optimizer's collectives are copies: its
// update over pieces (here cut by buckets of 1000 elements, so that parameters straddle buckets)
// must be the host optimizer's update bit for bit, clipping included.
TEST(ShardedOptimizer, WorldOneEqualsTheHostOptimizerBitForBit) {
  const model::Qwen35Config cfg = model::tiny_config();
  const std::vector<model::ParamSpec> specs = model::param_specs(cfg);
  model::Qwen35Model a(cfg, Backend::Cpu, 64, 2, {}), b(cfg, Backend::Cpu, 64, 2, {});
  auto fresh = [&] {
    OptimizerState s;
    s.master = model::ParamStore(specs);
    model::init_params(s.master, cfg, 5);
    return s;
  };
  OptimizerConfig oc;
  oc.hyper.weight_decay = 0.1;
  oc.clip = 0.5;
  auto comm = dist::make_comm(dist::LaunchInfo{}, dist::CommKind::Local, {});
  auto host = make_host_optimizer(a, specs, fresh(), oc);
  auto sharded = make_sharded_optimizer(b, specs, fresh(), oc, *comm, 1000);
  EXPECT_TRUE(sharded->sharded());
  EXPECT_NE(sharded->describe().find("rank 0 of 1"), std::string::npos) << sharded->describe();
  for (int t = 1; t <= 3; ++t) {
    for (model::Qwen35Model* m : {&a, &b})
      for (const Tensor& g : m->grads()) {
        float* p = g.ptr<float>();  // [numel] F32 (cpu)
        for (int64_t j = 0; j < g.numel(); ++j)
          p[j] = 0.01f * static_cast<float>(t) * static_cast<float>(1 + (j * 7 + t) % 13);
      }
    const double norm = ops::grad_global_norm(a.grads());
    sharded->reduce_grads();
    double sumsq = 0;
    ASSERT_TRUE(sharded->grad_sumsq_into(Tensor(&sumsq, DType::F64, {1})));
    EXPECT_NEAR(std::sqrt(sumsq), norm, 1e-12 * norm);
    // The same norm for both (the sum's order differs: the whole tensors come last).
    host->step(1e-2, t, GradCheck{1.0, norm, {}, {}});
    sharded->step(1e-2, t, GradCheck{1.0, norm, {}, {}});
    for (size_t i = 0; i < specs.size(); ++i)
      ASSERT_EQ(std::memcmp(a.param(i).data(), b.param(i).data(),
                            static_cast<size_t>(a.param(i).nbytes())),
                0)
          << specs[i].name << " after step " << t;
  }
  const OptimizerState& x = host->host_state();
  const OptimizerState& y = sharded->host_state();
  for (size_t i = 0; i < specs.size(); ++i)
    for (auto [s, u] : {std::pair{&x.master, &y.master}, {&x.m, &y.m}, {&x.v, &y.v}})
      ASSERT_EQ(std::memcmp(s->tensor(i).data(), u->tensor(i).data(),
                            static_cast<size_t>(s->tensor(i).nbytes())),
                0)
          << specs[i].name;
  // A non-finite loss skips the step: nothing moves.
  std::vector<float> before(static_cast<size_t>(b.param(0).numel()));
  std::memcpy(before.data(), b.param(0).data(), before.size() * sizeof(float));
  sharded->step(1e-2, 4, GradCheck{std::nan(""), 1.0, {}, {}});
  EXPECT_EQ(std::memcmp(before.data(), b.param(0).data(), before.size() * sizeof(float)), 0);
}

// N ranks as threads of this process: the collectives through shared memory, reduced in rank
// order (F32 sums only; all_gather moves bytes). Enough for the sharded optimizer's host path.
class ThreadComm final : public dist::Comm {
 public:
  struct Shared {
    explicit Shared(int n) : sync(n), send(static_cast<size_t>(n)) {}
    std::barrier<> sync;
    std::vector<const void*> send;
  };
  ThreadComm(int rank, int size, Shared& sh) : Comm(rank, size, rank, size), sh_(sh) {}
  bool on_device() const override { return false; }
  dist::CommKind kind() const override { return dist::CommKind::Local; }
  void all_reduce(const void* send, void* recv, int64_t n, DType dt, dist::ReduceOp,
                  dist::StreamHandle) override {
    std::vector<float> out(static_cast<size_t>(n));
    sum(send, dt, 0, out);
    sh_.sync.arrive_and_wait();  // every rank has read every send buffer (recv may be one)
    std::memcpy(recv, out.data(), out.size() * sizeof(float));
  }
  void reduce_scatter(const void* send, void* recv, int64_t n, DType dt, dist::ReduceOp,
                      dist::StreamHandle) override {
    std::vector<float> out(static_cast<size_t>(n));
    sum(send, dt, rank() * n, out);
    sh_.sync.arrive_and_wait();  // every rank has read every send buffer
    std::memcpy(recv, out.data(), out.size() * sizeof(float));
  }
  void all_gather(const void* send, void* recv, int64_t n, DType dt, dist::StreamHandle) override {
    const auto bytes = static_cast<size_t>(n) * static_cast<size_t>(dtype_size(dt));
    publish(send);
    for (int q = 0; q < size(); ++q)
      std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(q) * bytes,
                  sh_.send[static_cast<size_t>(q)], bytes);
    sh_.sync.arrive_and_wait();
  }
  void broadcast(void*, int64_t, DType, int, dist::StreamHandle) override {
    GDN_FAIL("ThreadComm: broadcast is not used by the sharded optimizer");
  }
  void barrier() override { sh_.sync.arrive_and_wait(); }

 private:
  void publish(const void* send) {
    sh_.send[static_cast<size_t>(rank())] = send;
    sh_.sync.arrive_and_wait();
  }
  // out[i] = sum over ranks q, in rank order, of q's send[at + i] (F32, or F64 for the norm).
  void sum(const void* send, DType dt, int64_t at, std::vector<float>& out) {
    GDN_CHECK(dt == DType::F32, "ThreadComm: reductions of F32 only, got {}", dtype_name(dt));
    publish(send);
    std::fill(out.begin(), out.end(), 0.0f);
    for (int q = 0; q < size(); ++q) {
      const float* x = static_cast<const float*>(sh_.send[static_cast<size_t>(q)]) + at;
      for (size_t i = 0; i < out.size(); ++i) out[i] += x[i];
    }
  }
  Shared& sh_;
};

// The sharded optimizer at 2, 3 and `nd` ranks (threads), buckets of 5000 elements: every rank's
// compute copy after each step, and the state rank 0 gathers, are bit for bit the host
// optimizer's. Rank 0 holds the gradients, the others zeros, so that the reduced gradient is
// exactly rank 0's. The boundaries fall inside parameters that decay, and at `nd` ranks inside
// one that does not (world_with_non_decaying_straddler); 3 ranks pad.
TEST(ShardedOptimizer, ThreadRanksEqualTheHostOptimizerBitForBit) {
  const model::Qwen35Config cfg = model::tiny_config();
  const std::vector<model::ParamSpec> specs = model::param_specs(cfg);
  auto fresh = [&] {
    OptimizerState s;
    s.master = model::ParamStore(specs);
    model::init_params(s.master, cfg, 5);
    return s;
  };
  auto fill = [](model::Qwen35Model& m, int t, bool zero) {
    for (const Tensor& g : m.grads()) {
      float* p = g.ptr<float>();  // [numel] F32 (cpu)
      for (int64_t j = 0; j < g.numel(); ++j)
        p[j] =
            zero ? 0.0f : 0.01f * static_cast<float>(t) * static_cast<float>(1 + (j * 7 + t) % 13);
    }
  };
  OptimizerConfig oc;
  oc.hyper.weight_decay = 0.1;
  oc.clip = 0.5;
  model::Qwen35Model ref(cfg, Backend::Cpu, 64, 2, {});
  auto host = make_host_optimizer(ref, specs, fresh(), oc);
  std::vector<double> norms;
  for (int t = 1; t <= 3; ++t) {
    fill(ref, t, false);
    norms.push_back(ops::grad_global_norm(ref.grads()));
    host->step(1e-2, t, GradCheck{1.0, norms.back(), {}, {}});
  }
  const OptimizerState& want = host->host_state();
  const int nd = world_with_non_decaying_straddler();
  ASSERT_GT(nd, 0);
  for (int world : {2, 3, nd}) {
    ThreadComm::Shared sh(world);
    std::vector<std::string> failures(static_cast<size_t>(world));
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r)
      ranks.emplace_back([&, r] {
        std::string& fail = failures[static_cast<size_t>(r)];
        try {
          ThreadComm comm(r, world, sh);
          model::Qwen35Model m(cfg, Backend::Cpu, 64, 2, {});
          auto opt = make_sharded_optimizer(m, specs, fresh(), oc, comm, 5000);
          for (int t = 1; t <= 3; ++t) {
            fill(m, t, r != 0);
            opt->reduce_grads();
            double sumsq = 0;
            opt->grad_sumsq_into(Tensor(&sumsq, DType::F64, {1}));
            const double norm = norms[static_cast<size_t>(t - 1)];
            if (std::fabs(std::sqrt(sumsq) - norm) > 1e-12 * norm)
              fail += fmt::format("step {}: norm {} vs {}; ", t, std::sqrt(sumsq), norm);
            opt->step(1e-2, t, GradCheck{1.0, norm, {}, {}});
          }
          for (size_t i = 0; i < specs.size(); ++i)
            if (std::memcmp(m.param(i).data(), ref.param(i).data(),
                            static_cast<size_t>(m.param(i).nbytes())) != 0)
              fail += specs[i].name + " differs; ";
          const OptimizerState& got = opt->host_state();
          for (size_t i = 0; i < specs.size() && r == 0; ++i)
            for (auto [s, u] :
                 {std::pair{&want.master, &got.master}, {&want.m, &got.m}, {&want.v, &got.v}})
              if (std::memcmp(s->tensor(i).data(), u->tensor(i).data(),
                              static_cast<size_t>(s->tensor(i).nbytes())) != 0)
                fail += "gathered state of " + specs[i].name + " differs; ";
        } catch (const std::exception& e) {
          fail += e.what();
        }
      });
    for (std::thread& th : ranks) th.join();
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(failures[static_cast<size_t>(r)], "") << world << " ranks, rank " << r;
  }
}

}  // namespace
}  // namespace gdn::train
