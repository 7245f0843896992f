// The hook protocol both front ends drive (engine/protocol/): the group planner's rules, and
// the protocol itself on the toy model (toy_model.h) with a recording ParameterTensors in
// place of a front end's tensors — it trains as the core driven directly does, points a
// group exactly while something holds it, and refuses misuse with the front end's names.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "strata/engine/protocol/groups.h"
#include "strata/engine/protocol/hook_protocol.h"
#include "toy_model.h"

namespace strata::engine {
namespace {

using namespace toy;  // NOLINT(google-build-using-namespace): test helpers

// ---------------------------------------------------------------------------
// PlanGroups

std::vector<std::vector<size_t>> ParamsOf(const GroupPlan& p) {
  std::vector<std::vector<size_t>> out;
  for (const PlannedGroup& g : p.groups)
    out.push_back(g.params);
  return out;
}

TEST(PlanGroupsTest, TheRootTheBlocksThenTheFrozenGroupsEachInTheGivenOrder) {
  // Blocks a, b; parameters: 0 outside, 1 in b, 2 in a (frozen), 3 in a, 4 outside (frozen),
  // 5 in b.
  const std::vector<ParamPlacement> params = {
      {"emb", {}, true, true},   {"b.w", {1}, false, true},  {"a.base", {0}, false, false},
      {"a.w", {0}, false, true}, {"scale", {}, true, false}, {"b.v", {1}, false, true}};
  Result<GroupPlan> p = PlanGroups({"a", "b"}, params, GroupRules{});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->groups.size(), 5u);
  EXPECT_EQ(ParamsOf(*p), (std::vector<std::vector<size_t>>{{0}, {3}, {1, 5}, {4}, {2}}));
  EXPECT_EQ(p->groups[0].name, "root");
  EXPECT_EQ(p->groups[1].name, "a");
  EXPECT_EQ(p->groups[3].name, "root:frozen");
  EXPECT_EQ(p->groups[4].name, "a:frozen");
  EXPECT_EQ(p->groups[0].companion, 3);
  EXPECT_EQ(p->groups[1].companion, 4);
  EXPECT_EQ(p->groups[2].companion, -1);
  EXPECT_TRUE(p->groups[3].frozen && p->groups[4].frozen && !p->groups[1].frozen);
  EXPECT_EQ(p->groups[3].owner, 0);
  EXPECT_EQ(p->groups[4].owner, 1);
  EXPECT_EQ(p->groups[1].block, 0);
  EXPECT_EQ(p->groups[0].block, -1);
  EXPECT_EQ(p->group_of_block, (std::vector<int>{1, 2}));
}

TEST(PlanGroupsTest, ASharedParameterGoesToTheRootOrIsRefusedNamingIt) {
  // Tied between two blocks, and between a block and the model outside it.
  const std::vector<ParamPlacement> params = {
      {"a.w", {0}, false, true}, {"tied", {0, 1}, false, true}, {"head", {1}, true, true}};
  Result<GroupPlan> root = PlanGroups({"a", "b"}, params, GroupRules{});
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ(ParamsOf(*root), (std::vector<std::vector<size_t>>{{1, 2}, {0}}));
  EXPECT_EQ(root->group_of_block, (std::vector<int>{1, -1}));  // b has nothing of its own

  GroupRules refuse;
  refuse.refuse_shared = true;
  refuse.block_word = "strata::zero3 module";
  refuse.caller = "strata::initialize";
  Result<GroupPlan> two = PlanGroups({"a", "b"}, {params[0], params[1]}, refuse);
  ASSERT_FALSE(two.ok());
  EXPECT_EQ(two.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(two.status().message(),
            "strata::initialize: parameter 'tied' is shared between strata::zero3 modules 'a' "
            "and 'b'");
  Result<GroupPlan> outside = PlanGroups({"a", "b"}, {params[0], params[2]}, refuse);
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find(
                "parameter 'head' is used both inside strata::zero3 module 'b' and outside it"),
            std::string::npos)
      << outside.status();
  EXPECT_FALSE(PlanGroups({"a"}, {{"x", {3}, false, true}}, GroupRules{}).ok());
}

TEST(PlanGroupsTest, ABlockWithNoParameterIsDroppedOrKept) {
  const std::vector<ParamPlacement> params = {{"b.w", {1}, false, true}};
  Result<GroupPlan> dropped = PlanGroups({"a", "b"}, params, GroupRules{});
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(dropped->groups.size(), 2u);
  EXPECT_EQ(dropped->group_of_block, (std::vector<int>{-1, 1}));
  GroupRules keep;
  keep.keep_empty_blocks = true;
  Result<GroupPlan> kept = PlanGroups({"a", "b"}, params, keep);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(ParamsOf(*kept), (std::vector<std::vector<size_t>>{{}, {}, {0}}));
  EXPECT_EQ(kept->group_of_block, (std::vector<int>{1, 2}));
  // A block of frozen parameters only is kept: it is gathered (with its frozen group).
  Result<GroupPlan> frozen_only = PlanGroups({"a"}, {{"a.base", {0}, false, false}}, GroupRules{});
  ASSERT_TRUE(frozen_only.ok());
  ASSERT_EQ(frozen_only->groups.size(), 3u);
  EXPECT_TRUE(frozen_only->groups[1].params.empty());
  EXPECT_EQ(frozen_only->groups[1].companion, 2);
}

// ---------------------------------------------------------------------------
// HookProtocol

// A front end's tensors, recorded: each group's parameter addresses while pointed, and the
// calls in order.
class RecordingTensors final : public ParameterTensors {
 public:
  Status Point(int group, std::span<std::byte* const> data) override {
    if (pointed_.count(group) != 0) return InternalError("group pointed twice");
    pointed_[group] = std::vector<std::byte*>(data.begin(), data.end());
    calls_.push_back("point " + std::to_string(group));
    return Status::Ok();
  }
  Status Empty(int group) override {
    pointed_.erase(group);
    calls_.push_back("empty " + std::to_string(group));
    return Status::Ok();
  }
  Status DropGradients() override {
    calls_.push_back("drop");
    return Status::Ok();
  }
  bool pointed(int group) const { return pointed_.count(group) != 0; }
  // Parameter i of a pointed group, as floats of `dtype`.
  std::vector<float> Values(int group, size_t i, size_t numel, DType dtype) const {
    std::vector<float> v(numel);
    ConvertToFloat(pointed_.at(group)[i], dtype, numel, v.data());
    return v;
  }
  std::vector<std::string> TakeCalls() { return std::exchange(calls_, {}); }

