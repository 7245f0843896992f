// The LibTorch front end (strata::initialize, strata::zero3, strata::Engine) against plain
// LibTorch: a small GPT-like model (embedding, zero3-wrapped blocks of layer_norm + linear +
// gelu inside torch::nn::Sequential, final layer norm, tied or untied head) trained by the
// engine on 1, 2 and 4 Gloo ranks (forked processes, one thread each) and by
// torch::optim::AdamW on one process with the same global batch.
//
// The parent process never touches LibTorch before it forks: every torch call happens in
// the rank processes (tests/comm/multiprocess.h). Children check with RK_CHECK / RK_OK.
#include "strata/engine/libtorch/zero3.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "../../comm/multiprocess.h"
#include "host_waits.h"
#include "strata/core/check.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "temp_dir.h"
#include "torch_ranks.h"
#include "update_fault.h"

#if defined(STRATA_HAVE_CUDA)
#include "strata/core/cuda/cuda.h"
#endif
#if defined(STRATA_TEST_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace strata {
namespace {

using comm::testing::AllExitedZero;
using comm::testing::Describe;
using comm::testing::MakeGloo;
using comm::testing::PortChannel;
using comm::testing::RunProcesses;

constexpr int64_t kVocab = 32;
constexpr int64_t kDim = 16;
constexpr int64_t kSeq = 8;
constexpr int64_t kBatch = 4;  // global batch (sequences), divisible by 1, 2 and 4

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 2 * d))),
        fc2(register_module("fc2", torch::nn::Linear(2 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

// The holder's forward has exactly the wrapped forward's signature.
static_assert(std::is_same_v<decltype(&Zero3Impl<BlockImpl>::forward),
                             torch::Tensor (Zero3Impl<BlockImpl>::*)(torch::Tensor)>);

// A const forward, and one taking a const reference, work as well.
struct ConstBlockImpl : torch::nn::Module {
  ConstBlockImpl() : fc(register_module("fc", torch::nn::Linear(kDim, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) const {
    return torch::nn::functional::linear(x, fc->weight, fc->bias);
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(ConstBlock);

struct Spec {
  int blocks = 3;
  bool tied = true;
  uint64_t seed = 5;
};

struct NetImpl : torch::nn::Module {
  NetImpl(const Spec& s, bool wrap) : tied(s.tied) {
    torch::manual_seed(s.seed);
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < s.blocks; ++i) {
      if (wrap) {
        blocks->push_back(zero3(Block(kDim)));
      } else {
        blocks->push_back(Block(kDim));
      }
    }
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    if (!tied) {
      head = register_module("head",
                             torch::nn::Linear(torch::nn::LinearOptions(kDim, kVocab).bias(false)));
    }
  }
  // `order`: the blocks to run (empty: all, through the Sequential).
  torch::Tensor forward(const torch::Tensor& tokens, const std::vector<int>& order = {}) {
    torch::Tensor h = emb(tokens);
    if (order.empty()) {
      h = blocks->forward(h);
    } else {
      std::vector<torch::nn::AnyModule*> mods;
      for (auto& m : *blocks)
        mods.push_back(&m);
      for (int i : order)
        h = mods[static_cast<size_t>(i)]->forward(h);
    }
    h = lnf(h);
    return tied ? torch::matmul(h, emb->weight.t()) : head(h);
  }
  bool tied;
  torch::nn::Embedding emb{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor tokens, targets;  // [kBatch, kSeq]
};

Batch MakeBatch(int index) {
  torch::Generator gen = at::detail::createCPUGenerator(1000 + static_cast<uint64_t>(index));
  Batch b;
  b.tokens = torch::randint(kVocab, {kBatch, kSeq}, gen, torch::kLong);
  b.targets = (b.tokens * 3 + 1).remainder(kVocab);
  return b;
}

torch::Tensor LossOf(Net& net, const torch::Tensor& tokens, const torch::Tensor& targets,
                     const std::vector<int>& order) {
  torch::Tensor logits = net->forward(tokens, order).to(torch::kFloat32);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape(-1));
}

struct Train {
  int steps = 20;
  int gas = 1;
  double lr = 0.01;
  double weight_decay = 0.01;
  double clip = 0.0;
  bool change_order = false;
  // The fine-tuning recipe's parameter groups: no weight decay on biases and norms (the
  // parameters of one dimension), at twice the learning rate.
  bool recipe = false;
  // The caller all-reduces each micro-step's loss on the engine's communicator between the
  // forward and the backward (the pipelined step's deferred all-gathers go out then too:
  // on several gloo ranks initialize gives them a lane of their own).
  bool all_reduce_loss = false;
  std::vector<int> Order(int step, int blocks) const {
    std::vector<int> order;
    if (!change_order) return order;
    for (int i = 0; i < blocks; ++i)
      order.push_back(i);
    if (step % 2 == 1) std::rotate(order.begin(), order.begin() + 1, order.end());
    return order;
  }
};

struct RunResult {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};

std::string Canonical(std::string name) {
  return std::regex_replace(name, std::regex("\\.inner\\."), ".");
}

// Plain LibTorch: AdamW on one process over the global batch, on `device`.
RunResult Reference(const Spec& s, const Train& t, torch::Device device = torch::kCPU) {
  Net net(s, /*wrap=*/false);
  net->to(device);
  const auto defaults =
      torch::optim::AdamWOptions(t.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(t.weight_decay);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (t.recipe) {
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& p : net->parameters())
      (p.dim() >= 2 ? decay : no_decay).push_back(p);
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(defaults));
    auto nd = std::make_unique<torch::optim::AdamWOptions>(defaults);
    nd->weight_decay(0.0).lr(2 * t.lr);
    groups.emplace_back(no_decay, std::move(nd));
  } else {
    groups.emplace_back(net->parameters());
  }
  torch::optim::AdamW opt(groups, defaults);
  RunResult r;
  for (int step = 0; step < t.steps; ++step) {
    opt.zero_grad();
    double total = 0.0;
    for (int m = 0; m < t.gas; ++m) {
      const Batch b = MakeBatch(step * t.gas + m);
      torch::Tensor loss =
          LossOf(net, b.tokens.to(device), b.targets.to(device), t.Order(step, s.blocks));
      (loss / t.gas).backward();
      total += loss.item<double>() / t.gas;
    }
    if (t.clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), t.clip);
    opt.step();
    r.losses.push_back(total);
  }
  for (const auto& item : net->named_parameters())
    r.params[item.key()] = item.value().detach().to(torch::kCPU).clone();
  return r;
}

Config MakeConfig(const Train& t) {
  Config c;
  c.optimizer.lr = t.lr;
  c.optimizer.weight_decay = t.weight_decay;
  c.gradient_accumulation_steps = t.gas;
  c.gradient_clipping = t.clip;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.stage3_max_reuse_distance = 0;
  c.zero.stage3_prefetch_bucket_size = 2500;
  c.zero.stage3_max_live_parameters = 4000;
  c.zero.reduce_bucket_size = 100000;  // the whole model: one reduce-scatter per backward
  c.zero.sub_group_size = 700;         // several CPU-Adam calls per step
  return c;
}

engine::EngineOptions Options() {
  engine::EngineOptions o;
  o.cpu_adam.num_threads = 1;
  return o;
}

// The engine run of one rank; `losses` are the global losses (mean over ranks).
struct EngineRun {
  RunResult result;
  engine::EngineStats after_first, stats;
  std::vector<engine::StepOutcome> outcomes;
  uint64_t total_numel = 0;
  uint64_t padded_bytes = 0;  // sum over groups of padded_numel * 4
  uint64_t shard_bytes = 0;   // sum over groups of shard_numel * 4
  uint64_t global_params_updated = 0;
  std::vector<uint64_t> group_bytes;    // padded bytes per group
  std::vector<float> caller_loss_sums;  // Train::all_reduce_loss
};

Status RunEngine(const Spec& s, const Train& t, const Config& c, comm::Communicator* comm_raw,
                 std::shared_ptr<comm::Communicator> comm, EngineRun& out, int inject_inf_at = -1,
                 const std::function<Status(Engine&)>& after_init = {},
                 bool partitioned_construction = false,
                 const std::function<void(Net&)>& before_init = {}) {
  (void)comm_raw;
  engine::EngineOptions opts = Options();
  std::optional<ZeroInit> zero_init;
  if (partitioned_construction) zero_init.emplace(c, comm, opts);
  Net net(s, /*wrap=*/true);
  if (zero_init) {
    RK_CHECK(zero_init->holders() == s.blocks, zero_init->holders() << " holders partitioned");
    for (const auto& item : net->blocks->named_parameters())
      RK_CHECK(item.value().numel() == 0, item.key() << " kept its memory");
    zero_init.reset();
  }
  if (t.recipe) {
    // Group 1: the parameters of one dimension (by name, as model->named_parameters()).
    auto dims = std::make_shared<std::map<std::string, int64_t>>();
    for (const auto& item : net->named_parameters())
      (*dims)[item.key()] = item.value().dim();
    engine::ParamGroupOptions no_decay;
    no_decay.weight_decay = 0.0;
    no_decay.lr = 2 * t.lr;
    opts.param_groups = {engine::ParamGroupOptions{}, no_decay};
    opts.param_group_of = [dims](const std::string& name) { return dims->at(name) >= 2 ? 0 : 1; };
  }
  if (before_init) before_init(net);
  // strata.device = cuda: the engine makes its NCCL and gloo communicators from torchrun's
  // environment (cuda:LOCAL_RANK); `comm` then carries only the test's own collectives.
  const bool cuda = c.strata.device == ComputeDevice::kCuda;
  Engine e = initialize(net.ptr(), c, cuda ? nullptr : comm, opts);
  if (after_init) RK_OK(after_init(e));
  const int w = e.world_size(), rank = e.rank();
  const int64_t rows = kBatch / w;
  const torch::Device dev = cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank))
                                 : torch::Device(torch::kCPU);
  std::vector<float> losses;
  for (int step = 0; step < t.steps; ++step) {
    double total = 0.0;
    for (int m = 0; m < t.gas; ++m) {
      const Batch b = MakeBatch(step * t.gas + m);
      torch::Tensor loss =
          LossOf(net, b.tokens.narrow(0, rank * rows, rows).to(dev),
                 b.targets.narrow(0, rank * rows, rows).to(dev), t.Order(step, s.blocks));
      total += loss.item<double>() / t.gas;
      if (t.all_reduce_loss) {
        float l = loss.item<float>();
        RK_OK(comm->AllReduce(&l, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
        out.caller_loss_sums.push_back(l);
      }
      if (step == inject_inf_at) loss = loss * std::numeric_limits<float>::infinity();
      e.backward(loss);
      engine::StepOutcome o = e.step();
      if (o.boundary) out.outcomes.push_back(o);
    }
    losses.push_back(static_cast<float>(total));
    if (step == 0) out.after_first = e.statistics();
  }
  out.stats = e.statistics();
  RK_OK(comm->AllReduce(losses.data(), losses.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
  for (float l : losses)
    out.result.losses.push_back(static_cast<double>(l) / w);
  for (const auto& item : e.gather_parameters())
    out.result.params[Canonical(item.key())] = item.value().to(torch::kCPU);
  engine::EngineCore& core = e.core();
  for (int g = 0; g < core.num_groups(); ++g) {
    out.total_numel += core.layout(g).numel;
    out.padded_bytes += core.layout(g).padded_numel * 4;
    out.shard_bytes += core.layout(g).shard_numel * 4;
    out.group_bytes.push_back(core.layout(g).padded_numel * 4);
  }
  float updated = static_cast<float>(out.stats.optimizer.params_updated);
  RK_OK(comm->AllReduce(&updated, 1, comm::DType::kFloat32, comm::ReduceOp::kSum));
  out.global_params_updated = static_cast<uint64_t>(updated);
  return Status::Ok();
}

double ParamRelDiff(const std::map<std::string, torch::Tensor>& a,
                    const std::map<std::string, torch::Tensor>& b, std::string* missing) {
  double num = 0.0, den = 0.0;
  for (const auto& [name, ref] : b) {
    auto it = a.find(name);
    if (it == a.end()) {
      *missing = name;
      return 1e30;
    }
    num += (it->second - ref).pow(2).sum().item<double>();
    den += ref.pow(2).sum().item<double>();
  }
  if (a.size() != b.size()) *missing = "(different parameter counts)";
  return std::sqrt(num / den);
}

Status CheckMatches(const RunResult& got, const RunResult& ref, double tol) {
  RK_CHECK(got.losses.size() == ref.losses.size(), got.losses.size() << " losses");
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    const double rel = std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]);
    RK_CHECK(rel <= tol, "step " << i << ": loss " << got.losses[i] << " vs reference "
                                 << ref.losses[i] << " (relative " << rel << ")");
  }
  std::string missing;
  const double diff = ParamRelDiff(got.params, ref.params, &missing);
  RK_CHECK(missing.empty(), "parameter " << missing << " missing");
  RK_CHECK(diff <= tol, "parameters differ by " << diff << " (relative norm)");
  return Status::Ok();
}

// Runs body(rank, comm) on `world` forked ranks, one thread each.
template <typename Body>
void RunRanks(int world, Body body) {
  torch_testing::RunTorchRanks(world, std::move(body));
}

// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------
// Initial weights from a safetensors file.

using engine::testing::TempDir;

// The format by its definition: u64 LE header size, the JSON header, the tensors' bytes.
void WriteSafetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      torch::ScalarType type = torch::kFloat32) {
  nlohmann::json h = nlohmann::json::object();
  std::vector<torch::Tensor> data;
  uint64_t at = 0;
  for (const auto& [name, t] : tensors) {
    torch::Tensor c = t.detach().to(torch::kCPU, type).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(c.numel()) * c.element_size();
    h[name] = {{"dtype", type == torch::kBFloat16 ? "BF16" : "F32"},
               {"shape", c.sizes().vec()},
               {"data_offsets", {at, at + bytes}}};
    at += bytes;
    data.push_back(c);
  }
  const std::string text = h.dump();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i)
    f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << text;
  for (const torch::Tensor& c : data)
    f.write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

// The plain model's parameters (names without the holders' "inner"), as a file saved from
// a LibTorch model would hold them.
std::vector<std::pair<std::string, torch::Tensor>> PlainParameters(const Spec& s) {
  Net net(s, /*wrap=*/false);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : net->named_parameters())
    out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

// A model built from one seed and loaded from another seed's file trains bit for bit as
// the model built from that seed, on 1 and 2 ranks.
TEST(Zero3Test, LoadSafetensorsTrainsAsTheFilesModel) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    TempDir dir;
    const std::string file = dir.File("model.safetensors");
    Spec from;
    from.seed = 11;
    WriteSafetensors(file, PlainParameters(from));
    RunRanks(world, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
      Train t;
      t.steps = 3;
      const Config c = MakeConfig(t);
      EngineRun built, loaded;
      RK_OK(RunEngine(from, t, c, comm.get(), comm, built));
      Spec into;  // seed 5
      RK_OK(RunEngine(into, t, c, comm.get(), comm, loaded, -1, [&](Engine& e) -> Status {
        e.load_safetensors(file);
        std::map<std::string, torch::Tensor> expected;
        for (const auto& [name, value] : PlainParameters(from))
          expected[name] = value;
        for (const auto& item : e.gather_parameters()) {
          RK_CHECK(torch::equal(item.value(), expected.at(Canonical(item.key()))),
                   item.key() << " differs");
        }
        return Status::Ok();
      }));
      RK_CHECK(loaded.result.losses == built.result.losses,
               "losses " << loaded.result.losses[0] << " vs " << built.result.losses[0]);
      for (const auto& [name, value] : built.result.params) {
        RK_CHECK(torch::equal(loaded.result.params.at(name), value), name << " differs");
      }
      return Status::Ok();
    });
  }
}

