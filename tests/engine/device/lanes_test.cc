// Separate lanes for the all-gathers and the gradient reductions
// (EngineOptions::reduce_comm): with the reduce-scatter lane held, a prefetch all-gather
// still completes; on one lane it cannot (the control shows the test can fail). Checked
// on order, not on time; training is bit-identical with one lane and with two. And the
// all-gathers' own lane (EngineOptions::gather_comm), which leaves the engine's
// communicator to the caller between any two calls, the pipelined step's deferred
// all-gathers included.
#include "strata/engine/runtime/lanes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "strata/engine/device/lane.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

// NCCL lanes (strata.nccl_lanes) are refused where one hardware queue would serialize their
// streams (CUDA_DEVICE_MAX_CONNECTIONS=1), with both ways out named; allowed otherwise.
TEST(LanesTest, NcclLanesAreRefusedWithOneDeviceConnection) {
  const char* saved = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string restore = saved != nullptr ? saved : "";
  ASSERT_EQ(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1), 0);
  const Status refused = CheckNcclLanes();
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("strata.nccl_lanes"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("unset CUDA_DEVICE_MAX_CONNECTIONS"), std::string::npos);
  ASSERT_EQ(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1), 0);
  EXPECT_TRUE(CheckNcclLanes().ok());
  ASSERT_EQ(unsetenv("CUDA_DEVICE_MAX_CONNECTIONS"), 0);
  EXPECT_TRUE(CheckNcclLanes().ok());
  if (saved != nullptr) setenv("CUDA_DEVICE_MAX_CONNECTIONS", restore.c_str(), 1);
  EXPECT_TRUE(Config().strata.nccl_lanes) << "on by default";
}

// One rank's latch, shared by its lanes. Every collective the rank issues gets a sequence
// number (in issue order, across both lanes). Once armed, the second reduce-scatter a lane
// is about to run is held until an all-gather issued after it completes (or until
// `timeout`, so a test that would deadlock ends). The second: a backward's first bucket
// goes out with the root group's early gradients and is waited for as soon as the next
// layer's gradients need that bucket, before any later all-gather is issued; the second
// (the last layer's) stays in flight while the next layers' all-gathers are issued.
class Latch {
 public:
  explicit Latch(std::chrono::milliseconds timeout) : timeout_(timeout) {}
  void Arm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
  }
  uint64_t NextSeq() { return next_seq_.fetch_add(1); }
  // Called by a lane before it runs the reduce-scatter issued as `seq`.
  void HoldReduceScatter(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!armed_ || released_ || ++scatters_ < 2) return;
    if (gathered_after_ > seq) {
      // An all-gather issued after this reduce-scatter completed before the lane even got
      // to it (a loaded machine): it did not queue behind it either.
      ++gathers_past_held_;
      released_ = true;
      return;
    }
    held_ = true;
    held_seq_ = seq;
    cv_.wait_for(lock, timeout_, [&] { return released_; });
    released_ = true;  // released (or timed out): nothing is held again
    held_ = false;
  }
  // Called by a lane after the all-gather issued as `seq` completed.
  void AllGatherDone(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    if (armed_) gathered_after_ = std::max(gathered_after_, seq + 1);
    if (held_ && seq > held_seq_) {
      ++gathers_past_held_;
      released_ = true;
      cv_.notify_all();
    }
  }
  int gathers_past_held() {
    std::lock_guard<std::mutex> lock(mu_);
    return gathers_past_held_;
  }

 private:
  const std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> next_seq_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;
  int scatters_ = 0;  // run since armed
  bool held_ = false;
  bool released_ = false;
  uint64_t held_seq_ = 0;
  uint64_t gathered_after_ = 0;  // 1 + the highest sequence number of a completed all-gather
  int gathers_past_held_ = 0;
};

// A lane: runs a rank's collectives on its own thread, in issue order, as a real
// communicator's progress thread does (the thread communicator underneath runs each one
// synchronously). A held reduce-scatter holds everything queued behind it on this lane.
class LaneCommunicator final : public comm::Communicator {
 public:
  LaneCommunicator(std::shared_ptr<ThreadGroup> group, int rank, Latch* latch)
      : inner_(std::move(group), rank), latch_(latch), worker_([this] { Run(); }) {}
  ~LaneCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  comm::Backend backend() const override { return inner_.backend(); }
  const comm::CommOptions& options() const override { return inner_.options(); }
  comm::CommStats stats() const override { return {}; }
  // All-gathers issued on this lane so far (coalesced ones count once).
  int gathers_issued() const { return gathers_issued_.load(); }

