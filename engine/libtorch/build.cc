// strata::initialize for LibTorch modules: EngineState::Build and its phases, in order —
// the holders, the groups (engine/protocol/groups.h), the shapes partitioned construction
// left — then the TensorEngine over those tensors (the compute device, the communicators,
// the core, the tensors bound to it: tensor_engine.h).
#include <optional>
#include <unordered_map>

#include "strata/comm/rendezvous.h"
#include "strata/engine/libtorch/engine_state.h"
#include "strata/engine/libtorch/profiler_ranges.h"
#include "strata/engine/protocol/groups.h"

namespace strata::detail {

std::unique_ptr<comm::Communicator> GlooFromEnvironment(const char* who) {
  Result<comm::Rendezvous> rv = comm::RendezvousFromEnvironment({});
  if (!rv.ok()) Throw(rv.status().WithContext(std::string(who) + ": rendezvous"));
  comm::CommOptions co;
  if (rv->world_size == 1) co.interface = "127.0.0.1";  // nothing leaves the process
  Result<std::unique_ptr<comm::Communicator>> c =
      comm::CreateCommunicator(comm::Backend::kGloo, *rv, co);
  if (!c.ok()) Throw(c.status().WithContext(std::string(who) + ": communicator"));
  return std::move(*c);
}

std::shared_ptr<EngineState> EngineState::Build(std::shared_ptr<torch::nn::Module> model,
                                                const Config& config,
                                                std::shared_ptr<comm::Communicator> comm,
                                                const engine::EngineOptions& options) {
  if (model == nullptr) Throw(InvalidArgumentError("strata::initialize: null model"));
  // DeepSpeed's monitors are written by the Python engine (strata/monitor.py); the C++ one
  // refuses them rather than accept a setting it would ignore.
  for (const char* monitor : {"csv_monitor", "tensorboard", "wandb"}) {
    const auto& n = config.normalized;
    if (n.contains(monitor) && n[monitor].value("enabled", false)) {
      Throw(InvalidArgumentError(
          std::string("strata::initialize: ") + monitor +
          ".enabled: the monitors are written by the Python engine (strata.initialize); in "
          "C++ read Engine::statistics() (docs/engine.md), or set it to false"));
    }
  }
  if (config.normalized.is_object() && config.normalized.value("wall_clock_breakdown", false)) {
    Throw(InvalidArgumentError(
        "strata::initialize: wall_clock_breakdown: the per-phase timing lines are written by the "
        "Python engine; in C++ read Engine::timeline() (docs/engine.md), or set it to false"));
  }
  InstallProfilerRanges();  // the engine's waits as profiler ranges (profiler_ranges.h)
  auto state = std::make_shared<EngineState>();
  state->model_ = std::move(model);
  state->FindHolders();
  std::vector<TensorGroup> groups = state->PlanGroups(options);
  std::shared_ptr<comm::Communicator> init_comm = state->TakePartitionedShapes(groups, options);
  if (comm == nullptr && init_comm != nullptr) comm = init_comm;  // the ZeroInit's
  state->CheckPartitionedRanks(comm);
  TensorEngineOptions topts;
  topts.engine = options;
  topts.comm = std::move(comm);
  std::vector<torch::Tensor> buffers;
  for (const torch::Tensor& b : state->model_->buffers())
    buffers.push_back(b);
  state->engine_ =
      Value(TensorEngine::Create(std::move(groups), buffers, config, std::move(topts)));
  for (size_t k = 0; k < state->holders_.size(); ++k) {
    state->holders_[k].second->partitioned_.reset();  // the shards are in the engine now
    state->holders_[k].second->state_ = state;
    state->holders_[k].second->group_ = static_cast<int>(k + 1);
  }
  return state;
}

// The holders, in registration order (depth first); no holder inside another.
void EngineState::FindHolders() {
  for (const auto& item : model_->named_modules()) {
    auto holder = std::dynamic_pointer_cast<Zero3ModuleBase>(item.value());
    if (holder == nullptr) continue;
    for (const auto& [path, outer] : holders_) {
      if (outer == holder) {
        Throw(InvalidArgumentError("strata::initialize: the strata::zero3 module '" + item.key() +
                                   "' is registered twice (also as '" + path + "')"));
      }
      if (path.empty() || item.key().rfind(path + ".", 0) == 0) {
        Throw(InvalidArgumentError("strata::initialize: strata::zero3 module '" + item.key() +
                                   "' is nested inside strata::zero3 module '" + path +
                                   "'; wrap either the outer or the inner modules"));
      }
    }
    if (holder->bound()) {
      Throw(FailedPreconditionError("strata::initialize: the strata::zero3 module '" + item.key() +
                                    "' is already managed by another engine"));
    }
    holders_.emplace_back(item.key(), holder);
  }
}

// The groups (engine/protocol/groups.h): the root, one per holder (holder k is group k + 1,
// kept when empty), then the frozen groups; a parameter shared between holders, or used
// inside one and outside it, is refused. Each parameter keeps its other names (tied ones,
// and without a holder's ".inner": the plain model's) for safetensors files, and its
// optimizer parameter group (EngineOptions::param_group_of).
std::vector<TensorGroup> EngineState::PlanGroups(const engine::EngineOptions& options) {
  std::vector<std::string> blocks;
  for (const auto& [path, holder] : holders_)
    blocks.push_back(path.empty() ? "model" : path);
  std::vector<engine::ParamPlacement> placements;
  std::vector<torch::Tensor> tensors;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  auto place = [&](const std::string& name, const torch::Tensor& t) -> engine::ParamPlacement& {
    auto [it, added] = index.emplace(t.unsafeGetTensorImpl(), placements.size());
    if (added) {
      placements.push_back({name, {}, false, t.requires_grad()});
      tensors.push_back(t);
    }
    return placements[it->second];
  };
  for (size_t k = 0; k < holders_.size(); ++k) {
    const std::string& path = holders_[k].first;
    for (const auto& item : holders_[k].second->named_parameters()) {
      engine::ParamPlacement& p =
          place(path.empty() ? item.key() : path + "." + item.key(), item.value());
      if (p.blocks.empty() || p.blocks.back() != static_cast<int>(k))
        p.blocks.push_back(static_cast<int>(k));
    }
  }
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names;
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    names[item.value().unsafeGetTensorImpl()].push_back(item.key());
    bool inside = false;
    for (const auto& [path, holder] : holders_)
      inside = inside || path.empty() || item.key().rfind(path + ".", 0) == 0;
    if (!inside) place(item.key(), item.value()).outside = true;
  }
  engine::GroupRules rules;
  rules.refuse_shared = true;
  rules.keep_empty_blocks = true;
  rules.block_word = "strata::zero3 module";
  rules.caller = "strata::initialize";
  Result<engine::GroupPlan> plan = engine::PlanGroups(blocks, placements, rules);
  Check(plan.status());
  std::vector<TensorGroup> groups;
  for (const engine::PlannedGroup& pg : plan->groups) {
    TensorGroup gb;
    gb.name = pg.name;
    gb.frozen = pg.frozen;
    gb.companion = pg.companion;
    for (const size_t i : pg.params) {
      TensorParam p;
      p.name = placements[i].name;
      p.tensor = tensors[i];
      for (const std::string& n : names[tensors[i].unsafeGetTensorImpl()]) {
        if (n != p.name) p.aliases.push_back(n);
        if (const std::string u = Unwrapped(n); !u.empty()) p.aliases.push_back(u);
      }
      if (!pg.frozen && options.param_group_of) p.param_group = options.param_group_of(p.name);
      gb.params.push_back(std::move(p));
    }
    groups.push_back(std::move(gb));
  }
  return groups;
}

