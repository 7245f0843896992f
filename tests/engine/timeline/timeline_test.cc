// The engine's phases, its timeline and the Chrome trace, and the reducer's
// count of reductions left in flight beside the backward. Checked on order and counts,
// never on how long anything took.
#include "strata/engine/timeline/timeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "../../swap/test_util.h"
#include "temp_dir.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

Config OverlapConfig(bool overlap) {
  Config c = BaseConfig();
  c.zero.overlap_comm = overlap;
  c.zero.reduce_bucket_size = kD * kD + kD;  // one layer group per bucket
  return c;
}

void TrainSteps(EngineCore& e, int first, int steps) {
  for (int s = first; s < first + steps; ++s) {
    ASSERT_TRUE(EngineMicroStep(e, Seq(s), MakeBatch(s)).ok());
    ASSERT_TRUE(e.Step().ok());
  }
}

std::vector<TimelineEvent> Named(const std::vector<TimelineEvent>& ev, TimelineLane lane,
                                 const std::string& name) {
  std::vector<TimelineEvent> out;
  for (const TimelineEvent& e : ev)
    if (e.lane == lane && e.name == name) out.push_back(e);
  return out;
}

bool Inside(const TimelineEvent& inner, const TimelineEvent& outer) {
  return inner.start_us >= outer.start_us &&
         inner.start_us + inner.duration_us <= outer.start_us + outer.duration_us + 1e-3;
}

