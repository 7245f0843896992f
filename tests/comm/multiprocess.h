// Multi-process test harness for comm/: a test forks one process per rank, each runs a
// body that returns a Status, and the parent collects the exit codes.
//
// Children must not use GoogleTest assertions (their results would stay in the child):
// bodies check with RK_CHECK / RK_OK and return the first failure, which the child prints
// to stderr (prefixed with its rank) before it exits with code 1. The parent kills every
// child still running after `hang_guard` and reports the hang (ctest's TIMEOUT is the
// second guard). Children die with the parent (PR_SET_PDEATHSIG).
//
// Fork happens while the parent is single-threaded (the parent never creates a
// communicator or a store), so the children start from a clean state.
#pragma once

#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/core/status.h"

namespace strata::comm::testing {

#define RK_STRINGIFY2(x) #x
#define RK_STRINGIFY(x) RK_STRINGIFY2(x)
#define RK_WHERE __FILE__ ":" RK_STRINGIFY(__LINE__)

// Returns InternalError("<file:line>: check failed: cond: <streamed message>").
#define RK_CHECK(cond, msg)                                       \
  do {                                                            \
    if (!(cond)) {                                                \
      std::ostringstream rk_os_;                                  \
      rk_os_ << RK_WHERE << ": check failed: " #cond ": " << msg; \
      return ::strata::InternalError(rk_os_.str());               \
    }                                                             \
  } while (0)

#define RK_OK(expr)                                                 \
  do {                                                              \
    ::strata::Status rk_s_ = (expr);                                \
    if (!rk_s_.ok()) return rk_s_.WithContext(RK_WHERE ": " #expr); \
  } while (0)

// A TCP port that is free now, for a test that must name the store's port in advance
// (MASTER_PORT). Chosen below the kernel's ephemeral range, where outgoing connections
// never take ports, so only another listener could race for it. Prefer PortChannel.
inline int FreePort() {
  int low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  const int hi = std::max(low, 2048);
  const int lo = std::max(1024, hi - 12000);
  unsigned seed =
      static_cast<unsigned>(getpid()) * 2654435761u ^
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int attempt = 0; attempt < 200; ++attempt) {
    seed = seed * 1103515245u + 12345u;
    const int port = lo + static_cast<int>((seed >> 8) % static_cast<unsigned>(hi - lo));
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (ok) return port;
  }
  return 0;
}

// Passes the port that rank 0's store bound (port 0: the kernel's choice, no race) to the
// other ranks: a pipe created by the parent before forking.
class PortChannel {
 public:
  PortChannel() {
    if (pipe(fds_) != 0) fds_[0] = fds_[1] = -1;
  }
  ~PortChannel() {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  PortChannel(const PortChannel&) = delete;
  PortChannel& operator=(const PortChannel&) = delete;

  // Rank 0: once per reader.
  Status Publish(int port, int readers) {
    for (int i = 0; i < readers; ++i) {
      if (write(fds_[1], &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) {
        return ErrnoError(errno, "PortChannel: write");
      }
    }
    return Status::Ok();
  }
  Result<int> Await(std::chrono::milliseconds timeout) {
    pollfd p{fds_[0], POLLIN, 0};
    const int n = poll(&p, 1, static_cast<int>(timeout.count()));
    if (n <= 0) return DeadlineExceededError("PortChannel: rank 0 published no port");
    int port = 0;
    if (read(fds_[0], &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) {
      return ErrnoError(errno, "PortChannel: read");
    }
    return port;
  }

  // Ranks as threads of one process (a build without LibTorch has no TCP store, and under
  // ThreadSanitizer threads of one process are what it can see): MakeGloo meets through
  // this in-process store instead of a TCP store on rank 0.
  void UseInProcessStore() { store_ = InProcessStore(); }
  const std::shared_ptr<Store>& in_process_store() const { return store_; }

 private:
  int fds_[2] = {-1, -1};
  std::shared_ptr<Store> store_;
};

inline int ThreadCount() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(d);
  }
  return n;
}

struct ProcessResult {
  int exit_code = -1;  // exit status, or -1 when killed by a signal
  int signal = 0;
  bool hung = false;  // killed by the harness after the hang guard
};

// Runs body(i) for i in [0, n) in n child processes. One thread per process for the math
// libraries (OMP_NUM_THREADS=1 etc. are set before forking).
inline std::vector<ProcessResult> RunProcesses(
    int n, const std::function<Status(int)>& body,
    std::chrono::seconds hang_guard = std::chrono::seconds(60)) {
  // fork() copies only the calling thread: warn if the parent has others.
  if (const int threads = ThreadCount(); threads > 1) {
    std::fprintf(stderr, "multiprocess.h: warning: forking a parent with %d threads\n", threads);
  }
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("MKL_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  std::vector<pid_t> pids(static_cast<size_t>(n), -1);
  for (int i = 0; i < n; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(3);
      Status s;
      try {
        s = body(i);
      } catch (const std::exception& e) {
        s = InternalError(std::string("exception: ") + e.what());
      }
      if (!s.ok()) std::fprintf(stderr, "[process %d] FAILED: %s\n", i, s.ToString().c_str());
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(s.ok() ? 0 : 1);
    }
    pids[i] = pid;
  }
  std::vector<ProcessResult> results(static_cast<size_t>(n));
  std::vector<bool> done(static_cast<size_t>(n), false);
  const auto deadline = std::chrono::steady_clock::now() + hang_guard;
  int remaining = n;
  for (int i = 0; i < n; ++i) {
    if (pids[i] < 0) {
      done[i] = true;
      --remaining;
    }
  }
  while (remaining > 0) {
    for (int i = 0; i < n; ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t r = waitpid(pids[i], &status, WNOHANG);
      if (r == pids[i]) {
        done[i] = true;
        --remaining;
        if (WIFEXITED(status)) results[i].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) results[i].signal = WTERMSIG(status);
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int i = 0; i < n; ++i) {
        if (done[i]) continue;
        kill(pids[i], SIGKILL);
        int status = 0;
        waitpid(pids[i], &status, 0);
        results[i].hung = true;
        results[i].signal = SIGKILL;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return results;
}

inline std::string Describe(const std::vector<ProcessResult>& results) {
  std::ostringstream os;
  for (size_t i = 0; i < results.size(); ++i) {
    os << "process " << i << ": ";
    if (results[i].hung) {
      os << "HUNG (killed by the harness)";
    } else if (results[i].signal != 0) {
      os << "killed by signal " << results[i].signal;
    } else {
      os << "exit " << results[i].exit_code;
    }
    os << "\n";
  }
  return os.str();
}

inline bool AllExitedZero(const std::vector<ProcessResult>& results) {
  for (const auto& r : results) {
    if (r.hung || r.signal != 0 || r.exit_code != 0) return false;
  }
  return true;
}

// Rank `rank` of `world` meets the others through a TCP store on 127.0.0.1 (rank 0 hosts
// it on a port of the kernel's choice and passes it on through `ports`; 30 s to meet, so
// that a loaded machine does not fail the test) and builds a Gloo communicator on the
// loopback interface with `timeout`.
inline Result<std::unique_ptr<Communicator>> MakeGloo(
    int rank, int world, PortChannel& ports,
    std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  CommOptions co;
  co.timeout = timeout;
  co.interface = "127.0.0.1";
  if (ports.in_process_store() != nullptr) {
    Rendezvous rv;
    rv.rank = rv.local_rank = rank;
    rv.world_size = rv.local_world_size = world;
    rv.store = ports.in_process_store();
    return CreateCommunicator(Backend::kGloo, rv, co);
  }
  RendezvousOptions ro;
  ro.timeout = std::chrono::seconds(30);
  int port = 0;
  if (rank != 0) {
    STRATA_ASSIGN_OR_RETURN(port, ports.Await(ro.timeout));
  }
  STRATA_ASSIGN_OR_RETURN(Rendezvous rv, RendezvousTcp(rank, world, "127.0.0.1", port, ro));
  if (rank == 0) STRATA_RETURN_IF_ERROR(ports.Publish(rv.master_port, world - 1));
  return CreateCommunicator(Backend::kGloo, rv, co);
}

}  // namespace strata::comm::testing
