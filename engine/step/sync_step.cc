// The step inside Step(): the gradient norm and the overflow agreed on, the loss scale, then
// CPU-Adam (or LAMB) sub-group by sub-group (optimizer_driver.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/core/logging.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/step/driver_internal.h"
#include "strata/engine/step/optimizer_driver.h"
#include "strata/engine/timeline/elapsed.h"
#include "strata/swap/crc32c.h"
namespace strata::engine {

using namespace driver_internal;  // NOLINT(google-build-using-namespace): the driver's own

Result<bool> OptimizerDriver::Prepare(double lr, LossScaler& scaler, StepOutcome& out,
                                      GradScaling& scaling) {
  out.boundary = true;
  out.lr = lr;
  out.loss_scale = scaler.scale();
  const float inv_scale = static_cast<float>(1.0 / scaler.scale());
  const bool can_fail = this->can_fail();
  const auto world = static_cast<size_t>(partition_->world_size);

  // Lazy zeroing: the stale gradients no addition wrote over are zeroed before the norm and
  // the update read them (none when every parameter got a gradient). An early step's
  // groups were, each as it was given to the worker (all of them by now).
  if (update_ == nullptr) STRATA_RETURN_IF_ERROR(MaterializeChunkZeros(0, num_chunks_));
  // 1-2: local norm² and overflow (and, with a store that can fail, each rank's I/O
  // outcome of the backward and of reading the accumulators), one all-reduce.
  Status io = std::exchange(acc_error_, Status::Ok());
  std::optional<TimedScope> summing;  // until the all-reduce
  summing.emplace(stats_.norm_s, options_.timeline, "gradient norm", TimelineLane::kOptimizer);
  // The norm summed during the backward (host memory): the tiles left are summed now.
  if (norm_ahead_ != nullptr) STRATA_RETURN_IF_ERROR(SumNormInBackward());
  // Each chunk's sum as noted when it was written out, else read now — in the reverse of
  // the update's order, so the chunks read last are the first the update needs and an NVMe
  // store still holds them. The sums are added in one fixed order either way.
  const offload::StateId acc_id = id(OptimizerState::kGradAccumulator);
  std::vector<size_t> unread;
  if (sums_ != nullptr) {
    // The device's sums: every chunk's tiles summed there (the micro-steps added into them
    // unseen); nothing is read to the host for the norm.
    for (size_t at = order_.size(); at-- > 0;)
      STRATA_RETURN_IF_ERROR(NoteDeviceNorm(order_[at]));
  }
  for (size_t at = order_.size(); at-- > 0;) {
    const size_t i = order_[at];
    if (!acc_norm_[i].valid && !NoteAccNormAsWritten(i)) unread.push_back(i);
  }
  const size_t ahead = update_ != nullptr ? 0 : options_.prefetch_ahead;
  for (size_t k = 0; k < std::min(ahead, unread.size()); ++k) {
    Status hint = StoreFor(OptimizerState::kGradAccumulator)
                      ->Prefetch(StateRange{acc_id, unread[k]});  // errors: kept
  }
  if (update_ != nullptr) {
    // An early step: its update holds the chunks (and only reads the accumulators); its
    // worker summed the tiles of the groups it finished.
    STRATA_RETURN_IF_ERROR(NoteEarlyAccNorms(unread));
    unread.clear();
  }
  for (size_t k = 0; k < unread.size() && io.ok(); ++k) {
    Result<StateLease> l = StoreFor(OptimizerState::kGradAccumulator)
                               ->Acquire(StateRange{acc_id, unread[k]}, Access::kRead);
    if (ahead > 0 && k + ahead < unread.size()) {
      Status hint = StoreFor(OptimizerState::kGradAccumulator)
                        ->Prefetch(StateRange{acc_id, unread[k + ahead]});
    }
    if (!l.ok()) {
      if (!can_fail) return l.status();
      io = l.status().WithContext("reading the gradient accumulators for the norm");
      break;
    }
    STRATA_RETURN_IF_ERROR(NoteAccNorm(unread[k], l->as<const float>()));
    STRATA_RETURN_IF_ERROR(l->Release());
  }
  double sum_sq = 0.0;
  bool inf_nan = false;
  for (size_t at = order_.size(); at-- > 0 && io.ok();) {
    const ChunkNorm& c = acc_norm_[order_[at]];
    sum_sq += c.sum_sq;
    inf_nan = inf_nan || c.inf_nan;
    stats_.norm_tiles_as_written += c.tiles_as_written;
  }
  // The update zeroes the accumulators next (with the step, or at its end): the tile sums
  // are spent. (An early step's worker may still read them: its update's end forgets them.)
  if (update_ == nullptr) ForgetTilesAsWritten();
  // Unscaled by the loss scale here, in double (the chunks' sums are of the scaled values).
  sum_sq *= static_cast<double>(inv_scale) * static_cast<double>(inv_scale);
  summing.reset();
  std::vector<float> reduced(2 + (can_fail ? world : 0), 0.0f);
  reduced[0] = static_cast<float>(sum_sq);
  reduced[1] = inf_nan ? 1.0f : 0.0f;
  if (can_fail && !io.ok()) reduced[2 + static_cast<size_t>(partition_->rank)] = 1.0f;
  STRATA_RETURN_IF_ERROR_CTX(
      comm_->AllReduce(reduced.data(), reduced.size(), comm::DType::kFloat32, comm::ReduceOp::kSum),
      "all-reduce of the gradient norm and overflow flag");
  ++stats_.norm_all_reduce_calls;
  if (can_fail) {
    Status agreed = Agree(io, std::vector<float>(reduced.begin() + 2, reduced.end()),
                          "accumulating the gradients of this step");
    if (!agreed.ok()) return agreed;  // rolled back: the accumulators are zero again
  }
  out.overflow = reduced[1] > 0.0f || !std::isfinite(reduced[0]);
  out.global_norm = std::sqrt(static_cast<double>(reduced[0]));
  stats_.last_global_norm = out.global_norm;

  // 3: overflow.
  const bool skip =
      scaler.enabled() ? scaler.Update(out.overflow) : out.overflow && options_.skip_inf_nan;
  if (out.overflow && !skip && !scaler.enabled()) {
    STRATA_LOG(kWarn) << "inf/NaN gradients applied (strata.skip_inf_nan_steps false): the "
                         "parameters now hold inf/NaN";
    ++stats_.steps_inf_nan_applied;
  }
  if (skip) {
    if (!scaler.enabled()) {
      STRATA_LOG(kWarn) << "inf/NaN gradients without fp16 loss scaling: step skipped";
    }
    ++stats_.steps_skipped;
    out.adam_step = adam_step();
    STRATA_RETURN_IF_ERROR(ZeroGradAccumulators());
    STRATA_RETURN_IF_ERROR(Commit());  // every rank skips: the same collectives
    return false;
  }

  // 4: clipping.
  if (options_.gradient_clipping > 0.0) {
    out.clip_coef = std::min(1.0, options_.gradient_clipping / (out.global_norm + 1e-6));
  }
  scaling = GradScaling{inv_scale, static_cast<float>(out.clip_coef)};
  return true;
}

Result<bool> OptimizerDriver::TimedPrepare(double lr, LossScaler& scaler, StepOutcome& out,
                                           GradScaling& scaling) {
  AddElapsed timed(stats_.step_s);
  return Prepare(lr, scaler, out, scaling);
}

Result<StepOutcome> OptimizerDriver::Finish(StepOutcome out, Status io, size_t calls,
                                            int64_t next_step) {
  // 6: with a store that can fail, everything is written and every rank's outcome agreed
  // on before the step is committed anywhere.
  if (io.ok()) io = ZeroGradAccumulators();
  STRATA_RETURN_IF_ERROR(CommitAgreed(std::move(io), "the optimizer step"));
  for (int k = 0; k < optimizer_.num_groups(); ++k)
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, next_step));
  out.applied = true;
  out.adam_step = adam_step();
  ++stats_.steps_applied;
  stats_.adam_calls += calls;
  stats_.elements_updated += partition_->partition_numel;
  stats_.params_updated += real_shard_elems_;
  return out;
}

