// Config: batch-size derivation, a realistic ZeRO-3 NVMe config end to end (normalize,
// round trip, typed view, files) and default filling from the key table.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "config_test_util.h"
#include "strata/core/config.h"

namespace strata {
namespace {

using nlohmann::ordered_json;
using testing_util::Contains;
using testing_util::ValidOrDie;

std::string PointerOf(std::string_view dotted) {
  std::string p = "/";
  for (char c : dotted)
    p += c == '.' ? '/' : c;
  return p;
}

// ---------------------------------------------------------------------------
// Batch sizes: train_batch_size = micro x accumulation x world size.

struct BatchCase {
  std::string fields;  // the batch keys, as JSON members
  int world_size;
  // Expected on success (error empty):
  int64_t tbs = 0, mbs = 0, gas = 0;
  std::string error = {};  // a fragment of the one error
  std::string error_path = "train_batch_size";
};

void PrintTo(const BatchCase& c, std::ostream* os) {
  *os << "{" << c.fields << "} with world size " << c.world_size;
}

class BatchTest : public testing::TestWithParam<BatchCase> {};

TEST_P(BatchTest, Derivation) {
  const BatchCase& c = GetParam();
  ValidationResult r = ValidateConfigJson("{" + c.fields + "}", {.world_size = c.world_size});
  if (c.error.empty()) {
    ASSERT_TRUE(r.ok()) << r.ErrorsToString();
    EXPECT_EQ(r.normalized.at("train_batch_size"), c.tbs);
    EXPECT_EQ(r.normalized.at("train_micro_batch_size_per_gpu"), c.mbs);
    EXPECT_EQ(r.normalized.at("gradient_accumulation_steps"), c.gas);
    // The batch keys come first, in table order.
    auto it = r.normalized.begin();
    EXPECT_EQ(it.key(), "train_batch_size");
    EXPECT_EQ((++it).key(), "train_micro_batch_size_per_gpu");
    EXPECT_EQ((++it).key(), "gradient_accumulation_steps");
    // The typed view agrees.
    Result<Config> config = ParseConfig("{" + c.fields + "}", {.world_size = c.world_size});
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->train_batch_size, c.tbs);
    EXPECT_EQ(config->train_micro_batch_size_per_gpu, c.mbs);
    EXPECT_EQ(config->gradient_accumulation_steps, c.gas);
    EXPECT_EQ(config->world_size, c.world_size);
  } else {
    ASSERT_EQ(r.errors.size(), 1u) << r.ErrorsToString();
    EXPECT_EQ(r.errors[0].path, c.error_path);
    EXPECT_TRUE(Contains(r.errors[0].message, c.error));
    EXPECT_TRUE(r.normalized.is_null());
  }
}

constexpr char kAll[] =
    R"("train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2)";
constexpr char kTbsMbs[] = R"("train_batch_size": 32, "train_micro_batch_size_per_gpu": 4)";
constexpr char kTbsGas[] = R"("train_batch_size": 32, "gradient_accumulation_steps": 2)";

