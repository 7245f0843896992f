// The LibTorch front end of the ZeRO-3 engine: strata::initialize and the
// strata::zero3 module holder, a thin layer over EngineCore (engine_core.h).
//
//   auto model = std::make_shared<Gpt>(...);      // blocks wrapped: strata::zero3(Block(...))
//   strata::Engine engine = strata::initialize(model, config);   // comm from the environment
//   for (...) {
//     torch::Tensor loss = model->forward(x, y);
//     engine.backward(loss);
//     engine.step();
//   }
//
// Errors are thrown as strata::Error (a std::runtime_error carrying the Status).
// This header is the contract between the front end (engine/libtorch/) and its users
// (examples/strata-train, tests); extend it, don't break it.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/status.h"
#include "strata/engine/libtorch/activation_checkpoint.h"
#include "strata/engine/libtorch/error.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/runtime/save_model.h"

namespace strata {

namespace detail {
class EngineState;  // engine/libtorch/
class Zero3ForwardScope;
struct PartitionedGroup;  // engine/libtorch/: a holder's shard from partitioned construction

// The part of every strata::zero3 holder that does not depend on the wrapped type
// (engine/libtorch/). initialize() binds it to the engine and a group.
class Zero3ModuleBase : public torch::nn::Module {
 public:
  // The group this holder's parameters form (1, 2, ... in registration order; 0 is the
  // root group), -1 before initialize.
  int group() const { return group_; }
  // Whether an engine manages this holder now.
  bool bound() const { return !state_.expired(); }

 protected:
  explicit Zero3ModuleBase(std::string inner_name);
  // PreForward(g) and point the parameters at the gathered buffer. Throws strata::Error
  // ("wrapped module used outside the engine") when no engine manages this holder.
  void BeginForward();
  // PostForward(g) and empty the parameters; with `throw_errors` false (unwinding) an
  // error is recorded in the engine and reported by the next engine call.
  void EndForward(bool throw_errors);
  // Wraps the outputs in the autograd function that re-gathers the group (PreBackward)
  // before the block's gradient functions run. Identity when grad mode is off.
  std::vector<torch::Tensor> WrapOutputs(std::vector<torch::Tensor> outputs);
  // A holder with frozen parameters: an input that requires grad goes through the autograd
  // function that tells the engine when the input's gradient is computed (no parameter
  // gradient says when the frozen weights' last use is over: HookProtocol::ExpectInputs).
  // Identity otherwise.
  torch::Tensor WrapInput(const torch::Tensor& input);
  // The wrapped forward's arguments: torch::Tensor and const torch::Tensor& through
  // WrapInput, anything else as it is.
  template <typename A>
  decltype(auto) Input(std::remove_reference_t<A>& a) {
    using T = std::remove_reference_t<A>;
    if constexpr (std::is_same_v<std::remove_const_t<T>, torch::Tensor> &&
                  (!std::is_lvalue_reference_v<A> || std::is_const_v<T>)) {
      return WrapInput(a);
    } else {
      return std::forward<A>(a);
    }
  }
  // Under a strata::ZeroInit on this thread: partitions the wrapped module's parameters
  // now, trainable and frozen (the holder's constructor calls it once the module is
  // registered).
  void PartitionIfInitializing();

