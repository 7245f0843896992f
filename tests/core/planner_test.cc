// The tier planner (core/planner.h): the plan's numbers for a known config, and each
// refusal of CheckPlan with its numbers, against machine facts the test makes up.
#include "strata/core/planner.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include "strata/core/bytes.h"

namespace strata {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// 1e9 parameters on 4 ranks in bf16: the optimizer on NVMe over two paths (12 pinned
// buffers of 1e7-element sub-groups), the parameters on NVMe (5 buffers of the largest
// group's shard, none kept in host), 4 GB/s reads, 2 GB/s writes.
Config InfinityConfig() {
  Config c;
  c.bf16 = true;
  c.zero.sub_group_size = 10000000;
  c.zero.reduce_bucket_size = 50000000;
  c.zero.overlap_comm = true;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {"/a", "/b"};
  c.zero.offload_optimizer.buffer_count = 12;
  c.zero.offload_optimizer.pin_memory = true;
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = {"/a"};
  c.zero.offload_param.buffer_count = 5;
  c.zero.offload_param.max_in_cpu = 0;
  c.strata.nvme_read_bandwidth = 4e9;
  c.strata.nvme_write_bandwidth = 2e9;
  return c;
}

uint64_t Blocks(uint64_t bytes) {
  return (bytes + 4095) / 4096 * 4096;
}

TEST(PlannerTest, ZeroInfinityNumbersPerRank) {
  Result<Plan> p = MakePlan(
      InfinityConfig(),
      {.params = 1000000000, .world_size = 4, .largest_group = 200000000, .adam_rate = 1e9});
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t n = 250000000;
  EXPECT_EQ(p->rank_elems, n);
  EXPECT_EQ(p->dtype, "bf16");
  ASSERT_EQ(p->rows.size(), 5u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(p->rows[static_cast<size_t>(i)].tier, PlanTier::kNvme);
    EXPECT_EQ(p->rows[static_cast<size_t>(i)].bytes, 4 * n);
  }
  EXPECT_EQ(p->rows[4].state, "working shards (bf16)");
  EXPECT_EQ(p->rows[4].bytes, 2 * n);
  // Host: 12 optimizer buffers of one 1e7-element fp32 sub-group, 5 parameter buffers of the
  // largest group's shard (5e7 bf16 elements), two reduced-gradient staging buffers of a
  // bucket's shard (a bucket holds at least the largest group, 2e8: 5e7 bf16), and three
  // staging buffers for the pipelined step's new shards (two, and the one measured beside
  // them), all pinned (one host pool: the optimizer's pin_memory pins it).
  EXPECT_EQ(p->optimizer_buffer_bytes, Blocks(40000000));
  EXPECT_EQ(p->param_buffer_bytes, Blocks(100000000));
  EXPECT_EQ(p->param_staging_buffers, 3);
  EXPECT_EQ(p->param_staging_bytes, Blocks(100000000));
  EXPECT_EQ(p->host_pinned_bytes, 12 * Blocks(40000000) + 5 * Blocks(100000000) +
                                      3 * Blocks(100000000) + 2 * 50000000 * 2);
  EXPECT_EQ(p->host_unpinned_bytes, 0u);
  // Swap: the optimizer's 25 sub-groups x 4 states x 2 slots over /a and /b; the
  // parameters' 2 slots of 5e8 bytes on /a.
  const uint64_t opt_swap = 2 * 4 * 25 * Blocks(40000000);
  ASSERT_EQ(p->nvme_bytes.size(), 2u);
  EXPECT_EQ(p->nvme_bytes[0].first, "/a");
  EXPECT_EQ(p->nvme_bytes[0].second, opt_swap / 2 + 2 * 2 * n);
  EXPECT_EQ(p->nvme_bytes[1].first, "/b");
  EXPECT_EQ(p->nvme_bytes[1].second, opt_swap / 2);
  // A step reads 16n (optimizer) + 2 x 2n (shards, forward and backward) and writes
  // 12n (master, m, v) + 4n (the accumulators the backward evicts: 16n do not fit the
  // buffers) + 2n (shards).
  EXPECT_EQ(p->nvme_read_bytes, 20 * n);
  EXPECT_EQ(p->nvme_write_bytes, 18 * n);
  EXPECT_DOUBLE_EQ(p->io_s, 20.0 * n / 4e9 + 18.0 * n / 2e9);
  EXPECT_DOUBLE_EQ(p->adam_s, 0.25);
  EXPECT_DOUBLE_EQ(p->step_bound_s, p->io_s);
  // Device: up to stage3_max_live_parameters gathered (its default 1e9: the whole model),
  // two buckets of the largest group (the config's 5e7 is smaller), their park (a
  // sixteenth of a bucket) and each bucket's reduce-scatter output (a quarter), in bf16.
  EXPECT_EQ(p->device_bytes, 0u);
  EXPECT_EQ(p->device_working_bytes,
            1000000000u * 2 + (2 * 200000000 + 12500000 + 2 * 50000000) * 2);
  const std::string text = p->ToString();
  EXPECT_NE(text.find("nvme /a: "), std::string::npos) << text;
  EXPECT_NE(text.find("step bound: "), std::string::npos) << text;
}

// A LoRA model: 9e8 of 1e9 parameters frozen. The optimizer's rows (and its NVMe traffic
// and the CPU-Adam bound) cover the 1e8 trainable ones; the working shards every one.
TEST(PlannerTest, FrozenParametersHaveNoOptimizerState) {
  Result<Plan> p = MakePlan(InfinityConfig(), {.params = 1000000000,
                                               .frozen_params = 900000000,
                                               .world_size = 4,
                                               .largest_group = 200000000,
                                               .adam_rate = 1e9});
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t n = 250000000, nt = 25000000;
  EXPECT_EQ(p->trainable_rank_elems, nt);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(p->rows[static_cast<size_t>(i)].bytes, 4 * nt);
  EXPECT_EQ(p->rows[4].bytes, 2 * n);
  EXPECT_DOUBLE_EQ(p->adam_s, 0.025);
  EXPECT_EQ(p->nvme_read_bytes, 16 * nt + 4 * n);
  EXPECT_NE(p->ToString().find("900000000 frozen"), std::string::npos) << p->ToString();
  EXPECT_FALSE(
      MakePlan(InfinityConfig(), {.params = 10, .frozen_params = 11, .world_size = 1}).ok());
}

TEST(PlannerTest, HostPlacementsAndMaxInCpu) {
  Config c;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;  // fp32, unpinned
  c.zero.offload_param.device = OffloadDevice::kNone;     // the pinned host mirror
  Result<Plan> p = MakePlan(c, {.params = 1000, .world_size = 1});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->dtype, "fp32");
  EXPECT_EQ(p->device_bytes, 4000u);  // the working shards
  // One host pool, pinned for the mirror: the states, the mirror, two staging buckets.
  EXPECT_EQ(p->host_pinned_bytes, 16000u + 4000u + 2 * 1000 * 4);
  EXPECT_EQ(p->host_unpinned_bytes, 0u);
  EXPECT_EQ(p->io_s, 0.0);
  EXPECT_EQ(p->step_bound_s, 0.0);  // no Adam rate given
  Config k = InfinityConfig();
  k.zero.offload_param.max_in_cpu = 400000000;  // 1e8 per rank kept in host
  p = MakePlan(k, {.params = 1000000000, .world_size = 4});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->rows.size(), 6u);
  EXPECT_EQ(p->rows[4].bytes, 2 * 150000000u);
  EXPECT_EQ(p->rows[5].tier, PlanTier::kHost);
  EXPECT_EQ(p->rows[5].bytes, 2 * 100000000u);
  EXPECT_EQ(p->nvme_read_bytes, uint64_t{16} * 250000000 + uint64_t{2} * 2 * 150000000);
  EXPECT_FALSE(MakePlan(k, {.params = 0}).ok());
  k.zero.stage = 0;
  EXPECT_FALSE(MakePlan(k, {.params = 10}).ok());
  // Stages 1 and 2 keep every parameter gathered on the device instead of two groups.
  Config three;
  three.zero.offload_optimizer.device = OffloadDevice::kCpu;
  three.zero.stage3_max_live_parameters = 2000;  // stage 3: two groups gathered
  three.zero.reduce_scatter = false;             // stage 1 never reduce-scatters: the same buckets
  const PlanInput in{.params = 1000000, .world_size = 2, .largest_group = 1000};
  Result<Plan> p3 = MakePlan(three, in);
  ASSERT_TRUE(p3.ok()) << p3.status();
  for (int stage : {1, 2}) {
    Config staged = three;
    staged.zero.stage = stage;
    Result<Plan> ps = MakePlan(staged, in);
    ASSERT_TRUE(ps.ok()) << ps.status();
    EXPECT_EQ(ps->device_working_bytes - p3->device_working_bytes, (1000000u - 2 * 1000u) * 4);
    EXPECT_EQ(ps->host_bytes(), p3->host_bytes());
    EXPECT_NE(ps->ToString().find("stage " + std::to_string(stage) + " (every parameter kept"),
              std::string::npos)
        << ps->ToString();
  }
}