// bf16 values load exactly (widened to fp32); a file of another model is refused on every
// rank with the missing, mismatched and extra names, and training goes on unchanged.
TEST(Zero3Test, LoadSafetensorsConvertsBf16AndRefusesAnotherModel) {
  TempDir dir;
  const std::string bf16 = dir.File("bf16.safetensors");
  const std::string other = dir.File("other.safetensors");
  Spec from;
  from.seed = 11;
  WriteSafetensors(bf16, PlainParameters(from), torch::kBFloat16);
  Spec wrong;
  wrong.blocks = 2;
  wrong.tied = false;
  WriteSafetensors(other, PlainParameters(wrong));
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Train t;
    t.steps = 2;
    const Config c = MakeConfig(t);
    Spec into;
    EngineRun plain, refused;
    RK_OK(RunEngine(into, t, c, comm.get(), comm, plain));
    RK_OK(RunEngine(into, t, c, comm.get(), comm, refused, -1, [&](Engine& e) -> Status {
      try {
        e.load_safetensors(other);
        return InternalError("a file of another model was accepted");
      } catch (const Error& err) {
        const std::string what = err.what();
        for (const char* part :
             {"missing from the file (6):", "blocks.2.inner.fc1.weight [",
              "in the file but not in the model (1):", "head.weight", "nothing was changed"}) {
          RK_CHECK(what.find(part) != std::string::npos, "no '" << part << "' in: " << what);
        }
      }
      return Status::Ok();
    }));
    RK_CHECK(refused.result.losses == plain.result.losses, "the refused load changed training");
    // bf16: every parameter is the file's bf16 value, widened.
    Net net(into, /*wrap=*/true);
    Engine e = initialize(net.ptr(), c, comm, Options());
    e.load_safetensors(bf16);
    std::map<std::string, torch::Tensor> expected;
    for (const auto& [name, value] : PlainParameters(from))
      expected[name] = value.to(torch::kBFloat16).to(torch::kFloat32);
    for (const auto& item : e.gather_parameters()) {
      RK_CHECK(torch::equal(item.value(), expected.at(Canonical(item.key()))), item.key()
                                                                                   << " differs");
    }
    return Status::Ok();
  });
}

// ---------------------------------------------------------------------------
// Checkpoints through the LibTorch front end.

// A model with what the engine does not manage: a frozen parameter, a buffer the forward
// updates, and dropout (the CPU generator).
struct CkNetImpl : torch::nn::Module {
  explicit CkNetImpl(uint64_t seed, int64_t scale_dim = kDim) {
    torch::manual_seed(seed);
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::Sequential());
    for (int i = 0; i < 2; ++i)
      blocks->push_back(zero3(Block(kDim)));
    scale = register_parameter("scale", torch::rand({scale_dim}) + 0.5, /*requires_grad=*/false);
    running = register_buffer("running", torch::zeros({kDim}));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    torch::Tensor h = blocks->forward(emb(tokens)) * scale;
    h = torch::dropout(h, 0.2, is_training());
    {
      torch::NoGradGuard no_grad;
      running.mul_(0.9).add_(h.mean(std::vector<int64_t>{0, 1}), 0.1);
    }
    return head(h + running);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::Tensor scale, running;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(CkNet);

struct CkRun {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
  torch::Tensor running;
};

// Steps [from, to) of the model built from `seed`, loading `load` first (when not empty)
// and saving into `save` at the end (when not empty) with `save_options`.
Status CkTrain(std::shared_ptr<comm::Communicator> comm, uint64_t seed, int from, int to,
               const std::string& load, const std::string& save, CkRun& out,
               std::string* client_state = nullptr, const SaveCheckpointOptions& save_options = {},
               LoadedCheckpoint* loaded = nullptr, const LoadCheckpointOptions& load_options = {}) {
  Train t;
  const Config c = MakeConfig(t);
  CkNet net(seed);
  Engine e = initialize(net.ptr(), c, comm, Options());
  if (!load.empty()) {
    const LoadedCheckpoint l = e.load_checkpoint(load, "", load_options);
    RK_CHECK(l.global_steps == from, "loaded step " << l.global_steps);
    if (client_state != nullptr) *client_state = l.client_state;
    if (loaded != nullptr) *loaded = l;
  }
  const int w = e.world_size(), rank = e.rank();
  const int64_t rows = kBatch / w;
  for (int step = from; step < to; ++step) {
    const Batch b = MakeBatch(step);
    torch::Tensor logits = net->forward(b.tokens.narrow(0, rank * rows, rows));
    torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).reshape({-1, kVocab}),
                                             b.targets.narrow(0, rank * rows, rows).reshape(-1));
    out.losses.push_back(loss.item<double>());
    e.backward(loss);
    e.step();
  }
  if (!save.empty()) {
    e.save_checkpoint(save, "", "data position " + std::to_string(to), save_options);
  }
  for (const auto& item : e.gather_parameters())
    out.params[item.key()] = item.value();
  out.running = net->running.clone();
  return Status::Ok();
}

