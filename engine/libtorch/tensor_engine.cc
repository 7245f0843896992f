// TensorEngine's construction, in order — the compute device, the communicators, the core
// from the tensors' initial values, the tensors bound to it — and the parameter tensors as
// the hook protocol points and empties them (tensor_engine.h).
#include "strata/engine/libtorch/tensor_engine.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "strata/core/memory_limit.h"
#include "strata/engine/agreement/agreement.h"
#include "strata/engine/libtorch/torch_internal.h"
#include "strata/engine/runtime/lanes.h"

#if defined(STRATA_TORCH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata {

namespace {

// Engines reachable from autograd nodes (which may outlive them): id -> engine.
std::mutex g_registry_mu;
std::unordered_map<int64_t, std::weak_ptr<TensorEngine>>& Registry() {
  static auto* registry = new std::unordered_map<int64_t, std::weak_ptr<TensorEngine>>();
  return *registry;
}
std::atomic<int64_t> g_next_id{1};

// A tensor of `dtype` and `shape` on `storage` (its data pointer as it is).
torch::Tensor OnStorage(const c10::Storage& storage, c10::ScalarType dtype,
                        c10::IntArrayRef shape) {
  torch::NoGradGuard no_grad;
  return torch::empty({0}, torch::TensorOptions().dtype(dtype).device(storage.device()))
      .set_(storage, 0, shape, {});
}

bool Trainable(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf;
}

// LOCAL_RANK (0 without it): the CUDA device of strata.device = cuda.
Result<int> LocalRank(const std::string& caller) {
  const char* lr = std::getenv("LOCAL_RANK");
  if (lr == nullptr || *lr == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(lr, &end, 10);
  if (*end != '\0' || v < 0 || v > 1023) {
    return InvalidArgumentError(caller + ": LOCAL_RANK='" + std::string(lr) +
                                "' is not a device index");
  }
  return static_cast<int>(v);
}

}  // namespace

std::string TorchDTypeName(c10::ScalarType t) {
  switch (t) {
    case c10::kDouble:
      return "torch.float64";
    case c10::kFloat:
      return "torch.float32";
    case c10::kHalf:
      return "torch.float16";
    case c10::kBFloat16:
      return "torch.bfloat16";
    case c10::kLong:
      return "torch.int64";
    case c10::kInt:
      return "torch.int32";
    case c10::kShort:
      return "torch.int16";
    case c10::kChar:
      return "torch.int8";
    case c10::kByte:
      return "torch.uint8";
    case c10::kBool:
      return "torch.bool";
    case c10::kComplexFloat:
      return "torch.complex64";
    case c10::kComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

c10::ScalarType TorchDTypeOf(engine::DType t) {
  switch (t) {
    case engine::DType::kBFloat16:
      return c10::ScalarType::BFloat16;
    case engine::DType::kFloat16:
      return c10::ScalarType::Half;
    default:
      return c10::ScalarType::Float;
  }
}

engine::DType EngineDTypeOf(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16:
      return engine::DType::kBFloat16;
    case c10::ScalarType::Half:
      return engine::DType::kFloat16;
    default:
      return engine::DType::kFloat32;
  }
}

std::shared_ptr<TensorEngine> LookupTensorEngine(int64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = Registry().find(id);
  return it == Registry().end() ? nullptr : it->second.lock();
}

TensorEngine::TensorEngine(std::vector<TensorGroup> groups, TensorEngineOptions options)
    : id_(g_next_id.fetch_add(1)), options_(std::move(options)), groups_(std::move(groups)) {}

TensorEngine::~TensorEngine() {
  Close();
}

Result<std::shared_ptr<TensorEngine>> TensorEngine::Create(
    std::vector<TensorGroup> groups, const std::vector<torch::Tensor>& follow_device,
    const Config& config, TensorEngineOptions options) {
  std::shared_ptr<TensorEngine> e(new TensorEngine(std::move(groups), std::move(options)));
  Status s;
  try {
    s = e->ChooseDevice(config);
    if (s.ok() && e->device_.is_cuda()) s = e->PrepareCuda(config, follow_device);
    if (s.ok()) s = e->MakeCommunicators(config);
    if (s.ok()) s = e->AgreeOnFrontEndCheck();
    if (s.ok()) s = e->CreateCore(config);
    if (s.ok()) s = e->BindTensors();
    if (s.ok() && e->options_.test_after_binding) s = e->options_.test_after_binding();
  } catch (const std::exception& ex) {  // LibTorch's own errors (c10::Error)
    s = InternalError(e->options_.caller + ": " + ex.what());
  }
  if (s.ok()) {
    e->Register();
    // The root group is held from here (and after every step) to the end of backward.
    s = e->hooks_->Start();
  }
  if (!s.ok()) {
    e->Restore();
    return s;
  }
  e->found_.clear();  // the tensors' original memory goes back now
  TrimHeap();         // to the system (host tensors freed on the malloc heap stay resident)
#if defined(STRATA_TORCH_CUDA)
  // ... to LibTorch's cache: return it to the device, the engine's arena holds them now.
  if (e->device_.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  return e;
}

void TensorEngine::Restore() {
  Unbind();
  torch::NoGradGuard no_grad;
  for (auto it = found_.rbegin(); it != found_.rend(); ++it) {  // the last change first
    try {
      it->tensor.set_data(it->data);
      it->tensor.mutable_grad() = it->grad;
    } catch (const std::exception&) {  // cannot fail: the tensor's own data back
    }
  }
  found_.clear();
}

void TensorEngine::Register() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  Registry()[id_] = weak_from_this();
}

Result<engine::EngineCore*> TensorEngine::core() {
  if (core_ == nullptr) return FailedPreconditionError("strata: the engine was closed");
  return core_.get();
}

Result<engine::HookProtocol*> TensorEngine::protocol() {
  if (hooks_ == nullptr) return FailedPreconditionError("strata: the engine was closed");
  return hooks_.get();
}

const std::vector<int64_t>& TensorEngine::shape(int g, int i) const {
  return bound_[static_cast<size_t>(g)][static_cast<size_t>(i)].shape;
}

std::optional<std::pair<int, int>> TensorEngine::Find(const torch::Tensor& t) const {
  if (!t.defined()) return std::nullopt;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t i = 0; i < groups_[g].params.size(); ++i) {
      if (groups_[g].params[i].tensor.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        return std::pair<int, int>{static_cast<int>(g), static_cast<int>(i)};
      }
    }
  }
  return std::nullopt;
}