MachineFacts Roomy() {
  MachineFacts m;
  m.host_available_bytes = 1000 * kGiB;
  m.memlock_limit = UINT64_MAX;
  m.free_disk = {{"/a", 1000 * kGiB}, {"/b", 1000 * kGiB}};
  return m;
}

// A limit on the process's memory as ReadMemoryLimits reports one.
MemoryLimit Limit(const char* source, MemoryScope scope, uint64_t limit, uint64_t used,
                  const char* used_by, const char* raise_by) {
  return {.source = source,
          .scope = scope,
          .limit = limit,
          .used = used,
          .used_by = used_by,
          .raise_by = raise_by};
}

// The limits' arithmetic without strata.memory_reserve (TheReserveIsLeftOutOfTheRoom has it).
Config NoReserve(Config c) {
  c.strata.memory_reserve = 0;
  return c;
}

TEST(PlannerTest, EachRefusalNamesTheLimitAndTheNumbers) {
  const Config c = NoReserve(InfinityConfig());
  Result<Plan> p = MakePlan(c, {.params = 1000000000, .world_size = 4, .largest_group = 200000000});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(CheckPlan(*p, c, Roomy()).ok());
  const std::string host = FormatBytes(p->host_bytes());
  const std::string node = FormatBytes(4 * p->host_bytes());  // 4 ranks on one machine

  MachineFacts m = Roomy();
  m.host_available_bytes = 512 << 20;
  Status s = CheckPlan(*p, c, m);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("host memory: the plan needs " + node + " (" + host +
                             " per rank x 4 ranks on this machine"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("512 MiB available (MemAvailable)"), std::string::npos) << s;

  m = Roomy();
  m.memlock_limit = 64 << 10;
  s = CheckPlan(*p, c, m);
  EXPECT_NE(s.message().find("RLIMIT_MEMLOCK: the plan pins " + host), std::string::npos) << s;
  EXPECT_NE(s.message().find("the limit is 64 KiB"), std::string::npos) << s;
  Config unpinned = c;
  unpinned.strata.allow_unpinned = true;
  EXPECT_TRUE(CheckPlan(*p, unpinned, m).ok());

  m = Roomy();
  m.free_disk["/b"] = 10 * kGiB;  // the 4 ranks need 4 x the per-rank swap
  s = CheckPlan(*p, c, m);
  EXPECT_NE(
      s.message().find("nvme_path /b: the plan needs " + FormatBytes(4 * p->nvme_bytes[1].second)),
      std::string::npos)
      << s;
  EXPECT_NE(s.message().find("10 GiB is free"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("nvme_path /a"), std::string::npos) << s;

  m = Roomy();
  m.free_disk.erase("/a");
  m.disk_errors["/a"] = "No such file or directory";
  s = CheckPlan(*p, c, m);
  EXPECT_NE(s.message().find("nvme_path /a: No such file or directory"), std::string::npos) << s;
  EXPECT_TRUE(CheckPlan(*p, c, m, {.unusable_paths = false}).ok());  // left to the swap space

  Config budget = c;
  budget.strata.device_budget = 512 << 20;
  s = CheckPlan(*p, budget, Roomy());
  EXPECT_NE(s.message().find("strata.device_budget = 512 MiB is below the plan's " +
                             FormatBytes(p->device_working_bytes)),
            std::string::npos)
      << s;
  budget = c;
  budget.strata.host_budget = 512 << 20;
  s = CheckPlan(*p, budget, Roomy());
  EXPECT_NE(s.message().find("strata.host_budget = 512 MiB is below the plan's " + host),
            std::string::npos)
      << s;

  // Two ranks per machine: half the host memory and swap of four.
  Result<Plan> two = MakePlan(
      c, {.params = 1000000000, .world_size = 4, .ranks_per_node = 2, .largest_group = 200000000});
  ASSERT_TRUE(two.ok()) << two.status();
  m = Roomy();
  m.host_available_bytes = 3 * p->host_bytes();  // holds 2 ranks, not 4
  m.free_disk["/b"] = 3 * p->nvme_bytes[1].second;
  EXPECT_FALSE(CheckPlan(*p, c, m).ok());
  EXPECT_TRUE(CheckPlan(*two, c, m).ok()) << CheckPlan(*two, c, m);
  // The budgets can be left to the engine.
  budget = c;
  budget.strata.host_budget = 1;
  budget.strata.device_budget = 1;
  EXPECT_TRUE(CheckPlan(*p, budget, Roomy(), {.device_budget = false, .host_budget = false}).ok());

  // Several at once: every one is listed.
  m = Roomy();
  m.free_disk.erase("/a");
  m.disk_errors["/a"] = "No such file or directory";
  m.host_available_bytes = 1;
  m.memlock_limit = 1;
  s = CheckPlan(*p, c, m);
  EXPECT_NE(s.message().find("host memory"), std::string::npos) << s;
  EXPECT_NE(s.message().find("RLIMIT_MEMLOCK"), std::string::npos) << s;
  EXPECT_NE(s.message().find("nvme_path /a"), std::string::npos) << s;
}

// strata.memory_reserve (what the engine's buffers do not hold) is left out of the room: a
// plan that fits the limit alone is refused when it does not fit beside the reserve, and the
// refusal says the reserve.
TEST(PlannerTest, TheReserveIsLeftOutOfTheRoom) {
  Config c = InfinityConfig();
  Result<Plan> p = MakePlan(c, {.params = 1000000000, .world_size = 1, .largest_group = 200000000});
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t host = p->memory_bytes();
  MachineFacts m = Roomy();
  m.host_limits = {Limit("RLIMIT_AS", MemoryScope::kProcess,
                         host + 100 * (uint64_t{1} << 20) + kGiB, kGiB, "VmSize",
                         "raise the soft limit (ulimit -v)")};
  EXPECT_EQ(c.strata.memory_reserve, uint64_t{256} << 20);  // the default
  const Status s = CheckPlan(*p, c, m);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("with strata.memory_reserve's 256 MiB) but this process may use " +
                             FormatBytes(host + 100 * (uint64_t{1} << 20)) + " more"),
            std::string::npos)
      << s;
  c.strata.memory_reserve = 64 << 20;  // a reserve that fits beside it
  EXPECT_TRUE(CheckPlan(*p, c, m).ok()) << CheckPlan(*p, c, m);
}

