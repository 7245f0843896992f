#include "strata/engine/runtime/engine_core.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "strata/core/bytes.h"
#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
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

Status EngineCore::AgreeOnLoadCheck(const Status& local_check, const std::string& what) {
  // 16 KiB per rank: a check lists names (up to 20 of each kind).
  STRATA_ASSIGN_OR_RETURN(Outcomes checked,
                          AgreeOnOutcomes(*host_comm_, local_check, {}, size_t{16} << 10));
  // Nothing stays gathered (prefetches in flight are waited for): the groups gathered
  // after the load see the new values. This ends the pass the front end's calls began, on
  // the failed path too, so the next iteration starts the same way on every rank.
  STRATA_RETURN_IF_ERROR(coordinator_->EndForwardOnly());
  if (checked.any_failed) {
    STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
    return Status(checked.code, OutcomeStatus(checked, what).message() + "; nothing was changed");
  }
  return Status::Ok();
}

namespace {
// "loading" -> "load": WriteParameters' messages.
std::string Infinitive(const std::string& verb) {
  if (verb == "setting") return "set";
  if (verb == "assembling") return "assemble";
  return "load";
}
}  // namespace

Status EngineCore::LoadParameters(const Status& local_check, const ParamReader& read,
                                  const std::function<bool(int group, size_t param)>& only) {
  return WriteParameters("loading", local_check, nullptr, read, only);
}

Status EngineCore::WriteParameters(const std::string& verb, const Status& local_check,
                                   const std::function<Status(Status& local)>& prepare,
                                   const ParamReader& read,
                                   const std::function<bool(int group, size_t param)>& only) {
  if (step_->between_backward_and_step() || reducer_->pending() ||
      step_->micro_steps() % config_.gradient_accumulation_steps != 0) {
    return FailedPreconditionError(
        verb + " parameters between a backward and its step: " + Infinitive(verb) +
        " them before training or right after step()");
  }
  STRATA_RETURN_IF_ERROR(step_->JoinStep(true, StepControl::Join::kDrain));
  STRATA_RETURN_IF_ERROR(
      AgreeOnLoadCheck(local_check, "checking the parameters to " + Infinitive(verb)));
  Status local;
  if (prepare) STRATA_RETURN_IF_ERROR(prepare(local));
  std::vector<float> buffer;
  constexpr size_t kPiece = size_t{1} << 20;
  for (int g = 0; g < num_groups() && local.ok(); ++g) {
    const GroupLayout& l = layout(g);
    const size_t shard = partition_.shard_offset[static_cast<size_t>(g)];
    for (size_t i = 0; i < l.params.size() && local.ok(); ++i) {
      if (only && !only(g, i)) continue;
      const std::optional<ShardSlice> s = l.Slice(i, partition_.rank);
      if (!s) continue;
      for (size_t done = 0; done < s->count && local.ok();) {
        const size_t count = std::min(kPiece, s->count - done);
        buffer.resize(count);
        local = read(g, i, s->param_offset + done, buffer);
        if (local.ok()) {
          // A frozen group's values go straight to its working shard.
          local = frozen(g) ? placement_->WriteFrozen(g, s->shard_offset + done, buffer)
                            : driver_->WriteMaster(shard + s->shard_offset + done, buffer);
        }
        done += count;
      }
    }
  }
  // Agreed on every rank, so every rank goes on into the collectives below either way: the
  // groups gathered again hold what the master holds now.
  const Status committed = driver_->CommitMasterAgreed(local, verb + " parameters");
  STRATA_RETURN_IF_ERROR(placement_->PushWorkingShards());
  STRATA_RETURN_IF_ERROR(coordinator_->RegatherPersistent());
  STRATA_RETURN_IF_ERROR(coordinator_->BeginIteration());
  return committed;
}