// strata.device against where the parameters are: auto = where they are (all on one
// device), cuda = cuda:LOCAL_RANK (a model on the CPU is taken from there), cpu = the CPU.
Status TensorEngine::ChooseDevice(const Config& config) {
  const std::string& caller = options_.caller;
  std::optional<c10::Device> seen;
  std::string seen_name;
  for (const TensorGroup& gb : groups_) {
    for (const TensorParam& p : gb.params) {
      if (!Trainable(p.tensor.scalar_type())) {
        return InvalidArgumentError(
            caller + ": parameter " + p.name + " is " + TorchDTypeName(p.tensor.scalar_type()) +
            "; the engine trains fp32, bf16 and fp16 parameters (cast the model with "
            "model.to(torch.bfloat16), say; the config's fp16/bf16 sections choose the working "
            "precision)");
      }
      if (p.tensor.is_sparse()) {
        return InvalidArgumentError(caller + ": parameter " + p.name + " is sparse");
      }
      if (!gb.frozen && !p.tensor.requires_grad()) {
        return InvalidArgumentError(caller + ": parameter " + p.name +
                                    " is to be trained but does not require grad "
                                    "(requires_grad true to train it; left false, it is frozen)");
      }
      if (!seen) {
        seen = p.tensor.device();
        seen_name = p.name;
      } else if (p.tensor.device() != *seen) {
        return InvalidArgumentError(caller + ": parameter " + p.name + " is on " +
                                    p.tensor.device().str() + " but " + seen_name + " is on " +
                                    seen->str() + "; put the whole model on one device");
      }
    }
  }
  const c10::Device model = seen.value_or(c10::Device(c10::kCPU));
  if (!model.is_cpu() && !model.is_cuda()) {
    return InvalidArgumentError(caller + ": the model is on " + model.str() +
                                "; Strata computes on the CPU or on CUDA");
  }
  const ComputeDevice wanted = config.strata.device;
  if (wanted == ComputeDevice::kCpu && !model.is_cpu()) {
    return InvalidArgumentError(caller + ": strata.device = cpu but the model is on " +
                                model.str() +
                                " (move it to the CPU, or set strata.device to auto or cuda)");
  }
  if (wanted != ComputeDevice::kCuda) {
    device_ = model;
    return Status::Ok();
  }
  STRATA_ASSIGN_OR_RETURN(const int local_rank, LocalRank(caller));
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  if (model.is_cuda() && model != target) {
    return InvalidArgumentError(caller + ": strata.device = cuda means " + target.str() +
                                " (LOCAL_RANK) on this rank, but the model is on " + model.str());
  }
  device_ = target;
  return Status::Ok();
}