// Train 4 steps; or train 2, save, build another model (another seed), load, train 2: the
// same losses (dropout draws included), parameters (frozen one too) and each rank's buffer,
// bit for bit,
// and the client state back; on 1 and 2 ranks.
TEST(Zero3CheckpointTest, ResumeIsBitIdenticalWithFrozenParametersBuffersAndRng) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    TempDir dir;
    RunRanks(world, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
      CkRun full, first, second;
      RK_OK(CkTrain(comm, 5, 0, 4, "", "", full));
      RK_OK(CkTrain(comm, 5, 0, 2, "", dir.path(), first));
      std::string client;
      RK_OK(CkTrain(comm, 9, 2, 4, dir.path(), "", second, &client));
      RK_CHECK(client == "data position 2", "client state '" << client << "'");
      RK_CHECK(second.losses[0] == full.losses[2] && second.losses[1] == full.losses[3],
               "losses " << second.losses[0] << ", " << second.losses[1] << " vs " << full.losses[2]
                         << ", " << full.losses[3]);
      for (const auto& [name, value] : full.params)
        RK_CHECK(torch::equal(second.params.at(name), value), name << " differs");
      RK_CHECK(torch::equal(second.running, full.running), "the buffer differs");
      return Status::Ok();
    });
  }
}

// Saved without the frozen parameter (exclude_frozen_parameters): a model built with the
// same base resumes bit for bit; one built with another keeps its own frozen values.
TEST(Zero3CheckpointTest, WithoutFrozenParametersTheModelsBaseIsKept) {
  TempDir dir;
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    SaveCheckpointOptions without;
    without.exclude_frozen_parameters = true;
    CkRun full, first, same, other;
    RK_OK(CkTrain(comm, 5, 0, 4, "", "", full));
    RK_OK(CkTrain(comm, 5, 0, 2, "", dir.path(), first, nullptr, without));
    LoadedCheckpoint loaded;
    RK_OK(CkTrain(comm, 5, 2, 4, dir.path(), "", same, nullptr, {}, &loaded));
    RK_CHECK(!loaded.frozen_parameters_loaded, "the load reported the frozen values loaded");
    RK_CHECK(loaded.frozen_base_checked, "the load did not check the base");
    RK_CHECK(same.losses[0] == full.losses[2] && same.losses[1] == full.losses[3],
             "losses " << same.losses[0] << ", " << same.losses[1] << " vs " << full.losses[2]
                       << ", " << full.losses[3]);
    for (const auto& [name, value] : full.params)
      RK_CHECK(torch::equal(same.params.at(name), value), name << " differs");
    // Another base (seed 9): refused, naming the frozen group; loaded onto it on request.
    std::string error;
    try {
      RK_OK(CkTrain(comm, 9, 2, 3, dir.path(), "", other));
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    RK_CHECK(error.find("not the base it was trained on (the fingerprints of 1 of 1 frozen groups "
                        "differ: root:frozen)") != std::string::npos,
             error);
    LoadCheckpointOptions unchecked;
    unchecked.check_frozen_parameters = false;
    other = {};
    RK_OK(CkTrain(comm, 9, 2, 3, dir.path(), "", other, nullptr, {}, &loaded, unchecked));
    RK_CHECK(!loaded.frozen_base_checked, "reported the base checked");
    RK_CHECK(torch::equal(other.params.at("scale"), CkNet(9)->scale), "not the model's own scale");
    RK_CHECK(!torch::equal(other.params.at("scale"), full.params.at("scale")), "the same base");
    return Status::Ok();
  });
}

// A checkpoint written by an earlier build still loads: tests/fixtures/checkpoints/libtorch
// was written by the LibTorch front end as it was before the hook protocol moved into the
// engine (it kept the CPU generator under the blob name "rng:cpu"), by this test
// with STRATA_WRITE_CHECKPOINT_FIXTURE=<dir> (tests/fixtures/checkpoints/make.sh): CkNet(5)
// trained 2 steps on 2 ranks and saved; beside it, expected-rank<N>.json holds the
// parameters at the save (their float bits) and the uninterrupted run's losses (the rank's
// own) at steps 2 and 3 and parameters after them. Loaded into a model built from another
// seed: the parameters bit for bit, the client state, and the next two steps (dropout draws
// from the restored generator) as the uninterrupted run's (to 1e-5: another machine's CPU
// kernels may round differently).
TEST(Zero3CheckpointTest, ACheckpointOfAnEarlierBuildResumes) {
  const char* write = std::getenv("STRATA_WRITE_CHECKPOINT_FIXTURE");
  const char* src = std::getenv("STRATA_SOURCE_DIR");
  const std::string fixture = write != nullptr ? std::string(write)
                              : src != nullptr
                                  ? std::string(src) + "/tests/fixtures/checkpoints/libtorch"
                                  : std::string();
  ASSERT_FALSE(fixture.empty()) << "STRATA_SOURCE_DIR is not set (ctest sets it)";
  auto bits = [](const torch::Tensor& t) {
    const torch::Tensor c = t.detach().to(torch::kFloat32).contiguous().view(torch::kInt32);
    return std::vector<int32_t>(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
  };
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
    const std::string ckpt = fixture + "/ckpt";
    const std::string expected = fixture + "/expected-rank" + std::to_string(rank) + ".json";
    if (write != nullptr) {
      CkRun full, first;
      RK_OK(CkTrain(comm, 5, 0, 4, "", "", full));
      RK_OK(CkTrain(comm, 5, 0, 2, "", ckpt, first));
      nlohmann::json j;
      j["losses"] = {full.losses[2], full.losses[3]};
      for (const auto& [name, value] : first.params)
        j["params_at_save"][name] = bits(value);
      for (const auto& [name, value] : full.params)
        j["params_after"][name] = bits(value);
      std::ofstream(expected) << j.dump() << "\n";
      return Status::Ok();
    }
    std::ifstream in(expected);
    RK_CHECK(in.good(), "cannot read " << expected);
    const nlohmann::json want = nlohmann::json::parse(in);
    CkRun at_load, resumed;
    std::string client;
    RK_OK(CkTrain(comm, 9, 2, 2, ckpt, "", at_load, &client));
    RK_CHECK(client == "data position 2", "client state '" << client << "'");
    RK_CHECK(at_load.params.size() == want["params_at_save"].size(), at_load.params.size());
    for (const auto& [name, value] : at_load.params) {
      RK_CHECK(want["params_at_save"].contains(name), name << " is not in expected.json");
      RK_CHECK(bits(value) == want["params_at_save"][name].get<std::vector<int32_t>>(),
               name << " differs from the saved values");
    }
    RK_OK(CkTrain(comm, 9, 2, 4, ckpt, "", resumed));
    RunResult got{resumed.losses, resumed.params}, ref;
    ref.losses = want["losses"].get<std::vector<double>>();
    for (const auto& [name, b] : want["params_after"].items()) {
      std::vector<int32_t> v = b.get<std::vector<int32_t>>();
      const torch::Tensor t =
          torch::from_blob(v.data(), {static_cast<int64_t>(v.size())}, torch::kInt32)
              .clone()
              .view(torch::kFloat32);
      const auto it = resumed.params.find(name);
      ref.params[name] = it == resumed.params.end() ? t : t.view(it->second.sizes());
    }
    return CheckMatches(got, ref, 1e-5);
  });
}

// A checkpoint of a model whose frozen parameter has another shape is refused on every
// rank, naming it (in the root's frozen group), and nothing changes.
TEST(Zero3CheckpointTest, AnotherModelsFrozenParameterIsRefused) {
  TempDir dir;
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    CkRun first;
    RK_OK(CkTrain(comm, 5, 0, 1, "", dir.path(), first));
    Train t;
    CkNet net(9, 2 * kDim);  // not the saved model's
    Engine e = initialize(net.ptr(), MakeConfig(t), comm, Options());
    const auto before = e.gather_parameters();
    std::string error;
    try {
      e.load_checkpoint(dir.path());
    } catch (const std::exception& ex) {
      error = ex.what();
    }
    RK_CHECK(error.find("of another size (1): root:frozen/scale (checkpoint 16 elements, model "
                        "32)") != std::string::npos,
             error);
    RK_CHECK(error.find("nothing was changed") != std::string::npos, error);
    for (const auto& item : e.gather_parameters())
      RK_CHECK(torch::equal(item.value(), before[item.key()]), item.key() << " changed");
    return Status::Ok();
  });
}

// ---------------------------------------------------------------------------
// Partitioned construction (strata::ZeroInit).

// Built inside a ZeroInit, the model trains bit for bit as the same model built plainly, on
// 1 and 2 ranks; rank 1 builds from another seed, so both runs take rank 0's values.
TEST(ZeroInitTest, TrainsBitForBitAsPlainConstruction) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
      Train t;
      t.steps = 4;
      const Config c = MakeConfig(t);
      Spec s;
      s.seed = rank == 0 ? 5 : 6;
      EngineRun plain, partitioned;
      RK_OK(RunEngine(s, t, c, comm.get(), comm, plain));
      RK_OK(RunEngine(s, t, c, comm.get(), comm, partitioned, -1, {}, /*partitioned=*/true));
      RK_CHECK(partitioned.result.losses == plain.result.losses,
               "losses " << partitioned.result.losses[0] << " vs " << plain.result.losses[0]);
      for (const auto& [name, value] : plain.result.params)
        RK_CHECK(torch::equal(partitioned.result.params.at(name), value), name << " differs");
      return Status::Ok();
    });
  }
}

// A change made under strata::GatheredParameters by the modifier rank (another
// rank's dropped) trains as the same change made to the model before initialize, on 1 and 2
// ranks: a block's parameter (empty outside the forward, whole inside) and the root group's
// tied embedding (gathered from step to step).
TEST(GatheredParametersTest, AChangeTrainsAsOneMadeBeforeInitialize) {
  for (const int world : {1, 2}) {
    SCOPED_TRACE("world " + std::to_string(world));
    RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
      Train t;
      t.steps = 3;
      const Config c = MakeConfig(t);
      const int modifier = world - 1;
      auto change = [](const Net& net, bool drop) {
        torch::NoGradGuard no_grad;
        torch::Tensor w = net->blocks->named_parameters()[0].value();
        w.fill_(drop ? 7.0f : 0.03f);
        if (!drop) net->emb->weight.narrow(0, 0, 4).mul_(2.0f);
      };
      EngineRun before, under;
      RK_OK(RunEngine(Spec{}, t, c, comm.get(), comm, before, -1, {}, false,
                      [&](Net& net) { change(net, false); }));
      Net held{nullptr};
      RK_OK(RunEngine(
          Spec{}, t, c, comm.get(), comm, under, -1,
          [&](Engine& e) -> Status {
            torch::Tensor w = held->blocks->named_parameters()[0].value();
            const int64_t numel = w.numel();
            {
              GatheredParameters g(e, {w, held->emb->weight}, modifier);
              RK_CHECK(numel == 0 && w.numel() > 0, "not whole inside: " << w.numel());
              change(held, rank != modifier);
              g.release();
            }
            RK_CHECK(w.numel() == 0, "still whole after release");
            return Status::Ok();
          },
          false, [&](Net& net) { held = net; }));
      RK_CHECK(under.result.losses == before.result.losses,
               "losses " << under.result.losses[0] << " vs " << before.result.losses[0]);
      for (const auto& [name, value] : before.result.params)
        RK_CHECK(torch::equal(under.result.params.at(name), value), name << " differs");
      return Status::Ok();
    });
  }
}

