// strata-train: the main job. A GPT-style byte-level decoder (examples/gpt.h) trained by
// the ZeRO-3 engine (engine/libtorch/zero3.h) on a text file; with no arguments, the embedded
// default: a small model on the project's own documentation, ZeRO-3 with the optimizer
// and the parameters offloaded to the host tier and a device budget well below the
// model's size. See docs/strata-train.md.
//
// Exit codes: 0 success; 1 a failure while training; 2 bad options, configuration or
// data; 4 the loss did not fall to --max-loss-ratio of its first value; 5 --baseline
// disagreed beyond --baseline-tol or --baseline-final-tol.
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/model_shapes.h"
#include "strata/core/planner.h"
#include "strata/core/throughput.h"
#include "strata/engine/libtorch/zero3.h"
#include "strata/engine/step/lr_schedule.h"
#include "strata/examples/gpt.h"
#include "strata/examples/train_data.h"
#include "strata/optim/cpu_adam/cpu_adam.h"
#include "strata_generated/version.h"

namespace po = boost::program_options;
using strata::train::Corpus;
using strata::train::GptImpl;
using strata::train::GptOptions;
using strata::train::StepMetrics;

namespace {

constexpr int kOk = 0;
constexpr int kFailure = 1;
constexpr int kUsage = 2;
constexpr int kLossCheckFailed = 4;
constexpr int kBaselineMismatch = 5;

// The embedded default: ZeRO-3, optimizer states and parameters on the host tier, fp32.
// strata.device_budget is filled in by DefaultConfigJson for the model being trained.
constexpr const char* kDefaultConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
  "seed": 1234,
  "optimizer": {"type": "AdamW",
                "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 30,
                           "warmup_type": "linear"}},
  "zero_optimization": {
    "stage": 3,
    "overlap_comm": true,
    "reduce_bucket_size": 1,
    "stage3_param_persistence_threshold": 100000,
    "offload_optimizer": {"device": "cpu", "pin_memory": true},
    "offload_param": {"device": "cpu", "pin_memory": true}
  },
  "strata": {"allow_unpinned": true}
})";

uint64_t RoundUp(uint64_t v, uint64_t m) {
  return (v + m - 1) / m * m;
}

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

// The embedded config sized for the model `o` on `world` ranks:
//  - stage3_param_persistence_threshold: the root group (embeddings, ln_f) stays gathered,
//    the blocks are partitioned and fetched (the threshold is the root's size when that is
//    below a block's, else 0);
//  - stage3_max_live_parameters / prefetch bucket / max_reuse_distance: two blocks live;
//  - reduce_bucket_size: one block, with overlap_comm (two buckets): each block's gradients
//    are reduce-scattered as soon as its backward is done, while the next block's backward
//    runs (DeepSpeed's 5e8-element default would hold the whole model, reduced only when
//    the backward ends; one bucket would wait for each reduction before the next block's
//    gradients could land);
//  - strata.device_budget: what the engine needs on the device tier with everything
//    offloaded (docs/engine/runtime.md, "The device budget check"): two blocks gathered, the persistent
//    root, two gradient buckets (each the largest group, plus its 1/world shard), fp32,
//    16-element alignment, 64-byte rounding; plus 2% and 16 KiB of slack, rounded up to
//    4 KiB. About half of the default model's parameter bytes.
std::string DefaultConfigJson(const GptOptions& o, int world) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::parse(kDefaultConfig);
  const bool root_persistent = o.RootParams() < o.BlockParams();
  doc["zero_optimization"]["stage3_param_persistence_threshold"] =
      root_persistent ? o.RootParams() : 0;
  // At most two blocks gathered (the one running and the one prefetched), each released
  // as soon as it has run.
  doc["zero_optimization"]["stage3_max_live_parameters"] = 2 * o.BlockParams();
  doc["zero_optimization"]["stage3_prefetch_bucket_size"] = o.BlockParams();
  doc["zero_optimization"]["stage3_max_reuse_distance"] = 0;
  doc["zero_optimization"]["reduce_bucket_size"] = o.BlockParams();
  auto bytes = [](uint64_t numel) { return RoundUp(RoundUp(numel, 16) * 4, 64); };
  const uint64_t block_elems = RoundUp(static_cast<uint64_t>(o.BlockParams()), 16);
  const uint64_t root_elems = RoundUp(static_cast<uint64_t>(o.RootParams()), 16);
  uint64_t need = 0;
  if (root_persistent) {
    need += bytes(root_elems) + std::min<int64_t>(2, o.n_layers) * bytes(block_elems);
  } else {
    std::vector<uint64_t> groups(static_cast<size_t>(o.n_layers), bytes(block_elems));
    groups.push_back(bytes(root_elems));
    std::sort(groups.rbegin(), groups.rend());
    need += groups[0] + groups[1];
  }
  const uint64_t largest = std::max(block_elems, root_elems);
  need += 2 * (bytes(largest) + bytes(largest / static_cast<uint64_t>(world)));  // 2 buckets
  const uint64_t budget = RoundUp(need + need / 50 + 16384, 4096);
  doc["strata"]["device_budget"] = budget;
  return doc.dump();
}

