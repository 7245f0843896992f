// Config validation: every error path with its message, normalization, aliases,
// refused DeepSpeed keys, JSON syntax errors and duplicate keys.
#include "strata/core/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "config_test_util.h"

namespace strata {
namespace {

using nlohmann::ordered_json;
using testing_util::Contains;
using testing_util::OneError;
using testing_util::ValidOrDie;

const ordered_json& At(const ordered_json& doc, const std::string& pointer) {
  return doc.at(ordered_json::json_pointer(pointer));
}
bool Has(const ordered_json& doc, const std::string& pointer) {
  return doc.contains(ordered_json::json_pointer(pointer));
}

// ---------------------------------------------------------------------------
// Unknown keys

TEST(ConfigUnknownKeyTest, SuggestsTheClosestSibling) {
  ValidationResult r = ValidateConfigJson(
      R"({"train_batch_size": 8,
          "zero_optimization": {"offload_optimizer": {"pinmemory": true}}})");
  ASSERT_EQ(r.errors.size(), 1u) << r.ErrorsToString();
  EXPECT_EQ(r.errors[0].ToString(),
            "zero_optimization.offload_optimizer.pinmemory: unknown key; did you mean "
            "pin_memory?");
  EXPECT_EQ(r.errors[0].path, "zero_optimization.offload_optimizer.pinmemory");
  EXPECT_EQ(r.errors[0].line, 0);
  EXPECT_TRUE(r.normalized.is_null());
  EXPECT_EQ(r.ErrorsToString(), r.errors[0].ToString() + "\n");
}

TEST(ConfigUnknownKeyTest, TyposCaseAndSeparators) {
  EXPECT_TRUE(OneError(R"({"train_micro_batch_size_per_gpu": 2, "train_batch_sise": 8})",
                       "train_batch_sise", "unknown key; did you mean train_batch_size?"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"Queue-Depth": 8}})", "aio.Queue-Depth",
                       "did you mean queue_depth?"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"weightdecay": 0}}})",
                       "optimizer.params.weightdecay", "did you mean weight_decay?"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budgte": 0}})",
                       "strata.host_budgte", "did you mean host_budget?"));
}

TEST(ConfigUnknownKeyTest, KeyAtTheWrongLevelSuggestsTheFullPath) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "stage": 3})", "stage",
                       "unknown key here; did you mean zero_optimization.stage?"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"lr": 0.1}})", "optimizer.lr",
                       "did you mean optimizer.params.lr?"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"queue_depth": 8}})",
                       "zero_optimization.queue_depth", "did you mean aio.queue_depth?"));
  // A name that lives in two places names both.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"nvme_path": "/x"}})",
                       "zero_optimization.nvme_path",
                       "zero_optimization.offload_optimizer.nvme_path",
                       "zero_optimization.offload_param.nvme_path"));
  // Spelling variants at the wrong level too.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "Stage": 3})", "Stage",
                       "did you mean zero_optimization.stage?"));
  // Aliases count as names too.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "thread_count": 2})", "thread_count",
                       "did you mean aio.thread_count?"));
}

TEST(ConfigUnknownKeyTest, DottedKeysAreNotPaths) {
  // JSON keys are single components: "zero_optimization.stage" at the top is unknown.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization.stage": 3})",
                       "zero_optimization.stage", "unknown key",
                       R"({"zero_optimization": {"stage": ...}})"));
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "zero_optimization": {"offload_param.device": "cpu"}})",
               "zero_optimization.offload_param.device", "unknown key"));
}

TEST(ConfigUnknownKeyTest, NoCloseMatchListsKnownKeys) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"frobnicate": 1}})",
                       "zero_optimization.frobnicate",
                       "unknown key; known keys here: stage, contiguous_gradients, overlap_comm"));
  ValidationResult r = ValidateConfigJson(R"({"train_batch_size": 8, "aio": {"xyzzy_plugh": 1}})");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0].message,
            "unknown key; known keys here: block_size, queue_depth, intra_op_parallelism, "
            "single_submit, overlap_events");
}

TEST(ConfigUnknownKeyTest, UnknownObjectIsOneError) {
  // The keys inside an unknown object are not reported one by one.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zzz_custom": {"a": 1, "b": 2}})", "zzz_custom",
                       "unknown key"));
}

TEST(ConfigUnknownKeyTest, RefusedKeysAreNotSuggested) {
  // "pipeline" is a DeepSpeed key Strata refuses; suggesting it would be unhelpful.
  ValidationResult r = ValidateConfigJson(R"({"train_batch_size": 8, "pipelin": {}})");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_FALSE(Contains(r.errors[0].message, "pipeline"));
}

// ---------------------------------------------------------------------------
// Types

TEST(ConfigTypeTest, WrongTypes) {
  // bool
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "fp16": {"enabled": "yes"}})", "fp16.enabled",
                       "expected true or false, got string \"yes\""));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "fp16": {"enabled": 1}})", "fp16.enabled",
                       "expected true or false, got number 1"));
  // int
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "steps_per_print": "10"})", "steps_per_print",
                       "expected a whole number, got string \"10\""));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "steps_per_print": true})", "steps_per_print",
                       "expected a whole number, got boolean true"));
  // number
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "gradient_clipping": null})", "gradient_clipping",
                       "expected a number, got null"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "gradient_clipping": [1.0]})",
                       "gradient_clipping", "expected a number, got array [1.0]"));
  // strings (enum and paths)
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": 5}})", "optimizer.type",
                       "expected one of Adam, AdamW, Lamb, got number 5"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"offload_param":
                          {"device": "nvme", "nvme_path": 7}}})",
                       "zero_optimization.offload_param.nvme_path",
                       "expected a path or a list of paths, got number 7"));
  // object
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": 5})", "aio",
                       "expected an object ({...}), got number 5"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": []}})",
                       "optimizer.params", "expected an object ({...}), got array []"));
  // list
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": 0.9}}})",
                       "optimizer.params.betas", "expected a list of two numbers, got number 0.9"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": [0.9]}}})",
                       "optimizer.params.betas", "expected a list of two numbers"));
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": [0.9, 0.99, 0.999]}}})",
               "optimizer.params.betas", "expected a list of two numbers"));
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": ["0.9", "0.99"]}}})",
               "optimizer.params.betas", "expected a list of two numbers"));
  // bytes and bandwidth
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": true}})",
                       "strata.host_budget", "expected a byte size", "got boolean true"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"nvme_read_bandwidth": {}}})",
                       "strata.nvme_read_bandwidth", "expected bytes per second", "got object {}"));
}

