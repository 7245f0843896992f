// OptimizerDriver: the optimizer step over the rank's partition, and the fp32 state it
// owns (master parameters, Adam m and v, gradient accumulators) on the optimizer tier.
//
// Step(lr, scaler), at a gradient-accumulation boundary:
//   1. local sum of squares and inf/NaN flag over the rank's gradient accumulators,
//      unscaled by the loss scale (CpuAdam::GradSquaredNorm);
//   2. ONE all-reduce (sum, fp32) of [norm², overflow flag] over the ranks;
//   3. overflow: the step is skipped (fp16: LossScaler::Update lowers the scale; bf16 and
//      fp32 skip too and count it, rather than writing NaN into the parameters);
//   4. clip coefficient min(1, gradient_clipping / (global_norm + 1e-6)) (1 with clipping
//      off), fused with 1/loss_scale into the kernel's gradient scaling;
//   5. for each sub-group (sub_group_size contiguous elements of the partition) one fused
//      CPU-Adam pass: unscale, clip, weight decay, Adam on master/m/v, and the copy of the
//      new parameters into the working shards (16-bit round-to-nearest-even copy-out in
//      the kernel, or a plain copy in fp32 mode);
//   6. the accumulators are zeroed (also after a skipped step).
// With LAMB (OptimizerDriverOptions::lamb) step 5 is two passes, because a parameter's trust
// ratio needs its whole norms and ZeRO splits a parameter across ranks:
//   5a. per piece (a parameter's elements on this rank, with the padding after it, cut at
//       sub-group windows) CpuAdam::LambMoments updates m and v and returns the piece's
//       sums of w^2 and u^2, added up per parameter;
//   5b. ONE all-reduce (sum, fp32) of the [w^2, u^2] sums of every parameter of the model;
//   5c. per piece CpuAdam::LambApply with its parameter's trust ratio, and the copy-out.
// Every rank computes the same ratios from the same reduced sums.
// All sub-groups share one Adam step counter (AdamOptimizer group 0), advanced once per
// applied step.
//
// Ownership and lifetime: owns its TierBuffers; borrows the partition, the working shards
// (partition_numel elements of the working dtype, on the parameter tier), the communicator
// and the CpuAdam; all must outlive it.
// Thread-safety: not thread-safe; call from the engine's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/status.h"
#include "strata/engine/dtype.h"
#include "strata/engine/loss_scaler.h"
#include "strata/engine/partition.h"
#include "strata/engine/tier.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::engine {

// LAMB's own settings (DeepSpeed FusedLamb's): the trust ratio's clamp and where eps goes.
struct LambOptions {
  double max_coeff = 10.0;
  double min_coeff = 0.01;
  bool eps_inside_sqrt = false;
};

struct OptimizerDriverOptions {
  AdamParams adam;                        // lr is replaced by Step's
  uint64_t sub_group_elems = 1000000000;  // sub_group_size
  double gradient_clipping = 0.0;         // 0 = off
  // Parameter groups (torch.optim's): each group's hyper-parameters; empty: one group,
  // `adam`. A group's learning rate is scaled with the schedule: at a step with learning
  // rate lr, group k uses lr * groups[k].lr / adam.lr (adam.lr = 0: lr).
  std::vector<AdamParams> groups;
  // [engine group][parameter] -> index into `groups` (empty: every parameter in group 0).
  // The padding after a parameter goes with it (its gradient is zero: it stays zero).
  std::vector<std::vector<int>> param_group;
  // LAMB instead of Adam: each group's lr, betas, eps, weight_decay and bias_correction with
  // these (weight_decay_mode is not used: LAMB's decay is part of its update).
  std::optional<LambOptions> lamb;
};

struct StepOutcome {
  bool boundary = false;     // a gradient-accumulation boundary (false: nothing was done)
  bool applied = false;      // the parameters were updated
  bool overflow = false;     // some gradient was inf/NaN: the step was skipped
  double global_norm = 0.0;  // unscaled, over all ranks (before clipping)
  double clip_coef = 1.0;
  double lr = 0.0;
  double loss_scale = 1.0;  // the scale the gradients carried
  int64_t adam_step = 0;    // the optimizer's step count after this step
};

