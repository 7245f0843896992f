// strata-train's engine run (train_run.h): the model built under the ZeRO engine and
// trained step by step on this rank's slice of each global batch, with the checkpoints,
// the per-step metrics, the resource reports, the throughput summary and the trace.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/core/throughput.h"
#include "strata/engine/libtorch/zero3.h"
#include "strata/examples/train_run.h"

namespace strata::train {

std::pair<torch::Tensor, torch::Tensor> MakeBatch(const Corpus& corpus,
                                                  const std::vector<int64_t>& offsets,
                                                  int64_t begin, int64_t count, int64_t seq_len) {
  torch::Tensor x = torch::empty({count, seq_len}, torch::kLong);
  torch::Tensor y = torch::empty({count, seq_len}, torch::kLong);
  int64_t* xp = x.data_ptr<int64_t>();
  int64_t* yp = y.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* src = corpus.bytes.data() + offsets[static_cast<size_t>(begin + r)];
    for (int64_t t = 0; t < seq_len; ++t) {
      xp[r * seq_len + t] = src[t];
      yp[r * seq_len + t] = src[t + 1];
    }
  }
  return {x, y};
}

std::string Human(double v) {
  char buf[32];
  if (v >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  } else if (v >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  }
  return buf;
}

namespace {
// Seconds the engine's thread waited (the exposed waits of its statistics).
double WaitedSeconds(const strata::engine::EngineStats& s) {
  return s.coordinator.all_gather_wait_s + s.coordinator.staging_wait_s + s.reducer.compute_wait_s +
         s.reducer.reduce_wait_s + s.reducer.shard_copy_wait_s + s.reducer.accumulate_wait_s +
         s.working_push_wait_s + s.store.read_wait_s + s.store.write_wait_s +
         s.param_store.read_wait_s + s.param_store.write_wait_s + s.optimizer.pipelined_wait_s -
         s.optimizer.pipelined_store_wait_s;  // (waited on the pipelined update's worker)
}

// The end-of-run summary: each phase and wait per optimizer step, in milliseconds.
std::string PhaseSummary(const strata::engine::EngineStats& s, int64_t steps) {
  const double per = 1e3 / static_cast<double>(std::max<int64_t>(1, steps));
  char buf[1024];
  std::snprintf(buf, sizeof(buf),
                "strata-train: per step (ms, mean of %" PRId64
                "): forward %.2f, backward %.2f, optimizer step %.2f (pipelined steps: %" PRIu64
                ", of which early: %" PRIu64 " with %" PRIu64
                " groups updated during the backward; their updates ran %.2f beside the backward "
                "and the next forward); the engine's thread waited %.2f: "
                "all-gathers %.2f, shard staging %.2f, the step's updates %.2f, compute before "
                "reductions %.2f, reductions %.2f, reduced-shard copies %.2f, the reducer's "
                "thread %.2f, working-shard pushes %.2f, NVMe %.2f",
                steps, s.phases.forward_s * per, s.phases.backward_s * per, s.phases.step_s * per,
                s.optimizer.steps_pipelined, s.optimizer.steps_early,
                s.optimizer.groups_released_in_backward, s.optimizer.pipelined_update_s * per,
                WaitedSeconds(s) * per, s.coordinator.all_gather_wait_s * per,
                s.coordinator.staging_wait_s * per, s.optimizer.pipelined_wait_s * per,
                s.reducer.compute_wait_s * per, s.reducer.reduce_wait_s * per,
                s.reducer.shard_copy_wait_s * per, s.reducer.accumulate_wait_s * per,
                s.working_push_wait_s * per,
                (s.store.read_wait_s + s.store.write_wait_s + s.param_store.read_wait_s +
                 s.param_store.write_wait_s - s.optimizer.pipelined_store_wait_s) *
                    per);
  return buf;
}

// --trace FILE for rank `rank` of `world`: FILE itself on one rank, else FILE's stem plus
// "-rank<N>" and its extension (trace.json -> trace-rank1.json).
std::string TracePath(const std::string& file, int rank, int world) {
  if (world == 1) return file;
  const size_t slash = file.find_last_of('/');
  const size_t dot = file.find_last_of('.');
  const bool ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  return (ext ? file.substr(0, dot) : file) + "-rank" + std::to_string(rank) +
         (ext ? file.substr(dot) : "");
}

struct Zero3Blocks {
  using Holder = strata::Zero3<BlockImpl>;
  static Holder Make(const GptOptions& o) { return strata::zero3(Block(o)); }
};
using EngineModel = GptImpl<Zero3Blocks>;

// The model, from `seed`'s initial values.
std::shared_ptr<EngineModel> BuildModel(const strata::Config& config, const GptOptions& gopts,
                                        const std::shared_ptr<strata::comm::Communicator>& comm,
                                        uint64_t seed) {
  torch::manual_seed(seed);
  if (config.zero.stage == 3) {
    // Partitioned construction (docs/engine/libtorch.md): each block is sharded as it is built, so a
    // rank never holds the whole model; the same values as building it whole (rank 0's).
    strata::ZeroInit init(config, comm);
    return std::make_shared<EngineModel>(gopts);
  }
  // Stages 1 and 2 replicate the parameters: every rank builds the whole model (the
  // same values: every rank seeds alike, and initialize broadcasts rank 0's).
  return std::make_shared<EngineModel>(gopts);
}

// The swap directories whose open files --resources-every counts, as the kernel names
// them (absolute, symbolic links resolved).
std::vector<std::string> SwapDirs(const strata::Config& config) {
  std::vector<std::string> swap_dirs;
  for (const strata::OffloadConfig* o :
       {&config.zero.offload_optimizer, &config.zero.offload_param}) {
    if (o->device != strata::OffloadDevice::kNvme) continue;
    for (const std::string& dir : o->nvme_path) {
      char real[PATH_MAX];
      swap_dirs.push_back(::realpath(dir.c_str(), real) != nullptr ? real : dir);
    }
  }
  return swap_dirs;
}

// What a checkpoint keeps besides the engine's state: the data position, and what must be
// the same for a resumed run to continue this one.
nlohmann::json Identity(const Corpus& corpus, uint64_t seed, const GptOptions& gopts) {
  nlohmann::json identity = {{"data", corpus.name},
                             {"data_bytes", corpus.bytes.size()},
                             {"seed", seed},
                             {"model", gopts.ToString()}};
  return identity;
}

// One run of the engine's training loop: what it trains, with what, and its state between
// steps.
class EngineRun {
 public:
  EngineRun(const Args& args, const strata::Config& config, const GptOptions& gopts,
            const Corpus& corpus, const std::shared_ptr<strata::comm::Communicator>& comm,
            uint64_t seed, MetricsWriter* metrics);

