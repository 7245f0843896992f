// strata::initialize for LibTorch modules: EngineState::Build and its phases, in order —
// the holders, the groups (engine/protocol/groups.h), the shapes partitioned construction
// left, the compute device and the communicators, the core, the tensors bound to it.
#include <cstdlib>
#include <optional>
#include <unordered_map>

#include "strata/comm/rendezvous.h"
#include "strata/engine/libtorch/engine_state.h"
#include "strata/engine/libtorch/profiler_ranges.h"
#include "strata/engine/libtorch/torch_internal.h"
#include "strata/engine/protocol/groups.h"
#include "strata/engine/runtime/lanes.h"

#if defined(STRATA_TORCH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata::detail {

namespace {

// The device the engine computes on: strata.device, or where the model's trainable
// parameters are (all on one device).
c10::Device ComputeDeviceOf(const std::vector<GroupBinding>& groups, ComputeDevice wanted) {
  std::optional<c10::Device> seen;
  std::string seen_name;
  for (const GroupBinding& gb : groups) {
    for (const ParamBinding& p : gb.params) {
      if (!seen) {
        seen = p.param.device();
        seen_name = p.name;
      } else if (p.param.device() != *seen) {
        Throw(InvalidArgumentError("strata::initialize: parameter " + p.name + " is on " +
                                   p.param.device().str() + " but " + seen_name + " is on " +
                                   seen->str() + "; put the whole model on one device"));
      }
    }
  }
  const c10::Device model = seen.value_or(c10::Device(c10::kCPU));
  if (!model.is_cpu() && !model.is_cuda()) {
    Throw(InvalidArgumentError("strata::initialize: the model is on " + model.str() +
                               "; Strata computes on the CPU or on CUDA"));
  }
  if (wanted == ComputeDevice::kCpu) {
    if (!model.is_cpu()) {
      Throw(InvalidArgumentError("strata::initialize: strata.device = cpu but the model is on " +
                                 model.str() +
                                 " (move it to the CPU, or set strata.device to "
                                 "auto or cuda)"));
    }
    return model;
  }
  if (wanted == ComputeDevice::kAuto) return model;
  // cuda: cuda:LOCAL_RANK (0 without torchrun).
  int local_rank = 0;
  if (const char* lr = std::getenv("LOCAL_RANK"); lr != nullptr && *lr != '\0') {
    char* end = nullptr;
    const long v = std::strtol(lr, &end, 10);
    if (*end != '\0' || v < 0 || v > 1023) {
      Throw(InvalidArgumentError("strata::initialize: LOCAL_RANK='" + std::string(lr) +
                                 "' is not a device index"));
    }
    local_rank = static_cast<int>(v);
  }
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  if (model.is_cuda() && model != target) {
    Throw(InvalidArgumentError("strata::initialize: strata.device = cuda means " + target.str() +
                               " (LOCAL_RANK) on this rank, but the model is on " + model.str()));
  }
  return target;
}

}  // namespace

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
  InstallProfilerRanges();  // the engine's waits as profiler ranges (profiler_ranges.h)
  auto state = std::make_shared<EngineState>();
  state->model_ = std::move(model);
  state->FindHolders();
  state->PlanGroups();
  std::shared_ptr<comm::Communicator> init_comm = state->TakePartitionedShapes(options);
  if (comm == nullptr && init_comm != nullptr) comm = init_comm;  // the ZeroInit's
  engine::EngineOptions eopts = options;
  state->MakeCommunicators(config, comm, eopts);
  state->CreateCore(config, std::move(comm), eopts);
  state->BindTensors();
  state->Register();
  for (size_t k = 0; k < state->holders_.size(); ++k) {
    state->holders_[k].second->state_ = state;
    state->holders_[k].second->group_ = static_cast<int>(k + 1);
  }
  // The root group is gathered from here (and after every step) to the end of backward.
  Check(state->hooks_->Start());
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
// inside one and outside it, is refused.
void EngineState::PlanGroups() {
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
  for (const auto& item : model_->named_parameters()) {
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
  for (const engine::PlannedGroup& pg : plan->groups) {
    GroupBinding gb;
    gb.name = pg.name;
    gb.frozen = pg.frozen;
    gb.companion = pg.companion;
    gb.owner = pg.owner;
    for (const size_t i : pg.params) {
      ParamBinding p;
      p.name = placements[i].name;
      p.param = tensors[i];
      p.shape = tensors[i].sizes().vec();
      p.numel = tensors[i].numel();
      gb.params.push_back(std::move(p));
    }
    groups_.push_back(std::move(gb));
  }
}

// Holders partitioned at construction (ZeroInit): their parameters are empty tensors now;
// the shapes and the rank's shard come from the construction. Returns the ZeroInit's
// communicator (null: no holder was partitioned).
std::shared_ptr<comm::Communicator> EngineState::TakePartitionedShapes(
    const engine::EngineOptions& options) {
  std::shared_ptr<comm::Communicator> init_comm;
  for (size_t k = 0; k < holders_.size(); ++k) {
    const auto& [path, holder] = holders_[k];
    const std::shared_ptr<PartitionedGroup>& pg = holder->partitioned_;
    if (pg == nullptr) continue;
    GroupBinding& gb = groups_[k + 1];
    std::vector<ParamBinding> none;
    std::vector<ParamBinding>& frozen_now =
        gb.companion < 0 ? none : groups_[static_cast<size_t>(gb.companion)].params;
    auto same = [&](const std::vector<ParamBinding>& now, const PartitionedParams& then) {
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
    auto take = [](std::vector<ParamBinding>& now, const PartitionedParams& then) {
      for (size_t i = 0; i < now.size(); ++i) {
        now[i].shape = then.shapes[i];
        now[i].numel = then.numels[i];
      }
    };
    take(gb.params, pg->trainable);
    take(frozen_now, pg->frozen);
    if (init_comm == nullptr) init_comm = pg->comm;
  }
  return init_comm;
}

// The compute device, and the engine's device and communicators for it: on CUDA the CUDA
// device and NCCL (PrepareCuda); otherwise gloo from torchrun's environment unless given; on
// several gloo ranks a lane for the reductions and one for the all-gathers (docs/engine.md,
// "Lanes"), unless given.
void EngineState::MakeCommunicators(const Config& config, std::shared_ptr<comm::Communicator>& comm,
                                    engine::EngineOptions& options) {
  device_ = ComputeDeviceOf(groups_, config.strata.device);
  if (device_.is_cuda()) PrepareCuda(config, comm, options);
  if (comm != nullptr) {
    for (const auto& [path, holder] : holders_) {
      const std::shared_ptr<PartitionedGroup>& pg = holder->partitioned_;
      if (pg != nullptr && (pg->world_size != comm->world_size() || pg->rank != comm->rank())) {
        Throw(InvalidArgumentError(
            "strata::initialize: the strata::zero3 module '" + path +
            "' was partitioned for rank " + std::to_string(pg->rank) + " of " +
            std::to_string(pg->world_size) + ", the engine's communicator is rank " +
            std::to_string(comm->rank()) + " of " + std::to_string(comm->world_size())));
      }
    }
  }
  if (comm == nullptr) comm = GlooFromEnvironment("strata::initialize");
  const bool nccl = comm->backend() == comm::Backend::kNccl;
  if (nccl && comm->world_size() > 1 && config.strata.nccl_lanes) Check(engine::CheckNcclLanes());
  if (comm->world_size() > 1 && (!nccl || config.strata.nccl_lanes)) {
    // The reductions' and the all-gathers' lanes, each a duplicate of `comm` (gloo or NCCL:
    // a communicator of its own, on its own CUDA stream), which then carries only the
    // collectives the engine issues inside its calls (the caller's may go between any two).
    // Every rank makes them in this order; each lane's collectives are issued by the
    // engine's thread, in the same order on every rank. Backward prefetches thus never queue
    // behind a reduction in flight.
    auto lane = [&](std::shared_ptr<comm::Communicator>& slot, const char* what,
                    const char* option) {
      if (slot != nullptr) return;
      Result<std::unique_ptr<comm::Communicator>> d = comm->Duplicate();
      if (!d.ok()) {
        Throw(d.status().WithContext(std::string("strata::initialize: ") + what +
                                     " (a duplicate of the communicator; or give one as "
                                     "EngineOptions::" +
                                     option + ")"));
      }
      slot = std::move(*d);
    };
    lane(options.reduce_comm, "the gradient reductions' communicator", "reduce_comm");
    lane(options.gather_comm, "the all-gathers' communicator", "gather_comm");
  }
}

// The core, from fp32 copies of the initial values (on the host), and the hook protocol over
// it.
void EngineState::CreateCore(const Config& config, std::shared_ptr<comm::Communicator> comm,
                             const engine::EngineOptions& options) {
  std::vector<torch::Tensor> inits;
  std::vector<engine::GroupDesc> descs;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupBinding& gb = groups_[g];
    // The holder whose construction partitioned this group (its companion too), if any.
    const size_t holder_group = gb.frozen ? static_cast<size_t>(gb.owner) : g;
    const std::shared_ptr<PartitionedGroup> pg =
        holder_group == 0 ? nullptr : holders_[holder_group - 1].second->partitioned_;
    engine::GroupDesc d;
    d.name = gb.name;
    d.frozen = gb.frozen;
    if (pg != nullptr) {
      d.init_is_shard = true;
      d.init_shard = (gb.frozen ? pg->frozen : pg->trainable).shard.span();
    }
    for (const ParamBinding& p : gb.params) {
      const int group = options.param_group_of ? options.param_group_of(p.name) : 0;
      if (pg != nullptr) {
        d.params.push_back(
            {p.name, static_cast<size_t>(p.numel), nullptr, engine::DType::kFloat32, group});
        continue;
      }
      // The parameter's own memory when the core can read it (CPU, contiguous, fp32 / bf16 /
      // fp16: it converts), else an fp32 host copy (a CUDA model, another dtype).
      torch::Tensor init = p.param.detach();
      const c10::ScalarType t = init.scalar_type();
      if (!init.is_cpu() || !init.is_contiguous() ||
          (t != c10::kFloat && t != c10::kBFloat16 && t != c10::kHalf)) {
        init = init.to(torch::kCPU, torch::kFloat32).contiguous();
        inits.push_back(init);
      }
      d.params.push_back({p.name, static_cast<size_t>(p.numel), init.data_ptr(),
                          DTypeOf(init.scalar_type()), group});
    }
    descs.push_back(std::move(d));
  }
  Result<std::unique_ptr<engine::EngineCore>> core =
      engine::EngineCore::Create(config, std::move(comm), descs, options);
  if (!core.ok()) Throw(core.status());
  core_ = std::move(*core);
  for (const auto& [path, holder] : holders_)
    holder->partitioned_.reset();  // the shards are in the engine now
  std::vector<engine::ProtocolGroup> protocol;
  for (const GroupBinding& gb : groups_)
    protocol.push_back({gb.params.size(), gb.frozen, gb.companion});
  engine::ParameterTensors& tensors = *this;
  hooks_ = std::make_unique<engine::HookProtocol>(*core_, std::move(protocol), tensors,
                                                  engine::FrontEndNames{"", "Engine::"});
}

// Frees the original storage; every parameter gets its engine-side storage and a hook.
// Parameters compute in the working dtype (on the CPU too: LibTorch 2.x has fp16 and bf16
// CPU kernels), pointing straight at the gathered buffer on the compute device.
void EngineState::BindTensors() {
  const c10::ScalarType compute =
      core_->dtype() == engine::DType::kBFloat16  ? c10::ScalarType::BFloat16
      : core_->dtype() == engine::DType::kFloat16 ? c10::ScalarType::Half
                                                  : c10::ScalarType::Float;
  for (size_t g = 0; g < groups_.size(); ++g) {
    GroupBinding& gb = groups_[g];
    for (size_t i = 0; i < gb.params.size(); ++i) {
      ParamBinding& p = gb.params[i];
      p.compute = compute;
      p.storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device_),
                               nullptr, false);
      {
        // The accumulator records the shape, dtype and device the gradients must have:
        // the parameter takes them on its engine storage, with no memory behind it yet.
        torch_internal::PointStorage(p.storage.unsafeGetStorageImpl(), nullptr, 0);
        p.storage.unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(p.numel) *
                                                     c10::elementSize(compute));
        p.param.set_data(OnStorage(p.storage, compute, p.shape));
      }
      p.param.mutable_grad() = torch::Tensor();
      if (gb.frozen) continue;  // no gradient
      p.accumulator = torch_internal::AddGradAccumulatorPostHook(
          p.param, MakeGradHook(weak_from_this(), static_cast<int>(g), static_cast<int>(i)));
      if (p.accumulator == nullptr) {
        Throw(InternalError("strata::initialize: no gradient accumulator for " + p.name));
      }
    }
    Check(Empty(static_cast<int>(g)));
  }
}

