// The memory a process may use (core/memory_limit.h), read from fake /proc and
// /sys/fs/cgroup trees: MemAvailable, cgroup v2 (nested limits, "max", the hybrid layout, a
// namespaced root), cgroup v1, missing and malformed files, the rlimits through an injected
// getter, strata.host_budget; and which limit binds for several ranks.
#include "strata/core/memory_limit.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "strata/core/bytes.h"
#include "strata/core/planner.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class MemoryLimitTest : public testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/strata-memlimit-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    root_ = dir;
    opts_.proc_root = root_ + "/proc";
    opts_.cgroup_root = root_ + "/cgroup";
    opts_.soft_rlimit = [](int) { return UINT64_MAX; };
    // 16 GiB available on the machine.
    Write("proc/meminfo", "MemTotal:       33554432 kB\nMemAvailable:   16777216 kB\n");
    Write("proc/self/status", "Name:\ttest\nVmSize:\t 1048576 kB\nVmData:\t  524288 kB\n");
  }
  void TearDown() override { fs::remove_all(root_); }

  void Write(const std::string& rel, const std::string& text) {
    const fs::path p = fs::path(root_) / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  // A cgroup v2 directory under the fake root: memory.max, memory.current (if not empty)
  // and memory.stat's inactive_file.
  void V2(const std::string& cg, const std::string& max, const std::string& current = "",
          uint64_t inactive = 0) {
    Write("cgroup" + cg + "/memory.max", max + "\n");
    if (!current.empty()) Write("cgroup" + cg + "/memory.current", current + "\n");
    Write("cgroup" + cg + "/memory.stat",
          "anon 1\nfile 2\ninactive_file " + std::to_string(inactive) + "\nactive_file 3\n");
  }
  std::vector<MemoryLimit> Read() {
    Result<std::vector<MemoryLimit>> r = ReadMemoryLimits(opts_);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : std::vector<MemoryLimit>{};
  }

  std::string root_;
  MemoryLimitOptions opts_;
};

TEST_F(MemoryLimitTest, MemAvailableAloneWhenNothingElseIsSet) {
  Write("proc/self/cgroup", "0::/user.slice/session-1.scope\n");
  Write("cgroup/cgroup.controllers", "cpu memory\n");
  const std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 1u);
  EXPECT_EQ(limits[0].source, "MemAvailable");
  EXPECT_EQ(limits[0].scope, MemoryScope::kMachine);
  EXPECT_EQ(limits[0].available(), 16 * kGiB);
  EXPECT_EQ(limits[0].ToString(), "MemAvailable");
  EXPECT_EQ(BindingLimit(limits), &limits[0]);
}

TEST_F(MemoryLimitTest, NoMemAvailableIsAnError) {
  Write("proc/meminfo", "MemTotal: 1024 kB\n");
  Result<std::vector<MemoryLimit>> r = ReadMemoryLimits(opts_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("has no MemAvailable line"), std::string::npos);
  fs::remove(fs::path(root_) / "proc/meminfo");
  EXPECT_FALSE(ReadMemoryLimits(opts_).ok());
  EXPECT_TRUE(BindingLimit({}) == nullptr);
}

// The lowest of the cgroup's and its ancestors' limits, each less what its subtree uses
// (less the page cache the kernel reclaims); "max" is none.
TEST_F(MemoryLimitTest, CgroupV2TakesTheTightestLevel) {
  Write("proc/self/cgroup", "0::/user.slice/a/b\n");
  Write("cgroup/cgroup.controllers", "cpu memory\n");
  V2("/user.slice", std::to_string(8 * kGiB), std::to_string(3 * kGiB), 1 * kGiB);
  V2("/user.slice/a", "max", std::to_string(2 * kGiB));
  V2("/user.slice/a/b", std::to_string(16 * kGiB), std::to_string(1 * kGiB));
  std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].source, "cgroup v2 memory.max of /user.slice");
  EXPECT_EQ(limits[1].scope, MemoryScope::kCgroup);
  EXPECT_EQ(limits[1].limit, 8 * kGiB);
  EXPECT_EQ(limits[1].used, 2 * kGiB);  // 3 GiB current less 1 GiB inactive_file
  EXPECT_EQ(limits[1].available(), 6 * kGiB);
  EXPECT_EQ(BindingLimit(limits), &limits[1]);
  EXPECT_EQ(limits[1].ToString(),
            "cgroup v2 memory.max of /user.slice = 8 GiB, 2 GiB of it in use (memory.current "
            "less inactive_file)");

  // The process's own cgroup tighter than its parent's.
  V2("/user.slice/a/b", std::to_string(4 * kGiB), std::to_string(1 * kGiB));
  limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].source, "cgroup v2 memory.max of /user.slice/a/b");
  EXPECT_EQ(limits[1].available(), 3 * kGiB);

  // Above MemAvailable: listed, not binding.
  V2("/user.slice", std::to_string(64 * kGiB), "0");
  V2("/user.slice/a/b", std::to_string(40 * kGiB), "0");
  limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].available(), 40 * kGiB);
  EXPECT_EQ(BindingLimit(limits)->source, "MemAvailable");

  // "max" at every level: no cgroup limit.
  V2("/user.slice", "max", "0");
  V2("/user.slice/a/b", "max", "0");
  EXPECT_EQ(Read().size(), 1u);
}

