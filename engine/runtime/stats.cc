// VisitStats (stats.h): every statistic once, with its key; EngineCore::stats(), which reads
// them from the engine's parts; EngineStats::ToString, the summary for logs.
#include "strata/engine/runtime/stats.h"

#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>

#include "strata/core/bytes.h"
#include "strata/engine/runtime/phase_clock.h"
#include "strata/engine/runtime/placement.h"
#include "strata/engine/runtime/step_control.h"

namespace strata::engine {

namespace {

// Integers of every width as the visitor's 64-bit ones.
template <typename T>
void V(StatsVisitor& v, std::string_view key, const T& x) {
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, double> ||
                std::is_same_v<T, std::string> || std::is_same_v<T, std::vector<double>> ||
                std::is_same_v<T, std::vector<uint64_t>>) {
    v.Value(key, x);
  } else if constexpr (std::is_unsigned_v<T>) {
    v.Value(key, static_cast<uint64_t>(x));
  } else {
    v.Value(key, static_cast<int64_t>(x));
  }
}

void TierValues(StatsVisitor& v, std::string_view key, const TierStats& t) {
  v.Enter(key);
  V(v, "name", t.name);
  V(v, "bytes_in_use", t.usage.bytes_in_use);
  V(v, "peak_bytes", t.usage.peak_bytes);
  V(v, "budget_bytes", t.usage.budget_bytes);
  V(v, "allocations", t.usage.allocations);
  v.Leave();
}

// A state store's ("host", or "nvme": its swap traffic and buffers).
void Store(StatsVisitor& v, std::string_view key, const std::string& name,
           const offload::StateStoreStats& x) {
  v.Enter(key);
  V(v, "name", name);
  V(v, "states", x.states);
  V(v, "chunks", x.chunks);
  V(v, "state_bytes", x.state_bytes);
  V(v, "memory_bytes", x.memory_bytes);
  V(v, "reads", x.reads);
  V(v, "read_bytes", x.read_bytes);
  V(v, "writes", x.writes);
  V(v, "write_bytes", x.write_bytes);
  V(v, "zero_fills", x.zero_fills);
  V(v, "prefetches", x.prefetches);
  V(v, "prefetch_hits", x.prefetch_hits);
  V(v, "evictions", x.evictions);
  V(v, "reads_beside_write", x.reads_beside_write);
  V(v, "reads_ahead_overwritten", x.reads_ahead_overwritten);
  V(v, "exchanges", x.exchanges);
  V(v, "writes_with_given_crcs", x.writes_with_given_crcs);
  V(v, "acquires", x.acquires);
  V(v, "relocations", x.relocations);
  V(v, "commits", x.commits);
  V(v, "rollbacks", x.rollbacks);
  V(v, "bounced_bytes", x.bounced_bytes);
  V(v, "swap_bytes", x.swap_bytes);
  V(v, "registered_buffers", x.registered_buffers);
  V(v, "reads_ahead_given_up", x.reads_ahead_given_up);
  V(v, "fixed_buffer_ios", x.fixed_buffer_ios);
  V(v, "read_wait_s", x.read_wait_s);
  V(v, "write_wait_s", x.write_wait_s);
  v.Leave();
}

void Counts(StatsVisitor& v, std::string_view key, const CollectiveCounts& n) {
  v.Enter(key);
  V(v, "calls", n.calls);
  V(v, "bytes", n.bytes);
  v.Leave();
}

void Comm(StatsVisitor& v, std::string_view key, const comm::CommStats& c) {
  v.Enter(key);
  V(v, "bytes_sent", c.bytes_sent);
  V(v, "bytes_received", c.bytes_received);
  V(v, "operations", c.operations);
  v.Leave();
}

void Coordinator(StatsVisitor& v, const EngineStats& s) {
  v.Enter("coordinator");
  V(v, "fetches_on_demand", s.coordinator.fetches_on_demand);
  V(v, "fetches_prefetched", s.coordinator.fetches_prefetched);
  V(v, "shards_staged", s.coordinator.shards_staged);
  V(v, "fetches_reused", s.coordinator.fetches_reused);
  V(v, "persistent_hits", s.coordinator.persistent_hits);
  V(v, "prefetches_issued", s.coordinator.prefetches_issued);
  V(v, "prefetches_wasted", s.coordinator.prefetches_wasted);
  V(v, "evictions", s.coordinator.evictions);
  V(v, "all_gather_calls", s.coordinator.all_gather_calls);
  V(v, "all_gather_bytes", s.coordinator.all_gather_bytes);
  V(v, "live_elements", s.coordinator.live_elements);
  V(v, "live_elements_peak", s.coordinator.live_elements_peak);
  V(v, "persistent_elements", s.coordinator.persistent_elements);
  V(v, "trace_recordings", s.coordinator.trace_recordings);
  V(v, "trace_invalidations", s.coordinator.trace_invalidations);
  V(v, "trace_valid", s.coordinator.trace_valid);
  V(v, "trace_length", s.coordinator.trace_length);
  V(v, "all_gather_wait_s", s.coordinator.all_gather_wait_s);
  V(v, "staging_wait_s", s.coordinator.staging_wait_s);
  V(v, "shard_reads_ahead", s.coordinator.shard_reads_ahead);
  V(v, "shard_reads_on_demand", s.coordinator.shard_reads_on_demand);
  V(v, "shard_read_errors", s.coordinator.shard_read_errors);
  V(v, "shard_read_wait_s", s.coordinator.shard_read_wait_s);
  V(v, "prefetches_deferred", s.coordinator.prefetches_deferred);
  v.Leave();
}

void Reducer(StatsVisitor& v, const EngineStats& s) {
  v.Enter("reducer");
  V(v, "gradients_received", s.reducer.gradients_received);
  V(v, "buckets_reduced", s.reducer.buckets_reduced);
  V(v, "reduce_scatter_calls", s.reducer.reduce_scatter_calls);
  V(v, "reduce_scatter_bytes", s.reducer.reduce_scatter_bytes);
  V(v, "all_reduce_calls", s.reducer.all_reduce_calls);
  V(v, "all_reduce_bytes", s.reducer.all_reduce_bytes);
  V(v, "bucket_bytes", s.reducer.bucket_bytes);
  V(v, "shard_copies", s.reducer.shard_copies);
  V(v, "shard_copy_bytes", s.reducer.shard_copy_bytes);
  V(v, "device_accumulator_bytes", s.reducer.device_accumulator_bytes);
  V(v, "shards_added_on_device", s.reducer.shards_added_on_device);
  V(v, "accumulated_copies", s.reducer.accumulated_copies);
  V(v, "staging_refills", s.reducer.staging_refills);
  V(v, "compute_wait_s", s.reducer.compute_wait_s);
  V(v, "reduce_wait_s", s.reducer.reduce_wait_s);
  V(v, "shard_copy_wait_s", s.reducer.shard_copy_wait_s);
  V(v, "accumulate_wait_s", s.reducer.accumulate_wait_s);
  V(v, "buckets_accumulated_in_background", s.reducer.buckets_accumulated_in_background);
  V(v, "background_accumulate_s", s.reducer.background_accumulate_s);
  V(v, "buckets_launched_in_backward", s.reducer.buckets_launched_in_backward);
  V(v, "buckets_overlapping_backward", s.reducer.buckets_overlapping_backward);
  V(v, "gradients_parked", s.reducer.gradients_parked);
  V(v, "park_elems", s.reducer.park_elems);
  v.Leave();
}

void Optimizer(StatsVisitor& v, const EngineStats& s) {
  v.Enter("optimizer");
  V(v, "steps_applied", s.optimizer.steps_applied);
  V(v, "steps_skipped", s.optimizer.steps_skipped);
  V(v, "adam_calls", s.optimizer.adam_calls);
  V(v, "elements_updated", s.optimizer.elements_updated);
  V(v, "params_updated", s.optimizer.params_updated);
  V(v, "norm_all_reduce_calls", s.optimizer.norm_all_reduce_calls);
  V(v, "lamb_norms_all_reduce_calls", s.optimizer.lamb_norms_all_reduce_calls);
  V(v, "lamb_norms_all_reduce_bytes", s.optimizer.lamb_norms_all_reduce_bytes);
  V(v, "lamb_trust_ratio_min", s.optimizer.lamb_trust_ratio_min);
  V(v, "lamb_trust_ratio_max", s.optimizer.lamb_trust_ratio_max);
  V(v, "master_bytes", s.optimizer.master_bytes);
  V(v, "exp_avg_bytes", s.optimizer.exp_avg_bytes);
  V(v, "exp_avg_sq_bytes", s.optimizer.exp_avg_sq_bytes);
  V(v, "grad_accumulator_bytes", s.optimizer.grad_accumulator_bytes);
  V(v, "last_global_norm", s.optimizer.last_global_norm);
  V(v, "step_s", s.optimizer.step_s);
  V(v, "group_lr", s.optimizer.group_lr);
  V(v, "group_elements", s.optimizer.group_elements);
  V(v, "adam_s", s.optimizer.adam_s);
  V(v, "steps_failed", s.optimizer.steps_failed);
  V(v, "sub_groups", s.optimizer.sub_groups);
  V(v, "steps_pipelined", s.optimizer.steps_pipelined);
  V(v, "pipelined_update_s", s.optimizer.pipelined_update_s);
  V(v, "pipelined_wait_s", s.optimizer.pipelined_wait_s);
  V(v, "delayed_copy_outs", s.optimizer.delayed_copy_outs);
  V(v, "delayed_copy_out_s", s.optimizer.delayed_copy_out_s);
  V(v, "pipelined_store_wait_s", s.optimizer.pipelined_store_wait_s);
  V(v, "shard_handovers", s.optimizer.shard_handovers);
  V(v, "shard_handover_s", s.optimizer.shard_handover_s);
  V(v, "shard_handovers_exchanged", s.optimizer.shard_handovers_exchanged);
  V(v, "shard_handovers_checksummed", s.optimizer.shard_handovers_checksummed);
  V(v, "shard_checksum_s", s.optimizer.shard_checksum_s);
  V(v, "staging_buffers", s.optimizer.staging_buffers);
  V(v, "steps_early", s.optimizer.steps_early);
  V(v, "groups_released_in_backward", s.optimizer.groups_released_in_backward);
  V(v, "steps_inf_nan_applied", s.optimizer.steps_inf_nan_applied);
  V(v, "norm_tiles_in_background", s.optimizer.norm_tiles_in_background);
  V(v, "norms_in_backward", s.optimizer.norms_in_backward);
  V(v, "norms_in_backward_dropped", s.optimizer.norms_in_backward_dropped);
  V(v, "norm_tiles_in_step", s.optimizer.norm_tiles_in_step);
  V(v, "norm_tiles_as_written", s.optimizer.norm_tiles_as_written);
  V(v, "norm_s", s.optimizer.norm_s);
  V(v, "acc_elements_added_to_zero", s.optimizer.acc_elements_added_to_zero);
  V(v, "acc_chunks_zeroed_lazily", s.optimizer.acc_chunks_zeroed_lazily);
  V(v, "acc_stale_elements_zeroed", s.optimizer.acc_stale_elements_zeroed);
  v.Leave();
}

}  // namespace