Status EngineState::FollowComputeStream() {
#if defined(STRATA_TORCH_CUDA)
  if (!device_.is_cuda() || core_ == nullptr) return Status::Ok();
  return core_->UseComputeStream(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
#else
  return Status::Ok();
#endif
}

void EngineState::PrepareCuda(const Config& config, std::shared_ptr<comm::Communicator>& comm,
                              engine::EngineOptions& options) {
#if !defined(STRATA_TORCH_CUDA)
  (void)config;
  (void)comm;
  (void)options;
  Throw(UnimplementedError("strata::initialize: the compute device is " + device_.str() +
                           " but this build of Strata has no CUDA (configure it with the CUDA "
                           "toolkit found and a CUDA build of LibTorch)"));
#else
  const int count = c10::cuda::device_count();
  const int index = device_.has_index() ? device_.index() : c10::cuda::current_device();
  if (index >= count) {
    Throw(InvalidArgumentError(
        "strata::initialize: the compute device is cuda:" + std::to_string(index) +
        " but this process sees " + std::to_string(count) + " CUDA devices"));
  }
  device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  {
    // What the engine does not manage (the buffers) follows the model to the device.
    torch::NoGradGuard no_grad;
    for (torch::Tensor& b : model_->buffers()) {
      if (b.defined() && b.device() != device_) b.set_data(b.to(device_));
    }
  }
  if (options.device == nullptr) {
    engine::CudaDeviceOptions o;
    o.device = index;
    o.budget_bytes = config.strata.device_budget;
    // LibTorch's current stream on this device is the engine's compute stream.
    o.compute_stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)).stream();
    Result<std::unique_ptr<engine::Device>> d = engine::MakeCudaDevice(o);
    if (!d.ok()) Throw(d.status().WithContext("strata::initialize: the CUDA device"));
    options.device = std::shared_ptr<engine::Device>(std::move(*d));
  }
  if (comm == nullptr) {
    // NCCL for the device buffers, gloo for the host's, both from torchrun's environment.
    Result<comm::Rendezvous> rv = comm::RendezvousFromEnvironment({});
    if (!rv.ok()) Throw(rv.status().WithContext("strata::initialize: rendezvous"));
    comm::CommOptions nco;
    nco.device = comm::Device::Cuda(index);
    Result<std::unique_ptr<comm::Communicator>> nccl =
        comm::CreateCommunicator(comm::Backend::kNccl, *rv, nco);
    if (!nccl.ok()) Throw(nccl.status().WithContext("strata::initialize: NCCL communicator"));
    comm = std::move(*nccl);
    if (options.host_comm == nullptr) {
      comm::CommOptions gco;
      if (rv->world_size == 1) gco.interface = "127.0.0.1";
      Result<std::unique_ptr<comm::Communicator>> gloo =
          comm::CreateCommunicator(comm::Backend::kGloo, *rv, gco);
      if (!gloo.ok()) Throw(gloo.status().WithContext("strata::initialize: gloo communicator"));
      options.host_comm = std::move(*gloo);
    }
  } else if (comm->backend() != comm::Backend::kNccl) {
    Throw(InvalidArgumentError(
        "strata::initialize: the compute device is " + device_.str() + " but the communicator is " +
        std::string(comm::BackendName(comm->backend())) +
        ": the engine's communicator carries device buffers and must be NCCL (pass an NCCL "
        "communicator and a gloo one as EngineOptions::host_comm, or none: both are then made "
        "from torchrun's environment)"));
  }
#endif
}

}  // namespace strata::detail
