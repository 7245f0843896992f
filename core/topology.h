// Hardware topology through hwloc: NUMA nodes with their cores and memory, PCI devices
// (GPUs, NVMe drives) and the NUMA node each hangs off, and the NUMA node of the block
// device behind a path (for swap directories).
//
// Thread-safety: a Topology is an immutable value once discovered.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata {

struct NumaNode {
  int os_index = 0;           // the kernel's node number (as numactl names it)
  std::vector<int> cpus;      // OS indexes of the processing units (hardware threads)
  uint64_t memory_bytes = 0;  // local memory
};

enum class PciKind { kGpu, kNvme, kNetwork, kOther };
std::string_view PciKindName(PciKind kind);

struct PciDevice {
  std::string bus_id;  // "0000:3b:00.0"
  PciKind kind = PciKind::kOther;
  uint16_t vendor_id = 0;
  uint16_t device_id = 0;
  uint16_t class_id = 0;              // PCI class and subclass, e.g. 0x0108 (NVMe)
  int numa_node = -1;                 // -1 when unknown (or the device spans nodes)
  std::vector<std::string> os_names;  // "nvme0n1", "eth0", ... as the OS names them
};

class Topology {
 public:
  // Reads the machine (restricted to the CPUs and memory this process may use).
  static Result<Topology> Discover();

  const std::vector<NumaNode>& numa_nodes() const { return numa_nodes_; }
  const std::vector<PciDevice>& pci_devices() const { return pci_devices_; }
  int num_cores() const { return num_cores_; }  // physical cores
  int num_pus() const { return num_pus_; }      // hardware threads
  uint64_t total_memory_bytes() const;

  // The node a CPU belongs to, or -1.
  int NumaNodeOfCpu(int cpu) const;
  // The node of a PCI device given by bus id, or -1. Accepts "0000:3b:00.0", "3b:00.0",
  // capitals (CUDA's cudaDeviceGetPCIBusId) and nvidia-smi's "00000000:3B:00.0".
  int NumaNodeOfPci(std::string_view bus_id) const;
  bool HasNumaNode(int os_index) const;

  // Human-readable summary, as `strata-config topology` prints it.
  std::string ToString() const;

 private:
  std::vector<NumaNode> numa_nodes_;
  std::vector<PciDevice> pci_devices_;
  int num_cores_ = 0;
  int num_pus_ = 0;
};

// The NUMA node of the device that holds `path` (walking sysfs from the block device up
// to its PCI function); -1 when the kernel does not say (virtual disks, tmpfs,
// single-node machines report -1 or 0). NotFound when the path does not exist.
Result<int> NumaNodeOfPath(const std::string& path);

// Whether this CPU converts fp16 in hardware (F16C, with AVX): CPUID leaf 1. (GCC's
// __builtin_cpu_supports knows "f16c", clang 14's does not; both compile this.) False on
// other architectures.
bool CpuHasF16c();

}  // namespace strata