// save_16bit_model on 2 ranks: rank 0's files hold every parameter (the working dtype of the
// gathered master) and the buffers, by name; a forward inside a GatheredParameters and a
// modifier rank that is not one are refused.
TEST(GatheredParametersTest, SaveSixteenBitModelAndMisuse) {
  TempDir dir;
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
    Train t;
    t.steps = 2;
    Config c = MakeConfig(t);
    c.bf16 = true;
    EngineRun run;
    Net held{nullptr};
    RK_OK(RunEngine(
        Spec{}, t, c, comm.get(), comm, run, -1,
        [&](Engine& e) -> Status {
          try {
            GatheredParameters bad(e, {held->emb->weight}, 2);
            RK_CHECK(false, "modifier_rank 2 of 2 accepted");
          } catch (const std::exception& ex) {
            RK_CHECK(
                std::string(ex.what()).find("modifier_rank 2 is not a rank") != std::string::npos,
                ex.what());
          }
          GatheredParameters g(e, {held->emb->weight});
          try {
            (void)held->forward(MakeBatch(0).tokens);
            RK_CHECK(false, "a forward inside GatheredParameters ran");
          } catch (const std::exception& ex) {
            RK_CHECK(std::string(ex.what()).find("while a strata::GatheredParameters lives") !=
                         std::string::npos,
                     ex.what());
          }
          g.release();
          engine::SaveModelResult saved =
              e.save_16bit_model(dir.File("out"), "model.safetensors", 4096);
          const auto master = e.gather_parameters();
          if (rank != 0) return Status::Ok();
          RK_CHECK(saved.files.files.size() > 1, "one file");
          Result<std::unique_ptr<engine::SafetensorsReader>> r =
              engine::SafetensorsReader::Open(dir.File("out/model.safetensors.index.json"));
          if (!r.ok()) return r.status();
          for (const auto& item : master) {
            const engine::SafetensorsTensor* f = (*r)->Find(item.key());
            RK_CHECK(f != nullptr && f->dtype == "BF16", item.key() << " missing or not BF16");
            torch::Tensor got = torch::empty({static_cast<int64_t>(f->numel)}, torch::kFloat32);
            const Status read =
                (*r)->ReadFloat(item.key(), 0, std::span<float>(got.data_ptr<float>(), f->numel));
            if (!read.ok()) return read;
            const torch::Tensor want =
                item.value().reshape({-1}).to(torch::kBFloat16).to(torch::kFloat32);
            RK_CHECK(torch::equal(got, want), item.key() << " differs");
          }
          return Status::Ok();
        },
        false, [&](Net& net) { held = net; }));
    return Status::Ok();
  });
}

// Bytes of this process's resident set now and its peak since the last reset.
struct Rss {
  uint64_t now = 0, peak = 0;
};
Rss ReadRss() {
  std::ifstream f("/proc/self/status");
  std::string line;
  Rss r;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) r.now = std::stoull(line.substr(6)) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) r.peak = std::stoull(line.substr(6)) * 1024;
  }
  return r;
}
bool ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return static_cast<bool>(f.flush());
}

struct BigBlockImpl : torch::nn::Module {
  BigBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(512, 1024))),
        fc2(register_module("fc2", torch::nn::Linear(1024, 512))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(BigBlock);

// Building 32 blocks of 4 MiB (fp32) on each of 4 ranks: inside a ZeroInit the process's
// peak grows by about one block and its broadcast buffer plus the rank's shards (32 MiB),
// within a stated 24 MiB of slack (the communicator's buffers, the allocator); built
// plainly it grows by the whole model (128 MiB).
TEST(ZeroInitTest, PeakMemoryWhileBuildingIsAboutOneBlockPlusTheShards) {
  constexpr int kBlocks = 32, kWorld = 4;
  const uint64_t block_bytes = (512 * 1024 + 1024 + 1024 * 512 + 512) * 4;
  const uint64_t model_bytes = kBlocks * block_bytes;
  RunRanks(kWorld, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Config c;
    auto build = [&](bool partitioned, uint64_t* growth) -> Status {
      RK_CHECK(ResetPeakRss(), "cannot reset the peak RSS (/proc/self/clear_refs)");
      const Rss before = ReadRss();
      {
        std::optional<ZeroInit> init;
        if (partitioned) init.emplace(c, comm, Options());
        auto blocks = std::make_shared<torch::nn::Sequential>();
        for (int i = 0; i < kBlocks; ++i)
          (*blocks)->push_back(zero3(BigBlock()));
        if (init) RK_CHECK(init->shard_bytes() >= model_bytes / kWorld, init->shard_bytes());
        *growth = ReadRss().peak - before.now;
      }
      return Status::Ok();
    };
    uint64_t plain = 0, partitioned = 0;
    RK_OK(build(true, &partitioned));
    RK_OK(build(false, &plain));
    const uint64_t bound = 2 * block_bytes + model_bytes / kWorld + (uint64_t{24} << 20);
    std::printf("peak growth while building: partitioned %.1f MiB (bound %.1f), plain %.1f MiB\n",
                static_cast<double>(partitioned) / (1 << 20),
                static_cast<double>(bound) / (1 << 20), static_cast<double>(plain) / (1 << 20));
    RK_CHECK(partitioned <= bound, "partitioned construction grew the peak by " << partitioned);
    RK_CHECK(plain >= model_bytes * 9 / 10, "plain construction grew the peak by only " << plain);
    return Status::Ok();
  });
}

TEST(ZeroInitTest, MisuseIsRefused) {
  RunRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Config c;
    ZeroInit init(c, comm, Options());
    try {
      ZeroInit second(c, comm, Options());
      return InternalError("a second ZeroInit on the thread was accepted");
    } catch (const Error& e) {
      RK_CHECK(std::string(e.what()).find("another ZeroInit is active") != std::string::npos,
               e.what());
    }
    auto block = zero3(Block(kDim));
    try {
      block->forward(torch::ones({2, kDim}));
      return InternalError("a partitioned module ran before initialize");
    } catch (const Error& e) {
      RK_CHECK(std::string(e.what()).find("used outside the engine") != std::string::npos,
               e.what());
    }
    return Status::Ok();
  });
}

struct MatchCase {
  int world;
  bool offload_param;
  bool tied;
};

class Zero3MatchTest : public ::testing::TestWithParam<MatchCase> {};

TEST_P(Zero3MatchTest, MatchesLibTorchAdamWAndProvesTheMechanism) {
  const MatchCase mc = GetParam();
  RunRanks(mc.world, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    s.tied = mc.tied;
    Train t;
    t.all_reduce_loss = true;  // the caller's collective beside the engine's
    Config c = MakeConfig(t);
    if (mc.offload_param) c.zero.offload_param.device = OffloadDevice::kCpu;
    const RunResult ref = Reference(s, t);
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    // The caller's all-reduces of the loss: the mean over the ranks is the global loss.
    RK_CHECK(run.caller_loss_sums.size() == ref.losses.size(), run.caller_loss_sums.size());
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      const double mean = run.caller_loss_sums[i] / mc.world;
      RK_CHECK(
          std::abs(mean - ref.losses[i]) <= 1e-5 * std::abs(ref.losses[i]),
          "step " << i << ": the caller's all-reduced loss " << mean << " vs " << ref.losses[i]);
    }

    const engine::EngineStats& st = run.stats;
    const uint64_t w = static_cast<uint64_t>(mc.world);
    const uint64_t steps = static_cast<uint64_t>(t.steps);
    const uint64_t groups = run.group_bytes.size();
    // 1/W of master, m, v (and the gradient accumulators) on each rank.
    const engine::OptimizerStats& o = st.optimizer;
    RK_CHECK(o.master_bytes == run.shard_bytes, o.master_bytes << " vs " << run.shard_bytes);
    RK_CHECK(
        o.master_bytes * w >= run.total_numel * 4 &&
            o.master_bytes * w <= run.total_numel * 4 + w * groups * 16 * 4,
        "master bytes " << o.master_bytes << " per rank for " << run.total_numel << " parameters");
    RK_CHECK(o.exp_avg_bytes == o.master_bytes && o.exp_avg_sq_bytes == o.master_bytes &&
                 o.grad_accumulator_bytes == o.master_bytes,
             "optimizer state sizes differ");
    RK_CHECK(st.optimizer_tier == engine::TierKind::kHost, "optimizer state not on the host");
    RK_CHECK(
        st.param_tier == (mc.offload_param ? engine::TierKind::kHost : engine::TierKind::kDevice),
        "parameter tier");
    // CPU-Adam updated every parameter each step (all ranks together).
    RK_CHECK(o.steps_applied == steps, "steps applied " << o.steps_applied);
    RK_CHECK(run.global_params_updated == steps * run.total_numel,
             "parameters updated " << run.global_params_updated << " for " << steps << " x "
                                   << run.total_numel);
    RK_CHECK(o.adam_calls >= steps, "CPU-Adam calls " << o.adam_calls);
    // One reduce-scatter per backward over every group's padded gradient.
    RK_CHECK(st.reduce_scatter.calls == steps, "reduce-scatter calls " << st.reduce_scatter.calls);
    RK_CHECK(st.reduce_scatter.bytes == steps * run.padded_bytes,
             "reduce-scatter bytes " << st.reduce_scatter.bytes << " vs " << steps << " x "
                                     << run.padded_bytes);
    // All-gathers: per iteration the root once, every block for its forward and again for
    // its backward except the last block (its backward follows its forward at once); after
    // the last step the prefetch of the next iteration's first groups (root, blocks 0, ..).
    uint64_t per_iter = run.group_bytes[0];
    for (size_t g = 1; g < groups; ++g)
      per_iter += 2 * run.group_bytes[g];
    per_iter -= run.group_bytes[groups - 1];
    const uint64_t calls_per_iter = 1 + 2 * (groups - 1) - 1;
    const engine::CoordinatorStats& cs = st.coordinator;
    // A pipelined step (strata.pipeline_step, on by default) prefetches nothing at its end:
    // the next forward fetches its first group on demand, once that group's update is done.
    const bool pipelined = st.optimizer.steps_pipelined > 0;
    RK_CHECK(st.optimizer.steps_pipelined == (pipelined ? steps : 0),
             "pipelined steps " << st.optimizer.steps_pipelined);
    RK_CHECK(st.all_gather.calls >= steps * calls_per_iter + (pipelined ? 0 : 1) &&
                 st.all_gather.calls <= steps * calls_per_iter + groups,
             "all-gather calls " << st.all_gather.calls);
    const uint64_t ahead = st.all_gather.calls - steps * calls_per_iter;
    uint64_t ahead_bytes = 0;
    for (size_t g = 0; g < ahead; ++g)
      ahead_bytes += run.group_bytes[g];
    RK_CHECK(st.all_gather.bytes == steps * per_iter + ahead_bytes,
             "all-gather bytes " << st.all_gather.bytes << " vs " << steps << " x " << per_iter
                                 << " + " << ahead_bytes << " (calls " << st.all_gather.calls
                                 << ", on demand " << cs.fetches_on_demand << ", prefetched "
                                 << cs.fetches_prefetched << ", reused " << cs.fetches_reused
                                 << ")");
    RK_CHECK(st.all_gather.calls == cs.all_gather_calls, "coordinator count");
    // On several ranks initialize gave the all-gathers and the reductions lanes of their
    // own (duplicates of `comm`): every all-gather went out on the all-gathers' lane.
    RK_CHECK(st.gather_lane == (mc.world > 1) && st.reduce_lane == (mc.world > 1),
             "lanes: all-gathers " << st.gather_lane << ", reductions " << st.reduce_lane);
    if (mc.world > 1) {
      RK_CHECK(st.gather_lane_comm.operations == cs.all_gather_calls,
               st.gather_lane_comm.operations << " operations on the all-gathers' lane, "
                                              << cs.all_gather_calls << " all-gathers");
      RK_CHECK(st.reduce_lane_comm.operations == st.reduce_scatter.calls,
               st.reduce_lane_comm.operations << " operations on the reductions' lane");
    }
    // After the first step, with a stable order: no on-demand fetch — pipelined, two per
    // iteration: the root group step() holds (it waits for the root's update, first in
    // the update's order, and prefetches nothing beside the update) and the first block.
    RK_CHECK(cs.fetches_on_demand ==
                 run.after_first.coordinator.fetches_on_demand + (pipelined ? 2 * (steps - 1) : 0),
             "on-demand fetches " << cs.fetches_on_demand << " at the end, "
                                  << run.after_first.coordinator.fetches_on_demand
                                  << " after the first step");
    RK_CHECK(cs.fetches_prefetched > 0, "nothing prefetched");
    RK_CHECK(cs.live_elements_peak <= static_cast<uint64_t>(c.zero.stage3_max_live_parameters),
             "live elements peaked at " << cs.live_elements_peak);
    RK_CHECK(cs.trace_invalidations == 0, "trace invalidated " << cs.trace_invalidations);
    return Status::Ok();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, Zero3MatchTest,
                         ::testing::Values(MatchCase{1, false, true}, MatchCase{1, true, false},
                                           MatchCase{2, false, true}, MatchCase{2, true, false},
                                           MatchCase{4, false, true}, MatchCase{4, true, false}),
                         [](const ::testing::TestParamInfo<MatchCase>& p) {
                           return "W" + std::to_string(p.param.world) +
                                  (p.param.offload_param ? "_ParamCpu" : "_ParamDevice") +
                                  (p.param.tied ? "_Tied" : "_Untied");
                         });