struct OptimizerStats {
  uint64_t steps_applied = 0;
  uint64_t steps_skipped = 0;
  // Fused optimizer passes: Adam one per sub-group and step; LAMB two per piece and step.
  uint64_t adam_calls = 0;
  uint64_t elements_updated = 0;  // elements passed to CPU-Adam, padding included
  uint64_t params_updated = 0;    // real parameter elements of the rank's shards, summed
  uint64_t norm_all_reduce_calls = 0;
  // LAMB: the all-reduces of the per-parameter norm sums (one per applied step), their
  // bytes, and the smallest and largest trust ratio of the last applied step (over every
  // parameter of the model; the same on every rank).
  uint64_t lamb_norms_all_reduce_calls = 0;
  uint64_t lamb_norms_all_reduce_bytes = 0;
  double lamb_trust_ratio_min = 0.0;
  double lamb_trust_ratio_max = 0.0;
  uint64_t master_bytes = 0;  // per rank
  uint64_t exp_avg_bytes = 0;
  uint64_t exp_avg_sq_bytes = 0;
  uint64_t grad_accumulator_bytes = 0;
  double last_global_norm = 0.0;
  double step_s = 0;  // seconds in Step (norm all-reduce, CPU-Adam, copy-out)
  // Per parameter group: the learning rate of the last applied step and the rank's
  // elements (padding included) in the group.
  std::vector<double> group_lr;
  std::vector<uint64_t> group_elements;
};

class OptimizerDriver {
 public:
  static Result<std::unique_ptr<OptimizerDriver>> Create(
      const ModelPartition* partition, Tier* optimizer_tier, std::byte* working_shards,
      DType working_dtype, comm::Communicator* comm, const CpuAdam* adam,
      const OptimizerDriverOptions& options);

  // The rank's fp32 master parameters (partition_numel), e.g. to initialize them. After
  // writing them call SyncWorkingFromMaster.
  std::span<float> master() { return master_.as<float>(); }
  std::span<const float> master() const { return master_.as<const float>(); }
  std::span<const float> exp_avg() const { return m_.as<const float>(); }
  std::span<const float> exp_avg_sq() const { return v_.as<const float>(); }
  // The accumulators the reducer adds into (partition_numel floats).
  float* grad_accumulators() { return acc_.as<float>().data(); }
  // working = master rounded to the working dtype.
  Status SyncWorkingFromMaster();

  // See the header comment. `scaler` is updated (fp16) or left alone (disabled).
  // `betas`: Adam's (beta1, beta2) for this step when the schedule sets them (OneCycle), for
  // every group; nullopt: each group's own.
  Result<StepOutcome> Step(double lr, LossScaler& scaler,
                           std::optional<std::pair<double, double>> betas = std::nullopt);
  void ZeroGradAccumulators();

  int64_t adam_step() const;
  Status set_adam_step(int64_t step);
  OptimizerStats stats() const { return stats_; }

 private:
  OptimizerDriver(const ModelPartition* partition, std::byte* working, DType dtype,
                  comm::Communicator* comm, const CpuAdam* adam,
                  const OptimizerDriverOptions& options);

  // A run of the rank's partition [offset, offset + count) in one parameter group.
  struct Run {
    size_t offset;
    size_t count;
    int group;
  };
  Status BuildRuns();
  // LAMB: a parameter's elements on this rank (its padding included) within one sub-group
  // window; `param` counts the model's parameters over all engine groups.
  struct Piece {
    size_t offset;
    size_t count;
    int param;
    int group;
  };
  void BuildPieces();
  // Group k's hyper-parameters at a step with learning rate `lr`.
  AdamParams GroupParamsAt(size_t k, double lr,
                           std::optional<std::pair<double, double>> betas) const;
  // Step 5 with Adam; returns the fused passes run.
  Result<size_t> StepAdam(double lr, std::optional<std::pair<double, double>> betas,
                          const GradScaling& scaling, int64_t step);
  // Step 5 with LAMB.
  Status StepLamb(double lr, std::optional<std::pair<double, double>> betas,
                  const GradScaling& scaling, int64_t step);

  const ModelPartition* partition_;
  std::vector<Run> runs_;      // in offset order, covering the partition
  std::vector<Piece> pieces_;  // LAMB only, in offset order
  size_t num_params_ = 0;      // of the whole model
  std::byte* working_;
  DType dtype_;
  comm::Communicator* comm_;
  const CpuAdam* cpu_adam_;
  AdamOptimizer optimizer_;
  OptimizerDriverOptions options_;
  TierBuffer master_, m_, v_, acc_;
  uint64_t real_shard_elems_ = 0;
  OptimizerStats stats_;
};

}  // namespace strata::engine
