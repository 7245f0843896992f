// Forked rank processes for the LibTorch front end's tests: body(rank, comm) on `world`
// processes, one LibTorch thread each, with a Gloo communicator met through a PortChannel
// (tests/comm/multiprocess.h). The parent must not touch LibTorch before it forks.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <memory>

#include "../comm/multiprocess.h"

namespace strata::torch_testing {

template <typename Body>
void RunTorchRanks(int world, Body body, std::chrono::seconds timeout = std::chrono::seconds(120)) {
  comm::testing::PortChannel ports;
  const auto results = comm::testing::RunProcesses(
      world,
      [&](int rank) -> Status {
        torch::set_num_threads(1);
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> c,
                                comm::testing::MakeGloo(rank, world, ports));
        return body(rank, std::shared_ptr<comm::Communicator>(std::move(c)));
      },
      timeout);
  EXPECT_TRUE(comm::testing::AllExitedZero(results)) << comm::testing::Describe(results);
}

}  // namespace strata::torch_testing