TEST(Zero3Test, GradientAccumulationAndClippingMatchLibTorch) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 8;
    t.gas = 3;
    t.clip = 0.05;
    Config c = MakeConfig(t);
    c.zero.offload_param.device = OffloadDevice::kCpu;
    const RunResult ref = Reference(s, t);
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    RK_CHECK(run.outcomes.size() == static_cast<size_t>(t.steps), run.outcomes.size());
    int clipped = 0;
    for (const auto& o : run.outcomes)
      clipped += o.clip_coef < 1.0 ? 1 : 0;
    RK_CHECK(clipped > 0, "clipping never engaged");
    RK_CHECK(run.stats.micro_steps == t.steps * t.gas, run.stats.micro_steps);
    return Status::Ok();
  });
}

// ZeRO stages 1 and 2 through strata::initialize: on 2 ranks, with accumulation
// and clipping, the numbers of LibTorch's AdamW; no group is fetched in a pass (every
// parameter stays gathered), and the gradient collective is the stage's.
TEST(Zero3Test, StagesOneAndTwoMatchLibTorch) {
  for (const int stage : {1, 2}) {
    RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
      Spec s;
      Train t;
      t.steps = 6;
      t.gas = 2;
      t.clip = 0.05;
      Config c = MakeConfig(t);
      c.zero.stage = stage;
      const RunResult ref = Reference(s, t);
      EngineRun run;
      RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
      RK_OK(CheckMatches(run.result, ref, 1e-5));
      const engine::CoordinatorStats& cs = run.stats.coordinator;
      RK_CHECK(cs.fetches_on_demand + cs.fetches_prefetched + cs.fetches_reused == 0,
               "stage " << stage << " fetched groups in a pass");
      RK_CHECK(cs.persistent_hits > 0, "stage " << stage << ": no persistent use");
      if (stage == 1) {
        RK_CHECK(
            run.stats.reducer.reduce_scatter_calls == 0 && run.stats.reducer.all_reduce_calls > 0,
            "stage 1 did not all-reduce its gradients");
      } else {
        RK_CHECK(
            run.stats.reducer.reduce_scatter_calls > 0 && run.stats.reducer.all_reduce_calls == 0,
            "stage 2 did not reduce-scatter its gradients");
      }
      return Status::Ok();
    });
  }
}

// torch.optim-style parameter groups through EngineOptions::param_group_of: weight decay on
// matrices only, biases and norms at twice the lr; against LibTorch's AdamW with the same
// two groups, on 2 ranks.
TEST(Zero3Test, ParamGroupsMatchLibTorchAdamWWithTheSameGroups) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 8;
    t.weight_decay = 0.1;
    t.recipe = true;
    Config c = MakeConfig(t);
    const RunResult ref = Reference(s, t);
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    RK_CHECK(run.stats.optimizer.group_lr.size() == 2 &&
                 run.stats.optimizer.group_lr[1] == 2 * run.stats.optimizer.group_lr[0],
             run.stats.ToString());
    // Without the groups the same training ends elsewhere: the groups mattered.
    Train plain = t;
    plain.recipe = false;
    const RunResult other = Reference(s, plain);
    RK_CHECK(!CheckMatches(other, ref, 1e-4).ok(), "the recipe changed nothing");
    return Status::Ok();
  });
}

TEST(Zero3Test, ChangingBlockOrderStillMatchesLibTorch) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 10;
    t.change_order = true;
    Config c = MakeConfig(t);
    const RunResult ref = Reference(s, t);
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    RK_CHECK(run.stats.coordinator.trace_invalidations > 0, "the trace was never invalidated");
    return Status::Ok();
  });
}

TEST(Zero3Test, Fp16SkipsAStepOnOverflowAndLowersTheScale) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 12;
    t.lr = 0.02;
    Config c = MakeConfig(t);
    c.fp16.enabled = true;
    c.fp16.initial_scale_power = 8;
    c.fp16.hysteresis = 1;
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run, /*inject_inf_at=*/3));
    RK_CHECK(run.outcomes.size() == 12u, run.outcomes.size());
    const engine::StepOutcome& bad = run.outcomes[3];
    RK_CHECK(bad.overflow && !bad.applied,
             "step 3: overflow " << bad.overflow << ", applied " << bad.applied);
    RK_CHECK(run.outcomes[4].loss_scale < bad.loss_scale,
             "scale " << bad.loss_scale << " then " << run.outcomes[4].loss_scale);
    RK_CHECK(run.stats.optimizer.steps_skipped == 1, run.stats.optimizer.steps_skipped);
    RK_CHECK(run.stats.optimizer.steps_applied == 11, run.stats.optimizer.steps_applied);
    for (size_t i = 0; i < run.outcomes.size(); ++i) {
      if (i != 3) RK_CHECK(run.outcomes[i].applied, "step " << i << " skipped");
    }
    RK_CHECK(run.result.losses.back() < 0.9 * run.result.losses.front(),
             "loss " << run.result.losses.front() << " -> " << run.result.losses.back());
    return Status::Ok();
  });
}

TEST(Zero3Test, Bf16Trains) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.lr = 0.02;
    Config c = MakeConfig(t);
    c.bf16 = true;
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
    for (const auto& [name, p] : run.result.params)
      RK_CHECK(torch::isfinite(p).all().item<bool>(), name << " not finite");
    RK_CHECK(run.result.losses.back() < 0.8 * run.result.losses.front(),
             "loss " << run.result.losses.front() << " -> " << run.result.losses.back());
    RK_CHECK(run.stats.optimizer.steps_applied == static_cast<uint64_t>(t.steps),
             run.stats.optimizer.steps_applied);
    return Status::Ok();
  });
}

TEST(Zero3Test, TheEarlyStepIsBitIdenticalAndStartsUpdatesDuringTheBackward) {
  // strata.early_step: each block's update starts once LibTorch's autograd gave its last
  // gradient and its one-block bucket was reduced; the result is the step after the
  // backward's, bit for bit (2 ranks, gradient accumulation, bf16 compute).
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 6;
    t.gas = 2;
    t.lr = 0.02;
    Config c = MakeConfig(t);
    c.bf16 = true;
    c.zero.overlap_comm = true;
    c.zero.reduce_bucket_size = 1;  // one group per bucket
    c.strata.skip_inf_nan_steps = false;
    EngineRun off, early;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, off));
    c.strata.early_step = true;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, early));
    RK_CHECK(early.result.losses == off.result.losses, "losses differ");
    for (const auto& [name, p] : off.result.params) {
      RK_CHECK(torch::equal(p, early.result.params.at(name)), name << " differs");
    }
    RK_CHECK(early.stats.optimizer.steps_early == 6u, early.stats.optimizer.steps_early);
    RK_CHECK(off.stats.optimizer.steps_early == 0u, off.stats.optimizer.steps_early);
    // Some blocks are handed over during the backward (the root, held, goes at its end).
    RK_CHECK(early.stats.optimizer.groups_released_in_backward > 0u,
             early.stats.optimizer.groups_released_in_backward);
    return Status::Ok();
  });
}