// On CUDA: the device checked and made current, the tensors the engine does not manage moved
// to it, and the engine's CUDA device on LibTorch's current stream there.
Status TensorEngine::PrepareCuda(const Config& config,
                                 const std::vector<torch::Tensor>& follow_device) {
#if !defined(STRATA_TORCH_CUDA)
  (void)config;
  (void)follow_device;
  return UnimplementedError(options_.caller + ": the compute device is " + device_.str() +
                            " but this build of Strata has no CUDA (configure it with the CUDA "
                            "toolkit found and a CUDA build of LibTorch)");
#else
  const int count = c10::cuda::device_count();
  const int index = device_.has_index() ? device_.index() : c10::cuda::current_device();
  if (index >= count) {
    return InvalidArgumentError(options_.caller +
                                ": the compute device is cuda:" + std::to_string(index) +
                                " but torch sees " + std::to_string(count) + " CUDA devices");
  }
  device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  {
    torch::NoGradGuard no_grad;
    for (torch::Tensor t : follow_device) {
      if (!t.defined() || t.device() == device_) continue;
      found_.push_back({t, t.variable_data(), t.grad()});
      t.set_data(t.to(device_));
    }
  }
  if (options_.engine.device == nullptr) {
    engine::CudaDeviceOptions o;
    o.device = index;
    o.budget_bytes = config.strata.device_budget;
    o.compute_stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)).stream();
    Result<std::unique_ptr<engine::Device>> d = engine::MakeCudaDevice(o);
    if (!d.ok()) return d.status().WithContext(options_.caller + ": the CUDA device");
    options_.engine.device = std::shared_ptr<engine::Device>(std::move(*d));
  }
  return Status::Ok();
#endif
}

