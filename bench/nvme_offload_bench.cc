// nvme_offload_bench: the optimizer step with its states on NVMe
// (offload_optimizer.device = nvme) against the size of the states at a fixed host budget,
// beside the two limits measured in the same run:
//   - I/O time: the step's reads and writes (master, m, v and the gradient accumulators
//     read, master, m and v written, chunk by chunk) through a SwapSpace on the same
//     directory with the same pipeline (reads one sub-group ahead, writes behind) and no
//     compute;
//   - Adam time: the same step with the states in host memory (offload_optimizer = cpu).
// It reports the NVMe step time, both limits, the ratio step / max(I/O, Adam) (the goal is
// at most 1.15) and the exposed I/O (step time minus the time in the CPU-Adam kernels).
// One rank, bf16 working dtype, synthetic gradients. The working shards live on a
// count-only device (a host arena), so strata.host_budget is what the state store's
// buffers get. Medians over --steps steps after one warm-up step.
//
// --params: the working shards on NVMe too (offload_param.device = nvme,
// --param-buffers buffers), against the same run with them in host memory, both with the
// optimizer states on NVMe and the real shard staging of the CPU device. Each group's
// forward and backward "computes" for --compute-ms (a busy wait standing in for the
// module), so the table shows how much of the shards' NVMe reads the trace-driven
// read-ahead hides: forward+backward time of both runs, the read wait left exposed in the
// forward and in the backward, the shards read on demand, and the compute floor.
// (Every mode but --pipeline steps inside Step(): strata.pipeline_step off.)
//
// --params --pipeline: the working shards and states on NVMe with the step
// inside Step() and with the pipelined step (the update beside the next forward, new
// shards through staging buffers), --rounds interleaved rounds: the whole iteration's time
// (forward, backward, Step()) of each, against the compute floor and the update's own time,
// and the pipelined run's exposed step wait, hand-overs and the worker's block-CRC time.
//
// Usage: nvme_offload_bench --dir DIR [--budget 256MiB] [--ratios 4,8] [--sub-group 4M]
//                           [--buffers 12] [--steps 5] [--threads 2] [--allow-tmpfs]
//                           [--no-checksums] [--unregistered]
//                           [--params [--param-buffers 5] [--compute-ms 5]
//                            [--read-bandwidth 2.8GB/s] [--max-in-cpu 0]
//                            [--pipeline [--rounds 3]]]
// --no-checksums: strata.swap_checksums false in every run (and the I/O-only pipeline).
// --unregistered: the engine runs' swap I/O without registered (fixed) buffers, for the
// comparison (the stores register their buffers with io_uring); the table's last column
// counts the transfers that used one.
#include <linux/magic.h>
#include <sys/vfs.h>

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
#include "strata/offload/cpu/host_pool.h"
#include "strata/swap/swap_space.h"