struct Args {
  std::string config_file, data_file, metrics_file, model = "small";
  int64_t steps = 300;
  std::optional<int64_t> layers, d_model, heads, d_mlp, seq_len;
  std::optional<int64_t> seed;
  bool baseline = false;
  double baseline_tol = 1e-5;
  int64_t baseline_check_steps = 20;  // steps whose loss must agree to baseline_tol; 0 = all
  double baseline_final_tol = 0.03;   // relative difference of the final (tail-mean) losses
  double max_loss_ratio = 0.7;
  int threads = 0;
  bool progress = true;
  bool print_config = false;
  bool plan = false;
  double adam_rate = 0.0;       // --plan: given CPU-Adam rate (0: measured)
  std::string save_dir;         // --save-dir
  int64_t save_every = 0;       // --save-every (0: only at the end)
  int64_t resources_every = 0;  // --resources-every (0: never)
  std::string trace_file;       // --trace (empty: none)
  std::string resume;           // --resume DIR|auto
  double peak_tflops = 0;       // --peak-tflops (0: the GPU's datasheet, or none)
};

struct Run {
  std::vector<double> losses;  // per optimizer step (mean over micro-batches and ranks)
  // The final parameters by name (the engine's gathered from the shards, with the
  // holders' ".inner" removed), for --baseline.
  std::vector<std::pair<std::string, torch::Tensor>> params;
  double seconds = 0;
  double tokens = 0;       // global tokens trained on
  int64_t first_step = 1;  // > 1: resumed from a checkpoint at first_step - 1
  // The loss of step 1: this run's, or the resumed checkpoint's (NaN: a checkpoint of an
  // earlier strata-train, which did not keep it).
  double step1_loss = std::numeric_limits<double>::quiet_NaN();
};

// Inputs and next-byte targets of rows [begin, begin + count) of a global micro-batch.
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

// ---------------------------------------------------------------------------
// The plain LibTorch baseline: the same model, initial values and data order, trained by
// torch::optim::AdamW (Adam when adam_w_mode is off) with the same LR schedule, clipping
// and gradient accumulation, on the whole global batch in one process.

Run TrainBaseline(const Args& args, const strata::Config& config, const GptOptions& gopts,
                  const Corpus& corpus, int world_size, uint64_t seed) {
  torch::manual_seed(seed);
  auto model = std::make_shared<GptImpl<strata::train::PlainBlocks>>(gopts);
  const strata::OptimizerConfig& oc = config.optimizer;
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (oc.adam_w_mode) {
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(),
                                                torch::optim::AdamWOptions(oc.lr)
                                                    .betas({oc.beta1, oc.beta2})
                                                    .eps(oc.eps)
                                                    .weight_decay(oc.weight_decay));
  } else {
    opt = std::make_unique<torch::optim::Adam>(model->parameters(),
                                               torch::optim::AdamOptions(oc.lr)
                                                   .betas({oc.beta1, oc.beta2})
                                                   .eps(oc.eps)
                                                   .weight_decay(oc.weight_decay));
  }
  strata::Result<strata::engine::LrSchedule> sched =
      strata::engine::LrSchedule::Create(config.scheduler, config.optimizer);
  if (!sched.ok()) throw std::runtime_error(sched.status().ToString());
  const int64_t micro = config.train_micro_batch_size_per_gpu;
  const int64_t gas = config.gradient_accumulation_steps;
  const int64_t rows = micro * world_size;
  strata::train::Sampler sampler(corpus, gopts.seq_len, seed);
  Run run;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < args.steps; ++step) {
    const double lr = sched->LrAt(sched->first_iteration() + step);
    for (auto& group : opt->param_groups()) {
      if (oc.adam_w_mode) {
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      } else {
        static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
      }
    }
    opt->zero_grad();
    double loss_sum = 0;
    for (int64_t m = 0; m < gas; ++m) {
      auto [x, y] = MakeBatch(corpus, sampler.NextOffsets(rows), 0, rows, gopts.seq_len);
      torch::Tensor loss = model->forward(x, y);
      loss_sum += loss.item<double>();
      (loss / static_cast<double>(gas)).backward();
    }
    if (config.gradient_clipping > 0)
      torch::nn::utils::clip_grad_norm_(model->parameters(), config.gradient_clipping);
    opt->step();
    run.losses.push_back(loss_sum / static_cast<double>(gas));
    run.tokens += static_cast<double>(rows * gas * gopts.seq_len);
  }
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& item : model->named_parameters())
    run.params.emplace_back(item.key(), item.value().detach().clone());
  return run;
}

// ---------------------------------------------------------------------------
// The engine run.

struct Zero3Blocks {
  using Holder = strata::Zero3<strata::train::BlockImpl>;
  static Holder Make(const GptOptions& o) { return strata::zero3(strata::train::Block(o)); }
};

