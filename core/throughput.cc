#include "strata/core/throughput.h"

namespace strata {

double TrainingFlopsPerToken(double params, int64_t n_layers, int64_t seq_len, int64_t d_model) {
  return 6.0 * params + 12.0 * static_cast<double>(n_layers) * static_cast<double>(seq_len) *
                            static_cast<double>(d_model);
}

Throughput ComputeThroughput(double flops_per_token, double tokens, double seconds, int ranks,
                             double peak_flops_per_rank) {
  Throughput t;
  if (seconds <= 0 || tokens <= 0) return t;
  t.tokens_per_s = tokens / seconds;
  t.flops_per_s = flops_per_token * t.tokens_per_s;
  t.tflops = t.flops_per_s / 1e12;
  if (peak_flops_per_rank > 0 && ranks > 0) {
    t.mfu = t.flops_per_s / (static_cast<double>(ranks) * peak_flops_per_rank);
  }
  return t;
}

namespace {

struct Sheet {
  const char* match;    // in the device's name (the first row that matches counts)
  const char* product;  // as the source names it
  double fp32, half;    // dense TFLOPS: FP32 (no TF32), BF16/FP16 tensor cores
};

// NVIDIA's datasheets, dense (the sparsity figures are twice these).
constexpr Sheet kSheets[] = {
    {"H100 PCIe", "H100 PCIe", 51.2, 756.0}, {"H100 NVL", "H100 NVL", 60.0, 835.0},
    {"H100", "H100 SXM", 66.9, 989.4},       {"H200", "H200 SXM", 66.9, 989.4},
    {"A100", "A100", 19.5, 312.0},
};

}  // namespace

std::optional<DatasheetPeak> DatasheetPeakFlops(std::string_view device_name,
                                                std::string_view dtype) {
  const bool half = dtype == "bf16" || dtype == "fp16";
  if (!half && dtype != "fp32") return std::nullopt;
  for (const Sheet& s : kSheets) {
    if (device_name.find(s.match) == std::string_view::npos) continue;
    DatasheetPeak p;
    p.flops_per_s = (half ? s.half : s.fp32) * 1e12;
    p.source = std::string(s.product) + " datasheet, dense " + std::string(dtype);
    return p;
  }
  return std::nullopt;
}

}  // namespace strata