Status EngineCore::SetParameters(const Status& local_check, int source,
                                 const std::vector<std::pair<int, size_t>>& which,
                                 const std::vector<std::span<float>>& values) {
  Status check = local_check;
  if (check.ok() && (source < 0 || source >= world_size())) {
    check = InvalidArgumentError("SetParameters: source rank " + std::to_string(source) + " of " +
                                 std::to_string(world_size()));
  }
  if (check.ok() && which.size() != values.size()) {
    check = InvalidArgumentError("SetParameters: " + std::to_string(which.size()) +
                                 " parameters, " + std::to_string(values.size()) + " values");
  }
  std::map<std::pair<int, size_t>, size_t> index;
  for (size_t k = 0; k < which.size() && check.ok(); ++k) {
    const auto [g, i] = which[k];
    if (g < 0 || g >= num_groups() || i >= layout(g).params.size()) {
      check = InvalidArgumentError("SetParameters: no parameter " + std::to_string(i) +
                                   " in group " + std::to_string(g));
    } else if (values[k].size() != layout(g).params[i].numel) {
      check = InvalidArgumentError("SetParameters: parameter " + layout(g).params[i].name +
                                   " has " + std::to_string(layout(g).params[i].numel) +
                                   " elements, " + std::to_string(values[k].size()) + " given");
    } else if (!index.emplace(which[k], k).second) {
      check = InvalidArgumentError("SetParameters: parameter " + layout(g).params[i].name +
                                   " given twice");
    }
  }
  // Checked and agreed on before the broadcasts (WriteParameters), which are collective.
  return WriteParameters(
      "setting", check,
      [&](Status&) -> Status {
        for (size_t k = 0; k < which.size(); ++k) {
          if (values[k].empty()) continue;
          STRATA_RETURN_IF_ERROR_CTX(
              host_comm_->Broadcast(values[k].data(), values[k].size(), comm::DType::kFloat32,
                                    source),
              "broadcasting parameter " + layout(which[k].first).params[which[k].second].name);
        }
        return Status::Ok();
      },
      [&](int g, size_t i, uint64_t first, std::span<float> out) -> Status {
        const std::span<float> v = values[index.at({g, i})];
        std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(first), out.size(), out.begin());
        return Status::Ok();
      },
      [&](int g, size_t i) {
        return index.count({g, i}) != 0;
      });
}

Status EngineCore::AssembleParameters(const Status& local_check,
                                      const std::vector<std::pair<int, size_t>>& which,
                                      const std::vector<std::span<const float>>& parts) {
  Status check = local_check;
  if (check.ok() && which.size() != parts.size()) {
    check = InvalidArgumentError("AssembleParameters: " + std::to_string(which.size()) +
                                 " parameters, " + std::to_string(parts.size()) + " parts");
  }
  for (size_t k = 0; k < which.size() && check.ok(); ++k) {
    const auto [g, i] = which[k];
    if (g < 0 || g >= num_groups() || i >= layout(g).params.size()) {
      check = InvalidArgumentError("AssembleParameters: no parameter " + std::to_string(i) +
                                   " in group " + std::to_string(g));
      break;
    }
    const comm::Shard part = comm::Partition(layout(g).params[i].numel, world_size(), rank());
    if (parts[k].size() != part.count) {
      check = InvalidArgumentError(
          "parameter " + layout(g).params[i].name + ": this rank's part holds " +
          std::to_string(parts[k].size()) + " elements, its share of " +
          std::to_string(layout(g).params[i].numel) + " over " + std::to_string(world_size()) +
          " ranks is " + std::to_string(part.count) +
          " (built under strata.zero.Init with another world size?)");
    }
  }
  // The same gate as a load: at a step boundary, the check agreed on (nothing changed when
  // it fails), nothing gathered while the master changes.
  return WriteParameters(
      "assembling", check,
      [&](Status& local) -> Status {
        // Every rank takes part in every gather, whatever its writes do (a failure is kept
        // in `local` and agreed on by CommitMasterAgreed).
        std::vector<float> full;
        for (size_t k = 0; k < which.size(); ++k) {
          const auto [g, i] = which[k];
          const GroupLayout& l = layout(g);
          full.resize(l.params[i].numel);
          if (full.empty()) continue;
          // An empty part (fewer elements than ranks) may have no storage: a valid address
          // all the same.
          const float none = 0.0f;
          const float* part = parts[k].empty() ? &none : parts[k].data();
          STRATA_RETURN_IF_ERROR_CTX(
              host_comm_->AllGatherAsync(part, full.data(), full.size(), comm::DType::kFloat32)
                  ->Wait(),
              "gathering parameter " + l.params[i].name);
          const std::optional<ShardSlice> sl = l.Slice(i, partition_.rank);
          if (!sl || !local.ok()) continue;
          const std::span<const float> mine(full.data() + sl->param_offset, sl->count);
          local =
              frozen(g)
                  ? placement_->WriteFrozen(g, sl->shard_offset, mine)
                  : driver_->WriteMaster(
                        partition_.shard_offset[static_cast<size_t>(g)] + sl->shard_offset, mine);
        }
        return Status::Ok();
      },
      [](int, size_t, uint64_t, std::span<float>) { return Status::Ok(); },
      [](int, size_t) { return false; });  // written above
}

