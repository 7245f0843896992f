// CPU Adam/AdamW and LAMB over spans: the optimizer step of offloaded optimizer states.
//
// One fused pass over memory per step: unscale the gradient by the loss scale, multiply
// by the clip coefficient, apply weight decay (L2 or decoupled), update the fp32 master
// parameters and the fp32 moments m and v, and optionally write a 16-bit (bf16 or fp16)
// copy of the new parameters. A separate read-only pass (GradSquaredNorm) computes the
// sum of squares of the unscaled gradients and detects inf/NaN, for the global norm and
// the overflow check that must come before the update.
//
// The instruction set is chosen at run time from cpuid (scalar, AVX2+FMA+F16C,
// AVX-512F/BW/VL); STRATA_CPU_ISA=scalar|avx2|avx512 forces one and an ISA the CPU lacks
// is refused with a FailedPrecondition Status. Every kernel performs the same sequence of
// correctly rounded float operations, so results are bit-identical across ISAs and
// whatever the thread count (see docs/cpu_adam.md for the exact formula).
//
// Ownership: the library never owns the spans passed to it; they must stay valid for the
// duration of the call. Spans may be unaligned. The arrays of one call must not overlap.
//
// LAMB runs in two passes per tensor (LambMoments, then LambApply with the tensor's trust
// ratio), with the same dispatch, fusion and bit-identity; see the LAMB section below.
//
// Thread-safety: a CpuAdam may be used by several threads at once (its methods are const
// apart from construction); AdamOptimizer's group table is not synchronized: mutate it
// (AddGroup, SetGroupParams, Step*) from one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/config.h"
#include "strata/core/planner.h"
#include "strata/core/status.h"

namespace strata {

// ---------------------------------------------------------------------------
// Instruction sets.

enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

std::string_view CpuIsaName(CpuIsa isa);  // "scalar", "avx2", "avx512"
// Case-insensitive "scalar", "avx2", "avx512"; InvalidArgument otherwise.
Result<CpuIsa> ParseCpuIsa(std::string_view name);
// Whether this CPU (and OS) can run the kernel of `isa` (cpuid + xgetbv).
// kAvx2 needs AVX2, FMA and F16C; kAvx512 needs AVX-512F, BW and VL (plus the AVX2 set).
bool CpuSupportsIsa(CpuIsa isa);
// The best ISA this CPU supports.
CpuIsa BestCpuIsa();
// The ISA to use: `forced` if given, else STRATA_CPU_ISA if set and non-empty, else the
// best. InvalidArgument for an unknown name, FailedPrecondition for an ISA the CPU lacks.
Result<CpuIsa> ResolveCpuIsa(std::optional<CpuIsa> forced = std::nullopt);

// ---------------------------------------------------------------------------
// Element types and conversions (round to nearest even; NaN stays NaN, made quiet).

enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
std::string_view ScalarTypeName(ScalarType t);  // "fp32", "bf16", "fp16"

uint16_t FloatToBFloat16(float f);
float BFloat16ToFloat(uint16_t h);  // exact
uint16_t FloatToFloat16(float f);   // IEEE binary16, subnormals kept, overflow -> inf
float Float16ToFloat(uint16_t h);   // exact

// A read-only gradient of any supported type (16-bit values are raw bit patterns).
struct GradSpan {
  const void* data = nullptr;
  size_t size = 0;
  ScalarType type = ScalarType::kFloat32;

  static GradSpan Fp32(std::span<const float> s) {
    return {s.data(), s.size(), ScalarType::kFloat32};
  }
  static GradSpan Bf16(std::span<const uint16_t> s) {
    return {s.data(), s.size(), ScalarType::kBFloat16};
  }
  static GradSpan Fp16(std::span<const uint16_t> s) {
    return {s.data(), s.size(), ScalarType::kFloat16};
  }
};

// The optional 16-bit copy of the updated parameters (data == nullptr: none).
struct Param16Span {
  uint16_t* data = nullptr;
  size_t size = 0;
  ScalarType type = ScalarType::kBFloat16;  // kBFloat16 or kFloat16