  comm::WorkPtr AllGatherAsync(const void* shard, void* full, size_t total,
                               comm::DType dtype) override {
    return Queue([=, this] { return inner_.AllGather(shard, full, total, dtype); }, kGather);
  }
  comm::WorkPtr ReduceScatterAsync(const void* full, void* shard, size_t total, comm::DType dtype,
                                   comm::ReduceOp op) override {
    return Queue([=, this] { return inner_.ReduceScatter(full, shard, total, dtype, op); },
                 kScatter);
  }
  comm::WorkPtr AllReduceAsync(void* data, size_t count, comm::DType dtype,
                               comm::ReduceOp op) override {
    return Queue([=, this] { return inner_.AllReduce(data, count, dtype, op); }, kOther);
  }
  comm::WorkPtr BroadcastAsync(void* data, size_t count, comm::DType dtype, int root) override {
    return Queue([=, this] { return inner_.Broadcast(data, count, dtype, root); }, kOther);
  }
  comm::WorkPtr BarrierAsync() override {
    return Queue([this] { return inner_.Barrier(); }, kOther);
  }
  comm::WorkPtr AllGatherCoalescedAsync(std::span<const comm::GatherItem> items,
                                        comm::DType dtype) override {
    std::vector<comm::GatherItem> v(items.begin(), items.end());
    return Queue([v, dtype, this] { return inner_.AllGatherCoalescedAsync(v, dtype)->Wait(); },
                 kGather);
  }
  comm::WorkPtr ReduceScatterCoalescedAsync(std::span<const comm::ScatterItem> items,
                                            comm::DType dtype, comm::ReduceOp op) override {
    std::vector<comm::ScatterItem> v(items.begin(), items.end());
    return Queue(
        [v, dtype, op, this] { return inner_.ReduceScatterCoalescedAsync(v, dtype, op)->Wait(); },
        kScatter);
  }
  comm::WorkPtr AllReduceCoalescedAsync(std::span<const comm::ReduceItem> items, comm::DType dtype,
                                        comm::ReduceOp op) override {
    std::vector<comm::ReduceItem> v(items.begin(), items.end());
    return Queue(
        [v, dtype, op, this] { return inner_.AllReduceCoalescedAsync(v, dtype, op)->Wait(); },
        kOther);
  }

 private:
  enum Kind { kGather, kScatter, kOther };
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
  };
  class LaneWork final : public comm::Work {
   public:
    explicit LaneWork(std::shared_ptr<State> s) : s_(std::move(s)) {}
    Status Wait(std::optional<std::chrono::milliseconds> = std::nullopt) override {
      std::unique_lock<std::mutex> lock(s_->mu);
      s_->cv.wait(lock, [&] { return s_->done; });
      return s_->status;
    }
    bool IsCompleted() const override {
      std::lock_guard<std::mutex> lock(s_->mu);
      return s_->done;
    }

   private:
    std::shared_ptr<State> s_;
  };
  struct Op {
    std::function<Status()> fn;
    Kind kind;
    std::shared_ptr<State> state;
    uint64_t seq = 0;
  };

  comm::WorkPtr Queue(std::function<Status()> fn, Kind kind) {
    auto state = std::make_shared<State>();
    if (kind == kGather) gathers_issued_.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back({std::move(fn), kind, state, latch_ != nullptr ? latch_->NextSeq() : 0});
    }
    cv_.notify_all();
    return std::make_unique<LaneWork>(state);
  }
  void Run() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !ops_.empty(); });
        if (ops_.empty()) return;
        op = std::move(ops_.front());
        ops_.pop_front();
      }
      if (op.kind == kScatter && latch_ != nullptr) latch_->HoldReduceScatter(op.seq);
      const Status st = op.fn();
      if (op.kind == kGather && latch_ != nullptr) latch_->AllGatherDone(op.seq);
      {
        std::lock_guard<std::mutex> lock(op.state->mu);
        op.state->status = st;
        op.state->done = true;
      }
      op.state->cv.notify_all();
    }
  }

  ThreadCommunicator inner_;
  Latch* latch_;
  std::atomic<int> gathers_issued_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> ops_;
  bool stop_ = false;
  std::thread worker_;  // last: it starts once the rest is built
};

struct LaneRun {
  std::vector<double> losses;
  Params params;
  int gathers_past_held = 0;
};

