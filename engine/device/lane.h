// A collective lane (docs/engine.md, "Lanes" and "Every wait of a step"): one communicator's
// collectives, ordered against the device's streams. The engine's reductions and all-gathers
// each go through one; a collective takes the event its inputs are ready at and returns the
// event of its completion, so the streams that produce its inputs and consume its outputs
// are ordered with it on the device, not by the host.
//
//   kStream  the communicator issues on a device stream of its own (NCCL,
//            Communicator::native_stream): the stream waits on the device for the inputs'
//            event, the collective is issued on it, and the completion event is recorded on
//            it. The host never waits for the inputs.
//   kQueued  a host communicator (gloo) that carries this lane's collectives only: each runs
//            as host work queued on a device stream of the lane's (Device::LaunchHostFunc),
//            after a device-side wait for its inputs, and the completion event is recorded
//            after it. On the CPU device this is the same order as kStream's, so the
//            delaying device's tests exercise the device-ordered path.
//   kHost    a host communicator shared with other collectives (the engine's own, which the
//            caller may use between the engine's calls): queued work would issue at a time
//            of the worker's choosing, in a different order on different ranks. The host
//            waits for the inputs (a named HostWait) and issues at once; there is no
//            completion event, so a consumer waits for the Work on the host.
//
// Every rank picks the same kind (from the communicator's backend and whether the lane is
// exclusive: the same on every rank), and issues each lane's collectives in the same order.
// Errors: a collective's status is its Work's; a consumer ordered on the device must still
// check the Work (Check) before what it computed from the result is committed.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "strata/comm/communicator.h"
#include "strata/core/status.h"
#include "strata/engine/device/device.h"

namespace strata::engine {

enum class LaneOrder : uint8_t { kStream, kQueued, kHost };
std::string_view LaneOrderName(LaneOrder order);  // "stream", "queued", "host"

// One collective issued on a lane.
struct LaneCollective {
  comm::WorkPtr work;  // its status (kQueued: done once the queued host work ran)
  EventId done;        // the device point after it; invalid for kHost
  explicit operator bool() const { return work != nullptr; }
};

class CollectiveLane {
 public:
  // `exclusive`: the communicator carries this lane's collectives only (no one else issues
  // on it), which a host communicator needs to be queued. `name` names the lane's stream.
  static Result<std::unique_ptr<CollectiveLane>> Create(Device* device, comm::Communicator* comm,
                                                        bool exclusive, const std::string& name);

  LaneOrder order() const { return order_; }
  comm::Communicator& comm() const { return *comm_; }
  // The stream the collectives run in the order of (kStream, kQueued); none for kHost.
  std::optional<StreamId> stream() const {
    return order_ == LaneOrder::kHost ? std::nullopt : std::optional<StreamId>(stream_);
  }

  // Issues `issue(comm)` after `inputs` (an event of the device; invalid: nothing to wait
  // for). kHost waits for `inputs` on the host, as `why`. `skip_inputs_wait`: tests only
  // (the collective may then read its inputs before they are written).
  using IssueFn = std::function<comm::WorkPtr(comm::Communicator&)>;
  Result<LaneCollective> Issue(EventId inputs, HostWait why, IssueFn issue,
                               bool skip_inputs_wait = false);

  // Makes later work of `consumer` wait for the collective (a device-side wait); for kHost,
  // or when `host_reads` (the host itself reads or writes the buffers next), the host waits
  // for the Work and returns its status. Otherwise the status is not known yet: Check it
  // later.
  Status OrderBefore(const LaneCollective& c, StreamId consumer, bool host_reads);

 private:
  CollectiveLane(Device* device, comm::Communicator* comm, LaneOrder order, StreamId stream)
      : device_(device), comm_(comm), order_(order), stream_(stream) {}

  Device* device_;
  comm::Communicator* comm_;
  LaneOrder order_;
  StreamId stream_;  // kStream: the communicator's, adopted; kQueued: the lane's own
};

}  // namespace strata::engine
