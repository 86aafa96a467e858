// The resolver's fault injection: deliberately wrong but finite implementations registered above
// a good one must be rejected by the numeric probe (and the good one chosen); under strict mode the
// same setup fails with a clear error; the decision and its log line happen exactly once however
// many threads call. The op under test is a toy "per-document chunked cumsum" with the same edges
// as the GDN kernels: packed documents, chunks of 64, a partial last chunk and 1-token documents.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <thread>

#include "gdn/backend/probe.h"
#include "gdn/backend/registry.h"
#include "gdn/core/env.h"
#include "gdn/core/log.h"

namespace gdn {
namespace {

constexpr int64_t kChunk = 64;

struct CumsumArgs {
  Tensor x;          // [T]
  Tensor cu;         // [N+1] int32
  Tensor y;          // [T] out
  const char* mode;  // which deliberate defect to apply ("" = none)
};
struct CumsumTable {
  void (*forward)(const CumsumArgs&);
  void (*backward)(const CumsumArgs&);  // x holds dy, y receives dx
};

// Per-document inclusive cumsum (fwd) / reverse cumsum (bwd), any float dtype through doubles.
template <bool kReverse>
void cumsum_docs(const CumsumArgs& a, const char* defect) {
  auto x = to_f64_vector(a.x);
  std::vector<double> y(x.size(), 0.0);
  const int32_t* cu = a.cu.ptr<int32_t>();
  const int64_t n = a.cu.numel() - 1;
  const std::string d = defect;
  for (int64_t doc = 0; doc < n; ++doc) {
    const int64_t b = cu[doc], e = cu[doc + 1], len = e - b;
    if (d == "one_token" && len == 1) continue;  // forgets 1-token documents
    double carry = 0;
    for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
      const int64_t c1 = std::min(len, c0 + kChunk);
      const bool partial = c1 - c0 < kChunk;
      if (d == "partial_chunk" && partial && c0 > 0) continue;  // drops the partial last chunk
      for (int64_t i = c0; i < c1; ++i) {
        int64_t t = kReverse ? e - 1 - i : b + i;
        carry += x[static_cast<size_t>(t)];
        y[static_cast<size_t>(t)] = carry;
      }
    }
  }
  double scale = d == "scaled" ? 1.001 : 1.0;
  if (d == "zeros") scale = 0.0;
  for (auto& v : y) v *= scale;
  OwnedTensor out = from_f64(y, a.y.dtype(), a.y.shape());
  copy_into(a.y, out);
}

template <const char* kDefect, bool kBwdOnly = false>
const CumsumTable* make_table() {
  static const CumsumTable t{
      [](const CumsumArgs& a) { cumsum_docs<false>(a, kBwdOnly ? "" : kDefect); },
      [](const CumsumArgs& a) { cumsum_docs<true>(a, kDefect); }};
  return &t;
}
constexpr char kNone[] = "", kZeros[] = "zeros", kScaled[] = "scaled", kPartial[] = "partial_chunk",
               kOneToken[] = "one_token";

// Registers the op (with a probe covering a 1-token document and a partial chunk) and a good
// cpu implementation at priority 0 in a private registry.
struct Fixture {
  Registry reg;
  std::atomic<int> probes{0};
  Fixture() {
    OpDesc d;
    d.name = "doc_cumsum";
    d.summary = "test op";
    d.probe = [this](const ImplDesc& impl, const OpQuery&) {
      ++probes;
      const auto& cand = *static_cast<const CumsumTable*>(impl.table);
      const auto& ref = *static_cast<const CumsumTable*>(reg.ref("doc_cumsum").table);
      ProbeTensors p(impl.backend);
      // Documents: 1 token, 150 tokens (two full chunks + a partial one), 7 tokens.
      std::vector<int64_t> cu = {0, 1, 151, 158};
      auto cut = p.ints(cu, {4}, DType::I32);
      auto x = p.normal({158}, 5, 1.0);
      auto dy = p.normal({158}, 6, 1.0);
      auto y = p.zeros({158}), ry = p.zeros({158}), dx = p.zeros({158}), rdx = p.zeros({158});
      ref.forward({x.ref, cut.ref, ry.ref, ""});
      ref.backward({dy.ref, cut.ref, rdx.ref, ""});
      cand.forward({x.cand, cut.cand, y.cand, ""});
      cand.backward({dy.cand, cut.cand, dx.cand, ""});
      return ProbeError{rel_l2_error(y.cand, ry.ref), rel_l2_error(dx.cand, rdx.ref)};
    };
    d.tolerance = [](DType) { return ProbeError{1e-5, 1e-5}; };
    reg.add_op(std::move(d));
    reg.add_impl({"doc_cumsum", "ref", Backend::Ref, 0, nullptr, make_table<kNone>()});
    reg.add_impl({"doc_cumsum", "cpu.good", Backend::Cpu, 0, nullptr, make_table<kNone>()});
  }
};

class Resolver : public ::testing::Test {
 protected:
  void SetUp() override {
    env::reset_cache_for_testing();
    log::reset_once_keys_for_testing();
    log::set_sink([this](log::Level, std::string_view l) {
      std::lock_guard lock(mu_);
      lines_.emplace_back(l);
    });
  }
  void TearDown() override {
    log::set_sink({});
    unsetenv("GDN_STRICT_KERNELS");
    unsetenv("GDN_OP_DOC_CUMSUM");
    env::reset_cache_for_testing();
  }
  std::vector<std::string> lines() {
    std::lock_guard lock(mu_);
    return lines_;
  }
  std::mutex mu_;
  std::vector<std::string> lines_;
};

struct BadCase {
  const char* name;
  const CumsumTable* table;
};

TEST_F(Resolver, RejectsEveryFiniteButWrongImplementationAndChoosesTheGoodOne) {
  const BadCase cases[] = {{"cpu.zeros", make_table<kZeros>()},
                           {"cpu.scaled", make_table<kScaled>()},
                           {"cpu.partial_chunk", make_table<kPartial>()},
                           {"cpu.one_token", make_table<kOneToken>()},
                           {"cpu.bwd_only_scaled", make_table<kScaled, true>()}};
  for (const BadCase& c : cases) {
    Fixture f;
    f.reg.add_impl({"doc_cumsum", c.name, Backend::Cpu, 100, nullptr, c.table});
    lines_.clear();
    const Resolution& r = f.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}});
    EXPECT_EQ(r.impl->name, "cpu.good") << c.name;
    EXPECT_LE(r.error.fwd, 1e-6);
    ASSERT_EQ(r.rejected.size(), 1u) << c.name;
    EXPECT_NE(r.rejected[0].find(std::string("rejecting ") + c.name + ": probe error"),
              std::string::npos)
        << r.rejected[0];
    auto ls = lines();
    ASSERT_EQ(ls.size(), 2u) << c.name;  // one rejection line, one decision line
    EXPECT_NE(ls[1].find("[resolve] doc_cumsum/cpu: cpu.good (probe fwd"), std::string::npos)
        << ls[1];
  }
}