  // Resumes (--resume), trains up to --steps, then the summary into `stats_text`, the trace
  // and (--baseline) the gathered parameters.
  Run Train(std::string* stats_text);

 private:
  // Model FLOPs and their utilization (core/throughput.h): against --peak-tflops, else a
  // GPU's datasheet peak for the working dtype, else none.
  void FindPeak();
  // The checkpoint --resume names (auto: --save-dir's latest, if any): the engine's state
  // loaded, the data position restored; run_.first_step and run_.step1_loss set. Throws
  // when the checkpoint is not strata-train's, is of another model, data or seed, or is at
  // --steps already.
  void Resume();
  // One optimizer step's micro-steps (forward, backward, the engine's step): their mean loss
  // over them and the ranks; the learning rate the optimizer step used in `lr`.
  double TrainStep(double* lr);
  // Step `step`'s metrics (timed from `ts`, its start, to `te`, its end); before_ becomes
  // its statistics.
  StepMetrics Measure(int64_t step, double loss, double lr,
                      std::chrono::steady_clock::time_point ts,
                      std::chrono::steady_clock::time_point te);
  // A checkpoint of step `step` in --save-dir, with the data position and the run's identity.
  void SaveCheckpoint(int64_t step);
  // --resources-every: what the process holds, printed.
  void PrintResources(int64_t step, const StepMetrics& m);
  // The engine's statistics, the phases per step and the throughput, for the end of run.
  std::string Summary();
  // --trace: the timeline written as a Chrome trace (this rank's file).
  void WriteTrace();