TEST(ConfigTypeTest, LongValuesAreShortenedInMessages) {
  const std::string big(200, 'x');
  ValidationResult r =
      ValidateConfigJson(R"({"train_batch_size": 8, "fp16": {"enabled": ")" + big + R"("}})");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_LT(r.errors[0].message.size(), 120u) << r.errors[0].message;
  EXPECT_TRUE(Contains(r.errors[0].message, "..."));
}

TEST(ConfigTypeTest, AutoGetsAHint) {
  const std::string hint = "\"auto\" is a placeholder that the Hugging Face Trainer fills in";
  EXPECT_TRUE(OneError(R"({"train_micro_batch_size_per_gpu": "auto"})",
                       "train_micro_batch_size_per_gpu", "expected a whole number", hint));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"block_size": "auto"}})",
                       "aio.block_size", hint));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "auto"}})",
                       "optimizer.type", "is not one of Adam, AdamW, Lamb", hint));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "gradient_clipping": "auto"})",
                       "gradient_clipping", "expected a number", hint));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"nvme_read_bandwidth": "auto"}})",
                       "strata.nvme_read_bandwidth", hint));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": "auto"}})",
                       "strata.host_budget", "\"auto\": not a byte size", hint));
  // Other strings get no hint.
  ValidationResult r = ValidateConfigJson(R"({"train_batch_size": 8, "gradient_clipping": "1"})");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_FALSE(Contains(r.errors[0].message, "placeholder"));
}

// ---------------------------------------------------------------------------
// Enums

TEST(ConfigEnumTest, ValueNotAllowedListsTheChoices) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "SGD"}})", "optimizer.type",
                       "\"SGD\" is not one of Adam, AdamW, Lamb"));
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
      "zero_optimization.offload_optimizer.device", "\"disk\" is not one of none, cpu, nvme"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"log_level": "loud"}})",
                       "strata.log_level", "is not one of trace, debug, info, warn, error, off"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "CyclicLR"}})",
                       "scheduler.type",
                       "\"CyclicLR\" is not one of WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                       "OneCycle, LRRangeTest"));
  // OneCycle's bounds have no defaults (DeepSpeed's are positional arguments).
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle",
                           "params": {"cycle_max_lr": 0.1}}})",
                       "scheduler.params.cycle_min_lr",
                       "required when scheduler.type is OneCycle"));
}

TEST(ConfigEnumTest, CaseInsensitiveAndNormalized) {
  ordered_json n = ValidOrDie(R"({
    "train_batch_size": 8,
    "optimizer": {"type": "adamw"},
    "scheduler": {"type": "warmuplr"},
    "zero_optimization": {"offload_optimizer": {"device": "CPU"},
                          "offload_param": {"device": "NVMe", "nvme_path": "/nvme"}},
    "strata": {"log_level": "DEBUG"}})");
  EXPECT_EQ(At(n, "/optimizer/type"), "AdamW");
  EXPECT_EQ(At(n, "/scheduler/type"), "WarmupLR");
  EXPECT_EQ(At(n, "/zero_optimization/offload_optimizer/device"), "cpu");
  EXPECT_EQ(At(n, "/zero_optimization/offload_param/device"), "nvme");
  EXPECT_EQ(At(n, "/strata/log_level"), "debug");
  // The `when` conditions read the normalized spelling too.
  EXPECT_TRUE(Has(n, "/scheduler/params/warmup_max_lr"));
  EXPECT_FALSE(Has(n, "/scheduler/params/total_num_steps"));
}

// ---------------------------------------------------------------------------
// Numbers: ranges and whole numbers

TEST(ConfigRangeTest, MinMaxAndExclusiveMin) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 0})", "train_batch_size",
                       "0 is out of range; expected a value >= 1"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": -4})", "train_batch_size",
                       "-4 is out of range; expected a value >= 1"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"queue_depth": 5000}})",
                       "aio.queue_depth",
                       "5000 is out of range; expected a value between 1 and 4096"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"eps": 0}}})",
                       "optimizer.params.eps", "0 is out of range; expected a value > 0"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"lr": -0.1}}})",
                       "optimizer.params.lr", "-0.1 is out of range; expected a value >= 0"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"numa_node": -2}})",
                       "strata.numa_node",
                       "-2 is out of range; expected a value between -1 and 1023"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"stage": 4}})",
                       "zero_optimization.stage", "between 0 and 3"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "fp16": {"initial_scale_power": 64}})",
                       "fp16.initial_scale_power", "between 0 and 63"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "fp16": {"min_loss_scale": 0}})",
                       "fp16.min_loss_scale", "expected a value > 0"));
  // Bounds themselves are inside.
  ValidOrDie(R"({"train_batch_size": 1, "aio": {"queue_depth": 4096}, "strata": {"numa_node": -1},
                 "optimizer": {"params": {"eps": 1e-30}}})");
}

TEST(ConfigRangeTest, BetasEachInZeroToOne) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": [0.9, 1.0]}}})",
                       "optimizer.params.betas",
                       "element 1 = 1.0 is out of range; expected a value in [0, 1)"));
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": [-0.1, 0.9]}}})",
               "optimizer.params.betas", "element 0 = -0.1 is out of range"));
  ordered_json n =
      ValidOrDie(R"({"train_batch_size": 8, "optimizer": {"params": {"betas": [0, 0.95]}}})");
  EXPECT_EQ(At(n, "/optimizer/params/betas"), ordered_json::parse("[0.0, 0.95]"));
}

TEST(ConfigRangeTest, WholeNumbers) {
  // A count accepts 5e8 as DeepSpeed configs write it, and normalizes it to an integer.
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8, "zero_optimization":
      {"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5.0e7,
       "stage3_param_persistence_threshold": 0}})");
  EXPECT_EQ(At(n, "/zero_optimization/reduce_bucket_size"), 500000000);
  EXPECT_TRUE(At(n, "/zero_optimization/reduce_bucket_size").is_number_integer());
  EXPECT_EQ(At(n, "/zero_optimization/stage3_prefetch_bucket_size"), 50000000);
  EXPECT_EQ(At(n, "/zero_optimization/stage3_param_persistence_threshold"), 0);

  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 1.5}})",
               "zero_optimization.reduce_bucket_size",
               "expected a non-negative whole number, got number 1.5"));
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_parameters": -1}})",
      "zero_optimization.stage3_max_live_parameters", "expected a non-negative whole number"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "steps_per_print": 2.5})", "steps_per_print",
                       "expected a whole number, got number 2.5"));
  // 2.0 is a whole number.
  ordered_json m = ValidOrDie(R"({"train_batch_size": 8, "steps_per_print": 2.0})");
  EXPECT_EQ(At(m, "/steps_per_print"), 2);
  EXPECT_TRUE(At(m, "/steps_per_print").is_number_integer());
}