Run TrainEngine(const Args& args, const strata::Config& config, const GptOptions& gopts,
                const Corpus& corpus, const std::shared_ptr<strata::comm::Communicator>& comm,
                uint64_t seed, strata::train::MetricsWriter* metrics, std::string* stats_text) {
  torch::manual_seed(seed);
  std::shared_ptr<GptImpl<Zero3Blocks>> model;
  if (config.zero.stage == 3) {
    // Partitioned construction (docs/engine/libtorch.md): each block is sharded as it is built, so a
    // rank never holds the whole model; the same values as building it whole (rank 0's).
    strata::ZeroInit init(config, comm);
    model = std::make_shared<GptImpl<Zero3Blocks>>(gopts);
  } else {
    // Stages 1 and 2 replicate the parameters: every rank builds the whole model (the
    // same values: every rank seeds alike, and initialize broadcasts rank 0's).
    model = std::make_shared<GptImpl<Zero3Blocks>>(gopts);
  }
  // On several ranks initialize gives the all-gathers and the gradient reductions lanes of
  // their own (duplicates of `comm`): a prefetch never queues behind a reduce-scatter, and
  // `comm` is free for the loss's all-reduce.
  strata::Engine engine = strata::initialize(model, config, comm);
  if (!args.trace_file.empty()) engine.core().EnableTimeline(true);
  strata::engine::EngineStats before = engine.statistics();  // the previous step's
  const int rank = engine.rank();
  const int world = engine.world_size();
  const int64_t micro = config.train_micro_batch_size_per_gpu;
  const int64_t gas = config.gradient_accumulation_steps;
  const double step_tokens = static_cast<double>(micro * world * gas * gopts.seq_len);
  // Model FLOPs and their utilization (core/throughput.h): against --peak-tflops, else a
  // GPU's datasheet peak for the working dtype, else none.
  const double flops_per_token = strata::TrainingFlopsPerToken(
      static_cast<double>(gopts.TotalParams()), gopts.n_layers, gopts.seq_len, gopts.d_model);
  const char* dtype = config.bf16 ? "bf16" : config.fp16.enabled ? "fp16" : "fp32";
  double peak = 0;
  std::string peak_source;
  if (args.peak_tflops > 0) {
    peak = args.peak_tflops * 1e12;
    peak_source = "--peak-tflops";
  } else if (std::optional<strata::DatasheetPeak> sheet =
                 strata::DatasheetPeakFlops(engine.core().device_name(), dtype)) {
    peak = sheet->flops_per_s;
    peak_source = sheet->source;
  }
  // The swap directories whose open files --resources-every counts, as the kernel names
  // them (absolute, symbolic links resolved).
  std::vector<std::string> swap_dirs;
  for (const strata::OffloadConfig* o :
       {&config.zero.offload_optimizer, &config.zero.offload_param}) {
    if (o->device != strata::OffloadDevice::kNvme) continue;
    for (const std::string& dir : o->nvme_path) {
      char real[PATH_MAX];
      swap_dirs.push_back(::realpath(dir.c_str(), real) != nullptr ? real : dir);
    }
  }
  strata::train::Sampler sampler(corpus, gopts.seq_len, seed);
  // What a checkpoint keeps besides the engine's state: the data position, and what must
  // be the same for a resumed run to continue this one.
  nlohmann::json identity = {{"data", corpus.name},
                             {"data_bytes", corpus.bytes.size()},
                             {"seed", seed},
                             {"model", gopts.ToString()}};
  int64_t first_step = 1;
  double step1_loss = std::numeric_limits<double>::quiet_NaN();
  if (!args.resume.empty()) {
    const std::string dir = args.resume == "auto" ? args.save_dir : args.resume;
    if (args.resume == "auto" && ::access((dir + "/latest").c_str(), F_OK) != 0) {
      if (rank == 0)
        std::printf("strata-train: no checkpoint in %s yet: starting at step 1\n", dir.c_str());
    } else {
      const strata::LoadedCheckpoint loaded = engine.load_checkpoint(dir);
      nlohmann::json client;
      try {
        client = nlohmann::json::parse(loaded.client_state);
      } catch (const std::exception& e) {
        throw std::runtime_error(loaded.path + " was not saved by strata-train (" + e.what() + ")");
      }
      for (const auto& [key, value] : identity.items()) {
        if (!client.contains(key) || client[key] != value) {
          throw std::runtime_error("--resume: " + loaded.path + " was trained with " + key + " " +
                                   (client.contains(key) ? client[key].dump() : "(none)") +
                                   ", this run has " + value.dump() +
                                   ": resume with the same model, data and seed");
        }
      }
      strata::Status st = sampler.SetState(client.value("sampler", std::string()));
      if (!st.ok()) throw std::runtime_error(loaded.path + ": " + st.message());
      first_step = client.value("step", int64_t{0}) + 1;
      // The loss check judges the whole run, from its step 1.
      if (client.contains("step1_loss") && client["step1_loss"].is_number())
        step1_loss = client["step1_loss"].get<double>();
      if (first_step > args.steps) {
        throw std::runtime_error("--resume: " + loaded.path + " is at step " +
                                 std::to_string(first_step - 1) + ", not before --steps " +
                                 std::to_string(args.steps) + ": nothing left to train");
      }
      if (rank == 0) {
        std::printf("strata-train: resumed from %s at step %" PRId64 "\n", loaded.path.c_str(),
                    first_step - 1);
      }
    }
  }
  strata::train::Progress progress(args.progress && rank == 0, args.steps,
                                   std::max<int64_t>(1, config.steps_per_print));
  Run run;
  run.first_step = first_step;
  run.step1_loss = step1_loss;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = first_step; step <= args.steps; ++step) {
    const auto ts = std::chrono::steady_clock::now();
    double loss_sum = 0;
    double lr = engine.get_lr();
    for (int64_t m = 0; m < gas; ++m) {
      const std::vector<int64_t> offsets = sampler.NextOffsets(micro * world);
      auto [x, y] = MakeBatch(corpus, offsets, rank * micro, micro, gopts.seq_len);
      torch::Tensor loss = model->forward(x, y);
      loss_sum += loss.item<double>();
      engine.backward(loss);
      const strata::engine::StepOutcome out = engine.step();
      if (out.boundary) lr = out.lr;
    }
    double mean_loss = loss_sum / static_cast<double>(gas);
    if (world > 1) {
      float global = static_cast<float>(mean_loss);
      strata::Status st =
          comm->AllReduce(&global, 1, strata::comm::DType::kFloat32, strata::comm::ReduceOp::kAvg);
      if (!st.ok()) throw std::runtime_error("all-reduce of the loss: " + st.ToString());
      mean_loss = global;
    }
    const auto te = std::chrono::steady_clock::now();
    const strata::engine::EngineStats stats = engine.statistics();
    StepMetrics m;
    m.step = step;
    m.loss = mean_loss;
    m.lr = lr;
    const strata::Throughput tp = strata::ComputeThroughput(
        flops_per_token, step_tokens, std::chrono::duration<double>(te - ts).count(), world, peak);
    m.tokens_per_s = tp.tokens_per_s;
    m.tflops = tp.tflops;
    m.mfu = tp.mfu;
    m.device_bytes = stats.device.usage.bytes_in_use;
    m.device_peak_bytes = stats.device.usage.peak_bytes;
    if (stats.host) {
      m.host_bytes = stats.host->usage.bytes_in_use;
      m.host_peak_bytes = stats.host->usage.peak_bytes;
    }
    m.elapsed_s = std::chrono::duration<double>(te - t0).count();
    m.forward_s = stats.phases.forward_s - before.phases.forward_s;
    m.backward_s = stats.phases.backward_s - before.phases.backward_s;
    m.step_s = stats.phases.step_s - before.phases.step_s;
    m.waited_s = WaitedSeconds(stats) - WaitedSeconds(before);
    before = stats;
    run.losses.push_back(mean_loss);
    if (step == 1) run.step1_loss = mean_loss;
    run.tokens += step_tokens;
    if (rank == 0) {
      progress.Update(m, stats.device.usage.budget_bytes);
      strata::Status st = metrics->Write(m);
      if (!st.ok()) throw std::runtime_error(st.message());
    }
    if (!args.save_dir.empty() &&
        (step == args.steps || (args.save_every > 0 && step % args.save_every == 0))) {
      nlohmann::json client = identity;
      client["step"] = step;
      client["sampler"] = sampler.State();
      if (std::isfinite(run.step1_loss)) client["step1_loss"] = run.step1_loss;
      const auto s0 = std::chrono::steady_clock::now();
      const std::string path = engine.save_checkpoint(args.save_dir, "", client.dump());
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
      if (rank == 0) {
        std::printf("%sstrata-train: saved %s in %.2f s\n", args.progress ? "\n" : "", path.c_str(),
                    secs);
        std::fflush(stdout);
      }
    }
    if (args.resources_every > 0 && step % args.resources_every == 0) {
      const strata::Result<strata::train::ProcessResources> res =
          strata::train::ReadProcessResources(swap_dirs);
      if (!res.ok()) throw std::runtime_error(res.status().ToString());
      const std::string who = world > 1 ? " (rank " + std::to_string(rank) + ")" : "";
      std::printf("%sstrata-train: resources at step %" PRId64 "%s: rss %" PRIu64
                  " B, open fds %" PRId64 ", locked %" PRIu64 " B, pinned %" PRIu64
                  " B, swap files %" PRIu64 " B, host tier %" PRIu64 " B\n",
                  args.progress ? "\n" : "", step, who.c_str(), res->rss_bytes, res->open_fds,
                  res->locked_bytes, res->pinned_bytes, res->swap_file_bytes, m.host_bytes);
      std::fflush(stdout);
    }
  }
  progress.Finish();
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const strata::engine::EngineStats end_stats = engine.statistics();
  *stats_text = end_stats.ToString();
  if (!stats_text->empty() && stats_text->back() != '\n') *stats_text += '\n';
  *stats_text += PhaseSummary(end_stats, args.steps - first_step + 1);
  {
    const strata::Throughput tp =
        strata::ComputeThroughput(flops_per_token, run.tokens, run.seconds, world, peak);
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "\nstrata-train: throughput: %.1f tokens/s, %.4g model TFLOPS (%.4g MFLOPs per "
                  "token: 6 x %" PRId64 " parameters + attention 12 x %" PRId64 " x %" PRId64
                  " x %" PRId64 "), ",
                  tp.tokens_per_s, tp.tflops, flops_per_token / 1e6, gopts.TotalParams(),
                  gopts.n_layers, gopts.seq_len, gopts.d_model);
    *stats_text += buf;
    if (peak > 0) {
      std::snprintf(buf, sizeof buf, "MFU %.2f%% of %.4g TFLOPS per rank (%s)", 100.0 * tp.mfu,
                    peak / 1e12, peak_source.c_str());
      *stats_text += buf;
    } else {
      *stats_text +=
          "MFU: no peak known (--peak-tflops; bench/gemm_peak.py measures this machine's)";
    }
  }
  if (!args.trace_file.empty()) {
    const std::string path = TracePath(args.trace_file, rank, world);
    const std::vector<strata::engine::TimelineEvent> events = engine.core().TakeTimeline();
    const strata::Status st =
        strata::engine::WriteChromeTrace(path, events, rank, engine.core().timeline_dropped());
    if (!st.ok()) throw std::runtime_error("--trace: " + st.ToString());
    std::printf("strata-train: trace of rank %d written to %s (%zu spans)\n", rank, path.c_str(),
                events.size());
    std::fflush(stdout);
  }
  if (args.baseline) {
    for (const auto& item : engine.gather_parameters()) {
      std::string name = item.key();
      for (size_t pos; (pos = name.find(".inner.")) != std::string::npos;)
        name.erase(pos, 6);
      run.params.emplace_back(name, item.value());
    }
  }
  return run;
}

