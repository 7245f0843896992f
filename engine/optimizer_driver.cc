#include "strata/engine/optimizer_driver.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "strata/core/logging.h"
#include "strata/engine/elapsed.h"

namespace strata::engine {

OptimizerDriver::OptimizerDriver(const ModelPartition* partition, std::byte* working, DType dtype,
                                 comm::Communicator* comm, const CpuAdam* adam,
                                 const OptimizerDriverOptions& options)
    : partition_(partition),
      working_(working),
      dtype_(dtype),
      comm_(comm),
      cpu_adam_(adam),
      optimizer_(adam),
      options_(options) {}

Result<std::unique_ptr<OptimizerDriver>> OptimizerDriver::Create(
    const ModelPartition* partition, Tier* optimizer_tier, std::byte* working_shards,
    DType working_dtype, comm::Communicator* comm, const CpuAdam* adam,
    const OptimizerDriverOptions& options) {
  if (partition == nullptr || optimizer_tier == nullptr || comm == nullptr || adam == nullptr) {
    return InvalidArgumentError("OptimizerDriver: null partition, tier, communicator or CpuAdam");
  }
  if (working_shards == nullptr && partition->partition_numel > 0) {
    return InvalidArgumentError("OptimizerDriver: null working shards");
  }
  if (options.sub_group_elems == 0) {
    return InvalidArgumentError("zero_optimization.sub_group_size must be at least 1");
  }
  STRATA_RETURN_IF_ERROR(ValidateAdamParams(options.adam));
  OptimizerDriverOptions o = options;
  if (o.groups.empty()) o.groups.push_back(o.adam);
  for (size_t k = 0; k < o.groups.size(); ++k) {
    STRATA_RETURN_IF_ERROR(
        ValidateAdamParams(o.groups[k]).WithContext("parameter group " + std::to_string(k)));
  }
  if (o.lamb) {
    LambParams check;
    check.max_coeff = o.lamb->max_coeff;
    check.min_coeff = o.lamb->min_coeff;
    STRATA_RETURN_IF_ERROR(ValidateLambParams(check));
  }
  std::unique_ptr<OptimizerDriver> d(
      new OptimizerDriver(partition, working_shards, working_dtype, comm, adam, o));
  for (const AdamParams& g : o.groups)
    STRATA_RETURN_IF_ERROR(d->optimizer_.AddGroup(g).status());
  STRATA_RETURN_IF_ERROR(d->BuildRuns());
  if (o.lamb) d->BuildPieces();
  const size_t bytes = partition->partition_numel * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(d->master_, optimizer_tier->Allocate(bytes, "fp32 master parameters"));
  STRATA_ASSIGN_OR_RETURN(d->m_, optimizer_tier->Allocate(bytes, "Adam exp_avg (m)"));
  STRATA_ASSIGN_OR_RETURN(d->v_, optimizer_tier->Allocate(bytes, "Adam exp_avg_sq (v)"));
  STRATA_ASSIGN_OR_RETURN(d->acc_, optimizer_tier->Allocate(bytes, "fp32 gradient accumulators"));
  d->stats_.master_bytes = d->stats_.exp_avg_bytes = d->stats_.exp_avg_sq_bytes =
      d->stats_.grad_accumulator_bytes = bytes;
  for (const GroupLayout& g : partition->groups) {
    for (size_t i = 0; i < g.params.size(); ++i) {
      if (auto s = g.Slice(i, partition->rank)) d->real_shard_elems_ += s->count;
    }
  }
  return d;
}

Status OptimizerDriver::BuildRuns() {
  const size_t n = partition_->partition_numel;
  const int num_groups = static_cast<int>(options_.groups.size());
  if (!options_.param_group.empty() && options_.param_group.size() != partition_->groups.size()) {
    return InvalidArgumentError("parameter groups: " + std::to_string(options_.param_group.size()) +
                                " engine groups named, the model has " +
                                std::to_string(partition_->groups.size()));
  }
  // Each parameter's slice on this rank starts a run of its group (padding follows it).
  std::vector<Run> starts;
  for (size_t g = 0; g < partition_->groups.size(); ++g) {
    const GroupLayout& layout = partition_->groups[g];
    if (!options_.param_group.empty() && options_.param_group[g].size() != layout.params.size()) {
      return InvalidArgumentError("parameter groups: engine group " + layout.name + " has " +
                                  std::to_string(layout.params.size()) + " parameters, " +
                                  std::to_string(options_.param_group[g].size()) + " named");
    }
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const int k = options_.param_group.empty() ? 0 : options_.param_group[g][i];
      if (k < 0 || k >= num_groups) {
        return InvalidArgumentError("parameter " + layout.params[i].name + ": parameter group " +
                                    std::to_string(k) + " of " + std::to_string(num_groups));
      }
      if (auto sl = layout.Slice(i, partition_->rank)) {
        starts.push_back({partition_->shard_offset[g] + sl->shard_offset, 0, k});
      }
    }
  }
  std::sort(starts.begin(), starts.end(),
            [](const Run& a, const Run& b) { return a.offset < b.offset; });
  runs_.clear();
  int group = starts.empty() ? 0 : starts.front().group;
  size_t from = 0;
  for (const Run& r : starts) {
    if (r.group == group) continue;
    if (r.offset > from) runs_.push_back({from, r.offset - from, group});
    from = r.offset;
    group = r.group;
  }
  if (n > from) runs_.push_back({from, n - from, group});
  stats_.group_elements.assign(static_cast<size_t>(num_groups), 0);
  stats_.group_lr.assign(static_cast<size_t>(num_groups), 0.0);
  for (const Run& r : runs_)
    stats_.group_elements[static_cast<size_t>(r.group)] += r.count;
  return Status::Ok();
}