  static Param16Span Bf16(std::span<uint16_t> s) {
    return {s.data(), s.size(), ScalarType::kBFloat16};
  }
  static Param16Span Fp16(std::span<uint16_t> s) {
    return {s.data(), s.size(), ScalarType::kFloat16};
  }
  bool enabled() const { return data != nullptr; }
};

// Bulk conversions for the engine's buffers (16-bit gradients into fp32 accumulators,
// 16-bit shards to and from fp32): SIMD kernels of the best ISA of this CPU
// unless `isa` names one. Results are bit-identical on every ISA and to the element
// converters above (an added value is one float addition). Single-threaded; the spans
// may be unaligned and must not overlap.
// REQUIRES: equal sizes; a 16-bit `dst` type for BulkToHalf; CpuSupportsIsa(*isa).
void BulkToFloat(GradSpan src, std::span<float> dst, std::optional<CpuIsa> isa = std::nullopt);
// dst[i] += src[i].
void BulkAddToFloat(GradSpan src, std::span<float> dst, std::optional<CpuIsa> isa = std::nullopt);
// dst[i] = 0.0f + src[i]: BulkAddToFloat's result bit for bit where dst holds +0.0f (a -0.0
// source gives +0.0), without reading dst. The vector kernels write with non-temporal
// stores (no read for ownership, the lines not kept in cache: 6 instead of 10 bytes of
// memory traffic per bf16 value; PERFORMANCE.md) and fence them before returning.
void BulkAddToZeroedFloat(GradSpan src, std::span<float> dst,
                          std::optional<CpuIsa> isa = std::nullopt);
void BulkToHalf(std::span<const float> src, Param16Span dst,
                std::optional<CpuIsa> isa = std::nullopt);

// A value's term in an indexed sum of bits (the checkpoints' frozen-base fingerprint,
// engine/checkpoint/checkpoint.h's FrozenFingerprintTerm): splitmix64's finalizer over the index's
// multiple of the golden ratio mixed with the value's fp32 bits. For a given index a
// bijection of the bits.
inline uint64_t IndexedBitsTerm(uint64_t index, uint32_t bits) {
  uint64_t z = (index * 0x9E3779B97F4A7C15ull) ^ bits;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// The sum mod 2^64 of IndexedBitsTerm(first_index + i, fp32 bits of values[i]) over the span
// (the index wraps mod 2^64 too): SIMD kernels of the best ISA unless `isa` names one; integer
// arithmetic, so the same sum on every ISA. Single-threaded; `values` may be unaligned.
// REQUIRES: CpuSupportsIsa(*isa).
uint64_t BulkIndexedBitsSum(std::span<const float> values, uint64_t first_index,
                            std::optional<CpuIsa> isa = std::nullopt);

// ---------------------------------------------------------------------------
// Hyper-parameters (one set per parameter group).

enum class WeightDecayMode : int {
  kL2 = 0,         // Adam (torch.optim.Adam): g += weight_decay * p before the moments
  kDecoupled = 1,  // AdamW (torch.optim.AdamW): p *= 1 - lr * weight_decay before the update
};

// Doubles, as torch.optim and DeepSpeed configs hold them: the kernel constants (beta,
// 1 - beta, lr / (1 - beta1^t), ...) are computed in double and rounded to float once, so
// 1 - beta2 is 0.001f for beta2 = 0.999, as in torch (not 1 - 0.999f).
struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  WeightDecayMode weight_decay_mode = WeightDecayMode::kDecoupled;
  bool bias_correction = true;

  static AdamParams Adam(double lr, double weight_decay = 0.0) {
    AdamParams p;
    p.lr = lr;
    p.weight_decay = weight_decay;
    p.weight_decay_mode = WeightDecayMode::kL2;
    return p;
  }
  static AdamParams AdamW(double lr, double weight_decay = 1e-2) {
    AdamParams p;
    p.lr = lr;
    p.weight_decay = weight_decay;
    p.weight_decay_mode = WeightDecayMode::kDecoupled;
    return p;
  }
};

// InvalidArgument naming the field: lr, eps, weight_decay must be finite and >= 0,
// betas in [0, 1).
Status ValidateAdamParams(const AdamParams& p);

// Per-step gradient scaling, fused into the update: the kernel uses
// g * (inv_loss_scale * clip_coef), the product rounded to float once.
struct GradScaling {
  float inv_loss_scale = 1.0f;  // 1 / loss scale (fp16 dynamic scaling), 1 otherwise
  float clip_coef = 1.0f;       // min(1, max_norm / (global_norm + 1e-6)), 1 for no clipping
};

// The arrays of one update: fp32 master params, m, v and the gradient, all of one size.
struct AdamTensors {
  std::span<float> param;
  std::span<float> exp_avg;     // m
  std::span<float> exp_avg_sq;  // v
  GradSpan grad;
  Param16Span param16;  // optional copy-out
};

struct GradNorm {
  double sum_sq = 0.0;       // sum of (g * inv_loss_scale)^2, accumulated in double
  bool has_inf_nan = false;  // some gradient element is inf or NaN
};

// ---------------------------------------------------------------------------
// LAMB: "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (You et
// al., 2019), Algorithm 2, per tensor x with the Adam moments m and v of step t:
//   u = m_hat / (sqrt(v_hat) + eps) + weight_decay * x,  m_hat = m / (1 - beta1^t), ...
//   x = x - lr * ratio * u,  ratio = ||x|| / ||u||   (1 when either norm is 0)
// DeepSpeed's variant (FusedLamb), which this follows: the ratio is clamped to
// [min_coeff, max_coeff] (the paper clips ||x|| with a scaling function instead), and
// eps_inside_sqrt puts eps under the root: sqrt(v_hat + eps). docs/cpu_adam.md has the
// exact float formula.

struct LambParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  bool eps_inside_sqrt = false;
  double max_coeff = 10.0;  // DeepSpeed's defaults
  double min_coeff = 0.01;
};