TEST(ConfigRangeTest, IntegersBeyond64BitsAreRefusedNotWrapped) {
  EXPECT_FALSE(ValidateConfigJson(R"({"train_batch_size": 8, "zero_optimization":
      {"stage3_max_live_parameters": 9223372036854775808}})")
                   .ok());
  EXPECT_FALSE(ValidateConfigJson(R"({"train_batch_size": 18446744073709551615})").ok());
  EXPECT_FALSE(ValidateConfigJson(R"({"train_batch_size": 8, "seed": 1e300})").ok());
  // The largest int64 is fine.
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8, "zero_optimization":
      {"stage3_model_persistence_threshold": 9223372036854775807}})");
  EXPECT_EQ(At(n, "/zero_optimization/stage3_model_persistence_threshold").get<int64_t>(),
            INT64_MAX);
}

TEST(ConfigRangeTest, IntFieldsFitTheirTypedFields) {
  // buffer_count and hysteresis are ints in the typed Config; a value that does not fit
  // is refused instead of being truncated.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer":
                          {"buffer_count": 4294967297}}})",
                       "zero_optimization.offload_optimizer.buffer_count", "out of range"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "fp16": {"hysteresis": 4294967298}})",
                       "fp16.hysteresis", "out of range"));
}

// ---------------------------------------------------------------------------
// Bytes and bandwidth

TEST(ConfigBytesTest, StringsAndNumbersNormalizedToBytes) {
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8,
      "strata": {"host_budget": "512MiB", "device_budget": "1.5G"},
      "aio": {"block_size": "1 MiB"}})");
  EXPECT_EQ(At(n, "/strata/host_budget"), 536870912);
  EXPECT_EQ(At(n, "/strata/device_budget"), 1610612736);
  EXPECT_EQ(At(n, "/aio/block_size"), 1048576);
  ordered_json m = ValidOrDie(
      R"({"train_batch_size": 8, "strata": {"host_budget": 1e9, "device_budget": 8589934592}})");
  EXPECT_EQ(At(m, "/strata/host_budget"), 1000000000);
  EXPECT_EQ(At(m, "/strata/device_budget"), 8589934592);
  // A large integer is kept exactly (not rounded through a double).
  ordered_json big =
      ValidOrDie(R"({"train_batch_size": 8, "strata": {"host_budget": 9007199254740993}})");
  EXPECT_EQ(At(big, "/strata/host_budget").get<uint64_t>(), 9007199254740993u);
}

TEST(ConfigBytesTest, BadByteSizes) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": "12XB"}})",
                       "strata.host_budget", "\"12XB\": unknown unit \"xb\""));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": "lots"}})",
                       "strata.host_budget", "\"lots\": not a byte size"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": "1.3K"}})",
                       "strata.host_budget", "not a whole number of bytes"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": -5}})",
                       "strata.host_budget", "-5", "cannot be negative"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": 0.5}})",
                       "strata.host_budget", "0.5 is not a whole number of bytes"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"host_budget": "20EiB"}})",
                       "strata.host_budget", "beyond 2^64-1"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"block_size": "2KiB"}})",
                       "aio.block_size",
                       "\"2KiB\" (2 KiB) is out of range; expected a value between 4096 and "
                       "1073741824"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"block_size": "2GiB"}})",
                       "aio.block_size", "out of range"));
}

TEST(ConfigBytesTest, BlockSizeMultipleOf4096) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"block_size": 6000}})", "aio.block_size",
                       "6000 is not a multiple of 4096 (O_DIRECT alignment)"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"block_size": "1MB"}})", "aio.block_size",
                       "1000000 is not a multiple of 4096"));
  ValidOrDie(R"({"train_batch_size": 8, "aio": {"block_size": "8K"}})");
}

TEST(ConfigBandwidthTest, StringsAndNumbers) {
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8,
      "strata": {"nvme_read_bandwidth": "6.5GB/s", "nvme_write_bandwidth": "800 MiB/s"}})");
  EXPECT_DOUBLE_EQ(At(n, "/strata/nvme_read_bandwidth").get<double>(), 6.5e9);
  EXPECT_DOUBLE_EQ(At(n, "/strata/nvme_write_bandwidth").get<double>(), 800.0 * 1024 * 1024);
  ordered_json m = ValidOrDie(R"({"train_batch_size": 8, "strata": {"nvme_read_bandwidth": 3e9}})");
  EXPECT_DOUBLE_EQ(At(m, "/strata/nvme_read_bandwidth").get<double>(), 3e9);

  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"nvme_read_bandwidth": -1}})",
                       "strata.nvme_read_bandwidth", "-1: a bandwidth cannot be negative"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"nvme_read_bandwidth": "fast"}})",
                       "strata.nvme_read_bandwidth", "\"fast\""));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "strata": {"nvme_read_bandwidth": "-2GB/s"}})",
                       "strata.nvme_read_bandwidth", "negative"));
}

// ---------------------------------------------------------------------------
// nvme_path

constexpr char kNvmeOpt[] = "zero_optimization.offload_optimizer.nvme_path";

std::string WithOptimizerOffload(const std::string& offload_fields) {
  return R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {)" +
         offload_fields + "}}}";
}

TEST(ConfigNvmePathTest, StringBecomesAList) {
  ordered_json n = ValidOrDie(WithOptimizerOffload(R"("device": "nvme", "nvme_path": "/nvme0")"));
  EXPECT_EQ(At(n, "/zero_optimization/offload_optimizer/nvme_path"),
            ordered_json::parse(R"(["/nvme0"])"));
}

TEST(ConfigNvmePathTest, ListIsKept) {
  ordered_json n = ValidOrDie(
      WithOptimizerOffload(R"("device": "nvme", "nvme_path": ["/nvme0/swap", "/nvme1/swap"])"));
  EXPECT_EQ(At(n, "/zero_optimization/offload_optimizer/nvme_path"),
            ordered_json::parse(R"(["/nvme0/swap", "/nvme1/swap"])"));
}

