// Launch detection (issue 23): who am I in a multi-process run, read from the variables the
// launchers users already have set.
//
//   torchrun (torch/distributed/run.py): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//            MASTER_ADDR, MASTER_PORT; `torchrun --no-python ... gdntrain train ...`.
//   Open MPI (mpirun): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE.
//   Slurm (srun): SLURM_PROCID, SLURM_NTASKS (SLURM_STEP_NUM_TASKS when srun sets it),
//            SLURM_LOCALID, SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE + SLURM_NODEID).
//
// Precedence when several are present: torchrun, then Open MPI, then Slurm (torchrun started by
// srun, or mpirun inside an salloc/sbatch allocation, both carry Slurm variables that describe the
// allocation, not this process).
//
// Everything is validated before any work: a malformed number, rank >= world, local rank >= local
// world, a distributed torchrun/Slurm launch without MASTER_ADDR/MASTER_PORT, or two launchers
// disagreeing on the world size is a gdn::Error naming the variable. The parser reads an EnvMap
// (tests pass fake environments); process_env() snapshots the real one.
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace gdn::dist {

using EnvMap = std::map<std::string, std::string, std::less<>>;

enum class Launcher { None, Torchrun, OpenMpi, Slurm };
std::string_view launcher_name(Launcher l);

struct LaunchInfo {
  int rank = 0;
  int world = 1;
  int local_rank = 0;       // picks the GPU: one rank per GPU
  int local_world = 1;      // ranks on this node
  std::string master_addr;  // empty when not needed (world 1, or the rendezvous goes over MPI)
  int master_port = 0;
  Launcher launcher = Launcher::None;

  bool distributed() const { return world > 1; }
};

struct LaunchOptions {
  // True when the communicator will bootstrap over MPI (mpirun, or srun starting MPI through
  // PMIx): then Slurm launches need no MASTER_ADDR/MASTER_PORT. torchrun launches always need
  // them (the TCP rendezvous is the only one torchrun provides).
  bool rendezvous_over_mpi = false;
};

// Snapshot of the process environment.
EnvMap process_env();

// Detects the launcher and validates its variables; a plain start (none set) is world 1.
LaunchInfo detect_launch(const EnvMap& env, const LaunchOptions& opts = {});

// "rank 1/8 (local 1/4) launched by torchrun, rendezvous 10.0.0.1:29500".
std::string describe(const LaunchInfo& info);

}  // namespace gdn::dist