Status EngineCore::GatherMasterParams(int group, std::span<float> out) {
  if (group < 0 || group >= num_groups()) {
    return FailedPreconditionError("GatherMasterParams: unknown group " + std::to_string(group));
  }
  if (step_->early_open()) {
    return FailedPreconditionError(
        "GatherMasterParams between a backward and its step() with strata.early_step (the "
        "master parameters are being updated): call it before the backward or after step()");
  }
  // The reducer's thread may be adding gradients through the driver (in a backward not
  // ended yet).
  STRATA_RETURN_IF_ERROR(reducer_->WaitAccumulations());
  STRATA_RETURN_IF_ERROR(step_->JoinStep());
  const GroupLayout& l = layout(group);
  if (out.size() != l.numel) {
    return InvalidArgumentError("GatherMasterParams: output holds " + std::to_string(out.size()) +
                                " floats, group " + l.name + " has " + std::to_string(l.numel));
  }
  if (l.padded_numel == 0) return Status::Ok();
  std::vector<float> full(l.padded_numel);
  std::vector<float> shard(l.shard_numel);
  // A read error must not leave the other ranks in the all-gather: every rank sends its
  // shard (zeros after a failure) and the ranks agree on the outcome first.
  Status read;
  if (!frozen(group)) {
    read = driver_->ReadMaster(partition_.shard_offset[static_cast<size_t>(group)], shard);
  } else if (placement_->shards().has(group)) {
    // A frozen group's values are its working shard's.
    Result<offload::StateLease> lease = placement_->shards().Acquire(group, offload::Access::kRead);
    read = lease.status();
    if (lease.ok()) {
      ConvertToFloat(lease->data(), dtype_, shard.size(), shard.data());
      read = lease->Release();
    }
    if (!read.ok()) std::fill(shard.begin(), shard.end(), 0.0f);
  }
  if (driver_->store()->can_fail() || placement_->shards().can_fail()) {
    float failed = read.ok() ? 0.0f : 1.0f;
    STRATA_RETURN_IF_ERROR(
        host_comm_->AllReduce(&failed, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
    if (!read.ok()) return read;
    if (failed > 0.0f) {
      return IOError("GatherMasterParams: reading the master parameters failed on " +
                     std::to_string(static_cast<int>(failed)) + " other rank(s)");
    }
  }
  STRATA_RETURN_IF_ERROR(read);
  STRATA_RETURN_IF_ERROR(
      host_comm_->AllGather(shard.data(), full.data(), l.padded_numel, comm::DType::kFloat32));
  size_t pos = 0;
  for (const ParamSlot& p : l.params) {
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(p.offset), p.numel,
                out.begin() + static_cast<std::ptrdiff_t>(pos));
    pos += p.numel;
  }
  return Status::Ok();
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
