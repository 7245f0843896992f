// _strata.Engine: PyEngine (py_engine.h) bound for strata/engine.py — the hooks, the calls
// between steps, the core's counters — and the engine's module-level helpers (the learning
// rate schedule, the group planner, the checkpoint blobs' names).
#include <pybind11/stl.h>

#include "py_engine.h"
#include "strata/core/config.h"
#include "strata/engine/checkpoint/blobs.h"
#include "strata/engine/libtorch/profiler_ranges.h"
#include "strata/engine/protocol/groups.h"
#include "strata/engine/runtime/stats.h"
#include "strata/engine/step/lr_schedule.h"

namespace py = pybind11;
namespace se = strata::engine;

namespace strata_py {

namespace {

using PyEngineClass = py::class_<PyEngine>;

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

// A protocol call on group g (checked first), without the GIL.
template <typename F>
void OnGroup(PyEngine& e, int g, F&& f) {
  e.CheckGroup(g);
  strata::TensorEngine& te = e.engine();
  e.Call([&] { return f(te); });
}

// What a front end's hooks call: a block's forward and the autograd functions around it,
// the backward, the step, evaluation.
void BindHooks(PyEngineClass& c) {
  c.def(
       "begin_forward",
       [](PyEngine& e, int g) {
         OnGroup(e, g, [g](strata::TensorEngine& t) { return t.BeginForward(g); });
       },
       py::arg("group"))
      .def(
          "end_forward",
          [](PyEngine& e, int g, bool unwinding) {
            OnGroup(e, g, [&](strata::TensorEngine& t) { return t.EndForward(g, unwinding); });
          },
          py::arg("group"), py::arg("unwinding") = false)
      .def(
          "wrap_outputs",
          [](PyEngine& e, int g, std::vector<torch::Tensor> tensors) {
            e.CheckGroup(g);
            return e.engine().WrapOutputs(g, std::move(tensors));
          },
          py::arg("group"), py::arg("tensors"),
          "The tensors that require grad through the function that re-gathers the group "
          "before its backward.")
      .def(
          "wrap_inputs",
          [](PyEngine& e, int g, std::vector<torch::Tensor> tensors) {
            e.CheckGroup(g);
            return e.engine().WrapInputs(g, std::move(tensors));
          },
          py::arg("group"), py::arg("tensors"),
          "A block with frozen parameters: its inputs that require grad through the function "
          "that ends its backward when their gradients are computed.")
      .def("abort_forward",
           [](PyEngine& e) {
             se::HookProtocol& h = e.hooks();
             e.Call([&] { return h.AbortForward(); });
           })
      .def("check_forward",
           [](PyEngine& e) {
             se::HookProtocol& h = e.hooks();
             e.Call([&] { return h.CheckForward(); });
           })
      .def(
          "begin_backward",
          [](PyEngine& e, const torch::Tensor& loss) {
            strata::TensorEngine& t = e.engine();
            return e.Call([&] { return t.BeginBackward(loss); });
          },
          py::arg("loss"), "Checks the loss; returns it times the loss multiplier.")
      .def("finish_backward",
           [](PyEngine& e) {
             strata::TensorEngine& t = e.engine();
             e.Call([&] { return t.FinishBackward(); });
           })
      .def(
          "autograd_failed",
          [](PyEngine& e, const std::string& what) {
            strata::TensorEngine& t = e.engine();
            e.Call([&] { return t.AutogradFailed(what); });
          },
          py::arg("what"))
      .def("step", &PyEngine::Step)
      .def("begin_eval",
           [](PyEngine& e) {
             se::HookProtocol& h = e.hooks();
             e.Call([&] { return h.BeginEval(); });
           })
      .def("end_eval",
           [](PyEngine& e) {
             se::HookProtocol& h = e.hooks();
             e.Call([&] { return h.EndEval(); });
           })
      .def("check_usable", [](PyEngine& e) {
        se::HookProtocol& h = e.hooks();
        e.Call([&] { return h.CheckUsable(); });
      });
}

// The calls between steps: checkpoints, weights, parameters made whole.
void BindBetweenSteps(PyEngineClass& c) {
  c.def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("dir"), py::arg("tag"),
        py::arg("blobs"), py::arg("whole"), py::arg("exclude_frozen_parameters"))
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("dir"), py::arg("tag"),
           py::arg("load_optimizer_states"), py::arg("load_lr_scheduler_states"),
           py::arg("load_module_only"), py::arg("check_frozen_parameters"), py::arg("whole"))
      .def(
          "load_safetensors",
          [](PyEngine& e, const std::string& path, const std::vector<PyWhole>& whole,
             const std::vector<std::string>& optional) {
            strata::TensorEngine& t = e.engine();
            const std::vector<strata::WholeTensor> w = ToWhole(whole);
            e.Call([&] { return t.LoadSafetensors(path, w, optional); });
          },
          py::arg("path"), py::arg("whole"), py::arg("optional") = std::vector<std::string>())
      .def(
          "gather_parameters",
          [](PyEngine& e, const std::vector<torch::Tensor>& params) {
            strata::TensorEngine& t = e.engine();
            return e.Call([&] { return t.GatherParameters(params); });
          },
          py::arg("params"))
      .def("save_model", &PyEngine::SaveModel, py::arg("dir"), py::arg("filename"),
           py::arg("max_file_bytes"), py::arg("names"), py::arg("whole"), py::arg("files"))
      .def(
          "gather_whole",
          [](PyEngine& e, const std::vector<torch::Tensor>& params) {
            strata::TensorEngine& t = e.engine();
            return e.Call([&] { return t.GatherWhole(params); });
          },
          py::arg("params"))
      .def(
          "release_whole",
          [](PyEngine& e, const std::vector<std::pair<int, int>>& held,
             std::optional<int> modifier) {
            strata::TensorEngine& t = e.engine();
            e.Call([&] { return t.ReleaseWhole(held, modifier); });
          },
          py::arg("held"), py::arg("modifier"))
      .def(
          "assemble_parameters",
          [](PyEngine& e, const std::vector<std::tuple<int, size_t, torch::Tensor>>& parts,
             const std::string& check) {
            std::vector<std::pair<int, size_t>> which;
            std::vector<torch::Tensor> values;
            for (const auto& [g, i, t] : parts) {
              which.emplace_back(g, i);
              values.push_back(t);
            }
            const strata::Status local =
                check.empty() ? strata::Status::Ok() : strata::InvalidArgumentError(check);
            strata::TensorEngine& t = e.engine();
            e.Call([&] { return t.AssembleParameters(local, which, values); });
          },
          py::arg("parts"), py::arg("check"));
}

