#include "dist/numa.h"

#include <dirent.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "gdn/core/error.h"
#include "gdn/core/log.h"

namespace gdn::dist {

namespace {

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

int parse_cpu(std::string_view t, std::string_view whole) {
  int v = -1;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
  GDN_CHECK(!t.empty() && ec == std::errc() && p == t.data() + t.size() && v >= 0 && v < (1 << 20),
            "CPU list '{}': '{}' is not a CPU number", whole, t);
  return v;
}

std::optional<std::string> read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int> intersect(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

}  // namespace

std::vector<int> parse_cpulist(std::string_view text) {
  const std::string t = trim(text);
  std::vector<int> cpus;
  if (t.empty()) return cpus;  // a node without CPUs (memory-only) has an empty list
  size_t pos = 0;
  while (pos <= t.size()) {
    size_t end = t.find(',', pos);
    if (end == std::string::npos) end = t.size();
    std::string_view item = std::string_view(t).substr(pos, end - pos);
    // "a-b" or "a-b:stride/group" (the kernel's bitmap_parselist); we take plain ranges and
    // single numbers, which is what sysfs prints.
    if (size_t dash = item.find('-'); dash != std::string_view::npos) {
      const int a = parse_cpu(item.substr(0, dash), t), b = parse_cpu(item.substr(dash + 1), t);
      GDN_CHECK(a <= b, "CPU list '{}': range {}-{} is reversed", t, a, b);
      for (int c = a; c <= b; ++c) cpus.push_back(c);
    } else {
      cpus.push_back(parse_cpu(item, t));
    }
    pos = end + 1;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpulist(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += j == i ? std::to_string(cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return s;
}

std::string normalize_pci_bus_id(std::string_view bus_id) {
  std::string s = trim(bus_id);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // Domain "00000000" (NVML) -> "0000" (sysfs); the domain is 16 bits on Linux.
  if (size_t colon = s.find(':'); colon == 8 && s.compare(0, 4, "0000") == 0) s.erase(0, 4);
  return s;
}

NumaPlan plan_numa_binding(NumaBind mode, const std::optional<std::string>& pci_bus_id,
                           const std::vector<int>& allowed, const std::filesystem::path& sysfs) {
  NumaPlan plan;
  const std::string kept = fmt::format("keeping the current CPU affinity ({})",
                                       allowed.empty() ? "unknown" : format_cpulist(allowed));
  if (mode == NumaBind::Off) {
    plan.message = "dist.numa_bind = off: " + kept;
    return plan;
  }
  if (!pci_bus_id || pci_bus_id->empty()) {
    plan.message = "no GPU: " + kept + " (the launcher's binding, if it set one)";
    return plan;
  }
  const std::string id = normalize_pci_bus_id(*pci_bus_id);
  const auto dev = sysfs / "bus" / "pci" / "devices" / id;
  const auto node_text = read_text(dev / "numa_node");
  if (!node_text) {
    plan.warn = true;
    plan.message =
        fmt::format("cannot read {}: not binding; {}", (dev / "numa_node").string(), kept);
    return plan;
  }
  try {
    int node = -1;
    const std::string nt = trim(*node_text);
    auto [p, ec] = std::from_chars(nt.data(), nt.data() + nt.size(), node);
    GDN_CHECK(ec == std::errc() && p == nt.data() + nt.size() && node >= -1,
              "{} holds '{}', not a node number", (dev / "numa_node").string(), nt);
    std::vector<int> local;
    std::string source;
    if (node >= 0) {
      const auto list =
          sysfs / "devices" / "system" / "node" / fmt::format("node{}", node) / "cpulist";
      const auto text = read_text(list);
      GDN_CHECK(text.has_value(), "cannot read {}", list.string());
      local = parse_cpulist(*text);
      source = fmt::format("NUMA node {}", node);
    } else if (const auto text = read_text(dev / "local_cpulist")) {
      local = parse_cpulist(*text);
      source = "its local_cpulist (NUMA node unknown)";
    } else {
      plan.message = fmt::format("GPU {}: NUMA node unknown (numa_node = -1): {}", id, kept);
      return plan;
    }
    std::vector<int> cpus = allowed.empty() ? local : intersect(local, allowed);
    if (cpus.empty()) {
      plan.warn = true;
      plan.message = fmt::format(
          "GPU {}: none of the CPUs of {} ({}) may be used by this process ({}): not binding", id,
          source, format_cpulist(local), allowed.empty() ? "?" : format_cpulist(allowed));
      return plan;
    }
    plan.bind = true;
    plan.node = node;
    plan.cpus = std::move(cpus);
    plan.message =
        fmt::format("GPU {} is on {}: binding to CPUs {}", id, source, format_cpulist(plan.cpus));
  } catch (const Error& e) {
    plan = NumaPlan{};
    plan.warn = true;
    plan.message = fmt::format("GPU {}: {}: not binding; {}", id, e.message(), kept);
  }
  return plan;
}

std::vector<int> current_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

#if !defined(GDN_WITH_CUDA)
std::optional<std::string> cuda_pci_bus_id(int) { return std::nullopt; }
#endif

NumaPlan bind_to_device_numa_node(NumaBind mode, int device) {
  const std::optional<std::string> bus =
      device >= 0 ? cuda_pci_bus_id(device) : std::optional<std::string>{};
  NumaPlan plan = plan_numa_binding(mode, bus, current_affinity());
  if (plan.bind) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : plan.cpus)
      if (c < CPU_SETSIZE) CPU_SET(c, &set);
    // Every thread that exists now (an OpenMP pool may already run), then the main thread, whose
    // affinity the threads started later inherit.
    int failed = 0;
    if (DIR* d = ::opendir("/proc/self/task")) {
      while (dirent* e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        const pid_t tid = static_cast<pid_t>(std::atoi(e->d_name));
        if (sched_setaffinity(tid, sizeof(set), &set) != 0) ++failed;
      }
      ::closedir(d);
    }
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      plan.bind = false;
      plan.warn = true;
      plan.message +=
          fmt::format(" failed ({}): the affinity is left as it was", std::strerror(errno));
    } else if (failed > 0) {
      plan.warn = true;
      plan.message += fmt::format(" ({} thread(s) that already ran could not be moved)", failed);
    }
  }
  if (plan.warn) {
    log::warn("[numa] {}", plan.message);
  } else {
    log::info("[numa] {}", plan.message);
  }
  return plan;
}

}  // namespace gdn::dist