namespace strata::bench {
namespace {

struct Args {
  std::string dir;
  uint64_t budget = uint64_t{256} << 20;
  std::vector<double> ratios = {4, 8};
  uint64_t sub_group = uint64_t{4} << 20;  // elements
  int buffers = 12;
  int steps = 5;
  int threads = 2;
  bool allow_tmpfs = false;
  bool params = false;
  int param_buffers = 5;
  double compute_ms = 5.0;
  double read_bandwidth = 0.0;  // strata.nvme_read_bandwidth (0: unknown)
  uint64_t max_in_cpu = 0;      // offload_param.max_in_cpu (0: every shard on NVMe)
  bool checksums = true;        // strata.swap_checksums
  bool registered = true;       // the stores' buffers registered with io_uring
  bool pipeline = false;        // --params: the step inside Step() against the pipelined one
  int rounds = 3;
};

constexpr size_t kGroups = 16;

// The NVMe and the host runs: per-step times of Step() and of the kernels in it.
struct EngineRun {
  std::vector<double> step_s, adam_s;
  // --params: per step, forward+backward seconds and the shard read wait of each pass.
  std::vector<double> passes_s, read_wait_fwd_s, read_wait_bwd_s;
  // Per step: the whole iteration (forward, backward, Step()); the pipelined update's
  // time beside the forward, the forward's step wait and the hand-over copies.
  std::vector<double> iter_s, update_s, step_wait_s, handover_s;
  // Per step: the seconds the (completed) update's worker spent on the new shards' block
  // CRCs, which the hand-over then need not compute on the engine's thread.
  std::vector<double> checksum_s;
  engine::EngineStats stats;
};

void BusyWait(double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
  }
}

// `nvme`: the optimizer states on NVMe; `params`: the working shards too (--params mode:
// the optimizer is on NVMe either way, the shards in host memory or on NVMe); `pipeline`:
// strata.pipeline_step (the bench's tables measure the step inside Step() otherwise).
Result<EngineRun> RunEngine(const Args& a, size_t numel, bool nvme, bool params = false,
                            bool pipeline = false) {
  Config c;
  c.strata.pipeline_step = pipeline;
  c.bf16 = true;
  c.optimizer.lr = 1e-3;
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.sub_group_size = static_cast<int64_t>(a.sub_group);
  c.zero.reduce_bucket_size = static_cast<int64_t>(numel / kGroups);
  c.zero.offload_optimizer.device = nvme ? OffloadDevice::kNvme : OffloadDevice::kCpu;
  if (nvme) {
    c.zero.offload_optimizer.nvme_path = {a.dir};
    c.zero.offload_optimizer.buffer_count = a.buffers;
    c.zero.offload_optimizer.pipeline_read = true;
    c.zero.offload_optimizer.pipeline_write = true;
    c.strata.swap_checksums = a.checksums;
    if (!a.params || params) c.strata.host_budget = a.budget;
    // --pipeline: both runs get room for the pipelined step's two staging buffers of a
    // group's bf16 shard (rounded up to 4 KiB, as the shards' store buffers are).
    if (a.pipeline && params) c.strata.host_budget += 2 * AlignUp((numel / kGroups) * 2, 4096);
  }
  if (a.params) {
    c.zero.offload_param.device = params ? OffloadDevice::kNvme : OffloadDevice::kCpu;
    c.zero.offload_param.nvme_path = {a.dir};
    c.zero.offload_param.buffer_count = a.param_buffers;
    c.zero.offload_param.buffer_size = static_cast<int64_t>(numel);
    c.zero.offload_param.max_in_cpu = static_cast<int64_t>(a.max_in_cpu);
    c.zero.stage3_prefetch_bucket_size = static_cast<int64_t>(numel / kGroups);  // one ahead
    c.strata.nvme_read_bandwidth = a.read_bandwidth;
  }
  comm::Rendezvous rv;
  rv.store = comm::InProcessStore();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> cm,
                          comm::CreateCommunicator(comm::Backend::kGloo, rv, {}));
  std::vector<engine::GroupDesc> groups;
  const size_t per = numel / kGroups;
  for (size_t g = 0; g < kGroups; ++g) {
    groups.push_back({"m" + std::to_string(g), {{"w", per, nullptr}}});
  }
  engine::EngineOptions o;
  o.cpu_adam.num_threads = a.threads;
  if (!a.registered) {
    o.test.nvme_io_engine_factory = [](const swap::IoEngineOptions& io) {
      swap::IoEngineOptions plain = io;
      plain.fixed_buffers = false;
      return swap::CreateIoEngine(plain);
    };
  }
  // --params: the CPU device, so shards are staged as on a GPU.
  if (!a.params) o.device_allocator = std::make_shared<engine::HostArenaAllocator>(0);
  o.broadcast_initial_values = false;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<engine::EngineCore> e,
                          engine::EngineCore::Create(c, std::move(cm), groups, o));
  std::vector<uint16_t> grad(per);
  EngineRun run;
  for (int step = 0; step <= a.steps; ++step) {
    for (size_t i = 0; i < per; ++i)
      grad[i] = static_cast<uint16_t>(0x3c00 + ((i * 7 + static_cast<size_t>(step)) % 97));
    const double compute_s = a.params ? a.compute_ms / 1000.0 : 0.0;
    const double wait0 = e->stats().coordinator.shard_read_wait_s;
    const engine::OptimizerStats at0 = e->stats().optimizer;
    const auto t0 = Clock::now();
    for (int g = 0; g < static_cast<int>(kGroups); ++g) {
      STRATA_RETURN_IF_ERROR(e->PreForward(g));
      BusyWait(compute_s);
      STRATA_RETURN_IF_ERROR(e->PostForward(g));
    }
    const double wait1 = e->stats().coordinator.shard_read_wait_s;
    for (int g = static_cast<int>(kGroups) - 1; g >= 0; --g) {
      STRATA_RETURN_IF_ERROR(e->PreBackward(g));
      BusyWait(compute_s);
      STRATA_RETURN_IF_ERROR(e->AddGradient(g, 0, grad.data(), engine::DType::kBFloat16));
      STRATA_RETURN_IF_ERROR(e->PostBackward(g));
    }
    STRATA_RETURN_IF_ERROR(e->EndBackward());
    const double passes = Seconds(t0, Clock::now());
    const double wait2 = e->stats().coordinator.shard_read_wait_s;
    const engine::OptimizerStats before = e->stats().optimizer;
    STRATA_RETURN_IF_ERROR(e->Step().status());
    const engine::OptimizerStats after = e->stats().optimizer;
    const double iter = Seconds(t0, Clock::now());
    if (step == 0) continue;  // warm-up
    run.iter_s.push_back(iter);
    // (The pipelined update the Step() before started completes in this iteration.)
    run.update_s.push_back(after.pipelined_update_s - at0.pipelined_update_s);
    run.step_wait_s.push_back(after.pipelined_wait_s - at0.pipelined_wait_s);
    run.handover_s.push_back(after.shard_handover_s - at0.shard_handover_s);
    run.checksum_s.push_back(after.shard_checksum_s - at0.shard_checksum_s);
    run.step_s.push_back(after.step_s - before.step_s);
    run.adam_s.push_back(after.adam_s - before.adam_s);
    run.passes_s.push_back(passes);
    run.read_wait_fwd_s.push_back(wait1 - wait0);
    run.read_wait_bwd_s.push_back(wait2 - wait1);
  }
  run.stats = e->stats();
  return run;
}

