#include "strata/core/sizing.h"

#include <algorithm>

namespace strata {

namespace {
// The key's value when the document left it at its default (nullptr otherwise).
int64_t* Defaulted(Config& config, const std::string& path, int64_t* value, int64_t dflt) {
  if (config.Given(path) || *value != dflt) return nullptr;
  return value;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

std::string SizedKey::ToString() const {
  return path + " " + std::to_string(from) + " -> " + std::to_string(to) + " (" + why + ")";
}

std::vector<SizedKey> SizeFromModel(Config& config, const ModelExtent& model) {
  const ZeroConfig defaults;
  std::vector<SizedKey> out;
  const std::string bucket_key = "zero_optimization.reduce_bucket_size";
  if (int64_t* v = Defaulted(config, bucket_key, &config.zero.reduce_bucket_size,
                             defaults.reduce_bucket_size);
      v != nullptr && model.trainable > 0) {
    const uint64_t want = std::max<uint64_t>(CeilDiv(model.trainable, 16),
                                             std::max<uint64_t>(1, model.largest_group));
    if (want < static_cast<uint64_t>(*v)) {
      out.push_back({bucket_key, *v, static_cast<int64_t>(want),
                     "not set: a sixteenth of the model's " + std::to_string(model.trainable) +
                         " trainable elements, at least its largest group of " +
                         std::to_string(model.largest_group)});
      *v = static_cast<int64_t>(want);
    }
  }
  const std::string sub_key = "zero_optimization.sub_group_size";
  if (int64_t* v = Defaulted(config, sub_key, &config.zero.sub_group_size, defaults.sub_group_size);
      v != nullptr && model.partition > 0) {
    const uint64_t want = std::max<uint64_t>(CeilDiv(model.partition, 16), uint64_t{1} << 20);
    if (want < static_cast<uint64_t>(*v)) {
      out.push_back({sub_key, *v, static_cast<int64_t>(want),
                     "not set: a sixteenth of this rank's " + std::to_string(model.partition) +
                         " elements of optimizer state, at least 1048576"});
      *v = static_cast<int64_t>(want);
    }
  }
  const std::string buffer_key = "zero_optimization.offload_param.buffer_size";
  if (int64_t* v = Defaulted(config, buffer_key, &config.zero.offload_param.buffer_size,
                             defaults.offload_param.buffer_size);
      v != nullptr && config.zero.offload_param.device == OffloadDevice::kNvme &&
      model.largest_shard > static_cast<uint64_t>(*v)) {
    out.push_back({buffer_key, *v, static_cast<int64_t>(model.largest_shard),
                   "not set: the largest group's shard of " + std::to_string(model.largest_shard) +
                       " elements, which each NVMe buffer holds whole"});
    *v = static_cast<int64_t>(model.largest_shard);
  }
  return out;
}

}  // namespace strata
