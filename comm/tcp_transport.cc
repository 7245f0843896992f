// The gloo backend's TCP transport (see tcp_transport.h).
#include "strata/comm/tcp_transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <utility>

#include "strata/core/check.h"

namespace strata::comm::internal {

Result<PeerAddress> ParsePeerAddress(std::string_view text) {
  auto bad = [&](const std::string& why) {
    std::string shown(text.substr(0, 100));
    for (char& c : shown)
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
    return InvalidArgumentError("malformed address '" + shown + (text.size() > 100 ? "...'" : "'") +
                                " in the store: " + why);
  };
  const size_t space = text.find(' ');
  if (space == std::string_view::npos || space == 0) {
    return bad("expected '<numeric host> <port>'");
  }
  PeerAddress out;
  out.host = std::string(text.substr(0, space));
  const std::string_view port = text.substr(space + 1);
  if (port.empty() || port.size() > 5) return bad("the port is not 1 to 65535");
  int value = 0;
  for (const char c : port) {
    if (c < '0' || c > '9') return bad("the port is not a decimal number");
    value = value * 10 + (c - '0');
  }
  if (value < 1 || value > 65535) return bad("the port is not 1 to 65535");
  out.port = value;
  in_addr v4{};
  in6_addr v6{};
  if (::inet_pton(AF_INET, out.host.c_str(), &v4) == 1) return out;
  std::string literal = out.host;
  if (const size_t pct = literal.find('%'); pct != std::string::npos) {
    const std::string ifname = literal.substr(pct + 1);
    if (ifname.empty() || ifname.size() > 15 ||
        ifname.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                 "0123456789_.-") != std::string::npos) {
      return bad("the interface after '%' is not a name");
    }
    literal.resize(pct);
  }
  if (::inet_pton(AF_INET6, literal.c_str(), &v6) == 1) return out;
  return bad("the host is not a numeric IPv4 or IPv6 address");
}

namespace {

constexpr uint64_t kHelloMagic = 0x5354524154413031ull;  // "STRATA01"

// The reserved slot of a farewell (tcp_transport.h), the last message on a connection. Its
// payload is one byte of kind and, for an abort, the error's text (at most kMaxReason bytes).
constexpr uint64_t kFarewellSlot = ~uint64_t{0};
constexpr uint8_t kGoodbye = 0;
constexpr uint8_t kAbort = 1;
constexpr size_t kMaxReason = 4000;
// How long Close() waits for the sender threads to write their farewells.
constexpr Millis kFarewellGrace{1000};

struct Header {
  uint64_t slot;
  uint64_t bytes;
};
static_assert(sizeof(Header) == 16);

struct Hello {
  uint64_t magic;
  int32_t rank;
  int32_t world;
};

std::string Errno(std::string_view what, int err) {
  return std::string(what) + ": " + std::strerror(err);
}

// Owns a file descriptor until released.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

Millis Left(Clock::time_point deadline) {
  return std::max(Millis(0), std::chrono::duration_cast<Millis>(deadline - Clock::now()));
}

// Waits for `events` on `fd` until the deadline. OK, DeadlineExceeded or the poll error.
Status PollFor(int fd, short events, Clock::time_point deadline, std::string_view what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(Left(deadline).count(), 1000)));
    if (n > 0) return Status::Ok();
    if (n < 0 && errno != EINTR) return UnavailableError(Errno("poll", errno));
    if (Clock::now() >= deadline) return DeadlineExceededError(std::string(what));
  }
}

