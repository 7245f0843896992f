// The driver: ISA selection, argument checks, the per-step constants and the oneTBB
// tiling. Compiled with the baseline flags; the vector kernels are reached only through
// the tables of the ISAs that cpuid reports.
#include "strata/optim/cpu_adam/cpu_adam.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/check.h"
#include "strata/core/topology.h"
#include "strata/optim/cpu_adam/kernels.h"

namespace strata {

namespace {
#if defined(__has_feature)
#define STRATA_CPU_ADAM_HAS_FEATURE(x) __has_feature(x)
#else
#define STRATA_CPU_ADAM_HAS_FEATURE(x) 0
#endif
constexpr bool kThreadSanitizer =
#if defined(__SANITIZE_THREAD__) || STRATA_CPU_ADAM_HAS_FEATURE(thread_sanitizer)
    true;
#else
    false;
#endif
constexpr bool kAddressSanitizer =
#if defined(__SANITIZE_ADDRESS__) || STRATA_CPU_ADAM_HAS_FEATURE(address_sanitizer)
    true;
#else
    false;
#endif
}  // namespace

using cpu_adam_internal::KernelConsts;
using cpu_adam_internal::KernelTable;
using cpu_adam_internal::LambConsts;

// ---------------------------------------------------------------------------
// ISA

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Result<CpuIsa> ParseCpuIsa(std::string_view name) {
  std::string lower(name);
  for (char& ch : lower)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower == "scalar") return CpuIsa::kScalar;
  if (lower == "avx2") return CpuIsa::kAvx2;
  if (lower == "avx512") return CpuIsa::kAvx512;
  return InvalidArgumentError("unknown CPU ISA '" + std::string(name) +
                              "' (expected scalar, avx2 or avx512)");
}

bool CpuSupportsIsa(CpuIsa isa) {
  // Asked once: CpuHasF16c's cpuid exits to the hypervisor in a virtual machine (2-3 us a call
  // on the dev VM), and every bulk conversion asks (KernelsFor below), many of them for a tile
  // of 32K elements or fewer (docs/PERFORMANCE.md, "Bulk conversions: cpuid once").
  static const std::array<bool, 3> supported = [] {
    __builtin_cpu_init();
    const bool avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();  // core
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    return std::array<bool, 3>{true, avx2, avx512};
  }();
  switch (isa) {
    case CpuIsa::kScalar:
    case CpuIsa::kAvx2:
    case CpuIsa::kAvx512:
      return supported[static_cast<size_t>(isa)];
  }
  return false;
}