TEST(ConfigNvmePathTest, Errors) {
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme", "nvme_path": [])"), kNvmeOpt,
                       "an empty list; give at least one directory"));
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme", "nvme_path": "")"), kNvmeOpt,
                       "an empty path"));
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme", "nvme_path": ["/a", "/b", "/a"])"),
                       kNvmeOpt, "\"/a\" is listed twice"));
  // The same directory spelled differently is the same directory.
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme", "nvme_path": ["/a/b", "/a//b/"])"),
                       kNvmeOpt, "listed twice"));
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme", "nvme_path": ["/a", 3])"),
                       kNvmeOpt, "expected a path or a list of paths (strings)"));
}

TEST(ConfigNvmePathTest, PathWithoutNvmeDevice) {
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "cpu", "nvme_path": "/nvme0")"), kNvmeOpt,
                       "set, but zero_optimization.offload_optimizer.device is \"cpu\"",
                       "set device to \"nvme\" or remove nvme_path"));
  // device defaults to none.
  EXPECT_TRUE(
      OneError(WithOptimizerOffload(R"("nvme_path": "/nvme0")"), kNvmeOpt, "device is \"none\""));
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "zero_optimization": {"offload_param": {"nvme_path": "/p"}}})",
      "zero_optimization.offload_param.nvme_path", "device is \"none\""));
}

TEST(ConfigNvmePathTest, NvmeDeviceWithoutPath) {
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme")"), kNvmeOpt,
                       "required when zero_optimization.offload_optimizer.device is nvme"));
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "zero_optimization": {"offload_param": {"device": "nvme"}}})",
      "zero_optimization.offload_param.nvme_path",
      "required when zero_optimization.offload_param.device is nvme"));
  // A given-but-invalid path is reported once, not also as missing.
  EXPECT_TRUE(OneError(WithOptimizerOffload(R"("device": "nvme", "nvme_path": 5)"), kNvmeOpt,
                       "expected a path"));
}

// ---------------------------------------------------------------------------
// Aliases

TEST(ConfigAliasTest, AliasIsResolvedToTheCanonicalKey) {
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8, "aio": {"thread_count": 4},
      "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": true}})");
  EXPECT_EQ(At(n, "/aio/intra_op_parallelism"), 4);
  EXPECT_FALSE(Has(n, "/aio/thread_count"));
  EXPECT_EQ(At(n, "/zero_optimization/stage3_gather_16bit_weights_on_model_save"), true);
  EXPECT_FALSE(Has(n, "/zero_optimization/stage3_gather_fp16_weights_on_model_save"));

  const KeySpec* k = FindConfigKey("aio.thread_count");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->path, "aio.intra_op_parallelism");
  EXPECT_EQ(FindConfigKey("aio.intra_op_parallelism"), k);
  EXPECT_EQ(FindConfigKey("thread_count"), nullptr);
  EXPECT_EQ(FindConfigKey("aio.nope"), nullptr);
}

TEST(ConfigAliasTest, AliasIsValidatedLikeTheKey) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"thread_count": 0}})", "aio.thread_count",
                       "0 is out of range; expected a value between 1 and 256"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"thread_count": "two"}})",
                       "aio.thread_count", "expected a whole number"));
}

TEST(ConfigAliasTest, AliasAndCanonicalBothGiven) {
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "aio": {"thread_count": 2, "intra_op_parallelism": 2}})",
               "aio.thread_count",
               "both intra_op_parallelism and its alias thread_count are given; keep one"));
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
          "stage3_gather_fp16_weights_on_model_save": true}})",
      "zero_optimization.stage3_gather_fp16_weights_on_model_save", "both", "keep one"));
}

// ---------------------------------------------------------------------------
// DeepSpeed keys that Strata refuses

TEST(ConfigNotSupportedTest, RefusedWhenTheyAskForSomething) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("zero_optimization": {"zero_quantized_weights": true})",
       "zero_optimization.zero_quantized_weights"},
      {R"("zero_optimization": {"zero_quantized_gradients": true})",
       "zero_optimization.zero_quantized_gradients"},
      {R"("zero_optimization": {"mics_shard_size": 4})", "zero_optimization.mics_shard_size"},
      {R"("zero_optimization": {"cpu_offload": true})", "zero_optimization.cpu_offload"},
      {R"("aio": {"use_gds": true})", "aio.use_gds"},
      {R"("zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}})",
       "zero_optimization.offload_optimizer.ratio"},
      {R"("pipeline": {"stages": 2})", "pipeline"},
      {R"("pipeline": {})", "pipeline"},
      {R"("activation_checkpointing": {"partition_activations": true})",
       "activation_checkpointing.partition_activations"},
      {R"("activation_checkpointing": {"partition_activations": false, "number_checkpoints": 4})",
       "activation_checkpointing.number_checkpoints"},
      {R"("activation_checkpointing": {"contiguous_memory_optimization": true})",
       "activation_checkpointing.contiguous_memory_optimization"},
      {R"("activation_checkpointing": {"synchronize_checkpoint_boundary": true})",
       "activation_checkpointing.synchronize_checkpoint_boundary"},
      {R"("activation_checkpointing": {"profile": true})", "activation_checkpointing.profile"},
      {R"("zero_optimization": {"allgather_partitions": false})",
       "zero_optimization.allgather_partitions"},
      {R"("zero_optimization": {"load_from_fp32_weights": false})",
       "zero_optimization.load_from_fp32_weights"},
      {R"("zero_allow_untested_optimizer": true)", "zero_allow_untested_optimizer"},
      {R"("data_types": {"grad_accum_dtype": "bf16"})", "data_types"},
      {R"("amp": {"enabled": true})", "amp"},
      {R"("flops_profiler": {"enabled": true})", "flops_profiler"},
      {R"("flops_profiler": {"profile_step": 1})", "flops_profiler"},
      {R"("communication_data_type": "fp32")", "communication_data_type"},
      {R"("optimizer": {"params": {"amsgrad": true}})", "optimizer.params.amsgrad"},
      {R"("fp16": {"auto_cast": true})", "fp16.auto_cast"},
  };
  for (const auto& [fields, path] : cases) {
    EXPECT_TRUE(OneError(R"({"train_batch_size": 8, )" + fields + "}", path,
                         "not supported by Strata: ", "; remove the key"))
        << fields;
  }
  // The reason is part of the message.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "aio": {"use_gds": true}})", "aio.use_gds",
                       "not supported by Strata: GPUDirect Storage is not implemented"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "pipeline": {}})", "pipeline",
                       "pipeline parallelism is not implemented"));
  // DeepSpeed's activation checkpointing section: each setting by name, with what to use
  // (cpu_checkpointing is supported: ConfigActivationCheckpointingTest).
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "activation_checkpointing": {"partition_activations": true}})",
      "activation_checkpointing.partition_activations", "strata::checkpoint"));
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpoint": false}})",
               "activation_checkpointing.cpu_checkpoint", "unknown key"));
}