// Blocking full transfers on a connected socket (the transport's threads).
Status SendAll(int fd, const void* data, size_t bytes, int flags) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, flags | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return UnavailableError(Errno("send", errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Reads exactly `bytes`. *eof is set when the stream ended before the first byte.
Status RecvAll(int fd, void* data, size_t bytes, bool* eof = nullptr) {
  auto* p = static_cast<uint8_t*>(data);
  const size_t want = bytes;
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n == 0) {
      if (eof != nullptr && bytes == want) *eof = true;
      return UnavailableError(bytes == want ? "connection closed by the peer"
                                            : "connection closed by the peer in mid-message");
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return UnavailableError(Errno("recv", errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

// Reads exactly `bytes` before the deadline (set-up only; the socket is non-blocking).
Status RecvBefore(int fd, void* data, size_t bytes, Clock::time_point deadline,
                  std::string_view what) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    STRATA_RETURN_IF_ERROR(PollFor(fd, POLLIN, deadline, what));
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n == 0) return UnavailableError(std::string(what) + ": connection closed by the peer");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return UnavailableError(std::string(what) + ": " + Errno("recv", errno));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status SetBlocking(int fd, bool blocking) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return InternalError(Errno("fcntl(F_GETFL)", errno));
  const int want = blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK);
  if (::fcntl(fd, F_SETFL, want) < 0) return InternalError(Errno("fcntl(F_SETFL)", errno));
  return Status::Ok();
}

void Tune(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Resolves `host` (a name or an address) for `port` (0: any).
Result<std::vector<sockaddr_storage>> Resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return UnavailableError("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  std::vector<sockaddr_storage> out;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    sockaddr_storage ss{};
    std::memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
    out.push_back(ss);
  }
  ::freeaddrinfo(res);
  if (out.empty()) return UnavailableError("'" + host + "' resolves to no address");
  return out;
}

socklen_t Len(const sockaddr_storage& ss) {
  return ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

std::string Numeric(const sockaddr_storage& ss, int* port) {
  char host[NI_MAXHOST] = {};
  char serv[NI_MAXSERV] = {};
  ::getnameinfo(reinterpret_cast<const sockaddr*>(&ss), Len(ss), host, sizeof(host), serv,
                sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV);
  if (port != nullptr) *port = std::atoi(serv);
  return host;
}

// Connects to "<host> <port>" before the deadline, retrying while the peer is not
// listening yet.
Result<Fd> ConnectTo(const std::string& address, Clock::time_point deadline,
                     const std::string& what) {
  Result<PeerAddress> peer = ParsePeerAddress(address);
  if (!peer.ok()) return peer.status().WithContext(what);
  const std::string& host = peer->host;
  const int port = peer->port;
  STRATA_ASSIGN_OR_RETURN(std::vector<sockaddr_storage> addrs, Resolve(host, port));
  std::string last = "no address tried";
  for (;;) {
    for (const auto& ss : addrs) {
      Fd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (fd.get() < 0) return UnavailableError(what + ": " + Errno("socket", errno));
      if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&ss), Len(ss)) == 0) {
        return fd;
      }
      if (errno == EINPROGRESS) {
        Status s = PollFor(fd.get(), POLLOUT, deadline, what + ": connecting to " + address);
        if (!s.ok()) return s;
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0) return fd;
        last = Errno("connect to " + address, err);
      } else {
        last = Errno("connect to " + address, errno);
      }
    }
    if (Clock::now() >= deadline) {
      return DeadlineExceededError(what + ": " + last);
    }
    std::this_thread::sleep_for(Millis(20));
  }
}

}  // namespace

TcpTransport::TcpTransport(int rank, int world_size)
    : rank_(rank), world_(world_size), peers_(static_cast<size_t>(world_size)) {}