CpuIsa BestCpuIsa() {
  if (CpuSupportsIsa(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (CpuSupportsIsa(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

namespace {
std::string_view IsaRequirement(CpuIsa isa) {
  return isa == CpuIsa::kAvx512 ? "AVX-512F, AVX-512BW, AVX-512VL and AVX-512DQ"
                                : "AVX2, FMA and F16C";
}
}  // namespace

Result<CpuIsa> ResolveCpuIsa(std::optional<CpuIsa> forced) {
  std::string source = "requested CPU ISA";
  if (!forced) {
    const char* env = std::getenv("STRATA_CPU_ISA");
    if (env == nullptr || *env == '\0') return BestCpuIsa();
    auto parsed = ParseCpuIsa(env);
    if (!parsed.ok()) return parsed.status().WithContext("STRATA_CPU_ISA");
    forced = *parsed;
    source = "STRATA_CPU_ISA=" + std::string(env);
  }
  if (!CpuSupportsIsa(*forced)) {
    return FailedPreconditionError(
        source + ": this CPU lacks " + std::string(IsaRequirement(*forced)) +
        " (cpuid); the best it supports is " + std::string(CpuIsaName(BestCpuIsa())));
  }
  return *forced;
}

// ---------------------------------------------------------------------------
// Types and conversions

std::string_view ScalarTypeName(ScalarType t) {
  switch (t) {
    case ScalarType::kFloat32:
      return "fp32";
    case ScalarType::kBFloat16:
      return "bf16";
    case ScalarType::kFloat16:
      return "fp16";
  }
  return "unknown";
}

uint16_t FloatToBFloat16(float f) {
  return cpu_adam_internal::F32ToBf16(f);
}
float BFloat16ToFloat(uint16_t h) {
  return cpu_adam_internal::Bf16ToF32(h);
}
uint16_t FloatToFloat16(float f) {
  return cpu_adam_internal::F32ToFp16(f);
}
float Float16ToFloat(uint16_t h) {
  return cpu_adam_internal::Fp16ToF32(h);
}

namespace {
const cpu_adam_internal::KernelTable& KernelsFor(std::optional<CpuIsa> isa) {
  static const CpuIsa best = BestCpuIsa();
  const CpuIsa use = isa.value_or(best);
  STRATA_CHECK(CpuSupportsIsa(use))
      << "bulk conversion: this CPU cannot run the " << CpuIsaName(use) << " kernels";
  switch (use) {
    case CpuIsa::kScalar:
      return cpu_adam_internal::ScalarKernels();
    case CpuIsa::kAvx2:
      return cpu_adam_internal::Avx2Kernels();
    case CpuIsa::kAvx512:
      break;
  }
  return cpu_adam_internal::Avx512Kernels();
}
}  // namespace

void BulkToFloat(GradSpan src, std::span<float> dst, std::optional<CpuIsa> isa) {
  STRATA_CHECK(src.size == dst.size()) << "BulkToFloat: " << src.size << " vs " << dst.size();
  if (src.size == 0) return;
  KernelsFor(isa).to_float(src.data, src.type, dst.data(), src.size, /*add=*/false);
}

void BulkAddToFloat(GradSpan src, std::span<float> dst, std::optional<CpuIsa> isa) {
  STRATA_CHECK(src.size == dst.size()) << "BulkAddToFloat: " << src.size << " vs " << dst.size();
  if (src.size == 0) return;
  KernelsFor(isa).to_float(src.data, src.type, dst.data(), src.size, /*add=*/true);
}

void BulkAddToZeroedFloat(GradSpan src, std::span<float> dst, std::optional<CpuIsa> isa) {
  STRATA_CHECK(src.size == dst.size())
      << "BulkAddToZeroedFloat: " << src.size << " vs " << dst.size();
  if (src.size == 0) return;
  KernelsFor(isa).add_to_zero(src.data, src.type, dst.data(), src.size);
}

uint64_t BulkIndexedBitsSum(std::span<const float> values, uint64_t first_index,
                            std::optional<CpuIsa> isa) {
  if (values.empty()) return 0;
  return KernelsFor(isa).indexed_bits_sum(values.data(), first_index, values.size());
}

void BulkToHalf(std::span<const float> src, Param16Span dst, std::optional<CpuIsa> isa) {
  STRATA_CHECK(src.size() == dst.size) << "BulkToHalf: " << src.size() << " vs " << dst.size;
  STRATA_CHECK(dst.type != ScalarType::kFloat32) << "BulkToHalf: a 16-bit destination";
  if (src.empty()) return;
  KernelsFor(isa).to_half(src.data(), dst.data, dst.type, src.size());
}

// ---------------------------------------------------------------------------
// Hyper-parameters

Status ValidateAdamParams(const AdamParams& p) {
  auto non_negative = [](const char* name, double x) -> Status {
    if (!std::isfinite(x) || x < 0.0) {
      return InvalidArgumentError(std::string("Adam ") + name + " must be finite and >= 0, got " +
                                  std::to_string(x));
    }
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(non_negative("lr", p.lr));
  STRATA_RETURN_IF_ERROR(non_negative("eps", p.eps));
  STRATA_RETURN_IF_ERROR(non_negative("weight_decay", p.weight_decay));
  for (auto [name, beta] : {std::pair{"beta1", p.beta1}, std::pair{"beta2", p.beta2}}) {
    if (!(beta >= 0.0 && beta < 1.0)) {
      return InvalidArgumentError(std::string("Adam ") + name + " must be in [0, 1), got " +
                                  std::to_string(beta));
    }
  }
  if (p.weight_decay_mode != WeightDecayMode::kL2 &&
      p.weight_decay_mode != WeightDecayMode::kDecoupled) {
    return InvalidArgumentError("Adam weight_decay_mode is neither L2 nor decoupled");
  }
  return Status::Ok();
}

Status ValidateLambParams(const LambParams& p) {
  AdamParams a;
  a.lr = p.lr;
  a.beta1 = p.beta1;
  a.beta2 = p.beta2;
  a.eps = p.eps;
  a.weight_decay = p.weight_decay;
  STRATA_RETURN_IF_ERROR(ValidateAdamParams(a).WithContext("LAMB"));
  if (!std::isfinite(p.min_coeff) || !std::isfinite(p.max_coeff) || p.min_coeff < 0.0 ||
      p.min_coeff > p.max_coeff) {
    return InvalidArgumentError("LAMB needs finite 0 <= min_coeff <= max_coeff, got min_coeff " +
                                std::to_string(p.min_coeff) + " and max_coeff " +
                                std::to_string(p.max_coeff));
  }
  return Status::Ok();
}

double LambTrustRatio(const LambParams& p, const LambNorms& whole_tensor) {
  const double w = std::sqrt(whole_tensor.param_sq);
  const double u = std::sqrt(whole_tensor.update_sq);
  if (!(w > 0.0) || !(u > 0.0) || !std::isfinite(w) || !std::isfinite(u)) return 1.0;
  return std::clamp(w / u, p.min_coeff, p.max_coeff);
}

// ---------------------------------------------------------------------------
// CpuAdam

struct CpuAdam::Impl {
  const KernelTable* kernels = nullptr;
  int threads = 1;
  bool pinned = false;  // the arena is constrained to a NUMA node
  int numa_node = -1;   // that node
  // Mutable: task_arena::execute is not const, but running work in it does not change the
  // CpuAdam's observable state; the arena is thread-safe.
  mutable tbb::task_arena arena;

  // Calls fn(begin, end) for every tile of [0, n), on the arena's threads.
  template <typename Fn>
  void ForTiles(size_t n, Fn&& fn) const {
    const size_t tiles = (n + kTileElems - 1) / kTileElems;
    // Small spans, and one unpinned thread, run on the caller (no arena round trip).
    if (tiles <= 1 || (threads == 1 && !pinned)) {
      for (size_t t = 0; t < tiles; ++t)
        fn(t, t * kTileElems, std::min(n, (t + 1) * kTileElems));
      return;
    }
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, tiles, 1),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t t = r.begin(); t != r.end(); ++t) {
              fn(t, t * kTileElems, std::min(n, (t + 1) * kTileElems));
            }
          },
          tbb::simple_partitioner());
    });
  }
};