// The step's I/O without compute: chunks of the four states in one slot each, read one
// sub-group ahead (master, m, v, accumulator) and written behind (master, m, v).
Result<std::vector<double>> RunIo(const Args& a, size_t numel) {
  swap::SwapSpaceOptions so;
  so.directories = {a.dir};
  so.checksums = a.checksums;  // as the engine's runs
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::SwapSpace> space, swap::SwapSpace::Create(so));
  HostPoolOptions po;
  po.pin = false;
  po.name = "nvme_offload_bench I/O";
  STRATA_ASSIGN_OR_RETURN(HostPool pool, HostPool::Create(po));
  const size_t chunk = std::min<size_t>(a.sub_group, numel);
  const size_t chunks = (numel + chunk - 1) / chunk;
  std::vector<swap::SwapHandle> h(4 * chunks);
  for (size_t i = 0; i < chunks; ++i) {
    const size_t bytes = (std::min(numel, (i + 1) * chunk) - i * chunk) * sizeof(float);
    for (size_t s = 0; s < 4; ++s) {
      STRATA_ASSIGN_OR_RETURN(h[4 * i + s], space->Allocate(bytes));
    }
  }
  // Two sub-groups' buffers (reading i+1 while writing i).
  std::vector<HostBuffer> buf;
  for (int k = 0; k < 8; ++k) {
    STRATA_ASSIGN_OR_RETURN(HostBuffer b, pool.Allocate(chunk * sizeof(float)));
    // As the engine's stores do (unless --unregistered); the space unregisters at its end.
    if (a.registered) STRATA_RETURN_IF_ERROR(space->RegisterBuffer(b.span()).status());
    buf.push_back(std::move(b));
  }
  auto span = [&](size_t i, size_t s) {
    const size_t bytes = (std::min(numel, (i + 1) * chunk) - i * chunk) * sizeof(float);
    return buf[4 * (i % 2) + s].span().subspan(0, bytes);
  };
  for (size_t i = 0; i < chunks; ++i) {
    for (size_t s = 0; s < 4; ++s)
      STRATA_RETURN_IF_ERROR(space->Write(h[4 * i + s], span(i, s)));
  }
  std::vector<double> times;
  for (int step = 0; step <= a.steps; ++step) {
    const auto t0 = Clock::now();
    std::vector<swap::SwapFuture> reads, writes;
    for (size_t s = 0; s < 4; ++s) {
      STRATA_ASSIGN_OR_RETURN(swap::SwapFuture f, space->ReadAsync(h[s], span(0, s)));
      reads.push_back(std::move(f));
    }
    for (size_t i = 0; i < chunks; ++i) {
      for (auto& f : reads)
        STRATA_RETURN_IF_ERROR(f.Wait());
      reads.clear();
      // The buffers of i+1 were written from by sub-group i-1: those writes end first.
      for (auto& f : writes)
        STRATA_RETURN_IF_ERROR(f.Wait());
      writes.clear();
      if (i + 1 < chunks) {
        for (size_t s = 0; s < 4; ++s) {
          STRATA_ASSIGN_OR_RETURN(swap::SwapFuture f,
                                  space->ReadAsync(h[4 * (i + 1) + s], span(i + 1, s)));
          reads.push_back(std::move(f));
        }
      }
      for (size_t s = 0; s < 3; ++s) {
        STRATA_ASSIGN_OR_RETURN(swap::SwapFuture f, space->WriteAsync(h[4 * i + s], span(i, s)));
        writes.push_back(std::move(f));
      }
    }
    for (auto& f : writes)
      STRATA_RETURN_IF_ERROR(f.Wait());
    if (step > 0) times.push_back(Seconds(t0, Clock::now()));
  }
  return times;
}