// The optimizer states on NVMe with the pipelined step (on by default): a read that fails
// on rank 1 in step 2's update, after step() returned, is reported on both ranks by the
// next backward (a strata::Error saying the iteration is void). The front end then drops
// its holds, views and gradients and takes its root group again: training again from the
// last completed step ends with the host tier's losses and parameters, bit for bit.
TEST(Zero3Test, AFailedPipelinedUpdateVoidsTheIterationAndTrainingGoesOn) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 5;
    constexpr int kFailing = 2;
    Config host = MakeConfig(t);
    host.zero.sub_group_size = 128;  // reads still ahead once the third sub-group began
    EngineRun ref;
    RK_OK(RunEngine(s, t, host, comm.get(), comm, ref));
    TempDir dir;
    RK_CHECK(!dir.path().empty(), "no temporary directory");
    Config c = host;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    c.zero.offload_optimizer.nvme_path = {dir.path()};
    c.zero.offload_optimizer.buffer_count = 12;
    c.aio.block_size = 4096;
    RK_CHECK(c.strata.pipeline_step, "the pipelined step is on by default");
    engine::EngineOptions o = Options();
    engine::testing::UpdateReadFault fault;  // rank 1's read fails in step kFailing's update
    fault.Install(o, kFailing, /*fails=*/rank == 1);
    Net net(s, /*wrap=*/true);
    Engine e = initialize(net.ptr(), c, comm, o);
    const int w = e.world_size();
    const int64_t rows = kBatch / w;
    std::vector<float> losses;
    std::vector<std::string> errors;
    for (int step = 0; step < t.steps;) {
      const Batch b = MakeBatch(step);
      torch::Tensor loss = LossOf(net, b.tokens.narrow(0, rank * rows, rows),
                                  b.targets.narrow(0, rank * rows, rows), t.Order(step, s.blocks));
      try {
        e.backward(loss);
      } catch (const Error& err) {
        errors.emplace_back(err.what());
        RK_CHECK(err.status().code() == StatusCode::kIOError, err.status());
        // Again from the last completed step (every rank agreed on it).
        const auto good = static_cast<int>(e.statistics().optimizer.steps_applied);
        RK_CHECK(good == kFailing, "the last completed step: " << good);
        // The voided forward's loss again: refused (by the engine or by autograd, whose
        // graph the failed backward partly freed), and the engine stays usable.
        bool refused = false;
        try {
          e.backward(loss);
        } catch (const std::exception&) {
          refused = true;
        }
        RK_CHECK(refused, "a backward of the voided iteration's loss was accepted");
        losses.resize(static_cast<size_t>(good));
        step = good;
        continue;
      }
      fault.updating = step;
      e.step();
      losses.push_back(static_cast<float>(loss.item<double>()));
      ++step;
    }
    RK_CHECK(e.statistics().optimizer.sub_groups >= 6u, e.statistics().optimizer.sub_groups);
    RK_CHECK(fault.armed || rank == 0, "the fault was never armed");
    RK_CHECK(errors.size() == 1u, errors.size() << " errors");
    for (const char* part :
         {"on rank 1", "reading state", "last completed step", "iteration are void"}) {
      RK_CHECK(errors[0].find(part) != std::string::npos, errors[0]);
    }
    const engine::EngineStats stats = e.statistics();
    RK_CHECK(stats.optimizer.steps_failed == 1u, stats.optimizer.steps_failed);
    RK_CHECK(stats.optimizer.steps_applied == static_cast<uint64_t>(t.steps),
             stats.optimizer.steps_applied);
    RK_OK(
        comm->AllReduce(losses.data(), losses.size(), comm::DType::kFloat32, comm::ReduceOp::kSum));
    RK_CHECK(losses.size() == ref.result.losses.size(), losses.size());
    for (size_t i = 0; i < losses.size(); ++i) {
      RK_CHECK(static_cast<double>(losses[i]) / w == ref.result.losses[i],
               "step " << i << ": " << losses[i] / w << " vs " << ref.result.losses[i]);
    }
    for (const auto& item : e.gather_parameters()) {
      const torch::Tensor& want = ref.result.params.at(Canonical(item.key()));
      RK_CHECK(torch::equal(item.value(), want), item.key() << " differs");
    }
    return Status::Ok();
  });
}

// 16 blocks, parameters on the host, a device budget of a quarter of the fp32 model.
struct QuarterBudget {
  Spec spec;
  Train train;
  Config config;
  uint64_t model_bytes = 0;
};
QuarterBudget QuarterBudgetCase() {
  QuarterBudget q;
  q.spec.blocks = 16;
  q.train.steps = 5;
  q.config = MakeConfig(q.train);
  q.config.zero.offload_param.device = OffloadDevice::kCpu;
  q.config.zero.overlap_comm = false;
  q.config.zero.reduce_bucket_size = 1000;  // one rank (the GPU test) needs two buckets of it
  Net probe(q.spec, false);
  for (const auto& p : probe->parameters())
    q.model_bytes += static_cast<uint64_t>(p.numel()) * 4;
  q.config.strata.device_budget = q.model_bytes / 4;
  return q;
}

TEST(Zero3Test, DeviceBudgetOfAQuarterOfTheModelTrains) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    const QuarterBudget q = QuarterBudgetCase();
    const Spec& s = q.spec;
    const Train& t = q.train;
    const Config& c = q.config;
    const uint64_t model_bytes = q.model_bytes;
    const RunResult ref = Reference(s, t);
    EngineRun run;
    RK_OK(RunEngine(s, t, c, comm.get(), comm, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    const engine::TierUsage& u = run.stats.device.usage;
    RK_CHECK(u.budget_bytes == model_bytes / 4, u.budget_bytes);
    RK_CHECK(u.peak_bytes <= u.budget_bytes && u.peak_bytes > 0,
             "device peak " << u.peak_bytes << " for a budget of " << u.budget_bytes);
    return Status::Ok();
  });
}

TEST(Zero3Test, DeviceBudgetBelowTwoGroupsIsRefusedWithTheNumbers) {
  RunRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Config c = MakeConfig(Train{});
    c.strata.device_budget = 4000;  // below one block gathered twice
    Net net(s, true);
    try {
      initialize(net.ptr(), c, comm, Options());
    } catch (const Error& e) {
      const std::string what = e.what();
      std::smatch m;
      RK_CHECK(std::regex_search(what, m,
                                 std::regex("strata.device_budget = 4000 bytes .* is "
                                            "below the ([0-9]+) bytes")),
               what);
      RK_CHECK(std::stoull(m[1].str()) > 4000, what);
      RK_CHECK(e.status().code() == StatusCode::kInvalidArgument, e.status());
      return Status::Ok();
    }
    return InternalError("a device budget of 4000 bytes was accepted");
  });
}

// The budget the check at initialize names is enough to train, with the smallest model
// of blocks on the host tier, in fp32 and in fp16 (which computes in fp16 on the CPU
// device too: no fp32 copies, so the check names none).
TEST(Zero3Test, TheDeviceBudgetTheCheckNamesTrainsInFp32AndFp16) {
  RunRanks(2, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    for (const bool fp16 : {false, true}) {
      Spec s;
      Train t;
      t.steps = 4;
      Config c = MakeConfig(t);
      c.fp16.enabled = fp16;
      c.zero.offload_param.device = OffloadDevice::kCpu;
      c.zero.overlap_comm = false;
      c.zero.reduce_bucket_size = 1200;
      c.strata.device_budget = 4000;
      uint64_t need = 0;
      try {
        Net net(s, true);
        initialize(net.ptr(), c, comm, Options());
        return InternalError("fp16 " + std::to_string(fp16) + ": a budget of 4000 B was accepted");
      } catch (const Error& e) {
        const std::string what = e.what();
        std::smatch m;
        RK_CHECK(std::regex_search(what, m, std::regex("is below the ([0-9]+) bytes")), what);
        need = std::stoull(m[1].str());
        RK_CHECK(what.find("copies") == std::string::npos, "fp16 " << fp16 << ": " << what);
      }
      c.strata.device_budget = need;  // exactly what the check asked for
      EngineRun run;
      RK_OK(RunEngine(s, t, c, comm.get(), comm, run)
                .WithContext("fp16 " + std::to_string(fp16) + ", device budget " +
                             std::to_string(need)));
      const engine::TierUsage& u = run.stats.device.usage;
      RK_CHECK(u.peak_bytes <= need && u.peak_bytes > 0,
               "device peak " << u.peak_bytes << " for a budget of " << need);
      RK_CHECK(run.stats.optimizer.steps_applied + run.stats.optimizer.steps_skipped ==
                   static_cast<uint64_t>(t.steps),
               run.stats.optimizer.steps_applied);
    }
    return Status::Ok();
  });
}

TEST(Zero3Test, EvaluationForwardMatchesAndTrainingContinues) {
  RunRanks(2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Train t;
    t.steps = 1;
    Config c = MakeConfig(t);
    Net net(s, true);
    Net plain(s, false);
    Engine e = initialize(net.ptr(), c, comm, Options());
    const Batch b = MakeBatch(0);
    const int64_t rows = kBatch / e.world_size();
    for (int round = 0; round < 2; ++round) {
      e.begin_eval();
      double got = 0.0;
      {
        torch::NoGradGuard no_grad;
        got = LossOf(net, b.tokens, b.targets, {}).item<double>();
      }
      e.end_eval();
      RK_CHECK(std::abs(got - LossOf(plain, b.tokens, b.targets, {}).item<double>()) < 1e-6,
               "eval loss " << got);
      torch::Tensor loss = LossOf(net, b.tokens.narrow(0, rank * rows, rows),
                                  b.targets.narrow(0, rank * rows, rows), {});
      e.backward(loss);
      e.step();
      // The plain model follows with the engine's parameters.
      auto params = e.gather_parameters();
      torch::NoGradGuard no_grad;
      for (const auto& item : plain->named_parameters())
        item.value().copy_(
            params[item.key().substr(0, 7) == "blocks."
                       ? std::regex_replace(item.key(), std::regex("^blocks\\.([0-9]+)\\."),
                                            "blocks.$1.inner.")
                       : item.key()]);
    }
    return Status::Ok();
  });
}

// ---------------------------------------------------------------------------
// Misuse (in process, one rank: no fork).

std::shared_ptr<comm::Communicator> OneRank() {
  auto rv = comm::RendezvousTcp(0, 1, "127.0.0.1", 0, {});
  STRATA_CHECK_OK(rv.status());
  comm::CommOptions co;
  co.interface = "127.0.0.1";
  auto c = comm::CreateCommunicator(comm::Backend::kGloo, *rv, co);
  STRATA_CHECK_OK(c.status());
  return std::shared_ptr<comm::Communicator>(std::move(*c));
}

std::string ErrorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no strata::Error)";
}

