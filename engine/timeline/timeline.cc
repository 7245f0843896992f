#include "strata/engine/timeline/timeline.h"

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>

namespace strata::engine {

std::string_view TimelineLaneName(TimelineLane lane) {
  switch (lane) {
    case TimelineLane::kPhase:
      return "phase";
    case TimelineLane::kCompute:
      return "compute";
    case TimelineLane::kWait:
      return "wait";
    case TimelineLane::kComm:
      return "comm";
    case TimelineLane::kOptimizer:
      return "optimizer";
    case TimelineLane::kNvme:
      return "nvme";
  }
  return "?";
}

void Timeline::Add(std::string name, TimelineLane lane, Clock::time_point begin,
                   Clock::time_point end, int index) {
  if (!enabled()) return;
  TimelineEvent e;
  e.name = std::move(name);
  e.lane = lane;
  e.start_us = std::chrono::duration<double, std::micro>(begin - origin_).count();
  e.duration_us = std::chrono::duration<double, std::micro>(end - begin).count();
  e.index = index;
  e.micro_step = micro_step_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled()) return;  // disabled since the check above
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  events_.push_back(std::move(e));
}

std::vector<TimelineEvent> Timeline::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TimelineEvent> out = std::move(events_);
  events_.clear();
  return out;
}

uint64_t Timeline::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

namespace {
std::atomic<const ScopeObserver*> scope_observer{nullptr};
}  // namespace

void SetScopeObserver(const ScopeObserver* observer) {
  scope_observer.store(observer, std::memory_order_release);
}

const ScopeObserver* GetScopeObserver() {
  return scope_observer.load(std::memory_order_acquire);
}

TimedScope::~TimedScope() {
  const Timeline::Clock::time_point end = Timeline::Clock::now();
  total_ += std::chrono::duration<double>(end - start_).count();
  if (timeline_ != nullptr && timeline_->enabled())
    timeline_->Add(name_, lane_, start_, end, index_);
  if (range_ != nullptr) observer_->end(range_);
}

Status WriteChromeTrace(const std::string& path, const std::vector<TimelineEvent>& events, int rank,
                        uint64_t dropped) {
  using Json = nlohmann::ordered_json;
  Json trace = Json::array();
  trace.push_back({{"name", "process_name"},
                   {"ph", "M"},
                   {"pid", rank},
                   {"tid", 0},
                   {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (const TimelineLane lane : kTimelineLanes) {
    const int tid = static_cast<int>(lane);
    trace.push_back({{"name", "thread_name"},
                     {"ph", "M"},
                     {"pid", rank},
                     {"tid", tid},
                     {"args", {{"name", std::string(TimelineLaneName(lane))}}}});
    trace.push_back({{"name", "thread_sort_index"},
                     {"ph", "M"},
                     {"pid", rank},
                     {"tid", tid},
                     {"args", {{"sort_index", tid}}}});
  }
  for (const TimelineEvent& e : events) {
    Json j = {{"name", e.name},
              {"cat", std::string(TimelineLaneName(e.lane))},
              {"ph", "X"},
              {"ts", e.start_us},
              {"dur", e.duration_us},
              {"pid", rank},
              {"tid", static_cast<int>(e.lane)}};
    Json args = {{"micro_step", e.micro_step}};
    if (e.index >= 0) {
      args[e.lane == TimelineLane::kOptimizer ? "sub_group"
           : e.lane == TimelineLane::kNvme    ? "chunk"
                                              : "group"] = e.index;
    }
    j["args"] = std::move(args);
    trace.push_back(std::move(j));
  }
  Json doc = {{"traceEvents", std::move(trace)}, {"displayTimeUnit", "ms"}};
  if (dropped > 0) doc["otherData"] = {{"dropped_events", dropped}};
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return ErrnoError(errno, "writing the trace " + tmp);
  const std::string text = doc.dump();
  const bool wrote = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !wrote) {
    std::remove(tmp.c_str());
    return ErrnoError(wrote ? errno : err, "writing the trace " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    return ErrnoError(e, "renaming the trace to " + path);
  }
  return Status::Ok();
}

}  // namespace strata::engine
