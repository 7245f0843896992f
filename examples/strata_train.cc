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
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/bytes.h"
#include "strata/core/config.h"
#include "strata/core/model_shapes.h"
#include "strata/core/planner.h"
#include "strata/examples/gpt.h"
#include "strata/examples/train_data.h"
#include "strata/examples/train_run.h"
#include "strata/optim/cpu_adam/cpu_adam.h"
#include "strata_generated/version.h"

namespace po = boost::program_options;
using strata::train::Args;
using strata::train::Corpus;
using strata::train::GptOptions;
using strata::train::Human;
using strata::train::Run;

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

// The command line's numbers that override the preset's shape (--layers, --d-model, --heads,
// --d-mlp, --seq-len) and the config's seed (--seed) when given.
struct Overrides {
  int64_t layers = 0, d_model = 0, heads = 0, d_mlp = 0, seq_len = 0, seed = 0;
};

// The options and their help.
void AddOptions(po::options_description& desc, Args& args, Overrides& over) {
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
      "docs/**/*.md)")("steps", po::value<int64_t>(&args.steps)->default_value(300),
                    "optimizer steps")("model",
                                       po::value<std::string>(&args.model)->default_value("small"),
                                       ("model preset: " + strata::ModelPresetNames()).c_str())(
      "layers", po::value<int64_t>(&over.layers), "transformer blocks (overrides the preset)")(
      "d-model", po::value<int64_t>(&over.d_model), "embedding width")(
      "heads", po::value<int64_t>(&over.heads), "attention heads (must divide d-model)")(
      "d-mlp", po::value<int64_t>(&over.d_mlp), "MLP hidden width (default 4 x d-model)")(
      "seq-len", po::value<int64_t>(&over.seq_len), "context length in bytes")(
      "seed", po::value<int64_t>(&over.seed),
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
}

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

// The flags into `args`, and the checks of the options against each other. A usage error's
// message as an InvalidArgument status.
strata::Status ReadFlags(const po::variables_map& vm, Args& args) {
  args.baseline = vm.count("baseline") > 0;
  args.progress = vm.count("no-progress") == 0;
  args.print_config = vm.count("print-config") > 0;
  args.plan = vm.count("plan") > 0;
  if (vm.count("adam-rate") && !(args.adam_rate > 0))
    return strata::InvalidArgumentError("--adam-rate must be positive");
  if (args.steps < 1) return strata::InvalidArgumentError("--steps must be at least 1");
  if (args.baseline_check_steps < 0)
    return strata::InvalidArgumentError("--baseline-check-steps must be >= 0");
  if (!(args.baseline_tol >= 0) || !(args.baseline_final_tol >= 0))
    return strata::InvalidArgumentError("--baseline-tol and --baseline-final-tol must be >= 0");
  if (vm.count("threads") && args.threads < 1)
    return strata::InvalidArgumentError("--threads must be at least 1");
  if (vm.count("save-every") && (args.save_every < 1 || args.save_dir.empty()))
    return strata::InvalidArgumentError("--save-every needs a positive N and --save-dir");
  if (vm.count("peak-tflops") && !(args.peak_tflops > 0))
    return strata::InvalidArgumentError("--peak-tflops must be positive");
  if (vm.count("resources-every") && args.resources_every < 1)
    return strata::InvalidArgumentError("--resources-every needs a positive N");
  if (vm.count("trace")) {
    const size_t slash = args.trace_file.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : args.trace_file.substr(0, slash + 1);
    if (args.trace_file.empty() || args.trace_file.back() == '/')
      return strata::InvalidArgumentError("--trace needs a file name");
    if (::access(dir.c_str(), W_OK) != 0)
      return strata::InvalidArgumentError("--trace " + args.trace_file + ": cannot write into " +
                                          dir + " (" + std::strerror(errno) + ")");
  }
  if (args.resume == "auto" && args.save_dir.empty())
    return strata::InvalidArgumentError(
        "--resume auto needs --save-dir (the directory it resumes from)");
  if (!args.resume.empty() && args.baseline)
    return strata::InvalidArgumentError(
        "--resume and --baseline exclude each other (the baseline trains from step 1)");
  return strata::Status::Ok();
}

