// The gloo backend: collectives over host buffers on Strata's TCP transport.
//
// The transport (tcp_transport.h) provides the connections (a full mesh set up through our
// Store) and point-to-point transfers (send/recv by slot); it links no Gloo library, so a
// process that loads torch maps exactly one Gloo, torch's (docs/comm.md). The backend keeps
// the name "gloo", torch's name for CPU collectives. The collectives are rings written here so
// that sizes need not divide by the world size, 16-bit types reduce in fp32, the traffic of
// each rank is exact (CommStats) and every wait is bounded by the operation's deadline:
//
// - reduce-scatter: a pipelined ring. In step s rank r sends its partial sum of block
//   r-s-1 to r+1 and receives block r-s-2 from r-1, adds its own contribution and passes
//   it on; after W-1 steps it holds the full sum of block r. Each rank sends and receives
//   (W-1)/W of the buffer. Blocks are cut into chunks so that the addition of one chunk
//   overlaps the transfer of the next.
// - all-gather: a pipelined ring; every received chunk is forwarded as soon as it lands.
// - all-reduce: reduce-scatter then all-gather, in place.
// - broadcast: a pipelined chain from the root.
// - barrier: a dissemination barrier (ceil(log2 W) rounds of one-byte tokens).
//
// A failed wait throws TransferError inside an operation's body; Execute() catches it and
// turns it into a Status that names this rank, the operation and the peer being waited
// on. The first error closes the connections (peers fail fast) and joins the transport's
// threads before the operation's buffers are released. The transport fails every pending
// transfer with a peer as soon as its connection breaks, so no watchdog is needed.
#include "strata/comm/gloo_communicator.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "strata/comm/common.h"
#include "strata/comm/tcp_transport.h"
#include "strata/core/check.h"
#include "strata/core/logging.h"

namespace strata::comm::internal {
namespace {

using Transfer = TcpTransport::TransferPtr;

// A buffer of an operation: at most one send and one receive in flight on it at a time.
struct Ub {
  uint8_t* ptr = nullptr;
  size_t size = 0;
  Transfer send;
  Transfer recv;
};
using UbPtr = std::unique_ptr<Ub>;

// Bytes per pipelined chunk of the rings.
constexpr size_t kChunkBytes = size_t{512} << 10;

// Slots of the transfers: a prefix byte, 22 bits of the operation's sequence number, 2 bits of
// phase, 32 bits of message index within the operation.
uint64_t MakeSlot(uint64_t seq, uint32_t phase, uint64_t msg) {
  return (uint64_t{0xA7} << 56) | ((seq & 0x3FFFFFu) << 34) | (uint64_t{phase & 3u} << 32) |
         (msg & 0xFFFFFFFFu);
}
// A failed wait inside an operation's body (caught in Execute).
class TransferError : public std::runtime_error {
 public:
  explicit TransferError(Status s) : std::runtime_error(s.ToString()), status(std::move(s)) {}
  Status status;
};

// Per-operation state for error messages and the deadline.
struct OpState {
  std::string_view desc;
  Clock::time_point deadline;
  Millis timeout;
  int peer = -1;
  const char* action = "";
  // Every buffer of the operation. On an error the connections are closed (and the
  // transport's threads joined) before they go away.
  std::vector<UbPtr> buffers;
  Millis Remaining() const {
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    return std::max(left, Millis(1));
  }
};

Status DTypeCheck(DType dtype) {
  if (static_cast<int>(dtype) > static_cast<int>(DType::kInt64)) {
    return InvalidArgumentError("unknown dtype value " + std::to_string(static_cast<int>(dtype)));
  }
  return Status::Ok();
}

Status ReduceOpCheck(ReduceOp op) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    return InvalidArgumentError("unknown reduce op value " + std::to_string(static_cast<int>(op)));
  }
  return Status::Ok();
}

// Whether `host` resolves to an address this machine can bind.
bool CanBind(const std::string& host, bool* loopback) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  bool ok = false;
  for (addrinfo* ai = res; ai != nullptr && !ok; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      ok = true;
      if (ai->ai_family == AF_INET) {
        const auto* in = reinterpret_cast<const sockaddr_in*>(ai->ai_addr);
        *loopback = (ntohl(in->sin_addr.s_addr) >> 24) == 127;
      } else if (ai->ai_family == AF_INET6) {
        const auto* in6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr);
        *loopback = IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
      }
    }
    close(fd);
  }
  freeaddrinfo(res);
  return ok;
}

// The first IPv4 (else IPv6) address of network interface `name`, numeric.
Result<std::string> InterfaceAddress(const std::string& name) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return ErrnoError(errno, "getifaddrs");
  std::string v4, v6;
  for (ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || name != ifa->ifa_name) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    if (ifa->ifa_addr->sa_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(ifa->ifa_addr)->sin_addr, buf,
                sizeof(buf));
      v4 = buf;
    } else if (ifa->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(ifa->ifa_addr)->sin6_addr, buf,
                sizeof(buf));
      v6 = buf;
    }
  }
  freeifaddrs(list);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  return InvalidArgumentError("network interface '" + name + "' has no IP address");
}

