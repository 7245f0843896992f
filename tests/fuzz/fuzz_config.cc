// ParseConfig over arbitrary text: no crash, leak or undefined behaviour; an accepted
// config's normalized document parses again to the same document (for one rank and for
// four), and the planner over it returns a plan or an error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/core/config.h"
#include "strata/core/planner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const int world : {1, 4}) {
    strata::ValidateOptions options;
    options.world_size = world;
    strata::Result<strata::Config> config = strata::ParseConfig(text, options);
    if (!config.ok()) {
      if (config.status().message().empty()) __builtin_trap();  // errors say what is wrong
      continue;
    }
    strata::Result<strata::Config> again = strata::ParseConfig(config->normalized.dump(), options);
    if (!again.ok() || again->normalized != config->normalized) __builtin_trap();
    strata::PlanInput in;
    in.params = 1 + size * 1000;
    in.world_size = world;
    strata::Result<strata::Plan> plan = strata::MakePlan(*config, in);
    if (plan.ok()) (void)plan->ToString();
  }
  return 0;
}