 private:
  std::map<int, std::vector<std::byte*>> pointed_;
  std::vector<std::string> calls_;
};

std::vector<ProtocolGroup> ToyGroups() {
  std::vector<ProtocolGroup> groups = {{1, false, -1}};
  for (int k = 1; k <= kLayers; ++k)
    groups.push_back({2, false, -1});
  return groups;
}

// One micro-step of the toy model through the protocol, as a front end's hooks make it: each
// layer's forward between BeginForward and EndForward, its backward after PreBackward, its
// gradients through Gradient (which ends its backward once both arrived); the root, held
// throughout, read where it is pointed. Checks along the way that a group is pointed exactly
// while it is used.
Result<double> ProtocolMicroStep(HookProtocol& h, RecordingTensors& t, EngineCore& e,
                                 const std::vector<int>& seq, const Batch& b) {
  Status first;
  auto note = [&](Status s) {
    if (first.ok() && !s.ok()) first = s;
  };
  auto values = [&](int g) {
    std::vector<std::vector<float>> vals;
    if (!t.pointed(g)) {
      note(InternalError("group " + std::to_string(g) + " is used but not pointed"));
      for (const ParamSlot& p : e.layout(g).params)
        vals.emplace_back(p.numel, 0.0f);
      return vals;
    }
    for (size_t i = 0; i < e.layout(g).params.size(); ++i)
      vals.push_back(t.Values(g, i, e.layout(g).params[i].numel, e.dtype()));
    return vals;
  };
  Driver d;
  d.acquire = [&](int g, Phase phase) {
    if (g != 0) note(phase == Phase::kForward ? h.BeginForward(g, false) : h.PreBackward(g));
    return values(g);
  };
  d.release = [&](int g, Phase phase) {
    if (g != 0 && phase == Phase::kForward) note(h.EndForward(g, false));
    if (g != 0 && t.pointed(g))
      note(InternalError("group " + std::to_string(g) + " still pointed"));
  };
  d.grad = [&](int g, int i, const std::vector<float>& gr) {
    note(h.Gradient(g, i, gr.data(), DType::kFloat32));
  };
  STRATA_RETURN_IF_ERROR(h.BeginBackward());
  const int rows = kBatch / e.world_size();
  const double loss = ForwardBackward(d, seq, b, e.rank() * rows, rows, kBatch, e.LossMultiplier());
  STRATA_RETURN_IF_ERROR(first);
  STRATA_RETURN_IF_ERROR(h.FinishBackward());
  return loss;
}

// Trained through the protocol, the toy model's losses and parameters are the core's driven
// directly (toy_model.h's EngineMicroStep), bit for bit, with gradient accumulation.
TEST(HookProtocolTest, TrainsTheToyModelAsTheCoreDrivenDirectly) {
  Config c = BaseConfig();
  c.gradient_accumulation_steps = 2;
  const Params init = InitialParams();
  std::unique_ptr<EngineCore> direct = MakeEngine(c, SingleRank(), init);
  std::unique_ptr<EngineCore> driven = MakeEngine(c, SingleRank(), init);
  ASSERT_NE(direct, nullptr);
  ASSERT_NE(driven, nullptr);
  RecordingTensors tensors;
  HookProtocol h(*driven, ToyGroups(), tensors, {"", "Engine::"});
  ASSERT_TRUE(h.Start().ok());
  EXPECT_EQ(tensors.TakeCalls(), (std::vector<std::string>{"point 0"}));
  for (int micro = 0; micro < 6; ++micro) {
    const Batch b = MakeBatch(micro);
    Result<double> want = EngineMicroStep(*direct, Seq(micro), b);
    ASSERT_TRUE(want.ok()) << want.status();
    Result<double> got = ProtocolMicroStep(h, tensors, *driven, Seq(micro), b);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, *want) << "micro-step " << micro;
    EXPECT_FALSE(tensors.pointed(0)) << "the root is released at the end of the backward";
    ASSERT_TRUE(direct->Step().ok());
    Result<StepOutcome> out = h.Step();
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->applied, micro % 2 == 1);
    EXPECT_TRUE(tensors.pointed(0)) << "the root is taken again at step()";
  }
  const Params a = EngineParams(*direct), p = EngineParams(*driven);
  for (size_t g = 0; g < a.size(); ++g)
    for (size_t i = 0; i < a[g].size(); ++i)
      EXPECT_TRUE(BitEqual(a[g][i], p[g][i])) << "group " << g << " parameter " << i;
}

