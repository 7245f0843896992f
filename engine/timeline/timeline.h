// Timeline: what the engine's thread did and waited for, as timed spans, for a
// Chrome/Perfetto trace (WriteChromeTrace) and per-step phase figures.
//
// Off by default: a disabled timeline records nothing and costs one branch per span. When
// enabled (EngineCore::EnableTimeline) every span is kept, up to kMaxEvents; later ones are
// counted in dropped(). Lanes group the spans as a trace viewer shows them:
//   phase      forward, backward, step: one span each per micro-step / Step() call
//   compute    a group's module between its Pre* and Post* call ("forward layer3")
//   wait       the engine's thread blocked: all-gather, shard staging, compute before a
//              reduction, reduction, reduced-shard copy, working-shard push
//   comm       a collective from its issue to the end of the wait for it (all-gathers and
//              reduce-scatters: how long each was in flight beside the compute)
//   optimizer  each CPU-Adam pass of a sub-group (a pipelined step's: "CPU optimizer step of
//              <group>", one per group, recorded when the update completes)
//   nvme       each NVMe state store read and write from its submission to its completion
//              being seen ("NVMe read: <state>", index = the chunk): the swap traffic in
//              flight beside the compute (the waits for it are in the store's statistics)
// Times are microseconds since the timeline was created (steady clock).
// Thread-safety: Add, Take, dropped and the setters may be called from any thread (the
// engine's thread records its spans; a pipelined step's worker streaming states through
// an NVMe store reports that store's reads and writes).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::engine {

enum class TimelineLane : uint8_t { kPhase, kCompute, kWait, kComm, kOptimizer, kNvme };
inline constexpr TimelineLane kTimelineLanes[] = {TimelineLane::kPhase,     TimelineLane::kCompute,
                                                  TimelineLane::kWait,      TimelineLane::kComm,
                                                  TimelineLane::kOptimizer, TimelineLane::kNvme};
std::string_view TimelineLaneName(TimelineLane lane);  // "phase", "compute", ...

struct TimelineEvent {
  std::string name;
  TimelineLane lane = TimelineLane::kPhase;
  double start_us = 0;
  double duration_us = 0;
  // The parameter group (compute, wait and comm lanes), the optimizer's sub-group (its
  // lane), the chunk (nvme lane); -1: none.
  int index = -1;
  int64_t micro_step = 0;  // the engine's micro-steps completed when it started
};

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxEvents = size_t{1} << 20;

  Timeline() : origin_(Clock::now()) {}
  // Once Enable(false) returns, no thread's Add records anything more (Add checks again
  // under the lock this takes).
  void Enable(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_.store(on, std::memory_order_relaxed);
  }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void set_micro_step(int64_t s) { micro_step_.store(s, std::memory_order_relaxed); }

  void Add(std::string name, TimelineLane lane, Clock::time_point begin, Clock::time_point end,
           int index = -1);
  // The events recorded so far (and forgets them).
  std::vector<TimelineEvent> Take();
  uint64_t dropped() const;

 private:
  const Clock::time_point origin_;
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> micro_step_{0};
  mutable std::mutex mu_;
  std::vector<TimelineEvent> events_;  // guarded by mu_
  uint64_t dropped_ = 0;               // guarded by mu_
};

// Live ranges for a profiler: told, on the thread that runs it, when each TimedScope
// begins and ends. The LibTorch layer installs one that opens torch.profiler ranges and NVTX
// ranges (engine/libtorch/profiler_ranges.h); this layer stays free of LibTorch.
struct ScopeObserver {
  void* (*begin)(const char* name);  // a token for end(); nullptr: nothing was opened
  void (*end)(void* token);
};
// Installs `observer` (static storage; nullptr: none) for the scopes that begin from now on.
void SetScopeObserver(const ScopeObserver* observer);
const ScopeObserver* GetScopeObserver();

// Adds its scope's wall seconds to `total` (a statistic) and, when `timeline` is enabled,
// records the scope as a span; a range of the scope observer's while it runs.
class TimedScope {
 public:
  TimedScope(double& total, Timeline* timeline, const char* name, TimelineLane lane, int index = -1)
      : total_(total),
        timeline_(timeline),
        name_(name),
        lane_(lane),
        index_(index),
        observer_(GetScopeObserver()),
        range_(observer_ != nullptr ? observer_->begin(name) : nullptr),
        start_(Timeline::Clock::now()) {}
  ~TimedScope();
  TimedScope(const TimedScope&) = delete;
  TimedScope& operator=(const TimedScope&) = delete;

 private:
  double& total_;
  Timeline* timeline_;
  const char* name_;
  TimelineLane lane_;
  int index_;
  const ScopeObserver* observer_;
  void* range_;
  Timeline::Clock::time_point start_;
};

// Writes `events` of rank `rank` as Chrome trace-event JSON (the format chrome://tracing
// and Perfetto open): complete events ("ph": "X"), pid = rank, one tid per lane, named.
// The file is written to a temporary name and renamed, so a reader never sees half of it.
Status WriteChromeTrace(const std::string& path, const std::vector<TimelineEvent>& events, int rank,
                        uint64_t dropped = 0);

}  // namespace strata::engine
