// comm::Store over a torch.distributed Store object (set/get/add/wait), so that a process
// group the user already initialized is reused rather than fought over. Each call takes
// the GIL itself: the engine calls it from threads that do not hold it.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/comm/store.h"

namespace strata_py {

class PyStore final : public strata::comm::Store {
 public:
  explicit PyStore(pybind11::object store) : store_(std::move(store)) {}
  ~PyStore() override;

  strata::Status Set(const std::string& key, const std::vector<uint8_t>& value) override;
  strata::Result<std::vector<uint8_t>> Get(const std::string& key,
                                           std::chrono::milliseconds timeout) override;
  strata::Result<int64_t> Add(const std::string& key, int64_t delta) override;
  strata::Status Wait(const std::vector<std::string>& keys,
                      std::chrono::milliseconds timeout) override;

 private:
  pybind11::object store_;
};

}  // namespace strata_py
