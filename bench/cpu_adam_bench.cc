// cpu_adam_bench: Strata's CPU Adam against the memory-bandwidth limit and LibTorch.
//
// For each size (1M..256M parameters) and thread count (1 and all cores) it measures:
//   copy, triad      STREAM-style bandwidth (8 and 12 counted bytes per element)
//   roofline         a trivial kernel with exactly the Adam step's traffic: read p, g, m,
//                    v and write p, m, v in place (28 B per parameter)
//   adam_fp32        Strata's fp32 step (28 B per parameter)
//   adam_mixed       bf16 grads in, fp32 master/m/v, bf16 params out, fused unscale and
//                    clip, plus the read-only norm/overflow pass (2+12+12+2+2 = 30 B)
//   adam_zero_pass   the engine's pipelined update of one sub-group: fp32 gradient
//                    accumulators in, bf16 parameters out, then the spent accumulators
//                    zeroed in a second threaded pass (ForEachTile + memset), as before
//                    (4+8+8+8+2 + 4 counted bytes = 34 B)
//   adam_zero_fused  the same with Step's zero_grad: each tile zeroed as the kernel leaves it
//                    (34 B)
//   adam_acc_nozero  the same update leaving the accumulators as they are (4+8+8+8+2 = 30 B):
//                    the cost of the zeroing is the difference
//   libtorch_adam    torch::optim::Adam on the same fp32 data
//   lamb_roofline    LAMB's two passes with trivial arithmetic: read p, g, m, v and write
//                    m, v; then read p, m, v and write p (40 B per parameter)
//   lamb_fp32        Strata's LAMB, both passes (LambMoments, LambApply), fp32 (40 B)
//   lamb_mixed       bf16 grads, the norm/overflow pass, both LAMB passes and the bf16
//                    copy-out (2 + 22 + 18 = 42 B)
// (LibTorch has no LAMB, and DeepSpeed's FusedLamb runs on CUDA only: the LAMB rows are
// held to their roofline and to Strata's Adam in the same run.)
// and prints a table; --json FILE writes the same rows as JSON. --quick: small sizes,
// few repetitions (well under 30 s). Times are medians of the repetitions.
//
// Usage: cpu_adam_bench [--quick] [--json FILE] [--max-size N] [--size N] [--no-torch]
// (--size N: only that many parameters; --max-size N: the standard sizes up to N).
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "cpu_adam_bench_torch.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::bench {
namespace {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
Buffer<T> Allocate(size_t n) {
  const size_t bytes = std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) {
    std::fprintf(stderr, "cpu_adam_bench: out of memory allocating %zu bytes\n", bytes);
    std::exit(1);
  }
  return Buffer<T>(static_cast<T*>(p));
}

constexpr size_t kGrain = CpuAdam::kTileElems;  // the library's tiles

// Runs fn(begin, end) over [0, n) on `arena`, tiled exactly as CpuAdam tiles its work.
template <typename Fn>
void ParallelChunks(tbb::task_arena& arena, size_t n, const Fn& fn) {
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, n, kGrain),
        [&](const tbb::blocked_range<size_t>& r) { fn(r.begin(), r.end()); },
        tbb::simple_partitioner());
  });
}

// The bandwidth kernels, cloned for AVX-512, AVX2 and baseline and picked at load time
// (ifunc), so the roofline uses the same vector width as the kernel it bounds.
#define STRATA_BENCH_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
STRATA_BENCH_CLONES void CopyRange(float* __restrict dst, const float* __restrict src, size_t b,
                                   size_t e) {
  for (size_t i = b; i < e; ++i)
    dst[i] = src[i];
}
STRATA_BENCH_CLONES void TriadRange(float* __restrict a, const float* __restrict bb,
                                    const float* __restrict c, size_t b, size_t e) {
  for (size_t i = b; i < e; ++i)
    a[i] = bb[i] + 0.5f * c[i];
}
// The roofline kernels prefetch each stream they read 1 KiB ahead, as the library's
// kernels do (optim/cpu_adam/kernels.h: the hardware prefetchers restart at every 4 KiB
// page): without it the Adam kernel ran above this bound. Work comes in blocks of 16
// elements, one prefetch per stream and 64-byte line, the block's loop vectorized.
constexpr size_t kBlock = 16;
constexpr size_t kAhead = 1024 / sizeof(float);
// Prefetches element i + kAhead of each stream; always inlined, as the library's helpers
// are (GCC may otherwise drop the calls of a prefetch-only function as side-effect free).
template <typename... Streams>
[[gnu::always_inline]] inline void Ahead(size_t i, const Streams*... xs) {
  (__builtin_prefetch(
       reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(xs + i) + kAhead * sizeof(float))),
   ...);
}

