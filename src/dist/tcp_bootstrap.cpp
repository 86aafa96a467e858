#include "dist/tcp_bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::dist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x424e4447;  // "GDNB" little-endian
constexpr uint32_t kVersion = 1;
constexpr size_t kHelloBytes = 24;  // magic, version, rank, world: u32; payload size: u64
constexpr const char* kHint =
    "every rank needs the same MASTER_ADDR (rank 0's host, reachable from the others) and "
    "MASTER_PORT (free on that host); docs/DISTRIBUTED.md";

// Closes on scope exit.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

int ms_left(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

// Waits until `fd` is readable/writable or the deadline; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms_left(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

enum class Io { Ok, Timeout, Closed, Error };

Io send_all(int fd, const void* buf, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    if (!wait_fd(fd, POLLOUT, deadline)) return Io::Timeout;
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno == EPIPE || errno == ECONNRESET ? Io::Closed : Io::Error;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Io::Ok;
}

Io recv_all(int fd, void* buf, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return Io::Timeout;
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) return Io::Closed;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno == ECONNRESET ? Io::Closed : Io::Error;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return Io::Ok;
}

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

std::string peer_name(const sockaddr_storage& a) {
  char host[NI_MAXHOST] = "?";
  char serv[NI_MAXSERV] = "?";
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&a), sizeof(a), host, sizeof(host), serv,
                sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV);
  return std::string(host) + ":" + serv;
}

std::string list_ranks(const std::vector<int>& ranks) {
  std::string s;
  const size_t shown = std::min<size_t>(ranks.size(), 16);
  for (size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > shown) s += fmt::format(" and {} more", ranks.size() - shown);
  return s;
}

