#include "strata/engine/optimizer_driver.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "strata/core/logging.h"

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
  std::unique_ptr<OptimizerDriver> d(
      new OptimizerDriver(partition, working_shards, working_dtype, comm, adam, options));
  STRATA_RETURN_IF_ERROR(d->optimizer_.AddGroup(options.adam).status());
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
  return optimizer_.SetStepCount(0, step);
}

Result<StepOutcome> OptimizerDriver::Step(double lr, LossScaler& scaler) {
  struct Timer {
    double& total;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timer() {
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } timer{stats_.step_s};
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

  // 5: one fused pass per sub-group.
  AdamParams params = options_.adam;
  params.lr = lr;
  STRATA_RETURN_IF_ERROR(optimizer_.SetGroupParams(0, params));
  std::span<float> master = master_.as<float>();
  std::span<float> m = m_.as<float>();
  std::span<float> v = v_.as<float>();
  std::vector<AdamTensors> parts;
  const bool half = dtype_ != DType::kFloat32;
  for (size_t off = 0; off < n; off += options_.sub_group_elems) {
    const size_t len = std::min<size_t>(options_.sub_group_elems, n - off);
    AdamTensors t{master.subspan(off, len), m.subspan(off, len), v.subspan(off, len),
                  GradSpan::Fp32(acc.subspan(off, len)), Param16Span{}};
    if (half) {
      t.param16 =
          Param16Span{reinterpret_cast<uint16_t*>(working_) + off, len, ToScalarType(dtype_)};
    }
    parts.push_back(t);
  }
  if (parts.empty()) {
    STRATA_RETURN_IF_ERROR(optimizer_.SetStepCount(0, adam_step() + 1));
  } else {
    STRATA_RETURN_IF_ERROR(optimizer_.StepGroup(0, parts, scaling));
  }
  if (!half && n > 0) std::memcpy(working_, master.data(), n * sizeof(float));
  out.applied = true;
  out.adam_step = adam_step();
  ++stats_.steps_applied;
  stats_.adam_calls += parts.size();
  stats_.elements_updated += n;
  stats_.params_updated += real_shard_elems_;

  // 6.
  ZeroGradAccumulators();
  return out;
}

}  // namespace strata::engine