// The core's settings and counters.
void BindCore(PyEngineClass& c) {
  c.def_property_readonly("rank", [](PyEngine& e) { return e.core().rank(); })
      .def_property_readonly("world_size", [](PyEngine& e) { return e.core().world_size(); })
      // The configuration as the core parsed it: every default filled in, batch sizes
      // derived for this data-parallel world (JSON text).
      .def_property_readonly("normalized_config",
                             [](PyEngine& e) { return e.core().config().normalized.dump(); })
      .def_property_readonly("num_groups", [](PyEngine& e) { return e.engine().num_groups(); })
      .def_property_readonly(
          "dtype", [](PyEngine& e) { return std::string(se::DTypeName(e.core().dtype())); })
      .def_property_readonly("device", [](PyEngine& e) { return e.engine().device(); })
      .def_property_readonly("compute_dtype",
                             [](PyEngine& e) { return e.engine().compute_dtype(); })
      .def("layout", &PyEngine::Layout, py::arg("group"))
      .def(
          "full_buffer",
          [](PyEngine& e, int g) {
            e.CheckGroup(g);
            se::GatheredGroup full = ValueOrThrow(e.core().FullBuffer(g));
            std::vector<uintptr_t> out;
            for (size_t i = 0; i < full.layout->params.size(); ++i)
              out.push_back(reinterpret_cast<uintptr_t>(full.param_data(i)));
            return out;
          },
          py::arg("group"), "The addresses of group g's parameters in its gathered buffer.")
      .def(
          "find", [](PyEngine& e, const torch::Tensor& t) { return e.engine().Find(t); },
          py::arg("tensor"), "(group, index) of a parameter the engine manages, else None.")
      .def_property_readonly("holds_whole", [](PyEngine& e) { return e.engine().holds_whole(); })
      .def("is_gradient_accumulation_boundary",
           [](PyEngine& e) { return e.core().IsGradientAccumulationBoundary(); })
      .def("loss_multiplier", [](PyEngine& e) { return e.core().LossMultiplier(); })
      .def("lr", [](PyEngine& e) { return e.core().lr(); })
      .def("lr_iteration", [](PyEngine& e) { return e.core().lr_iteration(); })
      .def("skipped_steps", [](PyEngine& e) { return e.core().loss_scaler().skipped_steps(); })
      .def(
          "set_lr_iteration",
          [](PyEngine& e, int64_t iteration) {
            se::EngineCore& core = e.core();
            e.Call([&] { return core.set_lr_iteration(iteration); });
          },
          py::arg("iteration"))
      .def(
          "set_lr",
          [](PyEngine& e, double lr) {
            se::EngineCore& core = e.core();
            e.Call([&] { return core.set_lr(lr); });
          },
          py::arg("lr"))
      .def("loss_scale", [](PyEngine& e) { return e.core().loss_scale(); })
      .def("stats", [](PyEngine& e) { return StatsDict(e.core().stats()); })
      .def("close", &PyEngine::Close);
}

