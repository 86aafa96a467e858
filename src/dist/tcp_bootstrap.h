// Rank 0 broadcasts a few bytes to every other rank over TCP: the rendezvous that carries NCCL's
// 128-byte ncclUniqueId when the ranks were not started by MPI (torchrun, srun without PMIx).
//
// The idea is the one of PyTorch's c10d TCPStore (torch/csrc/distributed/c10d/TCPStore.cpp: rank
// 0 serves a key the others fetch) and of llm.c's TCP bootstrap (llmc/zero.cuh: rank 0 listens
// and sends the id to each connecting rank; the others retry connect); written here from scratch,
// reduced to the one thing we need.
//
// Protocol: rank 0 listens on MASTER_PORT (all interfaces), accepts connections until every other
// rank has said hello (a magic, its rank, the world size, the payload size), checks each hello
// (a stranger on the port, a duplicate rank or a different world size/payload size is refused
// with an error naming it), then sends the payload to each. The others retry connecting to
// MASTER_ADDR:MASTER_PORT until the timeout (rank 0 may start later), send the hello and read the
// payload. Every wait is bounded by the timeout: a missing rank 0, a missing peer or a peer that
// stops talking is a gdn::Error naming who did not come, never a hang.
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <string>

namespace gdn::dist {

struct TcpRendezvous {
  std::string addr;  // MASTER_ADDR: host name or address of rank 0's host
  int port = 0;      // MASTER_PORT
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// On rank 0 `data` is sent; on every other rank it is overwritten with rank 0's bytes. Every rank
// passes the same size. Throws gdn::Error on timeout or a protocol mismatch.
void tcp_broadcast(const TcpRendezvous& where, int rank, int world, std::span<std::byte> data);

// A TCP port that was free on the loopback a moment ago (tests).
int find_free_tcp_port();

}  // namespace gdn::dist