void VisitStats(const EngineStats& s, StatsVisitor& v) {
  TierValues(v, "device", s.device);
  if (s.host) {
    TierValues(v, "host", *s.host);
  } else {
    v.Null("host");
  }
  V(v, "param_tier", std::string(TierKindName(s.param_tier)));
  V(v, "optimizer_tier", std::string(TierKindName(s.optimizer_tier)));
  V(v, "working_shard_bytes", s.working_shard_bytes);
  V(v, "working_shard_host_bytes", s.working_shard_host_bytes);
  V(v, "working_shard_pushes", s.working_shard_pushes);
  V(v, "working_push_wait_s", s.working_push_wait_s);
  Coordinator(v, s);
  Reducer(v, s);
  Optimizer(v, s);
  Store(v, "optimizer_store", s.store_name, s.store);
  Store(v, "param_store", s.param_store_name, s.param_store);
  Counts(v, "all_gather", s.all_gather);
  Counts(v, "reduce_scatter", s.reduce_scatter);
  Counts(v, "all_reduce", s.all_reduce);
  Comm(v, "comm", s.comm);
  V(v, "reduce_lane", s.reduce_lane);
  Comm(v, "reduce_lane_comm", s.reduce_lane_comm);
  V(v, "gather_lane", s.gather_lane);
  Comm(v, "gather_lane_comm", s.gather_lane_comm);
  V(v, "reduce_order", s.reduce_order);
  V(v, "gradient_accumulation", s.gradient_accumulation);
  V(v, "grad_accumulators", s.grad_accumulators);
  v.Enter("device_sums");
  V(v, "device_bytes", s.device_sums.device_bytes);
  V(v, "buffers", s.device_sums.buffers);
  V(v, "buffer_bytes", s.device_sums.buffer_bytes);
  V(v, "fetches", s.device_sums.fetches);
  V(v, "fetch_bytes", s.device_sums.fetch_bytes);
  V(v, "fetches_ahead", s.device_sums.fetches_ahead);
  V(v, "write_backs", s.device_sums.write_backs);
  V(v, "zeroed_chunks", s.device_sums.zeroed_chunks);
  V(v, "norm_passes", s.device_sums.norm_passes);
  V(v, "fetch_wait_s", s.device_sums.fetch_wait_s);
  v.Leave();
  V(v, "delayed_update_steps", s.delayed_update_steps);
  V(v, "delayed_copy_outs", s.delayed_copy_outs);
  V(v, "delayed_copy_out_s", s.delayed_copy_out_s);
  V(v, "delayed_update_wait_s", s.delayed_update_wait_s);
  V(v, "gather_order", s.gather_order);
  // The device seam's counters; host waits by HostWait's name ("arena reuse", ...).
  v.Enter("device_ops");
  V(v, "copies", s.device_ops.copies);
  V(v, "copy_bytes", s.device_ops.copy_bytes);
  V(v, "kernels", s.device_ops.kernels);
  V(v, "events_recorded", s.device_ops.events_recorded);
  V(v, "stream_waits", s.device_ops.stream_waits);
  V(v, "keep_alives", s.device_ops.keep_alives);
  V(v, "host_waits_total", s.device_ops.host_synchronizes);
  v.Enter("host_waits");
  for (int i = 0; i < kHostWaitKinds; ++i)
    V(v, HostWaitName(static_cast<HostWait>(i)), s.device_ops.host_waits[static_cast<size_t>(i)]);
  v.Leave();
  v.Enter("host_waits_last_step");
  for (int i = 0; i < kHostWaitKinds; ++i) {
    V(v, HostWaitName(static_cast<HostWait>(i)), s.host_waits_last_step[static_cast<size_t>(i)]);
  }
  v.Leave();
  v.Leave();
  V(v, "micro_steps", s.micro_steps);
  V(v, "numa_node", s.numa_node);
  V(v, "cpu_adam_threads", s.cpu_adam_threads);
  V(v, "cpu_adam_cores", s.cpu_adam_cores);
  V(v, "cpu_adam_ranks_sharing", s.cpu_adam_ranks_sharing);
  V(v, "global_steps", s.global_steps);
  v.Enter("phases");
  V(v, "forward_s", s.phases.forward_s);
  V(v, "backward_s", s.phases.backward_s);
  V(v, "step_s", s.phases.step_s);
  V(v, "forwards", s.phases.forwards);
  V(v, "backwards", s.phases.backwards);
  V(v, "steps", s.phases.steps);
  v.Leave();
  V(v, "loss_scale", s.loss_scale);
  V(v, "summary", s.ToString());
}

// What every part of the engine counts, read in one pass.
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
       << store.write_wait_s << " s), " << store.zero_fills << " zero-filled; swap files "
       << FormatBytes(store.swap_bytes) << " on disk (unlinked: df counts them, du does not)\n";
  }
  if (param_tier == TierKind::kNvme) {
    os << "nvme working shards: " << param_store.chunks << " shards ("
       << FormatBytes(working_shard_host_bytes) << " more in host memory, max_in_cpu), buffers "
       << FormatBytes(param_store.memory_bytes) << "; read " << FormatBytes(param_store.read_bytes)
       << " (" << param_store.reads << " shards, " << coordinator.shard_reads_ahead
       << " read ahead, " << coordinator.shard_reads_on_demand << " on demand, waited "
       << coordinator.shard_read_wait_s << " s), written " << FormatBytes(param_store.write_bytes)
       << " (" << param_store.writes << " shards); swap files "
       << FormatBytes(param_store.swap_bytes) << " on disk";
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
