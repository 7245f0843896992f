// EngineCore over comm's Gloo backend: 2 and 4 ranks as forked processes (the harness of
// tests/comm/multiprocess.h) train the toy model and must end with the parameters of a
// single-rank run, each holding 1/W of the optimizer state.
//
// Kept in its own executable: the parent must be single-threaded when it forks, so it
// never creates an engine (CpuAdam's thread arena) itself.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "../../comm/multiprocess.h"
#include "failing_allocator.h"
#include "temp_dir.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using comm::testing::AllExitedZero;
using comm::testing::Describe;
using comm::testing::MakeGloo;
using comm::testing::PortChannel;
using comm::testing::RunProcesses;
using testing::FailingAllocator;

Status RunGlooRank(const Config& c, int rank, int world, PortChannel& ports, int steps) {
  // The single-rank run, in this process, with the in-process communicator.
  const RankResult one = RunRank(c, SingleRank(), steps);
  RK_OK(one.status);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> gloo, MakeGloo(rank, world, ports));
  std::shared_ptr<comm::Communicator> comm = std::move(gloo);
  const RankResult r = RunRank(c, comm, steps);
  RK_OK(r.status);
  const double diff = RelDiff(r.params, one.params);
  RK_CHECK(diff < 1e-6, "parameters differ from the single-rank run by " << diff);
  // The ranks' losses (each over its rows) add up to the single-rank loss.
  std::vector<float> losses(r.losses.begin(), r.losses.end());
  RK_OK(comm->AllReduce(losses.data(), losses.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
  for (size_t s = 0; s < losses.size(); ++s) {
    RK_CHECK(std::abs(losses[s] - one.losses[s]) <= 1e-5 * one.losses[s],
             "step " << s << ": loss " << losses[s] << " vs " << one.losses[s]);
  }
  // 1/W of the master parameters, m and v (the single-rank partition plus padding).
  const OptimizerStats& o = r.stats.optimizer;
  const uint64_t single = one.stats.optimizer.master_bytes;
  const uint64_t w = static_cast<uint64_t>(world);
  RK_CHECK(o.master_bytes * w >= single && o.master_bytes * w <= single + w * 4 * 16 * 4,
           "master bytes " << o.master_bytes << " per rank for " << single << " on one rank");
  RK_CHECK(o.exp_avg_bytes == o.master_bytes && o.exp_avg_sq_bytes == o.master_bytes &&
               o.grad_accumulator_bytes == o.master_bytes,
           "optimizer state sizes differ");
  RK_CHECK(o.steps_applied == static_cast<uint64_t>(steps), "steps " << o.steps_applied);
  // The collectives ran and moved bytes.
  RK_CHECK(r.stats.reduce_scatter.calls > 0 && r.stats.all_gather.calls > 0,
           "reduce-scatter " << r.stats.reduce_scatter.calls << ", all-gather "
                             << r.stats.all_gather.calls);
  RK_CHECK(r.stats.comm.bytes_sent > 0, "no bytes sent");
  // A stable order: only the first iteration fetched on demand (4 groups, forward and
  // backward); every later fetch was prefetched, or found still gathered (the root group:
  // its backward use comes right after its forward use, distance 0) — except, after a
  // pipelined step (offload cpu), the iteration's first group, which Step() leaves to the
  // forward (its update may still run).
  const CoordinatorStats& cs = r.stats.coordinator;
  const uint64_t later = static_cast<uint64_t>(steps - 1);
  const uint64_t first = c.strata.pipeline_step && r.stats.optimizer.steps_pipelined > 0 ? 1 : 0;
  RK_CHECK(r.stats.optimizer.steps_pipelined ==
               (c.strata.pipeline_step ? static_cast<uint64_t>(steps) : 0),
           "pipelined steps " << r.stats.optimizer.steps_pipelined);
  RK_CHECK(cs.fetches_on_demand == 8 + first * later, "on-demand fetches " << cs.fetches_on_demand);
  RK_CHECK(cs.fetches_prefetched + cs.fetches_reused == (8u - first) * later &&
               cs.fetches_prefetched >= (6u - first) * later,
           "prefetched " << cs.fetches_prefetched << ", reused " << cs.fetches_reused);
  return Status::Ok();
}

class EngineGlooTest : public ::testing::TestWithParam<int> {};

// Gloo ranks as processes meet through c10d's TCP store (comm/rendezvous.h), which only a
// LibTorch build has.
#if defined(STRATA_TEST_HAVE_TORCH)
#define STRATA_NEEDS_TCP_STORE() (void)0
#else
#define STRATA_NEEDS_TCP_STORE()                                                        \
  GTEST_SKIP() << "gloo ranks as processes need the TCP store (c10d's TCPStore): this " \
                  "build has STRATA_TORCH=OFF (the GlooThreads tests run the ranks as threads)"
#endif

TEST_P(EngineGlooTest, MatchesOneRankWithOneWthOfTheState) {
  STRATA_NEEDS_TCP_STORE();
  const int world = GetParam();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.stage3_max_reuse_distance = 0;
  c.gradient_clipping = 0.5;
  PortChannel ports;  // rank 0's store port, passed on through a pipe
  const auto results = RunProcesses(
      world, [&](int rank) { return RunGlooRank(c, rank, world, ports, 6); },
      std::chrono::seconds(120));
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EngineGlooTest, ::testing::Values(2, 4));

// The same with the ranks as threads of this process over the real gloo communicator (an
// in-process store): in a build without LibTorch too, and under ThreadSanitizer
// (scripts/sanitize.sh), which then sees every rank's engine, transport and CPU-Adam.
TEST(EngineGlooThreadsTest, MatchesOneRankWithOneWthOfTheStateThreeRanks) {
  constexpr int kWorld = 3;
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.stage3_max_reuse_distance = 0;
  c.gradient_clipping = 0.5;
  PortChannel ports;
  ports.UseInProcessStore();
  std::vector<Status> results(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back(
        [&, r] { results[static_cast<size_t>(r)] = RunGlooRank(c, r, kWorld, ports, 4); });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < kWorld; ++r)
    EXPECT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)];
}