// A forward's group is pointed from BeginForward to EndForward; a backward's from
// PreBackward until all its gradients arrived; a recompute (activation checkpointing) takes
// it as the backward does, and its EndForward leaves it to the backward.
TEST(HookProtocolTest, AGroupIsPointedExactlyWhileHeld) {
  std::unique_ptr<EngineCore> e = MakeEngine(BaseConfig(), SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  RecordingTensors t;
  HookProtocol h(*e, ToyGroups(), t, {"", "Engine::"});
  ASSERT_TRUE(h.Start().ok());
  t.TakeCalls();
  ASSERT_TRUE(h.BeginBackward().ok());
  ASSERT_TRUE(h.BeginForward(1, false).ok());
  ASSERT_TRUE(h.EndForward(1, false).ok());
  EXPECT_EQ(t.TakeCalls(), (std::vector<std::string>{"point 1", "empty 1"}));
  const std::vector<float> grad(kD * kD, 0.5f);
  ASSERT_TRUE(h.PreBackward(1).ok());
  ASSERT_TRUE(h.BeginForward(1, /*recompute=*/true).ok());  // a second hold, no second point
  ASSERT_TRUE(h.EndForward(1, /*recompute=*/true).ok());
  EXPECT_TRUE(t.pointed(1));
  ASSERT_TRUE(h.Gradient(1, 0, grad.data(), DType::kFloat32).ok());
  EXPECT_TRUE(t.pointed(1)) << "one of two gradients arrived";
  ASSERT_TRUE(h.Gradient(1, 1, grad.data(), DType::kFloat32).ok());
  EXPECT_FALSE(t.pointed(1)) << "both gradients arrived: the backward's holds end";
  EXPECT_EQ(t.TakeCalls(), (std::vector<std::string>{"point 1", "empty 1"}));
  // A group whose backward got no gradient (a PostBackward would close it) ends at
  // FinishBackward, and the root with it.
  ASSERT_TRUE(h.PreBackward(2).ok());
  ASSERT_TRUE(h.PostBackward(3).ok());  // nothing held: nothing to do
  ASSERT_TRUE(h.FinishBackward().ok());
  EXPECT_EQ(t.TakeCalls(), (std::vector<std::string>{"point 2", "empty 2", "empty 0"}));
  ASSERT_TRUE(h.Step().ok());
  EXPECT_EQ(t.TakeCalls(), (std::vector<std::string>{"point 0"}));
  // A forward that raised: AbortForward releases what it held.
  ASSERT_TRUE(h.BeginForward(2, false).ok());
  ASSERT_TRUE(h.BeginForward(3, false).ok());
  ASSERT_TRUE(h.AbortForward().ok());
  EXPECT_EQ(t.TakeCalls(), (std::vector<std::string>{"point 2", "point 3", "empty 2", "empty 3"}));
  // Evaluation: the root is released with the forward-only pass and taken again.
  ASSERT_TRUE(h.BeginEval().ok());
  ASSERT_TRUE(h.BeginForward(1, false).ok());
  ASSERT_TRUE(h.EndForward(1, false).ok());
  ASSERT_TRUE(h.EndEval().ok());
  EXPECT_EQ(t.TakeCalls(), (std::vector<std::string>{"point 1", "empty 1", "empty 0", "point 0"}));
}

// Misuse is FailedPrecondition, named as the front end names its calls; a hook's error is
// kept and every later call but the hooks says the engine is unusable.
TEST(HookProtocolTest, MisuseIsRefusedAndAHooksErrorIsKept) {
  std::unique_ptr<EngineCore> e = MakeEngine(BaseConfig(), SingleRank(), InitialParams());
  ASSERT_NE(e, nullptr);
  RecordingTensors t;
  HookProtocol h(*e, ToyGroups(), t, {"strata: ", "strata: engine."});
  ASSERT_TRUE(h.Start().ok());
  Result<StepOutcome> early = h.Step();
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(early.status().message().rfind("strata: engine.step: ", 0), 0u) << early.status();
  Result<double> loss = ProtocolMicroStep(h, t, *e, Seq(0), MakeBatch(0));
  ASSERT_TRUE(loss.ok()) << loss.status();
  Status twice = h.BeginBackward();
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(twice.message(),
            "strata: engine.backward called twice without step(): call engine.step() after every "
            "engine.backward()");
  Status forward = h.BeginForward(1, false);
  EXPECT_EQ(forward.message().rfind("strata: forward after backward() without step()", 0), 0u)
      << forward;
  CheckpointSaveRequest save;
  save.dir = "/nonexistent";
  Result<std::string> saved = h.SaveCheckpoint(save);
  EXPECT_EQ(saved.status().message(),
            "strata: engine.save_checkpoint between backward() and step()");
  ASSERT_TRUE(h.Step().ok());
  ASSERT_TRUE(h.BeginEval().ok());
  EXPECT_EQ(h.BeginEval().message(), "strata: engine.begin_eval called twice");
  EXPECT_EQ(h.Step().status().message(), "strata: engine.step between begin_eval() and end_eval()");
  ASSERT_TRUE(h.EndEval().ok());
  // A gradient for a parameter the group does not have: the core refuses it, the protocol
  // keeps it, and the next call reports it.
  ASSERT_TRUE(h.BeginBackward().ok());
  ASSERT_TRUE(h.PreBackward(1).ok());
  const float g = 1.0f;
  Status bad = h.Gradient(1, 7, &g, DType::kFloat32);
  ASSERT_FALSE(bad.ok());
  Status finished = h.FinishBackward();
  EXPECT_EQ(finished.code(), bad.code());
  EXPECT_EQ(finished.message(),
            "strata: an earlier error left the engine unusable: " + bad.message());
  EXPECT_EQ(h.CheckForward().message(), finished.message());
}

}  // namespace
}  // namespace strata::engine
