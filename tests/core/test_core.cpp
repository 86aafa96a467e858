// Core runtime: dtypes (bf16/f16 bit patterns), tensor views, arenas, the counter RNG, env knobs,
// log-once and error formatting.
#include <gtest/gtest.h>

#include <stdlib.h>
#include <cstring>

#include <atomic>
#include <cmath>
#include <limits>
#include <thread>

#include "gdn/core/arena.h"
#include "gdn/core/dtype.h"
#include "gdn/core/env.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"
#include "gdn/core/rng.h"
#include "gdn/core/split_f32.h"
#include "gdn/core/tensor.h"

namespace gdn {
namespace {

TEST(Bf16, KnownBitPatterns) {
  EXPECT_EQ(float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16_bits(3.140625f), 0x4049);  // exactly representable
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80);
  // NaN stays NaN (quiet), including a signalling NaN whose payload sits in the low bits only.
  uint16_t n = float_to_bf16_bits(f32_from_bits(0x7f800001u));
  EXPECT_EQ(n & 0x7f80, 0x7f80);
  EXPECT_NE(n & 0x007f, 0);
  // Round to nearest even: 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7 -> even (1.0).
  EXPECT_EQ(float_to_bf16_bits(f32_from_bits(0x3f808000u)), 0x3f80);
  // 1 + 3·2^-8 is halfway between 0x3f81 and 0x3f82 -> even (0x3f82).
  EXPECT_EQ(float_to_bf16_bits(f32_from_bits(0x3f818000u)), 0x3f82);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(float_to_bf16_bits(f32_from_bits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(float_to_bf16_bits(f32_from_bits(0x3f807fffu)), 0x3f80);
  // Largest finite float rounds to infinity in bf16 (as torch does).
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);
  // Subnormal floats keep their top bits.
  EXPECT_EQ(float_to_bf16_bits(f32_from_bits(0x00010000u)), 0x0001);
  EXPECT_EQ(bf16_bits_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_bits_to_float(0xc049), -3.140625f);
  // (1 + w) formed in bf16 loses a small w: the reason the precision policy forms it in fp32.
  EXPECT_EQ(round_bf16(1.0f + 0.0039f), 1.0f);
}

TEST(F16, KnownBitPatterns) {
  EXPECT_EQ(float_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65536.0f), 0x7c00);                      // overflow -> inf
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -26)), 0x0000);         // underflow
  EXPECT_EQ(float_to_f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  for (uint32_t h = 0; h < 0x7c00; ++h)  // every finite positive half round-trips exactly
    ASSERT_EQ(float_to_f16_bits(f16_bits_to_float(static_cast<uint16_t>(h))), h) << h;
}

