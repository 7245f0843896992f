// The one table of configuration keys. Validation, default filling, the typed Config,
// `strata-config defaults` and docs/config.md all read it; edit here, then regenerate
// docs/config.md with `build/bin/strata-config defaults --markdown > docs/config.md`.
#include <array>

#include "strata/core/config.h"

namespace strata {
namespace {

using T = KeyType;
constexpr std::string_view kEnabledFalse = R"({"enabled": false})";
// The largest value of a key read into an `int` of the typed Config.
constexpr double kIntMax = 2147483647;

// The table is laid out by hand, a few fields to a line; clang-format would put every
// field on its own line.
// clang-format off
constexpr auto kKeys = std::to_array<KeySpec>({
    // ---- batch, clipping, logging -------------------------------------------------
    {.path = "train_batch_size", .type = T::kInt,
     .meaning = "Global batch size per optimizer step: micro batch x gradient accumulation "
                "steps x world size. Give it, or the micro batch size, or both; the missing "
                "ones are derived and all three must agree.",
     .min = 1},
    {.path = "train_micro_batch_size_per_gpu", .type = T::kInt,
     .meaning = "Samples per forward/backward on each rank.", .min = 1},
    {.path = "gradient_accumulation_steps", .type = T::kInt,
     .meaning = "Micro batches whose gradients are summed before a step. Derived when absent "
                "(1 unless train_batch_size says otherwise).",
     .min = 1},
    {.path = "gradient_clipping", .type = T::kFloat, .default_json = "0.0",
     .meaning = "Clip the global gradient norm to this value; 0 disables clipping.", .min = 0},
    {.path = "steps_per_print", .type = T::kInt, .default_json = "10",
     .meaning = "Log progress every N optimizer steps: strata-train its loss, learning rate and "
                "step time; the Python engine DeepSpeed's line (step, skipped, lr, mom) on rank 0 "
                "through the `strata` logger.",
     .min = 1},
    {.path = "seed", .type = T::kInt, .default_json = "42",
     .meaning = "Seed for Strata's own random choices (the demo data, initialization in "
                "examples).",
     .min = 0},

    // ---- optimizer ------------------------------------------------------------------
    {.path = "optimizer", .type = T::kObject, .default_json = "{}",
     .meaning = "The optimizer run by Strata's CPU-Adam (or on the device)."},
    {.path = "optimizer.type", .type = T::kEnum, .default_json = "\"Adam\"",
     .meaning = "Adam, AdamW or Lamb (case-insensitive, as in DeepSpeed). As in DeepSpeed, Adam "
                "uses decoupled weight decay unless params.adam_w_mode is false. Lamb is "
                "DeepSpeed's FusedLamb: Adam's moments, a per-parameter trust ratio "
                "||w|| / ||update|| clamped to [min_coeff, max_coeff], weight decay inside the "
                "update; it runs on the CPU like Adam, under every ZeRO setting.",
     .choices = "Adam|AdamW|Lamb"},
    {.path = "optimizer.params", .type = T::kObject, .default_json = "{}",
     .meaning = "Hyper-parameters of the optimizer."},
    {.path = "optimizer.params.lr", .type = T::kFloat, .default_json = "0.001",
     .meaning = "Learning rate (the peak rate when a scheduler is set).", .min = 0},
    {.path = "optimizer.params.betas", .type = T::kFloatPair, .default_json = "[0.9, 0.999]",
     .meaning = "Adam's (beta1, beta2), each in [0, 1).", .min = 0, .max = 1},
    {.path = "optimizer.params.eps", .type = T::kFloat, .default_json = "1e-08",
     .meaning = "Added to the denominator for numerical stability.", .min = 0,
     .min_exclusive = true},
    {.path = "optimizer.params.weight_decay", .type = T::kFloat, .default_json = "0.0",
     .meaning = "Weight decay: decoupled (AdamW) when adam_w_mode is true, else L2 added to "
                "the gradient; Lamb adds weight_decay * w to the update its trust ratio "
                "scales.",
     .min = 0},
    {.path = "optimizer.params.bias_correction", .type = T::kBool, .default_json = "true",
     .meaning = "Apply Adam's bias correction to m and v."},
    {.path = "optimizer.params.adam_w_mode", .type = T::kBool, .default_json = "true",
     .meaning = "Decoupled weight decay (DeepSpeed's default for Adam too). Must stay true for "
                "AdamW.",
     .when_key = "optimizer.type", .when_values = "Adam|AdamW"},
    {.path = "optimizer.params.max_coeff", .type = T::kFloat, .default_json = "10.0",
     .meaning = "Lamb: the trust ratio's upper clamp (DeepSpeed's default).", .min = 0,
     .when_key = "optimizer.type", .when_values = "Lamb"},
    {.path = "optimizer.params.min_coeff", .type = T::kFloat, .default_json = "0.01",
     .meaning = "Lamb: the trust ratio's lower clamp; at most max_coeff.", .min = 0,
     .when_key = "optimizer.type", .when_values = "Lamb"},
    {.path = "optimizer.params.eps_inside_sqrt", .type = T::kBool, .default_json = "false",
     .meaning = "Lamb: eps under the square root, sqrt(v_hat + eps), instead of "
                "sqrt(v_hat) + eps.",
     .when_key = "optimizer.type", .when_values = "Lamb"},
    {.path = "optimizer.params.max_grad_norm", .type = T::kFloat,
     .meaning = "DeepSpeed FusedLamb's own gradient clipping.",
     .not_supported = "use gradient_clipping, which clips the global norm for every optimizer",
     .inert_json = "0.0"},
    {.path = "optimizer.params.amsgrad", .type = T::kBool,
     .meaning = "AMSGrad variant.", .not_supported = "AMSGrad is not implemented",
     .inert_json = "false"},
    {.path = "optimizer.params.torch_adam", .type = T::kBool,
     .meaning = "DeepSpeed: use torch's Adam.",
     .not_supported = "Strata always runs its own CPU-Adam", .inert_json = "false"},

    // ---- scheduler ------------------------------------------------------------------
    {.path = "scheduler", .type = T::kObject,
     .meaning = "Learning-rate schedule; absent means a constant learning rate."},
    {.path = "scheduler.type", .type = T::kEnum,
     .meaning = "The schedule, named as in DeepSpeed.",
     .choices = "WarmupLR|WarmupDecayLR|WarmupCosineLR|OneCycle|LRRangeTest", .required = true},
    {.path = "scheduler.params", .type = T::kObject, .default_json = "{}",
     .meaning = "Parameters of the schedule; which ones apply depends on scheduler.type."},
    {.path = "scheduler.params.warmup_min_lr", .type = T::kFloat, .default_json = "0.0",
     .meaning = "Learning rate at the start of warm-up.", .min = 0,
     .when_key = "scheduler.type", .when_values = "WarmupLR|WarmupDecayLR"},
    {.path = "scheduler.params.warmup_max_lr", .type = T::kFloat, .default_json = "0.001",
     .meaning = "Learning rate at the end of warm-up.", .min = 0,
     .when_key = "scheduler.type", .when_values = "WarmupLR|WarmupDecayLR"},
    {.path = "scheduler.params.warmup_num_steps", .type = T::kInt, .default_json = "1000",
     .meaning = "Steps of warm-up.", .min = 0, .when_key = "scheduler.type",
     .when_values = "WarmupLR|WarmupDecayLR|WarmupCosineLR"},
    {.path = "scheduler.params.warmup_type", .type = T::kEnum, .default_json = "\"log\"",
     .meaning = "Shape of the warm-up curve.", .choices = "log|linear",
     .when_key = "scheduler.type", .when_values = "WarmupLR|WarmupDecayLR|WarmupCosineLR"},
    {.path = "scheduler.params.total_num_steps", .type = T::kInt,
     .meaning = "Total steps of the run; the rate decays to its end.", .min = 1,
     .when_key = "scheduler.type", .when_values = "WarmupDecayLR|WarmupCosineLR",
     .required = true},
    {.path = "scheduler.params.warmup_min_ratio", .type = T::kFloat, .default_json = "0.0",
     .meaning = "Warm-up starts at this fraction of the optimizer's lr.", .min = 0, .max = 1,
     .when_key = "scheduler.type", .when_values = "WarmupCosineLR"},
    {.path = "scheduler.params.cos_min_ratio", .type = T::kFloat, .default_json = "0.0001",
     .meaning = "The cosine decays to this fraction of the optimizer's lr.", .min = 0, .max = 1,
     .when_key = "scheduler.type", .when_values = "WarmupCosineLR"},
    {.path = "scheduler.params.cycle_min_lr", .type = T::kFloat,
     .meaning = "OneCycle: the learning rate at the start and end of the cycle.", .min = 0,
     .when_key = "scheduler.type", .when_values = "OneCycle", .required = true},
    {.path = "scheduler.params.cycle_max_lr", .type = T::kFloat,
     .meaning = "OneCycle: the learning rate at the top of the cycle.", .min = 0,
     .when_key = "scheduler.type", .when_values = "OneCycle", .required = true},
    {.path = "scheduler.params.decay_lr_rate", .type = T::kFloat, .default_json = "0.0",
     .meaning = "OneCycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate x (steps "
                "since the cycle) / decay_step_size); 0: cycle_min_lr.",
     .min = 0, .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_first_step_size", .type = T::kInt, .default_json = "2000",
     .meaning = "OneCycle: steps of the rising half of the cycle.", .min = 1,
     .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_second_step_size", .type = T::kInt, .default_json = "0",
     .meaning = "OneCycle: steps of the falling half; 0: cycle_first_step_size (DeepSpeed's "
                "null).",
     .min = 0, .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_first_stair_count", .type = T::kInt, .default_json = "0",
     .meaning = "OneCycle: the rising half moves in this many stairs; 0: every step.", .min = 0,
     .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_second_stair_count", .type = T::kInt, .default_json = "-1",
     .meaning = "OneCycle: stairs of the falling half; -1: cycle_first_stair_count (DeepSpeed's "
                "null).",
     .min = -1, .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.decay_step_size", .type = T::kInt, .default_json = "0",
     .meaning = "OneCycle: the decay's interval in steps; 0: no decay after the cycle.", .min = 0,
     .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_momentum", .type = T::kBool, .default_json = "true",
     .meaning = "OneCycle: cycle Adam's beta1 inversely to the learning rate, between "
                "cycle_max_mom and cycle_min_mom; beta2 is then 0.99, as DeepSpeed sets it.",
     .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_min_mom", .type = T::kFloat, .default_json = "0.8",
     .meaning = "OneCycle: beta1 at the top of the cycle.", .min = 0, .max = 1,
     .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.cycle_max_mom", .type = T::kFloat, .default_json = "0.9",
     .meaning = "OneCycle: beta1 at the start and end of the cycle.", .min = 0, .max = 1,
     .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.decay_mom_rate", .type = T::kFloat, .default_json = "0.0",
     .meaning = "OneCycle: after the cycle, beta1 = cycle_max_mom x (1 + decay_mom_rate x "
                "(steps since the cycle) / decay_step_size); 0: cycle_max_mom.",
     .min = 0, .when_key = "scheduler.type", .when_values = "OneCycle"},
    {.path = "scheduler.params.lr_range_test_min_lr", .type = T::kFloat, .default_json = "0.001",
     .meaning = "LRRangeTest: the learning rate it starts from.", .min = 0,
     .when_key = "scheduler.type", .when_values = "LRRangeTest"},
    {.path = "scheduler.params.lr_range_test_step_size", .type = T::kInt, .default_json = "2000",
     .meaning = "LRRangeTest: steps per interval of increase.", .min = 1,
     .when_key = "scheduler.type", .when_values = "LRRangeTest"},
    {.path = "scheduler.params.lr_range_test_step_rate", .type = T::kFloat, .default_json = "1.0",
     .meaning = "LRRangeTest: lr = min_lr x (1 + step_rate x intervals).", .min = 0,
     .when_key = "scheduler.type", .when_values = "LRRangeTest"},
    {.path = "scheduler.params.lr_range_test_staircase", .type = T::kBool,
     .default_json = "false",
     .meaning = "LRRangeTest: count whole intervals only (a staircase) rather than fractions.",
     .when_key = "scheduler.type", .when_values = "LRRangeTest"},
    {.path = "scheduler.params.last_batch_iteration", .type = T::kInt, .default_json = "-1",
     .meaning = "Step the schedule resumes after (-1: start from the beginning).", .min = -1,
     .when_key = "scheduler.type",
     .when_values = "WarmupLR|WarmupDecayLR|WarmupCosineLR|OneCycle|LRRangeTest"},

    // ---- mixed precision ---------------------------------------------------------------
    {.path = "fp16", .type = T::kObject, .default_json = "{}",
     .meaning = "16-bit floating point with dynamic loss scaling."},
    {.path = "fp16.enabled", .type = T::kBool, .default_json = "false",
     .meaning = "Store and communicate parameters and gradients in fp16 (fp32 master copy)."},
    {.path = "fp16.loss_scale", .type = T::kFloat, .default_json = "0.0",
     .meaning = "A fixed loss scale; 0 selects dynamic loss scaling.", .min = 0},
    {.path = "fp16.initial_scale_power", .type = T::kInt, .default_json = "16",
     .meaning = "Dynamic scaling starts at 2^initial_scale_power.", .min = 0, .max = 63},
    {.path = "fp16.loss_scale_window", .type = T::kInt, .default_json = "1000",
     .meaning = "Steps without overflow before the scale doubles.", .min = 1},
    {.path = "fp16.hysteresis", .type = T::kInt, .default_json = "2",
     .meaning = "Overflows tolerated before the scale is lowered.", .min = 1, .max = kIntMax},
    {.path = "fp16.consecutive_hysteresis", .type = T::kBool, .default_json = "false",
     .meaning = "Refill the hysteresis after every step without overflow."},
    {.path = "fp16.min_loss_scale", .type = T::kFloat, .default_json = "1.0",
     .meaning = "The dynamic scale never goes below this.", .min = 0, .min_exclusive = true},
    {.path = "fp16.auto_cast", .type = T::kBool, .meaning = "DeepSpeed: autocast inputs.",
     .not_supported = "Strata does not cast model inputs", .inert_json = "false"},
    {.path = "fp16.fp16_master_weights_and_grads", .type = T::kBool,
     .meaning = "DeepSpeed: fp16 master weights.",
     .not_supported = "Strata keeps fp32 master weights", .inert_json = "false"},
    {.path = "bf16", .type = T::kObject, .default_json = "{}",
     .meaning = "bfloat16 parameters and gradients (fp32 master copy), no loss scaling."},
    {.path = "bf16.enabled", .type = T::kBool, .default_json = "false",
     .meaning = "Enable bf16. Cannot be combined with fp16.enabled."},

    // ---- ZeRO ---------------------------------------------------------------------------
    {.path = "zero_optimization", .type = T::kObject, .default_json = "{}",
     .meaning = "Partitioning of parameters, gradients and optimizer states (ZeRO)."},
    {.path = "zero_optimization.stage", .type = T::kInt, .default_json = "3",
     .meaning = "ZeRO stage: 1 (optimizer states partitioned, gradients all-reduced), 2 "
                "(optimizer states and gradients partitioned: reduce-scattered) or 3 (and "
                "parameters: gathered block by block). Stages 1 and 2 keep every parameter on "
                "each rank's device, gathered again after each step; the stage3_* keys apply "
                "to stage 3 only. Stage 0 is refused.",
     .min = 0, .max = 3},
    {.path = "zero_optimization.contiguous_gradients", .type = T::kBool, .default_json = "true",
     .meaning = "Copy gradients into one contiguous buffer as they are produced."},
    {.path = "zero_optimization.overlap_comm", .type = T::kBool, .default_json = "true",
     .meaning = "Overlap gradient reduction with backward (two gradient buckets). Left out, "
                "turned off at start when the plan does not fit the memory the process may use "
                "(docs/tuning.md)."},
    {.path = "zero_optimization.reduce_scatter", .type = T::kBool, .default_json = "true",
     .meaning = "Reduce gradients with reduce-scatter (false: all-reduce)."},
    {.path = "zero_optimization.reduce_bucket_size", .type = T::kCount,
     .default_json = "500000000",
     .meaning = "Elements per gradient reduction bucket. Left out, the engine sizes it from the "
                "model: a sixteenth of the trainable parameters, at least the largest group, at "
                "most the default; lowered further (to the largest group) at start when the plan "
                "does not fit the memory the process may use (docs/tuning.md).",
     .min = 1},
    {.path = "zero_optimization.allgather_bucket_size", .type = T::kCount,
     .default_json = "500000000", .meaning = "Elements per parameter all-gather bucket.",
     .min = 1},
    {.path = "zero_optimization.sub_group_size", .type = T::kCount, .default_json = "1000000000",
     .meaning = "Elements per optimizer sub-group (the unit of one CPU-Adam pass and of NVMe "
                "swapping). Left out, the engine sizes it from the model: a sixteenth of the "
                "rank's trainable elements, at least 1048576, at most the default; lowered "
                "further (to 1e6) at start when the plan does not fit the memory the process "
                "may use (docs/tuning.md).",
     .min = 1},
    {.path = "zero_optimization.stage3_prefetch_bucket_size", .type = T::kCount,
     .default_json = "50000000", .meaning = "Elements of parameters prefetched ahead of use."},
    {.path = "zero_optimization.stage3_param_persistence_threshold", .type = T::kCount,
     .default_json = "100000",
     .meaning = "Parameters with at most this many elements stay gathered on every rank."},
    {.path = "zero_optimization.stage3_model_persistence_threshold", .type = T::kCount,
     .default_json = "9223372036854775807",
     .meaning = "Upper bound on the elements kept persistent by the threshold above."},
    {.path = "zero_optimization.stage3_max_live_parameters", .type = T::kCount,
     .default_json = "1000000000",
     .meaning = "Upper bound on gathered parameter elements resident at once (the two groups "
                "in use are always kept). Left out, lowered at start when the plan does not fit "
                "the memory the process may use, with the CPU device (docs/tuning.md)."},
    {.path = "zero_optimization.stage3_max_reuse_distance", .type = T::kCount,
     .default_json = "1000000000",
     .meaning = "Keep a parameter gathered when it is used again within this many elements "
                "of other parameters."},
    {.path = "zero_optimization.stage3_gather_16bit_weights_on_model_save", .type = T::kBool,
     .default_json = "false",
     .meaning = "DeepSpeed: gather the full 16-bit weights when the model is saved. Accepted "
                "and not needed: a Strata checkpoint keeps the fp32 master, and `strata-ckpt "
                "export --dtype bf16` writes the full 16-bit model from it.",
     .alias = "stage3_gather_fp16_weights_on_model_save"},
    {.path = "zero_optimization.offload_optimizer", .type = T::kObject, .default_json = "{}",
     .meaning = "Where the fp32 master parameters, Adam states and gradient accumulators "
                "live."},
    {.path = "zero_optimization.offload_optimizer.device", .type = T::kEnum,
     .default_json = "\"none\"",
     .meaning = "none (device memory), cpu (pinned host memory) or nvme (swap files).",
     .choices = "none|cpu|nvme"},
    {.path = "zero_optimization.offload_optimizer.nvme_path", .type = T::kPaths,
     .meaning = "Directory, or list of directories on several drives, for the swap files "
                "(device nvme only; blocks are striped across them)."},
    {.path = "zero_optimization.offload_optimizer.pin_memory", .type = T::kBool,
     .default_json = "false", .meaning = "Page-lock the host buffers."},
    {.path = "zero_optimization.offload_optimizer.buffer_count", .type = T::kInt,
     .default_json = "4",
     .meaning = "Host buffers (device nvme), each one sub-group of one fp32 state "
                "(sub_group_size x 4 bytes), allocated once on the host tier (they count "
                "against strata.host_budget). At least 4 (a sub-group's master, m, v and "
                "gradient accumulator are held together), at least 8 with pipeline_read. Left "
                "out, lowered to that least at start when the plan does not fit the memory the "
                "process may use (docs/tuning.md).",
     .min = 1, .max = kIntMax},
    {.path = "zero_optimization.offload_optimizer.pipeline_read", .type = T::kBool,
     .default_json = "false",
     .meaning = "Read the next sub-group's states while CPU-Adam updates this one "
                "(device nvme)."},
    {.path = "zero_optimization.offload_optimizer.pipeline_write", .type = T::kBool,
     .default_json = "false",
     .meaning = "Write a sub-group's states as soon as it is updated, while the next one "
                "runs (device nvme); without it they are written when their buffer is "
                "needed or at the end of the step."},
    {.path = "zero_optimization.offload_optimizer.fast_init", .type = T::kBool,
     .default_json = "false",
     .meaning = "DeepSpeed: skip writing initial states to NVMe. Strata never writes zero "
                "states (m, v and the accumulators start as zeros without I/O); only the "
                "initial master parameters are written, with or without it."},
    {.path = "zero_optimization.offload_optimizer.ratio", .type = T::kFloat,
     .meaning = "DeepSpeed: fraction of states offloaded.",
     .not_supported = "partial optimizer offload is not implemented", .inert_json = "1.0"},
    {.path = "zero_optimization.offload_param", .type = T::kObject, .default_json = "{}",
     .meaning = "Where the 16-bit parameter shards live between uses."},
    {.path = "zero_optimization.offload_param.device", .type = T::kEnum,
     .default_json = "\"none\"",
     .meaning = "none (device memory), cpu (pinned host memory) or nvme (swap files).",
     .choices = "none|cpu|nvme"},
    {.path = "zero_optimization.offload_param.nvme_path", .type = T::kPaths,
     .meaning = "Directory, or list of directories, for parameter swap files (device nvme "
                "only)."},
    {.path = "zero_optimization.offload_param.pin_memory", .type = T::kBool,
     .default_json = "false", .meaning = "Page-lock the host buffers."},
    {.path = "zero_optimization.offload_param.buffer_count", .type = T::kInt,
     .default_json = "5",
     .meaning = "Host buffers for working shards brought up from NVMe (device nvme), each "
                "one group's shard (the largest decides their size), allocated once on the "
                "host tier. One holds the shard being gathered, the others read the next "
                "groups' shards ahead along the trace. At least 2. With strata.pipeline_step "
                "the step's update stages new shards in two more host buffers of that size "
                "(more only while one sub-group spans more groups). Left out, lowered to 2 at "
                "start when the plan does not fit the memory the process may use "
                "(docs/tuning.md).",
     .min = 1, .max = kIntMax},
    {.path = "zero_optimization.offload_param.buffer_size", .type = T::kCount,
     .default_json = "100000000",
     .meaning = "Elements per such buffer (DeepSpeed): an upper bound checked against the "
                "largest group's shard; the buffers themselves are sized by that shard. Left "
                "out, raised to the largest shard (docs/tuning.md).",
     .min = 1},
    {.path = "zero_optimization.offload_param.max_in_cpu", .type = T::kCount,
     .default_json = "1000000000",
     .meaning = "Parameter elements whose working shards stay in host memory when "
                "offloading to NVMe (device nvme): the first groups in order (the ones a "
                "forward needs first after a step), while their elements add up to at most "
                "this; 0 puts every shard on NVMe. The default keeps all of a model under "
                "1e9 parameters in host memory. Left out, lowered to 0 at start when the plan "
                "does not fit the memory the process may use (docs/tuning.md)."},
    {.path = "zero_optimization.zero_quantized_weights", .type = T::kBool,
     .meaning = "DeepSpeed ZeRO++ quantized weights.",
     .not_supported = "ZeRO++ quantization is not implemented", .inert_json = "false"},
    {.path = "zero_optimization.zero_quantized_gradients", .type = T::kBool,
     .meaning = "DeepSpeed ZeRO++ quantized gradients.",
     .not_supported = "ZeRO++ quantization is not implemented", .inert_json = "false"},
    {.path = "zero_optimization.zero_hpz_partition_size", .type = T::kInt,
     .meaning = "DeepSpeed ZeRO++ hierarchical partitioning.",
     .not_supported = "hierarchical partitioning is not implemented", .inert_json = "1"},
    {.path = "zero_optimization.mics_shard_size", .type = T::kInt,
     .meaning = "DeepSpeed MiCS sharding.", .not_supported = "MiCS is not implemented",
     .inert_json = "-1"},
    {.path = "zero_optimization.round_robin_gradients", .type = T::kBool,
     .meaning = "DeepSpeed stage 1/2 option.", .not_supported = "a ZeRO stage 1/2 option",
     .inert_json = "false"},
    {.path = "zero_optimization.allgather_partitions", .type = T::kBool,
     .meaning = "DeepSpeed stage 1/2 option.", .not_supported = "a ZeRO stage 1/2 option",
     .inert_json = "true"},
    {.path = "zero_optimization.ignore_unused_parameters", .type = T::kBool,
     .meaning = "DeepSpeed (stages 1 and 2): whether a parameter without a gradient is an "
                "error.",
     .not_supported = "Strata never fails on unused parameters: in every stage a parameter "
                      "that got no gradient contributes zeros; false (fail instead) is not "
                      "offered",
     .inert_json = "true"},
    {.path = "zero_optimization.load_from_fp32_weights", .type = T::kBool,
     .meaning = "DeepSpeed checkpoint loading option.",
     .not_supported = "Strata always restores from the fp32 master weights",
     .inert_json = "true"},
    {.path = "zero_optimization.elastic_checkpoint", .type = T::kBool,
     .meaning = "DeepSpeed elastic checkpoints.",
     .not_supported = "elastic checkpoints are not implemented", .inert_json = "false"},
    {.path = "zero_optimization.cpu_offload", .type = T::kBool,
     .meaning = "Deprecated DeepSpeed spelling.",
     .not_supported = "deprecated; use offload_optimizer.device = \"cpu\"",
     .inert_json = "false"},

    // ---- asynchronous I/O ------------------------------------------------------------
    {.path = "aio", .type = T::kObject, .default_json = "{}",
     .meaning = "NVMe swap I/O (io_uring); nvme_bench prints the best values for a drive."},
    {.path = "aio.block_size", .type = T::kBytes, .default_json = "1048576",
     .meaning = "Bytes per I/O request; a multiple of 4096 (O_DIRECT).", .min = 4096,
     .max = 1073741824},
    {.path = "aio.queue_depth", .type = T::kInt, .default_json = "8",
     .meaning = "Requests in flight per ring.", .min = 1, .max = 4096},
    {.path = "aio.intra_op_parallelism", .type = T::kInt, .default_json = "1",
     .meaning = "I/O threads (rings) per transfer.", .min = 1, .max = 256,
     .alias = "thread_count"},
    {.path = "aio.single_submit", .type = T::kBool, .default_json = "false",
     .meaning = "Submit requests one at a time instead of in batches."},
    {.path = "aio.overlap_events", .type = T::kBool, .default_json = "true",
     .meaning = "Submit new requests while completions are reaped."},
    {.path = "aio.use_gds", .type = T::kBool, .meaning = "DeepSpeed: GPUDirect Storage.",
     .not_supported = "GPUDirect Storage is not implemented", .inert_json = "false"},

    // ---- DeepSpeed features Strata does not implement ---------------------------------
    {.path = "pipeline", .type = T::kObject, .meaning = "DeepSpeed pipeline parallelism.",
     .not_supported = "pipeline parallelism is not implemented"},
    {.path = "activation_checkpointing", .type = T::kObject,
     .meaning = "DeepSpeed's activation checkpointing settings (for deepspeed.checkpointing's "
                "own checkpoint function). Strata needs none of them: torch.utils.checkpoint (Python, "
                "docs/python.md) and strata::checkpoint (C++, docs/engine.md) around Strata "
                "blocks work. cpu_checkpointing is honoured by Strata's checkpoint functions; each other "
                "setting is refused by name unless it is off."},
    {.path = "activation_checkpointing.partition_activations", .type = T::kBool,
     .meaning = "DeepSpeed: split saved activations across model-parallel ranks.",
     .not_supported = "partitioning saved activations needs DeepSpeed's checkpoint function "
                      "and model-parallel ranks; use torch.utils.checkpoint or strata::checkpoint",
     .inert_json = "false"},
    {.path = "activation_checkpointing.cpu_checkpointing", .type = T::kBool, .default_json = "false",
     .meaning = "Keep each checkpoint's saved inputs in host memory (pinned with a GPU) between "
                "the forward and the backward, as DeepSpeed's cpu_checkpointing: honoured by "
                "Strata's checkpoint functions (strata.checkpointing.checkpoint in Python, "
                "strata::checkpoint with Engine::checkpoint_options() in C++); "
                "torch.utils.checkpoint ignores it."},
    {.path = "activation_checkpointing.contiguous_memory_optimization", .type = T::kBool,
     .meaning = "DeepSpeed: copy checkpoints into one contiguous buffer.",
     .not_supported = "contiguous checkpoint buffers belong to DeepSpeed's checkpoint function; "
                      "use torch.utils.checkpoint or strata::checkpoint",
     .inert_json = "false"},
    {.path = "activation_checkpointing.number_checkpoints", .type = T::kInt,
     .meaning = "DeepSpeed: checkpoints per step (sizes the contiguous buffers).",
     .not_supported = "only used with contiguous_memory_optimization, which is not supported",
     .inert_json = "null"},
    {.path = "activation_checkpointing.synchronize_checkpoint_boundary", .type = T::kBool,
     .meaning = "DeepSpeed: synchronize the device at each checkpoint boundary.",
     .not_supported = "belongs to DeepSpeed's checkpoint function; use torch.utils.checkpoint or strata::checkpoint",
     .inert_json = "false"},
    {.path = "activation_checkpointing.profile", .type = T::kBool,
     .meaning = "DeepSpeed: time the checkpoint function's forward and backward.",
     .not_supported = "belongs to DeepSpeed's checkpoint function; use torch.utils.checkpoint or strata::checkpoint",
     .inert_json = "false"},
    {.path = "amp", .type = T::kObject, .meaning = "DeepSpeed: NVIDIA Apex AMP.",
     .not_supported = "Apex AMP is not supported; use fp16 or bf16", .inert_json = kEnabledFalse},
    {.path = "zero_allow_untested_optimizer", .type = T::kBool,
     .meaning = "DeepSpeed: allow client optimizers with ZeRO.",
     .not_supported = "Strata runs its own optimizers only", .inert_json = "false"},
    {.path = "data_types", .type = T::kObject, .meaning = "DeepSpeed: gradient accumulation dtype.",
     .not_supported = "gradients accumulate in fp32 on the optimizer tier"},
    {.path = "checkpoint", .type = T::kObject, .meaning = "DeepSpeed checkpoint options.",
     .not_supported = "the checkpoint section's options (tag_validation, load_universal, "
                      "use_node_local_storage, parallel_write) are not supported; "
                      "save_checkpoint and load_checkpoint need no config "
                      "(docs/checkpoints.md)"},
    {.path = "communication_data_type", .type = T::kString,
     .meaning = "DeepSpeed: dtype of gradient communication.",
     .not_supported = "gradients are communicated in the training dtype"},
    {.path = "prescale_gradients", .type = T::kBool, .meaning = "DeepSpeed option.",
     .not_supported = "gradient pre-scaling is not implemented", .inert_json = "false"},
    {.path = "gradient_predivide_factor", .type = T::kFloat, .meaning = "DeepSpeed option.",
     .not_supported = "gradient pre-division is not implemented", .inert_json = "1.0"},
    {.path = "sparse_gradients", .type = T::kBool, .meaning = "DeepSpeed option.",
     .not_supported = "sparse gradients are not implemented", .inert_json = "false"},
    {.path = "wall_clock_breakdown", .type = T::kBool, .default_json = "false",
     .meaning = "DeepSpeed's per-phase timings: with every steps_per_print line, rank 0 of the "
                "Python engine logs the mean wall-clock milliseconds of forward, backward and "
                "step per micro-step since the last line (DeepSpeed's fwd_microstep, "
                "bwd_microstep, step_microstep). The C++ engine refuses it (strata-train prints "
                "its step time; Engine::timeline() has every phase)."},
    {.path = "flops_profiler", .type = T::kObject, .meaning = "DeepSpeed profiler.",
     .not_supported = "the FLOPs profiler is not implemented", .inert_json = kEnabledFalse},

    // ---- monitors (DeepSpeed's; written by the Python engine, docs/python.md) ----------
    {.path = "csv_monitor", .type = T::kObject,
     .meaning = "DeepSpeed's CSV monitor: rank 0 of the Python engine appends each event to "
                "<output_path>/<job_name>/<event name, / as _>.csv (rows step,value; step = "
                "samples trained), every steps_per_print optimizer steps, from a background "
                "thread. The C++ engine refuses it (read Engine::statistics())."},
    {.path = "csv_monitor.enabled", .type = T::kBool, .default_json = "false",
     .meaning = "Write the CSV files."},
    {.path = "csv_monitor.output_path", .type = T::kString, .default_json = "\"\"",
     .meaning = "Directory of the job's directory (\"\": the working directory)."},
    {.path = "csv_monitor.job_name", .type = T::kString, .default_json = "\"DeepSpeedJobName\"",
     .meaning = "The job's directory under output_path."},
    {.path = "tensorboard", .type = T::kObject,
     .meaning = "DeepSpeed's TensorBoard monitor: the csv_monitor's events as scalars in "
                "<output_path>/<job_name> through torch.utils.tensorboard (needs the "
                "tensorboard package: an error names it when missing)."},
    {.path = "tensorboard.enabled", .type = T::kBool, .default_json = "false",
     .meaning = "Write TensorBoard event files."},
    {.path = "tensorboard.output_path", .type = T::kString, .default_json = "\"\"",
     .meaning = "Directory of the job's directory (\"\": the working directory)."},
    {.path = "tensorboard.job_name", .type = T::kString, .default_json = "\"DeepSpeedJobName\"",
     .meaning = "The job's directory under output_path."},
    {.path = "wandb", .type = T::kObject,
     .meaning = "DeepSpeed's Weights & Biases monitor: the csv_monitor's events through "
                "wandb.log (needs the wandb package: an error names it when missing)."},
    {.path = "wandb.enabled", .type = T::kBool, .default_json = "false",
     .meaning = "Log to Weights & Biases."},
    {.path = "wandb.project", .type = T::kString, .default_json = "\"deepspeed\"",
     .meaning = "wandb.init's project."},
    {.path = "wandb.group", .type = T::kString, .default_json = "\"\"",
     .meaning = "wandb.init's group (\"\": none)."},
    {.path = "wandb.team", .type = T::kString, .default_json = "\"\"",
     .meaning = "wandb.init's entity (\"\": the user's default)."},

    // ---- Strata's own keys -------------------------------------------------------------
    {.path = "strata", .type = T::kObject, .default_json = "{}",
     .meaning = "Strata's extensions (not read by DeepSpeed)."},
    {.path = "strata.device", .type = T::kEnum, .default_json = "\"auto\"",
     .meaning = "The compute device: auto = where the model's parameters are (cuda:N or the "
                "CPU); cuda = cuda:LOCAL_RANK, also for a model built on the CPU (its "
                "parameters are taken from there, its buffers moved); cpu = the CPU device "
                "(the model must be on the CPU).",
     .choices = "auto|cpu|cuda"},
    {.path = "strata.device_budget", .type = T::kBytes, .default_json = "0",
     .meaning = "Bytes of device memory the engine reserves for gathered parameters, "
                "gradient buckets and device-resident shards (on the CPU device: the size of "
                "its arena); 0 = on CUDA half the GPU's free memory at initialize (the rest is "
                "LibTorch's, for activations), on the CPU device no arena (unbounded)."},
    {.path = "strata.host_budget", .type = T::kBytes, .default_json = "0",
     .meaning = "Bytes of host memory the host tier may hold; 0 = no limit beyond the "
                "process's (the planner's check at start: MemAvailable, its cgroup's limit, "
                "RLIMIT_AS and RLIMIT_DATA)."},
    {.path = "strata.memory_reserve", .type = T::kBytes, .default_json = "268435456",
     .meaning = "Bytes of host memory per rank the plan leaves to what the engine's buffers "
                "do not hold: a load's or an assembly's chunk (64 MiB), torch's first step "
                "(its threads and caches), the activations on the CPU device. The start-up "
                "check and the sizing to the memory fit the plan to the limit less this; "
                "raise it for large batches or sequences on the CPU device (not counted "
                "against strata.host_budget, which bounds the host tier alone)."},
    {.path = "strata.allow_unpinned", .type = T::kBool, .default_json = "false",
     .meaning = "When page-locking fails (RLIMIT_MEMLOCK), continue with unpinned memory and "
                "a warning instead of stopping."},
    {.path = "strata.numa_node", .type = T::kInt, .default_json = "-1",
     .meaning = "NUMA node for the host tier's buffers and CPU-Adam's threads; -1 = the "
                "node the GPU hangs off on a machine of several nodes, else no binding (pages "
                "where first touched, threads unpinned).",
     .min = -1, .max = 1023},
    {.path = "strata.cpu_adam_threads", .type = T::kInt, .default_json = "0",
     .meaning = "Threads of this rank's CPU optimizer (and of the engine's other elementwise "
                "host passes); 0 = the cores this rank may use (its affinity mask, within "
                "strata.numa_node's node when bound) divided among the ranks of the job that "
                "run on the same machine with the same mask and node, at least 1 (ranks that "
                "torchrun starts without a binding share one mask: 8 of them on 64 cores get "
                "8 threads each, not 64). A rank that its launcher gave cores of its own "
                "keeps them all.",
     .min = 0, .max = 4096},
    {.path = "strata.pipeline_step", .type = T::kBool, .default_json = "true",
     .meaning = "Run the CPU optimizer step in the background, group by group in the order "
                "the next forward uses the groups, so that forward waits only for each "
                "group's own update (bit-identical to the step run inside step()). Applies "
                "to Adam and AdamW (LAMB always steps inside step()). Optimizer states on "
                "NVMe are streamed in that order; with offload_param nvme each group's new "
                "working shard goes through a host staging buffer (two of them) into its swap "
                "slot as the forward opens the group. On NVMe an I/O "
                "error of the update, or of the parameters' store before the next backward, "
                "fails that backward on every rank (the iteration is void, the states are the "
                "last completed step's). Left out, turned off at start when the plan does not "
                "fit the memory the process may use (docs/tuning.md)."},
    {.path = "strata.early_step", .type = T::kBool, .default_json = "false",
     .meaning = "Start a group's CPU optimizer update during the backward, as soon as its "
                "gradient is final (its backward ended and its reductions were added into "
                "the accumulators), instead of after it; bit-identical to the step after the "
                "backward. Needs strata.pipeline_step true, gradient_clipping 0, fp16 off, "
                "strata.skip_inf_nan_steps false, Adam or AdamW, and optimizer states and "
                "parameters off NVMe. The learning rate of a step is then fixed when its "
                "backward begins (set_lr between the backward and step() is refused)."},
    {.path = "strata.norm_in_backward", .type = T::kBool, .default_json = "true",
     .meaning = "Sum the gradient norm and inf/NaN check of the optimizer step during the "
                "backward of a gradient-accumulation boundary, on a background thread, group "
                "by group as each group's gradient becomes final, so that step() only adds "
                "up what is left and all-reduces it (bit-identical to the pass inside "
                "step(); clipping, fp16 and skipping unchanged). Applies with the optimizer "
                "states in host memory (on NVMe each chunk's sum is noted as it is written "
                "out) and without strata.early_step, which sums the norm itself. A block "
                "whose backward runs twice in one backward makes step() sum it all again."},
    {.path = "strata.accumulate_in_background", .type = T::kBool, .default_json = "true",
     .meaning = "With the optimizer states in host memory: wait for each gradient bucket's "
                "reduction and device-to-host copy, and add its shards into the fp32 "
                "accumulators, on a thread of the gradient reducer, while the backward goes "
                "on computing the next gradients (false: on the backward's own thread, which "
                "stalls the GPU meanwhile). Bit-identical either way. The CPU device does the "
                "same (the summary's \"added on the reducer's thread\" counts the buckets). No "
                "effect with the optimizer states on NVMe (the store's leases are the engine "
                "thread's) or on the device (offload_optimizer none)."},
    {.path = "strata.accumulate_on_device", .type = T::kBool, .default_json = "true",
     .meaning = "With gradient_accumulation_steps above 1 and the optimizer states offloaded "
                "(cpu or nvme): accumulate the reduced gradients across the micro-steps in "
                "fp32 accumulators in device memory (4 bytes per trainable parameter per rank, "
                "within strata.device_budget) and copy each one to the host once per "
                "optimizer step, instead of copying every micro-step's reduced shards to the "
                "host and adding them there. CPU-Adam then reads those sums directly, each "
                "sub-group copied to pinned host memory as the step reaches it: no host "
                "accumulators (4 bytes per parameter less on the host or in the NVMe swap "
                "files), unless strata.early_step or strata.delayed_update, which read "
                "accumulators while gradients are added (they keep host accumulators and "
                "one copy per group at the boundary). Bit-identical either way (the same fp32 "
                "additions in the same order). When the device budget cannot hold the "
                "accumulators beside the rest, the engine accumulates on the host and its "
                "statistics and log say so (strata-config plan shows the choice). false: "
                "always on the host."},
    {.path = "strata.delayed_update", .type = T::kBool, .default_json = "false",
     .meaning = "NOT EXACT. The delayed parameter update (ZeRO-Offload's idea): after "
                "strata.delayed_update_warmup exact steps, the CPU update of step i runs in the "
                "background beside the forward and backward of step i+1, which therefore use the "
                "parameters of step i-1 (one step stale); its new parameters reach the working "
                "shards after step i+1's step(), copied by the next update's worker group by "
                "group as the next forward needs them. The gradient norm, clipping, fp16 overflow skips "
                "and the learning rate of each step are those of its own gradients, as "
                "without the delay. With gradient_accumulation_steps K > 1 and "
                "strata.accumulate_on_device the update overlaps K - 1 micro-steps and the "
                "boundary micro-step's forward; otherwise the next forward (the backward "
                "waits for the update: it writes the gradient accumulators the update reads). "
                "Checkpoints drain the update (the saving run's next step uses the new "
                "parameters too, so saved and resumed runs agree). Needs strata.pipeline_step "
                "true, strata.early_step false, Adam or AdamW, and optimizer states and "
                "parameters off NVMe."},
    {.path = "strata.delayed_update_warmup", .type = T::kInt, .default_json = "40",
     .meaning = "With strata.delayed_update: the optimizer steps run exactly (not delayed) "
                "first; the delay starts with the step after them.",
     .min = 0, .max = 1000000000},
    {.path = "strata.nccl_lanes", .type = T::kBool, .default_json = "true",
     .meaning = "On CUDA with several ranks: the gradient reduce-scatters and the parameter "
                "all-gathers each on an NCCL communicator (and CUDA stream) of their own, "
                "duplicated from the engine's, so a backward prefetch never queues behind a "
                "reduction in flight. Each lane's collectives go out in the same order on every "
                "rank, but not the two lanes' together (the pipelined step defers prefetches): "
                "NCCL then needs both lanes' kernels able to run at once, which "
                "CUDA_DEVICE_MAX_CONNECTIONS=1 forbids (refused with it set). false: one "
                "communicator carries both. No effect on gloo (its lanes are always made) nor "
                "on one rank."},
    {.path = "strata.skip_inf_nan_steps", .type = T::kBool, .default_json = "true",
     .meaning = "Skip an optimizer step whose gradients hold inf or NaN on any rank (with a "
                "warning, counted). false: such a step is applied (the parameters then hold "
                "inf/NaN; a warning says so), which lets the optimizer start before the whole "
                "gradient is known (strata.early_step). Must be true with fp16, whose "
                "dynamic loss scale relies on skipped steps."},
    {.path = "strata.swap_checksums", .type = T::kBool, .default_json = "true",
     .meaning = "CRC32C every swapped block and verify it on every read."},
    {.path = "strata.swap_pipeline_depth", .type = T::kInt, .default_json = "2",
     .meaning = "Sub-groups in flight while streaming optimizer states from NVMe with "
                "offload_optimizer.pipeline_read: the one being updated and depth - 1 read "
                "ahead (at least 2 with pipeline_read; buffer_count at least 4 x depth).",
     .min = 1, .max = 64},
    {.path = "strata.nvme_read_bandwidth", .type = T::kBandwidth, .default_json = "0",
     .meaning = "Measured read bandwidth of the swap tier (bytes/s or \"6.5GB/s\", as "
                "nvme_bench prints it); 0 = unknown."},
    {.path = "strata.nvme_write_bandwidth", .type = T::kBandwidth, .default_json = "0",
     .meaning = "Measured write bandwidth of the swap tier; 0 = unknown."},
    {.path = "strata.log_level", .type = T::kEnum, .default_json = "\"info\"",
     .meaning = "Log level; the STRATA_LOG_LEVEL environment variable overrides it.",
     .choices = "trace|debug|info|warn|error|off"},
});
// clang-format on

}  // namespace

std::span<const KeySpec> ConfigKeys() {
  return kKeys;
}

}  // namespace strata
