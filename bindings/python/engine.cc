// The native half of strata.initialize: EngineCore (engine/runtime/engine_core.h) over raw
// addresses, a comm::Store that forwards to a torch.distributed store (so a process group
// the user already initialized is reused rather than fought over), and the one LibTorch
// detail Python cannot express: pointing an existing storage at the engine's buffer (so
// views autograd saved in the forward see the re-gathered buffer wherever it lands, as
// engine/libtorch/ does).
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "errors.h"
#include "strata/comm/communicator.h"
#include "strata/comm/rendezvous.h"
#include "strata/comm/store.h"
#include "strata/core/config.h"
#include "strata/engine/checkpoint/blobs.h"
#include "strata/engine/checkpoint/safetensors.h"
#include "strata/engine/layout/dtype.h"
#include "strata/engine/libtorch/profiler_ranges.h"
#include "strata/engine/libtorch/torch_internal.h"
#include "strata/engine/protocol/groups.h"
#include "strata/engine/protocol/hook_protocol.h"
#include "strata/engine/runtime/engine_core.h"
#include "strata/engine/runtime/lanes.h"
#include "strata/engine/runtime/stats.h"
#include "strata/engine/step/lr_schedule.h"
#include "strata/swap/fault_injection.h"

namespace py = pybind11;
namespace se = strata::engine;

namespace strata_py {

namespace {

// A comm::Store over a torch.distributed Store object (set/get/add/wait).
class PyStore final : public strata::comm::Store {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

  strata::Status Set(const std::string& key, const std::vector<uint8_t>& value) override {
    py::gil_scoped_acquire gil;
    try {
      store_.attr("set")(key, py::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
      return strata::Status::Ok();
    } catch (py::error_already_set& e) {
      return strata::UnavailableError("torch.distributed store set(" + key + "): " + e.what());
    }
  }

  strata::Result<std::vector<uint8_t>> Get(const std::string& key,
                                           std::chrono::milliseconds timeout) override {
    STRATA_RETURN_IF_ERROR(Wait({key}, timeout));
    py::gil_scoped_acquire gil;
    try {
      std::string v = store_.attr("get")(key).cast<py::bytes>();
      return std::vector<uint8_t>(v.begin(), v.end());
    } catch (py::error_already_set& e) {
      return strata::UnavailableError("torch.distributed store get(" + key + "): " + e.what());
    }
  }

  strata::Result<int64_t> Add(const std::string& key, int64_t delta) override {
    py::gil_scoped_acquire gil;
    try {
      return store_.attr("add")(key, delta).cast<int64_t>();
    } catch (py::error_already_set& e) {
      return strata::UnavailableError("torch.distributed store add(" + key + "): " + e.what());
    }
  }

  strata::Status Wait(const std::vector<std::string>& keys,
                      std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    try {
      store_.attr("wait")(keys, timeout);
      return strata::Status::Ok();
    } catch (py::error_already_set& e) {
      std::string names;
      for (const std::string& k : keys)
        names += (names.empty() ? "" : ", ") + k;
      return strata::DeadlineExceededError("torch.distributed store wait(" + names +
                                           "): " + e.what());
    }
  }

 private:
  py::object store_;
};

se::DType ParseDType(const std::string& name) {
  if (name == "fp32") return se::DType::kFloat32;
  if (name == "bf16") return se::DType::kBFloat16;
  if (name == "fp16") return se::DType::kFloat16;
  ThrowValueError("dtype must be fp32, bf16 or fp16, got " + name);
}

// The engine's statistics as nested dicts, from the one definition of them
// (engine/runtime/stats.h).
class DictVisitor final : public se::StatsVisitor {
 public:
  DictVisitor() { stack_.emplace_back(); }
  py::dict Take() { return stack_.front(); }
  void Enter(std::string_view key) override {
    py::dict d;
    stack_.back()[py::str(std::string(key))] = d;
    stack_.push_back(d);
  }
  void Leave() override { stack_.pop_back(); }
  void Null(std::string_view key) override { Set(key, py::none()); }
  void Value(std::string_view key, uint64_t v) override { Set(key, py::int_(v)); }
  void Value(std::string_view key, int64_t v) override { Set(key, py::int_(v)); }
  void Value(std::string_view key, double v) override { Set(key, py::float_(v)); }
  void Value(std::string_view key, bool v) override { Set(key, py::bool_(v)); }
  void Value(std::string_view key, const std::string& v) override { Set(key, py::str(v)); }
  void Value(std::string_view key, const std::vector<double>& v) override { Set(key, py::cast(v)); }
  void Value(std::string_view key, const std::vector<uint64_t>& v) override {
    Set(key, py::cast(v));
  }

 private:
  void Set(std::string_view key, py::object value) {
    stack_.back()[py::str(std::string(key))] = std::move(value);
  }
  std::vector<py::dict> stack_;
};

py::dict StatsDict(const se::EngineStats& s) {
  DictVisitor v;
  se::VisitStats(s, v);
  return v.Take();
}

// The Python front end's tensors as the hook protocol sees them: its object's point(group,
// [addresses]), empty(group) and drop_gradients(), called with the GIL taken (the protocol's
// calls run without it: several autograd threads may call the hooks).
class PyTensors final : public se::ParameterTensors {
 public:
  explicit PyTensors(py::object tensors) : tensors_(std::move(tensors)) {}
  ~PyTensors() override {
    py::gil_scoped_acquire gil;
    tensors_ = py::object();
  }
  PyTensors(const PyTensors&) = delete;
  PyTensors& operator=(const PyTensors&) = delete;