TEST(ConfigNotSupportedTest, AcceptedWhenInert) {
  ordered_json n = ValidOrDie(R"({
    "train_batch_size": 8,
    "flops_profiler": {"enabled": false, "profile_step": 1, "detailed": true},
    "zero_optimization": {"zero_quantized_weights": false, "mics_shard_size": -1,
                          "zero_hpz_partition_size": 1,
                          "allgather_partitions": true, "ignore_unused_parameters": true,
                          "load_from_fp32_weights": true, "elastic_checkpoint": false,
                          "offload_optimizer": {"device": "cpu", "ratio": 1.0}},
    "aio": {"use_gds": false},
    "prescale_gradients": false,
    "gradient_predivide_factor": 1,
    "zero_allow_untested_optimizer": false,
    "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false,
                                 "number_checkpoints": null}})");
  // Inert keys ask for nothing and are left out of the normalized document.
  EXPECT_FALSE(Has(n, "/flops_profiler"));
  EXPECT_FALSE(Has(n, "/zero_optimization/zero_quantized_weights"));
  EXPECT_FALSE(Has(n, "/zero_optimization/mics_shard_size"));
  EXPECT_FALSE(Has(n, "/zero_optimization/offload_optimizer/ratio"));
  EXPECT_FALSE(Has(n, "/aio/use_gds"));
  // Of the activation checkpointing section only the supported key stays.
  EXPECT_EQ(n["activation_checkpointing"], ordered_json::parse(R"({"cpu_checkpointing": false})"));
  EXPECT_FALSE(Has(n, "/zero_optimization/allgather_partitions"));
}

TEST(ConfigActivationCheckpointingTest, CpuCheckpointingIsReadAndOffByDefault) {
  Result<Config> c = ParseConfig(
      R"({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": true}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->activation_checkpointing.cpu_checkpointing);
  c = ParseConfig(R"({"train_batch_size": 8})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->activation_checkpointing.cpu_checkpointing);
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": "yes"}})",
      "activation_checkpointing.cpu_checkpointing", "expected"));
}

TEST(ConfigNotSupportedTest, InertNeedsTheRightType) {
  // "false" as a string is not false.
  EXPECT_TRUE(OneError(
      R"({"train_batch_size": 8, "zero_optimization": {"zero_quantized_weights": "false"}})",
      "zero_optimization.zero_quantized_weights", "not supported by Strata"));
}

// ---------------------------------------------------------------------------
// Scheduler

TEST(ConfigSchedulerTest, ParamsThatDoNotBelongToTheType) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR",
                          "params": {"total_num_steps": 100}}})",
                       "scheduler.params.total_num_steps",
                       "not a parameter of scheduler.type WarmupLR (it applies to WarmupDecayLR, "
                       "WarmupCosineLR)"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 10000, "warmup_max_lr": 0.1}}})",
                       "scheduler.params.warmup_max_lr",
                       "not a parameter of scheduler.type WarmupCosineLR"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                          "params": {"total_num_steps": 10000, "cos_min_ratio": 0.1}}})",
                       "scheduler.params.cos_min_ratio", "it applies to WarmupCosineLR"));
}

TEST(ConfigSchedulerTest, TypeIsRequired) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"params": {}}})", "scheduler.type",
                       "required in scheduler"));
  EXPECT_TRUE(
      OneError(R"({"train_batch_size": 8, "scheduler": {}})", "scheduler.type", "required"));
}

TEST(ConfigSchedulerTest, TotalNumStepsRequiredForDecayingSchedules) {
  for (const char* type : {"WarmupDecayLR", "WarmupCosineLR"}) {
    EXPECT_TRUE(OneError(
        std::string(R"({"train_batch_size": 8, "scheduler": {"type": ")") + type + R"("}})",
        "scheduler.params.total_num_steps",
        "required when scheduler.type is WarmupDecayLR or WarmupCosineLR"))
        << type;
  }
}

TEST(ConfigSchedulerTest, TotalBelowWarmup) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                          "params": {"total_num_steps": 100, "warmup_num_steps": 200}}})",
                       "scheduler.params.total_num_steps",
                       "100 is less than warmup_num_steps 200; the schedule must end after "
                       "warm-up"));
  // Against the default warm-up of 1000 steps too.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 500}}})",
                       "scheduler.params.total_num_steps",
                       "less than warmup_num_steps 1000 (the default)"));
}

TEST(ConfigSchedulerTest, DefaultsDependOnTheType) {
  ordered_json lr = ValidOrDie(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR"}})");
  EXPECT_EQ(At(lr, "/scheduler/params"),
            ordered_json::parse(R"({"warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1})"));
  ordered_json cos = ValidOrDie(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
      "params": {"total_num_steps": 5000, "warmup_type": "LINEAR"}}})");
  EXPECT_EQ(At(cos, "/scheduler/params"),
            ordered_json::parse(R"({"warmup_num_steps": 1000, "warmup_type": "linear",
                "total_num_steps": 5000, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001,
                "last_batch_iteration": -1})"));
  // No scheduler: none in the output.
  ordered_json none = ValidOrDie(R"({"train_batch_size": 8})");
  EXPECT_FALSE(Has(none, "/scheduler"));
}

TEST(ConfigSchedulerTest, BadTypeIsReportedOnce) {
  // An unknown type makes every parameter's `when` unknown; only the type is reported.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "scheduler": {"type": "Cyclic",
                          "params": {"warmup_max_lr": 0.1, "total_num_steps": 10}}})",
                       "scheduler.type", "is not one of"));
}

// ---------------------------------------------------------------------------
// Cross-key checks

TEST(ConfigCrossTest, Fp16AndBf16) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "fp16": {"enabled": true},
                          "bf16": {"enabled": true}})",
                       "bf16.enabled", "fp16 and bf16 are both enabled; enable one"));
  ValidOrDie(R"({"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": false}})");
  ValidOrDie(R"({"train_batch_size": 8, "fp16": {"enabled": false}, "bf16": {"enabled": true}})");
}