INSTANTIATE_TEST_SUITE_P(
    Config, BatchTest,
    testing::Values(
        // All three, consistent only for world size 4.
        BatchCase{kAll, 4, 32, 4, 2},
        BatchCase{kAll, 2, 0, 0, 0,
                  "32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x "
                  "world size 2 = 16"},
        BatchCase{kAll, 1, 0, 0, 0, "x world size 1 = 8"},
        BatchCase{R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 8,
                     "gradient_accumulation_steps": 1)",
                  1, 8, 8, 1},
        // Total and micro: accumulation derived.
        BatchCase{kTbsMbs, 1, 32, 4, 8}, BatchCase{kTbsMbs, 2, 32, 4, 4},
        BatchCase{kTbsMbs, 4, 32, 4, 2},
        BatchCase{R"("train_batch_size": 32, "train_micro_batch_size_per_gpu": 3)", 1, 0, 0, 0,
                  "32 is not divisible by train_micro_batch_size_per_gpu 3 x world size 1"},
        BatchCase{R"("train_batch_size": 32, "train_micro_batch_size_per_gpu": 16)", 4, 0, 0, 0,
                  "32 is not divisible by train_micro_batch_size_per_gpu 16 x world size 4"},
        // Total and accumulation: micro derived.
        BatchCase{kTbsGas, 1, 32, 16, 2}, BatchCase{kTbsGas, 2, 32, 8, 2},
        BatchCase{kTbsGas, 4, 32, 4, 2},
        BatchCase{R"("train_batch_size": 30, "gradient_accumulation_steps": 4)", 1, 0, 0, 0,
                  "30 is not divisible by gradient_accumulation_steps 4 x world size 1"},
        BatchCase{R"("train_batch_size": 24, "gradient_accumulation_steps": 4)", 4, 0, 0, 0,
                  "24 is not divisible by gradient_accumulation_steps 4 x world size 4"},
        // Micro only (accumulation 1 or given): total derived.
        BatchCase{R"("train_micro_batch_size_per_gpu": 4)", 1, 4, 4, 1},
        BatchCase{R"("train_micro_batch_size_per_gpu": 4)", 2, 8, 4, 1},
        BatchCase{R"("train_micro_batch_size_per_gpu": 4)", 4, 16, 4, 1},
        BatchCase{R"("train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3)", 2, 24,
                  4, 3},
        // Total only: accumulation 1, micro = total / world size.
        BatchCase{R"("train_batch_size": 8)", 1, 8, 8, 1},
        BatchCase{R"("train_batch_size": 8)", 2, 8, 4, 1},
        BatchCase{R"("train_batch_size": 8)", 4, 8, 2, 1},
        BatchCase{R"("train_batch_size": 6)", 4, 0, 0, 0, "6 is not divisible by the world size 4"},
        // None given (accumulation alone is not enough).
        BatchCase{"", 1, 0, 0, 0,
                  "set train_batch_size or train_micro_batch_size_per_gpu (or both)"},
        BatchCase{R"("gradient_accumulation_steps": 2)", 2, 0, 0, 0,
                  "set train_batch_size or train_micro_batch_size_per_gpu"},
        // Products that do not fit in 64 bits are refused, not wrapped.
        BatchCase{R"("train_micro_batch_size_per_gpu": 4611686018427387904,
                     "gradient_accumulation_steps": 4)",
                  1, 0, 0, 0, "4 is too large", "gradient_accumulation_steps"},
        BatchCase{R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 4611686018427387904)",
                  4, 0, 0, 0, "4611686018427387904 is too large",
                  "train_micro_batch_size_per_gpu"}),
    [](const testing::TestParamInfo<BatchCase>& p) {
      return "Case" + std::to_string(p.index) + "_WorldSize" + std::to_string(p.param.world_size);
    });

TEST(BatchWorldSizeTest, WorldSizeMustBePositive) {
  ValidationResult r = ValidateConfigJson(R"({"train_batch_size": 8})", {.world_size = 0});
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_TRUE(Contains(r.errors[0].message, "world size must be at least 1, got 0"));
}

TEST(BatchWorldSizeTest, InvalidBatchValueIsNotAlsoReportedAsMissing) {
  ValidationResult r = ValidateConfigJson(R"({"train_batch_size": "big"})");
  ASSERT_EQ(r.errors.size(), 1u) << r.ErrorsToString();
  EXPECT_EQ(r.errors[0].path, "train_batch_size");
  EXPECT_TRUE(Contains(r.errors[0].message, "expected a whole number"));
}

// ---------------------------------------------------------------------------
// A realistic DeepSpeed-style ZeRO-3 NVMe offload configuration.

