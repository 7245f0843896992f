// strata-train: the main job — fine-tune a GPT-style model under the ZeRO-3 engine.
//
// The engine (issue #6) has not landed yet. Until it does, this program validates its
// embedded default configuration (or --config FILE), prints it, and says plainly that
// no training was run; it exits with status 3 so that no script mistakes it for a run.
#include <cstdio>
#include <cstring>
#include <string>

#include "strata/core/config.h"
#include "strata_generated/version.h"

namespace {

// The embedded default: a small model trained with the optimizer offloaded to the CPU.
constexpr const char* kDefaultConfig = R"({
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 20, "warmup_max_lr": 3e-4}},
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true}},
  "strata": {"allow_unpinned": true}
})";

constexpr int kNotBuilt = 3;

}  // namespace

int main(int argc, char** argv) {
  std::string config_file;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
      config_file = argv[++i];
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: strata-train [--config FILE]\n");
      return 0;
    } else {
      std::fprintf(stderr,
                   "strata-train: unknown argument \"%s\" (usage: strata-train [--config FILE])\n",
                   argv[i]);
      return 2;
    }
  }
  strata::ValidationResult r = config_file.empty() ? strata::ValidateConfigJson(kDefaultConfig)
                                                   : strata::ValidateConfigFile(config_file);
  if (!r.ok()) {
    std::fprintf(stderr, "strata-train: %s:\n%s",
                 config_file.empty() ? "embedded default config" : config_file.c_str(),
                 r.ErrorsToString().c_str());
    return 2;
  }
  std::printf("strata-train %s: configuration (%s) is valid:\n%s\n", STRATA_VERSION_STRING,
              config_file.empty() ? "embedded default" : config_file.c_str(),
              r.normalized.dump(2).c_str());
  std::fprintf(stderr,
               "strata-train: not built yet: the ZeRO-3 engine (engine/, issue #6) and the "
               "collectives (comm/, issue #5) have not landed, so no model was trained. What "
               "works today: the configuration model (strata-config), the host memory pool, "
               "the topology and CPU-Adam (bench/cpu_adam_bench).\n");
  return kNotBuilt;
}