// ---------------------------------------------------------------------------

int UsageError(const std::string& message) {
  std::fprintf(stderr, "strata-train: %s\n(see strata-train --help)\n", message.c_str());
  return kUsage;
}

void PrintHelp(const po::options_description& desc) {
  std::printf(
      "usage: strata-train [options]\n"
      "       torchrun --nproc_per_node N --no_python strata-train ...\n"
      "\n"
      "Trains a GPT-style byte-level decoder under Strata's ZeRO-3 engine. With no options:\n"
      "the \"small\" model on the project's own documentation, optimizer states and\n"
      "parameters offloaded to the host tier, a device budget of about a third of the\n"
      "model's parameter bytes (the embedded config sizes it for the model), 300 steps.\n"
      "Under torchrun it trains data-parallel, each rank on its slice of the global batch.\n\n");
  std::cout << desc << "\n";
  std::printf("model presets:\n");
  for (const strata::ModelPreset& p : strata::ModelPresets())
    std::printf("  %-7s %s (%s)\n", p.name, p.shape.ToString().c_str(), p.what);
  std::printf(
      "\nexit status: 0 ok, 1 training failed, 2 bad options, config or data, 4 loss ratio\n"
      "above --max-loss-ratio, 5 --baseline disagreement above its tolerances.\n");
}