// Where this rank listens: CommOptions::interface (an interface name or a host
// name/address), else GLOO_SOCKET_IFNAME (first of a comma-separated list, as c10d), else
// this host's name when it resolves to a local address, else the loopback address.
Result<std::string> ListenHost(const CommOptions& options, const Rendezvous& rendezvous) {
  if (!options.interface.empty()) {
    if (if_nametoindex(options.interface.c_str()) != 0) {
      return InterfaceAddress(options.interface);
    }
    return options.interface;
  }
  if (const char* env = std::getenv("GLOO_SOCKET_IFNAME"); env != nullptr && *env != '\0') {
    std::string name(env);
    name = name.substr(0, name.find(','));
    if (if_nametoindex(name.c_str()) == 0) {
      return InvalidArgumentError("GLOO_SOCKET_IFNAME='" + std::string(env) +
                                  "': no network interface named '" + name + "'");
    }
    return InterfaceAddress(name);
  }
  // Where the ranks span hosts, a loopback address cannot be reached from the others: the
  // rank fails at once with the advice (it used to warn, and the other hosts' ranks then
  // waited out the connect timeout).
  const bool several_hosts = rendezvous.local_world_size < rendezvous.world_size;
  const std::string where = " (rank " + std::to_string(rendezvous.rank) + " of " +
                            std::to_string(rendezvous.world_size) + ", " +
                            std::to_string(rendezvous.local_world_size) + " on this host)";
  char host[256] = {};
  bool loopback = false;
  if (gethostname(host, sizeof(host) - 1) == 0 && CanBind(host, &loopback)) {
    if (loopback && several_hosts) {
      return FailedPreconditionError(
          "gloo: this host's name '" + std::string(host) +
          "' resolves to a loopback address but the ranks span several hosts; set "
          "GLOO_SOCKET_IFNAME (or CommOptions.interface) to the interface the hosts reach "
          "each other on, e.g. GLOO_SOCKET_IFNAME=eth0" +
          where);
    }
    return std::string(host);
  }
  if (several_hosts) {
    return FailedPreconditionError(
        "gloo: this host's name '" + std::string(host) +
        "' does not resolve to a local address and the ranks span several hosts; set "
        "GLOO_SOCKET_IFNAME (or CommOptions.interface) to the interface the hosts reach each "
        "other on, e.g. GLOO_SOCKET_IFNAME=eth0" +
        where);
  }
  return std::string("127.0.0.1");
}

Status FromException(StatusCode code, std::string_view label, std::string_view what) {
  return Status(code, std::string(label) + ": " + std::string(what));
}

class GlooCommunicator final : public Communicator {
 public:
  // `origin`: the rendezvous with this communicator's own store namespace, which Duplicate
  // meets the other ranks' duplicates in.
  GlooCommunicator(Rendezvous origin, CommOptions options, std::unique_ptr<TcpTransport> transport)
      : rank_(origin.rank),
        world_(origin.world_size),
        options_(std::move(options)),
        label_(RankLabel(Backend::kGloo, rank_, world_)),
        origin_(std::move(origin)),
        transport_(std::move(transport)) {
    queue_ =
        std::make_unique<OpQueue>("strata-gloo", [this](const Status& s) { CloseConnections(s); });
  }

