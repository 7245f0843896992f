// strata-train --baseline: the plain LibTorch run the engine's is checked against, and the
// comparison of the two (train_run.h).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/engine/step/lr_schedule.h"
#include "strata/examples/train_run.h"

namespace strata::train {

Run TrainBaseline(const Args& args, const strata::Config& config, const GptOptions& gopts,
                  const Corpus& corpus, int world_size, uint64_t seed) {
  torch::manual_seed(seed);
  auto model = std::make_shared<GptImpl<PlainBlocks>>(gopts);
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
  Sampler sampler(corpus, gopts.seq_len, seed);
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

namespace {

// The loss curves side by side (every step up to 60, else every steps_per_print) and their
// largest relative difference. Steps 1..window are held to --baseline-tol. Beyond, two
// correct fp32 implementations drift apart: a one-ulp difference (a different summation
// order in a norm or a reduction) is amplified by Adam wherever a gradient is pure rounding
// noise (attention key biases have an exactly zero gradient), then spreads through
// training. So later steps are compared by the final mean loss (docs/strata-train.md,
// "--baseline"). Whether both parts agree (fp32 only; else not checked).
bool CompareLosses(const Args& args, const strata::Config& config, const Run& run, const Run& base,
                   size_t tail, double last) {
  const bool fp32 = !config.fp16.enabled && !config.bf16;
  const int64_t window = args.baseline_check_steps == 0
                             ? args.steps
                             : std::min<int64_t>(args.steps, args.baseline_check_steps);
  double max_rel = 0, late_max_rel = 0;
  int64_t max_at = 1, late_max_at = 0;
  std::printf("strata-train: loss curves (engine vs plain LibTorch %s):\n",
              config.optimizer.adam_w_mode ? "AdamW" : "Adam");
  std::printf("  %6s  %12s  %12s  %10s\n", "step", "strata", "libtorch", "rel diff");
  const int64_t every = args.steps <= 60 ? 1 : std::max<int64_t>(1, config.steps_per_print);
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
  std::printf("strata-train: baseline: largest relative loss difference %.3e at step %" PRId64
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
  return !((fp32 && max_rel > args.baseline_tol) || !final_ok);
}

// The final parameters, norm-wise: |p_engine - p_torch| / |p_torch|, over all tensors and
// the largest for a single one (infinite for a parameter the engine's run lacks). Printed
// only: not held to a tolerance.
void CompareParameters(const Run& run, const Run& base) {
  double max_param = 0;
  std::string max_param_name = "(none)";
  size_t compared = 0;
  double diff_sq = 0, norm_sq = 0;
  for (const auto& [name, p] : base.params) {
    auto it = std::find_if(run.params.begin(), run.params.end(),
                           [&](const auto& e) { return e.first == name; });
    if (it == run.params.end() || it->second.sizes() != p.sizes()) {
      std::printf("strata-train: baseline: parameter %s missing from the engine's\n", name.c_str());
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
}

}  // namespace

bool CompareWithBaseline(const Args& args, const strata::Config& config, const Run& run,
                         const Run& base, size_t tail, double last) {
  const bool losses_ok = CompareLosses(args, config, run, base, tail, last);
  CompareParameters(run, base);
  const bool fp32 = !config.fp16.enabled && !config.bf16;
  if (fp32) std::printf("strata-train: baseline tolerance %.1e\n", args.baseline_tol);
  return losses_ok;
}

}  // namespace strata::train