Result<StepOutcome> OptimizerDriver::Step(double lr, LossScaler& scaler,
                                          std::optional<std::pair<double, double>> betas) {
  if (update_ != nullptr) {
    return FailedPreconditionError(
        "Step while a pipelined update is in flight: FinishUpdate first");
  }
  AddElapsed timed(stats_.step_s);
  StepOutcome out;
  GradScaling scaling;
  STRATA_ASSIGN_OR_RETURN(const bool update, Prepare(lr, scaler, out, scaling));
  if (!update) return out;
  const bool can_fail = this->can_fail();
  // 5: the update (Adam: StepAdam; LAMB: StepLamb); every group's step counter advances
  // together, once the step is committed on every rank. Released chunks are written
  // behind only here, where each is visited once.
  const int64_t next_step = adam_step() + 1;
  size_t calls = 0;
  Status io;
  {
    store_->SetWriteBehind(true);
    struct Off {
      offload::StateStore* s;
      ~Off() { s->SetWriteBehind(false); }
    } off{store_};
    if (options_.lamb) {
      STRATA_RETURN_IF_ERROR(StepLamb(lr, betas, scaling, next_step, io));
      calls = 2 * pieces_.size();
    } else {
      Result<size_t> c = StepAdam(lr, betas, scaling, next_step);
      if (!c.ok()) {
        if (!can_fail) return c.status();
        io = c.status();
      } else {
        calls = *c;
      }
    }
  }
  return Finish(out, std::move(io), calls, next_step);
}