TEST(ConfigCrossTest, StagesOneToThreeAndParamOffloadOnlyInStage3) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "zero_optimization": {"stage": 0}})",
                       "zero_optimization.stage", "stage 0 (plain data parallelism"));
  for (int stage : {1, 2, 3}) {
    const std::string z =
        R"({"train_batch_size": 8, "zero_optimization": {"stage": )" + std::to_string(stage);
    Result<Config> c = ParseConfig(z + R"(, "offload_optimizer": {"device": "cpu"}}})");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->zero.stage, stage);
    const std::string with_param = z + R"(, "offload_param": {"device": "cpu"}}})";
    if (stage == 3) {
      ValidOrDie(with_param);
    } else {
      EXPECT_TRUE(OneError(with_param, "zero_optimization.offload_param.device",
                           "\"cpu\" with stage " + std::to_string(stage) +
                               ": stages 1 and 2 keep every parameter on each rank's device"));
    }
  }
}

TEST(ConfigCrossTest, TheEarlyStepNeedsWhatItCannotWaitFor) {
  const std::string base = R"({"train_batch_size": 8, )";
  const std::string early = R"("strata": {"early_step": true, "skip_inf_nan_steps": false})";
  Result<Config> c = ParseConfig(base + early + "}");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->strata.early_step);
  EXPECT_FALSE(c->strata.skip_inf_nan_steps);
  // Defaults: off, and inf/NaN steps skipped.
  Result<Config> d = ParseConfig(R"({"train_batch_size": 8})");
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->strata.early_step);
  EXPECT_TRUE(d->strata.skip_inf_nan_steps);
  EXPECT_TRUE(OneError(base + R"("strata": {"early_step": true}})", "strata.early_step",
                       "true with strata.skip_inf_nan_steps true"));
  EXPECT_TRUE(OneError(base + R"("gradient_clipping": 1.0, )" + early + "}", "strata.early_step",
                       "true with gradient_clipping 1.0"));
  EXPECT_TRUE(OneError(base + R"("bf16": {"enabled": true}, "strata": {"early_step": true,
                          "skip_inf_nan_steps": false, "pipeline_step": false}})",
                       "strata.early_step", "true with strata.pipeline_step false"));
  EXPECT_TRUE(OneError(base + R"("optimizer": {"type": "lamb"}, )" + early + "}",
                       "strata.early_step", "true with optimizer.type Lamb"));
  EXPECT_TRUE(OneError(base + R"("zero_optimization": {"stage": 3, "offload_optimizer":
                          {"device": "nvme", "nvme_path": "/tmp"}}, )" +
                           early + "}",
                       "strata.early_step",
                       "true with zero_optimization.offload_optimizer.device nvme"));
  // fp16: both keys are refused (its loss scale skips overflowed steps).
  ValidationResult fp16 = ValidateConfigJson(base + R"("fp16": {"enabled": true}, )" + early + "}");
  ASSERT_EQ(fp16.errors.size(), 2u);
  EXPECT_EQ(fp16.errors[0].path, "strata.skip_inf_nan_steps");
  EXPECT_EQ(fp16.errors[1].path, "strata.early_step");
}

TEST(ConfigCrossTest, TheDelayedUpdateNeedsAPipelinedStepOffNvme) {
  const std::string base = R"({"train_batch_size": 8, )";
  Result<Config> c =
      ParseConfig(base + R"("strata": {"delayed_update": true, "delayed_update_warmup": 3}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->strata.delayed_update);
  EXPECT_EQ(c->strata.delayed_update_warmup, 3);
  // Defaults: off, 40 exact steps first.
  Result<Config> d = ParseConfig(R"({"train_batch_size": 8})");
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->strata.delayed_update);
  EXPECT_EQ(d->strata.delayed_update_warmup, 40);
  EXPECT_TRUE(OneError(base + R"("strata": {"delayed_update": true, "pipeline_step": false}})",
                       "strata.delayed_update", "true with strata.pipeline_step false"));
  EXPECT_TRUE(OneError(base + R"("strata": {"delayed_update": true, "early_step": true,
                          "skip_inf_nan_steps": false}})",
                       "strata.delayed_update", "true with strata.early_step true"));
  EXPECT_TRUE(
      OneError(base + R"("optimizer": {"type": "lamb"}, "strata": {"delayed_update": true}})",
               "strata.delayed_update", "true with optimizer.type Lamb"));
  EXPECT_TRUE(OneError(base + R"("zero_optimization": {"stage": 3, "offload_param":
                          {"device": "nvme", "nvme_path": "/tmp"}}, "strata": {"delayed_update": true}})",
                       "strata.delayed_update",
                       "true with zero_optimization.offload_param.device nvme"));
  EXPECT_TRUE(OneError(base + R"("strata": {"delayed_update_warmup": -1}})",
                       "strata.delayed_update_warmup", ""));
}

TEST(ConfigCrossTest, AdamWNeedsDecoupledDecay) {
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
                          "params": {"adam_w_mode": false}}})",
                       "optimizer.params.adam_w_mode", "false contradicts optimizer.type AdamW"));
  // Adam with L2 decay is fine.
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8, "optimizer": {"type": "Adam",
                                  "params": {"adam_w_mode": false, "weight_decay": 0.01}}})");
  EXPECT_EQ(At(n, "/optimizer/params/adam_w_mode"), false);
}