// InvalidArgument naming the field: lr, eps, weight_decay finite and >= 0, betas in
// [0, 1), 0 <= min_coeff <= max_coeff, both finite.
Status ValidateLambParams(const LambParams& p);

// A tensor's (or a piece's) sums of squares: parameters before the step, and updates u.
struct LambNorms {
  double param_sq = 0.0;
  double update_sq = 0.0;
};

// The trust ratio of a whole tensor from its sums: sqrt(param_sq) / sqrt(update_sq)
// clamped to [min_coeff, max_coeff]; 1 when either sum is 0 (or not finite).
double LambTrustRatio(const LambParams& p, const LambNorms& whole_tensor);

// ---------------------------------------------------------------------------
// The kernel driver: an ISA and a thread arena.

class CpuAdam {
 public:
  struct Options {
    std::optional<CpuIsa> isa;  // nullopt: STRATA_CPU_ISA or the best (ResolveCpuIsa)
    int num_threads = 0;        // 0: all cores this process may use (or of numa_node)
    int numa_node = -1;         // >= 0: pin the arena's threads to this node's cores
  };

  // Elements per tile: the unit of work of a thread and of the norm's fixed-order sum.
  static constexpr size_t kTileElems = size_t{1} << 15;

  static Result<std::unique_ptr<CpuAdam>> Create(const Options& options);
  static Result<std::unique_ptr<CpuAdam>> Create() { return Create(Options{}); }
  // The threads num_threads 0 means: the cores this process may use (its affinity mask),
  // of numa_node's when it is >= 0 and oneTBB can bind to it here (else all of them).
  static int AvailableThreads(int numa_node);
  ~CpuAdam();
  CpuAdam(const CpuAdam&) = delete;
  CpuAdam& operator=(const CpuAdam&) = delete;