 private:
  friend class EngineState;
  friend class Zero3ForwardScope;
  std::string inner_name_;
  std::weak_ptr<EngineState> state_;
  int group_ = -1;
  std::shared_ptr<PartitionedGroup> partitioned_;
};

// Outputs of a wrapped forward: a tensor, a vector of tensors, or a tuple of those (other
// tuple elements pass through untouched).
template <typename T>
struct Zero3Outputs {
  static_assert(sizeof(T) == 0,
                "strata::zero3: the wrapped module's forward must return torch::Tensor, "
                "std::vector<torch::Tensor> or a std::tuple of tensors (and other values)");
};
template <>
struct Zero3Outputs<torch::Tensor> {
  static void Flatten(const torch::Tensor& t, std::vector<torch::Tensor>& out) { out.push_back(t); }
  static void Unflatten(torch::Tensor& t, const std::vector<torch::Tensor>& in, size_t& pos) {
    t = in[pos++];
  }
};
template <>
struct Zero3Outputs<std::vector<torch::Tensor>> {
  static void Flatten(const std::vector<torch::Tensor>& v, std::vector<torch::Tensor>& out) {
    out.insert(out.end(), v.begin(), v.end());
  }
  static void Unflatten(std::vector<torch::Tensor>& v, const std::vector<torch::Tensor>& in,
                        size_t& pos) {
    for (auto& t : v)
      t = in[pos++];
  }
};
template <typename T>
struct Zero3PassThrough {
  static void Flatten(const T&, std::vector<torch::Tensor>&) {}
  static void Unflatten(T&, const std::vector<torch::Tensor>&, size_t&) {}
};
template <typename T>
using Zero3Element = std::conditional_t<std::is_same_v<T, torch::Tensor> ||
                                            std::is_same_v<T, std::vector<torch::Tensor>>,
                                        Zero3Outputs<T>, Zero3PassThrough<T>>;
template <typename... Ts>
struct Zero3Outputs<std::tuple<Ts...>> {
  static void Flatten(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out) {
    std::apply(
        [&](const auto&... e) { (Zero3Element<std::decay_t<decltype(e)>>::Flatten(e, out), ...); },
        t);
  }
  static void Unflatten(std::tuple<Ts...>& t, const std::vector<torch::Tensor>& in, size_t& pos) {
    std::apply(
        [&](auto&... e) { (Zero3Element<std::decay_t<decltype(e)>>::Unflatten(e, in, pos), ...); },
        t);
  }
};

// Ends the forward (PostForward) on every path out of the inner forward.
class Zero3ForwardScope {
 public:
  explicit Zero3ForwardScope(Zero3ModuleBase* m) : m_(m) {}
  Zero3ForwardScope(const Zero3ForwardScope&) = delete;
  Zero3ForwardScope& operator=(const Zero3ForwardScope&) = delete;
  ~Zero3ForwardScope() {
    if (m_ != nullptr) m_->EndForward(false);
  }
  void Close() {
    Zero3ModuleBase* m = m_;
    m_ = nullptr;
    m->EndForward(true);
  }

 private:
  Zero3ModuleBase* m_;
};
}  // namespace detail

// The module holder of strata::zero3: wraps a module whose parameters form one ZeRO-3 group.
// Its forward has exactly the wrapped module's forward signature (deduced from
// &Inner::forward), so it works inside torch::nn::Sequential and AnyModule. The wrapped
// module is registered as the submodule "inner": a parameter "attn.weight" of a block
// registered as "blocks.0" is named "blocks.0.inner.attn.weight".
//
// Outside a forward its parameters are empty tensors (numel 0): the values live in the
// engine's shards. Use Engine::gather_parameters() to read them.
template <typename Inner, typename Forward = decltype(&Inner::forward)>
class Zero3Impl;

template <typename Inner, typename Class, typename R, typename... Args>
class Zero3Impl<Inner, R (Class::*)(Args...)> : public detail::Zero3ModuleBase {
 public:
  explicit Zero3Impl(std::shared_ptr<Inner> inner)
      : detail::Zero3ModuleBase(inner == nullptr ? std::string("?") : inner->name()),
        inner_(register_module("inner", std::move(inner))) {
    PartitionIfInitializing();
  }

  R forward(Args... args) {
    BeginForward();
    detail::Zero3ForwardScope scope(this);
    R out = inner_->forward(Input<Args>(args)...);
    scope.Close();
    std::vector<torch::Tensor> flat;
    detail::Zero3Outputs<R>::Flatten(out, flat);
    flat = WrapOutputs(std::move(flat));
    size_t pos = 0;
    detail::Zero3Outputs<R>::Unflatten(out, flat, pos);
    return out;
  }

  const std::shared_ptr<Inner>& inner() const { return inner_; }

  void pretty_print(std::ostream& stream) const override { stream << "strata::Zero3"; }

