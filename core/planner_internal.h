// Internal to strata_core (not installed): what the planner's parts share. planner.cc
// defines the plan and its check; planner_suggest.cc the search for a placement that fits.
#pragma once

#include <string>
#include <vector>

#include "strata/core/planner.h"

namespace strata {

// CheckPlan's problems with the host memory (the limit that binds it, strata.host_budget,
// RLIMIT_MEMLOCK), each a line of its message; empty when the host holds the plan.
std::vector<std::string> HostProblems(const Plan& plan, const Config& config,
                                      const MachineFacts& machine, const CheckOptions& options);

}  // namespace strata