Result<std::unique_ptr<TcpTransport>> TcpTransport::Connect(int rank, int world_size,
                                                            const std::string& host, Store& store,
                                                            Millis timeout) {
  STRATA_CHECK(rank >= 0 && rank < world_size);
  const Clock::time_point deadline = Clock::now() + timeout;
  std::unique_ptr<TcpTransport> t(new TcpTransport(rank, world_size));

  // Listen on an ephemeral port of `host`.
  STRATA_ASSIGN_OR_RETURN(std::vector<sockaddr_storage> addrs, Resolve(host, 0));
  Fd listener;
  std::string bind_error;
  for (const auto& ss : addrs) {
    Fd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (fd.get() < 0) {
      bind_error = Errno("socket", errno);
      continue;
    }
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&ss), Len(ss)) != 0) {
      bind_error = Errno("bind to " + Numeric(ss, nullptr), errno);
      continue;
    }
    if (::listen(fd.get(), std::max(16, world_size)) != 0) {
      bind_error = Errno("listen", errno);
      continue;
    }
    listener = std::move(fd);
    break;
  }
  if (listener.get() < 0) {
    return UnavailableError("cannot listen on '" + host + "': " + bind_error);
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  int port = 0;
  const std::string numeric = Numeric(bound, &port);
  const std::string mine = numeric + " " + std::to_string(port);
  STRATA_RETURN_IF_ERROR(
      store.Set("tcp/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end())));

  // Connect to every lower rank.
  for (int p = 0; p < rank; ++p) {
    const std::string what = "connecting to rank " + std::to_string(p);
    auto addr = store.Get("tcp/" + std::to_string(p), Left(deadline));
    if (!addr.ok()) {
      return addr.status().WithContext("rank " + std::to_string(p) +
                                       " did not publish its address (has it started?)");
    }
    STRATA_ASSIGN_OR_RETURN(Fd fd,
                            ConnectTo(std::string(addr->begin(), addr->end()), deadline, what));
    const Hello hello{kHelloMagic, rank, world_size};
    STRATA_RETURN_IF_ERROR(SetBlocking(fd.get(), true));
    STRATA_RETURN_IF_ERROR(SendAll(fd.get(), &hello, sizeof(hello), 0).WithContext(what));
    t->peers_[p].fd = fd.release();
  }
  // Accept every higher rank.
  for (int accepted = 0; accepted < world_size - 1 - rank;) {
    STRATA_RETURN_IF_ERROR(PollFor(listener.get(), POLLIN, deadline,
                                   "waiting for the higher ranks to connect (" +
                                       std::to_string(world_size - 1 - rank - accepted) +
                                       " missing)"));
    Fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (fd.get() < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      return UnavailableError(Errno("accept", errno));
    }
    Hello hello{};
    STRATA_RETURN_IF_ERROR(
        RecvBefore(fd.get(), &hello, sizeof(hello), deadline, "reading a peer's greeting"));
    if (hello.magic != kHelloMagic || hello.world != world_size || hello.rank <= rank ||
        hello.rank >= world_size || t->peers_[hello.rank].fd >= 0) {
      return FailedPreconditionError("a process that is not a rank of this group connected (rank " +
                                     std::to_string(hello.rank) + " of " +
                                     std::to_string(hello.world) +
                                     "): is another job using the same store?");
    }
    STRATA_RETURN_IF_ERROR(SetBlocking(fd.get(), true));
    t->peers_[hello.rank].fd = fd.release();
    ++accepted;
  }
  for (int p = 0; p < world_size; ++p) {
    if (p != rank) Tune(t->peers_[p].fd);
  }
  t->StartThreads();
  return t;
}

void TcpTransport::StartThreads() {
  started_ = true;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    peers_[p].sender = std::thread([this, p] { SendLoop(p); });
    peers_[p].receiver = std::thread([this, p] { RecvLoop(p); });
  }
}

TcpTransport::~TcpTransport() {
  Close();
  for (auto& peer : peers_) {
    if (peer.fd >= 0) ::close(peer.fd);
  }
}

void TcpTransport::Close(const Status& reason) {
  std::lock_guard<std::mutex> close_lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  {
    std::unique_lock<std::mutex> lock(mu_);
    closing_ = true;
    farewell_ = reason;
    cv_.notify_all();
    // The sender threads write their farewells and end; one stuck in a write to a peer that
    // stopped reading is cut off by the shutdown below.
    if (started_) {
      cv_.wait_for(lock, kFarewellGrace, [&] {
        for (int p = 0; p < world_; ++p) {
          if (p != rank_ && !peers_[p].sender_done) return false;
        }
        return true;
      });
    }
  }
  for (auto& peer : peers_) {
    if (peer.fd >= 0) ::shutdown(peer.fd, SHUT_RDWR);
  }
  for (auto& peer : peers_) {
    if (peer.sender.joinable()) peer.sender.join();
    if (peer.receiver.joinable()) peer.receiver.join();
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) Break(p, UnavailableError("the connections were closed"), true);
  }
}

void TcpTransport::Finish(Transfer& t, Status status) {
  if (status.ok()) {
    t.state_.store(Transfer::kDone, std::memory_order_release);
  } else {
    t.error_ = std::move(status);
    t.state_.store(Transfer::kFailed, std::memory_order_release);
  }
}

Status TcpTransport::Lost(int peer, std::string_view detail) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) return UnavailableError("the connections were closed");
  }
  return UnavailableError("lost rank " + std::to_string(peer) + ": " + std::string(detail));
}