constexpr char kZero3Nvme[] = R"({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 50,
  "wall_clock_breakdown": false,
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "initial_scale_power": 12,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
  },
  "scheduler": {
    "type": "WarmupDecayLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500,
               "total_num_steps": 10000}
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "overlap_comm": true,
    "reduce_bucket_size": 5e8,
    "sub_group_size": 1e9,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": ["/local_nvme0/strata", "/local_nvme1/strata"],
      "pin_memory": true,
      "buffer_count": 4,
      "pipeline_read": true,
      "pipeline_write": true
    },
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme0/strata",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    }
  },
  "aio": {
    "block_size": "1MiB",
    "queue_depth": 16,
    "thread_count": 2,
    "single_submit": false,
    "overlap_events": true
  },
  "strata": {
    "device_budget": "60GiB",
    "host_budget": "200GiB",
    "numa_node": 0,
    "swap_checksums": true,
    "swap_pipeline_depth": 3,
    "nvme_read_bandwidth": "6.5GB/s",
    "nvme_write_bandwidth": "3.2 GB/s",
    "log_level": "warn"
  }
})";

TEST(Zero3NvmeConfigTest, ValidatesAndNormalizes) {
  ordered_json n = ValidOrDie(kZero3Nvme, /*world_size=*/4);
  EXPECT_EQ(n["train_batch_size"], 64);
  EXPECT_EQ(n["optimizer"]["type"], "AdamW");
  EXPECT_EQ(n["zero_optimization"]["reduce_bucket_size"], 500000000);
  EXPECT_EQ(n["zero_optimization"]["offload_optimizer"]["nvme_path"],
            ordered_json::parse(R"(["/local_nvme0/strata", "/local_nvme1/strata"])"));
  EXPECT_EQ(n["zero_optimization"]["offload_param"]["nvme_path"],
            ordered_json::parse(R"(["/local_nvme0/strata"])"));
  EXPECT_EQ(n["aio"]["block_size"], 1048576);
  EXPECT_EQ(n["aio"]["intra_op_parallelism"], 2);
  EXPECT_FALSE(n["aio"].contains("thread_count"));
  EXPECT_EQ(n["strata"]["device_budget"], 60 * 1073741824ULL);
  EXPECT_DOUBLE_EQ(n["strata"]["nvme_read_bandwidth"].get<double>(), 6.5e9);
  EXPECT_EQ(n["wall_clock_breakdown"], false);
  // Defaults filled in beside the given values.
  EXPECT_EQ(n["zero_optimization"]["allgather_bucket_size"], 500000000);
  EXPECT_EQ(n["zero_optimization"]["offload_optimizer"]["fast_init"], false);
  EXPECT_EQ(n["scheduler"]["params"]["warmup_type"], "log");
  EXPECT_EQ(n["bf16"]["enabled"], false);
  // The same document with another world size is inconsistent.
  EXPECT_FALSE(ValidateConfigJson(kZero3Nvme, {.world_size = 2}).ok());
}

TEST(Zero3NvmeConfigTest, NormalizedOutputRoundTrips) {
  ordered_json once = ValidOrDie(kZero3Nvme, 4);
  ordered_json twice = ValidOrDie(once.dump(2), 4);
  EXPECT_EQ(twice, once) << "first:\n" << once.dump(2) << "\nsecond:\n" << twice.dump(2);
  EXPECT_EQ(twice.dump(), once.dump());  // key order too
  // The minimal document round-trips as well.
  ordered_json minimal = ValidOrDie(R"({"train_micro_batch_size_per_gpu": 2})", 2);
  EXPECT_EQ(ValidOrDie(minimal.dump(), 2).dump(), minimal.dump());
}