 private:
  std::shared_ptr<Inner> inner_;
};

// A const forward: the same holder (its forward is not const).
template <typename Inner, typename Class, typename R, typename... Args>
class Zero3Impl<Inner, R (Class::*)(Args...) const>
    : public Zero3Impl<Inner, R (Class::*)(Args...)> {
 public:
  using Zero3Impl<Inner, R (Class::*)(Args...)>::Zero3Impl;
};

template <typename Inner>
class Zero3 : public torch::nn::ModuleHolder<Zero3Impl<Inner>> {
 public:
  using torch::nn::ModuleHolder<Zero3Impl<Inner>>::ModuleHolder;
};

// Wraps a module (its holder, e.g. Block(cfg), or its shared_ptr) for ZeRO-3:
//   auto block = strata::zero3(Block(cfg));   // strata::Zero3<BlockImpl>
template <typename Inner>
Zero3<Inner> zero3(const torch::nn::ModuleHolder<Inner>& module) {
  return Zero3<Inner>(std::make_shared<Zero3Impl<Inner>>(module.ptr()));
}
template <typename Inner>
Zero3<Inner> zero3(std::shared_ptr<Inner> module) {
  return Zero3<Inner>(std::make_shared<Zero3Impl<Inner>>(std::move(module)));
}

// Partitioned construction: while a ZeroInit lives on this thread, each
// strata::zero3(...) holder partitions its module's parameters as it is made (the frozen
// ones, requires_grad false, as the holder's frozen group):
// the module's fp32 values (rank 0's, broadcast, unless
// EngineOptions::broadcast_initial_values is off) are flattened and padded as the engine
// lays the group out, this rank keeps its shard, and the parameters' memory is freed (they
// become empty tensors until strata::initialize binds them). So a rank's host memory while
// building holds about one block plus the shards, not the model. The parameters outside
// holders (the root group) stay whole until initialize partitions them.
//
//   strata::ZeroInit init(config, comm);     // before the model
//   auto model = std::make_shared<Gpt>(...);  // each strata::zero3(Block(...)) partitions
//   strata::Engine engine = strata::initialize(model, config, comm);
//
// `comm`: the gloo communicator initialize will get (null: one from torchrun's
// environment, which initialize then uses when its own `comm` is null). `options`: the
// engine options initialize will get (align_elems and broadcast_initial_values matter
// here; initialize refuses others). A partitioned module's parameters cannot be used
// before initialize. One ZeroInit per thread at a time; the model must be built on the
// thread that made it. Errors throw strata::Error.
class ZeroInit {
 public:
  explicit ZeroInit(const Config& config, std::shared_ptr<comm::Communicator> comm = nullptr,
                    const engine::EngineOptions& options = {});
  ~ZeroInit();
  ZeroInit(const ZeroInit&) = delete;
  ZeroInit& operator=(const ZeroInit&) = delete;

  const std::shared_ptr<comm::Communicator>& communicator() const { return comm_; }
  // Holders partitioned so far and the bytes of this rank's shards of them.
  int holders() const { return holders_; }
  uint64_t shard_bytes() const { return shard_bytes_; }

 private:
  friend class detail::Zero3ModuleBase;
  std::shared_ptr<comm::Communicator> comm_;
  size_t align_elems_;
  bool broadcast_;
  int holders_ = 0;
  uint64_t shard_bytes_ = 0;
};

// Engine::load_checkpoint's options (DeepSpeed's names).
struct LoadCheckpointOptions {
  // false: the parameters and counters, with a fresh optimizer (m = v = 0, step count 0).
  bool load_optimizer_states = true;
  // false: the learning-rate schedule keeps its position.
  bool load_lr_scheduler_states = true;
  // true: the parameters only (trained, frozen, buffers); counters, loss scale, schedule,
  // m, v and the RNG states stay as they are.
  bool load_module_only = false;
  // A checkpoint saved with exclude_frozen_parameters keeps a fingerprint of the frozen
  // parameters: true refuses a model whose frozen values are not that base (nothing is
  // changed); false loads onto this model's base anyway. The same on every rank.
  bool check_frozen_parameters = true;
};

struct SaveCheckpointOptions {
  // Leave the frozen parameters' values out (DeepSpeed's exclude_frozen_parameters): a LoRA
  // run's checkpoint then holds the adapters, not the base. A load keeps the frozen values
  // the model has: build it with the same base (the load checks it against a fingerprint of
  // the saving run's base; docs/checkpoints.md).
  bool exclude_frozen_parameters = false;
};

struct LoadedCheckpoint {
  std::string path;  // <load_dir>/<tag>
  std::string tag;
  std::string client_state;  // what this rank gave save_checkpoint (rank % saved world size)
  int64_t global_steps = 0;
  // false: the checkpoint left the frozen parameters out; the model's were kept.
  bool frozen_parameters_loaded = true;
  // Those frozen values matched the checkpoint's fingerprint of the saving run's base (false:
  // nothing to check, an older build saved it, or check_frozen_parameters was false).
  bool frozen_base_checked = false;
};

// Handle to an initialized engine (cheap to copy; copies share the engine).
class Engine {
 public:
  Engine() = default;
  explicit Engine(std::shared_ptr<detail::EngineState> state) : state_(std::move(state)) {}