// ---- A rank that fails alone in Create -------------------------------------------------
//
// One rank's EngineCore::Create fails where the others' would succeed: its machine's limits
// cannot be read (before any collective), its first device allocation fails (after the
// all-gather of the ranks' cores, before the initial values' broadcasts), or its last (after
// the broadcasts; the persistent groups' gathering comes after it). Every rank's Create must
// fail at once, each naming that rank and its error; none may wait for the communicator's
// timeout, none may return an engine the failing rank does not have.

enum class CreateFault { kNone, kMachineLimits, kFirstAllocation, kLastAllocation };

constexpr auto kCreateTimeout = std::chrono::seconds(20);

struct CreateOutcome {
  Status status;
  double seconds = 0;
  int allocations = 0;
};

// Three gloo ranks as threads create the toy model's engine; rank 1 meets `fault` (its
// `fail_at`-th device allocation for the allocation faults).
std::vector<CreateOutcome> CreateOnThreeRanks(CreateFault fault, int fail_at) {
  constexpr int kWorld = 3;
  PortChannel ports;
  ports.UseInProcessStore();
  std::vector<CreateOutcome> out(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      CreateOutcome& o = out[static_cast<size_t>(r)];
      Result<std::unique_ptr<comm::Communicator>> gloo = MakeGloo(r, kWorld, ports, kCreateTimeout);
      if (!gloo.ok()) {
        o.status = gloo.status();
        return;
      }
      std::shared_ptr<comm::Communicator> comm = std::move(*gloo);
      const bool faulty = r == 1;
      const bool allocation =
          fault == CreateFault::kFirstAllocation || fault == CreateFault::kLastAllocation;
      auto alloc = std::make_shared<FailingAllocator>(0, faulty && allocation ? fail_at : 0);
      EngineOptions opts = TestOptions();
      opts.device_allocator = alloc;
      if (faulty && fault == CreateFault::kMachineLimits) {
        opts.test.machine_facts = [](const Plan&) -> Result<MachineFacts> {
          return UnavailableError("injected: the machine's limits are unreadable");
        };
      }
      const auto start = std::chrono::steady_clock::now();
      Result<std::unique_ptr<EngineCore>> e =
          EngineCore::Create(BaseConfig(), comm, Groups(InitialParams()), opts);
      o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      o.status = e.status();
      o.allocations = alloc->count();
    });
  }
  for (auto& t : threads)
    t.join();
  return out;
}

