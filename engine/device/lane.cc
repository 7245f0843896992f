#include "strata/engine/device/lane.h"

#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>

namespace strata::engine {

std::string_view LaneOrderName(LaneOrder order) {
  switch (order) {
    case LaneOrder::kStream:
      return "stream";
    case LaneOrder::kQueued:
      return "queued";
    case LaneOrder::kHost:
      return "host";
  }
  return "?";
}

namespace {

// A collective run as host work queued on the lane's stream: done once that work ran (the
// collective issued and waited for there).
class QueuedWork final : public comm::Work {
 public:
  void Run(comm::Communicator& comm, const CollectiveLane::IssueFn& issue) {
    comm::WorkPtr work = issue(comm);
    Status s = work != nullptr ? work->Wait()
                               : InternalError("collective lane: the issue returned no work");
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(s);
      done_ = true;
    }
    cv_.notify_all();
  }

  // Without a timeout: bounded by the device reaching the queued work (its inputs' events)
  // and by the communicator's own timeout on the collective.
  Status Wait(std::optional<std::chrono::milliseconds> timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (timeout.has_value()) {
      if (!cv_.wait_for(lock, *timeout, [&] { return done_; })) {
        return DeadlineExceededError("collective lane: a queued collective not done after " +
                                     std::to_string(timeout->count()) + " ms");
      }
    } else {
      cv_.wait(lock, [&] { return done_; });
    }
    return status_;
  }

  bool IsCompleted() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  Status status_;
};

}  // namespace

Result<std::unique_ptr<CollectiveLane>> CollectiveLane::Create(Device* device,
                                                               comm::Communicator* comm,
                                                               bool exclusive,
                                                               const std::string& name) {
  if (device == nullptr || comm == nullptr) {
    return InvalidArgumentError("CollectiveLane: null device or communicator");
  }
  if (void* native = comm->native_stream(); native != nullptr) {
    Result<StreamId> stream = device->AdoptStream(native);
    if (!stream.ok()) {
      return stream.status().WithContext("collective lane " + name + ": the communicator's stream");
    }
    return std::unique_ptr<CollectiveLane>(
        new CollectiveLane(device, comm, LaneOrder::kStream, *stream));
  }
  if (!exclusive) {
    return std::unique_ptr<CollectiveLane>(
        new CollectiveLane(device, comm, LaneOrder::kHost, StreamId{}));
  }
  STRATA_ASSIGN_OR_RETURN(StreamId stream, device->CreateStream(name));
  return std::unique_ptr<CollectiveLane>(
      new CollectiveLane(device, comm, LaneOrder::kQueued, stream));
}

Result<LaneCollective> CollectiveLane::Issue(EventId inputs, HostWait why, IssueFn issue,
                                             bool skip_inputs_wait) {
  LaneCollective c;
  const bool wait = inputs.valid() && !skip_inputs_wait;
  if (order_ == LaneOrder::kHost) {
    if (wait) STRATA_RETURN_IF_ERROR(device_->Synchronize(inputs, why));
    c.work = issue(*comm_);
    return c;
  }
  if (wait) STRATA_RETURN_IF_ERROR(device_->Wait(stream_, inputs));
  if (order_ == LaneOrder::kStream) {
    c.work = issue(*comm_);
  } else {
    auto work = std::make_shared<QueuedWork>();
    STRATA_RETURN_IF_ERROR(device_->LaunchHostFunc(
        stream_, [work, comm = comm_, fn = std::move(issue)] { work->Run(*comm, fn); }));
    c.work = std::move(work);
  }
  STRATA_ASSIGN_OR_RETURN(c.done, device_->Record(stream_));
  return c;
}

Status CollectiveLane::OrderBefore(const LaneCollective& c, StreamId consumer, bool host_reads) {
  if (!c) return FailedPreconditionError("collective lane: no collective to order after");
  if (host_reads || !c.done.valid()) return c.work->Wait();
  return device_->Wait(consumer, c.done);
}

}  // namespace strata::engine
