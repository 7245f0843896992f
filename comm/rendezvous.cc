// Rendezvous from torchrun's environment, and the c10d TCPStore adapter.
//
// This is the one translation unit of comm/ that includes LibTorch (c10d's TCPStore, so
// that ranks meet the store torchrun's agent hosts). Built with STRATA_TORCH=OFF it has no
// TCP store: a multi-rank rendezvous is then Unimplemented (naming the build option) and a
// single-process run uses the in-process store.
#include "strata/comm/rendezvous.h"

#include <charconv>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#if defined(STRATA_HAVE_TORCH)
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

#include "strata/core/logging.h"

namespace strata::comm {
namespace {

#if defined(STRATA_HAVE_TORCH)

bool LooksLikeTimeout(std::string_view what) {
  return what.find("imeout") != std::string_view::npos ||
         what.find("timed out") != std::string_view::npos;
}

std::string JoinKeys(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys)
    s += (s.empty() ? "'" : ", '") + k + "'";
  return s;
}

// c10d's TCPStore behind our Store interface; c10d's exceptions become Status values.
class C10dStore final : public Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::TCPStore> store, std::string endpoint)
      : store_(std::move(store)), endpoint_(std::move(endpoint)) {}

  Status Set(const std::string& key, const std::vector<uint8_t>& value) override {
    return Guard("setting key '" + key + "'", [&] { store_->set(key, value); });
  }

  Result<std::vector<uint8_t>> Get(const std::string& key,
                                   std::chrono::milliseconds timeout) override {
    std::vector<uint8_t> value;
    Status s =
        Guard("waiting for key '" + key + "' (" + std::to_string(timeout.count()) + " ms)", [&] {
          store_->wait({key}, timeout);
          value = store_->get(key);
        });
    if (!s.ok()) return s;
    return value;
  }

  Result<int64_t> Add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    Status s = Guard("adding to key '" + key + "'", [&] { value = store_->add(key, delta); });
    if (!s.ok()) return s;
    return value;
  }

  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    return Guard(
        "waiting for keys " + JoinKeys(keys) + " (" + std::to_string(timeout.count()) + " ms)",
        [&] { store_->wait(keys, timeout); });
  }

 private:
  template <typename Fn>
  Status Guard(const std::string& what, Fn fn) {
    std::string message;
    try {
      fn();
      return Status::Ok();
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    } catch (const std::exception& e) {
      message = e.what();
    }
    const std::string text = "store " + endpoint_ + ": " + what + ": " + message;
    return LooksLikeTimeout(message) ? DeadlineExceededError(text) : UnavailableError(text);
  }

  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::string endpoint_;
};

Result<std::shared_ptr<Store>> ConnectTcpStore(const std::string& host, int port, bool server,
                                               int world_size, std::chrono::milliseconds timeout,
                                               int* bound_port) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = server;
  opts.numWorkers = static_cast<size_t>(world_size);
  // Clients count themselves in (as torch.distributed's do); the host does not wait for
  // them here: the communicator's own rendezvous waits, bounded by its timeout, and a host
  // on port 0 must return to pass its port on.
  opts.waitWorkers = !server;
  opts.timeout = timeout;
  opts.multiTenant = true;  // share the server with a torch.distributed group in this process
  const std::string endpoint = host + ":" + std::to_string(port);
  std::string message;
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
    *bound_port = store->getPort();
    return std::shared_ptr<Store>(
        std::make_shared<C10dStore>(std::move(store), host + ":" + std::to_string(*bound_port)));
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const std::string text = std::string(server ? "hosting" : "connecting to") + " the TCP store " +
                           endpoint + " (timeout " + std::to_string(timeout.count()) +
                           " ms): " + message;
  return LooksLikeTimeout(message) ? DeadlineExceededError(text) : UnavailableError(text);
}

#endif  // STRATA_HAVE_TORCH

std::optional<std::string> Env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