TEST(ConfigCrossTest, LambTakesItsOwnParametersAndNotAdamsOrTheOtherWayRound) {
  // DeepSpeed's FusedLamb keys, case-insensitive type, defaults filled.
  ordered_json n = ValidOrDie(R"({"train_batch_size": 8, "optimizer": {"type": "lamb",
                                  "params": {"lr": 0.002, "weight_decay": 0.01,
                                             "max_coeff": 0.3, "max_grad_norm": 0.0}}})");
  EXPECT_EQ(At(n, "/optimizer/type"), "Lamb");
  EXPECT_EQ(At(n, "/optimizer/params/max_coeff"), 0.3);
  EXPECT_EQ(At(n, "/optimizer/params/min_coeff"), 0.01);
  EXPECT_EQ(At(n, "/optimizer/params/eps_inside_sqrt"), false);
  EXPECT_FALSE(n["optimizer"]["params"].contains("adam_w_mode"));
  Result<Config> c = ParseConfig(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb",
                                     "params": {"min_coeff": 0.1, "eps_inside_sqrt": true}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->optimizer.type, OptimizerType::kLamb);
  EXPECT_EQ(c->optimizer.min_coeff, 0.1);
  EXPECT_EQ(c->optimizer.max_coeff, 10.0);
  EXPECT_TRUE(c->optimizer.eps_inside_sqrt);
  // Adam's (default type too) refuses LAMB's keys, and LAMB refuses adam_w_mode.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"params": {"max_coeff": 1}}})",
                       "optimizer.params.max_coeff",
                       "not a parameter of optimizer.type Adam (it applies to Lamb)"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
                          "params": {"eps_inside_sqrt": true}}})",
                       "optimizer.params.eps_inside_sqrt", "it applies to Lamb"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb",
                          "params": {"adam_w_mode": true}}})",
                       "optimizer.params.adam_w_mode", "not a parameter of optimizer.type Lamb"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb",
                          "params": {"min_coeff": 2.0, "max_coeff": 1.0}}})",
                       "optimizer.params.min_coeff", "is above max_coeff 1.0"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb",
                          "params": {"max_grad_norm": 1.0}}})",
                       "optimizer.params.max_grad_norm", "use gradient_clipping"));
  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "optimizer": {"type": "Lamb",
                          "params": {"min_coeff": -1}}})",
                       "optimizer.params.min_coeff", ">= 0"));
}

// ---------------------------------------------------------------------------
// JSON syntax and structure

TEST(ConfigSyntaxTest, SyntaxErrorHasLineAndColumn) {
  const std::string doc =
      "{\n"
      "  \"train_batch_size\": 8,\n"
      "  \"fp16\": @\n"
      "}\n";
  ValidationResult r = ValidateConfigJson(doc);
  ASSERT_EQ(r.errors.size(), 1u) << r.ErrorsToString();
  const ConfigError& e = r.errors[0];
  EXPECT_EQ(e.line, 3);
  EXPECT_EQ(e.column, 11);  // the '@'
  EXPECT_EQ(e.path, "");
  EXPECT_TRUE(Contains(e.message, "JSON syntax error: "));
  EXPECT_TRUE(Contains(e.message, "invalid literal"));
  EXPECT_FALSE(Contains(e.message, "[json.exception")) << "nlohmann's prefix leaks: " << e.message;
  EXPECT_EQ(e.ToString().rfind("line 3, column 11: JSON syntax error: ", 0), 0u) << e.ToString();
  EXPECT_TRUE(r.normalized.is_null());
}

TEST(ConfigSyntaxTest, MissingCommaPointsIntoTheNextKey) {
  const std::string doc =
      "{\n"
      "  \"train_batch_size\": 8\n"
      "  \"steps_per_print\": 10\n"
      "}\n";
  ValidationResult r = ValidateConfigJson(doc);
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0].line, 3);
  EXPECT_GE(r.errors[0].column, 3);   // the key starts at column 3 ...
  EXPECT_LE(r.errors[0].column, 19);  // ... and ends at column 19
}

TEST(ConfigSyntaxTest, NewlineInsideAStringStaysOnItsLine) {
  const std::string doc =
      "{\n"
      "  \"train_batch_size\": 8,\n"
      "  \"strata\": {\"log_level\": \"inf\n"
      "}}\n";
  ValidationResult r = ValidateConfigJson(doc);
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0].line, 3);
  EXPECT_EQ(r.errors[0].column, 31);
}

TEST(ConfigSyntaxTest, TrailingCommaAndEmptyInput) {
  ValidationResult trailing = ValidateConfigJson("{\"train_batch_size\": 8,\n}");
  ASSERT_EQ(trailing.errors.size(), 1u);
  EXPECT_EQ(trailing.errors[0].line, 2);
  EXPECT_EQ(trailing.errors[0].column, 1);

  ValidationResult empty = ValidateConfigJson("");
  ASSERT_EQ(empty.errors.size(), 1u);
  EXPECT_EQ(empty.errors[0].line, 1);
  EXPECT_EQ(empty.errors[0].column, 1);
  EXPECT_TRUE(Contains(empty.errors[0].message, "unexpected end of input"));

  // Comments are not JSON (DeepSpeed's reader refuses them too).
  ValidationResult comment = ValidateConfigJson("{\"train_batch_size\": 8 // batch\n}");
  ASSERT_EQ(comment.errors.size(), 1u);
  EXPECT_EQ(comment.errors[0].line, 1);
}

TEST(ConfigSyntaxTest, NumberOverflowIsAnErrorNotACrash) {
  // nlohmann throws out_of_range (not parse_error) for these.
  ValidationResult r = ValidateConfigJson("{\n  \"train_batch_size\": 8,\n  \"seed\": 1e400\n}");
  ASSERT_EQ(r.errors.size(), 1u) << r.ErrorsToString();
  EXPECT_TRUE(Contains(r.errors[0].message, "number overflow parsing '1e400'"));
  EXPECT_EQ(r.errors[0].line, 3);
  EXPECT_EQ(r.errors[0].column, 11);
  EXPECT_FALSE(Contains(r.errors[0].message, "[json.exception"));
  EXPECT_FALSE(ValidateConfigJson(R"({"train_batch_size": -1e999})").ok());
  // An integer beyond 64 bits is read as a float by the parser, then refused.
  EXPECT_TRUE(OneError(R"({"train_batch_size": 99999999999999999999999})", "train_batch_size",
                       "out of range"));
}

TEST(ConfigSyntaxTest, DuplicateKeysNameTheirPath) {
  ValidationResult r = ValidateConfigJson(R"({
    "train_batch_size": 8,
    "aio": {"queue_depth": 8, "queue_depth": 16},
    "zero_optimization": {"offload_param": {"device": "cpu", "device": "cpu"}}})");
  ASSERT_EQ(r.errors.size(), 2u) << r.ErrorsToString();
  EXPECT_EQ(r.errors[0].path, "aio.queue_depth");
  EXPECT_TRUE(Contains(r.errors[0].message, "duplicate key"));
  EXPECT_EQ(r.errors[1].path, "zero_optimization.offload_param.device");
  EXPECT_TRUE(Contains(r.errors[1].message, "duplicate key"));
  EXPECT_TRUE(r.normalized.is_null());

  EXPECT_TRUE(OneError(R"({"train_batch_size": 8, "train_batch_size": 8})", "train_batch_size",
                       "duplicate key"));
}

