// Model FLOPs, throughput and model FLOPs utilization: the one definition that
// strata-train, the Python module (strata.throughput) and bench/train_bench.py report.
//
// Model FLOPs count the model's arithmetic, not the hardware's: a recomputed forward
// (activation checkpointing) or the optimizer is not counted, so the utilization is the
// "MFU" of PaLM's appendix B, comparable between systems that train the same model.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace strata {

// FLOPs to train on one token of a GPT-style decoder (forward and backward): 6 x the
// parameters (a multiply-add per parameter forward, two backward) plus attention's score and
// value products, 12 x n_layers x seq_len x d_model (the full causal square counted).
double TrainingFlopsPerToken(double params, int64_t n_layers, int64_t seq_len, int64_t d_model);

struct Throughput {
  double tokens_per_s = 0;  // all ranks together
  double flops_per_s = 0;   // model FLOPs per second, all ranks together
  double tflops = 0;        // flops_per_s / 1e12
  // flops_per_s / (ranks x the peak of one rank); 0 when the peak is unknown.
  double mfu = 0;
};

// `tokens` (all ranks) trained in `seconds` by `ranks` ranks, each with a peak of
// `peak_flops_per_rank` FLOP/s (0: unknown, no MFU). Zero seconds or tokens: zeros.
Throughput ComputeThroughput(double flops_per_token, double tokens, double seconds, int ranks,
                             double peak_flops_per_rank);

// A GPU's dense peak from NVIDIA's datasheet, by the name CUDA reports ("NVIDIA H100 80GB
// HBM3"; any text containing it, such as a device's "cuda:0 (...)") and the working dtype
// ("bf16", "fp16": tensor cores; "fp32": without TF32, LibTorch's default for matmuls).
struct DatasheetPeak {
  double flops_per_s = 0;
  std::string source;  // "H100 SXM datasheet, dense bf16"
};
std::optional<DatasheetPeak> DatasheetPeakFlops(std::string_view device_name,
                                                std::string_view dtype);

}  // namespace strata