TEST(EngineGlooThreadsTest, ARankFailingAloneInCreateFailsItOnEveryRankAtOnce) {
  // How many device allocations a Create makes (the same on every rank).
  const std::vector<CreateOutcome> clean = CreateOnThreeRanks(CreateFault::kNone, 0);
  for (const CreateOutcome& o : clean)
    ASSERT_TRUE(o.status.ok()) << o.status;
  const int last = clean[1].allocations;
  ASSERT_GT(last, 2);
  for (const CreateFault fault :
       {CreateFault::kMachineLimits, CreateFault::kFirstAllocation, CreateFault::kLastAllocation}) {
    SCOPED_TRACE("fault " + std::to_string(static_cast<int>(fault)));
    const std::vector<CreateOutcome> got =
        CreateOnThreeRanks(fault, fault == CreateFault::kLastAllocation ? last : 1);
    for (size_t r = 0; r < got.size(); ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_FALSE(got[r].status.ok());
      const std::string msg = got[r].status.ToString();
      EXPECT_NE(msg.find("creating the engine failed on rank 1; rank 1: "), std::string::npos)
          << msg;
      EXPECT_NE(msg.find(fault == CreateFault::kMachineLimits
                             ? "injected: the machine's limits are unreadable"
                             : "injected: out of memory"),
                std::string::npos)
          << msg;
      EXPECT_LT(got[r].seconds, 10.0) << "waited for the communicator's timeout";
    }
    if (fault == CreateFault::kLastAllocation) {
      EXPECT_EQ(got[1].allocations, last);
    }
  }
}

// ---- A rank that dies ------------------------------------------------------------------
//
// One rank calls _exit(9) at a named point of the third step (no destructor runs, as with
// SIGKILL or a crash); every other rank must end with an error that names the lost rank
// within the communicator's timeout of 30 s, none may hang, and the swap directory (the
// optimizer states are on NVMe) must be empty once every process ended.

enum class DiePoint {
  kAllGather,
  kReduceScatter,
  kNormAllReduce,
  kCpuStep,
  kNvmeRead,        // a read of an NVMe state (parameters and optimizer on NVMe)
  kCheckpointSave,  // a checkpoint save, after the rank wrote its file (crash_at)
};

const char* DiePointName(DiePoint p) {
  switch (p) {
    case DiePoint::kAllGather:
      return "AllGather";
    case DiePoint::kReduceScatter:
      return "ReduceScatter";
    case DiePoint::kNormAllReduce:
      return "NormAllReduce";
    case DiePoint::kCpuStep:
      return "CpuStep";
    case DiePoint::kNvmeRead:
      return "NvmeRead";
    case DiePoint::kCheckpointSave:
      return "CheckpointSave";
  }
  return "?";
}

constexpr int kDieAtStep = 2;
constexpr auto kDeadRankTimeout = std::chrono::seconds(30);

// Forwards to a real communicator; on the dying rank, after Arm(), _exit(9) when the chosen
// collective is issued: the N-th parameter all-gather or gradient reduce-scatter (the
// engine's agreements all-gather int64 flags: not counted), or the first all-reduce (armed
// right before Step(): the gradient norm's).
class DyingCommunicator final : public comm::Communicator {
 public:
  DyingCommunicator(std::shared_ptr<comm::Communicator> inner, bool dies, DiePoint point, int nth)
      : inner_(std::move(inner)), dies_(dies), point_(point), nth_(nth) {}
  void Arm() { armed_ = dies_; }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  comm::Backend backend() const override { return inner_->backend(); }
  const comm::CommOptions& options() const override { return inner_->options(); }
  comm::CommStats stats() const override { return inner_->stats(); }