void OptimizerDriver::BuildPieces() {
  const size_t n = partition_->partition_numel;
  std::vector<Piece> starts;
  int param = 0;
  for (size_t g = 0; g < partition_->groups.size(); ++g) {
    const GroupLayout& layout = partition_->groups[g];
    for (size_t i = 0; i < layout.params.size(); ++i, ++param) {
      const int k = options_.param_group.empty() ? 0 : options_.param_group[g][i];
      if (auto sl = layout.Slice(i, partition_->rank)) {
        starts.push_back({partition_->shard_offset[g] + sl->shard_offset, 0, param, k});
      }
    }
  }
  num_params_ = static_cast<size_t>(param);
  std::sort(starts.begin(), starts.end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  // Elements before the first slice are padding: zero, and they stay zero.
  pieces_.clear();
  for (size_t j = 0; j < starts.size(); ++j) {
    const size_t end = j + 1 < starts.size() ? starts[j + 1].offset : n;
    for (size_t off = starts[j].offset; off < end;) {
      const size_t window_end = (off / options_.sub_group_elems + 1) * options_.sub_group_elems;
      const size_t len = std::min(end, window_end) - off;
      pieces_.push_back({off, len, starts[j].param, starts[j].group});
      off += len;
    }
  }
}

Status OptimizerDriver::SyncWorkingFromMaster() {
  const size_t n = partition_->partition_numel;
  if (dtype_ == DType::kFloat32 || n == 0) {
    ConvertFromFloat(master_.as<float>().data(), n, working_, dtype_);
    return Status::Ok();
  }
  // The kernel's threaded SIMD copy-out (the same rounding as the step's).
  return cpu_adam_->CopyToHalf(
      master_.as<const float>(),
      Param16Span{reinterpret_cast<uint16_t*>(working_), n, ToScalarType(dtype_)});
}

void OptimizerDriver::ZeroGradAccumulators() {
  if (!acc_.empty()) std::memset(acc_.data(), 0, acc_.size());
}

int64_t OptimizerDriver::adam_step() const {
  return optimizer_.StepCount(0).value_or(0);
}

Status OptimizerDriver::set_adam_step(int64_t step) {
  for (int k = 0; k < optimizer_.num_groups(); ++k)
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, step));
  return Status::Ok();
}

