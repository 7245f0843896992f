// The child of CheckpointCrashTest (checkpoint_test.cc): two thread ranks of the toy model
// train a step and save tag "first" in argv[1], train another step and save "second" with
// the crash point argv[2], where the save calls _exit(9). Exit 3: the save returned.
#include <cstdio>
#include <string>

#include "checkpoint_util.h"

int main(int argc, char** argv) {
  using namespace strata::engine;       // NOLINT(google-build-using-namespace)
  using namespace strata::engine::toy;  // NOLINT(google-build-using-namespace)
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DIR CRASH_POINT\n", argv[0]);
    return 2;
  }
  strata::Config c = BaseConfig();
  c.zero.offload_optimizer.device = strata::OffloadDevice::kCpu;
  c.zero.sub_group_size = 16;
  c.gradient_clipping = 0.5;
  c.scheduler.type = strata::SchedulerType::kWarmupLR;
  c.scheduler.warmup_num_steps = 4;
  c.scheduler.warmup_max_lr = 0.02;
  CkptPlan first;
  first.from = 0;
  first.to = 1;
  first.save.dir = argv[1];
  first.save.tag = "first";
  for (const CkptRun& run : CkptTrain(c, 2, InitialParams(), first)) {
    if (!run.save.ok()) {
      std::fprintf(stderr, "saving 'first': %s\n", run.save.ToString().c_str());
      return 1;
    }
  }
  CkptPlan second;
  second.from = 1;
  second.to = 2;
  second.load.dir = argv[1];
  second.save.dir = argv[1];
  second.save.tag = "second";
  second.save.crash_at = argv[2];
  for (const CkptRun& run : CkptTrain(c, 2, InitialParams(), second)) {
    std::fprintf(stderr, "the save returned: %s\n", run.save.ToString().c_str());
  }
  return 3;
}