  comm::WorkPtr AllGatherAsync(const void* shard, void* full, size_t total,
                               comm::DType dtype) override {
    if (dtype != comm::DType::kInt64) CountAllGather();
    return inner_->AllGatherAsync(shard, full, total, dtype);
  }
  comm::WorkPtr ReduceScatterAsync(const void* full, void* shard, size_t total, comm::DType dtype,
                                   comm::ReduceOp op) override {
    CountReduceScatter();
    return inner_->ReduceScatterAsync(full, shard, total, dtype, op);
  }
  comm::WorkPtr AllReduceAsync(void* data, size_t count, comm::DType dtype,
                               comm::ReduceOp op) override {
    if (armed_ && point_ == DiePoint::kNormAllReduce) Die("the gradient norm's all-reduce");
    return inner_->AllReduceAsync(data, count, dtype, op);
  }
  comm::WorkPtr BroadcastAsync(void* data, size_t count, comm::DType dtype, int root) override {
    return inner_->BroadcastAsync(data, count, dtype, root);
  }
  comm::WorkPtr BarrierAsync() override { return inner_->BarrierAsync(); }
  comm::WorkPtr AllGatherCoalescedAsync(std::span<const comm::GatherItem> items,
                                        comm::DType dtype) override {
    if (dtype != comm::DType::kInt64) CountAllGather();
    return inner_->AllGatherCoalescedAsync(items, dtype);
  }
  comm::WorkPtr ReduceScatterCoalescedAsync(std::span<const comm::ScatterItem> items,
                                            comm::DType dtype, comm::ReduceOp op) override {
    CountReduceScatter();
    return inner_->ReduceScatterCoalescedAsync(items, dtype, op);
  }
  comm::WorkPtr AllReduceCoalescedAsync(std::span<const comm::ReduceItem> items, comm::DType dtype,
                                        comm::ReduceOp op) override {
    if (armed_ && point_ == DiePoint::kNormAllReduce) Die("the gradient norm's all-reduce");
    return inner_->AllReduceCoalescedAsync(items, dtype, op);
  }

  [[noreturn]] static void Die(const char* where) {
    std::printf("[dying rank] _exit(9) at %s\n", where);
    std::fflush(stdout);
    _exit(9);
  }

 private:
  void CountAllGather() {
    if (armed_ && point_ == DiePoint::kAllGather && ++count_ == nth_) Die("an all-gather");
  }
  void CountReduceScatter() {
    if (armed_ && point_ == DiePoint::kReduceScatter && ++count_ == nth_) Die("a reduce-scatter");
  }

  std::shared_ptr<comm::Communicator> inner_;
  const bool dies_;
  const DiePoint point_;
  const int nth_;
  bool armed_ = false;  // the engine issues from one thread (the caller's)
  int count_ = 0;
};

struct DeadRankCase {
  DiePoint point;
  int dead;  // the rank that dies
  int world;
};

std::string CaseName(const ::testing::TestParamInfo<DeadRankCase>& info) {
  return std::string("DeadRankAt") + DiePointName(info.param.point) + "_Rank" +
         std::to_string(info.param.dead) + "Of" + std::to_string(info.param.world);
}

// The checkpoint every case saves at the end of step kSaveAtStep (before any rank dies),
// under the tag this gives.
constexpr int kSaveAtStep = 1;
const char kSavedTag[] = "global_step2";  // kSaveAtStep + 1 steps applied

