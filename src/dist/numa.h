// NUMA-local CPU binding (issue 23, seed requirement #2131; ops_notes.md): a rank driving GPU g
// runs its host threads on the CPUs of g's NUMA node, so its data reading, kernel launches and
// host-side optimizer work do not cross the socket interconnect.
//
// Where the facts come from (Linux sysfs): the GPU's PCI bus id (cudaDeviceGetPCIBusId) names
// /sys/bus/pci/devices/<bus id>/numa_node; /sys/devices/system/node/node<N>/cpulist lists that
// node's CPUs. When the node is unknown (numa_node = -1, single-socket machines and some VMs) the
// device's own local_cpulist is used if present. The CPUs bound to are those of the node that the
// process may use at all (its current affinity: a cgroup or the launcher's binding is respected).
//
// dist.numa_bind = auto: bind when the node is known; off: never. A rank without a GPU (the cpu
// backend) keeps the launcher's binding (mpirun --bind-to, srun --cpu-bind). A failure to bind is
// one warning line, never fatal.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dist/comm.h"

namespace gdn::dist {

// "0-3,8-11,16\n" -> {0,1,2,3,8,9,10,11,16} (sorted, unique). Malformed text is a gdn::Error.
std::vector<int> parse_cpulist(std::string_view text);
// The inverse, compressed: {0,1,2,3,8} -> "0-3,8".
std::string format_cpulist(const std::vector<int>& cpus);
// CUDA's "0000:3B:00.0" (or NVML's 8-digit domain "00000000:3B:00.0") -> sysfs's "0000:3b:00.0".
std::string normalize_pci_bus_id(std::string_view bus_id);

struct NumaPlan {
  bool bind = false;
  int node = -1;          // the NUMA node, when known
  std::vector<int> cpus;  // what to bind to, when bind
  bool warn = false;      // the message is a warning (something could not be read)
  std::string message;    // one line: what was decided and why
};

// The decision, from a sysfs tree (tests pass a fake one). `allowed` is the process's current
// affinity; `pci_bus_id` is empty for a rank without a GPU.
NumaPlan plan_numa_binding(NumaBind mode, const std::optional<std::string>& pci_bus_id,
                           const std::vector<int>& allowed,
                           const std::filesystem::path& sysfs = "/sys");

// The CPUs this process may run on now.
std::vector<int> current_affinity();

// The PCI bus id of CUDA device `device` (normalised); nullopt in CPU builds or on failure.
std::optional<std::string> cuda_pci_bus_id(int device);

// Plans for CUDA device `device` (-1: no GPU), applies the plan to every thread of the process
// (threads started later inherit it) and logs one line (a warning when it could not bind).
// Returns the plan, with bind = false when applying failed.
NumaPlan bind_to_device_numa_node(NumaBind mode, int device);

}  // namespace gdn::dist