void TcpTransport::Break(int peer, Status error, bool connection_lost) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& p = peers_[peer];
    if (connection_lost) p.connection_lost = true;
    if (p.broken.ok()) p.broken = std::move(error);
    for (auto& t : p.sends)
      Finish(*t, p.broken);
    p.sends.clear();
    for (auto& [slot, t] : p.posted)
      Finish(*t, p.broken);
    p.posted.clear();
    // Messages read whole before the break stay receivable: a peer that sent its last
    // message and exited must not fail a receive that is posted after its end of stream.
  }
  cv_.notify_all();
}

TcpTransport::TransferPtr TcpTransport::Send(int peer, uint64_t slot, const void* data,
                                             size_t bytes) {
  STRATA_CHECK(peer >= 0 && peer < world_ && peer != rank_);
  auto t = std::make_shared<Transfer>();
  t->peer_ = peer;
  t->slot_ = slot;
  t->data_ = static_cast<uint8_t*>(const_cast<void*>(data));
  t->bytes_ = bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& p = peers_[peer];
    if (!p.broken.ok()) {
      Finish(*t, p.broken);
      return t;
    }
    p.sends.push_back(t);
  }
  cv_.notify_all();
  return t;
}

TcpTransport::TransferPtr TcpTransport::Recv(int peer, uint64_t slot, void* data, size_t bytes) {
  STRATA_CHECK(peer >= 0 && peer < world_ && peer != rank_);
  auto t = std::make_shared<Transfer>();
  t->peer_ = peer;
  t->slot_ = slot;
  t->data_ = static_cast<uint8_t*>(data);
  t->bytes_ = bytes;
  bool mismatch = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Peer& p = peers_[peer];
    auto it = p.held.find(slot);
    if (!p.broken.ok() && (it == p.held.end() || it->second.size() != bytes)) {
      Finish(*t, p.broken);
      return t;
    }
    if (it == p.held.end()) {
      p.posted.emplace(slot, t);
      return t;
    }
    if (it->second.size() == bytes) {
      if (bytes > 0) std::memcpy(t->data_, it->second.data(), bytes);
      p.held.erase(it);
      Finish(*t, Status::Ok());
    } else {
      mismatch = true;
      p.posted.emplace(slot, t);
    }
  }
  if (mismatch) {
    Break(peer,
          InternalError("rank " + std::to_string(peer) +
                        " sent a message of another size "
                        "than the receive posted for it (do the ranks run the same "
                        "operations in the same order?)"),
          true);
  } else {
    cv_.notify_all();
  }
  return t;
}

Status TcpTransport::Wait(const Transfer& t, Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return t.done(); })) {
    return DeadlineExceededError("not done within the timeout");
  }
  if (t.state_.load(std::memory_order_acquire) == Transfer::kDone) return Status::Ok();
  return t.error_;
}

void TcpTransport::SendLoop(int peer) {
  pthread_setname_np(pthread_self(), "strata-tcp-tx");
  Peer& p = peers_[peer];
  auto done = [&] {
    {
      std::lock_guard<std::mutex> lock(mu_);
      p.sender_done = true;
    }
    cv_.notify_all();
  };
  for (;;) {
    TransferPtr t;
    Status farewell;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Break() empties the queue and Send() queues nothing on a broken peer, so a queued
      // send means the peer is healthy. A peer broken by an abort still gets a farewell.
      cv_.wait(lock, [&] { return closing_ || !p.sends.empty() || p.connection_lost; });
      if (p.connection_lost) break;
      if (closing_) {
        farewell = farewell_;
      } else {
        // In flight from here: only this thread finishes it. A transfer whose bytes were
        // all written counts as sent even when the peer closes its side right after
        // reading them.
        t = p.sends.front();
        p.sends.pop_front();
      }
    }
    if (t == nullptr) {
      // The farewell, best effort: a peer that is gone finds out by itself.
      std::string payload(1, static_cast<char>(farewell.ok() ? kGoodbye : kAbort));
      if (!farewell.ok()) payload += farewell.ToString().substr(0, kMaxReason);
      const Header h{kFarewellSlot, payload.size()};
      if (SendAll(p.fd, &h, sizeof(h), MSG_MORE).ok()) {
        (void)SendAll(p.fd, payload.data(), payload.size(), 0);
      }
      break;
    }
    const Header h{t->slot_, t->bytes_};
    Status s = SendAll(p.fd, &h, sizeof(h), t->bytes_ > 0 ? MSG_MORE : 0);
    if (s.ok() && t->bytes_ > 0) s = SendAll(p.fd, t->data_, t->bytes_, 0);
    if (!s.ok()) {
      const Status error = Lost(peer, s.message());
      {
        std::lock_guard<std::mutex> lock(mu_);
        Finish(*t, p.broken.ok() ? error : p.broken);
      }
      Break(peer, error, /*connection_lost=*/true);
      break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      Finish(*t, Status::Ok());
    }
    cv_.notify_all();
  }
  done();
}