// The process's own limits beside MemAvailable: a cgroup's is shared by the node's ranks, an
// rlimit is each rank's; the refusal names the one that binds, its source and numbers.
TEST(PlannerTest, HostMemoryAgainstTheLimitThatBinds) {
  const Config c = NoReserve(InfinityConfig());
  Result<Plan> p = MakePlan(c, {.params = 1000000000, .world_size = 4, .largest_group = 200000000});
  ASSERT_TRUE(p.ok()) << p.status();
  const uint64_t host = p->host_bytes();
  const MemoryLimit cgroup =
      Limit("cgroup v2 memory.max of /job", MemoryScope::kCgroup, 3 * host + kGiB, kGiB,
            "memory.current less inactive_file", "raise the cgroup's limit");
  MachineFacts m = Roomy();
  m.host_limits = {cgroup};
  // 3 x a rank's host bytes left in the cgroup: the 4 ranks in it do not fit, 3 would.
  Status s = CheckPlan(*p, c, m);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("host memory: the plan needs " + FormatBytes(4 * host) + " (" +
                             FormatBytes(host) +
                             " per rank x 4 ranks on this machine, in one "
                             "cgroup, "),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("but its cgroup leaves " + FormatBytes(3 * host) +
                             " (cgroup v2 memory.max of /job = " + FormatBytes(3 * host + kGiB) +
                             ", 1 GiB of it in use (memory.current less inactive_file))"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("lower zero_optimization.sub_group_size"), std::string::npos) << s;
  EXPECT_NE(s.message().find("or raise the cgroup's limit"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("MemAvailable"), std::string::npos) << s;
  Result<Plan> three = MakePlan(
      c, {.params = 1000000000, .world_size = 4, .ranks_per_node = 3, .largest_group = 200000000});
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_TRUE(CheckPlan(*three, c, m).ok()) << CheckPlan(*three, c, m);
  EXPECT_EQ(BindingHostLimit(*p, c, m).source, "cgroup v2 memory.max of /job");

  // An rlimit is each rank's: two ranks' worth of room holds a rank, whatever the ranks.
  const MemoryLimit rlimit = Limit("RLIMIT_AS", MemoryScope::kProcess, 2 * host + kGiB, kGiB,
                                   "VmSize", "raise the soft limit (ulimit -v)");
  m.host_limits = {rlimit};
  EXPECT_TRUE(CheckPlan(*p, c, m).ok()) << CheckPlan(*p, c, m);
  m.host_limits[0].limit = host - 1 + kGiB;
  s = CheckPlan(*p, c, m);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("host memory: the plan needs " + FormatBytes(host) + " per rank (" +
                             FormatBytes(p->host_pinned_bytes) +
                             " pinned) but this process may "
                             "use " +
                             FormatBytes(host - 1) + " more (RLIMIT_AS = "),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("or raise the soft limit (ulimit -v)"), std::string::npos) << s;
  // MemAvailable exceeded too, half a rank's each: it binds, the rlimit is named after it.
  m.host_available_bytes = 2 * host;
  s = CheckPlan(*p, c, m);
  EXPECT_NE(s.message().find("but the machine has " + FormatBytes(2 * host) +
                             " available (MemAvailable), and RLIMIT_AS (" + FormatBytes(host - 1) +
                             " left) is exceeded too;"),
            std::string::npos)
      << s;
  EXPECT_EQ(BindingHostLimit(*p, c, m).source, "MemAvailable");

  // strata.host_budget binds when it is the lowest; the check keeps its own line for it.
  Config budget = c;
  budget.strata.host_budget = host / 2;
  EXPECT_EQ(BindingHostLimit(*p, budget, Roomy()).source, "strata.host_budget");
  EXPECT_EQ(BindingHostLimit(*p, budget, Roomy(), {.host_budget = false}).source, "MemAvailable");
  EXPECT_EQ(HostLimits(budget, Roomy()).size(), 2u);
}