  const Args& args_;
  const strata::Config& config_;
  const GptOptions& gopts_;
  const Corpus& corpus_;
  const std::shared_ptr<strata::comm::Communicator>& comm_;
  MetricsWriter* metrics_;
  std::shared_ptr<EngineModel> model_;
  // On several ranks initialize gives the all-gathers and the gradient reductions lanes of
  // their own (duplicates of `comm`): a prefetch never queues behind a reduce-scatter, and
  // `comm` is free for the loss's all-reduce.
  strata::Engine engine_;
  strata::engine::EngineStats before_;  // the previous step's
  const int rank_;
  const int world_;
  const int64_t micro_;
  const int64_t gas_;
  const double step_tokens_;
  const double flops_per_token_;
  double peak_ = 0;
  std::string peak_source_;
  const std::vector<std::string> swap_dirs_;
  Sampler sampler_;
  const nlohmann::json identity_;  // Identity()
  Progress progress_;
  Run run_;
  std::chrono::steady_clock::time_point t0_;  // when the first step started
};

EngineRun::EngineRun(const Args& args, const strata::Config& config, const GptOptions& gopts,
                     const Corpus& corpus, const std::shared_ptr<strata::comm::Communicator>& comm,
                     uint64_t seed, MetricsWriter* metrics)
    : args_(args),
      config_(config),
      gopts_(gopts),
      corpus_(corpus),
      comm_(comm),
      metrics_(metrics),
      model_(BuildModel(config, gopts, comm, seed)),
      engine_(strata::initialize(model_, config, comm)),
      rank_(engine_.rank()),
      world_(engine_.world_size()),
      micro_(config.train_micro_batch_size_per_gpu),
      gas_(config.gradient_accumulation_steps),
      step_tokens_(static_cast<double>(micro_ * world_ * gas_ * gopts.seq_len)),
      flops_per_token_(strata::TrainingFlopsPerToken(static_cast<double>(gopts.TotalParams()),
                                                     gopts.n_layers, gopts.seq_len, gopts.d_model)),
      swap_dirs_(SwapDirs(config)),
      sampler_(corpus, gopts.seq_len, seed),
      identity_(Identity(corpus, seed, gopts)),
      progress_(args.progress && rank_ == 0, args.steps,
                std::max<int64_t>(1, config.steps_per_print)) {
  if (!args.trace_file.empty()) engine_.core().EnableTimeline(true);
  before_ = engine_.statistics();
  FindPeak();
}

void EngineRun::FindPeak() {
  const char* dtype = config_.bf16 ? "bf16" : config_.fp16.enabled ? "fp16" : "fp32";
  if (args_.peak_tflops > 0) {
    peak_ = args_.peak_tflops * 1e12;
    peak_source_ = "--peak-tflops";
  } else if (std::optional<strata::DatasheetPeak> sheet =
                 strata::DatasheetPeakFlops(engine_.core().device_name(), dtype)) {
    peak_ = sheet->flops_per_s;
    peak_source_ = sheet->source;
  }
}

void EngineRun::Resume() {
  const std::string dir = args_.resume == "auto" ? args_.save_dir : args_.resume;
  if (args_.resume == "auto" && ::access((dir + "/latest").c_str(), F_OK) != 0) {
    if (rank_ == 0)
      std::printf("strata-train: no checkpoint in %s yet: starting at step 1\n", dir.c_str());
    return;
  }
  const strata::LoadedCheckpoint loaded = engine_.load_checkpoint(dir);
  nlohmann::json client;
  try {
    client = nlohmann::json::parse(loaded.client_state);
  } catch (const std::exception& e) {
    throw std::runtime_error(loaded.path + " was not saved by strata-train (" + e.what() + ")");
  }
  for (const auto& [key, value] : identity_.items()) {
    if (!client.contains(key) || client[key] != value) {
      throw std::runtime_error("--resume: " + loaded.path + " was trained with " + key + " " +
                               (client.contains(key) ? client[key].dump() : "(none)") +
                               ", this run has " + value.dump() +
                               ": resume with the same model, data and seed");
    }
  }
  strata::Status st = sampler_.SetState(client.value("sampler", std::string()));
  if (!st.ok()) throw std::runtime_error(loaded.path + ": " + st.message());
  run_.first_step = client.value("step", int64_t{0}) + 1;
  // The loss check judges the whole run, from its step 1: the checkpoint keeps that loss.
  if (client.contains("step1_loss") && client["step1_loss"].is_number())
    run_.step1_loss = client["step1_loss"].get<double>();
  if (run_.first_step > args_.steps) {
    throw std::runtime_error("--resume: " + loaded.path + " is at step " +
                             std::to_string(run_.first_step - 1) + ", not before --steps " +
                             std::to_string(args_.steps) + ": nothing left to train");
  }
  if (rank_ == 0) {
    std::printf("strata-train: resumed from %s at step %" PRId64 "\n", loaded.path.c_str(),
                run_.first_step - 1);
  }
}

double EngineRun::TrainStep(double* lr) {
  double loss_sum = 0;
  *lr = engine_.get_lr();
  for (int64_t m = 0; m < gas_; ++m) {
    const std::vector<int64_t> offsets = sampler_.NextOffsets(micro_ * world_);
    auto [x, y] = MakeBatch(corpus_, offsets, rank_ * micro_, micro_, gopts_.seq_len);
    torch::Tensor loss = model_->forward(x, y);
    loss_sum += loss.item<double>();
    engine_.backward(loss);
    const strata::engine::StepOutcome out = engine_.step();
    if (out.boundary) *lr = out.lr;
  }
  double mean_loss = loss_sum / static_cast<double>(gas_);
  if (world_ > 1) {
    float global = static_cast<float>(mean_loss);
    strata::Status st =
        comm_->AllReduce(&global, 1, strata::comm::DType::kFloat32, strata::comm::ReduceOp::kAvg);
    if (!st.ok()) throw std::runtime_error("all-reduce of the loss: " + st.ToString());
    mean_loss = global;
  }
  return mean_loss;
}

StepMetrics EngineRun::Measure(int64_t step, double loss, double lr,
                               std::chrono::steady_clock::time_point ts,
                               std::chrono::steady_clock::time_point te) {
  const strata::engine::EngineStats stats = engine_.statistics();
  StepMetrics m;
  m.step = step;
  m.loss = loss;
  m.lr = lr;
  const strata::Throughput tp =
      strata::ComputeThroughput(flops_per_token_, step_tokens_,
                                std::chrono::duration<double>(te - ts).count(), world_, peak_);
  m.tokens_per_s = tp.tokens_per_s;
  m.tflops = tp.tflops;
  m.mfu = tp.mfu;
  m.device_bytes = stats.device.usage.bytes_in_use;
  m.device_peak_bytes = stats.device.usage.peak_bytes;
  if (stats.host) {
    m.host_bytes = stats.host->usage.bytes_in_use;
    m.host_peak_bytes = stats.host->usage.peak_bytes;
  }
  m.elapsed_s = std::chrono::duration<double>(te - t0_).count();
  m.forward_s = stats.phases.forward_s - before_.phases.forward_s;
  m.backward_s = stats.phases.backward_s - before_.phases.backward_s;
  m.step_s = stats.phases.step_s - before_.phases.step_s;
  m.waited_s = WaitedSeconds(stats) - WaitedSeconds(before_);
  before_ = stats;
  return m;
}

void EngineRun::SaveCheckpoint(int64_t step) {
  nlohmann::json client = identity_;
  client["step"] = step;
  client["sampler"] = sampler_.State();
  if (std::isfinite(run_.step1_loss)) client["step1_loss"] = run_.step1_loss;
  const auto s0 = std::chrono::steady_clock::now();
  const std::string path = engine_.save_checkpoint(args_.save_dir, "", client.dump());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
  if (rank_ == 0) {
    std::printf("%sstrata-train: saved %s in %.2f s\n", args_.progress ? "\n" : "", path.c_str(),
                secs);
    std::fflush(stdout);
  }
}

void EngineRun::PrintResources(int64_t step, const StepMetrics& m) {
  const strata::Result<ProcessResources> res = ReadProcessResources(swap_dirs_);
  if (!res.ok()) throw std::runtime_error(res.status().ToString());
  const std::string who = world_ > 1 ? " (rank " + std::to_string(rank_) + ")" : "";
  std::printf("%sstrata-train: resources at step %" PRId64 "%s: rss %" PRIu64
              " B, open fds %" PRId64 ", locked %" PRIu64 " B, pinned %" PRIu64
              " B, swap files %" PRIu64 " B, host tier %" PRIu64 " B\n",
              args_.progress ? "\n" : "", step, who.c_str(), res->rss_bytes, res->open_fds,
              res->locked_bytes, res->pinned_bytes, res->swap_file_bytes, m.host_bytes);
  std::fflush(stdout);
}

std::string EngineRun::Summary() {
  const strata::engine::EngineStats end_stats = engine_.statistics();
  std::string text = end_stats.ToString();
  if (!text.empty() && text.back() != '\n') text += '\n';
  text += PhaseSummary(end_stats, args_.steps - run_.first_step + 1);
  const strata::Throughput tp =
      strata::ComputeThroughput(flops_per_token_, run_.tokens, run_.seconds, world_, peak_);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "\nstrata-train: throughput: %.1f tokens/s, %.4g model TFLOPS (%.4g MFLOPs per "
                "token: 6 x %" PRId64 " parameters + attention 12 x %" PRId64 " x %" PRId64
                " x %" PRId64 "), ",
                tp.tokens_per_s, tp.tflops, flops_per_token_ / 1e6, gopts_.TotalParams(),
                gopts_.n_layers, gopts_.seq_len, gopts_.d_model);
  text += buf;
  if (peak_ > 0) {
    std::snprintf(buf, sizeof buf, "MFU %.2f%% of %.4g TFLOPS per rank (%s)", 100.0 * tp.mfu,
                  peak_ / 1e12, peak_source_.c_str());
    text += buf;
  } else {
    text += "MFU: no peak known (--peak-tflops; bench/gemm_peak.py measures this machine's)";
  }
  return text;
}

