// Run under mpirun by tests/dist/expect_failure.cmake: one rank misbehaves after a first
// collective that succeeds, and the job must end non-zero within the timeout, naming that rank.
//   mpi_failure hang TIMEOUT_S   the last rank sleeps instead of joining all_reduce #2
//   mpi_failure exit TIMEOUT_S   the last rank exits (status 7, no MPI_Finalize) instead
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "dist/comm.h"
#include "dist/launch.h"
#include "gdn/core/error.h"
#include "gdn/core/log.h"

int main(int argc, char** argv) {
  using namespace gdn::dist;
  if (argc != 3) return 2;
  const std::string mode = argv[1];
  const double timeout_s = std::atof(argv[2]);
  auto comm = make_comm(detect_launch(process_env(), {.rendezvous_over_mpi = true}), CommKind::Mpi,
                        {.timeout_s = timeout_s});
  float x = 1.f;
  comm->all_reduce(&x, &x, 1, gdn::DType::F32, ReduceOp::Sum);
  if (x != static_cast<float>(comm->size())) return 4;
  if (comm->rank() == comm->size() - 1) {
    if (mode == "exit") ::_exit(7);
    // "hang": stuck outside communication (long past the timeout); the job must not wait for it.
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 0;
  }
  comm->all_reduce(&x, &x, 1, gdn::DType::F32, ReduceOp::Sum);
  gdn::log::error("all_reduce #2 returned although rank {} never joined it", comm->size() - 1);
  return 5;
}