AdamParams OptimizerDriver::GroupParamsAt(size_t k, double lr,
                                          std::optional<std::pair<double, double>> betas) const {
  AdamParams params = options_.groups[k];
  params.lr = options_.adam.lr > 0 ? lr * options_.groups[k].lr / options_.adam.lr : lr;
  if (betas) {
    params.beta1 = betas->first;
    params.beta2 = betas->second;
  }
  return params;
}

Result<std::vector<AdamParams>> OptimizerDriver::AdamParamsAt(
    double lr, std::optional<std::pair<double, double>> betas) {
  std::vector<AdamParams> params(options_.groups.size());
  for (size_t k = 0; k < params.size(); ++k) {
    params[k] = GroupParamsAt(k, lr, betas);
    stats_.group_lr[k] = params[k].lr;
    STRATA_RETURN_IF_ERROR(optimizer_.SetGroupParams(static_cast<int>(k), params[k]));
  }
  return params;
}

Status OptimizerDriver::AdamRun(Leases& l, size_t i, const Run& r, std::byte* to,
                                const AdamParams& params, int64_t step, const GradScaling& scaling,
                                bool zero_grad) const {
  const size_t o = r.offset - chunk_begin(i);
  AdamTensors t{l.span(OptimizerState::kMaster).subspan(o, r.count),
                l.span(OptimizerState::kExpAvg).subspan(o, r.count),
                l.span(OptimizerState::kExpAvgSq).subspan(o, r.count),
                GradSpan::Fp32(l.span(OptimizerState::kGradAccumulator).subspan(o, r.count)),
                Param16Span{}};
  // (to null: a delayed update, which writes no working shard.)
  const bool half = dtype_ != DType::kFloat32;
  if (half && to != nullptr)
    t.param16 = Param16Span{reinterpret_cast<uint16_t*>(to), r.count, ToScalarType(dtype_)};
  const std::span<float> zero =
      zero_grad ? l.span(OptimizerState::kGradAccumulator).subspan(o, r.count) : std::span<float>{};
  STRATA_RETURN_IF_ERROR(cpu_adam_->Step(params, step, scaling, t, zero));
  if (!half && to != nullptr) std::memcpy(to, t.param.data(), t.param.size_bytes());
  return Status::Ok();
}

Status OptimizerDriver::RoundInto(std::span<const float> master, std::byte* to) const {
  if (dtype_ == DType::kFloat32) {
    ConvertFromFloat(master.data(), master.size(), to, dtype_);
    return Status::Ok();
  }
  // The kernel's threaded SIMD copy-out (the same rounding as the step's).
  return cpu_adam_->CopyToHalf(
      master, Param16Span{reinterpret_cast<uint16_t*>(to), master.size(), ToScalarType(dtype_)});
}

Status OptimizerDriver::CopyOutRun(Leases& l, size_t i, const Run& r, std::byte* to) const {
  return RoundInto(l.span(OptimizerState::kMaster).subspan(r.offset - chunk_begin(i), r.count), to);
}

