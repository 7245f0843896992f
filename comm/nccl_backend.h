// Internal: the NCCL backend's factory, implemented in nccl_communicator.cc (built only
// when CUDA is found, STRATA_HAVE_CUDA). CreateCommunicator (communicator.cc) calls it for
// Backend::kNccl; without CUDA it returns Unimplemented and never references this symbol.
// Not installed; not part of the public API.
#pragma once

#include <memory>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/status.h"

namespace strata::comm::internal {
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const Rendezvous& rendezvous,
                                                             const CommOptions& options);
}  // namespace strata::comm::internal