TEST(SplitF32, EveryPatternRoundTripsAndTheHighHalfIsBf16Rounding) {
  // Every 251st bit pattern (17 million, both signs, specials) and every pattern whose low half
  // is a tie or next to one: join(split(x)) == x; hi is round to nearest even except at exact ties,
  // where it is the one away from zero.
  int64_t bad = 0;
  auto check = [&](uint32_t b) {
    const uint16_t hi = split_hi(b);
    bad += split_join(hi, split_lo(b, hi)) != b;
    const bool nan = (b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0;
    if (nan) return;
    const bool tie = (b & 0xffffu) == 0x8000u;
    bad += tie ? hi != static_cast<uint16_t>((b >> 16) + 1)
               : hi != float_to_bf16_bits(f32_from_bits(b));
  };
  for (uint64_t b = 0; b <= 0xffffffffu; b += 251) check(static_cast<uint32_t>(b));
  for (uint32_t top = 0; top < 0x10000u; top += 3)
    for (uint32_t low : {0x7fffu, 0x8000u, 0x8001u, 0x0000u, 0xffffu}) check((top << 16) | low);
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(split_hi(f32_bits(1.0f + 0x1p-8f)), 0x3f81);  // tie: away from zero
  EXPECT_EQ(split_lo(f32_bits(1.0f + 0x1p-8f), 0x3f81), -32768);
  EXPECT_EQ(split_hi(f32_bits(std::numeric_limits<float>::max())), 0x7f80);
}

TEST(DType, NamesRoundTripAndUnknownIsAnError) {
  for (DType t :
       {DType::F64, DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::I16})
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  try {
    dtype_from_name("F8_E4M3");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dtype 'F8_E4M3'"), std::string::npos);
  }
}

TEST(Tensor, ViewsShapesAndChecks) {
  OwnedTensor t = OwnedTensor::zeros(DType::F32, {3, 4});
  const Tensor& v = t.view();
  EXPECT_EQ(v.numel(), 12);
  EXPECT_EQ(v.size(-1), 4);
  EXPECT_EQ(v.stride(0), 4);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.shape_str(), "[3, 4]");
  EXPECT_EQ(v.reshape({12}).numel(), 12);
  EXPECT_THROW(v.reshape({5}), Error);
  EXPECT_EQ(v.slice0(1, 3).size(0), 2);
  EXPECT_EQ(static_cast<char*>(v.slice0(1, 3).data()) - static_cast<char*>(v.data()), 16);
  EXPECT_THROW(v.ptr<double>(), Error);
  EXPECT_FALSE(Tensor().defined());
  try {
    expect_shape(v, "myop", "x", {3, 5});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("myop: tensor 'x' has shape [3, 4], expected [3, 5]"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("src/core/tensor.cpp:"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(expect_shape(v, "myop", "x", {-1, 4}));
  try {
    expect_tensor(Tensor(), "myop", "bias", DType::F32, {4});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'bias' is required"), std::string::npos);
  }
}

TEST(Tensor, ConvertRoundsAndChecksIntegerRange) {
  std::vector<double> vals = {1.0, 1.0 + 1.0 / 256, -3.5};
  OwnedTensor b = from_f64(vals, DType::BF16, {3});
  EXPECT_EQ(b.ptr<bf16>()[0].bits, 0x3f80);
  EXPECT_EQ(b.ptr<bf16>()[1].bits, 0x3f80);  // tie to even
  auto back = to_f64_vector(b);
  EXPECT_EQ(back[2], -3.5);
  OwnedTensor big = OwnedTensor::empty(DType::I64, {1});
  big.ptr<int64_t>()[0] = int64_t{1} << 40;
  EXPECT_THROW(convert(big, DType::I32), Error);
  EXPECT_THROW(convert(b, DType::I32), Error);  // float -> int is not a conversion we do silently
}

// The CPU side of the transfers a training step uses on the GPU: staging is zeroed host memory,
// an asynchronous host-to-host copy is a copy, fences are no-ops that cannot time, and the host
// never drains a device it does not have.
TEST(Transfers, HostSideOfStagingFencesAndDrains) {
  HostStaging st(64, Device::CPU);
  ASSERT_NE(st.data(), nullptr);
  EXPECT_EQ(st.size(), 64u);
  const auto* z = static_cast<const unsigned char*>(st.data());
  for (size_t i = 0; i < st.size(); ++i) ASSERT_EQ(z[i], 0) << i;
  const double src[3] = {1.5, -2.0, 3.25};
  copy_bytes_async(st.data(), Device::CPU, src, Device::CPU, sizeof(src));
  double back[3] = {0, 0, 0};
  std::memcpy(back, st.data(), sizeof(back));
  EXPECT_EQ(back[0], 1.5);
  EXPECT_EQ(back[1], -2.0);
  EXPECT_EQ(back[2], 3.25);
  StreamFence a, b;
  a.record();
  b.record();
  b.wait();
  EXPECT_EQ(b.ms_since(a), -1.0);  // the caller times the CPU with the host clock
  StreamFence moved(std::move(b));
  moved.wait();
  if (!cuda_available()) {
    EXPECT_EQ(device_drains(), 0u);
  }
}

TEST(Arena, SubAllocatesAlignedAndReportsPeak) {
  Arena a("test", Device::CPU, 4096);
  void* p1 = a.alloc(10);
  void* p2 = a.alloc(10);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p2) % 256, 0u);
  EXPECT_EQ(static_cast<char*>(p2) - static_cast<char*>(p1), 256);
  size_t mark = a.used();
  Tensor t = a.alloc_tensor(DType::F32, {100});
  EXPECT_EQ(t.numel(), 100);
  a.release_to(mark);
  EXPECT_EQ(a.used(), mark);
  EXPECT_EQ(a.peak(), 512u + 400u);
  try {
    a.alloc(8192);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("arena 'test' is full"), std::string::npos) << e.what();
  }
}

