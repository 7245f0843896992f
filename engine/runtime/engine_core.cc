// EngineCore (engine_core.h): the calls a front end makes, each run by the components that own
// its parts (the private section of engine_core.h lists them). Create is in engine_create.cc.
#include "strata/engine/runtime/engine_core.h"

#include <mutex>
#include <sstream>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/engine/runtime/checkpoint_io.h"
#include "strata/engine/runtime/model_io.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"
#include "strata/engine/runtime/update_gate.h"

namespace strata::engine {

EngineCore::~EngineCore() {
  if (placement_ == nullptr || !placement_->has_copy_stream()) return;
  // No copy may still read the working shards' store when it goes (only a test skips the
  // wait): the coordinator's leases go first, then the copies end.
  coordinator_.reset();
  const Status s = placement_->WaitForCopies();
  if (!s.ok()) STRATA_LOG(kWarn) << "engine: waiting for the shard copies: " << s;
}

std::string EngineCore::device_name() const {
  return placement_->device().name();
}

Status EngineCore::UseComputeStream(void* native) {
  return placement_->device().SetComputeStream(native);
}

Status EngineCore::PreForward(int group, bool begins_phase) {
  if (begins_phase && clock_->phase() != PhaseClock::Phase::kBackward) step_->BeginForward();
  if (begins_phase) clock_->Enter(PhaseClock::Phase::kForward);
  // A front end's hold right after a pipelined Step() prefetches nothing: a prefetch
  // deferred there would be issued after Step() returned, where the caller may run its own
  // collectives (the same on every rank: the update runs on every rank or on none).
  // (A delayed update defers nothing: the forward does not wait for it.)
  const bool hold_beside_update = !begins_phase && gate_->ForwardWaits();
  STRATA_RETURN_IF_ERROR(coordinator_->PreForward(group, /*prefetch=*/!hold_beside_update));
  clock_->OpenSpan(group, 0);
  return Status::Ok();
}

Status EngineCore::PostForward(int group) {
  clock_->CloseSpan(group, 0);
  return coordinator_->PostForward(group);
}

Status EngineCore::PreBackward(int group) {
  STRATA_RETURN_IF_ERROR(step_->RefuseVoidBackward("PreBackward"));
  clock_->Enter(PhaseClock::Phase::kBackward);
  STRATA_RETURN_IF_ERROR(step_->PreBackward(group));
  STRATA_RETURN_IF_ERROR(coordinator_->PreBackward(group));
  clock_->OpenSpan(group, 1);
  return Status::Ok();
}

Status EngineCore::PostBackward(int group) {
  STRATA_RETURN_IF_ERROR(step_->RefuseVoidBackward("PostBackward"));
  clock_->CloseSpan(group, 1);
  STRATA_RETURN_IF_ERROR(coordinator_->PostBackward(group));
  return step_->PostBackward(group);
}

Status EngineCore::AddGradient(int group, int param, const void* grad, DType dtype,
                               std::shared_ptr<const void> owner) {
  return step_->AddGradient(group, param, grad, dtype, std::move(owner));
}

Status EngineCore::EndBackward() {
  STRATA_RETURN_IF_ERROR(step_->RefuseEndBackward());
  // A backward whose groups were all left out still ends here.
  clock_->Enter(PhaseClock::Phase::kBackward);
  STRATA_RETURN_IF_ERROR(step_->EndBackward());
  clock_->End("backward");
  clock_->timeline().set_micro_step(step_->CountBackward());
  return Status::Ok();
}

Status EngineCore::EndForwardOnly() {
  STRATA_RETURN_IF_ERROR(step_->EndForwardOnly());
  if (clock_->phase() == PhaseClock::Phase::kForward) clock_->End("forward (no backward)");
  return coordinator_->BeginIteration();
}

bool EngineCore::IsGradientAccumulationBoundary() const {
  return step_->IsGradientAccumulationBoundary();
}

bool EngineCore::BackwardIsBoundary() const {
  return step_->BackwardIsBoundary();
}

Result<StepOutcome> EngineCore::Step() {
  const Timeline::Clock::time_point began = Timeline::Clock::now();
  Result<StepOutcome> out = step_->Step();
  clock_->EndStep(began, out.ok() && out->applied, placement_->device().stats().host_waits);
  return out;
}

bool EngineCore::iteration_void() const {
  return step_->iteration_void();
}

double EngineCore::LossMultiplier() const {
  return step_->LossMultiplier();
}

double EngineCore::loss_scale() const {
  return step_->loss_scaler().scale();
}

const LossScaler& EngineCore::loss_scaler() const {
  return step_->loss_scaler();
}

double EngineCore::lr() const {
  return step_->lr();
}

Status EngineCore::set_lr(double lr) {
  return step_->set_lr(lr);
}

int64_t EngineCore::lr_iteration() const {
  return step_->lr_iteration();
}

Status EngineCore::set_lr_iteration(int64_t iteration) {
  return step_->set_lr_iteration(iteration);
}

Tier* EngineCore::device_tier() const {
  return placement_->device_tier();
}

Tier* EngineCore::host_tier() const {
  return placement_->host_tier();
}

OptimizerDriver& EngineCore::optimizer() {
  const Status joined = step_->JoinStep(/*flush=*/false);
  if (!joined.ok()) STRATA_LOG(kWarn) << "completing the pipelined optimizer step: " << joined;
  return *driver_;
}

bool EngineCore::delayed_copy_out_pending() const {
  return step_->delayed_copy_out_pending();
}

Status EngineCore::GatherMasterParams(int group, std::span<float> out) {
  return model_io_->GatherMasterParams(group, out);
}

Status EngineCore::AssembleParameters(const Status& local_check,
                                      const std::vector<std::pair<int, size_t>>& which,
                                      const std::vector<std::span<const float>>& parts) {
  return model_io_->AssembleParameters(local_check, which, parts);
}

Status EngineCore::LoadParameters(const Status& local_check, const ParamReader& read,
                                  const std::function<bool(int group, size_t param)>& only) {
  return model_io_->LoadParameters(local_check, read, only);
}

Status EngineCore::SetParameters(const Status& local_check, int source,
                                 const std::vector<std::pair<int, size_t>>& which,
                                 const std::vector<std::span<float>>& values) {
  return model_io_->SetParameters(local_check, source, which, values);
}

Result<std::string> EngineCore::SaveCheckpoint(const CheckpointSaveRequest& options) {
  return checkpoints_->Save(options);
}

Result<CheckpointLoadResult> EngineCore::LoadCheckpoint(const CheckpointLoadRequest& options) {
  return checkpoints_->Load(options);
}

void EngineCore::EnableTimeline(bool on) {
  clock_->timeline().Enable(on);
}

bool EngineCore::timeline_enabled() const {
  return clock_->timeline().enabled();
}

std::vector<TimelineEvent> EngineCore::TakeTimeline() {
  return clock_->timeline().Take();
}

uint64_t EngineCore::timeline_dropped() const {
  return clock_->timeline().dropped();
}

EngineStats EngineCore::stats() const {
  EngineStats s;
  placement_->AddStats(s);
  s.phases = clock_->phases();
  s.coordinator = coordinator_->stats();
  s.reducer = reducer_->stats();
  {
    // The reducer's thread may be in the driver's Accumulate (its counters).
    std::unique_lock<std::mutex> held = reducer_->HoldAccumulation();
    s.optimizer = driver_->stats();
    s.store_name = placement_->store().name();
    s.store = driver_->store_stats();
  }
  s.all_gather = {s.coordinator.all_gather_calls, s.coordinator.all_gather_bytes};
  s.reduce_scatter = {s.reducer.reduce_scatter_calls, s.reducer.reduce_scatter_bytes};
  s.all_reduce = {s.reducer.all_reduce_calls + s.optimizer.norm_all_reduce_calls +
                      s.optimizer.lamb_norms_all_reduce_calls,
                  s.reducer.all_reduce_bytes + s.optimizer.norm_all_reduce_calls * 8 +
                      s.optimizer.lamb_norms_all_reduce_bytes};
  s.comm = comm_->stats();
  s.reduce_lane = reduce_comm_ != nullptr;
  if (reduce_comm_ != nullptr) s.reduce_lane_comm = reduce_comm_->stats();
  s.gather_lane = gather_comm_ != nullptr;
  if (gather_comm_ != nullptr) s.gather_lane_comm = gather_comm_->stats();
  s.reduce_order = std::string(LaneOrderName(reducer_->lane_order()));
  placement_->AddAccumulationStats(s);
  step_->AddStats(s);
  s.gather_order = std::string(LaneOrderName(coordinator_->lane_order()));
  s.device_ops = placement_->device().stats();
  s.host_waits_last_step = clock_->host_waits_last_step();
  return s;
}

uint64_t EngineStats::HostWaitsLastStep() const {
  uint64_t n = 0;
  for (uint64_t w : host_waits_last_step)
    n += w;
  return n;
}

std::string EngineStats::ToString() const {
  std::ostringstream os;
  os << "device tier " << device.name << ": " << FormatBytes(device.usage.bytes_in_use) << " now, "
     << FormatBytes(device.usage.peak_bytes) << " peak";
  if (device.usage.budget_bytes > 0) os << " of " << FormatBytes(device.usage.budget_bytes);
  os << "\n";
  if (host) {
    os << "host tier " << host->name << ": " << FormatBytes(host->usage.bytes_in_use) << " now, "
       << FormatBytes(host->usage.peak_bytes) << " peak\n";
  }
  os << "CPU-Adam: " << cpu_adam_threads << " threads"
     << (numa_node >= 0 ? " on NUMA node " + std::to_string(numa_node)
                        : std::string(", not bound to a NUMA node"))
     << " (" << cpu_adam_cores << " cores this rank may use, shared by " << cpu_adam_ranks_sharing
     << (cpu_adam_ranks_sharing == 1 ? " rank" : " ranks") << " of this machine)\n";
  os << "per rank: working shards " << FormatBytes(working_shard_bytes) << " ("
     << TierKindName(param_tier) << "), master " << FormatBytes(optimizer.master_bytes) << ", m "
     << FormatBytes(optimizer.exp_avg_bytes) << ", v " << FormatBytes(optimizer.exp_avg_sq_bytes)
     << ", grad accumulators " << FormatBytes(optimizer.grad_accumulator_bytes) << " ("
     << grad_accumulators << ")\n";
  if (device_sums.device_bytes > 0) {
    os << "device gradient sums: " << FormatBytes(device_sums.device_bytes) << " on the device, "
       << device_sums.buffers << " host buffers of " << FormatBytes(device_sums.buffer_bytes)
       << "; " << device_sums.fetches << " sub-group copies to the host ("
       << FormatBytes(device_sums.fetch_bytes) << ", " << device_sums.fetches_ahead
       << " read ahead), " << device_sums.norm_passes << " norm passes on the device, waited "
       << device_sums.fetch_wait_s << " s\n";
  }
  if (optimizer_tier == TierKind::kNvme) {
    os << "nvme states: " << store.chunks << " chunks, buffers " << FormatBytes(store.memory_bytes)
       << "; read " << FormatBytes(store.read_bytes) << " (" << store.reads << " chunks, "
       << store.prefetch_hits << " prefetched, waited " << store.read_wait_s << " s), written "
       << FormatBytes(store.write_bytes) << " (" << store.writes << " chunks, waited "
       << store.write_wait_s << " s), " << store.zero_fills << " zero-filled\n";
  }
  if (param_tier == TierKind::kNvme) {
    os << "nvme working shards: " << param_store.chunks << " shards ("
       << FormatBytes(working_shard_host_bytes) << " more in host memory, max_in_cpu), buffers "
       << FormatBytes(param_store.memory_bytes) << "; read " << FormatBytes(param_store.read_bytes)
       << " (" << param_store.reads << " shards, " << coordinator.shard_reads_ahead
       << " read ahead, " << coordinator.shard_reads_on_demand << " on demand, waited "
       << coordinator.shard_read_wait_s << " s), written " << FormatBytes(param_store.write_bytes)
       << " (" << param_store.writes << " shards)";
    if (optimizer.shard_handovers > 0) {
      os << "; " << optimizer.shard_handovers << " new shards handed over by the pipelined step ("
         << optimizer.shard_handovers_exchanged << " without a copy, "
         << optimizer.shard_handovers_checksummed << " with their CRCs from CPU-Adam's threads, "
         << optimizer.shard_checksum_s << " s there; " << optimizer.shard_handover_s
         << " s on the engine's thread)";
    }
    os << "\n";
  }
  os << "fetches: " << coordinator.fetches_on_demand << " on demand, "
     << coordinator.fetches_prefetched << " prefetched, " << coordinator.fetches_reused
     << " reused; live " << coordinator.live_elements << " elements (peak "
     << coordinator.live_elements_peak << "); shards staged host->device "
     << coordinator.shards_staged << ", reduced shards copied device->host " << reducer.shard_copies
     << " (" << FormatBytes(reducer.shard_copy_bytes) << ")"
     << ", working shards copied host->device " << working_shard_pushes << "\n";
  os << "gradient accumulation: " << gradient_accumulation;
  if (reducer.device_accumulator_bytes > 0) {
    os << " (" << FormatBytes(reducer.device_accumulator_bytes) << " of accumulators; "
       << reducer.shards_added_on_device << " reduced shards added there, "
       << reducer.accumulated_copies << " sums copied to the host)";
  }
  os << "\n";
  if (delayed_update_steps > 0) {
    os << "delayed update: " << delayed_update_steps << " steps beside the next micro-steps, "
       << delayed_copy_outs << " copies into the working shards (" << delayed_copy_out_s << " s), "
       << delayed_update_wait_s << " s waited for the update\n";
  }
  os << "collectives: all-gather " << all_gather.calls << " (" << FormatBytes(all_gather.bytes)
     << "), reduce-scatter " << reduce_scatter.calls << " (" << FormatBytes(reduce_scatter.bytes)
     << "), all-reduce " << all_reduce.calls << " (" << FormatBytes(all_reduce.bytes) << "); "
     << (reduce_lane || gather_lane
             ? "all-gathers and gradient reductions on separate communicators"
             : "all-gathers and gradient reductions on one communicator")
     << (!gather_lane  ? ""
         : reduce_lane ? " (neither the engine's)"
                       : " (the reductions on the engine's)")
     << "; ordered with the device's work: reductions " << reduce_order << ", all-gathers "
     << gather_order << "\n";
  os << "phases (s): forward " << phases.forward_s << " (" << phases.forwards << "), backward "
     << phases.backward_s << " (" << phases.backwards << "), step " << phases.step_s << " ("
     << phases.steps << ")\n";
  os << "gradient buckets: " << reducer.buckets_reduced << " reduced, "
     << reducer.buckets_launched_in_backward << " launched during the backward, "
     << reducer.buckets_overlapping_backward << " of them in flight beside it, "
     << reducer.buckets_accumulated_in_background << " added on the reducer's thread ("
     << reducer.background_accumulate_s << " s), " << reducer.gradients_parked
     << " gradients parked until their group's slot opened\n";
  os << "waited (s): all-gathers " << coordinator.all_gather_wait_s << ", shard staging "
     << coordinator.staging_wait_s << ", compute before reductions " << reducer.compute_wait_s
     << ", reductions " << reducer.reduce_wait_s << ", reduced-shard copies "
     << reducer.shard_copy_wait_s << ", the reducer's thread " << reducer.accumulate_wait_s
     << ", working-shard copies " << working_push_wait_s << "; optimizer steps " << optimizer.step_s
     << "\n";
  os << "host waits on the device: " << device_ops.host_synchronizes << " (last step "
     << HostWaitsLastStep();
  for (size_t i = 0; i < host_waits_last_step.size(); ++i) {
    if (host_waits_last_step[i] > 0) {
      os << ", " << HostWaitName(static_cast<HostWait>(i)) << " " << host_waits_last_step[i];
    }
  }
  os << "); stream waits " << device_ops.stream_waits << ", events " << device_ops.events_recorded
     << ", kept alive " << device_ops.keep_alives << "\n";
  os << "optimizer: " << optimizer.steps_applied << " steps, " << optimizer.steps_skipped
     << " skipped, " << optimizer.adam_calls << " CPU optimizer passes, "
     << optimizer.params_updated << " parameter elements updated; loss scale " << loss_scale;
  if (optimizer.lamb_norms_all_reduce_calls > 0) {
    os << "\nLAMB: trust ratios of the last step in [" << optimizer.lamb_trust_ratio_min << ", "
       << optimizer.lamb_trust_ratio_max << "], " << optimizer.lamb_norms_all_reduce_calls
       << " norm all-reduces (" << FormatBytes(optimizer.lamb_norms_all_reduce_bytes) << ")";
  }
  if (optimizer.group_elements.size() > 1) {
    os << "\nparameter groups:";
    for (size_t k = 0; k < optimizer.group_elements.size(); ++k) {
      os << (k == 0 ? " " : ", ") << k << ": " << optimizer.group_elements[k] << " elements, lr "
         << optimizer.group_lr[k];
    }
  }
  return os.str();
}

}  // namespace strata::engine