TEST_F(Resolver, StrictModeTurnsTheRejectionIntoAnError) {
  setenv("GDN_STRICT_KERNELS", "1", 1);
  Fixture f;
  f.reg.add_impl(
      {"doc_cumsum", "cpu.partial_chunk", Backend::Cpu, 100, nullptr, make_table<kPartial>()});
  try {
    f.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}});
    FAIL() << "strict mode accepted a wrong kernel";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("GDN_STRICT_KERNELS: op 'doc_cumsum' implementation 'cpu.partial_chunk' "
                     "rejected: probe error fwd"),
              std::string::npos)
        << m;
  }
  // A failed capability check is a fallback too, and also an error under strict mode.
  Fixture g;
  g.reg.add_impl({"doc_cumsum", "cpu.needs_avx1024", Backend::Cpu, 100,
                  [](const OpQuery&) { return std::string("this CPU lacks AVX-1024"); },
                  make_table<kNone>()});
  try {
    g.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'cpu.needs_avx1024' cannot run: this CPU lacks AVX-1024"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Resolver, CapabilityCheckSkipsWithTheReason) {
  Fixture f;
  f.reg.add_impl({"doc_cumsum", "cpu.big_only", Backend::Cpu, 100,
                  [](const OpQuery& q) {
                    return q.dims.at("T") < 1000 ? std::string("needs T >= 1000") : std::string();
                  },
                  make_table<kNone>()});
  const Resolution& r = f.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "small", {{"T", 10}}});
  EXPECT_EQ(r.impl->name, "cpu.good");
  ASSERT_EQ(r.rejected.size(), 1u);
  EXPECT_NE(r.rejected[0].find("skipping cpu.big_only: needs T >= 1000"), std::string::npos);
  // Another shape class is resolved on its own.
  const Resolution& r2 = f.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "big", {{"T", 5000}}});
  EXPECT_EQ(r2.impl->name, "cpu.big_only");
}