void EngineRun::WriteTrace() {
  const std::string path = TracePath(args_.trace_file, rank_, world_);
  const std::vector<strata::engine::TimelineEvent> events = engine_.core().TakeTimeline();
  const strata::Status st =
      strata::engine::WriteChromeTrace(path, events, rank_, engine_.core().timeline_dropped());
  if (!st.ok()) throw std::runtime_error("--trace: " + st.ToString());
  std::printf("strata-train: trace of rank %d written to %s (%zu spans)\n", rank_, path.c_str(),
              events.size());
  std::fflush(stdout);
}

Run EngineRun::Train(std::string* stats_text) {
  if (!args_.resume.empty()) Resume();
  t0_ = std::chrono::steady_clock::now();
  for (int64_t step = run_.first_step; step <= args_.steps; ++step) {
    const auto ts = std::chrono::steady_clock::now();
    double lr = 0;
    const double mean_loss = TrainStep(&lr);
    const auto te = std::chrono::steady_clock::now();
    const StepMetrics m = Measure(step, mean_loss, lr, ts, te);
    run_.losses.push_back(mean_loss);
    if (step == 1) run_.step1_loss = mean_loss;
    run_.tokens += step_tokens_;
    if (rank_ == 0) {
      progress_.Update(m, before_.device.usage.budget_bytes);  // before_: this step's
      strata::Status st = metrics_->Write(m);
      if (!st.ok()) throw std::runtime_error(st.message());
    }
    if (!args_.save_dir.empty() &&
        (step == args_.steps || (args_.save_every > 0 && step % args_.save_every == 0))) {
      SaveCheckpoint(step);
    }
    if (args_.resources_every > 0 && step % args_.resources_every == 0) PrintResources(step, m);
  }
  progress_.Finish();
  run_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  *stats_text = Summary();
  if (!args_.trace_file.empty()) WriteTrace();
  if (args_.baseline) {
    for (const auto& item : engine_.gather_parameters()) {
      std::string name = item.key();
      for (size_t pos; (pos = name.find(".inner.")) != std::string::npos;)
        name.erase(pos, 6);
      run_.params.emplace_back(name, item.value());
    }
  }
  return std::move(run_);
}

}  // namespace

Run TrainEngine(const Args& args, const strata::Config& config, const GptOptions& gopts,
                const Corpus& corpus, const std::shared_ptr<strata::comm::Communicator>& comm,
                uint64_t seed, MetricsWriter* metrics, std::string* stats_text) {
  EngineRun run(args, config, gopts, corpus, comm, seed, metrics);
  return run.Train(stats_text);
}

}  // namespace strata::train