Result<int> ParseEnvInt(const char* name, const std::string& value, int min, int max) {
  int out = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, out);
  if (ec != std::errc() || ptr != end) {
    return InvalidArgumentError("environment variable " + std::string(name) + "='" + value +
                                "' is not an integer");
  }
  if (out < min || out > max) {
    return InvalidArgumentError("environment variable " + std::string(name) + "=" + value +
                                " is out of range [" + std::to_string(min) + ", " +
                                std::to_string(max) + "]");
  }
  return out;
}

Status Missing(const char* name, const char* why) {
  return InvalidArgumentError(std::string("environment variable ") + name + " is not set, " + why +
                              " (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
                              "MASTER_ADDR and MASTER_PORT; set all of them or none)");
}

Status Validate(int rank, int world_size, int port, bool need_port) {
  if (world_size < 1) {
    return InvalidArgumentError("world size must be at least 1, got " + std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    return InvalidArgumentError("rank " + std::to_string(rank) + " is outside [0, " +
                                std::to_string(world_size) + ")");
  }
  if (port < 0 || port > 65535 || (need_port && port == 0)) {
    return InvalidArgumentError("port " + std::to_string(port) + " is outside [" +
                                (need_port ? "1" : "0") + ", 65535]");
  }
  return Status::Ok();
}

#if !defined(STRATA_HAVE_TORCH)
Status NoTorch(const std::string& what) {
  return UnimplementedError(what +
                            ": this build of Strata has no TCP store (configured with "
                            "STRATA_TORCH=OFF; the store is c10d's TCPStore from LibTorch). "
                            "Rebuild with -DSTRATA_TORCH=ON for several processes; a "
                            "single-process run needs no store");
}
#endif

}  // namespace

std::string Rendezvous::ToString() const {
  std::ostringstream os;
  os << "rank " << rank << " of " << world_size << " (local " << local_rank << " of "
     << local_world_size << "), ";
  if (master_addr.empty()) {
    os << "in-process store";
  } else {
    os << "store " << master_addr << ":" << master_port
       << (torchrun ? " (torchrun agent's store)" : (rank == 0 ? " (hosted here)" : ""));
  }
  return os.str();
}