  // Scales the loss (loss scale / gradient_accumulation_steps), runs autograd, then
  // finishes the micro-step (gradients reduced into the accumulators).
  void backward(const torch::Tensor& loss);
  // Call after every backward; applies the optimizer at a gradient-accumulation boundary.
  engine::StepOutcome step();

  double get_lr() const;
  // Throws during an early step's backward (strata.early_step): set it before backward().
  void set_lr(double lr);
  double loss_scale() const;
  bool is_gradient_accumulation_boundary() const;
  int rank() const;
  int world_size() const;
  engine::EngineStats statistics() const;
  engine::EngineCore& core();
  // strata::checkpoint's options from the config (activation_checkpointing.cpu_checkpointing):
  // strata::checkpoint(fn, x, engine.checkpoint_options()).
  CheckpointOptions checkpoint_options() const;

  // Evaluation: the model's forward under torch::NoGradGuard between these two calls.
  void begin_eval();
  void end_eval();

  // Collective (every rank calls it): the model's full fp32 parameters, by name as in
  // model->named_parameters(), gathered from the rank's shards.
  torch::OrderedDict<std::string, torch::Tensor> gather_parameters();

  // Collective: replaces the model's parameters with a safetensors file's (or the files an
  // index JSON names, as Hugging Face writes sharded models), names as in
  // model->named_parameters() (a tied parameter under any of its names; a wrapped one also
  // without the holder's ".inner", as the plain model names it), fp32/bf16/fp16/f64
  // values converted to fp32. Each rank reads only the slices its shards hold, frozen
  // parameters' too (floating-point buffers, which every rank keeps whole, are read
  // whole, and may be absent). Call it before training or right after step(). A file that
  // does not match the model (missing, mismatched and extra names listed), or that some
  // rank cannot read, fails on every rank with nothing changed. The optimizer's states,
  // step counts and loss scale are kept (docs/engine.md, "Loading initial weights").
  void load_safetensors(const std::string& path);

  // Collective: saves a checkpoint into save_dir/tag (tag empty: "global_step<N>") and
  // moves save_dir/latest to it; returns the tag's directory. Call it before training or
  // right after step(). What it holds (engine/checkpoint/checkpoint.h, docs/checkpoints.md): each
  // rank's fp32 master (a frozen group's values with it, unless options.exclude_frozen_parameters),
  // Adam m and v, step counts, loss scaler, schedule position; the buffers (rank 0's); this
  // rank's RNG states (the CPU generator's and, on CUDA, the device's); `client_state` (any
  // bytes, this rank's). Atomic: a failed or killed save leaves the previous checkpoints and
  // `latest` as they were.
  std::string save_checkpoint(const std::string& save_dir, const std::string& tag = "",
                              const std::string& client_state = "",
                              const SaveCheckpointOptions& options = {});
  // Collective: loads load_dir/tag (tag empty: the one load_dir/latest names), saved on
  // any number of ranks. Every rank first checks the manifest against the model (missing,
  // extra and mismatched names listed) and the CRC32C of everything it reads; a failure on
  // any rank fails the load on every rank with nothing changed.
  LoadedCheckpoint load_checkpoint(const std::string& load_dir, const std::string& tag = "",
                                   const LoadCheckpointOptions& options = {});

