// Internal: the Gloo backend's factory (CPU buffers, TCP transport). CreateCommunicator
// (communicator.cc) calls it for Backend::kGloo. Not installed; not part of the public API.
#pragma once

#include <memory>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/status.h"

namespace strata::comm::internal {
Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const Rendezvous& rendezvous,
                                                             const CommOptions& options);
}  // namespace strata::comm::internal
