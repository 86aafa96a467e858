// scripts/setup.sh: installed packages are detected through dpkg (it once re-installed
// libopenblas-dev and ran `apt-get update` on every call), nothing is fetched when nothing is
// missing, and a non-root user with missing packages gets the one apt-get line to run instead of
// `sudo: command not found`. dpkg-query, id and apt-get are stubs on PATH, so the test changes
// nothing on the machine.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "gdn/core/error.h"

namespace {

namespace fs = std::filesystem;

const fs::path kScript = fs::path(GDN_TEST_DATA_DIR) / ".." / ".." / "scripts" / "setup.sh";

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class SetupScript : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("gdn_setup_{}", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "bin");
    stub("dpkg-query",
         "pkg=\"${@: -1}\"\n"
         "for m in $FAKE_MISSING; do [ \"$m\" = \"$pkg\" ] && { printf 'un '; exit 0; }; done\n"
         "printf 'ii '\n");
    stub("id", "if [ \"$1\" = -u ]; then echo \"$FAKE_UID\"; else exec /usr/bin/id \"$@\"; fi\n");
    stub("apt-get", "echo \"apt-get $*\" >> \"$FAKE_LOG\"\n");
  }
  void TearDown() override { fs::remove_all(dir_); }

  void stub(const std::string& name, const std::string& body) {
    const fs::path p = dir_ / "bin" / name;
    std::ofstream(p) << "#!/bin/bash\n" << body;
    fs::permissions(p, fs::perms::owner_all);
  }

  struct Result {
    int status;
    std::string out, err, apt;
  };
  Result run(const std::string& missing, int uid, const std::string& args = "") {
    const fs::path log = dir_ / "apt.log", out = dir_ / "out", err = dir_ / "err";
    fs::remove(log);
    const std::string cmd = fmt::format(
        "PATH='{}':\"$PATH\" FAKE_MISSING='{}' FAKE_UID={} FAKE_LOG='{}' GDN_SETUP_DEBUG_TOOLS=0 "
        "bash '{}' {} > '{}' 2> '{}'",
        (dir_ / "bin").string(), missing, uid, log.string(), kScript.string(), args, out.string(),
        err.string());
    const int st = std::system(cmd.c_str());
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_file(out), read_file(err), read_file(log)};
  }

  fs::path dir_;
};

TEST_F(SetupScript, DoesNothingWhenEveryPackageIsInstalled) {
  for (int uid : {0, 1000}) {
    Result r = run("", uid);
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.apt, "") << "apt-get ran although nothing is missing";
    EXPECT_EQ(r.err, "");
  }
}

TEST_F(SetupScript, NonRootGetsTheAptGetLineToRun) {
  Result r = run("libfmt-dev ccache", 1000);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.apt, "");
  EXPECT_NE(r.err.find("apt-get update && apt-get install -y --no-install-recommends ccache "
                       "libfmt-dev"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("sudo: command not found"), std::string::npos) << r.err;
}

TEST_F(SetupScript, RootInstallsOnlyWhatIsMissing) {
  Result r = run("libopenblas-dev", 0);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.apt,
            "apt-get update -qq\n"
            "apt-get install -y -qq --no-install-recommends libopenblas-dev\n");
}

TEST_F(SetupScript, CheckOnlyReports) {
  Result r = run("cmake", 0, "--check");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.apt, "");
  EXPECT_NE(r.out.find("missing packages: cmake"), std::string::npos) << r.out;
  EXPECT_EQ(run("", 0, "--check").status, 0);
  EXPECT_EQ(run("", 0, "--bogus").status, 2);
}

}  // namespace
