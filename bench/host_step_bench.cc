// host_step_bench: the engine's optimizer step with its states in host memory,
// in each step mode (inside Step(), pipelined beside the next forward, early: begun during
// the backward), with the spent gradient accumulators zeroed at each step against left in
// place (lazy zeroing, OptimizerDriverOptions::lazy_zero; EngineOptions::test_lazy_zero),
// beside CPU-Adam's kernel alone on the same elements, measured in the same run.
//
// One rank, bf16 working dtype, --groups groups of one parameter each, synthetic bf16
// gradients (every element gets one each step), no compute: an iteration (forward,
// backward, Step()) is the host's work alone, so what the zeroing costs shows in it. Each
// round runs every mode with zeroing and lazily, interleaved, --steps steps after one
// warm-up step; the table gives medians over every round's steps:
//   - iter ms: forward + backward + Step() (the pipelined and early updates are waited for
//     by the next forward, so they are in it);
//   - update ms: the optimizer's pass (inside: CPU-Adam's kernel time in Step(); pipelined
//     and early: the update's wall time from its start to its worker's end, Step()'s norm
//     included, and for the early step the backward it began in);
//   - kernel ms: the limit of the update, CPU-Adam's kernel alone over the same elements, a
//     call per group, measured before the rounds (30 bytes a parameter: p, m, v read and written,
//     the fp32 gradient read, the bf16 copy out; zeroing the gradient in its tiles writes 4
//     more).
//
// Usage: host_step_bench [--params 32M] [--groups 16] [--steps 5] [--rounds 3]
//                        [--threads 2] [--modes inside,pipelined,early]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/bytes.h"
#include "strata/core/check.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/optim/cpu_adam/cpu_adam.h"

namespace strata::bench {
namespace {

enum class Mode { kInside, kPipelined, kEarly };

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kInside:
      return "inside";
    case Mode::kPipelined:
      return "pipelined";
    case Mode::kEarly:
      return "early";
  }
  return "?";
}

struct Args {
  uint64_t params = uint64_t{32} << 20;
  int groups = 16;
  int steps = 5;
  int rounds = 3;
  int threads = 2;
  std::vector<Mode> modes = {Mode::kInside, Mode::kPipelined, Mode::kEarly};
};

struct Run {
  std::vector<double> iter_s, update_s;
  uint64_t zeroed_lazily = 0;
  uint64_t stale_zeroed = 0;
};

Result<Run> RunEngine(const Args& a, Mode mode, bool lazy) {
  Config c;
  c.bf16 = true;
  c.optimizer.lr = 1e-3;
  c.zero.stage3_param_persistence_threshold = 0;
  const size_t per = a.params / static_cast<size_t>(a.groups);
  c.zero.sub_group_size = static_cast<int64_t>(per);
  c.zero.reduce_bucket_size = static_cast<int64_t>(per);  // a bucket per group
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.pipeline_step = mode != Mode::kInside;
  c.strata.early_step = mode == Mode::kEarly;
  if (mode == Mode::kEarly) c.strata.skip_inf_nan_steps = false;
  comm::Rendezvous rv;
  rv.store = comm::InProcessStore();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> cm,
                          comm::CreateCommunicator(comm::Backend::kGloo, rv, {}));
  std::vector<engine::GroupDesc> groups;
  for (int g = 0; g < a.groups; ++g)
    groups.push_back({"m" + std::to_string(g), {{"w", per, nullptr}}});
  engine::EngineOptions o;
  o.cpu_adam.num_threads = a.threads;
  o.device_allocator = std::make_shared<engine::HostArenaAllocator>(0);
  o.broadcast_initial_values = false;
  o.test.driver.lazy_zero = lazy;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::EngineCore> e,
                          engine::EngineCore::Create(c, std::move(cm), groups, o));
  std::vector<uint16_t> grad(per);
  Run run;
  for (int step = 0; step <= a.steps; ++step) {
    for (size_t i = 0; i < per; ++i)
      grad[i] = static_cast<uint16_t>(0x3c00 + ((i * 7 + static_cast<size_t>(step)) % 97));
    const double update0 = e->stats().optimizer.pipelined_update_s;
    const auto t0 = Clock::now();
    for (int g = 0; g < a.groups; ++g) {
      STRATA_RETURN_IF_ERROR(e->PreForward(g));
      STRATA_RETURN_IF_ERROR(e->PostForward(g));
    }
    for (int g = a.groups - 1; g >= 0; --g) {
      STRATA_RETURN_IF_ERROR(e->PreBackward(g));
      STRATA_RETURN_IF_ERROR(e->AddGradient(g, 0, grad.data(), engine::DType::kBFloat16));
      STRATA_RETURN_IF_ERROR(e->PostBackward(g));
    }
    STRATA_RETURN_IF_ERROR(e->EndBackward());
    const double adam0 = e->stats().optimizer.adam_s;
    STRATA_RETURN_IF_ERROR(e->Step().status());
    const double iter = Seconds(t0, Clock::now());
    const engine::OptimizerStats after = e->stats().optimizer;
    if (step == 0) continue;  // warm-up
    run.iter_s.push_back(iter);
    // Pipelined and early: the update completed in this iteration is the last step's.
    run.update_s.push_back(mode == Mode::kInside ? after.adam_s - adam0
                                                 : after.pipelined_update_s - update0);
  }
  (void)e->optimizer();  // completes the last pipelined update
  const engine::EngineStats s = e->stats();
  run.zeroed_lazily = s.optimizer.acc_chunks_zeroed_lazily;
  run.stale_zeroed = s.optimizer.acc_stale_elements_zeroed;
  return run;
}