// The engine's communicators: the one given, or made from the rendezvous (torchrun's
// environment without one): gloo on the CPU device; on CUDA NCCL for the device buffers and
// gloo for the host's. On several ranks the reductions get a lane of their own (a duplicate
// of the engine's communicator, unless given), so a prefetch never queues behind a
// reduction; when the caller gave the communicator, the all-gathers get one too, so that the
// caller's communicator carries only the collectives the engine issues inside its calls and
// the caller may use it between any two (docs/engine/device.md, "Lanes"). A communicator the
// engine made itself nobody else reaches: its all-gathers stay on it. Every rank makes them in
// this order.
Status TensorEngine::MakeCommunicators(const Config& config) {
  const std::string& caller = options_.caller;
  engine::EngineOptions& eo = options_.engine;
  comm_ = options_.comm;
  if (comm_ != nullptr) {
    if (device_.is_cuda() && comm_->backend() != comm::Backend::kNccl) {
      return InvalidArgumentError(
          caller + ": the compute device is " + device_.str() + " but the communicator is " +
          std::string(comm::BackendName(comm_->backend())) +
          ": the engine's communicator carries device buffers and must be NCCL (pass an NCCL "
          "communicator and a gloo one as EngineOptions::host_comm, or none: both are then "
          "made from torchrun's environment)");
    }
  } else {
    comm::Rendezvous rv;
    if (options_.rendezvous) {
      rv = *options_.rendezvous;
    } else {
      comm::RendezvousOptions ro;
      ro.timeout = options_.comm_timeout;
      Result<comm::Rendezvous> r = comm::RendezvousFromEnvironment(ro);
      if (!r.ok()) return r.status().WithContext(caller + ": rendezvous");
      rv = std::move(*r);
    }
    comm::CommOptions gco;
    gco.timeout = options_.comm_timeout;
    if (rv.world_size == 1) gco.interface = "127.0.0.1";  // nothing leaves the process
    if (device_.is_cuda()) {
      comm::CommOptions nco = gco;
      nco.device = comm::Device::Cuda(device_.index());
      Result<std::unique_ptr<comm::Communicator>> nccl =
          comm::CreateCommunicator(comm::Backend::kNccl, rv, nco);
      if (!nccl.ok()) return nccl.status().WithContext(caller + ": NCCL communicator");
      comm_ = std::move(*nccl);
    }
    if (!device_.is_cuda() || eo.host_comm == nullptr) {
      Result<std::unique_ptr<comm::Communicator>> gloo =
          comm::CreateCommunicator(comm::Backend::kGloo, rv, gco);
      if (!gloo.ok()) return gloo.status().WithContext(caller + ": gloo communicator");
      if (device_.is_cuda()) {
        eo.host_comm = std::move(*gloo);
      } else {
        comm_ = std::move(*gloo);
      }
    }
  }
  const bool nccl = comm_->backend() == comm::Backend::kNccl;
  if (comm_->world_size() <= 1 || (nccl && !config.strata.nccl_lanes)) return Status::Ok();
  if (nccl) STRATA_RETURN_IF_ERROR(engine::CheckNcclLanes().WithContext(caller));
  auto lane = [&](std::shared_ptr<comm::Communicator>& slot, const char* what,
                  const char* option) -> Status {
    if (slot != nullptr) return Status::Ok();
    Result<std::unique_ptr<comm::Communicator>> d = comm_->Duplicate();
    if (!d.ok()) {
      return d.status().WithContext(caller + ": " + what +
                                    " (a duplicate of the communicator; or give one as "
                                    "EngineOptions::" +
                                    option + ")");
    }
    slot = std::move(*d);
    return Status::Ok();
  };
  STRATA_RETURN_IF_ERROR(
      lane(eo.reduce_comm, "the gradient reductions' communicator", "reduce_comm"));
  if (options_.comm == nullptr) return Status::Ok();
  return lane(eo.gather_comm, "the all-gathers' communicator", "gather_comm");
}

// The core, from the initial values: a tensor's own memory where the core can read it (on
// the host, contiguous: the core converts fp32, bf16 and fp16 piece by piece, this rank's
// shard only), else a host copy of that one parameter in its own dtype made when the core
// reads it (a CUDA model, a strided tensor): no rank makes an fp32 copy of the model, nor
// holds a host copy of a device model. Then the hook protocol over the core.
Status TensorEngine::AgreeOnFrontEndCheck() {
  comm::Communicator& host =
      options_.engine.host_comm != nullptr ? *options_.engine.host_comm : *comm_;
  if (host.world_size() == 1) return options_.front_end_check;
  STRATA_ASSIGN_OR_RETURN(engine::Outcomes agreed,
                          engine::AgreeOnOutcomes(host, options_.front_end_check, {}, 4096));
  return engine::OutcomeStatus(agreed, options_.caller);
}