  strata::Status Point(int group, std::span<std::byte* const> data) override {
    return CallPython("point", [&] {
      py::list addresses;
      for (std::byte* p : data)
        addresses.append(reinterpret_cast<uintptr_t>(p));
      tensors_.attr("point")(group, addresses);
    });
  }
  strata::Status Empty(int group) override {
    return CallPython("empty", [&] { tensors_.attr("empty")(group); });
  }
  strata::Status DropGradients() override {
    return CallPython("drop_gradients", [&] { tensors_.attr("drop_gradients")(); });
  }

 private:
  template <typename F>
  strata::Status CallPython(const char* what, F&& f) {
    py::gil_scoped_acquire gil;
    try {
      f();
      return strata::Status::Ok();
    } catch (py::error_already_set& e) {
      return strata::InternalError(std::string("strata: the front end's ") + what + ": " +
                                   e.what());
    }
  }

  py::object tensors_;
};

// Python objects the engine keeps alive (a gradient its compute stream still reads): the
// engine drops them on any thread, without the GIL, so a dropped object goes here and is
// released at the next Drain (called with the GIL: at each gradient and when the engine
// goes). One the process keeps after its engine is gone leaks rather than be released
// without the GIL.
class Graveyard : public std::enable_shared_from_this<Graveyard> {
 public:
  // REQUIRES the GIL.
  std::shared_ptr<const void> Hold(py::object obj) {
    PyObject* raw = obj.release().ptr();  // our reference now
    return std::shared_ptr<const void>(raw, [self = shared_from_this()](const void* p) {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->dead_.push_back(static_cast<PyObject*>(const_cast<void*>(p)));
    });
  }
  // REQUIRES the GIL.
  void Drain() {
    std::vector<PyObject*> dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead.swap(dead_);
    }
    for (PyObject* p : dead)
      Py_DECREF(p);
  }

 private:
  std::mutex mu_;
  std::vector<PyObject*> dead_;
};

class PyEngine {
 public:
  // groups: [(name, [(param name, numel, address of fp32 initial values or 0, parameter
  // group)])]; param_groups: each parameter group's overrides {lr, weight_decay, beta1,
  // beta2, eps} (absent or None: the config's), empty: one group.
  // store None: comm::RendezvousFromEnvironment (torchrun's variables; one process
  // without them). Otherwise a torch.distributed Store; keys go under `prefix`.
  PyEngine(
      const std::string& config_json,
      const std::vector<std::tuple<
          std::string, std::vector<std::tuple<std::string, size_t, uintptr_t, int, std::string>>,
          bool>>& groups,
      py::object store, const std::string& prefix, int rank, int world_size, int local_rank,
      int local_world_size, bool prefetch, bool broadcast_initial_values, double timeout_s,
      int cuda_device, uintptr_t compute_stream,
      const std::vector<std::map<std::string, std::optional<double>>>& param_groups) {
    strata::comm::Rendezvous rv;
    if (store.is_none()) {
      strata::comm::RendezvousOptions ro;
      ro.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
      std::optional<strata::Result<strata::comm::Rendezvous>> r;
      {
        py::gil_scoped_release release;
        r.emplace(strata::comm::RendezvousFromEnvironment(ro));
      }
      rv = ValueOrThrow(std::move(*r).WithContext("strata.initialize: rendezvous"));
    } else {
      rv.rank = rank;
      rv.world_size = world_size;
      rv.local_rank = local_rank;
      rv.local_world_size = local_world_size;
      rv.store = strata::comm::PrefixStore(prefix, std::make_shared<PyStore>(store));
    }
    strata::Config config =
        ValueOrThrow(strata::ParseConfig(config_json, {.world_size = rv.world_size}));

    std::vector<se::GroupDesc> descs;
    for (const auto& [name, params, frozen] : groups) {
      se::GroupDesc d;
      d.name = name;
      d.frozen = frozen;
      for (const auto& [pname, numel, address, pgroup, dtype] : params) {
        d.params.push_back(
            {pname, numel, reinterpret_cast<const void*>(address), ParseDType(dtype), pgroup});
      }
      descs.push_back(std::move(d));
    }
    se::EngineOptions options;
    for (const auto& pg : param_groups) {
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
      options.param_groups.push_back(o);
    }
    options.prefetch = prefetch;
    Check(ArmTestFault(options, rv.rank));
    options.broadcast_initial_values = broadcast_initial_values;
    strata::comm::CommOptions co;
    co.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    if (rv.world_size == 1) co.interface = "127.0.0.1";  // nothing leaves the process
    strata::Status s;
    {
      py::gil_scoped_release release;
      s = Build(config, rv, co, descs, options, cuda_device, compute_stream);
    }
    Check(s);
  }