  // Collective: the model's weights in Hugging Face's layout in `save_dir` (DeepSpeed's
  // name; engine/runtime/save_model.h): safetensors files in the working dtype, names as in
  // model->named_parameters() (each parameter once) plus the buffers (rank 0's), sharded
  // with "model.safetensors.index.json" past `max_shard_bytes`. Streamed: every rank gathers
  // one group at a time and rank 0 writes it. A failure on any rank throws on every rank and
  // leaves `save_dir` as it was. Call it before training or right after step().
  engine::SaveModelResult save_16bit_model(const std::string& save_dir,
                                           const std::string& filename = "model.safetensors",
                                           uint64_t max_shard_bytes = 5'000'000'000);

 private:
  friend class GatheredParameters;
  std::shared_ptr<detail::EngineState> state_;
};

// DeepSpeed's GatheredParameters as a scoped object (Python: strata.zero.GatheredParameters):
// collective, made and released by every rank with the same parameters. While it lives the
// listed parameters of the engine's model are whole on every rank, in the working dtype on
// the compute device (parameters the engine does not manage are left as they are; one
// already held by another GatheredParameters stays as that one gave it). release() (or the
// destructor, which logs an error instead of throwing) ends it: with `modifier_rank`, that
// rank's values are written into every rank's fp32 master and working shards (elements it
// left unchanged keep their fp32 master exactly); without, changes are dropped. Release at a
// step boundary; a parameter's shape must not change. No engine forward runs while one
// lives.
//
//   {
//     strata::GatheredParameters g(engine, {model->emb->weight}, /*modifier_rank=*/0);
//     if (engine.rank() == 0) model->emb->weight[0].zero_();
//     g.release();
//   }
class GatheredParameters {
 public:
  GatheredParameters(Engine engine, const std::vector<torch::Tensor>& params,
                     std::optional<int> modifier_rank = std::nullopt);
  ~GatheredParameters();
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;
  // Collective; throws strata::Error (the parameters are given back either way).
  void release();

 private:
  Engine engine_;
  std::optional<int> modifier_;
  std::vector<std::pair<int, int>> held_;  // (group, param) this object gathered
  bool released_ = false;
};

// Partitions every parameter of `model` (those under strata::zero3 holders form one group
// per holder, in registration order; the rest form the root group; the frozen ones,
// requires_grad false, form each such group's frozen companion group, gathered with it,
// with no optimizer state, gradient or weight decay), frees the original storage and
// returns the engine. Every rank calls it with the same model structure;
// rank 0's initial values are broadcast.
//
// The compute device is strata.device: auto = where the model's trainable parameters are
// (all on one device), cuda = cuda:LOCAL_RANK (a model built on the CPU is taken from
// there: its parameters become the engine's, its buffers move to the GPU), cpu = the CPU device. On
// CUDA the engine computes on LibTorch's current stream of that device at this call, and needs
// offload_optimizer.device = cpu.
//
// `comm` null: communicators from torchrun's environment (world size 1 without it):
// gloo on the CPU device; on CUDA, NCCL for the device buffers and gloo for the host-side
// collectives (EngineOptions::host_comm). A `comm` given for a CUDA model must be NCCL (with
// a gloo options.host_comm). On several gloo ranks the gradient reductions and the
// parameter all-gathers get lanes of their own (EngineOptions::reduce_comm and gather_comm,
// unless given: duplicates of `comm`, Communicator::Duplicate), so `comm` — yours, or the
// strata::ZeroInit's — carries only collectives the engine issues inside its calls, the
// same on every rank: run yours on it between any two of the engine's calls. On CUDA the
// all-gathers stay on `comm`: between the first forward after engine.step() and the
// backward no collective of yours may run on it (the pipelined step's deferred all-gathers
// go out then, at points that differ between ranks; docs/engine.md, "The pipelined step"),
// unless you give options.gather_comm. Yours may go on the gloo options.host_comm: it
// carries only collectives the engine issues inside its calls.
Engine initialize(std::shared_ptr<torch::nn::Module> model, const Config& config,
                  std::shared_ptr<comm::Communicator> comm = nullptr,
                  const engine::EngineOptions& options = {});

// engine.load_safetensors(path).
void load_safetensors(Engine& engine, const std::string& path);

}  // namespace strata