Status TensorEngine::CreateCore(const Config& config) {
  std::vector<engine::GroupDesc> descs;
  for (const TensorGroup& gb : groups_) {
    engine::GroupDesc d;
    d.name = gb.name;
    d.frozen = gb.frozen;
    if (gb.init_shard) {
      d.init_is_shard = true;
      d.init_shard = *gb.init_shard;
    }
    // The parameters whose values the core cannot read where they are: copied to the host,
    // in their own dtype, when the core reads them.
    std::vector<torch::Tensor> fetched(gb.params.size());
    for (size_t i = 0; i < gb.params.size(); ++i) {
      const TensorParam& p = gb.params[i];
      engine::ParamDesc pd;
      pd.name = p.name;
      pd.param_group = p.param_group;
      if (p.shape) {  // no values: the group's shard, or zeros until a load
        int64_t n = 1;
        for (const int64_t s : *p.shape)
          n *= s;
        pd.numel = static_cast<size_t>(n);
        d.params.push_back(std::move(pd));
        continue;
      }
      const torch::Tensor t = p.tensor.detach();
      pd.numel = static_cast<size_t>(t.numel());
      pd.init_dtype = EngineDTypeOf(t.scalar_type());
      if (t.is_cpu() && t.is_contiguous()) {
        pd.init = pd.numel == 0 ? nullptr : t.data_ptr();
      } else {
        fetched[i] = t;
      }
      d.params.push_back(std::move(pd));
    }
    d.fetch_init = [fetched = std::move(fetched),
                    &gb](size_t i) -> Result<std::shared_ptr<const void>> {
      if (!fetched[i].defined() || fetched[i].numel() == 0) return std::shared_ptr<const void>();
      try {
        auto host = std::make_shared<torch::Tensor>(fetched[i].to(torch::kCPU).contiguous());
        return std::shared_ptr<const void>(host, host->data_ptr());
      } catch (const std::exception& e) {
        return InternalError("copying " + gb.params[i].name + " to the host: " + e.what());
      }
    };
    descs.push_back(std::move(d));
  }
  Result<std::unique_ptr<engine::EngineCore>> core =
      engine::EngineCore::Create(config, comm_, descs, options_.engine);
  if (!core.ok()) return core.status();
  core_ = std::move(*core);
  std::vector<engine::ProtocolGroup> protocol;
  for (const TensorGroup& gb : groups_)
    protocol.push_back({gb.params.size(), gb.frozen, gb.companion});
  engine::ParameterTensors& tensors = *this;
  hooks_ =
      std::make_unique<engine::HookProtocol>(*core_, std::move(protocol), tensors, options_.names);
  return Status::Ok();
}

// Every parameter gets its engine-side storage (its original memory is freed when nothing
// else holds it) and, when it trains, a hook on its gradient accumulator. Parameters compute
// in the working dtype (on the CPU too: LibTorch 2.x has fp16 and bf16 CPU kernels), pointing
// straight at the gathered buffer on the compute device.
Status TensorEngine::BindTensors() {
  compute_ = TorchDTypeOf(core_->dtype());
  bound_.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    TensorGroup& gb = groups_[g];
    for (size_t i = 0; i < gb.params.size(); ++i) {
      TensorParam& p = gb.params[i];
      Bound& b = bound_[g].emplace_back();
      b.shape = p.shape ? *p.shape : p.tensor.sizes().vec();
      b.numel = 1;
      for (const int64_t s : b.shape)
        b.numel *= s;
      b.storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device_),
                               nullptr, false);
      // The accumulator records the shape, dtype and device the gradients must have: the
      // parameter takes them on its engine storage, with no memory behind it yet.
      torch_internal::PointStorage(b.storage.unsafeGetStorageImpl(), nullptr, 0);
      b.storage.unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(b.numel) *
                                                   c10::elementSize(compute_));
      found_.push_back({p.tensor, p.tensor.variable_data(), p.tensor.grad()});
      p.tensor.set_data(OnStorage(b.storage, compute_, b.shape));
      p.tensor.mutable_grad() = torch::Tensor();
      if (gb.frozen) continue;  // no gradient
      std::unique_ptr<torch::autograd::FunctionPostHook> hook =
          MakeGradHook(static_cast<int>(g), static_cast<int>(i));
      b.hook = hook.get();
      b.accumulator = torch_internal::AddGradAccumulatorPostHook(p.tensor, std::move(hook));
      if (b.accumulator == nullptr) {
        return InternalError(options_.caller + ": no gradient accumulator for " + p.name);
      }
    }
    STRATA_RETURN_IF_ERROR(Empty(static_cast<int>(g)));
  }
  return Status::Ok();
}