TEST(TimelineTest, PhasesGroupsReductionsAndOptimizerPassesInOrder) {
  std::unique_ptr<EngineCore> e = MakeEngine(OverlapConfig(true), SingleRank(), InitialParams());
  ASSERT_TRUE(e != nullptr);
  TrainSteps(*e, 0, 1);
  EXPECT_TRUE(e->TakeTimeline().empty()) << "recorded while off";
  e->EnableTimeline(true);
  TrainSteps(*e, 1, 2);
  const std::vector<TimelineEvent> ev = e->TakeTimeline();
  EXPECT_TRUE(e->TakeTimeline().empty()) << "not taken";

  std::vector<TimelineEvent> phases;
  for (const TimelineEvent& x : ev)
    if (x.lane == TimelineLane::kPhase) phases.push_back(x);
  ASSERT_EQ(phases.size(), 6u);
  for (size_t i = 0; i < phases.size(); ++i) {
    EXPECT_EQ(phases[i].name, (std::vector<std::string>{"forward", "backward", "step"})[i % 3]);
    if (i > 0) {
      EXPECT_LE(phases[i - 1].start_us + phases[i - 1].duration_us, phases[i].start_us);
    }
  }
  for (int k = 1; k <= kLayers; ++k) {
    const std::string name = "layer" + std::to_string(k);
    const auto fw = Named(ev, TimelineLane::kCompute, "forward " + name);
    const auto bw = Named(ev, TimelineLane::kCompute, "backward " + name);
    const auto rs = Named(ev, TimelineLane::kComm, "reduce-scatter " + name);
    const auto ag = Named(ev, TimelineLane::kComm, "all-gather " + name);
    ASSERT_EQ(fw.size(), 2u) << name;
    ASSERT_EQ(bw.size(), 2u) << name;
    ASSERT_EQ(rs.size(), 2u) << name;
    EXPECT_GE(ag.size(), 2u) << name;
    for (int s = 0; s < 2; ++s) {
      const TimelineEvent& f = phases[static_cast<size_t>(3 * s)];
      const TimelineEvent& b = phases[static_cast<size_t>(3 * s + 1)];
      EXPECT_TRUE(Inside(fw[static_cast<size_t>(s)], f)) << name << " step " << s;
      EXPECT_TRUE(Inside(bw[static_cast<size_t>(s)], b)) << name << " step " << s;
      EXPECT_EQ(fw[static_cast<size_t>(s)].index, k);
      // The layer's reduce-scatter was issued inside the backward, after its own backward
      // (its gradients) and before the backward ended.
      const TimelineEvent& r = rs[static_cast<size_t>(s)];
      EXPECT_GE(r.start_us, bw[static_cast<size_t>(s)].start_us) << name;
      EXPECT_LT(r.start_us, b.start_us + b.duration_us) << name << " step " << s;
    }
  }
  size_t passes = 0;
  std::vector<TimelineEvent> norms;
  for (const TimelineEvent& x : ev) {
    EXPECT_GE(x.duration_us, 0.0) << x.name;
    if (x.lane == TimelineLane::kOptimizer) {
      EXPECT_EQ(x.index, -1);
      if (x.name == "gradient norm") {
        norms.push_back(x);
        continue;
      }
      // The pipelined step (the default here): one span per group, named after it.
      EXPECT_EQ(x.name.rfind("CPU optimizer step of ", 0), 0u) << x.name;
      ++passes;
    }
  }
  EXPECT_GT(passes, 0u);
  // Each step's own gradient norm (the tiles left to it), inside its step phase.
  ASSERT_EQ(norms.size(), 2u);
  for (size_t s = 0; s < norms.size(); ++s)
    EXPECT_TRUE(Inside(norms[s], phases[3 * s + 2])) << "step " << s;

  const EngineStats st = e->stats();
  EXPECT_EQ(st.phases.forwards, 3);
  EXPECT_EQ(st.phases.backwards, 3);
  EXPECT_EQ(st.phases.steps, 3);
  EXPECT_GT(st.phases.backward_s, 0.0);
  // Every layer's bucket went during the backward and stayed in flight beside it.
  EXPECT_GE(st.reducer.buckets_launched_in_backward, 3u * kLayers);
  EXPECT_EQ(st.reducer.buckets_overlapping_backward, st.reducer.buckets_launched_in_backward);

  // The Chrome trace: the lanes named, every span a complete event of this rank.
  testing::TempDir dir;
  const std::string path = dir.File("trace.json");
  ASSERT_TRUE(WriteChromeTrace(path, ev, 3).ok());
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  std::map<std::string, int> lanes;
  size_t spans = 0;
  for (const auto& x : doc.at("traceEvents")) {
    EXPECT_EQ(x.at("pid"), 3);
    if (x.at("ph") == "M" && x.at("name") == "thread_name") {
      lanes[x.at("args").at("name")] = x.at("tid");
    } else if (x.at("ph") == "X") {
      ++spans;
      EXPECT_EQ(lanes.at(x.at("cat")), x.at("tid"));
    }
  }
  EXPECT_EQ(lanes.size(), 6u);  // phase, compute, wait, comm, optimizer, nvme
  EXPECT_EQ(spans, ev.size());
  EXPECT_FALSE(WriteChromeTrace(dir.File("no/such/dir/t.json"), ev, 0).ok());
}

// The scope observer (what the LibTorch layer turns into profiler ranges) sees each timed
// scope begin and end on the thread that runs it, properly nested, with the name the
// timeline gives the span: one begin per timeline span of this thread's waits.
struct ObservedScopes {
  std::mutex mu;
  std::map<std::string, int> begun;
  int open = 0;
  int max_open = 0;
  std::thread::id main;
  int other_threads = 0;
};
ObservedScopes* observed = nullptr;

void* ObserveBegin(const char* name) {
  std::lock_guard<std::mutex> lock(observed->mu);
  if (std::this_thread::get_id() != observed->main) {
    ++observed->other_threads;
    return nullptr;  // nothing opened: end() is not called for it
  }
  ++observed->begun[name];
  observed->max_open = std::max(observed->max_open, ++observed->open);
  return observed;
}

void ObserveEnd(void* token) {
  EXPECT_EQ(token, observed);
  std::lock_guard<std::mutex> lock(observed->mu);
  --observed->open;
}

