// Rendezvous: who am I, how many are we, and the store we meet through.
//
// From the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent
// already hosts a TCP store on MASTER_PORT: every rank connects as a client and keys live
// under torchrun's per-attempt prefix ("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>").
// Outside torchrun, rank 0 hosts the store on MASTER_PORT. With none of these variables
// set, a single-process run (rank 0 of 1, an in-process store) needs no environment at
// all. A partial or malformed environment is InvalidArgument naming the variable.
//
// The store is c10d's TCPStore; rendezvous.cc is the one translation unit of comm/ that
// includes LibTorch.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "strata/comm/store.h"
#include "strata/core/status.h"

namespace strata::comm {

struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr;  // empty for a single process
  int master_port = 0;
  bool torchrun = false;         // the agent hosts the store
  std::shared_ptr<Store> store;  // keys already under the per-attempt prefix
  std::string ToString() const;  // "rank 1 of 4 (local 1 of 4), store 127.0.0.1:29500 ..."
};

struct RendezvousOptions {
  // Connecting to (or hosting) the store, and every store wait.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

Result<Rendezvous> RendezvousFromEnvironment(const RendezvousOptions& options);

// Explicit form (tests and programs that start their own ranks): rank 0 hosts a TCP store
// on host:port (port 0 = any free port, only meaningful with world_size 1 or when the
// port is then passed on), the others connect.
Result<Rendezvous> RendezvousTcp(int rank, int world_size, const std::string& host, int port,
                                 const RendezvousOptions& options);

// An in-process store (single process, or threads of one process in tests).
std::shared_ptr<Store> InProcessStore();

}  // namespace strata::comm