CpuAdam::CpuAdam(CpuIsa isa, std::unique_ptr<Impl> impl) : isa_(isa), impl_(std::move(impl)) {}
CpuAdam::~CpuAdam() = default;

int CpuAdam::num_threads() const {
  return impl_->threads;
}

int CpuAdam::numa_node() const {
  return impl_->numa_node;
}

void CpuAdam::ForEachTile(size_t n, const std::function<void(size_t, size_t)>& fn) const {
  impl_->ForTiles(n, [&](size_t /*tile*/, size_t b, size_t e) { fn(b, e); });
}

int CpuAdam::AvailableThreads(int numa_node) {
  // A sanitizer build cannot load oneTBB's NUMA support (Create refuses a node there).
  if (numa_node >= 0 && !kThreadSanitizer && !kAddressSanitizer) {
    const std::vector<tbb::numa_node_id> nodes = tbb::info::numa_nodes();
    if (std::find(nodes.begin(), nodes.end(), numa_node) != nodes.end()) {
      return tbb::info::default_concurrency(numa_node);
    }
  }
  return tbb::info::default_concurrency();
}

Result<std::unique_ptr<CpuAdam>> CpuAdam::Create(const Options& options) {
  STRATA_ASSIGN_OR_RETURN(CpuIsa isa, ResolveCpuIsa(options.isa));
  if (options.num_threads < 0) {
    return InvalidArgumentError("CpuAdam num_threads must be >= 0 (0: all cores), got " +
                                std::to_string(options.num_threads));
  }
  auto impl = std::make_unique<Impl>();
  switch (isa) {
    case CpuIsa::kScalar:
      impl->kernels = &cpu_adam_internal::ScalarKernels();
      break;
    case CpuIsa::kAvx2:
      impl->kernels = &cpu_adam_internal::Avx2Kernels();
      break;
    case CpuIsa::kAvx512:
      impl->kernels = &cpu_adam_internal::Avx512Kernels();
      break;
  }
  tbb::task_arena::constraints constraints;
  if (options.numa_node >= 0 && (kThreadSanitizer || kAddressSanitizer)) {
    // oneTBB's NUMA support dlopens libtbbbind with RTLD_DEEPBIND, which the sanitizer
    // runtimes refuse by aborting the process.
    return FailedPreconditionError(
        "CpuAdam numa_node " + std::to_string(options.numa_node) +
        ": a sanitizer build cannot pin oneTBB's threads to a NUMA node (oneTBB loads "
        "libtbbbind with RTLD_DEEPBIND, which the sanitizer runtime refuses); use numa_node -1");
  }
  if (options.numa_node >= 0) {
    const std::vector<tbb::numa_node_id> nodes = tbb::info::numa_nodes();
    if (std::find(nodes.begin(), nodes.end(), options.numa_node) == nodes.end()) {
      return InvalidArgumentError("CpuAdam numa_node " + std::to_string(options.numa_node) +
                                  " is not a NUMA node oneTBB knows on this machine");
    }
    constraints.numa_id = options.numa_node;
    impl->pinned = true;
    impl->numa_node = options.numa_node;
  }
  impl->threads =
      options.num_threads == 0 ? AvailableThreads(options.numa_node) : options.num_threads;
  if (kThreadSanitizer) {
    // oneTBB (libtbb, not instrumented) hands tiles to its workers through synchronization
    // ThreadSanitizer cannot see, so every tile would be reported as a race: a TSan build
    // runs every update on the caller's thread (scripts/sanitize.sh; docs/testing.md).
    impl->threads = 1;
    impl->pinned = false;
  }
  constraints.max_concurrency = impl->threads;
  impl->arena.initialize(constraints);
  return std::unique_ptr<CpuAdam>(new CpuAdam(isa, std::move(impl)));
}