// A container with its own cgroup namespace: its cgroup is "/", the mount's root, which has
// a memory.max of its own; the hybrid layout puts v2 under unified/.
TEST_F(MemoryLimitTest, CgroupV2AtTheNamespaceRootAndInTheHybridLayout) {
  Write("proc/self/cgroup", "0::/\n");
  Write("cgroup/cgroup.controllers", "memory\n");
  V2("", std::to_string(2 * kGiB), std::to_string(512 * kMiB));
  std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].source, "cgroup v2 memory.max of /");
  EXPECT_EQ(limits[1].available(), 1536 * kMiB);

  fs::remove_all(fs::path(root_) / "cgroup");
  Write("proc/self/cgroup", "1:cpu:/\n0::/job\n");
  Write("cgroup/unified/cgroup.controllers", "memory\n");
  Write("cgroup/unified/job/memory.max", std::to_string(kGiB) + "\n");
  limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].source, "cgroup v2 memory.max of /job");
  EXPECT_EQ(limits[1].used, 0u);  // no memory.current: nothing counted as used
  EXPECT_EQ(limits[1].available(), kGiB);
}

TEST_F(MemoryLimitTest, CgroupV1MemoryController) {
  Write("proc/self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n");
  Write("cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");  // unlimited
  Write("cgroup/memory/docker/memory.limit_in_bytes", "9223372036854771712\n");
  Write("cgroup/memory/docker/abc/memory.limit_in_bytes", std::to_string(4 * kGiB) + "\n");
  Write("cgroup/memory/docker/abc/memory.usage_in_bytes", std::to_string(2 * kGiB) + "\n");
  Write("cgroup/memory/docker/abc/memory.stat",
        "inactive_file 1\ntotal_inactive_file " + std::to_string(kGiB) + "\n");
  std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].source, "cgroup v1 memory.limit_in_bytes of /docker/abc");
  EXPECT_EQ(limits[1].used, kGiB);
  EXPECT_EQ(limits[1].available(), 3 * kGiB);
  EXPECT_EQ(BindingLimit(limits), &limits[1]);

  // Unlimited at every level: none.
  Write("cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(Read().size(), 1u);
}

// A cgroup named but not there, a limit that is not a number, a path outside the mounted
// hierarchy: no limit, no error.
TEST_F(MemoryLimitTest, MissingAndMalformedFilesAreNoLimit) {
  EXPECT_EQ(Read().size(), 1u);  // no /proc/self/cgroup at all
  Write("proc/self/cgroup", "0::/gone\n4:memory:/gone\n");
  Write("cgroup/cgroup.controllers", "memory\n");
  EXPECT_EQ(Read().size(), 1u);
  V2("/gone", "lots", "0");
  EXPECT_EQ(Read().size(), 1u);
  V2("/gone", "", "0");
  EXPECT_EQ(Read().size(), 1u);
  Write("proc/self/cgroup", "0::/../outside\n");
  V2("", std::to_string(kGiB), "0");
  EXPECT_EQ(Read().size(), 1u);
  // A usage that is not a number counts as nothing used.
  fs::remove(fs::path(root_) / "cgroup/memory.max");
  Write("proc/self/cgroup", "0::/gone\n");
  V2("/gone", std::to_string(2 * kGiB), "many");
  std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].available(), 2 * kGiB);
}

// The soft RLIMIT_AS and RLIMIT_DATA less what the process maps (VmSize) and uses (VmData).
TEST_F(MemoryLimitTest, RlimitsLessWhatTheProcessAlreadyUses) {
  opts_.soft_rlimit = [](int resource) {
    return resource == RLIMIT_AS ? 8 * kGiB : resource == RLIMIT_DATA ? 20 * kGiB : UINT64_MAX;
  };
  std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 3u);
  EXPECT_EQ(limits[1].source, "RLIMIT_AS");
  EXPECT_EQ(limits[1].scope, MemoryScope::kProcess);
  EXPECT_EQ(limits[1].used, kGiB);  // VmSize 1048576 kB
  EXPECT_EQ(limits[1].available(), 7 * kGiB);
  EXPECT_EQ(limits[1].raise_by, "raise the soft limit (ulimit -v)");
  EXPECT_EQ(limits[2].source, "RLIMIT_DATA");
  EXPECT_EQ(limits[2].used, 512 * kMiB);
  EXPECT_EQ(BindingLimit(limits)->source, "RLIMIT_AS");
  EXPECT_EQ(limits[1].ToString(), "RLIMIT_AS = 8 GiB, 1 GiB of it in use (VmSize)");

  opts_.soft_rlimit = [](int resource) { return resource == RLIMIT_DATA ? kGiB : UINT64_MAX; };
  limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(BindingLimit(limits)->source, "RLIMIT_DATA");
  EXPECT_EQ(limits[1].available(), 512 * kMiB);
  // Already past it: nothing left.
  Write("proc/self/status", "VmData:\t 2097152 kB\n");
  EXPECT_EQ(Read()[1].available(), 0u);
}