int MainParams(const Args& a) {
  std::printf(
      "parameters on NVMe: %zu groups, offload_param.buffer_count %d, max_in_cpu %llu, %.1f ms "
      "of compute per group and pass, strata.nvme_read_bandwidth %s; against the shards in host "
      "memory\n",
      kGroups, a.param_buffers, static_cast<unsigned long long>(a.max_in_cpu), a.compute_ms,
      a.read_bandwidth > 0 ? (FormatBytes(static_cast<uint64_t>(a.read_bandwidth)) + "/s").c_str()
                           : "unknown");
  std::printf("%-10s %-9s %-9s %-9s %-10s %-10s %-9s %-9s %-9s %s\n", "shards", "compute",
              "fwd+bwd", "fwd+bwd", "read wait", "read wait", "step s", "step s", "on", "read");
  std::printf("%-10s %-9s %-9s %-9s %-10s %-10s %-9s %-9s %-9s %s\n", "", "floor s", "host s",
              "nvme s", "fwd s", "bwd s", "host", "nvme", "demand", "per step");
  for (double ratio : a.ratios) {
    size_t numel = static_cast<size_t>(ratio * static_cast<double>(a.budget) / 16.0);
    numel = numel / (kGroups * 1024) * (kGroups * 1024);
    Result<EngineRun> host = RunEngine(a, numel, true, false);
    Result<EngineRun> nvme = RunEngine(a, numel, true, true);
    for (const Status& s : {host.status(), nvme.status()}) {
      if (!s.ok()) {
        std::fprintf(stderr, "nvme_offload_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    const engine::EngineStats& st = nvme->stats;
    const double floor = 2.0 * kGroups * a.compute_ms / 1000.0;
    const uint64_t steps = static_cast<uint64_t>(a.steps) + 1;
    std::printf("%-10s %-9.3f %-9.3f %-9.3f %-10.4f %-10.4f %-9.3f %-9.3f %-9llu %s\n",
                FormatBytes(st.working_shard_bytes).c_str(), floor, Median(host->passes_s),
                Median(nvme->passes_s), Median(nvme->read_wait_fwd_s),
                Median(nvme->read_wait_bwd_s), Median(host->step_s), Median(nvme->step_s),
                static_cast<unsigned long long>(st.coordinator.shard_reads_on_demand),
                FormatBytes(st.param_store.read_bytes / steps).c_str());
  }
  return 0;
}

// --params --pipeline: the step inside Step() against the pipelined step, both with the
// working shards and states on NVMe, in interleaved rounds.
int MainPipeline(const Args& a) {
  std::printf(
      "the pipelined step with parameters on NVMe: %zu groups, offload_param.buffer_count %d, "
      "%.1f ms of compute per group and pass, %d interleaved rounds (medians of every round's "
      "steps); iteration = forward + backward + Step(); both runs' host budget has room for the "
      "pipelined step's two staging buffers of a group's shard\n",
      kGroups, a.param_buffers, a.compute_ms, a.rounds);
  std::printf("%-10s %-9s %-9s %-9s %-9s %-9s %-10s %-10s %-10s %s\n", "shards", "compute",
              "iter s", "iter s", "step s", "update s", "step wait", "hand-over", "crc s",
              "on/off");
  std::printf("%-10s %-9s %-9s %-9s %-9s %-9s %-10s %-10s %-10s %s\n", "", "floor s", "inside",
              "piped", "inside", "piped", "piped s", "piped s", "worker", "");
  for (double ratio : a.ratios) {
    size_t numel = static_cast<size_t>(ratio * static_cast<double>(a.budget) / 16.0);
    numel = numel / (kGroups * 1024) * (kGroups * 1024);
    std::vector<double> off_iter, on_iter, off_step, on_update, on_wait, on_handover, on_crc;
    uint64_t shard_bytes = 0;
    for (int round = 0; round < a.rounds; ++round) {
      Result<EngineRun> off = RunEngine(a, numel, true, true, /*pipeline=*/false);
      Result<EngineRun> on = RunEngine(a, numel, true, true, /*pipeline=*/true);
      for (const Status& s : {off.status(), on.status()}) {
        if (!s.ok()) {
          std::fprintf(stderr, "nvme_offload_bench: %s\n", s.ToString().c_str());
          return 1;
        }
      }
      if (on->stats.optimizer.steps_pipelined == 0 || on->stats.optimizer.shard_handovers == 0) {
        std::fprintf(stderr, "nvme_offload_bench: the pipelined run did not pipeline\n");
        return 1;
      }
      shard_bytes = on->stats.working_shard_bytes;
      off_iter.insert(off_iter.end(), off->iter_s.begin(), off->iter_s.end());
      on_iter.insert(on_iter.end(), on->iter_s.begin(), on->iter_s.end());
      off_step.insert(off_step.end(), off->step_s.begin(), off->step_s.end());
      // The first measured iteration completes the warm-up step's update: from the second.
      if (on->update_s.size() > 1) {
        on_update.insert(on_update.end(), on->update_s.begin() + 1, on->update_s.end());
        on_crc.insert(on_crc.end(), on->checksum_s.begin() + 1, on->checksum_s.end());
      }
      on_wait.insert(on_wait.end(), on->step_wait_s.begin(), on->step_wait_s.end());
      on_handover.insert(on_handover.end(), on->handover_s.begin(), on->handover_s.end());
    }
    const double floor = 2.0 * kGroups * a.compute_ms / 1000.0;
    std::printf("%-10s %-9.3f %-9.3f %-9.3f %-9.3f %-9.3f %-10.4f %-10.4f %-10.4f %.2f\n",
                FormatBytes(shard_bytes).c_str(), floor, Median(off_iter), Median(on_iter),
                Median(off_step), Median(on_update), Median(on_wait), Median(on_handover),
                Median(on_crc), Median(on_iter) / Median(off_iter));
  }
  return 0;
}

bool ParseSize(const std::string& s, uint64_t* out) {
  Result<uint64_t> r = ParseBytes(s);
  if (!r.ok()) return false;
  *out = *r;
  return true;
}

int Main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--dir" && has) {
      a.dir = argv[++i];
    } else if (k == "--budget" && has) {
      if (!ParseSize(argv[++i], &a.budget)) {
        std::fprintf(stderr, "nvme_offload_bench: --budget takes a size (256MiB), got '%s'\n",
                     argv[i]);
        return 2;
      }
    } else if (k == "--ratios" && has) {
      a.ratios.clear();
      std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        const double r = std::atof(list.substr(p, q - p).c_str());
        if (r <= 0) {
          std::fprintf(stderr, "nvme_offload_bench: --ratios takes positive numbers: '%s'\n",
                       list.c_str());
          return 2;
        }
        a.ratios.push_back(r);
        p = q + 1;
      }
    } else if (k == "--sub-group" && has) {
      if (!ParseSize(argv[++i], &a.sub_group) || a.sub_group == 0) {
        std::fprintf(stderr, "nvme_offload_bench: --sub-group takes an element count (4M)\n");
        return 2;
      }
    } else if ((k == "--buffers" || k == "--steps" || k == "--threads") && has) {
      const int v = std::atoi(argv[++i]);
      if (v < 1) {
        std::fprintf(stderr, "nvme_offload_bench: %s takes a positive integer\n", k.c_str());
        return 2;
      }
      (k == "--buffers" ? a.buffers : k == "--steps" ? a.steps : a.threads) = v;
    } else if (k == "--allow-tmpfs") {
      a.allow_tmpfs = true;
    } else if (k == "--params") {
      a.params = true;
    } else if (k == "--param-buffers" && has) {
      a.param_buffers = std::atoi(argv[++i]);
      if (a.param_buffers < 2) {
        std::fprintf(stderr, "nvme_offload_bench: --param-buffers takes an integer >= 2\n");
        return 2;
      }
    } else if (k == "--compute-ms" && has) {
      a.compute_ms = std::atof(argv[++i]);
      if (!(a.compute_ms >= 0)) {
        std::fprintf(stderr, "nvme_offload_bench: --compute-ms takes a number >= 0\n");
        return 2;
      }
    } else if (k == "--pipeline") {
      a.pipeline = true;
    } else if (k == "--rounds" && has) {
      a.rounds = std::atoi(argv[++i]);
      if (a.rounds < 1) {
        std::fprintf(stderr, "nvme_offload_bench: --rounds takes an integer >= 1\n");
        return 2;
      }
    } else if (k == "--no-checksums") {
      a.checksums = false;
    } else if (k == "--unregistered") {
      a.registered = false;
    } else if (k == "--max-in-cpu" && has) {
      if (!ParseSize(argv[++i], &a.max_in_cpu)) {
        std::fprintf(stderr, "nvme_offload_bench: --max-in-cpu takes an element count (8M)\n");
        return 2;
      }
    } else if (k == "--read-bandwidth" && has) {
      uint64_t bw = 0;
      const std::string v = argv[++i];
      const std::string unit = v.size() > 2 ? v.substr(v.size() - 2) : "";
      if (!ParseSize(unit == "/s" ? v.substr(0, v.size() - 2) : v, &bw) || bw == 0) {
        std::fprintf(stderr, "nvme_offload_bench: --read-bandwidth takes bytes/s (2.8GB/s)\n");
        return 2;
      }
      a.read_bandwidth = static_cast<double>(bw);
    } else {
      std::fprintf(stderr,
                   "usage: nvme_offload_bench --dir DIR [--budget 256MiB] [--ratios 4,8] "
                   "[--sub-group 4M] [--buffers 12] [--steps 5] [--threads 2] [--allow-tmpfs] "
                   "[--no-checksums] [--unregistered] [--params [--param-buffers 5] "
                   "[--compute-ms 5] "
                   "[--read-bandwidth 2.8GB/s] [--max-in-cpu 0] [--pipeline [--rounds 3]]]\n");
      return k == "--help" || k == "-h" ? 0 : 2;
    }
  }
  if (a.dir.empty()) {
    std::fprintf(stderr,
                 "nvme_offload_bench: --dir DIR is required (a directory on the drive "
                 "nvme_bench measured)\n");
    return 2;
  }
  struct statfs fs;
  if (statfs(a.dir.c_str(), &fs) != 0) {
    std::fprintf(stderr, "nvme_offload_bench: %s: %s\n", a.dir.c_str(), std::strerror(errno));
    return 2;
  }
  if (fs.f_type == TMPFS_MAGIC && !a.allow_tmpfs) {
    std::fprintf(stderr,
                 "nvme_offload_bench: %s is tmpfs (memory, not a drive); pass a "
                 "directory on the swap drive, or --allow-tmpfs to measure it anyway\n",
                 a.dir.c_str());
    return 2;
  }
  std::printf(
      "nvme_offload_bench: dir %s, host budget %s, sub_group_size %llu, buffer_count "
      "%d, %d CPU-Adam threads, bf16, %d steps (medians)\n",
      a.dir.c_str(), FormatBytes(a.budget).c_str(), static_cast<unsigned long long>(a.sub_group),
      a.buffers, a.threads, a.steps);
  if (a.params) return a.pipeline ? MainPipeline(a) : MainParams(a);
  if (a.pipeline) {
    std::fprintf(stderr, "nvme_offload_bench: --pipeline needs --params\n");
    return 2;
  }
  std::printf("%-10s %-10s %-9s %-9s %-9s %-9s %-12s %-9s %s\n", "states", "x budget", "step s",
              "I/O s", "Adam s", "kernels s", "step/max", "exposed",
              "read / written; host peak; registered buffers, fixed-buffer transfers");
  for (double ratio : a.ratios) {
    // states = 4 fp32 per element.
    size_t numel = static_cast<size_t>(ratio * static_cast<double>(a.budget) / 16.0);
    numel = numel / (kGroups * 1024) * (kGroups * 1024);
    Result<EngineRun> host = RunEngine(a, numel, false);
    Result<std::vector<double>> io = RunIo(a, numel);
    Result<EngineRun> nvme = RunEngine(a, numel, true);
    for (const Status& s : {host.status(), io.status(), nvme.status()}) {
      if (!s.ok()) {
        std::fprintf(stderr, "nvme_offload_bench: %s\n", s.ToString().c_str());
        return 1;
      }
    }
    const double step = Median(nvme->step_s);
    const double io_s = Median(*io);
    const double adam = Median(host->step_s);
    const double kernels = Median(nvme->adam_s);
    const engine::EngineStats& st = nvme->stats;
    const uint64_t states = 4 * st.optimizer.master_bytes;
    std::printf(
        "%-10s %-10.1f %-9.3f %-9.3f %-9.3f %-9.3f %-12.3f %-9.3f %s / %s; host peak %s; %llu, "
        "%llu\n",
        FormatBytes(states).c_str(), static_cast<double>(states) / a.budget, step, io_s, adam,
        kernels, step / std::max(io_s, adam), step - kernels,
        FormatBytes(st.store.read_bytes).c_str(), FormatBytes(st.store.write_bytes).c_str(),
        st.host ? FormatBytes(st.host->usage.peak_bytes).c_str() : "-",
        static_cast<unsigned long long>(st.store.registered_buffers),
        static_cast<unsigned long long>(st.store.fixed_buffer_ios));
  }
  return 0;
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  return strata::bench::Main(argc, argv);
}