namespace {

// A tile's sum of squares from its 16 lanes, added in lane order: the one reduction every
// producer of a tile's sum uses (GradSquaredNormTiles, AddToZeroedWithNormTiles), so that
// their sums agree bit for bit.
double SumLanes(const double (&lanes)[16]) {
  double s = 0.0;
  for (double lane : lanes)
    s += lane;
  return s;
}

// One sum per tile of n elements.
Status CheckTileSums(const char* what, size_t sums, size_t n) {
  if (sums == CpuAdam::NumTiles(n)) return Status::Ok();
  return InvalidArgumentError(std::string(what) + ": " + std::to_string(sums) + " tile sums for " +
                              std::to_string(n) + " elements (" +
                              std::to_string(CpuAdam::NumTiles(n)) + " tiles)");
}

Status CheckGrad(const GradSpan& g, size_t n) {
  if (g.size != n) {
    return InvalidArgumentError("gradient has " + std::to_string(g.size) + " elements, expected " +
                                std::to_string(n));
  }
  if (n > 0 && g.data == nullptr) return InvalidArgumentError("gradient data is null");
  if (g.type != ScalarType::kFloat32 && g.type != ScalarType::kBFloat16 &&
      g.type != ScalarType::kFloat16) {
    return InvalidArgumentError("gradient has an unknown element type");
  }
  return Status::Ok();
}

Status CheckParam16(const Param16Span& o, size_t n) {
  if (!o.enabled()) return Status::Ok();
  if (o.size != n) {
    return InvalidArgumentError("16-bit parameter copy has " + std::to_string(o.size) +
                                " elements, expected " + std::to_string(n));
  }
  if (o.type != ScalarType::kBFloat16 && o.type != ScalarType::kFloat16) {
    return InvalidArgumentError("16-bit parameter copy must be bf16 or fp16, got " +
                                std::string(ScalarTypeName(o.type)));
  }
  return Status::Ok();
}

// The sizes and pointers of one update's arrays (the gradient's only when it is read).
Status CheckTensors(const AdamTensors& t, bool with_grad) {
  const size_t n = t.param.size();
  if (t.exp_avg.size() != n || t.exp_avg_sq.size() != n) {
    return InvalidArgumentError("optimizer arrays differ in size: param " + std::to_string(n) +
                                ", exp_avg " + std::to_string(t.exp_avg.size()) + ", exp_avg_sq " +
                                std::to_string(t.exp_avg_sq.size()));
  }
  if (n > 0 && (t.param.data() == nullptr || t.exp_avg.data() == nullptr ||
                t.exp_avg_sq.data() == nullptr)) {
    return InvalidArgumentError("optimizer array data is null");
  }
  if (with_grad) STRATA_RETURN_IF_ERROR(CheckGrad(t.grad, n));
  return CheckParam16(t.param16, n);
}

Status CheckStepAndScaling(int64_t step, const GradScaling& s) {
  if (step < 1)
    return InvalidArgumentError("step number must be >= 1, got " + std::to_string(step));
  if (!std::isfinite(s.inv_loss_scale) || !std::isfinite(s.clip_coef)) {
    return InvalidArgumentError("gradient scaling factors must be finite");
  }
  return Status::Ok();
}

// The moment constants Adam's and LAMB's kernels share (the gradient scale, betas, 1 -
// betas and eps, each rounded to float once); returns the bias corrections (1 - beta^t, or
// 1 without bias correction) in double.
template <typename Consts, typename Params>
std::pair<double, double> SetMomentConsts(Consts& c, const Params& hp, int64_t step,
                                          const GradScaling& s) {
  c.gscale = s.inv_loss_scale * s.clip_coef;
  c.beta1 = static_cast<float>(hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.omb1 = static_cast<float>(1.0 - hp.beta1);
  c.omb2 = static_cast<float>(1.0 - hp.beta2);
  c.eps = static_cast<float>(hp.eps);
  if (!hp.bias_correction) return {1.0, 1.0};
  return {1.0 - std::pow(hp.beta1, static_cast<double>(step)),
          1.0 - std::pow(hp.beta2, static_cast<double>(step))};
}

Result<KernelConsts> MakeConsts(const AdamParams& hp, int64_t step, const GradScaling& s) {
  STRATA_RETURN_IF_ERROR(ValidateAdamParams(hp));
  STRATA_RETURN_IF_ERROR(CheckStepAndScaling(step, s).WithContext("Adam"));
  KernelConsts c;
  const auto [bc1, bc2] = SetMomentConsts(c, hp, step, s);
  c.neg_step_size = static_cast<float>(-hp.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const bool wd = hp.weight_decay != 0.0;
  c.l2 = wd && hp.weight_decay_mode == WeightDecayMode::kL2;
  c.decoupled = wd && hp.weight_decay_mode == WeightDecayMode::kDecoupled;
  c.wd = static_cast<float>(hp.weight_decay);
  c.decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  return c;
}

size_t ElemSize(ScalarType t) {
  return t == ScalarType::kFloat32 ? 4 : 2;
}

// LAMB's constants; the bias corrections in double, each rounded to float once.
Result<LambConsts> MakeLambConsts(const LambParams& hp, int64_t step, const GradScaling& s,
                                  double trust_ratio) {
  STRATA_RETURN_IF_ERROR(ValidateLambParams(hp));
  STRATA_RETURN_IF_ERROR(CheckStepAndScaling(step, s).WithContext("LAMB"));
  if (!std::isfinite(trust_ratio) || trust_ratio < 0.0) {
    return InvalidArgumentError("LAMB trust ratio must be finite and >= 0, got " +
                                std::to_string(trust_ratio));
  }
  LambConsts c;
  const auto [bc1, bc2] = SetMomentConsts(c, hp, step, s);
  c.inv_bc1 = static_cast<float>(1.0 / bc1);
  c.inv_bc2 = static_cast<float>(1.0 / bc2);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.wd = static_cast<float>(hp.weight_decay);
  c.neg_lr_ratio = static_cast<float>(-hp.lr * trust_ratio);
  c.eps_inside_sqrt = hp.eps_inside_sqrt;
  return c;
}

}  // namespace

Status CpuAdam::Step(const AdamParams& params, int64_t step, const GradScaling& scaling,
                     const AdamTensors& t, std::span<float> zero_grad) const {
  const size_t n = t.param.size();
  STRATA_RETURN_IF_ERROR(CheckTensors(t, /*with_grad=*/true));
  if (!zero_grad.empty() && (t.grad.type != ScalarType::kFloat32 ||
                             zero_grad.data() != t.grad.data || zero_grad.size() != n)) {
    return InvalidArgumentError(
        "CpuAdam::Step: zero_grad must be the step's own fp32 gradient (the same address and " +
        std::to_string(n) + " elements), got " + std::to_string(zero_grad.size()) + " elements" +
        (zero_grad.data() != t.grad.data ? " elsewhere" : "") +
        (t.grad.type != ScalarType::kFloat32 ? " for a 16-bit gradient" : ""));
  }
  STRATA_ASSIGN_OR_RETURN(const KernelConsts c, MakeConsts(params, step, scaling));
  if (n == 0) return Status::Ok();
  float* zero = zero_grad.data();

  const auto* g = static_cast<const unsigned char*>(t.grad.data);
  const size_t gsize = ElemSize(t.grad.type);
  const auto adam = impl_->kernels->adam;
  float* p = t.param.data();
  float* m = t.exp_avg.data();
  float* v = t.exp_avg_sq.data();
  uint16_t* out = t.param16.data;
  const ScalarType gt = t.grad.type, ot = t.param16.type;
  impl_->ForTiles(n, [&](size_t, size_t b, size_t e) {
    adam(c, p + b, m + b, v + b, g + b * gsize, gt, out != nullptr ? out + b : nullptr, ot, e - b);
    if (zero != nullptr) std::memset(zero + b, 0, (e - b) * sizeof(float));
  });
  return Status::Ok();
}

Status CpuAdam::GradSquaredNormTiles(GradSpan grad, std::span<double> tile_sums) const {
  STRATA_RETURN_IF_ERROR(CheckGrad(grad, grad.size));
  const size_t n = grad.size;
  STRATA_RETURN_IF_ERROR(CheckTileSums("GradSquaredNormTiles", tile_sums.size(), n));
  const auto* g = static_cast<const unsigned char*>(grad.data);
  const size_t gsize = ElemSize(grad.type);
  const auto sumsq = impl_->kernels->sumsq;
  const ScalarType gt = grad.type;
  impl_->ForTiles(n, [&](size_t tile, size_t b, size_t e) {
    double lanes[16] = {};
    sumsq(g + b * gsize, gt, e - b, lanes);
    tile_sums[tile] = SumLanes(lanes);
  });
  return Status::Ok();
}

Status CpuAdam::AddToZeroedWithNormTiles(GradSpan src, std::span<float> dst,
                                         std::span<double> tile_sums) const {
  STRATA_RETURN_IF_ERROR(CheckGrad(src, dst.size()));
  const size_t n = dst.size();
  STRATA_RETURN_IF_ERROR(CheckTileSums("AddToZeroedWithNormTiles", tile_sums.size(), n));
  const auto* g = static_cast<const unsigned char*>(src.data);
  const size_t gsize = ElemSize(src.type);
  const auto fused = impl_->kernels->add_to_zero_sumsq;
  const ScalarType gt = src.type;
  float* out = dst.data();
  impl_->ForTiles(n, [&](size_t tile, size_t b, size_t e) {
    double lanes[16] = {};
    fused(g + b * gsize, gt, out + b, e - b, lanes);
    tile_sums[tile] = SumLanes(lanes);
  });
  return Status::Ok();
}

GradNorm CpuAdam::GradNormOfTiles(std::span<const double> tile_sums, float inv_loss_scale) {
  double raw = 0.0;
  for (double s : tile_sums)
    raw += s;
  GradNorm result;
  // Squares of floats cannot overflow a double, so a non-finite sum means inf or NaN input.
  result.has_inf_nan = !std::isfinite(raw);
  const double scale = inv_loss_scale;
  result.sum_sq = raw * (scale * scale);
  return result;
}

Result<GradNorm> CpuAdam::GradSquaredNorm(GradSpan grad, float inv_loss_scale) const {
  std::vector<double> partial(NumTiles(grad.size), 0.0);
  STRATA_RETURN_IF_ERROR(GradSquaredNormTiles(grad, partial));
  return GradNormOfTiles(partial, inv_loss_scale);
}

Result<LambNorms> CpuAdam::LambMoments(const LambParams& params, int64_t step,
                                       const GradScaling& scaling, const AdamTensors& t) const {
  STRATA_RETURN_IF_ERROR(CheckTensors(t, /*with_grad=*/true));
  STRATA_ASSIGN_OR_RETURN(const LambConsts c, MakeLambConsts(params, step, scaling, 1.0));
  const size_t n = t.param.size();
  const size_t tiles = (n + kTileElems - 1) / kTileElems;
  std::vector<LambNorms> partial(tiles);
  const auto* g = static_cast<const unsigned char*>(t.grad.data);
  const size_t gsize = ElemSize(t.grad.type);
  const auto moments = impl_->kernels->lamb_moments;
  const float* p = t.param.data();
  float* m = t.exp_avg.data();
  float* v = t.exp_avg_sq.data();
  const ScalarType gt = t.grad.type;
  impl_->ForTiles(n, [&](size_t tile, size_t b, size_t e) {
    double w_lanes[16] = {}, u_lanes[16] = {};
    moments(c, p + b, m + b, v + b, g + b * gsize, gt, e - b, w_lanes, u_lanes);
    for (int k = 0; k < 16; ++k) {
      partial[tile].param_sq += w_lanes[k];
      partial[tile].update_sq += u_lanes[k];
    }
  });
  LambNorms sums;
  for (const LambNorms& s : partial) {
    sums.param_sq += s.param_sq;
    sums.update_sq += s.update_sq;
  }
  return sums;
}

Status CpuAdam::LambApply(const LambParams& params, int64_t step, double trust_ratio,
                          const AdamTensors& t) const {
  STRATA_RETURN_IF_ERROR(CheckTensors(t, /*with_grad=*/false));
  STRATA_ASSIGN_OR_RETURN(const LambConsts c, MakeLambConsts(params, step, {}, trust_ratio));
  const auto apply = impl_->kernels->lamb_apply;
  float* p = t.param.data();
  const float* m = t.exp_avg.data();
  const float* v = t.exp_avg_sq.data();
  uint16_t* out = t.param16.data;
  const ScalarType ot = t.param16.type;
  impl_->ForTiles(t.param.size(), [&](size_t, size_t b, size_t e) {
    apply(c, p + b, m + b, v + b, out != nullptr ? out + b : nullptr, ot, e - b);
  });
  return Status::Ok();
}

Status CpuAdam::LambStep(const LambParams& params, int64_t step, const GradScaling& scaling,
                         std::span<const AdamTensors> tensors,
                         std::vector<double>* trust_ratios) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    STRATA_RETURN_IF_ERROR_CTX(CheckTensors(tensors[i], /*with_grad=*/true),
                               "tensor " + std::to_string(i));
  }
  STRATA_RETURN_IF_ERROR(MakeLambConsts(params, step, scaling, 1.0).status());
  if (trust_ratios != nullptr) trust_ratios->clear();
  for (const AdamTensors& t : tensors) {
    STRATA_ASSIGN_OR_RETURN(const LambNorms norms, LambMoments(params, step, scaling, t));
    const double ratio = LambTrustRatio(params, norms);
    STRATA_RETURN_IF_ERROR(LambApply(params, step, ratio, t));
    if (trust_ratios != nullptr) trust_ratios->push_back(ratio);
  }
  return Status::Ok();
}

