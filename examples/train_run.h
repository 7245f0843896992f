// strata-train's training runs: the settings a run takes from the command line (Args),
// what a run yields (Run) and the micro-batches it trains on (MakeBatch); the engine's run
// (train_engine.cc) and the plain LibTorch baseline it is checked against
// (train_baseline.cc). strata_train.cc reads the command line, then runs and judges them.
//
// Thread-safety: each run is driven from strata-train's one training thread.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/examples/gpt.h"
#include "strata/examples/train_data.h"

namespace strata::train {

// The command line's settings (strata_train.cc fills them in; their defaults are the
// options').
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
                                                  int64_t begin, int64_t count, int64_t seq_len);

// A count for people: 1234567 -> "1.23M", 12345 -> "12.3k", 123 -> "123".
std::string Human(double v);

// The engine's run (train_engine.cc): `args.steps` optimizer steps of the model under the
// ZeRO engine on this rank's slice of each global batch, resumed from a checkpoint, saved,
// traced and measured as `args` says; per-step metrics to `metrics` (rank 0), the engine's
// statistics and the throughput to `stats_text`. Throws std::runtime_error on failure.
Run TrainEngine(const Args& args, const strata::Config& config, const GptOptions& gopts,
                const Corpus& corpus, const std::shared_ptr<strata::comm::Communicator>& comm,
                uint64_t seed, MetricsWriter* metrics, std::string* stats_text);

// The plain LibTorch baseline (train_baseline.cc): the same model, initial values and data
// order, trained by torch::optim::AdamW (Adam when adam_w_mode is off) with the same LR
// schedule, clipping and gradient accumulation, on the whole global batch in one process.
// Throws on failure.
Run TrainBaseline(const Args& args, const strata::Config& config, const GptOptions& gopts,
                  const Corpus& corpus, int world_size, uint64_t seed);

// Prints the engine's run against the baseline's: the loss curves, their largest relative
// difference over the first --baseline-check-steps steps, the final `tail`-step mean losses
// (`last`: the engine's) beyond, and the final parameters. Whether they agree within the
// tolerances (always, for the parts not held to one: not fp32).
bool CompareWithBaseline(const Args& args, const strata::Config& config, const Run& run,
                         const Run& base, size_t tail, double last);

}  // namespace strata::train