// Listens on every interface (IPv6 dual-stack when the host has IPv6, else IPv4), like TCPStore's
// server socket: MASTER_ADDR names rank 0's host for the others, rank 0 needs no address of its
// own.
Fd listen_on(int port, int backlog) {
  int last_errno = 0;
  for (int family : {AF_INET6, AF_INET}) {
    Fd s(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s.fd < 0) {
      last_errno = errno;
      continue;
    }
    const int one = 1, zero = 0;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (family == AF_INET6) {
      ::setsockopt(s.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (rc == 0 && ::listen(s.fd, backlog) == 0) return s;
    last_errno = errno;
    if (last_errno == EADDRINUSE) break;  // the other family would fail the same way
  }
  GDN_FAIL_HINT(kHint, "rank 0: cannot listen on TCP port {} (MASTER_PORT): {}", port,
                std::strerror(last_errno));
}

void serve(const TcpRendezvous& where, int world, std::span<const std::byte> data) {
  const auto deadline = Clock::now() + where.timeout;
  Fd listener = listen_on(where.port, world);
  ::fcntl(listener.fd, F_SETFL, ::fcntl(listener.fd, F_GETFL) | O_NONBLOCK);
  std::vector<Fd> peers(static_cast<size_t>(world));
  int arrived = 1;
  while (arrived < world) {
    if (!wait_fd(listener.fd, POLLIN, deadline)) {
      std::vector<int> missing;
      for (int r = 1; r < world; ++r)
        if (peers[r].fd < 0) missing.push_back(r);
      GDN_FAIL_HINT(
          kHint, "rank 0: {} of {} ranks did not reach port {} within {} s; missing: rank {}",
          missing.size(), world - 1, where.port, seconds(where.timeout), list_ranks(missing));
    }
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    Fd c(::accept4(listener.fd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC));
    if (c.fd < 0) continue;  // EAGAIN (a connection that went away), EINTR
    const int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A rank sends its hello right after connecting; something that connects and says nothing
    // (a port scanner, a stale client) is dropped after a few seconds instead of holding us up.
    std::array<uint8_t, kHelloBytes> h{};
    const auto hello_deadline = std::min(deadline, Clock::now() + std::chrono::seconds(10));
    if (recv_all(c.fd, h.data(), h.size(), hello_deadline) != Io::Ok ||
        get_u32(h.data()) != kMagic || get_u32(h.data() + 4) != kVersion) {
      log::warn("rank 0: ignored a connection from {} on port {} that is not a gdntrain rank",
                peer_name(from), where.port);
      continue;
    }
    const uint32_t r = get_u32(h.data() + 8), w = get_u32(h.data() + 12);
    const uint64_t n = get_u64(h.data() + 16);
    GDN_CHECK_HINT(static_cast<int>(w) == world, kHint,
                   "rank 0: the process at {} says it is rank {} of {}, but this run has {} ranks "
                   "(WORLD_SIZE differs between ranks)",
                   peer_name(from), r, w, world);
    GDN_CHECK_HINT(r >= 1 && static_cast<int>(r) < world, kHint,
                   "rank 0: the process at {} says it is rank {} (expected 1..{})", peer_name(from),
                   r, world - 1);
    GDN_CHECK_HINT(peers[r].fd < 0, kHint,
                   "rank 0: two processes say they are rank {} (the second from {}); RANK must be "
                   "unique",
                   r, peer_name(from));
    GDN_CHECK_HINT(n == data.size(), kHint,
                   "rank 0: rank {} expects {} bytes but rank 0 sends {} (different builds?)", r, n,
                   data.size());
    peers[r] = std::move(c);
    ++arrived;
  }
  for (int r = 1; r < world; ++r) {
    const Io io = send_all(peers[r].fd, data.data(), data.size(), deadline);
    GDN_CHECK_HINT(io == Io::Ok, kHint,
                   "rank 0: sending the rendezvous bytes to rank {} failed ({})", r,
                   io == Io::Timeout ? "timeout" : "it closed the connection");
  }
}

Fd connect_once(const addrinfo* ai, Clock::time_point deadline, int* err) {
  Fd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
  if (s.fd < 0) {
    *err = errno;
    return Fd{};
  }
  if (::connect(s.fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      *err = errno;
      return Fd{};
    }
    if (!wait_fd(s.fd, POLLOUT, std::min(deadline, Clock::now() + std::chrono::seconds(2)))) {
      *err = ETIMEDOUT;
      return Fd{};
    }
    int so = 0;
    socklen_t len = sizeof(so);
    ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &so, &len);
    if (so != 0) {
      *err = so;
      return Fd{};
    }
  }
  const int one = 1;
  ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return s;
}

void fetch(const TcpRendezvous& where, int rank, int world, std::span<std::byte> data) {
  const auto deadline = Clock::now() + where.timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(where.port);
  const int gai = ::getaddrinfo(where.addr.c_str(), port.c_str(), &hints, &res);
  GDN_CHECK_HINT(gai == 0, kHint, "rank {}: MASTER_ADDR='{}' does not resolve: {}", rank,
                 where.addr, ::gai_strerror(gai));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
  // Rank 0 may start later than us: retry with a growing pause (50 ms .. 1 s), as llm.c's and
  // TCPStore's clients do, until the deadline.
  Fd s;
  int err = 0;
  auto pause = std::chrono::milliseconds(50);
  for (;;) {
    for (const addrinfo* ai = res; ai && s.fd < 0; ai = ai->ai_next)
      s = connect_once(ai, deadline, &err);
    if (s.fd >= 0) break;
    GDN_CHECK_HINT(ms_left(deadline) > 0, kHint,
                   "rank {}: rank 0 did not answer at {}:{} (MASTER_ADDR:MASTER_PORT) within {} s "
                   "(last error: {}); is rank 0 running?",
                   rank, where.addr, where.port, seconds(where.timeout), std::strerror(err));
    std::this_thread::sleep_for(std::min(pause, std::chrono::milliseconds(ms_left(deadline))));
    pause = std::min(pause * 2, std::chrono::milliseconds(1000));
  }
  std::array<uint8_t, kHelloBytes> h{};
  put_u32(h.data(), kMagic);
  put_u32(h.data() + 4, kVersion);
  put_u32(h.data() + 8, static_cast<uint32_t>(rank));
  put_u32(h.data() + 12, static_cast<uint32_t>(world));
  put_u64(h.data() + 16, data.size());
  Io io = send_all(s.fd, h.data(), h.size(), deadline);
  if (io == Io::Ok) io = recv_all(s.fd, data.data(), data.size(), deadline);
  GDN_CHECK_HINT(io != Io::Timeout, kHint,
                 "rank {}: connected to rank 0 at {}:{} but it did not send the rendezvous bytes "
                 "within {} s (it waits for every rank: another rank is missing, see rank 0's "
                 "error)",
                 rank, where.addr, where.port, seconds(where.timeout));
  GDN_CHECK_HINT(io == Io::Ok, kHint,
                 "rank {}: rank 0 at {}:{} closed the connection before sending the rendezvous "
                 "bytes (it refused this rank or failed: see rank 0's error)",
                 rank, where.addr, where.port);
}

}  // namespace

void tcp_broadcast(const TcpRendezvous& where, int rank, int world, std::span<std::byte> data) {
  GDN_CHECK(world >= 1 && rank >= 0 && rank < world, "tcp_broadcast: rank {} of {}", rank, world);
  GDN_CHECK(where.port > 0 && where.port < 65536, "tcp_broadcast: port {} out of range",
            where.port);
  if (world == 1) return;
  if (rank == 0) {
    serve(where, world, data);
  } else {
    fetch(where, rank, world, data);
  }
}

int find_free_tcp_port() {
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  GDN_CHECK(s.fd >= 0, "socket: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  GDN_CHECK(::bind(s.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0, "bind: {}",
            std::strerror(errno));
  socklen_t len = sizeof(a);
  GDN_CHECK(::getsockname(s.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0, "getsockname: {}",
            std::strerror(errno));
  return ntohs(a.sin_port);
}

}  // namespace gdn::dist