// The limit of the engine's update: CPU-Adam's kernel alone over the same elements, a call
// per group of `per` (fp32 gradient, bf16 copy-out), zeroing the gradient in its tiles or
// not, `reps` times each, interleaved; medians in seconds.
struct Kernel {
  double zeroed_s = 0, lazy_s = 0;
  std::string isa;
};

Result<Kernel> KernelAlone(size_t n, size_t per, int threads, int reps) {
  CpuAdam::Options o;
  o.num_threads = threads;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CpuAdam> adam, CpuAdam::Create(o));
  std::vector<float> p(n, 0.5f), m(n, 0.0f), v(n, 0.0f), g(n);
  std::vector<uint16_t> out(n);
  AdamParams params;
  std::vector<double> zeroed, lazy;
  for (int k = 0; k < reps; ++k) {
    for (int zero = 0; zero < 2; ++zero) {
      std::fill(g.begin(), g.end(), 0.01f * static_cast<float>(k + 1));
      const auto t0 = Clock::now();
      for (size_t b = 0; b < n; b += per) {
        const size_t c = std::min(per, n - b);
        const AdamTensors t{std::span<float>(p).subspan(b, c), std::span<float>(m).subspan(b, c),
                            std::span<float>(v).subspan(b, c),
                            GradSpan::Fp32(std::span<const float>(g).subspan(b, c)),
                            Param16Span::Bf16(std::span<uint16_t>(out).subspan(b, c))};
        const std::span<float> zero_grad =
            zero != 0 ? std::span<float>(g).subspan(b, c) : std::span<float>{};
        STRATA_RETURN_IF_ERROR(adam->Step(params, 2 * k + zero + 1, {}, t, zero_grad));
      }
      (zero != 0 ? zeroed : lazy).push_back(Seconds(t0, Clock::now()));
    }
  }
  if (g[n - 1] != 0.0f) return InternalError("the kernel did not zero the gradient");
  return Kernel{Median(zeroed), Median(lazy), std::string(CpuIsaName(adam->isa()))};
}