TEST(ConfigSyntaxTest, DuplicateKeysInsideArraysAndSameNameInSiblings) {
  // Same key in two different objects is fine.
  ValidOrDie(R"({"train_batch_size": 8, "fp16": {"enabled": false}, "bf16": {"enabled": false}})");
  // Inside an object inside an array (not part of the schema, but still a duplicate).
  ValidationResult r =
      ValidateConfigJson(R"({"train_batch_size": 8, "extra": [{"a": 1, "a": 2}]})");
  bool dup = false, unknown = false;
  for (const ConfigError& e : r.errors) {
    if (e.path == "extra[].a" && Contains(e.message, "duplicate key")) dup = true;
    if (e.path == "extra" && Contains(e.message, "unknown key")) unknown = true;
  }
  EXPECT_TRUE(dup) << r.ErrorsToString();
  EXPECT_TRUE(unknown) << r.ErrorsToString();
}

TEST(ConfigSyntaxTest, TopLevelMustBeAnObject) {
  for (const char* doc : {"[1, 2]", "5", "\"config\"", "null", "true"}) {
    ValidationResult r = ValidateConfigJson(doc);
    ASSERT_EQ(r.errors.size(), 1u) << doc;
    EXPECT_EQ(r.errors[0].path, "");
    EXPECT_TRUE(
        Contains(r.errors[0].message, "the configuration must be a JSON object ({...}), got"))
        << doc;
    EXPECT_EQ(r.errors[0].ToString(), r.errors[0].message);
  }
  EXPECT_TRUE(Contains(ValidateConfigJson("[1, 2]").errors[0].message, "got array [1,2]"));
}

TEST(ConfigSyntaxTest, AllErrorsAreReportedAtOnce) {
  ValidationResult r = ValidateConfigJson(R"({
    "train_batch_size": 8,
    "steps_per_print": "often",
    "aio": {"queue_depth": 0},
    "zero_optimization": {"offload_optimizer": {"pinmemory": true}}})");
  ASSERT_EQ(r.errors.size(), 3u) << r.ErrorsToString();
  std::vector<std::string> paths;
  for (const ConfigError& e : r.errors)
    paths.push_back(e.path);
  EXPECT_NE(std::find(paths.begin(), paths.end(), "steps_per_print"), paths.end());
  EXPECT_NE(std::find(paths.begin(), paths.end(), "aio.queue_depth"), paths.end());
  EXPECT_NE(std::find(paths.begin(), paths.end(), "zero_optimization.offload_optimizer.pinmemory"),
            paths.end());
  const std::string all = r.ErrorsToString();
  EXPECT_EQ(std::count(all.begin(), all.end(), '\n'), 3);

  // Errors of every kind together: parse-level duplicates, per-key and cross-key checks.
  ValidationResult mixed = ValidateConfigJson(R"({
    "train_batch_size": 8, "seed": 1, "seed": 2,
    "fp16": {"enabled": true}, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 0},
    "pipeline": {"stages": 2}})");
  EXPECT_EQ(mixed.errors.size(), 4u) << mixed.ErrorsToString();
}

TEST(ConfigErrorTest, ToStringForms) {
  EXPECT_EQ((ConfigError{"a.b", "bad"}).ToString(), "a.b: bad");
  EXPECT_EQ((ConfigError{"", "bad"}).ToString(), "bad");
  EXPECT_EQ((ConfigError{"", "bad", 3, 7}).ToString(), "line 3, column 7: bad");
}

// ---------------------------------------------------------------------------
// The key table itself

TEST(ConfigKeysTest, TableIsWellFormed) {
  std::set<std::string> seen;
  for (const KeySpec& k : ConfigKeys()) {
    const std::string path(k.path);
    EXPECT_TRUE(seen.insert(path).second) << "duplicate " << path;
    const size_t dot = path.rfind('.');
    if (dot != std::string::npos) {
      EXPECT_TRUE(seen.count(path.substr(0, dot))) << path << " listed before its parent";
    }
    EXPECT_FALSE(k.meaning.empty()) << path;
    EXPECT_EQ(FindConfigKey(k.path), &k) << path;
    if (!k.default_json.empty()) {
      EXPECT_TRUE(nlohmann::json::accept(k.default_json)) << path;
      EXPECT_TRUE(k.not_supported.empty()) << path << ": a refused key with a default";
    }
    if (!k.inert_json.empty()) {
      EXPECT_TRUE(nlohmann::json::accept(k.inert_json)) << path;
      EXPECT_FALSE(k.not_supported.empty()) << path;
    }
    if (k.type == KeyType::kEnum) {
      EXPECT_FALSE(k.choices.empty()) << path;
    }
    if (!k.when_key.empty()) {
      const KeySpec* cond = FindConfigKey(k.when_key);
      ASSERT_NE(cond, nullptr) << path;
      EXPECT_EQ(cond->type, KeyType::kEnum) << path;
      for (size_t start = 0;;) {
        const size_t bar = k.when_values.find('|', start);
        const std::string_view v = k.when_values.substr(start, bar - start);
        EXPECT_NE(cond->choices.find(v), std::string_view::npos) << path << ": " << v;
        if (bar == std::string_view::npos) break;
        start = bar + 1;
      }
    }
    EXPECT_FALSE(KeyTypeName(k.type).empty());
  }
}

TEST(ConfigKeysTest, DefaultsValidateAgainstTheirOwnRows) {
  // Each default, given explicitly, is accepted (for keys whose parents exist by default).
  for (const KeySpec& k : ConfigKeys()) {
    if (k.default_json.empty() || k.type == KeyType::kObject || !k.when_key.empty()) continue;
    nlohmann::ordered_json doc = {{"train_batch_size", 8}};
    doc[nlohmann::ordered_json::json_pointer("/" + [&] {
      std::string p(k.path);
      for (char& c : p) {
        if (c == '.') c = '/';
      }
      return p;
    }())] = nlohmann::ordered_json::parse(k.default_json);
    ValidationResult r = ValidateConfigJson(doc.dump());
    EXPECT_TRUE(r.ok()) << k.path << ": " << r.ErrorsToString();
  }
}

TEST(ConfigTest, KeyTypeNamesAndOffloadDeviceNames) {
  EXPECT_EQ(KeyTypeName(KeyType::kBool), "boolean");
  EXPECT_EQ(KeyTypeName(KeyType::kBytes), "bytes");
  EXPECT_EQ(KeyTypeName(KeyType::kPaths), "path or [paths]");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kNone), "none");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kCpu), "cpu");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kNvme), "nvme");
}

}  // namespace
}  // namespace strata
