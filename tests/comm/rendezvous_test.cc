// Rendezvous from the environment: torchrun's (an agent hosts the store, every rank is a
// client with keys under /worker/attempt_<n>), a bare one (rank 0 hosts), partial and
// malformed ones (InvalidArgument naming the variable), and none at all (single process).
#include "strata/comm/rendezvous.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "multiprocess.h"
#include "strata/comm/communicator.h"
#include "strata/comm/store.h"

namespace strata::comm {
namespace {

using std::chrono::milliseconds;
using testing::AllExitedZero;
using testing::Describe;
using testing::FreePort;
using testing::PortChannel;
using testing::RunProcesses;

const char* const kVars[] = {"RANK",
                             "WORLD_SIZE",
                             "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE",
                             "LOCAL_SIZE",
                             "MASTER_ADDR",
                             "MASTER_PORT",
                             "TORCHELASTIC_USE_AGENT_STORE",
                             "TORCHELASTIC_RESTART_COUNT",
                             "GLOO_SOCKET_IFNAME"};

// Clears the rendezvous variables for the test and restores them afterwards.
class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kVars)
      unsetenv(v);
    for (const auto& [k, v] : saved_)
      setenv(k.c_str(), v.c_str(), 1);
  }
  static void Set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }

 private:
  std::map<std::string, std::string> saved_;
};

bool TorchBuild() {
#if defined(STRATA_TEST_HAVE_TORCH)
  return true;
#else
  return false;
#endif
}

TEST_F(EnvTest, NoEnvironmentIsASingleProcess) {
  auto rv = RendezvousFromEnvironment({});
  ASSERT_TRUE(rv.ok()) << rv.status();
  EXPECT_EQ(rv->rank, 0);
  EXPECT_EQ(rv->world_size, 1);
  EXPECT_EQ(rv->local_rank, 0);
  EXPECT_EQ(rv->local_world_size, 1);
  EXPECT_FALSE(rv->torchrun);
  EXPECT_TRUE(rv->master_addr.empty());
  ASSERT_NE(rv->store, nullptr);
  EXPECT_NE(rv->ToString().find("in-process"), std::string::npos) << rv->ToString();
  auto comm = CreateCommunicator(Backend::kGloo, *rv, {});
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::vector<float> x = {1, 2};
  EXPECT_TRUE((*comm)->AllReduce(x.data(), 2, DType::kFloat32, ReduceOp::kAvg).ok());
  EXPECT_EQ(x, (std::vector<float>{1, 2}));
}

void ExpectInvalid(const std::string& must_name) {
  auto rv = RendezvousFromEnvironment({std::chrono::milliseconds(500)});
  ASSERT_FALSE(rv.ok());
  EXPECT_EQ(rv.status().code(), StatusCode::kInvalidArgument) << rv.status();
  EXPECT_NE(rv.status().message().find(must_name), std::string::npos) << rv.status();
}

TEST_F(EnvTest, PartialEnvironmentNamesTheMissingVariable) {
  Set("RANK", "0");
  ExpectInvalid("WORLD_SIZE");
  unsetenv("RANK");
  Set("WORLD_SIZE", "2");
  ExpectInvalid("RANK");
  Set("RANK", "1");
  ExpectInvalid("MASTER_ADDR");
  Set("MASTER_ADDR", "127.0.0.1");
  ExpectInvalid("MASTER_PORT");
  Set("LOCAL_WORLD_SIZE", "2");
  Set("MASTER_PORT", "29500");
  ExpectInvalid("LOCAL_RANK");
}

// DeepSpeed's serial environment (its unit tests, a notebook): RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT, no LOCAL_WORLD_SIZE; its launcher's LOCAL_SIZE stands for it.
TEST_F(EnvTest, LocalRankAloneAssumesOneHostAndLocalSizeIsDeepSpeedsName) {
  if (!TorchBuild()) GTEST_SKIP() << "needs c10d's TCPStore: built with STRATA_TORCH=OFF";
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  Set("LOCAL_RANK", "0");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", std::to_string(FreePort()));
  auto rv = RendezvousFromEnvironment({std::chrono::seconds(20)});
  ASSERT_TRUE(rv.ok()) << rv.status();
  EXPECT_EQ(rv->local_rank, 0);
  EXPECT_EQ(rv->local_world_size, 1);
  Set("RANK", "1");
  Set("WORLD_SIZE", "4");
  Set("LOCAL_RANK", "1");
  Set("LOCAL_SIZE", "5");
  ExpectInvalid("LOCAL_SIZE=5");  // 5 is more than WORLD_SIZE=4
  Set("LOCAL_SIZE", "2");
  Set("LOCAL_RANK", "2");
  ExpectInvalid("LOCAL_RANK");  // outside [0, LOCAL_SIZE)
}