TEST(Zero3NvmeConfigTest, TypedView) {
  Result<Config> parsed = ParseConfig(kZero3Nvme, {.world_size = 4});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const Config& c = *parsed;
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.train_batch_size, 64);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 50);
  EXPECT_EQ(c.seed, 42);

  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-5);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_TRUE(c.optimizer.bias_correction);
  EXPECT_TRUE(c.optimizer.adam_w_mode);

  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-5);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 500);
  EXPECT_EQ(c.scheduler.total_num_steps, 10000);
  EXPECT_EQ(c.scheduler.warmup_type, WarmupType::kLog);
  EXPECT_EQ(c.scheduler.last_batch_iteration, -1);

  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_DOUBLE_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_FALSE(c.fp16.consecutive_hysteresis);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_FALSE(c.bf16);

  const ZeroConfig& z = c.zero;
  EXPECT_EQ(z.stage, 3);
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_TRUE(z.overlap_comm);
  EXPECT_TRUE(z.reduce_scatter);
  EXPECT_EQ(z.reduce_bucket_size, 500000000);
  EXPECT_EQ(z.allgather_bucket_size, 500000000);
  EXPECT_EQ(z.sub_group_size, 1000000000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50000000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100000);
  EXPECT_EQ(z.stage3_model_persistence_threshold, INT64_MAX);
  EXPECT_EQ(z.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1000000000);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);

  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_optimizer.nvme_path,
            (std::vector<std::string>{"/local_nvme0/strata", "/local_nvme1/strata"}));
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_TRUE(z.offload_optimizer.pipeline_read);
  EXPECT_TRUE(z.offload_optimizer.pipeline_write);
  EXPECT_FALSE(z.offload_optimizer.fast_init);

  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_param.nvme_path, (std::vector<std::string>{"/local_nvme0/strata"}));
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100000000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1000000000);

  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.queue_depth, 16);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);

  EXPECT_EQ(c.strata.device_budget, 60ULL << 30);
  EXPECT_EQ(c.strata.host_budget, 200ULL << 30);
  EXPECT_FALSE(c.strata.allow_unpinned);
  EXPECT_EQ(c.strata.numa_node, 0);
  EXPECT_TRUE(c.strata.swap_checksums);
  EXPECT_EQ(c.strata.swap_pipeline_depth, 3);
  EXPECT_DOUBLE_EQ(c.strata.nvme_read_bandwidth, 6.5e9);
  EXPECT_DOUBLE_EQ(c.strata.nvme_write_bandwidth, 3.2e9);
  EXPECT_EQ(c.strata.log_level, LogLevel::kWarn);

  EXPECT_EQ(c.normalized, ValidOrDie(kZero3Nvme, 4));
}

TEST(ConfigTypedTest, MinimalDocumentGetsTheTableDefaults) {
  Result<Config> parsed = ParseConfig(R"({"train_batch_size": 8})");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const Config& c = *parsed;
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kNone);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_TRUE(c.zero.offload_optimizer.nvme_path.empty());
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_EQ(c.zero.offload_param.buffer_count, 5);
  EXPECT_EQ(c.aio.block_size, 1048576u);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.strata.numa_node, -1);
  EXPECT_EQ(c.strata.swap_pipeline_depth, 2);
  EXPECT_EQ(c.strata.log_level, LogLevel::kInfo);
}

TEST(ConfigTypedTest, SchedulerAndWarmupTypes) {
  Result<Config> cos = ParseConfig(R"({"train_batch_size": 8, "bf16": {"enabled": true},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000,
          "warmup_type": "linear", "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}}})");
  ASSERT_TRUE(cos.ok()) << cos.status();
  EXPECT_TRUE(cos->bf16);
  EXPECT_EQ(cos->scheduler.type, SchedulerType::kWarmupCosineLR);
  EXPECT_EQ(cos->scheduler.warmup_type, WarmupType::kLinear);
  EXPECT_EQ(cos->scheduler.total_num_steps, 2000);
  EXPECT_DOUBLE_EQ(cos->scheduler.warmup_min_ratio, 0.1);
  EXPECT_DOUBLE_EQ(cos->scheduler.cos_min_ratio, 0.01);

  Result<Config> lr = ParseConfig(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR"},
      "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})");
  ASSERT_TRUE(lr.ok()) << lr.status();
  EXPECT_EQ(lr->scheduler.type, SchedulerType::kWarmupLR);
  EXPECT_EQ(lr->scheduler.warmup_num_steps, 1000);
  EXPECT_EQ(lr->zero.offload_optimizer.device, OffloadDevice::kCpu);
}