TEST(TimelineTest, ScopeObserverSeesEveryWaitSpanOfItsThread) {
  std::unique_ptr<EngineCore> e = MakeEngine(OverlapConfig(true), SingleRank(), InitialParams());
  ASSERT_TRUE(e != nullptr);
  TrainSteps(*e, 0, 1);
  ObservedScopes scopes;
  scopes.main = std::this_thread::get_id();
  observed = &scopes;
  static constexpr ScopeObserver kObserver{&ObserveBegin, &ObserveEnd};
  SetScopeObserver(&kObserver);
  e->EnableTimeline(true);
  TrainSteps(*e, 1, 2);
  SetScopeObserver(nullptr);
  const std::vector<TimelineEvent> ev = e->TakeTimeline();
  TrainSteps(*e, 3, 1);  // none observed once removed
  observed = nullptr;

  std::map<std::string, int> waits;
  for (const TimelineEvent& t : ev)
    if (t.lane == TimelineLane::kWait) ++waits[t.name];
  ASSERT_FALSE(waits.empty());
  EXPECT_TRUE(waits.count("all-gather wait")) << "no all-gather wait span";
  for (const auto& [name, n] : waits)
    EXPECT_EQ(scopes.begun[name], n) << name;
  EXPECT_EQ(scopes.open, 0);
  EXPECT_GE(scopes.max_open, 1);
  int begun = 0;
  for (const auto& [name, n] : scopes.begun)
    begun += n;
  EXPECT_GT(begun, 0);
}

TEST(TimelineTest, WithOneBucketEachReductionIsWaitedForAtOnce) {
  std::unique_ptr<EngineCore> e = MakeEngine(OverlapConfig(false), SingleRank(), InitialParams());
  ASSERT_TRUE(e != nullptr);
  TrainSteps(*e, 0, 2);
  const ReducerStats r = e->stats().reducer;
  EXPECT_GE(r.buckets_launched_in_backward, 2u * kLayers);
  EXPECT_EQ(r.buckets_overlapping_backward, 0u);
}

TEST(TimelineTest, NvmeReadsAndWritesInFlightOnTheirLane) {
  swap::testing::ScratchDir dir;
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.offload_optimizer.nvme_path = {dir.path()};
  c.zero.offload_optimizer.buffer_count = 4;  // fewer buffers than chunks: every step swaps
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = {dir.path()};
  c.zero.offload_param.buffer_count = 2;
  c.zero.offload_param.max_in_cpu = 0;
  c.aio.block_size = 4096;
  std::unique_ptr<EngineCore> e = MakeEngine(c, SingleRank(), InitialParams());
  ASSERT_TRUE(e != nullptr);
  // From the first step: its forward reads every shard from NVMe. (After a pipelined step
  // the forward reads none: each new shard is handed to the store as its group opens, and
  // this toy's groups stay gathered until the step.)
  e->EnableTimeline(true);
  TrainSteps(*e, 0, 3);
  // Off before taking: the last step's update may still be running beside us (the step is
  // pipelined), and what it records while the timeline is on is kept for the next Take.
  e->EnableTimeline(false);
  const std::vector<TimelineEvent> ev = e->TakeTimeline();
  std::map<std::string, int> by_name;
  for (const TimelineEvent& x : ev) {
    if (x.lane != TimelineLane::kNvme) continue;
    ++by_name[x.name];
    EXPECT_GE(x.index, 0) << x.name;
    EXPECT_GE(x.duration_us, 0.0) << x.name;
  }
  // The optimizer's states and the working shards, read and written.
  EXPECT_GT(by_name["NVMe read: fp32 master parameters"], 0);
  EXPECT_GT(by_name["NVMe write: fp32 master parameters"], 0);
  EXPECT_GT(by_name["NVMe write: Adam exp_avg (m)"], 0);
  int shard_reads = 0, shard_writes = 0;
  for (const auto& [name, n] : by_name) {
    if (name.rfind("NVMe read: working shard of group ", 0) == 0) shard_reads += n;
    if (name.rfind("NVMe write: working shard of group ", 0) == 0) shard_writes += n;
  }
  EXPECT_GT(shard_reads, 0);
  EXPECT_GT(shard_writes, 0);
  // Off: nothing more is recorded, by this thread or the update's worker.
  TrainSteps(*e, 3, 2);
  EXPECT_TRUE(e->TakeTimeline().empty());
}

}  // namespace
}  // namespace strata::engine
