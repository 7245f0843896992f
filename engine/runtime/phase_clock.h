// PhaseClock: what EngineCore measures of its own calls. The phases its calls delimit
// (forward, backward, step: PhaseStats), each group's forward and backward as spans on the
// timeline's compute lane, the NVMe stores' reads and writes as spans on its nvme lane, and
// the device's host waits of the last Step() cycle. It owns the Timeline every component
// records into (EngineCore::EnableTimeline, TakeTimeline).
//
// Ownership and lifetime: owns the timeline and the bookkeeping above; reads the partition
// (the groups' names), which must outlive it. EngineCore declares it before every component
// that records into the timeline (they hold a pointer to it).
// Thread-safety: the engine's thread, except NoteNvmeEvent (any thread: a pipelined step's
// worker reports the optimizer store's I/O from its own; guarded by a mutex) and the
// timeline itself (timeline.h).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "strata/engine/device/device.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/timeline/timeline.h"
#include "strata/offload/cpu/state_store.h"

namespace strata::engine {

class PhaseClock {
 public:
  enum class Phase : uint8_t { kIdle, kForward, kBackward };

  explicit PhaseClock(const ModelPartition& partition);
  PhaseClock(const PhaseClock&) = delete;
  PhaseClock& operator=(const PhaseClock&) = delete;

  Timeline& timeline() { return timeline_; }
  const Timeline& timeline() const { return timeline_; }

  // The phase the engine's calls are in. Enter begins one (a forward entered during a
  // backward is a recompute, part of the backward; entering another phase ends a forward);
  // End records the phase under way as `name` and makes the clock idle; Reset makes it idle
  // without recording (an iteration made void).
  Phase phase() const { return phase_; }
  void Enter(Phase phase);
  void End(const char* name);
  void Reset() { phase_ = Phase::kIdle; }
  // Group g's forward (`backward` 0) or backward (1) as a span on the compute lane, from
  // OpenSpan to CloseSpan (the timeline on).
  void OpenSpan(int group, int backward);
  void CloseSpan(int group, int backward);

  // A Step() from `began` to now: its phase, and the host waits of the cycle that ends here
  // (`host_waits`: the device's counters now). StartCycle begins the first cycle (Create).
  void EndStep(Timeline::Clock::time_point began, bool applied,
               const std::array<uint64_t, kHostWaitKinds>& host_waits);
  void StartCycle(const std::array<uint64_t, kHostWaitKinds>& host_waits) {
    host_waits_at_step_ = host_waits;
  }

  // An NVMe store's read or write (`params`: the working shards' store, else the
  // optimizer's; `store` names its states): a span from submission to completion on the
  // nvme lane, for the I/O submitted while the timeline is on.
  void NoteNvmeEvent(bool params, const offload::StateStore* store, const offload::StateEvent& ev);

  const PhaseStats& phases() const { return phases_; }
  const std::array<uint64_t, kHostWaitKinds>& host_waits_last_step() const {
    return host_waits_last_step_;
  }

 private:
  const ModelPartition& partition_;
  Timeline timeline_;
  Phase phase_ = Phase::kIdle;
  Timeline::Clock::time_point phase_begin_;
  PhaseStats phases_;
  std::vector<Timeline::Clock::time_point> span_begin_[2];     // per group: forward, backward
  std::array<uint64_t, kHostWaitKinds> host_waits_at_step_{};  // at the last Step()'s return
  std::array<uint64_t, kHostWaitKinds> host_waits_last_step_{};
  // NVMe reads and writes in flight (the timeline on): (params store, read, state, chunk).
  using NvmeKey = std::tuple<bool, bool, uint32_t, size_t>;
  std::mutex nvme_mu_;
  std::map<NvmeKey, Timeline::Clock::time_point> nvme_in_flight_;  // guarded by nvme_mu_
};

}  // namespace strata::engine
