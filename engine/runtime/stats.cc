// VisitStats (stats.h): every statistic once, with its key.
#include "strata/engine/runtime/stats.h"

#include <type_traits>

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

}  // namespace strata::engine