// Two thread ranks train 3 steps; `lanes`: the reductions on their own communicator.
// `hold`: each rank's latch (timing out after that) holds its second reduce-scatter of the
// second step. One group prefetched ahead, one layer per gradient bucket: in a backward,
// the release of a layer issues the all-gather of the layer two ahead after that layer's
// reduce-scatter went out, and the next bucket's launch waits for that reduce-scatter.
std::vector<LaneRun> Train(bool lanes, std::optional<std::chrono::milliseconds> hold,
                           bool queued = false) {
  Config c = BaseConfig();
  c.zero.overlap_comm = true;
  c.zero.reduce_bucket_size = kD * kD + kD;           // one layer per bucket
  c.zero.stage3_prefetch_bucket_size = kD * kD + kD;  // one group ahead
  c.zero.stage3_max_reuse_distance = 0;               // gathered again for the backward
  const int world = 2;
  auto gather_group = std::make_shared<ThreadGroup>(world);
  auto reduce_group = std::make_shared<ThreadGroup>(world);
  std::vector<LaneRun> runs(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Latch> latch;
      if (hold) latch = std::make_unique<Latch>(*hold);
      EngineOptions o = TestOptions();
      // The latch orders the collectives as they reach their communicators; a queued lane
      // (lane.h) hands its reduce-scatters over later, from its stream, so the host orders
      // them here (the queued lanes' order: CollectiveLaneTest, EngineCoreTest's
      // AsyncDevice*QueuedLanes* and *StreamWait* tests).
      o.test.host_ordered_lanes = !queued;
      auto comm = std::make_shared<LaneCommunicator>(gather_group, r, latch.get());
      if (lanes) o.reduce_comm = std::make_shared<LaneCommunicator>(reduce_group, r, latch.get());
      {
        std::unique_ptr<EngineCore> e = MakeEngine(c, comm, InitialParams(), o);
        if (e == nullptr) return;
        for (int s = 0; s < 3; ++s) {
          // From the second step on every fetch is a prefetch (the first records the order).
          if (s == 1 && latch != nullptr) latch->Arm();
          Result<double> loss = EngineMicroStep(*e, Seq(s), MakeBatch(s));
          if (!loss.ok() || !e->Step().ok()) return;
          runs[static_cast<size_t>(r)].losses.push_back(*loss);
        }
        runs[static_cast<size_t>(r)].params = EngineParams(*e);
        EXPECT_EQ(e->stats().reduce_lane, lanes);
      }
      o.reduce_comm.reset();
      comm.reset();  // the lanes' threads end before the latch goes
      if (latch != nullptr)
        runs[static_cast<size_t>(r)].gathers_past_held = latch->gathers_past_held();
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

TEST(LanesTest, APrefetchAllGatherCompletesWhileTheReduceScatterLaneIsHeld) {
  const std::vector<LaneRun> two = Train(/*lanes=*/true, std::chrono::seconds(30));
  const std::vector<LaneRun> one = Train(/*lanes=*/false, std::nullopt);
  for (size_t r = 0; r < two.size(); ++r) {
    EXPECT_GT(two[r].gathers_past_held, 0)
        << "rank " << r << ": no all-gather issued after the held reduce-scatter completed";
    ASSERT_EQ(two[r].losses.size(), 3u);
    EXPECT_EQ(two[r].losses, one[r].losses) << "rank " << r;
    EXPECT_EQ(two[r].params, one[r].params) << "rank " << r;
  }
}

// Lanes of their own run queued on the device's streams (lane.h, kQueued): training is
// bit-identical to one host-ordered lane.
TEST(LanesTest, QueuedLanesTrainBitIdenticallyToOneLane) {
  const std::vector<LaneRun> queued = Train(/*lanes=*/true, std::nullopt, /*queued=*/true);
  const std::vector<LaneRun> one = Train(/*lanes=*/false, std::nullopt);
  for (size_t r = 0; r < queued.size(); ++r) {
    ASSERT_EQ(queued[r].losses.size(), 3u) << "rank " << r;
    EXPECT_EQ(queued[r].losses, one[r].losses) << "rank " << r;
    EXPECT_EQ(queued[r].params, one[r].params) << "rank " << r;
  }
}

TEST(LanesTest, OnOneLaneTheAllGatherWaitsBehindTheHeldReduceScatter) {
  // The control: the same latch, one communicator for both. No all-gather issued after
  // the held reduce-scatter gets past it; the latch's timeout lets the run finish.
  const std::vector<LaneRun> one = Train(/*lanes=*/false, std::chrono::milliseconds(300));
  for (size_t r = 0; r < one.size(); ++r) {
    EXPECT_EQ(one[r].gathers_past_held, 0) << "rank " << r;
    EXPECT_EQ(one[r].losses.size(), 3u) << "rank " << r;
  }
}

// The all-gathers' lane (EngineOptions::gather_comm): the pipelined step defers the
// prefetches of groups whose update is not done and issues them later, at points that
// differ between ranks. Rank 0's update of step 1 is held after group kHeld until its next
// forward has gathered kHeld (or a timeout); rank 1 lets its update end before that
// forward. `caller`: each rank all-reduces on the engine's communicator once each group is
// gathered in every forward, as a C++ caller may do between its calls.
struct CallerRun {
  std::vector<double> losses;
  Params params;
  // In step 2's forward, at each group's gather: the all-gathers issued so far on the
  // communicator that carries them.
  std::vector<int> gathers_at;
  int engine_comm_gathers = 0;     // all-gathers issued on the engine's communicator
  std::vector<float> caller_sums;  // what the caller's all-reduces returned
  uint64_t deferred = 0;
  bool gather_lane = false;
  bool opened_by_timeout = false;
};

std::vector<CallerRun> TrainWithCallerCollectives(bool gather_lane, bool caller) {
  constexpr int kHeld = 2;
  const int world = 2;
  Config c = BaseConfig();
  c.strata.pipeline_step = true;
  auto engine_group = std::make_shared<ThreadGroup>(world);
  auto reduce_group = std::make_shared<ThreadGroup>(world);
  auto gather_group = std::make_shared<ThreadGroup>(world);
  std::vector<CallerRun> runs(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CallerRun& run = runs[static_cast<size_t>(r)];
      std::mutex mu;
      std::condition_variable cv;
      bool armed = false, open = false;
      int updated = 0;  // groups of the armed update done
      EngineOptions o = TestOptions();
      o.test.driver.on_group_updated = [&](int g) {
        std::unique_lock<std::mutex> lock(mu);
        if (!armed) return;
        ++updated;
        cv.notify_all();
        if (r == 0 && g == kHeld) {
          if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return open; }))
            run.opened_by_timeout = true;
        }
      };
      auto comm = std::make_shared<LaneCommunicator>(engine_group, r, nullptr);
      auto reduce = std::make_shared<LaneCommunicator>(reduce_group, r, nullptr);
      auto gather = std::make_shared<LaneCommunicator>(gather_group, r, nullptr);
      o.reduce_comm = reduce;
      if (gather_lane) o.gather_comm = gather;
      LaneCommunicator* gathers_on = gather_lane ? gather.get() : comm.get();
      {
        std::unique_ptr<EngineCore> e = MakeEngine(c, comm, InitialParams(), o);
        if (e == nullptr) return;
        // Creation's own all-gather (the ranks' cores, for CPU-Adam's threads) is not training's.
        const int created_gathers = comm->gathers_issued();
        const int groups = e->num_groups();
        for (int s = 0; s < 3; ++s) {
          if (s == 2 && r == 1) {
            // Rank 1's update ends before its forward: its prefetches go out at once.
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [&] { return updated == groups; });
          }
          auto gathered = [&](int g, Phase phase) {
            if (phase != Phase::kForward) return;
            if (s == 2) run.gathers_at.push_back(gathers_on->gathers_issued());
            if (s == 2 && r == 0 && g == kHeld) {
              std::lock_guard<std::mutex> lock(mu);
              open = true;
              cv.notify_all();
            }
            if (caller) {
              float x = static_cast<float>(r + 1);
              EXPECT_TRUE(comm->AllReduce(&x, 1, comm::DType::kFloat32, comm::ReduceOp::kSum).ok());
              run.caller_sums.push_back(x);
            }
          };
          Result<double> loss = EngineMicroStep(*e, Seq(s), MakeBatch(s), {}, gathered);
          EXPECT_TRUE(loss.ok()) << loss.status();
          if (!loss.ok()) return;
          run.losses.push_back(*loss);
          if (s == 1) {
            std::lock_guard<std::mutex> lock(mu);
            armed = true;  // the update Step() starts now
          }
          Result<StepOutcome> out = e->Step();
          EXPECT_TRUE(out.ok()) << out.status();
          if (!out.ok()) return;
        }
        // Before GatherMasterParams, which all-gathers on the host-side communicator.
        run.engine_comm_gathers = comm->gathers_issued() - created_gathers;
        run.params = EngineParams(*e);
        run.deferred = e->stats().coordinator.prefetches_deferred;
        run.gather_lane = e->stats().gather_lane;
      }
    });
  }
  for (auto& t : threads)
    t.join();
  return runs;
}

