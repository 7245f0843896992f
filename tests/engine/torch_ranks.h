// Forked rank processes for the LibTorch front end's tests: body(rank, comm) on `world`
// processes, one LibTorch thread each, with a Gloo communicator met through a PortChannel
// (tests/comm/multiprocess.h). The parent must not touch LibTorch before it forks.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <memory>

#include "../comm/multiprocess.h"
#include "strata/engine/libtorch/zero3.h"

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

// Whether LibTorch sees a CUDA device, asked in a forked child: a parent that initializes
// CUDA (torch::cuda::is_available() does) before it forks the ranks leaves them "CUDA
// error: initialization error" (seen on the first GPU machine).
inline bool TorchCudaUsableInAChild() {
  const pid_t pid = fork();
  if (pid == 0) _exit(torch::cuda::is_available() ? 0 : 2);
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// A small model's ZeRO-3 configuration: AdamW (lr 0.01, weight decay 0.01) with the
// optimizer on the host, every group gathered and released around each use, one bucket.
inline Config SmallZero3Config() {
  Config c;
  c.optimizer.lr = 0.01;
  c.optimizer.weight_decay = 0.01;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.stage3_max_reuse_distance = 0;
  c.zero.reduce_bucket_size = 100000;
  return c;
}

// CPU-Adam on the calling thread's core only (ranks are processes with one thread each).
inline engine::EngineOptions OneThreadOptions() {
  engine::EngineOptions o;
  o.cpu_adam.num_threads = 1;
  return o;
}

}  // namespace strata::torch_testing
