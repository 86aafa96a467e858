// NUMA binding: the sysfs cpulist parser and the binding decision, on a fake sysfs tree.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "dist/numa.h"
#include "gdn/core/error.h"

namespace gdn::dist {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Cpulist, ParsesWhatSysfsPrints) {
  EXPECT_THAT(parse_cpulist("0-3,8-11,16\n"), ElementsAre(0, 1, 2, 3, 8, 9, 10, 11, 16));
  EXPECT_THAT(parse_cpulist("5"), ElementsAre(5));
  EXPECT_THAT(parse_cpulist("  7,3,3,0-1 "), ElementsAre(0, 1, 3, 7));
  EXPECT_TRUE(parse_cpulist("\n").empty());  // a memory-only node
  EXPECT_EQ(format_cpulist({0, 1, 2, 3, 8, 9, 10, 11, 16}), "0-3,8-11,16");
  EXPECT_EQ(format_cpulist({}), "");
  EXPECT_EQ(format_cpulist(parse_cpulist("48-95,144-191")), "48-95,144-191");
}

TEST(Cpulist, MalformedIsAnError) {
  for (const char* bad : {"a", "1-", "-1", "3-1", "1,,2", "1 2", "0x3"}) {
    EXPECT_THROW(parse_cpulist(bad), Error) << bad;
  }
}

TEST(Cpulist, BusIdIsNormalisedToSysfs) {
  EXPECT_EQ(normalize_pci_bus_id("0000:3B:00.0"), "0000:3b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("00000000:9A:00.0\n"), "0000:9a:00.0");
}

class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            fmt::format("gdn_sysfs_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    put("devices/system/node/node0/cpulist", "0-3,8-11\n");
    put("devices/system/node/node1/cpulist", "4-7,12-15\n");
    put("bus/pci/devices/0000:3b:00.0/numa_node", "0\n");
    put("bus/pci/devices/0000:9a:00.0/numa_node", "1\n");
  }
  void TearDown() override { fs::remove_all(root_); }
  void put(const std::string& rel, const std::string& text) {
    fs::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  NumaPlan plan(NumaBind mode, std::optional<std::string> bus, std::vector<int> allowed) {
    return plan_numa_binding(mode, bus, allowed, root_);
  }
  fs::path root_;
  const std::vector<int> all_ = parse_cpulist("0-15");
};

TEST_F(FakeSysfs, BindsToTheGpusNode) {
  NumaPlan p = plan(NumaBind::Auto, "00000000:9A:00.0", all_);
  EXPECT_TRUE(p.bind);
  EXPECT_FALSE(p.warn);
  EXPECT_EQ(p.node, 1);
  EXPECT_EQ(format_cpulist(p.cpus), "4-7,12-15");
  EXPECT_EQ(p.message, "GPU 0000:9a:00.0 is on NUMA node 1: binding to CPUs 4-7,12-15");
  EXPECT_EQ(format_cpulist(plan(NumaBind::Auto, "0000:3B:00.0", all_).cpus), "0-3,8-11");
}

TEST_F(FakeSysfs, RespectsTheAllowedSet) {
  // A cgroup or the launcher allows 2-5 only: bind to the node's CPUs among those.
  NumaPlan p = plan(NumaBind::Auto, "0000:3b:00.0", parse_cpulist("2-5"));
  EXPECT_TRUE(p.bind);
  EXPECT_EQ(format_cpulist(p.cpus), "2-3");
  // None of them allowed: a warning, no binding.
  p = plan(NumaBind::Auto, "0000:3b:00.0", parse_cpulist("4-7"));
  EXPECT_FALSE(p.bind);
  EXPECT_TRUE(p.warn);
  EXPECT_THAT(p.message, HasSubstr("none of the CPUs of NUMA node 0 (0-3,8-11)"));
}

TEST_F(FakeSysfs, OffAndNoGpuKeepTheAffinity) {
  NumaPlan p = plan(NumaBind::Off, "0000:3b:00.0", all_);
  EXPECT_FALSE(p.bind);
  EXPECT_FALSE(p.warn);
  EXPECT_THAT(p.message,
              HasSubstr("dist.numa_bind = off: keeping the current CPU affinity (0-15)"));
  p = plan(NumaBind::Auto, std::nullopt, all_);
  EXPECT_FALSE(p.bind);
  EXPECT_FALSE(p.warn);
  EXPECT_THAT(p.message, HasSubstr("no GPU"));
}

TEST_F(FakeSysfs, UnknownNodeUsesLocalCpulistOrKeeps) {
  put("bus/pci/devices/0000:01:00.0/numa_node", "-1\n");
  NumaPlan p = plan(NumaBind::Auto, "0000:01:00.0", all_);
  EXPECT_FALSE(p.bind);
  EXPECT_FALSE(p.warn);
  EXPECT_THAT(p.message, HasSubstr("NUMA node unknown (numa_node = -1)"));
  put("bus/pci/devices/0000:01:00.0/local_cpulist", "0-7\n");
  p = plan(NumaBind::Auto, "0000:01:00.0", all_);
  EXPECT_TRUE(p.bind);
  EXPECT_EQ(p.node, -1);
  EXPECT_EQ(format_cpulist(p.cpus), "0-7");
}

TEST_F(FakeSysfs, UnreadableOrMalformedIsOneWarningNeverFatal) {
  NumaPlan p = plan(NumaBind::Auto, "0000:ff:00.0", all_);  // no such device
  EXPECT_FALSE(p.bind);
  EXPECT_TRUE(p.warn);
  EXPECT_THAT(p.message, HasSubstr("cannot read"));
  put("bus/pci/devices/0000:02:00.0/numa_node", "zero\n");
  p = plan(NumaBind::Auto, "0000:02:00.0", all_);
  EXPECT_FALSE(p.bind);
  EXPECT_TRUE(p.warn);
  EXPECT_THAT(p.message, HasSubstr("not a node number"));
  put("bus/pci/devices/0000:03:00.0/numa_node", "3\n");  // node3 has no cpulist
  p = plan(NumaBind::Auto, "0000:03:00.0", all_);
  EXPECT_TRUE(p.warn);
  EXPECT_THAT(p.message, HasSubstr("node3/cpulist"));
  put("devices/system/node/node1/cpulist", "4-\n");
  p = plan(NumaBind::Auto, "0000:9a:00.0", all_);
  EXPECT_TRUE(p.warn);
  EXPECT_FALSE(p.bind);
}

TEST(NumaBind, RealProcessWithoutGpuKeepsItsAffinity) {
  const std::vector<int> before = current_affinity();
  ASSERT_FALSE(before.empty());
  NumaPlan p = bind_to_device_numa_node(NumaBind::Auto, -1);
  EXPECT_FALSE(p.bind);
  EXPECT_EQ(current_affinity(), before);
  EXPECT_EQ(parse_numa_bind("off"), NumaBind::Off);
  EXPECT_THROW(parse_numa_bind("on"), Error);
}

}  // namespace
}  // namespace gdn::dist