TEST_F(MemoryLimitTest, HostBudgetWhenSet) {
  opts_.host_budget = 4 * kGiB;
  std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 2u);
  EXPECT_EQ(limits[1].source, "strata.host_budget");
  EXPECT_EQ(limits[1].ToString(), "strata.host_budget = 4 GiB");
  EXPECT_EQ(BindingLimit(limits), &limits[1]);
}

// The machine's and a cgroup's memory are shared by the node's ranks; a process's own limit
// is each rank's: which one binds depends on how many ranks there are.
TEST_F(MemoryLimitTest, TheBindingLimitDependsOnTheRanks) {
  Write("proc/self/cgroup", "0::/job\n");
  Write("cgroup/cgroup.controllers", "memory\n");
  V2("/job", std::to_string(12 * kGiB), "0");
  opts_.soft_rlimit = [](int resource) { return resource == RLIMIT_AS ? 5 * kGiB : UINT64_MAX; };
  const std::vector<MemoryLimit> limits = Read();
  ASSERT_EQ(limits.size(), 3u);
  EXPECT_EQ(BindingLimit(limits, 1)->source, "RLIMIT_AS");  // 4 GiB left of 5
  EXPECT_EQ(BindingLimit(limits, 2)->source, "RLIMIT_AS");  // the cgroup's 6 GiB each
  EXPECT_EQ(BindingLimit(limits, 4)->source, "cgroup v2 memory.max of /job");  // 3 GiB each
  EXPECT_EQ(limits[1].PerRank(4), 3 * kGiB);
  EXPECT_EQ(limits[0].PerRank(4), 4 * kGiB);
  EXPECT_EQ(limits[2].PerRank(4), 4 * kGiB);
}

// ReadMachineFacts carries the limits to the planner's check: MemAvailable apart (as
// before), the others in host_limits; strata.host_budget is the config's, not read here.
TEST_F(MemoryLimitTest, MachineFactsCarryTheLimits) {
  Write("proc/self/cgroup", "0::/job\n");
  Write("cgroup/cgroup.controllers", "memory\n");
  V2("/job", std::to_string(4 * kGiB), std::to_string(kGiB));
  opts_.soft_rlimit = [](int resource) { return resource == RLIMIT_DATA ? 8 * kGiB : UINT64_MAX; };
  opts_.host_budget = kGiB;
  Result<MachineFacts> m = ReadMachineFacts({}, opts_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->host_available_bytes, 16 * kGiB);
  ASSERT_EQ(m->host_limits.size(), 2u);
  EXPECT_EQ(m->host_limits[0].source, "cgroup v2 memory.max of /job");
  EXPECT_EQ(m->host_limits[0].available(), 3 * kGiB);
  EXPECT_EQ(m->host_limits[1].source, "RLIMIT_DATA");
  // A 4 GiB plan fits MemAvailable but not the cgroup.
  Config c;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  Result<Plan> p = MakePlan(c, {.params = 250000000, .world_size = 1});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_GT(p->host_bytes(), 3 * kGiB);
  ASSERT_LT(p->host_bytes(), 16 * kGiB);
  Status s = CheckPlan(*p, c, *m);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("its cgroup leaves 3 GiB (cgroup v2 memory.max of /job = 4 GiB"),
            std::string::npos)
      << s;
  fs::remove(fs::path(root_) / "proc/meminfo");
  m = ReadMachineFacts({}, opts_);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("plan: "), std::string::npos) << m.status();
}

TEST(MemoryLimitMachineTest, ReadsThisMachine) {
  Result<std::vector<MemoryLimit>> r = ReadMemoryLimits();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_FALSE(r->empty());
  EXPECT_EQ((*r)[0].source, "MemAvailable");
  EXPECT_GT((*r)[0].available(), 0u);
  const MemoryLimit* binding = BindingLimit(*r);
  ASSERT_NE(binding, nullptr);
  EXPECT_LE(binding->available(), (*r)[0].available());
}

}  // namespace
}  // namespace strata
