// Store: the key-value store ranks meet through (addresses, NCCL's unique id, barriers).
//
// Torch-free interface. The implementation that meets `torchrun` is c10d's TCPStore,
// wrapped in comm's rendezvous unit (rendezvous.cc) — the only place in comm/ that sees
// LibTorch. Tests may use any implementation (e.g. an in-process one).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/status.h"

namespace strata::comm {

class Store {
 public:
  virtual ~Store() = default;
  virtual Status Set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists, up to `timeout`; DeadlineExceeded naming the key then.
  virtual Result<std::vector<uint8_t>> Get(const std::string& key,
                                           std::chrono::milliseconds timeout) = 0;
  // Atomically adds `delta` to the integer stored at key (0 when absent); returns it.
  virtual Result<int64_t> Add(const std::string& key, int64_t delta) = 0;
  // Blocks until all keys exist, up to `timeout`.
  virtual Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
};

// A store whose keys all live under `prefix + "/"` of another store.
std::shared_ptr<Store> PrefixStore(std::string prefix, std::shared_ptr<Store> base);

}  // namespace strata::comm