Result<size_t> OptimizerDriver::StepAdam(double lr, std::optional<std::pair<double, double>> betas,
                                         const GradScaling& scaling, int64_t step) {
  STRATA_ASSIGN_OR_RETURN(const std::vector<AdamParams> params, AdamParamsAt(lr, betas));
  constexpr Access kAccess[4] = {Access::kReadWrite, Access::kReadWrite, Access::kReadWrite,
                                 Access::kRead};
  size_t calls = 0;
  ShardWriter out(working_);
  const bool ascending = std::is_sorted(order_.begin(), order_.end());
  const size_t ahead = options_.prefetch_ahead;
  for (size_t k = 0; k < std::min(ahead, order_.size()); ++k)
    PrefetchSubGroup(order_[k], kAccess);
  for (size_t at = 0; at < order_.size(); ++at) {
    const size_t i = order_[at];
    STRATA_ASSIGN_OR_RETURN(Leases l, AcquireSubGroup(i, kAccess));
    // Keep `ahead` sub-groups coming: the chunks before are already being read.
    if (ahead > 0 && at + ahead < order_.size()) PrefetchSubGroup(order_[at + ahead], kAccess);
    if (sums_ != nullptr && at + 1 < order_.size()) {
      // The device's sums: the next sub-group's copy to the host runs beside this one's pass.
      Status hint =
          sums_->Prefetch(StateRange{id(OptimizerState::kGradAccumulator), order_[at + 1]});
      if (!hint.ok()) return hint;
    }
    if (options_.test.on_update) options_.test.on_update(i, true);
    {
      TimedScope adam(stats_.adam_s, options_.timeline, "CPU optimizer pass",
                      TimelineLane::kOptimizer, static_cast<int>(i));
      // One fused pass per parameter-group run of the sub-group.
      for (const Run& r : chunk_runs_[i]) {
        // The runs cover the sub-group, and in ascending order the partition: a group's
        // shard is then written whole while held (no read of its old contents).
        STRATA_ASSIGN_OR_RETURN(std::byte * to,
                                out.At(r.offset, r.count, ascending || group_inside(r.offset, i)));
        STRATA_RETURN_IF_ERROR(
            AdamRun(l, i, r, to, params[static_cast<size_t>(r.group)], step, scaling));
        ++calls;
      }
    }
    if (options_.test.on_update) options_.test.on_update(i, false);
    for (offload::StateLease& lease : l.l)
      STRATA_RETURN_IF_ERROR(lease.Release());
    // The sub-group's gradients are spent: zero now frees an NVMe buffer without a write
    // (a failed step rolls them back with the rest). The device's sums are zeroed once, by
    // Finish (nothing is freed by zeroing them earlier).
    if (sums_ == nullptr) STRATA_RETURN_IF_ERROR(ZeroAccumulatorChunk(i));
  }
  STRATA_RETURN_IF_ERROR(out.Release());
  if (options_.test.on_group_updated) {
    for (int g = 0; g < static_cast<int>(partition_->groups.size()); ++g)
      options_.test.on_group_updated(g);
  }
  return calls;
}