  CpuIsa isa() const { return isa_; }
  int num_threads() const;
  // The NUMA node its threads' arena is constrained to (Options::numa_node), or -1.
  int numa_node() const;

  // Calls fn(begin, end) for every tile of [0, n) on this optimizer's threads, the way its
  // own passes split their work, and returns when all are done: for the engine's other
  // elementwise host passes over the partition (adding reduced gradients into the fp32
  // accumulators, zeroing them), which on one thread took longer than the GPU's backward
  // (docs/PERFORMANCE.md, train_bench on the H200). fn runs concurrently on disjoint tiles.
  void ForEachTile(size_t n, const std::function<void(size_t begin, size_t end)>& fn) const;

  // One fused Adam step over `t` with the bias corrections of step number `step` (>= 1).
  // InvalidArgument for mismatched sizes, null data, step < 1 or bad hyper-parameters.
  // `zero_grad`: empty, or the gradient's own memory (t.grad fp32, the same data and size):
  // each tile of it is set to 0 right after the tile's update, while its cache lines are
  // still near (the engine's spent fp32 accumulators), instead of a later pass that reads
  // every line back from memory to overwrite it. The step itself is unchanged, bit for bit.
  Status Step(const AdamParams& params, int64_t step, const GradScaling& scaling,
              const AdamTensors& t, std::span<float> zero_grad = {}) const;

  // Read-only pass: sum of squares of grad * inv_loss_scale and the inf/NaN flag. The sum
  // is computed per tile in a fixed order and the tiles are added in index order, so the
  // result is bit-identical whatever the thread count and ISA.
  Result<GradNorm> GradSquaredNorm(GradSpan grad, float inv_loss_scale = 1.0f) const;
  // The same pass in two halves, for a caller that computes the tiles at different times
  // or on different threads: GradSquaredNormTiles writes tile k of `grad` (its elements
  // from k * kTileElems) into tile_sums[k] (unscaled; tile_sums.size() must be
  // NumTiles(grad.size)), and GradNormOfTiles adds them up in index order. Together they
  // give GradSquaredNorm's result bit for bit (it is made of them).
  Status GradSquaredNormTiles(GradSpan grad, std::span<double> tile_sums) const;
  static GradNorm GradNormOfTiles(std::span<const double> tile_sums, float inv_loss_scale = 1.0f);
  // BulkAddToZeroedFloat(src, dst) on this optimizer's threads (dst holds +0.0f; it is
  // written, not read), and tile_sums[k] = GradSquaredNormTiles' tile k of the new dst,
  // bit for bit, computed from the values as they are written instead of a later pass that
  // reads them back (the engine's reduced gradients written into zeroed accumulators,
  // their norm's tiles summed at the same time: 4 bytes less memory traffic per element).
  // InvalidArgument for mismatched sizes or a tile_sums of other than NumTiles(dst.size()).
  Status AddToZeroedWithNormTiles(GradSpan src, std::span<float> dst,
                                  std::span<double> tile_sums) const;
  static constexpr size_t NumTiles(size_t n) { return (n + kTileElems - 1) / kTileElems; }

  // LAMB pass 1 over `t` (a whole tensor, or a piece of one whose sums the caller adds
  // up, e.g. across ranks): unscales and clips the gradient, updates m and v, and returns
  // the sums of p^2 and u^2, computed per tile in a fixed order (bit-identical whatever
  // the thread count and ISA). t.param16 is not written.
  Result<LambNorms> LambMoments(const LambParams& params, int64_t step, const GradScaling& scaling,
                                const AdamTensors& t) const;
  // LAMB pass 2: p -= lr * trust_ratio * u with the moments of pass 1, and the 16-bit
  // copy-out. t.grad is not read.
  Status LambApply(const LambParams& params, int64_t step, double trust_ratio,
                   const AdamTensors& t) const;
  // Both passes over whole tensors (each element of `tensors` is one tensor), every
  // argument checked before any update. `trust_ratios` (optional) receives each ratio.
  Status LambStep(const LambParams& params, int64_t step, const GradScaling& scaling,
                  std::span<const AdamTensors> tensors,
                  std::vector<double>* trust_ratios = nullptr) const;