  ~GlooCommunicator() override {
    queue_.reset();      // runs what is queued, joins the worker
    transport_.reset();  // closes the connections, joins the transport's threads
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Backend backend() const override { return Backend::kGloo; }
  const CommOptions& options() const override { return options_; }
  CommStats stats() const override {
    return CommStats{sent_.load(std::memory_order_relaxed),
                     received_.load(std::memory_order_relaxed),
                     operations_.load(std::memory_order_relaxed)};
  }

  WorkPtr AllGatherAsync(const void* shard, void* full, size_t total, DType dtype) override {
    const Shard mine = Partition(total, world_, rank_);
    Status arg = DTypeCheck(dtype);
    if (arg.ok()) arg = CheckBuffer(shard, mine.count, "all_gather shard");
    if (arg.ok()) arg = CheckBuffer(full, total, "all_gather output");
    return Issue([=](uint64_t seq) { return OpLabel("all_gather", seq, total, dtype); },
                 std::move(arg),
                 [=, this](OpState& st, uint64_t seq) {
                   const std::vector<size_t> counts = BalancedCounts(total);
                   RingAllGather(st, seq, 0, static_cast<const uint8_t*>(shard),
                                 static_cast<uint8_t*>(full), counts, dtype);
                 });
  }

  WorkPtr ReduceScatterAsync(const void* full, void* shard, size_t total, DType dtype,
                             ReduceOp op) override {
    const Shard mine = Partition(total, world_, rank_);
    Status arg = DTypeCheck(dtype);
    if (arg.ok()) arg = ReduceOpCheck(op);
    if (arg.ok()) arg = CheckBuffer(full, total, "reduce_scatter input");
    if (arg.ok()) arg = CheckBuffer(shard, mine.count, "reduce_scatter shard");
    return Issue([=](uint64_t seq) { return OpLabel("reduce_scatter", seq, total, dtype, op); },
                 std::move(arg),
                 [=, this](OpState& st, uint64_t seq) {
                   const std::vector<size_t> counts = BalancedCounts(total);
                   RingReduceScatter(st, seq, 0, static_cast<const uint8_t*>(full),
                                     static_cast<uint8_t*>(shard), counts, dtype, op);
                 });
  }

  WorkPtr AllReduceAsync(void* data, size_t count, DType dtype, ReduceOp op) override {
    Status arg = DTypeCheck(dtype);
    if (arg.ok()) arg = ReduceOpCheck(op);
    if (arg.ok()) arg = CheckBuffer(data, count, "all_reduce buffer");
    return Issue([=](uint64_t seq) { return OpLabel("all_reduce", seq, count, dtype, op); },
                 std::move(arg),
                 [=, this](OpState& st, uint64_t seq) {
                   RingAllReduce(st, seq, static_cast<uint8_t*>(data), count, dtype, op);
                 });
  }

  WorkPtr BroadcastAsync(void* data, size_t count, DType dtype, int root) override {
    Status arg = DTypeCheck(dtype);
    if (arg.ok()) arg = CheckRoot(root, world_);
    if (arg.ok()) arg = CheckBuffer(data, count, "broadcast buffer");
    return Issue(
        [=](uint64_t seq) {
          return OpLabel("broadcast", seq, count, dtype) + " from rank " + std::to_string(root);
        },
        std::move(arg),
        [=, this](OpState& st, uint64_t seq) {
          ChainBroadcast(st, seq, static_cast<uint8_t*>(data), count, dtype, root);
        });
  }

  WorkPtr BarrierAsync() override {
    return Issue([](uint64_t seq) { return "barrier #" + std::to_string(seq); }, Status::Ok(),
                 [this](OpState& st, uint64_t seq) { DisseminationBarrier(st, seq); });
  }

  WorkPtr AllGatherCoalescedAsync(std::span<const GatherItem> items_in, DType dtype) override {
    std::vector<GatherItem> items(items_in.begin(), items_in.end());
    Status arg = DTypeCheck(dtype);
    size_t total = 0;
    for (size_t i = 0; i < items.size() && arg.ok(); ++i) {
      const std::string what = "all_gather_coalesced item " + std::to_string(i);
      arg = CheckBuffer(items[i].shard, Partition(items[i].total, world_, rank_).count,
                        what + " shard");
      if (arg.ok()) arg = CheckBuffer(items[i].full, items[i].total, what + " output");
      total += items[i].total;
    }
    const size_t n_items = items.size();
    return Issue(
        [=](uint64_t seq) {
          return OpLabel("all_gather_coalesced", seq, total, dtype) + " of " +
                 std::to_string(n_items) + " buffers";
        },
        std::move(arg),
        [items = std::move(items), dtype, this](OpState& st, uint64_t seq) {
          CoalescedAllGather(st, seq, items, dtype);
        });
  }

  WorkPtr ReduceScatterCoalescedAsync(std::span<const ScatterItem> items_in, DType dtype,
                                      ReduceOp op) override {
    std::vector<ScatterItem> items(items_in.begin(), items_in.end());
    Status arg = DTypeCheck(dtype);
    if (arg.ok()) arg = ReduceOpCheck(op);
    size_t total = 0;
    for (size_t i = 0; i < items.size() && arg.ok(); ++i) {
      const std::string what = "reduce_scatter_coalesced item " + std::to_string(i);
      arg = CheckBuffer(items[i].full, items[i].total, what + " input");
      if (arg.ok()) {
        arg = CheckBuffer(items[i].shard, Partition(items[i].total, world_, rank_).count,
                          what + " shard");
      }
      total += items[i].total;
    }
    const size_t n_items = items.size();
    return Issue(
        [=](uint64_t seq) {
          return OpLabel("reduce_scatter_coalesced", seq, total, dtype, op) + " of " +
                 std::to_string(n_items) + " buffers";
        },
        std::move(arg),
        [items = std::move(items), dtype, op, this](OpState& st, uint64_t seq) {
          CoalescedReduceScatter(st, seq, items, dtype, op);
        });
  }

  WorkPtr AllReduceCoalescedAsync(std::span<const ReduceItem> items_in, DType dtype,
                                  ReduceOp op) override {
    std::vector<ReduceItem> items(items_in.begin(), items_in.end());
    Status arg = DTypeCheck(dtype);
    if (arg.ok()) arg = ReduceOpCheck(op);
    size_t total = 0;
    for (size_t i = 0; i < items.size() && arg.ok(); ++i) {
      arg = CheckBuffer(items[i].data, items[i].count,
                        "all_reduce_coalesced item " + std::to_string(i));
      total += items[i].count;
    }
    const size_t n_items = items.size();
    return Issue(
        [=](uint64_t seq) {
          return OpLabel("all_reduce_coalesced", seq, total, dtype, op) + " of " +
                 std::to_string(n_items) + " buffers";
        },
        std::move(arg),
        [items = std::move(items), dtype, op, this](OpState& st, uint64_t seq) {
          CoalescedAllReduce(st, seq, items, dtype, op);
        });
  }

 private:
  Result<std::unique_ptr<Communicator>> DuplicateImpl() const override {
    return CreateGlooCommunicator(origin_, options_);
  }

  using Body = std::function<void(OpState&, uint64_t)>;

  // Assigns the next sequence number and queues `body`; an argument error completes at
  // once (nothing is issued, the communicator stays healthy).
  template <typename LabelFn>
  WorkPtr Issue(LabelFn label, Status arg, Body body) {
    std::lock_guard<std::mutex> lock(issue_mu_);
    const uint64_t seq = next_seq_++;
    std::string desc = label_ + ": " + label(seq);
    if (!arg.ok()) return CompletedWork(std::move(arg).WithContext(desc));
    return queue_->Submit(
        desc, [this, seq, desc, body = std::move(body)]() { return Execute(seq, desc, body); });
  }

  // Runs on the worker thread.
  Status Execute(uint64_t seq, const std::string& desc, const Body& body) {
    operations_.fetch_add(1, std::memory_order_relaxed);
    OpState st;
    st.desc = desc;
    st.timeout = options_.timeout;
    st.deadline = Clock::now() + options_.timeout;
    auto where = [&] {
      std::string s = desc;
      if (st.peer >= 0) s += std::string(": ") + st.action + " rank " + std::to_string(st.peer);
      return s;
    };
    Status status;
    try {
      body(st, seq);
      return Status::Ok();
    } catch (const TransferError& e) {
      status = Status(e.status.code(), where() + ": " + e.status.message());
    } catch (const std::bad_alloc&) {
      status = FromException(StatusCode::kResourceExhausted, where(), "out of memory");
    } catch (const std::exception& e) {
      status = FromException(StatusCode::kInternal, where(), e.what());
    }
    CloseConnections(status);  // before st.buffers go away
    return status;
  }

  // The first error breaks the communicator: close every connection (once) so that peers
  // waiting on this rank fail at once instead of at their timeout, and no late data can
  // reach a buffer of the failed operation. The peers are told the error (the transport's
  // abort farewell), so theirs names the root cause, e.g. the rank that was lost.
  void CloseConnections(const Status& why) {
    if (transport_ == nullptr || closed_.exchange(true)) return;
    transport_->Close(why);
  }

  std::vector<size_t> BalancedCounts(size_t total) const {
    std::vector<size_t> counts(static_cast<size_t>(world_));
    for (int b = 0; b < world_; ++b)
      counts[b] = Partition(total, world_, b).count;
    return counts;
  }

  int Block(int x) const { return ((x % world_) + world_) % world_; }

  Ub* Buffer(OpState& st, void* ptr, size_t bytes) {
    auto ub = std::make_unique<Ub>();
    ub->ptr = static_cast<uint8_t*>(ptr);
    ub->size = bytes;
    st.buffers.push_back(std::move(ub));
    return st.buffers.back().get();
  }

  void PostSend(Ub& ub, int peer, uint64_t slot, size_t offset, size_t bytes) {
    STRATA_CHECK(ub.send == nullptr && offset + bytes <= ub.size);
    ub.send = transport_->Send(peer, slot, ub.ptr + offset, bytes);
    sent_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void PostRecv(Ub& ub, int peer, uint64_t slot, size_t offset, size_t bytes) {
    STRATA_CHECK(ub.recv == nullptr && offset + bytes <= ub.size);
    ub.recv = transport_->Recv(peer, slot, ub.ptr + offset, bytes);
  }

  void WaitRecv(Ub& ub, OpState& st, int peer) { WaitOn(ub.recv, st, peer, false); }
  void WaitSend(Ub& ub, OpState& st, int peer) { WaitOn(ub.send, st, peer, true); }

  // Waits for the transfer with `peer` until the operation's deadline; a failure (the
  // connection broke, or the deadline passed) throws TransferError naming the peer.
  void WaitOn(Transfer& t, OpState& st, int peer, bool send) {
    STRATA_CHECK(t != nullptr);
    st.peer = peer;
    st.action = send ? "sending to" : "receiving from";
    Status s = transport_->Wait(*t, st.deadline);
    if (!s.ok()) {
      if (s.code() == StatusCode::kDeadlineExceeded) {
        s = DeadlineExceededError("not done within the timeout of " +
                                  std::to_string(options_.timeout.count()) + " ms");
      }
      throw TransferError(std::move(s));
    }
    t.reset();
    st.peer = -1;
  }

  uint8_t* Scratch(std::unique_ptr<uint8_t[]>& buf, size_t& cap, size_t bytes) {
    if (bytes > cap) {
      buf.reset();
      buf = std::make_unique_for_overwrite<uint8_t[]>(bytes);
      cap = bytes;
    }
    return buf.get();
  }

  // Ring reduce-scatter over blocks of `counts[b]` elements laid out in order in `in`;
  // `out` receives the reduction of block `rank_` (it may alias that block of `in`).
  void RingReduceScatter(OpState& st, uint64_t seq, uint32_t phase, const uint8_t* in, uint8_t* out,
                         const std::vector<size_t>& counts, DType dtype, ReduceOp op) {
    const int W = world_;
    const int r = rank_;
    const size_t es = DTypeSize(dtype);
    if (W == 1) {
      if (counts[0] > 0 && out != in) std::memmove(out, in, counts[0] * es);
      return;
    }
    std::vector<size_t> off(static_cast<size_t>(W) + 1, 0);
    for (int b = 0; b < W; ++b)
      off[b + 1] = off[b] + counts[b];
    const size_t maxc = *std::max_element(counts.begin(), counts.end());
    if (maxc == 0) return;
    const int right = Block(r + 1);
    const int left = Block(r - 1);
    const size_t K = std::max<size_t>(1, kChunkBytes / es);
    const size_t nc = (maxc + K - 1) / K;
    auto len = [&](int b, size_t c) -> size_t {
      const size_t start = c * K;
      return start >= counts[b] ? 0 : std::min(K, counts[b] - start);
    };
    auto msg = [&](int s, size_t c) { return static_cast<uint64_t>(s) * nc + c; };

    uint8_t* R = Scratch(rs_scratch_, rs_scratch_cap_, 3 * maxc * es);
    uint8_t* P[2] = {R + maxc * es, R + 2 * maxc * es};
    std::vector<Ub*> rub(nc, nullptr), iub(nc, nullptr);
    std::vector<Ub*> pub[2] = {std::vector<Ub*>(nc, nullptr), std::vector<Ub*>(nc, nullptr)};
    std::vector<uint8_t> ppend(2 * nc, 0);
    for (size_t c = 0; c < nc; ++c) {
      const size_t bytes = std::min(K, maxc - c * K) * es;
      rub[c] = Buffer(st, R + c * K * es, bytes);
      if (W > 2) {
        pub[0][c] = Buffer(st, P[0] + c * K * es, bytes);
        pub[1][c] = Buffer(st, P[1] + c * K * es, bytes);
      }
    }
    // Step 0: send this rank's own contribution to block r-1, receive block r-2.
    const int b0 = Block(r - 1);
    for (size_t c = 0; c < nc; ++c) {
      const size_t L = len(b0, c);
      if (L == 0) continue;
      iub[c] = Buffer(st, const_cast<uint8_t*>(in) + (off[b0] + c * K) * es, L * es);
      PostSend(*iub[c], right, MakeSlot(seq, phase, msg(0, c)), 0, L * es);
    }
    const int br0 = Block(r - 2);
    for (size_t c = 0; c < nc; ++c) {
      const size_t L = len(br0, c);
      if (L > 0) PostRecv(*rub[c], left, MakeSlot(seq, phase, msg(0, c)), 0, L * es);
    }
    // An output that overlaps the input anywhere but at block r (e.g. the shard written to
    // the start of the input) must not be written while step 0 still sends from the input.
    const uint8_t* in_end = in + off[W] * es;
    const bool out_overlaps =
        out != in + off[r] * es && out < in_end && out + counts[r] * es > in && counts[r] > 0;
    for (int s = 0; s <= W - 2; ++s) {
      if (s == W - 2 && out_overlaps) {
        for (size_t c = 0; c < nc; ++c) {
          if (iub[c] != nullptr) WaitSend(*iub[c], st, right);
          iub[c] = nullptr;
        }
      }
      const int br = Block(r - s - 2);       // block received in this step
      const int next_br = Block(r - s - 3);  // block received in the next step
      const bool last = s == W - 2;          // br == r
      for (size_t c = 0; c < nc; ++c) {
        const size_t L = len(br, c);
        if (L > 0) {
          WaitRecv(*rub[c], st, left);
          received_.fetch_add(L * es, std::memory_order_relaxed);
          const uint8_t* own = in + (off[br] + c * K) * es;
          const uint8_t* got = R + c * K * es;
          if (!last) {
            const int x = (s + 1) & 1;
            if (ppend[x * nc + c]) {
              WaitSend(*pub[x][c], st, right);
              ppend[x * nc + c] = 0;
            }
            uint8_t* partial = P[x] + c * K * es;
            ReduceSum(dtype, got, own, partial, L);
            PostSend(*pub[x][c], right, MakeSlot(seq, phase, msg(s + 1, c)), 0, L * es);
            ppend[x * nc + c] = 1;
          } else {
            uint8_t* dst = out + c * K * es;
            if (op == ReduceOp::kAvg) {
              ReduceSumDivide(dtype, got, own, dst, L, W);
            } else {
              ReduceSum(dtype, got, own, dst, L);
            }
          }
        }
        if (!last) {
          const size_t L2 = len(next_br, c);
          if (L2 > 0) {
            PostRecv(*rub[c], left, MakeSlot(seq, phase, msg(s + 1, c)), 0, L2 * es);
          }
        }
      }
    }
    for (size_t c = 0; c < nc; ++c) {
      if (iub[c]) WaitSend(*iub[c], st, right);
      for (int x = 0; x < 2; ++x) {
        if (ppend[x * nc + c]) WaitSend(*pub[x][c], st, right);
      }
    }
  }

  // Ring all-gather of blocks of `counts[b]` elements into `out` (laid out in order);
  // `own` holds this rank's block (it may be that block of `out`).
  void RingAllGather(OpState& st, uint64_t seq, uint32_t phase, const uint8_t* own, uint8_t* out,
                     const std::vector<size_t>& counts, DType dtype) {
    const int W = world_;
    const int r = rank_;
    const size_t es = DTypeSize(dtype);
    std::vector<size_t> off(static_cast<size_t>(W) + 1, 0);
    for (int b = 0; b < W; ++b)
      off[b + 1] = off[b] + counts[b];
    if (counts[r] > 0 && own != out + off[r] * es) {
      std::memmove(out + off[r] * es, own, counts[r] * es);
    }
    if (W == 1) return;
    const size_t maxc = *std::max_element(counts.begin(), counts.end());
    if (maxc == 0) return;
    const int right = Block(r + 1);
    const int left = Block(r - 1);
    const size_t K = std::max<size_t>(1, kChunkBytes / es);
    const size_t nc = (maxc + K - 1) / K;
    auto len = [&](int b, size_t c) -> size_t {
      const size_t start = c * K;
      return start >= counts[b] ? 0 : std::min(K, counts[b] - start);
    };
    auto msg = [&](int s, size_t c) { return static_cast<uint64_t>(s) * nc + c; };
    std::vector<Ub*> ub(static_cast<size_t>(W) * nc, nullptr);
    std::vector<uint8_t> spend(static_cast<size_t>(W) * nc, 0);
    for (int b = 0; b < W; ++b) {
      for (size_t c = 0; c < nc; ++c) {
        const size_t L = len(b, c);
        if (L > 0) ub[b * nc + c] = Buffer(st, out + (off[b] + c * K) * es, L * es);
      }
    }
    // Every block but ours arrives once from the left, block b in step r-1-b.
    for (int b = 0; b < W; ++b) {
      if (b == r) continue;
      const int s = Block(r - 1 - b);
      for (size_t c = 0; c < nc; ++c) {
        const size_t L = len(b, c);
        if (L > 0) PostRecv(*ub[b * nc + c], left, MakeSlot(seq, phase, msg(s, c)), 0, L * es);
      }
    }
    for (size_t c = 0; c < nc; ++c) {
      const size_t L = len(r, c);
      if (L == 0) continue;
      PostSend(*ub[r * nc + c], right, MakeSlot(seq, phase, msg(0, c)), 0, L * es);
      spend[r * nc + c] = 1;
    }
    for (int s = 0; s <= W - 2; ++s) {
      const int br = Block(r - s - 1);
      for (size_t c = 0; c < nc; ++c) {
        const size_t L = len(br, c);
        if (L == 0) continue;
        Ub& b = *ub[br * nc + c];
        WaitRecv(b, st, left);
        received_.fetch_add(L * es, std::memory_order_relaxed);
        if (s < W - 2) {
          PostSend(b, right, MakeSlot(seq, phase, msg(s + 1, c)), 0, L * es);
          spend[br * nc + c] = 1;
        }
      }
    }
    for (size_t i = 0; i < ub.size(); ++i) {
      if (spend[i]) WaitSend(*ub[i], st, right);
    }
  }

  void RingAllReduce(OpState& st, uint64_t seq, uint8_t* data, size_t count, DType dtype,
                     ReduceOp op) {
    if (world_ == 1 || count == 0) return;
    const std::vector<size_t> counts = BalancedCounts(count);
    const size_t es = DTypeSize(dtype);
    uint8_t* mine = data + Partition(count, world_, rank_).offset * es;
    RingReduceScatter(st, seq, 0, data, mine, counts, dtype, op);
    RingAllGather(st, seq, 1, mine, data, counts, dtype);
  }

  // Pipelined chain root -> root+1 -> ... -> root-1.
  void ChainBroadcast(OpState& st, uint64_t seq, uint8_t* data, size_t count, DType dtype,
                      int root) {
    if (world_ == 1 || count == 0) return;
    const size_t es = DTypeSize(dtype);
    const int pos = Block(rank_ - root);
    const int prev = Block(rank_ - 1);
    const int next = Block(rank_ + 1);
    const size_t K = std::max<size_t>(1, kChunkBytes / es);
    const size_t nc = (count + K - 1) / K;
    std::vector<Ub*> ub(nc, nullptr);
    for (size_t c = 0; c < nc; ++c) {
      const size_t L = std::min(K, count - c * K);
      ub[c] = Buffer(st, data + c * K * es, L * es);
      if (pos > 0) PostRecv(*ub[c], prev, MakeSlot(seq, 0, c), 0, L * es);
    }
    const bool forwards = pos < world_ - 1;
    for (size_t c = 0; c < nc; ++c) {
      const size_t L = std::min(K, count - c * K);
      if (pos > 0) {
        WaitRecv(*ub[c], st, prev);
        received_.fetch_add(L * es, std::memory_order_relaxed);
      }
      if (forwards) {
        PostSend(*ub[c], next, MakeSlot(seq, 0, c), 0, L * es);
      }
    }
    if (forwards) {
      for (size_t c = 0; c < nc; ++c)
        WaitSend(*ub[c], st, next);
    }
  }

  // Round k: a token to rank+2^k, one from rank-2^k. No payload bytes are counted.
  void DisseminationBarrier(OpState& st, uint64_t seq) {
    if (world_ == 1) return;
    uint8_t out_token = 1;
    uint8_t in_token = 0;
    for (int k = 0; (1 << k) < world_; ++k) {
      const int to = Block(rank_ + (1 << k));
      const int from = Block(rank_ - (1 << k));
      Ub* in = Buffer(st, &in_token, 1);
      Ub* out = Buffer(st, &out_token, 1);
      // Tokens are not payload: not counted in CommStats.
      in->recv = transport_->Recv(from, MakeSlot(seq, 0, static_cast<uint64_t>(k)), in->ptr, 1);
      out->send = transport_->Send(to, MakeSlot(seq, 0, static_cast<uint64_t>(k)), out->ptr, 1);
      WaitRecv(*in, st, from);
      WaitSend(*out, st, to);
    }
  }

  // Coalesced calls: rank-major packing into one staging buffer, one collective, unpack.
  void CoalescedAllGather(OpState& st, uint64_t seq, const std::vector<GatherItem>& items,
                          DType dtype) {
    const size_t es = DTypeSize(dtype);
    if (world_ == 1) {
      // One rank's shard is the whole: no packing, no scratch (which would hold the items
      // twice for the communicator's life).
      for (const auto& it : items) {
        if (it.total > 0 && it.shard != it.full) std::memmove(it.full, it.shard, it.total * es);
      }
      return;
    }
    std::vector<size_t> totals;
    totals.reserve(items.size());
    for (const auto& it : items)
      totals.push_back(it.total);
    const std::vector<size_t> counts = CoalescedCounts(totals, world_);
    std::vector<size_t> off(static_cast<size_t>(world_) + 1, 0);
    for (int b = 0; b < world_; ++b)
      off[b + 1] = off[b] + counts[b];
    if (off[world_] == 0) return;
    uint8_t* packed = Scratch(pack_, pack_cap_, off[world_] * es);
    size_t pos = off[rank_];
    for (const auto& it : items) {
      const size_t n = Partition(it.total, world_, rank_).count;
      if (n > 0) std::memcpy(packed + pos * es, it.shard, n * es);
      pos += n;
    }
    RingAllGather(st, seq, 0, packed + off[rank_] * es, packed, counts, dtype);
    for (int q = 0; q < world_; ++q) {
      size_t p = off[q];
      for (const auto& it : items) {
        const Shard sh = Partition(it.total, world_, q);
        if (sh.count > 0) {
          std::memcpy(static_cast<uint8_t*>(it.full) + sh.offset * es, packed + p * es,
                      sh.count * es);
        }
        p += sh.count;
      }
    }
  }

  void CoalescedReduceScatter(OpState& st, uint64_t seq, const std::vector<ScatterItem>& items,
                              DType dtype, ReduceOp op) {
    const size_t es = DTypeSize(dtype);
    if (world_ == 1) {
      // The reduction of one rank is its input (sum and average alike): no packing, no
      // scratch (which would hold the items twice for the communicator's life).
      for (const auto& it : items) {
        if (it.total > 0 && it.shard != it.full) std::memmove(it.shard, it.full, it.total * es);
      }
      return;
    }
    std::vector<size_t> totals;
    totals.reserve(items.size());
    for (const auto& it : items)
      totals.push_back(it.total);
    const std::vector<size_t> counts = CoalescedCounts(totals, world_);
    std::vector<size_t> off(static_cast<size_t>(world_) + 1, 0);
    for (int b = 0; b < world_; ++b)
      off[b + 1] = off[b] + counts[b];
    if (off[world_] == 0) return;
    // The packed input, then room for this rank's reduced part.
    uint8_t* packed = Scratch(pack_, pack_cap_, (off[world_] + counts[rank_]) * es);
    uint8_t* result = packed + off[world_] * es;
    for (int q = 0; q < world_; ++q) {
      size_t p = off[q];
      for (const auto& it : items) {
        const Shard sh = Partition(it.total, world_, q);
        if (sh.count > 0) {
          std::memcpy(packed + p * es, static_cast<const uint8_t*>(it.full) + sh.offset * es,
                      sh.count * es);
        }
        p += sh.count;
      }
    }
    RingReduceScatter(st, seq, 0, packed, result, counts, dtype, op);
    size_t p = 0;
    for (const auto& it : items) {
      const size_t n = Partition(it.total, world_, rank_).count;
      if (n > 0) std::memcpy(it.shard, result + p * es, n * es);
      p += n;
    }
  }

  void CoalescedAllReduce(OpState& st, uint64_t seq, const std::vector<ReduceItem>& items,
                          DType dtype, ReduceOp op) {
    const size_t es = DTypeSize(dtype);
    size_t total = 0;
    for (const auto& it : items)
      total += it.count;
    if (total == 0 || world_ == 1) return;
    uint8_t* packed = Scratch(pack_, pack_cap_, total * es);
    size_t p = 0;
    for (const auto& it : items) {
      if (it.count > 0) std::memcpy(packed + p * es, it.data, it.count * es);
      p += it.count;
    }
    RingAllReduce(st, seq, packed, total, dtype, op);
    p = 0;
    for (const auto& it : items) {
      if (it.count > 0) std::memcpy(it.data, packed + p * es, it.count * es);
      p += it.count;
    }
  }

  const int rank_;
  const int world_;
  const CommOptions options_;
  const std::string label_;
  const Rendezvous origin_;
  std::unique_ptr<TcpTransport> transport_;  // null when world_ == 1

  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> operations_{0};
  std::atomic<bool> closed_{false};

  // Worker-thread only: staging for the rings and the coalesced calls, grown on demand.
  std::unique_ptr<uint8_t[]> rs_scratch_;
  size_t rs_scratch_cap_ = 0;
  std::unique_ptr<uint8_t[]> pack_;
  size_t pack_cap_ = 0;

  std::mutex issue_mu_;
  uint64_t next_seq_ = 0;  // guarded by issue_mu_
  // Last: destroyed first, so the worker is joined before the transport goes away.
  std::unique_ptr<OpQueue> queue_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const Rendezvous& rendezvous,
                                                             const CommOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));
  const std::string label = RankLabel(Backend::kGloo, rendezvous.rank, rendezvous.world_size);
  if (options.device.kind != Device::Kind::kCpu) {
    return InvalidArgumentError(label +
                                ": the gloo backend takes host (CPU) buffers only, but "
                                "CommOptions.device is CUDA device " +
                                std::to_string(options.device.index));
  }
  if (rendezvous.world_size == 1) {
    return std::unique_ptr<Communicator>(
        std::make_unique<GlooCommunicator>(rendezvous, options, std::unique_ptr<TcpTransport>()));
  }
  Result<std::shared_ptr<comm::Store>> counted = CommunicatorStore(rendezvous, Backend::kGloo);
  if (!counted.ok()) return counted.status().WithContext(label);
  std::shared_ptr<comm::Store> store = *std::move(counted);
  STRATA_ASSIGN_OR_RETURN(std::string host, ListenHost(options, rendezvous));
  const std::string where = label + ": connecting to the other ranks (listening on " + host + ")";
  auto transport =
      TcpTransport::Connect(rendezvous.rank, rendezvous.world_size, host, *store, options.timeout);
  if (!transport.ok()) return transport.status().WithContext(where);
  Rendezvous origin = rendezvous;
  origin.store = std::move(store);
  return std::unique_ptr<Communicator>(
      std::make_unique<GlooCommunicator>(std::move(origin), options, std::move(*transport)));
}

}  // namespace strata::comm::internal