TEST(Zero3MisuseTest, WrappedModuleUsedOutsideTheEngine) {
  torch::set_num_threads(1);
  Net net(Spec{}, true);
  const Batch b = MakeBatch(0);
  EXPECT_NE(ErrorOf([&] {
              LossOf(net, b.tokens, b.targets, {});
            }).find("wrapped module used outside the engine"),
            std::string::npos);
  // Also through AnyModule.
  torch::nn::AnyModule any(zero3(Block(kDim)));
  torch::nn::Sequential seq(zero3(ConstBlock()));
  EXPECT_NE(ErrorOf([&] {
              seq->forward(torch::zeros({2, kDim}));
            }).find("wrapped module used outside the engine"),
            std::string::npos);
  EXPECT_NE(ErrorOf([&] {
              any.forward(torch::zeros({2, kDim}));
            }).find("wrapped module used outside the engine"),
            std::string::npos);
  // The engine gone: used outside the engine again.
  {
    Engine e = initialize(net.ptr(), MakeConfig(Train{}), OneRank(), Options());
    LossOf(net, b.tokens, b.targets, {});
  }
  // (The root group's tensors are empty now: no tensor points into the engine's buffers.)
  EXPECT_EQ(net->emb->weight.numel(), 0);
  torch::nn::AnyModule& first = *net->blocks->begin();
  EXPECT_NE(ErrorOf([&] {
              first.forward(torch::zeros({2, kDim}));
            }).find("wrapped module used outside the engine"),
            std::string::npos);
}

// The wrapped module's forward throws: the holder releases the group on the way out
// (post-forward), the exception reaches the caller, and the engine trains on.
struct ThrowingBlockImpl : torch::nn::Module {
  ThrowingBlockImpl() : fc(register_module("fc", torch::nn::Linear(kDim, kDim))) {}
  torch::Tensor forward(torch::Tensor x) {
    if (fail) throw std::runtime_error("inner forward failed");
    return x + fc(x);
  }
  torch::nn::Linear fc;
  bool fail = false;
};
TORCH_MODULE(ThrowingBlock);

TEST(Zero3MisuseTest, AnInnerForwardThatThrowsReleasesItsGroup) {
  torch::set_num_threads(1);
  auto seq = torch::nn::Sequential(zero3(ThrowingBlock()), zero3(ThrowingBlock()));
  Config c = MakeConfig(Train{});
  Engine e = initialize(seq.ptr(), c, OneRank(), Options());
  const uint64_t live = e.statistics().coordinator.live_elements;
  auto* second = seq->ptr<Zero3Impl<ThrowingBlockImpl>>(1)->inner().get();
  second->fail = true;
  const torch::Tensor x = torch::randn({4, kDim});
  try {
    seq->forward(x);
    ADD_FAILURE() << "the inner forward's exception did not reach the caller";
  } catch (const std::runtime_error& err) {
    EXPECT_NE(std::string(err.what()).find("inner forward failed"), std::string::npos)
        << err.what();
  }
  EXPECT_EQ(e.statistics().coordinator.live_elements, live);
  second->fail = false;
  for (int step = 0; step < 3; ++step) {
    e.backward(seq->forward(x).pow(2).mean());
    EXPECT_TRUE(e.step().applied);
  }
  EXPECT_EQ(e.statistics().optimizer.steps_applied, 3u);
}

TEST(Zero3MisuseTest, StepBeforeBackwardAndBackwardTwice) {
  torch::set_num_threads(1);
  Net net(Spec{}, true);
  Engine e = initialize(net.ptr(), MakeConfig(Train{}), OneRank(), Options());
  EXPECT_NE(ErrorOf([&] { e.step(); }).find("Step() before any backward"), std::string::npos);
  const Batch b = MakeBatch(0);
  torch::Tensor first = LossOf(net, b.tokens, b.targets, {});
  torch::Tensor second = LossOf(net, b.tokens, b.targets, {});
  e.backward(first);
  EXPECT_NE(ErrorOf([&] { e.backward(second); }).find("called twice without step()"),
            std::string::npos);
  e.step();
  EXPECT_NE(ErrorOf([&] { e.step(); }).find("Step() called twice"), std::string::npos);
  // Training goes on after the misuse.
  e.backward(LossOf(net, b.tokens, b.targets, {}));
  EXPECT_TRUE(e.step().applied);
  EXPECT_NE(ErrorOf([&] {
              torch::NoGradGuard no_grad;
              e.backward(LossOf(net, b.tokens, b.targets, {}));
            }).find("does not require grad"),
            std::string::npos);
  EXPECT_EQ(e.world_size(), 1);
  EXPECT_EQ(e.rank(), 0);
  EXPECT_NEAR(e.get_lr(), 0.01, 1e-12);
  e.set_lr(0.5);
  EXPECT_NEAR(e.get_lr(), 0.5, 1e-12);
}

TEST(Zero3MisuseTest, ParametersOnNvmeWithTheOptimizerInHostMemoryAreRefused) {
  torch::set_num_threads(1);
  Net net(Spec{}, true);
  Config c = MakeConfig(Train{});
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = {"/tmp"};
  const std::string what = ErrorOf([&] { initialize(net.ptr(), c, OneRank(), Options()); });
  EXPECT_NE(what.find("zero_optimization.offload_param.device = nvme needs "
                      "offload_optimizer.device = nvme"),
            std::string::npos)
      << what;
  // A refused initialize leaves the model as it was (its holders still unbound).
  EXPECT_EQ(net->emb->weight.numel(), kVocab * kDim);
  torch::nn::AnyModule& first = *net->blocks->begin();
  EXPECT_NE(ErrorOf([&] {
              first.forward(torch::zeros({2, kDim}));
            }).find("wrapped module used outside the engine"),
            std::string::npos);
}

TEST(Zero3MisuseTest, DefaultCommunicatorWithoutTorchrunIsOneRank) {
  torch::set_num_threads(1);
  for (const char* v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    unsetenv(v);
  Net net(Spec{}, true);
  Engine e = initialize(net.ptr(), MakeConfig(Train{}));
  EXPECT_EQ(e.world_size(), 1);
  const Batch b = MakeBatch(0);
  e.backward(LossOf(net, b.tokens, b.targets, {}));
  EXPECT_TRUE(e.step().applied);
  EXPECT_GT(e.statistics().optimizer.params_updated, 0u);
}

TEST(Zero3MisuseTest, NamesAndGroupsAreDocumented) {
  torch::set_num_threads(1);
  Net net(Spec{}, true);
  Engine e = initialize(net.ptr(), MakeConfig(Train{}), OneRank(), Options());
  auto params = e.gather_parameters();
  EXPECT_TRUE(params.contains("blocks.0.inner.fc1.weight"));
  EXPECT_TRUE(params.contains("emb.weight"));
  EXPECT_EQ(e.core().num_groups(), 4);
  EXPECT_EQ(e.core().layout(0).name, "root");
  EXPECT_EQ(e.core().layout(1).name, "blocks.0");
  // Outside a forward the wrapped parameters are empty; the root group's are gathered.
  EXPECT_EQ(net->named_parameters()["blocks.0.inner.fc1.weight"].numel(), 0);
  EXPECT_EQ(net->emb->weight.numel(), kVocab * kDim);
}

// ---------------------------------------------------------------------------
// On a GPU (SKIPPED without one): the same model trained by the engine on cuda:0 (NCCL for
// the device buffers, gloo for the host's, world size 1: NCCL cannot run two ranks on one
// GPU and the test machines have one) against plain LibTorch on the same GPU.

// Whether a CUDA device is usable, asked in a child process: the parent must not
// initialize CUDA before it forks the ranks (a forked child cannot use it then).
bool CudaUsable(std::string* reason, int want = 1) {
#if defined(STRATA_HAVE_CUDA)
  int fds[2];
  if (pipe(fds) != 0) {
    *reason = "pipe() failed";
    return false;
  }
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    std::string why;
    const int n = cuda::DeviceCount(&why);
    if (n == 0) {
      why = "no usable CUDA device: " + why;
    } else if (n < want) {
      why = "this machine has " + std::to_string(n) + " CUDA device" + (n == 1 ? "" : "s") +
            ", the test needs " + std::to_string(want) + " (one per NCCL rank: NCCL cannot run " +
            "two ranks on one GPU)";
    }
    if (n < want) (void)!write(fds[1], why.data(), why.size());
    _exit(n >= want ? 0 : 2);
  }
  close(fds[1]);
  char buf[512];
  ssize_t got = 0;
  std::string why;
  while ((got = read(fds[0], buf, sizeof(buf))) > 0)
    why.append(buf, static_cast<size_t>(got));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  *reason = why;
  return false;
#else
  (void)want;
  *reason = "this build has no CUDA";
  return false;
#endif
}

#define SKIP_WITHOUT_CUDA()                                     \
  do {                                                          \
    std::string skip_reason;                                    \
    if (!CudaUsable(&skip_reason)) GTEST_SKIP() << skip_reason; \
  } while (0)

// Runs body() in one child process (the GPU rank).
template <typename Body>
void RunOnGpu(Body body) {
  const auto results = RunProcesses(
      1,
      [&](int) -> Status {
        torch::set_num_threads(1);
        return body();
      },
      std::chrono::seconds(300));
  EXPECT_TRUE(AllExitedZero(results)) << Describe(results);
}

struct GpuRun {
  RunResult result;
  engine::EngineStats stats;
  uint64_t device_wide_syncs = 0;  // during the steps (core/cuda's counter)
  // The first step whose host waits on the device went beyond the design
  // (CheckHostWaitsOfAStep), and the most host waits of one step.
  Status host_waits;
  uint64_t most_host_waits = 0;
  uint64_t model_bytes = 0;  // the model's parameters in the working dtype
};