Status OptimizerDriver::StepLamb(double lr, std::optional<std::pair<double, double>> betas,
                                 const GradScaling& scaling, int64_t step, Status& io_error) {
  std::vector<LambParams> params;
  for (size_t k = 0; k < options_.groups.size(); ++k) {
    const AdamParams a = GroupParamsAt(k, lr, betas);
    LambParams p;
    p.lr = a.lr;
    p.beta1 = a.beta1;
    p.beta2 = a.beta2;
    p.eps = a.eps;
    p.weight_decay = a.weight_decay;
    p.bias_correction = a.bias_correction;
    p.eps_inside_sqrt = options_.lamb->eps_inside_sqrt;
    p.max_coeff = options_.lamb->max_coeff;
    p.min_coeff = options_.lamb->min_coeff;
    params.push_back(p);
    stats_.group_lr[k] = p.lr;
  }
  const bool can_fail = this->can_fail();
  // Pieces never cross a sub-group: each pass visits the sub-groups in order and runs the
  // pieces of each while its chunks are held.
  auto pass = [&](const Access(&access)[4], auto&& fn) -> Status {
    size_t next = 0;
    // The apply pass (no accumulator) writes the working shards: the pieces cover the
    // partition in ascending order, so each shard is written whole while held.
    const bool copy_out = access[3] == kSkip;
    ShardWriter out(working_);
    const size_t ahead = options_.prefetch_ahead;
    for (size_t k = 0; k < std::min(ahead, num_chunks_); ++k)
      PrefetchSubGroup(k, access);
    for (size_t i = 0; i < num_chunks_; ++i) {
      STRATA_ASSIGN_OR_RETURN(Leases l, AcquireSubGroup(i, access));
      if (ahead > 0 && i + ahead < num_chunks_) PrefetchSubGroup(i + ahead, access);
      const size_t b = chunk_begin(i), e = chunk_end(i);
      for (; next < pieces_.size() && pieces_[next].offset < e; ++next) {
        const Piece& pc = pieces_[next];
        const size_t o = pc.offset - b;
        AdamTensors t{l.span(OptimizerState::kMaster).subspan(o, pc.count),
                      l.span(OptimizerState::kExpAvg).subspan(o, pc.count),
                      l.span(OptimizerState::kExpAvgSq).subspan(o, pc.count), GradSpan{},
                      Param16Span{}};
        if (l.l[3].valid()) {
          t.grad = GradSpan::Fp32(l.span(OptimizerState::kGradAccumulator).subspan(o, pc.count));
        }
        std::byte* to = nullptr;
        if (copy_out) {
          STRATA_ASSIGN_OR_RETURN(to, out.At(pc.offset, pc.count, /*whole=*/true));
          if (dtype_ != DType::kFloat32) {
            t.param16 =
                Param16Span{reinterpret_cast<uint16_t*>(to), pc.count, ToScalarType(dtype_)};
          }
        }
        {
          TimedScope adam(stats_.adam_s, options_.timeline, "CPU optimizer pass",
                          TimelineLane::kOptimizer, static_cast<int>(i));
          STRATA_RETURN_IF_ERROR(fn(pc, t));
        }
        if (copy_out && dtype_ == DType::kFloat32) {
          std::memcpy(to, t.param.data(), t.param.size_bytes());
        }
      }
      for (offload::StateLease& lease : l.l)
        STRATA_RETURN_IF_ERROR(lease.Release());
    }
    return out.Release();
  };
  // 5a: moments, and each parameter's local sums.
  std::vector<double> local(2 * num_params_, 0.0);
  constexpr Access kMoments[4] = {Access::kRead, Access::kReadWrite, Access::kReadWrite,
                                  Access::kRead};
  Status st = pass(kMoments, [&](const Piece& pc, const AdamTensors& t) -> Status {
    AdamTensors moments = t;
    moments.param16 = Param16Span{};
    STRATA_ASSIGN_OR_RETURN(
        LambNorms sums,
        cpu_adam_->LambMoments(params[static_cast<size_t>(pc.group)], step, scaling, moments));
    local[2 * static_cast<size_t>(pc.param)] += sums.param_sq;
    local[2 * static_cast<size_t>(pc.param) + 1] += sums.update_sq;
    return Status::Ok();
  });
  if (!st.ok()) {
    if (!can_fail) return st;
    io_error = st;
  }
  // 5b: every rank, every step, the same all-reduce (a rank without pieces, or whose
  // states failed to load, sends zeros).
  std::vector<float> reduced(local.begin(), local.end());
  if (!reduced.empty()) {
    STRATA_RETURN_IF_ERROR_CTX(comm_->AllReduce(reduced.data(), reduced.size(),
                                                comm::DType::kFloat32, comm::ReduceOp::kSum),
                               "all-reduce of LAMB's per-parameter norms");
    ++stats_.lamb_norms_all_reduce_calls;
    stats_.lamb_norms_all_reduce_bytes += reduced.size() * sizeof(float);
  }
  if (!io_error.ok()) return Status::Ok();
  // 5c: the ratios (the clamp is the same in every group) and the update.
  std::vector<double> ratio(num_params_, 1.0);
  for (size_t q = 0; q < num_params_; ++q) {
    ratio[q] = LambTrustRatio(params.front(), {reduced[2 * q], reduced[2 * q + 1]});
  }
  if (!ratio.empty()) {
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    stats_.lamb_trust_ratio_min = *lo;
    stats_.lamb_trust_ratio_max = *hi;
  }
  constexpr Access kApply[4] = {Access::kReadWrite, Access::kRead, Access::kRead, kSkip};
  st = pass(kApply, [&](const Piece& pc, const AdamTensors& t) -> Status {
    return cpu_adam_->LambApply(params[static_cast<size_t>(pc.group)], step,
                                ratio[static_cast<size_t>(pc.param)], t);
  });
  if (!st.ok()) {
    if (!can_fail) return st;
    io_error = st;
  }
  return Status::Ok();
}

}  // namespace strata::engine