// Reads p, g, m, v and writes p, m, v in place: the Adam step's 28 B, trivial arithmetic.
STRATA_BENCH_CLONES void RooflineRange(float* __restrict pp, float* __restrict mm,
                                       float* __restrict vv, const float* __restrict gg, size_t b,
                                       size_t e) {
  for (size_t blk = b; blk < e; blk += kBlock) {
    Ahead(blk, pp, mm, vv, gg);
    const size_t end = std::min(e, blk + kBlock);
    for (size_t i = blk; i < end; ++i) {
      const float x = gg[i];
      pp[i] = pp[i] * 0.999f + x;
      mm[i] = mm[i] * 0.9f + x;
      vv[i] = vv[i] * 0.999f + x * x;
    }
  }
}

// LAMB's traffic: pass 1 reads p, g, m, v and writes m, v; pass 2 reads p, m, v and
// writes p.
STRATA_BENCH_CLONES void LambRooflinePass1(const float* __restrict pp, float* __restrict mm,
                                           float* __restrict vv, const float* __restrict gg,
                                           size_t b, size_t e) {
  for (size_t blk = b; blk < e; blk += kBlock) {
    Ahead(blk, pp, mm, vv, gg);
    const size_t end = std::min(e, blk + kBlock);
    for (size_t i = blk; i < end; ++i) {
      const float x = gg[i] + pp[i];
      mm[i] = mm[i] * 0.9f + x;
      vv[i] = vv[i] * 0.999f + x * x;
    }
  }
}
STRATA_BENCH_CLONES void LambRooflinePass2(float* __restrict pp, const float* __restrict mm,
                                           const float* __restrict vv, size_t b, size_t e) {
  for (size_t blk = b; blk < e; blk += kBlock) {
    Ahead(blk, pp, mm, vv);
    const size_t end = std::min(e, blk + kBlock);
    for (size_t i = blk; i < end; ++i)
      pp[i] = pp[i] * 0.999f + mm[i] * vv[i];
  }
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One warm-up round, then as many rounds as fit in `budget_s` per kernel (between min
// and max); returns each function's median seconds.
std::vector<double> InterleavedMedians(const std::vector<std::function<void()>>& fns,
                                       double budget_s, int min_reps, int max_reps) {
  double slowest = 1e-6;
  for (const auto& fn : fns)
    slowest = std::max(slowest, Seconds(fn));
  const int reps = std::clamp(static_cast<int>(budget_s / slowest), min_reps, max_reps);
  std::vector<std::vector<double>> t(fns.size());
  for (int r = 0; r < reps; ++r) {
    for (size_t k = 0; k < fns.size(); ++k)
      t[k].push_back(Seconds(fns[k]));
  }
  std::vector<double> medians;
  for (auto& v : t)
    medians.push_back(Median(v));
  return medians;
}

struct Row {
  size_t size;
  int threads;
  std::string kernel;
  double bytes_per_param;
  double params_per_s;
  std::optional<double> roofline_fraction;
  std::optional<double> speedup_vs_libtorch;
};

std::string Opt(const std::optional<double>& v, bool as_speedup) {
  if (!v) return "-";
  char buf[64];
  if (as_speedup) {
    std::snprintf(buf, sizeof buf, "%.2fx", *v);
  } else {
    std::snprintf(buf, sizeof buf, "%.3f", *v);
  }
  return buf;
}

void PrintRow(const Row& r) {
  std::printf("%6zuM %3d  %-15s %6.0f %11.1f %9.2f  %9s %9s\n", r.size >> 20, r.threads,
              r.kernel.c_str(), r.bytes_per_param, r.params_per_s / 1e6,
              r.params_per_s * r.bytes_per_param / 1e9, Opt(r.roofline_fraction, false).c_str(),
              Opt(r.speedup_vs_libtorch, true).c_str());
  std::fflush(stdout);
}

std::string JsonNumber(const std::optional<double>& v) {
  if (!v) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", *v);
  return buf;
}

int Main(int argc, char** argv) {
  bool quick = false, use_torch = true;
  std::string json_path;
  size_t max_size = size_t{256} << 20;
  size_t only_size = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--no-torch") {
      use_torch = false;
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--size" && i + 1 < argc) {
      only_size = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--max-size" && i + 1 < argc) {
      max_size = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(
          stderr,
          "usage: cpu_adam_bench [--quick] [--json FILE] [--max-size N] [--size N] [--no-torch]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  use_torch = use_torch && HaveLibTorch();

  std::vector<size_t> sizes;
  for (size_t s :
       {size_t{1} << 20, size_t{4} << 20, size_t{16} << 20, size_t{64} << 20, size_t{256} << 20}) {
    if (s <= max_size && (!quick || s <= (size_t{4} << 20))) sizes.push_back(s);
  }
  if (only_size != 0) sizes = {only_size};
  const int all = tbb::info::default_concurrency();
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  const double budget = quick ? 0.08 : 0.6;
  const int min_reps = quick ? 2 : 3;

  auto probe = CpuAdam::Create();
  if (!probe.ok()) {
    std::fprintf(stderr, "cpu_adam_bench: %s\n", probe.status().ToString().c_str());
    return 1;
  }
  std::printf("cpu_adam_bench: ISA %s (best on this CPU: %s), %d cores for TBB, LibTorch %s\n",
              std::string(CpuIsaName((*probe)->isa())).c_str(),
              std::string(CpuIsaName(BestCpuIsa())).c_str(), all, use_torch ? "yes" : "no");
  std::printf("%7s %3s  %-15s %6s %11s %9s  %9s %9s\n", "size", "thr", "kernel", "B/par",
              "Mparams/s", "GB/s", "roofline", "vs torch");

  std::vector<Row> rows;
  for (size_t n : sizes) {
    Buffer<float> p = Allocate<float>(n), g = Allocate<float>(n), m = Allocate<float>(n),
                  v = Allocate<float>(n);
    Buffer<uint16_t> g16 = Allocate<uint16_t>(n), p16 = Allocate<uint16_t>(n);
    Buffer<float> scratch = Allocate<float>(n);  // copy/triad destination
    Buffer<float> acc = Allocate<float>(n);      // the zeroing rows' accumulators
    for (int threads : thread_counts) {
      tbb::task_arena arena(threads);
      ParallelChunks(arena, n, [&](size_t b, size_t e) {  // first touch by the workers
        for (size_t i = b; i < e; ++i) {
          const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
          p[i] = x;
          g[i] = x * 1e-2f;
          m[i] = x * 1e-3f;
          v[i] = x * x * 1e-4f;
          g16[i] = FloatToBFloat16(g[i] * 1024.0f);
          p16[i] = 0;
          scratch[i] = 0;
          acc[i] = g[i];
        }
      });
      auto report = [&](const char* kernel, double bytes, double secs) {
        rows.push_back(Row{n, threads, kernel, bytes, static_cast<double>(n) / secs, {}, {}});
        return &rows.back();
      };
      float* P = p.get();
      float* G = g.get();
      float* M = m.get();
      float* V = v.get();
      CpuAdam::Options opts;
      opts.num_threads = threads;
      auto adam_r = CpuAdam::Create(opts);
      if (!adam_r.ok()) {
        std::fprintf(stderr, "cpu_adam_bench: %s\n", adam_r.status().ToString().c_str());
        return 1;
      }
      const CpuAdam& adam = **adam_r;
      const AdamParams hp = AdamParams::AdamW(1e-3, 0.01);
      LambParams lamb;
      lamb.weight_decay = 0.01;
      int64_t step = 0;
      float* A = scratch.get();
      const AdamTensors fp32{{P, n}, {M, n}, {V, n}, GradSpan::Fp32({G, n}), {}};
      const AdamTensors accumulated{{P, n},
                                    {M, n},
                                    {V, n},
                                    GradSpan::Fp32({acc.get(), n}),
                                    Param16Span::Bf16({p16.get(), n})};
      const AdamTensors mixed{{P, n},
                              {M, n},
                              {V, n},
                              GradSpan::Bf16({g16.get(), n}),
                              Param16Span::Bf16({p16.get(), n})};
      auto check = [](const Status& s) {
        if (!s.ok()) {
          std::fprintf(stderr, "cpu_adam_bench: %s\n", s.ToString().c_str());
          std::exit(1);
        }
      };
      const std::vector<std::function<void()>> kernels = {
          // STREAM copy: a = p (8 counted bytes per element).
          [&] { ParallelChunks(arena, n, [&](size_t b, size_t e) { CopyRange(A, P, b, e); }); },
          // STREAM triad: a = p + 0.5 g (12 counted bytes per element).
          [&] { ParallelChunks(arena, n, [&](size_t b, size_t e) { TriadRange(A, P, G, b, e); }); },
          // Roofline: read p, g, m, v; write p, m, v in place (the Adam step's 28 B).
          [&] {
            ParallelChunks(arena, n, [&](size_t b, size_t e) { RooflineRange(P, M, V, G, b, e); });
          },
          // Strata fp32 AdamW step.
          [&] { check(adam.Step(hp, ++step, {}, fp32)); },
          // LAMB roofline: its two passes with trivial arithmetic (40 B).
          [&] {
            ParallelChunks(arena, n,
                           [&](size_t b, size_t e) { LambRooflinePass1(P, M, V, G, b, e); });
            ParallelChunks(arena, n, [&](size_t b, size_t e) { LambRooflinePass2(P, M, V, b, e); });
          },
          // Strata fp32 LAMB: moments and norms, then the update with the trust ratio.
          [&] {
            const int64_t s = ++step;
            auto norms = adam.LambMoments(lamb, s, {}, fp32);
            check(norms.status());
            check(adam.LambApply(lamb, s, LambTrustRatio(lamb, *norms), fp32));
          },
          // Strata mixed LAMB: norm/overflow pass, both passes with bf16 grads and copy-out.
          [&] {
            auto norm = adam.GradSquaredNorm(mixed.grad, 1.0f / 1024.0f);
            check(norm.status());
            if (norm->has_inf_nan) std::fprintf(stderr, "cpu_adam_bench: overflow\n"), std::exit(1);
            const float clip =
                static_cast<float>(std::min(1.0, 1.0 / (std::sqrt(norm->sum_sq) + 1e-6)));
            const int64_t s = ++step;
            auto norms = adam.LambMoments(lamb, s, {1.0f / 1024.0f, clip}, mixed);
            check(norms.status());
            check(adam.LambApply(lamb, s, LambTrustRatio(lamb, *norms), mixed));
          },
          // Strata mixed step: norm/overflow pass, then the fused unscale+clip+AdamW+bf16 out.
          [&] {
            auto norm = adam.GradSquaredNorm(mixed.grad, 1.0f / 1024.0f);
            check(norm.status());
            if (norm->has_inf_nan) std::fprintf(stderr, "cpu_adam_bench: overflow\n"), std::exit(1);
            const double gnorm = std::sqrt(norm->sum_sq);
            const float clip = static_cast<float>(std::min(1.0, 1.0 / (gnorm + 1e-6)));
            check(adam.Step(hp, ++step, {1.0f / 1024.0f, clip}, mixed));
          },
          // The engine's update, then its accumulators zeroed in a pass of their own. (After
          // the first run the gradient is 0: the same instructions, the same traffic.)
          [&] {
            check(adam.Step(hp, ++step, {}, accumulated));
            adam.ForEachTile(n, [&](size_t b, size_t e) {
              std::memset(acc.get() + b, 0, (e - b) * sizeof(float));
            });
          },
          // The same with the zeroing fused into the step's tiles.
          [&] {
            check(adam.Step(hp, ++step, {}, accumulated, {acc.get(), n}));
          },
          // The update without zeroing the accumulators (what an engine that never zeroes
          // them, writing the next backward's first gradient over them instead, would pay).
          [&] { check(adam.Step(hp, ++step, {}, accumulated)); },
      };
      // Interleaved rounds (copy, triad, roofline, fp32, lamb_roofline, lamb_fp32, lamb_mixed,
      // mixed, copy, ...): drifts of a shared machine hit every kernel alike; each kernel's time is
      // its median.
      const std::vector<double> t = InterleavedMedians(kernels, budget, min_reps, 40);
      const double t_copy = t[0], t_triad = t[1], t_roof = t[2], t_fp32 = t[3];
      const double t_lamb_roof = t[4], t_lamb_fp32 = t[5], t_lamb_mixed = t[6], t_mixed = t[7];
      const double t_zero_pass = t[8], t_zero_fused = t[9], t_nozero = t[10];
      const double N = static_cast<double>(n);
      const double roof_bw = 28.0 * N / t_roof;
      const double stream_bw = std::max(8.0 * N / t_copy, 12.0 * N / t_triad);
      const size_t copy_row = rows.size();
      report("copy", 8, t_copy)->roofline_fraction = 8.0 * N / t_copy / roof_bw;
      report("triad", 12, t_triad)->roofline_fraction = 12.0 * N / t_triad / roof_bw;
      report("roofline", 28, t_roof)->roofline_fraction = roof_bw / stream_bw;
      report("adam_fp32", 28, t_fp32)->roofline_fraction = 28.0 * N / t_fp32 / roof_bw;
      const size_t fp32_index = rows.size() - 1;
      report("adam_mixed", 30, t_mixed)->roofline_fraction = 30.0 * N / t_mixed / roof_bw;
      const size_t mixed_index = rows.size() - 1;
      report("adam_zero_pass", 34, t_zero_pass)->roofline_fraction =
          34.0 * N / t_zero_pass / roof_bw;
      report("adam_zero_fused", 34, t_zero_fused)->roofline_fraction =
          34.0 * N / t_zero_fused / roof_bw;
      report("adam_acc_nozero", 30, t_nozero)->roofline_fraction = 30.0 * N / t_nozero / roof_bw;
      const double lamb_bw = 40.0 * N / t_lamb_roof;
      report("lamb_roofline", 40, t_lamb_roof)->roofline_fraction = lamb_bw / roof_bw;
      report("lamb_fp32", 40, t_lamb_fp32)->roofline_fraction = 40.0 * N / t_lamb_fp32 / lamb_bw;
      report("lamb_mixed", 42, t_lamb_mixed)->roofline_fraction = 42.0 * N / t_lamb_mixed / lamb_bw;

      if (use_torch) {
        // LibTorch on the same fp32 data (its own m and v); few repetitions: it is slow.
        const std::vector<double> ts = TimeLibTorchAdam(P, G, n, threads, quick ? 2 : 3);
        const double t_torch = Median(ts);
        report("libtorch_adam", 28, t_torch);
        rows[fp32_index].speedup_vs_libtorch = t_torch / t_fp32;
        rows[mixed_index].speedup_vs_libtorch = t_torch / t_mixed;
      }
      for (size_t i = copy_row; i < rows.size(); ++i)
        PrintRow(rows[i]);
    }
  }
  std::printf(
      "roofline column: kernels' counted bytes/s over the roofline kernel's (28 B/param; the "
      "lamb rows over lamb_roofline's 40 B/param); on the roofline row, the roofline's "
      "bandwidth over the best of copy/triad; on the lamb_roofline row, its bandwidth over the "
      "roofline's.\n");

  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "[\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << "  {\"size\": " << r.size << ", \"threads\": " << r.threads << ", \"kernel\": \""
          << r.kernel << "\", \"params_per_s\": " << JsonNumber(r.params_per_s)
          << ", \"bytes_per_param\": " << JsonNumber(r.bytes_per_param)
          << ", \"roofline_fraction\": " << JsonNumber(r.roofline_fraction)
          << ", \"speedup_vs_libtorch\": " << JsonNumber(r.speedup_vs_libtorch) << "}"
          << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    out << "]\n";
    if (!out) {
      std::fprintf(stderr, "cpu_adam_bench: cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  return strata::bench::Main(argc, argv);
}