Status DeadRankBody(const DeadRankCase& k, int rank, PortChannel& ports, const std::string& dir,
                    const std::string& ckpt_dir) {
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {dir};
  c.zero.offload_param.device = OffloadDevice::kCpu;
  if (k.point == DiePoint::kNvmeRead) {
    c.zero.offload_param.device = OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = {dir};
    // The step inside Step(), which writes the shards behind and leaves the forward to read
    // them back: the pipelined step hands each new shard to the store as the forward opens
    // its group, so this toy's forward reads none from NVMe (the first read after arming
    // would be the update's, on its worker, a race with the arming). A rank dying in the
    // update's worker is the kCpuStep case.
    c.strata.pipeline_step = false;
  }
  c.gradient_clipping = 0.5;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> gloo,
                          MakeGloo(rank, k.world, ports, kDeadRankTimeout));
  const bool dies = rank == k.dead;
  // Step kDieAtStep's 1st parameter all-gather or 2nd reduce-scatter (a gradient bucket in
  // its backward pass). The pipelined step (on by default; the states on NVMe stream on its
  // worker) prefetches nothing at the end of Step(): the previous step's update runs beside
  // this forward, which fetches the groups as their updates end, so the first all-gather
  // comes in step kDieAtStep's forward. The CPU step's update also runs beside the next
  // forward: the survivors find the loss in step kDieAtStep + 1.
  const int nth = k.point == DiePoint::kAllGather ? 1 : 2;
  const int fails_at = k.point == DiePoint::kCpuStep ? kDieAtStep + 1 : kDieAtStep;
  auto dying = std::make_shared<DyingCommunicator>(std::move(gloo), dies, k.point, nth);
  EngineOptions o = TestOptions();
  std::atomic<int> step_now{0};
  std::atomic<int> updates{0};
  std::atomic<bool> nvme_armed{false};
  if (dies && k.point == DiePoint::kCpuStep) {
    o.test.driver.on_update = [&](size_t, bool begin) {
      // The second sub-group's CPU-Adam update of step kDieAtStep (on the pipelined update's
      // worker: step_now is the step whose Step() was called last).
      if (begin && step_now.load() == kDieAtStep && ++updates == 2)
        DyingCommunicator::Die("the CPU step (second sub-group)");
    };
  }
  if (dies && k.point == DiePoint::kNvmeRead) {
    // The first NVMe read (a working shard or an optimizer state) submitted in step
    // kDieAtStep, while the read is in flight.
    o.test.nvme_observer = [&](const offload::StateEvent& ev) {
      if (ev.kind == offload::StateEvent::kReadSubmitted && nvme_armed.load())
        DyingCommunicator::Die("an NVMe read");
    };
  }
  Result<std::unique_ptr<EngineCore>> e = EngineCore::Create(c, dying, Groups(InitialParams()), o);
  RK_OK(e.status());
  Status failure;
  double failed_after = 0.0;
  int failed_at_step = -1;
  Params saved;  // the parameters of the checkpoint saved at kSaveAtStep
  for (int step = 0; step < 6 && failure.ok(); ++step) {
    const bool now = step == kDieAtStep;
    if (now && k.point != DiePoint::kNormAllReduce) dying->Arm();
    if (now && k.point == DiePoint::kNvmeRead) nvme_armed = true;
    const auto start = std::chrono::steady_clock::now();
    Status s = EngineMicroStep(**e, Seq(step), MakeBatch(step)).status();
    if (s.ok()) {
      if (now && k.point == DiePoint::kNormAllReduce) dying->Arm();
      step_now = step;
      s = (*e)->Step().status();
    }
    if (s.ok() && step == kSaveAtStep) {
      saved = EngineParams(**e);
      CheckpointSaveRequest so;
      so.dir = ckpt_dir;
      Result<std::string> path = (*e)->SaveCheckpoint(so);
      RK_OK(path.status());
      RK_CHECK(path->ends_with(kSavedTag), "saved as " << *path);
    }
    if (s.ok() && now && k.point == DiePoint::kCheckpointSave) {
      // Every rank saves; the dying one stops after writing its file, before the ranks
      // agree that every file is written.
      CheckpointSaveRequest so;
      so.dir = ckpt_dir;
      if (dies) so.crash_at = "rank_file_written";
      s = (*e)->SaveCheckpoint(so).status();
    }
    if (!s.ok()) {
      failure = s;
      failed_at_step = step;
      failed_after =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  RK_CHECK(!dies, "the dying rank did not die (its point was never reached)");
  std::printf("[rank %d of %d] step %d failed after %.2f s: %s\n", rank, k.world, failed_at_step,
              failed_after, failure.ToString().c_str());
  std::fflush(stdout);
  RK_CHECK(!failure.ok(),
           "rank " << rank << " trained 6 steps although rank " << k.dead << " died");
  RK_CHECK(failed_at_step == fails_at, "failed at step " << failed_at_step << ": " << failure);
  RK_CHECK(failed_after < std::chrono::duration<double>(kDeadRankTimeout).count(),
           "the error came after " << failed_after << " s");
  const std::string lost = "lost rank " + std::to_string(k.dead);
  RK_CHECK(failure.message().find(lost) != std::string::npos,
           "the error does not say '" << lost << "': " << failure);
  // Tearing the engine down after the failure ends too (a hang is caught by the harness).
  const auto teardown = std::chrono::steady_clock::now();
  e->reset();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - teardown).count();
  RK_CHECK(secs < 30.0, "the engine took " << secs << " s to tear down");
  // The checkpoint saved before the loss is the last complete one (a save the loss
  // interrupted left no tag), and it loads on this survivor alone, resharded to one rank,
  // with the parameters it had: the previous state is intact.
  std::string latest;
  if (FILE* f = std::fopen((ckpt_dir + "/latest").c_str(), "r")) {
    char buf[64] = {};
    latest.assign(buf, std::fread(buf, 1, sizeof(buf) - 1, f));
    std::fclose(f);
  }
  while (!latest.empty() && latest.back() == '\n')
    latest.pop_back();
  RK_CHECK(latest == kSavedTag, "latest names '" << latest << "'");
  struct stat st;
  RK_CHECK(::stat((ckpt_dir + "/global_step3").c_str(), &st) != 0,
           "the interrupted save left a tag directory global_step3");
  const std::string reload_dir = dir + "/reload-rank" + std::to_string(rank);
  RK_CHECK(::mkdir(reload_dir.c_str(), 0700) == 0, "mkdir " << reload_dir);
  {
    Config one = c;
    one.zero.offload_optimizer.nvme_path = {reload_dir};
    if (one.zero.offload_param.device == OffloadDevice::kNvme)
      one.zero.offload_param.nvme_path = {reload_dir};
    std::unique_ptr<EngineCore> fresh = MakeEngine(one, SingleRank(), InitialParams());
    RK_CHECK(fresh != nullptr, "a one-rank engine could not be created");
    CheckpointLoadRequest lo;
    lo.dir = ckpt_dir;
    Result<CheckpointLoadResult> loaded = fresh->LoadCheckpoint(lo);
    RK_OK(loaded.status());
    RK_CHECK(loaded->tag == kSavedTag && loaded->saved_world_size == k.world,
             "loaded " << loaded->tag << " saved on " << loaded->saved_world_size << " ranks");
    RK_CHECK(EngineParams(*fresh) == saved, "the loaded parameters differ from the saved ones");
  }
  RK_CHECK(::rmdir(reload_dir.c_str()) == 0, "the one-rank engine left files in " << reload_dir);
  return Status::Ok();
}