Status CpuAdam::CopyToHalf(std::span<const float> src, Param16Span dst) const {
  if (!dst.enabled()) return InvalidArgumentError("CopyToHalf: destination is null");
  STRATA_RETURN_IF_ERROR(CheckParam16(dst, src.size()));
  const auto to_half = impl_->kernels->to_half;
  impl_->ForTiles(src.size(), [&](size_t, size_t b, size_t e) {
    to_half(src.data() + b, dst.data + b, dst.type, e - b);
  });
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// AdamOptimizer

Status AdamOptimizer::CheckGroup(int group) const {
  if (group < 0 || group >= num_groups()) {
    return OutOfRangeError("parameter group " + std::to_string(group) + " does not exist (" +
                           std::to_string(num_groups()) + " groups)");
  }
  return Status::Ok();
}

Result<int> AdamOptimizer::AddGroup(const AdamParams& params) {
  STRATA_RETURN_IF_ERROR(ValidateAdamParams(params));
  groups_.push_back(Group{params, 0});
  return num_groups() - 1;
}

Status AdamOptimizer::SetGroupParams(int group, const AdamParams& params) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  STRATA_RETURN_IF_ERROR(ValidateAdamParams(params));
  groups_[static_cast<size_t>(group)].params = params;
  return Status::Ok();
}

