// ModelIo: the engine's parameters read and written whole, outside the optimizer's step:
// LoadParameters, SetParameters and AssembleParameters (new values for the fp32 master and
// the working shards, at a step boundary: EngineCore's calls of those names say what each
// takes) and GatherMasterParams (a group's fp32 master gathered from every rank). Every one is
// collective, and every rank's local outcome is agreed on before anything changes (a check)
// or is committed (a write), so a failure on one rank is every rank's and leaves the model
// as it was.
//
// Ownership and lifetime: owns nothing between calls; borrows EngineCore's parts (IoParts),
// which must outlive it (EngineCore declares it after them).
// Thread-safety: the engine's thread.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/gather/coordinator.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/reduce/reducer.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/step/optimizer_driver.h"

namespace strata::engine {

class Placement;
class StepControl;

// A load's check agreed on (LoadParameters, LoadCheckpoint): the pass the front end's calls
// began ends on every rank (nothing stays gathered), and any rank's failure is every rank's
// error ("<what> ...; nothing was changed"), after the next iteration was begun again.
Status AgreeOnLoadCheck(comm::Communicator& host, ParameterCoordinator& coordinator,
                        const Status& local_check, const std::string& what);

// What a call on the whole model (ModelIo's, CheckpointIo's) reads and writes: EngineCore's
// config, partition and host communicator, the optimizer's driver, the coordinator, the
// reducer, the placement and the step. They must outlive the component that holds them.
struct IoParts {
  const Config& config;
  const ModelPartition& partition;
  comm::Communicator& host;
  OptimizerDriver& driver;
  ParameterCoordinator& coordinator;
  GradientReducer& reducer;
  Placement& placement;
  StepControl& step;
};

class ModelIo {
 public:
  explicit ModelIo(const IoParts& io) : io_(io) {}
  ModelIo(const ModelIo&) = delete;
  ModelIo& operator=(const ModelIo&) = delete;

  using ParamReader = EngineCore::ParamReader;
  using ParamFilter = std::function<bool(int group, size_t param)>;
  // EngineCore's calls of the same names (engine_core.h says what each takes and does).
  Status LoadParameters(const Status& local_check, const ParamReader& read,
                        const ParamFilter& only);
  // Parameters as (group, param) pairs, the same list on every rank.
  using ParamList = std::vector<std::pair<int, size_t>>;
  // Rank `source`'s values broadcast, then written as a load.
  Status SetParameters(const Status& local_check, int source, const ParamList& which,
                       const std::vector<std::span<float>>& values);
  // Every rank's parts of each parameter gathered a chunk at a time, the elements of this
  // rank's shard written as a load.
  Status AssembleParameters(const Status& local_check, const ParamList& which,
                            const EngineCore::AssembleParts& parts);
  Status GatherMasterParams(int group, std::span<float> out);

 private:
  // LoadParameters, SetParameters and AssembleParameters ("loading", "setting",
  // "assembling"): `prepare` runs after the check is agreed on, before the reader's writes
  // (SetParameters' broadcasts, AssembleParameters' gathers and writes); it returns an error
  // that ends the call (a collective's) and may set `local`, this rank's write failure,
  // which the ranks agree on with the reader's.
  Status WriteParameters(const std::string& verb, const Status& local_check,
                         const std::function<Status(Status& local)>& prepare,
                         const ParamReader& read, const ParamFilter& only);
  // AssembleParameters' gathers and writes of parameter which[k] (`local`: as prepare's).
  Status AssembleOne(const ParamList& which, size_t k, const EngineCore::AssembleParts& parts,
                     Status& local);
  const GroupLayout& layout(int group) const {
    return io_.partition.groups[static_cast<size_t>(group)];
  }

  const IoParts io_;
};

}  // namespace strata::engine
