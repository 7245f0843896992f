// Hardware topology through hwloc, checked against what the kernel says directly.
#include "strata/core/topology.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <fstream>
#include <set>
#include <string>

namespace strata {
namespace {

class TopologyTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = Topology::Discover();
    ASSERT_TRUE(t.ok()) << t.status();
    topo_ = new Topology(std::move(t).value());
  }
  void SetUp() override { ASSERT_NE(topo_, nullptr) << "Topology::Discover failed"; }
  static void TearDownTestSuite() {
    delete topo_;
    topo_ = nullptr;
  }
  static Topology* topo_;
};
Topology* TopologyTest::topo_ = nullptr;

std::set<int> AffinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::set<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.insert(c);
  }
  return cpus;
}

// The memory limit of this process's cgroup (v2 or v1), or 0 when unlimited/unknown.
uint64_t CgroupMemoryLimit() {
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    std::string v;
    if (in >> v && v != "max") {
      try {
        const uint64_t limit = std::stoull(v);
        if (limit < (uint64_t{1} << 60)) return limit;
      } catch (...) {
      }
    }
  }
  return 0;
}

TEST_F(TopologyTest, HasNumaNodesWithCpusAndMemory) {
  ASSERT_FALSE(topo_->numa_nodes().empty());
  std::set<int> indexes;
  for (const NumaNode& n : topo_->numa_nodes()) {
    EXPECT_GE(n.os_index, 0);
    EXPECT_TRUE(indexes.insert(n.os_index).second) << "node " << n.os_index << " twice";
    EXPECT_GT(n.memory_bytes, 0u) << "node " << n.os_index;
    EXPECT_TRUE(topo_->HasNumaNode(n.os_index));
  }
  EXPECT_FALSE(topo_->HasNumaNode(-1));
  EXPECT_FALSE(topo_->HasNumaNode(100000));
  EXPECT_GT(topo_->num_pus(), 0);
  EXPECT_GT(topo_->num_cores(), 0);
  EXPECT_LE(topo_->num_cores(), topo_->num_pus());
}

TEST_F(TopologyTest, NodeCpusAreTheCpusThisProcessMayUse) {
  std::set<int> from_nodes;
  for (const NumaNode& n : topo_->numa_nodes()) {
    for (int c : n.cpus) {
      EXPECT_TRUE(from_nodes.insert(c).second) << "cpu " << c << " in two nodes";
    }
  }
  const std::set<int> affinity = AffinityCpus();
  ASSERT_FALSE(affinity.empty());
  // hwloc restricts to the CPUs allowed by the cgroup; the affinity mask may be narrower
  // (taskset), never wider.
  for (int c : affinity) {
    EXPECT_TRUE(from_nodes.count(c)) << "cpu " << c << " is usable but in no NUMA node";
  }
  EXPECT_EQ(from_nodes.size(), static_cast<size_t>(topo_->num_pus()));
  EXPECT_GE(from_nodes.size(), affinity.size());
}

// MemTotal of one node as the kernel reports it in sysfs, or 0.
uint64_t SysfsNodeMemory(int node) {
  std::ifstream in("/sys/devices/system/node/node" + std::to_string(node) + "/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("MemTotal:");
    if (at == std::string::npos) continue;
    return std::stoull(line.substr(at + 9)) * 1024;  // "Node 0 MemTotal:  5597388 kB"
  }
  return 0;
}

TEST_F(TopologyTest, TotalMemoryMatchesTheKernel) {
  const uint64_t total = topo_->total_memory_bytes();
  ASSERT_GT(total, 0u);
  uint64_t sum = 0, sysfs_sum = 0;
  bool have_sysfs = true;
  for (const NumaNode& n : topo_->numa_nodes()) {
    sum += n.memory_bytes;
    const uint64_t kernel = SysfsNodeMemory(n.os_index);
    have_sysfs &= kernel > 0;
    sysfs_sum += kernel;
    if (kernel > 0) {
      // hwloc reads the same file; allow for memory coming and going in between.
      EXPECT_NEAR(static_cast<double>(n.memory_bytes), static_cast<double>(kernel),
                  0.05 * static_cast<double>(kernel))
          << "node " << n.os_index;
    }
  }
  EXPECT_EQ(total, sum);
  const uint64_t phys =
      static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t cgroup = CgroupMemoryLimit();
  if (cgroup != 0 && cgroup < phys) {
    GTEST_SKIP() << "memory is limited by the cgroup to " << cgroup << " bytes; hwloc says "
                 << total;
  }
  if (have_sysfs && (static_cast<double>(sysfs_sum) < 0.9 * static_cast<double>(phys) ||
                     static_cast<double>(sysfs_sum) > 1.1 * static_cast<double>(phys))) {
    // Seen in a Firecracker VM: the nodes' MemTotal in sysfs (what hwloc reports) is
    // far from sysinfo()'s total RAM. hwloc agrees with the per-node numbers (above).
    GTEST_SKIP() << "the kernel's per-node memory (" << sysfs_sum
                 << " bytes) disagrees with its total RAM (" << phys << " bytes)";
  }
  EXPECT_GE(static_cast<double>(total), 0.9 * static_cast<double>(phys))
      << "hwloc " << total << " vs sysconf " << phys;
  EXPECT_LE(static_cast<double>(total), 1.1 * static_cast<double>(phys))
      << "hwloc " << total << " vs sysconf " << phys;
}