Result<AdamParams> AdamOptimizer::GroupParams(int group) const {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  return groups_[static_cast<size_t>(group)].params;
}

Result<int64_t> AdamOptimizer::StepCount(int group) const {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  return groups_[static_cast<size_t>(group)].step;
}

Status AdamOptimizer::SetStepCount(int group, int64_t step) {
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  if (step < 0) return InvalidArgumentError("step count must be >= 0");
  groups_[static_cast<size_t>(group)].step = step;
  return Status::Ok();
}

Status AdamOptimizer::StepGroup(int group, std::span<const AdamTensors> parts,
                                const GradScaling& scaling) {
  STRATA_CHECK(adam_ != nullptr) << "AdamOptimizer needs a CpuAdam";
  STRATA_RETURN_IF_ERROR(CheckGroup(group));
  Group& g = groups_[static_cast<size_t>(group)];
  const int64_t step = g.step + 1;
  // Check every part first (with an empty update: same checks, no writes).
  for (size_t i = 0; i < parts.size(); ++i) {
    const AdamTensors& t = parts[i];
    const size_t n = t.param.size();
    if (t.exp_avg.size() != n || t.exp_avg_sq.size() != n) {
      return InvalidArgumentError("part " + std::to_string(i) + ": Adam arrays differ in size");
    }
    STRATA_RETURN_IF_ERROR_CTX(CheckGrad(t.grad, n), "part " + std::to_string(i));
    STRATA_RETURN_IF_ERROR_CTX(CheckParam16(t.param16, n), "part " + std::to_string(i));
  }
  STRATA_RETURN_IF_ERROR(MakeConsts(g.params, step, scaling).status());
  for (size_t i = 0; i < parts.size(); ++i) {
    STRATA_RETURN_IF_ERROR_CTX(adam_->Step(g.params, step, scaling, parts[i]),
                               "part " + std::to_string(i));
  }
  g.step = step;
  return Status::Ok();
}