TEST(LanesTest, WithoutAGatherLaneDeferredAllGathersGoOutAtPointsThatDifferBetweenRanks) {
  // The trap the all-gathers' lane removes: at the same point of the forward the ranks
  // have issued different numbers of all-gathers on the engine's communicator, so a
  // collective of the caller's there would pair up with an all-gather on the other rank.
  const std::vector<CallerRun> runs = TrainWithCallerCollectives(false, false);
  ASSERT_EQ(runs[0].gathers_at.size(), runs[1].gathers_at.size());
  EXPECT_GT(runs[0].deferred, 0u);
  EXPECT_FALSE(runs[0].opened_by_timeout);
  EXPECT_NE(runs[0].gathers_at, runs[1].gathers_at);
  EXPECT_FALSE(runs[0].gather_lane);
}

TEST(LanesTest, WithAGatherLaneTheCallerMayUseTheEnginesCommunicatorInTheForward) {
  const std::vector<CallerRun> with = TrainWithCallerCollectives(true, true);
  const std::vector<CallerRun> reference = TrainWithCallerCollectives(false, false);
  // The deferred all-gathers went out beside the caller's collectives, at other points on
  // the two ranks (on their own lane).
  EXPECT_GT(with[0].deferred, 0u);
  EXPECT_NE(with[0].gathers_at, with[1].gathers_at);
  for (size_t r = 0; r < with.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(with[r].gather_lane);
    EXPECT_FALSE(with[r].opened_by_timeout);
    EXPECT_EQ(with[r].engine_comm_gathers, 0);
    ASSERT_EQ(with[r].caller_sums.size(), 12u);  // four groups a forward, three forwards
    for (float x : with[r].caller_sums)
      EXPECT_EQ(x, 3.0f);
    ASSERT_EQ(with[r].losses.size(), 3u);
    EXPECT_EQ(with[r].losses, reference[r].losses);
    EXPECT_EQ(with[r].params, reference[r].params);
  }
}