// --suggest: host first, then the optimizer on NVMe, then the parameters; the snippet
// sets the placement; no nvme_path, or nothing that fits, says so.
TEST(PlannerTest, SuggestTakesTheCheapestPlacementThatFits) {
  Config c;
  c.bf16 = true;
  c.zero.offload_optimizer.nvme_path = {"/a"};
  c.zero.reduce_bucket_size = 100000000;  // the largest group's (the default's would be 5x)
  const PlanInput in{.params = 1000000000, .world_size = 1, .largest_group = 100000000};
  MachineFacts m = Roomy();
  Result<Suggestion> s = SuggestPlan(c, in, m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->config.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(s->config.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_TRUE(s->tried.empty());
  // 16 GB of fp32 states do not fit 10 GiB; on NVMe (12 buffers of a 1e9 sub-group would
  // be 48 GB: the sub-group is the config's) they do with sub-groups of 1e7.
  m.host_available_bytes = 10 * kGiB;
  c.zero.sub_group_size = 10000000;
  s = SuggestPlan(c, in, m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->config.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(s->config.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_NE(s->snippet.find("\"device\": \"nvme\""), std::string::npos) << s->snippet;
  EXPECT_NE(s->snippet.find("\"/a\""), std::string::npos) << s->snippet;
  EXPECT_NE(s->tried.find("optimizer in host memory, parameters on the device: "),
            std::string::npos)
      << s->tried;
  // Too little host memory even for the buffers of both: parameters on NVMe too.
  m.host_available_bytes = 2 * kGiB;
  s = SuggestPlan(c, in, m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->config.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_NE(s->snippet.find("\"max_in_cpu\": 0"), std::string::npos) << s->snippet;
  // Nothing fits: every placement's reason.
  m.host_available_bytes = 1000;
  s = SuggestPlan(c, in, m);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("optimizer and parameters on NVMe: "), std::string::npos)
      << s.status();
  // NVMe needed, no path named.
  c.zero.offload_optimizer.nvme_path.clear();
  m.host_available_bytes = 10 * kGiB;
  s = SuggestPlan(c, in, m);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("names no nvme_path"), std::string::npos) << s.status();
}

// A config that leaves the sizes at DeepSpeed's defaults is planned with the sizes the
// engine chooses from the model (core/sizing.h), and the plan says so.
TEST(PlannerTest, DefaultSizesArePlannedAsTheEngineSizesThem) {
  Config c;
  c.bf16 = true;
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {"/a"};
  const PlanInput in{.params = 1000000000, .world_size = 1, .largest_group = 20000000};
  Result<Plan> p = MakePlan(c, in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->sized.size(), 2u);
  EXPECT_EQ(p->sized[0].to, 62500000);  // reduce_bucket_size: a sixteenth of 1e9
  EXPECT_EQ(p->sized[1].to, 62500000);  // sub_group_size: a sixteenth of the partition
  EXPECT_NE(p->ToString().find("sized from the model: zero_optimization.sub_group_size "
                               "1000000000 -> 62500000"),
            std::string::npos)
      << p->ToString();
  // The same config with the keys written out keeps DeepSpeed's sizes, and needs more.
  Config given = c;
  given.given = {"zero_optimization.sub_group_size", "zero_optimization.reduce_bucket_size"};
  Result<Plan> q = MakePlan(given, in);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->sized.empty());
  EXPECT_GT(q->host_bytes(), p->host_bytes() + 8 * uint64_t{1000000000});
}

// The issue's case: DeepSpeed's default sub-group (1e9 elements) with 12 pipelined NVMe
// buffers is 48 GB of host memory. --suggest lowers sub_group_size within the placement
// until the binding limit (here a cgroup's) holds it, says so, and never raises a count.
TEST(PlannerTest, SuggestLowersSizesBeforeItMovesATier) {
  Config c;
  // Set in the document (at DeepSpeed's defaults), so not sized from the model.
  c.given = {"zero_optimization.sub_group_size", "zero_optimization.reduce_bucket_size"};
  c.bf16 = true;
  c.zero.offload_optimizer.nvme_path = {"/a"};
  c.zero.offload_optimizer.buffer_count = 12;
  const PlanInput in{.params = 1000000000, .world_size = 1, .largest_group = 100000000};
  MachineFacts m = Roomy();
  m.host_limits = {Limit("cgroup v2 memory.max of /job", MemoryScope::kCgroup, 10 * kGiB, 0,
                         "memory.current less inactive_file", "raise the cgroup's limit")};
  Result<Suggestion> s = SuggestPlan(c, in, m);
  ASSERT_TRUE(s.ok()) << s.status();
  const Config& got = s->config;
  EXPECT_EQ(got.zero.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(got.zero.offload_param.device, OffloadDevice::kCpu);
  // 12 x 4 x 1e8 + 2e9 of shards + 2e9 of staged buckets: the first sub-group that fits.
  EXPECT_EQ(got.zero.sub_group_size, 100000000);
  EXPECT_EQ(got.zero.offload_optimizer.buffer_count, 12);
  EXPECT_TRUE(got.zero.offload_optimizer.pipeline_read);  // 12 buffers hold the pipeline
  EXPECT_LE(s->plan.host_bytes(), 10 * kGiB);
  EXPECT_NE(s->lowered.find("lowered zero_optimization.sub_group_size 1000000000 -> 100000000: "
                            "the placement needed " +
                            FormatBytes(12 * Blocks(4000000000) + 4000000000) +
                            " of host memory per rank with the config's, " +
                            FormatBytes(s->plan.host_bytes()) +
                            " with these, and 10 GiB is available per rank (cgroup v2 "
                            "memory.max of /job = 10 GiB"),
            std::string::npos)
      << s->lowered;
  EXPECT_NE(s->lowered.find("zero_optimization.sub_group_size: the optimizer's NVMe buffers"),
            std::string::npos)
      << s->lowered;
  EXPECT_NE(s->snippet.find("\"sub_group_size\": 100000000"), std::string::npos) << s->snippet;
  EXPECT_EQ(s->snippet.find("reduce_bucket_size"), std::string::npos) << s->snippet;
  // The placements before it tried their sizes too: the buckets down to the largest group.
  EXPECT_NE(s->tried.find("(with zero_optimization.reduce_bucket_size 500000000 -> 100000000 "
                          "lowered for the host memory)"),
            std::string::npos)
      << s->tried;
  EXPECT_NE(s->tried.find("its cgroup leaves 10 GiB"), std::string::npos) << s->tried;

  // Moved to NVMe from the host, the config's 4 buffers stay 4 (no pipelined reads, which
  // need 8): a buffer count is never raised.
  c.zero.offload_optimizer.buffer_count = 4;
  s = SuggestPlan(c, in, m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->config.zero.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(s->config.zero.offload_optimizer.pipeline_read);
  EXPECT_EQ(s->config.zero.offload_param.device, OffloadDevice::kCpu);

  // Nothing fits: every key at its floor, said for each placement.
  m.host_available_bytes = 1000;
  s = SuggestPlan(c, in, m);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("optimizer and parameters on NVMe: "), std::string::npos);
  EXPECT_NE(s.status().message().find("zero_optimization.sub_group_size 1000000000 -> 1000000, "
                                      "zero_optimization.reduce_bucket_size 500000000 -> "
                                      "100000000, zero_optimization.offload_param.buffer_count "
                                      "4 -> 2 lowered"),
            std::string::npos)
      << s.status();
}

// The sizes go first, to their floors, before any buffer count; then the count whose notch
// saves the most (the parameters' buffers, each the largest group's shard).
TEST(PlannerTest, SuggestLowersBufferCountsAfterTheSizes) {
  Config c = NoReserve(InfinityConfig());  // both on NVMe, 12 pipelined optimizer buffers
  c.zero.offload_optimizer.nvme_path = {"/a"};
  c.zero.offload_optimizer.pipeline_read = true;
  c.zero.sub_group_size = 2000000;
  c.zero.reduce_bucket_size = 50000000;
  const PlanInput in{.params = 1000000000, .world_size = 1, .largest_group = 50000000};
  Config want = c;
  want.zero.sub_group_size = 1000000;
  want.zero.offload_param.buffer_count = 3;
  Result<Plan> three = MakePlan(want, in);
  want.zero.offload_param.buffer_count = 4;
  Result<Plan> four = MakePlan(want, in);
  ASSERT_TRUE(three.ok() && four.ok());
  MachineFacts m = Roomy();
  m.host_available_bytes = (three->host_bytes() + four->host_bytes()) / 2;
  Result<Suggestion> s = SuggestPlan(c, in, m);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->config.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(s->config.zero.sub_group_size, 1000000);
  EXPECT_EQ(s->config.zero.offload_param.buffer_count, 3);
  EXPECT_EQ(s->config.zero.offload_optimizer.buffer_count, 12);
  EXPECT_EQ(s->plan.host_bytes(), three->host_bytes());
  EXPECT_NE(s->lowered.find("lowered zero_optimization.sub_group_size 2000000 -> 1000000, "
                            "zero_optimization.offload_param.buffer_count 5 -> 3: "),
            std::string::npos)
      << s->lowered;
  EXPECT_NE(s->snippet.find("\"buffer_count\": 3"), std::string::npos) << s->snippet;
  // Tighter: the optimizer's buffers go down to pipeline_read's least, 4 x depth.
  m.host_available_bytes = 1000;
  s = SuggestPlan(c, in, m);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("offload_optimizer.buffer_count 12 -> 8"), std::string::npos)
      << s.status();
}

// What `strata-config plan` prints when the plan fits: the room the binding limit leaves.
TEST(PlannerTest, DescribeHostRoomNamesTheBindingLimit) {
  const Config c = InfinityConfig();
  Result<Plan> p = MakePlan(c, {.params = 1000000000, .world_size = 4, .largest_group = 200000000});
  ASSERT_TRUE(p.ok()) << p.status();
  MachineFacts m = Roomy();
  EXPECT_EQ(DescribeHostRoom(*p, c, m),
            "250 GiB of host memory available to each of the 4 ranks on this machine "
            "(MemAvailable), the plan needs " +
                FormatBytes(p->host_bytes()) +
                " per rank and strata.memory_reserve 256 MiB beside it");
  m.host_limits = {Limit("RLIMIT_DATA", MemoryScope::kProcess, 9 * kGiB, kGiB, "VmData",
                         "raise the soft limit (ulimit -d)")};
  EXPECT_EQ(DescribeHostRoom(*p, c, m),
            "8 GiB of host memory available (RLIMIT_DATA = 9 GiB, 1 GiB of it in use (VmData)), "
            "the plan needs " +
                FormatBytes(p->host_bytes()) +
                " per rank and strata.memory_reserve 256 MiB beside it");
}

TEST(PlannerTest, MachineFactsAreReadFromThisMachine) {
  char dir[] = "/tmp/strata-plan-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  Config c = InfinityConfig();
  c.zero.offload_optimizer.nvme_path = {dir, std::string(dir) + "/missing"};
  c.zero.offload_param.nvme_path = {dir};
  Result<Plan> p = MakePlan(c, {.params = 1000, .world_size = 1});
  ASSERT_TRUE(p.ok()) << p.status();
  Result<MachineFacts> m = ReadMachineFacts(*p);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(m->host_available_bytes, 0u);
  EXPECT_GT(m->memlock_limit, 0u);
  ASSERT_EQ(m->free_disk.count(dir), 1u);
  EXPECT_GT(m->free_disk.at(dir), 0u);
  ASSERT_EQ(m->disk_errors.count(std::string(dir) + "/missing"), 1u);
  rmdir(dir);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

TEST(NvmeBenchJsonTest, ReadsTheChosenBandwidthsAndNamesWhatIsWrong) {
  Result<MeasuredBandwidth> m =
      ParseNvmeBenchJson(R"({"best": {"chosen": {"read_gbps": 3.22, "write_gbps": 3.95}}})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_DOUBLE_EQ(m->read, 3.22e9);
  EXPECT_DOUBLE_EQ(m->write, 3.95e9);
  const std::pair<const char*, const char*> bad[] = {
      {"{", "not JSON"},
      {"[1, 2]", "no best.chosen object"},
      {R"({"best": {"chosen": 3}})", "no best.chosen object"},
      {R"({"best": {"chosen": {"read_gbps": 1}}})", "no number best.chosen.write_gbps"},
      {R"({"best": {"chosen": {"read_gbps": "1", "write_gbps": 1}}})",
       "no number best.chosen.read_gbps"},
      {R"({"best": {"chosen": {"read_gbps": 0, "write_gbps": 1}}})",
       "best.chosen.read_gbps = 0 is not a positive bandwidth"},
      {R"({"best": {"chosen": {"read_gbps": 1, "write_gbps": -2.5}}})",
       "best.chosen.write_gbps = -2.5 is not a positive bandwidth"},
      // Found by fuzz_nvme_bench_json: finite in GB/s, infinite in bytes/s.
      {R"({"best": {"chosen": {"read_gbps": 5, "write_gbps": 1e304}}})",
       "best.chosen.write_gbps = 1e+304 is not a positive bandwidth"},
  };
  for (const auto& [text, why] : bad) {
    Result<MeasuredBandwidth> r = ParseNvmeBenchJson(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << text << ": " << r.status();
  }
}

// strata.accumulate_on_device: with micro-steps to sum and the optimizer offloaded, fp32
// accumulators for the rank's trainable elements on the device (a row, in device_bytes),
// read by CPU-Adam from there: no host accumulators, the pinned buffers of the sub-groups
// leased at once instead; on the host, with the reason, when the device budget cannot hold
// them, with one micro-step per step, or when the key is off; host accumulators beside the
// device's sums with the early step.
TEST(PlannerTest, GradientAccumulationOnTheDeviceWhenTheBudgetHoldsIt) {
  Config c;
  c.given = {"zero_optimization.sub_group_size"};  // 1e9: one sub-group, the whole partition
  c.bf16 = true;
  c.gradient_accumulation_steps = 4;
  c.zero.reduce_bucket_size = 1000000;
  c.zero.overlap_comm = true;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  const PlanInput in{.params = 8000000, .world_size = 2, .largest_group = 1000000};
  Result<Plan> on = MakePlan(c, in);
  ASSERT_TRUE(on.ok()) << on.status();
  const uint64_t nt = 4000000;
  EXPECT_EQ(on->device_accumulator_bytes, 4 * nt);
  EXPECT_EQ(on->gradient_accumulation.rfind("device (if the device's own budget", 0), 0u)
      << on->gradient_accumulation;
  auto row = [](const Plan& p, const std::string& state) -> const PlanRow* {
    for (const PlanRow& r : p.rows) {
      if (r.state == state) return &r;
    }
    return nullptr;
  };
  const PlanRow* acc = row(*on, "device gradient accumulators");
  ASSERT_NE(acc, nullptr);
  EXPECT_EQ(acc->tier, PlanTier::kDevice);
  EXPECT_EQ(acc->bytes, 4 * nt);
  EXPECT_NE(on->ToString().find("gradient accumulation: device"), std::string::npos);
  // CPU-Adam on the device's sums: no host accumulators; the pipelined step's worker holds
  // up to three sub-groups' sums (one sub-group of nt here: one buffer).
  EXPECT_EQ(row(*on, "gradient accumulators"), nullptr);
  const PlanRow* buffers = row(*on, "gradient sums' host buffers");
  ASSERT_NE(buffers, nullptr);
  EXPECT_EQ(buffers->bytes, 4 * nt);
  EXPECT_EQ(on->grad_accumulators.rfind("device (", 0), 0u) << on->grad_accumulators;
  Config small = c;
  small.zero.sub_group_size = 500000;
  Result<Plan> subs = MakePlan(small, in);
  ASSERT_TRUE(subs.ok());
  EXPECT_EQ(subs->grad_sums_buffer_bytes, 3 * 4 * 500000u);
  EXPECT_EQ(on->host_bytes() - subs->host_bytes(), 4 * nt - 3 * 4 * 500000u);
  small.strata.pipeline_step = false;
  EXPECT_EQ(MakePlan(small, in)->grad_sums_buffer_bytes, 2 * 4 * 500000u);
  // The early step reads host accumulators: they stay.
  Config early = c;
  early.strata.early_step = true;
  Result<Plan> e = MakePlan(early, in);
  ASSERT_TRUE(e.ok());
  ASSERT_NE(row(*e, "gradient accumulators"), nullptr);
  EXPECT_EQ(row(*e, "gradient sums' host buffers"), nullptr);
  EXPECT_EQ(e->host_bytes(), on->host_bytes()) << "one sub-group: the same bytes either way";
  EXPECT_EQ(e->grad_accumulators.rfind("host (strata.early_step", 0), 0u) << e->grad_accumulators;
  // Without the key: the device holds working shards and buckets only; the host the host
  // accumulators instead of the sums' buffers (one sub-group: the same bytes).
  Config off_key = c;
  off_key.strata.accumulate_on_device = false;
  Result<Plan> off = MakePlan(off_key, in);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->gradient_accumulation, "host (strata.accumulate_on_device false)");
  EXPECT_EQ(off->device_accumulator_bytes, 0u);
  EXPECT_EQ(on->device_bytes, off->device_bytes + 4 * nt);
  EXPECT_EQ(on->host_bytes(), off->host_bytes());
  // A budget with room for the rest only.
  Config tight = c;
  tight.strata.device_budget = off->device_bytes + off->device_working_bytes + 4 * nt - 1;
  Result<Plan> host = MakePlan(tight, in);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->gradient_accumulation.rfind("host (strata.device_budget ", 0), 0u)
      << host->gradient_accumulation;
  EXPECT_EQ(host->device_bytes, off->device_bytes);
  EXPECT_NE(row(*host, "gradient accumulators"), nullptr) << "host accumulators after all";
  EXPECT_EQ(host->host_bytes(), off->host_bytes());
  tight.strata.device_budget += 1;
  Result<Plan> fits = MakePlan(tight, in);
  ASSERT_TRUE(fits.ok());
  EXPECT_EQ(fits->gradient_accumulation, "device");
  Config one = c;
  one.gradient_accumulation_steps = 1;
  EXPECT_EQ(MakePlan(one, in)->gradient_accumulation,
            "host (one micro-step per optimizer step: nothing to sum)");
}

}  // namespace
}  // namespace strata