TEST(ConfigTypedTest, ParseConfigListsEveryError) {
  Result<Config> r = ParseConfig(R"({"train_batch_size": 0, "aio": {"queue_depth": 0}})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "invalid configuration (2 errors):\n"
            "train_batch_size: 0 is out of range; expected a value >= 1\n"
            "aio.queue_depth: 0 is out of range; expected a value between 1 and 4096");
  Result<Config> one = ParseConfig(R"({"train_batch_size": 0})");
  ASSERT_FALSE(one.ok());
  EXPECT_TRUE(Contains(one.status().message(), "invalid configuration (1 error):\n"));
}

// ---------------------------------------------------------------------------
// Files

class ConfigFileTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TempDir() + "strata_config_test_" + std::to_string(getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(ConfigFileTest, LoadsAFile) {
  const std::string path = Write("ds_config.json", kZero3Nvme);
  Result<Config> c = LoadConfigFile(path, {.world_size = 4});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train_batch_size, 64);
  EXPECT_EQ(c->zero.offload_optimizer.nvme_path.size(), 2u);

  ValidationResult v = ValidateConfigFile(path, {.world_size = 4});
  EXPECT_TRUE(v.ok()) << v.ErrorsToString();
  EXPECT_EQ(v.normalized, c->normalized);
}

TEST_F(ConfigFileTest, MissingFileNamesThePath) {
  const std::string path = dir_ + "/no_such_config.json";
  Result<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(c.status().message(), path));
  EXPECT_TRUE(Contains(c.status().message(), "(errno 2)"));

  ValidationResult v = ValidateConfigFile(path);
  ASSERT_EQ(v.errors.size(), 1u);
  EXPECT_TRUE(Contains(v.errors[0].message, path));
  EXPECT_TRUE(v.normalized.is_null());
}

TEST_F(ConfigFileTest, DirectoryIsNotAConfigFile) {
  Result<Config> c = LoadConfigFile(dir_);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(Contains(c.status().message(), dir_));
  EXPECT_TRUE(Contains(c.status().message(), "directory")) << c.status();
}

TEST_F(ConfigFileTest, InvalidFileNamesThePathAndTheErrors) {
  const std::string path = Write("bad.json", "{\n  \"train_batch_size\": 8,\n  \"aio\": 1\n}\n");
  Result<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message().rfind(path + ": invalid configuration (1 error):\naio: ", 0), 0u)
      << c.status();

  const std::string syntax = Write("syntax.json", "{\n  \"train_batch_size\": 8,,\n}\n");
  ValidationResult v = ValidateConfigFile(syntax);
  ASSERT_EQ(v.errors.size(), 1u);
  EXPECT_EQ(v.errors[0].line, 2);
}

// ---------------------------------------------------------------------------
// Defaults: every key of the table with a default appears in the normalized document
// unless its parent is absent or its `when` condition excludes it.

