// PhaseClock (phase_clock.h): the phases, spans and host waits EngineCore measures.
#include "strata/engine/runtime/phase_clock.h"

#include <chrono>
#include <string>

namespace strata::engine {

PhaseClock::PhaseClock(const ModelPartition& partition) : partition_(partition) {
  for (auto& begins : span_begin_)
    begins.resize(static_cast<size_t>(partition_.num_groups()));
}

void PhaseClock::Enter(Phase phase) {
  if (phase_ == phase) return;
  if (phase == Phase::kForward && phase_ == Phase::kBackward) return;  // a recompute
  if (phase_ == Phase::kForward) End("forward");
  phase_ = phase;
  phase_begin_ = Timeline::Clock::now();
}

void PhaseClock::End(const char* name) {
  if (phase_ == Phase::kIdle) return;
  const Timeline::Clock::time_point now = Timeline::Clock::now();
  const double secs = std::chrono::duration<double>(now - phase_begin_).count();
  if (phase_ == Phase::kForward) {
    phases_.forward_s += secs;
    ++phases_.forwards;
  } else {
    phases_.backward_s += secs;
    ++phases_.backwards;
  }
  timeline_.Add(name, TimelineLane::kPhase, phase_begin_, now);
  phase_ = Phase::kIdle;
}

void PhaseClock::OpenSpan(int group, int backward) {
  if (!timeline_.enabled() || group < 0 || group >= partition_.num_groups()) return;
  span_begin_[backward][static_cast<size_t>(group)] = Timeline::Clock::now();
}

void PhaseClock::CloseSpan(int group, int backward) {
  if (!timeline_.enabled() || group < 0 || group >= partition_.num_groups()) return;
  timeline_.Add((backward != 0 ? "backward " : "forward ") +
                    partition_.groups[static_cast<size_t>(group)].name,
                TimelineLane::kCompute, span_begin_[backward][static_cast<size_t>(group)],
                Timeline::Clock::now(), group);
}

void PhaseClock::EndStep(Timeline::Clock::time_point began, bool applied,
                         const std::array<uint64_t, kHostWaitKinds>& host_waits) {
  const Timeline::Clock::time_point ended = Timeline::Clock::now();
  phases_.step_s += std::chrono::duration<double>(ended - began).count();
  ++phases_.steps;
  timeline_.Add(applied ? "step" : "step (no update)", TimelineLane::kPhase, began, ended);
  for (size_t i = 0; i < host_waits.size(); ++i)
    host_waits_last_step_[i] = host_waits[i] - host_waits_at_step_[i];
  host_waits_at_step_ = host_waits;
}

void PhaseClock::NoteNvmeEvent(bool params, const offload::StateStore* store,
                               const offload::StateEvent& ev) {
  std::lock_guard<std::mutex> lock(nvme_mu_);
  const bool read =
      ev.kind == offload::StateEvent::kReadSubmitted || ev.kind == offload::StateEvent::kReadDone;
  const bool submitted = ev.kind == offload::StateEvent::kReadSubmitted ||
                         ev.kind == offload::StateEvent::kWriteSubmitted;
  const NvmeKey key{params, read, ev.range.state.value, ev.range.chunk};
  if (submitted) {
    if (timeline_.enabled()) nvme_in_flight_[key] = Timeline::Clock::now();
    return;
  }
  auto it = nvme_in_flight_.find(key);
  if (it == nvme_in_flight_.end()) return;  // submitted while the timeline was off
  timeline_.Add(std::string(read ? "NVMe read: " : "NVMe write: ") +
                    (store != nullptr ? store->state_name(ev.range.state) : std::string("?")),
                TimelineLane::kNvme, it->second, Timeline::Clock::now(),
                static_cast<int>(ev.range.chunk));
  nvme_in_flight_.erase(it);
}

}  // namespace strata::engine
