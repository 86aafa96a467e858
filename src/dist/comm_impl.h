// Internal: the implementations' factories and the MPI runtime hooks the NCCL bootstrap uses.
// Not part of the module's interface (dist/comm.h is).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "dist/comm.h"

namespace gdn::dist::detail {

std::unique_ptr<Comm> make_local_comm(const LaunchInfo& launch);
// comm_mpi.cpp; throws when this build has no MPI.
std::unique_ptr<Comm> make_mpi_comm(const LaunchInfo& launch, const DistOptions& opts);
// comm_nccl.cu; throws when this build has no NCCL (comm.cpp does not call it then).
std::unique_ptr<Comm> make_nccl_comm(const LaunchInfo& launch, const DistOptions& opts);

// Initialises MPI once per process (MPI_THREAD_FUNNELED: only the thread that made the
// communicator calls MPI) unless something else already did.
void mpi_init_once();
// Called by the destructors of communicators that use MPI. MPI is finalised at process exit when
// we initialised it, unless a communicator was destroyed by an exception unwinding: a process that
// leaves on an error must *not* finalise (Finalize waits for every rank, and the others wait for
// us in a collective); exiting without it makes mpirun end the whole job at once, naming this
// rank.
void mpi_comm_released();
// MPI_Bcast of raw bytes from rank 0 over MPI_COMM_WORLD, bounded by the timeout (the NCCL id
// under mpirun).
void mpi_broadcast_bytes(std::span<std::byte> data, double timeout_s);

// "[rank r/N] error: ..." on stderr, then ends the process with `code` without unwinding: the
// path for a collective that timed out, where returning would only hang in the next call.
[[noreturn]] void fatal(int code, const std::string& message);

}  // namespace gdn::dist::detail