// Holders partitioned at construction (ZeroInit): their parameters are empty tensors now;
// the shapes and the rank's shard come from the construction. Returns the ZeroInit's
// communicator (null: no holder was partitioned).
std::shared_ptr<comm::Communicator> EngineState::TakePartitionedShapes(
    std::vector<TensorGroup>& groups, const engine::EngineOptions& options) {
  std::shared_ptr<comm::Communicator> init_comm;
  for (size_t k = 0; k < holders_.size(); ++k) {
    const auto& [path, holder] = holders_[k];
    const std::shared_ptr<PartitionedGroup>& pg = holder->partitioned_;
    if (pg == nullptr) continue;
    TensorGroup& gb = groups[k + 1];
    std::vector<TensorParam> none;
    TensorGroup* frozen = gb.companion < 0 ? nullptr : &groups[static_cast<size_t>(gb.companion)];
    std::vector<TensorParam>& frozen_now = frozen == nullptr ? none : frozen->params;
    auto same = [&](const std::vector<TensorParam>& now, const PartitionedParams& then) {
      bool ok = now.size() == then.names.size();
      for (size_t i = 0; ok && i < now.size(); ++i)
        ok = now[i].name == (path.empty() ? then.names[i] : path + "." + then.names[i]);
      return ok;
    };
    if (!same(gb.params, pg->trainable) || !same(frozen_now, pg->frozen)) {
      Throw(FailedPreconditionError(
          "strata::initialize: the strata::zero3 module '" + path +
          "' was partitioned at construction (strata::ZeroInit) with " +
          std::to_string(pg->trainable.names.size()) + " trainable and " +
          std::to_string(pg->frozen.names.size()) + " frozen parameters and now has " +
          std::to_string(gb.params.size()) + " and " + std::to_string(frozen_now.size()) +
          " (requires_grad or the parameters changed after construction)"));
    }
    if (pg->align_elems != options.align_elems) {
      Throw(InvalidArgumentError("strata::initialize: EngineOptions::align_elems = " +
                                 std::to_string(options.align_elems) +
                                 ", the strata::ZeroInit partitioned with " +
                                 std::to_string(pg->align_elems) + ": give both the same options"));
    }
    auto take = [](TensorGroup& group, const PartitionedParams& then) {
      for (size_t i = 0; i < group.params.size(); ++i)
        group.params[i].shape = then.shapes[i];
      group.init_shard = then.shard.span();
    };
    take(gb, pg->trainable);
    if (frozen != nullptr) take(*frozen, pg->frozen);
    if (init_comm == nullptr) init_comm = pg->comm;
  }
  return init_comm;
}

// The holders partitioned at construction were so for the engine's ranks.
void EngineState::CheckPartitionedRanks(const std::shared_ptr<comm::Communicator>& comm) const {
  if (comm == nullptr) return;  // made from torchrun's environment: so was the ZeroInit's
  for (const auto& [path, holder] : holders_) {
    const std::shared_ptr<PartitionedGroup>& pg = holder->partitioned_;
    if (pg != nullptr && (pg->world_size != comm->world_size() || pg->rank != comm->rank())) {
      Throw(InvalidArgumentError(
          "strata::initialize: the strata::zero3 module '" + path + "' was partitioned for rank " +
          std::to_string(pg->rank) + " of " + std::to_string(pg->world_size) +
          ", the engine's communicator is rank " + std::to_string(comm->rank()) + " of " +
          std::to_string(comm->world_size())));
    }
  }
}

std::string EngineState::Unwrapped(const std::string& name) const {
  for (const auto& [at, holder] : holders_) {
    const std::string prefix = at.empty() ? "inner." : at + ".inner.";
    if (name.rfind(prefix, 0) == 0)
      return (at.empty() ? "" : at + ".") + name.substr(prefix.size());
  }
  return "";
}

}  // namespace strata::detail