  // Copies fp32 values to 16 bits (round to nearest even), threaded.
  Status CopyToHalf(std::span<const float> src, Param16Span dst) const;

 private:
  struct Impl;
  CpuAdam(CpuIsa isa, std::unique_ptr<Impl> impl);
  CpuIsa isa_;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------
// Parameter groups with their step counters, over a CpuAdam.

class AdamOptimizer {
 public:
  // REQUIRES: `adam` outlives the optimizer.
  explicit AdamOptimizer(const CpuAdam* adam) : adam_(adam) {}

  // Returns the group's index.
  Result<int> AddGroup(const AdamParams& params);
  Status SetGroupParams(int group, const AdamParams& params);
  Result<AdamParams> GroupParams(int group) const;
  int num_groups() const { return static_cast<int>(groups_.size()); }
  // Steps taken by the group so far.
  Result<int64_t> StepCount(int group) const;
  Status SetStepCount(int group, int64_t step);  // for checkpoint restore

  // Advances the group's step counter once and updates every part of the group (the
  // sub-groups of a partition) with the new step number. On error the counter is left
  // unchanged when no part was touched (the arguments are checked before any update).
  Status StepGroup(int group, std::span<const AdamTensors> parts, const GradScaling& scaling = {});

 private:
  struct Group {
    AdamParams params;
    int64_t step = 0;
  };
  Status CheckGroup(int group) const;
  const CpuAdam* adam_;
  std::vector<Group> groups_;
};

// ---------------------------------------------------------------------------
// The planner's CPU-Adam rate, measured on the spot (`strata-config plan`, `strata-train
// --plan`): fused AdamW steps over `elements` fp32 master, m and v with an fp32 gradient
// (the engine's accumulators) and, with `copy_out` bf16 or fp16, the 16-bit copy-out of a
// mixed-precision run. One untimed step first (it faults the pages in), then steps until
// `min_seconds` have passed and at least `min_steps` were timed; the median step's rate.

struct AdamRateOptions {
  size_t elements = size_t{1} << 23;           // 8 Mi: 144 MiB of arrays, well past the caches
  ScalarType copy_out = ScalarType::kFloat32;  // kFloat32: none
  double min_seconds = 0.25;
  int min_steps = 3;
};

struct AdamRate {
  double params_per_second = 0.0;
  double median_step_s = 0.0;
  int steps = 0;  // timed steps
  // What ran: "avx512, 2 threads, bf16 copy-out".
  std::string description;
};

// InvalidArgument for elements 0, min_steps < 1 or a negative min_seconds; ResourceExhausted
// when the arrays cannot be allocated.
Result<AdamRate> MeasureAdamRate(const CpuAdam& adam, const AdamRateOptions& options = {});

// The rate of one of `ranks_sharing` ranks on this machine: a CpuAdam of the best ISA with
// its share of the cores this process may use (at least one thread).
Result<AdamRate> MeasureAdamRateOfARank(int ranks_sharing, ScalarType copy_out);
// The same with `threads` threads (strata.cpu_adam_threads, when the config sets it).
Result<AdamRate> MeasureAdamRateOnThreads(int threads, ScalarType copy_out);

// The planner's input, when it names no rate: the rate of one of the node's ranks
// (RanksPerNode) with the config's 16-bit copy-out, and where it came from ("measured
// here: avx512, 2 threads, bf16 copy-out; --adam-rate R to give it").
Status MeasureAdamRateForPlan(const Config& config, PlanInput& input);

}  // namespace strata
