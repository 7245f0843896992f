// Partitioned construction (strata::ZeroInit): each strata::zero3 holder built while a
// ZeroInit lives on the thread partitions its module's parameters as it is made (zero3.h).
#include <sys/mman.h>

#include <algorithm>
#include <unordered_set>

#include "strata/core/memory_limit.h"
#include "strata/engine/layout/partition.h"
#include "strata/engine/libtorch/engine_state.h"

namespace strata {

namespace detail {

namespace {
thread_local ZeroInit* g_zero_init = nullptr;
}  // namespace

MappedFloats::MappedFloats(size_t n) : n_(n) {
  if (n == 0) return;
  void* p =
      mmap(nullptr, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    throw Error(ResourceExhaustedError("strata::ZeroInit: cannot map " +
                                       std::to_string(n * sizeof(float)) + " bytes"));
  }
  data_ = static_cast<float*>(p);  // zero-filled
}

MappedFloats::~MappedFloats() {
  if (data_ != nullptr) munmap(data_, n_ * sizeof(float));
}

void Zero3ModuleBase::PartitionIfInitializing() {
  ZeroInit* init = g_zero_init;
  if (init == nullptr) return;
  torch::NoGradGuard no_grad;
  auto pg = std::make_shared<PartitionedGroup>();
  pg->comm = init->comm_;
  pg->align_elems = init->align_elems_;
  pg->world_size = init->comm_->world_size();
  pg->rank = init->comm_->rank();
  // The groups initialize will make: the trainable parameters in registration order (a
  // parameter tied inside the module once), and the frozen ones (its companion group).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<torch::Tensor> tensors[2];
  std::vector<engine::ParamSpec> specs[2];
  for (const auto& item : named_parameters()) {
    const torch::Tensor& t = item.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
    const int f = t.requires_grad() ? 0 : 1;
    PartitionedParams& pp = f == 0 ? pg->trainable : pg->frozen;
    tensors[f].push_back(t);
    specs[f].push_back({item.key(), static_cast<size_t>(t.numel())});
    pp.names.push_back(item.key());
    pp.shapes.push_back(t.sizes().vec());
    pp.numels.push_back(t.numel());
  }
  uint64_t shard_bytes = 0;
  for (int f = 0; f < 2; ++f) {
    PartitionedParams& pp = f == 0 ? pg->trainable : pg->frozen;
    const std::string what = inner_name_ + (f == 0 ? "" : " (frozen parameters)");
    Result<engine::GroupLayout> layout =
        engine::LayoutGroup(what, specs[f], pg->world_size, pg->align_elems);
    Check(layout.status().WithContext("strata::ZeroInit: partitioning " + what));
    // Rank 0's values, flattened and padded as the engine's group buffer, to every rank
    // (one block at a time: the peak while building).
    MappedFloats full(layout->padded_numel);
    if (!init->broadcast_ || pg->rank == 0) {
      for (size_t i = 0; i < tensors[f].size(); ++i) {
        torch::Tensor v = tensors[f][i].detach().to(torch::kCPU, torch::kFloat32).contiguous();
        std::copy_n(v.data_ptr<float>(), v.numel(), full.data() + layout->params[i].offset);
      }
    }
    if (init->broadcast_ && pg->world_size > 1 && full.size() > 0) {
      // Every rank at the broadcast before rank 0 sends: a receiver still building its
      // block would otherwise take the block's bytes into its transport's holding buffers
      // (a second copy of the block on the heap of another thread).
      Check(init->comm_->Barrier().WithContext("strata::ZeroInit: barrier before " + what +
                                               "'s broadcast"));
      Check(init->comm_->Broadcast(full.data(), full.size(), comm::DType::kFloat32, 0)
                .WithContext("strata::ZeroInit: broadcasting the initial values of " + what));
    }
    pp.shard = MappedFloats(layout->shard_numel);
    std::copy_n(full.data() + layout->shard_begin(pg->rank), layout->shard_numel, pp.shard.data());
    shard_bytes += layout->shard_numel * sizeof(float);
  }
  for (const std::vector<torch::Tensor>& ts : tensors)
    for (torch::Tensor t : ts)
      t.set_data(torch::empty({0}, t.options()));  // the module's memory goes back
  // ... to the system too: glibc keeps freed chunks of the heap resident (and, with its
  // dynamic mmap threshold, serves the next block's tensors from fresh pages), so without
  // this the process's resident set grows by a block per block built (measured).
  TrimHeap();
  ++init->holders_;
  init->shard_bytes_ += shard_bytes;
  partitioned_ = std::move(pg);
}

}  // namespace detail

ZeroInit::ZeroInit(const Config& config, std::shared_ptr<comm::Communicator> comm,
                   const engine::EngineOptions& options)
    : comm_(std::move(comm)),
      align_elems_(options.align_elems),
      broadcast_(options.broadcast_initial_values) {
  if (detail::g_zero_init != nullptr) {
    detail::Throw(FailedPreconditionError(
        "strata::ZeroInit: another ZeroInit is active on this thread (one at a time)"));
  }
  if (config.zero.stage != 3) {
    detail::Throw(InvalidArgumentError(
        "strata::ZeroInit: zero_optimization.stage = " + std::to_string(config.zero.stage) +
        ": partitioned construction is ZeRO stage 3's"));
  }
  if (comm_ == nullptr) {
    comm_ = detail::GlooFromEnvironment("strata::ZeroInit");
  } else if (comm_->backend() != comm::Backend::kGloo) {
    detail::Throw(InvalidArgumentError(
        "strata::ZeroInit: the communicator is " +
        std::string(comm::BackendName(comm_->backend())) +
        "; partitioned construction moves host buffers and needs a gloo communicator"));
  }
  detail::g_zero_init = this;
}

ZeroInit::~ZeroInit() {
  if (detail::g_zero_init == this) detail::g_zero_init = nullptr;
}

}  // namespace strata