TEST_F(Resolver, DecisionAndLogLineHappenOnceAcrossThreads) {
  Fixture f;
  f.reg.add_impl({"doc_cumsum", "cpu.zeros", Backend::Cpu, 100, nullptr, make_table<kZeros>()});
  std::vector<std::thread> ts;
  std::atomic<int> good{0};
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        const Resolution& r = f.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}});
        if (r.impl->name == "cpu.good") ++good;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(good.load(), 1600);
  EXPECT_EQ(f.probes.load(), 2);  // cpu.zeros once, cpu.good once
  EXPECT_EQ(lines().size(), 2u);
}

TEST_F(Resolver, ForcedImplementationByKnob) {
  Fixture f;
  f.reg.add_impl({"doc_cumsum", "cpu.other", Backend::Cpu, -5, nullptr, make_table<kNone>()});
  setenv("GDN_OP_DOC_CUMSUM", "cpu.other", 1);
  const Resolution& r = f.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}});
  EXPECT_EQ(r.impl->name, "cpu.other");
  EXPECT_NE(lines().back().find("forced by GDN_OP_DOC_CUMSUM"), std::string::npos);

  Fixture g;
  env::reset_cache_for_testing();
  setenv("GDN_OP_DOC_CUMSUM", "cpu.nope", 1);
  try {
    g.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GDN_OP_DOC_CUMSUM=cpu.nope names no implementation"),
              std::string::npos);
    EXPECT_NE(e.hint().find("cpu.good"), std::string::npos) << e.hint();
  }
  // A forced implementation that fails its probe is still rejected (no silent wrong answers).
  Fixture h;
  h.reg.add_impl({"doc_cumsum", "cpu.scaled", Backend::Cpu, 1, nullptr, make_table<kScaled>()});
  env::reset_cache_for_testing();
  setenv("GDN_OP_DOC_CUMSUM", "cpu.scaled", 1);
  EXPECT_THROW(h.reg.resolve("doc_cumsum", OpQuery{Backend::Cpu, "", {}}), Error);
}

TEST_F(Resolver, NoPassingImplementationIsAnErrorListingTheReasons) {
  Registry reg;
  OpDesc d;
  d.name = "only_bad";
  d.probe = [](const ImplDesc&, const OpQuery&) { return ProbeError{0.5, 0.5}; };
  d.tolerance = [](DType) { return ProbeError{1e-5, 1e-5}; };
  reg.add_op(std::move(d));
  reg.add_impl({"only_bad", "cpu.bad", Backend::Cpu, 0, nullptr, make_table<kNone>()});
  try {
    reg.resolve("only_bad", OpQuery{Backend::Cpu, "", {}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no implementation of op 'only_bad' on backend cpu"),
              std::string::npos);
    EXPECT_NE(std::string(e.what()).find("rejecting cpu.bad: probe error fwd 0.5"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(reg.resolve("only_bad", OpQuery{Backend::Cuda, "", {}}), Error);
  EXPECT_THROW(reg.op("missing"), Error);
}

TEST(GlobalRegistry, EveryOpHasARefAndProbesCleanOnCpu) {
  Registry& reg = Registry::global();
  ASSERT_FALSE(reg.ops().empty());
  for (const OpDesc* op : reg.ops()) {
    EXPECT_NO_THROW(reg.ref(op->name)) << op->name;
    EXPECT_TRUE(op->probe && op->tolerance) << op->name;
    if (reg.impls(op->name, Backend::Cpu).empty()) continue;
    const Resolution& r = reg.resolve(op->name, OpQuery{Backend::Cpu, "", {}});
    EXPECT_LE(r.error.fwd, op->tolerance(DType::F32).fwd) << op->name;
    EXPECT_LE(r.error.bwd, op->tolerance(DType::F32).bwd) << op->name;
  }
}

// A shape class keeps every dim it is given, up to ShapeClass's limit of 10; one more is an error
// rather than a class that silently lost a dim (two shapes differing only there would share a
// decision).
TEST(ShapeClassDims, TenDimsAreKeptAndAnEleventhIsAnError) {
  ShapeClass c(Backend::Cpu);
  const char* names[] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k"};
  for (int i = 0; i < 10; ++i) c.dim(names[i], i);
  const OpQuery q = c.query();
  EXPECT_EQ(q.dims.size(), 10u);
  EXPECT_EQ(q.shape_class, "a=0,b=1,c=2,d=3,e=4,f=5,g=6,h=7,i=8,j=9");
  c.dim(names[10], 10);
  EXPECT_THROW(c.query(), Error);
}

}  // namespace
}  // namespace gdn