// The model's shape: the preset's, with the options that override it; a usage error's
// message as an InvalidArgument status.
strata::Result<GptOptions> ModelShape(const po::variables_map& vm,
                                      const strata::ModelPreset& preset, const Overrides& over) {
  GptOptions gopts = preset.shape;
  if (vm.count("d-model")) {
    gopts.d_model = over.d_model;
    if (!vm.count("d-mlp")) gopts.d_mlp = 4 * over.d_model;
  }
  if (vm.count("layers")) gopts.n_layers = over.layers;
  if (vm.count("heads")) gopts.n_heads = over.heads;
  if (vm.count("d-mlp")) gopts.d_mlp = over.d_mlp;
  if (vm.count("seq-len")) gopts.seq_len = over.seq_len;
  if (gopts.n_layers < 1 || gopts.d_model < 1 || gopts.n_heads < 1 || gopts.d_mlp < 1 ||
      gopts.seq_len < 1)
    return strata::InvalidArgumentError(
        "--layers, --d-model, --heads, --d-mlp and --seq-len must be positive");
  if (gopts.d_model % gopts.n_heads != 0)
    return strata::InvalidArgumentError("--d-model " + std::to_string(gopts.d_model) +
                                        " is not a multiple of --heads " +
                                        std::to_string(gopts.n_heads));
  return gopts;
}

// --plan: the tier planner's plan for this model and config, and whether this machine holds
// it; the exit code.
int RunPlan(const Args& args, const strata::Config& config, const GptOptions& gopts,
            const strata::ModelPreset& preset, int world, int rank) {
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
  } else if (strata::Status measured = strata::MeasureAdamRateForPlan(config, in); !measured.ok()) {
    return UsageError("measuring CPU-Adam: " + measured.message());
  }
  strata::Result<strata::Plan> plan = strata::MakePlan(config, in);
  strata::Result<strata::MachineFacts> machine =
      plan.ok() ? strata::ReadMachineFacts(*plan) : plan.status();
  if (!machine.ok()) return UsageError(machine.status().message());
  if (rank == 0)
    std::printf("model %s: %s\n%s", preset.name, gopts.ToString().c_str(),
                plan->ToString().c_str());
  strata::Status fits = strata::CheckPlan(*plan, config, *machine);
  if (!fits.ok()) {
    if (rank == 0) std::fprintf(stderr, "strata-train: %s\n", fits.message().c_str());
    return kUsage;
  }
  if (rank == 0) std::printf("fits this machine\n");
  return kOk;
}

// Rank 0's banner: the model, the data, the batch, the config's stage, dtype, offloading
// and device budget.
void PrintBanner(const Args& args, const strata::Config& config, const strata::ModelPreset& preset,
                 const GptOptions& gopts, const Corpus& corpus, int world) {
  const int64_t params = gopts.TotalParams();
  const int64_t global_batch =
      config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps * world;
  std::printf("strata-train %s: model %s: %s, %s parameters (%s in fp32)\n", STRATA_VERSION_STRING,
              preset.name, gopts.ToString().c_str(), Human(static_cast<double>(params)).c_str(),
              strata::FormatBytes(static_cast<uint64_t>(params) * 4).c_str());
  std::printf("strata-train: data %s (%zu bytes); config %s; %d rank(s); global batch %" PRId64
              " x %" PRId64 " bytes (micro %" PRId64 " x accumulation %" PRId64 " x %d ranks)\n",
              corpus.name.c_str(), corpus.bytes.size(),
              args.config_file.empty() ? "embedded default" : args.config_file.c_str(), world,
              global_batch, gopts.seq_len, config.train_micro_batch_size_per_gpu,
              config.gradient_accumulation_steps, world);
  const uint64_t budget = config.strata.device_budget;
  std::printf(
      "strata-train: ZeRO-%d, dtype %s, offload_optimizer %s, offload_param %s, device budget "
      "%s%s\n",
      config.zero.stage, config.bf16 ? "bf16" : (config.fp16.enabled ? "fp16" : "fp32"),
      std::string(strata::OffloadDeviceName(config.zero.offload_optimizer.device)).c_str(),
      std::string(strata::OffloadDeviceName(config.zero.offload_param.device)).c_str(),
      budget ? strata::FormatBytes(budget).c_str() : "unlimited",
      budget ? (" (" +
                std::to_string(static_cast<int>(std::lround(100.0 * static_cast<double>(budget) /
                                                            static_cast<double>(params * 4)))) +
                "% of the parameter bytes)")
                   .c_str()
             : "");
  std::fflush(stdout);
}