Status TensorEngine::Point(int g, std::span<std::byte* const> data) {
  TensorGroup& gb = groups_[static_cast<size_t>(g)];
  try {
    for (size_t i = 0; i < gb.params.size(); ++i) {
      Bound& b = bound_[static_cast<size_t>(g)][i];
      torch_internal::PointStorage(b.storage.unsafeGetStorageImpl(), data[i],
                                   static_cast<size_t>(b.numel) * c10::elementSize(compute_));
      gb.params[i].tensor.set_data(OnStorage(b.storage, compute_, b.shape));
    }
  } catch (const std::exception& e) {
    return InternalError("pointing " + gb.name +
                         "'s parameters at the gathered buffer: " + e.what());
  }
  return Status::Ok();
}

Status TensorEngine::Empty(int g) {
  TensorGroup& gb = groups_[static_cast<size_t>(g)];
  try {
    for (size_t i = 0; i < bound_[static_cast<size_t>(g)].size(); ++i) {
      Bound& b = bound_[static_cast<size_t>(g)][i];
      torch_internal::PointStorage(b.storage.unsafeGetStorageImpl(), nullptr, 0);
      gb.params[i].tensor.set_data(OnStorage(b.storage, compute_, {0}));
    }
  } catch (const std::exception& e) {
    return InternalError("emptying " + gb.name + "'s parameters: " + e.what());
  }
  return Status::Ok();
}

Status TensorEngine::DropGradients() {
  for (TensorGroup& gb : groups_) {
    for (TensorParam& p : gb.params)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad() = torch::Tensor();
  }
  return Status::Ok();
}

void TensorEngine::Close() {
  // The tensors outlive the engine: none keeps pointing into its buffers, and none keeps a
  // hook that would call it.
  {
    torch::NoGradGuard no_grad;
    for (size_t g = 0; g < bound_.size(); ++g) {
      for (size_t i = 0; i < bound_[g].size(); ++i) {
        Bound& b = bound_[g][i];
        if (b.storage) torch_internal::PointStorage(b.storage.unsafeGetStorageImpl(), nullptr, 0);
        try {
          groups_[g].params[i].tensor.set_data(
              torch::empty({0}, torch::TensorOptions().dtype(compute_).device(device_)));
        } catch (const std::exception&) {  // cannot fail: a fresh empty tensor of the same type
        }
      }
    }
  }
  Unbind();
  whole_.clear();
  options_.engine = engine::EngineOptions();  // the device and the lanes
}

void TensorEngine::Unbind() {
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    Registry().erase(id_);
  }
  hooks_.reset();
  for (std::vector<Bound>& group : bound_) {
    for (Bound& b : group) {
      if (b.accumulator != nullptr && b.hook != nullptr) {
        b.accumulator->del_post_hook(reinterpret_cast<uintptr_t>(b.hook));
      }
    }
  }
  bound_.clear();
  core_.reset();
  comm_.reset();
}

}  // namespace strata