int Main(int argc, char** argv) {
  Args args;
  po::options_description desc("options");
  int64_t layers = 0, d_model = 0, heads = 0, d_mlp = 0, seq_len = 0, seed_arg = 0;
  desc.add_options()("help,h", "show this help")("version", "print the version")(
      "config", po::value<std::string>(&args.config_file),
      "DeepSpeed-style JSON config (default: the embedded one; --print-config shows it)")(
      "print-config", "print the normalized configuration and exit")(
      "plan",
      "print the tier planner's plan for this model and config (strata-config plan with the "
      "model's exact parameter count and largest block) and whether this machine holds it; "
      "exit 2 when it does not")(
      "adam-rate", po::value<double>(&args.adam_rate),
      "with --plan: CPU-Adam parameters per second of a rank (default: measured here)")(
      "data", po::value<std::string>(&args.data_file),
      "text file to train on, read as bytes (default: the project's docs, README.md and "
      "docs/*.md)")("steps", po::value<int64_t>(&args.steps)->default_value(300),
                    "optimizer steps")("model",
                                       po::value<std::string>(&args.model)->default_value("small"),
                                       ("model preset: " + strata::ModelPresetNames()).c_str())(
      "layers", po::value<int64_t>(&layers), "transformer blocks (overrides the preset)")(
      "d-model", po::value<int64_t>(&d_model), "embedding width")(
      "heads", po::value<int64_t>(&heads), "attention heads (must divide d-model)")(
      "d-mlp", po::value<int64_t>(&d_mlp), "MLP hidden width (default 4 x d-model)")(
      "seq-len", po::value<int64_t>(&seq_len), "context length in bytes")(
      "seed", po::value<int64_t>(&seed_arg),
      "seed of the model's initial values and the data order "
      "(default: the config's \"seed\")")(
      "metrics", po::value<std::string>(&args.metrics_file),
      "write per-step metrics: FILE.csv (CSV) or FILE.jsonl (JSON lines)")(
      "baseline",
      "also train the same model on the same data with plain LibTorch AdamW and compare the "
      "loss curves")("baseline-tol", po::value<double>(&args.baseline_tol)->default_value(1e-5),
                     "largest relative loss difference --baseline accepts (fp32 only)")(
      "baseline-check-steps", po::value<int64_t>(&args.baseline_check_steps)->default_value(20),
      "the first N steps are held to --baseline-tol; later steps are compared by their "
      "final mean loss (0 = hold every step to --baseline-tol)")(
      "baseline-final-tol", po::value<double>(&args.baseline_final_tol)->default_value(0.03),
      "largest relative difference of the final mean losses beyond --baseline-check-steps")(
      "max-loss-ratio", po::value<double>(&args.max_loss_ratio)->default_value(0.7),
      "fail unless the final loss is at most this fraction of the first (checked when "
      "steps >= 100; 0 = off)")("threads", po::value<int>(&args.threads),
                                "LibTorch intra-op threads (default: LibTorch's)")(
      "no-progress", "no progress bar on stderr")(
      "save-dir", po::value<std::string>(&args.save_dir),
      "save checkpoints here (each as DIR/global_step<N>, DIR/latest naming the last): at the "
      "end, and every --save-every steps")("save-every", po::value<int64_t>(&args.save_every),
                                           "also save every N steps")(
      "trace", po::value<std::string>(&args.trace_file),
      "write a Chrome/Perfetto trace of the run (chrome://tracing, ui.perfetto.dev): each "
      "phase, each block's forward and backward, every wait of the engine's thread, the "
      "collectives in flight and the CPU optimizer's passes; several ranks write FILE's stem "
      "plus -rank<N>")(
      "resources-every", po::value<int64_t>(&args.resources_every),
      "every N steps print what the process holds: resident memory, open file descriptors, "
      "locked and pinned bytes, the bytes of its open swap files (for soak runs: "
      "bench/soak.py)")(
      "peak-tflops", po::value<double>(&args.peak_tflops),
      "one rank's peak TFLOPS for the model FLOPs utilization (MFU) strata-train prints "
      "(bench/gemm_peak.py measures a CPU's); default: a GPU's datasheet peak for the dtype, "
      "else no MFU")(
      "resume", po::value<std::string>(&args.resume),
      "continue from the checkpoint DIR/latest names (auto: --save-dir's, or start fresh "
      "when it has none) up to --steps, with the same model, data and seed");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    return UsageError(e.what());
  }
  if (vm.count("help")) {
    PrintHelp(desc);
    return kOk;
  }
  if (vm.count("version")) {
    std::printf("strata-train %s\n", STRATA_VERSION_STRING);
    return kOk;
  }
  args.baseline = vm.count("baseline") > 0;
  args.progress = vm.count("no-progress") == 0;
  args.print_config = vm.count("print-config") > 0;
  args.plan = vm.count("plan") > 0;
  if (vm.count("adam-rate") && !(args.adam_rate > 0))
    return UsageError("--adam-rate must be positive");
  if (args.steps < 1) return UsageError("--steps must be at least 1");
  if (args.baseline_check_steps < 0) return UsageError("--baseline-check-steps must be >= 0");
  if (!(args.baseline_tol >= 0) || !(args.baseline_final_tol >= 0))
    return UsageError("--baseline-tol and --baseline-final-tol must be >= 0");
  if (vm.count("threads") && args.threads < 1) return UsageError("--threads must be at least 1");
  if (vm.count("save-every") && (args.save_every < 1 || args.save_dir.empty()))
    return UsageError("--save-every needs a positive N and --save-dir");
  if (vm.count("peak-tflops") && !(args.peak_tflops > 0))
    return UsageError("--peak-tflops must be positive");
  if (vm.count("resources-every") && args.resources_every < 1)
    return UsageError("--resources-every needs a positive N");
  if (vm.count("trace")) {
    const size_t slash = args.trace_file.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : args.trace_file.substr(0, slash + 1);
    if (args.trace_file.empty() || args.trace_file.back() == '/')
      return UsageError("--trace needs a file name");
    if (::access(dir.c_str(), W_OK) != 0)
      return UsageError("--trace " + args.trace_file + ": cannot write into " + dir + " (" +
                        std::strerror(errno) + ")");
  }
  if (args.resume == "auto" && args.save_dir.empty())
    return UsageError("--resume auto needs --save-dir (the directory it resumes from)");
  if (!args.resume.empty() && args.baseline)
    return UsageError(
        "--resume and --baseline exclude each other (the baseline trains from step 1)");

  // The model.
  const strata::ModelPreset* preset = strata::FindModelPreset(args.model);
  if (preset == nullptr)
    return UsageError("--model " + args.model + ": unknown preset (one of " +
                      strata::ModelPresetNames() + ")");
  GptOptions gopts = preset->shape;
  if (vm.count("d-model")) {
    gopts.d_model = d_model;
    if (!vm.count("d-mlp")) gopts.d_mlp = 4 * d_model;
  }
  if (vm.count("layers")) gopts.n_layers = layers;
  if (vm.count("heads")) gopts.n_heads = heads;
  if (vm.count("d-mlp")) gopts.d_mlp = d_mlp;
  if (vm.count("seq-len")) gopts.seq_len = seq_len;
  if (gopts.n_layers < 1 || gopts.d_model < 1 || gopts.n_heads < 1 || gopts.d_mlp < 1 ||
      gopts.seq_len < 1)
    return UsageError("--layers, --d-model, --heads, --d-mlp and --seq-len must be positive");
  if (gopts.d_model % gopts.n_heads != 0)
    return UsageError("--d-model " + std::to_string(gopts.d_model) +
                      " is not a multiple of --heads " + std::to_string(gopts.n_heads));

  // Who we are (torchrun's environment, else one process).
  strata::Result<strata::comm::Rendezvous> rv = strata::comm::RendezvousFromEnvironment({});
  if (!rv.ok()) return UsageError("rendezvous: " + rv.status().ToString());
  const int world = rv->world_size;
  const int rank = rv->rank;

  // The configuration, checked against the world size.
  strata::ValidateOptions vopts;
  vopts.world_size = world;
  strata::Result<strata::Config> config =
      args.config_file.empty() ? strata::ParseConfig(DefaultConfigJson(gopts, world), vopts)
                               : strata::LoadConfigFile(args.config_file, vopts);
  if (!config.ok()) {
    std::fprintf(stderr, "strata-train: %s:\n%s\n",
                 args.config_file.empty() ? "embedded default config" : args.config_file.c_str(),
                 config.status().message().c_str());
    return kUsage;
  }
  if (args.print_config) {
    if (rank == 0) std::printf("%s\n", config->normalized.dump(2).c_str());
    return kOk;
  }
  if (args.plan) {
    // The planner (core/planner.h) with the model's own numbers: the blocks are the groups.
    strata::PlanInput in;
    in.params = static_cast<uint64_t>(gopts.TotalParams());
    in.largest_group = static_cast<uint64_t>(gopts.LargestGroupParams());
    in.world_size = world;
    if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local != nullptr)
      in.ranks_per_node = std::atoi(local);  // torchrun's; as the engine reads it
    if (args.adam_rate > 0) {
      in.adam_rate = args.adam_rate;
      in.adam_rate_source = "given";
    } else if (strata::Status measured = strata::MeasureAdamRateForPlan(*config, in);
               !measured.ok()) {
      return UsageError("measuring CPU-Adam: " + measured.message());
    }
    strata::Result<strata::Plan> plan = strata::MakePlan(*config, in);
    strata::Result<strata::MachineFacts> machine =
        plan.ok() ? strata::ReadMachineFacts(*plan) : plan.status();
    if (!machine.ok()) return UsageError(machine.status().message());
    if (rank == 0)
      std::printf("model %s: %s\n%s", preset->name, gopts.ToString().c_str(),
                  plan->ToString().c_str());
    strata::Status fits = strata::CheckPlan(*plan, *config, *machine);
    if (!fits.ok()) {
      if (rank == 0) std::fprintf(stderr, "strata-train: %s\n", fits.message().c_str());
      return kUsage;
    }
    if (rank == 0) std::printf("fits this machine\n");
    return kOk;
  }
  const uint64_t seed = static_cast<uint64_t>(vm.count("seed") ? seed_arg : config->seed);

  // The data.
  strata::Result<Corpus> corpus = args.data_file.empty()
                                      ? strata::train::LoadDefaultCorpus(STRATA_SOURCE_DIR)
                                      : strata::train::LoadCorpusFile(args.data_file);
  if (!corpus.ok()) return UsageError(corpus.status().message());
  if (static_cast<int64_t>(corpus->bytes.size()) < gopts.seq_len + 2)
    return UsageError("the data (" + std::to_string(corpus->bytes.size()) +
                      " bytes) is shorter than --seq-len + 2");

  strata::train::MetricsWriter metrics;
  if (!args.metrics_file.empty() && rank == 0) {
    strata::Status st = metrics.Open(args.metrics_file);
    if (!st.ok()) return UsageError(st.message());
  }
  if (args.threads > 0) torch::set_num_threads(args.threads);

  const int64_t params = gopts.TotalParams();
  const int64_t global_batch =
      config->train_micro_batch_size_per_gpu * config->gradient_accumulation_steps * world;
  if (rank == 0) {
    std::printf("strata-train %s: model %s: %s, %s parameters (%s in fp32)\n",
                STRATA_VERSION_STRING, preset->name, gopts.ToString().c_str(),
                Human(static_cast<double>(params)).c_str(),
                strata::FormatBytes(static_cast<uint64_t>(params) * 4).c_str());
    std::printf("strata-train: data %s (%zu bytes); config %s; %d rank(s); global batch %" PRId64
                " x %" PRId64 " bytes (micro %" PRId64 " x accumulation %" PRId64 " x %d ranks)\n",
                corpus->name.c_str(), corpus->bytes.size(),
                args.config_file.empty() ? "embedded default" : args.config_file.c_str(), world,
                global_batch, gopts.seq_len, config->train_micro_batch_size_per_gpu,
                config->gradient_accumulation_steps, world);
    const uint64_t budget = config->strata.device_budget;
    std::printf(
        "strata-train: ZeRO-%d, dtype %s, offload_optimizer %s, offload_param %s, device budget "
        "%s%s\n",
        config->zero.stage, config->bf16 ? "bf16" : (config->fp16.enabled ? "fp16" : "fp32"),
        std::string(strata::OffloadDeviceName(config->zero.offload_optimizer.device)).c_str(),
        std::string(strata::OffloadDeviceName(config->zero.offload_param.device)).c_str(),
        budget ? strata::FormatBytes(budget).c_str() : "unlimited",
        budget ? (" (" +
                  std::to_string(static_cast<int>(std::lround(100.0 * static_cast<double>(budget) /
                                                              static_cast<double>(params * 4)))) +
                  "% of the parameter bytes)")
                     .c_str()
               : "");
    std::fflush(stdout);
  }

  strata::Result<std::unique_ptr<strata::comm::Communicator>> comm_or =
      strata::comm::CreateCommunicator(strata::comm::Backend::kGloo, *rv, {});
  if (!comm_or.ok()) {
    std::fprintf(stderr, "strata-train: communicator: %s\n", comm_or.status().ToString().c_str());
    return kFailure;
  }
  std::shared_ptr<strata::comm::Communicator> comm = std::move(comm_or).value();
  std::string stats_text;
  Run run;
  try {
    run = TrainEngine(args, *config, gopts, *corpus, comm, seed, &metrics, &stats_text);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nstrata-train: rank %d: training failed: %s\n", rank, e.what());
    return kFailure;
  }
  strata::Status closed = metrics.Close();
  if (!closed.ok()) {
    std::fprintf(stderr, "strata-train: %s\n", closed.message().c_str());
    return kFailure;
  }
  if (rank != 0) return kOk;

  int rc = kOk;
  const bool fp32 = !config->fp16.enabled && !config->bf16;
  std::printf("strata-train: engine statistics (rank 0):\n%s\n", stats_text.c_str());
  // The ratio compares the last losses with the loss of the run's step 1, also when this
  // process resumed later (the checkpoint keeps that loss): a resumed run is judged as the
  // whole run it continues, not by its own first step.
  const bool resumed = run.first_step > 1;
  const bool have_first = !resumed || std::isfinite(run.step1_loss);
  const double first = resumed && have_first ? run.step1_loss : run.losses.front();
  // The last min(10, steps/10) steps of the run (of this process's, when it resumed late).
  const size_t tail = std::max<size_t>(
      1, std::min<size_t>({10, static_cast<size_t>(args.steps) / 10, run.losses.size()}));
  double last = 0;
  for (size_t i = run.losses.size() - tail; i < run.losses.size(); ++i)
    last += run.losses[i];
  last /= static_cast<double>(tail);
  const double ratio = last / first;
  const bool check_ratio = args.max_loss_ratio > 0 && args.steps >= 100 && have_first;
  std::string verdict = "not checked (fewer than 100 steps)";
  if (!have_first) {
    verdict =
        "not checked (resumed from a checkpoint without the loss of step 1: an earlier "
        "strata-train's)";
  }
  if (args.max_loss_ratio <= 0) verdict = "not checked (--max-loss-ratio 0)";
  if (check_ratio) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s %.2f", ratio <= args.max_loss_ratio ? "<=" : "ABOVE",
                  args.max_loss_ratio);
    verdict = buf;
    if (ratio > args.max_loss_ratio) rc = kLossCheckFailed;
  }

  if (args.baseline) {
    Run base;
    try {
      base = TrainBaseline(args, *config, gopts, *corpus, world, seed);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "strata-train: baseline failed: %s\n", e.what());
      return kFailure;
    }
    // Steps 1..window are held to --baseline-tol. Beyond, two correct fp32 implementations
    // drift apart: a one-ulp difference (a different summation order in a norm or a
    // reduction) is amplified by Adam wherever a gradient is pure rounding noise (attention
    // key biases have an exactly zero gradient), then spreads through training. So later
    // steps are compared by the final mean loss (docs/strata-train.md, "--baseline").
    const int64_t window = args.baseline_check_steps == 0
                               ? args.steps
                               : std::min<int64_t>(args.steps, args.baseline_check_steps);
    double max_rel = 0, late_max_rel = 0;
    int64_t max_at = 1, late_max_at = 0;
    std::printf("strata-train: loss curves (engine vs plain LibTorch %s):\n",
                config->optimizer.adam_w_mode ? "AdamW" : "Adam");
    std::printf("  %6s  %12s  %12s  %10s\n", "step", "strata", "libtorch", "rel diff");
    const int64_t every = args.steps <= 60 ? 1 : std::max<int64_t>(1, config->steps_per_print);
    for (size_t i = 0; i < run.losses.size(); ++i) {
      const double rel =
          std::abs(run.losses[i] - base.losses[i]) / std::max(1e-30, std::abs(base.losses[i]));
      const int64_t s = static_cast<int64_t>(i) + 1;
      if (s <= window && rel > max_rel) {
        max_rel = rel;
        max_at = s;
      }
      if (s > window && rel > late_max_rel) {
        late_max_rel = rel;
        late_max_at = s;
      }
      if (s == 1 || s % every == 0 || s == args.steps)
        std::printf("  %6" PRId64 "  %12.6f  %12.6f  %10.2e\n", s, run.losses[i], base.losses[i],
                    rel);
    }
    std::printf(
        "strata-train: baseline: largest relative loss difference %.3e at step %" PRId64
        " of steps 1-%" PRId64 " (%s); baseline %.1f s, %s tokens/s\n",
        max_rel, max_at, window,
        fp32 ? (max_rel <= args.baseline_tol ? "within" : "ABOVE") : "not checked, not fp32",
        base.seconds, Human(base.tokens / base.seconds).c_str());
    bool final_ok = true;
    if (window < args.steps) {
      // The final losses, each the mean of the same tail of steps as the summary's.
      double base_last = 0;
      for (size_t i = base.losses.size() - tail; i < base.losses.size(); ++i)
        base_last += base.losses[i] / static_cast<double>(tail);
      const double final_rel = std::abs(last - base_last) / std::max(1e-30, std::abs(base_last));
      final_ok = !fp32 || final_rel <= args.baseline_final_tol;
      std::printf("strata-train: baseline: after step %" PRId64
                  " (not held to the tolerance: rounding differences grow over training) the "
                  "largest relative loss difference is %.3e at step %" PRId64
                  "; final %zu-step mean loss %.4f vs %.4f, relative difference %.3e (%s %.2f)\n",
                  window, late_max_rel, late_max_at, tail, last, base_last, final_rel,
                  !fp32      ? "not checked, not fp32"
                  : final_ok ? "within"
                             : "ABOVE",
                  args.baseline_final_tol);
    }
    // Final parameters, norm-wise: |p_engine - p_torch| / |p_torch|.
    double max_param = 0;
    std::string max_param_name = "(none)";
    size_t compared = 0;
    double diff_sq = 0, norm_sq = 0;
    for (const auto& [name, p] : base.params) {
      auto it = std::find_if(run.params.begin(), run.params.end(),
                             [&](const auto& e) { return e.first == name; });
      if (it == run.params.end() || it->second.sizes() != p.sizes()) {
        std::printf("strata-train: baseline: parameter %s missing from the engine's\n",
                    name.c_str());
        max_param = std::numeric_limits<double>::infinity();
        continue;
      }
      ++compared;
      const double d = (it->second - p).norm().item<double>();
      const double n = p.norm().item<double>();
      diff_sq += d * d;
      norm_sq += n * n;
      const double rel = d / std::max(1e-30, n);
      if (!(rel <= max_param)) {
        max_param = rel;
        max_param_name = name;
      }
    }
    std::printf(
        "strata-train: baseline: final parameters, relative difference (norm-wise): all %zu "
        "tensors %.3e, largest single tensor %.3e (%s)\n",
        compared, std::sqrt(diff_sq / std::max(1e-30, norm_sq)), max_param, max_param_name.c_str());
    if (fp32) std::printf("strata-train: baseline tolerance %.1e\n", args.baseline_tol);
    if ((fp32 && max_rel > args.baseline_tol) || !final_ok) rc = kBaselineMismatch;
  }
  std::string from = "";
  if (resumed) {
    from = " (resumed at step " + std::to_string(run.first_step - 1) +
           (have_first ? "; first: step 1's, from the checkpoint)"
                       : "; first: step " + std::to_string(run.first_step) + "'s)");
  }
  std::printf("strata-train: summary: %" PRId64
              " steps, %d rank(s), %s params, loss %.4f -> %.4f "
              "(last %zu-step mean)%s, ratio %.3f (%s), %.1f s, %s tokens/s%s\n",
              args.steps, world, Human(static_cast<double>(params)).c_str(), first, last, tail,
              from.c_str(), ratio, verdict.c_str(), run.seconds,
              Human(run.tokens / run.seconds).c_str(), rc == kOk ? "" : " FAILED");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-train: error: %s\n", e.what());
    return kFailure;
  }
}