// The loss check: the final losses against the first (--max-loss-ratio).
struct LossCheck {
  bool resumed = false;     // this process started past step 1
  bool have_first = false;  // the loss of step 1 is known
  double first = 0;         // the loss of step 1
  size_t tail = 1;          // steps in the final mean
  double last = 0;          // the final mean loss
  double ratio = 0;         // last / first
  std::string verdict;      // for the summary
  bool failed = false;      // the ratio is above --max-loss-ratio
};

LossCheck CheckLoss(const Args& args, const Run& run) {
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
  }
  return {.resumed = resumed,
          .have_first = have_first,
          .first = first,
          .tail = tail,
          .last = last,
          .ratio = ratio,
          .verdict = verdict,
          .failed = check_ratio && ratio > args.max_loss_ratio};
}

// Rank 0's last line: the steps, the loss check and the throughput, FAILED unless `rc` is
// kOk.
void PrintSummary(const Args& args, int world, int64_t params, const Run& run, const LossCheck& c,
                  int rc) {
  std::string from = "";
  if (c.resumed) {
    from = " (resumed at step " + std::to_string(run.first_step - 1) +
           (c.have_first ? "; first: step 1's, from the checkpoint)"
                         : "; first: step " + std::to_string(run.first_step) + "'s)");
  }
  std::printf("strata-train: summary: %" PRId64
              " steps, %d rank(s), %s params, loss %.4f -> %.4f "
              "(last %zu-step mean)%s, ratio %.3f (%s), %.1f s, %s tokens/s%s\n",
              args.steps, world, Human(static_cast<double>(params)).c_str(), c.first, c.last,
              c.tail, from.c_str(), c.ratio, c.verdict.c_str(), run.seconds,
              Human(run.tokens / run.seconds).c_str(), rc == kOk ? "" : " FAILED");
}

// Rank 0 after training: the engine's statistics, the loss check, the baseline's comparison
// (--baseline), the summary; the exit code.
int Judge(const Args& args, const strata::Config& config, const GptOptions& gopts,
          const Corpus& corpus, int world, uint64_t seed, const Run& run,
          const std::string& stats_text) {
  int rc = kOk;
  std::printf("strata-train: engine statistics (rank 0):\n%s\n", stats_text.c_str());
  const LossCheck check = CheckLoss(args, run);
  if (check.failed) rc = kLossCheckFailed;
  if (args.baseline) {
    Run base;
    try {
      base = strata::train::TrainBaseline(args, config, gopts, corpus, world, seed);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "strata-train: baseline failed: %s\n", e.what());
      return kFailure;
    }
    if (!strata::train::CompareWithBaseline(args, config, run, base, check.tail, check.last)) {
      rc = kBaselineMismatch;
    }
  }
  PrintSummary(args, world, gopts.TotalParams(), run, check, rc);
  return rc;
}

// Reads the command line, the config and the data, trains (and, on rank 0, judges the run);
// the exit code.
int Main(int argc, char** argv) {
  Args args;
  Overrides over;
  po::options_description desc("options");
  AddOptions(desc, args, over);
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
  if (strata::Status st = ReadFlags(vm, args); !st.ok()) return UsageError(st.message());

  // The model.
  const strata::ModelPreset* preset = strata::FindModelPreset(args.model);
  if (preset == nullptr)
    return UsageError("--model " + args.model + ": unknown preset (one of " +
                      strata::ModelPresetNames() + ")");
  const strata::Result<GptOptions> shape = ModelShape(vm, *preset, over);
  if (!shape.ok()) return UsageError(shape.status().message());
  const GptOptions& gopts = *shape;

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
  if (args.plan) return RunPlan(args, *config, gopts, *preset, world, rank);
  const uint64_t seed = static_cast<uint64_t>(vm.count("seed") ? over.seed : config->seed);

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
  if (rank == 0) PrintBanner(args, *config, *preset, gopts, *corpus, world);

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
    run = strata::train::TrainEngine(args, *config, gopts, *corpus, comm, seed, &metrics,
                                     &stats_text);
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
  return Judge(args, *config, gopts, *corpus, world, seed, run, stats_text);
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