int Usage(const char* what) {
  std::fprintf(stderr,
               "host_step_bench: %s\nusage: host_step_bench [--params 32M] [--groups 16] "
               "[--steps 5] [--rounds 3] [--threads 2] [--modes inside,pipelined,early]\n",
               what);
  return 2;
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--params" && has) {
      const Result<uint64_t> v = ParseBytes(argv[++i]);  // 32M = 32 Mi parameters
      if (!v.ok()) return Usage(("--params takes a count (32M): " + v.status().ToString()).c_str());
      a.params = *v;
    } else if ((k == "--groups" || k == "--steps" || k == "--rounds" || k == "--threads") && has) {
      const int v = std::atoi(argv[++i]);
      if (v < 1) return Usage((k + " takes a positive integer").c_str());
      (k == "--groups"   ? a.groups
       : k == "--steps"  ? a.steps
       : k == "--rounds" ? a.rounds
                         : a.threads) = v;
    } else if (k == "--modes" && has) {
      a.modes.clear();
      const std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        const std::string m = list.substr(p, q - p);
        if (m == "inside") {
          a.modes.push_back(Mode::kInside);
        } else if (m == "pipelined") {
          a.modes.push_back(Mode::kPipelined);
        } else if (m == "early") {
          a.modes.push_back(Mode::kEarly);
        } else {
          return Usage(("--modes: '" + m + "' is not inside, pipelined or early").c_str());
        }
        p = q + 1;
      }
    } else {
      return Usage(("unknown or incomplete argument '" + k + "'").c_str());
    }
  }
  const size_t per = a.params / static_cast<size_t>(a.groups);
  if (per == 0) return Usage("--params must be at least --groups");
  const size_t n = per * static_cast<size_t>(a.groups);
  const Result<Kernel> kernel = KernelAlone(n, per, a.threads, 2 * a.steps + 1);
  if (!kernel.ok()) {
    std::fprintf(stderr, "host_step_bench: %s\n", kernel.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "host_step_bench: %zu parameters in %d groups, bf16, states in host memory, %d CPU-Adam "
      "threads (%s), %d rounds of %d steps\n",
      n, a.groups, a.threads, kernel->isa.c_str(), a.rounds, a.steps);
  struct Cell {
    std::vector<double> iter_s, update_s;
    uint64_t zeroed_lazily = 0, stale_zeroed = 0;
  };
  std::vector<Cell> cells(a.modes.size() * 2);
  for (int round = 0; round < a.rounds; ++round) {
    for (size_t m = 0; m < a.modes.size(); ++m) {
      for (int lazy = 0; lazy < 2; ++lazy) {
        // Alternate which goes first.
        const bool l = (round % 2 == 0) == (lazy == 0);
        Result<Run> r = RunEngine(a, a.modes[m], l);
        if (!r.ok()) {
          std::fprintf(stderr, "host_step_bench: %s\n", r.status().ToString().c_str());
          return 1;
        }
        Cell& c = cells[2 * m + (l ? 1 : 0)];
        c.iter_s.insert(c.iter_s.end(), r->iter_s.begin(), r->iter_s.end());
        c.update_s.insert(c.update_s.end(), r->update_s.begin(), r->update_s.end());
        c.zeroed_lazily += r->zeroed_lazily;
        c.stale_zeroed += r->stale_zeroed;
      }
    }
  }
  std::printf("%-10s %-8s %-9s %-10s %-10s %-12s %s\n", "mode", "zeroing", "iter ms", "update ms",
              "kernel ms", "chunks left", "stale zeroed");
  for (size_t m = 0; m < a.modes.size(); ++m) {
    for (int l = 0; l < 2; ++l) {
      const Cell& c = cells[2 * m + static_cast<size_t>(l)];
      std::printf("%-10s %-8s %-9.2f %-10.2f %-10.2f %-12llu %llu\n", ModeName(a.modes[m]),
                  l != 0 ? "lazy" : "zeroed", 1e3 * Median(c.iter_s), 1e3 * Median(c.update_s),
                  1e3 * (l != 0 ? kernel->lazy_s : kernel->zeroed_s),
                  static_cast<unsigned long long>(c.zeroed_lazily),
                  static_cast<unsigned long long>(c.stale_zeroed));
    }
    const Cell& z = cells[2 * m];
    const Cell& y = cells[2 * m + 1];
    std::printf("%-10s zeroed / lazy: iter %.3f, update %.3f\n", ModeName(a.modes[m]),
                Median(z.iter_s) / Median(y.iter_s), Median(z.update_s) / Median(y.update_s));
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  return strata::bench::Main(argc, argv);
}