TEST_F(TopologyTest, NumaNodeOfCpu) {
  const std::set<int> affinity = AffinityCpus();
  ASSERT_FALSE(affinity.empty());
  const int cpu = *affinity.begin();
  const int node = topo_->NumaNodeOfCpu(cpu);
  EXPECT_GE(node, 0);
  EXPECT_TRUE(topo_->HasNumaNode(node));
  bool found = false;
  for (const NumaNode& n : topo_->numa_nodes()) {
    if (n.os_index != node) continue;
    for (int c : n.cpus)
      found |= c == cpu;
  }
  EXPECT_TRUE(found);
  if (affinity.count(0)) {
    EXPECT_GE(topo_->NumaNodeOfCpu(0), 0);
  }
  EXPECT_EQ(topo_->NumaNodeOfCpu(-1), -1);
  EXPECT_EQ(topo_->NumaNodeOfCpu(1 << 20), -1);
}

TEST_F(TopologyTest, NumaNodeOfPci) {
  EXPECT_EQ(topo_->NumaNodeOfPci("ffff:ff:1f.7"), -1);
  EXPECT_EQ(topo_->NumaNodeOfPci("ff:1f.7"), -1);
  EXPECT_EQ(topo_->NumaNodeOfPci(""), -1);
  EXPECT_EQ(topo_->NumaNodeOfPci("garbage"), -1);
  for (const PciDevice& d : topo_->pci_devices()) {
    ASSERT_EQ(d.bus_id.size(), 12u) << d.bus_id;
    EXPECT_EQ(topo_->NumaNodeOfPci(d.bus_id), d.numa_node) << d.bus_id;
    // Without the domain, and in capitals, it is the same device (when unambiguous).
    std::string upper = d.bus_id;
    for (char& ch : upper)
      ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    EXPECT_EQ(topo_->NumaNodeOfPci(upper), d.numa_node) << upper;
    EXPECT_EQ(topo_->NumaNodeOfPci("0000" + upper), d.numa_node) << "nvidia-smi form";
    if (d.bus_id.rfind("0000:", 0) == 0) {
      EXPECT_EQ(topo_->NumaNodeOfPci(d.bus_id.substr(5)), d.numa_node) << d.bus_id;
    }
    if (d.numa_node >= 0) {
      EXPECT_TRUE(topo_->HasNumaNode(d.numa_node)) << d.bus_id;
    }
    EXPECT_FALSE(PciKindName(d.kind).empty());
  }
}

TEST_F(TopologyTest, ToStringSummarizes) {
  const std::string s = topo_->ToString();
  EXPECT_EQ(s.rfind("NUMA nodes: " + std::to_string(topo_->numa_nodes().size()), 0), 0u) << s;
  EXPECT_NE(s.find("hardware threads: " + std::to_string(topo_->num_pus())), std::string::npos);
  for (const NumaNode& n : topo_->numa_nodes()) {
    EXPECT_NE(s.find("  node " + std::to_string(n.os_index) + ": "), std::string::npos) << s;
  }
  EXPECT_NE(s.find("PCI devices (GPUs, NVMe, network): "), std::string::npos);
  EXPECT_EQ(s.back(), '\n');
}

TEST(PciKindTest, Names) {
  EXPECT_EQ(PciKindName(PciKind::kGpu), "gpu");
  EXPECT_EQ(PciKindName(PciKind::kNvme), "nvme");
  EXPECT_EQ(PciKindName(PciKind::kNetwork), "network");
  EXPECT_EQ(PciKindName(PciKind::kOther), "other");
}

TEST(NumaNodeOfPathTest, ExistingPaths) {
  for (const char* path : {"/", "/proc", "/tmp"}) {
    Result<int> node = NumaNodeOfPath(path);
    ASSERT_TRUE(node.ok()) << path << ": " << node.status();
    EXPECT_GE(*node, -1) << path;
  }
}

TEST(NumaNodeOfPathTest, MissingPathIsNotFound) {
  Result<int> node = NumaNodeOfPath("/no/such/strata/path");
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), StatusCode::kNotFound);
  EXPECT_NE(node.status().message().find("/no/such/strata/path"), std::string::npos);
  EXPECT_EQ(node.status().errno_value(), ENOENT);
}

}  // namespace
}  // namespace strata
