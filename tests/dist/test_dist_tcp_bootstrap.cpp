// The TCP rendezvous on the loopback: several ranks (threads) receive rank 0's bytes whatever the
// start order; a missing rank 0, a missing peer and a mismatched world are errors naming who,
// within the timeout.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dist/tcp_bootstrap.h"
#include "gdn/core/error.h"

namespace gdn::dist {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<std::byte> pattern(size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed * 7 + 3) & 0xff);
  return v;
}

// Runs `world` ranks as threads; returns each rank's bytes, or its error in `errors`.
struct Outcome {
  std::vector<std::vector<std::byte>> data;
  std::vector<std::string> errors;
};
Outcome run_ranks(int world, size_t nbytes, std::chrono::milliseconds timeout,
                  std::vector<int> present, std::chrono::milliseconds root_delay = 0ms,
                  int world_seen_by_last = -1, int port = 0) {
  const TcpRendezvous where{"127.0.0.1", port > 0 ? port : find_free_tcp_port(), timeout};
  Outcome out;
  out.data.resize(static_cast<size_t>(world));
  out.errors.resize(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r : present) {
    out.data[r] = r == 0 ? pattern(nbytes, 42) : std::vector<std::byte>(nbytes);
    ts.emplace_back([&, r] {
      if (r == 0) std::this_thread::sleep_for(root_delay);
      const int w = (world_seen_by_last > 0 && r == present.back()) ? world_seen_by_last : world;
      try {
        tcp_broadcast(where, r, w, out.data[r]);
      } catch (const Error& e) {
        out.errors[r] = e.message();
      }
    });
  }
  for (auto& t : ts) t.join();
  return out;
}

TEST(TcpBootstrap, EveryRankGetsRankZerosBytes) {
  for (int world : {2, 3, 5}) {
    // 128 bytes: the size of an ncclUniqueId.
    Outcome r = run_ranks(world, 128, 10s, [&] {
      std::vector<int> all(world);
      for (int i = 0; i < world; ++i) all[i] = i;
      return all;
    }());
    for (int i = 0; i < world; ++i) {
      EXPECT_EQ(r.errors[i], "") << "rank " << i << " of " << world;
      EXPECT_EQ(r.data[i], pattern(128, 42)) << "rank " << i << " of " << world;
    }
  }
}

TEST(TcpBootstrap, PeersWaitForALateRankZero) {
  // The others start first and keep retrying the connection until rank 0 listens.
  Outcome r = run_ranks(3, 4096, 10s, {1, 2, 0}, 700ms);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r.errors[i], "") << "rank " << i;
    EXPECT_EQ(r.data[i], pattern(4096, 42)) << "rank " << i;
  }
}

// A port on the loopback that this process holds bound but never listens on: a connection to it
// is refused, and no other process (an mpirun daemon, another test) can take it meanwhile, which
// a port found free and released (find_free_tcp_port) does not guarantee.
class HeldPort {
 public:
  HeldPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t n = sizeof(a);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &n) != 0)
      throw std::runtime_error("HeldPort: cannot bind a loopback port");
    port_ = ntohs(a.sin_port);
  }
  ~HeldPort() { ::close(fd_); }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1, port_ = 0;
};

TEST(TcpBootstrap, RankZeroNeverComingIsAnErrorWithinTheTimeout) {
  const HeldPort held;
  const auto t0 = Clock::now();
  Outcome r = run_ranks(3, 128, 1500ms, {1, 2}, 0ms, -1, held.port());
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int i : {1, 2}) {
    EXPECT_THAT(r.errors[i],
                HasSubstr(fmt::format("rank {}: rank 0 did not answer at 127.0.0.1:", i)));
    EXPECT_THAT(r.errors[i], HasSubstr("within 1.5 s"));
  }
  EXPECT_GE(s, 1.4);
  EXPECT_LT(s, 5.0) << "the timeout must bound the wait";
}

TEST(TcpBootstrap, MissingPeerIsNamedByRankZero) {
  const auto t0 = Clock::now();
  Outcome r = run_ranks(4, 128, 1500ms, {0, 1, 3});
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_THAT(r.errors[0], HasSubstr("1 of 3 ranks did not reach port"));
  EXPECT_THAT(r.errors[0], HasSubstr("missing: rank 2"));
  // The ranks that came learn that rank 0 gave up, instead of waiting forever.
  for (int i : {1, 3}) EXPECT_THAT(r.errors[i], HasSubstr("rank 0")) << r.errors[i];
  EXPECT_LT(s, 5.0);
}

TEST(TcpBootstrap, DifferentWorldSizesAreRefused) {
  Outcome r = run_ranks(2, 128, 3s, {0, 1}, 0ms, /*world_seen_by_last=*/3);
  EXPECT_THAT(r.errors[0], HasSubstr("says it is rank 1 of 3, but this run has 2 ranks"));
  EXPECT_THAT(r.errors[1], HasSubstr("closed the connection"));
}

TEST(TcpBootstrap, WorldOneIsANoOp) {
  std::vector<std::byte> d = pattern(16, 1);
  tcp_broadcast({"nowhere.invalid", 1, 10ms}, 0, 1, d);
  EXPECT_EQ(d, pattern(16, 1));
}

TEST(TcpBootstrap, UnresolvableMasterAddrIsAnError) {
  std::vector<std::byte> d(16);
  try {
    tcp_broadcast({"no-such-host.invalid", 29500, 1s}, 1, 2, d);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("MASTER_ADDR='no-such-host.invalid' does not resolve"));
  }
}

}  // namespace
}  // namespace gdn::dist