class EngineDeadRankTest : public ::testing::TestWithParam<DeadRankCase> {};

TEST_P(EngineDeadRankTest, SurvivorsNameTheLostRankLeaveNoSwapFileAndLoadThePreviousCheckpoint) {
  STRATA_NEEDS_TCP_STORE();
  const DeadRankCase k = GetParam();
  testing::TempDir dir;
  testing::TempDir ckpt;
  PortChannel ports;
  const auto results = RunProcesses(
      k.world, [&](int rank) { return DeadRankBody(k, rank, ports, dir.path(), ckpt.path()); },
      std::chrono::seconds(90));
  for (int r = 0; r < k.world; ++r) {
    const auto& res = results[static_cast<size_t>(r)];
    EXPECT_FALSE(res.hung) << "rank " << r << " hung\n" << Describe(results);
    EXPECT_EQ(res.exit_code, r == k.dead ? 9 : 0) << "rank " << r << "\n" << Describe(results);
  }
  // Nothing is left in the swap directory: not the survivors' files (closed with their
  // engines), not the dead rank's (unnamed from the start).
  std::vector<std::string> left;
  if (DIR* d = opendir(dir.path().c_str())) {
    while (dirent* ent = readdir(d)) {
      const std::string n = ent->d_name;
      if (n != "." && n != "..") left.push_back(n);
    }
    closedir(d);
  }
  EXPECT_TRUE(left.empty()) << left.size() << " entries left, the first " << left[0];
}

INSTANTIATE_TEST_SUITE_P(Points, EngineDeadRankTest,
                         ::testing::Values(DeadRankCase{DiePoint::kAllGather, 2, 3},
                                           DeadRankCase{DiePoint::kAllGather, 0, 3},
                                           DeadRankCase{DiePoint::kReduceScatter, 2, 3},
                                           DeadRankCase{DiePoint::kNormAllReduce, 2, 3},
                                           DeadRankCase{DiePoint::kCpuStep, 1, 2},
                                           DeadRankCase{DiePoint::kNvmeRead, 1, 2},
                                           DeadRankCase{DiePoint::kNvmeRead, 0, 3},
                                           DeadRankCase{DiePoint::kCheckpointSave, 1, 2},
                                           DeadRankCase{DiePoint::kCheckpointSave, 2, 3}),
                         CaseName);

}  // namespace
}  // namespace strata::engine
