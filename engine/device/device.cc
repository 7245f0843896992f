// The device seam's shared parts (device.h).
#include "strata/engine/device/device.h"

namespace strata::engine {

std::string_view HostWaitName(HostWait why) {
  switch (why) {
    case HostWait::kOther:
      return "other";
    case HostWait::kBucketInputs:
      return "bucket inputs";
    case HostWait::kGradientRead:
      return "gradient read";
    case HostWait::kGradientShards:
      return "gradient shards";
    case HostWait::kShardStaging:
      return "shard staging";
    case HostWait::kShardZeroFill:
      return "shard zero fill";
    case HostWait::kWorkingShardPush:
      return "working-shard push";
    case HostWait::kEndOfBackward:
      return "end of backward";
    case HostWait::kArenaReuse:
      return "arena reuse";
    case HostWait::kShutdown:
      return "shutdown";
    case HostWait::kGradientFetch:
      return "gradient fetch";
  }
  return "unknown";
}

}  // namespace strata::engine
