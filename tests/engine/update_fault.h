// A read error (EIO) injected into a rank's NVMe state store in the middle of one step's
// pipelined update, for the tests of the failed-update protocol (the core's and the C++
// front end's).
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <memory>

#include "strata/core/status.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/swap/fault_injection.h"

namespace strata::engine::testing {

// Install() makes the rank's NVMe I/O engines fault-injecting and, when `fails`, arms one
// read error on the optimizer states' store (the first engine made) once the third
// sub-group of step `failing_step`'s update began, on the update's worker (the reads ahead
// of it then come from the update, not from the norm pass). The caller sets `updating` to
// the step whose Step() it calls, before the call: never while an update runs (the next
// micro-step's backward joins it first), so the worker reads the step it updates.
// REQUIRES: the object outlives the engine and does not move.
struct UpdateReadFault {
  swap::FaultInjectingIoEngine* io = nullptr;
  std::atomic<int> updating{-1};
  int began = 0;       // the update's worker only
  bool armed = false;  // read after the engine joined its last update

  void Install(EngineOptions& o, int failing_step, bool fails, uint64_t seed = 1) {
    o.test.nvme_io_engine_factory =
        [this,
         seed](const swap::IoEngineOptions& options) -> Result<std::unique_ptr<swap::IoEngine>> {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<swap::FaultInjectingIoEngine> e,
                              swap::FaultInjectingIoEngine::Create(options, seed));
      if (io == nullptr) io = e.get();
      return std::unique_ptr<swap::IoEngine>(std::move(e));
    };
    if (!fails) return;
    o.test.driver.on_update = [this, failing_step](size_t, bool begin) {
      if (!begin || updating.load() != failing_step || armed || ++began < 3) return;
      armed = io->AddRule(swap::FaultRule::Error(EIO).OnOp(swap::IoOp::kRead).Nth(1)).ok();
    };
  }
};

}  // namespace strata::engine::testing