// The engine on cuda:0 (strata.device = cuda: the model is built on the CPU, its
// parameters are taken from there), communicators made by initialize.
// `user_streams`: each micro-step's forward, backward and step run under a stream of the
// caller's (two from LibTorch's pool, alternating; neither the stream of initialize), as
// under a user's torch.cuda.stream.
Status RunEngineOnGpu(const Spec& s, const Train& t, Config c, GpuRun& out,
                      bool user_streams = false) {
#if defined(STRATA_HAVE_CUDA) && defined(STRATA_TEST_TORCH_CUDA)
  c.strata.device = ComputeDevice::kCuda;
  Net net(s, /*wrap=*/true);
  for (const auto& p : net->parameters())
    out.model_bytes += static_cast<uint64_t>(p.numel()) * (c.fp16.enabled || c.bf16 ? 2 : 4);
  Engine e = initialize(net.ptr(), c, nullptr, Options());
  RK_CHECK(e.statistics().device.name.find("cuda") != std::string::npos,
           e.statistics().device.name);
  const torch::Device dev(torch::kCUDA, 0);
  engine::EngineStats last = e.statistics();
  for (int step = 0; step < t.steps; ++step) {
    double total = 0.0;
    for (int m = 0; m < t.gas; ++m) {
      const Batch b = MakeBatch(step * t.gas + m);
      const uint64_t before = cuda::GetSyncCounts().device_wide;
      torch::Tensor loss;
      {
        std::optional<c10::cuda::CUDAStreamGuard> guard;
        if (user_streams) {
          c10::cuda::CUDAStream user = c10::cuda::getStreamFromPool(false, 0);
          user.synchronize();  // (fresh from the pool: nothing queued on it)
          guard.emplace(user);
        }
        torch::Tensor tokens = b.tokens.to(dev), targets = b.targets.to(dev);
        loss = LossOf(net, tokens, targets, {});
        e.backward(loss);
        e.step();
        loss = loss.detach();
      }
      out.device_wide_syncs += cuda::GetSyncCounts().device_wide - before;
      const engine::EngineStats now = e.statistics();
      if (out.host_waits.ok()) {
        out.host_waits = engine::testing::CheckHostWaitsOfAStep(last, now, e.core().num_groups());
      }
      out.most_host_waits = std::max(out.most_host_waits, now.HostWaitsLastStep());
      last = now;
      total += loss.item<double>() / t.gas;
    }
    out.result.losses.push_back(total);
  }
  out.stats = e.statistics();
  for (const auto& item : e.gather_parameters())
    out.result.params[Canonical(item.key())] = item.value();
  return Status::Ok();
#else
  (void)s, (void)t, (void)c, (void)out, (void)user_streams;
  return UnimplementedError("no CUDA (or no LibTorch CUDA) in this build");
#endif
}

// Several GPUs (gpu-check's multigpu phase; SKIPPED on a machine with fewer): 2 and 4 NCCL
// ranks, each on cuda:LOCAL_RANK, with the reductions and the all-gathers on NCCL lanes of
// their own (strata.nccl_lanes), against the same ranks on gloo on the CPU.
void NcclRanksMatchGlooRanks(int world) {
  std::string skip;
  if (!CudaUsable(&skip, world)) GTEST_SKIP() << skip;
  const int port = comm::testing::FreePort();
  RunRanks(world, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> Status {
    Train t;
    t.steps = 4;
    const Config cpu = MakeConfig(t);
    EngineRun on_cpu, on_gpu;
    RK_OK(RunEngine(Spec{}, t, cpu, comm.get(), comm, on_cpu));
    // torchrun's variables, for the engine's own NCCL and gloo communicators.
    const std::string r = std::to_string(rank), w = std::to_string(world);
    setenv("RANK", r.c_str(), 1);
    setenv("LOCAL_RANK", r.c_str(), 1);
    setenv("WORLD_SIZE", w.c_str(), 1);
    setenv("LOCAL_WORLD_SIZE", w.c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    Config gpu = cpu;
    gpu.strata.device = ComputeDevice::kCuda;
    RK_OK(RunEngine(Spec{}, t, gpu, comm.get(), comm, on_gpu));
    RK_OK(CheckMatches(on_gpu.result, on_cpu.result, 1e-4).WithContext("NCCL ranks vs gloo ranks"));
    RK_CHECK(on_gpu.stats.device.name.find("cuda") != std::string::npos, on_gpu.stats.device.name);
    // The engine made its NCCL communicator itself (nobody else reaches it): the reductions
    // get a lane of their own, the all-gathers stay on it.
    RK_CHECK(on_gpu.stats.reduce_lane && !on_gpu.stats.gather_lane,
             "the NCCL reductions' lane was not made: " << on_gpu.stats.ToString());
    RK_CHECK(on_gpu.stats.reduce_lane_comm.operations > 0, on_gpu.stats.ToString());
    return Status::Ok();
  });
}

TEST(Zero3CudaTest, TwoNcclRanksOnTwoGpusMatchGlooRanks) {
  NcclRanksMatchGlooRanks(2);
}
TEST(Zero3CudaTest, FourNcclRanksOnFourGpusMatchGlooRanks) {
  NcclRanksMatchGlooRanks(4);
}

TEST(Zero3CudaTest, MatchesLibTorchOnTheSameGpuWithNoDeviceWideSynchronize) {
  SKIP_WITHOUT_CUDA();
  RunOnGpu([]() -> Status {
    Spec s;
    Train t;
    t.steps = 10;
    const RunResult ref = Reference(s, t, torch::Device(torch::kCUDA, 0));
    for (const bool offload_param : {false, true}) {
      Config c = MakeConfig(t);
      if (offload_param) c.zero.offload_param.device = OffloadDevice::kCpu;
      GpuRun run;
      RK_OK(RunEngineOnGpu(s, t, c, run));
      RK_OK(CheckMatches(run.result, ref, 1e-5)
                .WithContext(offload_param ? "offload_param cpu" : "offload_param none"));
      RK_CHECK(run.device_wide_syncs == 0, run.device_wide_syncs << " device-wide synchronizes");
      // Each kind of host wait on the device within what the step did (a check that fails
      // when a wait is added or a front end stops passing what the design needs).
      RK_OK(run.host_waits);
      RK_CHECK(run.most_host_waits > 0, "no host wait counted: the device does not count them");
      // Every parameter and gradient byte crossed PCIe from or into pinned memory (the
      // device refuses anything else), and crossed it at all.
      RK_CHECK(run.stats.reducer.shard_copies > 0, run.stats.ToString());
      RK_CHECK(offload_param ? run.stats.coordinator.shards_staged > 0
                             : run.stats.working_shard_pushes == static_cast<uint64_t>(t.steps) + 1,
               run.stats.ToString());
    }
    return Status::Ok();
  });
}

// The compute stream follows LibTorch's current stream: every micro-step under
// a different user stream, the engine's events and kernels go on it, and training still
// matches LibTorch on the default stream.
TEST(Zero3CudaTest, ForwardAndBackwardUnderUserStreamsMatchLibTorch) {
  SKIP_WITHOUT_CUDA();
  RunOnGpu([]() -> Status {
    Spec s;
    Train t;
    t.steps = 6;
    const RunResult ref = Reference(s, t, torch::Device(torch::kCUDA, 0));
    GpuRun run;
    RK_OK(RunEngineOnGpu(s, t, MakeConfig(t), run, /*user_streams=*/true));
    RK_OK(CheckMatches(run.result, ref, 1e-5).WithContext("under user streams"));
    RK_CHECK(run.device_wide_syncs == 0, run.device_wide_syncs << " device-wide synchronizes");
    RK_OK(run.host_waits);
    return Status::Ok();
  });
}

TEST(Zero3CudaTest, GradientAccumulationClippingAndAnUntiedHeadMatchLibTorch) {
  SKIP_WITHOUT_CUDA();
  RunOnGpu([]() -> Status {
    Spec s;
    s.tied = false;
    Train t;
    t.steps = 6;
    t.gas = 3;
    t.clip = 0.05;
    const RunResult ref = Reference(s, t, torch::Device(torch::kCUDA, 0));
    Config c = MakeConfig(t);
    GpuRun run;
    RK_OK(RunEngineOnGpu(s, t, c, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    RK_CHECK(run.device_wide_syncs == 0, run.device_wide_syncs);
    RK_CHECK(run.stats.optimizer.steps_applied == static_cast<uint64_t>(t.steps),
             run.stats.ToString());
    return Status::Ok();
  });
}

TEST(Zero3CudaTest, Bf16AndFp16ComputeOnTheGpuAndLearn) {
  SKIP_WITHOUT_CUDA();
  RunOnGpu([]() -> Status {
    for (const bool fp16 : {false, true}) {
      Spec s;
      Train t;
      t.steps = 30;
      Config c = MakeConfig(t);
      c.bf16 = !fp16;
      c.fp16.enabled = fp16;
      GpuRun run;
      RK_OK(RunEngineOnGpu(s, t, c, run));
      double first = 0, last = 0;
      for (int i = 0; i < 3; ++i) {
        first += run.result.losses[static_cast<size_t>(i)];
        last += run.result.losses[run.result.losses.size() - 1 - static_cast<size_t>(i)];
      }
      RK_CHECK(std::isfinite(last) && last < 0.8 * first,
               (fp16 ? "fp16" : "bf16") << ": losses " << first / 3 << " -> " << last / 3);
      RK_CHECK(run.device_wide_syncs == 0, run.device_wide_syncs);
    }
    return Status::Ok();
  });
}

TEST(Zero3CudaTest, HbmStaysWithinABudgetAQuarterOfTheModel) {
  SKIP_WITHOUT_CUDA();
  RunOnGpu([]() -> Status {
    const QuarterBudget q = QuarterBudgetCase();
    const Spec& s = q.spec;
    const Train& t = q.train;
    const Config& c = q.config;
    const RunResult ref = Reference(s, t, torch::Device(torch::kCUDA, 0));
    GpuRun run;
    RK_OK(RunEngineOnGpu(s, t, c, run));
    RK_OK(CheckMatches(run.result, ref, 1e-5));
    const engine::TierUsage& u = run.stats.device.usage;
    RK_CHECK(run.model_bytes >= 4 * u.budget_bytes, run.model_bytes << " vs " << u.budget_bytes);
    RK_CHECK(u.peak_bytes <= u.budget_bytes && u.peak_bytes > 0,
             "HBM peak " << u.peak_bytes << " for a budget of " << u.budget_bytes);
    return Status::Ok();
  });
}

// Without a GPU the CUDA front end says why (this runs everywhere: on a GPU machine it
// checks that a model on the CPU with strata.device = cpu stays on the CPU device).
TEST(Zero3MisuseTest, StrataDeviceCudaWithoutAGpuIsAClearError) {
  std::string reason;
  const bool gpu = CudaUsable(&reason);
  RunRanks(1, [&](int /*rank*/, std::shared_ptr<comm::Communicator> comm) -> Status {
    Spec s;
    Config c = MakeConfig(Train{});
    Net net(s, true);
    if (gpu) {
      c.strata.device = ComputeDevice::kCpu;
      Engine e = initialize(net.ptr(), c, comm, Options());
      RK_CHECK(e.statistics().device.name.find("cuda") == std::string::npos,
               e.statistics().device.name);
      return Status::Ok();
    }
    c.strata.device = ComputeDevice::kCuda;
    try {
      initialize(net.ptr(), c, comm, Options());
    } catch (const Error& e) {
      const std::string what = e.what();
      RK_CHECK(what.find("cuda") != std::string::npos || what.find("CUDA") != std::string::npos,
               what);
      return Status::Ok();
    }
    return InternalError("strata.device = cuda was accepted without a GPU");
  });
}

}  // namespace
}  // namespace strata