Result<AdamRate> MeasureAdamRate(const CpuAdam& adam, const AdamRateOptions& options) {
  if (options.elements == 0 || options.min_steps < 1 || !(options.min_seconds >= 0)) {
    return InvalidArgumentError(
        "MeasureAdamRate: elements must be positive, min_steps at least 1 and min_seconds "
        "not negative");
  }
  const size_t n = options.elements;
  const bool half = options.copy_out != ScalarType::kFloat32;
  std::vector<float> param, m, v, grad;
  std::vector<uint16_t> p16;
  try {
    param.assign(n, 0.5f);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    grad.resize(n);
    if (half) p16.assign(n, 0);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("MeasureAdamRate: cannot allocate the arrays of " +
                                  std::to_string(n) + " elements");
  }
  for (size_t i = 0; i < n; ++i)
    grad[i] = static_cast<float>(static_cast<int>(i % 2001) - 1000) * 1e-6f;
  AdamTensors t;
  t.param = param;
  t.exp_avg = m;
  t.exp_avg_sq = v;
  t.grad = GradSpan::Fp32(grad);
  if (half) t.param16 = {p16.data(), n, options.copy_out};
  const AdamParams params = AdamParams::AdamW(1e-4);
  int64_t step = 1;
  STRATA_RETURN_IF_ERROR(adam.Step(params, step++, {}, t));  // untimed
  using Clock = std::chrono::steady_clock;
  std::vector<double> times;
  const Clock::time_point start = Clock::now();
  while (static_cast<int>(times.size()) < options.min_steps ||
         std::chrono::duration<double>(Clock::now() - start).count() < options.min_seconds) {
    const Clock::time_point t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(adam.Step(params, step++, {}, t));
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  AdamRate rate;
  rate.steps = static_cast<int>(times.size());
  rate.median_step_s = times[times.size() / 2];
  rate.params_per_second = static_cast<double>(n) / std::max(rate.median_step_s, 1e-9);
  const int threads = adam.num_threads();
  rate.description =
      std::string(CpuIsaName(adam.isa())) + ", " + std::to_string(threads) +
      (threads == 1 ? " thread" : " threads") +
      (half ? ", " + std::string(ScalarTypeName(options.copy_out)) + " copy-out" : std::string());
  return rate;
}

Result<AdamRate> MeasureAdamRateOfARank(int ranks_sharing, ScalarType copy_out) {
  if (ranks_sharing < 1) {
    return InvalidArgumentError("MeasureAdamRateOfARank: ranks_sharing must be at least 1");
  }
  return MeasureAdamRateOnThreads(std::max(1, CpuAdam::AvailableThreads(-1) / ranks_sharing),
                                  copy_out);
}

Result<AdamRate> MeasureAdamRateOnThreads(int threads, ScalarType copy_out) {
  CpuAdam::Options adam_options;
  adam_options.num_threads = threads;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CpuAdam> adam, CpuAdam::Create(adam_options));
  AdamRateOptions options;
  options.copy_out = copy_out;
  return MeasureAdamRate(*adam, options);
}

Status MeasureAdamRateForPlan(const Config& config, PlanInput& input) {
  const ScalarType copy_out = config.bf16           ? ScalarType::kBFloat16
                              : config.fp16.enabled ? ScalarType::kFloat16
                                                    : ScalarType::kFloat32;
  // strata.cpu_adam_threads: the engine's count, whatever the ranks.
  STRATA_ASSIGN_OR_RETURN(const AdamRate rate,
                          config.strata.cpu_adam_threads > 0
                              ? MeasureAdamRateOnThreads(config.strata.cpu_adam_threads, copy_out)
                              : MeasureAdamRateOfARank(RanksPerNode(input), copy_out));
  input.adam_rate = rate.params_per_second;
  input.adam_rate_source = "measured here: " + rate.description + "; --adam-rate R to give it";
  return Status::Ok();
}

}  // namespace strata