// A lane (EngineOptions::*lane, named `name`) over other ranks, and the engine's own
// communicator as a lane, are refused with messages naming the option.
void ExpectLaneRefused(std::shared_ptr<comm::Communicator> EngineOptions::*lane,
                       const std::string& name) {
  auto other = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(2), 1);
  EngineOptions o = TestOptions();
  o.*lane = other;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(BaseConfig(), SingleRank(), Groups(InitialParams()), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("EngineOptions::" + name + " is gloo rank 1 of 2"),
            std::string::npos)
      << e.status();
  std::shared_ptr<comm::Communicator> same = SingleRank();
  o.*lane = same;
  e = EngineCore::Create(BaseConfig(), same, Groups(InitialParams()), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find(name + " is the engine's communicator itself"),
            std::string::npos)
      << e.status();
}

TEST(LanesTest, AReduceLaneOverOtherRanksIsRefused) {
  ExpectLaneRefused(&EngineOptions::reduce_comm, "reduce_comm");
}

TEST(LanesTest, AGatherLaneThatIsNotAnotherCommunicatorOverTheRanksIsRefused) {
  ExpectLaneRefused(&EngineOptions::gather_comm, "gather_comm");
  EngineOptions o = TestOptions();
  std::shared_ptr<comm::Communicator> lane = SingleRank();
  o.gather_comm = lane;
  o.reduce_comm = lane;
  Result<std::unique_ptr<EngineCore>> e =
      EngineCore::Create(BaseConfig(), SingleRank(), Groups(InitialParams()), o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("reduce_comm and gather_comm are one communicator"),
            std::string::npos)
      << e.status();
  o.reduce_comm = SingleRank();  // two lanes of their own: fine
  e = EngineCore::Create(BaseConfig(), SingleRank(), Groups(InitialParams()), o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE((*e)->stats().gather_lane);
  EXPECT_TRUE((*e)->stats().reduce_lane);
}

// The order a lane gets (engine/device/lane.h): a communicator that issues on a device
// stream is ordered by stream waits on it; a host one by queueing on the device when the lane
// is its own, else by the host. The same on every rank: it depends on the communicator and
// the options only.
TEST(CollectiveLaneTest, TheOrderFollowsTheCommunicatorAndWhetherTheLaneIsItsOwn) {
  CpuDeviceOptions dopts;
  dopts.budget_bytes = 1 << 16;
  std::unique_ptr<Device> dev = *MakeCpuDevice(dopts);
  auto host = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(1), 0);
  EXPECT_EQ((*CollectiveLane::Create(dev.get(), host.get(), true, "a"))->order(),
            LaneOrder::kQueued);
  EXPECT_EQ((*CollectiveLane::Create(dev.get(), host.get(), false, "b"))->order(),
            LaneOrder::kHost);
  const StreamId theirs = *dev->CreateStream("the communicator's");
  host->set_native_stream(*dev->NativeStream(theirs));
  for (const bool exclusive : {false, true}) {
    EXPECT_EQ((*CollectiveLane::Create(dev.get(), host.get(), exclusive, "c"))->order(),
              LaneOrder::kStream);
  }
  int foreign = 0;
  host->set_native_stream(&foreign);
  Result<std::unique_ptr<CollectiveLane>> bad =
      CollectiveLane::Create(dev.get(), host.get(), true, "d");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("the communicator's stream"), std::string::npos)
      << bad.status();
}