TEST(Arena, PlanningModeMeasuresTheSameSequence) {
  auto sequence = [](Arena& a) {
    a.alloc(100);
    size_t m = a.used();
    a.alloc(1000);
    a.release_to(m);
    a.alloc(300);
  };
  Arena plan = Arena::planning("plan", Device::CPU);
  sequence(plan);
  Arena real("real", Device::CPU, plan.peak());
  EXPECT_NO_THROW(sequence(real));
  EXPECT_EQ(real.peak(), plan.peak());
}

TEST(Rng, PhiloxKnownAnswer) {
  // Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
  auto r = rng::philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  auto s = rng::philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                           {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(s[0], 0x408f276du);
  EXPECT_EQ(s[1], 0x41c83b0eu);
  EXPECT_EQ(s[2], 0xa20bc7c6u);
  EXPECT_EQ(s[3], 0x6d5451fdu);
}

TEST(Rng, ReproducibleOrderIndependentAndWellDistributed) {
  OwnedTensor a = OwnedTensor::empty(DType::F32, {4096});
  OwnedTensor b = OwnedTensor::empty(DType::F32, {4096});
  rng::fill_normal(a, 42, rng::stream_id("w"), 0.0, 1.0);
  rng::fill_normal(b, 42, rng::stream_id("w"), 0.0, 1.0);
  EXPECT_EQ(std::memcmp(a.view().data(), b.view().data(), 4096 * 4), 0);
  // Element i does not depend on the tensor it is drawn into: a prefix matches.
  OwnedTensor c = OwnedTensor::empty(DType::F32, {10});
  rng::fill_normal(c, 42, rng::stream_id("w"), 0.0, 1.0);
  EXPECT_EQ(std::memcmp(a.view().data(), c.view().data(), 40), 0);
  rng::fill_normal(b, 43, rng::stream_id("w"), 0.0, 1.0);
  EXPECT_NE(std::memcmp(a.view().data(), b.view().data(), 4096 * 4), 0);
  double mean = 0, var = 0;
  for (int i = 0; i < 4096; ++i) mean += a.ptr<float>()[i];
  mean /= 4096;
  for (int i = 0; i < 4096; ++i) var += (a.ptr<float>()[i] - mean) * (a.ptr<float>()[i] - mean);
  var /= 4096;
  EXPECT_NEAR(mean, 0.0, 0.06);
  EXPECT_NEAR(var, 1.0, 0.08);
  for (uint64_t i = 0; i < 1000; ++i) {
    float u = rng::uniform(1, 2, i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
  }
}

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override { env::reset_cache_for_testing(); }
  void TearDown() override {
    unsetenv("GDN_STRICT_KERNELS");
    unsetenv("GDN_STRICT_KERNEL");
    unsetenv("GDN_LOG_LEVEL");
    unsetenv("GDN_NUM_THREADS");
    env::reset_cache_for_testing();
    log::set_sink({});
  }
};

TEST_F(EnvTest, DefaultsParsingAndInvalidValues) {
  EXPECT_FALSE(env::get_bool("GDN_STRICT_KERNELS"));
  env::reset_cache_for_testing();
  setenv("GDN_STRICT_KERNELS", "1", 1);
  EXPECT_TRUE(env::get_bool("GDN_STRICT_KERNELS"));
  setenv("GDN_STRICT_KERNELS", "0", 1);
  EXPECT_TRUE(env::get_bool("GDN_STRICT_KERNELS")) << "read-once knob re-read";
  env::reset_cache_for_testing();
  setenv("GDN_STRICT_KERNELS", "maybe", 1);
  try {
    env::get_bool("GDN_STRICT_KERNELS");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GDN_STRICT_KERNELS='maybe' is not a boolean"),
              std::string::npos);
  }
  setenv("GDN_NUM_THREADS", "four", 1);
  EXPECT_THROW(env::get_int("GDN_NUM_THREADS"), Error);
  setenv("GDN_LOG_LEVEL", "loud", 1);
  EXPECT_THROW(env::get_string("GDN_LOG_LEVEL"), Error);
  EXPECT_THROW(env::get_bool("GDN_NOT_A_KNOB"), Error);
}

