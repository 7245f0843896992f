// EngineBuilder: EngineCore::Create's construction, in named phases, in the order Create runs
// them: the arguments checked, the communicators taken, this rank's partition and the clock,
// the machine's limits, the placement's tiers and the device budget, CPU-Adam's cores, the
// stores and the optimizer's driver, the initial values, then the update gate, the
// coordinator, the reducer, the step, the model's and the checkpoints' I/O. Every rank
// agrees on each phase's local outcome before the next collective (AgreeOnCreate): a rank
// that fails alone (a device budget or an allocation, its machine's limits, a path) fails
// Create on every rank, each naming it, instead of leaving the others in a collective
// (docs/engine/runtime.md, "The start-up check").
//
// Ownership and lifetime: a builder lives for one Create. It sets the parts of the engine it
// is given (EngineCore's private members: the one code besides EngineCore's own that does)
// and owns only what its phases decide for the later ones (the reducer's options, the device
// budget); it borrows the groups and the options, read during Create only.
// Thread-safety: Create's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/planner.h"
#include "strata/core/status.h"
#include "strata/engine/reduce/reducer.h"
#include "strata/engine/runtime/engine_core.h"

namespace strata::engine {

class EngineBuilder {
 public:
  // The configuration the engine runs and the communicators it was given, before anything
  // is made.
  static Status CheckArguments(const Config& config, const comm::Communicator* comm,
                               const EngineOptions& options);

  EngineBuilder(EngineCore& engine, const std::vector<GroupDesc>& groups,
                const EngineOptions& options)
      : e_(engine), groups_(groups), options_(options) {}
  EngineBuilder(const EngineBuilder&) = delete;
  EngineBuilder& operator=(const EngineBuilder&) = delete;

  // Every phase, agreed on; the persistent groups gathered at the end.
  Status Build(const Config& config, std::shared_ptr<comm::Communicator> comm);

 private:
  // 1. This rank's partition, its limits, the device and the tiers, the device budget.
  Status Prepare();
  Status PartitionGroups();
  void SizeFromTheModel();
  Status CheckMachine();
  Status CheckDeviceBudget();
  // 2. CPU-Adam, the stores, the working shards and the optimizer's driver.
  Status MakeStoresAndDriver();
  Status MakeDriver();
  // 3. The initial values: the Status returned is a collective's (every rank returns it at
  // once); `init` this rank's outcome, for the ranks to agree on.
  Status WriteInitialValues(Status& init);
  // 4. The initial states committed, the working shards pushed, the components.
  Status MakeComponents();

  EngineCore& e_;
  const std::vector<GroupDesc>& groups_;
  const EngineOptions& options_;
  // What the phases decide for the later ones: the reducer's options (its buckets,
  // accumulation on the device), and the device budget (0: unbounded) with what the model
  // needs of it without the device gradient accumulators (CheckDeviceBudget).
  ReducerOptions reducer_;
  uint64_t device_budget_ = 0;
  uint64_t device_need_ = 0;
};

}  // namespace strata::engine
