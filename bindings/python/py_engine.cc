// PyEngine (py_engine.h): the TensorEngine made from Python's description of the model, its
// test-only fault, and the calls that turn its results into Python values.
#include "py_engine.h"

#include <pybind11/stl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "py_store.h"
#include "strata/comm/rendezvous.h"
#include "strata/engine/checkpoint/blobs.h"
#include "strata/swap/fault_injection.h"

namespace py = pybind11;
namespace se = strata::engine;

namespace strata_py {

namespace {

se::ParamGroupOptions GroupOptions(const std::map<std::string, std::optional<double>>& pg) {
  se::ParamGroupOptions o;
  for (const auto& [key, value] : pg) {
    if (!value) continue;
    if (key == "lr") {
      o.lr = value;
    } else if (key == "weight_decay") {
      o.weight_decay = value;
    } else if (key == "beta1") {
      o.beta1 = value;
    } else if (key == "beta2") {
      o.beta2 = value;
    } else if (key == "eps") {
      o.eps = value;
    } else {
      ThrowValueError("parameter group: unknown key " + key);
    }
  }
  return o;
}

std::vector<strata::TensorGroup> ToGroups(const std::vector<PyGroup>& groups) {
  std::vector<strata::TensorGroup> out;
  for (const auto& [name, frozen, companion, params] : groups) {
    strata::TensorGroup g;
    g.name = name;
    g.frozen = frozen;
    g.companion = companion;
    for (const auto& [pname, tensor, shape, pgroup, aliases] : params)
      g.params.push_back({pname, tensor, shape, pgroup, aliases});
    out.push_back(std::move(g));
  }
  return out;
}

}  // namespace

std::vector<strata::WholeTensor> ToWhole(const std::vector<PyWhole>& whole) {
  std::vector<strata::WholeTensor> out;
  for (const auto& [name, tensor, parameter, aliases] : whole)
    out.push_back({name, tensor, parameter, aliases});
  return out;
}

// Tests only: STRATA_TEST_FAIL_UPDATE_READ=N[:RANK] makes the NVMe state store's I/O go
// through a FaultInjectingIoEngine, and the optimizer update that the N-th step() call
// (from 0) starts fails at its next read (EIO) once its third sub-group began, on rank
// RANK (every rank when omitted): with strata.pipeline_step, the next backward reports
// the void iteration (tests/python/test_engine.py).
struct TestFault {
  int at = -1;
  int rank = -1;
  int steps = 0;                  // step() calls so far (the engine's thread)
  std::atomic<int> stepping{-1};  // the call that started the update now running
  strata::swap::FaultInjectingIoEngine* io = nullptr;
  int began = 0;  // the update's worker from here on
  bool armed = false;
};

strata::Status PyEngine::ArmTestFault(se::EngineOptions& options, int rank) {
  const char* v = std::getenv("STRATA_TEST_FAIL_UPDATE_READ");
  if (v == nullptr || *v == '\0') return strata::Status::Ok();
  auto f = std::make_shared<TestFault>();
  char* end = nullptr;
  f->at = static_cast<int>(std::strtol(v, &end, 10));
  if (*end == ':') f->rank = static_cast<int>(std::strtol(end + 1, &end, 10));
  if (end == v || *end != '\0' || f->at < 0) {
    return strata::InvalidArgumentError("STRATA_TEST_FAIL_UPDATE_READ='" + std::string(v) +
                                        "': want STEP or STEP:RANK (tests only)");
  }
  options.test.nvme_io_engine_factory = [f](const strata::swap::IoEngineOptions& io)
      -> strata::Result<std::unique_ptr<strata::swap::IoEngine>> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::swap::FaultInjectingIoEngine> e,
                            strata::swap::FaultInjectingIoEngine::Create(io));
    if (f->io == nullptr) f->io = e.get();  // the optimizer states' store: made first
    return std::unique_ptr<strata::swap::IoEngine>(std::move(e));
  };
  if (f->rank >= 0 && f->rank != rank) {
    test_fault_ = std::move(f);  // counts step() calls only
    return strata::Status::Ok();
  }
  options.test.driver.on_update = [f](size_t, bool begin) {
    if (!begin || f->armed || f->io == nullptr || f->stepping.load() != f->at) return;
    if (++f->began < 3) return;
    f->armed =
        f->io->AddRule(strata::swap::FaultRule::Error(EIO).OnOp(strata::swap::IoOp::kRead).Nth(1))
            .ok();
  };
  test_fault_ = std::move(f);
  return strata::Status::Ok();
}