// A queued lane runs a collective after its inputs' event on the device, and a consumer
// ordered after it sees the result: a reduce-scatter (one rank: a copy) of a buffer a
// delayed copy fills. Without the inputs' wait the collective reads the buffer too early.
int QueuedLaneReadsWrong(bool skip_inputs_wait) {
  CpuDeviceOptions dopts;
  dopts.budget_bytes = 1 << 20;
  dopts.delaying = true;
  dopts.seed = 35;
  std::unique_ptr<Device> dev = *MakeCpuDevice(dopts);
  auto comm = std::make_shared<ThreadCommunicator>(std::make_shared<ThreadGroup>(1), 0);
  std::unique_ptr<CollectiveLane> lane = *CollectiveLane::Create(dev.get(), comm.get(), true, "r");
  const size_t n = 1024;
  std::vector<float> src(n);
  EXPECT_TRUE(dev->RegisterHost(src.data(), n * 4).ok());
  auto* full = static_cast<float*>(*dev->allocator()->Allocate(n * 4));
  auto* shard = static_cast<float*>(*dev->allocator()->Allocate(n * 4));
  const StreamId copies = *dev->CreateStream("copies");
  int wrong = 0;
  for (int round = 1; round <= 20; ++round) {
    std::fill(src.begin(), src.end(), static_cast<float>(round));
    EXPECT_TRUE(dev->CopyAsync(full, src.data(), n * 4, CopyKind::kHostToDevice, copies).ok());
    const EventId written = *dev->Record(copies);
    Result<LaneCollective> c = lane->Issue(
        written, HostWait::kBucketInputs,
        [full, shard, n](comm::Communicator& cm) {
          return cm.ReduceScatterAsync(full, shard, n, comm::DType::kFloat32, comm::ReduceOp::kAvg);
        },
        skip_inputs_wait);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) break;
    EXPECT_TRUE(c->done.valid());
    EXPECT_TRUE(lane->OrderBefore(*c, kComputeStream, /*host_reads=*/false).ok());
    EXPECT_TRUE(c->work->Wait().ok());
    if (shard[n - 1] != static_cast<float>(round)) ++wrong;
    // The source is rewritten next round: the copy has to be done with it.
    EXPECT_TRUE(dev->Synchronize(written, HostWait::kOther).ok());
  }
  EXPECT_EQ(dev->stats().host_waits[static_cast<size_t>(HostWait::kBucketInputs)], 0u);
  dev->allocator()->Free(full, n * 4);
  dev->allocator()->Free(shard, n * 4);
  EXPECT_TRUE(dev->UnregisterHost(src.data()).ok());
  return wrong;
}

TEST(CollectiveLaneTest, AQueuedLaneRunsAfterItsInputsOnTheDevice) {
  EXPECT_EQ(QueuedLaneReadsWrong(false), 0);
}

TEST(CollectiveLaneTest, AsyncDeviceWithoutTheLanesInputsWaitGoesWrong) {
  EXPECT_GT(QueuedLaneReadsWrong(true), 0)
      << "without the wait the lane still read the inputs: the delaying device did not expose "
         "the missing wait";
}

}  // namespace
}  // namespace strata::engine