Result<StepOutcome> OptimizerDriver::Step(double lr, LossScaler& scaler,
                                          std::optional<std::pair<double, double>> betas) {
  AddElapsed timed(stats_.step_s);
  StepOutcome out;
  out.boundary = true;
  out.lr = lr;
  out.loss_scale = scaler.scale();
  const size_t n = partition_->partition_numel;
  const float inv_scale = static_cast<float>(1.0 / scaler.scale());
  std::span<float> acc = acc_.as<float>();

  // 1-2: local norm² and overflow, one all-reduce.
  float reduced[2] = {0.0f, 0.0f};
  if (n > 0) {
    STRATA_ASSIGN_OR_RETURN(GradNorm local,
                            cpu_adam_->GradSquaredNorm(GradSpan::Fp32(acc), inv_scale));
    reduced[0] = static_cast<float>(local.sum_sq);
    reduced[1] = local.has_inf_nan ? 1.0f : 0.0f;
  }
  STRATA_RETURN_IF_ERROR_CTX(
      comm_->AllReduce(reduced, 2, comm::DType::kFloat32, comm::ReduceOp::kSum),
      "all-reduce of the gradient norm and overflow flag");
  ++stats_.norm_all_reduce_calls;
  out.overflow = reduced[1] > 0.0f || !std::isfinite(reduced[0]);
  out.global_norm = std::sqrt(static_cast<double>(reduced[0]));
  stats_.last_global_norm = out.global_norm;

  // 3: overflow.
  const bool skip = scaler.enabled() ? scaler.Update(out.overflow) : out.overflow;
  if (skip) {
    if (!scaler.enabled()) {
      STRATA_LOG(kWarn) << "inf/NaN gradients without fp16 loss scaling: step skipped";
    }
    ++stats_.steps_skipped;
    out.adam_step = adam_step();
    ZeroGradAccumulators();
    return out;
  }

  // 4: clipping.
  if (options_.gradient_clipping > 0.0) {
    out.clip_coef = std::min(1.0, options_.gradient_clipping / (out.global_norm + 1e-6));
  }
  const GradScaling scaling{inv_scale, static_cast<float>(out.clip_coef)};

  // 5: the update (Adam: StepAdam; LAMB: StepLamb); every group's step counter advances
  // together.
  const int64_t next_step = adam_step() + 1;
  size_t calls = 0;
  if (options_.lamb) {
    STRATA_RETURN_IF_ERROR(StepLamb(lr, betas, scaling, next_step));
    calls = 2 * pieces_.size();
    for (int k = 0; k < optimizer_.num_groups(); ++k)
      STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(k, next_step));
  } else {
    STRATA_ASSIGN_OR_RETURN(calls, StepAdam(lr, betas, scaling, next_step));
  }
  const bool half = dtype_ != DType::kFloat32;
  std::span<float> master = master_.as<float>();
  if (!half && n > 0) std::memcpy(working_, master.data(), n * sizeof(float));
  out.applied = true;
  out.adam_step = adam_step();
  ++stats_.steps_applied;
  stats_.adam_calls += calls;
  stats_.elements_updated += n;
  stats_.params_updated += real_shard_elems_;

  // 6.
  ZeroGradAccumulators();
  return out;
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

