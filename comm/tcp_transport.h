// Internal: the point-to-point transport of the gloo backend (CPU buffers over TCP).
// Not installed; not part of the public API.
//
// Why Strata has its own transport and does not link a Gloo library: a process that loads
// torch already carries torch's Gloo inside libtorch_cpu.so. PyPI's torch does not ship
// Gloo's headers, and Debian's libgloo (a 2022 snapshot) loaded into the same process binds
// to the other copy's symbols. The gloo backend's collectives are Strata's own rings
// (gloo_communicator.cc); all they need from a transport is tagged, asynchronous send and
// receive between two ranks, which this file provides. docs/comm.md has the details.
//
// A full mesh of TCP connections, one per pair of ranks, set up through the rendezvous
// store: every rank listens on an ephemeral port and publishes "<host> <port>"; it connects
// to every lower rank and accepts every higher one (the kernel's listen backlog completes
// a connect before the accept, so the order cannot deadlock). Each connection has a sender
// thread (transfers in the order they were posted) and a receiver thread. A message is a
// 16-byte header {slot, bytes} and its payload. The receiver reads a payload straight into
// the buffer of a posted receive with the same slot; a message that arrives before its
// receive is posted is held in memory and copied when the receive is posted.
//
// Failure: an error or end of stream on a connection fails every pending transfer with
// that peer at once, and every later one, except a receive of a message that had been read
// whole before (a peer may send its last message and exit before the receive for it is
// posted); a transfer that completed stays completed, and a
// send being written is finished by its sender thread (it counts as sent once all its
// bytes are written, even if the peer closes right after reading them). Close()
// shuts every connection down and joins the threads: after it returns, no thread touches
// a transfer's buffer again.
//
// Farewells: before it shuts a connection down, Close() sends a last message on a reserved
// slot: a goodbye (the communicator was closed normally), or, when it is given an error,
// an abort that carries that error's text. So a peer tells three ends apart:
// - a goodbye: that peer's transfers fail ("rank P closed its communicator");
// - an abort: every pending and later transfer with every peer fails with "rank P gave up:
//   <its error>" (the group cannot finish any collective without P), and since a rank's
//   error names what it was waiting for, the root cause (the lost rank) travels on;
// - the end of stream or a reset without a farewell: the process is gone ("lost rank P:
//   ..."); that peer's transfers fail (a rank that finished its part and exited without
//   closing must not fail the others' last transfers: they fail when they need P, or
//   through an abort of a rank that did).
// A sender thread stuck in a write to a peer that stopped reading gets a grace period
// (at most 1 s) before the connection is shut down without its farewell.
//
// Thread-safety: Send, Recv, Wait and Close may be called from any thread.
#pragma once

#include <netdb.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/store.h"
#include "strata/core/status.h"

namespace strata::comm::internal {

// A rank's address as it publishes it in the store: "<numeric host> <port>" (an IPv4 or IPv6
// literal, an IPv6 one optionally with "%<interface>"; a port in 1..65535; one space
// between, nothing else). The text comes from another process through the store, so it is
// checked whole before anything connects: InvalidArgument naming it (cut to 100 characters)
// otherwise. A host name is refused too: every rank publishes a numeric address, and a name
// would be looked up in the DNS.
struct PeerAddress {
  std::string host;
  int port = 0;
};
Result<PeerAddress> ParsePeerAddress(std::string_view text);

class TcpTransport {
 public:
  // One posted send or receive. Its buffer must stay valid until the transfer is done or
  // failed, or until Close() returned.
  class Transfer {
   public:
    bool done() const { return state_.load(std::memory_order_acquire) != kPending; }

   private:
    friend class TcpTransport;
    enum State : int { kPending, kDone, kFailed };
    int peer_ = -1;
    uint64_t slot_ = 0;
    uint8_t* data_ = nullptr;
    size_t bytes_ = 0;
    std::atomic<int> state_{kPending};
    Status error_;  // written before state_ becomes kFailed
  };
  using TransferPtr = std::shared_ptr<Transfer>;

  // Connects the full mesh. `host` is the address (or host name) this rank listens on and
  // publishes to the others; `store` holds the addresses (keys "tcp/<rank>"). Every wait
  // is bounded by `timeout`.
  static Result<std::unique_ptr<TcpTransport>> Connect(int rank, int world_size,
                                                       const std::string& host, Store& store,
                                                       Millis timeout);
  ~TcpTransport();
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  // REQUIRES: 0 <= peer < world_size, peer != rank. A send of 0 bytes still sends a header.
  TransferPtr Send(int peer, uint64_t slot, const void* data, size_t bytes);
  // A receive of `bytes` bytes on `slot` from `peer`; a message of another size on that
  // slot fails the connection (the peers disagree about the operation).
  TransferPtr Recv(int peer, uint64_t slot, void* data, size_t bytes);

  // Waits until `t` is done (OK), failed (its error: Unavailable naming the peer), or the
  // deadline passed (DeadlineExceeded; `t` stays posted).
  Status Wait(const Transfer& t, Clock::time_point deadline);

  // Sends every peer a farewell (a goodbye when `reason` is OK, else an abort carrying
  // reason's text), shuts every connection down, fails what is pending and joins the
  // threads. Idempotent (the first call's reason is sent).
  // REQUIRES: not called from inside the transport's threads (none calls back).
  void Close(const Status& reason = Status::Ok());

  int rank() const { return rank_; }
  int world_size() const { return world_; }

 private:
  struct Peer {
    int fd = -1;
    std::thread sender;
    std::thread receiver;
    std::deque<TransferPtr> sends;                       // queued, guarded by mu_
    std::multimap<uint64_t, TransferPtr> posted;         // receives, guarded by mu_
    std::multimap<uint64_t, std::vector<uint8_t>> held;  // early messages, guarded by mu_
    Status broken;                                       // guarded by mu_; !ok: failed
    bool sender_done = false;                            // guarded by mu_
    bool connection_lost = false;                        // guarded by mu_
  };

  TcpTransport(int rank, int world_size);
  void StartThreads();
  void SendLoop(int peer);
  void RecvLoop(int peer);
  // Marks `peer` broken with `error` (the first error stays) and fails everything pending
  // with it. `connection_lost`: the connection itself is unusable (an I/O error, its end,
  // or the peer's farewell), so this rank's sender writes no farewell on it. Takes mu_.
  void Break(int peer, Status error, bool connection_lost);
  // "lost rank <peer>: <detail>", or, once Close() began, "the connections were closed".
  // Takes mu_.
  Status Lost(int peer, std::string_view detail);
  void Finish(Transfer& t, Status status);  // REQUIRES: mu_ held
  // Reads the payload of a farewell from `peer` and breaks what it says (a malformed one
  // breaks the connection as a protocol error).
  void ReadFarewell(int peer, uint64_t bytes);

  const int rank_;
  const int world_;
  std::vector<Peer> peers_;
  std::mutex mu_;
  std::condition_variable cv_;  // a transfer finished, or a send was queued
  bool closing_ = false;        // guarded by mu_
  Status farewell_;             // guarded by mu_: what Close() tells the peers
  bool started_ = false;        // the threads run (set before they start)
  std::mutex close_mu_;         // serializes Close()
  bool closed_ = false;         // guarded by close_mu_
};

}  // namespace strata::comm::internal
