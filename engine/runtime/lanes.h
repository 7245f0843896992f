// The communication lanes the front ends make (docs/engine.md, "Lanes"): on CUDA, with
// strata.nccl_lanes, the gradient reductions and the parameter all-gathers each get an NCCL
// communicator of their own, duplicated from the engine's.
#pragma once

#include "strata/core/config.h"
#include "strata/core/status.h"

namespace strata::engine {

// Whether NCCL lanes may be made under this process's environment: Ok, or
// FailedPrecondition when CUDA_DEVICE_MAX_CONNECTIONS=1 (the device then runs the lanes'
// streams through one hardware queue, so one lane's kernel waiting for a peer can keep the
// other lane's from starting: the ranks may issue the two lanes in different orders, and
// NCCL would hang). The message names both ways out.
Status CheckNcclLanes();

}  // namespace strata::engine