// `rendezvous.store` None: torchrun's environment (one process without it). Otherwise a
// torch.distributed Store; keys go under `prefix`. `param_groups`: each optimizer
// parameter group's overrides {lr, weight_decay, beta1, beta2, eps} (absent or None: the
// config's); empty: one group. `front_end_check`: this rank's error before the engine (the
// monitors'), agreed on by every rank before anything is taken; empty: none.
PyEngine::PyEngine(const std::string& config_json, const std::vector<PyGroup>& groups,
                   const std::vector<torch::Tensor>& follow_device, const PyRendezvous& rendezvous,
                   bool prefetch, double timeout_s,
                   const std::vector<std::map<std::string, std::optional<double>>>& param_groups,
                   const std::string& front_end_check) {
  strata::TensorEngineOptions o;
  o.names = se::FrontEndNames{"strata: ", "strata: engine."};
  o.caller = "strata.initialize";
  o.gathered = "strata.zero.GatheredParameters";
  o.comm_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  int world_size = 1, rank = 0;
  if (rendezvous.store.is_none()) {
    strata::comm::RendezvousOptions ro;
    ro.timeout = o.comm_timeout;
    std::optional<strata::Result<strata::comm::Rendezvous>> r;
    {
      py::gil_scoped_release release;
      r.emplace(strata::comm::RendezvousFromEnvironment(ro));
    }
    o.rendezvous = ValueOrThrow(std::move(*r).WithContext("strata.initialize: rendezvous"));
  } else {
    strata::comm::Rendezvous rv;
    rv.rank = rendezvous.rank;
    rv.world_size = rendezvous.world_size;
    rv.local_rank = rendezvous.local_rank;
    rv.local_world_size = rendezvous.local_world_size;
    rv.store =
        strata::comm::PrefixStore(rendezvous.prefix, std::make_shared<PyStore>(rendezvous.store));
    o.rendezvous = std::move(rv);
  }
  world_size = o.rendezvous->world_size;
  rank = o.rendezvous->rank;
  const strata::Config config =
      ValueOrThrow(strata::ParseConfig(config_json, {.world_size = world_size}));
  for (const auto& pg : param_groups)
    o.engine.param_groups.push_back(GroupOptions(pg));
  o.engine.prefetch = prefetch;
  if (!front_end_check.empty())
    o.front_end_check = strata::FailedPreconditionError(front_end_check);
  Check(ArmTestFault(o.engine, rank));
  std::vector<strata::TensorGroup> tg = ToGroups(groups);
  engine_ = Call([&] {
    return strata::TensorEngine::Create(std::move(tg), follow_device, config, std::move(o));
  });
}

PyEngine::~PyEngine() {
  Close();
}

strata::TensorEngine& PyEngine::engine() {
  if (engine_ == nullptr) Check(strata::FailedPreconditionError("strata: the engine was closed"));
  return *engine_;
}

se::EngineCore& PyEngine::core() {
  return *ValueOrThrow(engine().core());
}

se::HookProtocol& PyEngine::hooks() {
  return *ValueOrThrow(engine().protocol());
}

void PyEngine::CheckGroup(int g) {
  if (g < 0 || g >= engine().num_groups()) {
    Check(strata::OutOfRangeError("strata: group " + std::to_string(g) + " of " +
                                  std::to_string(engine().num_groups())));
  }
}

py::dict PyEngine::Step() {
  se::HookProtocol& h = hooks();
  if (test_fault_ != nullptr) test_fault_->stepping = test_fault_->steps++;
  const se::StepOutcome o = Call([&] { return h.Step(); });
  py::dict d;
  d["boundary"] = o.boundary;
  d["applied"] = o.applied;
  d["overflow"] = o.overflow;
  d["global_norm"] = o.global_norm;
  d["clip_coef"] = o.clip_coef;
  d["lr"] = o.lr;
  d["loss_scale"] = o.loss_scale;
  d["adam_step"] = o.adam_step;
  return d;
}