// The timeline (engine/timeline/timeline.h) as dicts, and its Chrome trace.
void BindTimeline(PyEngineClass& c) {
  c.def(
       "enable_timeline", [](PyEngine& e, bool on) { e.core().EnableTimeline(on); }, py::arg("on"))
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
            Check(se::WriteChromeTrace(path, evs, e.core().rank(), e.core().timeline_dropped()));
          },
          py::arg("path"), py::arg("events"));
}

// The module's helpers beside the engine.
void BindEngineHelpers(py::module_& m) {
  m.def(
      "lr_schedule",
      [](const std::string& config_json, int64_t steps) {
        const strata::Config config = ValueOrThrow(strata::ParseConfig(config_json));
        const se::LrSchedule schedule =
            ValueOrThrow(se::LrSchedule::Create(config.scheduler, config.optimizer));
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

}  // namespace

void BindEngine(py::module_& m) {
  // The engine's waits as torch.profiler ranges (strata::all-gather wait, ...).
  strata::InstallProfilerRanges();
  py::class_<PyRendezvous>(m, "Rendezvous", "The ranks an engine meets (py_engine.h).")
      .def(py::init([](py::object store, std::string prefix, int rank, int world_size,
                       int local_rank, int local_world_size) {
             return PyRendezvous{std::move(store), std::move(prefix), rank,
                                 world_size,       local_rank,        local_world_size};
           }),
           py::arg("store") = py::none(), py::arg("prefix") = "strata", py::arg("rank") = 0,
           py::arg("world_size") = 1, py::arg("local_rank") = 0, py::arg("local_world_size") = 1);
  PyEngineClass c(m, "Engine",
                  "The TensorEngine (engine/libtorch/tensor_engine.h) for strata/engine.py.");
  c.def(py::init<const std::string&, const std::vector<PyGroup>&, const std::vector<torch::Tensor>&,
                 const PyRendezvous&, bool, double,
                 const std::vector<std::map<std::string, std::optional<double>>>&,
                 const std::string&>(),
        py::arg("config_json"), py::arg("groups"), py::arg("follow_device"), py::arg("rendezvous"),
        py::arg("prefetch") = true, py::arg("timeout_s") = 300.0,
        py::arg("param_groups") = std::vector<std::map<std::string, std::optional<double>>>(),
        py::arg("front_end_check") = "");
  BindHooks(c);
  BindBetweenSteps(c);
  BindCore(c);
  BindTimeline(c);
  BindEngineHelpers(m);
}

}  // namespace strata_py