Result<size_t> OptimizerDriver::StepAdam(double lr, std::optional<std::pair<double, double>> betas,
                                         const GradScaling& scaling, int64_t step) {
  // One fused pass per sub-group and parameter group (a sub-group is cut where the
  // parameter group changes).
  std::span<float> master = master_.as<float>();
  std::span<float> m = m_.as<float>();
  std::span<float> v = v_.as<float>();
  std::span<float> acc = acc_.as<float>();
  const size_t num_groups = options_.groups.size();
  std::vector<std::vector<AdamTensors>> parts(num_groups);
  const bool half = dtype_ != DType::kFloat32;
  size_t calls = 0;
  for (const Run& r : runs_) {
    for (size_t done = 0; done < r.count;) {
      // Sub-groups are windows of sub_group_elems over the partition.
      const size_t off = r.offset + done;
      const size_t window_end = (off / options_.sub_group_elems + 1) * options_.sub_group_elems;
      const size_t len = std::min(r.count - done, window_end - off);
      AdamTensors t{master.subspan(off, len), m.subspan(off, len), v.subspan(off, len),
                    GradSpan::Fp32(acc.subspan(off, len)), Param16Span{}};
      if (half) {
        t.param16 =
            Param16Span{reinterpret_cast<uint16_t*>(working_) + off, len, ToScalarType(dtype_)};
      }
      parts[static_cast<size_t>(r.group)].push_back(t);
      done += len;
    }
  }
  for (size_t k = 0; k < num_groups; ++k) {
    const AdamParams params = GroupParamsAt(k, lr, betas);
    stats_.group_lr[k] = params.lr;
    const int g = static_cast<int>(k);
    STRATA_RETURN_IF_ERROR(optimizer_.SetGroupParams(g, params));
    if (parts[k].empty()) {
      STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(g, step));
    } else {
      STRATA_RETURN_IF_ERROR(optimizer_.StepGroup(g, parts[k], scaling));
      calls += parts[k].size();
    }
  }
  return calls;
}

Status OptimizerDriver::StepLamb(double lr, std::optional<std::pair<double, double>> betas,
                                 const GradScaling& scaling, int64_t step) {
  std::span<float> master = master_.as<float>();
  std::span<float> m = m_.as<float>();
  std::span<float> v = v_.as<float>();
  std::span<float> acc = acc_.as<float>();
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
  auto tensors = [&](const Piece& pc) {
    AdamTensors t{master.subspan(pc.offset, pc.count), m.subspan(pc.offset, pc.count),
                  v.subspan(pc.offset, pc.count), GradSpan::Fp32(acc.subspan(pc.offset, pc.count)),
                  Param16Span{}};
    if (dtype_ != DType::kFloat32) {
      t.param16 = Param16Span{reinterpret_cast<uint16_t*>(working_) + pc.offset, pc.count,
                              ToScalarType(dtype_)};
    }
    return t;
  };
  // 5a: moments, and each parameter's local sums.
  std::vector<double> local(2 * num_params_, 0.0);
  for (const Piece& pc : pieces_) {
    const auto k = static_cast<size_t>(pc.group);
    STRATA_ASSIGN_OR_RETURN(LambNorms sums,
                            cpu_adam_->LambMoments(params[k], step, scaling, tensors(pc)));
    local[2 * static_cast<size_t>(pc.param)] += sums.param_sq;
    local[2 * static_cast<size_t>(pc.param) + 1] += sums.update_sq;
  }
  // 5b: every rank, every step, the same all-reduce (a rank without pieces sends zeros).
  std::vector<float> reduced(local.begin(), local.end());
  if (!reduced.empty()) {
    STRATA_RETURN_IF_ERROR_CTX(comm_->AllReduce(reduced.data(), reduced.size(),
                                                comm::DType::kFloat32, comm::ReduceOp::kSum),
                               "all-reduce of LAMB's per-parameter norms");
    ++stats_.lamb_norms_all_reduce_calls;
    stats_.lamb_norms_all_reduce_bytes += reduced.size() * sizeof(float);
  }
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
  for (const Piece& pc : pieces_) {
    STRATA_RETURN_IF_ERROR(cpu_adam_->LambApply(params[static_cast<size_t>(pc.group)], step,
                                                ratio[static_cast<size_t>(pc.param)], tensors(pc)));
  }
  return Status::Ok();
}

}  // namespace strata::engine