std::string PyEngine::SaveCheckpoint(const std::string& dir, const std::string& tag,
                                     const std::vector<std::pair<std::string, py::bytes>>& blobs,
                                     const std::vector<PyWhole>& whole,
                                     bool exclude_frozen_parameters) {
  se::CheckpointSaveRequest r;
  r.dir = dir;
  r.tag = tag;
  r.exclude_frozen_parameters = exclude_frozen_parameters;
  for (const auto& [name, bytes] : blobs) {
    char* data = nullptr;
    Py_ssize_t n = 0;
    if (PyBytes_AsStringAndSize(bytes.ptr(), &data, &n) != 0) throw py::error_already_set();
    se::CheckpointBlob b;
    b.name = name;
    b.bytes.resize(static_cast<size_t>(n));
    if (n > 0) std::memcpy(b.bytes.data(), data, static_cast<size_t>(n));
    r.blobs.push_back(std::move(b));
  }
  if (const char* crash = std::getenv("STRATA_TEST_CHECKPOINT_CRASH_AT"); crash != nullptr) {
    r.crash_at = crash;  // tests only: _exit(9) at that point of the save
  }
  const std::vector<strata::WholeTensor> w = ToWhole(whole);
  strata::TensorEngine& e = engine();
  return Call([&] { return e.SaveCheckpoint(std::move(r), w); });
}

// Returns {path, tag, global_steps, saved_world_size, frozen_parameters_loaded,
// frozen_base_checked, blobs: {name: bytes}} (the blobs the layer did not restore itself are
// the front end's).
py::dict PyEngine::LoadCheckpoint(const std::string& dir, const std::string& tag,
                                  bool load_optimizer_states, bool load_lr_scheduler_states,
                                  bool load_module_only, bool check_frozen_parameters,
                                  const std::vector<PyWhole>& whole) {
  se::CheckpointLoadRequest r;
  r.dir = dir;
  r.tag = tag;
  r.load_optimizer_states = load_optimizer_states;
  r.load_lr_scheduler_states = load_lr_scheduler_states;
  r.load_module_only = load_module_only;
  r.check_frozen_parameters = check_frozen_parameters;
  const std::vector<strata::WholeTensor> w = ToWhole(whole);
  strata::TensorEngine& e = engine();
  const se::CheckpointLoadResult loaded = Call([&] { return e.LoadCheckpoint(std::move(r), w); });
  py::dict d;
  d["path"] = loaded.path;
  d["tag"] = loaded.tag;
  d["global_steps"] = loaded.global_steps;
  d["saved_world_size"] = loaded.saved_world_size;
  d["frozen_parameters_loaded"] = loaded.frozen_parameters_loaded;
  d["frozen_base_checked"] = loaded.frozen_base_checked;
  py::dict blobs;
  for (const se::CheckpointBlob& b : loaded.blobs) {
    blobs[py::str(b.name)] =
        py::bytes(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size());
  }
  d["blobs"] = blobs;
  return d;
}

// `names[g][i]`: parameter (g, i)'s name in the files ("" leaves it out); `whole`: (name,
// tensor) written from rank 0; `files`: (name, text) written beside the weights by rank 0,
// with them. Returns {files, index, tensors, tensor_bytes, file_bytes, gather_bytes} (the file
// fields on rank 0 only).
py::dict PyEngine::SaveModel(const std::string& dir, const std::string& filename,
                             uint64_t max_file_bytes,
                             const std::vector<std::vector<std::string>>& names,
                             const std::vector<std::pair<std::string, torch::Tensor>>& whole,
                             const std::vector<std::pair<std::string, std::string>>& files) {
  se::SaveModelRequest r;
  r.small_files = files;
  r.dir = dir;
  r.filename = filename;
  r.max_file_bytes = max_file_bytes;
  strata::TensorEngine& e = engine();
  const se::SaveModelResult out = Call([&] { return e.SaveModel(std::move(r), names, whole); });
  py::dict d;
  d["files"] = out.files.files;
  d["index"] = out.files.index;
  d["tensors"] = out.files.tensors;
  d["tensor_bytes"] = out.files.tensor_bytes;
  d["file_bytes"] = out.files.file_bytes;
  d["gather_bytes"] = out.gather_bytes;
  return d;
}

py::dict PyEngine::Layout(int g) {
  CheckGroup(g);
  const se::GroupLayout& l = core().layout(g);
  py::dict d;
  d["name"] = l.name;
  d["numel"] = l.numel;
  d["padded_numel"] = l.padded_numel;
  d["shard_numel"] = l.shard_numel;
  d["frozen"] = core().frozen(g);
  py::list params;
  for (const se::ParamSlot& p : l.params)
    params.append(py::make_tuple(p.name, p.numel, p.offset));
  d["params"] = params;
  return d;
}

void PyEngine::Close() {
  std::shared_ptr<strata::TensorEngine> e = std::move(engine_);
  if (e == nullptr) return;
  py::gil_scoped_release release;  // the store's destructor takes the GIL itself
  e->Close();
  e.reset();
}

}  // namespace strata_py
