// Uses the installed headers and libraries the way a downstream project would.
#include <strata/core/bytes.h>
#include <strata/core/config.h>
#include <strata_generated/version.h>

#include <cstdio>

int main() {
  auto config = strata::ParseConfig(R"({"train_batch_size": 8, "strata": {"host_budget": "2GiB"}})",
                                    {.world_size = 2});
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  std::printf("strata %s: train_micro_batch_size_per_gpu=%lld host_budget=%s\n",
              STRATA_VERSION_STRING, static_cast<long long>(config->train_micro_batch_size_per_gpu),
              strata::FormatBytes(config->strata.host_budget).c_str());
  return 0;
}