Result<Rendezvous> RendezvousFromEnvironment(const RendezvousOptions& options) {
  const char* kVars[] = {"RANK",        "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT"};
  bool any = false;
  for (const char* v : kVars)
    any = any || Env(v).has_value();
  Rendezvous rv;
  if (!any) {
    rv.store = InProcessStore();
    return rv;
  }
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  auto rank_s = Env("RANK");
  auto world_s = Env("WORLD_SIZE");
  if (!rank_s) return Missing("RANK", "but other rendezvous variables are");
  if (!world_s) return Missing("WORLD_SIZE", "but other rendezvous variables are");
  STRATA_ASSIGN_OR_RETURN(rv.rank, ParseEnvInt("RANK", *rank_s, 0, kMaxInt));
  STRATA_ASSIGN_OR_RETURN(rv.world_size, ParseEnvInt("WORLD_SIZE", *world_s, 1, kMaxInt));
  if (rv.rank >= rv.world_size) {
    return InvalidArgumentError("environment variable RANK=" + *rank_s +
                                " is not below WORLD_SIZE=" + *world_s);
  }
  auto local_rank_s = Env("LOCAL_RANK");
  auto local_world_s = Env("LOCAL_WORLD_SIZE");
  // DeepSpeed's launcher names the local world LOCAL_SIZE; its serial environment (one
  // process: a notebook, its unit tests) sets LOCAL_RANK alone.
  const bool deepspeed_local_size = !local_world_s && Env("LOCAL_SIZE").has_value();
  if (deepspeed_local_size) local_world_s = Env("LOCAL_SIZE");
  const char* local_world_name = deepspeed_local_size ? "LOCAL_SIZE" : "LOCAL_WORLD_SIZE";
  if (local_world_s && !local_rank_s) {
    return Missing("LOCAL_RANK",
                   deepspeed_local_size ? "but LOCAL_SIZE is" : "but LOCAL_WORLD_SIZE is");
  }
  if (local_rank_s && !local_world_s) {
    // One host assumed, as without any local variable.
    local_world_s = std::to_string(rv.world_size);
  }
  if (local_rank_s) {
    STRATA_ASSIGN_OR_RETURN(rv.local_world_size,
                            ParseEnvInt(local_world_name, *local_world_s, 1, rv.world_size));
    STRATA_ASSIGN_OR_RETURN(rv.local_rank,
                            ParseEnvInt("LOCAL_RANK", *local_rank_s, 0, rv.local_world_size - 1));
  } else {
    // Without torchrun's local variables: assume one host.
    rv.local_rank = rv.rank;
    rv.local_world_size = rv.world_size;
  }
  auto addr = Env("MASTER_ADDR");
  auto port_s = Env("MASTER_PORT");
  if (rv.world_size > 1 || addr || port_s) {
    if (!addr) return Missing("MASTER_ADDR", "but it is needed to reach the store");
    if (!port_s) return Missing("MASTER_PORT", "but it is needed to reach the store");
    STRATA_ASSIGN_OR_RETURN(rv.master_port, ParseEnvInt("MASTER_PORT", *port_s, 1, 65535));
    rv.master_addr = *addr;
  }
  rv.torchrun = Env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  std::string prefix;
  if (rv.torchrun) {
    auto attempt = Env("TORCHELASTIC_RESTART_COUNT");
    if (!attempt) {
      return InvalidArgumentError(
          "environment variable TORCHELASTIC_RESTART_COUNT is not set, but "
          "TORCHELASTIC_USE_AGENT_STORE=True is (torchrun sets both)");
    }
    STRATA_ASSIGN_OR_RETURN(int n, ParseEnvInt("TORCHELASTIC_RESTART_COUNT", *attempt, 0, kMaxInt));
    prefix = "/worker/attempt_" + std::to_string(n);
  }
  if (rv.master_addr.empty()) {  // world size 1 without a store address
    rv.store = InProcessStore();
    return rv;
  }
#if defined(STRATA_HAVE_TORCH)
  int bound = 0;
  // Under torchrun every rank is a client of the agent's store; otherwise rank 0 hosts.
  const bool server = !rv.torchrun && rv.rank == 0;
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Store> store,
                          ConnectTcpStore(rv.master_addr, rv.master_port, server, rv.world_size,
                                          options.timeout, &bound));
  rv.store = prefix.empty() ? std::move(store) : PrefixStore(prefix, std::move(store));
  STRATA_LOG(kDebug) << "rendezvous: " << rv.ToString();
  return rv;
#else
  (void)options;
  if (rv.world_size == 1) {
    STRATA_LOG(kDebug) << "rendezvous: world size 1 without a TCP store (STRATA_TORCH=OFF): "
                          "using an in-process store";
    rv.store = InProcessStore();
    return rv;
  }
  return NoTorch("RendezvousFromEnvironment (RANK=" + *rank_s + ", WORLD_SIZE=" + *world_s + ")");
#endif
}

Result<Rendezvous> RendezvousTcp(int rank, int world_size, const std::string& host, int port,
                                 const RendezvousOptions& options) {
  STRATA_RETURN_IF_ERROR(Validate(rank, world_size, port, /*need_port=*/false));
  if (port == 0 && world_size > 1 && rank != 0) {
    return InvalidArgumentError("RendezvousTcp: rank " + std::to_string(rank) +
                                " cannot connect to port 0; pass the port rank 0 bound");
  }
  Rendezvous rv;
  rv.rank = rank;
  rv.world_size = world_size;
  rv.local_rank = rank;
  rv.local_world_size = world_size;
  rv.master_addr = host;
  rv.master_port = port;
#if defined(STRATA_HAVE_TORCH)
  int bound = 0;
  STRATA_ASSIGN_OR_RETURN(
      rv.store, ConnectTcpStore(host, port, rank == 0, world_size, options.timeout, &bound));
  rv.master_port = bound;
  return rv;
#else
  (void)options;
  if (world_size == 1) {
    rv.master_addr.clear();
    rv.master_port = 0;
    rv.store = InProcessStore();
    return rv;
  }
  return NoTorch("RendezvousTcp(rank " + std::to_string(rank) + " of " +
                 std::to_string(world_size) + ", " + host + ":" + std::to_string(port) + ")");
#endif
}

}  // namespace strata::comm