void TcpTransport::ReadFarewell(int peer, uint64_t bytes) {
  Peer& p = peers_[peer];
  const std::string who = "rank " + std::to_string(peer);
  if (bytes < 1 || bytes > 1 + kMaxReason) {
    Break(peer,
          InternalError(who + " sent a malformed farewell (" + std::to_string(bytes) + " bytes)"),
          true);
    return;
  }
  std::string payload(bytes, '\0');
  Status s = RecvAll(p.fd, payload.data(), payload.size());
  if (!s.ok()) {
    Break(peer, Lost(peer, s.message()), true);
    return;
  }
  const uint8_t kind = static_cast<uint8_t>(payload[0]);
  std::string reason = payload.substr(1);
  for (char& c : reason) {
    if (static_cast<unsigned char>(c) < 0x20 && c != '\n') c = '?';
  }
  if (kind == kGoodbye && reason.empty()) {
    Break(peer, UnavailableError(who + " closed its communicator"), true);
  } else if (kind == kAbort) {
    // Without `peer` no collective of the group can finish: fail everything, with its
    // error, which names what it was waiting for.
    const Status error = UnavailableError(who + " gave up: " + reason);
    Break(peer, error, true);
    for (int q = 0; q < world_; ++q) {
      if (q != rank_ && q != peer) Break(q, error, false);
    }
  } else {
    Break(peer, InternalError(who + " sent a farewell of unknown kind " + std::to_string(kind)),
          true);
  }
}

void TcpTransport::RecvLoop(int peer) {
  pthread_setname_np(pthread_self(), "strata-tcp-rx");
  Peer& p = peers_[peer];
  const std::string who = "rank " + std::to_string(peer);
  for (;;) {
    Header h{};
    bool eof = false;
    Status s = RecvAll(p.fd, &h, sizeof(h), &eof);
    if (!s.ok()) {
      Break(peer,
            Lost(peer, eof ? "its connection ended without a farewell (did the process die or "
                             "get killed?)"
                           : s.message()),
            true);
      return;
    }
    if (h.slot == kFarewellSlot) {
      ReadFarewell(peer, h.bytes);
      return;
    }
    TransferPtr t;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = p.posted.find(h.slot);
      if (it != p.posted.end()) {
        t = it->second;
        if (t->bytes_ != h.bytes) {
          t.reset();
        } else {
          p.posted.erase(it);
        }
      }
    }
    if (t == nullptr) {
      // Nothing posted for it yet (or a size mismatch, reported when the message is read).
      std::vector<uint8_t> held(h.bytes);
      s = RecvAll(p.fd, held.data(), held.size());
      if (!s.ok()) {
        Break(peer, Lost(peer, s.message()), true);
        return;
      }
      bool mismatch = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = p.posted.find(h.slot);
        if (it == p.posted.end()) {
          p.held.emplace(h.slot, std::move(held));
        } else if (it->second->bytes_ == h.bytes) {
          if (h.bytes > 0) std::memcpy(it->second->data_, held.data(), h.bytes);
          Finish(*it->second, Status::Ok());
          p.posted.erase(it);
        } else {
          mismatch = true;
        }
      }
      if (mismatch) {
        Break(peer,
              InternalError(who + " sent a message of another size than the receive "
                                  "posted for it (do the ranks run the same operations "
                                  "in the same order?)"),
              true);
        return;
      }
      cv_.notify_all();
      continue;
    }
    if (h.bytes > 0) s = RecvAll(p.fd, t->data_, h.bytes);
    const Status lost = s.ok() ? Status::Ok() : Lost(peer, s.message());
    {
      std::lock_guard<std::mutex> lock(mu_);
      // On failure: failed below too by Break; fail this one, which is no longer posted.
      Finish(*t, lost);
    }
    if (!s.ok()) {
      Break(peer, lost, true);
      return;
    }
    cv_.notify_all();
  }
}

}  // namespace strata::comm::internal