TEST_F(EnvTest, UnknownVariableWarnsWithClosestKnob) {
  setenv("GDN_STRICT_KERNEL", "1", 1);
  std::vector<std::string> lines;
  log::set_sink([&](log::Level, std::string_view l) { lines.emplace_back(l); });
  EXPECT_EQ(env::check_environment(), 1);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("GDN_STRICT_KERNEL is ignored; did you mean GDN_STRICT_KERNELS?"),
            std::string::npos)
      << lines[0];
  // An invalid value of a known knob is an error at start-up, not a warning.
  setenv("GDN_STRICT_KERNELS", "2x", 1);
  EXPECT_THROW(env::check_environment(), Error);
}

// GDN_FUSED_FWD and GDN_GDR_GENERIC are gone (issue 21): the gated delta rule's routes are registry
// candidates, forced with GDN_OP_GATED_DELTA_RULE. Setting either old knob warns that it is
// unknown.
TEST_F(EnvTest, RetiredRouteKnobsWarn) {
  for (const char* name : {"GDN_FUSED_FWD", "GDN_GDR_GENERIC"}) {
    setenv(name, "1", 1);
    std::vector<std::string> lines;
    log::set_sink([&](log::Level, std::string_view l) { lines.emplace_back(l); });
    env::check_environment();
    log::set_sink({});
    int named = 0;
    for (const std::string& l : lines) named += l.find(name) != std::string::npos;
    EXPECT_EQ(named, 1) << name;
    unsetenv(name);
  }
}

TEST(EnvTable, EveryKnobHasHelpAndAValidDefault) {
  for (const env::Knob& k : env::knobs()) {
    EXPECT_GT(std::strlen(k.help), 10u) << k.name;
    EXPECT_TRUE(std::string_view(k.name).starts_with("GDN_")) << k.name;
    if (std::string_view(k.name).ends_with('*')) continue;
    env::reset_cache_for_testing();
    switch (k.type) {
      case env::KnobType::Bool:
        EXPECT_NO_THROW(env::get_bool(k.name)) << k.name;
        break;
      case env::KnobType::Int:
        EXPECT_NO_THROW(env::get_int(k.name)) << k.name;
        break;
      case env::KnobType::Float:
        EXPECT_NO_THROW(env::get_float(k.name)) << k.name;
        break;
      default:
        EXPECT_NO_THROW(env::get_string(k.name)) << k.name;
    }
  }
  EXPECT_EQ(env::edit_distance("kitten", "sitting"), 3u);
}

TEST(Log, OncePerKeyAcrossThreadsWithRankPrefix) {
  log::reset_once_keys_for_testing();
  std::atomic<int> count{0};
  std::vector<std::string> lines;
  std::mutex mu;
  log::set_sink([&](log::Level, std::string_view l) {
    std::lock_guard lock(mu);
    lines.emplace_back(l);
    ++count;
  });
  log::set_rank(3, 8);
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([] {
      for (int i = 0; i < 100; ++i) log::info_once("layer-kernel", "chose kernel {}", "x");
    });
  for (auto& t : ts) t.join();
  log::set_rank(0, 1);
  log::set_sink({});
  EXPECT_EQ(count.load(), 1);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "[rank 3/8] chose kernel x");
}

}  // namespace
}  // namespace gdn
