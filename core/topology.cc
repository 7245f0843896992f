#include "strata/core/topology.h"

#include <hwloc.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "strata/core/bytes.h"

namespace strata {

std::string_view PciKindName(PciKind kind) {
  switch (kind) {
    case PciKind::kGpu:
      return "gpu";
    case PciKind::kNvme:
      return "nvme";
    case PciKind::kNetwork:
      return "network";
    case PciKind::kOther:
      return "other";
  }
  return "?";
}

namespace {

struct TopologyDeleter {
  void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};
using TopologyPtr = std::unique_ptr<hwloc_topology, TopologyDeleter>;

PciKind KindOf(uint16_t class_id) {
  const uint8_t base = class_id >> 8;
  if (class_id == 0x0108) return PciKind::kNvme;
  if (class_id == 0x0300 || class_id == 0x0302 || base == 0x12) return PciKind::kGpu;
  if (base == 0x02) return PciKind::kNetwork;
  return PciKind::kOther;
}

std::string BusId(const hwloc_obj_t obj) {
  char buf[32];
  const auto& p = obj->attr->pcidev;
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%01x", p.domain, p.bus, p.dev, p.func);
  return buf;
}

int SingleNode(hwloc_const_nodeset_t nodeset) {
  if (nodeset == nullptr || hwloc_bitmap_weight(nodeset) != 1) return -1;
  return hwloc_bitmap_first(nodeset);
}

}  // namespace

Result<Topology> Topology::Discover() {
  hwloc_topology_t raw = nullptr;
  // hwloc does not always set errno; ErrnoError needs a non-zero one.
  if (hwloc_topology_init(&raw) != 0)
    return ErrnoError(errno ? errno : ENOMEM, "hwloc_topology_init");
  TopologyPtr topo(raw);
  hwloc_topology_set_io_types_filter(raw, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(raw) != 0) return ErrnoError(errno ? errno : EIO, "hwloc_topology_load");

  Topology t;
  const int n_nodes = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < n_nodes; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(raw, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    NumaNode n;
    n.os_index = static_cast<int>(node->os_index);
    n.memory_bytes = node->attr ? node->attr->numanode.local_memory : 0;
    unsigned cpu;
    hwloc_bitmap_foreach_begin(cpu, node->cpuset) n.cpus.push_back(static_cast<int>(cpu));
    hwloc_bitmap_foreach_end();
    t.numa_nodes_.push_back(std::move(n));
  }
  t.num_cores_ = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_CORE);
  t.num_pus_ = hwloc_get_nbobjs_by_type(raw, HWLOC_OBJ_PU);

  for (hwloc_obj_t obj = hwloc_get_next_pcidev(raw, nullptr); obj != nullptr;
       obj = hwloc_get_next_pcidev(raw, obj)) {
    PciDevice d;
    d.bus_id = BusId(obj);
    d.vendor_id = obj->attr->pcidev.vendor_id;
    d.device_id = obj->attr->pcidev.device_id;
    d.class_id = obj->attr->pcidev.class_id;
    d.kind = KindOf(d.class_id);
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(raw, obj);
    d.numa_node = anc ? SingleNode(anc->nodeset) : -1;
    for (hwloc_obj_t child = obj->io_first_child; child; child = child->next_sibling) {
      if (child->type == HWLOC_OBJ_OS_DEVICE && child->name) d.os_names.emplace_back(child->name);
    }
    t.pci_devices_.push_back(std::move(d));
  }
  return t;
}

uint64_t Topology::total_memory_bytes() const {
  uint64_t total = 0;
  for (const NumaNode& n : numa_nodes_)
    total += n.memory_bytes;
  return total;
}

int Topology::NumaNodeOfCpu(int cpu) const {
  for (const NumaNode& n : numa_nodes_) {
    for (int c : n.cpus) {
      if (c == cpu) return n.os_index;
    }
  }
  return -1;
}

int Topology::NumaNodeOfPci(std::string_view bus_id) const {
  // Bus ids are hex: "0000:3B:00.0" (as nvidia-smi prints them) is "0000:3b:00.0".
  std::string id(bus_id);
  for (char& c : id) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  // nvidia-smi writes an 8-digit domain ("00000000:3b:00.0"); hwloc 4 digits.
  if (const size_t colon = id.find(':');
      colon != std::string::npos && colon > 4 && id.find_first_not_of('0') >= colon - 4) {
    id.erase(0, colon - 4);
  }
  for (const PciDevice& d : pci_devices_) {
    // Accept the id with or without the PCI domain.
    if (d.bus_id == id || std::string_view(d.bus_id).substr(5) == id) return d.numa_node;
  }
  return -1;
}

bool Topology::HasNumaNode(int os_index) const {
  for (const NumaNode& n : numa_nodes_) {
    if (n.os_index == os_index) return true;
  }
  return false;
}

std::string Topology::ToString() const {
  std::ostringstream os;
  os << "NUMA nodes: " << numa_nodes_.size() << ", physical cores: " << num_cores_
     << ", hardware threads: " << num_pus_ << ", memory: " << FormatBytes(total_memory_bytes())
     << "\n";
  for (const NumaNode& n : numa_nodes_) {
    os << "  node " << n.os_index << ": " << FormatBytes(n.memory_bytes) << ", cpus";
    // Print runs compactly: 0-15,32-47.
    for (size_t i = 0; i < n.cpus.size();) {
      size_t j = i;
      while (j + 1 < n.cpus.size() && n.cpus[j + 1] == n.cpus[j] + 1)
        ++j;
      os << (i == 0 ? " " : ",") << n.cpus[i];
      if (j > i) os << "-" << n.cpus[j];
      i = j + 1;
    }
    os << "\n";
  }
  os << "PCI devices (GPUs, NVMe, network): ";
  size_t shown = 0;
  for (const PciDevice& d : pci_devices_) {
    if (d.kind == PciKind::kOther) continue;
    if (shown++ == 0) os << "\n";
    char ids[32];
    std::snprintf(ids, sizeof ids, "%04x:%04x", d.vendor_id, d.device_id);
    os << "  " << d.bus_id << "  " << PciKindName(d.kind) << "  [" << ids << "]  numa node "
       << (d.numa_node >= 0 ? std::to_string(d.numa_node) : std::string("unknown"));
    for (const std::string& name : d.os_names)
      os << "  " << name;
    os << "\n";
  }
  if (shown == 0) os << "none found\n";
  return os.str();
}

Result<int> NumaNodeOfPath(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoError(errno, "stat " + path);
  namespace fs = std::filesystem;
  const std::string link =
      "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev));
  std::error_code ec;
  fs::path dir = fs::canonical(link, ec);
  if (ec) return -1;  // not a block device (tmpfs, overlay, network filesystem)
  // Walk up from the block device (or partition) to the first ancestor with numa_node.
  for (; !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
    std::ifstream in(dir / "device" / "numa_node");
    if (!in) in.open(dir / "numa_node");
    int node = -1;
    if (in && (in >> node)) return node < 0 ? -1 : node;
  }
  return -1;
}

bool CpuHasF16c() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & bit_F16C) != 0 && (ecx & bit_AVX) != 0;
#else
  return false;
#endif
}

}  // namespace strata
