// EngineCore over comm's Gloo backend: 2 and 4 ranks as forked processes (the harness of
// tests/comm/multiprocess.h) train the toy model and must end with the parameters of a
// single-rank run, each holding 1/W of the optimizer state.
//
// Kept in its own executable: the parent must be single-threaded when it forks, so it
// never creates an engine (CpuAdam's thread arena) itself.
#include <gtest/gtest.h>

#include <vector>

#include "../comm/multiprocess.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers
using comm::testing::AllExitedZero;
using comm::testing::Describe;
using comm::testing::MakeGloo;
using comm::testing::PortChannel;
using comm::testing::RunProcesses;

Status RunGlooRank(const Config& c, int rank, int world, PortChannel& ports, int steps) {
  // The single-rank run, in this process, with the in-process communicator.
  const RankResult one = RunRank(c, SingleRank(), steps);
  RK_OK(one.status);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> gloo, MakeGloo(rank, world, ports));
  std::shared_ptr<comm::Communicator> comm = std::move(gloo);
  const RankResult r = RunRank(c, comm, steps);
  RK_OK(r.status);
  const double diff = RelDiff(r.params, one.params);
  RK_CHECK(diff < 1e-6, "parameters differ from the single-rank run by " << diff);
  // The ranks' losses (each over its rows) add up to the single-rank loss.
  std::vector<float> losses(r.losses.begin(), r.losses.end());
  RK_OK(comm->AllReduce(losses.data(), losses.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
  for (size_t s = 0; s < losses.size(); ++s) {
    RK_CHECK(std::abs(losses[s] - one.losses[s]) <= 1e-5 * one.losses[s],
             "step " << s << ": loss " << losses[s] << " vs " << one.losses[s]);
  }
  // 1/W of the master parameters, m and v (the single-rank partition plus padding).
  const OptimizerStats& o = r.stats.optimizer;
  const uint64_t single = one.stats.optimizer.master_bytes;
  const uint64_t w = static_cast<uint64_t>(world);
  RK_CHECK(o.master_bytes * w >= single && o.master_bytes * w <= single + w * 4 * 16 * 4,
           "master bytes " << o.master_bytes << " per rank for " << single << " on one rank");
  RK_CHECK(o.exp_avg_bytes == o.master_bytes && o.exp_avg_sq_bytes == o.master_bytes &&
               o.grad_accumulator_bytes == o.master_bytes,
           "optimizer state sizes differ");
  RK_CHECK(o.steps_applied == static_cast<uint64_t>(steps), "steps " << o.steps_applied);
  // The collectives ran and moved bytes.
  RK_CHECK(r.stats.reduce_scatter.calls > 0 && r.stats.all_gather.calls > 0,
           "reduce-scatter " << r.stats.reduce_scatter.calls << ", all-gather "
                             << r.stats.all_gather.calls);
  RK_CHECK(r.stats.comm.bytes_sent > 0, "no bytes sent");
  // A stable order: only the first iteration fetched on demand (4 groups, forward and
  // backward); every later fetch was prefetched, or found still gathered (the root group:
  // its backward use comes right after its forward use, distance 0).
  const CoordinatorStats& cs = r.stats.coordinator;
  RK_CHECK(cs.fetches_on_demand == 8, "on-demand fetches " << cs.fetches_on_demand);
  RK_CHECK(cs.fetches_prefetched + cs.fetches_reused == 8u * static_cast<uint64_t>(steps - 1) &&
               cs.fetches_prefetched >= 6u * static_cast<uint64_t>(steps - 1),
           "prefetched " << cs.fetches_prefetched << ", reused " << cs.fetches_reused);
  return Status::Ok();
}

class EngineGlooTest : public ::testing::TestWithParam<int> {};

TEST_P(EngineGlooTest, MatchesOneRankWithOneWthOfTheState) {
  const int world = GetParam();
  Config c = BaseConfig();
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kCpu;
  c.zero.stage3_max_reuse_distance = 0;
  c.gradient_clipping = 0.5;
  PortChannel ports;  // rank 0's store port, passed on through a pipe
  const auto results = RunProcesses(
      world, [&](int rank) { return RunGlooRank(c, rank, world, ports, 6); },
      std::chrono::seconds(120));
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EngineGlooTest, ::testing::Values(2, 4));

}  // namespace
}  // namespace strata::engine