TEST_F(EnvTest, MalformedEnvironmentNamesTheVariable) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "two");
  ExpectInvalid("WORLD_SIZE");
  Set("WORLD_SIZE", "2");
  Set("RANK", "2");
  ExpectInvalid("RANK");
  Set("RANK", "-1");
  ExpectInvalid("RANK");
  Set("RANK", "0");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", "70000");
  ExpectInvalid("MASTER_PORT");
  Set("MASTER_PORT", "29500");
  Set("LOCAL_RANK", "3");
  Set("LOCAL_WORLD_SIZE", "2");
  ExpectInvalid("LOCAL_RANK");
  Set("LOCAL_RANK", "0");
  Set("TORCHELASTIC_USE_AGENT_STORE", "True");
  ExpectInvalid("TORCHELASTIC_RESTART_COUNT");
}

TEST_F(EnvTest, WorldOfOneNeedsNoStoreAddress) {
  Set("RANK", "0");
  Set("WORLD_SIZE", "1");
  auto rv = RendezvousFromEnvironment({});
  ASSERT_TRUE(rv.ok()) << rv.status();
  EXPECT_EQ(rv->world_size, 1);
  EXPECT_TRUE(rv->master_addr.empty());
}

TEST_F(EnvTest, WithoutTorchSeveralRanksAreUnimplemented) {
  if (TorchBuild()) GTEST_SKIP() << "this build has LibTorch (STRATA_TORCH=ON)";
  Set("RANK", "0");
  Set("WORLD_SIZE", "2");
  Set("MASTER_ADDR", "127.0.0.1");
  Set("MASTER_PORT", "29500");
  auto rv = RendezvousFromEnvironment({});
  ASSERT_FALSE(rv.ok());
  EXPECT_EQ(rv.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(rv.status().message().find("STRATA_TORCH"), std::string::npos) << rv.status();
  auto tcp = RendezvousTcp(0, 2, "127.0.0.1", 29500, {});
  ASSERT_FALSE(tcp.ok());
  EXPECT_EQ(tcp.status().code(), StatusCode::kUnimplemented);
}

// Rank `rank` all-reduces through a communicator built on `rv` and checks the sum.
Status AllReduceCheck(const Rendezvous& rv) {
  CommOptions co;
  co.timeout = std::chrono::seconds(20);
  co.interface = "127.0.0.1";
  STRATA_ASSIGN_OR_RETURN(auto comm, CreateCommunicator(Backend::kGloo, rv, co));
  std::vector<int64_t> x(101, rv.rank + 1);
  RK_OK(comm->AllReduce(x.data(), x.size(), DType::kInt64, ReduceOp::kSum));
  const int64_t want = int64_t{rv.world_size} * (rv.world_size + 1) / 2;
  for (int64_t v : x)
    RK_CHECK(v == want, "sum " << v << " want " << want);
  return Status::Ok();
}

// torchrun: process W is the agent (it hosts the TCP store and writes a key under the
// attempt prefix); processes 0..W-1 are workers that only have torchrun's environment.
// A worker that tried to host the store would fail to bind the agent's port.
void RunTorchrunLike(int world) {
  if (!TorchBuild()) GTEST_SKIP() << "needs c10d's TCPStore: built with STRATA_TORCH=OFF";
  PortChannel ports;  // the agent binds a port of the kernel's choice and passes it on
  const std::string prefix = "/worker/attempt_3";
  auto results = RunProcesses(world + 1, [&](int p) -> Status {
    if (p == world) {  // the agent
      STRATA_ASSIGN_OR_RETURN(Rendezvous agent, RendezvousTcp(0, 1, "127.0.0.1", 0, {}));
      RK_OK(ports.Publish(agent.master_port, world));
      auto workers = PrefixStore(prefix, agent.store);
      RK_OK(workers->Set("agent_marker", {'o', 'k'}));
      std::vector<std::string> done;
      for (int r = 0; r < world; ++r)
        done.push_back("done_" + std::to_string(r));
      RK_OK(workers->Wait(done, std::chrono::seconds(40)));
      return Status::Ok();
    }
    STRATA_ASSIGN_OR_RETURN(const int port, ports.Await(std::chrono::seconds(30)));
    setenv("RANK", std::to_string(p).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("LOCAL_RANK", std::to_string(p).c_str(), 1);
    setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
    setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
    STRATA_ASSIGN_OR_RETURN(Rendezvous rv, RendezvousFromEnvironment({std::chrono::seconds(20)}));
    RK_CHECK(rv.torchrun, "not detected as torchrun");
    RK_CHECK(rv.rank == p && rv.world_size == world, rv.ToString());
    RK_CHECK(rv.master_port == port, rv.ToString());
    // The agent's key is visible without the prefix: the store is already under it.
    STRATA_ASSIGN_OR_RETURN(auto marker, rv.store->Get("agent_marker", std::chrono::seconds(20)));
    RK_CHECK(marker == (std::vector<uint8_t>{'o', 'k'}), "agent_marker");
    RK_OK(AllReduceCheck(rv));
    RK_OK(rv.store->Set("done_" + std::to_string(p), {1}));
    return Status::Ok();
  });
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

TEST_F(EnvTest, TorchrunAgentStoreTwoRanks) {
  RunTorchrunLike(2);
}
TEST_F(EnvTest, TorchrunAgentStoreFourRanks) {
  RunTorchrunLike(4);
}

// A bare environment (no torchrun agent, no LOCAL_*): rank 0 hosts the store.
TEST_F(EnvTest, BareEnvironmentRankZeroHosts) {
  if (!TorchBuild()) GTEST_SKIP() << "needs c10d's TCPStore: built with STRATA_TORCH=OFF";
  const int port = FreePort();
  ASSERT_NE(port, 0);
  constexpr int kWorld = 3;
  auto results = RunProcesses(kWorld, [&](int p) -> Status {
    setenv("RANK", std::to_string(p).c_str(), 1);
    setenv("WORLD_SIZE", std::to_string(kWorld).c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    STRATA_ASSIGN_OR_RETURN(Rendezvous rv, RendezvousFromEnvironment({std::chrono::seconds(20)}));
    RK_CHECK(!rv.torchrun, rv.ToString());
    RK_CHECK(rv.local_rank == p && rv.local_world_size == kWorld, rv.ToString());
    RK_OK(AllReduceCheck(rv));
    return Status::Ok();
  });
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

// Explicit form: a second rank that never shows up makes the first fail within the
// timeout, naming what it waited for, instead of hanging.
TEST(RendezvousTcp, MissingRankTimesOut) {
  if (!TorchBuild()) GTEST_SKIP() << "needs c10d's TCPStore: built with STRATA_TORCH=OFF";
  auto results = RunProcesses(1, [&](int) -> Status {
    RendezvousOptions ro;
    ro.timeout = std::chrono::milliseconds(1000);
    const auto t0 = std::chrono::steady_clock::now();
    auto rv = RendezvousTcp(0, 2, "127.0.0.1", 0, ro);
    std::printf("RendezvousTcp after %.2f s: %s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                rv.status().ToString().c_str());
    if (!rv.ok()) {
      RK_CHECK(rv.status().code() == StatusCode::kDeadlineExceeded ||
                   rv.status().code() == StatusCode::kUnavailable,
               rv.status());
      return Status::Ok();
    }
    CommOptions co;
    co.timeout = std::chrono::milliseconds(1000);
    co.interface = "127.0.0.1";
    auto comm = CreateCommunicator(Backend::kGloo, *rv, co);
    std::printf("CreateCommunicator: %s\n", comm.status().ToString().c_str());
    RK_CHECK(!comm.ok(), "connected to a rank that does not exist");
    RK_CHECK(comm.status().code() == StatusCode::kDeadlineExceeded, comm.status());
    RK_CHECK(comm.status().message().find("gloo rank 0 of 2") != std::string::npos, comm.status());
    return Status::Ok();
  });
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

}  // namespace
}  // namespace strata::comm