// Whether `k` should be filled by default in a document that gives only batch keys,
// `scheduler_type` (empty: no scheduler) and `optimizer_type` (absent means Adam).
bool ExpectDefaultFilled(const KeySpec& k, std::string_view scheduler_type,
                         std::string_view optimizer_type) {
  if (!k.not_supported.empty() || k.default_json.empty()) return false;
  // Every ancestor object must exist: exist by default, or be given (scheduler).
  std::string_view path = k.path;
  for (size_t dot = path.find('.'); dot != std::string_view::npos; dot = path.find('.', dot + 1)) {
    const KeySpec* parent = FindConfigKey(path.substr(0, dot));
    if (parent == nullptr) return false;
    const bool given = parent->path == "scheduler" && !scheduler_type.empty();
    if (parent->default_json.empty() && !given) return false;
  }
  if (!k.when_key.empty()) {
    EXPECT_TRUE(k.when_key == "scheduler.type" || k.when_key == "optimizer.type")
        << "update this test for a new `when` key";
    const std::string_view value = k.when_key == "scheduler.type" ? scheduler_type : optimizer_type;
    bool holds = false;
    for (size_t start = 0;;) {
      const size_t bar = k.when_values.find('|', start);
      if (k.when_values.substr(start, bar - start) == value) holds = true;
      if (bar == std::string_view::npos) break;
      start = bar + 1;
    }
    return holds;
  }
  return true;
}

void CheckDefaults(const std::string& doc, std::string_view scheduler_type,
                   std::string_view optimizer_type = "Adam") {
  ordered_json n = ValidOrDie(doc);
  ASSERT_FALSE(n.is_null());
  int checked = 0;
  for (const KeySpec& k : ConfigKeys()) {
    const ordered_json::json_pointer ptr(PointerOf(k.path));
    if (!k.not_supported.empty()) {
      EXPECT_FALSE(n.contains(ptr)) << k.path << ": a refused key in the normalized document";
      continue;
    }
    if (ExpectDefaultFilled(k, scheduler_type, optimizer_type)) {
      ++checked;
      ASSERT_TRUE(n.contains(ptr))
          << k.path << " (default " << k.default_json << ") is missing from:\n"
          << n.dump(2);
      if (k.type != KeyType::kObject && k.path != "scheduler.type" && k.path != "optimizer.type" &&
          k.path != "scheduler.params.total_num_steps") {
        EXPECT_EQ(n.at(ptr), ordered_json::parse(k.default_json)) << k.path;
      }
    } else if (k.default_json.empty() && !k.required && k.type != KeyType::kObject &&
               !k.path.starts_with("train_") && k.path != "gradient_accumulation_steps") {
      EXPECT_FALSE(n.contains(ptr)) << k.path << " has no default but appears";
    } else if (!k.default_json.empty()) {
      // Has a default but is excluded: by an absent parent or by its `when`.
      EXPECT_FALSE(n.contains(ptr)) << k.path << " appears although it is excluded";
    }
  }
  EXPECT_GT(checked, 40);
}

TEST(ConfigDefaultsTest, EveryDefaultIsFilled) {
  CheckDefaults(R"({"train_batch_size": 8})", "");
}

TEST(ConfigDefaultsTest, OptimizerDefaultsFollowTheType) {
  CheckDefaults(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW"}})", "", "AdamW");
  CheckDefaults(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb"}})", "", "Lamb");
}

TEST(ConfigDefaultsTest, SchedulerDefaultsFollowTheType) {
  CheckDefaults(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR"}})", "WarmupLR");
  CheckDefaults(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                    "params": {"total_num_steps": 5000}}})",
                "WarmupDecayLR");
  CheckDefaults(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
                    "params": {"total_num_steps": 5000}}})",
                "WarmupCosineLR");
}

TEST(ConfigDefaultsTest, NormalizedKeysFollowTableOrder) {
  ordered_json n = ValidOrDie(R"({"strata": {"log_level": "warn"}, "aio": {"queue_depth": 4},
                                  "train_batch_size": 8})");
  std::vector<std::string> top;
  for (auto it = n.begin(); it != n.end(); ++it)
    top.push_back(it.key());
  EXPECT_EQ(top,
            (std::vector<std::string>{
                "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "steps_per_print", "seed", "optimizer", "fp16", "bf16",
                "zero_optimization", "aio", "wall_clock_breakdown", "strata"}));
}

}  // namespace
}  // namespace strata
