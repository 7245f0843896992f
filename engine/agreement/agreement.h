// Agreeing on local outcomes before the next collective step: every rank makes the same
// decision from every rank's outcome (a failure on one rank fails the operation on all,
// each naming the failing ranks and their messages), so no collective ever depends on
// what happened on one rank alone.
//
// Thread-safety: a collective over the given communicator; call it from the thread that
// issues that communicator's collectives.
#pragma once

#include <string>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/status.h"

namespace strata::engine {

struct Outcomes {
  bool any_failed = false;
  std::string ranks;     // "1" or "0, 2": the failing ranks
  std::string messages;  // "; rank 1: <status>" for each failing rank
  // The lowest failing rank's code (every rank returns the same code); kIOError when the
  // messages could not be gathered.
  StatusCode code = StatusCode::kOk;
};

// `flags`: one float per rank, > 0 where the rank failed, when the caller already
// all-reduced them (e.g. inside a norm all-reduce); empty: one all-reduce here. When some
// rank failed, one all-gather of `message_bytes` per rank carries the codes and messages
// (another rank's message cut to fit; this rank's own is kept whole). An error of the
// all-reduce itself is returned (the ranks can no longer agree).
Result<Outcomes> AgreeOnOutcomes(comm::Communicator& comm, const Status& local,
                                 std::vector<float> flags = {}, size_t message_bytes = 512);

// Ok when no rank failed; else `code` with "<what> failed on rank(s) <ranks><messages>".
Status OutcomeStatus(const Outcomes& o, const std::string& what);

}  // namespace strata::engine