  // The communicators and the core. cuda_device >= 0: the CUDA device on `compute_stream`
  // (torch's current stream there), NCCL for the device buffers and gloo for the host's;
  // else gloo and the CPU device.
  strata::Status Build(const strata::Config& config, const strata::comm::Rendezvous& rv,
                       const strata::comm::CommOptions& co, const std::vector<se::GroupDesc>& descs,
                       se::EngineOptions options, int cuda_device, uintptr_t compute_stream) {
    if (cuda_device >= 0) {
      se::CudaDeviceOptions dopts;
      dopts.device = cuda_device;
      dopts.budget_bytes = config.strata.device_budget;
      dopts.compute_stream = reinterpret_cast<void*>(compute_stream);
      strata::Result<std::unique_ptr<se::Device>> dev = se::MakeCudaDevice(dopts);
      if (!dev.ok()) return dev.status().WithContext("strata.initialize: the CUDA device");
      options.device = std::shared_ptr<se::Device>(std::move(*dev));
      strata::comm::CommOptions nco = co;
      nco.device = strata::comm::Device::Cuda(cuda_device);
      strata::Result<std::unique_ptr<strata::comm::Communicator>> nccl =
          strata::comm::CreateCommunicator(strata::comm::Backend::kNccl, rv, nco);
      if (!nccl.ok()) return nccl.status().WithContext("strata.initialize: NCCL communicator");
      comm_ = std::move(*nccl);
    }
    strata::Result<std::unique_ptr<strata::comm::Communicator>> gloo =
        strata::comm::CreateCommunicator(strata::comm::Backend::kGloo, rv, co);
    if (!gloo.ok()) return gloo.status().WithContext("strata.initialize: communicator");
    if (comm_ == nullptr) {
      comm_ = std::move(*gloo);
      // The gradient reductions' own lane (EngineOptions::reduce_comm) on several ranks.
      if (rv.world_size > 1) {
        strata::Result<std::unique_ptr<strata::comm::Communicator>> lane =
            strata::comm::CreateCommunicator(strata::comm::Backend::kGloo, rv, co);
        if (!lane.ok()) {
          return lane.status().WithContext("strata.initialize: the reductions' communicator");
        }
        reduce_comm_ = std::move(*lane);
        options.reduce_comm = reduce_comm_;
      }
    } else {
      host_comm_ = std::move(*gloo);
      options.host_comm = host_comm_;
      // NCCL: the reductions on a communicator (and CUDA stream) of their own, so the
      // backward's all-gathers never queue behind a reduce-scatter in flight.
      if (rv.world_size > 1 && config.strata.nccl_lanes) {
        STRATA_RETURN_IF_ERROR(se::CheckNcclLanes().WithContext("strata.initialize"));
        strata::Result<std::unique_ptr<strata::comm::Communicator>> lane = comm_->Duplicate();
        if (!lane.ok()) {
          return lane.status().WithContext("strata.initialize: the reductions' NCCL lane");
        }
        reduce_comm_ = std::move(*lane);
        options.reduce_comm = reduce_comm_;
      }
    }
    strata::Result<std::unique_ptr<se::EngineCore>> core =
        se::EngineCore::Create(config, comm_, descs, options);
    if (!core.ok()) return core.status();
    core_ = std::move(*core);
    return strata::Status::Ok();
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
  strata::Status ArmTestFault(se::EngineOptions& options, int rank) {
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

  ~PyEngine() { Close(); }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  se::EngineCore& core() {
    if (core_ == nullptr) throw std::runtime_error("strata: the engine was closed");
    return *core_;
  }

  // f(the core) and f(the protocol), without the GIL: a collective may wait for other
  // ranks, and a hook of another autograd thread may hold the protocol's lock and wait for
  // the GIL in a PyTensors call.
  template <typename F>
  void Call(F&& f) {
    WithoutGil(core(), std::forward<F>(f));
  }
  template <typename F>
  void Hook(F&& f) {
    WithoutGil(hooks(), std::forward<F>(f));
  }

  // Releases the gradients the engine no longer keeps (needs the GIL).
  void DrainKept() { graveyard_->Drain(); }

  void CheckGroup(int g) {
    if (g < 0 || g >= core().num_groups()) {
      Check(strata::OutOfRangeError("strata: group " + std::to_string(g) + " of " +
                                    std::to_string(core().num_groups())));
    }
  }

  // The addresses of group g's parameters in its gathered buffer (0 for no storage).
  std::vector<uintptr_t> FullBuffer(int g) {
    CheckGroup(g);
    se::GatheredGroup full = ValueOrThrow(core().FullBuffer(g));
    std::vector<uintptr_t> out;
    for (size_t i = 0; i < full.layout->params.size(); ++i)
      out.push_back(reinterpret_cast<uintptr_t>(full.param_data(i)));
    return out;
  }

  // The hook protocol over this core (engine/protocol/hook_protocol.h), started at once
  // (the root group taken). `groups`: each group's (parameters, frozen, companion);
  // `tensors`: the front end's object (PyTensors).
  void StartHooks(const std::vector<std::tuple<size_t, bool, int>>& groups, py::object tensors) {
    std::vector<se::ProtocolGroup> defs;
    for (const auto& [params, frozen, companion] : groups)
      defs.push_back({params, frozen, companion});
    tensors_ = std::make_unique<PyTensors>(std::move(tensors));
    hooks_ = std::make_unique<se::HookProtocol>(core(), std::move(defs), *tensors_,
                                                se::FrontEndNames{"strata: ", "strata: engine."});
    Hook([](se::HookProtocol& h) { return h.Start(); });
  }

  se::HookProtocol& hooks() {
    if (hooks_ == nullptr) throw std::runtime_error("strata: the engine was closed");
    return *hooks_;
  }

  // `owner`: the gradient tensor when the engine must keep it alive until its compute
  // stream read it (a CPU gradient: the CPU device's compute stream is a worker), else None.
  void Gradient(int g, int i, uintptr_t grad, const std::string& dtype, py::object owner) {
    const se::DType t = ParseDType(dtype);
    graveyard_->Drain();
    std::shared_ptr<const void> held;
    if (!owner.is_none()) held = graveyard_->Hold(std::move(owner));
    Hook([&](se::HookProtocol& h) {
      return h.Gradient(g, i, reinterpret_cast<const void*>(grad), t, std::move(held));
    });
  }

  py::dict Step() {
    std::optional<strata::Result<se::StepOutcome>> r;
    se::HookProtocol& h = hooks();
    if (test_fault_ != nullptr) test_fault_->stepping = test_fault_->steps++;
    {
      py::gil_scoped_release release;
      r.emplace(h.Step());
    }
    se::StepOutcome o = ValueOrThrow(std::move(*r));
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

  void GatherMasterParams(int g, uintptr_t out, size_t numel) {
    CheckGroup(g);
    if (numel != core().layout(g).numel) {
      Check(strata::InvalidArgumentError("gather_master_params: group " + std::to_string(g) +
                                         " has " + std::to_string(core().layout(g).numel) +
                                         " elements, got room for " + std::to_string(numel)));
    }
    Hook([&](se::HookProtocol& h) {
      return h.GatherMasterParams(g, std::span<float>(reinterpret_cast<float*>(out), numel));
    });
  }

  using Expected = std::tuple<std::string, std::vector<std::string>, std::vector<int64_t>>;
  using Other = std::tuple<std::string, std::vector<std::string>, std::vector<int64_t>, bool>;
  // se::LoadSafetensors (collective); `fill(k, address, numel)` copies other tensor k's fp32
  // values (valid during the call) into the model.
  void LoadSafetensors(const std::string& path, const std::vector<std::vector<Expected>>& params,
                       const std::vector<Other>& others, const py::function& fill) {
    std::vector<std::vector<se::ExpectedTensor>> p;
    for (const auto& group : params) {
      p.emplace_back();
      for (const auto& [name, aliases, shape] : group)
        p.back().push_back({name, aliases, shape, false});
    }
    std::vector<se::ExpectedTensor> o;
    for (const auto& [name, aliases, shape, optional] : others)
      o.push_back({name, aliases, shape, optional});
    Hook([&](se::HookProtocol& h) {
      return h.LoadSafetensors(
          path, p, o, [&](size_t k, std::span<const float> values) -> strata::Status {
            py::gil_scoped_acquire gil;
            try {
              fill(k, reinterpret_cast<uintptr_t>(values.data()), values.size());
              return strata::Status::Ok();
            } catch (py::error_already_set& e) {
              return strata::InternalError("copying " + o[k].name + " into the model: " + e.what());
            }
          });
    });
  }

  // EngineCore::SetParameters (collective): `params` [(group, param, address, numel)] of
  // fp32 buffers, rank `source`'s sent to every rank; `check`: this rank's error ("" none).
  void SetParameters(int source,
                     const std::vector<std::tuple<int, size_t, uintptr_t, size_t>>& params,
                     const std::string& check) {
    std::vector<std::pair<int, size_t>> which;
    std::vector<std::span<float>> values;
    for (const auto& [g, i, address, numel] : params) {
      which.emplace_back(g, i);
      values.emplace_back(reinterpret_cast<float*>(address), numel);
    }
    const strata::Status local =
        check.empty() ? strata::Status::Ok() : strata::InvalidArgumentError(check);
    Hook([&](se::HookProtocol& h) { return h.SetParameters(local, source, which, values); });
  }

  // EngineCore::AssembleParameters (collective): `params` [(group, param, address, count)]:
  // this rank's part of each parameter, fp32.
  void AssembleParameters(const std::vector<std::tuple<int, size_t, uintptr_t, size_t>>& params,
                          const std::string& check) {
    std::vector<std::pair<int, size_t>> which;
    std::vector<std::span<const float>> parts;
    for (const auto& [g, i, address, count] : params) {
      which.emplace_back(g, i);
      parts.emplace_back(reinterpret_cast<const float*>(address), count);
    }
    const strata::Status local =
        check.empty() ? strata::Status::Ok() : strata::InvalidArgumentError(check);
    Hook([&](se::HookProtocol& h) { return h.AssembleParameters(local, which, parts); });
  }

  using SavedParam = std::tuple<std::string, std::vector<int64_t>>;
  using SavedWhole = std::tuple<std::string, std::string, std::vector<int64_t>, uintptr_t>;
  // engine::SaveModel (collective). `params[g][i]`: (name or "", shape); `whole`: (name,
  // safetensors dtype, shape, address of rank 0's contiguous CPU data); `files`: (name, text)
  // written beside the model by rank 0, with it; `check`: this rank's
  // error before the save ("" for none), agreed on. Returns {files, index, tensors,
  // tensor_bytes, file_bytes, gather_bytes} (the file fields on rank 0 only).
  py::dict SaveModel(const std::string& dir, const std::string& filename, uint64_t max_file_bytes,
                     const std::vector<std::vector<SavedParam>>& params,
                     const std::vector<SavedWhole>& whole,
                     const std::vector<std::pair<std::string, std::string>>& files,
                     const std::string& check) {
    se::SaveModelRequest r;
    r.small_files = files;
    r.dir = dir;
    r.filename = filename;
    r.max_file_bytes = max_file_bytes;
    for (const auto& group : params) {
      r.params.emplace_back();
      for (const auto& [name, shape] : group)
        r.params.back().push_back({name, shape});
    }
    for (const auto& [name, dtype, shape, data] : whole)
      r.whole.push_back({name, dtype, shape, reinterpret_cast<const void*>(data)});
    if (!check.empty()) r.local_check = strata::InvalidArgumentError(check);
    se::SaveModelResult out;
    Hook([&](se::HookProtocol& h) -> strata::Status {
      STRATA_ASSIGN_OR_RETURN(out, h.SaveModel(r));
      return strata::Status::Ok();
    });
    py::dict d;
    d["files"] = out.files.files;
    d["index"] = out.files.index;
    d["tensors"] = out.files.tensors;
    d["tensor_bytes"] = out.files.tensor_bytes;
    d["file_bytes"] = out.files.file_bytes;
    d["gather_bytes"] = out.gather_bytes;
    return d;
  }

  // Blobs as Python sees them: (name, dtype, shape, bytes).
  using PyBlob = std::tuple<std::string, std::string, std::vector<uint64_t>, py::bytes>;

  // EngineCore::SaveCheckpoint (collective); returns the tag's directory.
  std::string SaveCheckpoint(const std::string& dir, const std::string& tag,
                             const std::vector<PyBlob>& blobs,
                             const std::vector<std::vector<std::vector<int64_t>>>& shapes,
                             bool exclude_frozen_parameters) {
    se::CheckpointSaveRequest o;
    o.dir = dir;
    o.tag = tag;
    o.exclude_frozen_parameters = exclude_frozen_parameters;
    o.param_shapes = shapes;
    for (const auto& [name, dtype, shape, bytes] : blobs) {
      char* data = nullptr;
      Py_ssize_t n = 0;
      if (PyBytes_AsStringAndSize(bytes.ptr(), &data, &n) != 0) throw py::error_already_set();
      se::CheckpointBlob b;
      b.name = name;
      b.dtype = dtype;
      b.shape = shape;
      b.bytes.resize(static_cast<size_t>(n));
      if (n > 0) std::memcpy(b.bytes.data(), data, static_cast<size_t>(n));
      o.blobs.push_back(std::move(b));
    }
    if (const char* crash = std::getenv("STRATA_TEST_CHECKPOINT_CRASH_AT"); crash != nullptr) {
      o.crash_at = crash;  // tests only: _exit(9) at that point of the save
    }
    std::string path;
    Hook([&](se::HookProtocol& h) -> strata::Status {
      STRATA_ASSIGN_OR_RETURN(path, h.SaveCheckpoint(o));
      return strata::Status::Ok();
    });
    return path;
  }

  // EngineCore::LoadCheckpoint (collective). `whole`: the tensors the front end keeps whole,
  // [(blob name, dtype, shape)], checked against the checkpoint's (engine/checkpoint/blobs.h).
  // Returns {path, tag, global_steps, saved_world_size, frozen_parameters_loaded,
  // frozen_base_checked, blobs: [(name, dtype, shape, bytes)]}.
  py::dict LoadCheckpoint(
      const std::string& dir, const std::string& tag, bool load_optimizer_states,
      bool load_lr_scheduler_states, bool load_module_only, bool check_frozen_parameters,
      const std::vector<std::tuple<std::string, std::string, std::vector<uint64_t>>>& whole) {
    se::CheckpointLoadRequest o;
    o.dir = dir;
    o.tag = tag;
    o.load_optimizer_states = load_optimizer_states;
    o.load_lr_scheduler_states = load_lr_scheduler_states;
    o.load_module_only = load_module_only;
    o.check_frozen_parameters = check_frozen_parameters;
    std::vector<se::blob::WholeTensor> expected;
    for (const auto& [name, dtype, shape] : whole)
      expected.push_back({name, dtype, shape});
    o.check_blobs = [&](const std::vector<se::CheckpointTensor>& saved) {
      return se::blob::CheckWholeTensors(saved, expected);
    };
    se::CheckpointLoadResult loaded;
    Hook([&](se::HookProtocol& h) -> strata::Status {
      STRATA_ASSIGN_OR_RETURN(loaded, h.LoadCheckpoint(o));
      return strata::Status::Ok();
    });
    py::dict d;
    d["path"] = loaded.path;
    d["tag"] = loaded.tag;
    d["global_steps"] = loaded.global_steps;
    d["saved_world_size"] = loaded.saved_world_size;
    d["frozen_parameters_loaded"] = loaded.frozen_parameters_loaded;
    d["frozen_base_checked"] = loaded.frozen_base_checked;
    py::list blobs;
    for (const se::CheckpointBlob& b : loaded.blobs) {
      blobs.append(
          py::make_tuple(b.name, b.dtype, b.shape,
                         py::bytes(reinterpret_cast<const char*>(b.bytes.data()), b.bytes.size())));
    }
    d["blobs"] = blobs;
    return d;
  }

  py::dict Layout(int g) {
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

  // Also the destructor's (idempotent). Called with the GIL.
  void Close() {
    hooks_.reset();
    tensors_.reset();  // takes the GIL (held here)
    {
      py::gil_scoped_release release;  // the store's destructor takes the GIL itself
      core_.reset();
      comm_.reset();
      host_comm_.reset();
      reduce_comm_.reset();
    }
    graveyard_->Drain();  // the device is gone: every gradient it kept is there
  }

 private:
  template <typename T, typename F>
  static void WithoutGil(T& target, F&& f) {
    strata::Status s;
    {
      py::gil_scoped_release release;
      s = f(target);
    }
    Check(s);
  }

  std::shared_ptr<strata::comm::Communicator> comm_;
  std::shared_ptr<strata::comm::Communicator> host_comm_;    // gloo, beside an NCCL comm_
  std::shared_ptr<strata::comm::Communicator> reduce_comm_;  // the reductions' lane
  std::unique_ptr<se::EngineCore> core_;
  // After core_: destroyed before it.
  std::unique_ptr<PyTensors> tensors_;
  std::unique_ptr<se::HookProtocol> hooks_;
  std::shared_ptr<TestFault> test_fault_;
  std::shared_ptr<Graveyard> graveyard_ = std::make_shared<Graveyard>();
};

}  // namespace

void BindEngine(py::module_& m) {
  // The engine's waits as torch.profiler ranges (strata::all-gather wait, ...).
  strata::InstallProfilerRanges();
  py::
      class_<PyEngine>(m, "EngineCore", "engine/runtime/engine_core.h over raw addresses.")
          .def(
              py::init<
                  const std::string&,
                  const std::vector<std::tuple<
                      std::string,
                      std::vector<std::tuple<std::string, size_t, uintptr_t, int, std::string>>,
                      bool>>&,
                  py::object, const std::string&, int, int, int, int, bool, bool, double, int,
                  uintptr_t, const std::vector<std::map<std::string, std::optional<double>>>&>(),
              py::arg("config_json"), py::arg("groups"), py::arg("store") = py::none(),
              py::arg("prefix") = "strata", py::arg("rank") = 0, py::arg("world_size") = 1,
              py::arg("local_rank") = 0, py::arg("local_world_size") = 1,
              py::arg("prefetch") = true, py::arg("broadcast_initial_values") = true,
              py::arg("timeout_s") = 300.0, py::arg("cuda_device") = -1,
              py::arg("compute_stream") = 0,
              py::arg("param_groups") = std::vector<std::map<std::string, std::optional<double>>>())
          .def_property_readonly("rank", [](PyEngine& e) { return e.core().rank(); })
          .def_property_readonly("world_size", [](PyEngine& e) { return e.core().world_size(); })
          // The configuration as the core parsed it: every default filled in, batch sizes
          // derived for this data-parallel world (JSON text).
          .def_property_readonly("normalized_config",
                                 [](PyEngine& e) { return e.core().config().normalized.dump(); })
          .def_property_readonly("num_groups", [](PyEngine& e) { return e.core().num_groups(); })
          .def_property_readonly(
              "dtype", [](PyEngine& e) { return std::string(se::DTypeName(e.core().dtype())); })
          .def("layout", &PyEngine::Layout, py::arg("group"))
          .def("full_buffer", &PyEngine::FullBuffer, py::arg("group"))
          .def("start_hooks", &PyEngine::StartHooks, py::arg("groups"), py::arg("tensors"))
          .def(
              "begin_forward",
              [](PyEngine& e, int g, bool recompute) {
                e.CheckGroup(g);
                e.Hook([&](se::HookProtocol& h) { return h.BeginForward(g, recompute); });
              },
              py::arg("group"), py::arg("recompute"))
          .def(
              "end_forward",
              [](PyEngine& e, int g, bool recompute) {
                e.CheckGroup(g);
                e.Hook([&](se::HookProtocol& h) { return h.EndForward(g, recompute); });
              },
              py::arg("group"), py::arg("recompute"))
          .def("abort_forward",
               [](PyEngine& e) { e.Hook([](se::HookProtocol& h) { return h.AbortForward(); }); })
          .def("check_forward",
               [](PyEngine& e) { e.Hook([](se::HookProtocol& h) { return h.CheckForward(); }); })
          .def(
              "pre_backward",
              [](PyEngine& e, int g) {
                e.CheckGroup(g);
                e.Hook([g](se::HookProtocol& h) { return h.PreBackward(g); });
              },
              py::arg("group"))
          .def(
              "post_backward",
              [](PyEngine& e, int g) {
                e.CheckGroup(g);
                e.Hook([g](se::HookProtocol& h) { return h.PostBackward(g); });
              },
              py::arg("group"))
          .def("gradient", &PyEngine::Gradient, py::arg("group"), py::arg("param"),
               py::arg("grad"), py::arg("dtype"), py::arg("owner") = py::none())
          .def("begin_backward",
               [](PyEngine& e) { e.Hook([](se::HookProtocol& h) { return h.BeginBackward(); }); })
          .def("finish_backward",
               [](PyEngine& e) {
                 e.Hook([](se::HookProtocol& h) { return h.FinishBackward(); });
                 e.DrainKept();  // the backward's end waited for the compute stream
               })
          .def(
              "use_compute_stream",
              [](PyEngine& e, uintptr_t stream) {
                e.Call([stream](se::EngineCore& c) {
                  return c.UseComputeStream(reinterpret_cast<void*>(stream));
                });
              },
              py::arg("stream"),
              "The compute stream from now on (a cudaStream_t: torch.cuda.current_stream()"
              ".cuda_stream; 0: the stream of creation).")
          .def(
              "autograd_failed",
              [](PyEngine& e, const std::string& what) {
                e.Hook([&](se::HookProtocol& h) { return h.AutogradFailed(what); });
              },
              py::arg("what"))
          .def("begin_eval",
               [](PyEngine& e) { e.Hook([](se::HookProtocol& h) { return h.BeginEval(); }); })
          .def("end_eval",
               [](PyEngine& e) { e.Hook([](se::HookProtocol& h) { return h.EndEval(); }); })
          .def("check_usable",
               [](PyEngine& e) { e.Hook([](se::HookProtocol& h) { return h.CheckUsable(); }); })
          .def(
              "expect_inputs",
              [](PyEngine& e, int g, bool recompute) {
                e.CheckGroup(g);
                return e.hooks().ExpectInputs(g, recompute);
              },
              py::arg("group"), py::arg("recompute"))
          .def("is_gradient_accumulation_boundary",
               [](PyEngine& e) { return e.core().IsGradientAccumulationBoundary(); })
          .def("step", &PyEngine::Step)
          .def("loss_multiplier", [](PyEngine& e) { return e.core().LossMultiplier(); })
          .def("lr", [](PyEngine& e) { return e.core().lr(); })
          .def("lr_iteration", [](PyEngine& e) { return e.core().lr_iteration(); })
          .def("skipped_steps",
               [](PyEngine& e) { return e.core().loss_scaler().skipped_steps(); })
          .def(
              "set_lr_iteration",
              [](PyEngine& e, int64_t iteration) {
                e.Call([iteration](se::EngineCore& c) { return c.set_lr_iteration(iteration); });
              },
              py::arg("iteration"))
          .def(
              "set_lr",
              [](PyEngine& e,
                 double lr) { e.Call([lr](se::EngineCore& c) { return c.set_lr(lr); }); },
              py::arg("lr"))
          .def("loss_scale", [](PyEngine& e) { return e.core().loss_scale(); })
          .def("gather_master_params", &PyEngine::GatherMasterParams, py::arg("group"),
               py::arg("out"), py::arg("numel"))
          .def("set_parameters", &PyEngine::SetParameters, py::arg("source"), py::arg("params"),
               py::arg("check"))
          .def("assemble_parameters", &PyEngine::AssembleParameters, py::arg("params"),
               py::arg("check"))
          .def("save_model", &PyEngine::SaveModel, py::arg("dir"), py::arg("filename"),
               py::arg("max_file_bytes"), py::arg("params"), py::arg("whole"), py::arg("files"),
               py::arg("check"))
          .def("load_safetensors", &PyEngine::LoadSafetensors, py::arg("path"), py::arg("params"),
               py::arg("others"), py::arg("fill"))
          .def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("dir"), py::arg("tag"),
               py::arg("blobs"), py::arg("shapes"), py::arg("exclude_frozen_parameters"))
          .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("dir"), py::arg("tag"),
               py::arg("load_optimizer_states"), py::arg("load_lr_scheduler_states"),
               py::arg("load_module_only"), py::arg("check_frozen_parameters"),
               py::arg("whole"))
          .def("stats", [](PyEngine& e) { return StatsDict(e.core().stats()); })
          .def(
              "enable_timeline", [](PyEngine& e, bool on) { e.core().EnableTimeline(on); },
              py::arg("on"))
          .def("timeline_enabled", [](PyEngine& e) { return e.core().timeline_enabled(); })
          .def("timeline_dropped", [](PyEngine& e) { return e.core().timeline_dropped(); })
          .def("take_timeline",
               [](PyEngine& e) {
                 py::list out;
                 for (const se::TimelineEvent& ev : e.core().TakeTimeline()) {
                   py::dict d;
                   d["name"] = ev.name;
                   d["lane"] = std::string(se::TimelineLaneName(ev.lane));
                   d["start_us"] = ev.start_us;
                   d["duration_us"] = ev.duration_us;
                   d["index"] = ev.index;
                   d["micro_step"] = ev.micro_step;
                   out.append(std::move(d));
                 }
                 return out;
               })
          .def(
              "write_chrome_trace",
              [](PyEngine& e, const std::string& path, const py::list& events) {
                std::vector<se::TimelineEvent> evs;
                for (const py::handle h : events) {
                  const py::dict d = py::reinterpret_borrow<py::dict>(h);
                  se::TimelineEvent ev;
                  ev.name = d["name"].cast<std::string>();
                  const std::string lane = d["lane"].cast<std::string>();
                  bool known = false;
                  for (const se::TimelineLane l : se::kTimelineLanes) {
                    if (se::TimelineLaneName(l) == lane) {
                      ev.lane = l;
                      known = true;
                    }
                  }
                  if (!known) ThrowValueError("write_chrome_trace: unknown lane '" + lane + "'");
                  ev.start_us = d["start_us"].cast<double>();
                  ev.duration_us = d["duration_us"].cast<double>();
                  ev.index = d["index"].cast<int>();
                  ev.micro_step = d["micro_step"].cast<int64_t>();
                  evs.push_back(std::move(ev));
                }
                Check(
                    se::WriteChromeTrace(path, evs, e.core().rank(), e.core().timeline_dropped()));
              },
              py::arg("path"), py::arg("events"))
          .def("close", &PyEngine::Close);

  m.def(
      "lr_schedule",
      [](const std::string& config_json, int64_t steps) {
        const strata::Config config = ValueOrThrow(strata::ParseConfig(config_json));
        const strata::engine::LrSchedule schedule =
            ValueOrThrow(strata::engine::LrSchedule::Create(config.scheduler, config.optimizer));
        std::vector<std::tuple<double, double, double>> out;
        for (int64_t i = 0; i < steps; ++i) {
          const int64_t it = schedule.first_iteration() + i;
          const auto betas = schedule.BetasAt(it).value_or(
              std::pair{config.optimizer.beta1, config.optimizer.beta2});
          out.emplace_back(schedule.LrAt(it), betas.first, betas.second);
        }
        return out;
      },
      py::arg("config_json"), py::arg("steps"),
      "(lr, beta1, beta2) of the engine's first `steps` applied steps under the config's "
      "optimizer and scheduler (engine/step/lr_schedule.h): for comparing with DeepSpeed's.");

  m.def(
      "plan_groups",
      [](const std::vector<std::string>& blocks,
         const std::vector<std::tuple<std::string, std::vector<int>, bool, bool>>& params) {
        std::vector<se::ParamPlacement> placements;
        for (const auto& [name, in_blocks, outside, trainable] : params)
          placements.push_back({name, in_blocks, outside, trainable});
        se::GroupRules rules;  // shared parameters to the root, empty blocks dropped
        const se::GroupPlan plan = ValueOrThrow(se::PlanGroups(blocks, placements, rules));
        py::list out;
        for (const se::PlannedGroup& g : plan.groups) {
          py::dict d;
          d["name"] = g.name;
          d["params"] = g.params;
          d["frozen"] = g.frozen;
          d["companion"] = g.companion;
          d["block"] = g.block;
          out.append(std::move(d));
        }
        return out;
      },
      py::arg("blocks"), py::arg("params"),
      "The engine's groups (engine/protocol/groups.h) of a model with these blocks (names) "
      "and parameters [(name, [blocks holding it], held outside every block, trains)]: "
      "[{name, params (indices), frozen, companion, block}], the root first.");
  {
    namespace blob = se::blob;
    py::dict names;
    names["buffer"] = std::string(blob::kBuffer);
    names["unmanaged"] = std::string(blob::kUnmanaged);
    names["client_state"] = std::string(blob::kClientState);
    names["torch_cpu_rng"] = std::string(blob::kTorchCpuRng);
    names["torch_cuda_rng"] = std::string(blob::kTorchCudaRng);
    names["python_rng"] = std::string(blob::kPythonRng);
    names["numpy_rng"] = std::string(blob::kNumpyRng);
    // The checkpoint blobs' names, the same for both front ends (engine/checkpoint/blobs.h).
    m.attr("BLOB_NAMES") = names;
  }

  m.def(
      "set_storage_data",
      [](uintptr_t storage_impl, uintptr_t address, size_t nbytes) {
        // storage_impl: UntypedStorage._cdata, a c10::StorageImpl* of this process's
        // LibTorch (the same libc10 torch's Python module uses); engine/libtorch/torch_internal.h.
        auto* impl = reinterpret_cast<c10::StorageImpl*>(storage_impl);
        if (impl == nullptr) ThrowValueError("set_storage_data: null storage");
        strata::torch_internal::PointStorage(impl, reinterpret_cast<void*>(address), nbytes);
      },
      py::arg("storage"), py::arg("address"), py::arg("nbytes"),
      "Points a storage (UntypedStorage._cdata; CPU or CUDA, which it keeps) at "
      "engine-owned memory without copying; address 0 empties it. The previous memory is "
      "released by its owner.");
}

}  // namespace strata_py
